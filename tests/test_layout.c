/*
 * test_layout.c: the routing layout of src/cpu/layout.c. A hand-built case written out row by row,
 * then the layout's defining properties checked on random routings over W = 1..8 ranks and the
 * routing edge cases (uneven T, T = 0 with no routing array, empty experts, all tokens to one
 * expert, K = 1, empty slots), then every error path with its detail message. Last, the GPU
 * layout's split of the tokens into chunks (src/common/workspace.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/workspace.h"
#include "cpu/layout.h"
#include "support/rng.h"
#include "test.h"

/* ---- the property checker -------------------------------------------------------------------- */

/* (s, t, k) < (s', t', k') lexicographically. */
static int origin_less(mok_row_origin_t a, mok_row_origin_t b) {
  if (a.src != b.src) return a.src < b.src;
  if (a.token != b.token) return a.token < b.token;
  return a.slot < b.slot;
}

/* Checks every documented property of l against the routing it was built from. */
static void check_layout(const mok_layout_t *l, int W, int64_t E, int64_t K, int64_t tile_m,
                         const int64_t *T, const int32_t *const *idx) {
  MOK_REQUIRE(l->W == W && l->E == E && l->EL == E / W && l->K == K && l->tile_m == tile_m);
  const int64_t EL = E / W;
  for (int s = 0; s < W; s++) MOK_EXPECT(l->T[s] == T[s]);

  /* counts and expert_rows from a direct count; slot_row points into the right segment and
   * row_from maps it back; every non-empty slot is seen here exactly once. */
  int64_t *count = calloc((size_t)W * E, sizeof *count);
  int64_t *used = calloc((size_t)W, sizeof *used); /* non-padding rows found per rank */
  MOK_REQUIRE(count && used);
  for (int s = 0; s < W; s++) {
    for (int64_t t = 0; t < T[s]; t++) {
      for (int64_t k = 0; k < K; k++) {
        int32_t e = idx[s][t * K + k];
        int64_t row = l->slot_row[s][t * K + k];
        if (e < 0) {
          MOK_EXPECT(row == -1);
          continue;
        }
        count[s * E + e]++;
        int r = (int)(e / EL);
        MOK_EXPECT_MSG(row >= l->expert_start[e] && row < l->expert_start[e] + l->expert_rows[e],
                       "rank %d token %lld slot %lld: row %lld outside expert %d", s, (long long)t,
                       (long long)k, (long long)row, (int)e);
        if (row < 0 || row >= l->rank_rows[r]) continue;
        mok_row_origin_t o = l->row_from[r][row];
        MOK_EXPECT(o.src == s && o.token == t && o.slot == k);
      }
    }
  }
  for (int64_t e = 0; e < E; e++) {
    int64_t rows = 0;
    for (int s = 0; s < W; s++) {
      MOK_EXPECT(l->count[s * E + e] == count[s * E + e]);
      rows += count[s * E + e];
    }
    MOK_EXPECT(l->expert_rows[e] == rows);
  }

  /* Segments: in expert order from row 0, each starting at a multiple of tile_m and padded to
   * one; rank_rows is their sum; rows inside are strictly (src, token, slot) ordered and point
   * back through slot_row; the padding rows have src = -1. */
  for (int r = 0; r < W; r++) {
    int64_t cursor = 0;
    for (int64_t e = r * EL; e < (r + 1) * EL; e++) {
      int64_t start = l->expert_start[e], n = l->expert_rows[e];
      int64_t padded = (n + tile_m - 1) / tile_m * tile_m;
      MOK_EXPECT(start == cursor && start % tile_m == 0);
      for (int64_t i = start; i < start + padded && i < l->rank_rows[r]; i++) {
        mok_row_origin_t o = l->row_from[r][i];
        if (i >= start + n) {
          MOK_EXPECT_MSG(o.src == -1, "rank %d row %lld should be padding", r, (long long)i);
          continue;
        }
        MOK_REQUIRE(o.src >= 0 && o.src < W && o.token >= 0 && o.token < T[o.src] && o.slot >= 0 &&
                    o.slot < K);
        MOK_EXPECT(idx[o.src][o.token * K + o.slot] == e);
        MOK_EXPECT(l->slot_row[o.src][o.token * K + o.slot] == i);
        if (i > start) MOK_EXPECT(origin_less(l->row_from[r][i - 1], o));
        used[r]++;
      }
      cursor += padded;
    }
    MOK_EXPECT(l->rank_rows[r] == cursor);
  }
  int64_t slots = 0, found = 0;
  for (int s = 0; s < W; s++) {
    for (int64_t e = 0; e < E; e++) slots += count[s * E + e];
    found += used[s];
  }
  MOK_EXPECT(found == slots);

  /* Token dispatch: token_pos is -1 exactly when no slot goes to d, else a position whose
   * recv_from entry names the token back; recv_from is strictly (src, token) ordered, so each
   * token is there at most once; recv_tokens counts the tokens that go there. */
  for (int d = 0; d < W; d++) {
    int64_t expect = 0;
    for (int s = 0; s < W; s++) {
      for (int64_t t = 0; t < T[s]; t++) {
        int goes = 0;
        for (int64_t k = 0; k < K; k++)
          goes |= idx[s][t * K + k] >= 0 && idx[s][t * K + k] / EL == d;
        int64_t p = l->token_pos[s][t * W + d];
        MOK_EXPECT(goes ? p >= 0 && p < l->recv_tokens[d] : p == -1);
        if (!goes || p < 0 || p >= l->recv_tokens[d]) continue;
        MOK_EXPECT(l->recv_from[d][2 * p] == s && l->recv_from[d][2 * p + 1] == t);
        expect++;
      }
    }
    MOK_EXPECT(l->recv_tokens[d] == expect);
    for (int64_t p = 1; p < l->recv_tokens[d]; p++) {
      const int64_t *a = l->recv_from[d] + 2 * (p - 1), *b = a + 2;
      MOK_EXPECT(a[0] < b[0] || (a[0] == b[0] && a[1] < b[1]));
    }
  }
  free(count);
  free(used);
}

/* ---- random routings ------------------------------------------------------------------------- */

typedef enum {
  ROUTE_UNIFORM,    /* K distinct experts per token, some slots -1 */
  ROUTE_SUBSET,     /* only experts 0, 3, 6, ... (others empty) */
  ROUTE_ONE_EXPERT, /* slot 0 always expert E - 1, other slots -1 */
  ROUTE_SKEWED      /* expert ids biased to the low end: some ranks receive far more */
} route_kind_t;

/* Fills idx [T, K] with distinct experts per row, drawn by `kind`. empty_pct: chance of -1. */
static void random_routing(test_rng_t *rng, int32_t *idx, int64_t T, int64_t E, int64_t K,
                           route_kind_t kind, int empty_pct) {
  for (int64_t t = 0; t < T; t++) {
    for (int64_t k = 0; k < K; k++) {
      int32_t e = -1;
      if (kind == ROUTE_ONE_EXPERT) {
        e = k == 0 ? (int32_t)(E - 1) : -1;
      } else if (kind == ROUTE_SUBSET && k >= (E + 2) / 3) {
        e = -1; /* the subset has fewer than K experts */
      } else if ((int)(test_rng_u64(rng) % 100) >= empty_pct) {
        for (;;) { /* rejection until distinct from earlier slots of the row */
          uint64_t x = test_rng_u64(rng);
          if (kind == ROUTE_UNIFORM) e = (int32_t)(x % E);
          if (kind == ROUTE_SUBSET) e = (int32_t)((x % ((E + 2) / 3)) * 3);
          if (kind == ROUTE_SKEWED) e = (int32_t)((x % E) * ((x >> 32) % (E + 1)) / E);
          int dup = 0;
          for (int64_t j = 0; j < k; j++) dup |= idx[t * K + j] == e;
          if (!dup) break;
        }
      }
      idx[t * K + k] = e;
    }
  }
}

/* Builds and checks one random case; T[s] = 0 ranks get a NULL routing array. */
static void run_random(uint64_t seed, int W, int64_t E, int64_t K, int64_t tile_m, const int64_t *T,
                       route_kind_t kind, int empty_pct) {
  test_rng_t rng = test_rng(seed);
  int32_t *idx[8] = {0};
  for (int s = 0; s < W; s++) {
    if (T[s] == 0) continue;
    idx[s] = malloc((size_t)(T[s] * K) * sizeof *idx[s]);
    MOK_REQUIRE(idx[s]);
    random_routing(&rng, idx[s], T[s], E, K, kind, empty_pct);
  }
  mok_layout_t l;
  char err[256];
  mokResult_t res =
      mok_layout_build(&l, W, E, K, tile_m, T, (const int32_t *const *)idx, err, sizeof err);
  MOK_EXPECT_MSG(res == MOK_SUCCESS, "seed %llu: %s", (unsigned long long)seed, err);
  if (res == MOK_SUCCESS) {
    check_layout(&l, W, E, K, tile_m, T, (const int32_t *const *)idx);
    mok_layout_free(&l);
  }
  for (int s = 0; s < W; s++) free(idx[s]);
}

MOK_TEST(layout_random_routings_over_ranks) {
  const int Ws[4] = {1, 2, 4, 8};
  test_rng_t rng = test_rng(0x9E3779B97F4A7C15ull);
  for (int wi = 0; wi < 4; wi++) {
    int W = Ws[wi];
    for (int rep = 0; rep < 12; rep++) {
      int64_t T[8];
      for (int s = 0; s < W; s++) T[s] = 1 + (int64_t)(test_rng_u64(&rng) % 150); /* uneven */
      int64_t E = (int64_t)W * (1 + (int64_t)(test_rng_u64(&rng) % 6));
      int64_t K = 1 + (int64_t)(test_rng_u64(&rng) % (E < 8 ? E : 8));
      int64_t tile_m = 1 + (int64_t)(test_rng_u64(&rng) % 64);
      run_random(test_rng_u64(&rng), W, E, K, tile_m, T, (route_kind_t)(rep % 4), rep % 3 * 15);
    }
  }
}

MOK_TEST(layout_edge_cases) {
  /* T = 0 on one rank (routing pointer NULL), uneven T, K = 1, many empty slots. */
  const int64_t T_zero[4] = {37, 0, 5, 64};
  run_random(1, 4, 8, 2, 16, T_zero, ROUTE_UNIFORM, 20);
  run_random(2, 4, 8, 1, 16, T_zero, ROUTE_UNIFORM, 0); /* K = 1 */
  run_random(3, 4, 8, 3, 7, T_zero, ROUTE_UNIFORM, 90); /* mostly -1 slots */
  /* Every token to one expert (the last, on the last rank); every other expert empty. */
  const int64_t T_even[2] = {100, 100};
  run_random(4, 2, 6, 4, 32, T_even, ROUTE_ONE_EXPERT, 0);
  /* Empty experts from a subset routing; tile_m = 1 (no padding) and tile_m larger than T. */
  run_random(5, 2, 12, 3, 1, T_even, ROUTE_SUBSET, 10);
  run_random(6, 2, 12, 3, 256, T_even, ROUTE_SUBSET, 10);
  /* K = E: every expert in every row (no empty slots). */
  run_random(7, 2, 4, 4, 8, T_even, ROUTE_UNIFORM, 0);
  /* W = 8 with one expert per rank. */
  const int64_t T8[8] = {3, 0, 9, 1, 0, 20, 7, 2};
  run_random(8, 8, 8, 2, 4, T8, ROUTE_UNIFORM, 10);
  /* All ranks empty: a valid layout with no rows and no tokens. */
  const int64_t T_none[2] = {0, 0};
  const int32_t *none[2] = {NULL, NULL};
  mok_layout_t l;
  MOK_REQUIRE(mok_layout_build(&l, 2, 4, 2, 8, T_none, none, NULL, 0) == MOK_SUCCESS);
  MOK_EXPECT(l.rank_rows[0] == 0 && l.rank_rows[1] == 0);
  MOK_EXPECT(l.recv_tokens[0] == 0 && l.recv_tokens[1] == 0);
  for (int e = 0; e < 4; e++) MOK_EXPECT(l.expert_rows[e] == 0 && l.expert_start[e] == 0);
  mok_layout_free(&l);
  mok_layout_free(&l); /* freeing twice is harmless: free zeroes the struct */
}

/* ---- a hand-built case ----------------------------------------------------------------------- */

MOK_TEST(layout_hand_built_w2_e4_k2) {
  /* W = 2, E = 4 (EL = 2: experts 0, 1 on rank 0; 2, 3 on rank 1), K = 2, 3 tokens per rank,
   * tile_m = 4.
   *   rank 0: t0 [0, 2]   t1 [1, -1]   t2 [2, 3]
   *   rank 1: t0 [2, 0]   t1 [-1, -1]  t2 [3, 0]
   * Rows per expert in (src, token, slot) order:
   *   e0: (0,0,0) (1,0,1) (1,2,1)   3 rows -> padded 4, start 0 on rank 0
   *   e1: (0,1,0)                   1 row  -> padded 4, start 4 on rank 0   rank_rows[0] = 8
   *   e2: (0,0,1) (0,2,0) (1,0,0)   3 rows -> padded 4, start 0 on rank 1
   *   e3: (0,2,1) (1,2,0)           2 rows -> padded 4, start 4 on rank 1   rank_rows[1] = 8
   * slot_row, by (token, slot):
   *   rank 0: t0 [0 (e0 row 0), 0 (e2 row 0)]  t1 [4, -1]   t2 [1 (e2 row 1), 4 (e3 row 0)]
   *   rank 1: t0 [2 (e2 row 2), 1 (e0 row 1)]  t1 [-1, -1]  t2 [5 (e3 row 1), 2 (e0 row 2)]
   * Token dispatch (a token once per destination, in (src, token) order):
   *   to rank 0 (e0, e1): (0,0) (0,1) (1,0) (1,2)
   *   to rank 1 (e2, e3): (0,0) (0,2) (1,0) (1,2)   ((0,2) goes once though it has e2 and e3)
   * token_pos[s][t * W + d]:
   *   rank 0: t0 [0, 0]  t1 [1, -1]  t2 [-1, 1]
   *   rank 1: t0 [2, 2]  t1 [-1, -1] t2 [3, 3] */
  const int32_t r0[6] = {0, 2, 1, -1, 2, 3}, r1[6] = {2, 0, -1, -1, 3, 0};
  const int32_t *idx[2] = {r0, r1};
  const int64_t T[2] = {3, 3};
  mok_layout_t l;
  char err[128];
  MOK_REQUIRE(mok_layout_build(&l, 2, 4, 2, 4, T, idx, err, sizeof err) == MOK_SUCCESS);
  MOK_EXPECT(err[0] == '\0');

  const int64_t count[8] = {1, 1, 2, 1, 2, 0, 1, 1};
  const int64_t expert_rows[4] = {3, 1, 3, 2}, expert_start[4] = {0, 4, 0, 4};
  for (int i = 0; i < 8; i++) MOK_EXPECT(l.count[i] == count[i]);
  for (int e = 0; e < 4; e++) {
    MOK_EXPECT(l.expert_rows[e] == expert_rows[e] && l.expert_start[e] == expert_start[e]);
  }
  MOK_EXPECT(l.rank_rows[0] == 8 && l.rank_rows[1] == 8);

  const mok_row_origin_t P = {-1, -1, -1};
  const mok_row_origin_t from0[8] = {{0, 0, 0}, {1, 1, 0}, {1, 1, 2}, P, {0, 0, 1}, P, P, P};
  const mok_row_origin_t from1[8] = {{0, 1, 0}, {0, 0, 2}, {1, 0, 0}, P,
                                     {0, 1, 2}, {1, 0, 2}, P,         P};
  for (int i = 0; i < 8; i++) {
    MOK_EXPECT_MSG(l.row_from[0][i].src == from0[i].src && l.row_from[0][i].slot == from0[i].slot &&
                       l.row_from[0][i].token == from0[i].token,
                   "rank 0 row %d", i);
    MOK_EXPECT_MSG(l.row_from[1][i].src == from1[i].src && l.row_from[1][i].slot == from1[i].slot &&
                       l.row_from[1][i].token == from1[i].token,
                   "rank 1 row %d", i);
  }
  const int64_t slot0[6] = {0, 0, 4, -1, 1, 4}, slot1[6] = {2, 1, -1, -1, 5, 2};
  for (int i = 0; i < 6; i++)
    MOK_EXPECT(l.slot_row[0][i] == slot0[i] && l.slot_row[1][i] == slot1[i]);

  MOK_EXPECT(l.recv_tokens[0] == 4 && l.recv_tokens[1] == 4);
  const int64_t recv0[8] = {0, 0, 0, 1, 1, 0, 1, 2}, recv1[8] = {0, 0, 0, 2, 1, 0, 1, 2};
  for (int i = 0; i < 8; i++)
    MOK_EXPECT(l.recv_from[0][i] == recv0[i] && l.recv_from[1][i] == recv1[i]);
  const int64_t pos0[6] = {0, 0, 1, -1, -1, 1}, pos1[6] = {2, 2, -1, -1, 3, 3};
  for (int i = 0; i < 6; i++)
    MOK_EXPECT(l.token_pos[0][i] == pos0[i] && l.token_pos[1][i] == pos1[i]);

  check_layout(&l, 2, 4, 2, 4, T, idx); /* and the general properties agree */
  mok_layout_free(&l);
  MOK_EXPECT(l.T == NULL && l.row_from == NULL && l.W == 0);
}

/* ---- errors ---------------------------------------------------------------------------------- */

/* Builds the W = 2, E = 4, K = 2 layout with one id of rank `bad_rank` replaced, expects
 * MOK_ERROR_INVALID_ROUTING, an empty *l and a message holding every string in `want`. */
static void expect_bad_routing(int bad_rank, int bad_pos, int32_t bad_id, const char *const *want,
                               int nwant) {
  int32_t r0[6] = {0, 2, 1, -1, 2, 3}, r1[6] = {2, 0, -1, -1, 3, 0};
  int32_t *rows[2] = {r0, r1};
  rows[bad_rank][bad_pos] = bad_id;
  const int32_t *idx[2] = {r0, r1};
  const int64_t T[2] = {3, 3};
  mok_layout_t l;
  memset(&l, 0x5A, sizeof l); /* garbage in: a failed build must still leave nothing to free */
  char err[256];
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, 4, T, idx, err, sizeof err) ==
             MOK_ERROR_INVALID_ROUTING);
  for (int i = 0; i < nwant; i++) {
    MOK_EXPECT_MSG(strstr(err, want[i]) != NULL, "message \"%s\" lacks \"%s\"", err, want[i]);
  }
  MOK_EXPECT(l.T == NULL && l.count == NULL && l.slot_row == NULL && l.row_from == NULL &&
             l.token_pos == NULL && l.recv_from == NULL && l.W == 0);
  mok_layout_free(&l);
  /* err may be NULL, or too short: the result is the same and nothing overflows. */
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, 4, T, idx, NULL, 0) == MOK_ERROR_INVALID_ROUTING);
  char tiny[8];
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, 4, T, idx, tiny, sizeof tiny) ==
             MOK_ERROR_INVALID_ROUTING);
  MOK_EXPECT(strlen(tiny) == sizeof tiny - 1);
}

MOK_TEST(layout_rejects_bad_routing) {
  /* id = E on rank 1, token 2, slot 1. */
  const char *const want_e[] = {"rank 1", "token 2", "slot 1", "expert id 4"};
  expect_bad_routing(1, 5, 4, want_e, 4);
  /* id = -2 on rank 0, token 1, slot 1 (the -1 slot made invalid). */
  const char *const want_m2[] = {"rank 0", "token 1", "slot 1", "expert id -2"};
  expect_bad_routing(0, 3, -2, want_m2, 4);
  /* Rank 0 token 2 routes [2, 2]: a duplicate, reported at slot 1, naming the first slot 0. */
  const char *const want_dup[] = {"rank 0", "token 2", "slot 1", "expert id 2", "slot 0"};
  expect_bad_routing(0, 5, 2, want_dup, 5);
  /* Very large id. */
  const char *const want_big[] = {"rank 1", "token 0", "slot 0", "expert id 2147483647"};
  expect_bad_routing(1, 0, INT32_MAX, want_big, 4);
}

MOK_TEST(layout_rejects_bad_arguments) {
  const int32_t r0[6] = {0, 2, 1, -1, 2, 3}, r1[6] = {2, 0, -1, -1, 3, 0};
  const int32_t *idx[2] = {r0, r1}, *idx_null1[2] = {r0, NULL};
  const int64_t T[2] = {3, 3}, T_neg[2] = {3, -1}, T_zero1[2] = {3, 0};
  mok_layout_t l;
  char err[256];
  MOK_EXPECT(mok_layout_build(NULL, 2, 4, 2, 4, T, idx, err, sizeof err) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, 4, NULL, idx, err, sizeof err) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, 4, T, NULL, err, sizeof err) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layout_build(&l, 0, 4, 2, 4, T, idx, err, sizeof err) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(strstr(err, "W 0") != NULL);
  MOK_EXPECT(mok_layout_build(&l, 2, 5, 2, 4, T, idx, err, sizeof err) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_layout_build(&l, 2, 0, 2, 4, T, idx, err, sizeof err) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 0, 4, T, idx, err, sizeof err) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, 0, T, idx, err, sizeof err) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, 4, T_neg, idx, err, sizeof err) ==
             MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(strstr(err, "rank 1") != NULL);
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, 4, T, idx_null1, err, sizeof err) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(strstr(err, "rank 1") != NULL);
  MOK_EXPECT(l.T == NULL && l.W == 0);
  /* A NULL routing array is fine where T = 0. */
  MOK_REQUIRE(mok_layout_build(&l, 2, 4, 2, 4, T_zero1, idx_null1, err, sizeof err) == MOK_SUCCESS);
  MOK_EXPECT(l.recv_tokens[0] == 2 && l.recv_tokens[1] == 2); /* rank 0's t0, t1 / t0, t2 */
  mok_layout_free(&l);
  /* Padding that would overflow int64 row counts is refused, not wrapped. */
  MOK_EXPECT(mok_layout_build(&l, 2, 4, 2, INT64_MAX, T, idx, err, sizeof err) ==
             MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(l.T == NULL);
}

/* ---- the GPU layout's chunks (src/common/workspace.h, mok_ll_*) --------------------------------------- */

/* For every T up to 200 000 tokens: the chunks are whole rounds, at most MOK_LL_MAX_CTAS of them,
 * cover [0, T) with no empty chunk, and the layout region sized for any T_max >= T holds their
 * partials (counts [ctas, E] int32 up to mok_ll_bad_index, then two u64 per chunk). */
MOK_TEST(gpu_layout_chunks_cover_the_tokens_and_fit_the_workspace) {
  const int64_t E = 7;
  int64_t most = 0; /* the largest chunk count of any T so far */
  int bad = 0;
  for (int64_t T = 0; T <= 200000 && bad < 5; T += T < 5000 ? 1 : 37) {
    const int64_t chunk = mok_ll_chunk(T), ctas = mok_ll_ctas(T);
    const int ok = chunk > 0 && chunk % MOK_LL_ROUND == 0 && ctas >= 1 &&
                   ctas <= MOK_LL_MAX_CTAS && ctas * chunk >= T && (ctas - 1) * chunk < (T ? T : 1);
    if (!ok && bad++ < 5)
      mok_test_fail(__FILE__, __LINE__, "T = %lld: %lld chunks of %lld tokens", (long long)T,
                    (long long)ctas, (long long)chunk);
    if (ctas > most) most = ctas;
    const size_t need = (size_t)mok_ll_bad_index(most, E) * 4 + (size_t)most * 16;
    if (mok_ll_bytes(T, E) < need && bad++ < 5)
      mok_test_fail(__FILE__, __LINE__, "T_max = %lld: %zu bytes for %lld chunks (%zu needed)",
                    (long long)T, mok_ll_bytes(T, E), (long long)most, need);
  }
  MOK_EXPECT(bad == 0);
  MOK_EXPECT(mok_ll_ctas(16384) == 32 && mok_ll_chunk(16384) == 512);
}
