/*
 * forward/fused_tile.cuh: one task of the fused forward as both warp roles see it (fk_describe), and
 * the bounded wait on a task counter that every dependency goes through.
 */
#ifndef MOK_CUDA_FORWARD_FUSED_TILE_CUH
#define MOK_CUDA_FORWARD_FUSED_TILE_CUH

#include "common/task_plan.h"
#include "cuda/error_word.cuh"
#include "cuda/forward/fused_params.cuh"
#include "cuda/ptx/ptx.cuh"
#include "cuda/tile/counters.cuh"
// One tile task, as both roles see it (written once, so producer and consumers cannot disagree).
typedef struct {
  int kind;
  int k_blocks;
  int64_t row0, row_end;  // rows of A and C: [row0, min(row0 + 128, row_end)) are stored
  int n0, n;              // first output column; output columns (the row length of C)
  const CUtensorMap *a;   // NULL: GATE_UP, rows gathered from x
  const CUtensorMap *b_lo, *b_hi;
  int b_row_lo, b_row_hi;
  int wait;               // counter to wait on before loading A (-1: none)
  uint32_t wait_target;
  int done;               // counter released when the tile is stored
} fk_tile_t;

__device__ __forceinline__ fk_tile_t fk_describe(const fk_params_t &p, const fk_maps_t &m,
                                                 const mok_task_plan_t &plan,
                                                 const int32_t *s_off, mok_task_t t) {
  fk_tile_t d;
  d.kind = t.kind;
  d.wait = -1;
  d.wait_target = 0;
  if (t.kind == MOK_TASK_GATE_UP || t.kind == MOK_TASK_DOWN) {
    const int e = t.expert;
    d.row0 = s_off[e] + (int64_t)FK_BM * t.m;
    d.row_end = s_off[e + 1];
    const int tile = MOK_FC_GU + plan.mt_pre[e] + t.m;
    if (t.kind == MOK_TASK_GATE_UP) {
      d.n0 = 128 * t.n, d.n = (int)p.I, d.k_blocks = (int)(p.H / 64);
      d.a = NULL;  // rows gathered from x (fk_gather)
      d.b_lo = &m.wg, d.b_hi = &m.wu;
      d.b_row_lo = d.b_row_hi = e * (int)p.I + d.n0;  // gate and up rows of the same columns
      d.done = tile;
    } else {
      d.n0 = FK_BN * t.n, d.n = (int)p.H, d.k_blocks = (int)(p.I / 64);
      d.a = &m.a;
      d.b_lo = d.b_hi = &m.wd;
      d.b_row_lo = e * (int)p.H + d.n0, d.b_row_hi = d.b_row_lo + 128;
      d.wait = tile, d.wait_target = 2u * (uint32_t)plan.n_gu;
      d.done = (int)p.dn_base + e;
    }
  } else {  // the shared expert: one group of all T tokens
    d.row0 = (int64_t)FK_BM * t.m;
    d.row_end = p.T;
    if (t.kind == MOK_TASK_SHARED_GATE_UP) {
      d.n0 = 128 * t.n, d.n = (int)p.Is, d.k_blocks = (int)(p.H / 64);
      d.a = &m.x;
      d.b_lo = &m.wsg, d.b_hi = &m.wsu;
      d.b_row_lo = d.b_row_hi = d.n0;
      d.done = (int)p.sgu_base + t.m;
    } else {
      d.n0 = FK_BN * t.n, d.n = (int)p.H, d.k_blocks = (int)(p.Is / 64);
      d.a = &m.as;
      d.b_lo = d.b_hi = &m.wsd;
      d.b_row_lo = d.n0, d.b_row_hi = d.n0 + 128;
      d.wait = (int)p.sgu_base + t.m, d.wait_target = 2u * (uint32_t)plan.n_sgu;
      d.done = (int)p.sd_base + t.m;
    }
  }
  return d;
}

// Waits until counter `c` reaches `target` (tile/counters.cuh's bounded wait).
// sleep_ns: between polls. The reduce's claims use 1000: they wait long (a band of shared-expert
// tiles), from up to ~400 warps at once, on few counters; with 64 ns between polls DeepSeek-V3's
// forward was 2.6-3.5% slower (docs/performance.md, "Fused forward: reduce helpers").
__device__ __forceinline__ void fk_wait(const fk_params_t &p, int c, uint32_t target, int64_t task,
                                        uint32_t sleep_ns = 64) {
  tile_wait(p.counters, c, target, task, p.timeout_ns, p.err, sleep_ns);
}

#endif /* MOK_CUDA_FORWARD_FUSED_TILE_CUH */
