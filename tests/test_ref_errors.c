/*
 * test_ref_errors.c: the reference's error paths: bad routing (from the layout) with its message,
 * bad configs, missing pointers; and what is allowed (T = 0 with NULL arrays).
 */
#include <string.h>

#include "ref_problem.h"
#include "test.h"

/* Runs forward and backward of p as W = 2 ranks (T = 3 and 3); expects `want`, and a message in
 * err when it is an error. */
static void expect_run(ref_problem_t *p, mokResult_t want, const char *what) {
  ref_run_t run = ref_run_default(p);
  run.W = 2, run.T[0] = 3, run.T[1] = 3;
  ref_result_t r;
  char err[256];
  mokResult_t rc = ref_run(p, &run, &r, err);
  MOK_EXPECT_MSG(rc == want, "%s: got %d, want %d (%s)", what, (int)rc, (int)want, err);
  if (want != MOK_SUCCESS) MOK_EXPECT_MSG(strlen(err) > 0, "%s: no message", what);
  if (rc == MOK_SUCCESS) ref_result_free(&r);
}

MOK_TEST(ref_rejects_invalid_routing) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 16, 8, 8, 4, 2, 6, 101, 0.0, -1));
  expect_run(&p, MOK_SUCCESS, "valid routing");

  p.idx[4 * 2 + 1] = 4; /* rank 1, token 1, slot 1: expert id E */
  expect_run(&p, MOK_ERROR_INVALID_ROUTING, "expert id E");
  p.idx[4 * 2 + 1] = -2;
  expect_run(&p, MOK_ERROR_INVALID_ROUTING, "expert id -2");
  p.idx[4 * 2 + 1] = p.idx[4 * 2 + 0]; /* the same expert twice in one row */
  expect_run(&p, MOK_ERROR_INVALID_ROUTING, "duplicate expert");
  p.idx[4 * 2 + 1] = -1;
  p.idx[4 * 2 + 0] = -1; /* two empty slots are not duplicates */
  expect_run(&p, MOK_SUCCESS, "two empty slots");

  /* Backward validates the routing on its own (W = 1, expert id 7 >= E). */
  mok_ref_cfg_t cfg = {p.H, p.I, p.E, p.K, p.Is, 1, MOK_PRECISION_BF16, MOK_FP8_SCALE_FP32, 0, 1};
  mok_ref_weights_t w;
  MOK_REQUIRE(mok_ref_weights_effective(&cfg, p.wg, p.wu, p.wd, p.wsg, p.wsu, p.wsd, &w) ==
              MOK_SUCCESS);
  p.idx[0] = 7;
  double y[6 * 16], dx[6 * 16], dtw[12], dwg[4 * 8 * 16], dwu[4 * 8 * 16], dwd[4 * 16 * 8];
  double dwsg[8 * 16], dwsu[8 * 16], dwsd[16 * 8];
  mok_ref_in_t in = {6, p.x, p.idx, p.tw, p.dy};
  mok_ref_out_t out = {y, dx, dtw, dwg, dwu, dwd, dwsg, dwsu, dwsd};
  char err[256] = "";
  MOK_EXPECT(mok_ref_backward(&cfg, &w, &in, &out, NULL, err, sizeof(err)) ==
             MOK_ERROR_INVALID_ROUTING);
  MOK_EXPECT(strlen(err) > 0);
  mok_ref_weights_free(&w);
  ref_problem_free(&p);
}

MOK_TEST(ref_rejects_bad_config) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 16, 8, 8, 4, 2, 4, 102, 0.0, -1));
  const mok_ref_cfg_t good = {16, 8, 4, 2, 8, 2, MOK_PRECISION_BF16, MOK_FP8_SCALE_FP32, 0, 1};
  mok_ref_cfg_t bad[10];
  for (int i = 0; i < 10; i++) bad[i] = good;
  bad[0].H = 0;
  bad[1].I = -1;
  bad[2].Is = -1;
  bad[3].W = 3; /* E % W != 0 */
  bad[4].K = 0;
  bad[5].K = 5; /* K > E */
  bad[6].tile_m = 0;
  bad[7].exact = 1, bad[7].precision = MOK_PRECISION_MXFP8;
  bad[8].W = 0;
  bad[9].precision = (mok_precision_t)7;

  mok_ref_weights_t w[2];
  MOK_REQUIRE(mok_ref_weights_effective(&good, p.wg, p.wu, p.wd, p.wsg, p.wsu, p.wsd, &w[0]) ==
              MOK_SUCCESS);
  MOK_REQUIRE(mok_ref_weights_effective(&good, p.wg + 2 * 8 * 16, p.wu + 2 * 8 * 16,
                                        p.wd + 2 * 16 * 8, p.wsg, p.wsu, p.wsd,
                                        &w[1]) == MOK_SUCCESS);
  double y[4 * 16], dx[4 * 16], dtw[8], dwg[2][2 * 8 * 16], dwu[2][2 * 8 * 16],
      dwd[2][2 * 16 * 8], dwsg[2][8 * 16], dwsu[2][8 * 16], dwsd[2][16 * 8];
  mok_ref_in_t in[2] = {{2, p.x, p.idx, p.tw, p.dy},
                        {2, p.x + 2 * 16, p.idx + 2 * 2, p.tw + 2 * 2, p.dy + 2 * 16}};
  mok_ref_out_t out[2];
  for (int r = 0; r < 2; r++) {
    out[r] = (mok_ref_out_t){y + r * 32, dx + r * 32, dtw + r * 4, dwg[r], dwu[r], dwd[r],
                             dwsg[r], dwsu[r], dwsd[r]};
  }
  char err[256];
  MOK_EXPECT(mok_ref_forward(&good, w, in, out, NULL, err, sizeof(err)) == MOK_SUCCESS);
  MOK_EXPECT(mok_ref_backward(&good, w, in, out, NULL, err, sizeof(err)) == MOK_SUCCESS);
  for (int i = 0; i < 10; i++) {
    err[0] = '\0';
    mokResult_t rc = mok_ref_forward(&bad[i], w, in, out, NULL, err, sizeof(err));
    MOK_EXPECT_MSG(rc == MOK_ERROR_INVALID_VALUE && strlen(err) > 0, "cfg %d forward: %d '%s'", i,
                   (int)rc, err);
    err[0] = '\0';
    rc = mok_ref_backward(&bad[i], w, in, out, NULL, err, sizeof(err));
    MOK_EXPECT_MSG(rc == MOK_ERROR_INVALID_VALUE && strlen(err) > 0, "cfg %d backward: %d '%s'",
                   i, (int)rc, err);
    mok_ref_weights_t tmp;
    rc = mok_ref_weights_effective(&bad[i], p.wg, p.wu, p.wd, p.wsg, p.wsu, p.wsd, &tmp);
    MOK_EXPECT_MSG(rc == MOK_ERROR_INVALID_VALUE, "cfg %d weights: %d", i, (int)rc);
  }
  /* A negative token count. */
  in[1].T = -1;
  MOK_EXPECT(mok_ref_forward(&good, w, in, out, NULL, err, sizeof(err)) == MOK_ERROR_INVALID_VALUE);
  in[1].T = 2;

  /* Missing pointers. */
  MOK_EXPECT(mok_ref_forward(NULL, w, in, out, NULL, err, sizeof(err)) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_ref_forward(&good, NULL, in, out, NULL, err, sizeof(err)) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_ref_backward(&good, w, NULL, out, NULL, err, sizeof(err)) ==
             MOK_ERROR_NULL_POINTER);
  in[1].x = NULL;
  err[0] = '\0';
  MOK_EXPECT(mok_ref_forward(&good, w, in, out, NULL, err, sizeof(err)) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT_MSG(strstr(err, "in.x") && strstr(err, "rank 1"), "message '%s'", err);
  in[1].x = p.x + 2 * 16;
  out[0].dx = NULL;
  MOK_EXPECT(mok_ref_forward(&good, w, in, out, NULL, err, sizeof(err)) == MOK_SUCCESS);
  MOK_EXPECT(mok_ref_backward(&good, w, in, out, NULL, err, sizeof(err)) ==
             MOK_ERROR_NULL_POINTER);
  out[0].dx = dx;
  const double *keep = w[1].wsd;
  w[1].wsd = NULL; /* needed when Is > 0 */
  MOK_EXPECT(mok_ref_forward(&good, w, in, out, NULL, err, sizeof(err)) == MOK_ERROR_NULL_POINTER);
  w[1].wsd = keep;
  mok_ref_saved_t sv[2] = {{NULL, NULL, NULL, NULL}, {NULL, NULL, NULL, NULL}};
  MOK_EXPECT(mok_ref_forward(&good, w, in, out, sv, err, sizeof(err)) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_ref_weights_effective(&good, NULL, p.wu, p.wd, p.wsg, p.wsu, p.wsd, &w[0]) ==
             MOK_ERROR_NULL_POINTER);

  /* A rank without tokens needs no token arrays; err may be NULL. */
  in[1] = (mok_ref_in_t){0, NULL, NULL, NULL, NULL};
  out[1].y = out[1].dx = out[1].dtopk_w = NULL;
  MOK_EXPECT(mok_ref_forward(&good, w, in, out, NULL, NULL, 0) == MOK_SUCCESS);
  MOK_EXPECT(mok_ref_backward(&good, w, in, out, NULL, NULL, 0) == MOK_SUCCESS);
  mok_ref_weights_free(&w[0]);
  mok_ref_weights_free(&w[1]);
  ref_problem_free(&p);
}
