/* Decode attention over the paged KV cache on a CPU, fp32: one query token per row.

A row is one task: its query heads read every key and value of the row once, straight
from the pool through the row's slot table (no gathered copy), in blocks of KB keys with an
online softmax (the running max rescales what is summed so far). Tasks are spread over
torch's own OpenMP threads: the library is loaded after torch, so its libgomp.so.1 is torch's
and there is one thread pool, not two fighting for cores. exp is a polynomial (Cephes' expf,
within 2 ulp) that the compiler vectorizes; the scores it takes are never positive, which keeps
it in range.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KB 32 /* keys per block */

#pragma omp declare simd
static inline float exp_neg(float x) {
    x = fmaxf(x, -87.0f); /* exp(-87) ~ 1.6e-38: still a normal float, and nothing next to the 1 of the max */
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    float y = fmaf(p * r, r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return y * s;
}

/* q, out: [*, Hq, D] rows; kc, vc: [slots, Hkv, D]; table: [*, stride] slot of each position;
   rows[b]: b's row of q and out; req[b]: its row of table; lens[b]: its keys. A task is a row,
   every head: a slot's keys for all kv heads are one contiguous run, and a page's slots are
   consecutive, so the reads stream (a task per (row, kv head) read a third of each run and
   waited on memory: ~3x slower on SmolLM2; so did taking the heads one at a time over a
   block, which re-reads each run per head). */
void fanout_decode_attention(const float *q, float *out, const float *kc, const float *vc,
                             const int64_t *table, int64_t stride, const int64_t *rows,
                             const int64_t *req, const int64_t *lens, int64_t B, int64_t Hq,
                             int64_t Hkv, int64_t D, float scale) {
    const int64_t G = Hq / Hkv, run = Hkv * D;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = lens[b];
        const int64_t *slots = table + req[b] * stride;
        const float *qb = q + rows[b] * Hq * D;
        float acc[Hq][D], m[Hq], l[Hq], s[Hq][KB];
        for (int64_t g = 0; g < Hq; g++) {
            m[g] = -INFINITY;
            l[g] = 0.0f;
            memset(acc[g], 0, D * sizeof(float));
        }
        for (int64_t p0 = 0; p0 < len; p0 += KB) {
            const int64_t n = len - p0 < KB ? len - p0 : KB;
            for (int64_t j = 0; j < n; j++) {
                const float *k = kc + slots[p0 + j] * run;
                for (int64_t g = 0; g < Hq; g++) {
                    const float *qg = qb + g * D, *kg = k + (g / G) * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * kg[d];
                    s[g][j] = dot * scale;
                }
            }
            for (int64_t g = 0; g < Hq; g++) {
                float mx = m[g];
                for (int64_t j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
                const float c = m[g] == -INFINITY ? 0.0f : exp_neg(m[g] - mx);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < n; j++) {
                    s[g][j] = exp_neg(s[g][j] - mx);
                    sum += s[g][j];
                }
                l[g] = l[g] * c + sum;
                m[g] = mx;
                if (c != 1.0f) {
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) acc[g][d] *= c;
                }
            }
            for (int64_t j = 0; j < n; j++) {
                const float *v = vc + slots[p0 + j] * run;
                for (int64_t g = 0; g < Hq; g++) {
                    const float w = s[g][j], *vg = v + (g / G) * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) acc[g][d] += w * vg[d];
                }
            }
        }
        float *o = out + rows[b] * Hq * D;
        for (int64_t g = 0; g < Hq; g++) {
            const float inv = 1.0f / l[g];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[g * D + d] = acc[g][d] * inv;
        }
    }
}
