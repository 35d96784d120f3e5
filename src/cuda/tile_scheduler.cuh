/*
 * tile_scheduler.cuh: the persistent tile order of a grouped GEMM whose group sizes exist only in
 * device memory.
 *
 * A unit is CLUSTER row tiles of BM rows stacked (one per CTA of a cluster: they share the B tile)
 * times one column tile. Units are numbered group by group, row unit by row unit, column tile
 * fastest; cluster c takes units c, c + clusters, c + 2 clusters, ..., and CTA rank r of the
 * cluster takes row tile r of each. The producer and the consumer warpgroups each walk this same
 * sequence through gg_sched_next: the loop is written once, so the roles cannot drift apart.
 *
 * There is no table: unit indices only grow, so each walker keeps a cursor (current group, units
 * before it) and reads the offsets of the next group from global memory when it passes one (two
 * L1-resident loads per group per thread over the whole kernel). This keeps shared memory for the
 * ring and puts no limit on G.
 *
 * Offsets are clamped to [0, m_total] and a group whose end is below its start is empty, so a bad
 * offsets array can make results wrong but never makes the kernel touch rows outside [0, m_total).
 * A row tile that starts past its group's end (odd row-tile count, CLUSTER = 2) is still computed,
 * to keep the cluster in step, but none of its rows is stored.
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
  int unit_rows;         // rows per unit: BM x CLUSTER
  int row_offset;        // this CTA's row tile inside a unit: BM x cluster rank
  int bn;                // output columns per tile
  int next, stride;      // next unit this CTA takes; clusters in the grid
  int group;             // cursor: current group (-1 before the first)
  int units_before;      // units of the groups before `group`
  int units;             // units of `group`
  int lo, hi;            // rows [lo, hi) of `group`
} gg_sched_t;

__device__ __forceinline__ int64_t gg_load_offset(const void *offsets, int is64, int g) {
  return is64 ? ((const int64_t *)offsets)[g] : (int64_t)((const int32_t *)offsets)[g];
}

// cluster: CTAs per cluster (1 or 2, along the grid's x), rank: this CTA's rank in it.
__device__ __forceinline__ gg_sched_t gg_sched_init(const void *offsets, int offsets_int64,
                                                    int num_groups, int64_t m_total, int n_tiles,
                                                    int bm, int bn, int cluster, int rank) {
  gg_sched_t s;
  s.offsets = offsets;
  s.offsets_int64 = offsets_int64;
  s.num_groups = num_groups;
  s.m_total = m_total;
  s.n_tiles = n_tiles;
  s.unit_rows = bm * cluster;
  s.row_offset = bm * rank;
  s.bn = bn;
  s.next = blockIdx.x / cluster;
  s.stride = gridDim.x / cluster;
  s.group = -1;
  s.units_before = 0;
  s.units = 0;
  s.lo = s.hi = 0;
  return s;
}

// The next tile of this CTA, or 0 when it has none left (the same answer in every CTA of a cluster).
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
    int64_t lo = gg_load_offset(s->offsets, s->offsets_int64, s->group);
    int64_t hi = gg_load_offset(s->offsets, s->offsets_int64, s->group + 1);
    lo = lo < 0 ? 0 : (lo > s->m_total ? s->m_total : lo);
    hi = hi < lo ? lo : (hi > s->m_total ? s->m_total : hi);
    s->lo = (int)lo;
    s->hi = (int)hi;
    s->units = (int)((hi - lo + s->unit_rows - 1) / s->unit_rows) * s->n_tiles;
  }
  s->next += s->stride;
  const int local = idx - s->units_before;
  const int m_blk = local / s->n_tiles;
  const int n_blk = local - m_blk * s->n_tiles;
  t->group = s->group;
  t->row0 = s->lo + m_blk * s->unit_rows + s->row_offset;
  t->row_end = s->hi;
  t->n0 = n_blk * s->bn;
  return 1;
}

#endif /* MOK_CUDA_TILE_SCHEDULER_CUH */
