/* Decode attention over the paged KV cache on a CPU, fp32: one query token per row.

A row is one task: its query heads read every key and value of the row once, straight
from the pool through the row's slot table (no gathered copy), in blocks of KB keys with an
online softmax (the running max rescales what is summed so far). A slot's keys for all kv
heads are one contiguous run and a page's slots are consecutive, so the reads stream; a
block's keys and values (KB runs) stay in L1 while each query head goes over them: its
scores as vectors of D (one horizontal sum a key, in registers), its softmax over the block's
scores as vectors, its output accumulated in registers; the next block's runs are prefetched,
a few keys by each head.
On SmolLM2's shapes (64 rows of 250 keys, pools of 8 layers, from memory): 2.05 ms a layer
against 2.88 for the scalar kernel before it. D is a multiple of the vector width (VL) and
at most MAX_ND vectors; the loops over D unroll for each such D (attend's nd).
*/
#include <math.h>
#include <omp.h>

#include "cpu_vector.h"

#define KB 16 /* keys per block */

/* One row's query heads [h0, h1): qb [Hq, D] -> ob [Hq, D] over len keys at slots; the keys'
   floats [f0, f1) of each run are the ones those heads read (prefetched). acc, m, l: Hq heads'
   scratch. */
INLINE void attend(const int nd, const int capped, const float *qb, float *ob, const float *kc, const float *vc,
                   const int64_t *slots, int64_t len, int64_t Hq, int64_t Hkv, int64_t h0, int64_t h1,
                   int64_t f0, int64_t f1, float scale, float softcap, vf *acc, float *m, float *l) {
    const int64_t D = nd * VL, G = Hq / Hkv, run = Hkv * D, nh = h1 - h0;
    for (int64_t h = h0; h < h1; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        for (int c = 0; c < nd; c++) acc[h * nd + c] = (vf){0};
    }
    for (int64_t p0 = 0; p0 < len; p0 += KB) {
        const int n = len - p0 < KB ? (int)(len - p0) : KB;
        const float *k[KB], *v[KB];
        for (int j = 0; j < n; j++) {
            k[j] = kc + slots[p0 + j] * run;
            v[j] = vc + slots[p0 + j] * run;
        }
        for (int64_t h = h0; h < h1; h++) {
            const int64_t off = (h / G) * D;
            /* The next block's runs, fetched while this one computes (pages lie anywhere in
               the pool, and a hardware prefetcher stops at each 4 KB page of memory): keys
               h - h0, + nh, ... of it by head h (a task of one kv head: its floats only), so
               that the fetches are spread over the block's work instead of queued at its start
               (64 rows x 300 keys, Intel 2-core: 1.73 -> 1.19 ms a layer, ~25 GB/s of the ~27
               this machine streams). Into L2, not L1:
               this block's runs and the next's (2 x 24 KB on SmolLM2) overflow a 32 KB L1,
               and the fetched lines pushed out the ones the next heads were about to read
               (AMD 2-core, 32 KB L1: 2.4 -> 1.4 ms a layer, 12 -> ~21 GB/s of ~28). */
            for (int64_t j = p0 + KB + h - h0; j < p0 + 2 * KB && j < len; j += nh)
                for (int64_t o = f0; o < f1; o += 64 / sizeof(float)) {
                    __builtin_prefetch(kc + slots[j] * run + o, 0, 2);
                    __builtin_prefetch(vc + slots[j] * run + o, 0, 2);
                }
            vf q[MAX_ND];
            for (int c = 0; c < nd; c++) q[c] = load(qb + h * D + c * VL);
            float s[KB];
            for (int j = 0; j < KB; j++) {
                if (j < n) {
                    vf t = q[0] * load(k[j] + off);
                    for (int c = 1; c < nd; c++) t += q[c] * load(k[j] + off + c * VL);
                    s[j] = hsum(t) * scale;
                    if (capped) s[j] = softcap * tanhf(s[j] / softcap); /* Gemma 2's */
                } else {
                    s[j] = -INFINITY;
                }
            }
            float mx = m[h];
            for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
            vf sum = (vf){0};
            for (int j = 0; j < KB; j += VL) {
                const vf x = load(s + j);
                const vf e = pick(x == -INFINITY, (vf){0}, vexp(x - mx)); /* masked keys: 0 */
                store(s + j, e);
                sum += e;
            }
            const float corr = m[h] == -INFINITY ? 0.0f : vexp((vf){0} + (m[h] - mx))[0];
            l[h] = l[h] * corr + hsum(sum);
            m[h] = mx;
            vf a[MAX_ND];
            for (int c = 0; c < nd; c++) a[c] = acc[h * nd + c] * corr;
            for (int j = 0; j < n; j++)
                for (int c = 0; c < nd; c++) a[c] += s[j] * load(v[j] + off + c * VL);
            for (int c = 0; c < nd; c++) acc[h * nd + c] = a[c];
        }
    }
    for (int64_t h = h0; h < h1; h++) {
        const float inv = 1.0f / l[h];
        for (int c = 0; c < nd; c++) store(ob + h * D + c * VL, acc[h * nd + c] * inv);
    }
}

/* q, out: [*, Hq, D] rows; kc, vc: [slots, Hkv, D]; table: [*, stride] slot of each position;
   rows[b]: b's row of q and out; req[b]: its row of table; lens[b]: its keys (>= 1), of which
   it sees the last `window` (all when window is 0). softcap > 0: each score s becomes
   softcap * tanh(s / softcap) before the softmax. */
void fanout_decode_attention(const float *q, float *out, const float *kc, const float *vc,
                             const int64_t *table, int64_t stride, const int64_t *rows,
                             const int64_t *req, const int64_t *lens, int64_t B, int64_t Hq,
                             int64_t Hkv, int64_t D, float scale, int64_t window, float softcap) {
    const int nd = (int)(D / VL);
    /* A task is a row (its runs read whole, once), or with fewer rows than threads (batch 1
       or 2 on two cores) one kv head of a row and its query heads, so that no thread idles:
       SmolLM2 at batch 1 (3 kv heads), 30 layers, Zen 5 2-core: 48 keys 0.18-0.20 -> 0.13-0.14
       ms, 1,020 keys 2.29 -> 1.65-1.74 ms. A task's query heads: hs; its kv heads' floats of a
       run: span. */
    const int64_t split = B < omp_get_max_threads() ? Hkv : 1, hs = Hq / split, span = Hkv / split * D;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * split; task++) {
        const int64_t b = task / split, g = task % split, h0 = g * hs, f0 = g * span, f1 = f0 + span;
        vf acc[Hq * nd];
        float m[Hq], l[Hq];
        const float *qb = q + rows[b] * Hq * D;
        float *ob = out + rows[b] * Hq * D;
        const int64_t first = window > 0 && lens[b] > window ? lens[b] - window : 0;
        const int64_t *slots = table + req[b] * stride + first;
#define CASE(ND) \
    case ND: \
        if (softcap > 0.0f) /* two builds of the loop: no tanh call, nor a test, in the uncapped one */ \
            attend(ND, 1, qb, ob, kc, vc, slots, lens[b] - first, Hq, Hkv, h0, h0 + hs, f0, f1, scale, \
                   softcap, acc, m, l); \
        else \
            attend(ND, 0, qb, ob, kc, vc, slots, lens[b] - first, Hq, Hkv, h0, h0 + hs, f0, f1, scale, \
                   softcap, acc, m, l); \
        break;
        switch (nd) {
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
        }
#undef CASE
    }
}
