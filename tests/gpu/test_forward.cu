/*
 * test_forward.cu: the GPU forward of a W = 1 BF16 layer (src/gpu/forward.c: the fused
 * persistent kernel by default) against the CPU layer on the same inputs (tolerance:
 * forward_test_util.cuh), plus what only the GPU has: the layout against src/cpu/layout.c,
 * bitwise run-to-run determinism, CUDA graph capture and replay with new routing in the same
 * buffers, asynchronous errors reported by mok_layer_check with y untouched, the saved context.
 * The fused kernel against the unfused chain: test_forward_fused.cu. Every test skips without a
 * GPU.
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
/* Against the CPU layer                                                                           */
/* ---------------------------------------------------------------------------------------------- */

static void sized_case(int64_t H, int64_t I, int64_t E, int64_t K, int64_t Is, int64_t T,
                       test_route_t route, const char *what) {
  fwd_problem_t p;
  fwd_problem_init(&p, H, I, E, K, Is, T, T > 0 ? T : 16);
  fwd_route(&p, route);
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  fwd_check_against_cpu(&g, &p, what);
  test_gpu_layer_close(&g);
}

static void small_case(int64_t I, int64_t Is, int64_t K, int64_t T, test_route_t route,
                       const char *what) {
  sized_case(256, I, 8, K, Is, T, route, what);
}

MOK_TEST(fwd_gpu_matches_cpu_small) {
  NEED_GPU();
  const test_route_t r = {0.1, 0, -1};
  small_case(128, 0, 2, 100, r, "I=128");
  small_case(256, 0, 2, 100, r, "I=256");
  small_case(128, 128, 2, 100, r, "I=128 Is=128");
  small_case(256, 128, 2, 100, r, "I=256 Is=128");
}

MOK_TEST(fwd_gpu_routing_edge_cases) {
  NEED_GPU();
  const test_route_t empty_experts = {0.0, (1u << 0) | (1u << 3) | (1u << 6), -1};
  const test_route_t one_expert = {0.0, 0, 5};          // slot 0 of every token: expert 5
  const test_route_t many_empty = {0.45, 0, -1};        // -1 slots, some tokens with none at all
  const test_route_t all_empty = {1.0, 0, -1};          // no routed rows: y = bf16(ys)
  const test_route_t plain = {0.0, 0, -1};
  small_case(128, 0, 2, 100, empty_experts, "experts 0, 3, 6 empty");
  small_case(128, 128, 2, 300, one_expert, "every token to expert 5 (300 rows)");
  small_case(128, 0, 1, 100, plain, "K = 1");
  small_case(128, 128, 1, 100, one_expert, "K = 1, all to expert 5");
  small_case(128, 128, 4, 100, many_empty, "K = 4, -1 slots");
  small_case(128, 128, 2, 100, all_empty, "every slot -1, shared expert only");
  small_case(128, 0, 2, 1, plain, "T = 1");
  small_case(128, 128, 2, 257, plain, "T = 257 (not a multiple of 128)");
  small_case(128, 0, 8, 700, plain, "K = 8, T = 700 (two layout rounds)");
  // The reduce adds slots in groups of 8 and keeps two 16-byte chunks per lane in flight: 12
  // slots make two groups, H = 384 (48 chunks) gives half the lanes a second chunk.
  sized_case(384, 128, 16, 12, 128, 300, many_empty, "K = 12 of E = 16, H = 384, -1 slots");

  // T = 0 on a layer with T_max = 16: succeeds and reports no error.
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 128, 8, 2, 128, 0, 16);
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  MOK_EXPECT(test_gpu_layer_forward(&g, 0, 0) == MOK_SUCCESS);
  MOK_EXPECT_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
  // ... and T < T_max
  p.T = 9;
  fwd_check_against_cpu(&g, &p, "T = 9 < T_max = 16");
  test_gpu_layer_close(&g);
}

/* ---------------------------------------------------------------------------------------------- */
/* Layout                                                                                          */
/* ---------------------------------------------------------------------------------------------- */

// The context's slot_row and offsets against mok_layout_build (W = 1, tile_m = 1: no padding).
static void check_layout(const test_gpu_layer_t *g, const fwd_problem_t *p, const char *what) {
  const mok_ws_layout_t lay = fwd_ctx_layout(p);
  std::vector<uint8_t> c = fwd_gpu_ctx(g);
  const int32_t *slot_row = (const int32_t *)(c.data() + lay.ctx[MOK_CTX_SLOT_ROW]);
  const int32_t *offsets = (const int32_t *)(c.data() + lay.ctx[MOK_CTX_OFFSETS]);
  mok_layout_t L;
  char err[256];
  const int64_t T = p->T;
  const int32_t *idx = p->idx.data();
  MOK_REQUIRE(mok_layout_build(&L, 1, p->E, p->K, 1, &T, &idx, err, sizeof(err)) == MOK_SUCCESS);
  int64_t bad = 0;
  for (int64_t i = 0; i < T * p->K; i++) bad += slot_row[i] != L.slot_row[0][i];
  MOK_EXPECT_MSG(bad == 0, "%s: %lld slot rows differ from mok_layout_build", what, (long long)bad);
  for (int64_t e = 0; e < p->E; e++)
    MOK_EXPECT_MSG(offsets[e] == L.expert_start[e], "%s: offsets[%lld] = %d, layout.c says %lld",
                   what, (long long)e, offsets[e], (long long)L.expert_start[e]);
  MOK_EXPECT(offsets[p->E] == L.rank_rows[0]);
  const mok_ctx_header_t *h = (const mok_ctx_header_t *)(c.data() + lay.ctx[MOK_CTX_HEADER]);
  MOK_EXPECT(h->magic == MOK_CTX_MAGIC && h->num_tokens == T);
  mok_layout_free(&L);
}

// The layout kernels' reduce order for p's routing (launched directly, as the fused forward's
// layer does): red_order is a permutation of the call's tokens, and bin b (red_pre[b] ..
// red_pre[b + 1]) holds exactly the tokens whose highest expert is b - 1 (b = 0: none).
static void check_reduce_order(const fwd_problem_t *p, const char *what) {
  const int64_t T = p->T, E = p->E, K = p->K, R = p->T_max * K;
  const mok_ws_dims_t d = {p->T_max, p->H, p->I, p->Is, E, K, R, 0, 0};
  mok_ws_layout_t lay;
  mok_ws_layout(&d, &lay);
  const size_t ws_bytes = lay.ws[MOK_WS_XG];  // the regions the layout writes come first
  uint8_t *ws = NULL, *ctx = NULL;
  MOK_REQUIRE(cudaMalloc(&ws, ws_bytes) == cudaSuccess);
  MOK_REQUIRE(cudaMalloc(&ctx, lay.ctx_bytes) == cudaSuccess);
  cudaMemset(ws, 0xFF, ws_bytes);  // -1 everywhere: what the layout leaves unwritten shows
  int32_t *idx = to_dev(p->idx);
  float *tw = to_dev(p->tw);
  mok_fwd_local_params_t q;
  memset(&q, 0, sizeof(q));
  q.T = T, q.H = p->H, q.E = E, q.K = K, q.Is = p->Is, q.capacity_rows = R;
  q.topk_idx = idx, q.topk_w = tw;
  q.err = ws + lay.ws[MOK_WS_ERROR];
  cudaMemset(q.err, 0, sizeof(mok_ws_error_t));
  q.status = (int32_t *)(ws + lay.ws[MOK_WS_STATUS]);
  q.offsets = (int32_t *)(ws + lay.ws[MOK_WS_OFFSETS]);
  q.shared_offsets = (int32_t *)(ws + lay.ws[MOK_WS_SHARED_OFFSETS]);
  q.slot_row = (int32_t *)(ws + lay.ws[MOK_WS_SLOT_ROW]);
  q.row_w = (float *)(ws + lay.ws[MOK_WS_ROW_W]);
  q.row_tok = (int32_t *)(ws + lay.ws[MOK_WS_ROW_TOK]);
  q.tile_pre = (int32_t *)(ws + lay.ws[MOK_WS_TILE_PRE]);
  q.red_pre = (int32_t *)(ws + lay.ws[MOK_WS_RED_PRE]);
  q.red_order = (int32_t *)(ws + lay.ws[MOK_WS_RED_ORDER]);
  q.counters = (uint32_t *)(ws + lay.ws[MOK_WS_COUNTERS]);
  q.n_counters = mok_fc_count(R, E, p->T_max);
  q.layout_scratch = ws + lay.ws[MOK_WS_LAYOUT];
  q.ctx_header = ctx + lay.ctx[MOK_CTX_HEADER];
  q.ctx_slot_row = (int32_t *)(ctx + lay.ctx[MOK_CTX_SLOT_ROW]);
  q.ctx_offsets = (int32_t *)(ctx + lay.ctx[MOK_CTX_OFFSETS]);
  q.context_mode = MOK_CONTEXT_RECOMPUTE;
  MOK_EXPECT_MSG(mok_fwd_layout_launch(&q, NULL) == MOK_SUCCESS, "%s", mok_last_error());
  std::vector<int32_t> pre((size_t)(E + 2)), order((size_t)(T > 0 ? T : 1));
  int32_t status = 0;
  MOK_REQUIRE(cudaMemcpy(pre.data(), q.red_pre, pre.size() * 4, cudaMemcpyDeviceToHost) ==
              cudaSuccess);
  cudaMemcpy(order.data(), q.red_order, (size_t)T * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(&status, q.status, 4, cudaMemcpyDeviceToHost);
  MOK_EXPECT_MSG(status == 1, "%s: status %d", what, status);
  MOK_EXPECT_MSG(pre[0] == 0 && pre[(size_t)E + 1] == T, "%s: red_pre runs from %d to %d, T = %lld",
                 what, pre[0], pre[(size_t)E + 1], (long long)T);
  std::vector<int> seen((size_t)(T > 0 ? T : 1), 0);
  int64_t bad = 0;
  for (int64_t b = 0; b <= E; b++) {
    bad += pre[(size_t)b + 1] < pre[(size_t)b];
    for (int32_t c = pre[(size_t)b]; c < pre[(size_t)b + 1] && c >= 0 && c < T; c++) {
      const int32_t t = order[(size_t)c];
      if (t < 0 || t >= T || seen[(size_t)t]++) {
        bad++;
        continue;
      }
      int32_t last = -1;
      for (int64_t k = 0; k < K; k++) last = std::max(last, p->idx[(size_t)(t * K + k)]);
      bad += last != b - 1;
    }
  }
  MOK_EXPECT_MSG(bad == 0, "%s: %lld tokens out of their bin or repeated in red_order", what,
                 (long long)bad);
  cudaFree(idx);
  cudaFree(tw);
  cudaFree(ws);
  cudaFree(ctx);
}

MOK_TEST(fwd_gpu_layout_matches_cpu_layout) {
  NEED_GPU();
  const test_route_t routes[3] = {{0.2, (1u << 2) | (1u << 7), -1}, {0.0, 0, 1}, {0.0, 0, -1}};
  for (int i = 0; i < 3; i++) {
    fwd_problem_t p;
    fwd_problem_init(&p, 128, 128, 8, 2, 0, 1100, 1100);  // three chunks of one round
    fwd_route(&p, routes[i]);
    test_gpu_layer_t g;
    MOK_REQUIRE(fwd_gpu_open(&g, &p));
    fwd_gpu_inputs(&g, &p);
    MOK_EXPECT(test_gpu_layer_forward(&g, p.T, 0) == MOK_SUCCESS);
    MOK_EXPECT_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
    check_layout(&g, &p, "E = 8, K = 2, T = 1100");
    check_reduce_order(&p, "reduce order, E = 8, K = 2, T = 1100");
    test_gpu_layer_close(&g);
  }
  fwd_problem_t p;  // many experts, K = 8, with empty slots
  fwd_problem_init(&p, 128, 128, 128, 8, 0, 2000, 2048);
  test_route_t r = {0.05, 0, -1};
  fwd_route(&p, r);
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  fwd_gpu_inputs(&g, &p);
  MOK_EXPECT(test_gpu_layer_forward(&g, p.T, 0) == MOK_SUCCESS);
  MOK_EXPECT_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
  check_layout(&g, &p, "E = 128, K = 8, T = 2000");
  check_reduce_order(&p, "reduce order, E = 128, K = 8, T = 2000");
  fwd_route(&p, test_route_t{1.0, 0, -1});  // every slot empty: all tokens in bin 0
  check_reduce_order(&p, "reduce order, every slot empty");
  test_gpu_layer_close(&g);

  // Long calls on one layer sized for 70000 tokens: chunks of two rounds (T = 70000: 69 chunks of
  // 1024 tokens), then the most chunks (T = 65536: 128 of one round).
  fwd_problem_t q;
  fwd_problem_init(&q, 128, 128, 8, 2, 0, 70000, 70000);
  test_gpu_layer_t gq;
  MOK_REQUIRE(fwd_gpu_open(&gq, &q));
  fwd_gpu_inputs(&gq, &q);
  MOK_EXPECT(test_gpu_layer_forward(&gq, q.T, 0) == MOK_SUCCESS);
  MOK_EXPECT_MSG(mok_layer_check(gq.l) == MOK_SUCCESS, "%s", mok_last_error());
  check_layout(&gq, &q, "E = 8, K = 2, T = 70000");
  check_reduce_order(&q, "reduce order, E = 8, K = 2, T = 70000 (chunks of two rounds)");
  q.T = 65536;
  MOK_EXPECT(test_gpu_layer_forward(&gq, q.T, 0) == MOK_SUCCESS);
  MOK_EXPECT_MSG(mok_layer_check(gq.l) == MOK_SUCCESS, "%s", mok_last_error());
  check_layout(&gq, &q, "E = 8, K = 2, T = 65536 of 70000");
  test_gpu_layer_close(&gq);
}

/* ---------------------------------------------------------------------------------------------- */
/* Determinism, graphs, saved context                                                              */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(fwd_gpu_is_bitwise_deterministic) {
  NEED_GPU();
  fwd_problem_t p;
  fwd_problem_init(&p, 512, 256, 16, 4, 128, 1000, 1000);
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  fwd_gpu_inputs(&g, &p);
  MOK_REQUIRE(test_gpu_layer_forward(&g, p.T, 0) == MOK_SUCCESS);
  std::vector<uint16_t> y1 = fwd_gpu_y(&g, p.T, p.H);
  std::vector<uint8_t> c1 = fwd_gpu_ctx(&g);
  cudaMemset(g.y, 0xFF, (size_t)(p.T * p.H) * 2);
  MOK_REQUIRE(test_gpu_layer_forward(&g, p.T, 0) == MOK_SUCCESS);
  MOK_EXPECT_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
  std::vector<uint16_t> y2 = fwd_gpu_y(&g, p.T, p.H);
  std::vector<uint8_t> c2 = fwd_gpu_ctx(&g);
  MOK_EXPECT_MSG(y1 == y2, "y differs between two runs");
  MOK_EXPECT_MSG(c1 == c2, "the saved context differs between two runs");
  test_gpu_layer_close(&g);
}

// Captured through `path` (the layer's tuning, read when mok_forward is called).
static void graph_case(mok_forward_path_t path) {
  const char *name = path == MOK_FORWARD_CHAIN ? "chain" : "fused";
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 128, 8, 2, 128, 100, 100);
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  MOK_REQUIRE_MSG(test_set_forward_path(g.l, path) == MOK_SUCCESS, "%s", mok_last_error());
  fwd_gpu_inputs(&g, &p);
  cudaStream_t s;
  MOK_REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  MOK_REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
  const mokResult_t r = test_gpu_layer_forward(&g, p.T, s);
  const cudaError_t ce = cudaStreamEndCapture(s, &graph);
  MOK_REQUIRE_MSG(r == MOK_SUCCESS, "%s: mok_forward under capture: %s", name, mok_last_error());
  MOK_REQUIRE_MSG(ce == cudaSuccess, "%s: cudaStreamEndCapture: %s", name, cudaGetErrorString(ce));
  MOK_REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  const test_route_t routes[2] = {{0.2, 0, -1}, {0.0, 0, 4}};
  for (int i = 0; i < 2; i++) {
    fwd_route(&p, routes[i]);  // new routing and router weights, same device buffers
    fwd_gpu_inputs(&g, &p);
    cudaMemset(g.y, 0xFF, (size_t)(p.T * p.H) * 2);
    cudaDeviceSynchronize();  // the legacy stream's memset before the non-blocking stream's graph
    MOK_EXPECT(cudaGraphLaunch(exec, s) == cudaSuccess);
    MOK_EXPECT(cudaStreamSynchronize(s) == cudaSuccess);
    MOK_EXPECT_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
    std::vector<uint16_t> y = fwd_gpu_y(&g, p.T, p.H), ref;
    MOK_REQUIRE(cpu_forward(&p, p.T, p.x.data(), p.idx.data(), p.tw.data(), p.Is, p.T_max, &ref,
                            NULL) == MOK_SUCCESS);
    MOK_EXPECT_MSG(fwd_compare_y("graph replay", &p, y.data(), ref.data()),
                   "%s: graph replay %d: y differs from the CPU layer", name, i);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  test_gpu_layer_close(&g);
}

MOK_TEST(fwd_gpu_cuda_graph_replays_with_new_routing) {
  NEED_GPU();
  graph_case(MOK_FORWARD_CHAIN);
  graph_case(MOK_FORWARD_FUSED);
}

// Saved bf16 g, u (layout order, through the context layout) against the CPU's ((token, slot)
// order): one bf16 rounding of an fp32 GEMM result each, so |gpu - ref| <= atol + 2^-7 |ref| with
// atol = 2^-7 rms(ref) (a flip is one ulp, at most 2^-7 |ref|; order noise is far below atol).
static int compare_saved(const uint16_t *gpu, const uint16_t *ref, int64_t n, int64_t cols,
                         const char *what) {
  const std::vector<double> g = bf16_values(gpu, (size_t)n), r = bf16_values(ref, (size_t)n);
  return test_compare_report("saved", what, g.data(), r.data(), NULL, n, cols,
                             test_tol_rms(r.data(), NULL, n));
}

MOK_TEST(fwd_gpu_saved_context_matches_cpu) {
  NEED_GPU();
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 256, 8, 2, 128, 100, 100);
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  fwd_gpu_inputs(&g, &p);
  MOK_REQUIRE(test_gpu_layer_forward(&g, p.T, 0) == MOK_SUCCESS);
  MOK_REQUIRE_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
  std::vector<uint8_t> c = fwd_gpu_ctx(&g), cref;
  std::vector<uint16_t> yref;
  MOK_REQUIRE(cpu_forward(&p, p.T, p.x.data(), p.idx.data(), p.tw.data(), p.Is, p.T_max, &yref,
                          &cref) == MOK_SUCCESS);
  const mok_ws_layout_t lay = fwd_ctx_layout(&p);
  const int64_t T = p.T, K = p.K, I = p.I, Is = p.Is, TK = p.T_max * K;
  const int32_t *slot_row = (const int32_t *)(c.data() + lay.ctx[MOK_CTX_SLOT_ROW]);
  const uint16_t *gg = (const uint16_t *)(c.data() + lay.ctx[MOK_CTX_G]);
  const uint16_t *gu = (const uint16_t *)(c.data() + lay.ctx[MOK_CTX_U]);
  // CPU context (api/api.h): header, then g, u [T_max * K, I], gs, us [T_max, Is].
  const uint16_t *cg = (const uint16_t *)(cref.data() + sizeof(mok_ctx_header_t));
  const uint16_t *cu = cg + TK * I, *cgs = cu + TK * I, *cus = cgs + p.T_max * Is;
  std::vector<uint16_t> g_gpu, u_gpu, g_ref, u_ref;  // routed rows in (token, slot) order
  for (int64_t i = 0; i < T * K; i++) {
    if (p.idx[i] < 0) {
      MOK_EXPECT(slot_row[i] == -1);
      continue;
    }
    MOK_REQUIRE(slot_row[i] >= 0);
    g_gpu.insert(g_gpu.end(), gg + slot_row[i] * I, gg + (slot_row[i] + 1) * I);
    u_gpu.insert(u_gpu.end(), gu + slot_row[i] * I, gu + (slot_row[i] + 1) * I);
    g_ref.insert(g_ref.end(), cg + i * I, cg + (i + 1) * I);
    u_ref.insert(u_ref.end(), cu + i * I, cu + (i + 1) * I);
  }
  MOK_EXPECT(compare_saved(g_gpu.data(), g_ref.data(), (int64_t)g_gpu.size(), I, "g"));
  MOK_EXPECT(compare_saved(u_gpu.data(), u_ref.data(), (int64_t)u_gpu.size(), I, "u"));
  MOK_EXPECT(compare_saved((const uint16_t *)(c.data() + lay.ctx[MOK_CTX_GS]), cgs, T * Is, Is,
                           "gs"));
  MOK_EXPECT(compare_saved((const uint16_t *)(c.data() + lay.ctx[MOK_CTX_US]), cus, T * Is, Is,
                           "us"));
  test_gpu_layer_close(&g);
}

/* ---------------------------------------------------------------------------------------------- */
/* Asynchronous errors                                                                             */
/* ---------------------------------------------------------------------------------------------- */

// Runs a forward that must fail on the device: returns MOK_SUCCESS from mok_forward, then
// mok_layer_check reports `code` with `msg` in the detail, y keeps its poison, the context is
// marked unusable, and a second check reports nothing.
static void expect_async_error(test_gpu_layer_t *g, const fwd_problem_t *p, mokResult_t code,
                               const char *msg) {
  fwd_gpu_inputs(g, p);
  const size_t ybytes = (size_t)(p->T * p->H) * 2;
  cudaMemset(g->y, 0x5A, ybytes);
  MOK_EXPECT(test_gpu_layer_forward(g, p->T, 0) == MOK_SUCCESS);
  const mokResult_t r = mok_layer_check(g->l);
  MOK_EXPECT_MSG(r == code, "mok_layer_check returned %d (%s), expected %d", (int)r,
                 mok_layer_last_error(g->l), (int)code);
  MOK_EXPECT_MSG(strstr(mok_layer_last_error(g->l), msg) != NULL, "message \"%s\" lacks \"%s\"",
                 mok_layer_last_error(g->l), msg);
  std::vector<uint8_t> y(ybytes);
  cudaMemcpy(y.data(), g->y, ybytes, cudaMemcpyDeviceToHost);
  const size_t touched = test_bytes_not(y.data(), ybytes, 0x5A);
  MOK_EXPECT_MSG(touched == 0, "%zu bytes of y written by a failed forward", touched);
  const mok_ws_layout_t lay = fwd_ctx_layout(p);
  std::vector<uint8_t> c = fwd_gpu_ctx(g);
  MOK_EXPECT(((const mok_ctx_header_t *)(c.data() + lay.ctx[MOK_CTX_HEADER]))->magic == 0);
  MOK_EXPECT_MSG(mok_layer_check(g->l) == MOK_SUCCESS, "the error was not cleared: %s",
                 mok_last_error());
}

MOK_TEST(fwd_gpu_bad_routing_reported_by_check) {
  NEED_GPU();
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 128, 8, 2, 128, 100, 100);
  const std::vector<int32_t> good = p.idx;
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));

  p.idx[5 * 2 + 1] = 9;  // out of range
  expect_async_error(&g, &p, MOK_ERROR_INVALID_ROUTING,
                     "topk_idx[5][1] = 9 is not an expert id in [-1, 8)");
  p.idx = good;
  fwd_check_against_cpu(&g, &p, "good routing after an id out of range");

  p.idx[7 * 2 + 0] = 3, p.idx[7 * 2 + 1] = 3;  // the same expert twice
  expect_async_error(&g, &p, MOK_ERROR_INVALID_ROUTING,
                     "topk_idx[7][1] = 3 repeats the expert of slot 0");
  p.idx = good;

  p.idx[40 * 2 + 0] = -2;  // two bad entries: the first in (token, slot) order is reported
  p.idx[3 * 2 + 1] = 8;
  expect_async_error(&g, &p, MOK_ERROR_INVALID_ROUTING,
                     "topk_idx[3][1] = 8 is not an expert id in [-1, 8)");
  p.idx = good;
  fwd_check_against_cpu(&g, &p, "good routing after two bad entries");
  test_gpu_layer_close(&g);
}

MOK_TEST(fwd_gpu_capacity_overflow_reported_by_check) {
  NEED_GPU();
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 128, 8, 2, 0, 100, 100);
  p.capacity_factor = 0.5;  // 100 rows for T_max = 100, K = 2
  test_route_t full = {0.0, 0, -1};
  fwd_route(&p, full);  // 200 rows
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  expect_async_error(&g, &p, MOK_ERROR_CAPACITY_OVERFLOW, "200 routed rows, capacity is 100");
  for (int64_t t = 0; t < p.T; t++) p.idx[t * 2 + 1] = -1;  // exactly 100 rows: fits
  fwd_check_against_cpu(&g, &p, "rows = capacity");
  test_gpu_layer_close(&g);
}

/* ---------------------------------------------------------------------------------------------- */
/* Sizes and what is not implemented                                                               */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(fwd_gpu_sizes_and_mxfp8_layer) {
  NEED_GPU();
  fwd_problem_t p;
  fwd_problem_init(&p, 256, 128, 8, 2, 128, 64, 64);
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  size_t ws = 0, cb = 0;
  const mok_ws_layout_t lay = fwd_ctx_layout(&p);
  MOK_EXPECT(mok_layer_workspace_size(g.l, &ws) == MOK_SUCCESS && ws > 0);
  MOK_EXPECT(mok_context_size(g.l, &cb) == MOK_SUCCESS && cb == lay.ctx_bytes);
  test_gpu_layer_close(&g);

  mok_comm_t c = NULL;
  mok_layer_t l = NULL;
  MOK_REQUIRE(mok_comm_create_local(&c, 0) == MOK_SUCCESS);
  mok_layer_desc_t d = fwd_desc(&p, 0, 64);
  d.precision = MOK_PRECISION_MXFP8;  // its forwards: test_fp8_layer.cu
  MOK_REQUIRE(mok_layer_create(&l, c, &d) == MOK_SUCCESS);
  MOK_EXPECT(mok_layer_workspace_size(l, &ws) == MOK_SUCCESS && ws > 0);
  void *buf = NULL, *ctx = NULL;
  MOK_REQUIRE(mok_context_size(l, &cb) == MOK_SUCCESS);
  size_t qb = 0;
  MOK_REQUIRE(mok_quantized_weights_size(l, &qb) == MOK_SUCCESS);
  cudaMalloc(&buf, qb);
  cudaMalloc(&ctx, cb);
  mok_forward_args_t a;
  memset(&a, 0, sizeof(a));
  a.w.quantized = buf, a.w.quantized_bytes = qb;
  MOK_EXPECT_MSG(mok_forward(l, &a, NULL, ctx, cb, NULL) == MOK_SUCCESS, "%s",
                 mok_layer_last_error(l));  // T = 0
  MOK_EXPECT(mok_layer_check(l) == MOK_SUCCESS);
  cudaFree(buf);
  cudaFree(ctx);
  mok_layer_destroy(l);
  mok_comm_destroy(c);
}

/* ---------------------------------------------------------------------------------------------- */
/* Model size                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

// Qwen3-30B-A3B (H = 2048, I = 768, E = 128, K = 8), T = 4096: 64 random tokens against the CPU
// layer run on just those tokens (at W = 1 a token's result does not depend on the others), the
// layout against layout.c, and two runs bitwise equal.
MOK_TEST(fwd_gpu_qwen3_30b_a3b_sampled_tokens_match_cpu) {
  NEED_GPU();
  const int64_t T = 4096, S = 64;
  fwd_problem_t p;
  fwd_problem_init(&p, 2048, 768, 128, 8, 0, T, T);
  test_gpu_layer_t g;
  MOK_REQUIRE(fwd_gpu_open(&g, &p));
  fwd_gpu_inputs(&g, &p);
  MOK_REQUIRE(test_gpu_layer_forward(&g, T, 0) == MOK_SUCCESS);
  MOK_REQUIRE_MSG(mok_layer_check(g.l) == MOK_SUCCESS, "%s", mok_last_error());
  std::vector<uint16_t> y = fwd_gpu_y(&g, T, p.H);
  check_layout(&g, &p, "Qwen3-30B-A3B, T = 4096");
  MOK_REQUIRE(test_gpu_layer_forward(&g, T, 0) == MOK_SUCCESS);
  MOK_EXPECT(fwd_gpu_y(&g, T, p.H) == y);

  std::vector<int64_t> pick;  // S distinct tokens
  std::vector<char> taken((size_t)T, 0);
  while ((int64_t)pick.size() < S) {
    const int64_t t = (int64_t)test_rng_below(&g_route_rng, (uint64_t)T);
    if (!taken[t]) taken[t] = 1, pick.push_back(t);
  }
  const int64_t H = p.H, K = p.K;
  std::vector<uint16_t> xs((size_t)(S * H)), ys((size_t)(S * H)), ref;
  std::vector<int32_t> is((size_t)(S * K));
  std::vector<float> ws((size_t)(S * K));
  for (int64_t s = 0; s < S; s++) {
    const int64_t t = pick[s];
    memcpy(&xs[s * H], &p.x[t * H], (size_t)H * 2);
    memcpy(&ys[s * H], &y[t * H], (size_t)H * 2);
    memcpy(&is[s * K], &p.idx[t * K], (size_t)K * 4);
    memcpy(&ws[s * K], &p.tw[t * K], (size_t)K * 4);
  }
  MOK_REQUIRE(cpu_forward(&p, S, xs.data(), is.data(), ws.data(), 0, S, &ref, NULL) == MOK_SUCCESS);
  MOK_EXPECT(fwd_compare_y_of("Qwen3-30B-A3B, 64 of 4096 tokens", &p, ys.data(), ref.data(), S,
                              xs.data(), is.data(), ws.data(), 0));
  test_gpu_layer_close(&g);
}
