/*
 * layout.c: the routing layout of W ranks, built on the host from every rank's routing (layout.h).
 * It is the oracle the GPU layout phase and the transport are checked against, so it is written the
 * plain way: count, prefix-sum, then one pass in (source rank, token, slot) order that hands out
 * rows, which gives the order of rows inside each expert segment by construction.
 *
 * Steps: (1) validate the arguments and the routing while counting rows per (source, expert);
 * (2) place the expert segments (padded to tile_m, in expert order within each rank); (3) assign
 * rows; (4) assign token receive positions per destination rank, in (source rank, token) order.
 */
#include "cpu/layout.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* calloc of n elements with the size checked for overflow; never returns NULL for n = 0 (a rank
 * with T = 0 still gets a valid, empty array, so NULL always means "not allocated"). */
static void *layout_calloc(int64_t n, size_t size) {
  if (n < 0 || (uint64_t)n > SIZE_MAX / size) return NULL;
  return calloc(n > 0 ? (size_t)n : 1, size);
}

/* a + b into *out; 0 on int64 overflow. */
static int layout_add(int64_t a, int64_t b, int64_t *out) {
  if (b > 0 && a > INT64_MAX - b) return 0;
  *out = a + b;
  return 1;
}

static void layout_msg(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void layout_msg(char *err, size_t errlen, const char *fmt, ...) {
  if (!err || errlen == 0) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

void mok_layout_free(mok_layout_t *l) {
  if (!l) return;
  for (int s = 0; s < l->W; s++) {
    if (l->slot_row) free(l->slot_row[s]);
    if (l->row_from) free(l->row_from[s]);
    if (l->token_pos) free(l->token_pos[s]);
    if (l->recv_from) free(l->recv_from[s]);
  }
  free(l->T);
  free(l->count);
  free(l->expert_rows);
  free(l->expert_start);
  free(l->rank_rows);
  free(l->slot_row);
  free(l->row_from);
  free(l->recv_tokens);
  free(l->token_pos);
  free(l->recv_from);
  memset(l, 0, sizeof *l);
}

/* Step 1 for one rank: checks every id of rank s and counts its rows per expert. seen_row and
 * seen_slot ([E]) remember the last row (a running index over all ranks' tokens) and slot that
 * used each expert, which finds a duplicate in O(K) per row. */
static mokResult_t layout_count_rank(mok_layout_t *l, int s, const int32_t *idx, int64_t *row_id,
                                     int64_t *seen_row, int64_t *seen_slot, char *err,
                                     size_t errlen) {
  const int64_t E = l->E, K = l->K;
  for (int64_t t = 0; t < l->T[s]; t++, (*row_id)++) {
    for (int64_t k = 0; k < K; k++) {
      int32_t e = idx[t * K + k];
      if (e == -1) continue;
      if (e < -1 || e >= E) {
        layout_msg(err, errlen, "rank %d token %lld slot %lld: expert id %d is outside [-1, %lld)",
                   s, (long long)t, (long long)k, (int)e, (long long)E);
        return MOK_ERROR_INVALID_ROUTING;
      }
      if (seen_row[e] == *row_id) {
        layout_msg(err, errlen,
                   "rank %d token %lld slot %lld: expert id %d already routed by slot %lld of "
                   "the same token",
                   s, (long long)t, (long long)k, (int)e, (long long)seen_slot[e]);
        return MOK_ERROR_INVALID_ROUTING;
      }
      seen_row[e] = *row_id;
      seen_slot[e] = k;
      l->count[(int64_t)s * E + e]++;
    }
  }
  return MOK_SUCCESS;
}

/* Argument checks that need no routing data; the detail goes to err. */
static mokResult_t layout_check_args(int W, int64_t E, int64_t K, int64_t tile_m, const int64_t *T,
                                     const int32_t *const *topk_idx, char *err, size_t errlen) {
  if (!T || !topk_idx) {
    layout_msg(err, errlen, "layout: %s is NULL", !T ? "T" : "topk_idx");
    return MOK_ERROR_NULL_POINTER;
  }
  if (W < 1 || E < 1 || E % W != 0 || K < 1 || K > INT32_MAX || tile_m < 1) {
    layout_msg(err, errlen,
               "layout: W %d, E %lld, K %lld, tile_m %lld: need W >= 1, E >= 1, E %% W == 0, "
               "1 <= K < 2^31, tile_m >= 1",
               W, (long long)E, (long long)K, (long long)tile_m);
    return MOK_ERROR_INVALID_VALUE;
  }
  /* All tokens together times 2 * max(K, W) must fit in int64: that bounds every row count,
   * T * K, T * W and the receive buffers' 2 * recv_tokens. */
  int64_t max_total = INT64_MAX / (2 * (K > W ? K : W)), total = 0;
  for (int s = 0; s < W; s++) {
    if (T[s] < 0 || !layout_add(total, T[s], &total) || total > max_total) {
      layout_msg(err, errlen, "layout: rank %d has T = %lld tokens", s, (long long)T[s]);
      return MOK_ERROR_INVALID_VALUE;
    }
    if (T[s] > 0 && !topk_idx[s]) {
      layout_msg(err, errlen, "layout: topk_idx of rank %d is NULL but T = %lld", s,
                 (long long)T[s]);
      return MOK_ERROR_NULL_POINTER;
    }
  }
  return MOK_SUCCESS;
}

/* Step 2: segment starts and padded rank sizes. Fails only on int64 overflow of a row count. */
static int layout_place_segments(mok_layout_t *l) {
  for (int r = 0; r < l->W; r++) {
    int64_t cursor = 0;
    for (int64_t e = r * l->EL; e < (r + 1) * l->EL; e++) {
      l->expert_start[e] = cursor;
      int64_t pad = (l->tile_m - l->expert_rows[e] % l->tile_m) % l->tile_m;
      if (!layout_add(cursor, l->expert_rows[e], &cursor) || !layout_add(cursor, pad, &cursor)) {
        return 0;
      }
    }
    l->rank_rows[r] = cursor;
  }
  return 1;
}

mokResult_t mok_layout_build(mok_layout_t *l, int W, int64_t E, int64_t K, int64_t tile_m,
                             const int64_t *T, const int32_t *const *topk_idx, char *err,
                             size_t errlen) {
  if (err && errlen > 0) err[0] = '\0';
  if (!l) {
    layout_msg(err, errlen, "layout: l is NULL");
    return MOK_ERROR_NULL_POINTER;
  }
  memset(l, 0, sizeof *l);
  mokResult_t res = layout_check_args(W, E, K, tile_m, T, topk_idx, err, errlen);
  if (res != MOK_SUCCESS) return res;

  int64_t *seen_row = NULL, *seen_slot = NULL, *fill = NULL;
  res = MOK_ERROR_OUT_OF_MEMORY;
  l->W = W;
  l->E = E;
  l->EL = E / W;
  l->K = K;
  l->tile_m = tile_m;
  /* The per-rank pointer arrays come first and zeroed, so mok_layout_free can walk them at any
   * point of a failed build. */
  if (!(l->T = layout_calloc(W, sizeof *l->T)) ||
      !(l->count = layout_calloc((int64_t)W * E, sizeof *l->count)) ||
      !(l->expert_rows = layout_calloc(E, sizeof *l->expert_rows)) ||
      !(l->expert_start = layout_calloc(E, sizeof *l->expert_start)) ||
      !(l->rank_rows = layout_calloc(W, sizeof *l->rank_rows)) ||
      !(l->slot_row = layout_calloc(W, sizeof *l->slot_row)) ||
      !(l->row_from = layout_calloc(W, sizeof *l->row_from)) ||
      !(l->recv_tokens = layout_calloc(W, sizeof *l->recv_tokens)) ||
      !(l->token_pos = layout_calloc(W, sizeof *l->token_pos)) ||
      !(l->recv_from = layout_calloc(W, sizeof *l->recv_from)) ||
      !(seen_row = layout_calloc(E, sizeof *seen_row)) ||
      !(seen_slot = layout_calloc(E, sizeof *seen_slot)) ||
      !(fill = layout_calloc(E, sizeof *fill))) {
    layout_msg(err, errlen, "layout: out of host memory");
    goto fail;
  }
  memcpy(l->T, T, (size_t)W * sizeof *T);

  /* 1. Validate and count. */
  for (int64_t e = 0; e < E; e++) seen_row[e] = -1;
  int64_t row_id = 0;
  for (int s = 0; s < W; s++) {
    res = layout_count_rank(l, s, topk_idx[s], &row_id, seen_row, seen_slot, err, errlen);
    if (res != MOK_SUCCESS) goto fail;
  }
  for (int64_t e = 0; e < E; e++) {
    for (int s = 0; s < W; s++) l->expert_rows[e] += l->count[(int64_t)s * E + e];
  }

  /* 2. Segments. */
  res = MOK_ERROR_INVALID_VALUE;
  if (!layout_place_segments(l)) {
    layout_msg(err, errlen, "layout: padded row count overflows int64 (tile_m %lld)",
               (long long)tile_m);
    goto fail;
  }

  /* 3. Rows: visiting (source, token, slot) in order and taking the next free row of the slot's
   * expert orders every segment by (source, token, slot). Rows never handed out stay padding. */
  res = MOK_ERROR_OUT_OF_MEMORY;
  for (int s = 0; s < W; s++) {
    if (!(l->slot_row[s] = layout_calloc(T[s] * K, sizeof *l->slot_row[s])) ||
        !(l->row_from[s] = layout_calloc(l->rank_rows[s], sizeof *l->row_from[s])) ||
        !(l->token_pos[s] = layout_calloc(T[s] * W, sizeof *l->token_pos[s]))) {
      layout_msg(err, errlen, "layout: out of host memory");
      goto fail;
    }
    for (int64_t i = 0; i < l->rank_rows[s]; i++) {
      l->row_from[s][i] = (mok_row_origin_t){.src = -1, .slot = -1, .token = -1};
    }
  }
  memcpy(fill, l->expert_start, (size_t)E * sizeof *fill);
  for (int s = 0; s < W; s++) {
    for (int64_t t = 0; t < T[s]; t++) {
      for (int64_t k = 0; k < K; k++) {
        int32_t e = topk_idx[s][t * K + k];
        if (e < 0) {
          l->slot_row[s][t * K + k] = -1;
          continue;
        }
        int64_t row = fill[e]++;
        l->slot_row[s][t * K + k] = row;
        l->row_from[e / l->EL][row] = (mok_row_origin_t){.src = s, .slot = (int32_t)k, .token = t};
      }
    }
  }

  /* 4. Token dispatch: a token goes to rank d once if any of its slots routes there; visiting
   * (source, token) in order gives each receive buffer its (source, token) order. */
  for (int s = 0; s < W; s++) {
    for (int64_t t = 0; t < T[s]; t++) {
      int64_t *pos = l->token_pos[s] + t * W;
      for (int d = 0; d < W; d++) pos[d] = -1;
      for (int64_t k = 0; k < K; k++) {
        int32_t e = topk_idx[s][t * K + k];
        if (e < 0) continue;
        int64_t d = e / l->EL;
        if (pos[d] < 0) pos[d] = l->recv_tokens[d]++;
      }
    }
  }
  for (int d = 0; d < W; d++) {
    if (!(l->recv_from[d] = layout_calloc(l->recv_tokens[d] * 2, sizeof *l->recv_from[d]))) {
      layout_msg(err, errlen, "layout: out of host memory");
      goto fail;
    }
  }
  for (int s = 0; s < W; s++) {
    for (int64_t t = 0; t < T[s]; t++) {
      for (int d = 0; d < W; d++) {
        int64_t p = l->token_pos[s][t * W + d];
        if (p < 0) continue;
        l->recv_from[d][2 * p] = s;
        l->recv_from[d][2 * p + 1] = t;
      }
    }
  }
  free(seen_row);
  free(seen_slot);
  free(fill);
  return MOK_SUCCESS;

fail:
  free(seen_row);
  free(seen_slot);
  free(fill);
  mok_layout_free(l);
  return res;
}
