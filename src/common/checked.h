/*
 * checked.h: size arithmetic that reports overflow instead of wrapping, for host code that
 * multiplies a size it cannot bound by the descriptor (caller-given shapes, allocation sizes in
 * bytes). Each returns 1 and writes *out when the result fits in size_t, else 0 (out unchanged).
 */
#ifndef MOK_COMMON_CHECKED_H
#define MOK_COMMON_CHECKED_H

#include <stddef.h>
#include <stdint.h>

static inline int mok_mul_ok(size_t a, size_t b, size_t *out) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r)) return 0;
  *out = r;
  return 1;
}

/* n elements of elem_bytes each, n an int64 count (negative counts do not fit). */
static inline int mok_bytes_ok(int64_t n, size_t elem_bytes, size_t *out) {
  return n >= 0 && (uint64_t)n <= SIZE_MAX && mok_mul_ok((size_t)n, elem_bytes, out);
}

/* ceil(a / b) for a >= 0, b >= 1, without the overflow of (a + b - 1) / b near INT64_MAX. */
static inline int64_t mok_ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

#endif /* MOK_COMMON_CHECKED_H */
