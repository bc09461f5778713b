/* The per-row steps between a layer's matmuls on a CPU, fp32: residual add + RMSNorm, and
RoPE + the K/V store; and after the last, the greedy pick (each row's argmax). Each is one
call instead of the dozen small torch ops it replaces (a few microseconds each: at SmolLM2's
30 layers, more than the attention itself at batch 8).

Numerics follow HF: RMSNorm sums squares in fp32, x * rsqrt(mean + eps) rounded before the
weight multiplies it; RoPE's rotate-half products are each rounded before they are added, as
torch's separate ops do (no FMA contraction in that function).
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_FLOATS 65536 /* below this, one thread: waking the others costs more */

/* out = rmsnorm(x) * w for each of M rows of D; with res (not NULL): x += res first (x
   becomes the new residual). x, res, out: rows of stride D. */
void fanout_add_rmsnorm(float *x, const float *res, const float *w, float *out, int64_t M,
                        int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (M * D >= PARALLEL_FLOATS)
    for (int64_t m = 0; m < M; m++) {
        float *xm = x + m * D, *om = out + m * D;
        if (res) {
            const float *rm = res + m * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) xm[d] += rm[d];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; d++) ss += xm[d] * xm[d];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
#pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            const float n = xm[d] * r;
            om[d] = w[d] * n;
        }
    }
}

/* One head of D: out = x * [cos, cos] + rotate_half(x) * [sin, sin]. */
__attribute__((optimize("fp-contract=off"))) static void rotate(const float *x, const float *cos,
                                                                 const float *sin, float *out,
                                                                 int64_t D) {
    const int64_t h = D / 2;
#pragma omp simd
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i] * cos[i], b = x[i + h] * sin[i];
        const float c = x[i + h] * cos[i], e = x[i] * sin[i];
        out[i] = a - b;
        out[i + h] = c + e;
    }
}

/* qkv [T, (Hq + 2 Hkv) D] (row stride ld): q rotated into q_out [T, Hq, D]; k rotated into
   kc[slots[t]] and v copied into vc[slots[t]] ([slots, Hkv, D] pools); cos, sin [T, D/2],
   each token's own angles. */
void fanout_rope_store(const float *qkv, int64_t T, int64_t ld, const float *cos,
                       const float *sin, int64_t Hq, int64_t Hkv, int64_t D, float *q_out,
                       float *kc, float *vc, const int64_t *slots) {
#pragma omp parallel for schedule(static) if (T * (Hq + 2 * Hkv) * D >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * ld, *c = cos + t * (D / 2), *s = sin + t * (D / 2);
        for (int64_t h = 0; h < Hq; h++) rotate(row + h * D, c, s, q_out + (t * Hq + h) * D, D);
        const float *k = row + Hq * D, *v = k + Hkv * D;
        float *kd = kc + slots[t] * Hkv * D;
        for (int64_t h = 0; h < Hkv; h++) rotate(k + h * D, c, s, kd + h * D, D);
        memcpy(vc + slots[t] * Hkv * D, v, Hkv * D * sizeof(float));
    }
}

/* idx[m] = the column of row m's largest value: the first of equal ones, and a NaN counts as
   the largest (the first NaN), as torch.max's indices. x: M rows of N >= 1 floats, stride ld.
   Why not torch: its max took 28 us over a [1, 49152] row and 138 us over [8, 49152] (this
   7 and 46), up to ~0.3 ms of a q8 decode step at batch 8 in the engine; one vectorized pass
   for the max, a second that stops at it. */
void fanout_argmax(const float *x, int64_t M, int64_t N, int64_t ld, int64_t *idx) {
#pragma omp parallel for schedule(static) if (M > 1 && M * N >= PARALLEL_FLOATS)
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ld;
        float mx = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
        for (int64_t j = 0; j < N; j++) {
            mx = r[j] > mx ? r[j] : mx;
            nan |= r[j] != r[j];
        }
        /* mx is one of the row's values, or -inf where all are: GCC starts a max reduction
           at -inf. One that starts at -FLT_MAX finds no column equal to it in a row of -infs
           only; the scan stops at the last column and takes 0, as torch does. */
        int64_t j = 0;
        if (nan)
            while (j < N - 1 && r[j] == r[j]) j++;
        else
            while (j < N - 1 && r[j] != mx) j++;
        idx[m] = nan || r[j] == mx ? j : 0;
    }
}
