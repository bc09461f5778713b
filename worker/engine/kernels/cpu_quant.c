/* y = x W^T on a CPU from quantized weights (cpu_quant.py says why): GGUF's 4- and 8-bit
codes kept in memory and turned into fp32 weights where they are multiplied.

The panels are cpu_linear's (NR output columns, k-major), of codes instead of floats, with
per 32 k and column a scale d and an offset o:
  4 bits: codes [K/2][NR], byte (k2, j) = q[2 k2][j] | q[2 k2 + 1][j] << 4
  8 bits: codes [K][NR] (GGUF's signed codes + 128: unsigned, as the 4-bit ones)
  scales [K/32][2][NR]: d, then o
A weight is q * d + o, one FMA: Q4_1 and Q4_K (o = m, or -dmin * m), Q4_0 (o = -8 d), Q8_0
(o = -128 d). q * d is exact in float32 (a code of 8 bits at most times a scale of at most 17
significant bits), so the FMA's one rounding gives the float gguf's dequantization computes,
to the bit, and y equals cpu_linear's on the dequantized weight, float for float: the
engine's tokens and logits are those of the model loaded in fp32.

Two ways through a panel (a task), each sum in k order, so a row's output does not depend on
its batch-mates or on the way:
- a decode step's few rows (M <= SMALL_M): QR rows at a time, the codes become weights in
  registers, straight into the FMAs (the panel's codes stay in L1 for the next QR rows);
- more rows (prefill): in passes of rows (as in cpu_linear.c), KC k steps of the panel are
  turned into floats in L1 (KC x NR, 12 KB at NR 48) and every row tile of the pass adds them
  with cpu_linear's register tile (cpu_tile.h), its sums waiting in a per-thread buffer.
A decode step reads each weight's half byte (or byte) from memory, not its 4 bytes.
*/
#include <stdlib.h>

#include "cpu_tile.h"

#define KC 64 /* k steps turned into floats at a time (prefill) */
#define SMALL_M 8 /* rows up to which the codes are turned into weights in registers */
#define QR 4 /* rows a register tile of codes takes */

typedef uint8_t vu8 __attribute__((vector_size(VL)));

int64_t fanout_quant_nr(void) { return NR; }

/* bytes -> floats through int32 lanes (a zero-extend, then a convert; GCC turns a direct
   byte -> float conversion into one scalar convert per lane) */
INLINE vf widen(vu8 b) { return __builtin_convertvector(__builtin_convertvector(b, vi), vf); }

/* VL bytes at p, widened: the load folded into the zero-extend where the ISA has one (GCC
   builds a plain load's lanes one by one here) */
INLINE vf widen_at(const uint8_t *p) {
#if VL == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VL == 8
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vu8 b;
    memcpy(&b, p, sizeof b);
    return widen(b);
#endif
}

INLINE vu8 bytes_at(const uint8_t *p) {
    vu8 b;
    memcpy(&b, p, sizeof b);
    return b;
}

/* One panel's bytes of codes and floats of scales */
static int64_t panel_codes(int bits, int64_t K) { return (bits == 8 ? K : K / 2) * NR; }
static int64_t panel_scales(int64_t K) { return 2 * (K / 32) * NR; }

/* t[m][:] = rows 0..mr (at most QR) of x (row stride ldx) times one panel's weights
   [K][NR], each made from its code in registers as it is used: QR x NV sums, NV scales and
   offsets in registers. Each sum is a chain of FMAs in k order: every vector of columns at
   once keeps NV chains a row going (one vector at a time for up to MR rows ran 1.4-1.8x
   slower at 5-8 rows than two passes of QR over codes then in L1). */
INLINE void qtile(const int mr, const int bits, const float *x, int64_t ldx, const uint8_t *codes,
                  const float *scales, int64_t K, float t[MR][NR]) {
    vf a[QR][NV];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) a[m][v] = (vf){0};
    for (int64_t G = 0; G < K / 32; G++) {
        vf d[NV], o[NV];
        for (int v = 0; v < NV; v++) {
            d[v] = load(scales + 2 * G * NR + v * VL);
            o[v] = load(scales + (2 * G + 1) * NR + v * VL);
        }
        const float *xg = x + G * 32;
        if (bits == 4) {
            const uint8_t *c = codes + G * 16 * NR;
            for (int k2 = 0; k2 < 16; k2++) {
                __builtin_prefetch(c + (k2 + AHEAD) * NR);
                for (int v = 0; v < NV; v++) {
                    const vu8 b = bytes_at(c + k2 * NR + v * VL);
                    const vf w0 = widen(b & 15) * d[v] + o[v], w1 = widen(b >> 4) * d[v] + o[v];
                    for (int m = 0; m < mr; m++) {
                        a[m][v] += xg[m * ldx + 2 * k2] * w0;
                        a[m][v] += xg[m * ldx + 2 * k2 + 1] * w1;
                    }
                }
            }
        } else {
            const uint8_t *c = codes + G * 32 * NR;
            for (int k = 0; k < 32; k++) {
                __builtin_prefetch(c + (k + AHEAD) * NR);
                for (int v = 0; v < NV; v++) {
                    const vf w = widen_at(c + k * NR + v * VL) * d[v] + o[v];
                    for (int m = 0; m < mr; m++) a[m][v] += xg[m * ldx + k] * w;
                }
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) store(t[m] + v * VL, a[m][v]);
}

/* qtile() with mr and bits constants in each case, so its loops unroll into registers */
static void qtile_rows(int mr, int bits, const float *x, int64_t ldx, const uint8_t *codes,
                       const float *scales, int64_t K, float t[MR][NR]) {
#define CASE(R) case R: { \
        if (bits == 4) qtile(R, 4, x, ldx, codes, scales, K, t); \
        else qtile(R, 8, x, ldx, codes, scales, K, t); \
        break; }
    switch (mr) {
    CASE(1) CASE(2) CASE(3)
    default: CASE(QR)
    }
#undef CASE
}

/* w [kc][NR] = the panel's weights k0 .. k0 + kc (k0 and kc whole groups of 32) */
static void dequant(int bits, const uint8_t *codes, const float *scales, int64_t k0, int kc,
                    float *w) {
    for (int g = 0; g < kc / 32; g++) {
        const int64_t G = k0 / 32 + g;
        for (int v = 0; v < NV; v++) {
            const vf d = load(scales + 2 * G * NR + v * VL), o = load(scales + (2 * G + 1) * NR + v * VL);
            float *out = w + g * 32 * NR + v * VL;
            if (bits == 8) {
                for (int k = 0; k < 32; k++)
                    store(out + k * NR, widen_at(codes + (G * 32 + k) * NR + v * VL) * d + o);
                continue;
            }
            for (int k2 = 0; k2 < 16; k2++) {
                const vu8 b = bytes_at(codes + (G * 16 + k2) * NR + v * VL);
                store(out + 2 * k2 * NR, widen(b & 15) * d + o);
                store(out + (2 * k2 + 1) * NR, widen(b >> 4) * d + o);
            }
        }
    }
}

/* A decode step's rows: each task a panel (gate_up: gate panel p then up panel p, which come
   in turn), QR rows at a time. */
static void run_small(int bits, const float *x, int64_t M, int64_t K, int64_t ldx,
                      const uint8_t *codes, const float *scales, int gate_up, int64_t N,
                      const float *bias, float *y, int64_t ldy) {
    const int64_t P = (N + NR - 1) / NR, cb = panel_codes(bits, K), sb = panel_scales(K);
    const int parts = gate_up ? 2 : 1;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const int64_t c0 = p * NR, nc = N - c0 < NR ? N - c0 : NR, panel = p * parts;
        for (int64_t m0 = 0; m0 < M; m0 += QR) {
            const int mr = M - m0 < QR ? (int)(M - m0) : QR;
            float t[MR][NR], u[MR][NR];
            qtile_rows(mr, bits, x + m0 * ldx, ldx, codes + panel * cb, scales + panel * sb, K, t);
            if (gate_up)
                qtile_rows(mr, bits, x + m0 * ldx, ldx, codes + (panel + 1) * cb,
                           scales + (panel + 1) * sb, K, u);
            tile_out(mr, t, gate_up ? u : NULL, bias ? bias + c0 : NULL, y + m0 * ldy + c0, ldy, nc);
        }
    }
}

/* More rows: every task a panel with every pass of rows, KC k steps in floats at a time. */
static void run(int bits, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
                const float *scales, int gate_up, int64_t N, const float *bias, float *y,
                int64_t ldy) {
    if (M <= SMALL_M) {
        run_small(bits, x, M, K, ldx, codes, scales, gate_up, N, bias, y, ldy);
        return;
    }
    const int64_t P = (N + NR - 1) / NR, R = pass_rows(K);
    const int64_t cb = panel_codes(bits, K), sb = panel_scales(K);
    const int parts = gate_up ? 2 : 1;
    const int64_t rows = (M < R ? M : R) + MR; /* a pass's rows, rounded up past a tile */
#pragma omp parallel
    {
        float *w = aligned_alloc(64, KC * NR * sizeof(float));
        float *acc = aligned_alloc(64, parts * rows * NR * sizeof(float));
        for (int64_t r0 = 0; r0 < M; r0 += R)
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            const int64_t c0 = p * NR, nc = N - c0 < NR ? N - c0 : NR, end = r0 + R < M ? r0 + R : M;
            memset(acc, 0, parts * rows * NR * sizeof(float));
            for (int h = 0; h < parts; h++) {
                const int64_t panel = p * parts + h;
                float *a = acc + h * rows * NR;
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int kc = K - k0 < KC ? (int)(K - k0) : KC;
                    dequant(bits, codes + panel * cb, scales + panel * sb, k0, kc, w);
                    for (int64_t m0 = r0; m0 < end; m0 += MR)
                        tile_rows(end - m0 < MR ? (int)(end - m0) : MR, x + m0 * ldx + k0, ldx, w,
                                  kc, (float(*)[NR])(a + (m0 - r0) * NR));
                }
            }
            for (int64_t m0 = r0; m0 < end; m0 += MR)
                tile_out(end - m0 < MR ? (int)(end - m0) : MR, (float(*)[NR])(acc + (m0 - r0) * NR),
                         gate_up ? (float(*)[NR])(acc + (rows + m0 - r0) * NR) : NULL,
                         bias ? bias + c0 : NULL, y + m0 * ldy + c0, ldy, nc);
        }
        free(w);
        free(acc);
    }
}

/* x [M, K] (row stride ldx), codes and scales of ceil(N / NR) panels, bias [N] or NULL,
   y [M, N] (row stride ldy). K is a multiple of 32; bits 4 or 8. */
void fanout_quant_linear(int64_t bits, const float *x, int64_t M, int64_t K, int64_t ldx,
                         const uint8_t *codes, const float *scales, int64_t N, const float *bias,
                         float *y, int64_t ldy) {
    run((int)bits, x, M, K, ldx, codes, scales, 0, N, bias, y, ldy);
}

/* y = silu(x Wg^T) * (x Wu^T), y [M, N]; the panels of the two weights interleaved, gate p
   then up p. */
void fanout_quant_silu_mul(int64_t bits, const float *x, int64_t M, int64_t K, int64_t ldx,
                           const uint8_t *codes, const float *scales, int64_t N, float *y,
                           int64_t ldy) {
    run((int)bits, x, M, K, ldx, codes, scales, 1, N, NULL, y, ldy);
}

/* out [n, K] = rows ids[0..n) of W (the weight's output columns: an embedding table's
   lookup, from the same panels as its tied lm_head), each weight q * d + o as above. */
void fanout_quant_rows(int64_t bits, const uint8_t *codes, const float *scales, int64_t K,
                       const int64_t *ids, int64_t n, float *out) {
    const int64_t cb = panel_codes((int)bits, K), sb = panel_scales(K);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = ids[i] / NR, j = ids[i] % NR;
        const uint8_t *c = codes + p * cb;
        const float *s = scales + p * sb;
        float *o = out + i * K;
        for (int64_t k = 0; k < K; k++) {
            const uint8_t b = bits == 8 ? c[k * NR + j] : c[(k / 2) * NR + j];
            const float q = (float)(bits == 8 ? b : k % 2 ? b >> 4 : b & 15);
            o[k] = __builtin_fmaf(q, s[(k / 32) * 2 * NR + j], s[((k / 32) * 2 + 1) * NR + j]);
        }
    }
}
