/* A recorded decode forward replayed in one call (cpu_graph.py says why): the C kernels it
called, in order, each with the arguments it was given.

Every kernel is called through one wide prototype: MAX_INTS int64 arguments, then MAX_FLOATS
floats. On the ABIs this runs on (x86-64 System V and AArch64's AAPCS64, Linux; cpu_graph.py
checks) integer and float arguments take separate registers in order and spill to 8-byte stack
slots in order, so a callee that declares fewer of either (or narrower ints: an `int` reads the
low half of its slot) reads exactly the arguments it was recorded with, and the caller pops the
rest. No kernel returns a value that the forward reads (cpu_graph.py records void ones only).
*/
#include <stdint.h>
#include <time.h>

#define MAX_INTS 24
#define MAX_FLOATS 4

typedef struct {
    void *fn;
    int64_t i[MAX_INTS];
    float f[MAX_FLOATS];
} fanout_call;

typedef void (*wide)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                     int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                     int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                     float, float, float, float);

int64_t fanout_replay_max_ints(void) { return MAX_INTS; }
int64_t fanout_replay_max_floats(void) { return MAX_FLOATS; }

static inline void call(const fanout_call *c) {
    const int64_t *a = c->i;
    const float *f = c->f;
    ((wide)c->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                  a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], f[0],
                  f[1], f[2], f[3]);
}

void fanout_replay(const fanout_call *calls, int64_t n) {
    for (int64_t c = 0; c < n; c++) call(calls + c);
}

/* The same, each call's wall seconds added to seconds[c]: where a step's time goes, by kernel
   (bench/replay_calls.py) */
void fanout_replay_timed(const fanout_call *calls, int64_t n, double *seconds) {
    struct timespec t0, t1;
    for (int64_t c = 0; c < n; c++) {
        clock_gettime(CLOCK_MONOTONIC, &t0);
        call(calls + c);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        seconds[c] += (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
}
