/*
 * forward_test_util.cuh: helpers of the GPU forward tests (test_forward.cu,
 * test_forward_fused.cu) on top of tests/support: random layer problems with controlled routing (this file's two random streams),
 * the CPU layer (the reference) and a GPU layer on the same inputs, and the tolerance of y with
 * its reason. Header-only, static.
 */
#ifndef MOK_TESTS_GPU_FORWARD_TEST_UTIL_CUH
#define MOK_TESTS_GPU_FORWARD_TEST_UTIL_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

extern "C" {
#include "cpu/layout.h" /* plain C header without its own extern "C" */
}
#include "../support/bf16.h"
#include "../support/compare.h"
#include "../support/gpu.h"
#include "../support/layer.h"
#include "../support/magnitude.h"
#include "../support/rng.h"
#include "api/internal.h"
#include "common/workspace.h"
#include "cuda/forward/forward.h"
#include "gemm_test_util.h"
#include "mok.h"

/* ---------------------------------------------------------------------------------------------- */
/* Problems                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
  int64_t T, T_max, H, I, E, K, Is;
  double capacity_factor;   // 0: automatic
  mok_context_mode_t mode;
  std::vector<uint16_t> x;  // [T_max, H] bf16 (rows past T unused)
  std::vector<uint16_t> wg, wu, wd, wsg, wsu, wsd;
  std::vector<int32_t> idx; // [T_max, K]
  std::vector<float> tw;    // [T_max, K]
  mok_precision_t prec;     // BF16 unless a test sets another
  mok_fp8_scale_t fp8_scale;
} fwd_problem_t;

// The routing stream (the values come from gemm_test_util.h's g_rng).
static test_rng_t g_route_rng = {0x2545F4914F6CDD1Dull, TEST_RNG_XORSHIFT64};

// New routing and router weights for all T_max tokens of p (test_route).
static void fwd_route(fwd_problem_t *p, test_route_t r) {
  test_route(p->idx.data(), p->tw.data(), p->T_max, p->E, p->K, r, &g_route_rng);
}

// Inputs of unit scale: x ~ U(-1, 1), weights ~ U(-1, 1) · 2 / sqrt(fan_in).
static void fwd_problem_init(fwd_problem_t *p, int64_t H, int64_t I, int64_t E, int64_t K,
                             int64_t Is, int64_t T, int64_t T_max) {
  p->T = T, p->T_max = T_max, p->H = H, p->I = I, p->E = E, p->K = K, p->Is = Is;
  p->capacity_factor = 0;
  p->mode = MOK_CONTEXT_SAVE;
  p->prec = MOK_PRECISION_BF16;
  p->fp8_scale = MOK_FP8_SCALE_FP32;
  p->x.resize((size_t)(T_max * H));
  p->wg.resize((size_t)(E * I * H));
  p->wu.resize((size_t)(E * I * H));
  p->wd.resize((size_t)(E * H * I));
  // NOTE: 8 elements more (a valid .data() when Is = 0), drawn too: they are part of the stream.
  p->wsg.resize((size_t)(Is * H + 8));
  p->wsu.resize((size_t)(Is * H + 8));
  p->wsd.resize((size_t)(H * Is + 8));
  p->idx.resize((size_t)(T_max * K));
  p->tw.resize((size_t)(T_max * K));
  fill_bf16(p->x, 1.0f);
  fill_bf16(p->wg, 2.0f / sqrtf((float)H));
  fill_bf16(p->wu, 2.0f / sqrtf((float)H));
  fill_bf16(p->wd, 2.0f / sqrtf((float)I));
  if (Is > 0) {
    fill_bf16(p->wsg, 2.0f / sqrtf((float)H));
    fill_bf16(p->wsu, 2.0f / sqrtf((float)H));
    fill_bf16(p->wsd, 2.0f / sqrtf((float)Is));
  }
  fwd_route(p, test_route_uniform(0.1));
}

static mok_layer_desc_t fwd_desc(const fwd_problem_t *p, int64_t Is, int64_t T_max) {
  mok_layer_desc_t d = test_layer_desc(p->H, p->I, p->E, p->K, Is, T_max);
  d.capacity_factor = p->capacity_factor;
  d.context_mode = p->mode;
  d.precision = p->prec;
  d.fp8_scale = p->fp8_scale;
  return d;
}

// p's host weights, the shared expert's when it has one and `shared` asks for them.
static mok_weights_t fwd_weights(const fwd_problem_t *p, int shared) {
  mok_weights_t w;
  memset(&w, 0, sizeof(w));
  w.wg = p->wg.data(), w.wu = p->wu.data(), w.wd = p->wd.data();
  if (shared && p->Is > 0) w.wsg = p->wsg.data(), w.wsu = p->wsu.data(), w.wsd = p->wsd.data();
  return w;
}

// The magnitude model's inputs (tests/support/magnitude.h) for S tokens of p: x [S, H], idx,
// tw [S, K], dy [S, H] (NULL: forward only), the shared expert when Is > 0.
static test_mag_in_t fwd_mag_in(const fwd_problem_t *p, int64_t S, const uint16_t *x,
                                const int32_t *idx, const float *tw, int64_t Is,
                                const uint16_t *dy) {
  test_mag_in_t m;
  m.T = S, m.H = p->H, m.I = p->I, m.E = p->E, m.K = p->K, m.Is = Is;
  m.x = x, m.dy = dy, m.idx = idx, m.tw = tw;
  m.wg = p->wg.data(), m.wu = p->wu.data(), m.wd = p->wd.data();
  m.wsg = p->wsg.data(), m.wsu = p->wsu.data(), m.wsd = p->wsd.data();
  return m;
}

// The values of n bf16 elements.
static std::vector<double> bf16_values(const uint16_t *v, size_t n) {
  std::vector<double> d(n);
  for (size_t i = 0; i < n; i++) d[i] = bf2f(v[i]);
  return d;
}

// The GPU context's layout (src/common/workspace.h), as the layer computes it.
static mok_ws_layout_t fwd_ctx_layout(const fwd_problem_t *p) {
  mok_layer_desc_t d = fwd_desc(p, p->Is, p->T_max);
  const double cf = p->capacity_factor > 0 ? p->capacity_factor : 1.0;  // layer.c, W = 1
  const int64_t R = (int64_t)ceil(cf * (double)(p->T_max * p->K));
  mok_ws_dims_t dims = mok_ws_dims(&d, p->E, R);
  mok_ws_layout_t l;
  mok_ws_layout(&dims, &l);
  return l;
}

/* ---------------------------------------------------------------------------------------------- */
/* The CPU layer (reference)                                                                       */
/* ---------------------------------------------------------------------------------------------- */

// Forward of the CPU layer on T tokens (x [T, H], idx, tw [T, K]) with shared size Is and T_max;
// y [T, H] and, when ctx is not NULL, the whole context.
static mokResult_t cpu_forward(const fwd_problem_t *p, int64_t T, const uint16_t *x,
                               const int32_t *idx, const float *tw, int64_t Is, int64_t T_max,
                               std::vector<uint16_t> *y, std::vector<uint8_t> *ctx) {
  const mok_layer_desc_t d = fwd_desc(p, Is, T_max);
  test_cpu_layer_t c;
  mokResult_t r = test_cpu_layer_open(&c, &d);
  if (r != MOK_SUCCESS) return r;
  y->assign((size_t)(T * p->H), 0);
  mok_weights_t w = fwd_weights(p, Is > 0);
  if ((r = test_cpu_layer_weights(&c, &w)) != MOK_SUCCESS) {
    test_cpu_layer_close(&c);
    return r;
  }
  const mok_forward_args_t a = test_forward_args(T, x, idx, tw, w);
  r = mok_forward(c.l, &a, T ? y->data() : NULL, c.ctx, c.ctx_bytes, NULL);
  if (r == MOK_SUCCESS && ctx) ctx->assign((uint8_t *)c.ctx, (uint8_t *)c.ctx + c.ctx_bytes);
  test_cpu_layer_close(&c);
  return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* Comparison                                                                                      */
/* ---------------------------------------------------------------------------------------------- */
/*
 * Tolerance for y (DESIGN.md section 7; tests/support/compare.h), per element:
 *     |gpu - ref| <= atol + rtol · (|ref| + M),   rtol = 2^-7,  atol = 2^-7 · rms(ref),
 *     M = |ys| + Σ_k |yk|   (tests/support/magnitude.h: y = bf16(ys + Σ_k yk)).
 * Why: the GEMMs accumulate in fp32 in another order than the reference (wgmma k-blocks against a
 * sequential sum) and the epilogue's silu uses __expf, so g and u differ in their last fp32 bits;
 * then a bf16 rounding of `a` may flip (one bf16 ulp of one of I terms moves yk by about
 * 2^-8 / sqrt(I) of its size: inside atol), and so may that of an expert output yk (one ulp, at
 * most 2^-7 |yk|: inside rtol · M, however much the slots cancel) and the final one of y (at most
 * 2^-7 |ref|). Where the slots cancel M is much larger than |ref|: before M, 4 elements of 64
 * Qwen3-30B-A3B tokens were beyond atol + rtol · |ref| on the H200 (1.04 of it: one ulp of a yk
 * near 0.5 in a y near 0.02, which rtol · M covers; not yet re-run with M), and a CPU emulation
 * of the GPU's arithmetic (16-term fp32 blocks, fp32 silu, the same roundings) reached 0.78 of
 * it on the small shapes. The worst element is printed with its ratio to the bound and its M.
 *
 * fwd_compare_y_of: y of S tokens (x [S, H], idx, tw [S, K]; the shared expert when Is > 0).
 */
static int fwd_compare_y_of(const char *what, const fwd_problem_t *p, const uint16_t *gpu,
                            const uint16_t *ref, int64_t S, const uint16_t *x, const int32_t *idx,
                            const float *tw, int64_t Is) {
  const int64_t n = S * p->H;
  const std::vector<double> g = bf16_values(gpu, (size_t)n), r = bf16_values(ref, (size_t)n);
  std::vector<double> m((size_t)n + 1);
  const test_mag_in_t in = fwd_mag_in(p, S, x, idx, tw, Is, NULL);
  test_mag_out_t o;
  memset(&o, 0, sizeof(o));
  o.y = m.data();
  if (!test_magnitudes(&in, &o)) {
    printf("    %s: y: no memory for the magnitudes\n", what);
    return 0;
  }
  return test_compare_report(what, "y", g.data(), r.data(), m.data(), n, p->H,
                             test_tol_rms(r.data(), NULL, n));
}

// y of p's T tokens (its x, routing and shared expert) against the CPU layer's.
static int fwd_compare_y(const char *what, const fwd_problem_t *p, const uint16_t *gpu,
                         const uint16_t *ref) {
  return fwd_compare_y_of(what, p, gpu, ref, p->T, p->x.data(), p->idx.data(), p->tw.data(),
                          p->Is);
}

/* ---------------------------------------------------------------------------------------------- */
/* The GPU layer                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

// A GPU layer of descriptor d with p's inputs (all T_max rows) and weights uploaded (y poisoned,
// the context zeroed). 0 on failure (the reason printed).
static int fwd_gpu_open_desc(test_gpu_layer_t *g, const fwd_problem_t *p,
                             const mok_layer_desc_t *d) {
  const mok_weights_t w = fwd_weights(p, d->shared_intermediate > 0);
  return test_gpu_layer_open(g, d, p->x.data(), p->idx.data(), p->tw.data(), &w);
}

// A GPU layer for p (its descriptor, fwd_desc). 0 on failure (the reason printed).
static int fwd_gpu_open(test_gpu_layer_t *g, const fwd_problem_t *p) {
  const mok_layer_desc_t d = fwd_desc(p, p->Is, p->T_max);
  return fwd_gpu_open_desc(g, p, &d);
}

// Uploads the problem's current x, routing and router weights.
static void fwd_gpu_inputs(test_gpu_layer_t *g, const fwd_problem_t *p) {
  cudaMemcpy(g->x, p->x.data(), p->x.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(g->idx, p->idx.data(), p->idx.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(g->tw, p->tw.data(), p->tw.size() * 4, cudaMemcpyHostToDevice);
  // NOTE: a pageable upload may still be in flight on the legacy stream when cudaMemcpy returns,
  // and a non-blocking stream (the graph test's) is not ordered after it.
  cudaDeviceSynchronize();
}

static std::vector<uint16_t> fwd_gpu_y(const test_gpu_layer_t *g, int64_t T, int64_t H) {
  std::vector<uint16_t> y((size_t)(T * H));
  if (T > 0) cudaMemcpy(y.data(), g->y, y.size() * 2, cudaMemcpyDeviceToHost);
  return y;
}

static std::vector<uint8_t> fwd_gpu_ctx(const test_gpu_layer_t *g) {
  std::vector<uint8_t> c(g->ctx_bytes);
  cudaMemcpy(c.data(), g->ctx, c.size(), cudaMemcpyDeviceToHost);
  return c;
}

// Runs the GPU forward on p's current inputs and checks y against the CPU layer. Returns 1 when
// everything matched; failures are recorded on the running test.
static int fwd_check_against_cpu(test_gpu_layer_t *g, const fwd_problem_t *p, const char *what) {
  fwd_gpu_inputs(g, p);
  mokResult_t r = test_gpu_layer_forward(g, p->T, NULL);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: mok_forward: %s", what, mok_last_error());
  r = mok_layer_check(g->l);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: mok_layer_check: %s", what, mok_last_error());
  if (r != MOK_SUCCESS) return 0;
  std::vector<uint16_t> y = fwd_gpu_y(g, p->T, p->H), ref;
  r = cpu_forward(p, p->T, p->x.data(), p->idx.data(), p->tw.data(), p->Is, p->T_max, &ref, NULL);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: CPU layer: %s", what, mok_last_error());
  if (r != MOK_SUCCESS) return 0;
  const int ok = fwd_compare_y(what, p, y.data(), ref.data());
  MOK_EXPECT_MSG(ok, "%s: GPU y differs from the CPU layer beyond the tolerance", what);
  return ok;
}

#endif /* MOK_TESTS_GPU_FORWARD_TEST_UTIL_CUH */
