/*
 * test_fp8_layer.cu: fp8-block GPU layers with W = 1 (src/gpu/forward.c's gpu_forward_fp8 and the
 * fp8 steps of src/gpu/backward.c) against the CPU layer's fp8-block path on the same inputs and
 * the same quantized weights (mok_quantize_weights on each side: byte for byte the same buffer,
 * test_quantize.cu), in both scale roundings (fp32 and power-of-two scales): y, dx, dtopk_w and
 * every weight gradient; routing edge cases; bitwise run-to-run determinism; RECOMPUTE equal to
 * SAVE bitwise; and what such a layer refuses. Every test skips without a GPU.
 *
 * Tolerance: the BF16 layers' (forward_test_util.cuh, backward_test_util.cuh), element by
 * element against the magnitude M of the element's outermost sum. Why it carries over: the GPU
 * and the reference quantize the same values the same way (the quantizers are bit-exact), so they
 * differ only where an activation entering a quantizer already differed: a bf16 a, dg or du one
 * ulp apart (the reasons of the BF16 tolerance). Such a flip moves that element's e4m3 value by at
 * most one e4m3 step (2^-3 of it) when it crosses a rounding boundary, and when it is its block's
 * largest it moves the block's scale by 2^-8, which moves every other element of the block by at
 * most 2^-8 of itself plus, where one crosses a boundary, one step; across the reduction that is
 * one term's 2^-3 (of I >= 128 terms: inside atol = 2^-7 rms) plus 2^-8 of the block's share of M:
 * inside rtol · M = 2^-7 M. The weight gradients read the unquantized bf16 rows, exactly as in
 * BF16. The worst element is printed with its ratio to the bound.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "backward_test_util.cuh"

#define NEED_GPU() \
  if (!test_gpu_present()) MOK_SKIP("no CUDA device")

static const char *scale_name(mok_fp8_scale_t s) { return s == MOK_FP8_SCALE_POW2 ? "pow2" : "fp32"; }

static void fp8_set(fwd_problem_t *f, mok_fp8_scale_t scale) {
  f->prec = MOK_PRECISION_FP8_BLOCK;
  f->fp8_scale = scale;
}

/* ---------------------------------------------------------------------------------------------- */
/* Forward                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

static void fwd_case(int64_t H, int64_t I, int64_t Is, int64_t K, int64_t T, test_route_t route,
                     mok_fp8_scale_t scale, mok_context_mode_t mode, const char *what) {
  fwd_problem_t p;
  fwd_problem_init(&p, H, I, 8, K, Is, T, T > 0 ? T : 16);
  fwd_route(&p, route);
  fp8_set(&p, scale);
  p.mode = mode;
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  char name[160];
  snprintf(name, sizeof(name), "fp8-block %s %s %s", scale_name(scale),
           mode == MOK_CONTEXT_SAVE ? "SAVE" : "RECOMPUTE", what);
  fwd_check_against_cpu(&g, &p, name);
  test_gpu_layer_close(&g);
}

MOK_TEST(fp8_gpu_forward_matches_cpu) {
  NEED_GPU();
  const test_route_t r = {0.1, 0, -1};
  for (int s = 0; s < 2; s++) {
    const mok_fp8_scale_t sc = s ? MOK_FP8_SCALE_POW2 : MOK_FP8_SCALE_FP32;
    fwd_case(256, 128, 0, 2, 100, r, sc, MOK_CONTEXT_SAVE, "I=128");
    fwd_case(256, 256, 128, 2, 100, r, sc, MOK_CONTEXT_SAVE, "I=256 Is=128");
    fwd_case(384, 384, 256, 4, 300, r, sc, MOK_CONTEXT_RECOMPUTE, "H=384 I=384 Is=256 K=4");
  }
}

MOK_TEST(fp8_gpu_forward_routing_edge_cases) {
  NEED_GPU();
  const test_route_t empty_experts = {0.0, (1u << 0) | (1u << 3) | (1u << 6), -1};
  const test_route_t one_expert = {0.0, 0, 5};
  const test_route_t many_empty = {0.45, 0, -1};
  const test_route_t all_empty = {1.0, 0, -1};
  fwd_case(256, 128, 128, 2, 100, empty_experts, MOK_FP8_SCALE_FP32, MOK_CONTEXT_SAVE, "empty experts");
  fwd_case(256, 128, 128, 2, 100, one_expert, MOK_FP8_SCALE_FP32, MOK_CONTEXT_SAVE, "one expert");
  fwd_case(256, 128, 128, 3, 100, many_empty, MOK_FP8_SCALE_FP32, MOK_CONTEXT_SAVE, "-1 slots");
  fwd_case(256, 128, 128, 2, 100, all_empty, MOK_FP8_SCALE_FP32, MOK_CONTEXT_SAVE, "all -1");
  fwd_case(256, 128, 128, 2, 1, many_empty, MOK_FP8_SCALE_FP32, MOK_CONTEXT_SAVE, "T=1");
}

// The layer really runs in fp8: y is within e4m3 accuracy of the BF16 layer's, and not equal.
MOK_TEST(fp8_gpu_forward_differs_from_bf16_within_e4m3) {
  NEED_GPU();
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 256, 8, 2, 128, 200, 200);
  std::vector<uint16_t> y[2];
  for (int q = 0; q < 2; q++) {
    if (q) fp8_set(&p, MOK_FP8_SCALE_FP32);
    test_gpu_layer_t g;
    MOK_REQUIRE(fwd_gpu_open(&g, &p));
    fwd_gpu_inputs(&g, &p);
    MOK_REQUIRE_MSG(test_gpu_layer_forward(&g, p.T, NULL) == MOK_SUCCESS, "%s", mok_last_error());
    MOK_REQUIRE_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
    y[q] = fwd_gpu_y(&g, p.T, p.H);
    test_gpu_layer_close(&g);
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < y[0].size(); i++) {
    const double a = bf2f(y[1][i]), b = bf2f(y[0][i]);
    num += (a - b) * (a - b);
    den += b * b;
  }
  const double rel = sqrt(num / den);
  printf("    fp8-block against BF16: relative L2 difference of y %.4f\n", rel);
  // e4m3 keeps 4 significant bits: a relative rounding error up to 2^-4 per operand, about
  // 2^-4 / sqrt(3) rms each, of x, the weights and a, so some 5% of y; 0 would mean no quantization
  MOK_EXPECT_MSG(rel > 0.005 && rel < 0.15, "relative difference %.4f", rel);
}

/* ---------------------------------------------------------------------------------------------- */
/* Backward                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static void bwd_case(int64_t I, int64_t Is, int64_t K, int64_t T, test_route_t route,
                     mok_fp8_scale_t scale, mok_wgrad_dtype_t wdt, int accumulate,
                     mok_context_mode_t mode, const char *what) {
  bwd_problem_t p;
  bwd_problem_init(&p, 256, I, 8, K, Is, T, T > 0 ? T : 16);
  fwd_route(&p.f, route);
  fp8_set(&p.f, scale);
  p.f.mode = mode;
  bwd_set_wgrad(&p, wdt, accumulate);
  bwd_gpu_t g;
  MOK_REQUIRE(bwd_gpu_open(&g, &p));
  char name[160];
  snprintf(name, sizeof(name), "fp8-block %s %s %s", scale_name(scale),
           mode == MOK_CONTEXT_SAVE ? "SAVE" : "RECOMPUTE", what);
  bwd_check_against_cpu(&g, &p, name);
  bwd_gpu_close(&g);
}

MOK_TEST(fp8_gpu_backward_matches_cpu) {
  NEED_GPU();
  const test_route_t r = {0.1, 0, -1};
  for (int s = 0; s < 2; s++) {
    const mok_fp8_scale_t sc = s ? MOK_FP8_SCALE_POW2 : MOK_FP8_SCALE_FP32;
    bwd_case(128, 0, 2, 100, r, sc, MOK_WGRAD_FP32, 0, MOK_CONTEXT_SAVE, "I=128");
    bwd_case(256, 128, 2, 100, r, sc, MOK_WGRAD_FP32, 0, MOK_CONTEXT_SAVE, "I=256 Is=128");
    bwd_case(256, 128, 4, 200, r, sc, MOK_WGRAD_BF16, 1, MOK_CONTEXT_SAVE,
             "I=256 Is=128 K=4 bf16 accumulated");
  }
  const test_route_t empty_experts = {0.3, (1u << 1) | (1u << 4), -1};
  bwd_case(128, 128, 2, 100, empty_experts, MOK_FP8_SCALE_FP32, MOK_WGRAD_FP32, 0,
           MOK_CONTEXT_SAVE, "empty experts, -1 slots");
}

// RECOMPUTE's gate/up replays the forward's fp8 GEMM on the same e4m3 rows: every gradient equals
// SAVE's bit for bit; two runs are bitwise equal; RECOMPUTE also against the CPU layer.
MOK_TEST(fp8_gpu_recompute_equals_save_and_runs_repeat_bitwise) {
  NEED_GPU();
  bwd_problem_t p;
  bwd_problem_init(&p, 256, 256, 8, 2, 128, 300, 300);
  fp8_set(&p.f, MOK_FP8_SCALE_FP32);
  bwd_out_t o[3];
  for (int m = 0; m < 2; m++) {
    p.f.mode = m ? MOK_CONTEXT_RECOMPUTE : MOK_CONTEXT_SAVE;
    bwd_gpu_t g;
    MOK_REQUIRE(bwd_gpu_open(&g, &p));
    bwd_gpu_inputs(&g, &p);
    MOK_REQUIRE_MSG(bwd_gpu_run(&g, &p, 0) == MOK_SUCCESS, "%s", mok_last_error());
    MOK_EXPECT_MSG(mok_layer_check(g.f.l) == MOK_SUCCESS, "%s", mok_last_error());
    bwd_gpu_outputs(&g, &p, &o[m]);
    if (m == 1) {
      bwd_gpu_inputs(&g, &p);  // poisoned again
      MOK_REQUIRE_MSG(bwd_gpu_run(&g, &p, 0) == MOK_SUCCESS, "%s", mok_last_error());
      bwd_gpu_outputs(&g, &p, &o[2]);
    }
    bwd_gpu_close(&g);
  }
  MOK_EXPECT_MSG(bwd_same(&o[0], &o[1]), "fp8-block RECOMPUTE differs from SAVE");
  MOK_EXPECT_MSG(bwd_same(&o[1], &o[2]), "fp8-block gradients differ between two runs");
  bwd_out_t ref;
  MOK_REQUIRE_MSG(cpu_backward(&p, &ref) == MOK_SUCCESS, "%s", mok_last_error());
  MOK_EXPECT(bwd_compare_all("fp8-block RECOMPUTE", &p, &o[1], &ref));
}

/* ---------------------------------------------------------------------------------------------- */
/* What an fp8-block GPU layer refuses                                                             */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(fp8_gpu_layer_refuses_unaligned_shapes_and_missing_weights) {
  NEED_GPU();
  mok_comm_t c = NULL;
  mok_layer_t l = NULL;
  MOK_REQUIRE(mok_comm_create_local(&c, 0) == MOK_SUCCESS);
  mok_layer_desc_t d = test_layer_desc(256, 192, 8, 2, 0, 64);  // I % 128 != 0
  d.precision = MOK_PRECISION_FP8_BLOCK;
  MOK_EXPECT(mok_layer_create(&l, c, &d) == MOK_ERROR_INVALID_SHAPE);
  MOK_EXPECT(strstr(mok_last_error(), "multiples of 128") != NULL);
  d.intermediate = 256;
  MOK_REQUIRE(mok_layer_create(&l, c, &d) == MOK_SUCCESS);
  size_t ws = 0, cb = 0;
  MOK_EXPECT(mok_layer_workspace_size(l, &ws) == MOK_SUCCESS && ws > 0);
  MOK_REQUIRE(mok_context_size(l, &cb) == MOK_SUCCESS);
  void *ctx = NULL;
  cudaMalloc(&ctx, cb);
  mok_forward_args_t a;
  memset(&a, 0, sizeof(a));  // bf16 weights would be ignored; the quantized buffer is missing
  MOK_EXPECT(mok_forward(l, &a, NULL, ctx, cb, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(strstr(mok_layer_last_error(l), "quantized") != NULL);
  cudaFree(ctx);
  mok_layer_destroy(l);
  mok_comm_destroy(c);
}
