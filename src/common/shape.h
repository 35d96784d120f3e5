/*
 * shape.h: the shape rules of a GPU layer's kernels, in one place: a GPU layer checks them when
 * it is created (for T_max tokens and its capacity), and every launcher that takes a layer's
 * shape checks its call's shape with the same function, so the two can never disagree. Host
 * code only (the launchers run on the host), plain C.
 */
#ifndef MOK_COMMON_SHAPE_H
#define MOK_COMMON_SHAPE_H

#include <stdint.h>
#include <stdio.h>

#include "common/limits.h"
#include "mok.h"

typedef struct {
  int64_t T;  /* tokens of the call (T_max at create) */
  int64_t H, I, Is;
  int64_t E;  /* local experts */
  int64_t K;
  int64_t R;  /* rows of the routed buffers (the layer's capacity) */
} mok_shape_t;

/* Row tiles of the kernels (the layout's row tile, MOK_FC_TILE_M) and the forward's output
 * column tile. */
enum { MOK_SHAPE_TILE_M = 128, MOK_SHAPE_TILE_N = 256 };

/* MOK_SUCCESS, or MOK_ERROR_INVALID_SHAPE with the reason in why[n]. The kernels index rows,
 * weight rows and TMA coordinates in 32 bits and deal their tasks from a 32-bit ticket counter,
 * hence the bounds. */
static inline mokResult_t mok_shape_check(const mok_shape_t *s, char *why, size_t n) {
  const int64_t T = s->T, H = s->H, I = s->I, Is = s->Is, E = s->E, K = s->K, R = s->R;
  if (E < 1 || E > MOK_MAX_EXPERTS || K < 1 || K > MOK_MAX_TOP_K || T < 0 || H < 128 ||
      H % 128 || I < 128 || I % 128 || Is < 0 || Is % 128 || R < 1 || R >= INT32_MAX ||
      T >= INT32_MAX || H >= INT32_MAX / MOK_MAX_EXPERTS || I >= INT32_MAX / MOK_MAX_EXPERTS ||
      Is >= INT32_MAX || E * I >= INT32_MAX || E * H >= INT32_MAX) {
    snprintf(why, n,
             "T = %lld, H = %lld, I = %lld, Is = %lld, E = %lld, K = %lld, R = %lld out of the "
             "GPU kernels' range (H, I, Is multiples of 128; E <= %d, K <= %d; E H, E I, R < 2^31)",
             (long long)T, (long long)H, (long long)I, (long long)Is, (long long)E, (long long)K,
             (long long)R, MOK_MAX_EXPERTS, MOK_MAX_TOP_K);
    return MOK_ERROR_INVALID_SHAPE;
  }
  /* Tasks of the fused forward (src/common/task_plan.h): row tiles over all experts are at most
   * R / 128 + E (one partial per expert); the plan's tile arithmetic divides in 32 bits below
   * 2^31 tiles. */
  const int64_t h_tiles = (H + MOK_SHAPE_TILE_N - 1) / MOK_SHAPE_TILE_N;
  const int64_t t_tiles = (T + MOK_SHAPE_TILE_M - 1) / MOK_SHAPE_TILE_M;
  const int64_t most = (R / MOK_SHAPE_TILE_M + E) * (I / 128 + h_tiles) +
                       t_tiles * (Is / 128 + (Is > 0 ? h_tiles : 0) + 1);
  if (most > INT32_MAX / 2) {
    snprintf(why, n,
             "up to %lld tasks (R = %lld, I = %lld, H = %lld, T = %lld), more than the task "
             "counter deals (2^30)",
             (long long)most, (long long)R, (long long)I, (long long)H, (long long)T);
    return MOK_ERROR_INVALID_SHAPE;
  }
  return MOK_SUCCESS;
}

#endif /* MOK_COMMON_SHAPE_H */
