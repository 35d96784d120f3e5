/*
 * transport_team.cuh: the two-GPU harness of test_transport.cu: one thread per GPU running the
 * same step on every rank (collectives need every rank in flight), one call of the transport
 * (upload, layout, run, check, read back), self-identifying payloads and routings, and the bitwise
 * comparison of everything a call produced with src/cpu/layout.c's layout and the expected rows.
 * Included by test_transport.cu only, in builds with NCCL.
 */
#ifndef MOK_TESTS_GPU_TRANSPORT_TEAM_CUH
#define MOK_TESTS_GPU_TRANSPORT_TEAM_CUH

#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "../support/bf16.h"
#include "../support/rng.h"
#include "../support/timer.h"
#include "cuda/comm/comm.h"
#include "cuda/forward/forward.h"
#include "cuda/quant/quant.h"
extern "C" {
#include "cpu/layout.h"
}
#include "../test.h"

enum { W = 2, SPLIT_PHASES = 8 };

/* ---------------------------------------------------------------------------------------------- */
/* Helpers                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

// Why the two-GPU tests cannot run here, or NULL when they can.
static const char *two_gpu_skip_reason(void) {
  static char why[160];
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  if (n < W) {
    snprintf(why, sizeof why, "needs %d GPUs, found %d", W, n);
    return why;
  }
  int can = 0;
  cudaDeviceCanAccessPeer(&can, 0, 1);
  if (!can) return "GPUs 0 and 1 have no peer access";
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (DESIGN.md section 5)
  return NULL;
}

// Per-rank state; a thread per rank runs a step on it.
typedef struct {
  int rank;
  ncclComm_t nccl;
  mok_comm_t comm;
  mok_transport_t tp;
  mok_transport_desc_t desc;
  const mok_unique_id_t *id;
  // this call
  int64_t T;
  std::vector<int32_t> idx;   // [T, K]
  std::vector<uint16_t> x;    // [T, H]
  int phases;
  int expect_layout_only;
  // results
  mokResult_t res;
  char msg[512];
  double seconds;
  std::vector<int32_t> slot_row, token_pos, count, token_count, expert_start, rank_rows,
      recv_tokens, recv_meta;
  std::vector<uint16_t> recv_x, comb, y;
} rank_t;

typedef void (*step_fn)(rank_t *);

typedef struct {
  step_fn fn;
  rank_t *r;
} thread_arg_t;

static void *step_thread(void *p) {
  thread_arg_t *a = (thread_arg_t *)p;
  cudaSetDevice(a->r->rank);
  a->r->res = MOK_SUCCESS;
  a->r->msg[0] = '\0';
  const double t0 = test_now_s();
  a->fn(a->r);
  a->r->seconds = test_now_s() - t0;
  return NULL;
}

// Runs fn on every rank at once (collectives need every rank in flight together).
static void on_ranks(step_fn fn, rank_t *ranks) {
  pthread_t th[W];
  thread_arg_t args[W];
  for (int r = 0; r < W; r++) {
    args[r] = {fn, &ranks[r]};
    pthread_create(&th[r], NULL, step_thread, &args[r]);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
}

static void fail_into(rank_t *r, mokResult_t res, const char *what) {
  if (r->res != MOK_SUCCESS) return;
  r->res = res;
  snprintf(r->msg, sizeof r->msg, "rank %d: %s: %s", r->rank, what, mok_last_error());
}

#define STEP(r, call)                                \
  do {                                               \
    mokResult_t step_res_ = (call);                  \
    if (step_res_ != MOK_SUCCESS) {                  \
      fail_into(r, step_res_, #call);                \
      return;                                        \
    }                                                \
  } while (0)

#define STEP_CUDA(r, call)                                                          \
  do {                                                                              \
    cudaError_t step_e_ = (call);                                                   \
    if (step_e_ != cudaSuccess) {                                                   \
      r->res = MOK_ERROR_CUDA;                                                      \
      snprintf(r->msg, sizeof r->msg, "rank %d: %s: %s", r->rank, #call,            \
               cudaGetErrorString(step_e_));                                        \
      return;                                                                       \
    }                                                                               \
  } while (0)

#define REQUIRE_RANKS_OK(ranks)                                                          \
  do {                                                                                   \
    for (int rr_ = 0; rr_ < W; rr_++)                                                    \
      MOK_REQUIRE_MSG(ranks[rr_].res == MOK_SUCCESS, "%s", ranks[rr_].msg);              \
  } while (0)

/* ---- steps ------------------------------------------------------------------------------------ */

static void step_comm_from_nccl(rank_t *r) {
  STEP(r, mok_comm_create_nccl(&r->comm, (struct ncclComm *)r->nccl, r->rank));
}
static void step_comm_from_id(rank_t *r) {
  STEP(r, mok_comm_create_unique_id(&r->comm, r->id, r->rank, W, r->rank));
}
static void step_transport_create(rank_t *r) {
  STEP(r, mok_transport_create(&r->tp, r->comm, &r->desc));
}
static void step_transport_destroy(rank_t *r) {
  STEP(r, mok_transport_destroy(r->tp));
  r->tp = NULL;
}
static void step_comm_destroy(rank_t *r) {
  STEP(r, mok_comm_destroy(r->comm));
  r->comm = NULL;
}

template <typename T>
static int d2h(std::vector<T> &v, const void *src, size_t n) {
  v.resize(n);
  return n == 0 || cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess;
}

// One call: upload, layout, run (r->phases; 0 = layout only), check, download what tests read.
static void step_call(rank_t *r) {
  const int64_t T = r->T, K = r->desc.top_k, H = r->desc.hidden, E = r->desc.num_experts;
  int32_t *d_idx = NULL;
  uint16_t *d_x = NULL, *d_y = NULL;
  const size_t xb = (size_t)(T > 0 ? T : 1) * H * 2;
  STEP_CUDA(r, cudaMalloc(&d_idx, (size_t)(T > 0 ? T : 1) * K * 4));
  STEP_CUDA(r, cudaMalloc(&d_x, xb));
  STEP_CUDA(r, cudaMalloc(&d_y, xb));
  if (T > 0) {
    STEP_CUDA(r, cudaMemcpy(d_idx, r->idx.data(), (size_t)T * K * 4, cudaMemcpyHostToDevice));
    STEP_CUDA(r, cudaMemcpy(d_x, r->x.data(), (size_t)T * H * 2, cudaMemcpyHostToDevice));
  }
  STEP_CUDA(r, cudaMemset(d_y, 0xFF, xb));  // NaN poison: every row must be written
  mokResult_t res = mok_transport_layout(r->tp, T, T ? d_idx : NULL, NULL);
  // phases: 0 = layout only, SPLIT_PHASES = three launches (as the benchmark times them).
  const int launches[3] = {MOK_TP_DISPATCH, MOK_TP_COMBINE, MOK_TP_REDUCE};
  for (int i = 0; i < 3 && r->phases == SPLIT_PHASES && res == MOK_SUCCESS; i++)
    res = mok_transport_run(r->tp, launches[i], T ? d_x : NULL, T ? d_y : NULL, NULL);
  if (res == MOK_SUCCESS && r->phases && r->phases != SPLIT_PHASES)
    res = mok_transport_run(r->tp, r->phases, T ? d_x : NULL, T ? d_y : NULL, NULL);
  if (res == MOK_SUCCESS) res = mok_transport_check(r->tp);
  if (res != MOK_SUCCESS) fail_into(r, res, "layout/run/check");
  mok_transport_view_t v;
  if (mok_transport_view(r->tp, &v) == MOK_SUCCESS && cudaDeviceSynchronize() == cudaSuccess) {
    int ok = d2h(r->slot_row, v.slot_row, T * K) && d2h(r->token_pos, v.token_pos, T * W) &&
             d2h(r->count, v.count, W * E) && d2h(r->token_count, v.token_count, W * W) &&
             d2h(r->expert_start, v.expert_start, E) && d2h(r->rank_rows, v.rank_rows, W) &&
             d2h(r->recv_tokens, v.recv_tokens, W);
    const int64_t recv = ok ? r->recv_tokens[r->rank] : 0;
    ok = ok && recv >= 0 && recv <= v.recv_capacity && d2h(r->recv_x, v.recv_x, recv * H) &&
         d2h(r->recv_meta, v.recv_meta, recv * (K + 1)) && d2h(r->comb, v.comb, T * K * H) &&
         d2h(r->y, d_y, T * H);
    if (!ok && r->res == MOK_SUCCESS) {
      r->res = MOK_ERROR_CUDA;
      snprintf(r->msg, sizeof r->msg, "rank %d: reading results back failed", r->rank);
    }
  }
  cudaFree(d_idx);
  cudaFree(d_x);
  cudaFree(d_y);
}

/* ---- payloads and routing ---------------------------------------------------------------------- */

// x[s][t][c]: identifies (s, t) in its first three columns; exact in bf16.
static uint16_t payload(int s, int64_t t, int64_t c) {
  if (c == 0) return f2bf((float)(t & 255));
  if (c == 1) return f2bf((float)((t >> 8) & 255));
  if (c == 2) return f2bf((float)s);
  return f2bf((float)((s * 131 + t * 7 + c * 3) % 61 - 30) / 8.0f);
}

// This file's random stream: an integer in [0, n) from the top 31 bits of a draw.
static test_rng_t g_rng = {0x2545F4914F6CDD1Dull, TEST_RNG_XORSHIFT64};
static uint32_t rnd(uint32_t n) { return (uint32_t)((test_rng_u64(&g_rng) >> 33) % n); }

typedef enum {
  ROUTE_RANDOM,     // distinct experts, ~1 in 6 slots empty, expert `empty` never used
  ROUTE_FULL,       // distinct experts in every slot
  ROUTE_ONE_EXPERT  // slot 0 to expert `one`, the rest empty
} route_t;

static void make_rank(rank_t *r, int64_t T, route_t how, int empty, int one) {
  const int64_t K = r->desc.top_k, H = r->desc.hidden, E = r->desc.num_experts;
  r->T = T;
  r->idx.assign(T * K, -1);
  r->x.resize(T * H);
  for (int64_t t = 0; t < T; t++) {
    for (int64_t c = 0; c < H; c++) r->x[t * H + c] = payload(r->rank, t, c);
    if (how == ROUTE_ONE_EXPERT) {
      r->idx[t * K] = one;
      continue;
    }
    for (int64_t k = 0; k < K; k++) {
      if (how == ROUTE_RANDOM && rnd(6) == 0) continue;
      for (;;) {
        const int e = (int)rnd((uint32_t)E);
        if (e == empty) continue;
        int dup = 0;
        for (int64_t j = 0; j < k; j++) dup |= r->idx[t * K + j] == e;
        if (!dup) {
          r->idx[t * K + k] = e;
          break;
        }
      }
    }
  }
}

/* ---- the checks ------------------------------------------------------------------------------- */

// Compares everything the ranks read back with the CPU layout and the expected rows. Returns the
// number of mismatches (each reported, up to a few).
static int check_call(rank_t *ranks, const char *label) {
  const int64_t K = ranks[0].desc.top_k, H = ranks[0].desc.hidden, E = ranks[0].desc.num_experts;
  const int64_t EL = E / W, tile_m = ranks[0].desc.tile_m;
  int64_t T[W];
  const int32_t *idx[W];
  for (int r = 0; r < W; r++) T[r] = ranks[r].T, idx[r] = ranks[r].idx.data();
  mok_layout_t L;
  char err[256];
  if (mok_layout_build(&L, W, E, K, tile_m, T, idx, err, sizeof err) != MOK_SUCCESS) {
    mok_test_fail(__FILE__, __LINE__, "%s: CPU layout: %s", label, err);
    return 1;
  }
  int bad = 0;
#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    if (!(cond)) {                                                           \
      if (bad++ < 8) {                                                       \
        char m_[300];                                                        \
        snprintf(m_, sizeof m_, __VA_ARGS__);                                \
        mok_test_fail(__FILE__, __LINE__, "%s: %s", label, m_);              \
      }                                                                      \
    }                                                                        \
  } while (0)
  for (int r = 0; r < W; r++) {
    const rank_t *R = &ranks[r];
    for (int64_t i = 0; i < T[r] * K; i++)
      CHECK(R->slot_row[i] == L.slot_row[r][i], "rank %d slot_row[%lld] = %d, CPU %lld", r,
            (long long)i, R->slot_row[i], (long long)L.slot_row[r][i]);
    for (int64_t i = 0; i < T[r] * W; i++)
      CHECK(R->token_pos[i] == L.token_pos[r][i], "rank %d token_pos[%lld] = %d, CPU %lld", r,
            (long long)i, R->token_pos[i], (long long)L.token_pos[r][i]);
    for (int64_t i = 0; i < W * E; i++)
      CHECK(R->count[i] == L.count[i], "rank %d count[%lld] = %d, CPU %lld", r, (long long)i,
            R->count[i], (long long)L.count[i]);
    for (int64_t e = 0; e < E; e++)
      CHECK(R->expert_start[e] == L.expert_start[e], "rank %d expert_start[%lld] = %d, CPU %lld",
            r, (long long)e, R->expert_start[e], (long long)L.expert_start[e]);
    for (int d = 0; d < W; d++) {
      CHECK(R->rank_rows[d] == L.rank_rows[d], "rank %d rank_rows[%d] = %d, CPU %lld", r, d,
            R->rank_rows[d], (long long)L.rank_rows[d]);
      CHECK(R->recv_tokens[d] == L.recv_tokens[d], "rank %d recv_tokens[%d] = %d, CPU %lld", r, d,
            R->recv_tokens[d], (long long)L.recv_tokens[d]);
    }
    // Received tokens: rows and metadata, in (source, token) order. The block of this rank's own
    // tokens stays unwritten: their rows are read from x where they are.
    const int64_t recv = L.recv_tokens[r];
    for (int64_t p = 0; p < recv && (int64_t)R->recv_meta.size() >= (p + 1) * (K + 1); p++) {
      const int s = (int)L.recv_from[r][2 * p];
      const int64_t t = L.recv_from[r][2 * p + 1];
      if (s == r) continue;
      CHECK(!memcmp(&R->recv_x[p * H], &ranks[s].x[t * H], H * 2),
            "rank %d received row %lld is not x of rank %d token %lld (first columns %g %g %g)", r,
            (long long)p, s, (long long)t, bf2f(R->recv_x[p * H]), bf2f(R->recv_x[p * H + 1]),
            bf2f(R->recv_x[p * H + 2]));
      const int32_t *m = &R->recv_meta[p * (K + 1)];
      CHECK(m[0] == t, "rank %d meta of %lld: token %d, expected %lld", r, (long long)p, m[0],
            (long long)t);
      for (int64_t k = 0; k < K; k++) {
        const int32_t e = ranks[s].idx[t * K + k];
        const int64_t want = (e >= 0 && e / EL == r) ? L.slot_row[s][t * K + k] : -1;
        CHECK(m[1 + k] == want, "rank %d meta of %lld slot %lld: row %d, expected %lld", r,
              (long long)p, (long long)k, m[1 + k], (long long)want);
      }
    }
    // Combined rows and the sum.
    for (int64_t t = 0; t < T[r]; t++) {
      for (int64_t c = 0; c < H; c++) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; k++) {
          const int32_t e = R->idx[t * K + k];
          if (e < 0) continue;
          const uint16_t want = f2bf(bf2f(R->x[t * H + c]) * (float)(e % 4 + 1));
          const uint16_t got = R->comb[(t * K + k) * H + c];
          // Rows from other ranks' experts come home into comb; this rank's own stay put.
          if (e / EL != r)
            CHECK(got == want, "rank %d comb[token %lld, slot %lld, col %lld] = %g, expected %g",
                  r, (long long)t, (long long)k, (long long)c, bf2f(got), bf2f(want));
          acc += bf2f(want);
        }
        CHECK(R->y[t * H + c] == f2bf(acc), "rank %d y[%lld, %lld] = %g (0x%04x), expected %g", r,
              (long long)t, (long long)c, bf2f(R->y[t * H + c]), R->y[t * H + c], acc);
      }
    }
  }
#undef CHECK
  mok_layout_free(&L);
  return bad;
}

/* ---- setup ------------------------------------------------------------------------------------ */

static mok_transport_desc_t small_desc(void) {
  mok_transport_desc_t d;
  memset(&d, 0, sizeof d);
  d.max_tokens = 300;
  d.hidden = 256;
  d.num_experts = 8;  // 4 per rank
  d.top_k = 3;
  d.tile_m = 16;
  d.num_sms = 3;  // several CTAs even on small shapes
  d.timeout_s = 20;
  return d;
}

// NCCL communicators for GPUs 0 and 1 (ncclCommInitAll), then MoK communicators and transports.
static int team_up(rank_t *ranks, const mok_transport_desc_t *d) {
  ncclComm_t nccl[W];
  int devs[W] = {0, 1};
  ncclResult_t nr = ncclCommInitAll(nccl, W, devs);
  if (nr != ncclSuccess) {
    mok_test_fail(__FILE__, __LINE__, "ncclCommInitAll: %s", ncclGetErrorString(nr));
    return 0;
  }
  for (int r = 0; r < W; r++) {
    ranks[r].rank = r;
    ranks[r].nccl = nccl[r];
    ranks[r].desc = *d;
  }
  on_ranks(step_comm_from_nccl, ranks);
  for (int r = 0; r < W; r++)
    if (ranks[r].res != MOK_SUCCESS) {
      mok_test_fail(__FILE__, __LINE__, "%s", ranks[r].msg);
      return 0;
    }
  on_ranks(step_transport_create, ranks);
  for (int r = 0; r < W; r++)
    if (ranks[r].res != MOK_SUCCESS) {
      mok_test_fail(__FILE__, __LINE__, "%s", ranks[r].msg);
      return 0;
    }
  return 1;
}

static void team_down(rank_t *ranks) {
  on_ranks(step_transport_destroy, ranks);
  for (int r = 0; r < W; r++) MOK_EXPECT_MSG(ranks[r].res == MOK_SUCCESS, "%s", ranks[r].msg);
  on_ranks(step_comm_destroy, ranks);
  for (int r = 0; r < W; r++) {
    MOK_EXPECT_MSG(ranks[r].res == MOK_SUCCESS, "%s", ranks[r].msg);
    if (ranks[r].nccl) ncclCommDestroy(ranks[r].nccl);
    ranks[r].nccl = NULL;
  }
}

// One full call (layout, dispatch, combine) on both ranks, checked.
static int full_call(rank_t *ranks, const char *label) {
  for (int r = 0; r < W; r++) ranks[r].phases = MOK_TP_ALL;
  on_ranks(step_call, ranks);
  for (int r = 0; r < W; r++)
    if (ranks[r].res != MOK_SUCCESS) {
      mok_test_fail(__FILE__, __LINE__, "%s: %s", label, ranks[r].msg);
      return 1;
    }
  return check_call(ranks, label);
}

#define SKIP_UNLESS_TWO_GPUS()                        \
  do {                                                \
    const char *why_ = two_gpu_skip_reason();         \
    if (why_) MOK_SKIP(why_);                         \
  } while (0)

#endif /* MOK_TESTS_GPU_TRANSPORT_TEAM_CUH */
