/*
 * forward_test_util.cuh: helpers of the GPU forward tests (test_forward.cu): random layer problems
 * with controlled routing, a GPU layer with its device buffers, the CPU layer (the reference) on
 * the same inputs, and the elementwise comparison with its stated tolerance.
 * Header-only, static.
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
#include "gemm_test_util.h"
#include "mok.h"
#include "common/workspace.h"
#include "cuda/forward/forward.h"

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
} fwd_problem_t;

// How to route: each slot empty with probability p_empty; experts in `avoid` (bit e, E <= 64)
// never used; hot >= 0: slot 0 of every token goes to expert hot.
typedef struct {
  double p_empty;
  uint64_t avoid;
  int hot;
} route_t;

static uint64_t g_route_rng = 0x2545F4914F6CDD1Dull;
static inline uint64_t route_next(void) {
  g_route_rng ^= g_route_rng << 13;
  g_route_rng ^= g_route_rng >> 7;
  g_route_rng ^= g_route_rng << 17;
  return g_route_rng;
}
static inline double route_unit(void) { return (double)(route_next() >> 11) / 9007199254740992.0; }

// K distinct experts per token (the avoided ones never), then empty slots.
static void fwd_route(fwd_problem_t *p, route_t r) {
  const int64_t E = p->E, K = p->K;
  for (int64_t t = 0; t < p->T_max; t++) {
    int32_t *row = &p->idx[t * K];
    for (int64_t k = 0; k < K; k++) {
      int32_t e;
      for (;;) {
        e = k == 0 && r.hot >= 0 ? r.hot : (int32_t)(route_next() % (uint64_t)E);
        int used = E <= 64 && ((r.avoid >> e) & 1);
        for (int64_t j = 0; j < k; j++) used |= row[j] == e;
        if (!used) break;
      }
      row[k] = e;
    }
    for (int64_t k = 0; k < K; k++)
      if (route_unit() < r.p_empty) row[k] = -1;
    for (int64_t k = 0; k < K; k++) p->tw[t * K + k] = (float)(0.1 + 0.9 * route_unit());
  }
}

// Inputs of unit scale: x ~ U(-1, 1), weights ~ U(-1, 1) · 2 / sqrt(fan_in).
static void fwd_problem_init(fwd_problem_t *p, int64_t H, int64_t I, int64_t E, int64_t K,
                             int64_t Is, int64_t T, int64_t T_max) {
  p->T = T, p->T_max = T_max, p->H = H, p->I = I, p->E = E, p->K = K, p->Is = Is;
  p->capacity_factor = 0;
  p->mode = MOK_CONTEXT_SAVE;
  p->x.resize((size_t)(T_max * H));
  p->wg.resize((size_t)(E * I * H));
  p->wu.resize((size_t)(E * I * H));
  p->wd.resize((size_t)(E * H * I));
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
  route_t r = {0.1, 0, -1};
  fwd_route(p, r);
}

static mok_layer_desc_t fwd_desc(const fwd_problem_t *p, int64_t Is, int64_t T_max) {
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = p->H, d.intermediate = p->I, d.num_experts = p->E, d.top_k = p->K;
  d.shared_intermediate = Is, d.max_tokens = T_max, d.capacity_factor = p->capacity_factor;
  d.context_mode = p->mode;
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
  mok_comm_t c = NULL;
  mok_layer_t l = NULL;
  mokResult_t r = mok_comm_create_local(&c, MOK_DEVICE_CPU);
  if (r != MOK_SUCCESS) return r;
  mok_layer_desc_t d = fwd_desc(p, Is, T_max);
  if ((r = mok_layer_create(&l, c, &d)) != MOK_SUCCESS) {
    mok_comm_destroy(c);
    return r;
  }
  size_t cb = 0;
  mok_context_size(l, &cb);
  void *cbuf = aligned_alloc(64, (cb + 63) / 64 * 64);
  y->assign((size_t)(T * p->H), 0);
  mok_forward_args_t a;
  memset(&a, 0, sizeof(a));
  a.num_tokens = T;
  a.x = T ? x : NULL;
  a.topk_idx = T ? idx : NULL;
  a.topk_w = T ? tw : NULL;
  a.w.wg = p->wg.data(), a.w.wu = p->wu.data(), a.w.wd = p->wd.data();
  if (Is > 0) a.w.wsg = p->wsg.data(), a.w.wsu = p->wsu.data(), a.w.wsd = p->wsd.data();
  r = mok_forward(l, &a, T ? y->data() : NULL, cbuf, cb, NULL);
  if (r == MOK_SUCCESS && ctx) ctx->assign((uint8_t *)cbuf, (uint8_t *)cbuf + cb);
  free(cbuf);
  mok_layer_destroy(l);
  mok_comm_destroy(c);
  return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* Comparison                                                                                      */
/* ---------------------------------------------------------------------------------------------- */
/*
 * Tolerance for y (DESIGN.md section 7), per element:
 *     |gpu - ref| <= atol + rtol · |ref|,   rtol = 2^-7,  atol = 2^-7 · rms(ref).
 * Why: the GEMMs accumulate in fp32 in another order than the reference (wgmma k-blocks against a
 * sequential sum) and the epilogue's silu uses __expf, so g and u differ in their last fp32 bits;
 * then a bf16 rounding of `a` may flip (one bf16 ulp of one of I terms moves yk by about
 * 2^-8 / sqrt(I) of its size: inside atol), and so may the final bf16 rounding of y (at most
 * 2^-7 |ref|: rtol). A flip of an expert output yk (one ulp, up to 2^-7 |yk|) can exceed the
 * bound where slots cancel; a CPU emulation of the GPU's arithmetic (16-term fp32 blocks, fp32
 * silu, the same roundings) never did on the small shapes (worst 0.78 of the bound over 1.2M
 * elements), but 4 elements of 64 Qwen3-30B-A3B tokens did on the H200 (1.04 of the bound, a
 * diff of one ulp of a yk near 0.5 in a y near 0.02): fwd_compare_y_slots allows exactly that.
 * The worst element is printed with its ratio to the bound.
 */
typedef struct {
  double atol, rtol;
} fwd_y_bound_t;

// The bound above for the n elements of ref; fwd_y_allowed(b, r) is |gpu - r|'s limit.
static fwd_y_bound_t fwd_y_bound(const uint16_t *ref, int64_t n) {
  double ss = 0;
  for (int64_t i = 0; i < n; i++) ss += (double)bf2f(ref[i]) * bf2f(ref[i]);
  fwd_y_bound_t b;
  b.rtol = 1.0 / 128;
  b.atol = b.rtol * sqrt(ss / (double)(n > 0 ? n : 1));
  return b;
}
static double fwd_y_allowed(fwd_y_bound_t b, double r) { return b.atol + b.rtol * fabs(r); }

static int fwd_compare_y(const char *what, const uint16_t *gpu, const uint16_t *ref, int64_t T,
                         int64_t H) {
  const int64_t n = T * H;
  const fwd_y_bound_t yb = fwd_y_bound(ref, n);
  int64_t bad = 0, worst = -1;
  double worst_ratio = -1;
  for (int64_t i = 0; i < n; i++) {
    const double g = bf2f(gpu[i]), r = bf2f(ref[i]), d = fabs(g - r);
    const double bound = fwd_y_allowed(yb, r);
    if (!(d <= bound)) bad++;
    const double ratio = d <= bound && bound == 0 ? 0.0 : d / bound;  // ref all 0: d must be 0
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
      if (worst_ratio != worst_ratio) break;  // NaN: unwritten or broken output, report it
    }
  }
  if (worst >= 0) {
    const double g = bf2f(gpu[worst]), r = bf2f(ref[worst]);
    printf("    %s: worst y[%lld][%lld]: gpu %.6g ref %.6g |diff| %.3g = %.3f of its bound "
           "(atol %.3g); %lld elements beyond\n",
           what, (long long)(worst / H), (long long)(worst % H), g, r, fabs(g - r), worst_ratio,
           yb.atol, (long long)bad);
  }
  return bad == 0 && worst_ratio == worst_ratio;
}

// One bf16 ulp of v (v a bf16 value; 0 for 0).
static double fwd_bf16_ulp(double v) {
  if (v == 0) return 0;
  int e;
  frexp(fabs(v), &e);  // |v| in [2^(e-1), 2^e)
  return ldexp(1.0, e - 1 - 7);
}

/*
 * fwd_compare_y for S tokens of p (x rows xs, routing is, weights ws; no shared expert), where an
 * element beyond the bound may still be the one case the bound leaves out (see above): a bf16
 * rounding of an expert output yk that fell the other way where the slots cancel. For each token
 * with such an element the CPU layer runs it once per slot with the other slots empty (one call,
 * a row per (token, slot)), which gives that slot's yk exactly (a sum of one bf16 term), and the
 * element passes if it is within the bound plus one bf16 ulp of each slot's yk there. At most 8 tokens may need this; the number of
 * elements that did is printed.
 */
static int fwd_compare_y_slots(const char *what, const fwd_problem_t *p, const uint16_t *gpu,
                               const uint16_t *ref, int64_t S, const uint16_t *xs,
                               const int32_t *is, const float *ws) {
  const int64_t H = p->H, K = p->K, n = S * H;
  const fwd_y_bound_t yb = fwd_y_bound(ref, n);
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs((double)bf2f(gpu[i]) - bf2f(ref[i]));
    if (!(d <= fwd_y_allowed(yb, bf2f(ref[i]))) && (tokens.empty() || tokens.back() != i / H))
      tokens.push_back(i / H);
  }
  if (tokens.empty()) return fwd_compare_y(what, gpu, ref, S, H);
  if (tokens.size() > 8) {
    printf("    %s: %zu tokens beyond the bound\n", what, tokens.size());
    return fwd_compare_y(what, gpu, ref, S, H);
  }
  // One CPU call for all of them: row j = K t + k holds token tokens[t] with only slot k routed.
  const int64_t R = (int64_t)tokens.size() * K;
  std::vector<uint16_t> xr((size_t)(R * H)), yk;
  std::vector<int32_t> ir((size_t)(R * K), -1);
  std::vector<float> wr((size_t)(R * K));
  for (int64_t j = 0; j < R; j++) {
    const int64_t s = tokens[j / K], k = j % K;
    memcpy(&xr[j * H], xs + s * H, (size_t)H * 2);
    memcpy(&wr[j * K], ws + s * K, (size_t)K * 4);
    ir[j * K + k] = is[s * K + k];
  }
  if (cpu_forward(p, R, xr.data(), ir.data(), wr.data(), 0, R, &yk, NULL) != MOK_SUCCESS) return 0;
  int64_t flips = 0, bad = 0;
  for (size_t t = 0; t < tokens.size(); t++) {
    const int64_t s = tokens[t];
    for (int64_t h = 0; h < H; h++) {
      double allow = 0;  // an empty slot's row is all zeros: no ulp
      for (int64_t k = 0; k < K; k++) allow += fwd_bf16_ulp(bf2f(yk[((int64_t)t * K + k) * H + h]));
      const int64_t i = s * H + h;
      const double d = fabs((double)bf2f(gpu[i]) - bf2f(ref[i]));
      const double bound = fwd_y_allowed(yb, bf2f(ref[i]));
      if (d <= bound) continue;
      if (d <= bound + allow) {
        flips++;
      } else if (bad++ < 5) {
        printf("    %s: y[%lld][%lld]: gpu %.6g ref %.6g beyond %.3g + the slots' ulps %.3g\n",
               what, (long long)s, (long long)h, bf2f(gpu[i]), bf2f(ref[i]), bound, allow);
      }
    }
  }
  printf("    %s: %lld elements of %zu tokens within one ulp of their slots' expert outputs "
         "(cancelling slots), %lld beyond\n",
         what, (long long)flips, tokens.size(), (long long)bad);
  return bad == 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* The GPU layer                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
  mok_comm_t comm;
  mok_layer_t l;
  uint16_t *x, *wg, *wu, *wd, *wsg, *wsu, *wsd, *y;  // device
  int32_t *idx;
  float *tw;
  uint8_t *ctx;
  size_t ctx_bytes;
} fwd_gpu_t;

template <class T>
static T *fwd_upload(const std::vector<T> &h) {
  return to_dev(h);
}

static void fwd_gpu_close(fwd_gpu_t *g) {
  cudaDeviceSynchronize();
  void *bufs[] = {g->x, g->wg, g->wu, g->wd, g->wsg, g->wsu, g->wsd, g->y, g->idx, g->tw, g->ctx};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    if (bufs[i]) cudaFree(bufs[i]);
  if (g->l) mok_layer_destroy(g->l);
  if (g->comm) mok_comm_destroy(g->comm);
  memset(g, 0, sizeof(*g));
}

// A GPU layer for p (weights, x, routing uploaded). 0 on failure (the reason printed).
static int fwd_gpu_open(fwd_gpu_t *g, const fwd_problem_t *p) {
  memset(g, 0, sizeof(*g));
  mok_layer_desc_t d = fwd_desc(p, p->Is, p->T_max);
  if (mok_comm_create_local(&g->comm, 0) != MOK_SUCCESS ||
      mok_layer_create(&g->l, g->comm, &d) != MOK_SUCCESS ||
      mok_context_size(g->l, &g->ctx_bytes) != MOK_SUCCESS) {
    printf("    GPU layer: %s\n", mok_last_error());
    fwd_gpu_close(g);
    return 0;
  }
  g->x = fwd_upload(p->x), g->idx = fwd_upload(p->idx), g->tw = fwd_upload(p->tw);
  g->wg = fwd_upload(p->wg), g->wu = fwd_upload(p->wu), g->wd = fwd_upload(p->wd);
  if (p->Is > 0) g->wsg = fwd_upload(p->wsg), g->wsu = fwd_upload(p->wsu), g->wsd = fwd_upload(p->wsd);
  cudaMalloc(&g->y, (size_t)(p->T_max * p->H) * 2 + 16);
  cudaMalloc(&g->ctx, g->ctx_bytes);
  if (!g->x || !g->idx || !g->tw || !g->wg || !g->wu || !g->wd || !g->y || !g->ctx ||
      (p->Is > 0 && (!g->wsg || !g->wsu || !g->wsd))) {
    printf("    GPU layer: device allocation failed\n");
    fwd_gpu_close(g);
    return 0;
  }
  cudaMemset(g->y, 0xFF, (size_t)(p->T_max * p->H) * 2);  // NaN in bf16: unwritten rows show
  cudaMemset(g->ctx, 0, g->ctx_bytes);
  return 1;
}

// Uploads the problem's current x, routing and router weights.
static void fwd_gpu_inputs(fwd_gpu_t *g, const fwd_problem_t *p) {
  cudaMemcpy(g->x, p->x.data(), p->x.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(g->idx, p->idx.data(), p->idx.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(g->tw, p->tw.data(), p->tw.size() * 4, cudaMemcpyHostToDevice);
  // NOTE: a pageable upload may still be in flight on the legacy stream when cudaMemcpy returns,
  // and a non-blocking stream (the graph test's) is not ordered after it.
  cudaDeviceSynchronize();
}

// The forward arguments of the first T tokens of g's inputs (also the backward's).
static mok_forward_args_t fwd_gpu_args(const fwd_gpu_t *g, int64_t T) {
  mok_forward_args_t a;
  memset(&a, 0, sizeof(a));
  a.num_tokens = T;
  a.x = T ? g->x : NULL;
  a.topk_idx = T ? g->idx : NULL;
  a.topk_w = T ? g->tw : NULL;
  a.w.wg = g->wg, a.w.wu = g->wu, a.w.wd = g->wd;
  a.w.wsg = g->wsg, a.w.wsu = g->wsu, a.w.wsd = g->wsd;
  return a;
}

static mokResult_t fwd_gpu_forward(fwd_gpu_t *g, int64_t T, cudaStream_t stream) {
  const mok_forward_args_t a = fwd_gpu_args(g, T);
  return mok_forward(g->l, &a, T ? g->y : NULL, g->ctx, g->ctx_bytes, (mok_stream_t)stream);
}

static std::vector<uint16_t> fwd_gpu_y(const fwd_gpu_t *g, int64_t T, int64_t H) {
  std::vector<uint16_t> y((size_t)(T * H));
  if (T > 0) cudaMemcpy(y.data(), g->y, y.size() * 2, cudaMemcpyDeviceToHost);
  return y;
}

static std::vector<uint8_t> fwd_gpu_ctx(const fwd_gpu_t *g) {
  std::vector<uint8_t> c(g->ctx_bytes);
  cudaMemcpy(c.data(), g->ctx, c.size(), cudaMemcpyDeviceToHost);
  return c;
}

// Runs the GPU forward on p's current inputs and checks y against the CPU layer. Returns 1 when
// everything matched; failures are recorded on the running test.
static int fwd_check_against_cpu(fwd_gpu_t *g, const fwd_problem_t *p, const char *what) {
  fwd_gpu_inputs(g, p);
  mokResult_t r = fwd_gpu_forward(g, p->T, 0);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: mok_forward: %s", what, mok_last_error());
  r = mok_layer_check(g->l);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: mok_layer_check: %s", what, mok_last_error());
  if (r != MOK_SUCCESS) return 0;
  std::vector<uint16_t> y = fwd_gpu_y(g, p->T, p->H), ref;
  r = cpu_forward(p, p->T, p->x.data(), p->idx.data(), p->tw.data(), p->Is, p->T_max, &ref, NULL);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: CPU layer: %s", what, mok_last_error());
  if (r != MOK_SUCCESS) return 0;
  const int ok = fwd_compare_y(what, y.data(), ref.data(), p->T, p->H);
  MOK_EXPECT_MSG(ok, "%s: GPU y differs from the CPU layer beyond the tolerance", what);
  return ok;
}

#endif /* MOK_TESTS_GPU_FORWARD_TEST_UTIL_CUH */
