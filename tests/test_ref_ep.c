/*
 * test_ref_ep.c: properties of the reference in normal (rounded) mode that must hold bitwise:
 * EP-invariance (W ranks give the same y, dx, dtopk_w and routed weight gradients as 1 rank
 * holding all tokens in rank order), saved context vs recompute, and run-to-run determinism.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/quant.h"
#include "ref_problem.h"
#include "test.h"

/* Expects a[n] == b[n] bitwise; names the first differing element. */
static void expect_bitwise(const char *what, const double *a, const double *b, int64_t n) {
  int64_t i = ref_first_diff(a, b, n);
  MOK_EXPECT_MSG(i < 0, "%s differs at %lld: %.17g vs %.17g", what, (long long)i,
                 i >= 0 ? a[i] : 0.0, i >= 0 ? b[i] : 0.0);
}

/* Two runs' y, dx, dtopk_w and routed weight gradients bitwise equal, and with shared_elems > 0
 * their shared-expert weight gradients ([shared_elems] each) too. */
static void expect_results_bitwise(const ref_problem_t *p, const ref_result_t *a,
                                   const ref_result_t *b, int64_t shared_elems) {
  const int64_t NH = p->N * p->H, RW = ref_routed_w_elems(p);
  expect_bitwise("y", a->y, b->y, NH);
  expect_bitwise("dx", a->dx, b->dx, NH);
  expect_bitwise("dtopk_w", a->dtw, b->dtw, p->N * p->K);
  expect_bitwise("dwg", a->dwg, b->dwg, RW);
  expect_bitwise("dwu", a->dwu, b->dwu, RW);
  expect_bitwise("dwd", a->dwd, b->dwd, RW);
  if (shared_elems > 0) {
    expect_bitwise("dwsg", a->dwsg, b->dwsg, shared_elems);
    expect_bitwise("dwsu", a->dwsu, b->dwsu, shared_elems);
    expect_bitwise("dwsd", a->dwsd, b->dwsd, shared_elems);
  }
}

/* A result where every output that should have been written was (no fill value left over). */
static int all_finite(const double *a, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (!isfinite(a[i])) return 0;
  }
  return 1;
}

/* |sum over ranks of per-rank shared gradients - 1-rank gradient| within fp32 accumulation error.
 * Both are fp32 sums of the same N per-token terms, split at different points: a recursive fp32
 * sum of n terms is within (n - 1) * 2^-24 * sum|term| of the exact sum (first order), so the two
 * are within 2 * N * 2^-24 * sum|term|. sum|term| per element is the sum over tokens of |that
 * token's own contribution|, measured by running each token alone (one term: an exact fp32
 * product, rounded once). */
static void expect_shared_sum(const ref_problem_t *p, const ref_run_t *run, const ref_result_t *one,
                              const ref_result_t *many, const double *abs_terms[3]) {
  const int64_t SW = ref_shared_w_elems(p);
  const double *m1[3] = {one->dwsg, one->dwsu, one->dwsd};
  const double *mw[3] = {many->dwsg, many->dwsu, many->dwsd};
  const char *names[3] = {"dwsg", "dwsu", "dwsd"};
  int bad = 0, exact = 0;
  for (int m = 0; m < 3; m++) {
    for (int64_t i = 0; i < SW; i++) {
      double sum = 0.0;
      for (int r = 0; r < run->W; r++) sum += mw[m][r * SW + i];
      const double tol = 2.0 * (double)p->N * 0x1p-24 * abs_terms[m][i];
      exact += sum == m1[m][i];
      if (!(fabs(sum - m1[m][i]) <= tol) && bad++ < 3) {
        mok_test_fail(__FILE__, __LINE__,
                      "W=%d %s[%lld]: sum over ranks %.9g, 1 rank %.9g, tol %.3g", run->W,
                      names[m], (long long)i, sum, m1[m][i], tol);
      }
    }
  }
  /* Most elements agree exactly; the tolerance covers those whose fp32 sum rounds differently. */
  MOK_EXPECT(exact > 0);
}

/* sum over tokens of |each token's own shared weight gradient|, [3][Is * H] into abs_terms. */
static int shared_abs_terms(const ref_problem_t *p, ref_run_t base, double *abs_terms[3]) {
  const int64_t SW = ref_shared_w_elems(p);
  for (int m = 0; m < 3; m++) memset(abs_terms[m], 0, (size_t)SW * sizeof(double));
  for (int64_t t = 0; t < p->N; t++) {
    ref_problem_t one = *p; /* token t alone: the arrays point into p's */
    one.N = 1;
    one.x = p->x + t * p->H;
    one.dy = p->dy + t * p->H;
    one.idx = p->idx + t * p->K;
    one.tw = p->tw + t * p->K;
    ref_run_t run = base;
    run.W = 1;
    run.T[0] = 1;
    ref_result_t r;
    char err[256];
    if (ref_run(&one, &run, &r, err) != MOK_SUCCESS) return 0;
    const double *g[3] = {r.dwsg, r.dwsu, r.dwsd};
    for (int m = 0; m < 3; m++) {
      for (int64_t i = 0; i < SW; i++) abs_terms[m][i] += fabs(g[m][i]);
    }
    ref_result_free(&r);
  }
  return 1;
}

/* Runs p on W = 1 (tile_m 1) and on each split in `splits`, comparing bitwise. */
static void check_ep(const ref_problem_t *p, mok_precision_t prec, mok_fp8_scale_t scale,
                     const ref_run_t *splits, int nsplits) {
  ref_run_t base = ref_run_default(p);
  base.precision = prec;
  base.fp8_scale = scale;
  base.fill = NAN;
  ref_result_t one;
  char err[256];
  mokResult_t rc = ref_run(p, &base, &one, err);
  MOK_REQUIRE_MSG(rc == MOK_SUCCESS, "W=1: %d %s", (int)rc, err);
  const int64_t NH = p->N * p->H, NK = p->N * p->K, RW = ref_routed_w_elems(p);
  int64_t SW = ref_shared_w_elems(p);
  MOK_EXPECT(all_finite(one.y, NH) && all_finite(one.dx, NH) && all_finite(one.dtw, NK));
  MOK_EXPECT(all_finite(one.dwg, RW) && all_finite(one.dwu, RW) && all_finite(one.dwd, RW));

  double *abs_buf = malloc((size_t)(3 * SW + 1) * sizeof(double)); /* [3, Is * H] */
  double *abs_terms[3] = {abs_buf, abs_buf + SW, abs_buf + 2 * SW};
  MOK_REQUIRE(abs_buf);
  if (p->Is > 0 && !shared_abs_terms(p, base, abs_terms)) {
    mok_test_fail(__FILE__, __LINE__, "single-token runs failed");
    SW = 0; /* skip the shared comparisons below */
  }

  for (int s = 0; s < nsplits; s++) {
    ref_run_t run = splits[s];
    run.precision = prec;
    run.fp8_scale = scale;
    run.backward = 1;
    run.fill = NAN;
    ref_result_t many;
    rc = ref_run(p, &run, &many, err);
    MOK_REQUIRE_MSG(rc == MOK_SUCCESS, "W=%d: %d %s", run.W, (int)rc, err);
    expect_results_bitwise(p, &one, &many, 0);  /* shared gradients: summed over ranks, below */
    if (SW > 0) {
      MOK_EXPECT(all_finite(many.dwsg, run.W * SW) && all_finite(many.dwsd, run.W * SW));
      expect_shared_sum(p, &run, &one, &many, (const double **)abs_terms);
    }
    ref_result_free(&many);
  }
  free(abs_buf);
  ref_result_free(&one);
}

/* W = 1 with another tile_m; W = 2 and W = 4 with uneven token counts, T = 0 on one rank. */
static int standard_splits(ref_run_t *s, const ref_problem_t *p) {
  if (p->N != 16) return 0; /* the splits are written for N = 16 */
  s[0] = ref_run_default(p);
  s[0].tile_m = 7;
  s[1] = ref_run_default(p);
  s[1].W = 2, s[1].T[0] = 9, s[1].T[1] = 7, s[1].tile_m = 4;
  s[2] = ref_run_default(p);
  s[2].W = 4, s[2].T[0] = 7, s[2].T[1] = 0, s[2].T[2] = 5, s[2].T[3] = 4, s[2].tile_m = 128;
  s[3] = ref_run_default(p);
  s[3].W = 2, s[3].T[0] = 0, s[3].T[1] = 16, s[3].tile_m = 3;
  return 4;
}

/* H = 144 and I = 80 hold a partial 128-block and partial 32-blocks; expert 5 gets no row. */
static void ep_case(mok_precision_t prec, mok_fp8_scale_t scale) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 144, 80, 48, 8, 3, 16, 21, 0.2, 5));
  ref_run_t splits[4];
  int n = standard_splits(splits, &p);
  MOK_EXPECT(n == 4);
  check_ep(&p, prec, scale, splits, n);
  ref_problem_free(&p);
}

MOK_TEST(ref_ep_invariant_bf16) { ep_case(MOK_PRECISION_BF16, MOK_FP8_SCALE_FP32); }
MOK_TEST(ref_ep_invariant_fp8_block) { ep_case(MOK_PRECISION_FP8_BLOCK, MOK_FP8_SCALE_FP32); }
MOK_TEST(ref_ep_invariant_fp8_block_pow2) { ep_case(MOK_PRECISION_FP8_BLOCK, MOK_FP8_SCALE_POW2); }
MOK_TEST(ref_ep_invariant_mxfp8) { ep_case(MOK_PRECISION_MXFP8, MOK_FP8_SCALE_FP32); }

/* K = 1, no shared expert, E = 4 over up to 4 ranks (one expert per rank). */
MOK_TEST(ref_ep_invariant_k1_no_shared) {
  mok_precision_t precs[3] = {MOK_PRECISION_BF16, MOK_PRECISION_FP8_BLOCK, MOK_PRECISION_MXFP8};
  for (int i = 0; i < 3; i++) {
    ref_problem_t p;
    MOK_REQUIRE(ref_problem_init(&p, 64, 48, 0, 4, 1, 16, 31 + i, 0.15, 2));
    ref_run_t splits[4];
    int n = standard_splits(splits, &p);
    MOK_EXPECT(n == 4);
    check_ep(&p, precs[i], MOK_FP8_SCALE_FP32, splits, n);
    ref_problem_free(&p);
  }
}

/* The unused expert really is empty: its weight gradients are zero, and the test data has empty
 * slots and a token with every slot empty. */
MOK_TEST(ref_ep_empty_expert_has_zero_gradient) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 144, 80, 48, 8, 3, 16, 21, 0.2, 5));
  p.idx[3 * p.K + 0] = p.idx[3 * p.K + 1] = p.idx[3 * p.K + 2] = -1;
  ref_run_t run = ref_run_default(&p);
  run.W = 2, run.T[0] = 9, run.T[1] = 7;
  ref_result_t r;
  char err[256];
  MOK_REQUIRE(ref_run(&p, &run, &r, err) == MOK_SUCCESS);
  const int64_t M = p.I * p.H;
  int zero = 1, nonzero = 0;
  for (int64_t i = 0; i < M; i++) {
    zero = zero && r.dwg[5 * M + i] == 0.0 && r.dwu[5 * M + i] == 0.0 && r.dwd[5 * M + i] == 0.0;
    nonzero += r.dwg[4 * M + i] != 0.0;
  }
  MOK_EXPECT(zero);
  MOK_EXPECT(nonzero > M / 2);
  /* Token 3 has no routed slot: its router gradients are 0. */
  for (int64_t k = 0; k < p.K; k++) MOK_EXPECT(r.dtw[3 * p.K + k] == 0.0);
  ref_result_free(&r);
  ref_problem_free(&p);
}

/* Backward from the saved bf16 g, u equals backward that recomputes them, bitwise; forward gives
 * the same y whether or not it saves. */
MOK_TEST(ref_saved_context_matches_recompute) {
  mok_precision_t precs[3] = {MOK_PRECISION_BF16, MOK_PRECISION_FP8_BLOCK, MOK_PRECISION_MXFP8};
  for (int i = 0; i < 3; i++) {
    ref_problem_t p;
    MOK_REQUIRE(ref_problem_init(&p, 144, 80, 48, 8, 3, 16, 41 + i, 0.2, -1));
    ref_run_t run = ref_run_default(&p);
    run.precision = precs[i];
    run.W = 2, run.T[0] = 10, run.T[1] = 6, run.tile_m = 5;
    ref_result_t a, b;
    char err[256];
    run.save = 1;
    MOK_REQUIRE(ref_run(&p, &run, &a, err) == MOK_SUCCESS);
    run.save = 0;
    MOK_REQUIRE(ref_run(&p, &run, &b, err) == MOK_SUCCESS);
    expect_results_bitwise(&p, &a, &b, 2 * ref_shared_w_elems(&p)); /* one copy per rank */
    /* The saved g, u are bf16 values, written for every non-empty slot. */
    int ok = 1;
    for (int64_t s = 0; s < p.N * p.K; s++) {
      if (p.idx[s] < 0) continue;
      for (int64_t j = 0; j < p.I; j++) {
        double g = a.g[s * p.I + j];
        ok = ok && isfinite(g) && mok_round_bf16(g) == g;
      }
    }
    MOK_EXPECT(ok);
    ref_result_free(&a);
    ref_result_free(&b);
    ref_problem_free(&p);
  }
}

/* Two runs give the same bits, whatever the output buffers held before (NaN vs 0 fill). */
MOK_TEST(ref_runs_are_deterministic) {
  mok_precision_t precs[3] = {MOK_PRECISION_BF16, MOK_PRECISION_FP8_BLOCK, MOK_PRECISION_MXFP8};
  for (int i = 0; i < 3; i++) {
    ref_problem_t p;
    MOK_REQUIRE(ref_problem_init(&p, 144, 80, 48, 8, 3, 16, 51 + i, 0.2, -1));
    ref_run_t run = ref_run_default(&p);
    run.precision = precs[i];
    run.W = 4, run.T[0] = 3, run.T[1] = 6, run.T[2] = 0, run.T[3] = 7, run.tile_m = 2;
    ref_result_t a, b;
    char err[256];
    run.fill = NAN;
    MOK_REQUIRE(ref_run(&p, &run, &a, err) == MOK_SUCCESS);
    run.fill = 0.0;
    MOK_REQUIRE(ref_run(&p, &run, &b, err) == MOK_SUCCESS);
    expect_results_bitwise(&p, &a, &b, 4 * ref_shared_w_elems(&p)); /* one copy per rank */
    ref_result_free(&a);
    ref_result_free(&b);
    ref_problem_free(&p);
  }
}
