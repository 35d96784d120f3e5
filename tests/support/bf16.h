/*
 * bf16.h: bf16 values in the tests, and the bits of fp32 ones. Rounding to bf16 is the library's
 * own (src/cpu/quant.c: round to nearest even, NaN kept a NaN), so an expected value rounds
 * exactly as the reference does; widening is exact (the 16 bits shifted into a float), inline for
 * the tests' inner loops. Plain C11 that also compiles as C++ (nvcc), header-only; links with the
 * library's objects.
 */
#ifndef MOK_TESTS_SUPPORT_BF16_H
#define MOK_TESTS_SUPPORT_BF16_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "rng.h"

#ifdef __cplusplus
extern "C" {
#endif
#include "cpu/quant.h" /* plain C header without its own extern "C" */
#ifdef __cplusplus
}
#endif

/* The bits of an fp32 value, and the fp32 value of bits (bf16 is their top half). */
static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static inline float f32_of_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* bf16(f), round to nearest even. */
static inline uint16_t f2bf(float f) { return mok_bf16_from_float(f); }

/* The value of bf16 bits h (exact). */
static inline float bf2f(uint16_t h) { return f32_of_bits((uint32_t)h << 16); }

/* One bf16 ulp at v (v a bf16 value; 0 for 0): 2^(e - 8) for |v| in [2^(e-1), 2^e). */
static inline double bf16_ulp(double v) {
  if (v == 0) return 0;
  int e;
  frexp(fabs(v), &e);
  return ldexp(1.0, e - 1 - 7);
}

/* p[0 .. n) = bf16(scale * u), u uniform in [-1, 1) (test_rng_sym_f), scale and product in fp32. */
static inline void bf16_fill(uint16_t *p, size_t n, float scale, test_rng_t *r) {
  for (size_t i = 0; i < n; i++) p[i] = f2bf(scale * test_rng_sym_f(r));
}

#endif /* MOK_TESTS_SUPPORT_BF16_H */
