/*
 * forward/fused_consumer.cuh: the fused forward's consumer warpgroups after their mainloop: reading a
 * stage's tag, the epilogue of each task (SwiGLU and the router weight; staged TMA stores), and
 * the releases of the task counters, some deferred under the next tile's MMA.
 */
#ifndef MOK_CUDA_FORWARD_FUSED_CONSUMER_CUH
#define MOK_CUDA_FORWARD_FUSED_CONSUMER_CUH

#include <cuda_bf16.h>

#include "cuda/forward/fused_tile.cuh"
#include "cuda/tile/epilogue.cuh"
// Consumer side: waits for the stage at the ring's position and returns its tag (the stage is not
// consumed: a data stage's tile is then read by tp_consume_tile_bf16_n256 from this position).
__device__ __forceinline__ int64_t fk_peek(const tp_ring_t *ring, uint64_t *full,
                                           volatile int64_t *s_tag) {
  ptx_mbar_wait(&full[ring->stage], ring->phase);
  return s_tag[ring->stage];
}

// Consumer side: releases a tag-only stage (lane 0 of each consumer warp, as for data stages).
__device__ __forceinline__ void fk_skip(tp_ring_t *ring, uint64_t *empty) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) ptx_mbar_arrive(&empty[ring->stage]);
  tp_ring_advance<FK_STAGES>(ring);
}

// Consumer warpgroup cw adds `count` to counter `c` once all 128 threads' stores are done.
// PENDING >= 0: some stores went through the async proxy (TMA bulk stores, issued by thread lt 0),
// which that thread waits for, all but its PENDING most recent bulk groups (those hold data that
// no waiter of `c` reads), and fences against the generic release.
// NOTE: bar.sync counts whole warps, so each warp reconverges first (the stores branch per lane);
// likewise after the one-lane release, before the next tile's wgmma (.aligned).
// fk_release_by: thread lt 0's part, for fk_release and for a deferred release.
template <int PENDING>
__device__ __forceinline__ void fk_release_by(uint32_t *ctr, uint32_t count) {
  if (PENDING >= 0) {
    ptx_bulk_wait_group<PENDING < 0 ? 0 : PENDING>();
    ptx_fence_proxy_async_global();
  }
  __threadfence();
  if (count) ptx_red_release_gpu_add(ctr, count);
}
template <int PENDING>
__device__ __forceinline__ void fk_release(const fk_params_t &p, int c, uint32_t count, int cw,
                                           int lt) {
  __syncwarp();
  ptx_named_barrier_sync(MOK_BAR_FUSED_EPI + cw, 128);
  if (lt == 0) fk_release_by<PENDING>(p.counters + c, count);
  __syncwarp();
}

// A (SHARED_)GATE_UP tile's release left for later (fk_epilogue): thread lt 0 of the warpgroup
// waits until a's bulk group is complete (all but its g and u groups), fences and adds 1 to
// counter c. Only that thread's bulk stores wrote the tile, so no other thread takes part.
// Deferred, it runs once the next tile's first wgmmas are issued, so its wait on the stores and
// its fences overlap the MMA instead of the tensor cores waiting for them (1.1-1.2 us per
// GATE_UP tile on the H200).
// NOTE (deadlock freedom): the consumers defer it only past issuing the first stage of a tile
// whose stage is already full, which waits on nothing; before a REDUCE or the end, or when the
// next stage is not there yet (it may wait on this very counter), they release at once. The
// task-plan simulator checks this rule, and that deferring regardless of the next stage
// deadlocks (tests/test_task_plan.c, task_plan_deferred_releases_never_deadlock).
__device__ __forceinline__ void fk_release_deferred_now(uint32_t *ctr, int lt) {
  if (ctr && lt == 0) fk_release_by<2>(ctr, 1u);  // a's group: all but g's and u's complete
}
// As tp_consume_tile_bf16_n256's hook, for every thread of the warpgroup.
struct fk_deferred_release {
  uint32_t *ctr;  // NULL: nothing pending
  int lt;
  __device__ __forceinline__ void operator()() const {
    fk_release_deferred_now(ctr, lt);
    __syncwarp();  // warp 0 converged again before its next wgmma (.aligned)
  }
};

// A DOWN tile stored whole through TMA is released one tile later, once the warpgroup has issued
// the last stage of its next tile (or before it reduces), when its bulk stores have long
// completed and the wait and fences run under that stage's MMA: only the reduce waits for DN, so
// the release can wait. Waiting for the stores right after them, or under the next tile's first
// wgmmas as GATE_UP's release does, left the consumers idle ~1 us per DOWN tile, and at the start
// of the next epilogue the fences made it ~0.7 us longer (docs/performance.md, "Fused forward: deferred releases"). s_dpend[cw]: the
// counter + 1, 0 when none is pending.
__shared__ uint32_t s_dpend[2];
__device__ __forceinline__ void fk_flush_down(const fk_params_t &p, int cw, int lt) {
  if (lt == 0 && s_dpend[cw]) {
    fk_release_by<0>(p.counters + (s_dpend[cw] - 1u), 1u);
    s_dpend[cw] = 0;
  }
}
// As tp_consume_tile_bf16_n256's after_last hook.
struct fk_down_flush {
  const fk_params_t &p;
  int cw, lt;
  __device__ __forceinline__ void operator()() const {
    fk_flush_down(p, cw, lt);
    __syncwarp();  // warp 0 converged again before its next wgmma (.aligned)
  }
};

// The epilogue of one tile for consumer warpgroup cw, then its release of the tile's counter,
// or, for a GATE_UP tile stored whole through TMA with g and u, the counter to release later
// (fk_deferred_release; NULL: released).
template <int STAGED>
__device__ __forceinline__ uint32_t *fk_epilogue(const fk_params_t &p, const fk_maps_t &m,
                                                 const fk_tile_t &d, const float (&acc)[128],
                                                 float2 w, uint8_t *stage_c, int cw, int lt) {
  const epi_coords_t e = epi_coords(d.row0, d.row_end, d.n0, d.n, d.n, cw);
  const int bar = MOK_BAR_FUSED_EPI + cw;
  if (d.kind == MOK_TASK_DOWN) {
    const int64_t row0 = d.row0 + 64 * cw;
    if (STAGED && row0 + 64 <= d.row_end) {  // all 64 rows in the expert: 2 rounds of 128 columns
      epi_store_staged_bf16<0, 0>(acc, stage_c, &m.yk, d.n0, d.n, (int)row0, bar, lt);
      epi_store_staged_bf16<1, 0>(acc, stage_c, &m.yk, d.n0, d.n, (int)row0, bar, lt);
      if (p.by_last && lt == 0) s_dpend[cw] = (uint32_t)d.done + 1u;  // fk_flush_down
    } else {
      epi_store_bf16<128>(acc, (__nv_bfloat16 *)p.yk, e);
      if (p.by_last) fk_release<-1>(p, d.done, 1u, cw, lt);
    }
    return NULL;  // without by_last, the consumer loop counts the tile (MOK_FC_DOWN)
  }
  if (d.kind == MOK_TASK_GATE_UP || d.kind == MOK_TASK_SHARED_GATE_UP) {
    const bool sh = d.kind == MOK_TASK_SHARED_GATE_UP;
    __nv_bfloat16 *a_out = (__nv_bfloat16 *)(sh ? p.as : p.a);
    __nv_bfloat16 *g_out = (__nv_bfloat16 *)(sh ? p.gs_out : p.g_out);
    __nv_bfloat16 *u_out = (__nv_bfloat16 *)(sh ? p.us_out : p.u_out);
    const int64_t row0 = d.row0 + 64 * cw;
    if (STAGED && row0 + 64 <= d.row_end) {
      // a first: the release below (which DOWN waits for) waits only for its bulk group, while g
      // and u (only the backward reads them) drain under the next tile.
      epi_store_staged<0, 1, 0>(acc, stage_c, sh ? &m.as_st : &m.a_st, w, d.n0, d.n, (int)row0,
                                bar, lt);
      if (g_out && u_out) {
        epi_store_staged<0, 0, 0>(acc, stage_c, sh ? &m.gs : &m.g, w, d.n0, d.n, (int)row0, bar,
                                  lt);
        epi_store_staged<16, 0, 0>(acc, stage_c, sh ? &m.us : &m.u, w, d.n0, d.n, (int)row0, bar,
                                   lt);
        return p.counters + d.done;  // fk_deferred_release
      } else {
        fk_release<0>(p, d.done, 1u, cw, lt);
      }
      return NULL;
    }
    epi_store_swiglu<128>(acc, a_out, g_out, u_out, w, e);
  } else {
    epi_store_f32<128, false>(acc, (float *)p.ys, e);
  }
  fk_release<-1>(p, d.done, 1u, cw, lt);
  return NULL;
}

#endif /* MOK_CUDA_FORWARD_FUSED_CONSUMER_CUH */
