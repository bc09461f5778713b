/* The fp32 register tile of the CPU matmuls (cpu_linear.c; cpu_quant.c runs it on a panel
it dequantized): MR rows of x times one panel of NR weight columns, k-major. */
#ifndef FANOUT_CPU_TILE_H
#define FANOUT_CPU_TILE_H

#include "cpu_vector.h"

/* The register tile: MR rows x NV vectors of accumulators. AVX-512 (32 registers): 8 x 3, 24
   accumulators, 11 loads per 24 FMAs (SmolLM2's projections, Intel 2-core, vs 8 x 2: 287 ->
   307 GFLOP/s at 2,048 rows, 224 -> 240 at 64 rows from memory). 16 registers: 6 x 2. */
#if VL == 16
#define MR 8
#define NV 3
#else
#define MR 6
#define NV 2
#endif
#define NR (NV * VL)
#define AHEAD 32 /* k steps of prefetch, into L2 (cpu_quant.c's prefetch_group says why) */
#define PASS_BYTES (512 * 1024) /* a pass's rows of x: to stay in L2 while every panel meets them */

/* t[m][:] += rows 0..mr of x (row stride ldx) times one panel w [K][NR] (the sums go on
   from t, in k order: a caller may run K in pieces and get the same floats) */
INLINE void tile(const int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                 float t[MR][NR]) {
    vf a[MR][NV];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) a[m][v] = load(t[m] + v * VL);
    for (int64_t k = 0; k < K; k++) {
        for (int v = 0; v < NV; v++) __builtin_prefetch(w + (k + AHEAD) * NR + v * VL, 0, 2);
        vf wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = load(w + k * NR + v * VL);
        for (int m = 0; m < mr; m++) {
            const float xv = x[m * ldx + k];
            for (int v = 0; v < NV; v++) a[m][v] += xv * wv[v];
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) store(t[m] + v * VL, a[m][v]);
}

/* tile() with mr a constant in each case, so its loops over rows unroll into registers */
static void tile_rows(int mr, const float *x, int64_t ldx, const float *w, int64_t K,
                      float t[MR][NR]) {
#define CASE(R) case R: tile(R, x, ldx, w, K, t); break;
    switch (mr) {
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5)
#if MR > 6
    CASE(6) CASE(7)
#endif
    default: tile(MR, x, ldx, w, K, t); break;
    }
#undef CASE
}

/* Rows of x a pass takes: a prefill chunk's x (2,048 rows x 576 columns, 4.7 MB) would be read
   from L3 once per panel; in passes of a few hundred rows it is read from L2 (SmolLM2's
   projections at 2,048 rows, Intel 2-core: ~255 -> ~295 GFLOP/s). A decode step is one pass. */
static int64_t pass_rows(int64_t K) {
    const int64_t r = PASS_BYTES / (K * (int64_t)sizeof(float));
    return r < MR ? MR : r - r % MR;
}

/* A tile's rows out to y (row stride ldy), nc of its NR columns real: t (+ bias), or, given
   the up product u beside the gate product t, silu(t) * u. */
static void tile_out(int mr, float t[MR][NR], float u[MR][NR], const float *bias, float *y,
                     int64_t ldy, int64_t nc) {
    if (u)
        for (int m = 0; m < mr; m++)
            for (int h = 0; h < NR; h += VL) {
                const vf a = load(t[m] + h), b = load(u[m] + h);
                store(t[m] + h, a / (1.0f + vexp(-a)) * b);
            }
    for (int m = 0; m < mr; m++)
        for (int64_t j = 0; j < nc; j++) y[m * ldy + j] = bias ? t[m][j] + bias[j] : t[m][j];
}

#endif
