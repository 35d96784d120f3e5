/*
 * compare.h: comparing results with their reference, and reading poisoned buffers back. Plain C11
 * that also compiles as C++ (nvcc), header-only.
 *
 * The elementwise tolerance of DESIGN.md section 7 (docs/design.md, "Testing"):
 *     |got - ref| <= atol + rtol (|ref| + M)        results rounded to bf16 after their sum
 *     |got - ref| <= atol + rtol max(|ref|, M)      fp32 results
 * with rtol = 2^-7, atol = 2^-7 rms(ref - start), start being what the result started from
 * (accumulated weight gradients; NULL: 0), so that atol scales with what one call computes, and M
 * the magnitude of the sum behind the element, Σ |term| over its outermost sum
 * (tests/support/magnitude.h; not given: 0, today's bound atol + rtol |ref|). Why: the two sides
 * legitimately differ where a bf16 value inside the sum rounds one ulp apart (fp32 against fp64
 * sums straddling a rounding boundary), and one ulp of v is at most 2^-7 |v|, so the flips move
 * the sum by at most 2^-7 of its terms' magnitudes, 2^-7 M, which is far more than 2^-7 |ref|
 * where the terms cancel; a result rounded to bf16 then rounds apart by at most one ulp of its
 * own, 2^-7 |ref| more (a one-term sum whose factor flips lands 2 ulps apart). Where nothing
 * cancels M = |ref|. Why it holds for each result is stated where it is used
 * (tests/gpu/forward_test_util.cuh, backward_test_util.cuh, test_forward.cu); the worst element
 * is reported with its ratio to its bound. A NaN on either side is always beyond.
 *
 * Poison: outputs are filled with a byte pattern before a run (0xFF: a NaN in bf16 and fp32) so
 * that an element the run did not write shows; test_bytes_not counts what changed in a buffer
 * that must stay untouched.
 */
#ifndef MOK_TESTS_SUPPORT_COMPARE_H
#define MOK_TESTS_SUPPORT_COMPARE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
  double atol, rtol;
  int fp32; /* 1: the result is fp32 (not rounded to bf16 after its sum) */
} test_tol_t;

/* The bound above for the n elements of ref (and start, when not NULL), rounded to bf16. */
static inline test_tol_t test_tol_rms(const double *ref, const double *start, int64_t n) {
  double ss = 0;
  for (int64_t i = 0; i < n; i++) {
    const double v = ref[i] - (start ? start[i] : 0.0);
    ss += v * v;
  }
  test_tol_t t;
  t.rtol = 1.0 / 128;
  t.atol = t.rtol * sqrt(ss / (double)(n > 0 ? n : 1));
  t.fp32 = 0;
  return t;
}

/* |got - ref|'s limit at ref, for a sum of magnitude mag (0: none known). A NaN ref may leave
 * the limit finite, and |got - NaN| is beyond any limit. */
static inline double test_tol_allowed(test_tol_t t, double ref, double mag) {
  return t.atol + t.rtol * (t.fp32 ? fmax(fabs(ref), mag) : fabs(ref) + mag);
}

typedef struct {
  int64_t bad;        /* elements beyond their bound; a NaN on either side is always beyond */
  int64_t worst;      /* the element of the largest |got - ref| / bound, the first NaN if any;
                         -1 when there are no elements */
  double worst_ratio; /* its ratio (0 where ref's bound is 0 and got equals it); NaN when a
                         ratio was (an infinite ref and a finite got are within an infinite
                         bound, but not equal) */
} test_cmp_t;

/* Every element within its bound, and no ratio NaN. */
static inline int test_cmp_ok(test_cmp_t c) {
  return c.bad == 0 && c.worst_ratio == c.worst_ratio;
}

/* got against ref, n elements, with their magnitudes mag (NULL: none). */
static inline test_cmp_t test_compare(const double *got, const double *ref, const double *mag,
                                      int64_t n, test_tol_t t) {
  test_cmp_t c;
  c.bad = 0;
  c.worst = -1;
  c.worst_ratio = -1;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs(got[i] - ref[i]);
    const double bound = test_tol_allowed(t, ref[i], mag ? mag[i] : 0.0);
    if (!(d <= bound)) c.bad++;
    const double ratio = d <= bound && bound == 0 ? 0.0 : d / bound;
    const int nan_seen = c.worst >= 0 && c.worst_ratio != c.worst_ratio;
    if (!nan_seen && !(ratio <= c.worst_ratio)) c.worst_ratio = ratio, c.worst = i;
  }
  return c;
}

/* test_compare, with the worst element printed as "what: name worst [row][col]" (cols elements a
 * row) with its magnitude M when given. test_cmp_ok of the comparison. */
static inline int test_compare_report(const char *what, const char *name, const double *got,
                                      const double *ref, const double *mag, int64_t n,
                                      int64_t cols, test_tol_t t) {
  const test_cmp_t c = test_compare(got, ref, mag, n, t);
  if (cols < 1) cols = 1;
  if (c.worst >= 0) {
    const int64_t w = c.worst;
    char m[40] = "";
    if (mag) snprintf(m, sizeof(m), " M %.3g", mag[w]);
    printf("    %s: %s worst [%lld][%lld]: got %.6g ref %.6g%s |diff| %.3g = %.3f of its bound "
           "(atol %.3g); %lld beyond\n",
           what, name, (long long)(w / cols), (long long)(w % cols), got[w], ref[w], m,
           fabs(got[w] - ref[w]), c.worst_ratio, t.atol, (long long)c.bad);
  }
  return test_cmp_ok(c);
}

/* Bytes of p[0, n) other than `byte`. */
static inline size_t test_bytes_not(const void *p, size_t n, unsigned char byte) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) k += ((const unsigned char *)p)[i] != byte;
  return k;
}

/* Index of the first byte where a and b differ, -1 when they are equal. */
static inline int64_t test_first_diff(const void *a, const void *b, size_t n) {
  const unsigned char *x = (const unsigned char *)a, *y = (const unsigned char *)b;
  for (size_t i = 0; i < n; i++)
    if (x[i] != y[i]) return (int64_t)i;
  return -1;
}

#endif /* MOK_TESTS_SUPPORT_COMPARE_H */
