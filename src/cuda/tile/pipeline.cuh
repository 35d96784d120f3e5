/*
 * tile/pipeline.cuh: the warp-specialized tile pipeline of the Hopper tile engine.
 *
 * One CTA = one producer warpgroup + two consumer warpgroups (384 threads). The producer (one
 * thread) fills a ring of STAGES shared-memory stages with TMA; each stage holds one K block of
 * the A tile [BM rows x 128 bytes] and the B tile [BN rows x 128 bytes] (64 bf16 or 128 e4m3 of
 * the reduction per row), both K-major with the 128-byte swizzle. Consumer warpgroup w issues
 * wgmma for rows [64w, 64w + 64) of the tile against all BN columns, keeping one wgmma group in
 * flight, and frees a stage as soon as the wgmmas that read it have completed.
 *
 * Ring protocol (per stage s, phases alternate 0/1):
 *   full[s]  : 1 arrival (producer's arrive.expect_tx) + the TMA bytes  -> consumers may read
 *   empty[s] : 8 arrivals (lane 0 of each consumer warp)                -> producer may refill
 * The producer starts waiting on empty with parity 1, which a fresh barrier satisfies at once.
 * One CTA per tile: 2-CTA clusters multicasting B measured slower (docs/performance.md,
 * "Variants removed").
 *
 * The ring position is carried across tiles, so the producer runs ahead into the next tile while
 * consumers finish the epilogue of the current one.
 */
#ifndef MOK_CUDA_TILE_PIPELINE_CUH
#define MOK_CUDA_TILE_PIPELINE_CUH

#include <stdint.h>

#include "cuda/ptx/ptx.cuh"
#include "cuda/tile/barriers.cuh"
#include "cuda/tile/scheduler.cuh"

#define MOK_TP_THREADS 384        // producer warpgroup + 2 consumer warpgroups
#define MOK_TP_CONSUMER_WARPS 8
#define MOK_TP_ROW_BYTES 128      // one K block per operand row: 64 bf16 or 128 e4m3

// Shared-memory plan of a CTA; all offsets from a 1024-byte-aligned base. C_BYTES is the output
// staging area of the epilogue (0 when it stores straight from registers).
template <int BM, int BN, int STAGES, int C_BYTES>
struct tp_plan {
  static constexpr int NUM_STAGES = STAGES;
  static constexpr int A_BYTES = BM * MOK_TP_ROW_BYTES;  // A stage tile [BM, 128 B]
  static constexpr int B_BYTES = BN * MOK_TP_ROW_BYTES;  // B stage tile [BN, 128 B]
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int C_OFFSET = STAGES * STAGE_BYTES;
  static constexpr int FULL_OFFSET = C_OFFSET + C_BYTES;
  static constexpr int EMPTY_OFFSET = FULL_OFFSET + STAGES * 8;
  static constexpr int BYTES = EMPTY_OFFSET + STAGES * 8;
  // Beyond BYTES (a kernel whose producer uses tp_produce_tile or tp_produce_tile_bn allocates
  // TAGS_BYTES more): an int4 per stage, the tile the stage starts, right after the barriers.
  static constexpr int TAGS_OFFSET = BYTES;
  static constexpr int TAGS_BYTES = STAGES * 16;
  static constexpr int ALLOC_BYTES = BYTES + 1024;  // slack to align the dynamic base

  static_assert(BM == 128, "two consumer warpgroups of 64 rows each");
  static_assert(BN % 128 == 0 && BN <= 256, "B is loaded as 128-row TMA boxes; wgmma N <= 256");
  static_assert(A_BYTES % 1024 == 0 && B_BYTES % 1024 == 0 && C_BYTES % 1024 == 0,
                "128B swizzle needs 1024-byte aligned tiles");
  static_assert(ALLOC_BYTES <= 227 * 1024, "over the 227 KB of shared memory of an sm_90 CTA");
};

typedef struct {
  int stage;
  uint32_t phase;
} tp_ring_t;

template <int STAGES>
__device__ __forceinline__ void tp_ring_advance(tp_ring_t *r) {
  if (++r->stage == STAGES) {
    r->stage = 0;
    r->phase ^= 1u;
  }
}

// One thread: initializes the barriers. The caller syncs the CTA afterwards.
template <int STAGES>
__device__ __forceinline__ void tp_init_barriers(uint64_t *full, uint64_t *empty) {
  for (int s = 0; s < STAGES; s++) {
    ptx_mbar_init(&full[s], 1);
    ptx_mbar_init(&empty[s], MOK_TP_CONSUMER_WARPS);
  }
  ptx_fence_mbarrier_init();
}

// The start of a grouped-GEMM kernel: the ring's shared memory (plan P) in the dynamic allocation,
// aligned to 1024 bytes (the 128-byte swizzle's atom), its barriers initialized and the tensor
// maps prefetched by one thread, then a CTA barrier. NULL maps are not prefetched.
template <typename P>
__device__ __forceinline__ uint8_t *tp_kernel_start(uint8_t *smem_raw, uint64_t **full,
                                                    uint64_t **empty, const CUtensorMap *m0,
                                                    const CUtensorMap *m1, const CUtensorMap *m2,
                                                    const CUtensorMap *m3) {
  uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  *full = (uint64_t *)(smem + P::FULL_OFFSET);
  *empty = (uint64_t *)(smem + P::EMPTY_OFFSET);
  if (threadIdx.x == 32) {
    tp_init_barriers<P::NUM_STAGES>(*full, *empty);
    const CUtensorMap *maps[4] = {m0, m1, m2, m3};
#pragma unroll
    for (int i = 0; i < 4; i++)
      if (maps[i]) ptx_prefetch_tensormap(maps[i]);
  }
  __syncthreads();
  return smem;
}

// Where the B tile's two 128-row halves come from: rows [0, 128) from (map_lo, row_lo) and rows
// [128, 256) from (map_hi, row_hi). A plain GEMM reads both halves from B; SwiGLU reads the gate
// half from Wg and the up half from Wu, so g and u of the same columns land in one accumulator.
typedef struct {
  const CUtensorMap *map_lo, *map_hi;
  int row_lo, row_hi;
} tp_b_source_t;

// B stored N-major ([G, K, N] as a [G K, N] map with box [64 k-rows, 64 n]): the stage's B tile
// is 4 chunks of 64 columns, chunk c = [64 k][128 B] at c x 8 KB; loads at (n0 + 64 c, k_row).
// A second segment of the reduction (k_split < the tile's k_blocks) continues it from another
// pair of operands: K blocks [k_split, k_blocks) come from map_a2 (same rows) and map2 (rows from
// k_row2), so one accumulator holds A·B + A2·B2 as a single reduction of K + K2 (the backward's
// dxk = dg·Wg + du·Wu, design.md's one reduction of length 2I).
typedef struct {
  const CUtensorMap *map;
  int k_row0;  // g K: first row of group g in the [G K, N] view
  int n0;
  int k_split;                       // K blocks from (map_a, map); the rest from the second pair
  const CUtensorMap *map_a2, *map2;  // the second segment (unused when k_split >= k_blocks)
  int k_row2;                        // g K2: first row of group g in map2's [G K2, N] view
} tp_b_nmajor_t;

// Producer thread: the tag slot of `stage` (the plan's tags, after the barriers) gets `tag`.
template <typename P>
__device__ __forceinline__ void tp_post_tag(uint64_t *full, int stage, int4 tag) {
  ptx_st_shared_v4(ptx_smem_addr(full) + (P::TAGS_OFFSET - P::FULL_OFFSET) + 16 * stage, tag);
}

// What else the producer loads into each stage (the fp8 kernel's activation scales): called after
// the stage's operand loads with the stage, its K block and its full barrier, on which its copies
// complete extra_tx() bytes.
struct tp_no_stage_hook {
  __device__ __forceinline__ uint32_t extra_tx() const { return 0; }
  __device__ __forceinline__ void operator()(int, int, uint64_t *) const {}
};

// Producer, one thread: loads the k_blocks stages of one tile. The tile's first stage, once free, gets `tag` in its slot of the plan's tags before the arrival that the consumers' wait
// acquires: the consumers learn the tile there (grouped_gemm.cu's gg_peek).
template <int BM, int BN, int STAGES, int C_BYTES, class StageHook = tp_no_stage_hook>
__device__ __forceinline__ void tp_produce_tile(tp_ring_t *ring, uint8_t *smem, uint64_t *full,
                                                uint64_t *empty, const CUtensorMap *map_a,
                                                int a_row, tp_b_source_t b, int k_blocks,
                                                int k_elems_per_block, int4 tag,
                                                StageHook hook = StageHook()) {
  typedef tp_plan<BM, BN, STAGES, C_BYTES> P;
  // before the loop, so that the tag's registers are free in it
  ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
  tp_post_tag<P>(full, ring->stage, tag);
  for (int kb = 0; kb < k_blocks; kb++) {
    ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
    uint8_t *a_tile = smem + ring->stage * P::STAGE_BYTES;
    uint8_t *b_tile = a_tile + P::A_BYTES;
    uint64_t *bar = &full[ring->stage];
    const int kx = kb * k_elems_per_block;
    ptx_mbar_arrive_expect_tx(bar, P::STAGE_BYTES + hook.extra_tx());
    ptx_tma_load_2d(a_tile, map_a, bar, kx, a_row);
    ptx_tma_load_2d(b_tile, b.map_lo, bar, kx, b.row_lo);
    if (BN == 256) ptx_tma_load_2d(b_tile + 128 * MOK_TP_ROW_BYTES, b.map_hi, bar, kx, b.row_hi);
    hook(ring->stage, kb, bar);
    tp_ring_advance<STAGES>(ring);
  }
}

// Producer, one thread, B N-major: one tile's k_blocks stages (tag: as for
// tp_produce_tile).
template <int BM, int BN, int STAGES, int C_BYTES>
__device__ __forceinline__ void tp_produce_tile_bn(tp_ring_t *ring, uint8_t *smem, uint64_t *full,
                                                   uint64_t *empty, const CUtensorMap *map_a,
                                                   int a_row, tp_b_nmajor_t b, int k_blocks,
                                                   int4 tag) {
  typedef tp_plan<BM, BN, STAGES, C_BYTES> P;
  static_assert(BN % 64 == 0, "64-column chunks");
  ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
  tp_post_tag<P>(full, ring->stage, tag);
  for (int kb = 0; kb < k_blocks; kb++) {
    ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
    uint8_t *a_tile = smem + ring->stage * P::STAGE_BYTES;
    uint8_t *b_tile = a_tile + P::A_BYTES;
    uint64_t *bar = &full[ring->stage];
    const bool second = kb >= b.k_split;
    const CUtensorMap *ma = second ? b.map_a2 : map_a, *mb = second ? b.map2 : b.map;
    const int kx = second ? (kb - b.k_split) * 64 : kb * 64;
    const int k_row = (second ? b.k_row2 : b.k_row0) + kx;
    ptx_mbar_arrive_expect_tx(bar, P::STAGE_BYTES);
    ptx_tma_load_2d(a_tile, ma, bar, kx, a_row);
#pragma unroll
    for (int c = 0; c < BN / 64; c++)
      ptx_tma_load_2d(b_tile + c * 64 * MOK_TP_ROW_BYTES, mb, bar, b.n0 + 64 * c, k_row);
    tp_ring_advance<STAGES>(ring);
  }
}

// A consumer warpgroup that computes nothing of a tile (see `idle` below): releases its k_blocks
// stages as they arrive, as it would after reading them.
template <int STAGES>
__device__ __forceinline__ void tp_pass_tile(tp_ring_t *ring, uint64_t *full, uint64_t *empty,
                                             int k_blocks) {
  const int lane = threadIdx.x & 31;
  for (int kb = 0; kb < k_blocks; kb++) {
    ptx_mbar_wait(&full[ring->stage], ring->phase);
    if (lane == 0) ptx_mbar_arrive(&empty[ring->stage]);
    tp_ring_advance<STAGES>(ring);
  }
  __syncwarp();
}

// Consumer warpgroup `wg` (0 or 1): acc[64 rows, 256 cols] = A[64wg + (0..63)] · B[0..255]ᵀ over
// k_blocks stages, bf16 operands. acc is in wgmma's fragment layout (see tile/epilogue.cuh).
// idle: none of this warpgroup's 64 rows is stored (the last row tile of a group, with at most 64
// rows left): it only releases the stages as they arrive and leaves acc undefined, so the other
// warpgroup's wgmmas get the tensor cores to themselves and the tile takes about half the time.
// (The grouped GEMMs pass it only when their tiles are not in bands: grouped_gemm.cu's
// gg_skip_rows.)
// after_first: called once the first stage's wgmmas are issued (or at once, idle), for work that
// may overlap the tile's MMA (the fused kernel's deferred release of the previous tile); it must
// not wait on anything another CTA or warpgroup has yet to do, and leaves the warps converged.
// after_last: the same, once the last stage's wgmmas are issued (idle: after the last stage).
// prep: called by every thread with the stage and its K block once the stage has landed, before
// any wgmma reads it (the MXFP8-B GEMM converts its e4m3 B there: gemm/grouped_gemm_mx.cuh).
struct tp_no_hook {
  __device__ __forceinline__ void operator()() const {}
};
struct tp_no_prep {
  __device__ __forceinline__ void operator()(int, int) const {}
};
template <int BM, int STAGES, int C_BYTES, int B_NMAJOR, class Hook = tp_no_hook,
          class HookLast = tp_no_hook, class Prep = tp_no_prep>
__device__ __forceinline__ void tp_consume_tile_bf16_n256(tp_ring_t *ring, uint8_t *smem,
                                                          uint64_t *full, uint64_t *empty,
                                                          int k_blocks, int wg, bool idle,
                                                          float (&acc)[128],
                                                          Hook after_first = Hook(),
                                                          HookLast after_last = HookLast(),
                                                          Prep prep = Prep()) {
  typedef tp_plan<BM, 256, STAGES, C_BYTES> P;
  const int lane = threadIdx.x & 31;
  if (idle) {
    after_first();
    tp_pass_tile<STAGES>(ring, full, empty, k_blocks);
    after_last();
    return;
  }
#pragma unroll
  for (int i = 0; i < 128; i++) ptx_fence_operand(acc[i]);
  int prev_stage = -1;
  for (int kb = 0; kb < k_blocks; kb++) {
    ptx_mbar_wait(&full[ring->stage], ring->phase);
    prep(ring->stage, kb);
    uint8_t *a_tile = smem + ring->stage * P::STAGE_BYTES + wg * 64 * MOK_TP_ROW_BYTES;
    uint8_t *b_tile = smem + ring->stage * P::STAGE_BYTES + P::A_BYTES;
    // Only the descriptors' low words (start address, and the leading byte offset of N-major B)
    // change; the high word (stride byte offset, swizzle) is the same constant for both layouts.
    const uint32_t da = (uint32_t)ptx_desc_kmajor_sw128(a_tile);
    const uint32_t db = (uint32_t)(B_NMAJOR ? ptx_desc_mnmajor_sw128(b_tile, 64 * MOK_TP_ROW_BYTES)
                                            : ptx_desc_kmajor_sw128(b_tile));
    const uint64_t hi = ptx_desc_kmajor_sw128_hi();
    ptx_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
      // A (and K-major B): k16 step = 32 bytes along the swizzled 128-byte row = +2 in the
      // descriptor's address field. N-major B: k16 step = 16 rows of 128 bytes = +128. The
      // address field (bits 0-13) holds any shared address >> 4 plus these steps: no carry.
      ptx_wgmma_m64n256k16_bf16<B_NMAJOR>(acc, hi | (da + 2 * kk),
                                          hi | (db + (B_NMAJOR ? 128 : 2) * kk), (kb | kk) != 0);
    }
    ptx_wgmma_commit_group();
    if (kb == 0) after_first();
    if (kb == k_blocks - 1) after_last();
    // The group issued one block earlier has now completed: its stage can be refilled.
    ptx_wgmma_wait_group<1>();
    if (prev_stage >= 0 && lane == 0) ptx_mbar_arrive(&empty[prev_stage]);
    prev_stage = ring->stage;
    tp_ring_advance<STAGES>(ring);
  }
  ptx_wgmma_wait_group<0>();
  if (prev_stage >= 0 && lane == 0) ptx_mbar_arrive(&empty[prev_stage]);
#pragma unroll
  for (int i = 0; i < 128; i++) ptx_fence_operand(acc[i]);
}

// Scales of the fp8-block mainloop for one consumer thread (docs/design.md, "FP8 formats").
// The activation scales come from global memory (a0, a1), or (SMEM_A) from the stage: the
// producer loads the tile's 128 row scales of each K block into a slot of MOK_TP_FP8_SLOT_BYTES
// per stage (gemm/grouped_gemm_fp8.cuh), and `sa` is this thread's first row in stage 0's slot.
// A slot holds up to 132 scales from the tile's first row rounded down to a multiple of 4 (TMA's
// innermost coordinate must be a multiple of 16 bytes), 128-byte aligned for TMA.
#define MOK_TP_FP8_SLOT_BYTES 640
typedef struct {
  const float *a0, *a1;  // a_scale rows of this thread's two accumulator rows: [K/128] each
  const float *b;        // b_scale [K/128] of the tile's 128-column block of group g
  const float *b2;       // TP_FP8_B_HALVES: the up half's [K/128]; TP_FP8_B_SEGMENTS: the second
                         // segment's [K2/128] (its block kb is the tile's block k_split + kb)
  int k_split;           // TP_FP8_B_SEGMENTS: K blocks of the first segment
  uint32_t sa;           // SMEM_A: shared address of this thread's first row's scale, stage 0
} tp_fp8_scales_t;

// Where the B scale of a stage comes from (the consumer's BMODE):
//   TP_FP8_B_ONE       one 128x128 block per stage: b[kb]
//   TP_FP8_B_HALVES    SwiGLU: B rows [0, 64) are gate rows (scale b[kb]) and [64, 128) up rows
//                      (b2[kb]), so accumulator columns [0, 64) and [64, 128) promote with their
//                      own scale
//   TP_FP8_B_SEGMENTS  a second reduction segment: blocks kb >= k_split read b2[kb - k_split]
enum { TP_FP8_B_ONE = 0, TP_FP8_B_HALVES = 1, TP_FP8_B_SEGMENTS = 2 };

// Consumer warpgroup `wg`, fp8-block: total[64 rows, 128 cols] = Σ_kb (A_kb · B_kbᵀ) · sa · sb,
// e4m3 operands, 128 reduction elements per stage (four k32 wgmmas into a `part` set), promoted
// into the fp32 `total` on CUDA cores after every stage: the tensor cores' fp8 accumulator keeps
// too few bits to run over all of K (docs/design.md, "FP8 formats").
// Two `part` sets: block kb + 1 is issued into one before block kb, in the other, is waited for
// (wait_group 1), released and promoted, so the tensor cores always have the next block while the
// CUDA cores promote, as bf16's loop keeps one group in flight. With one set the warpgroup's
// tensor work stopped from each wait to its next issue: a loop-only probe ran at 1312-1337 TF/s
// with one set against 1536-1546 with two, and the grouped GEMM went from 0.68x-1.04x to
// 0.83x-1.37x torch's rowwise fp8 (docs/performance.md, "fp8-block GEMM: two part sets"). It costs 3 x 64 accumulator registers,
// hence the fp8 kernel's 232-240-register consumers.
// The scales of block kb + 1 are loaded when it is issued (an L2 load's latency hides behind one
// block's wgmmas), or with SMEM_A its row scales are read from its stage's slot just before they
// are needed: from global memory, ~12% of the stall samples sat on those loads and their
// products at DeepSeek-V3's shapes, where the L2 is busy (ncu; docs/performance.md, "fp8-block GEMM: activation scales"), and the
// slots measured 0-4% faster. Barriers and descriptors are shared-memory offsets fixed per
// tile, not generic pointers converted at every use (ncu: a third of the old loop's instructions).
// NOTE: the two warpgroups issue together: issuing in turns (ping-pong) measured 15-25% slower
// (docs/performance.md, "Variants removed").
// idle: as for tp_consume_tile_bf16_n256 (no row of this warpgroup is stored; total undefined).

// da, db: the low words of K-major 128B-swizzle descriptors (ptx_desc_kmajor_sw128); their high
// word is the same constant for every tile, so only the addresses take registers.
__device__ __forceinline__ void tp_fp8_issue(float (&part)[64], uint32_t da, uint32_t db) {
  const uint64_t hi = ptx_desc_kmajor_sw128_hi();
#pragma unroll
  for (int i = 0; i < 64; i++) ptx_fence_operand(part[i]);
  ptx_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; kk++)  // k32 step of e4m3 = 32 bytes = +2 in the descriptor's address
    ptx_wgmma_m64n128k32_e4m3(part, hi | (da + 2 * kk), hi | (db + 2 * kk), kk != 0);
  ptx_wgmma_commit_group();
}

// total += part · (s0 rows, s1 rows + 8): acc[4j + e] is row +8 when e >= 2 (tile/epilogue.cuh).
// The caller has waited for part's wgmmas and fenced its registers (ptx_fence_operand) right
// after the wait.
// Columns [64, 128) (j >= 8) take t0, t1 instead (TP_FP8_B_HALVES; else t = s).
__device__ __forceinline__ void tp_fp8_promote(float (&total)[64], float (&part)[64], float s0,
                                               float s1, float t0, float t1) {
#pragma unroll
  for (int j = 0; j < 16; j++) {
    const float r0 = j < 8 ? s0 : t0, r1 = j < 8 ? s1 : t1;
    total[4 * j] += part[4 * j] * r0;
    total[4 * j + 1] += part[4 * j + 1] * r0;
    total[4 * j + 2] += part[4 * j + 2] * r1;
    total[4 * j + 3] += part[4 * j + 3] * r1;
  }
}

// The two B scales of block kb (the second is the up half's with TP_FP8_B_HALVES, else unused).
template <int BMODE>
__device__ __forceinline__ float2 tp_fp8_b_scales(const tp_fp8_scales_t &sc, int kb) {
  if (BMODE == TP_FP8_B_HALVES) return make_float2(sc.b[kb], sc.b2[kb]);
  if (BMODE == TP_FP8_B_SEGMENTS)
    return make_float2(kb < sc.k_split ? sc.b[kb] : sc.b2[kb - sc.k_split], 0.0f);
  return make_float2(sc.b[kb], 0.0f);
}

// Waits until at most N wgmma groups are pending, so that block `cur` (stage st) has completed,
// releases the stage (the empty barriers follow the full ones: tp_plan's EMPTY_OFFSET =
// FULL_OFFSET + 8 STAGES, so one offset names both) and promotes cur with s0, s1 (columns
// [64, 128): t0, t1).
template <int N, int STAGES>
__device__ __forceinline__ void tp_fp8_retire(uint32_t full0, uint32_t st, float s0, float s1,
                                              float t0, float t1, float (&cur)[64],
                                              float (&total)[64]) {
  ptx_wgmma_wait_group<N>();
#pragma unroll
  for (int i = 0; i < 64; i++) ptx_fence_operand(cur[i]);
  if ((threadIdx.x & 31) == 0) ptx_mbar_arrive_at(full0 + 8 * (STAGES + st));  // empty
  tp_fp8_promote(total, cur, s0, s1, t0, t1);
}

// The promotion scales of one block: this thread's two row scales (sa0, sa1, or with SMEM_A read
// from the block's slot in stage st) times the block's B scales sb (.y: the up half's).
template <int BMODE, int SMEM_A>
__device__ __forceinline__ void tp_fp8_row_scales(uint32_t sa, uint32_t st, float sa0, float sa1,
                                                  float2 sb, float &s0, float &s1, float &t0,
                                                  float &t1) {
  if (SMEM_A) {
    const uint32_t at = sa + st * MOK_TP_FP8_SLOT_BYTES;
    sa0 = ptx_ld_shared_f32(at);
    sa1 = ptx_ld_shared_f32(at + 32);  // row + 8
  }
  s0 = sa0 * sb.x;
  s1 = sa1 * sb.x;
  t0 = BMODE == TP_FP8_B_HALVES ? sa0 * sb.y : s0;
  t1 = BMODE == TP_FP8_B_HALVES ? sa1 * sb.y : s1;
}

// Block kb is in flight in `cur` (stage *st_cur): issues block kb + 1 into `nxt` and loads its
// scales (SMEM_A: its B scales only), then retires block kb with the scales loaded one step
// earlier (SMEM_A: its row scales from its slot, read after the issue).
// NOTE: the caller keeps every wgmma and wait out of data-dependent branches (the loop below runs
// whole pairs of steps, then a tail); with them inside one, ptxas serializes the wgmmas (C7518).
template <int STAGES, int STAGE_BYTES, int SMEM_A, int BMODE>
__device__ __forceinline__ void tp_fp8_step(tp_ring_t *ring, uint32_t full0, uint32_t da0,
                                            uint32_t db0, int kb, const tp_fp8_scales_t &sc,
                                            float &sa0, float &sa1, float2 &sb, uint32_t *st_cur,
                                            float (&cur)[64], float (&nxt)[64],
                                            float (&total)[64]) {
  float s0 = 0.0f, s1 = 0.0f, t0 = 0.0f, t1 = 0.0f;
  const float2 sb_cur = sb;
  if (!SMEM_A) tp_fp8_row_scales<BMODE, 0>(0, 0, sa0, sa1, sb_cur, s0, s1, t0, t1);
  sb = tp_fp8_b_scales<BMODE>(sc, kb + 1);
  if (!SMEM_A) {
    sa0 = sc.a0[kb + 1];
    sa1 = sc.a1[kb + 1];
  }
  const uint32_t st_next = (uint32_t)ring->stage;
  ptx_mbar_wait_at(full0 + 8 * st_next, ring->phase);
  const uint32_t step = st_next * (STAGE_BYTES >> 4);
  tp_fp8_issue(nxt, da0 + step, db0 + step);
  tp_ring_advance<STAGES>(ring);
  if (SMEM_A) tp_fp8_row_scales<BMODE, 1>(sc.sa, *st_cur, 0.0f, 0.0f, sb_cur, s0, s1, t0, t1);
  tp_fp8_retire<1, STAGES>(full0, *st_cur, s0, s1, t0, t1, cur, total);
  *st_cur = st_next;
}

// The last retire of a tile (block in stage st, scales of one step earlier).
template <int STAGES, int SMEM_A, int BMODE>
__device__ __forceinline__ void tp_fp8_retire_last(uint32_t full0, uint32_t st,
                                                   const tp_fp8_scales_t &sc, float sa0, float sa1,
                                                   float2 sb, float (&cur)[64],
                                                   float (&total)[64]) {
  float s0, s1, t0, t1;
  tp_fp8_row_scales<BMODE, SMEM_A>(sc.sa, st, sa0, sa1, sb, s0, s1, t0, t1);
  tp_fp8_retire<0, STAGES>(full0, st, s0, s1, t0, t1, cur, total);
}

template <int BM, int STAGES, int C_BYTES, int SMEM_A = 0, int BMODE = TP_FP8_B_ONE>
__device__ __forceinline__ void tp_consume_tile_fp8_n128(tp_ring_t *ring, uint8_t *smem,
                                                         uint64_t *full, uint64_t *empty,
                                                         int k_blocks, int wg, bool idle,
                                                         tp_fp8_scales_t sc, float (&total)[64]) {
  typedef tp_plan<BM, 128, STAGES, C_BYTES> P;
  static_assert(P::EMPTY_OFFSET == P::FULL_OFFSET + 8 * STAGES, "empty[] follows full[]");
  if (idle) {
    tp_pass_tile<STAGES>(ring, full, empty, k_blocks);
    return;
  }
  const uint32_t full0 = ptx_smem_addr(full);
  const uint32_t da0 = (uint32_t)ptx_desc_kmajor_sw128(smem + wg * 64 * MOK_TP_ROW_BYTES);
  const uint32_t db0 = (uint32_t)ptx_desc_kmajor_sw128(smem + P::A_BYTES);
  float pa[64], pb[64];
#pragma unroll
  for (int i = 0; i < 64; i++) total[i] = 0.0f;
  float sa0 = 0.0f, sa1 = 0.0f;
  float2 sb = tp_fp8_b_scales<BMODE>(sc, 0);
  if (!SMEM_A) {
    sa0 = sc.a0[0];
    sa1 = sc.a1[0];
  }
  uint32_t st_cur = (uint32_t)ring->stage;
  ptx_mbar_wait_at(full0 + 8 * st_cur, ring->phase);
  tp_fp8_issue(pa, da0 + st_cur * (P::STAGE_BYTES >> 4), db0 + st_cur * (P::STAGE_BYTES >> 4));
  tp_ring_advance<STAGES>(ring);
  int kb = 0;
  for (; kb + 2 < k_blocks; kb += 2) {  // blocks kb + 1 and kb + 2 exist: a pair of steps
    tp_fp8_step<STAGES, P::STAGE_BYTES, SMEM_A, BMODE>(ring, full0, da0, db0, kb, sc, sa0, sa1,
                                                       sb, &st_cur, pa, pb, total);
    tp_fp8_step<STAGES, P::STAGE_BYTES, SMEM_A, BMODE>(ring, full0, da0, db0, kb + 1, sc, sa0,
                                                       sa1, sb, &st_cur, pb, pa, total);
  }
  // One or two blocks left (block kb in pa): issue the last if any, then wait for everything.
  if (kb + 1 < k_blocks) {
    tp_fp8_step<STAGES, P::STAGE_BYTES, SMEM_A, BMODE>(ring, full0, da0, db0, kb, sc, sa0, sa1,
                                                       sb, &st_cur, pa, pb, total);
    tp_fp8_retire_last<STAGES, SMEM_A, BMODE>(full0, st_cur, sc, sa0, sa1, sb, pb, total);
  } else {
    tp_fp8_retire_last<STAGES, SMEM_A, BMODE>(full0, st_cur, sc, sa0, sa1, sb, pa, total);
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* k-grouped stages (weight gradients): both operands MN-major, ragged reduction                   */
/* ---------------------------------------------------------------------------------------------- */
// C[g] [N, K] = A_gᵀ · B_g with A [M_total, N], B [M_total, K] row-major: the reduction runs over
// rows, the outer (strided) dimension of both, so both stage tiles are MN-major. One stage = 64
// reduced rows: 6 chunks of [64 rows][128 B] (64 bf16 columns each, 128-byte swizzle), chunks 0-1
// = A columns [c_row0, c_row0 + 128) (the tile's 128 output rows), chunks 2-5 = B columns
// [c_col0, c_col0 + 256); all 48 KB contiguous (tp_plan<128, 256>: A_BYTES then B_BYTES).
//
// Ragged reduction: group g's rows [lo, hi) are loaded in blocks starting at lo, so the last block
// may run into the next group's rows (TMA only zero-fills past M_total). Those rows must add
// exactly zero, and zeroing one operand is not enough (0 · inf = NaN in the other). So after the
// last block lands, the consumer threads zero its rows [valid, 64) in all six chunks in shared
// memory, fence the generic-proxy stores against the tensor cores' async-proxy reads, and meet at
// a named barrier before any wgmma reads the stage. With the 128-byte swizzle a tile row keeps its
// own 128 bytes (the swizzle permutes 16-byte units inside a row), so a row range is a byte range.
// Cost: at most 48 KB of shared stores once per tile. (Per-group tensor-map bounds, through
// tensormap.replace on a global copy of the map, would avoid it at the price of a map per CTA
// and proxy fences on every group change.)

#define MOK_TP_WGRAD_CHUNKS 6            // 2 A + 4 B chunks of 8 KB per stage
#define MOK_TP_WGRAD_CHUNK_BYTES 8192    // [64 rows][128 B]

// Producer, one thread: the k_blocks stages of one k-grouped tile; stage kb holds rows
// [row0 + 64 kb, row0 + 64 kb + 64) of A columns [a_col0, +128) and B columns [b_col0, +256).
template <int STAGES>
__device__ __forceinline__ void tp_produce_tile_wgrad(tp_ring_t *ring, uint8_t *smem,
                                                      uint64_t *full, uint64_t *empty,
                                                      const CUtensorMap *map_a,
                                                      const CUtensorMap *map_b, int row0,
                                                      int k_blocks, int a_col0, int b_col0) {
  typedef tp_plan<128, 256, STAGES, 0> P;
  static_assert(P::STAGE_BYTES == MOK_TP_WGRAD_CHUNKS * MOK_TP_WGRAD_CHUNK_BYTES, "stage layout");
  for (int kb = 0; kb < k_blocks; kb++) {
    ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
    uint8_t *stage = smem + ring->stage * P::STAGE_BYTES;
    uint64_t *bar = &full[ring->stage];
    const int row = row0 + 64 * kb;
    // Boxes past N or K (or M_total) are zero-filled and still count their bytes.
    ptx_mbar_arrive_expect_tx(bar, P::STAGE_BYTES);
#pragma unroll
    for (int c = 0; c < 2; c++)
      ptx_tma_load_2d(stage + c * MOK_TP_WGRAD_CHUNK_BYTES, map_a, bar, a_col0 + 64 * c, row);
#pragma unroll
    for (int c = 0; c < 4; c++)
      ptx_tma_load_2d(stage + P::A_BYTES + c * MOK_TP_WGRAD_CHUNK_BYTES, map_b, bar,
                      b_col0 + 64 * c, row);
    tp_ring_advance<STAGES>(ring);
  }
}

// The 256 consumer threads (ct = 0..255): rows [valid, 64) of every chunk of `stage` <- 0.
__device__ __forceinline__ void tp_zero_rows_wgrad(uint8_t *stage, int valid, int ct) {
  const int units = (64 - valid) * 8;  // 16-byte units past the valid rows, per chunk
  const int4 z = make_int4(0, 0, 0, 0);
  for (int i = ct; i < MOK_TP_WGRAD_CHUNKS * units; i += 256) {
    const int c = i / units;
    *(int4 *)(stage + c * MOK_TP_WGRAD_CHUNK_BYTES + valid * 128 + 16 * (i - c * units)) = z;
  }
}

// Consumer warpgroup `wg` (0 or 1), k-grouped: acc[64, 256] = Σ_rows A[row][64 wg + 0..63]ᵀ ⊗
// B[row][0..255] over the tile's k_blocks stages (rows in order), `last_rows` (1..64) of the last
// stage valid. k_blocks >= 1: an empty group has no accumulator (the caller stores zeros without
// writing acc: ordinary writes of wgmma accumulators serialize the wgmma pipeline, ptxas C7515).
// Both warpgroups walk the same tiles, so both reach the zeroing barrier of a partial last block.
template <int STAGES>
__device__ __forceinline__ void tp_consume_tile_wgrad_n256(tp_ring_t *ring, uint8_t *smem,
                                                           uint64_t *full, uint64_t *empty,
                                                           int k_blocks, int last_rows, int wg,
                                                           float (&acc)[128]) {
  typedef tp_plan<128, 256, STAGES, 0> P;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < 128; i++) ptx_fence_operand(acc[i]);
  int prev_stage = -1;
  for (int kb = 0; kb < k_blocks; kb++) {
    ptx_mbar_wait(&full[ring->stage], ring->phase);
    uint8_t *stage = smem + ring->stage * P::STAGE_BYTES;
    if (kb == k_blocks - 1 && last_rows < 64) {
      tp_zero_rows_wgrad(stage, last_rows, 128 * wg + (threadIdx.x & 127));
      // NOTE: generic stores read next by wgmma (async proxy): fence in every writer, then meet.
      ptx_fence_proxy_async_smem();
      ptx_named_barrier_sync(MOK_BAR_WGRAD_ZERO, 256);
    }
    // A: this warpgroup's 64 output rows = one chunk, exactly one swizzle atom wide (LBO unused).
    // B: 4 chunks of 64 columns, LBO = 8 KB between them. Both: k16 step = 16 rows of 128 B =
    // +2048 bytes = +128 in the descriptor's address field (two 1024-byte atoms, SBO apart).
    const uint64_t da = ptx_desc_mnmajor_sw128(stage + wg * MOK_TP_WGRAD_CHUNK_BYTES,
                                               MOK_TP_WGRAD_CHUNK_BYTES);
    const uint64_t db = ptx_desc_mnmajor_sw128(stage + P::A_BYTES, MOK_TP_WGRAD_CHUNK_BYTES);
    ptx_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
      ptx_wgmma_m64n256k16_bf16<1, 1>(acc, da + 128 * kk, db + 128 * kk, (kb | kk) != 0);
    ptx_wgmma_commit_group();
    ptx_wgmma_wait_group<1>();  // the previous block's group is complete: release its stage
    if (prev_stage >= 0 && lane == 0) ptx_mbar_arrive(&empty[prev_stage]);
    prev_stage = ring->stage;
    tp_ring_advance<STAGES>(ring);
  }
  ptx_wgmma_wait_group<0>();
  if (prev_stage >= 0 && lane == 0) ptx_mbar_arrive(&empty[prev_stage]);
#pragma unroll
  for (int i = 0; i < 128; i++) ptx_fence_operand(acc[i]);
}

#endif /* MOK_CUDA_TILE_PIPELINE_CUH */
