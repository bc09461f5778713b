/* y = x W^T on a CPU in fp32: every matmul of a model's forward (cpu_linear.py says why).

W is packed once into panels of NR output columns, k-major: panel p holds W[p*NR + j, k] at
[p][k][j] (the last panel zero-padded). A task is one panel: its K x NR weights are read from
memory and, while they sit in L2, multiplied with every row of a pass of x (a decode step's
rows are one pass), MR rows at a time: at each k, a broadcast of x[m, k] times the panel's NV
vectors into MR x NV accumulators held in registers, the weights a few KB ahead prefetched
into L2 (the first rows read them from memory).

Every output sums its K products in k order, one FMA at a time: the same order for a row
whatever the batch around it, so a request's logits do not depend on its batch-mates.
The register tile follows the vector width of the target (cpu_vector.h; fanout_linear_nr()
tells the packer).
Tasks are spread over torch's own OpenMP threads (loaded after torch: one libgomp).
*/
#include "cpu_tile.h"

int64_t fanout_linear_nr(void) { return NR; }

/* One task's rows m0 .. m0 + mr of its NR columns (nc of them real): y = x W^T (+ bias) from
   the panel w, or, given the up panel wu beside the gate panel w, y = silu(x Wg^T) * (x Wu^T)
   (the MLP's first half, with no [M, 2N] product in between). */
static void rows_out(int mr, const float *x, int64_t ldx, const float *w, const float *wu,
                     int64_t K, const float *bias, float *y, int64_t ldy, int64_t nc) {
    float t[MR][NR] = {{0}}, u[MR][NR] = {{0}};
    tile_rows(mr, x, ldx, w, K, t);
    if (wu)
        tile_rows(mr, x, ldx, wu, K, u);
    tile_out(mr, t, wu ? u : NULL, bias, y, ldy, nc);
}

/* Every task: panel p of the weight (gate_up: gate panel p then up panel p) with every pass of
   rows. */
static void run(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panels, int gate_up,
                int64_t N, const float *bias, float *y, int64_t ldy) {
    const int64_t P = (N + NR - 1) / NR, R = pass_rows(K), step = (gate_up ? 2 : 1) * K * NR;
#pragma omp parallel
    for (int64_t r0 = 0; r0 < M; r0 += R)
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const int64_t c0 = p * NR, nc = N - c0 < NR ? N - c0 : NR, end = r0 + R < M ? r0 + R : M;
        const float *w = panels + p * step;
        for (int64_t m0 = r0; m0 < end; m0 += MR)
            rows_out(end - m0 < MR ? (int)(end - m0) : MR, x + m0 * ldx, ldx, w,
                     gate_up ? w + K * NR : NULL, K, bias ? bias + c0 : NULL, y + m0 * ldy + c0,
                     ldy, nc);
    }
}

/* x [M, K] (row stride ldx), panels [ceil(N / NR), K, NR], bias [N] or NULL, y [M, N] (row
   stride ldy). */
void fanout_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panels,
                   int64_t N, const float *bias, float *y, int64_t ldy) {
    run(x, M, K, ldx, panels, 0, N, bias, y, ldy);
}

/* y = silu(x Wg^T) * (x Wu^T), y [M, N]. panels interleaves the two weights' panels, gate p
   then up p ([2 * ceil(N / NR), K, NR]), so a task reads both from one run and writes its NR
   columns of y once. */
void fanout_linear_silu_mul(const float *x, int64_t M, int64_t K, int64_t ldx,
                            const float *panels, int64_t N, float *y, int64_t ldy) {
    run(x, M, K, ldx, panels, 1, N, NULL, y, ldy);
}
