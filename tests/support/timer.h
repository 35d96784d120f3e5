/*
 * timer.h: wall time for the tests and tools, from the monotonic clock (never steps back when the
 * system clock is set). Plain C11 that also compiles as C++ (nvcc), header-only.
 *
 * C files need clock_gettime declared: define _POSIX_C_SOURCE 200809L before their first #include
 * (C++ compilers declare it by default).
 */
#ifndef MOK_TESTS_SUPPORT_TIMER_H
#define MOK_TESTS_SUPPORT_TIMER_H

#include <time.h>

#if !defined(__cplusplus) && (!defined(_POSIX_C_SOURCE) || _POSIX_C_SOURCE < 199309L)
#error "timer.h needs clock_gettime: define _POSIX_C_SOURCE 200809L before the first #include"
#endif

/* Seconds since an arbitrary fixed point (CLOCK_MONOTONIC). */
static inline double test_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif /* MOK_TESTS_SUPPORT_TIMER_H */
