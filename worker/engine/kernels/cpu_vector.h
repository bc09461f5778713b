/* The vector type the CPU kernels compute in, and the few helpers they share. GCC's vector
extensions: one source builds for AVX-512 (16 floats), AVX2 (8) or SSE / NEON (4). */
#ifndef FANOUT_CPU_VECTOR_H
#define FANOUT_CPU_VECTOR_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

#define INLINE static inline __attribute__((always_inline))

/* An attention kernel's head: D floats, a whole number of vectors, at most MAX_ND of them
   (its loops over D unroll for each count). Exported so that Python checks a model's head
   size against the library it loaded. */
#define MAX_ND 16
int64_t fanout_vl(void) { return VL; }
int64_t fanout_max_head_dim(void) { return VL * MAX_ND; }

INLINE vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

INLINE vf pick(vi mask, vf a, vf b) { /* mask ? a : b, lane by lane */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

INLINE float hsum(vf v) { /* halves added pairwise, in registers */
#if VL == 16
    return _mm512_reduce_add_ps((__m512)v);
#elif VL == 8
    __m128 a = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
#else
    return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

INLINE float hmax(vf v) { /* the largest lane */
#if VL == 16
    return _mm512_reduce_max_ps((__m512)v);
#else
    float m = v[0];
    for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
    return m;
#endif
}

INLINE vi lanes(void) { /* 0, 1, ..., VL - 1 */
    vi x;
    for (int i = 0; i < VL; i++) x[i] = i;
    return x;
}

/* Cephes' expf (within 2 ulp) on a vector, x clamped to [-87, 88]: finite, normal results */
INLINE vf vexp(vf x) {
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

#endif
