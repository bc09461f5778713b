/* The sampler's seeded noise on a CPU: its uniforms (sampler.seeded_uniform), the same numbers,
bit for bit, as its torch path, which makes some twenty passes of int32 tensor ops over [B, V];
and a whole row's Gumbel-max draw from them (sampler.gumbel_argmax), in one pass.

u[b, j] = ((h >> 9) + 0.5) / 2^23 with h = mix(mix(k_b ^ c_j) + k_b), mix = lowbias32
(Wellons), k_b the row's key (seed, step) and c_j the column's key; all in uint32, which
wraps as the hash wants. A row's columns go in blocks, so both threads share one long row.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_row.h"

#define COLS 4096 /* columns per task */

static inline uint32_t mix(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* row_keys [B], col_keys [V]: the keys' 32 bits in int64; out [B, V] */
void fanout_seeded_uniform(const int64_t *row_keys, int64_t B, const int64_t *col_keys,
                           int64_t V, float *out) {
    const int64_t blocks = (V + COLS - 1) / COLS;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < B * blocks; t++) {
        const int64_t b = t / blocks, j0 = (t % blocks) * COLS;
        const int64_t j1 = j0 + COLS < V ? j0 + COLS : V;
        const uint32_t k = (uint32_t)row_keys[b];
        float *o = out + b * V;
        for (int64_t j = j0; j < j1; j++) {
            const uint32_t h = mix(mix(k ^ (uint32_t)col_keys[j]) + k);
            o[j] = ((float)(h >> 9) + 0.5f) * (1.0f / (1 << 23));
        }
    }
}

/* The same numbers at a few columns a row: out[b][i] = u(row_keys[b], col_keys[cols[b][i]])
   for cols [B][K] (a top-k / top-p row's candidates); cols checked against V first (returns
   1 + the flat index of the first outside, nothing written). */
int64_t fanout_uniform_at(const int64_t *row_keys, int64_t B, const int64_t *cols, int64_t K,
                          const int64_t *col_keys, int64_t V, float *out) {
    for (int64_t i = 0; i < B * K; i++)
        if (cols[i] < 0 || cols[i] >= V) return i + 1;
    for (int64_t b = 0; b < B; b++) {
        const uint32_t k = (uint32_t)row_keys[b];
        for (int64_t i = 0; i < K; i++) {
            const uint32_t h = mix(mix(k ^ (uint32_t)col_keys[cols[b * K + i]]) + k);
            out[b * K + i] = ((float)(h >> 9) + 0.5f) * (1.0f / (1 << 23));
        }
    }
    return 0;
}

/* log(x) for a positive normal float x (every value the draw below takes it of): Cephes' logf,
   x = 2^k m with m in [sqrt(1/2), sqrt(2)), log m = log1p(f) from f = m - 1 by a polynomial of
   degree 9, within ~1 ulp (its relative error 7.6e-8). No division (a 16-lane vdivps is ~10
   cycles), no call (libm's logf is one per value): plain arithmetic, so the loop over it
   vectorizes. Not torch's log, which may differ by an ulp: see gumbel_argmax. */
static inline float ln(float x) {
    uint32_t ix;
    memcpy(&ix, &x, 4);
    ix += 0x3f800000 - 0x3f3504f3; /* the exponent of x / sqrt(1/2): m's range starts there */
    const int k = (int)(ix >> 23) - 0x7f;
    ix = (ix & 0x007fffff) + 0x3f3504f3;
    float m;
    memcpy(&m, &ix, 4);
    const float f = m - 1.0f, z = f * f, dk = (float)k;
    float p = 7.0376836292e-2f;
    p = p * f - 1.1514610310e-1f;
    p = p * f + 1.1676998740e-1f;
    p = p * f - 1.2420140846e-1f;
    p = p * f + 1.4249322787e-1f;
    p = p * f - 1.6668057665e-1f;
    p = p * f + 2.0000714765e-1f;
    p = p * f - 2.4999993993e-1f;
    p = p * f + 3.3333331174e-1f;
    const float y = p * f * z - 2.12194440e-4f * dk - 0.5f * z;
    return f + y + 0.693359375f * dk;
}

static inline float uniform(uint32_t k, int64_t c) {
    const uint32_t h = mix(mix(k ^ (uint32_t)c) + k);
    return ((float)(h >> 9) + 0.5f) * (1.0f / (1 << 23));
}

/* A value's score: z - log(-log u), its Gumbel noise; -log u > 0 as u < 1 */
static inline float score(float z, uint32_t k, int64_t c) { return z - ln(-ln(uniform(k, c))); }

#define LANES 16 /* columns whose bounds are tested before any is scored */
/* The noise's largest value, at the largest u (1 - 2^-24): 16.6355; with room for rounding */
#define NOISE_MAX 16.64f

/* idx[b] = the column of row b's largest score z[b, j] - log(-log u[b, j]), u the seeded
   uniforms above (a Gumbel-max draw: the token with probability softmax(z)): the first of equal
   scores, a NaN counting as the largest (the first NaN), as torch.max's indices. z: B rows of
   V, stride ldz. Returns 1 (nothing drawn) where its scratch cannot be allocated.

   Two logs a value are most of the cost, and few values can win: so only the values a bound
   cannot rule out are scored. A row's first score is that of its largest z (s0): a value
   needs a score >= s0 to win. The noise is at most NOISE_MAX, so a lane of LANES values whose
   z are all below s0 - NOISE_MAX is passed over unhashed; else each value's noise is bounded
   from its u without a log: -log(-log u) <= -log(1 - u) (as -log u >= 1 - u), and 1 - u =
   n 2^-24 for an integer n >= 2^e (e its float exponent), so the noise <= (24 - e) log 2; a
   value whose z plus that stays below s0 is passed over. The rest (on SmolLM2 at T = 0.8,
   about twice the row's 1 / max softmax: a handful) are scored. The bounds keep a margin
   over the scores' rounding (SLACK), which only scores a few more. A row's blocks of COLS go
   to the threads; the blocks' winners are then compared in column order. */
int64_t fanout_gumbel_argmax(const float *z, int64_t B, int64_t V, int64_t ldz, const int64_t *row_keys,
                             const int64_t *col_keys, int64_t *idx) {
    const int64_t blocks = (V + COLS - 1) / COLS, n = B * blocks;
    float *best = malloc((n + B) * sizeof(float));
    int64_t *at = malloc(n * sizeof(int64_t));
    if (!best || !at) { /* nothing drawn */
        free(best);
        free(at);
        return 1;
    }
    float *s0 = best + n;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const float *r = z + b * ldz;
            int nan;
            const int64_t j = idx[b] = first_max(r, V, &nan);
            /* A NaN's score is NaN: the first NaN wins. (A row of -inf: 0, its score -inf.) */
            s0[b] = nan ? NAN : score(r[j], (uint32_t)row_keys[b], col_keys[j]);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) {
            const int64_t b = t / blocks, j0 = (t % blocks) * COLS, j1 = j0 + COLS < V ? j0 + COLS : V;
            at[t] = -1;
            if (s0[b] != s0[b]) continue;
            const uint32_t k = (uint32_t)row_keys[b];
            const float *r = z + b * ldz;
            const float slack = 1e-3f + fabsf(s0[b]) * 0x1p-20f, need = s0[b] - slack;
            float top[LANES]; /* each lane's best score and its column (first of equals) */
            int64_t col[LANES];
            for (int i = 0; i < LANES; i++) {
                top[i] = -INFINITY;
                col[i] = -1;
            }
            for (int64_t l = j0; l + LANES <= j1; l += LANES) {
                const float *x = r + l;
                const int64_t *c = col_keys + l;
                int near = 0;
#pragma omp simd reduction(| : near)
                for (int i = 0; i < LANES; i++) near |= x[i] + NOISE_MAX >= need;
                if (!near) continue;
                int maybe = 0;
#pragma omp simd reduction(| : maybe)
                for (int i = 0; i < LANES; i++) {
                    const uint32_t h = mix(mix(k ^ (uint32_t)c[i]) + k);
                    const float rest = (float)((1 << 24) - 2 * (int32_t)(h >> 9) - 1); /* (1 - u) 2^24, exact */
                    int32_t bits;
                    memcpy(&bits, &rest, 4);
                    maybe |= x[i] + (float)(151 - (bits >> 23)) * 0.6931472f >= need; /* 24 - e */
                }
                if (!maybe) continue;
#pragma omp simd
                for (int i = 0; i < LANES; i++) {
                    const float v = score(x[i], k, c[i]);
                    col[i] = v > top[i] || col[i] < 0 ? l + i : col[i];
                    top[i] = v > top[i] ? v : top[i];
                }
            }
            best[t] = -INFINITY;
            at[t] = -1;
            for (int i = 0; i < LANES; i++)
                if (col[i] >= 0 && (top[i] > best[t] || (top[i] == best[t] && col[i] < at[t]) || at[t] < 0)) {
                    best[t] = top[i];
                    at[t] = col[i];
                }
            for (int64_t j = j0 + (j1 - j0) / LANES * LANES; j < j1; j++) { /* the block's last few */
                const float v = score(r[j], k, col_keys[j]);
                if (v > best[t] || at[t] < 0) {
                    best[t] = v;
                    at[t] = j;
                }
            }
        }
    }
    for (int64_t b = 0; b < B; b++) {
        if (s0[b] != s0[b]) continue;
        float top = s0[b];
        for (int64_t t = b * blocks; t < (b + 1) * blocks; t++) /* blocks in column order */
            if (at[t] >= 0 && (best[t] > top || (best[t] == top && at[t] < idx[b]))) {
                top = best[t];
                idx[b] = at[t];
            }
    }
    free(best);
    free(at);
    return 0;
}
