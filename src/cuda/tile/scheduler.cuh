/*
 * tile/scheduler.cuh: the persistent tile order of a grouped GEMM whose group sizes exist only in
 * device memory.
 *
 * A unit is one row tile of BM rows times one column tile. Units are numbered group by group; within a group, row unit by row unit
 * with the column tile fastest, or (group_m > 0) in bands of group_m row units, column tile by
 * column tile within a band and its row units fastest, so that the units that share a B tile
 * are taken together (what src/common/task_plan.h's mok_plan_tile does for the fused kernel).
 * CTA c takes units c, c + grid, c + 2 grid, ... The producer thread of each CTA walks this sequence through gg_sched_next and
 * posts each tile beside the ring stage that starts it, where the consumer warpgroups read it
 * (grouped_gemm.cu's gg_peek).
 *
 * There is no table: unit indices only grow, so each walker keeps a cursor (current group, units
 * before it) and reads the offsets of the next group from global memory when it passes one (two
 * L1-resident loads per group per thread over the whole kernel). This keeps shared memory for the
 * ring and puts no limit on G.
 *
 * Offsets are clamped to [0, m_total] and a group whose end is below its start is empty, so a bad
 * offsets array can make results wrong but never makes the kernel touch rows outside [0, m_total).
 *
 * The second order below (gw_sched_*) is the k-grouped one of the weight-gradient GEMM, where the
 * groups split the reduction instead of the output rows.
 */
#ifndef MOK_CUDA_TILE_SCHEDULER_CUH
#define MOK_CUDA_TILE_SCHEDULER_CUH

#include <stdint.h>

#define MOK_GG_MAX_GROUPS (1 << 20)

typedef struct {
  int group;    // expert g
  int row0;     // first row of the tile in A and C
  int row_end;  // end of group g's rows: rows >= row_end belong to no output of this tile
  int n0;       // first output column of the tile
} gg_tile_t;

typedef struct {
  const void *offsets;   // [G + 1] int32 or int64, device memory
  int offsets_int64;
  int num_groups;
  int64_t m_total;
  int n_tiles;           // column tiles per group
  int group_m;           // row units per band (0: row unit by row unit)
  int unit_rows;         // rows per unit: BM
  int bn;                // output columns per tile
  int next, stride;      // next unit this CTA takes; CTAs in the grid
  int group;             // cursor: current group (-1 before the first)
  int units_before;      // units of the groups before `group`
  int units;             // units of `group`
  int lo, hi;            // rows [lo, hi) of `group`
} gg_sched_t;

__device__ __forceinline__ int64_t gg_load_offset(const void *offsets, int is64, int g) {
  return is64 ? ((const int64_t *)offsets)[g] : (int64_t)((const int32_t *)offsets)[g];
}

// Rows [lo, hi) of group g, clamped to [0, m_total) (a group ending before its start is empty):
// what both orders below use, so that a bad offsets array never makes a row outside the tensor.
__device__ __forceinline__ void gg_group_rows(const void *offsets, int is64, int g,
                                              int64_t m_total, int *lo_out, int *hi_out) {
  int64_t lo = gg_load_offset(offsets, is64, g);
  int64_t hi = gg_load_offset(offsets, is64, g + 1);
  lo = lo < 0 ? 0 : (lo > m_total ? m_total : lo);
  hi = hi < lo ? lo : (hi > m_total ? m_total : hi);
  *lo_out = (int)lo;
  *hi_out = (int)hi;
}

__device__ __forceinline__ gg_sched_t gg_sched_init(const void *offsets, int offsets_int64,
                                                    int num_groups, int64_t m_total, int n_tiles,
                                                    int group_m, int bm, int bn) {
  gg_sched_t s;
  s.offsets = offsets;
  s.offsets_int64 = offsets_int64;
  s.num_groups = num_groups;
  s.m_total = m_total;
  s.n_tiles = n_tiles;
  s.group_m = group_m;
  s.unit_rows = bm;
  s.bn = bn;
  s.next = blockIdx.x;
  s.stride = gridDim.x;
  s.group = -1;
  s.units_before = 0;
  s.units = 0;
  s.lo = s.hi = 0;
  return s;
}

// The next tile of this CTA, or 0 when it has none left.
__device__ __forceinline__ int gg_sched_next(gg_sched_t *s, gg_tile_t *t) {
  const int idx = s->next;
  while (idx >= s->units_before + s->units) {  // walk forward, skipping empty groups
    if (s->group + 1 >= s->num_groups) {
      s->group = s->num_groups;
      s->units = 0;
      return 0;
    }
    s->units_before += s->units;
    s->group++;
    gg_group_rows(s->offsets, s->offsets_int64, s->group, s->m_total, &s->lo, &s->hi);
    s->units = (int)(((int64_t)s->hi - s->lo + s->unit_rows - 1) / s->unit_rows) * s->n_tiles;
  }
  s->next += s->stride;
  const int local = idx - s->units_before;
  int m_blk, n_blk;
  if (s->group_m > 0) {
    const int mt = s->units / s->n_tiles, per_band = s->group_m * s->n_tiles;
    const int g0 = local / per_band * s->group_m;
    const int gm = mt - g0 < s->group_m ? mt - g0 : s->group_m;
    const int r = local - g0 * s->n_tiles;
    n_blk = r / gm;
    m_blk = g0 + (r - n_blk * gm);
  } else {
    m_blk = local / s->n_tiles;
    n_blk = local - m_blk * s->n_tiles;
  }
  t->group = s->group;
  t->row0 = s->lo + m_blk * s->unit_rows;
  t->row_end = s->hi;
  t->n0 = n_blk * s->bn;
  return 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* k-grouped order (weight gradients)                                                              */
/* ---------------------------------------------------------------------------------------------- */
// The weight-gradient GEMM C[g] [N, K] = A_gᵀ · B_g reduces over the rows of group g, so every
// group has the same output tiles whatever its row count (an empty group still owns its tiles:
// they store zeros). Tile t = (group, row tile of C[g], column tile of C[g]) with the column tile
// fastest; CTA b takes tiles b, b + grid, b + 2 grid, ... Consecutive CTAs thus work on the same
// group at the same time, which keeps A_g and B_g in L2. A tile's reduction runs over all rows of
// its group in order, inside one CTA: one writer and one summation order per output element.

typedef struct {
  int group;    // expert g
  int row0;     // first reduced row (of A and B): offsets[g], clamped
  int rows;     // rows of group g (0: an empty group)
  int c_row0;   // first row of the tile in C[g] (a column of A)
  int c_col0;   // first column of the tile in C[g] (a column of B)
} gw_tile_t;

typedef struct {
  const void *offsets;   // [G + 1] int32 or int64, device memory
  int offsets_int64;
  int64_t m_total;
  int m_tiles, n_tiles;  // row and column tiles of one C[g]
  int bm, bn;            // tile shape in C[g]
  int next, stride, total;
  int group;             // cached group and its rows [lo, hi)
  int lo, hi;
} gw_sched_t;

__device__ __forceinline__ gw_sched_t gw_sched_init(const void *offsets, int offsets_int64,
                                                    int num_groups, int64_t m_total, int m_tiles,
                                                    int n_tiles, int bm, int bn) {
  gw_sched_t s;
  s.offsets = offsets;
  s.offsets_int64 = offsets_int64;
  s.m_total = m_total;
  s.m_tiles = m_tiles;
  s.n_tiles = n_tiles;
  s.bm = bm;
  s.bn = bn;
  s.next = blockIdx.x;
  s.stride = gridDim.x;
  s.total = num_groups * m_tiles * n_tiles;  // < 2^31: checked by the launcher
  s.group = -1;
  s.lo = s.hi = 0;
  return s;
}

// The next tile of this CTA, or 0 when it has none left.
__device__ __forceinline__ int gw_sched_next(gw_sched_t *s, gw_tile_t *t) {
  if (s->next >= s->total) return 0;
  const int idx = s->next;
  s->next += s->stride;
  const int per_group = s->m_tiles * s->n_tiles;
  const int g = idx / per_group;
  const int local = idx - g * per_group;
  const int m_blk = local / s->n_tiles;
  if (g != s->group) {
    gg_group_rows(s->offsets, s->offsets_int64, g, s->m_total, &s->lo, &s->hi);
    s->group = g;
  }
  t->group = g;
  t->row0 = s->lo;
  t->rows = s->hi - s->lo;
  t->c_row0 = m_blk * s->bm;
  t->c_col0 = (local - m_blk * s->n_tiles) * s->bn;
  return 1;
}

#endif /* MOK_CUDA_TILE_SCHEDULER_CUH */
