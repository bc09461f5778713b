/* y = x W^T on a CPU in fp32: every matmul of a model's forward (cpu_linear.py says why).

W is packed once into panels of NR output columns, k-major: panel p holds W[p*NR + j, k] at
[p][k][j] (the last panel zero-padded). A task is one panel: its K x NR weights are read from
memory once and, while they sit in L2, multiplied with every row of x, MR rows at a time: at
each k, a broadcast of x[m, k] times the panel's two vectors into MR x 2 accumulators held in
registers, the weights a few KB ahead prefetched (the first rows read them from memory).

Every output sums its K products in k order, one FMA at a time: the same order for a row
whatever the batch around it, so a request's logits do not depend on its batch-mates.
Written with GCC's vector extensions, so one source builds for AVX-512, AVX2 or NEON: the
register tile follows the vector width the target has (fanout_linear_nr() tells the packer).
Tasks are spread over torch's own OpenMP threads (loaded after torch: one libgomp).
*/
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#define MR 8 /* 16 accumulators of the 32 zmm registers */
#elif defined(__AVX__)
#define VL 8
#define MR 6 /* 12 accumulators of the 16 ymm registers */
#else
#define VL 4 /* SSE, NEON */
#define MR 6
#endif
#define NR (2 * VL)
#define AHEAD 32 /* k steps of prefetch: 32 * NR floats, 4 KB with AVX-512 */

typedef float vf __attribute__((vector_size(VL * sizeof(float))));

int64_t fanout_linear_nr(void) { return NR; }

static inline __attribute__((always_inline)) vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* t[m][:] = rows 0..mr of x (row stride ldx) times one panel w [K][NR] */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx,
                                                       const float *w, int64_t K,
                                                       float t[MR][NR]) {
    vf a0[MR], a1[MR];
    for (int m = 0; m < mr; m++) a0[m] = a1[m] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(w + (k + AHEAD) * NR);
        __builtin_prefetch(w + (k + AHEAD) * NR + VL);
        const vf w0 = load(w + k * NR), w1 = load(w + k * NR + VL);
        for (int m = 0; m < mr; m++) {
            const float xv = x[m * ldx + k];
            a0[m] += xv * w0;
            a1[m] += xv * w1;
        }
    }
    for (int m = 0; m < mr; m++) {
        memcpy(t[m], &a0[m], sizeof a0[m]);
        memcpy(t[m] + VL, &a1[m], sizeof a1[m]);
    }
}

/* tile() with mr a constant in each case, so its loops over rows unroll into registers */
static void tile_rows(int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                      float t[MR][NR]) {
    switch (mr) {
    case 1: tile(1, x, ldx, w, K, t); break;
    case 2: tile(2, x, ldx, w, K, t); break;
    case 3: tile(3, x, ldx, w, K, t); break;
    case 4: tile(4, x, ldx, w, K, t); break;
    case 5: tile(5, x, ldx, w, K, t); break;
#if MR > 6
    case 6: tile(6, x, ldx, w, K, t); break;
    case 7: tile(7, x, ldx, w, K, t); break;
#endif
    default: tile(MR, x, ldx, w, K, t); break;
    }
}

/* x [M, K] (row stride ldx), panels [ceil(N / NR), K, NR], bias [N] or NULL, y [M, N] (row
   stride ldy). */
void fanout_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panels,
                   int64_t N, const float *bias, float *y, int64_t ldy) {
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const int64_t c0 = p * NR, nc = N - c0 < NR ? N - c0 : NR;
        float t[MR][NR];
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            tile_rows(mr, x + m0 * ldx, ldx, panels + p * K * NR, K, t);
            for (int m = 0; m < mr; m++) {
                float *ym = y + (m0 + m) * ldy + c0;
                for (int64_t j = 0; j < nc; j++) ym[j] = bias ? t[m][j] + bias[c0 + j] : t[m][j];
            }
        }
    }
}

typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

static inline __attribute__((always_inline)) vf pick(vi mask, vf a, vf b) { /* mask ? a : b */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* Cephes' expf (within 2 ulp) on a vector, x clamped to [-87, 88]: finite, normal results */
static inline __attribute__((always_inline)) vf vexp(vf x) {
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
    x = pick(x < lo, lo, x);
    x = pick(x > hi, hi, x);
    const float shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, to even */
    const vf n = (x * 1.44269504088896341f + shift) - shift;
    vf r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vf e = (p * r) * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return e * (vf)bits;
}

/* The MLP's first half: y = silu(x Wg^T) * (x Wu^T), y [M, N]. panels interleaves the two
   weights' panels, gate p then up p ([2 * ceil(N / NR), K, NR]), so a task reads both from
   one run and writes its NR columns of y once, with no [M, 2N] product in between. */
void fanout_linear_silu_mul(const float *x, int64_t M, int64_t K, int64_t ldx,
                            const float *panels, int64_t N, float *y, int64_t ldy) {
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const int64_t c0 = p * NR, nc = N - c0 < NR ? N - c0 : NR;
        const float *wg = panels + 2 * p * K * NR, *wu = wg + K * NR;
        float g[MR][NR], u[MR][NR];
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            tile_rows(mr, x + m0 * ldx, ldx, wg, K, g);
            tile_rows(mr, x + m0 * ldx, ldx, wu, K, u);
            for (int m = 0; m < mr; m++) {
                for (int h = 0; h < NR; h += VL) {
                    const vf a = load(g[m] + h), b = load(u[m] + h);
                    const vf out = a / (1.0f + vexp(-a)) * b;
                    memcpy(g[m] + h, &out, sizeof out);
                }
                memcpy(y + (m0 + m) * ldy + c0, g[m], nc * sizeof(float));
            }
        }
    }
}
