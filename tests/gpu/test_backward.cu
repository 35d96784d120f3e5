/*
 * test_backward.cu: the GPU backward of a W = 1 BF16 layer (src/gpu/backward.c: the kernel chain,
 * or its prologue and the fused kernel of src/cuda/backward/fused.cu) against the CPU layer's forward + backward on the same inputs (tolerance:
 * backward_test_util.cuh): dx, dtopk_w and every weight gradient, in both weight-gradient dtypes,
 * overwritten and accumulated; routing edge cases; bitwise run-to-run determinism; RECOMPUTE
 * equal to SAVE bitwise; CUDA graph capture; contexts that do not match, reported by
 * mok_layer_check; the fused backward kernel bitwise equal to the chain, on any grid. Every test skips without a GPU. Filter: `make test TESTS=bwd_gpu`.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "backward_test_util.cuh"
#include "cuda/quant/quant.h"

#define NEED_GPU() \
  if (!test_gpu_present()) MOK_SKIP("no CUDA device")

/* ---------------------------------------------------------------------------------------------- */
/* Against the CPU layer                                                                           */
/* ---------------------------------------------------------------------------------------------- */

static void small_case(int64_t I, int64_t Is, int64_t K, int64_t T, test_route_t route,
                       mok_wgrad_dtype_t wdt, int accumulate, const char *what) {
  bwd_problem_t p;
  bwd_problem_init(&p, 256, I, 8, K, Is, T, T > 0 ? T : 16);
  fwd_route(&p.f, route);
  bwd_set_wgrad(&p, wdt, accumulate);
  bwd_gpu_t g;
  MOK_REQUIRE(bwd_gpu_open(&g, &p));
  bwd_check_against_cpu(&g, &p, what);
  bwd_gpu_close(&g);
}

static const test_route_t plain_route = {0.1, 0, -1};

MOK_TEST(bwd_gpu_matches_cpu_small) {
  NEED_GPU();
  small_case(128, 0, 2, 100, plain_route, MOK_WGRAD_FP32, 0, "I=128");
  small_case(256, 0, 2, 100, plain_route, MOK_WGRAD_FP32, 0, "I=256");
  small_case(128, 128, 2, 100, plain_route, MOK_WGRAD_FP32, 0, "I=128 Is=128");
  small_case(256, 128, 2, 100, plain_route, MOK_WGRAD_FP32, 0, "I=256 Is=128");
}

MOK_TEST(bwd_gpu_wgrad_dtypes_and_accumulate) {
  NEED_GPU();
  small_case(128, 128, 2, 100, plain_route, MOK_WGRAD_BF16, 0, "bf16 weight gradients");
  small_case(128, 128, 2, 100, plain_route, MOK_WGRAD_BF16, 1, "bf16, accumulated");
  small_case(256, 128, 2, 100, plain_route, MOK_WGRAD_FP32, 1, "fp32, accumulated");
}

MOK_TEST(bwd_gpu_routing_edge_cases) {
  NEED_GPU();
  const test_route_t empty_experts = {0.0, (1u << 0) | (1u << 3) | (1u << 6), -1};
  const test_route_t one_expert = {0.0, 0, 5};  // slot 0 of every token: expert 5
  const test_route_t many_empty = {0.45, 0, -1};
  const test_route_t all_empty = {1.0, 0, -1};  // no routed rows: routed gradients 0,
                                                // dx = bf16(dxs)
  const test_route_t full = {0.0, 0, -1};
  const mok_wgrad_dtype_t F = MOK_WGRAD_FP32, B = MOK_WGRAD_BF16;
  small_case(128, 0, 2, 100, empty_experts, F, 0, "experts 0, 3, 6 empty");
  small_case(128, 128, 2, 100, empty_experts, B, 1, "experts 0, 3, 6 empty, bf16 accumulated");
  small_case(128, 128, 2, 300, one_expert, F, 0, "every token to expert 5 (300 rows)");
  small_case(128, 0, 1, 100, full, F, 0, "K = 1");
  small_case(128, 128, 1, 100, one_expert, F, 0, "K = 1, all to expert 5");
  small_case(128, 128, 4, 100, many_empty, F, 0, "K = 4, -1 slots");
  small_case(128, 128, 2, 100, all_empty, F, 0, "every slot -1, shared expert only");
  small_case(128, 0, 2, 1, full, F, 0, "T = 1");
  small_case(128, 128, 2, 257, full, B, 0, "T = 257 (not a multiple of 128)");
  small_case(128, 0, 8, 700, full, F, 0, "K = 8, T = 700");
}

// T = 0: overwritten weight gradients become exactly 0; accumulated ones keep every bit.
MOK_TEST(bwd_gpu_zero_tokens) {
  NEED_GPU();
  for (int acc = 0; acc < 2; acc++) {
    for (int dt = 0; dt < 2; dt++) {
      bwd_problem_t p;
      bwd_problem_init(&p, 256, 128, 8, 2, 128, 0, 16);
      bwd_set_wgrad(&p, dt ? MOK_WGRAD_BF16 : MOK_WGRAD_FP32, acc);
      bwd_gpu_t g;
      MOK_REQUIRE(bwd_gpu_open(&g, &p));
      bwd_gpu_inputs(&g, &p);
      MOK_EXPECT_MSG(bwd_gpu_run(&g, &p, 0) == MOK_SUCCESS, "%s", mok_last_error());
      MOK_EXPECT_MSG(mok_layer_check(g.f.l) == MOK_SUCCESS, "%s", mok_last_error());
      bwd_out_t o;
      bwd_gpu_outputs(&g, &p, &o);
      for (int i = 0; i < BWD_NW; i++) {
        int64_t bad = 0;
        for (size_t j = 0; j < o.dw[i].size(); j++)
          bad += acc ? o.dw[i][j] != p.dw0[i][j] : o.dw[i][j] != 0;
        MOK_EXPECT_MSG(bad == 0, "T = 0, %s %s: %lld bytes of %s %s", dt ? "bf16" : "fp32",
                       acc ? "accumulated" : "overwritten", (long long)bad, bwd_w_name[i],
                       acc ? "changed" : "not zero");
      }
      bwd_gpu_close(&g);
    }
  }
  bwd_problem_t p;  // ... and then T = 9 < T_max on the same kind of layer
  bwd_problem_init(&p, 256, 128, 8, 2, 128, 9, 16);
  bwd_gpu_t g;
  MOK_REQUIRE(bwd_gpu_open(&g, &p));
  bwd_check_against_cpu(&g, &p, "T = 9 < T_max = 16");
  bwd_gpu_close(&g);
}

/* ---------------------------------------------------------------------------------------------- */
/* Determinism, recompute, graphs                                                                  */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(bwd_gpu_is_bitwise_deterministic) {
  NEED_GPU();
  for (int dt = 0; dt < 2; dt++) {
    bwd_problem_t p;
    bwd_problem_init(&p, 512, 256, 16, 4, 128, 1000, 1000);
    bwd_set_wgrad(&p, dt ? MOK_WGRAD_BF16 : MOK_WGRAD_FP32, 0);
    bwd_gpu_t g;
    MOK_REQUIRE(bwd_gpu_open(&g, &p));
    bwd_out_t o1, o2;
    bwd_gpu_inputs(&g, &p);
    MOK_REQUIRE_MSG(bwd_gpu_run(&g, &p, 0) == MOK_SUCCESS, "%s", mok_last_error());
    bwd_gpu_outputs(&g, &p, &o1);
    bwd_gpu_inputs(&g, &p);  // poison again
    MOK_REQUIRE_MSG(bwd_gpu_run(&g, &p, 0) == MOK_SUCCESS, "%s", mok_last_error());
    MOK_EXPECT_MSG(mok_layer_check(g.f.l) == MOK_SUCCESS, "%s", mok_last_error());
    bwd_gpu_outputs(&g, &p, &o2);
    MOK_EXPECT_MSG(bwd_same(&o1, &o2), "%s gradients differ between two runs (%s)",
                   dt ? "bf16" : "fp32", bwd_diff(&p, &o1, &o2).c_str());
    bwd_gpu_close(&g);
  }
}

// RECOMPUTE recomputes bf16 g, u with the forward's own GEMM: every gradient equals SAVE's bit
// for bit, in both weight-gradient dtypes and with accumulation.
MOK_TEST(bwd_gpu_recompute_equals_save_bitwise) {
  NEED_GPU();
  for (int c = 0; c < 2; c++) {
    bwd_problem_t p;
    bwd_problem_init(&p, 256, 256, 8, 2, 128, 300, 300);
    bwd_set_wgrad(&p, c ? MOK_WGRAD_BF16 : MOK_WGRAD_FP32, c);
    bwd_out_t o[2];
    MOK_REQUIRE(bwd_gpu_runs_in_mode(&p, MOK_CONTEXT_SAVE, 1, &o[0]));
    MOK_REQUIRE(bwd_gpu_runs_in_mode(&p, MOK_CONTEXT_RECOMPUTE, 1, &o[1]));
    MOK_EXPECT_MSG(bwd_same(&o[0], &o[1]), "RECOMPUTE differs from SAVE (%s: %s)",
                   c ? "bf16 accumulated" : "fp32", bwd_diff(&p, &o[0], &o[1]).c_str());
    if (c == 0) {  // and against the CPU layer in RECOMPUTE mode
      p.f.mode = MOK_CONTEXT_RECOMPUTE;
      bwd_out_t ref;
      MOK_REQUIRE_MSG(cpu_backward(&p, &ref) == MOK_SUCCESS, "%s", mok_last_error());
      MOK_EXPECT(bwd_compare_all("RECOMPUTE", &p, &o[1], &ref));
    }
  }
}

// Forward + backward captured in a CUDA graph on a non-blocking stream (no host synchronization
// inside either call), replayed with new routing in the same buffers: bitwise equal to the
// uncaptured calls.
static void graph_case(mok_backward_path_t path) {
  bwd_problem_t p;
  bwd_problem_init(&p, 256, 128, 8, 2, 128, 100, 100);
  bwd_gpu_t g;
  MOK_REQUIRE(bwd_gpu_open(&g, &p));
  mok_tuning_t tu;
  MOK_REQUIRE(mok_layer_tuning(g.f.l, &tu) == MOK_SUCCESS);
  tu.backward_path = path;
  MOK_REQUIRE_MSG(mok_layer_set_tuning(g.f.l, &tu) == MOK_SUCCESS, "%s", mok_last_error());
  bwd_gpu_inputs(&g, &p);
  cudaStream_t s;
  MOK_REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  MOK_REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
  const mokResult_t r = bwd_gpu_run(&g, &p, s);
  const cudaError_t ce = cudaStreamEndCapture(s, &graph);
  MOK_REQUIRE_MSG(r == MOK_SUCCESS, "forward + backward under capture: %s", mok_last_error());
  MOK_REQUIRE_MSG(ce == cudaSuccess, "cudaStreamEndCapture: %s", cudaGetErrorString(ce));
  MOK_REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  const test_route_t routes[2] = {{0.2, 0, -1}, {0.0, 0, 4}};
  for (int i = 0; i < 2; i++) {
    fwd_route(&p.f, routes[i]);
    bwd_gpu_inputs(&g, &p);
    MOK_EXPECT(cudaGraphLaunch(exec, s) == cudaSuccess);
    MOK_EXPECT(cudaStreamSynchronize(s) == cudaSuccess);
    MOK_EXPECT_MSG(mok_layer_check(g.f.l) == MOK_SUCCESS, "%s", mok_last_error());
    bwd_out_t og, od;
    bwd_gpu_outputs(&g, &p, &og);
    bwd_gpu_inputs(&g, &p);
    MOK_EXPECT_MSG(bwd_gpu_run(&g, &p, 0) == MOK_SUCCESS, "%s", mok_last_error());
    bwd_gpu_outputs(&g, &p, &od);
    MOK_EXPECT_MSG(bwd_same(&og, &od), "%s backward: graph replay %d differs from the direct "
                   "calls (%s)", path == MOK_BACKWARD_FUSED ? "fused" : "chain", i,
                   bwd_diff(&p, &og, &od).c_str());
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  bwd_gpu_close(&g);
}

MOK_TEST(bwd_gpu_cuda_graph_replays_with_new_routing) {
  NEED_GPU();
  graph_case(MOK_BACKWARD_CHAIN);
  graph_case(MOK_BACKWARD_FUSED);
}

/* ---------------------------------------------------------------------------------------------- */
/* The fused backward kernel against the chain                                                     */
/* ---------------------------------------------------------------------------------------------- */

// p's forward + backward on a layer of its own with backward_path `path` and backward_sms `sms`
// (the fused kernel's CTAs), the gradients into o. 1 when every call and check succeeded.
static int bwd_run_path(bwd_problem_t *p, mok_backward_path_t path, int sms, bwd_out_t *o) {
  bwd_gpu_t g;
  if (!bwd_gpu_open(&g, p)) {
    MOK_EXPECT_MSG(0, "creating the layer: %s", mok_last_error());
    return 0;
  }
  mok_tuning_t t;
  int ok = mok_layer_tuning(g.f.l, &t) == MOK_SUCCESS;
  t.backward_path = path, t.backward_sms = sms;
  ok = ok && mok_layer_set_tuning(g.f.l, &t) == MOK_SUCCESS;
  if (ok) {
    bwd_gpu_inputs(&g, p);
    ok = bwd_gpu_run(&g, p, 0) == MOK_SUCCESS && mok_layer_check(g.f.l) == MOK_SUCCESS;
  }
  MOK_EXPECT_MSG(ok, "%s backward: %s", path == MOK_BACKWARD_CHAIN ? "chain" : "fused",
                 mok_last_error());
  if (ok) bwd_gpu_outputs(&g, p, o);
  bwd_gpu_close(&g);
  return ok;
}

// The fused kernel gives the chain's bits (dx, dtopk_w, every weight gradient) whatever its grid.
static void fused_case(int64_t H, int64_t I, int64_t E, int64_t K, int64_t Is, int64_t T,
                       test_route_t route, mok_wgrad_dtype_t wdt, int accumulate,
                       mok_context_mode_t mode, const char *what) {
  bwd_problem_t p;
  bwd_problem_init(&p, H, I, E, K, Is, T, T);
  fwd_route(&p.f, route);
  bwd_set_wgrad(&p, wdt, accumulate);
  p.f.mode = mode;
  bwd_out_t chain;
  if (!bwd_run_path(&p, MOK_BACKWARD_CHAIN, 0, &chain)) return;
  const int grids[3] = {0, 7, 1};
  for (int i = 0; i < 3; i++) {
    bwd_out_t fused;
    if (!bwd_run_path(&p, MOK_BACKWARD_FUSED, grids[i], &fused)) continue;
    MOK_EXPECT_MSG(bwd_same(&fused, &chain), "%s: the fused backward on %d CTAs differs from the "
                   "chain (%s)", what, grids[i], bwd_diff(&p, &fused, &chain).c_str());
  }
}

MOK_TEST(bwd_gpu_fused_equals_chain_bitwise) {
  NEED_GPU();
  const test_route_t empty_experts = {0.0, (1u << 0) | (1u << 3) | (1u << 6), -1};
  const test_route_t one_expert = {0.0, 0, 5}, all_empty = {1.0, 0, -1}, full = {0.0, 0, -1};
  const mok_wgrad_dtype_t F = MOK_WGRAD_FP32, B = MOK_WGRAD_BF16;
  const mok_context_mode_t S = MOK_CONTEXT_SAVE, RC = MOK_CONTEXT_RECOMPUTE;
  fused_case(256, 128, 8, 2, 0, 100, plain_route, F, 0, S, "I=128");
  fused_case(512, 256, 16, 4, 128, 1000, plain_route, F, 0, S, "H=512 I=256 E=16 Is=128 T=1000");
  fused_case(512, 256, 16, 4, 128, 1000, plain_route, B, 0, S, "bf16 weight gradients");
  fused_case(512, 256, 16, 4, 128, 1000, plain_route, F, 1, S, "fp32, accumulated");
  fused_case(256, 384, 8, 2, 128, 300, empty_experts, F, 0, RC, "empty experts, RECOMPUTE");
  fused_case(256, 128, 8, 2, 128, 300, one_expert, B, 0, S, "every token to expert 5");
  fused_case(256, 128, 8, 2, 128, 100, all_empty, F, 0, S, "every slot -1");
  fused_case(384, 128, 8, 8, 0, 700, full, F, 0, S, "H=384 K=8 T=700");
  fused_case(256, 128, 8, 2, 128, 257, full, F, 1, S, "T=257, accumulated");
}

/* ---------------------------------------------------------------------------------------------- */
/* Contexts that do not match                                                                      */
/* ---------------------------------------------------------------------------------------------- */

// A backward whose context does not match: mok_backward succeeds (the check runs on the device),
// mok_layer_check reports CONTEXT_MISMATCH with `msg`, dx and dtopk_w keep their poison, the
// overwritten (fp32) weight gradients are zeros, and a second check reports nothing.
static void expect_mismatch(bwd_gpu_t *g, const bwd_problem_t *p, int64_t T, const void *ctx,
                            const char *msg) {
  const fwd_problem_t &f = p->f;
  cudaMemset(g->dx, 0x5A, (size_t)(f.T_max * f.H) * 2);
  cudaMemset(g->dtw, 0x5A, (size_t)(f.T_max * f.K) * 4);
  MOK_EXPECT_MSG(bwd_gpu_backward(g, p, T, ctx, 0) == MOK_SUCCESS, "%s", mok_last_error());
  const mokResult_t r = mok_layer_check(g->f.l);
  MOK_EXPECT_MSG(r == MOK_ERROR_CONTEXT_MISMATCH, "mok_layer_check returned %d (%s), expected "
                 "CONTEXT_MISMATCH", (int)r, mok_layer_last_error(g->f.l));
  MOK_EXPECT_MSG(strstr(mok_layer_last_error(g->f.l), msg) != NULL, "message \"%s\" lacks \"%s\"",
                 mok_layer_last_error(g->f.l), msg);
  std::vector<uint8_t> dx((size_t)(f.T_max * f.H) * 2), dtw((size_t)(f.T_max * f.K) * 4);
  cudaMemcpy(dx.data(), g->dx, dx.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(dtw.data(), g->dtw, dtw.size(), cudaMemcpyDeviceToHost);
  const size_t touched =
      test_bytes_not(dx.data(), dx.size(), 0x5A) + test_bytes_not(dtw.data(), dtw.size(), 0x5A);
  MOK_EXPECT_MSG(touched == 0, "%zu bytes of dx, dtopk_w written by a backward with a context "
                 "that does not match", touched);
  std::vector<float> dwg((size_t)bwd_w_elems(p, 0));
  cudaMemcpy(dwg.data(), g->dw[0], dwg.size() * 4, cudaMemcpyDeviceToHost);
  int64_t nonzero = 0;
  for (size_t i = 0; i < dwg.size(); i++) nonzero += dwg[i] != 0.0f;
  MOK_EXPECT_MSG(nonzero == 0, "%lld elements of dwg not zeroed", (long long)nonzero);
  MOK_EXPECT_MSG(mok_layer_check(g->f.l) == MOK_SUCCESS, "the error was not cleared: %s",
                 mok_last_error());
}

MOK_TEST(bwd_gpu_context_mismatch_reported_by_check) {
  NEED_GPU();
  bwd_problem_t p;
  bwd_problem_init(&p, 256, 128, 8, 2, 128, 100, 100);
  const std::vector<int32_t> good = p.f.idx;
  bwd_gpu_t g, other;
  MOK_REQUIRE(bwd_gpu_open(&g, &p));
  MOK_REQUIRE(bwd_gpu_open(&other, &p));
  bwd_gpu_inputs(&g, &p);
  MOK_REQUIRE(test_gpu_layer_forward(&g.f, p.f.T, 0) == MOK_SUCCESS);
  MOK_REQUIRE_MSG(mok_layer_check(g.f.l) == MOK_SUCCESS, "%s", mok_last_error());

  // Other routing than the forward's: one slot moved to an expert the token does not use.
  int32_t *row = &p.f.idx[5 * 2];
  int32_t e = (row[0] + 1) % 8;
  while (e == row[0] || e == row[1]) e = (e + 1) % 8;
  row[1] = e;
  cudaMemcpy(g.f.idx, p.f.idx.data(), p.f.idx.size() * 4, cudaMemcpyHostToDevice);
  expect_mismatch(&g, &p, p.f.T, NULL, "other topk_idx");
  p.f.idx = good;
  cudaMemcpy(g.f.idx, p.f.idx.data(), p.f.idx.size() * 4, cudaMemcpyHostToDevice);

  expect_mismatch(&g, &p, p.f.T - 1, NULL, "other number of tokens");

  // The context of another layer (same shapes, same inputs).
  bwd_gpu_inputs(&other, &p);
  MOK_REQUIRE(test_gpu_layer_forward(&other.f, p.f.T, 0) == MOK_SUCCESS);
  cudaDeviceSynchronize();
  expect_mismatch(&g, &p, p.f.T, other.f.ctx, "another layer wrote it");

  // The context of a forward that met bad routing.
  p.f.idx[3 * 2 + 1] = 8;
  bwd_gpu_inputs(&g, &p);
  MOK_EXPECT(test_gpu_layer_forward(&g.f, p.f.T, 0) == MOK_SUCCESS);
  MOK_EXPECT(mok_layer_check(g.f.l) == MOK_ERROR_INVALID_ROUTING);
  expect_mismatch(&g, &p, p.f.T, NULL, "did not complete");
  p.f.idx = good;

  // A good call afterwards computes normally.
  bwd_check_against_cpu(&g, &p, "good call after mismatches");
  bwd_gpu_close(&other);
  bwd_gpu_close(&g);
}

// Backward reads routing and g, u from the context, not from the workspace: a forward of other
// routing between this call's forward and its backward changes nothing.
MOK_TEST(bwd_gpu_uses_the_context_not_the_last_forward) {
  NEED_GPU();
  bwd_problem_t p;
  bwd_problem_init(&p, 256, 128, 8, 2, 128, 100, 100);
  bwd_gpu_t g;
  MOK_REQUIRE(bwd_gpu_open(&g, &p));
  bwd_gpu_inputs(&g, &p);
  MOK_REQUIRE(test_gpu_layer_forward(&g.f, p.f.T, 0) == MOK_SUCCESS);
  void *ctx2 = NULL;
  MOK_REQUIRE(cudaMalloc(&ctx2, g.f.ctx_bytes) == cudaSuccess);
  cudaMemcpy(ctx2, g.f.ctx, g.f.ctx_bytes, cudaMemcpyDeviceToDevice);  // this call's context
  bwd_problem_t q = p;
  const test_route_t hot = {0.0, 0, 2};
  fwd_route(&q.f, hot);
  fwd_gpu_inputs(&g.f, &q.f);
  MOK_REQUIRE(test_gpu_layer_forward(&g.f, q.f.T, 0) == MOK_SUCCESS);  // another forward in between
  fwd_gpu_inputs(&g.f, &p.f);                                   // back to this call's inputs
  MOK_REQUIRE(bwd_gpu_backward(&g, &p, p.f.T, ctx2, 0) == MOK_SUCCESS);
  MOK_EXPECT_MSG(mok_layer_check(g.f.l) == MOK_SUCCESS, "%s", mok_last_error());
  bwd_out_t gpu, ref;
  bwd_gpu_outputs(&g, &p, &gpu);
  MOK_REQUIRE_MSG(cpu_backward(&p, &ref) == MOK_SUCCESS, "%s", mok_last_error());
  MOK_EXPECT(bwd_compare_all("forward of other routing in between", &p, &gpu, &ref));
  cudaFree(ctx2);
  bwd_gpu_close(&g);
}

/* ---------------------------------------------------------------------------------------------- */
/* Kernels on their own                                                                            */
/* ---------------------------------------------------------------------------------------------- */

// The SwiGLU backward kernel against the same formulas on the host (libm's expf against CUDA's,
// each within 2 ulp of exp, so a, dg, du may differ by one bf16 ulp and dw_row by a few fp32 ulp
// of Σ|ds s|); rows outside [offsets[0], offsets[G]) are not written. With e4m3 outputs (fp8-block
// layers) dg and du's blocks are the quantizer's, bit for bit.
MOK_TEST(bwd_gpu_swiglu_backward_kernel_matches_host) {
  NEED_GPU();
  const int64_t M = 40, N = 256, G = 3;
  const std::vector<int32_t> offs = {3, 10, 10, 37};  // group 1 empty; rows 0-2, 37-39 outside
  std::vector<uint16_t> g((size_t)(M * N)), u((size_t)(M * N));
  fill_bf16(g, 6.0f);
  fill_bf16(u, 2.0f);
  g[5 * N + 7] = f2bf(-100.0f);  // e^-g = inf: silu = -0, sig = 0
  std::vector<float> ds((size_t)(M * N)), w((size_t)M);
  for (auto &v : ds) v = rnd_unit();
  for (auto &v : w) v = 0.5f + 0.5f * rnd_unit();
  uint16_t *dg_ = to_dev(g), *du_ = to_dev(u), *o_a = NULL, *o_dg = NULL, *o_du = NULL;
  float *d_ds = to_dev(ds), *d_w = to_dev(w), *d_dw = NULL;
  int32_t *d_off = to_dev(offs);
  cudaMalloc(&o_a, (size_t)(M * N) * 2);
  cudaMalloc(&o_dg, (size_t)(M * N) * 2);
  cudaMalloc(&o_du, (size_t)(M * N) * 2);
  cudaMalloc(&d_dw, (size_t)M * 4);
  MOK_REQUIRE(dg_ && du_ && d_ds && d_w && d_off && o_a && o_dg && o_du && d_dw);
  cudaMemset(o_a, 0x5A, (size_t)(M * N) * 2);
  cudaMemset(o_dg, 0x5A, (size_t)(M * N) * 2);
  cudaMemset(o_du, 0x5A, (size_t)(M * N) * 2);
  cudaMemset(d_dw, 0x5A, (size_t)M * 4);
  mok_bwd_swiglu_params_t p;
  memset(&p, 0, sizeof(p));
  p.num_groups = G, p.m_total = M, p.n = N, p.offsets = d_off;
  p.g = dg_, p.u = du_, p.ds = d_ds, p.row_w = d_w;
  p.a = o_a, p.dg = o_dg, p.du = o_du, p.dw_row = d_dw;
  MOK_REQUIRE_MSG(mok_bwd_swiglu_launch(&p, NULL) == MOK_SUCCESS, "%s", mok_last_error());
  MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<uint16_t> a((size_t)(M * N)), dg((size_t)(M * N)), du((size_t)(M * N));
  std::vector<float> dw((size_t)M);
  cudaMemcpy(a.data(), o_a, a.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(dg.data(), o_dg, dg.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(du.data(), o_du, du.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(dw.data(), d_dw, dw.size() * 4, cudaMemcpyDeviceToHost);
  int64_t bad = 0, untouched_bad = 0;
  for (int64_t r = 0; r < M; r++) {
    if (r < offs[0] || r >= offs[G]) {
      for (int64_t i = 0; i < N; i++)
        untouched_bad += a[r * N + i] != 0x5A5A || dg[r * N + i] != 0x5A5A || du[r * N + i] != 0x5A5A;
      uint32_t bits;
      memcpy(&bits, &dw[r], 4);
      untouched_bad += bits != 0x5A5A5A5Au;
      continue;
    }
    float lane[32] = {0}, mag = 0;
    for (int64_t i = 0; i < N; i++) {
      const float gf = bf2f(g[r * N + i]), uf = bf2f(u[r * N + i]), d = ds[r * N + i];
      const float den = 1.0f + expf(-gf), silu = gf / den, sig = 1.0f / den, s = silu * uf;
      const float da = w[r] * d, dsl = sig * (1.0f + gf * (1.0f - sig));
      const float ref[3] = {w[r] * s, da * uf * dsl, da * silu};
      const uint16_t got[3] = {a[r * N + i], dg[r * N + i], du[r * N + i]};
      for (int j = 0; j < 3; j++) {
        const float e = bf2f(f2bf(ref[j]));
        bad += !(fabsf(bf2f(got[j]) - e) <= fabsf(e) / 128 + 1e-30f);
      }
      lane[(i / 4) % 32] = fmaf(d, s, lane[(i / 4) % 32]);
      mag += fabsf(d * s);
    }
    for (int o = 16; o > 0; o >>= 1)
      for (int q = 0; q < 32; q++)
        if (!(q & o)) lane[q] += lane[q + o];
    bad += !(fabsf(dw[r] - lane[0]) <= 1e-5f * mag);
  }
  MOK_EXPECT_MSG(bad == 0, "%lld values differ from the host beyond one bf16 ulp", (long long)bad);
  MOK_EXPECT_MSG(untouched_bad == 0, "%lld values written outside the groups", (long long)untouched_bad);

  // fp8-block layers: the same launch also quantizing dg and du. The bf16 outputs do not change,
  // and the e4m3 bytes and scales are bit for bit the quantizer's (mok_quantize_launch, 1x128
  // blocks, K-block-major scales) of those bf16 dg and du, for both scale kinds; rows outside the
  // groups are not written. Row 5's block 0 holds the -0 of g = -100 (silu = -0).
  const int64_t ld = M + 4, nb = N / 128;
  uint8_t *q_g = NULL, *q_u = NULL, *ref_q = NULL;
  float *q_s = NULL, *ref_s = NULL;
  cudaMalloc(&q_g, (size_t)(M * N));
  cudaMalloc(&q_u, (size_t)(M * N));
  cudaMalloc(&ref_q, (size_t)(M * N));
  cudaMalloc(&q_s, (size_t)(2 * nb * ld) * 4);
  cudaMalloc(&ref_s, (size_t)(2 * nb * ld) * 4);
  MOK_REQUIRE(q_g && q_u && ref_q && q_s && ref_s);
  const mok_quant_scale_t kinds[2] = {MOK_QUANT_FP32_SCALE, MOK_QUANT_POW2_SCALE};
  for (int kk = 0; kk < 2; kk++) {
    cudaMemset(q_g, 0x5A, (size_t)(M * N));
    cudaMemset(q_u, 0x5A, (size_t)(M * N));
    cudaMemset(q_s, 0x5A, (size_t)(2 * nb * ld) * 4);
    mok_bwd_swiglu_params_t pq = p;
    pq.dgq = q_g, pq.duq = q_u, pq.q_scales = q_s, pq.q_ld = ld, pq.q_kind = kinds[kk];
    MOK_REQUIRE_MSG(mok_bwd_swiglu_launch(&pq, NULL) == MOK_SUCCESS, "%s", mok_last_error());
    MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<uint16_t> dg2((size_t)(M * N)), du2((size_t)(M * N));
    cudaMemcpy(dg2.data(), o_dg, dg2.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(du2.data(), o_du, du2.size() * 2, cudaMemcpyDeviceToHost);
    MOK_EXPECT_MSG(dg2 == dg && du2 == du, "kind %d: quantizing changed the bf16 dg, du", kk);
    std::vector<uint8_t> got_q((size_t)(M * N)), want_q((size_t)(M * N));
    std::vector<float> got_s((size_t)(2 * nb * ld)), want_s((size_t)(nb * ld));
    cudaMemcpy(got_s.data(), q_s, got_s.size() * 4, cudaMemcpyDeviceToHost);
    int64_t qbad = 0, qkept = 0;
    for (int which = 0; which < 2; which++) {
      mok_quantize_params_t qp;
      memset(&qp, 0, sizeof(qp));
      qp.in = which ? (const void *)o_du : (const void *)o_dg;
      qp.count = 1, qp.rows = M, qp.cols = N, qp.block_rows = 1, qp.block_cols = 128;
      qp.kind = kinds[kk], qp.q = ref_q, qp.scales = ref_s, qp.scales_ld = ld;
      MOK_REQUIRE_MSG(mok_quantize_launch(&qp, NULL) == MOK_SUCCESS, "%s", mok_last_error());
      MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      cudaMemcpy(want_q.data(), ref_q, want_q.size(), cudaMemcpyDeviceToHost);
      cudaMemcpy(want_s.data(), ref_s, want_s.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(got_q.data(), which ? q_u : q_g, got_q.size(), cudaMemcpyDeviceToHost);
      for (int64_t r = 0; r < M; r++) {
        const bool in = r >= offs[0] && r < offs[G];
        for (int64_t i = 0; i < N; i++) {
          const uint8_t gq = got_q[r * N + i];
          if (in) qbad += gq != want_q[r * N + i];
          else qkept += gq != 0x5A;
        }
        for (int64_t b = 0; b < nb; b++) {
          uint32_t gb, wb;
          memcpy(&gb, &got_s[(which * nb + b) * ld + r], 4);
          memcpy(&wb, &want_s[b * ld + r], 4);
          if (in) qbad += gb != wb;
          else qkept += gb != 0x5A5A5A5Au;
        }
      }
    }
    MOK_EXPECT_MSG(qbad == 0, "kind %d: %lld e4m3 bytes or scales differ from the quantizer's", kk,
                   (long long)qbad);
    MOK_EXPECT_MSG(qkept == 0, "kind %d: %lld e4m3 bytes or scales written outside the groups",
                   kk, (long long)qkept);
  }
  mok_bwd_swiglu_params_t bad_q = p;
  bad_q.dgq = q_g, bad_q.duq = q_u, bad_q.q_scales = q_s, bad_q.q_ld = M - 1;
  MOK_EXPECT(mok_bwd_swiglu_launch(&bad_q, NULL) == MOK_ERROR_INVALID_VALUE);
  bad_q.q_ld = ld, bad_q.duq = NULL;
  MOK_EXPECT(mok_bwd_swiglu_launch(&bad_q, NULL) == MOK_ERROR_NULL_POINTER);
  void *qbufs[] = {q_g, q_u, ref_q, q_s, ref_s};
  for (size_t i = 0; i < sizeof(qbufs) / sizeof(qbufs[0]); i++) cudaFree(qbufs[i]);
  void *bufs[] = {dg_, du_, o_a, o_dg, o_du, d_ds, d_w, d_dw, d_off};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) cudaFree(bufs[i]);
}

// bf16(fp32(old) + g) and bf16(g) are exact IEEE operations: bitwise equal to the host.
MOK_TEST(bwd_gpu_wgrad_store_bf16_is_exact) {
  NEED_GPU();
  const int64_t n = 4096 + 8;
  std::vector<float> g((size_t)n);
  for (auto &v : g) v = 3.0f * rnd_unit();
  std::vector<uint16_t> old((size_t)n);
  fill_bf16(old, 2.0f);
  float *d_g = to_dev(g);
  uint16_t *d_o = to_dev(old);
  MOK_REQUIRE(d_g && d_o);
  for (int acc = 1; acc >= 0; acc--) {  // accumulate onto old first, then overwrite
    MOK_REQUIRE_MSG(mok_bwd_wgrad_store_bf16_launch(d_g, d_o, n, acc, NULL) == MOK_SUCCESS, "%s",
                    mok_last_error());
    std::vector<uint16_t> out((size_t)n);
    cudaMemcpy(out.data(), d_o, out.size() * 2, cudaMemcpyDeviceToHost);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += out[i] != f2bf(acc ? bf2f(old[i]) + g[i] : g[i]);
    MOK_EXPECT_MSG(bad == 0, "%lld of %lld differ (accumulate = %d)", (long long)bad, (long long)n, acc);
  }
  MOK_EXPECT(mok_bwd_wgrad_store_bf16_launch(d_g, d_o, 12, 0, NULL) == MOK_ERROR_INVALID_SHAPE);
  cudaFree(d_g);
  cudaFree(d_o);
}
