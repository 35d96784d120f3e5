/*
 * test_ep.cu: expert parallelism inside the layer, on ONE GPU: W = 2 and W = 4 virtual ranks
 * (mok_comm_create_virtual, include/mok.h) whose peers are buffers on the same device, each
 * rank's calls on its own stream, all enqueued from this thread. The kernels, the counters and
 * the transport are those of W GPUs.
 *
 * EP-invariance: W ranks holding T_0, ..., T_{W-1} tokens give bitwise the y of one W = 1 layer
 * (the fused forward) holding the tokens concatenated in rank order. Cases: uneven T, T = 0 on a
 * rank, empty slots, experts nobody uses, every token on one rank's experts, many calls in a row
 * with new routing; bad routing and capacity overflow on one rank reported there, the other
 * ranks naming it, nothing computed, and the next good call right; a rank that never calls
 * gives MOK_ERROR_TIMEOUT on the others within the bound; forward + backward captured in CUDA
 * graphs and replayed with new routing; K = 40 and W = 8. ep_two_gpus_equal_one runs the same
 * comparison across two real GPUs (a thread per GPU, a unique-id communicator) and skips with one.
 * Every test skips without a GPU.
 */
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

static void ep_close(ep_team_t *t) {
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

static mok_forward_args_t ep_rank_args(const ep_team_t *t, int r, int64_t T);

// A team of W ranks for p's shape (T_max per rank), with tuning timeout `timeout_s` (0: default)
// and the layer descriptor's weight-gradient fields from `wdt`, `accumulate`.
static int ep_open_wgrad(ep_team_t *t, const fwd_problem_t *p, int W, int64_t T_max,
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

static int ep_open(ep_team_t *t, const fwd_problem_t *p, int W, int64_t T_max, double timeout_s) {
  return ep_open_wgrad(t, p, W, T_max, timeout_s, MOK_WGRAD_FP32, 0);
}

// Rank r's tokens are tokens [start_r, start_r + T_r) of p (rank order), poisoned y.
static void ep_inputs(ep_team_t *t, const fwd_problem_t *p, const int64_t *T) {
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
static mok_forward_args_t ep_rank_args(const ep_team_t *t, int r, int64_t T) {
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
static mok_backward_args_t ep_rank_backward_args(const ep_team_t *t, int r, int64_t T) {
  const size_t ew = (size_t)(t->EL * t->H * t->I);
  void *dw[6];
  for (int i = 0; i < 3; i++) dw[i] = (char *)t->dwr[i] + r * ew * t->wgrad_el;
  for (int i = 0; i < 3; i++) dw[3 + i] = t->dws[r][i];
  return test_backward_args(T, t->dy[r], t->dx[r], t->dtw[r], dw, t->wsg != NULL);
}

// One forward on every rank (rank order, each on its stream); res[r] the call's result.
static void ep_forward(ep_team_t *t, const int64_t *T, mokResult_t *res, int skip_rank) {
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
static void ep_check(ep_team_t *t, mokResult_t *res, char (*msg)[MOK_ERR_LEN]) {
  for (int r = 0; r < t->W; r++) cudaStreamSynchronize(t->s[r]);
  for (int r = 0; r < t->W; r++) {
    res[r] = mok_layer_check(t->l[r]);
    if (msg) snprintf(msg[r], MOK_ERR_LEN, "%s", res[r] == MOK_SUCCESS ? "" : mok_last_error());
  }
}

// y of one W = 1 layer (the fused forward) on p's first T tokens.
static std::vector<uint16_t> ep_reference_y(const fwd_problem_t *p, int64_t T) {
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
static int ep_same_as_w1(ep_team_t *t, const std::vector<uint16_t> &ref, const int64_t *T,
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
static int ep_set_mode(ep_team_t *t, ep_mode_t mode) {
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
static int ep_case_mode(const fwd_problem_t *p, int W, const int64_t *T, const char *what,
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

static int ep_case(const fwd_problem_t *p, int W, const int64_t *T, const char *what) {
  return ep_case_mode(p, W, T, what, EP_FUSED);
}

// The case with the dispatch kernel, then with the dispatch inside the fused kernel.
static void ep_case_both(const fwd_problem_t *p, int W, const int64_t *T, const char *what) {
  char in_kernel[160];
  snprintf(in_kernel, sizeof(in_kernel), "%s, the dispatch in the fused kernel", what);
  ep_case_mode(p, W, T, what, EP_FUSED);
  ep_case_mode(p, W, T, in_kernel, EP_FUSED_DISPATCH);
}

static void ep_problem(fwd_problem_t *p, int64_t Is, int64_t T, test_route_t route) {
  fwd_problem_init(p, 256, 256, 16, 4, Is, T, T);
  fwd_route(p, route);
}

MOK_TEST(ep_forward_two_ranks_equal_one) {
  NEED_GPU();
  fwd_problem_t p;
  ep_problem(&p, 128, 300, test_route_uniform(0.1));
  const int64_t even[2] = {150, 150}, uneven[2] = {211, 89}, zero[2] = {0, 300};
  ep_case(&p, 2, even, "W = 2, 150 + 150 tokens");
  ep_case(&p, 2, uneven, "W = 2, 211 + 89 tokens");
  ep_case(&p, 2, zero, "W = 2, rank 0 without tokens");
  ep_case_mode(&p, 2, uneven, "W = 2, the experts' kernel chain", EP_CHAIN);
  ep_case_mode(&p, 2, uneven, "W = 2, the dispatch in the fused kernel", EP_FUSED_DISPATCH);
  ep_case_mode(&p, 2, zero, "W = 2, the dispatch in the fused kernel, rank 0 without tokens",
               EP_FUSED_DISPATCH);
  ep_problem(&p, 0, 300, test_route_uniform(0.3));
  ep_case(&p, 2, uneven, "W = 2, no shared expert, 30% empty slots");
  ep_case_mode(&p, 2, zero, "W = 2, the chain, no shared expert, rank 0 without tokens",
               EP_CHAIN);
  ep_case_mode(&p, 2, uneven, "W = 2, the dispatch in the fused kernel, no shared expert",
               EP_FUSED_DISPATCH);
}

MOK_TEST(ep_forward_four_ranks_equal_one) {
  NEED_GPU();
  fwd_problem_t p;
  ep_problem(&p, 128, 400, test_route_uniform(0.1));
  const int64_t T[4] = {130, 0, 211, 59};
  ep_case_both(&p, 4, T, "W = 4, 130 + 0 + 211 + 59 tokens");
  const test_route_t hot = {0.0, 0, 13}; // slot 0 of every token on rank 3's expert 13
  ep_problem(&p, 0, 400, hot);
  ep_case_both(&p, 4, T, "W = 4, a hot expert");
  const test_route_t unused = {0.0, 0x0F0Full, -1}; // experts 0-3 and 8-11: ranks 0, 2 get none
  ep_problem(&p, 128, 400, unused);
  ep_case_both(&p, 4, T, "W = 4, ranks 0 and 2 hold no used expert");
  const test_route_t one_rank = {0.0, 0x00FFull, -1}; // W = 2: every row on rank 1's experts
  ep_problem(&p, 128, 400, one_rank);
  const int64_t T2[2] = {250, 150};
  ep_case_both(&p, 2, T2, "W = 2, every token on rank 1's experts");
  ep_problem(&p, 128, 400, test_route_uniform(1.0));
  ep_case_both(&p, 4, T, "W = 4, every slot empty (y = the shared expert)");
}

// Many calls on the same team with new routing and token counts each time: every call equals W = 1.
MOK_TEST(ep_forward_many_calls) {
  NEED_GPU();
  fwd_problem_t p;
  ep_problem(&p, 128, 512, test_route_uniform(0.1));
  ep_team_t t;
  MOK_REQUIRE(ep_open(&t, &p, 2, 256, 0));
  test_rng_t rng = test_rng(0x5eed0e9ull);
  int good = 0;
  const int calls = 12;
  for (int n = 0; n < calls; n++) {
    test_route_t rt = test_route_uniform(n % 3 == 0 ? 0.4 : 0.05);
    if (n % 4 == 1) rt.hot = (int)test_rng_below(&rng, 16);
    fwd_route(&p, rt);
    const int64_t T[2] = {(int64_t)test_rng_below(&rng, 257), (int64_t)test_rng_below(&rng, 257)};
    const std::vector<uint16_t> ref = ep_reference_y(&p, T[0] + T[1]);
    ep_inputs(&t, &p, T);
    // the dispatch kernel and the dispatch inside the fused kernel in turn, on the same counters
    MOK_REQUIRE(ep_set_mode(&t, n % 2 ? EP_FUSED_DISPATCH : EP_FUSED));
    mokResult_t res[2], chk[2];
    ep_forward(&t, T, res, -1);
    ep_check(&t, chk, NULL);
    char what[80];
    snprintf(what, sizeof(what), "call %d (%lld + %lld tokens, %s)", n, (long long)T[0],
             (long long)T[1], n % 2 ? "dispatch in the fused kernel" : "dispatch kernel");
    good += res[0] == MOK_SUCCESS && res[1] == MOK_SUCCESS && chk[0] == MOK_SUCCESS &&
            chk[1] == MOK_SUCCESS && ep_same_as_w1(&t, ref, T, what);
  }
  ep_close(&t);
  MOK_EXPECT_MSG(good == calls, "%d of %d calls equal to W = 1", good, calls);
}

// Bad routing on rank 0: rank 0 names the slot, rank 1 names rank 0, no y is written, and the
// next good call on the same layers is right.
MOK_TEST(ep_bad_routing_on_one_rank) {
  NEED_GPU();
  fwd_problem_t p;
  ep_problem(&p, 128, 200, test_route_uniform(0.1));
  const int64_t T[2] = {120, 80};
  ep_team_t t;
  MOK_REQUIRE(ep_open(&t, &p, 2, 128, 0));
  const int32_t good_id = p.idx[5 * 4 + 2];
  p.idx[5 * 4 + 2] = 99; // rank 0, token 5, slot 2: outside [-1, 16)
  ep_inputs(&t, &p, T);
  mokResult_t res[2], chk[2];
  char msg[2][MOK_ERR_LEN];
  ep_forward(&t, T, res, -1);
  ep_check(&t, chk, msg);
  MOK_EXPECT(res[0] == MOK_SUCCESS && res[1] == MOK_SUCCESS);
  MOK_EXPECT_MSG(chk[0] == MOK_ERROR_INVALID_ROUTING && strstr(msg[0], "token 5 slot 2"),
                 "rank 0: %s", msg[0]);
  MOK_EXPECT_MSG(chk[1] == MOK_ERROR_INVALID_ROUTING && strstr(msg[1], "rank 0's routing"),
                 "rank 1: %s", msg[1]);
  std::vector<uint16_t> y((size_t)(T[1] * p.H));
  cudaMemcpy(y.data(), t.y[1], y.size() * 2, cudaMemcpyDeviceToHost);
  size_t touched = 0;
  for (uint16_t v : y) touched += v != 0xFFFF;
  MOK_EXPECT_MSG(touched == 0, "rank 1 wrote %zu elements of y in a failed call", touched);
  p.idx[5 * 4 + 2] = good_id;
  const std::vector<uint16_t> ref = ep_reference_y(&p, T[0] + T[1]);
  ep_inputs(&t, &p, T);
  ep_forward(&t, T, res, -1);
  ep_check(&t, chk, msg);
  MOK_EXPECT_MSG(chk[0] == MOK_SUCCESS && chk[1] == MOK_SUCCESS, "after: %s / %s", msg[0], msg[1]);
  MOK_EXPECT(ep_same_as_w1(&t, ref, T, "the good call after bad routing"));
  ep_close(&t);
}

// Capacity overflow on the rank that holds every used expert: reported there, named on the
// other rank, nothing computed, nobody hangs, and a call within capacity afterwards is right.
MOK_TEST(ep_capacity_overflow_on_one_rank) {
  NEED_GPU();
  fwd_problem_t p;
  const test_route_t one_rank = {0.0, 0x00FFull, -1}; // every row on rank 1's experts
  ep_problem(&p, 0, 256, one_rank);
  p.capacity_factor = 0.5; // rows per rank: 0.5 x T_max x K = 256 of the 512 routed here
  const int64_t T[2] = {128, 128};
  ep_team_t t;
  MOK_REQUIRE(ep_open(&t, &p, 2, 128, 0));
  ep_inputs(&t, &p, T);
  mokResult_t res[2], chk[2];
  char msg[2][MOK_ERR_LEN];
  ep_forward(&t, T, res, -1);
  ep_check(&t, chk, msg);
  MOK_EXPECT_MSG(chk[1] == MOK_ERROR_CAPACITY_OVERFLOW, "rank 1: %s", msg[1]);
  MOK_EXPECT_MSG(chk[0] == MOK_ERROR_CAPACITY_OVERFLOW && strstr(msg[0], "rank 1 would receive"),
                 "rank 0: %s", msg[0]);
  const int64_t small[2] = {32, 32}; // 256 rows: exactly the capacity
  const std::vector<uint16_t> ref = ep_reference_y(&p, 64);
  ep_inputs(&t, &p, small);
  ep_forward(&t, small, res, -1);
  ep_check(&t, chk, msg);
  MOK_EXPECT_MSG(chk[0] == MOK_SUCCESS && chk[1] == MOK_SUCCESS, "after: %s / %s", msg[0], msg[1]);
  MOK_EXPECT(ep_same_as_w1(&t, ref, small, "rows = capacity after an overflow"));
  ep_close(&t);
}

// A rank that never calls: the other gets MOK_ERROR_TIMEOUT within the bound, naming the rank
// and the counter, and its call returns (no hang).
MOK_TEST(ep_rank_that_never_arrives_times_out) {
  NEED_GPU();
  fwd_problem_t p;
  ep_problem(&p, 0, 128, test_route_uniform(0.1));
  const int64_t T[2] = {64, 64};
  ep_team_t t;
  MOK_REQUIRE(ep_open(&t, &p, 2, 64, 0.5));
  ep_inputs(&t, &p, T);
  mokResult_t res[2];
  const double t0 = test_now_s();
  ep_forward(&t, T, res, 1); // rank 1 stays away
  cudaStreamSynchronize(t.s[0]);
  const double s = test_now_s() - t0;
  const mokResult_t chk = mok_layer_check(t.l[0]);
  char msg[MOK_ERR_LEN];
  snprintf(msg, sizeof(msg), "%s", mok_last_error());
  MOK_EXPECT_MSG(chk == MOK_ERROR_TIMEOUT && strstr(msg, "rank 1"), "rank 0: %s", msg);
  MOK_EXPECT_MSG(s < 5.0, "rank 0's forward took %.1f s with a 0.5 s bound", s);
  printf("    rank 0 gave up after %.2f s: %s\n", s, msg);
  ep_close(&t);
}

// After a timeout, mok_layer_recover on every rank and then a check on each make the layers
// usable again without creating them anew: when rank 1 stayed away from the call that timed
// out, and when it made that call late (after rank 0 had given up). Calls are refused between
// the timeout and the recovery's check; after it, two forwards in a row are bitwise the W = 1
// layer's. Last, a recovery that rank 1 does not join: rank 0's check reports MOK_ERROR_TIMEOUT
// naming rank 1 within the bound, and the layer refuses calls from then on.
MOK_TEST(ep_recovers_after_a_timeout) {
  NEED_GPU();
  fwd_problem_t p;
  ep_problem(&p, 128, 128, test_route_uniform(0.1));
  const int64_t T[2] = {64, 64};
  const std::vector<uint16_t> ref = ep_reference_y(&p, 128);
  ep_team_t t;
  MOK_REQUIRE(ep_open(&t, &p, 2, 64, 0.5));
  mokResult_t res[2], chk[2];
  char msg[2][MOK_ERR_LEN];
  for (int late = 0; late < 2; late++) {
    const char *what = late ? "rank 1 late" : "rank 1 away";
    ep_inputs(&t, &p, T);
    ep_forward(&t, T, res, 1);  // rank 0 alone: its waits time out
    cudaStreamSynchronize(t.s[0]);
    if (late) {
      const mok_forward_args_t a = ep_rank_args(&t, 1, T[1]);
      res[1] = mok_forward(t.l[1], &a, t.y[1], t.ctx[1], t.ctx_bytes, (mok_stream_t)t.s[1]);
      MOK_EXPECT_MSG(res[1] == MOK_SUCCESS, "%s: rank 1's late call: %s", what, mok_last_error());
    }
    ep_check(&t, chk, msg);
    MOK_EXPECT_MSG(chk[0] == MOK_ERROR_TIMEOUT && strstr(msg[0], "rank 1"), "%s: rank 0: %s", what,
                   msg[0]);
    printf("    %s: rank 0: %s; rank 1: %s\n", what, msg[0], chk[1] ? msg[1] : "no error");
    const mok_forward_args_t a0 = ep_rank_args(&t, 0, T[0]);
    const mokResult_t refused =
        mok_forward(t.l[0], &a0, t.y[0], t.ctx[0], t.ctx_bytes, (mok_stream_t)t.s[0]);
    MOK_EXPECT_MSG(refused == MOK_ERROR_TIMEOUT && strstr(mok_last_error(), "recover"),
                   "%s: a forward before the recovery: %s", what, mok_last_error());
    for (int r = 0; r < 2; r++) {
      const mokResult_t rr = mok_layer_recover(t.l[r], (mok_stream_t)t.s[r]);
      MOK_EXPECT_MSG(rr == MOK_SUCCESS, "%s: rank %d's recover: %s", what, r, mok_last_error());
    }
    ep_check(&t, chk, msg);
    MOK_EXPECT_MSG(chk[0] == MOK_SUCCESS && chk[1] == MOK_SUCCESS, "%s: recovery: %s / %s", what,
                   msg[0], msg[1]);
    for (int call = 0; call < 2; call++) {
      ep_inputs(&t, &p, T);
      ep_forward(&t, T, res, -1);
      ep_check(&t, chk, msg);
      MOK_EXPECT_MSG(res[0] == MOK_SUCCESS && res[1] == MOK_SUCCESS && chk[0] == MOK_SUCCESS &&
                         chk[1] == MOK_SUCCESS,
                     "%s: call %d after the recovery: %s / %s", what, call, msg[0], msg[1]);
      MOK_EXPECT(ep_same_as_w1(&t, ref, T, what));
    }
  }
  // A recovery that rank 1 does not join.
  const double t0 = test_now_s();
  MOK_EXPECT(mok_layer_recover(t.l[0], (mok_stream_t)t.s[0]) == MOK_SUCCESS);
  cudaStreamSynchronize(t.s[0]);
  const double sec = test_now_s() - t0;
  chk[0] = mok_layer_check(t.l[0]);
  snprintf(msg[0], MOK_ERR_LEN, "%s", mok_last_error());
  MOK_EXPECT_MSG(chk[0] == MOK_ERROR_TIMEOUT && strstr(msg[0], "rank 1 did not join"),
                 "rank 0: %s", msg[0]);
  MOK_EXPECT_MSG(sec < 5.0, "rank 0's recovery took %.1f s with a 0.5 s bound", sec);
  const mok_forward_args_t a0 = ep_rank_args(&t, 0, T[0]);
  MOK_EXPECT_MSG(mok_forward(t.l[0], &a0, t.y[0], t.ctx[0], t.ctx_bytes, (mok_stream_t)t.s[0]) ==
                     MOK_ERROR_TIMEOUT && strstr(mok_last_error(), "destroy"),
                 "a forward after the failed recovery: %s", mok_last_error());
  printf("    unjoined recovery after %.2f s: %s\n", sec, msg[0]);
  ep_close(&t);
}

/* ---------------------------------------------------------------------------------------------- */
/* Backward                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

// A team for bwd_problem p (T_max per rank) with its backward buffers: routed weight gradients
// start from p's dw0 (accumulate) or NaN poison, the shared ones likewise per rank.
static int ep_open_backward(ep_team_t *t, const bwd_problem_t *p, int W, int64_t T_max) {
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
static void ep_backward_inputs(ep_team_t *t, const bwd_problem_t *p, const int64_t *T) {
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

static void ep_backward(ep_team_t *t, const int64_t *T, mokResult_t *res) {
  for (int r = 0; r < t->W; r++) {
    const mok_forward_args_t a = ep_rank_args(t, r, T[r]);
    const mok_backward_args_t b = ep_rank_backward_args(t, r, T[r]);
    res[r] = mok_backward(t->l[r], &a, &b, t->ctx[r], t->ctx_bytes, (mok_stream_t)t->s[r]);
  }
}

// The outputs of rank r (dx, dtopk_w of its tokens; its shared-expert gradients).
static void ep_backward_outputs(const ep_team_t *t, const bwd_problem_t *p, int r, int64_t T,
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
static bwd_problem_t ep_slice(const bwd_problem_t *p, int64_t start, int64_t T) {
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
static int ep_w1_backward(const bwd_problem_t *q, bwd_out_t *o) {
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
static int ep_bwd_case(const bwd_problem_t *p, int W, const int64_t *T, const char *what) {
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

static void ep_bwd_problem(bwd_problem_t *p, int64_t Is, int64_t T, test_route_t route) {
  bwd_problem_init(p, 256, 256, 16, 4, Is, T, T);
  fwd_route(&p->f, route);
}

MOK_TEST(ep_backward_equals_one_rank) {
  NEED_GPU();
  bwd_problem_t p;
  ep_bwd_problem(&p, 128, 300, test_route_uniform(0.1));
  const int64_t two[2] = {211, 89}, zero[2] = {0, 300}, four[4] = {100, 0, 141, 59};
  ep_bwd_case(&p, 2, two, "W = 2, 211 + 89 tokens");
  ep_bwd_case(&p, 2, zero, "W = 2, rank 0 without tokens");
  ep_bwd_case(&p, 4, four, "W = 4, 100 + 0 + 141 + 59 tokens");
  p.f.mode = MOK_CONTEXT_RECOMPUTE;
  ep_bwd_case(&p, 2, two, "W = 2, RECOMPUTE");
  p.f.mode = MOK_CONTEXT_SAVE;
  bwd_set_wgrad(&p, MOK_WGRAD_BF16, 1);
  ep_bwd_case(&p, 2, two, "W = 2, bf16 weight gradients accumulated");
  bwd_set_wgrad(&p, MOK_WGRAD_FP32, 1);
  ep_bwd_case(&p, 4, four, "W = 4, fp32 weight gradients accumulated");
  const test_route_t hot = {0.3, 0, 13};
  ep_bwd_problem(&p, 0, 300, hot);
  ep_bwd_case(&p, 2, two, "W = 2, no shared expert, a hot expert, 30% empty slots");
}

// The same with the fused backward kernel on every rank (src/cuda/backward/fused.cu on the
// arrived rows, no reduce in it): bitwise the W = 1 layer's chain.
MOK_TEST(ep_backward_fused_equals_one_rank) {
  NEED_GPU();
  bwd_problem_t p;
  ep_bwd_problem(&p, 128, 300, test_route_uniform(0.1));
  const int64_t two[2] = {211, 89}, zero[2] = {0, 300}, four[4] = {100, 0, 141, 59};
  ep_bwd_path = MOK_BACKWARD_FUSED;
  ep_bwd_case(&p, 2, two, "fused, W = 2, 211 + 89 tokens");
  ep_bwd_case(&p, 2, zero, "fused, W = 2, rank 0 without tokens");
  ep_bwd_case(&p, 4, four, "fused, W = 4, 100 + 0 + 141 + 59 tokens");
  bwd_set_wgrad(&p, MOK_WGRAD_FP32, 1);
  ep_bwd_case(&p, 4, four, "fused, W = 4, fp32 weight gradients accumulated");
  ep_bwd_path = MOK_BACKWARD_CHAIN;
}

// An fp8 precision's cases with W = 2 and 4 ranks (`name` in the messages; RECOMPUTE with scale
// rounding `rec_scale`): y, dx, dtopk_w and the routed weight gradients bitwise the W = 1 layer's
// of the same precision.
static void ep_fp8_cases(mok_precision_t prec, const char *name, mok_fp8_scale_t rec_scale) {
  const int64_t two[2] = {211, 89}, zero[2] = {0, 300}, four[4] = {100, 0, 141, 59};
  char what[160];
#define EP_WHAT(s) (snprintf(what, sizeof(what), "%s %s", name, s), what)
  fwd_problem_t f;
  ep_problem(&f, 128, 300, test_route_uniform(0.1));
  f.prec = prec;
  ep_case(&f, 2, two, EP_WHAT("W = 2, 211 + 89 tokens"));
  ep_case(&f, 2, zero, EP_WHAT("W = 2, rank 0 without tokens"));
  ep_case(&f, 4, four, EP_WHAT("W = 4, 100 + 0 + 141 + 59 tokens"));
  ep_problem(&f, 0, 300, test_route_uniform(0.3));
  f.prec = prec;
  ep_case(&f, 2, two, EP_WHAT("W = 2, no shared expert, 30% empty slots"));
  bwd_problem_t p;
  ep_bwd_problem(&p, 128, 300, test_route_uniform(0.1));
  p.f.prec = prec;
  ep_bwd_case(&p, 2, two, EP_WHAT("W = 2, 211 + 89 tokens"));
  ep_bwd_case(&p, 2, zero, EP_WHAT("W = 2, rank 0 without tokens"));
  ep_bwd_case(&p, 4, four, EP_WHAT("W = 4, 100 + 0 + 141 + 59 tokens"));
  p.f.mode = MOK_CONTEXT_RECOMPUTE;
  p.f.fp8_scale = rec_scale;
  ep_bwd_case(&p, 2, two, EP_WHAT("W = 2, RECOMPUTE"));
  const test_route_t hot = {0.3, 0, 13};
  ep_bwd_problem(&p, 0, 300, hot);
  p.f.prec = prec;
  ep_bwd_case(&p, 2, two, EP_WHAT("W = 2, no shared expert, a hot expert, 30% empty slots"));
#undef EP_WHAT
}

// fp8-block: the arrived e4m3 rows and scales are the bytes W = 1 copies from each token's
// quantization, and every fp8 GEMM row depends on its own A row; RECOMPUTE with power-of-two
// scales.
MOK_TEST(ep_fp8_block_equals_one_rank) {
  NEED_GPU();
  ep_fp8_cases(MOK_PRECISION_FP8_BLOCK, "fp8-block", MOK_FP8_SCALE_POW2);
}

// MXFP8: each token's x crosses as e4m3 bytes and E8M0 scales, dequantized on the expert rank by
// the same device function that gives the W = 1 layer's values; the backward sends bf16 x and dy
// (its weight gradients read the unquantized rows) and quantizes per row.
MOK_TEST(ep_mxfp8_equals_one_rank) {
  NEED_GPU();
  ep_fp8_cases(MOK_PRECISION_MXFP8, "MXFP8", MOK_FP8_SCALE_FP32);  // MXFP8 ignores the scale
}

// A context that does not match on one rank: that rank says why, the other names it, and no
// rank computes (dx untouched on both).
MOK_TEST(ep_backward_context_mismatch_on_one_rank) {
  NEED_GPU();
  bwd_problem_t p;
  ep_bwd_problem(&p, 0, 200, test_route_uniform(0.1));
  const int64_t T[2] = {120, 80};
  ep_team_t t;
  MOK_REQUIRE(ep_open_backward(&t, &p, 2, 128));
  ep_inputs(&t, &p.f, T);
  ep_backward_inputs(&t, &p, T);
  mokResult_t res[2], chk[2];
  char msg[2][MOK_ERR_LEN];
  ep_forward(&t, T, res, -1);
  ep_check(&t, chk, msg);
  MOK_REQUIRE(chk[0] == MOK_SUCCESS && chk[1] == MOK_SUCCESS);
  cudaMemset(t.ctx[1], 0, 64);  // rank 1's header: no longer a forward's
  ep_backward(&t, T, res);
  ep_check(&t, chk, msg);
  MOK_EXPECT_MSG(chk[1] == MOK_ERROR_CONTEXT_MISMATCH, "rank 1: %s", msg[1]);
  MOK_EXPECT_MSG(chk[0] == MOK_ERROR_CONTEXT_MISMATCH && strstr(msg[0], "rank 1's ctx"),
                 "rank 0: %s", msg[0]);
  for (int r = 0; r < 2; r++) {
    std::vector<uint16_t> dx((size_t)(T[r] * p.f.H));
    cudaMemcpy(dx.data(), t.dx[r], dx.size() * 2, cudaMemcpyDeviceToHost);
    size_t touched = 0;
    for (uint16_t v : dx) touched += v != 0xFFFF;
    MOK_EXPECT_MSG(touched == 0, "rank %d wrote %zu elements of dx", r, touched);
  }
  ep_close(&t);
}

// Each rank's forward + backward captured in a CUDA graph of its own (as each process of W GPUs
// would), then replayed with new routing in the same buffers: every replay gives the W = 1 layer's
// y, dx and routed weight gradients (the call numbers live on the device, so replays count).
static void ep_graph_case(ep_mode_t mode) {
  bwd_problem_t p;
  ep_bwd_problem(&p, 128, 200, test_route_uniform(0.1));
  const int64_t T[2] = {120, 80};
  ep_team_t t;
  MOK_REQUIRE(ep_open_backward(&t, &p, 2, 128));
  MOK_REQUIRE(ep_set_mode(&t, mode));
  ep_inputs(&t, &p.f, T);
  ep_backward_inputs(&t, &p, T);
  cudaGraphExec_t exec[2] = {NULL, NULL};
  int captured = 1;
  for (int r = 0; r < 2 && captured; r++) {
    cudaGraph_t graph = NULL;
    captured &= cudaStreamBeginCapture(t.s[r], cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    mokResult_t res[2], bres[2];
    // Only rank r's calls go to its capture (the other's are skipped now, enqueued in its turn).
    ep_forward(&t, T, res, 1 - r);
    {  // rank r's backward
      const mok_forward_args_t a = ep_rank_args(&t, r, T[r]);
      const mok_backward_args_t b = ep_rank_backward_args(&t, r, T[r]);
      bres[r] = mok_backward(t.l[r], &a, &b, t.ctx[r], t.ctx_bytes, (mok_stream_t)t.s[r]);
    }
    const cudaError_t ce = cudaStreamEndCapture(t.s[r], &graph);
    captured &= res[r] == MOK_SUCCESS && bres[r] == MOK_SUCCESS && ce == cudaSuccess &&
                cudaGraphInstantiate(&exec[r], graph, 0) == cudaSuccess;
    if (!captured) printf("    rank %d: capture failed: %s / %s\n", r, mok_last_error(), cudaGetErrorString(ce));
    if (graph) cudaGraphDestroy(graph);
  }
  MOK_REQUIRE(captured);
  test_rng_t rng = test_rng(0x6a7e9ull);
  for (int n = 0; n < 4; n++) {
    test_route_t rt = test_route_uniform(n == 2 ? 0.5 : 0.1);
    if (n == 1) rt.hot = (int)test_rng_below(&rng, 16);
    fwd_route(&p.f, rt);
    bwd_out_t ref;
    const bwd_problem_t all = ep_slice(&p, 0, T[0] + T[1]);
    MOK_REQUIRE(ep_w1_backward(&all, &ref));
    ep_inputs(&t, &p.f, T);
    ep_backward_inputs(&t, &p, T);
    for (int i = 0; i < 3; i++) cudaMemset(t.dwr[i], 0xFF, bwd_w_bytes(&p, i));
    cudaDeviceSynchronize();
    for (int r = 0; r < 2; r++) MOK_EXPECT(cudaGraphLaunch(exec[r], t.s[r]) == cudaSuccess);
    mokResult_t chk[2];
    char msg[2][MOK_ERR_LEN];
    ep_check(&t, chk, msg);
    MOK_EXPECT_MSG(chk[0] == MOK_SUCCESS && chk[1] == MOK_SUCCESS, "replay %d: %s / %s", n,
                   msg[0], msg[1]);
    const std::vector<uint16_t> yref = ep_reference_y(&p.f, T[0] + T[1]);
    char what[48];
    snprintf(what, sizeof(what), "graph replay %d", n);
    MOK_EXPECT(ep_same_as_w1(&t, yref, T, what));
    int64_t start = 0;
    for (int r = 0; r < 2; r++) {
      bwd_out_t o;
      ep_backward_outputs(&t, &p, r, T[r], &o);
      int same = memcmp(o.dx.data(), ref.dx.data() + start * t.H, o.dx.size() * 2) == 0;
      for (int i = 0; i < 3 && r == 0; i++) same &= o.dw[i] == ref.dw[i];
      MOK_EXPECT_MSG(same, "replay %d, rank %d: dx or the routed weight gradients differ from W = 1",
                     n, r);
      start += T[r];
    }
  }
  for (int r = 0; r < 2; r++) cudaGraphExecDestroy(exec[r]);
  ep_close(&t);
}

MOK_TEST(ep_cuda_graph_replays_with_new_routing) {
  NEED_GPU();
  ep_graph_case(EP_FUSED);
  ep_graph_case(EP_FUSED_DISPATCH);
}

// Wide routing and many ranks: K = 40 > 31 (the dispatch's and combine's second group of slots),
// W = 8 with one expert per rank (EL = 1), forward and backward, bitwise the W = 1 layer's.
MOK_TEST(ep_wide_routing_and_eight_ranks) {
  NEED_GPU();
  bwd_problem_t p;
  bwd_problem_init(&p, 256, 128, 64, 40, 128, 160, 160);
  fwd_route(&p.f, test_route_uniform(0.2));
  const int64_t two[2] = {97, 63};
  ep_case(&p.f, 2, two, "W = 2, K = 40 of E = 64");
  ep_bwd_case(&p, 2, two, "W = 2, K = 40 of E = 64 (backward)");
  bwd_problem_init(&p, 256, 128, 8, 3, 0, 160, 160);
  fwd_route(&p.f, test_route_uniform(0.1));
  const int64_t eight[8] = {20, 0, 31, 7, 40, 12, 1, 49};
  ep_case(&p.f, 8, eight, "W = 8, one expert per rank");
  ep_bwd_case(&p, 8, eight, "W = 8, one expert per rank (backward)");
}

/* ---------------------------------------------------------------------------------------------- */
/* Two real GPUs (skipped with fewer): the same checks across NVLink                               */
/* ---------------------------------------------------------------------------------------------- */

// One rank of a W-GPU team: a thread per GPU, since creating the communicator and the layer are
// collectives that block until every rank has called them.
typedef struct {
  int rank, W;
  const mok_unique_id_t *id;
  const bwd_problem_t *p;
  const int64_t *T;
  int64_t start, T_max;
  mokResult_t res;
  char msg[MOK_ERR_LEN];
  bwd_out_t out;  // dx, dtopk_w of its tokens; dw[0..2] its experts' slices; dw[3..5] shared
} ep_gpu_rank_t;

static void *ep_gpu_rank_main(void *arg) {
  ep_gpu_rank_t *k = (ep_gpu_rank_t *)arg;
  const bwd_problem_t *p = k->p;
  const fwd_problem_t &f = p->f;
  const int64_t T = k->T[k->rank], H = f.H, I = f.I, K = f.K, Is = f.Is, EL = f.E / k->W;
  cudaSetDevice(k->rank);
  mok_comm_t comm = NULL;
  mok_layer_t l = NULL;
  k->res = mok_comm_create_unique_id(&comm, k->id, k->rank, k->W, k->rank);
  mok_layer_desc_t d = bwd_desc(p);
  d.max_tokens = k->T_max;
  if (k->res == MOK_SUCCESS) k->res = mok_layer_create(&l, comm, &d);
  size_t ctx_bytes = 0;
  if (k->res == MOK_SUCCESS) k->res = mok_context_size(l, &ctx_bytes);
  if (k->res != MOK_SUCCESS) {
    snprintf(k->msg, sizeof(k->msg), "%s", mok_last_error());
    if (l) mok_layer_destroy(l);
    if (comm) mok_comm_destroy(comm);
    return NULL;
  }
  const size_t ew = (size_t)(EL * I * H), el = p->wdt == MOK_WGRAD_BF16 ? 2 : 4;
  auto up = [](const void *h, size_t n) { return test_dev_copy(h, n); };
  void *x = up(f.x.data() + k->start * H, (size_t)(T * H) * 2);
  void *idx = up(f.idx.data() + k->start * K, (size_t)(T * K) * 4);
  void *tw = up(f.tw.data() + k->start * K, (size_t)(T * K) * 4);
  void *dy = up(p->dy.data() + k->start * H, (size_t)(T * H) * 2);
  void *wg = up(f.wg.data() + k->rank * ew, ew * 2), *wu = up(f.wu.data() + k->rank * ew, ew * 2);
  void *wd = up(f.wd.data() + k->rank * ew, ew * 2);
  void *wsg = Is ? up(f.wsg.data(), (size_t)(Is * H) * 2) : NULL;
  void *wsu = Is ? up(f.wsu.data(), (size_t)(Is * H) * 2) : NULL;
  void *wsd = Is ? up(f.wsd.data(), (size_t)(H * Is) * 2) : NULL;
  void *y = NULL, *dx = NULL, *dtw = NULL, *ctx = NULL, *dw[6] = {NULL};
  cudaMalloc(&y, (size_t)(k->T_max * H) * 2 + 16);
  cudaMalloc(&dx, (size_t)(k->T_max * H) * 2 + 16);
  cudaMalloc(&dtw, (size_t)(k->T_max * K) * 4 + 16);
  cudaMalloc(&ctx, ctx_bytes);
  for (int i = 0; i < (Is ? 6 : 3); i++) cudaMalloc(&dw[i], (i < 3 ? ew : (size_t)(Is * H)) * el + 16);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  mok_weights_t w;
  memset(&w, 0, sizeof(w));
  w.wg = wg, w.wu = wu, w.wd = wd, w.wsg = wsg, w.wsu = wsu, w.wsd = wsd;
  const mok_forward_args_t a = test_forward_args(T, x, (const int32_t *)idx, (const float *)tw, w);
  const mok_backward_args_t b = test_backward_args(T, dy, dx, (float *)dtw, dw, Is > 0);
  k->res = mok_forward(l, &a, T ? y : NULL, ctx, ctx_bytes, (mok_stream_t)s);
  if (k->res == MOK_SUCCESS) k->res = mok_backward(l, &a, &b, ctx, ctx_bytes, (mok_stream_t)s);
  if (k->res == MOK_SUCCESS) k->res = mok_layer_check(l);
  if (k->res != MOK_SUCCESS) snprintf(k->msg, sizeof(k->msg), "%s", mok_last_error());
  cudaStreamSynchronize(s);
  k->out.dx.assign((size_t)(T * H), 0);
  k->out.dtw.assign((size_t)(T * K), 0.0f);
  std::vector<uint16_t> yv((size_t)(T * H));
  if (T > 0) {
    cudaMemcpy(yv.data(), y, yv.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(k->out.dx.data(), dx, k->out.dx.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(k->out.dtw.data(), dtw, k->out.dtw.size() * 4, cudaMemcpyDeviceToHost);
  }
  k->out.dw[0] = std::vector<uint8_t>((const uint8_t *)yv.data(), (const uint8_t *)(yv.data() + yv.size()));
  for (int i = 0; i < 3; i++) {
    k->out.dw[1 + i].assign(ew * el, 0);
    cudaMemcpy(k->out.dw[1 + i].data(), dw[i], ew * el, cudaMemcpyDeviceToHost);
  }
  void *bufs[] = {x, idx, tw, dy, wg, wu, wd, wsg, wsu, wsd, y, dx, dtw, ctx, dw[0], dw[1], dw[2],
                  dw[3], dw[4], dw[5]};
  for (void *q : bufs)
    if (q) cudaFree(q);
  cudaStreamDestroy(s);
  mok_layer_destroy(l);
  mok_comm_destroy(comm);
  return NULL;
}

// W GPUs, one thread each, against the W = 1 layer on GPU 0: y, dx, dtopk_w and every routed
// expert's weight gradients bitwise. (out.dw[0] carries y; dw[1..3] the rank's dWg, dWu, dWd.)
MOK_TEST(ep_two_gpus_equal_one) {
  NEED_GPU();
  int n = 0;
  cudaGetDeviceCount(&n);
  if (n < 2) MOK_SKIP("needs 2 GPUs (NVLink peers), found 1");
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (DESIGN.md section 5)
  bwd_problem_t p;
  ep_bwd_problem(&p, 128, 300, test_route_uniform(0.1));
  const int64_t T[2] = {211, 89};
  bwd_out_t ref;
  const bwd_problem_t all = ep_slice(&p, 0, 300);
  MOK_REQUIRE(ep_w1_backward(&all, &ref));
  const std::vector<uint16_t> yref = ep_reference_y(&p.f, 300);
  mok_unique_id_t id;
  const mokResult_t idr = mok_get_unique_id(&id);
  MOK_REQUIRE_MSG(idr == MOK_SUCCESS, "mok_get_unique_id: %s", mok_last_error());
  ep_gpu_rank_t k[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    k[r].rank = r, k[r].W = 2, k[r].id = &id, k[r].p = &p, k[r].T = T;
    k[r].start = r ? T[0] : 0, k[r].T_max = 256;
    k[r].msg[0] = '\0';
    pthread_create(&th[r], NULL, ep_gpu_rank_main, &k[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  const int64_t H = p.f.H, K = p.f.K;
  const size_t ew = (size_t)(p.f.E / 2 * p.f.I * H) * 4;  // fp32 weight gradients
  for (int r = 0; r < 2; r++) {
    MOK_EXPECT_MSG(k[r].res == MOK_SUCCESS, "rank %d: %s", r, k[r].msg);
    if (k[r].res != MOK_SUCCESS) continue;
    const int64_t s = k[r].start;
    MOK_EXPECT_MSG(memcmp(k[r].out.dw[0].data(), yref.data() + s * H, (size_t)(T[r] * H) * 2) == 0,
                   "rank %d: y differs from W = 1", r);
    MOK_EXPECT_MSG(memcmp(k[r].out.dx.data(), ref.dx.data() + s * H, (size_t)(T[r] * H) * 2) == 0,
                   "rank %d: dx differs from W = 1", r);
    MOK_EXPECT_MSG(memcmp(k[r].out.dtw.data(), ref.dtw.data() + s * K, (size_t)(T[r] * K) * 4) == 0,
                   "rank %d: dtopk_w differs from W = 1", r);
    for (int i = 0; i < 3; i++)
      MOK_EXPECT_MSG(memcmp(k[r].out.dw[1 + i].data(), ref.dw[i].data() + r * ew, ew) == 0,
                     "rank %d: %s differs from W = 1's slice", r, bwd_w_name[i]);
  }
}

// Ranks whose layers differ (here max_tokens): a virtual rank's layer create refuses a window of
// another size than rank 0's, naming the rule, and the communicators stay usable. (On real
// ranks the transport's layout refuses such a call on every rank, and mok_layer_check names the
// other rank's max_tokens: ep_verdict, MOK_WS_ERR_PEER_SHAPE.)
MOK_TEST(ep_ranks_with_other_descriptors_are_refused) {
  NEED_GPU();
  mok_comm_t c[2] = {NULL, NULL};
  MOK_REQUIRE(mok_comm_create_virtual(c, 2, 0) == MOK_SUCCESS);
  mok_layer_desc_t d = test_layer_desc(256, 256, 16, 4, 0, 128);
  mok_layer_t l0 = NULL, l1 = NULL;
  MOK_EXPECT(mok_layer_create(&l0, c[0], &d) == MOK_SUCCESS);
  d.max_tokens = 256;
  const mokResult_t r = mok_layer_create(&l1, c[1], &d);
  MOK_EXPECT_MSG(r == MOK_ERROR_INVALID_VALUE && l1 == NULL &&
                     strstr(mok_last_error(), "same layers in the same order"),
                 "rank 1's create: %s (%s)", mok_error_string(r), mok_last_error());
  if (l1) mok_layer_destroy(l1);
  mok_layer_destroy(l0);
  MOK_EXPECT(mok_comm_destroy(c[0]) == MOK_SUCCESS && mok_comm_destroy(c[1]) == MOK_SUCCESS);
}
