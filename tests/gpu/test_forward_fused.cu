/*
 * test_forward_fused.cu: the fused forward kernel (src/cuda/forward/fused.cu) bitwise equal to the
 * unfused kernel chain of the same W = 1 BF16 layer, on several CTA counts and tunings
 * (src/api/internal.h), also with 1024 experts (stores from registers), and the fused launcher's
 * argument checks. test_forward.cu checks the layer against the CPU layer. Every GPU test skips
 * without a GPU.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "forward_test_util.cuh"

#define NEED_GPU() \
  if (!test_gpu_present()) MOK_SKIP("no CUDA device")

/* ---------------------------------------------------------------------------------------------- */
/* The fused kernel against the kernel chain                                                       */
/* ---------------------------------------------------------------------------------------------- */

// What t sets (src/common/tuning.h), for messages.
static const char *tuning_name(const mok_tuning_t *t, char *buf, size_t n) {
  snprintf(buf, n, "%s on %d CTAs (0: all), lag %d, shared band %d, help at %d%%, tile group %d",
           t->forward_path == MOK_FORWARD_CHAIN ? "chain" : "fused", t->forward_sms, t->fused_lag,
           t->fused_shared_band, t->fused_help_pct, t->tile_group_m);
  return buf;
}

// One forward with the layer's tuning set to t (src/api/internal.h), from poisoned outputs: y and
// the whole saved context.
static void run_tuned(test_gpu_layer_t *g, const fwd_problem_t *p, const mok_tuning_t *t,
                      std::vector<uint16_t> *y, std::vector<uint8_t> *c, const char *what) {
  char how[160];
  tuning_name(t, how, sizeof(how));
  cudaMemset(g->y, 0xFF, (size_t)(p->T_max * p->H) * 2);
  cudaMemset(g->ctx, 0xAB, g->ctx_bytes);
  mokResult_t r = mok_layer_set_tuning(g->l, t);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s (%s): mok_layer_set_tuning: %s", what, how,
                 mok_last_error());
  if (r == MOK_SUCCESS) {
    r = test_gpu_layer_forward(g, p->T, NULL);
    MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s (%s): mok_forward: %s", what, how, mok_last_error());
    r = mok_layer_check(g->l);
    MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s (%s): mok_layer_check: %s", what, how, mok_last_error());
  }
  *y = fwd_gpu_y(g, p->T, p->H);
  *c = fwd_gpu_ctx(g);
}

// The fused kernel's y and context bitwise equal to the chain's, on 1, 3, 7 CTAs and one per SM,
// and with every tuning value that moves work between SMs or in time (none may change a bit): on
// 3 CTAs, bands of 3 and of 8 row tiles in the plan, and none (the default for these small
// weights is none too); the reduce helpers from the first task (GATE_UP gathered by 2 warps
// throughout) or only past the last GATE_UP task (without a shared expert: tokens in token order
// after every DOWN tile; by default, without a shared expert, the helpers start at 85% of the
// expert stages, in the layout's reduce order); the shared expert's token tiles one per band
// (default 8); and on 5 CTAs the plan's smallest lag, 1.
static void fused_case(fwd_problem_t *p, const char *what) {
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, p));
  fwd_gpu_inputs(&g, p);
  mok_tuning_t base;
  MOK_REQUIRE(mok_layer_tuning(g.l, &base) == MOK_SUCCESS);
  base.forward_path = MOK_FORWARD_FUSED;
  std::vector<uint16_t> y0, y;
  std::vector<uint8_t> c0, c;
  mok_tuning_t t = base;
  t.forward_path = MOK_FORWARD_CHAIN;
  run_tuned(&g, p, &t, &y0, &c0, what);
  const int sms[4] = {0, 1, 3, 7};
  for (int i = 0; i < 4; i++) {
    t = base;
    t.forward_sms = sms[i];
    run_tuned(&g, p, &t, &y, &c, what);
    int64_t bad = 0, first = -1;
    for (size_t j = 0; j < y.size(); j++)
      if (y[j] != y0[j]) bad++, first = first < 0 ? (int64_t)j : first;
    MOK_EXPECT_MSG(bad == 0, "%s: fused on %d CTAs (0: all): %lld of %zu y elements differ from "
                   "the chain (first at %lld: %04x vs %04x)", what, sms[i], (long long)bad,
                   y.size(), (long long)first, first >= 0 ? y[first] : 0, first >= 0 ? y0[first] : 0);
    MOK_EXPECT_MSG(c == c0, "%s: fused on %d CTAs (0: all): the saved context differs from the "
                   "chain's", what, sms[i]);
  }
  enum { VARIANTS = 7 };
  mok_tuning_t v[VARIANTS];
  for (int i = 0; i < VARIANTS; i++) v[i] = base, v[i].forward_sms = 3;
  v[0].tile_group_m = 3;
  v[1].tile_group_m = 8;
  v[2].tile_group_m = -1;
  v[3].fused_help_pct = 0;
  v[4].fused_help_pct = 100;
  v[5].fused_shared_band = 1;
  v[6].fused_lag = 1, v[6].forward_sms = 5;
  for (int i = 0; i < VARIANTS; i++) {
    run_tuned(&g, p, &v[i], &y, &c, what);
    char how[160];
    MOK_EXPECT_MSG(y == y0 && c == c0, "%s: fused with %s differs from the chain", what,
                   tuning_name(&v[i], how, sizeof(how)));
  }
  test_gpu_layer_close(&g);
}

MOK_TEST(fwd_gpu_fused_equals_chain_bitwise) {
  NEED_GPU();
  struct {
    int64_t H, I, E, K, Is, T;
    test_route_t r;
    mok_context_mode_t mode;
    const char *what;
  } cases[] = {
      {256, 128, 8, 2, 128, 100, {0.1, 0, -1}, MOK_CONTEXT_SAVE, "small, shared expert"},
      {256, 256, 8, 2, 0, 257, {0.0, 0, -1}, MOK_CONTEXT_SAVE, "T = 257, no shared expert"},
      {256, 128, 8, 2, 128, 300, {0.0, 0, 5}, MOK_CONTEXT_SAVE, "every token to expert 5"},
      {256, 128, 8, 2, 0, 100, {0.0, (1u << 0) | (1u << 3) | (1u << 6), -1}, MOK_CONTEXT_SAVE,
       "experts 0, 3, 6 empty"},
      {256, 128, 8, 1, 128, 100, {0.0, 0, -1}, MOK_CONTEXT_SAVE, "K = 1"},
      {256, 128, 8, 4, 128, 100, {0.45, 0, -1}, MOK_CONTEXT_SAVE, "K = 4, -1 slots"},
      {256, 128, 8, 2, 128, 100, {1.0, 0, -1}, MOK_CONTEXT_SAVE, "every slot -1"},
      {256, 128, 8, 2, 128, 1, {0.0, 0, -1}, MOK_CONTEXT_SAVE, "T = 1"},
      {384, 256, 8, 2, 256, 500, {0.1, 0, -1}, MOK_CONTEXT_RECOMPUTE,
       "H = 384 (half a DOWN tile), recompute mode"},
      {1024, 384, 64, 6, 256, 3000, {0.05, 0, -1}, MOK_CONTEXT_SAVE,
       "E = 64, K = 6, T = 3000, shared expert"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    fwd_problem_t p;
    fwd_problem_init(&p, cases[i].H, cases[i].I, cases[i].E, cases[i].K, cases[i].Is, cases[i].T,
                     cases[i].T);
    p.mode = cases[i].mode;
    fwd_route(&p, cases[i].r);
    fused_case(&p, cases[i].what);
  }
}

// The fused launcher's checks come before any CUDA call, so this runs without a GPU too: each bad
// argument gets its own error code, T = 0 launches nothing.
MOK_TEST(fwd_fused_launcher_rejects_bad_arguments) {
  static char buf[4096] __attribute__((aligned(256)));
  void *ok = buf;
  mok_fwd_fused_params_t base;
  memset(&base, 0, sizeof(base));
  base.l.T = 100, base.l.H = 256, base.l.E = 8, base.l.K = 2, base.l.Is = 0;
  base.l.capacity_rows = 200;
  base.l.n_counters = mok_fc_count(200, 8, 100);
  base.l.x = base.l.y = ok, base.l.yk = ok, base.l.err = ok;
  base.l.status = base.l.offsets = base.l.slot_row = base.l.row_tok = base.l.tile_pre = (int32_t *)ok;
  base.l.red_pre = base.l.red_order = (int32_t *)ok;
  base.l.row_w = (float *)ok;
  base.l.counters = (uint32_t *)ok;
  base.I = 128;
  base.wg = base.wu = base.wd = ok;
  base.a = ok;

  mok_fwd_fused_params_t p;
  MOK_EXPECT(mok_fwd_fused_launch(NULL, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.l.row_tok = NULL;  MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.l.counters = NULL; MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.l.red_order = NULL; MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.wd = NULL;         MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.l.Is = 128;        /* a shared expert needs its weights and buffers */
  MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.l.H = 200;         MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.I = 0;             MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.l.E = 0;           MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.l.E = MOK_MAX_EXPERTS + 1;
  MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.l.K = 0;           MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.l.n_counters -= 1; MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  /* more tasks than the 32-bit ticket counter deals: 2^30 rows of capacity x 2^23 columns */
  p = base; p.l.capacity_rows = (int64_t)1 << 30; p.l.E = 1; p.I = (int64_t)1 << 23;
  p.l.n_counters = mok_fc_count(p.l.capacity_rows, 1, p.l.T);
  MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.l.x = buf + 8;     MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.a = buf + 4;       MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.l.T = 0;           MOK_EXPECT(mok_fwd_fused_launch(&p, NULL) == MOK_SUCCESS);
}

// E = MOK_MAX_EXPERTS local experts: the (E + 1) row-tile prefix sums leave no room in shared
// memory for the staging buffers (they fit up to about E = 480), so the fused kernel stores
// DOWN's yk and GATE_UP's a, g and u from registers, the path no tuning value selects. Against
// the CPU layer (tolerance: forward_test_util.cuh) and bitwise against the kernel chain on every
// CTA count and tuning of fused_case. Most experts get no row: about 2200 rows over 1024.
// (Named to run last in this file: the random streams of the tests before it stay the same.)
MOK_TEST(fwd_gpu_with_1024_experts_stores_from_registers) {
  NEED_GPU();
  struct {
    int64_t H, I, K, Is, T;
    const char *what;
  } cases[] = {{256, 128, 8, 0, 300, "E = 1024, K = 8, no shared expert"},
               {128, 256, 4, 128, 600, "E = 1024, K = 4, H = 128 (half a DOWN tile), Is = 128"}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    fwd_problem_t p;
    fwd_problem_init(&p, cases[i].H, cases[i].I, MOK_MAX_EXPERTS, cases[i].K, cases[i].Is,
                     cases[i].T, cases[i].T);
    test_gpu_layer_t g;
    MOK_REQUIRE(fwd_gpu_open(&g, &p));
    fwd_check_against_cpu(&g, &p, cases[i].what);
    test_gpu_layer_close(&g);
    fused_case(&p, cases[i].what);
  }
}
