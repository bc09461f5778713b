/* A row's largest value, as torch.max's indices pick it: shared by the greedy pick
   (cpu_pointwise.c) and the seeded draw (cpu_noise.c). */
#ifndef FANOUT_CPU_ROW_H
#define FANOUT_CPU_ROW_H

#include <math.h>
#include <stdint.h>

/* The column of r[0..n)'s largest value (n >= 1): the first of equal ones, and a NaN counts as
   the largest (the first NaN; *nan set then, else cleared). One vectorized pass for the max,
   a second that stops at it. The max is one of the row's values, or -inf where all are: GCC
   starts a max reduction at -inf. One that starts at -FLT_MAX finds no column equal to it in a
   row of -infs only; the scan stops at the last column and takes 0, as torch does. */
static inline int64_t first_max(const float *r, int64_t n, int *nan) {
    float mx = -INFINITY;
    int any = 0;
#pragma omp simd reduction(max : mx) reduction(| : any)
    for (int64_t j = 0; j < n; j++) {
        mx = r[j] > mx ? r[j] : mx;
        any |= r[j] != r[j];
    }
    *nan = any;
    int64_t j = 0;
    if (any)
        while (j < n - 1 && r[j] == r[j]) j++;
    else
        while (j < n - 1 && r[j] != mx) j++;
    return any || r[j] == mx ? j : 0;
}

#endif
