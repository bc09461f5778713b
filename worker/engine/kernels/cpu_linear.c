/* y = x W^T on a CPU in fp32: every matmul of a model's forward (cpu_linear.py says why).

W is packed once into panels of NR output columns, k-major: panel p holds W[p*NR + j, k] at
[p][k][j] (the last panel zero-padded). A task is one panel: its K x NR weights are read from
memory once and, while they sit in L2, multiplied with every row of x, MR rows at a time: at
each k, a broadcast of x[m, k] times the panel's two vectors into MR x 2 accumulators held in
registers, the weights a few KB ahead prefetched (the first rows read them from memory).

Every output sums its K products in k order, one FMA at a time: the same order for a row
whatever the batch around it, so a request's logits do not depend on its batch-mates.
The register tile follows the vector width of the target (cpu_vector.h; fanout_linear_nr()
tells the packer).
Tasks are spread over torch's own OpenMP threads (loaded after torch: one libgomp).
*/
#include "cpu_vector.h"

#if VL == 16
#define MR 8 /* 16 accumulators of the 32 zmm registers */
#else
#define MR 6 /* 12 accumulators of 16 registers */
#endif
#define NR (2 * VL)
#define AHEAD 32 /* k steps of prefetch: 32 * NR floats, 4 KB with AVX-512 */

int64_t fanout_linear_nr(void) { return NR; }

/* t[m][:] = rows 0..mr of x (row stride ldx) times one panel w [K][NR] */
INLINE void tile(const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
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
        store(t[m], a0[m]);
        store(t[m] + VL, a1[m]);
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
                    store(g[m] + h, out);
                }
                memcpy(y + (m0 + m) * ldy + c0, g[m], nc * sizeof(float));
            }
        }
    }
}
