/* Prefill (extend) attention over the paged KV cache on a CPU, fp32: the new tokens of a
request, causal, over its cached prefix and themselves.

A task is one request, one kv head and a block of its new tokens (QN query heads at most: the
block's tokens times the G query heads of that kv head). It goes over the request's keys in
blocks of KB, from the pool through the slot table (the new tokens' K/V are stored already),
up to its last token's position; a key block is transposed once into [D][KB] so that a query's
KB scores are D multiply-adds of one broadcast query value and one vector, no horizontal sums
(torch's CPU flash kernel ran this at ~35 GFLOP/s on SmolLM2's 9 x 64 heads and ~240-token
prompts), QR query heads at a time; then an online softmax over the block as vectors and the
values accumulated in registers. A query skips the blocks past its position and masks the keys past it in the block
that holds it; with a sliding window, a task starts at the block of its first token's window, and a query masks
the keys before its own. The tasks are spread over torch's OpenMP threads.
*/
#include <math.h>

#include "cpu_vector.h"

#define KB 16 /* keys per block */
#define NV (KB / VL) /* vectors of a block's scores */
#define QN 96 /* query heads per task */
/* Query heads that go over a key block together: QR x 2 chains of FMAs for their scores and QR
   x D / VL accumulators for their outputs, each key's values loaded once for all of them (a
   head at a time waited on one chain's latency: chats16's prompts, Intel 2-core, 81 -> 133
   GFLOP/s with QN 48 -> 96 too). */
#if VL == 16
#define QR 6
#else
#define QR 3
#endif

int64_t fanout_extend_qn(void) { return QN; }

/* Query heads of tokens t0..t1 (of one request, positions p + t) on kv head hk. */
INLINE void task(const int nd, const int capped, const float *q, float *out, const float *kc, const float *vc,
                 const int64_t *slots, int64_t start, int64_t p, int64_t t0, int64_t t1,
                 int64_t hk, int64_t Hq, int64_t Hkv, float scale, int64_t window, float softcap) {
    const int64_t D = nd * VL, G = Hq / Hkv, run = Hkv * D, nq = (t1 - t0) * G;
    float kt[MAX_ND * VL][KB];
    vf acc[QN][MAX_ND];
    float m[QN], l[QN];
    for (int64_t i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        for (int c = 0; c < nd; c++) acc[i][c] = (vf){0};
    }
    const int64_t keys = p + t1; /* the last token's position + 1 */
    /* the first key of the first token's window (later tokens' windows start later) */
    const int64_t lo = window > 0 && p + t0 - window + 1 > 0 ? (p + t0 - window + 1) / KB * KB : 0;
    for (int64_t k0 = lo; k0 < keys; k0 += KB) {
        const int n = keys - k0 < KB ? (int)(keys - k0) : KB;
        const float *v[KB];
        for (int j = 0; j < KB; j++) {
            if (j < n) {
                const float *k = kc + slots[k0 + j] * run + hk * D;
                v[j] = vc + slots[k0 + j] * run + hk * D;
                for (int64_t d = 0; d < D; d++) kt[d][j] = k[d];
            } else {
                for (int64_t d = 0; d < D; d++) kt[d][j] = 0.0f;
            }
        }
        /* tokens before k0 skip the block; the rest go QR query heads at a time */
        const int64_t first = (k0 - p > t0 ? k0 - p : t0) - t0;
        for (int64_t i0 = first * G; i0 < nq; i0 += QR) {
            const float *qr[QR];
            int64_t row[QR]; /* each one's query head; past nq, a copy of i0 (never stored) */
            int last[QR], lmax = 0;
            int below[QR]; /* keys 0..below-1 of the block are before the query's window */
            for (int r = 0; r < QR; r++) {
                const int64_t i = row[r] = i0 + r < nq ? i0 + r : i0, t = t0 + i / G, pos = p + t;
                qr[r] = q + ((start + t) * Hq + hk * G + i % G) * D;
                last[r] = pos - k0 < n - 1 ? (int)(pos - k0) : n - 1; /* keys 0..last seen */
                lmax = last[r] > lmax ? last[r] : lmax;
                const int64_t b = window > 0 ? pos - window + 1 - k0 : 0;
                below[r] = b > KB ? KB : (int)b;
            }
            vf s[QR][NV], s1[QR][NV];
            for (int r = 0; r < QR; r++)
                for (int u = 0; u < NV; u++) s[r][u] = s1[r][u] = (vf){0};
            for (int64_t d = 0; d < D; d += 2) /* 2 x QR chains of FMAs */
                for (int u = 0; u < NV; u++) {
                    const vf k0v = load(kt[d] + u * VL), k1v = load(kt[d + 1] + u * VL);
                    for (int r = 0; r < QR; r++) {
                        s[r][u] += qr[r][d] * k0v;
                        s1[r][u] += qr[r][d + 1] * k1v;
                    }
                }
            float w[QR][KB], corr[QR];
            for (int r = 0; r < QR; r++) {
                const int64_t i = row[r];
                vf top = (vf){0} + m[i];
                if (capped) /* Gemma 2's: softcap * tanh(score / softcap), lane by lane */
                    for (int u = 0; u < NV; u++) {
                        float t[VL];
                        store(t, (s[r][u] + s1[r][u]) * scale);
                        for (int x = 0; x < VL; x++) t[x] = softcap * tanhf(t[x] / softcap);
                        s[r][u] = load(t);
                        s1[r][u] = (vf){0};
                    }
                for (int u = 0; u < NV; u++) {
                    s[r][u] = capped ? s[r][u] : (s[r][u] + s1[r][u]) * scale;
                    if (last[r] < KB - 1) /* keys past the query's position, or past the last */
                        s[r][u] = pick(lanes() + u * VL > last[r], (vf){0} - INFINITY, s[r][u]);
                    if (below[r] > 0) /* keys before its window: a block wholly before it adds nothing */
                        s[r][u] = pick(lanes() + u * VL < below[r], (vf){0} - INFINITY, s[r][u]);
                    top = pick(s[r][u] > top, s[r][u], top);
                }
                const float mx = hmax(top);
                vf sum = (vf){0};
                for (int u = 0; u < NV; u++) {
                    s[r][u] = pick(s[r][u] == -INFINITY, (vf){0}, vexp(s[r][u] - mx));
                    sum += s[r][u];
                    store(w[r] + u * VL, s[r][u]);
                }
                corr[r] = m[i] == -INFINITY ? 0.0f : vexp((vf){0} + (m[i] - mx))[0];
                if (i0 + r < nq) {
                    l[i] = l[i] * corr[r] + hsum(sum);
                    m[i] = mx;
                }
            }
            vf a[QR][MAX_ND];
            for (int r = 0; r < QR; r++)
                for (int c = 0; c < nd; c++) a[r][c] = acc[row[r]][c] * corr[r];
            for (int j = 0; j <= lmax; j++) /* w is 0 past a row's last key */
                for (int c = 0; c < nd; c++) {
                    const vf vv = load(v[j] + c * VL);
                    for (int r = 0; r < QR; r++) a[r][c] += w[r][j] * vv;
                }
            for (int r = 0; r < QR && i0 + r < nq; r++)
                for (int c = 0; c < nd; c++) acc[i0 + r][c] = a[r][c];
        }
    }
    for (int64_t t = t0; t < t1; t++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t i = (t - t0) * G + g;
            const float inv = 1.0f / l[i];
            for (int c = 0; c < nd; c++)
                store(out + ((start + t) * Hq + hk * G + g) * D + c * VL, acc[i][c] * inv);
        }
}

/* q, out: [T, Hq, D]; kc, vc: [slots, Hkv, D]; table: [*, stride] slot of each position.
   Request r: its new tokens are q rows starts[r] .. + counts[r], at positions prefix[r] on,
   its slots table row req[r]. G = Hq / Hkv must be at most QN. A query sees the last `window`
   positions up to its own (all of them when window is 0); softcap > 0: each score s becomes
   softcap * tanh(s / softcap) before the softmax. */
void fanout_extend_attention(const float *q, float *out, const float *kc, const float *vc,
                             const int64_t *table, int64_t stride, const int64_t *starts,
                             const int64_t *counts, const int64_t *prefix, const int64_t *req,
                             int64_t R, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                             int64_t window, float softcap) {
    const int nd = (int)(D / VL);
    const int64_t G = Hq / Hkv, QB = QN / G; /* tokens per task */
    int64_t tasks = 0;
    for (int64_t r = 0; r < R; r++) tasks += Hkv * ((counts[r] + QB - 1) / QB);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t x = 0; x < tasks; x++) {
        int64_t r = 0, y = x; /* task x: request r, then kv head and token block */
        while (y >= Hkv * ((counts[r] + QB - 1) / QB)) y -= Hkv * ((counts[r++] + QB - 1) / QB);
        const int64_t blocks = (counts[r] + QB - 1) / QB, hk = y / blocks, t0 = (y % blocks) * QB;
        const int64_t t1 = t0 + QB < counts[r] ? t0 + QB : counts[r];
        const int64_t *slots = table + req[r] * stride;
#define CASE(ND) \
    case ND: /* two builds of the loop: no tanh calls, nor tests, in the uncapped one */ \
        if (softcap > 0.0f) \
            task(ND, 1, q, out, kc, vc, slots, starts[r], prefix[r], t0, t1, hk, Hq, Hkv, scale, window, softcap); \
        else \
            task(ND, 0, q, out, kc, vc, slots, starts[r], prefix[r], t0, t1, hk, Hq, Hkv, scale, window, softcap); \
        break;
        switch (nd) {
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
        }
#undef CASE
    }
}
