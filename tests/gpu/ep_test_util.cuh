/*
 * ep_test_util.cuh: the expert-parallel tests' teams (test_ep.cu, test_ep_backward.cu,
 * test_ep_gpus.cu): W virtual ranks on one GPU (mok_comm_create_virtual, include/mok.h) whose peers
 * are buffers on the same device, each rank's calls on its own stream, all enqueued from this
 * thread, and the comparisons with one W = 1 layer holding the tokens concatenated in rank order
 * (forward: ep_case; backward: ep_bwd_case). Header-only, static: each test file gets its own copy.
 */
#ifndef MOK_TESTS_GPU_EP_TEST_UTIL_CUH
#define MOK_TESTS_GPU_EP_TEST_UTIL_CUH

#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "../support/timer.h"
#include "api/internal.h"
#include "backward_test_util.cuh"

#define NEED_GPU() \
  if (!test_gpu_present()) MOK_SKIP("no CUDA device")

enum { EP_MAX_W = 8 };

// W virtual ranks on GPU 0; rank r holds experts [r EL, (r + 1) EL) of p's weights and its own
// x, idx, tw, y, context.
typedef struct {
  int W;
  int64_t EL, T_max, H, I, K;
  size_t wgrad_el; // bytes per weight-gradient element
  mok_comm_t comm[EP_MAX_W];
  mok_layer_t l[EP_MAX_W];
  cudaStream_t s[EP_MAX_W];
  uint16_t *wg, *wu, *wd, *wsg, *wsu, *wsd; // all E experts; rank r points into its slice
  uint16_t *x[EP_MAX_W], *y[EP_MAX_W];
  int32_t *idx[EP_MAX_W];
  float *tw[EP_MAX_W];
  uint8_t *ctx[EP_MAX_W];
  size_t ctx_bytes;
  // backward (ep_open_backward): dy, dx, dtopk_w per rank; the routed weight gradients of all E
  // experts in one buffer each (rank r writes its slice); the shared expert's per rank
  uint16_t *dy[EP_MAX_W], *dx[EP_MAX_W];
  float *dtw[EP_MAX_W];
  void *dwr[3], *dws[EP_MAX_W][3];
  // fp8 layers: each rank's experts quantized by its layer (mok_quantize_weights)
  void *qw[EP_MAX_W];
  size_t qw_bytes;
} ep_team_t;

static inline void ep_close(ep_team_t *t) {
  cudaDeviceSynchronize();
  for (int r = 0; r < t->W; r++) {
    if (t->l[r]) mok_layer_destroy(t->l[r]);
    void *b[] = {t->x[r],  t->y[r],       t->idx[r],     t->tw[r],      t->ctx[r], t->dy[r],
                 t->dx[r], t->dtw[r],     t->dws[r][0], t->dws[r][1], t->dws[r][2], t->qw[r]};
    for (void *q : b)
      if (q) cudaFree(q);
    if (t->s[r]) cudaStreamDestroy(t->s[r]);
  }
  for (int r = 0; r < t->W; r++)
    if (t->comm[r]) mok_comm_destroy(t->comm[r]);
  void *w[] = {t->wg, t->wu, t->wd, t->wsg, t->wsu, t->wsd, t->dwr[0], t->dwr[1], t->dwr[2]};
  for (void *q : w)
    if (q) cudaFree(q);
  memset(t, 0, sizeof(*t));
}

static inline mok_forward_args_t ep_rank_args(const ep_team_t *t, int r, int64_t T);

// A team of W ranks for p's shape (T_max per rank), with tuning timeout `timeout_s` (0: default)
// and the layer descriptor's weight-gradient fields from `wdt`, `accumulate`.
static inline int ep_open_wgrad(ep_team_t *t, const fwd_problem_t *p, int W, int64_t T_max,
                                double timeout_s, mok_wgrad_dtype_t wdt, int accumulate) {
  memset(t, 0, sizeof(*t));
  t->W = W, t->EL = p->E / W, t->T_max = T_max, t->H = p->H, t->I = p->I, t->K = p->K;
  if (mok_comm_create_virtual(t->comm, W, 0) != MOK_SUCCESS) {
    printf("    virtual ranks: %s\n", mok_last_error());
    return 0;
  }
  mok_layer_desc_t d = fwd_desc(p, p->Is, T_max);
  d.wgrad_dtype = wdt, d.wgrad_accumulate = accumulate;
  t->wgrad_el = wdt == MOK_WGRAD_BF16 ? 2 : 4;
  for (int r = 0; r < W; r++) {
    if (mok_layer_create(&t->l[r], t->comm[r], &d) != MOK_SUCCESS) {
      printf("    rank %d layer: %s\n", r, mok_last_error());
      ep_close(t);
      return 0;
    }
    if (timeout_s > 0) {
      mok_tuning_t tu;
      mok_layer_tuning(t->l[r], &tu);
      tu.timeout_s = timeout_s;
      mok_layer_set_tuning(t->l[r], &tu);
    }
    mok_context_size(t->l[r], &t->ctx_bytes);
    cudaStreamCreateWithFlags(&t->s[r], cudaStreamNonBlocking);
    const int64_t H = p->H, K = p->K;
    cudaMalloc((void **)&t->x[r], (size_t)(T_max * H) * 2 + 16);
    cudaMalloc((void **)&t->y[r], (size_t)(T_max * H) * 2 + 16);
    cudaMalloc((void **)&t->idx[r], (size_t)(T_max * K) * 4 + 16);
    cudaMalloc((void **)&t->tw[r], (size_t)(T_max * K) * 4 + 16);
    cudaMalloc((void **)&t->ctx[r], t->ctx_bytes);
  }
  t->wg = to_dev(p->wg), t->wu = to_dev(p->wu), t->wd = to_dev(p->wd);
  if (p->Is > 0) t->wsg = to_dev(p->wsg), t->wsu = to_dev(p->wsu), t->wsd = to_dev(p->wsd);
  if (mok_quantized_weights_size(t->l[0], &t->qw_bytes) != MOK_SUCCESS) t->qw_bytes = 0;
  for (int r = 0; r < W && t->qw_bytes > 0; r++) {  // fp8: rank r's slice, quantized by its layer
    const mok_forward_args_t a = ep_rank_args(t, r, 0);
    if (cudaMalloc(&t->qw[r], t->qw_bytes) != cudaSuccess ||
        mok_quantize_weights(t->l[r], &a.w, t->qw[r], t->qw_bytes, NULL) != MOK_SUCCESS) {
      printf("    rank %d: quantizing the weights: %s\n", r, mok_last_error());
      ep_close(t);
      return 0;
    }
  }
  return cudaDeviceSynchronize() == cudaSuccess;
}

static inline int ep_open(ep_team_t *t, const fwd_problem_t *p, int W, int64_t T_max,
                          double timeout_s) {
  return ep_open_wgrad(t, p, W, T_max, timeout_s, MOK_WGRAD_FP32, 0);
}

// Rank r's tokens are tokens [start_r, start_r + T_r) of p (rank order), poisoned y.
static inline void ep_inputs(ep_team_t *t, const fwd_problem_t *p, const int64_t *T) {
  int64_t start = 0;
  for (int r = 0; r < t->W; r++) {
    const int64_t H = p->H, K = p->K;
    if (T[r] > 0) {
      cudaMemcpy(t->x[r], p->x.data() + start * H, (size_t)(T[r] * H) * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(t->idx[r], p->idx.data() + start * K, (size_t)(T[r] * K) * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(t->tw[r], p->tw.data() + start * K, (size_t)(T[r] * K) * 4, cudaMemcpyHostToDevice);
    }
    cudaMemset(t->y[r], 0xFF, (size_t)(t->T_max * H) * 2);
    start += T[r];
  }
  cudaDeviceSynchronize();
}

// Rank r's forward arguments: its T tokens and its experts' slice of the weights.
static inline mok_forward_args_t ep_rank_args(const ep_team_t *t, int r, int64_t T) {
  mok_weights_t w;
  memset(&w, 0, sizeof(w));
  const size_t ew = (size_t)(t->EL * t->H * t->I);
  w.wg = t->wg + r * ew, w.wu = t->wu + r * ew, w.wd = t->wd + r * ew;
  w.wsg = t->wsg, w.wsu = t->wsu, w.wsd = t->wsd;
  w.quantized = t->qw[r], w.quantized_bytes = t->qw[r] ? t->qw_bytes : 0;
  return test_forward_args(T, t->x[r], t->idx[r], t->tw[r], w);
}

// Rank r's backward arguments: dy, dx, dtopk_w, its experts' slice of the routed weight gradients
// and its own shared-expert ones.
static inline mok_backward_args_t ep_rank_backward_args(const ep_team_t *t, int r, int64_t T) {
  const size_t ew = (size_t)(t->EL * t->H * t->I);
  void *dw[6];
  for (int i = 0; i < 3; i++) dw[i] = (char *)t->dwr[i] + r * ew * t->wgrad_el;
  for (int i = 0; i < 3; i++) dw[3 + i] = t->dws[r][i];
  return test_backward_args(T, t->dy[r], t->dx[r], t->dtw[r], dw, t->wsg != NULL);
}

// One forward on every rank (rank order, each on its stream); res[r] the call's result.
static inline void ep_forward(ep_team_t *t, const int64_t *T, mokResult_t *res, int skip_rank) {
  for (int r = 0; r < t->W; r++) {
    if (r == skip_rank) {
      res[r] = MOK_SUCCESS;
      continue;
    }
    const mok_forward_args_t a = ep_rank_args(t, r, T[r]);
    res[r] = mok_forward(t->l[r], &a, T[r] ? t->y[r] : NULL, t->ctx[r], t->ctx_bytes,
                         (mok_stream_t)t->s[r]);
  }
}

// Waits for every rank, then mok_layer_check on each: res[r].
static inline void ep_check(ep_team_t *t, mokResult_t *res, char (*msg)[MOK_ERR_LEN]) {
  for (int r = 0; r < t->W; r++) cudaStreamSynchronize(t->s[r]);
  for (int r = 0; r < t->W; r++) {
    res[r] = mok_layer_check(t->l[r]);
    if (msg) snprintf(msg[r], MOK_ERR_LEN, "%s", res[r] == MOK_SUCCESS ? "" : mok_last_error());
  }
}

// y of one W = 1 layer (the fused forward) on p's first T tokens.
static inline std::vector<uint16_t> ep_reference_y(const fwd_problem_t *p, int64_t T) {
  test_gpu_layer_t g;
  std::vector<uint16_t> y;
  mok_layer_desc_t d = fwd_desc(p, p->Is, T > 0 ? T : 1);
  d.capacity_factor = 0; // the reference never overflows
  if (!fwd_gpu_open_desc(&g, p, &d)) return y;
  fwd_gpu_inputs(&g, p);
  if (test_gpu_layer_forward(&g, T, NULL) == MOK_SUCCESS && mok_layer_check(g.l) == MOK_SUCCESS)
    y = fwd_gpu_y(&g, T, p->H);
  test_gpu_layer_close(&g);
  return y;
}

// Every rank's y against the W = 1 layer's rows of its tokens, bit for bit; 1 when all equal.
static inline int ep_same_as_w1(ep_team_t *t, const std::vector<uint16_t> &ref, const int64_t *T,
                                const char *what) {
  int64_t start = 0, total = 0;
  for (int r = 0; r < t->W; r++) total += T[r];
  if (ref.size() != (size_t)(total * t->H)) {
    printf("    %s: the W = 1 layer failed\n", what);
    return 0;
  }
  int ok = 1;
  for (int r = 0; r < t->W; r++) {
    std::vector<uint16_t> y((size_t)(T[r] * t->H));
    if (T[r] > 0) cudaMemcpy(y.data(), t->y[r], y.size() * 2, cudaMemcpyDeviceToHost);
    int64_t diff = 0, first = -1;
    for (size_t i = 0; i < y.size(); i++)
      if (y[i] != ref[(size_t)(start * t->H) + i] && diff++ == 0) first = (int64_t)i;
    if (diff) {
      printf("    %s: rank %d: %lld of %lld elements differ from W = 1, first [%lld][%lld]: "
             "0x%04x vs 0x%04x\n",
             what, r, (long long)diff, (long long)y.size(), (long long)(first / t->H),
             (long long)(first % t->H), y[(size_t)first], ref[(size_t)(start * t->H + first)]);
      ok = 0;
    }
    start += T[r];
  }
  return ok;
}

// How a rank runs its experts (src/gpu/forward_ep.c): the fused kernel after the dispatch kernel
// (the default on virtual ranks), the fused kernel dispatching itself (every rank's kernel on
// (SMs - W) / W CTAs, as virtual ranks need for it), or the chain of grouped GEMMs.
typedef enum { EP_FUSED, EP_FUSED_DISPATCH, EP_CHAIN } ep_mode_t;

// Sets every rank's tuning for `mode`; 0 on failure.
static inline int ep_set_mode(ep_team_t *t, ep_mode_t mode) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int r = 0; r < t->W; r++) {
    mok_tuning_t tu;
    if (mok_layer_tuning(t->l[r], &tu) != MOK_SUCCESS) return 0;
    tu.forward_path = mode == EP_CHAIN ? MOK_FORWARD_CHAIN : MOK_FORWARD_FUSED;
    tu.forward_sms = mode == EP_FUSED_DISPATCH ? (sms - t->W) / t->W : 0;
    if (mok_layer_set_tuning(t->l[r], &tu) != MOK_SUCCESS) return 0;
  }
  return 1;
}

// One EP-invariance case: W ranks with tokens T[0..W-1] (rank order) of p, run as `mode` says.
static inline int ep_case_mode(const fwd_problem_t *p, int W, const int64_t *T, const char *what,
                               ep_mode_t mode) {
  int64_t total = 0, T_max = 1;
  for (int r = 0; r < W; r++) total += T[r], T_max = T[r] > T_max ? T[r] : T_max;
  const std::vector<uint16_t> ref = ep_reference_y(p, total);
  if (ref.size() != (size_t)(total * p->H)) {
    printf("    %s: the W = 1 layer failed\n", what);
    return 0;
  }
  ep_team_t t;
  if (!ep_open(&t, p, W, T_max, 0)) {
    MOK_EXPECT_MSG(0, "%s: the ranks' layers could not be created", what);
    return 0;
  }
  if (!ep_set_mode(&t, mode)) {
    MOK_EXPECT_MSG(0, "%s: setting the ranks' tuning: %s", what, mok_last_error());
    ep_close(&t);
    return 0;
  }
  ep_inputs(&t, p, T);
  mokResult_t res[EP_MAX_W], chk[EP_MAX_W];
  char msg[EP_MAX_W][MOK_ERR_LEN];
  ep_forward(&t, T, res, -1);
  ep_check(&t, chk, msg);
  int ok = 1;
  for (int r = 0; r < W; r++)
    if (res[r] != MOK_SUCCESS || chk[r] != MOK_SUCCESS) {
      printf("    %s: rank %d: forward %s, check %s: %s\n", what, r, mok_error_string(res[r]),
             mok_error_string(chk[r]), msg[r]);
      ok = 0;
    }
  if (ok) ok = ep_same_as_w1(&t, ref, T, what);
  ep_close(&t);
  MOK_EXPECT_MSG(ok, "%s: the expert-parallel y is not the W = 1 layer's", what);
  return ok;
}

static inline int ep_case(const fwd_problem_t *p, int W, const int64_t *T, const char *what) {
  return ep_case_mode(p, W, T, what, EP_FUSED);
}

// The case with the dispatch kernel, then with the dispatch inside the fused kernel.
static inline void ep_case_both(const fwd_problem_t *p, int W, const int64_t *T, const char *what) {
  char in_kernel[160];
  snprintf(in_kernel, sizeof(in_kernel), "%s, the dispatch in the fused kernel", what);
  ep_case_mode(p, W, T, what, EP_FUSED);
  ep_case_mode(p, W, T, in_kernel, EP_FUSED_DISPATCH);
}

static inline void ep_problem(fwd_problem_t *p, int64_t Is, int64_t T, test_route_t route) {
  fwd_problem_init(p, 256, 256, 16, 4, Is, T, T);
  fwd_route(p, route);
}

/* ---------------------------------------------------------------------------------------------- */
/* Backward                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

// A team for bwd_problem p (T_max per rank) with its backward buffers: routed weight gradients
// start from p's dw0 (accumulate) or NaN poison, the shared ones likewise per rank.
static inline int ep_open_backward(ep_team_t *t, const bwd_problem_t *p, int W, int64_t T_max) {
  if (!ep_open_wgrad(t, &p->f, W, T_max, 0, p->wdt, p->accumulate)) return 0;
  const int64_t H = p->f.H, K = p->f.K;
  int ok = 1;
  for (int i = 0; i < 3; i++) {
    ok &= cudaMalloc(&t->dwr[i], bwd_w_bytes(p, i) + 16) == cudaSuccess;
    if (ok && p->accumulate)
      cudaMemcpy(t->dwr[i], p->dw0[i].data(), bwd_w_bytes(p, i), cudaMemcpyHostToDevice);
    else if (ok) cudaMemset(t->dwr[i], 0xFF, bwd_w_bytes(p, i));
  }
  for (int r = 0; r < W && ok; r++) {
    ok &= cudaMalloc((void **)&t->dy[r], (size_t)(T_max * H) * 2 + 16) == cudaSuccess;
    ok &= cudaMalloc((void **)&t->dx[r], (size_t)(T_max * H) * 2 + 16) == cudaSuccess;
    ok &= cudaMalloc((void **)&t->dtw[r], (size_t)(T_max * K) * 4 + 16) == cudaSuccess;
    for (int i = 0; i < 3 && p->f.Is > 0 && ok; i++) {
      ok &= cudaMalloc(&t->dws[r][i], bwd_w_bytes(p, 3 + i) + 16) == cudaSuccess;
      if (ok && p->accumulate)
        cudaMemcpy(t->dws[r][i], p->dw0[3 + i].data(), bwd_w_bytes(p, 3 + i), cudaMemcpyHostToDevice);
      else if (ok) cudaMemset(t->dws[r][i], 0xFF, bwd_w_bytes(p, 3 + i));
    }
  }
  if (!ok) {
    printf("    EP backward: device allocation failed\n");
    ep_close(t);
  }
  return ok;
}

// dy of each rank's tokens (rank order), poisoned dx and dtopk_w.
static inline void ep_backward_inputs(ep_team_t *t, const bwd_problem_t *p, const int64_t *T) {
  int64_t start = 0;
  for (int r = 0; r < t->W; r++) {
    if (T[r] > 0)
      cudaMemcpy(t->dy[r], p->dy.data() + start * t->H, (size_t)(T[r] * t->H) * 2,
                 cudaMemcpyHostToDevice);
    cudaMemset(t->dx[r], 0xFF, (size_t)(t->T_max * t->H) * 2);
    cudaMemset(t->dtw[r], 0xFF, (size_t)(t->T_max * t->K) * 4);
    start += T[r];
  }
  cudaDeviceSynchronize();
}

static inline void ep_backward(ep_team_t *t, const int64_t *T, mokResult_t *res) {
  for (int r = 0; r < t->W; r++) {
    const mok_forward_args_t a = ep_rank_args(t, r, T[r]);
    const mok_backward_args_t b = ep_rank_backward_args(t, r, T[r]);
    res[r] = mok_backward(t->l[r], &a, &b, t->ctx[r], t->ctx_bytes, (mok_stream_t)t->s[r]);
  }
}

// The outputs of rank r (dx, dtopk_w of its tokens; its shared-expert gradients).
static inline void ep_backward_outputs(const ep_team_t *t, const bwd_problem_t *p, int r, int64_t T,
                                       bwd_out_t *o) {
  o->dx.assign((size_t)(T * t->H), 0);
  o->dtw.assign((size_t)(T * t->K), 0.0f);
  if (T > 0) {
    cudaMemcpy(o->dx.data(), t->dx[r], o->dx.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(o->dtw.data(), t->dtw[r], o->dtw.size() * 4, cudaMemcpyDeviceToHost);
  }
  for (int i = 0; i < BWD_NW; i++) {
    o->dw[i].assign(i < 3 || p->f.Is > 0 ? bwd_w_bytes(p, i) : 0, 0);
    if (o->dw[i].empty()) continue;
    cudaMemcpy(o->dw[i].data(), i < 3 ? t->dwr[i] : t->dws[r][i - 3], o->dw[i].size(),
               cudaMemcpyDeviceToHost);
  }
}

// p's problem restricted to tokens [start, start + T) (moved to the front), T_max = max(T, 1).
static inline bwd_problem_t ep_slice(const bwd_problem_t *p, int64_t start, int64_t T) {
  bwd_problem_t q = *p;
  const int64_t H = p->f.H, K = p->f.K, Tm = T > 0 ? T : 1;
  q.f.T = T, q.f.T_max = Tm;
  q.f.x.assign((size_t)(Tm * H), 0), q.dy.assign((size_t)(Tm * H), 0);
  q.f.idx.assign((size_t)(Tm * K), -1), q.f.tw.assign((size_t)(Tm * K), 0.0f);
  std::copy(p->f.x.begin() + start * H, p->f.x.begin() + (start + T) * H, q.f.x.begin());
  std::copy(p->dy.begin() + start * H, p->dy.begin() + (start + T) * H, q.dy.begin());
  std::copy(p->f.idx.begin() + start * K, p->f.idx.begin() + (start + T) * K, q.f.idx.begin());
  std::copy(p->f.tw.begin() + start * K, p->f.tw.begin() + (start + T) * K, q.f.tw.begin());
  q.f.capacity_factor = 0;
  return q;
}

// W = 1 forward + backward of q on the GPU; 0 on failure.
static inline int ep_w1_backward(const bwd_problem_t *q, bwd_out_t *o) {
  bwd_gpu_t g;
  if (!bwd_gpu_open(&g, q)) return 0;
  bwd_gpu_inputs(&g, q);
  int ok = q->f.T == 0 ? 1
                       : bwd_gpu_run(&g, q, 0) == MOK_SUCCESS && mok_layer_check(g.f.l) == MOK_SUCCESS;
  if (q->f.T == 0) {  // a backward of no tokens: what it leaves in the shared gradients
    const mok_forward_args_t a = test_gpu_layer_args(&g.f, 0);
    const mok_backward_args_t b = test_backward_args(0, g.dy, g.dx, g.dtw, g.dw, q->f.Is > 0);
    ok = test_gpu_layer_forward(&g.f, 0, NULL) == MOK_SUCCESS &&
         mok_backward(g.f.l, &a, &b, g.f.ctx, g.f.ctx_bytes, NULL) == MOK_SUCCESS &&
         mok_layer_check(g.f.l) == MOK_SUCCESS;
  }
  if (ok) bwd_gpu_outputs(&g, q, o);
  bwd_gpu_close(&g);
  return ok;
}

// The ranks' backward path in ep_bwd_case (the W = 1 references keep the default, the chain).
static mok_backward_path_t ep_bwd_path = MOK_BACKWARD_CHAIN;

// Forward + backward with W ranks holding tokens T[0..W-1] of p (rank order): dx, dtopk_w and
// the routed experts' weight gradients bitwise the W = 1 layer's over all tokens; each rank's
// shared-expert gradients bitwise a W = 1 layer's over that rank's tokens.
static inline int ep_bwd_case(const bwd_problem_t *p, int W, const int64_t *T, const char *what) {
  int64_t total = 0, T_max = 1;
  for (int r = 0; r < W; r++) total += T[r], T_max = T[r] > T_max ? T[r] : T_max;
  bwd_out_t ref;
  const bwd_problem_t all = ep_slice(p, 0, total);
  if (!ep_w1_backward(&all, &ref)) {
    printf("    %s: the W = 1 layer failed\n", what);
    MOK_EXPECT_MSG(0, "%s: no reference", what);
    return 0;
  }
  ep_team_t t;
  if (!ep_open_backward(&t, p, W, T_max)) {
    MOK_EXPECT_MSG(0, "%s: the ranks' layers could not be created", what);
    return 0;
  }
  for (int r = 0; r < W; r++) {
    mok_tuning_t tu;
    const int tuned = mok_layer_tuning(t.l[r], &tu) == MOK_SUCCESS &&
                      (tu.backward_path = ep_bwd_path, 1) &&
                      mok_layer_set_tuning(t.l[r], &tu) == MOK_SUCCESS;
    MOK_EXPECT_MSG(tuned, "%s: rank %d's backward path: %s", what, r, mok_last_error());
  }
  ep_inputs(&t, &p->f, T);
  ep_backward_inputs(&t, p, T);
  mokResult_t res[EP_MAX_W], bres[EP_MAX_W], chk[EP_MAX_W];
  char msg[EP_MAX_W][MOK_ERR_LEN];
  ep_forward(&t, T, res, -1);
  ep_backward(&t, T, bres);
  ep_check(&t, chk, msg);
  int ok = 1;
  for (int r = 0; r < W; r++)
    if (res[r] != MOK_SUCCESS || bres[r] != MOK_SUCCESS || chk[r] != MOK_SUCCESS) {
      printf("    %s: rank %d: forward %s, backward %s, check %s: %s\n", what, r,
             mok_error_string(res[r]), mok_error_string(bres[r]), mok_error_string(chk[r]),
             msg[r]);
      ok = 0;
    }
  int64_t start = 0;
  for (int r = 0; r < W && ok; r++) {
    bwd_out_t o, own;
    ep_backward_outputs(&t, p, r, T[r], &o);
    const bwd_problem_t mine = ep_slice(p, start, T[r]);
    const int own_ok = p->f.Is == 0 || ep_w1_backward(&mine, &own);
    const int dx_same = memcmp(o.dx.data(), ref.dx.data() + start * t.H, o.dx.size() * 2) == 0;
    const int dtw_same = memcmp(o.dtw.data(), ref.dtw.data() + start * t.K, o.dtw.size() * 4) == 0;
    int dw_same = 1, dws_same = 1;
    for (int i = 0; i < 3; i++) dw_same &= r > 0 || o.dw[i] == ref.dw[i];
    for (int i = 3; i < BWD_NW && p->f.Is > 0; i++) dws_same &= own_ok && o.dw[i] == own.dw[i];
    if (!dx_same || !dtw_same || !dw_same || !dws_same) {
      printf("    %s: rank %d (%lld tokens): dx %s, dtopk_w %s, routed weight gradients %s, "
             "shared ones %s\n",
             what, r, (long long)T[r], dx_same ? "same" : "DIFFER", dtw_same ? "same" : "DIFFER",
             dw_same ? "same" : "DIFFER", dws_same ? "same" : "DIFFER");
      ok = 0;
    }
    start += T[r];
  }
  ep_close(&t);
  MOK_EXPECT_MSG(ok, "%s: the expert-parallel gradients are not the W = 1 layer's", what);
  return ok;
}

static inline void ep_bwd_problem(bwd_problem_t *p, int64_t Is, int64_t T, test_route_t route) {
  bwd_problem_init(p, 256, 256, 16, 4, Is, T, T);
  fwd_route(&p->f, route);
}

#endif /* MOK_TESTS_GPU_EP_TEST_UTIL_CUH */
