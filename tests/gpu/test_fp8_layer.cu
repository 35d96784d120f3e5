/*
 * test_fp8_layer.cu: fp8-block GPU layers with W = 1 (src/gpu/forward.c's gpu_forward_fp8 and the
 * fp8 steps of src/gpu/backward.c), and MXFP8 layers (gpu_forward_mx, the MXFP8 steps of the
 * backward), against the CPU layer's fp8 paths on the same inputs and the same quantized weights
 * (mok_quantize_weights on each side: byte for byte the same buffer,
 * test_quantize_launch.cu), in both scale roundings (fp32 and power-of-two scales; MXFP8: E8M0): y, dx, dtopk_w and
 * every weight gradient; routing edge cases; bitwise run-to-run determinism; RECOMPUTE equal to
 * SAVE bitwise; and what such a layer refuses. Every test skips without a GPU.
 *
 * Two kinds of problems (why: below):
 *   grid    x, dy and the weights integers in [-4, 4] times powers of two, power-of-two scales:
 *           every e4m3 value is exact and the fp8 GEMMs that feed a quantizer (gate/up, ds) add
 *           exactly, so both sides quantize the same a, dg, du (to the rare flip of an
 *           elementwise function's last bit). Compared element by element with the BF16 layers'
 *           tolerance (forward_test_util.cuh, backward_test_util.cuh), whose reasons then hold.
 *   random  unit-scale inputs, both scale roundings: relative L2 error per tensor at most 2^-6.
 * Why two: Hopper's fp8 MMA adds the products of a 128-element block in an accumulator of about
 * 14 bits (the reason for promoting every 128; tests/gpu/test_gemm_fp8.cu), so g, u and ds carry
 * errors near 2^-14 of themselves that the reference's fp32 sums do not. Then about one bf16
 * rounding of a (dg, du) in 2^6 lands an ulp apart, and where that element is its 1x128 block's
 * largest, the block's scale moves by 2^-8 and some of its 128 e4m3 values re-round by one step
 * (2^-3 .. 2^-4 of themselves): a few per cent of that row's output, an error no bf16 argument
 * bounds. Measured on the H200 with random inputs: 0.4-2.5% of the elements of y and dx beyond the
 * BF16 tolerance, up to 6.5 of it, while the relative L2 errors stay below 2^-6 (printed).
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

// Integers in [-4, 4] times 2^e (bf16-exact).
static void grid_fill(std::vector<uint16_t> &v, int e) {
  for (auto &x : v) x = f2bf(ldexpf((float)lrint(4.0 * rnd_unit()), e));
}

// p as a grid problem (above): x = k 2^-2, weights k 2^-5, dy k 2^-3; power-of-two scales. The
// e4m3 values are then multiples of 64 up to 256, products of multiples of 4096 up to 2^16, and a
// 128-term block sum at most 2^23 in steps of 2^12: exact in any accumulator of 11 bits or more.
// MXFP8's 1x32 blocks of such values have the same power-of-two scales as 1x128 blocks (each
// block's amax is 4 times its power of two, or a block is all zeros) and the bf16 MMA on them is
// exact as well.
static void grid_problem(fwd_problem_t *p, std::vector<uint16_t> *dy,
                         mok_precision_t prec = MOK_PRECISION_FP8_BLOCK) {
  grid_fill(p->x, -2);
  std::vector<uint16_t> *w[6] = {&p->wg, &p->wu, &p->wd, &p->wsg, &p->wsu, &p->wsd};
  for (auto *v : w) grid_fill(*v, -5);
  if (dy) grid_fill(*dy, -3);
  p->prec = prec;
  p->fp8_scale = MOK_FP8_SCALE_POW2;
}

static void fp8_set(fwd_problem_t *f, mok_fp8_scale_t scale,
                    mok_precision_t prec = MOK_PRECISION_FP8_BLOCK) {
  f->prec = prec;
  f->fp8_scale = scale;
}

static const char *prec_name(mok_precision_t p) {
  return p == MOK_PRECISION_MXFP8 ? "MXFP8" : "fp8-block";
}

// ||gpu - ref|| / ||ref|| of n values; 0 when both are 0.
static double rel_l2(const std::vector<double> &gpu, const std::vector<double> &ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); i++) {
    num += (gpu[i] - ref[i]) * (gpu[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void expect_close(const char *what, const char *name, const std::vector<double> &gpu,
                         const std::vector<double> &ref) {
  const double e = rel_l2(gpu, ref);
  printf("    %s: %s relative L2 error %.3g\n", what, name, e);
  MOK_EXPECT_MSG(e <= 0x1p-6, "%s: %s relative L2 error %.3g against the CPU layer", what, name, e);
}

/* ---------------------------------------------------------------------------------------------- */
/* Forward                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

// y of one forward of p on a fresh GPU layer; 0 (with the failure recorded) if it did not run.
static int fwd_y(const fwd_problem_t *p, std::vector<uint16_t> *y) {
  test_gpu_layer_t g;
  if (!fwd_gpu_open(&g, p)) return 0;
  fwd_gpu_inputs(&g, p);
  mokResult_t r = test_gpu_layer_forward(&g, p->T, NULL);
  if (r == MOK_SUCCESS) r = mok_layer_check(g.l);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "forward: %s", mok_last_error());
  if (r == MOK_SUCCESS) *y = fwd_gpu_y(&g, p->T, p->H);
  test_gpu_layer_close(&g);
  return r == MOK_SUCCESS;
}

// A forward of shape (H, I, Is, K, T) with `route`: grid (element by element) or random
// inputs in `scale` (relative L2), in precision `prec` (fp8-block or MXFP8).
static void fwd_case(int grid, int64_t H, int64_t I, int64_t Is, int64_t K, int64_t T,
                     test_route_t route, mok_fp8_scale_t scale, mok_context_mode_t mode,
                     const char *what, mok_precision_t prec = MOK_PRECISION_FP8_BLOCK) {
  fwd_problem_t p;
  fwd_problem_init(&p, H, I, 8, K, Is, T, T > 0 ? T : 16);
  fwd_route(&p, route);
  if (grid) grid_problem(&p, NULL, prec);
  else fp8_set(&p, scale, prec);
  p.mode = mode;
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  char name[160];
  snprintf(name, sizeof(name), "%s %s %s %s %s", prec_name(prec), grid ? "grid" : "random",
           prec == MOK_PRECISION_MXFP8 ? "e8m0" : scale_name(p.fp8_scale),
           mode == MOK_CONTEXT_SAVE ? "SAVE" : "RECOMPUTE", what);
  if (grid) {
    fwd_check_against_cpu(&g, &p, name);
  } else {
    fwd_gpu_inputs(&g, &p);
    MOK_REQUIRE_MSG(test_gpu_layer_forward(&g, p.T, NULL) == MOK_SUCCESS, "%s", mok_last_error());
    MOK_REQUIRE_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
    std::vector<uint16_t> y = fwd_gpu_y(&g, p.T, p.H), ref;
    MOK_REQUIRE(cpu_forward(&p, p.T, p.x.data(), p.idx.data(), p.tw.data(), p.Is, p.T_max, &ref,
                            NULL) == MOK_SUCCESS);
    expect_close(name, "y", bf16_values(y.data(), y.size()), bf16_values(ref.data(), ref.size()));
  }
  test_gpu_layer_close(&g);
}

MOK_TEST(fp8_gpu_forward_matches_cpu) {
  NEED_GPU();
  const test_route_t r = {0.1, 0, -1};
  const mok_context_mode_t save = MOK_CONTEXT_SAVE, rec = MOK_CONTEXT_RECOMPUTE;
  for (int grid = 1; grid >= 0; grid--) {
    for (int s = 0; s < 2 - grid; s++) {  // grid problems have power-of-two scales
      const mok_fp8_scale_t sc = s ? MOK_FP8_SCALE_POW2 : MOK_FP8_SCALE_FP32;
      fwd_case(grid, 256, 128, 0, 2, 100, r, sc, save, "I=128");
      fwd_case(grid, 256, 256, 128, 2, 100, r, sc, save, "I=256 Is=128");
      fwd_case(grid, 384, 384, 256, 4, 300, r, sc, rec, "H=384 I=384 Is=256 K=4");
    }
  }
}

MOK_TEST(fp8_gpu_forward_routing_edge_cases) {
  NEED_GPU();
  const test_route_t empty_experts = {0.0, (1u << 0) | (1u << 3) | (1u << 6), -1};
  const test_route_t one_expert = {0.0, 0, 5};
  const test_route_t many_empty = {0.45, 0, -1};
  const test_route_t all_empty = {1.0, 0, -1};
  const mok_fp8_scale_t p2 = MOK_FP8_SCALE_POW2;
  const mok_context_mode_t save = MOK_CONTEXT_SAVE;
  fwd_case(1, 256, 128, 128, 2, 100, empty_experts, p2, save, "empty experts");
  fwd_case(1, 256, 128, 128, 2, 100, one_expert, p2, save, "one expert");
  fwd_case(1, 256, 128, 128, 3, 100, many_empty, p2, save, "-1 slots");
  fwd_case(1, 256, 128, 128, 2, 100, all_empty, p2, save, "all -1");
  fwd_case(1, 256, 128, 128, 2, 1, many_empty, p2, save, "T=1");
}

// The layer really runs in fp8: y is within e4m3 accuracy of the BF16 layer's, and not equal.
MOK_TEST(fp8_gpu_forward_differs_from_bf16_within_e4m3) {
  NEED_GPU();
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 256, 8, 2, 128, 200, 200);
  std::vector<uint16_t> y[2];
  for (int q = 0; q < 2; q++) {
    if (q) fp8_set(&p, MOK_FP8_SCALE_FP32);
    MOK_REQUIRE(fwd_y(&p, &y[q]));
  }
  const double rel = rel_l2(bf16_values(y[1].data(), y[1].size()), bf16_values(y[0].data(), y[0].size()));
  printf("    fp8-block against BF16: relative L2 difference of y %.4f\n", rel);
  // e4m3 keeps 4 significant bits: a relative rounding error up to 2^-4 per operand, about
  // 2^-4 / sqrt(3) rms each, of x, the weights and a, so some 5% of y; 0 would mean no quantization
  MOK_EXPECT_MSG(rel > 0.005 && rel < 0.15, "relative difference %.4f", rel);
}

/* ---------------------------------------------------------------------------------------------- */
/* MXFP8 forward (W = 1)                                                                           */
/* ---------------------------------------------------------------------------------------------- */
// The random problems' relative L2 bound is fp8-block's (above): MXFP8 has the same e4m3 values
// with finer blocks, and bf16 MMA on them (the products exact, fp32 sums) instead of fp8 MMA, so
// its differences from the reference's fp32 GEMMs are those of the BF16 layer plus the re-rounding
// of an e4m3 value wherever a bf16 a differs by an ulp.

MOK_TEST(mx_gpu_forward_matches_cpu) {
  NEED_GPU();
  const test_route_t r = {0.1, 0, -1};
  const mok_context_mode_t save = MOK_CONTEXT_SAVE, rec = MOK_CONTEXT_RECOMPUTE;
  const mok_precision_t mx = MOK_PRECISION_MXFP8;
  const mok_fp8_scale_t sc = MOK_FP8_SCALE_FP32;  // MXFP8 ignores it: E8M0 scales
  for (int grid = 1; grid >= 0; grid--) {
    fwd_case(grid, 256, 128, 0, 2, 100, r, sc, save, "I=128", mx);
    fwd_case(grid, 256, 256, 128, 2, 100, r, sc, save, "I=256 Is=128", mx);
    fwd_case(grid, 384, 384, 256, 4, 300, r, sc, rec, "H=384 I=384 Is=256 K=4", mx);
    fwd_case(grid, 512, 640, 128, 8, 700, r, sc, save, "H=512 I=640 K=8 T=700", mx);
  }
}

MOK_TEST(mx_gpu_forward_routing_edge_cases) {
  NEED_GPU();
  const test_route_t empty_experts = {0.0, (1u << 0) | (1u << 3) | (1u << 6), -1};
  const test_route_t one_expert = {0.0, 0, 5};
  const test_route_t many_empty = {0.45, 0, -1};
  const test_route_t all_empty = {1.0, 0, -1};
  const mok_fp8_scale_t sc = MOK_FP8_SCALE_FP32;
  const mok_context_mode_t save = MOK_CONTEXT_SAVE;
  const mok_precision_t mx = MOK_PRECISION_MXFP8;
  fwd_case(1, 256, 128, 128, 2, 100, empty_experts, sc, save, "empty experts", mx);
  fwd_case(1, 256, 128, 128, 2, 100, one_expert, sc, save, "one expert", mx);
  fwd_case(1, 256, 128, 128, 3, 100, many_empty, sc, save, "-1 slots", mx);
  fwd_case(1, 256, 128, 128, 2, 100, all_empty, sc, save, "all -1", mx);
  fwd_case(1, 256, 128, 128, 2, 1, many_empty, sc, save, "T=1", mx);
}

// Quantized, not bf16: y within e4m3 accuracy of the BF16 layer's and not equal to it; two runs
// and RECOMPUTE against SAVE bitwise equal.
MOK_TEST(mx_gpu_forward_differs_from_bf16_and_repeats_bitwise) {
  NEED_GPU();
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 256, 8, 2, 128, 200, 200);
  std::vector<uint16_t> y[4];
  for (int q = 0; q < 4; q++) {  // BF16, MXFP8 SAVE twice, MXFP8 RECOMPUTE
    if (q) p.prec = MOK_PRECISION_MXFP8;
    p.mode = q == 3 ? MOK_CONTEXT_RECOMPUTE : MOK_CONTEXT_SAVE;
    MOK_REQUIRE(fwd_y(&p, &y[q]));
  }
  const double rel = rel_l2(bf16_values(y[1].data(), y[1].size()), bf16_values(y[0].data(), y[0].size()));
  printf("    MXFP8 against BF16: relative L2 difference of y %.4f\n", rel);
  MOK_EXPECT_MSG(rel > 0.005 && rel < 0.15, "relative difference %.4f", rel);  // as fp8-block's
  MOK_EXPECT_MSG(y[1] == y[2], "MXFP8 y differs between two runs");
  MOK_EXPECT_MSG(y[1] == y[3], "MXFP8 y differs between SAVE and RECOMPUTE");
}

/* ---------------------------------------------------------------------------------------------- */
/* Backward                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static void bwd_case(int grid, int64_t I, int64_t Is, int64_t K, int64_t T, test_route_t route,
                     mok_fp8_scale_t scale, mok_wgrad_dtype_t wdt, int accumulate,
                     mok_context_mode_t mode, const char *what,
                     mok_precision_t prec = MOK_PRECISION_FP8_BLOCK) {
  bwd_problem_t p;
  bwd_problem_init(&p, 256, I, 8, K, Is, T, T > 0 ? T : 16);
  fwd_route(&p.f, route);
  if (grid) grid_problem(&p.f, &p.dy, prec);
  else fp8_set(&p.f, scale, prec);
  p.f.mode = mode;
  bwd_set_wgrad(&p, wdt, accumulate);
  bwd_gpu_t g;
  MOK_REQUIRE(bwd_gpu_open(&g, &p));
  char name[160];
  snprintf(name, sizeof(name), "%s %s %s %s %s", prec_name(prec), grid ? "grid" : "random",
           prec == MOK_PRECISION_MXFP8 ? "e8m0" : scale_name(p.f.fp8_scale),
           mode == MOK_CONTEXT_SAVE ? "SAVE" : "RECOMPUTE", what);
  if (grid) {
    bwd_check_against_cpu(&g, &p, name);
  } else {
    bwd_gpu_inputs(&g, &p);
    MOK_REQUIRE_MSG(bwd_gpu_run(&g, &p, 0) == MOK_SUCCESS, "%s", mok_last_error());
    MOK_REQUIRE_MSG(mok_layer_check(g.f.l) == MOK_SUCCESS, "%s", mok_last_error());
    bwd_out_t gpu, ref;
    bwd_gpu_outputs(&g, &p, &gpu);
    std::vector<uint8_t> gctx = fwd_gpu_ctx(&g.f);
    MOK_REQUIRE(cpu_backward(&p, &ref, mode == MOK_CONTEXT_SAVE ? &gctx : NULL) == MOK_SUCCESS);
    expect_close(name, "dx", bf16_values(gpu.dx.data(), gpu.dx.size()),
                 bf16_values(ref.dx.data(), ref.dx.size()));
    expect_close(name, "dtopk_w", std::vector<double>(gpu.dtw.begin(), gpu.dtw.end()),
                 std::vector<double>(ref.dtw.begin(), ref.dtw.end()));
    for (int i = 0; i < (Is > 0 ? BWD_NW : 3); i++)
      expect_close(name, bwd_w_name[i], bwd_w_values(&p, gpu.dw[i]), bwd_w_values(&p, ref.dw[i]));
  }
  bwd_gpu_close(&g);
}

MOK_TEST(fp8_gpu_backward_matches_cpu) {
  NEED_GPU();
  const test_route_t r = {0.1, 0, -1};
  const test_route_t empty_experts = {0.3, (1u << 1) | (1u << 4), -1};
  const mok_context_mode_t save = MOK_CONTEXT_SAVE, rec = MOK_CONTEXT_RECOMPUTE;
  for (int grid = 1; grid >= 0; grid--) {
    for (int s = 0; s < 2 - grid; s++) {
      const mok_fp8_scale_t sc = s ? MOK_FP8_SCALE_POW2 : MOK_FP8_SCALE_FP32;
      bwd_case(grid, 128, 0, 2, 100, r, sc, MOK_WGRAD_FP32, 0, save, "I=128");
      bwd_case(grid, 256, 128, 2, 100, r, sc, MOK_WGRAD_FP32, 0, save, "I=256 Is=128");
      bwd_case(grid, 256, 128, 4, 200, r, sc, MOK_WGRAD_BF16, 1, rec,
               "I=256 Is=128 K=4 bf16 accumulated");
      bwd_case(grid, 128, 128, 2, 100, empty_experts, sc, MOK_WGRAD_FP32, 0, save,
               "empty experts, -1 slots");
    }
  }
}

MOK_TEST(mx_gpu_backward_matches_cpu) {
  NEED_GPU();
  const test_route_t r = {0.1, 0, -1};
  const test_route_t empty_experts = {0.3, (1u << 1) | (1u << 4), -1};
  const mok_context_mode_t save = MOK_CONTEXT_SAVE, rec = MOK_CONTEXT_RECOMPUTE;
  const mok_fp8_scale_t sc = MOK_FP8_SCALE_FP32;
  const mok_precision_t mx = MOK_PRECISION_MXFP8;
  for (int grid = 1; grid >= 0; grid--) {
    bwd_case(grid, 128, 0, 2, 100, r, sc, MOK_WGRAD_FP32, 0, save, "I=128", mx);
    bwd_case(grid, 256, 128, 2, 100, r, sc, MOK_WGRAD_FP32, 0, rec, "I=256 Is=128", mx);
    bwd_case(grid, 256, 128, 4, 200, r, sc, MOK_WGRAD_BF16, 1, rec,
             "I=256 Is=128 K=4 bf16 accumulated", mx);
    bwd_case(grid, 128, 128, 2, 100, empty_experts, sc, MOK_WGRAD_FP32, 0, save,
             "empty experts, -1 slots", mx);
  }
}

// RECOMPUTE's gate/up replays the forward's fp8 GEMM on the same e4m3 rows (MXFP8: the same
// dequantized rows and MXFP8-B GEMM): every gradient equals SAVE's bit for bit; two runs are
// bitwise equal.
MOK_TEST(fp8_gpu_recompute_equals_save_and_runs_repeat_bitwise) {
  NEED_GPU();
  for (int m = 0; m < 2; m++) {
    const mok_precision_t prec = m ? MOK_PRECISION_MXFP8 : MOK_PRECISION_FP8_BLOCK;
    bwd_problem_t p;
    bwd_problem_init(&p, 256, 256, 8, 2, 128, 300, 300);
    fp8_set(&p.f, MOK_FP8_SCALE_FP32, prec);
    bwd_out_t o[3];
    MOK_REQUIRE(bwd_gpu_runs_in_mode(&p, MOK_CONTEXT_SAVE, 1, &o[0]));
    MOK_REQUIRE(bwd_gpu_runs_in_mode(&p, MOK_CONTEXT_RECOMPUTE, 2, &o[1]));  // o[1], o[2]
    MOK_EXPECT_MSG(bwd_same(&o[0], &o[1]), "%s RECOMPUTE differs from SAVE", prec_name(prec));
    MOK_EXPECT_MSG(bwd_same(&o[1], &o[2]), "%s gradients differ between two runs",
                   prec_name(prec));
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* What an fp8-block GPU layer refuses                                                             */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(fp8_gpu_layer_needs_its_quantized_weights) {
  NEED_GPU();
  mok_comm_t c = NULL;
  mok_layer_t l = NULL;
  MOK_REQUIRE(mok_comm_create_local(&c, 0) == MOK_SUCCESS);
  mok_layer_desc_t d = test_layer_desc(256, 256, 8, 2, 0, 64);
  d.precision = MOK_PRECISION_FP8_BLOCK;
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
