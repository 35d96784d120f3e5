/*
 * forward/fused_producer.cuh: the fused forward's producer warpgroup: a task's stages into the ring, by
 * TMA, or (GATE_UP) gathered from the tokens' rows of x by cp.async, each task's first stage
 * tagged with the task for the consumers.
 */
#ifndef MOK_CUDA_FORWARD_FUSED_PRODUCER_CUH
#define MOK_CUDA_FORWARD_FUSED_PRODUCER_CUH

#include "cuda/forward/fused_tile.cuh"

// A stage's tag: the task number and the task itself, decoded once by the producer for both
// sides (decoded by the consumers too, between the stage's arrival and their first wgmma, the
// fused forward was 2-8% slower: docs/performance.md, "Fused forward: task decoding"). Thread 0
// of the producer, before its first arrival on the stage's full barrier.
// NOTE (memory ordering, and why compute-sanitizer's racecheck reports these accesses): the tag
// is written after thread 0's wait on the stage's empty barrier completed and before its
// mbarrier.arrive on the full barrier; consumers read it (fk_peek, fk_task) after their
// mbarrier.try_wait on the full barrier succeeded, and release the stage (arrive on empty) only
// after those reads. mbarrier.arrive has release and try_wait acquire semantics at CTA scope
// (PTX ISA, "mbarrier"), so each write happens before the reads of the same phase and each read
// before the next phase's write. racecheck orders shared-memory accesses only by bar.sync /
// __syncthreads, not by mbarriers: on the small fused forward and backward tests (build/mok_tests
// fwd_gpu_matches_cpu_small, bwd_gpu_matches_cpu_small) every hazard it reports in this kernel
// is a pair of this write and those reads; synccheck and initcheck report nothing.
__device__ __forceinline__ void fk_tag(volatile int64_t *s_tag, volatile int4 *s_task, int stage,
                                       int64_t tag, const mok_task_t &t) {
  s_tag[stage] = tag;
  s_task[stage].x = t.kind;
  s_task[stage].y = t.expert;
  s_task[stage].z = t.m;
  s_task[stage].w = t.n;
}

// The task posted with the tag of the stage at the ring's position (after fk_peek).
__device__ __forceinline__ mok_task_t fk_task(const tp_ring_t *ring, const volatile int4 *s_task) {
  mok_task_t t;
  t.kind = s_task[ring->stage].x;
  t.expert = s_task[ring->stage].y;
  t.m = s_task[ring->stage].z;
  t.n = s_task[ring->stage].w;
  return t;
}

// GATE_UP's stages, loaded by G producer warps (4, or 2 once warps 2-3 reduce): B by TMA (thread
// 0), A gathered. Per stage each tile row is 128 bytes (8 units of 16) of a token's row of x; unit
// c of tile row r goes to unit c ^ (r % 8) (the 128-byte swizzle; rows are 128 bytes and the stage
// is 1024-byte aligned). Thread lt = 32 w + l copies unit l % 8 of rows 4 J w + 4 j + l / 8,
// j < J = 32 / G, so that each warp instruction reads 4 whole 128-byte lines. Rows past the
// expert's end are zeros: nothing of them is stored. G is a template argument so that the J row
// addresses stay in registers (with one warp, 32 per thread and G at run time, they were rebuilt
// from constants per copy and GATE_UP's mainloop ran at half speed; docs/performance.md, "Fused forward: gather").
template <int G>
__device__ __forceinline__ void fk_gather(const fk_params_t &p, const fk_tile_t &d, tp_ring_t *ring,
                                          uint8_t *smem, uint64_t *full, uint64_t *empty,
                                          volatile int64_t *s_tag, volatile int4 *s_task,
                                          int64_t tag, const mok_task_t &task, int lt) {
  static_assert(G == 2 || G == 4, "rows per thread: 32 / G");
  constexpr int J = 32 / G;
  const int w = lt >> 5, c = lt & 7, r0 = 4 * J * w + ((lt & 31) >> 3);
  const char *src[J];
  uint32_t bytes[J];
#pragma unroll
  for (int j = 0; j < J; j++) {
    const int64_t row = d.row0 + r0 + 4 * j;
    const bool valid = row < d.row_end;
    // W = 1: the row's token of x. Expert parallel: a received token (v >= 0) or one of this
    // rank's (-(t + 1)), written by the dispatch of other ranks' kernels: read at L2.
    const int32_t v = valid ? __ldcg(p.row_tok + row) : 0;
    const bool recv = p.recv_x && v >= 0;
    const int64_t r = recv || !p.recv_x ? v : -(int64_t)v - 1;
    src[j] = (const char *)(recv ? p.recv_x : p.x) + r * p.H * 2 + 16 * c;
    bytes[j] = valid ? 16u : 0u;
  }
  for (int kb = 0; kb < d.k_blocks; kb++) {
    ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
    uint8_t *a_tile = smem + ring->stage * fk_plan::STAGE_BYTES;
    uint64_t *bar = &full[ring->stage];
    if (lt == 0) {
      if (kb == 0) fk_tag(s_tag, s_task, ring->stage, tag, task);
      uint8_t *b_tile = a_tile + fk_plan::A_BYTES;
      ptx_mbar_arrive_expect_tx(bar, fk_plan::B_BYTES);
      ptx_tma_load_2d(b_tile, d.b_lo, bar, kb * 64, d.b_row_lo);
      ptx_tma_load_2d(b_tile + 128 * MOK_TP_ROW_BYTES, d.b_hi, bar, kb * 64, d.b_row_hi);
      if (G < 4) ptx_mbar_arrive_count(bar, 32 * (4 - G));  // for the warps that reduce
    }
#pragma unroll
    for (int j = 0; j < J; j++) {
      const int r = r0 + 4 * j;
      ptx_cp_async_16(a_tile + r * MOK_TP_ROW_BYTES + ((c ^ (r & 7)) << 4),
                      src[j] + kb * MOK_TP_ROW_BYTES, bytes[j]);
    }
    ptx_cp_async_mbar_arrive_noinc(bar);
    tp_ring_advance<FK_STAGES>(ring);
  }
}

// The producer warps' share of one tile: k_blocks stages, the first tagged with the task number
// and the task (fk_tag, read by the consumers). lt: thread within the warpgroup (below 32 once
// warp 0 is alone: then the tile is not a GATE_UP, which fk_gather loads).
__device__ __forceinline__ void fk_produce(const fk_params_t &p, const fk_tile_t &d, tp_ring_t *ring,
                                           uint8_t *smem, uint64_t *full, uint64_t *empty,
                                           volatile int64_t *s_tag, volatile int4 *s_task,
                                           int64_t tag, const mok_task_t &task, int lt,
                                           int gwarps) {
  // NOTE: thread 0 writes the tag after the stage is free (a consumer may not have read the tag
  // of its previous use before) and before its first arrival on the stage's full barrier (a
  // release), so a consumer that saw the phase complete (acquire) reads it.
  if (d.a) {
    for (int kb = 0; kb < d.k_blocks; kb++) {
      ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
      uint64_t *bar = &full[ring->stage];
      if (lt == 0) {
        if (kb == 0) fk_tag(s_tag, s_task, ring->stage, tag, task);
        uint8_t *a_tile = smem + ring->stage * fk_plan::STAGE_BYTES;
        uint8_t *b_tile = a_tile + fk_plan::A_BYTES;
        ptx_mbar_arrive_expect_tx(bar, fk_plan::STAGE_BYTES);
        ptx_tma_load_2d(a_tile, d.a, bar, kb * 64, (int)d.row0);
        ptx_tma_load_2d(b_tile, d.b_lo, bar, kb * 64, d.b_row_lo);
        ptx_tma_load_2d(b_tile + 128 * MOK_TP_ROW_BYTES, d.b_hi, bar, kb * 64, d.b_row_hi);
        ptx_mbar_arrive_count(bar, 128);  // for the whole warpgroup, which may be warp 0 alone
      }
      tp_ring_advance<FK_STAGES>(ring);
    }
    return;
  }
  if (gwarps == 2) fk_gather<2>(p, d, ring, smem, full, empty, s_tag, s_task, tag, task, lt);
  else fk_gather<4>(p, d, ring, smem, full, empty, s_tag, s_task, tag, task, lt);
}

// A stage without data that only carries a tag to the consumers: a REDUCE task's number, or
// FK_TAG_END. Thread 0 arrives for all (FK_FULL_ARRIVALS), as on a TMA stage.
__device__ __forceinline__ void fk_post(tp_ring_t *ring, uint64_t *full, uint64_t *empty,
                                        volatile int64_t *s_tag, volatile int4 *s_task,
                                        int64_t tag, const mok_task_t &task, int lt) {
  if (lt == 0) {
    ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
    fk_tag(s_tag, s_task, ring->stage, tag, task);
    ptx_mbar_arrive_count(&full[ring->stage], FK_FULL_ARRIVALS);
  }
  tp_ring_advance<FK_STAGES>(ring);
}

#endif /* MOK_CUDA_FORWARD_FUSED_PRODUCER_CUH */
