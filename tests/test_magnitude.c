/*
 * test_magnitude.c: the magnitude model of tests/support/magnitude.h (the M of compare.h's
 * cancellation-aware bound) against the reference layer in exact (fp64) mode, where every output
 * is exactly the outermost sum the model takes the magnitude of: with random signs |output| <= M
 * everywhere (the triangle inequality), and with every input positive (nothing cancels) |output|
 * = M, which pins the model's terms to the reference's formulas and layouts. To rounding noise
 * of fp64 only (2^-40 relative). The normal mode's bf16 roundings are left out on purpose: the
 * GPU and CPU layers share them up to one-ulp flips, which is what M bounds. And compare.h's
 * bound widens with M in its two forms, is today's for M = 0, and still fails a NaN.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_problem.h"
#include "support/bf16.h"
#include "support/compare.h"
#include "support/magnitude.h"
#include "test.h"

enum { MAG_NOUT = 9 }; /* y, dx, dtopk_w, dwg, dwu, dwd, dwsg, dwsu, dwsd */
static const char *const mag_name[MAG_NOUT] = {"y",   "dx",   "dtopk_w", "dwg", "dwu",
                                               "dwd", "dwsg", "dwsu",    "dwsd"};

/* fp64 rounding noise of the reference's and the model's sums (a few hundred terms each). */
#define MAG_FP64_NOISE 0x1p-40

/* H = 256 != I = 128 (a transposed index reads other values), E = 5 with expert 4 unused (its
 * gradients and M are 0), K = 3 with empty slots, a shared expert, 24 tokens. */
static int mag_problem(ref_problem_t *p) {
  return ref_problem_init(p, 256, 128, 128, 5, 3, 24, 7, 0.2, 4);
}

/* bf16 bits of n bf16 values. NULL when out of memory. */
static uint16_t *mag_bits(const double *v, int64_t n) {
  uint16_t *b = (uint16_t *)malloc((size_t)(n + 1) * sizeof(uint16_t));
  if (b)
    for (int64_t i = 0; i < n; i++) b[i] = f2bf((float)v[i]);
  return b;
}

/* The reference in exact mode on p (*ref) and the model's magnitudes (mag[MAG_NOUT], allocated;
 * free each). MOK_SUCCESS or the failure. */
static mokResult_t mag_run(const ref_problem_t *p, ref_result_t *ref, double *mag[MAG_NOUT],
                           int64_t n[MAG_NOUT]) {
  const int64_t T = p->N, H = p->H, I = p->I, E = p->E, K = p->K, Is = p->Is;
  const int64_t sizes[MAG_NOUT] = {T * H, T * H, T * K, E * I * H, E * I * H, E * H * I,
                                   Is * H, Is * H, H * Is};
  ref_run_t run = ref_run_default(p);
  run.exact = 1;
  char err[256];
  mokResult_t r = ref_run(p, &run, ref, err);
  if (r != MOK_SUCCESS) {
    printf("    reference: %s\n", err);
    return r;
  }
  r = MOK_ERROR_OUT_OF_MEMORY;
  float *tw = (float *)malloc((size_t)(T * K + 1) * sizeof(float));
  uint16_t *b[8] = {mag_bits(p->x, T * H),      mag_bits(p->dy, T * H),
                    mag_bits(p->wg, E * I * H), mag_bits(p->wu, E * I * H),
                    mag_bits(p->wd, E * H * I), mag_bits(p->wsg, Is * H),
                    mag_bits(p->wsu, Is * H),   mag_bits(p->wsd, H * Is)};
  int ok = tw != NULL;
  for (int j = 0; j < 8; j++) ok &= b[j] != NULL;
  for (int j = 0; j < MAG_NOUT; j++) {
    n[j] = sizes[j];
    mag[j] = (double *)malloc((size_t)(sizes[j] + 1) * sizeof(double));
    ok &= mag[j] != NULL;
  }
  if (ok) {
    for (int64_t i = 0; i < T * K; i++) tw[i] = (float)p->tw[i];
    const test_mag_in_t in = {T, H, I, E, K, Is, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
                              p->idx, tw};
    const test_mag_out_t o = {mag[0], mag[1], mag[2], mag[3], mag[4],
                              mag[5], mag[6], mag[7], mag[8]};
    if (test_magnitudes(&in, &o)) r = MOK_SUCCESS;
  }
  free(tw);
  for (int j = 0; j < 8; j++) free(b[j]);
  return r;
}

/* Checks |ref| against M on every output: |ref| <= M (positive = 0) or ||ref| - M| <= noise
 * (positive = 1), both to MAG_FP64_NOISE of M. Prints each output's worst |ref| / M. */
static void mag_check(const ref_problem_t *p, int positive) {
  ref_result_t ref;
  double *mag[MAG_NOUT] = {NULL};
  int64_t n[MAG_NOUT];
  const mokResult_t r = mag_run(p, &ref, mag, n);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "reference or magnitudes failed: %d", (int)r);
  if (r == MOK_SUCCESS) {
    const double *out[MAG_NOUT] = {ref.y,   ref.dx,   ref.dtw,  ref.dwg, ref.dwu,
                                   ref.dwd, ref.dwsg, ref.dwsu, ref.dwsd};
    for (int j = 0; j < MAG_NOUT; j++) {
      int64_t bad = 0, zero = 0;
      double lo = INFINITY, hi = 0;
      for (int64_t i = 0; i < n[j]; i++) {
        const double v = fabs(out[j][i]), m = mag[j][i];
        const double d = positive ? fabs(v - m) : v - m;
        if (!(d <= MAG_FP64_NOISE * m)) bad++;
        if (m == 0) {
          zero++;
          continue;
        }
        lo = fmin(lo, v / m), hi = fmax(hi, v / m);
      }
      printf("    %s: |ref| / M in [%.6f, %.6f], %lld elements of M = 0\n", mag_name[j], lo,
             hi, (long long)zero);
      MOK_EXPECT_MSG(bad == 0, "%s: %lld elements with |ref| %s M (beyond 2^-40 M)", mag_name[j],
                     (long long)bad, positive ? "!=" : ">");
    }
    ref_result_free(&ref);
  }
  for (int j = 0; j < MAG_NOUT; j++) free(mag[j]);
}

MOK_TEST(magnitude_bounds_exact_reference) {
  ref_problem_t p;
  MOK_REQUIRE(mag_problem(&p));
  mag_check(&p, 0);
  ref_problem_free(&p);
}

MOK_TEST(magnitude_equals_exact_reference_without_cancellation) {
  ref_problem_t p;
  MOK_REQUIRE(mag_problem(&p));
  double *const v[8] = {p.x, p.dy, p.wg, p.wu, p.wd, p.wsg, p.wsu, p.wsd};
  const int64_t T = p.N, H = p.H, I = p.I, E = p.E, Is = p.Is;
  const int64_t n[8] = {T * H, T * H, E * I * H, E * I * H, E * H * I, Is * H, Is * H, H * Is};
  for (int j = 0; j < 8; j++) /* |v|: then g, u, s, a, ds, dg, du and every term are > 0 */
    for (int64_t i = 0; i < n[j]; i++) v[j][i] = fabs(v[j][i]);
  mag_check(&p, 1);
  ref_problem_free(&p);
}

/* 1 when got is within compare.h's bound at ref with magnitude mag (atol 2^-10, rtol 2^-7). */
static int mag_within(double got, double ref, double mag, int fp32) {
  const test_tol_t t = {1.0 / 1024, 1.0 / 128, fp32};
  return test_compare(&got, &ref, &mag, 1, t).bad == 0;
}

/* compare.h's bound with magnitudes: a large M admits a large difference, but never a NaN; M = 0
 * gives today's bound atol + rtol |ref| in both forms. */
MOK_TEST(magnitude_bound_widens_but_fails_nan) {
  /* bf16 results: atol + rtol (|ref| + M) = 2^-10 + 2^-7 (0.5 + 1) = 0.01270 */
  MOK_EXPECT(mag_within(0.5 + 0.0126, 0.5, 1.0, 0) && !mag_within(0.5 + 0.0128, 0.5, 1.0, 0));
  /* fp32 results: atol + rtol max(|ref|, M) = 2^-10 + 2^-7 1 = 0.00879 */
  MOK_EXPECT(mag_within(0.5 - 0.0087, 0.5, 1.0, 1) && !mag_within(0.5 - 0.0089, 0.5, 1.0, 1));
  /* M = 0: 2^-10 + 2^-7 0.5 = 0.00488 */
  for (int fp32 = 0; fp32 < 2; fp32++) {
    MOK_EXPECT(mag_within(0.5 + 0.0048, 0.5, 0.0, fp32));
    MOK_EXPECT(!mag_within(0.5 + 0.0050, 0.5, 0.0, fp32));
    MOK_EXPECT(!mag_within(NAN, 0.5, 1e30, fp32) && !mag_within(0.5, NAN, 1e30, fp32));
    const double got[3] = {0.5, 0.5 + 0.02, NAN}, ref[3] = {0.5, 0.5, 0.5}, mag[3] = {1, 1, 1};
    const test_tol_t t = {1.0 / 1024, 1.0 / 128, fp32};
    const test_cmp_t c = test_compare(got, ref, mag, 3, t);
    MOK_EXPECT_MSG(c.bad == 2 && c.worst == 2 && !test_cmp_ok(c), "the NaN: beyond, the worst");
  }
}
