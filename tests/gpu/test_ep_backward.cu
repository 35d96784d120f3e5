/*
 * test_ep_backward.cu: expert parallelism inside the layer, backward, on ONE GPU (virtual ranks,
 * ep_test_util.cuh): W ranks give bitwise the dx, dtopk_w and routed weight gradients of one
 * W = 1 layer holding the tokens concatenated in rank order (the chain and the fused backward;
 * SAVE and RECOMPUTE; bf16 and fp32 weight gradients, overwritten and accumulated), the fp8-block
 * and MXFP8 layers likewise, a context from another routing reported on the rank that holds it,
 * forward + backward captured in CUDA graphs and replayed with new routing, K = 40 and W = 8.
 * Every test skips without a GPU.
 */
#include "ep_test_util.cuh"


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

