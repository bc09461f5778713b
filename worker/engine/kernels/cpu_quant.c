/* y = x W^T on a CPU from quantized weights (cpu_quant.py says why): GGUF's 4- and 8-bit
codes kept in memory, a piece of a panel at a time dequantized into L1 and multiplied there
by cpu_linear.c's fp32 register tile (cpu_tile.h).

The panels are cpu_linear's (NR output columns, k-major), of codes instead of floats, with
per 32 k and column a scale d (and, kind Q41, an offset m):
  4 bits: codes [K/2][NR], byte (k2, j) = q[2 k2][j] | q[2 k2 + 1][j] << 4
  8 bits: codes [K][NR], q + 128 (unsigned, as the 4-bit codes: one widening for both)
  scales [K/32][S][NR]: d (then m), S = 2 for Q41, else 1
A weight is what gguf's dequantization computes, to the bit (its products q * d are exact
in float32, a 4- or 8-bit code times a scale of at most 17 significant bits, and contraction
into FMAs is off besides):
  Q41 (GGUF Q4_1, Q4_K): q * d + m      Q40 (Q4_0): (q - 8) * d      Q80 (Q8_0): q * d
so y equals cpu_linear's on the dequantized weight, float for float, and so the engine's
tokens and logits are those of the model loaded in fp32.

A task is one panel with one pass of rows (as in cpu_linear.c): KC k steps of the panel are
dequantized (KC x NR floats, 12 KB at NR 48) and every row tile of the pass adds them to its
sums, which wait in a per-thread buffer for the next piece; each sum runs in k order, so a
row's output does not depend on its batch-mates. A decode step reads each weight's half byte
(or byte) once from memory, not its 4 bytes.
*/
#include <stdlib.h>

#include "cpu_tile.h"

#define KC 64 /* k steps dequantized at a time */

enum { Q41 = 0, Q40 = 1, Q80 = 2 }; /* how codes become weights */

typedef uint8_t vu8 __attribute__((vector_size(VL)));

int64_t fanout_quant_nr(void) { return NR; }

/* bytes -> floats through int32 lanes (a zero-extend, then a convert; GCC turns a direct
   byte -> float conversion into one scalar convert per lane) */
INLINE vf widen(vu8 b) { return __builtin_convertvector(__builtin_convertvector(b, vi), vf); }

/* VL bytes at p, widened: the load folded into the zero-extend where the ISA has one (GCC
   builds the 8-bit path's lanes one by one from a plain load) */
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

static int scales_per_group(int kind) { return kind == Q41 ? 2 : 1; }

/* One panel's bytes of codes and floats of scales */
static int64_t panel_codes(int kind, int64_t K) { return (kind == Q80 ? K : K / 2) * NR; }
static int64_t panel_scales(int kind, int64_t K) { return scales_per_group(kind) * (K / 32) * NR; }

/* w [kc][NR] = the panel's weights k0 .. k0 + kc (k0 and kc whole groups of 32), each
   product and sum rounded as numpy's. */
__attribute__((optimize("fp-contract=off")))
static void dequant(int kind, const uint8_t *codes, const float *scales, int64_t k0, int kc,
                    float *w) {
    const int S = scales_per_group(kind);
    for (int g = 0; g < kc / 32; g++) {
        const int64_t G = k0 / 32 + g;
        for (int v = 0; v < NV; v++) {
            const vf d = load(scales + G * S * NR + v * VL);
            float *out = w + g * 32 * NR + v * VL;
            if (kind == Q80) {
                for (int k = 0; k < 32; k++) {
                    store(out + k * NR, (widen_at(codes + (G * 32 + k) * NR + v * VL) - 128.0f) * d);
                }
                continue;
            }
            const vf m = S == 2 ? load(scales + (G * S + 1) * NR + v * VL) : (vf){0};
            for (int k2 = 0; k2 < 16; k2++) {
                vu8 b;
                memcpy(&b, codes + (G * 16 + k2) * NR + v * VL, sizeof b);
                vf lo = widen(b & 15), hi = widen(b >> 4);
                if (kind == Q40) {
                    lo = (lo - 8.0f) * d;
                    hi = (hi - 8.0f) * d;
                } else {
                    lo = lo * d + m;
                    hi = hi * d + m;
                }
                store(out + 2 * k2 * NR, lo);
                store(out + (2 * k2 + 1) * NR, hi);
            }
        }
    }
}

/* Every task: panel p (gate_up: gate panel p then up panel p, which come in turn) with every
   pass of rows. */
static void run(int kind, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
                const float *scales, int gate_up, int64_t N, const float *bias, float *y,
                int64_t ldy) {
    const int64_t P = (N + NR - 1) / NR, R = pass_rows(K);
    const int64_t cb = panel_codes(kind, K), sb = panel_scales(kind, K);
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
                    dequant(kind, codes + panel * cb, scales + panel * sb, k0, kc, w);
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
   y [M, N] (row stride ldy). K is a multiple of 32. */
void fanout_quant_linear(int64_t kind, const float *x, int64_t M, int64_t K, int64_t ldx,
                         const uint8_t *codes, const float *scales, int64_t N, const float *bias,
                         float *y, int64_t ldy) {
    run((int)kind, x, M, K, ldx, codes, scales, 0, N, bias, y, ldy);
}

/* y = silu(x Wg^T) * (x Wu^T), y [M, N]; the panels of the two weights interleaved, gate p
   then up p. */
void fanout_quant_silu_mul(int64_t kind, const float *x, int64_t M, int64_t K, int64_t ldx,
                           const uint8_t *codes, const float *scales, int64_t N, float *y,
                           int64_t ldy) {
    run((int)kind, x, M, K, ldx, codes, scales, 1, N, NULL, y, ldy);
}

/* out [n, K] = rows ids[0..n) of W (the weight's output columns: an embedding table's
   lookup, from the same panels as its tied lm_head), each weight as dequant() makes it. */
__attribute__((optimize("fp-contract=off")))
void fanout_quant_rows(int64_t kind, const uint8_t *codes, const float *scales, int64_t K,
                       const int64_t *ids, int64_t n, float *out) {
    const int64_t cb = panel_codes((int)kind, K), sb = panel_scales((int)kind, K);
    const int S = scales_per_group((int)kind);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = ids[i] / NR, j = ids[i] % NR;
        const uint8_t *c = codes + p * cb;
        const float *s = scales + p * sb;
        float *o = out + i * K;
        for (int64_t k = 0; k < K; k++) {
            const float d = s[(k / 32) * S * NR + j];
            if (kind == Q80) {
                o[k] = ((float)c[k * NR + j] - 128.0f) * d;
                continue;
            }
            const uint8_t b = c[(k / 2) * NR + j];
            const float q = (float)(k % 2 ? b >> 4 : b & 15);
            o[k] = kind == Q40 ? (q - 8.0f) * d : q * d + s[((k / 32) * S + 1) * NR + j];
        }
    }
}
