/*
 * test_ep.cu: expert parallelism inside the layer, forward, on ONE GPU: W = 2 and W = 4 virtual
 * ranks (ep_test_util.cuh) through the kernels, counters and transport of W GPUs.
 *
 * EP-invariance: W ranks holding T_0, ..., T_{W-1} tokens give bitwise the y of one W = 1 layer
 * (the fused forward) holding the tokens concatenated in rank order. Cases: uneven T, T = 0 on a
 * rank, empty slots, experts nobody uses, every token on one rank's experts, many calls in a row
 * with new routing; bad routing and capacity overflow on one rank reported there, the other
 * ranks naming it, nothing computed, and the next good call right; a rank that never calls
 * gives MOK_ERROR_TIMEOUT on the others within the bound, and the layers recover. The backward,
 * fp8 layers, CUDA graphs and wide routing: test_ep_backward.cu; two real GPUs: test_ep_gpus.cu.
 * Every test skips without a GPU.
 */
#include "ep_test_util.cuh"

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
