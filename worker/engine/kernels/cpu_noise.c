/* The sampler's seeded uniforms on a CPU (sampler.seeded_uniform): the same numbers, bit for
bit, as its torch path, which makes some twenty passes of int32 tensor ops over [B, V].

u[b, j] = ((h >> 9) + 0.5) / 2^23 with h = mix(mix(k_b ^ c_j) + k_b), mix = lowbias32
(Wellons), k_b the row's key (seed, step) and c_j the column's key; all in uint32, which
wraps as the hash wants. A row's columns go in blocks, so both threads share one long row.
*/
#include <stdint.h>

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
