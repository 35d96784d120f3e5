/*
 * rng.h: the tests' random numbers. Fixed seeds, integer arithmetic and exactly rounded
 * conversions, so every machine and compiler draws the same values; plain C11 that also compiles
 * as C++ (nvcc), header-only.
 *
 *   test_rng_t r = test_rng(0x9E3779B97F4A7C15ull);
 *   const float v = test_rng_sym_f(&r);    // [-1, 1)
 *
 * Two generators of Marsaglia's xorshift family: xorshift64 (shifts 13, 7, 17; the output is the
 * state) for every test, and xorshift64* (shifts 12, 25, 27; the output is the state times
 * 0x2545F4914F6CDD1D) for the reference problems of tests/ref_problem.c only, whose finite
 * differences and fp8 error bounds were measured on that stream. Neither is meant to be
 * statistically strong: they only have to be fixed, fast, and far from any pattern the kernels
 * could depend on.
 */
#ifndef MOK_TESTS_SUPPORT_RNG_H
#define MOK_TESTS_SUPPORT_RNG_H

#include <math.h>
#include <stdint.h>

typedef enum {
  TEST_RNG_XORSHIFT64 = 0,      /* the tests' generator */
  TEST_RNG_XORSHIFT64_STAR = 1  /* tests/ref_problem.c's */
} test_rng_kind_t;

typedef struct {
  uint64_t s; /* the state, never 0 */
  test_rng_kind_t kind;
} test_rng_t;

static inline test_rng_t test_rng(uint64_t seed) {
  test_rng_t r;
  r.s = seed;
  r.kind = TEST_RNG_XORSHIFT64;
  return r;
}

static inline test_rng_t test_rng_star(uint64_t seed) {
  test_rng_t r;
  r.s = seed;
  r.kind = TEST_RNG_XORSHIFT64_STAR;
  return r;
}

/* The next 64 random bits. */
static inline uint64_t test_rng_u64(test_rng_t *r) {
  uint64_t x = r->s;
  if (r->kind == TEST_RNG_XORSHIFT64_STAR) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    r->s = x;
    return x * 0x2545F4914F6CDD1Dull;
  }
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return r->s = x;
}

/* The high 32 bits of the next draw. */
static inline uint32_t test_rng_u32(test_rng_t *r) { return (uint32_t)(test_rng_u64(r) >> 32); }

/* An integer in [0, n), n > 0 (the draw modulo n: the bias is below n / 2^64). */
static inline uint64_t test_rng_below(test_rng_t *r, uint64_t n) { return test_rng_u64(r) % n; }

/* Uniform in [0, 1): the top 53 bits as a binary fraction (exact in a double). */
static inline double test_rng_uniform(test_rng_t *r) {
  return (double)(test_rng_u64(r) >> 11) * 0x1p-53;
}

/* Uniform in [-1, 1) on a 2^-52 grid, in double. */
static inline double test_rng_sym(test_rng_t *r) {
  return (double)(test_rng_u64(r) >> 11) * 0x1p-52 - 1.0;
}

/* Uniform in [-1, 1) on a 2^-23 grid, in float: the top 24 bits (exact in a float). */
static inline float test_rng_sym_f(test_rng_t *r) {
  return (float)((double)(test_rng_u64(r) >> 40) * 0x1p-23) - 1.0f;
}

/* N(0, 1), Box-Muller from two uniform draws (1 - u keeps the logarithm finite). */
static inline double test_rng_normal(test_rng_t *r) {
  const double u1 = test_rng_uniform(r), u2 = test_rng_uniform(r);
  return sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
}

#endif /* MOK_TESTS_SUPPORT_RNG_H */
