/*
 * test_ref_experts.c: the reference's per-expert weights (ref.h, mok_ref_experts_t) give bitwise
 * the results of the same weights held in arrays, over W = 2 simulated ranks, in normal and exact
 * (fp64) mode and in fp8: load hands out one expert's slice (copied into a scratch buffer, so a
 * read past the expert shows), store collects each expert's gradients. Each rank's experts are
 * loaded only when they have rows, and stored exactly once, in order.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu/ref.h"
#include "ref_problem.h"
#include "test.h"

enum { W = 2 };

typedef struct {
  const mok_ref_weights_t *full; /* [W] the effective weights as arrays */
  int64_t I, H, EL;
  double *buf[6];                /* [I * H] one expert, copied */
  double *dwg, *dwu, *dwd;       /* [W * EL, I * H] what store received */
  int64_t next_store[W];         /* the expert each rank's next store must be */
  int loads[W], bad_order;
} io_t;

static void load(void *user, int rank, int64_t le, int backward, mok_ref_expert_t *e) {
  io_t *io = user;
  const mok_ref_weights_t *f = &io->full[rank];
  const double *src[6] = {f->wg, f->wu, f->wd, f->wg_b, f->wu_b, f->wd_b};
  const int64_t n = io->I * io->H;
  const double **dst[6] = {&e->wg, &e->wu, &e->wd, &e->wg_b, &e->wu_b, &e->wd_b};
  for (int i = 0; i < (backward ? 6 : 3); i++) {
    memcpy(io->buf[i], src[i] + le * n, (size_t)n * sizeof(double));
    *dst[i] = io->buf[i];
  }
  io->loads[rank]++;
}

static void store(void *user, int rank, int64_t le, const double *dwg, const double *dwu,
                  const double *dwd) {
  io_t *io = user;
  const int64_t n = io->I * io->H, at = (rank * io->EL + le) * n;
  io->bad_order |= le != io->next_store[rank]++;
  memcpy(io->dwg + at, dwg, (size_t)n * sizeof(double));
  memcpy(io->dwu + at, dwu, (size_t)n * sizeof(double));
  memcpy(io->dwd + at, dwd, (size_t)n * sizeof(double));
}

static int same(const double *a, const double *b, int64_t n) {
  return ref_first_diff(a, b, n) < 0;
}

static void check(mok_precision_t prec, int exact, int save) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 128, 64, 32, 8, 2, 6, 77, 0.1, 5)); /* never expert 5 */
  ref_run_t run = ref_run_default(&p);
  run.W = W, run.T[0] = 4, run.T[1] = 2, run.tile_m = 3, run.precision = prec, run.exact = exact;
  run.save = save;
  ref_result_t want;
  char err[256];
  MOK_REQUIRE_MSG(ref_run(&p, &run, &want, err) == MOK_SUCCESS, "%s", err);

  const int64_t H = p.H, I = p.I, Is = p.Is, K = p.K, N = p.N, EL = p.E / W, n = I * H;
  mok_ref_cfg_t cfg = {H, I, p.E, K, Is, W, prec, MOK_FP8_SCALE_FP32, exact, 3};
  mok_ref_weights_t full[W], w[W];
  io_t io = {full, I, H, EL, {0}, NULL, NULL, NULL, {0, 0}, {0, 0}, 0};
  mok_ref_experts_t ex = {load, store, &io};
  for (int i = 0; i < 6; i++) io.buf[i] = calloc((size_t)n, sizeof(double));
  io.dwg = calloc((size_t)(p.E * n), 8), io.dwu = calloc((size_t)(p.E * n), 8);
  io.dwd = calloc((size_t)(p.E * n), 8);
  double *y = calloc((size_t)(N * H), 8), *dx = calloc((size_t)(N * H), 8);
  double *dtw = calloc((size_t)(N * K), 8), *dws[3];
  for (int i = 0; i < 3; i++) dws[i] = calloc((size_t)(W * Is * H), 8);
  double *sv[4] = {calloc((size_t)(N * K * I), 8), calloc((size_t)(N * K * I), 8),
                   calloc((size_t)(N * Is), 8), calloc((size_t)(N * Is), 8)};
  mok_ref_in_t in[W];
  mok_ref_out_t out[W];
  mok_ref_saved_t saved[W];
  int64_t off = 0;
  for (int r = 0; r < W; r++) {
    MOK_REQUIRE(mok_ref_weights_effective(&cfg, p.wg + r * EL * n, p.wu + r * EL * n,
                                          p.wd + r * EL * n, p.wsg, p.wsu, p.wsd,
                                          &full[r]) == MOK_SUCCESS);
    w[r] = full[r];
    w[r].wg = w[r].wu = w[r].wd = w[r].wg_b = w[r].wu_b = w[r].wd_b = NULL; /* never read */
    w[r].experts = &ex;
    in[r] = (mok_ref_in_t){run.T[r], p.x + off * H, p.idx + off * K, p.tw + off * K,
                           p.dy + off * H};
    out[r] = (mok_ref_out_t){y + off * H, dx + off * H, dtw + off * K, NULL, NULL, NULL,
                             dws[0] + r * Is * H, dws[1] + r * Is * H, dws[2] + r * Is * H};
    saved[r] = (mok_ref_saved_t){sv[0] + off * K * I, sv[1] + off * K * I, sv[2] + off * Is,
                                 sv[3] + off * Is};
    off += run.T[r];
  }
  MOK_REQUIRE_MSG(mok_ref_forward(&cfg, w, in, out, save ? saved : NULL, err, sizeof err) ==
                      MOK_SUCCESS, "%s", err);
  const int fwd_loads = io.loads[0] + io.loads[1];
  MOK_REQUIRE_MSG(mok_ref_backward(&cfg, w, in, out, save ? saved : NULL, err, sizeof err) ==
                      MOK_SUCCESS, "%s", err);
  const char *what = prec == MOK_PRECISION_BF16 ? (exact ? "bf16 exact" : "bf16") : "fp8";
  MOK_EXPECT_MSG(same(y, want.y, N * H) && same(dx, want.dx, N * H) && same(dtw, want.dtw, N * K),
                 "%s: y, dx or dtopk_w differ", what);
  MOK_EXPECT_MSG(same(io.dwg, want.dwg, p.E * n) && same(io.dwu, want.dwu, p.E * n) &&
                     same(io.dwd, want.dwd, p.E * n),
                 "%s: routed weight gradients differ", what);
  MOK_EXPECT_MSG(same(dws[0], want.dwsg, W * Is * H) && same(dws[2], want.dwsd, W * Is * H),
                 "%s: shared weight gradients differ", what);
  /* Experts with rows are loaded once in forward and once in backward; each is stored once. */
  int used = 0;
  for (int e = 0; e < p.E; e++) {
    int rows = 0;
    for (int64_t i = 0; i < N * K; i++) rows += p.idx[i] == e;
    used += rows > 0;
  }
  MOK_EXPECT_MSG(used < p.E && fwd_loads == used && io.loads[0] + io.loads[1] == 2 * used,
                 "%s: %d experts with rows, %d + %d loads", what, used, fwd_loads,
                 io.loads[0] + io.loads[1] - fwd_loads);
  MOK_EXPECT(!io.bad_order && io.next_store[0] == EL && io.next_store[1] == EL);
  for (int r = 0; r < W; r++) mok_ref_weights_free(&full[r]);
  for (int i = 0; i < 6; i++) free(io.buf[i]);
  for (int i = 0; i < 3; i++) free(dws[i]);
  for (int i = 0; i < 4; i++) free(sv[i]);
  free(io.dwg), free(io.dwu), free(io.dwd), free(y), free(dx), free(dtw);
  ref_result_free(&want);
  ref_problem_free(&p);
}

MOK_TEST(ref_experts_match_arrays_bf16) { check(MOK_PRECISION_BF16, 0, 1); }
MOK_TEST(ref_experts_match_arrays_exact) { check(MOK_PRECISION_BF16, 1, 0); }
MOK_TEST(ref_experts_match_arrays_mxfp8) { check(MOK_PRECISION_MXFP8, 0, 0); }
MOK_TEST(ref_experts_match_arrays_fp8_block) { check(MOK_PRECISION_FP8_BLOCK, 0, 1); }
