/* The per-row steps between a layer's matmuls on a CPU, fp32: residual add + RMSNorm, and
RoPE + the K/V store; and after the last, the sampler's picks from a row (its argmax, its K
largest). Each is one
call instead of the dozen small torch ops it replaces (a few microseconds each: at SmolLM2's
30 layers, more than the attention itself at batch 8).

Numerics follow HF: RMSNorm sums squares in fp32, x * rsqrt(mean + eps) rounded before the
weight multiplies it; RoPE's rotate-half products are each rounded before they are added, as
torch's separate ops do (no FMA contraction in that function).
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_row.h"

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

/* idx[m] = the column of row m's largest value (first_max: the first of equal ones, a NaN the
   largest, as torch.max's indices). x: M rows of N >= 1 floats, stride ld. Why not torch: its
   max took 28 us over a [1, 49152] row and 138 us over [8, 49152] (this 7 and 46), up to ~0.3
   ms of a q8 decode step at batch 8 in the engine. */
void fanout_argmax(const float *x, int64_t M, int64_t N, int64_t ld, int64_t *idx) {
#pragma omp parallel for schedule(static) if (M > 1 && M * N >= PARALLEL_FLOATS)
    for (int64_t m = 0; m < M; m++) {
        int nan;
        idx[m] = first_max(x + m * ld, N, &nan);
    }
}

/* A value and its column; ordered by value, larger first, then by column, smaller first: a
   strict order (no two share a column), the one a stable descending sort gives. */
typedef struct {
    float v;
    int32_t j;
} Pick;

static inline int before(Pick a, Pick b) { return a.v > b.v || (a.v == b.v && a.j < b.j); }

static inline void swap(Pick *a, Pick *b) {
    const Pick t = *a;
    *a = *b;
    *b = t;
}

/* a[lo..hi]'s pivot (the median of three, moved to hi) put in its place, those before it to
   its left: returns where it lands. */
static int64_t partition(Pick *a, int64_t lo, int64_t hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (before(a[mid], a[lo])) swap(&a[mid], &a[lo]);
    if (before(a[hi], a[lo])) swap(&a[hi], &a[lo]);
    if (before(a[mid], a[hi])) swap(&a[mid], &a[hi]);
    const Pick p = a[hi];
    int64_t s = lo;
    for (int64_t i = lo; i < hi; i++)
        if (before(a[i], p)) swap(&a[i], &a[s++]);
    swap(&a[s], &a[hi]);
    return s;
}

/* Puts a[0..n)'s k first (in the order above) in a[0..k), in any order (quickselect). */
static void select_first(Pick *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (hi > lo) { /* lo <= k - 1 < k <= hi: the edge at k lies inside */
        const int64_t s = partition(a, lo, hi);
        if (s == k || s == k - 1) return;
        if (s < k) lo = s + 1;
        else hi = s - 1;
    }
}

/* Sorts a[lo..hi] in the order above (quicksort; insertion below 16; the comparison inlined,
   as qsort's call per comparison is not: a 4,096-value sort took 2x torch's topk with it). */
static void sort_picks(Pick *a, int64_t lo, int64_t hi) {
    while (hi - lo >= 16) {
        const int64_t s = partition(a, lo, hi);
        if (s - lo < hi - s) { /* recurse on the smaller side: depth stays O(log n) */
            sort_picks(a, lo, s - 1);
            lo = s + 1;
        } else {
            sort_picks(a, s + 1, hi);
            hi = s - 1;
        }
    }
    for (int64_t i = lo + 1; i <= hi; i++) {
        const Pick p = a[i];
        int64_t j = i;
        for (; j > lo && before(p, a[j - 1]); j--) a[j] = a[j - 1];
        a[j] = p;
    }
}

#define PICK_LANES 16

/* vals[m][0..K), ids[m][0..K) = row m's K largest values and their columns, in the order above
   (torch's topk, then a stable descending sort by value; ties by column). x: M rows of N > K
   floats, stride ld. A row with a NaN gets K NaNs (at columns 0..K): nothing of it is ranked.
   Why not torch: topk and the two sorts that order its ties took ~1.2 ms of a top-p step at
   batch 8 on SmolLM2's 49,152 columns. How: a buffer of 2K values; the values past it join
   only when larger than the K-th best kept (a vector compare passes most lanes over), and a
   full buffer keeps its K first (quickselect); at the end those K are sorted. (The buffer
   holds K or more at the end, as N > K.) */
int64_t fanout_top_k(const float *x, int64_t M, int64_t N, int64_t ld, int64_t K, float *vals, int64_t *ids) {
    if (K <= 0 || K >= N || N >= INT32_MAX) return 1;
    int failed = 0;
#pragma omp parallel for schedule(static) if (M > 1) reduction(| : failed)
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ld;
        float *ov = vals + m * K;
        int64_t *oi = ids + m * K;
        int nan = 0;
#pragma omp simd reduction(| : nan)
        for (int64_t j = 0; j < N; j++) nan |= r[j] != r[j];
        Pick *a = nan ? NULL : malloc((2 * K + PICK_LANES) * sizeof(Pick));
        if (nan || !a) {
            failed |= !nan;
            for (int64_t i = 0; i < K; i++) {
                ov[i] = NAN;
                oi[i] = i;
            }
            continue;
        }
        int64_t n = 0, j = 0;
        for (; j < N && j < 2 * K; j++) a[n++] = (Pick){r[j], (int32_t)j};
        float top = -INFINITY; /* the K-th value kept, once the buffer first fills */
        if (j < N) {
            select_first(a, n, K);
            n = K;
            top = a[0].v;
            for (int64_t i = 1; i < K; i++) top = a[i].v < top ? a[i].v : top;
        }
        for (; j < N; j += PICK_LANES) {
            const int64_t w = N - j < PICK_LANES ? N - j : PICK_LANES;
            int over = 0;
#pragma omp simd reduction(| : over)
            for (int64_t i = 0; i < w; i++) over |= r[j + i] > top;
            if (!over) continue;
            for (int64_t i = 0; i < w; i++)
                if (r[j + i] > top) a[n++] = (Pick){r[j + i], (int32_t)(j + i)};
            if (n >= 2 * K) {
                select_first(a, n, K);
                n = K;
                top = a[0].v;
                for (int64_t i = 1; i < K; i++) top = a[i].v < top ? a[i].v : top;
            }
        }
        /* Values equal to the K-th kept that came after the buffer filled are not in it: they
           follow it in the order (a larger column), so they are not among the K first. */
        if (n > K) select_first(a, n, K);
        sort_picks(a, 0, K - 1);
        for (int64_t i = 0; i < K; i++) {
            ov[i] = a[i].v;
            oi[i] = a[i].j;
        }
        free(a);
    }
    return failed;
}
