/*
 * test_transport.cu: the NVLink transport (src/gpu/transport.c, src/cuda/comm/transport.cu,
 * src/cuda/comm/nccl_window.cu) on two GPUs, one thread per GPU in this process (ncclCommInitAll, or
 * a unique id shared between the threads; the harness is transport_team.cuh). Skips without NCCL
 * in the build or with fewer than two GPUs; NCCL_NVLS_ENABLE=0 is set before any communicator
 * exists. transport_rejects_bad_arguments runs everywhere.
 *
 * Payloads identify their source: x[s][t] holds t & 255, t >> 8 and s in its first columns and a
 * pattern of (s, t, column) elsewhere, all exact in bf16; the stand-in expert scales a row by
 * (e % 4 + 1), exactly. So every check is bitwise:
 *   - the GPU layout (slot rows, token positions, counts, segment starts, rank sizes, receive
 *     sizes) equals src/cpu/layout.c's for the same routing;
 *   - every row received from another rank is x of the (source, token) the CPU layout puts
 *     there, its metadata the source token and the rows of its slots on this rank;
 *   - every (token, slot) row combined home from another rank is f(x[t], e), and y is the
 *     slot-order fp32 sum in bf16 (slots on the token's own rank included);
 * for uneven token counts, T = 0 on either rank, empty experts, all tokens on one expert, many
 * calls in a row without clearing, Qwen3-sized rows; bad routing is reported on its rank and
 * moves nothing anywhere; a rank that never arrives gives the other MOK_ERROR_TIMEOUT naming
 * rank, counter, value and target, not a hang; teardown returns the memory.
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <string.h>

#include "../test.h"

#ifdef MOK_WITH_NCCL

#include "transport_team.cuh"

/* ---------------------------------------------------------------------------------------------- */
/* Tests                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(transport_edge_cases_match_cpu_layout) {
  SKIP_UNLESS_TWO_GPUS();
  rank_t ranks[W] = {};
  mok_transport_desc_t d = small_desc();
  if (!team_up(ranks, &d)) return;
  // Uneven T, expert 5 never routed (empty), ~1/6 empty slots.
  make_rank(&ranks[0], 37, ROUTE_RANDOM, 5, 0);
  make_rank(&ranks[1], 250, ROUTE_RANDOM, 5, 0);
  full_call(ranks, "uneven T, empty expert");
  make_rank(&ranks[0], 0, ROUTE_RANDOM, -1, 0);  // T = 0 on rank 0
  make_rank(&ranks[1], 100, ROUTE_RANDOM, -1, 0);
  full_call(ranks, "T = 0 on rank 0");
  make_rank(&ranks[0], 120, ROUTE_FULL, -1, 0);
  make_rank(&ranks[1], 0, ROUTE_FULL, -1, 0);  // T = 0 on rank 1
  full_call(ranks, "T = 0 on rank 1");
  make_rank(&ranks[0], 0, ROUTE_FULL, -1, 0);
  make_rank(&ranks[1], 0, ROUTE_FULL, -1, 0);
  full_call(ranks, "T = 0 on both");
  make_rank(&ranks[0], 64, ROUTE_ONE_EXPERT, -1, 6);  // every token to expert 6 (rank 1)
  make_rank(&ranks[1], 64, ROUTE_ONE_EXPERT, -1, 6);
  full_call(ranks, "all tokens on one expert");
  make_rank(&ranks[0], 300, ROUTE_FULL, -1, 0);  // T = T_max, every slot used
  make_rank(&ranks[1], 300, ROUTE_FULL, -1, 0);
  full_call(ranks, "T = T_max, full");
  team_down(ranks);
}

MOK_TEST(transport_many_calls_without_clearing) {
  SKIP_UNLESS_TWO_GPUS();
  rank_t ranks[W] = {};
  mok_transport_desc_t d = small_desc();
  if (!team_up(ranks, &d)) return;
  int bad = 0;
  for (int i = 0; i < 24 && !bad; i++) {
    char label[64];
    snprintf(label, sizeof label, "call %d", i);
    for (int r = 0; r < W; r++)
      make_rank(&ranks[r], rnd(4) == 0 ? 0 : 1 + rnd(300), ROUTE_RANDOM, (int)rnd(8), 0);
    bad = full_call(ranks, label);
  }
  // Dispatch, combine and sum as separate launches (what bench/transport.py times).
  for (int i = 0; i < 3 && !bad; i++) {
    for (int r = 0; r < W; r++) {
      make_rank(&ranks[r], 1 + rnd(300), ROUTE_RANDOM, -1, 0);
      ranks[r].phases = SPLIT_PHASES;
    }
    on_ranks(step_call, ranks);
    REQUIRE_RANKS_OK(ranks);
    bad = check_call(ranks, "split phases");
  }
  // Layout-only calls in between must not disturb the counters of the next full call.
  for (int r = 0; r < W; r++) ranks[r].phases = 0;
  on_ranks(step_call, ranks);
  REQUIRE_RANKS_OK(ranks);
  full_call(ranks, "after a layout-only call");
  team_down(ranks);
}

MOK_TEST(transport_qwen3_rows_match_cpu_layout) {
  SKIP_UNLESS_TWO_GPUS();
  rank_t ranks[W] = {};
  mok_transport_desc_t d;
  memset(&d, 0, sizeof d);
  d.max_tokens = 2048;
  d.hidden = 4096;
  d.num_experts = 128;
  d.top_k = 8;
  d.tile_m = 128;
  d.num_sms = 20;
  if (!team_up(ranks, &d)) return;
  make_rank(&ranks[0], 2048, ROUTE_FULL, -1, 0);
  make_rank(&ranks[1], 1531, ROUTE_RANDOM, 77, 0);
  full_call(ranks, "Qwen3-235B rows, call 1");
  make_rank(&ranks[0], 999, ROUTE_RANDOM, 3, 0);
  make_rank(&ranks[1], 2048, ROUTE_FULL, -1, 0);
  full_call(ranks, "Qwen3-235B rows, call 2");
  team_down(ranks);
}

// Rows longer than one load round of a warp (TP_UNROLL = 8 chunks of 16 bytes per lane: 4 KB), the
// last round short: 2312 bf16 = 4 KB + 528 bytes, with 8 slots per token.
MOK_TEST(transport_rows_longer_than_a_load_round) {
  SKIP_UNLESS_TWO_GPUS();
  rank_t ranks[W] = {};
  mok_transport_desc_t d = small_desc();
  d.hidden = 2312;
  d.num_experts = 16;
  d.top_k = 8;
  if (!team_up(ranks, &d)) return;
  make_rank(&ranks[0], 211, ROUTE_RANDOM, 9, 0);
  make_rank(&ranks[1], 300, ROUTE_FULL, -1, 0);
  full_call(ranks, "H = 2312, call 1");
  make_rank(&ranks[0], 300, ROUTE_FULL, -1, 0);
  make_rank(&ranks[1], 17, ROUTE_RANDOM, -1, 0);
  full_call(ranks, "H = 2312, call 2");
  team_down(ranks);
}

MOK_TEST(transport_bad_routing_is_reported_and_moves_nothing) {
  SKIP_UNLESS_TWO_GPUS();
  rank_t ranks[W] = {};
  mok_transport_desc_t d = small_desc();
  if (!team_up(ranks, &d)) return;
  make_rank(&ranks[0], 50, ROUTE_FULL, -1, 0);
  make_rank(&ranks[1], 40, ROUTE_FULL, -1, 0);
  ranks[0].idx[7 * 3 + 1] = 99;  // token 7 slot 1: outside [-1, 8)
  for (int r = 0; r < W; r++) ranks[r].phases = MOK_TP_ALL;
  on_ranks(step_call, ranks);
  MOK_EXPECT_MSG(ranks[0].res == MOK_ERROR_INVALID_ROUTING, "rank 0: %d %s", ranks[0].res,
                 ranks[0].msg);
  MOK_EXPECT_MSG(strstr(ranks[0].msg, "token 7 slot 1") && strstr(ranks[0].msg, "99"), "%s",
                 ranks[0].msg);
  MOK_EXPECT_MSG(ranks[1].res == MOK_SUCCESS, "rank 1: %s", ranks[1].msg);
  // Nobody moved data: every slot is empty everywhere, y is all zeros (not the NaN poison).
  for (int r = 0; r < W; r++) {
    for (size_t i = 0; i < ranks[r].slot_row.size(); i++) MOK_EXPECT(ranks[r].slot_row[i] == -1);
    MOK_EXPECT(ranks[r].recv_tokens.size() == W && ranks[r].recv_tokens[r] == 0);
    for (size_t i = 0; i < ranks[r].y.size(); i++) MOK_EXPECT(ranks[r].y[i] == 0);
  }
  // The next call with good routing works: the counters stayed in step.
  ranks[0].idx[7 * 3 + 1] = ranks[0].idx[7 * 3 + 1] == 99 ? -1 : ranks[0].idx[7 * 3 + 1];
  full_call(ranks, "after bad routing");
  // A repeated expert in one token is reported too.
  make_rank(&ranks[0], 10, ROUTE_FULL, -1, 0);
  make_rank(&ranks[1], 10, ROUTE_FULL, -1, 0);
  ranks[1].idx[4 * 3 + 2] = ranks[1].idx[4 * 3 + 0];
  for (int r = 0; r < W; r++) ranks[r].phases = MOK_TP_ALL;
  on_ranks(step_call, ranks);
  MOK_EXPECT_MSG(ranks[1].res == MOK_ERROR_INVALID_ROUTING && strstr(ranks[1].msg, "token 4 slot 2"),
                 "rank 1: %s", ranks[1].msg);
  MOK_EXPECT_MSG(ranks[0].res == MOK_SUCCESS, "rank 0: %s", ranks[0].msg);
  team_down(ranks);
}

// Rank 0's waits for a rank 1 that does not come: the error names what was waited for.
static void expect_timeout(rank_t *ranks, const char *counter, double limit_s) {
  rank_t *r0 = &ranks[0];
  MOK_EXPECT_MSG(r0->res == MOK_ERROR_TIMEOUT, "rank 0: %d %s", r0->res, r0->msg);
  MOK_EXPECT_MSG(strstr(r0->msg, "rank 0") && strstr(r0->msg, counter) &&
                     strstr(r0->msg, "of rank 1") && strstr(r0->msg, "value 0") &&
                     strstr(r0->msg, "target "),
                 "message: %s", r0->msg);
  MOK_EXPECT_MSG(r0->seconds >= 0.2 && r0->seconds < limit_s, "timed out after %.3f s",
                 r0->seconds);
}

MOK_TEST(transport_missing_rank_times_out_without_hanging) {
  SKIP_UNLESS_TWO_GPUS();
  rank_t ranks[W] = {};
  mok_transport_desc_t d = small_desc();
  d.timeout_s = 0.2;
  if (!team_up(ranks, &d)) return;
  make_rank(&ranks[0], 30, ROUTE_FULL, -1, 0);
  make_rank(&ranks[1], 30, ROUTE_FULL, -1, 0);
  // Round 1: only rank 0 calls (rank 1's thread never starts); it waits for rank 1's layout flag.
  ranks[0].phases = MOK_TP_ALL;
  {
    pthread_t th;
    thread_arg_t a = {step_call, &ranks[0]};
    pthread_create(&th, NULL, step_thread, &a);
    pthread_join(th, NULL);
  }
  expect_timeout(ranks, "layout flag", 5.0);
  // The transport is now out of step: it says so instead of hanging.
  MOK_EXPECT(mok_transport_layout(ranks[0].tp, 0, NULL, NULL) == MOK_ERROR_TIMEOUT);
  on_ranks(step_transport_destroy, ranks);
  REQUIRE_RANKS_OK(ranks);

  // Round 2, fresh transports: both lay out, only rank 0 dispatches; it waits for rank 1's rows.
  on_ranks(step_transport_create, ranks);
  REQUIRE_RANKS_OK(ranks);
  for (int r = 0; r < W; r++) ranks[r].phases = 0;
  on_ranks(step_call, ranks);
  REQUIRE_RANKS_OK(ranks);
  ranks[0].phases = MOK_TP_ALL;
  {
    // step_call lays out again: rank 1 must take part in that layout, then stop.
    ranks[1].phases = 0;
    on_ranks(step_call, ranks);
  }
  MOK_EXPECT_MSG(ranks[1].res == MOK_SUCCESS, "rank 1: %s", ranks[1].msg);
  expect_timeout(ranks, "dispatch counter", 5.0);
  on_ranks(step_transport_destroy, ranks);
  REQUIRE_RANKS_OK(ranks);

  // The processes go on: a new transport on the same communicators works end to end.
  d.timeout_s = 20;
  for (int r = 0; r < W; r++) ranks[r].desc = d;
  on_ranks(step_transport_create, ranks);
  REQUIRE_RANKS_OK(ranks);
  make_rank(&ranks[0], 77, ROUTE_RANDOM, -1, 0);
  make_rank(&ranks[1], 21, ROUTE_RANDOM, -1, 0);
  full_call(ranks, "after the timeouts");
  team_down(ranks);
}

MOK_TEST(transport_unique_id_bootstrap) {
  SKIP_UNLESS_TWO_GPUS();
  mok_unique_id_t id;
  MOK_REQUIRE_MSG(mok_get_unique_id(&id) == MOK_SUCCESS, "%s", mok_last_error());
  rank_t ranks[W] = {};
  mok_transport_desc_t d = small_desc();
  for (int r = 0; r < W; r++) ranks[r].rank = r, ranks[r].id = &id, ranks[r].desc = d;
  on_ranks(step_comm_from_id, ranks);
  REQUIRE_RANKS_OK(ranks);
  for (int r = 0; r < W; r++) {
    int v = -1;
    MOK_EXPECT(mok_comm_rank(ranks[r].comm, &v) == MOK_SUCCESS && v == r);
    MOK_EXPECT(mok_comm_size(ranks[r].comm, &v) == MOK_SUCCESS && v == W);
    MOK_EXPECT(mok_comm_device(ranks[r].comm, &v) == MOK_SUCCESS && v == r);
  }
  on_ranks(step_transport_create, ranks);
  REQUIRE_RANKS_OK(ranks);
  make_rank(&ranks[0], 200, ROUTE_RANDOM, 2, 0);
  make_rank(&ranks[1], 13, ROUTE_RANDOM, 2, 0);
  full_call(ranks, "unique-id communicator");
  team_down(ranks);  // destroys the NCCL communicators MoK created
}

MOK_TEST(transport_teardown_returns_memory) {
  SKIP_UNLESS_TWO_GPUS();
  rank_t ranks[W] = {};
  mok_transport_desc_t d = small_desc();
  d.max_tokens = 4096;
  d.hidden = 4096;  // ~320 MB of window per transport: a leak shows
  d.top_k = 8;
  if (!team_up(ranks, &d)) return;  // one transport exists while we measure
  size_t before[W], after[W], total;
  for (int r = 0; r < W; r++) {
    cudaSetDevice(r);
    cudaDeviceSynchronize();
    cudaMemGetInfo(&before[r], &total);
  }
  for (int i = 0; i < 3; i++) {
    on_ranks(step_transport_destroy, ranks);
    REQUIRE_RANKS_OK(ranks);
    on_ranks(step_transport_create, ranks);
    REQUIRE_RANKS_OK(ranks);
  }
  for (int r = 0; r < W; r++) {
    cudaSetDevice(r);
    cudaDeviceSynchronize();
    cudaMemGetInfo(&after[r], &total);
    const double lost_mb = ((double)before[r] - (double)after[r]) / 1048576.0;
    MOK_EXPECT_MSG(lost_mb < 128, "GPU %d: %.0f MB less free after 3 destroy/create cycles", r,
                   lost_mb);
  }
  team_down(ranks);
}

#endif /* MOK_WITH_NCCL */

/* Argument checks, before any GPU work: these run on every machine (a CPU communicator). */
MOK_TEST(transport_rejects_bad_arguments) {
  mok_comm_t cpu = NULL;
  MOK_REQUIRE(mok_comm_create_local(&cpu, MOK_DEVICE_CPU) == MOK_SUCCESS);
  mok_transport_desc_t good;
  memset(&good, 0, sizeof good);
  good.max_tokens = 64, good.hidden = 256, good.num_experts = 8, good.top_k = 2, good.tile_m = 16;
  mok_transport_t t = (mok_transport_t)0x1;
  MOK_EXPECT(mok_transport_create(NULL, cpu, &good) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_transport_create(&t, NULL, &good) == MOK_ERROR_NULL_POINTER && t == NULL);
  MOK_EXPECT(mok_transport_create(&t, cpu, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_transport_create(&t, cpu, &good) == MOK_ERROR_INVALID_VALUE && t == NULL);
  MOK_EXPECT(strstr(mok_last_error(), "CPU") != NULL);
  struct {
    const char *field;
    mokResult_t code;
    mok_transport_desc_t d;
  } bad[10];
  for (int i = 0; i < 10; i++) bad[i].d = good;
  bad[0].field = "max_tokens", bad[0].code = MOK_ERROR_INVALID_VALUE, bad[0].d.max_tokens = 0;
  bad[1].field = "hidden", bad[1].code = MOK_ERROR_INVALID_SHAPE, bad[1].d.hidden = 100;
  bad[2].field = "num_experts", bad[2].code = MOK_ERROR_INVALID_SHAPE, bad[2].d.num_experts = 0;
  bad[3].field = "num_experts", bad[3].code = MOK_ERROR_INVALID_SHAPE, bad[3].d.num_experts = 2048;
  bad[4].field = "top_k", bad[4].code = MOK_ERROR_INVALID_VALUE, bad[4].d.top_k = 9;
  bad[5].field = "tile_m", bad[5].code = MOK_ERROR_INVALID_VALUE, bad[5].d.tile_m = 0;
  bad[6].field = "num_sms", bad[6].code = MOK_ERROR_INVALID_VALUE, bad[6].d.num_sms = -1;
  bad[7].field = "timeout_s", bad[7].code = MOK_ERROR_INVALID_VALUE, bad[7].d.timeout_s = -1;
  bad[8].field = "top_k", bad[8].code = MOK_ERROR_INVALID_VALUE, bad[8].d.top_k = 0;
  bad[9].field = "yk_rows", bad[9].code = MOK_ERROR_INVALID_SHAPE, bad[9].d.yk_rows = -1;
  for (int i = 0; i < 10; i++) {
    const mokResult_t r = mok_transport_create(&t, cpu, &bad[i].d);
    MOK_EXPECT_MSG(r == bad[i].code && t == NULL, "case %d (%s): %d, %s", i, bad[i].field, r,
                   mok_last_error());
    MOK_EXPECT_MSG(strstr(mok_last_error(), bad[i].field), "case %d: %s", i, mok_last_error());
  }
  MOK_EXPECT(mok_transport_layout(NULL, 0, NULL, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_transport_run(NULL, MOK_TP_ALL, NULL, NULL, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_transport_check(NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_transport_destroy(NULL) == MOK_SUCCESS);
  mok_comm_destroy(cpu);
}

#ifndef MOK_WITH_NCCL


MOK_TEST(transport_needs_nccl) { MOK_SKIP("this build has no NCCL (set NCCL_HOME)"); }

#endif
