/* y = x W^T on a CPU from quantized weights (cpu_quant.py says why): GGUF's 4- and 8-bit
codes kept in memory and multiplied where they are read, two ways (QPanels.dot picks):

- exact: each code becomes its fp32 weight q * d + o in registers, one FMA, and meets x in
  fp32. q * d is exact in float32 (a code of 8 bits at most times a scale of at most 17
  significant bits), so the FMA's one rounding gives the float gguf's dequantization
  computes, to the bit, and y equals cpu_linear's on the dequantized weight, float for float:
  the engine's tokens and logits are those of the model loaded in fp32;
- dot: each row of x is rounded to 8 bits per 32 values first (a scale amax / 127, as
  llama.cpp's Q8 blocks), and a group's 32 products are summed as integers (AVX-512 VNNI's
  dpbusd: 64 byte products summed into 16 lanes a instruction, against 16 fp32 FMAs; else
  AVX2's maddubs, 32 a instruction; no code turned into a float), then scaled: y += d dx
  sum(q xq) + o dx sum(xq), the weights times the rounded x (the offset too: with x's own
  sum there, the rounding's errors would meet the codes 0..15, all positive, not the
  weights about 0, and the error would be ~2x). The integer sums are exact, so both
  instruction sets give the same floats. Not equal to the fp32 model's: within the
  rounding of x to 8 bits, as llama.cpp's own products (Q8_1's sum is dx sum(xq) too).

The panels are NR output columns of K, a group of 32 k at a time, each column's codes for
4 k in one 32-bit lane (an integer dot product's unit):
  4 bits: codes [K/32][4][NR][4], byte (G, t, j, b) = q[32G + 8t + b][j] | q[32G + 8t + 4 + b][j] << 4
  8 bits: codes [K/32][8][NR][4], byte (G, t, j, b) = q[32G + 4t + b][j], GGUF's signed codes
  scales [K/32][2][NR]: d, then o; float16 where every one of the weight's is exactly a
  float16 (Q4_0, Q4_1 and Q8_0 keep the file's own: 20 bytes per 32 weights for Q4_1, not
  24), else float32 (Q4_K's d times its 6-bit scale); widened in registers, the same floats
A weight is q * d + o: Q4_1 and Q4_K (o = m, or -dmin * m), Q4_0 (o = -8 d), Q8_0 (o = 0).

Every sum runs in k order (exact) or group order (dot), whatever the rows beside it, so a
row's output does not depend on its batch-mates or on the way through:
- a decode step's few rows (M <= SMALL_M), and every row in the dot way: QR rows at a time
  over a panel, whose codes stay in L1 for the next QR rows;
- more rows, exact (prefill): in passes of rows (as in cpu_linear.c), KC k steps of the panel
  are turned into floats in L1 (KC x NR) and every row tile of the pass adds them with
  cpu_linear's register tile (cpu_tile.h), its sums waiting in a per-thread buffer.
A decode step reads each weight's half byte (or byte) from memory, not its 4 bytes.
*/
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu_tile.h"

#define KC 64 /* k steps turned into floats at a time (prefill) */
#define SMALL_M 8 /* rows up to which the codes are turned into weights in registers */
#define QR 4 /* rows a register tile of codes takes */

int64_t fanout_quant_nr(void) { return NR; }

/* One panel's bytes of codes and count of scales; a group's bytes of codes */
static int64_t group_codes(int bits) { return (bits == 8 ? 32 : 16) * NR; }
static int64_t panel_codes(int bits, int64_t K) { return K / 32 * group_codes(bits); }
static int64_t panel_scales(int64_t K) { return 2 * (K / 32) * NR; }

/* Scales, float32 or (half) float16, read from element i on */
typedef struct {
    const uint8_t *p;
    int half;
} Scales;
typedef float vf8 __attribute__((vector_size(32)));

INLINE Scales scales_from(Scales s, int64_t i) { return (Scales){s.p + i * (s.half ? 2 : 4), s.half}; }
INLINE float scale_at(Scales s, int64_t i) {
    return s.half ? (float)((const _Float16 *)s.p)[i] : ((const float *)s.p)[i];
}
/* VL of them (one vcvtph2ps where the CPU has it: GCC widens a _Float16 vector lane by lane) */
INLINE vf scales_vl(Scales s, int64_t i) {
    if (!s.half) return load((const float *)s.p + i);
#if VL == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s.p + 2 * i)));
#elif VL == 8 && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s.p + 2 * i)));
#else
    vf v;
    for (int l = 0; l < VL; l++) v[l] = scale_at(s, i + l);
    return v;
#endif
}
INLINE vf8 scales_8(Scales s, int64_t i) { /* 8 of them */
    vf8 f;
    if (!s.half) {
        memcpy(&f, s.p + 4 * i, sizeof f);
        return f;
    }
#if defined(__F16C__)
    return (vf8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s.p + 2 * i)));
#else
    for (int l = 0; l < 8; l++) f[l] = scale_at(s, i + l);
    return f;
#endif
}

/* Every line of group G + AHEAD_G's codes and scales asked for, past the panel's end into the
   next panel's (the panels lie in turn; a prefetch past the last does not fault): a decode
   step's panels come from memory. Into L2, not L1 (locality 2: prefetcht1; PLDL2KEEP on
   AArch64): as seen on a 2-core Zen 4, an L1 prefetch held one of a core's few L1 miss
   buffers until its line came, which capped a thread's stream; at 8 rows the lines ahead also
   evicted x's codes from L1. SmolLM2's Q4_1 there (a decode step's replay, three alternating
   rounds; docs/benchmarks.md): q8 batch 1 4.2-5.9 -> 3.6-4.2 ms, batch 8 9.7-11.2 -> 7.1-9.7
   ms; the exact way's batch 1 5.4-6.8 -> 4.5-5.0 ms. */
#define AHEAD_G 16
INLINE void prefetch_group(int bits, const uint8_t *codes, Scales scales, int64_t G) {
    const uint8_t *c = codes + (G + AHEAD_G) * group_codes(bits);
    for (int64_t b = 0; b < group_codes(bits); b += 64) __builtin_prefetch(c + b, 0, 2);
    const uint8_t *sc = scales_from(scales, 2 * (G + AHEAD_G) * NR).p;
    for (int64_t b = 0; b < 2 * NR * (scales.half ? 2 : 4); b += 64) __builtin_prefetch(sc + b, 0, 2);
}

INLINE vi lanes_at(const uint8_t *p) { /* VL columns' 32-bit lanes of codes */
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A lane's code of k: 4 bits, byte b's low (hi 0) or high half; 8 bits, byte b signed */
INLINE vf code4(vi c, int b, int hi) {
    return __builtin_convertvector((c >> (8 * b + 4 * hi)) & 15, vf);
}
INLINE vf code8(vi c, int b) { return __builtin_convertvector((c << (24 - 8 * b)) >> 24, vf); }

/* t[m][:] = rows 0..mr (at most QR) of x (row stride ldx) times one panel's weights [K][NR],
   each made from its code in registers as it is used (exact): QR x NV sums, NV scales and
   offsets in registers. Each sum is a chain of FMAs in k order. */
INLINE void qtile(const int mr, const int bits, const float *x, int64_t ldx, const uint8_t *codes,
                  Scales scales, int64_t K, float t[MR][NR]) {
    vf a[QR][NV];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) a[m][v] = (vf){0};
    const int64_t gb = group_codes(bits);
    for (int64_t G = 0; G < K / 32; G++) {
        vf d[NV], o[NV];
        for (int v = 0; v < NV; v++) {
            d[v] = scales_vl(scales, 2 * G * NR + v * VL);
            o[v] = scales_vl(scales, (2 * G + 1) * NR + v * VL);
        }
        const float *xg = x + G * 32;
        const uint8_t *cg = codes + G * gb;
        prefetch_group(bits, codes, scales, G);
        for (int q = 0; q < (bits == 4 ? 4 : 8); q++) {
            vi c[NV];
            for (int v = 0; v < NV; v++) c[v] = lanes_at(cg + (q * NR + v * VL) * 4);
            if (bits == 4) {
                for (int hi = 0; hi < 2; hi++)
                    for (int b = 0; b < 4; b++)
                        for (int v = 0; v < NV; v++) {
                            const vf w = code4(c[v], b, hi) * d[v] + o[v];
                            for (int m = 0; m < mr; m++) a[m][v] += xg[m * ldx + 8 * q + 4 * hi + b] * w;
                        }
            } else {
                for (int b = 0; b < 4; b++)
                    for (int v = 0; v < NV; v++) {
                        const vf w = code8(c[v], b) * d[v] + o[v];
                        for (int m = 0; m < mr; m++) a[m][v] += xg[m * ldx + 4 * q + b] * w;
                    }
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) store(t[m] + v * VL, a[m][v]);
}

/* x's rows rounded to 8 bits (the dot way): per row and group of 32, codes xq in -127..127,
   its scale dx = amax / 127 and sum(xq) (the rounded group's sum, dx sum(xq), meets the
   weights' offsets; VNNI's 8-bit codes need it too) */
typedef struct {
    int8_t *q;  /* [M][K] */
    float *d; /* [M][K / 32] */
    int32_t *qs; /* [M][K / 32] */
} Rows8;

INLINE float rounded_sum(Rows8 r, int64_t i) { return r.d[i] * (float)r.qs[i]; }

typedef int8_t vb __attribute__((vector_size(VL))); /* VL bytes: a vector's codes */

/* One group of 32 of x: its codes (roundf's half away from zero, in vectors: truncated, then
   a step out where the rest is a half or more), scale and codes' sum */
INLINE void round_group(const float *xg, int8_t *q, float *d, int32_t *qs) {
    vf v[32 / VL], top = {0};
    for (int j = 0; j < 32 / VL; j++) {
        v[j] = load(xg + j * VL);
        const vf a = (vf)((vi)v[j] & 0x7fffffff);
        top = pick(a > top, a, top);
    }
    const float amax = hmax(top); /* (no NaN in top: a NaN is never > top) */
    const float scale = amax / 127, id = scale > 0 ? 1 / scale : 0;
    vi total = {0};
    for (int j = 0; j < 32 / VL; j++) {
        const vf u = v[j] * id;
        const vi t = __builtin_convertvector(u, vi);
        const vf rest = u - __builtin_convertvector(t, vf);
        const vi c = t - (rest >= 0.5f) + (rest <= -0.5f); /* a true comparison is -1 */
        total += c;
        const vb b = __builtin_convertvector(c, vb);
        memcpy(q + j * VL, &b, VL);
    }
#if VL == 16
    *qs = _mm512_reduce_add_epi32((__m512i)total);
#else
    *qs = 0;
    for (int l = 0; l < VL; l++) *qs += total[l];
#endif
    *d = scale;
}

static Rows8 rows8_alloc(int64_t M, int64_t K) {
    const int64_t n = M * (K / 32);
    return (Rows8){malloc(M * K), malloc(n * sizeof(float)), malloc(n * sizeof(int32_t))};
}

/* Rounds x's M rows into r, its groups shared by the threads of the parallel region this
   runs in (a worksharing loop: they all wait for the last). One region with the products
   after: at batch 8 the rounding on one thread was ~0.7 ms of a 5 ms SmolLM2 step, about 1 ns
   a float (K 1536: 12,288 floats, 10 us beside a panel's 1.5 us of products). */
static void rows8_round(Rows8 r, const float *x, int64_t M, int64_t K, int64_t ldx) {
    const int64_t ng = K / 32, n = M * ng;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++)
        round_group(x + i / ng * ldx + i % ng * 32, r.q + i * 32, r.d + i, r.qs + i);
}

static void rows8_free(Rows8 r) {
    free(r.q);
    free(r.d);
    free(r.qs);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && VL == 16
/* t[m][:] = rows 0..mr of x (rounded: r, from row m0) times one panel, the dot way, the NR
   columns at once (NV vectors of 16 lanes): for each 4 k of a group, a column's 4 codes (one
   32-bit lane) times the row's 4 xq summed into its lane by one dpbusd (unsigned times
   signed bytes). 4 bits: the codes are unsigned. 8 bits: q + 128 (its sign bit flipped) is,
   and the group's sum loses 128 sum(xq) after. The sums then scaled in group order, as below. */
INLINE void dtile(const int mr, const int bits, Rows8 r, int64_t m0, int64_t K, const uint8_t *codes,
                  Scales scales, float t[MR][NR]) {
    const int64_t gb = group_codes(bits), ng = K / 32;
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    __m512 a[QR][NV];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) a[m][v] = _mm512_setzero_ps();
    for (int64_t G = 0; G < ng; G++) {
        const uint8_t *cg = codes + G * gb;
        prefetch_group(bits, codes, scales, G);
        __m512i s[QR][NV];
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < NV; v++) s[m][v] = _mm512_setzero_si512();
        for (int q = 0; q < (bits == 4 ? 4 : 8); q++)
            for (int v = 0; v < NV; v++) {
                const __m512i c = _mm512_loadu_si512(cg + (q * NR + v * VL) * 4);
                for (int m = 0; m < mr; m++) {
                    const int8_t *xq = r.q + (m0 + m) * K + G * 32;
                    int32_t xa, xb;
                    if (bits == 4) {
                        memcpy(&xa, xq + 8 * q, 4);
                        memcpy(&xb, xq + 8 * q + 4, 4);
                        s[m][v] = _mm512_dpbusd_epi32(s[m][v], _mm512_and_si512(c, low), _mm512_set1_epi32(xa));
                        s[m][v] = _mm512_dpbusd_epi32(s[m][v], _mm512_and_si512(_mm512_srli_epi16(c, 4), low),
                                                      _mm512_set1_epi32(xb));
                    } else {
                        memcpy(&xa, xq + 4 * q, 4);
                        s[m][v] = _mm512_dpbusd_epi32(s[m][v], _mm512_xor_si512(c, flip), _mm512_set1_epi32(xa));
                    }
                }
            }
        for (int m = 0; m < mr; m++) {
            const int64_t i = (m0 + m) * ng + G;
            const __m512 dx = _mm512_set1_ps(r.d[i]), sx = _mm512_set1_ps(rounded_sum(r, i));
            for (int v = 0; v < NV; v++) {
                __m512i sum = s[m][v];
                if (bits == 8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * r.qs[i]));
                const __m512 d = (__m512)scales_vl(scales, 2 * G * NR + v * VL);
                const __m512 o = (__m512)scales_vl(scales, (2 * G + 1) * NR + v * VL);
                a[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), a[m][v]);
                a[m][v] = _mm512_fmadd_ps(o, sx, a[m][v]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(t[m] + v * VL, a[m][v]);
}
#elif defined(__AVX2__)
/* t[m][:] = rows 0..mr of x (rounded: r, from row m0) times one panel, the dot way, 8
   columns at a time: a group's codes are loaded (and split into halves) once for the mr rows,
   each row's products summed as integers, one 32-bit lane a column, then scaled into its
   fp32 sum, in group order. 4 bits: unsigned codes times xq by maddubs, the 8 products of a
   16-bit lane pair within 16 bits (8 x 2 x 15 x 127 < 32767), widened once a group; 8 bits,
   |q| <= 128: maddubs of |q| and xq carrying q's sign (llama.cpp's way), widened at once. */
INLINE void dtile(const int mr, const int bits, Rows8 r, int64_t m0, int64_t K, const uint8_t *codes,
                  Scales scales, float t[MR][NR]) {
    const int64_t gb = group_codes(bits), ng = K / 32;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int col = 0; col < NR; col += 8) {
        __m256 a[QR];
        for (int m = 0; m < mr; m++) a[m] = _mm256_setzero_ps();
        for (int64_t G = 0; G < ng; G++) {
            const uint8_t *cg = codes + G * gb + col * 4;
            if (col == 0) prefetch_group(bits, codes, scales, G);
            __m256i s[QR];
            for (int m = 0; m < mr; m++) s[m] = _mm256_setzero_si256();
            for (int q = 0; q < (bits == 4 ? 4 : 8); q++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(cg + q * NR * 4));
                if (bits == 4) {
                    const __m256i lo = _mm256_and_si256(c, low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
                    for (int m = 0; m < mr; m++) {
                        const int8_t *xq = r.q + (m0 + m) * K + G * 32 + 8 * q;
                        int32_t xl, xh;
                        memcpy(&xl, xq, 4);
                        memcpy(&xh, xq + 4, 4);
                        s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)));
                        s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
                    }
                } else {
                    const __m256i u = _mm256_abs_epi8(c);
                    for (int m = 0; m < mr; m++) {
                        int32_t xv;
                        memcpy(&xv, r.q + (m0 + m) * K + G * 32 + 4 * q, 4);
                        const __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(_mm256_set1_epi32(xv), c));
                        s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(p, ones));
                    }
                }
            }
            const __m256 d = (__m256)scales_8(scales, 2 * G * NR + col);
            const __m256 o = (__m256)scales_8(scales, (2 * G + 1) * NR + col);
            for (int m = 0; m < mr; m++) {
                const int64_t i = (m0 + m) * ng + G;
                const __m256i sum = bits == 4 ? _mm256_madd_epi16(s[m], ones) : s[m];
                a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(r.d[i])), a[m]);
                a[m] = _mm256_fmadd_ps(o, _mm256_set1_ps(rounded_sum(r, i)), a[m]);
            }
        }
        for (int m = 0; m < mr; m++) _mm256_storeu_ps(t[m] + col, a[m]);
    }
}
#else
/* The dot way without AVX2: the same sums, one column at a time */
INLINE void dtile(const int mr, const int bits, Rows8 r, int64_t m0, int64_t K, const uint8_t *codes,
                  Scales scales, float t[MR][NR]) {
    const int64_t gb = group_codes(bits), ng = K / 32;
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < NR; j++) {
            float a = 0;
            for (int64_t G = 0; G < ng; G++) {
                const int64_t i = (m0 + m) * ng + G;
                const int8_t *xq = r.q + (m0 + m) * K + G * 32;
                int32_t sum = 0;
                for (int k = 0; k < 32; k++) {
                    const uint8_t *c = codes + G * gb + j * 4;
                    const int q = bits == 4 ? (c[(k / 8) * NR * 4 + k % 4] >> (4 * (k % 8 / 4))) & 15
                                            : (int8_t)c[(k / 4) * NR * 4 + k % 4];
                    sum += q * xq[k];
                }
                a = fmaf((float)sum, scale_at(scales, 2 * G * NR + j) * r.d[i], a);
                a = fmaf(scale_at(scales, (2 * G + 1) * NR + j), rounded_sum(r, i), a);
            }
            t[m][j] = a;
        }
}
#endif

/* QR rows (from m0) times one panel, the dot way (r) or exact (x): qtile() or dtile() with
   mr and bits constants in each case, so their loops unroll into registers */
static void small_tile(int mr, int bits, int dot, const float *x, int64_t ldx, Rows8 r, int64_t m0,
                       int64_t K, const uint8_t *codes, Scales scales, float t[MR][NR]) {
#define WAY(R, B) (dot ? dtile(R, B, r, m0, K, codes, scales, t) \
                       : qtile(R, B, x + m0 * ldx, ldx, codes, scales, K, t))
#define CASE(R) case R: { if (bits == 4) WAY(R, 4); else WAY(R, 8); break; }
    switch (mr) {
    CASE(1) CASE(2) CASE(3)
    default: CASE(QR)
    }
#undef CASE
#undef WAY
}

/* w [kc][NR] = the panel's weights k0 .. k0 + kc (k0 and kc whole groups of 32) */
static void dequant(int bits, const uint8_t *codes, Scales scales, int64_t k0, int kc,
                    float *w) {
    const int64_t gb = group_codes(bits);
    for (int g = 0; g < kc / 32; g++) {
        const int64_t G = k0 / 32 + g;
        for (int v = 0; v < NV; v++) {
            const vf d = scales_vl(scales, 2 * G * NR + v * VL), o = scales_vl(scales, (2 * G + 1) * NR + v * VL);
            float *out = w + g * 32 * NR + v * VL;
            for (int q = 0; q < (bits == 4 ? 4 : 8); q++) {
                const vi c = lanes_at(codes + G * gb + (q * NR + v * VL) * 4);
                for (int b = 0; b < 4; b++) {
                    if (bits == 8) {
                        store(out + (4 * q + b) * NR, code8(c, b) * d + o);
                        continue;
                    }
                    store(out + (8 * q + b) * NR, code4(c, b, 0) * d + o);
                    store(out + (8 * q + 4 + b) * NR, code4(c, b, 1) * d + o);
                }
            }
        }
    }
}

/* Few rows (exact), or any rows (dot): each task a panel (gate_up: gate panel p then up
   panel p, which come in turn), QR rows at a time, in passes of rows for the dot way's many. */
static void run_small(int bits, int dot, const float *x, int64_t M, int64_t K, int64_t ldx,
                      const uint8_t *codes, Scales scales, int gate_up, int64_t N,
                      const float *bias, float *y, int64_t ldy) {
    const int64_t P = (N + NR - 1) / NR, cb = panel_codes(bits, K), sb = panel_scales(K);
    const int parts = gate_up ? 2 : 1;
    const Rows8 r = dot ? rows8_alloc(M, K) : (Rows8){0};
    const int64_t R = dot ? (PASS_BYTES / K / QR + 1) * QR : M; /* rows of x8 a pass: in L2 */
#pragma omp parallel
    {
        {   /* This thread's first panel's first AHEAD_G groups asked for at once (prefetch_group
               asks for those ahead only): its panels are libgomp's static split, the first
               P % T threads taking one more (another runtime may split otherwise: then a
               wasted prefetch). SmolLM2 q8 batch 1 (bench/replay_calls.py, six
               alternating runs, 2-core Zen 4): a replay 3.96-4.72 -> 3.66-4.28 ms, o_proj's
               0.2 MB and qkv's 0.35 MB gaining most; batch 8 within noise. */
            const int64_t T = omp_get_num_threads(), t = omp_get_thread_num(), q = P / T, rem = P % T;
            const int64_t first = t * q + (t < rem ? t : rem);
            if (first < P)
                for (int64_t G = -AHEAD_G; G < 0; G++)
                    prefetch_group(bits, codes + first * parts * cb, scales_from(scales, first * parts * sb), G);
        }
        if (dot) rows8_round(r, x, M, K, ldx);
        for (int64_t r0 = 0; r0 < M; r0 += R) {
            const int64_t end = r0 + R < M ? r0 + R : M;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; p++) {
                const int64_t c0 = p * NR, nc = N - c0 < NR ? N - c0 : NR, panel = p * parts;
                for (int64_t m0 = r0; m0 < end; m0 += QR) {
                    const int mr = end - m0 < QR ? (int)(end - m0) : QR;
                    float t[MR][NR], u[MR][NR];
                    for (int h = 0; h < parts; h++) {
                        const uint8_t *c = codes + (panel + h) * cb;
                        const Scales s = scales_from(scales, (panel + h) * sb);
                        small_tile(mr, bits, dot, x, ldx, r, m0, K, c, s, h ? u : t);
                    }
                    tile_out(mr, t, gate_up ? u : NULL, bias ? bias + c0 : NULL, y + m0 * ldy + c0, ldy, nc);
                }
            }
        }
    }
    if (dot) rows8_free(r);
}

/* More rows, exact: every task a panel with every pass of rows, KC k steps in floats at a
   time. */
static void run(int bits, int dot, const float *x, int64_t M, int64_t K, int64_t ldx,
                const uint8_t *codes, Scales scales, int gate_up, int64_t N, const float *bias,
                float *y, int64_t ldy) {
    if (M <= SMALL_M || dot) {
        run_small(bits, dot, x, M, K, ldx, codes, scales, gate_up, N, bias, y, ldy);
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
                    dequant(bits, codes + panel * cb, scales_from(scales, panel * sb), k0, kc, w);
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

/* x [M, K] (row stride ldx), codes and scales (float16 where half) of ceil(N / NR) panels,
   bias [N] or NULL, y [M, N] (row stride ldy). K is a multiple of 32; bits 4 or 8; dot 0
   (exact) or 1. */
void fanout_quant_linear(int64_t bits, int64_t dot, const float *x, int64_t M, int64_t K, int64_t ldx,
                         const uint8_t *codes, const void *scales, int64_t half, int64_t N,
                         const float *bias, float *y, int64_t ldy) {
    run((int)bits, (int)dot, x, M, K, ldx, codes, (Scales){scales, (int)half}, 0, N, bias, y, ldy);
}

/* y = silu(x Wg^T) * (x Wu^T), y [M, N]; the panels of the two weights interleaved, gate p
   then up p. */
void fanout_quant_silu_mul(int64_t bits, int64_t dot, const float *x, int64_t M, int64_t K, int64_t ldx,
                           const uint8_t *codes, const void *scales, int64_t half, int64_t N,
                           float *y, int64_t ldy) {
    run((int)bits, (int)dot, x, M, K, ldx, codes, (Scales){scales, (int)half}, 1, N, NULL, y, ldy);
}

/* out [n, K] = rows ids[0..n) of W (the weight's output columns: an embedding table's
   lookup, from the same panels as its tied lm_head), each weight q * d + o as above. */
int64_t fanout_quant_rows(int64_t bits, const uint8_t *codes, const void *scales, int64_t half, int64_t K,
                          int64_t N, const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return i + 1; /* nothing written */
    const int64_t cb = panel_codes((int)bits, K), sb = panel_scales(K), gb = group_codes((int)bits);
    /* A decode step's few rows on one thread: waking the others costs more than they take. */
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = ids[i] / NR, j = ids[i] % NR;
        const uint8_t *c = codes + p * cb + j * 4;
        const Scales s = scales_from((Scales){scales, (int)half}, p * sb);
        float *o = out + i * K;
        for (int64_t k = 0; k < K; k++) {
            const uint8_t *cg = c + (k / 32) * gb;
            const int kk = k % 32;
            const float q = bits == 8 ? (float)(int8_t)cg[(kk / 4) * NR * 4 + kk % 4]
                                      : (float)((cg[(kk / 8) * NR * 4 + kk % 4] >> (4 * (kk % 8 / 4))) & 15);
            o[k] = __builtin_fmaf(q, scale_at(s, (k / 32) * 2 * NR + j), scale_at(s, ((k / 32) * 2 + 1) * NR + j));
        }
    }
    return 0;
}
