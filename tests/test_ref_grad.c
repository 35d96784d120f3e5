/*
 * test_ref_grad.c: the reference backward against central finite differences of its forward, in
 * exact (fp64) mode, on every entry of every input and weight.
 *
 * Loss L = sum(y * R) for a fixed random R, so dy = R. In exact mode nothing is rounded and silu
 * is smooth, so the central difference (L(t + h) - L(t - h)) / 2h with h = 1e-5 * max(|t|, 1)
 * differs from dL/dt only by the truncation term h^2 L''' / 6 (about 1e-10 relative with O(1)
 * activations) and the fp64 rounding of L divided by 2h (about 2^-52 * sum|y * R| / 2e-5, 1e-10 to
 * 1e-9 absolute here). The tolerance, 1e-6 relative plus 1e-8 absolute, sits more than an order of
 * magnitude above that noise (the worst entry measured uses 4% of it), while any error in a formula
 * (a sign, a missing silu' term, a transposed weight, a bf16 rounding leaking into exact mode)
 * moves the gradient by 2^-9 relative or much more: flipping a sign in silu' or in the shared
 * expert's ds fails every entry of the tensors it feeds.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ref_problem.h"
#include "test.h"

/* L = sum(y * R) of a forward run (exact mode). Returns NAN if the run fails. */
static double loss(const ref_problem_t *p, const ref_run_t *run, const double *R) {
  ref_run_t fwd = *run;
  fwd.backward = 0;
  ref_result_t res;
  char err[256];
  if (ref_run(p, &fwd, &res, err) != MOK_SUCCESS) return NAN;
  double L = 0.0;
  for (int64_t i = 0; i < p->N * p->H; i++) L += res.y[i] * R[i];
  ref_result_free(&res);
  return L;
}

/* Compares grad[n] (the analytic gradient w.r.t. param[n]) with central differences of the loss;
 * returns the number of entries outside the tolerance. */
static int check_tensor(const char *name, const ref_problem_t *p, const ref_run_t *run,
                        const double *R, double *param, const double *grad, int64_t n) {
  int bad = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double t0 = param[i];
    const double h = 1e-5 * fmax(fabs(t0), 1.0);
    param[i] = t0 + h;
    const double lp = loss(p, run, R);
    param[i] = t0 - h;
    const double lm = loss(p, run, R);
    param[i] = t0;
    const double fd = (lp - lm) / (2.0 * h);
    /* 1e-6 relative (see the banner); the absolute floor 1e-8 is 10x the fd rounding noise and
     * only matters for gradients that are (nearly) zero. */
    const double tol = 1e-6 * fabs(grad[i]) + 1e-8;
    const double d = fabs(fd - grad[i]);
    if (d / (fabs(grad[i]) + 1e-8) > worst) worst = d / (fabs(grad[i]) + 1e-8);
    if (!(d <= tol)) {
      if (bad < 3) {
        mok_test_fail(__FILE__, __LINE__, "%s[%lld]: analytic %.12g, finite difference %.12g",
                      name, (long long)i, grad[i], fd);
      }
      bad++;
    }
  }
  if (bad) printf("    %s: %d of %lld entries off, worst relative error %.3g\n", name, bad,
                  (long long)n, worst);
  return bad;
}

/* Checks every gradient of a problem run on `run` against finite differences. */
static void check_all(ref_problem_t *p, const ref_run_t *run_in) {
  ref_run_t run = *run_in;
  run.exact = 1;
  run.backward = 1;
  /* dy = R: the loss's gradient w.r.t. y. */
  const double *R = p->dy;
  ref_result_t g;
  char err[256];
  mokResult_t rc = ref_run(p, &run, &g, err);
  MOK_REQUIRE_MSG(rc == MOK_SUCCESS, "run failed: %d %s", (int)rc, err);
  MOK_REQUIRE(!isnan(loss(p, &run, R)));

  const int64_t NH = p->N * p->H, NK = p->N * p->K, RW = ref_routed_w_elems(p);
  MOK_EXPECT(check_tensor("dx", p, &run, R, p->x, g.dx, NH) == 0);
  MOK_EXPECT(check_tensor("dtopk_w", p, &run, R, p->tw, g.dtw, NK) == 0);
  MOK_EXPECT(check_tensor("dwg", p, &run, R, p->wg, g.dwg, RW) == 0);
  MOK_EXPECT(check_tensor("dwu", p, &run, R, p->wu, g.dwu, RW) == 0);
  MOK_EXPECT(check_tensor("dwd", p, &run, R, p->wd, g.dwd, RW) == 0);
  if (p->Is > 0) {
    /* Every rank holds the same shared weights and the loss sums over all ranks' tokens, so dL/dWs
     * is the sum of the per-rank shared gradients. */
    const int64_t SW = ref_shared_w_elems(p);
    double sum[3][1024];
    MOK_REQUIRE(SW <= 1024);
    const double *per_rank[3] = {g.dwsg, g.dwsu, g.dwsd};
    for (int m = 0; m < 3; m++) {
      for (int64_t i = 0; i < SW; i++) {
        sum[m][i] = 0.0;
        for (int r = 0; r < run.W; r++) sum[m][i] += per_rank[m][r * SW + i];
      }
    }
    MOK_EXPECT(check_tensor("dwsg", p, &run, R, p->wsg, sum[0], SW) == 0);
    MOK_EXPECT(check_tensor("dwsu", p, &run, R, p->wsu, sum[1], SW) == 0);
    MOK_EXPECT(check_tensor("dwsd", p, &run, R, p->wsd, sum[2], SW) == 0);
  }
  /* Empty slots carry no gradient to their router weight. */
  for (int64_t i = 0; i < NK; i++) {
    if (p->idx[i] < 0) MOK_EXPECT(g.dtw[i] == 0.0);
  }
  ref_result_free(&g);
}

/* One rank, a shared expert, H != I != Is so a transposed index cannot go unnoticed. */
MOK_TEST(ref_grad_exact_matches_finite_differences_shared) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 16, 12, 8, 4, 2, 5, 11, 0.2, -1));
  int empty = 0;
  for (int64_t i = 0; i < p.N * p.K; i++) empty += p.idx[i] < 0;
  MOK_EXPECT(empty > 0); /* the routing holds -1 slots */
  ref_run_t run = ref_run_default(&p);
  check_all(&p, &run);
  ref_problem_free(&p);
}

/* Two ranks (T = 3 and 2), no shared expert, K = 3 of E = 4, a padded layout. */
MOK_TEST(ref_grad_exact_matches_finite_differences_two_ranks_no_shared) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 12, 16, 0, 4, 3, 5, 12, 0.25, -1));
  ref_run_t run = ref_run_default(&p);
  run.W = 2;
  run.T[0] = 3;
  run.T[1] = 2;
  run.tile_m = 4;
  check_all(&p, &run);
  ref_problem_free(&p);
}
