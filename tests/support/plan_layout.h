/*
 * plan_layout.h: what the task-plan tests (tests/test_task_plan.c, test_task_plan_bwd.c) share: a
 * skewed random routing turned into src/cpu/layout.c's layout, the row tiles of each expert, and
 * the token blocks a row tile touches. Plain C11, header-only, static.
 */
#ifndef MOK_TESTS_SUPPORT_PLAN_LAYOUT_H
#define MOK_TESTS_SUPPORT_PLAN_LAYOUT_H

#include <stdint.h>
#include <stdlib.h>

#include "cpu/layout.h"
#include "rng.h"

/* The layout of a random routing of T tokens over E experts, K distinct or -1 per token, skewed:
 * expert 0 takes about a third of the rows, about 1 slot in 11 is empty, and with `skip_last`
 * (E > 3) expert E - 1 never gets a row. mt_pre [E + 1]: prefix sums of row tiles of bm rows.
 * 1, or 0 when the layout failed. The random stream does not depend on skip_last. */
static inline int plan_layout_random(mok_layout_t *lay, int32_t *mt_pre, uint64_t seed, int64_t T,
                                     int32_t E, int64_t K, int skip_last, int64_t bm) {
  test_rng_t s = test_rng(seed);
  int32_t *idx = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
  if (!idx) return 0;
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k < K; k++) {
      int32_t e;
      int dup;
      do {
        const uint64_t r = test_rng_u64(&s);
        e = r % 3 == 0 ? 0 : (int32_t)((r >> 8) % (uint64_t)E);
        if (skip_last && E > 3 && e == E - 1) e = 1;
        if ((r >> 20) % 11 == 0) e = -1;
        dup = 0;
        for (int64_t j = 0; j < k; j++) dup |= e >= 0 && idx[t * K + j] == e;
      } while (dup);
      idx[t * K + k] = e;
    }
  const int32_t *rows[1] = {idx};
  const int ok = mok_layout_build(lay, 1, E, K, 1, &T, rows, NULL, 0) == MOK_SUCCESS;
  free(idx);
  if (!ok) return 0;
  mt_pre[0] = 0;
  for (int32_t e = 0; e < E; e++)
    mt_pre[e + 1] = mt_pre[e] + (int32_t)((lay->expert_rows[e] + bm - 1) / bm);
  return 1;
}

/* Rows of expert e's row tile m (tiles of bm rows). */
static inline int64_t plan_tile_rows(const mok_layout_t *lay, int32_t e, int32_t m, int64_t bm) {
  const int64_t rows = lay->expert_rows[e] - (int64_t)m * bm;
  return rows < bm ? rows : bm;
}

/* Token of row r of expert e's row tile m. */
static inline int64_t plan_row_token(const mok_layout_t *lay, int32_t e, int32_t m, int64_t r,
                                     int64_t bm) {
  return lay->row_from[0][lay->expert_start[e] + (int64_t)m * bm + r].token;
}

/* Calls f(arg, block) once for each token block of bm tokens that the rows of expert e's row tile
 * m touch, as a kernel's epilogue would: rows are sorted by token, so blocks come in runs. */
static inline void plan_for_each_block(const mok_layout_t *lay, int32_t e, int32_t m, int64_t bm,
                                       void (*f)(void *, int64_t), void *arg) {
  int64_t last = -1;
  for (int64_t r = 0; r < plan_tile_rows(lay, e, m, bm); r++) {
    const int64_t b = plan_row_token(lay, e, m, r, bm) / bm;
    if (b != last) f(arg, b);
    last = b;
  }
}

#endif /* MOK_TESTS_SUPPORT_PLAN_LAYOUT_H */
