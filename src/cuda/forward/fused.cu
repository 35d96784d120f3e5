/*
 * forward/fused.cu: the forward MoE layer on one GPU (W = 1, BF16) as one persistent kernel.
 *
 * It runs after the layout kernel (forward/layout.cu) and walks the global task order of
 * src/common/task_plan.h: per expert stage s the GATE_UP tiles of expert s and the DOWN tiles of expert
 * s - L, then the shared expert by bands of token tiles (SHARED_GATE_UP tiles of band u and
 * SHARED_DOWN tiles of band u - 1), then REDUCE. Each CTA takes the tasks a ticket counter deals
 * out in that order, one at a time; its producer warpgroup takes the ticket, decodes the task,
 * and the consumers read both from a tag in the task's first ring stage:
 *
 *   producer warpgroup  fills the ring of tile/pipeline.cuh. B always comes by TMA (thread 0).
 *                       A comes by TMA too, except for GATE_UP, whose rows are tokens of x in
 *                       expert order: there its warps copy the tile's rows (x[row_tok[row]]) with
 *                       cp.async into the 128-byte swizzled layout TMA would have written, so the
 *                       gather costs no pass over memory of its own. From the CTA's first ticket
 *                       at or past expert stage help_stage, warps 2-3 leave to reduce (the
 *                       "reduce helpers") and warps 0-1 gather; past the last GATE_UP task, warp 1
 *                       leaves too and warp 0 alone loads the ring.
 *   consumer warpgroups wgmma into registers (rows 0-63 and 64-127 of the tile; a warpgroup
 *                       whose 64 rows are all past the expert's end issues none), then the
 *                       epilogue of the task (SwiGLU + router weight; bf16 outputs through a
 *                       shared-memory staging buffer and TMA stores, fp32 from registers), then
 *                       release the task's counter.
 * REDUCE is done token by token, each token claimed by one warp from a counter (MOK_FC_CLAIM): by
 * the reduce helpers beside the consumers' MMA, and by every warp of a CTA whose tickets reach the
 * REDUCE tasks (its first REDUCE stage in the ring carries only the tag); a last tag-only stage
 * tells the consumers that the tasks are gone.
 *   Without a shared expert (by_last), the helpers leave at 85% of the expert stages and the
 *   claims follow the layout's reduce order (tokens by their highest expert, red_order): a token
 *   is ready once the DOWN tiles of experts up to its last are done, so the helpers reduce tokens
 *   while the tiles of later experts run (with top-8 of 128 experts, (e / 128)^8 of the tokens
 *   have all their experts below e). Qwen3-235B's final reduce took 120 us per CTA instead of
 *   309 (Qwen3-30B: 152 against 163), at the price of gathering with 2 warps in the last 15% of
 *   GATE_UP tiles; the forward 1.0-2.5% faster (bench/NOTES.md v21).
 *   With one, the helpers leave at the last GATE_UP task and tokens go in token order, each ready
 *   once every DOWN tile and its token tile's SHARED_DOWN tiles are done (the shared expert comes
 *   after every routed tile, in bands of token tiles).
 *
 * Every tile is computed exactly as the unfused chain computes it (grouped_gemm.cu: same tile
 * shape, same K order, same epilogue code), and the reduce is forward/rows.cuh's, so the results
 * are bitwise those of the chain, for any grid size.
 *
 * Counters (src/common/workspace.h, MOK_FC_*; zeroed by this call's layout kernel) count warpgroup
 * releases, 2 per tile:
 *   DOWN(e, m, *)      waits for  GU[tile_pre[e] + m]  = 2 n_gu   (its rows of a are complete)
 *   SHARED_DOWN(m, *)  waits for  SGU[m]               = 2 n_sgu
 *   token t's reduce   by_last: waits for DN[e] = 2 n_down (tile_pre[e + 1] - tile_pre[e]) for
 *                      every expert e up to its last (a DOWN tile's release waits for its TMA
 *                      stores; it runs under the warpgroup's next tile, fk_flush_down);
 *                      else: waits for DOWN = 2 n_down tile_pre[E] (each consumer warpgroup adds
 *                      its DOWN tiles at once when it leaves the expert stages: at its first
 *                      shared-expert task, or before REDUCE), and SD[t / 128] = 2 n_sd
 * A release: the warpgroup's stores, a named barrier, then one thread's fence + red.release.gpu.
 * A wait (producer thread 0, or one consumer thread per warpgroup): ld.acquire.gpu in a loop; a
 * TMA read of the data then follows a proxy fence (the data was written through the generic
 * proxy), and ordinary reads of it go to L2 (.cg).
 *
 * NOTE (deadlock freedom, src/common/task_plan.h): every task waits only on tasks earlier in the order;
 * tickets are handed out in that order, each CTA finishes its tasks in the order it took them (the
 * producer never waits on a task of its own CTA that is not already loaded: it runs ahead only by
 * issuing loads), and the launch is cooperative, so every CTA is resident. Then the earliest
 * unfinished task is held by a running CTA and its dependencies are finished, so it finishes.
 * A token's reduce waits only on tile tasks (DOWN, SHARED_DOWN), and no tile waits on a reduce:
 * the reduce helpers are warps apart from the one that loads the ring, and the consumers reduce
 * only after their last tile (and their last deferred releases), so every tile finishes as above,
 * and then every reduce. No tile waits on DN or DOWN either, so a DOWN release held through the
 * next tile delays no tile.
 * Waits are still bounded (timeout_s): a wait that times out reports MOK_ERROR_TIMEOUT through
 * the error word, raises MOK_FC_ABORT so that every other wait gives up at once, and the kernel
 * runs to its end with wrong results instead of hanging.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/error_word.cuh"
#include "cuda/tile/epilogue.cuh"
#include "cuda/backward/backward.h"
#include "cuda/forward/forward.h"
#include "cuda/gemm/gemm.h"
#include "cuda/ptx/ptx.cuh"
#include "cuda/forward/rows.cuh"
#include "cuda/tile/pipeline.cuh"
#include "cuda/ptx/tma.cuh"
#include "common/shape.h"
#include "common/status.h"
#include "common/task_plan.h"
#include "common/workspace.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's forward kernels target sm_90a (Hopper) and newer"
#endif

enum { FK_BM = MOK_FC_TILE_M, FK_BN = 256, FK_STAGES = 4 };
// The kernel's configurations (STAGED). DOWN tiles and (SHARED_)GATE_UP's a, g and u are stored
// through shared memory and TMA (STAGED = 1: a [64, 128] bf16 staging buffer per consumer
// warpgroup, each round of 128 columns waiting until the copy engine has read the previous one)
// when the E + 1 row-tile prefix sums still fit next to it; else from registers (STAGED = 0).
// The ring is the same either way.
// NOTE: 3 stages and two staging buffers per warpgroup (so that consecutive rounds alternate)
// measured 4-7% slower at all three benchmark shapes (again in bench/NOTES.md v19: the rounds got
// shorter, the next task's first stage came later); lending a full tile's last ring stage to its
// epilogue for one round, 0.7-0.9% slower (v19).
template <int STAGED>
struct fk_cfg {
  static constexpr int WG_C_BYTES = STAGED * 64 * 128 * 2;  // per consumer warpgroup
  typedef tp_plan<FK_BM, FK_BN, FK_STAGES, 2 * WG_C_BYTES> P;
  static size_t bytes(int64_t E) { return P::ALLOC_BYTES + (size_t)(E + 1) * 4; }  // + s_pre
};
typedef tp_plan<FK_BM, FK_BN, FK_STAGES, 0> fk_plan;
static_assert(FK_BM == 128, "tile height = the layout's row tile (MOK_FC_TILE_M)");

// A full barrier's arrivals: GATE_UP's gathered stages, each gathering thread's cp.async arrival,
// thread 0's with the stage's TMA byte count, and thread 0's for the producer threads that have
// left to reduce; stages loaded by TMA alone (and tag-only stages), thread 0 for all.
#define FK_FULL_ARRIVALS (128 + 1)
// Named barriers: 1, the producer warps' tickets; 2 + cw, consumer warpgroup cw's own threads (its
// epilogues and releases).
#define FK_BAR_P 1
#define FK_BAR_C 2
#define FK_TAG_END (-1)  // tag of the stage that tells the consumers there is no task left


typedef struct {
  CUtensorMap x;        // [T, H], box [128, 64]: SHARED_GATE_UP's A
  CUtensorMap wg, wu;   // [E I, H], box [128, 64]
  CUtensorMap a;        // [R, I]: DOWN's A
  CUtensorMap wd;       // [E H, I]
  CUtensorMap as;       // [T, Is]: SHARED_DOWN's A
  CUtensorMap wsg, wsu; // [Is, H]
  CUtensorMap wsd;      // [H, Is]
  CUtensorMap yk;       // [R, H], box [64, 64]: DOWN's staged stores
  CUtensorMap g, u;     // [R, I], box [64, 64]: GATE_UP's staged stores of g and u
  CUtensorMap a_st;     // [R, I], box [64, 64]: GATE_UP's staged stores of a
  CUtensorMap as_st;    // [T, Is], box [64, 64]: SHARED_GATE_UP's staged stores of as, gs, us
  CUtensorMap gs, us;
} fk_maps_t;

// The kernel's one parameter struct (flat, passed as __grid_constant__), filled by the launcher
// from mok_fwd_fused_params_t and the layer's tuning. R = capacity rows of the routed buffers.
typedef struct {
  int64_t T, H, I, Is, E, K;    // tokens, hidden, intermediate, shared intermediate, local experts
  const void *x;                // [T, H] bf16
  void *y;                      // [T, H] bf16
  const int32_t *status;        // [1] 0: the call's routing was invalid, nothing is computed
  const int32_t *offsets;       // [E + 1] rows of expert e are [offsets[e], offsets[e + 1])
  const int32_t *tile_pre;      // [E + 1] row-tile prefix sums
  const int32_t *slot_row;      // [T, K] row of (token, slot), -1 for an empty slot
  const float *row_w;           // [R] router weight of each row
  const int32_t *row_tok;       // [R] token of each row (GATE_UP gathers x through it)
  const int32_t *red_pre;       // [E + 2] the reduce order's bins (by_last)
  const int32_t *red_order;     // [T] tokens by their last expert
  uint32_t *counters;           // the MOK_FC_* counters (src/common/workspace.h)
  void *err;                    // mok_ws_error_t
  void *yk;                     // [R, H] bf16 expert outputs
  float *ys;                    // [T, H] fp32 shared-expert output (NULL when Is = 0)
  void *a;                      // [R, I] bf16 bf16(w · silu(g) · u)
  void *as;                     // [T, Is] bf16
  void *g_out, *u_out;          // [R, I] bf16 (NULL: RECOMPUTE mode)
  void *gs_out, *us_out;        // [T, Is] bf16 (NULL: RECOMPUTE mode, or Is = 0)
  uint64_t timeout_ns;          // bound of each wait on a counter
  uint32_t sgu_base;            // counter index of SGU[0]
  uint32_t sd_base;             // counter index of SD[0]
  uint32_t dn_base;             // counter index of DN[0]
  int32_t shared_band;          // the plan's token tiles per band of the shared expert
  int32_t lag;                  // the plan's lag (fk_lag)
  int32_t group_m;              // the plan's row tiles per band (src/common/task_plan.h)
  int32_t by_last;              // without a shared expert, reduce in the layout's order
                                // (fk_reduce_claims)
  int32_t help_stage;           // expert stage from which 2 producer warps reduce (E: none
                                // before the last GATE_UP task)
} fk_params_t;

// The kernel of a configuration (STAGED = 1: outputs through the staging buffers) and its dynamic
// shared memory for E local experts.
typedef void (*fk_kernel_fn)(fk_params_t, fk_maps_t);
fk_kernel_fn fk_kernel(int staged);
size_t fk_smem_bytes(int staged, int64_t E);

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

// Waits until counter `c` reaches `target` (acquire), or the timeout, or an abort.
// sleep_ns: between polls. The reduce's claims use 1000: they wait long (a band of shared-expert
// tiles), from up to ~400 warps at once, on few counters; with 64 ns between polls DeepSeek-V3's
// forward was 2.6-3.5% slower (bench/NOTES.md v18).
__device__ __noinline__ void fk_wait(const fk_params_t &p, int c, uint32_t target, int64_t task,
                                     uint32_t sleep_ns = 64) {
  uint32_t *ctr = p.counters;
  uint32_t v = ptx_ld_acquire_gpu(ctr + c);
  if (v >= target) return;
  const uint64_t t0 = ptx_globaltimer_ns();
  for (;;) {
    __nanosleep(sleep_ns);
    v = ptx_ld_acquire_gpu(ctr + c);
    if (v >= target) return;
    if (*(volatile uint32_t *)(ctr + MOK_FC_ABORT)) return;
    if (ptx_globaltimer_ns() - t0 > p.timeout_ns) {
      mok_ws_record_error((mok_ws_error_t *)p.err, MOK_ERROR_TIMEOUT, MOK_WS_ERR_TIMEOUT, task,
                          c, v, target);
      atomicExch(ctr + MOK_FC_ABORT, 1u);
      return;
    }
  }
}

// A stage's tag: the task number and the task itself, decoded once by the producer for both
// sides. Decoded by the consumers too (between the stage's arrival and their first wgmma), the
// fused forward was 2-8% slower at the three benchmark shapes (bench/NOTES.md v12). Thread 0 of
// the producer, before its first arrival on the stage's full barrier.
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
// from constants per copy and GATE_UP's mainloop ran at half speed; bench/NOTES.md v21).
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
    src[j] = (const char *)p.x + (valid ? (int64_t)p.row_tok[row] * p.H * 2 : 0) + 16 * c;
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
  ptx_named_barrier_sync(FK_BAR_C + cw, 128);
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
// of the next epilogue the fences made it ~0.7 us longer (bench/NOTES.md v21). s_dpend[cw]: the
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
  const int bar = FK_BAR_C + cw;
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

// DN[e]'s target: both consumer warpgroups' releases of each of expert e's DOWN tiles.
__device__ __forceinline__ uint32_t fk_dn_target(const mok_task_plan_t &plan, int32_t e) {
  return 2u * (uint32_t)(plan.n_down * (plan.mt_pre[e + 1] - plan.mt_pre[e]));
}

// The reduce, token by token (forward/rows.cuh's sum, one warp per token): lane 0 claims the next
// token from MOK_FC_CLAIM and waits until its inputs are complete, then the warp sums it. Until
// the tokens are gone. With by_last, claim c is token red_order[c], whose highest expert is b - 1
// for the bin b with red_pre[b] <= c < red_pre[b + 1]; it waits for the DOWN tiles of experts
// 0 .. b - 1 (DN; all of them, not only its own: experts finish about in order, and one watermark
// per warp then costs one wait per expert instead of K per token). Else claim c is token c, which
// waits for every DOWN tile (MOK_FC_DOWN) and for its token tile's SHARED_DOWN tiles. Claims go in
// that order, so a warp's waits pass the counters in order: it remembers what it saw complete.
// Any warp of the CTA may call it, alone.
// Each lane keeps two chunks' loads in flight (rl_reduce_token<2>): against one, the 3 helper warps
// per SM beside the shared expert left a 85 us tail instead of 320 at DeepSeek-V3, and the final
// reduce on all 12 warps took 308 us instead of 330 at Qwen3-235B (bench/NOTES.md v19).
// NOTE (deadlock freedom): a token waits only on tile tasks, which wait on nothing a reduce does.
__device__ __noinline__ void fk_reduce_claims(const fk_params_t &p, const mok_task_plan_t &plan) {
  const int lane = threadIdx.x & 31;
  // REDUCE(0)'s task number (a timed-out wait reports the REDUCE task of its token)
  const int64_t H8 = p.H / 8, reduce0 = mok_plan_num_tasks(&plan) - plan.t_tiles;
  const bool by_last = p.by_last;  // (the host sets it only without a shared expert)
  int32_t bin = 0;         // (lane 0) the bin of the last claim (by_last)
  int32_t ready = 0;       // experts 0 .. ready - 1 have all their DOWN tiles done
  int64_t tile_done = -1;  // (lane 0) token tiles up to this one: their shared tiles are done
  for (;;) {
    int64_t t = p.T;
    int32_t need = plan.E;  // experts whose DOWN tiles the token needs: 0 .. need - 1
    if (lane == 0) {
      const int64_t c = (int64_t)atomicAdd(p.counters + MOK_FC_CLAIM, 1u);
      if (c < p.T && by_last) {
        while (p.red_pre[bin + 1] <= c) bin++;
        t = p.red_order[c];
        need = bin;
      } else if (c < p.T) {
        t = c;
      }
    }
    t = __shfl_sync(0xffffffffu, t, 0);
    if (t >= p.T) return;
    need = __shfl_sync(0xffffffffu, need, 0);
    const int64_t tile = t / FK_BM;
    if (!by_last && ready < plan.E) {  // every DOWN tile, counted in MOK_FC_DOWN
      if (lane == 0)
        fk_wait(p, MOK_FC_DOWN, 2u * (uint32_t)(plan.n_down * plan.mt_pre[plan.E]),
                reduce0 + tile, 1000);
      ready = plan.E;
    }
    // Experts ready .. need - 1, 32 at a time, a counter per lane; the first one not done is waited
    // for (lane 0), then the scan goes on after it. (Expert by expert, the 128 waits of the first
    // claim cost a final reduce ~30-50 us at the Qwen3 shapes.)
    while (ready < need) {
      const int32_t e = ready + lane;
      bool done = true;
      if (e < need)
        done = ptx_ld_acquire_gpu(p.counters + p.dn_base + e) >= fk_dn_target(plan, e);
      const uint32_t ok = __ballot_sync(0xffffffffu, done);
      if (ok == 0xffffffffu) {
        ready = ready + 32 < need ? ready + 32 : need;
        continue;
      }
      ready += __ffs(~ok) - 1;
      if (lane == 0)
        fk_wait(p, (int)p.dn_base + ready, fk_dn_target(plan, ready), reduce0 + tile, 1000);
      __syncwarp();
      ready++;
    }
    if (lane == 0 && plan.n_sd > 0 && tile > tile_done) {
      fk_wait(p, (int)p.sd_base + (int)tile, 2u * (uint32_t)plan.n_sd, reduce0 + tile, 1000);
      tile_done = tile;
    }
    __syncwarp();  // each lane's acquire (and lane 0's waits) order the other lanes' reads too
    rl_reduce_token<2>(p.slot_row + t * p.K, p.K, H8, (const uint4 *)p.yk,
                       p.ys ? (const float4 *)p.ys + t * (H8 * 2) : NULL, (uint4 *)p.y + t * H8,
                       lane);
  }
}

template <int STAGED>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    fk_forward_kernel(const __grid_constant__ fk_params_t p, const __grid_constant__ fk_maps_t m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (*(volatile int32_t *)p.status == 0) return;  // invalid routing: the call computes nothing
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  uint64_t *full = (uint64_t *)(smem + fk_cfg<STAGED>::P::FULL_OFFSET);
  uint64_t *empty = (uint64_t *)(smem + fk_cfg<STAGED>::P::EMPTY_OFFSET);
  typedef typename fk_cfg<STAGED>::P P;
  // offsets: read through the read-only cache (written by the layout kernel, before this launch)
  const int32_t *s_off = p.offsets;
  int32_t *s_pre = (int32_t *)(smem + P::BYTES);  // [E + 1]

  if (threadIdx.x == 0) {
    for (int s = 0; s < FK_STAGES; s++) {
      ptx_mbar_init(&full[s], FK_FULL_ARRIVALS);
      ptx_mbar_init(&empty[s], MOK_TP_CONSUMER_WARPS);
    }
    ptx_fence_mbarrier_init();
  }
  for (int64_t e = threadIdx.x; e <= p.E; e += blockDim.x) {
    s_pre[e] = p.tile_pre[e];
  }
  // The plan lives in shared memory: registers are short in the consumers (128 accumulators).
  // NOTE: thread 0 builds it from all of s_pre, so only after every thread's loads above.
  __shared__ mok_task_plan_t s_plan;
  __shared__ int64_t s_num_tasks;
  __syncthreads();
  if (threadIdx.x == 0) {
    mok_task_plan_t q;
    q.E = (int32_t)p.E;
    q.n_gu = (int32_t)(p.I / 128);
    q.n_down = (int32_t)((p.H + FK_BN - 1) / FK_BN);
    q.n_sgu = (int32_t)(p.Is / 128);
    q.n_sd = p.Is > 0 ? q.n_down : 0;
    q.t_tiles = (int32_t)((p.T + FK_BM - 1) / FK_BM);
    q.mt_pre = s_pre;
    q.lag = p.lag;
    q.group_m = p.group_m;
    q.shared_band = p.shared_band;
    s_plan = q;
    s_num_tasks = mok_plan_num_tasks(&q);
  }
  __syncthreads();
  const mok_task_plan_t &plan = s_plan;
  const int64_t num_tasks = s_num_tasks;

  const int wg = threadIdx.x / 128, lt = threadIdx.x & 127;
  tp_ring_t ring = {0, 0};
  __shared__ int64_t s_tag[FK_STAGES];  // the task number of the tile starting in each stage
  __shared__ int4 s_task[FK_STAGES];     // and the task (fk_tag)
  __shared__ int64_t s_ticket[2];        // the producer warps' current ticket, double-buffered
  if (wg == 0) {
    if (lt == 0) {
      ptx_prefetch_tensormap(&m.wg);
      ptx_prefetch_tensormap(&m.wu);
      ptx_prefetch_tensormap(&m.a);
      ptx_prefetch_tensormap(&m.wd);
    }
    // Tasks are dealt by a ticket counter in the plan's order: thread 0 takes the next one, the
    // producer warps meet to read it (every thread needs it for GATE_UP's rows and the ring), and
    // the consumers learn it from the tag of its first stage. The tasks in flight are thus always
    // a window of about one task per CTA, which keeps the tiles that share weights together in L2.
    // NOTE: the ticket is taken only when the producer is free for the task. Taken earlier, the
    // tiles that share a weight block drift apart in their K loops: at the start of the previous
    // task, DeepSeek-V3 was 17% slower; while the previous tile's last 4 or 8 stages were issued,
    // the first stages came 2 us earlier but the mainloops ran 2-5% slower, and the traced
    // forward took longer at all three benchmark shapes (bench/NOTES.md, v11).
    int32_t stage = 0;
    // gwarps: the producer warps still here (taking tickets, loading the ring). 2 from the first
    // task of stage help_stage (the others reduce); 1 from gather_end on, past the last GATE_UP
    // task (no more gathers).
    const int64_t gather_end = mok_plan_stage_start(&plan, plan.E);
    const int64_t help_from = p.help_stage < plan.E ? mok_plan_stage_start(&plan, p.help_stage)
                                                    : gather_end;
    int gwarps = 4;
    bool reduce = false;  // this thread's warp reduces after the loop (fk_reduce_claims)
    for (uint32_t k = 0;; k++) {  // k: this CTA's task count (s_ticket's buffer)
      if (lt == 0) s_ticket[k & 1] = (int64_t)atomicAdd(p.counters + MOK_FC_TICKET, 1u);
      __syncwarp();
      ptx_named_barrier_sync(FK_BAR_P, 32 * gwarps);
      const int64_t i = s_ticket[k & 1];
      if (i >= num_tasks) {
        fk_post(&ring, full, empty, s_tag, s_task, FK_TAG_END, mok_task_t{}, lt);
        break;
      }
      // The stage of this CTA's previous task starts the search (mok_plan_stage_of).
      const mok_task_t t = mok_plan_task_from(&plan, i, &stage);
      if (t.kind == MOK_TASK_REDUCE) {  // last in the order: every load of this CTA is issued
        // The consumers reduce on this tag until the tokens are gone, then find the end tag; the
        // CTA takes no more tickets (the claims do the other REDUCE tasks' work too).
        fk_post(&ring, full, empty, s_tag, s_task, i, t, lt);
        fk_post(&ring, full, empty, s_tag, s_task, FK_TAG_END, mok_task_t{}, lt);
        reduce = true;
        break;
      }
      const int keep = i >= gather_end ? 1 : i >= help_from ? 2 : 4;
      if (keep < gwarps) {
        gwarps = keep;
        if (lt >= 32 * keep) {
          reduce = true;
          break;
        }
      }
      const fk_tile_t d = fk_describe(p, m, plan, s_off, t);
      if (d.wait >= 0 && lt == 0) {
        fk_wait(p, d.wait, d.wait_target, i);
        ptx_fence_proxy_async_global();  // a was stored by other SMs' generic stores
      }
      fk_produce(p, d, &ring, smem, full, empty, s_tag, s_task, i, t, lt, gwarps);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    if (reduce) fk_reduce_claims(p, plan);
  } else {
    const int cw = wg - 1;
    uint8_t *stage_c = smem + P::C_OFFSET + cw * fk_cfg<STAGED>::WG_C_BYTES;  // STAGED only
    if (lt == 0) s_dpend[cw] = 0;
    // Without by_last: DOWN tiles of this warpgroup, counted by the thread that releases them (in
    // shared memory: the registers beside the accumulators are few), and whether they are added to
    // MOK_FC_DOWN (the reduce waits for that), when the expert stages are over for it.
    __shared__ uint32_t s_down_tiles[2];
    if (lt == 0) s_down_tiles[cw] = 0;
    bool down_out = p.by_last;
    int64_t i;
    uint32_t *pending = NULL;  // the previous tile's deferred release (fk_deferred_release)
    {
      float acc[128];  // dead after this loop (REDUCE tasks come last): REDUCE gets the registers
      for (;;) {
        // A deferred release waits past the next tile's first issue only if that tile's first
        // stage is already here (see fk_deferred_release); thread lt 0, the one that releases,
        // decides.
        // NOTE: no __syncwarp inside the branch (lane 0 alone would wait there for the others).
        if (pending && lt == 0 &&
            !ptx_mbar_try_wait_at(ptx_smem_addr(&full[ring.stage]), ring.phase)) {
          fk_release_deferred_now(pending, lt);
          pending = NULL;
        }
        __syncwarp();
        i = fk_peek(&ring, full, s_tag);
        if (i < 0) break;
        const mok_task_t t = fk_task(&ring, s_task);
        if (t.kind == MOK_TASK_REDUCE) break;
        if (!down_out && (t.kind == MOK_TASK_SHARED_GATE_UP || t.kind == MOK_TASK_SHARED_DOWN)) {
          // the expert stages are over: the reduce helpers may start once every DOWN tile is in
          fk_release<STAGED ? 0 : -1>(p, MOK_FC_DOWN, lt == 0 ? s_down_tiles[cw] : 0u, cw, lt);
          down_out = true;
        }
        // Only what the mainloop needs is computed before it (the 128 accumulators leave few
        // registers); the rest of the tile's description after.
        const bool routed = t.kind == MOK_TASK_GATE_UP || t.kind == MOK_TASK_DOWN;
        const int64_t row0 = (routed ? s_off[t.expert] : 0) + (int64_t)FK_BM * t.m;
        const int64_t row_end = routed ? s_off[t.expert + 1] : p.T;
        float2 w = make_float2(1.0f, 1.0f);
        if (t.kind == MOK_TASK_GATE_UP)  // loaded before the mainloop: latency hides behind it
          w = epi_row_scales(p.row_w, epi_coords(row0, row_end, 0, 0, 0, cw));
        const int64_t k = t.kind == MOK_TASK_GATE_UP || t.kind == MOK_TASK_SHARED_GATE_UP ? p.H
                          : t.kind == MOK_TASK_DOWN                                     ? p.I
                                                                                        : p.Is;
        tp_consume_tile_bf16_n256<FK_BM, FK_STAGES, 0, 0>(
            &ring, smem, full, empty, (int)(k / 64), cw, row0 + 64 * cw >= row_end, acc,
            fk_deferred_release{pending, lt}, fk_down_flush{p, cw, lt});
        pending =
            fk_epilogue<STAGED>(p, m, fk_describe(p, m, plan, s_off, t), acc, w, stage_c, cw, lt);
        if (lt == 0 && t.kind == MOK_TASK_DOWN) s_down_tiles[cw]++;
      }
    }
    fk_deferred_release{pending, lt}();  // before REDUCE waits (and whatever waits on it)
    fk_flush_down(p, cw, lt);
    if (!down_out)
      fk_release<STAGED ? 0 : -1>(p, MOK_FC_DOWN, lt == 0 ? s_down_tiles[cw] : 0u, cw, lt);
    if (i >= 0) {  // a REDUCE tag: reduce until the tokens are gone, then the end tag
      fk_skip(&ring, empty);
      fk_reduce_claims(p, plan);
      i = fk_peek(&ring, full, s_tag);
    }
    fk_skip(&ring, empty);
  }
#endif
}


fk_kernel_fn fk_kernel(int staged) { return staged ? fk_forward_kernel<1> : fk_forward_kernel<0>; }

size_t fk_smem_bytes(int staged, int64_t E) {
  return staged ? fk_cfg<1>::bytes(E) : fk_cfg<0>::bytes(E);
}

/* ---------------------------------------------------------------------------------------------- */
/* Launcher                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static int fk_a16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

// The plan's lag (src/common/task_plan.h) in expert stages: enough that the tasks between an
// expert's GATE_UP tiles and its DOWN tiles exceed one wave of the grid, from the average rows
// per expert (the host does not know the real counts), and at least 3: at Qwen3-235B and
// DeepSeek-V3 (2 by the first rule) 3 was as fast or faster in 7 of 8 same-run comparisons, by
// 0-2% (docs/performance.md, "Fused forward: task order and lag"). The tuning's fused_lag, when
// set, overrides it (the bits never depend on it).
static int32_t fk_lag(const mok_fwd_fused_params_t *p, const mok_tuning_t *t, int grid) {
  const mok_fwd_local_params_t *l = &p->l;
  if (t->fused_lag > 0) return (int32_t)(t->fused_lag > l->E ? l->E : t->fused_lag);
  const int64_t tiles = (l->T * l->K / l->E + FK_BM - 1) / FK_BM + 1;  // row tiles per expert
  const int64_t per_stage = tiles * (p->I / 128 + (l->H + FK_BN - 1) / FK_BN);
  int64_t lag = (grid + per_stage - 1) / per_stage + 1;
  if (lag < 3) lag = 3;
  return (int32_t)(lag > l->E ? l->E : lag);
}

// The tensor maps of one call (NULL-free: maps of absent tensors alias one that exists and are
// never read or written).
static int fk_encode_maps(const mok_fwd_fused_params_t *p, fk_maps_t *m) {
  const mok_fwd_local_params_t *l = &p->l;
  const uint64_t T = (uint64_t)l->T, H = (uint64_t)l->H, I = (uint64_t)p->I, Is = (uint64_t)l->Is,
                 E = (uint64_t)l->E, R = (uint64_t)l->capacity_rows;
  const int shared = l->Is > 0, save = p->g_out && p->u_out,
            shared_save = shared && p->gs_out && p->us_out;
  const int bad =
      tma_encode_bf16_sw128(&m->x, l->x, T, H, 128) ||
      tma_encode_bf16_sw128(&m->wg, p->wg, E * I, H, 128) ||
      tma_encode_bf16_sw128(&m->wu, p->wu, E * I, H, 128) ||
      tma_encode_bf16_sw128(&m->a, p->a, R, I, 128) ||
      tma_encode_bf16_sw128(&m->wd, p->wd, E * H, I, 128) ||
      tma_encode_bf16_sw128(&m->yk, l->yk, R, H, 64) ||
      tma_encode_bf16_sw128(&m->a_st, p->a, R, I, 64) ||
      (save && (tma_encode_bf16_sw128(&m->g, p->g_out, R, I, 64) ||
                tma_encode_bf16_sw128(&m->u, p->u_out, R, I, 64))) ||
      (shared && (tma_encode_bf16_sw128(&m->as, p->as, T, Is, 128) ||
                  tma_encode_bf16_sw128(&m->wsg, p->wsg, Is, H, 128) ||
                  tma_encode_bf16_sw128(&m->wsu, p->wsu, Is, H, 128) ||
                  tma_encode_bf16_sw128(&m->wsd, p->wsd, H, Is, 128) ||
                  tma_encode_bf16_sw128(&m->as_st, p->as, T, Is, 64))) ||
      (shared_save && (tma_encode_bf16_sw128(&m->gs, p->gs_out, T, Is, 64) ||
                       tma_encode_bf16_sw128(&m->us, p->us_out, T, Is, 64)));
  if (bad) return 1;
  if (!shared) m->as = m->wsg = m->wsu = m->wsd = m->x;  // never read
  if (!shared) m->as_st = m->yk;                           // never written
  if (!shared_save) m->gs = m->us = m->yk;
  if (!save) m->g = m->u = m->yk;
  return 0;
}

extern "C" mokResult_t mok_fwd_fused_launch(const mok_fwd_fused_params_t *p, void *stream) {
  if (!p) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "fused forward launch: NULL params");
  const mok_fwd_local_params_t *l = &p->l;
  const int shared = l->Is > 0;
  if (!l->status || !l->offsets || !l->slot_row || !l->row_w || !l->row_tok || !l->tile_pre ||
      !l->red_pre || !l->red_order || !l->counters || !l->err || !l->yk || !p->wg || !p->wu ||
      !p->wd || !p->a ||
      (l->T > 0 && (!l->x || !l->y)) ||
      (shared && (!p->wsg || !p->wsu || !p->wsd || !p->as || !l->ys)))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "fused forward launch: NULL buffer");
  const int64_t T = l->T, H = l->H, I = p->I, Is = l->Is, E = l->E, R = l->capacity_rows;
  const mok_shape_t shape = {T, H, I, Is, E, l->K, R};
  char why[256];
  if (mok_shape_check(&shape, why, sizeof(why)) != MOK_SUCCESS)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "fused forward launch: %s", why);
  if (l->n_counters < mok_fc_count(R, E, T))
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "fused forward launch: %lld counters, %lld "
                    "needed", (long long)l->n_counters, (long long)mok_fc_count(R, E, T));
  if (!fk_a16(l->x) || !fk_a16(l->y) || !fk_a16(l->yk) || !fk_a16(p->wg) || !fk_a16(p->wu) ||
      !fk_a16(p->wd) || !fk_a16(p->a) || (p->g_out && !fk_a16(p->g_out)) ||
      (p->u_out && !fk_a16(p->u_out)) ||
      (shared && (!fk_a16(p->wsg) || !fk_a16(p->wsu) || !fk_a16(p->wsd) || !fk_a16(p->as) ||
                  !fk_a16(l->ys))))
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "fused forward launch: a tensor is not 16-byte "
                    "aligned");
  mok_tuning_t defaults;
  const mok_tuning_t *tu = p->tuning;
  if (!tu) {
    mok_tuning_default(&defaults);  // an invalid MOK_DEBUG_TIMEOUT_S leaves the defaults
    tu = &defaults;
  }
  if (T == 0) return MOK_SUCCESS;

  fk_params_t kp;
  memset(&kp, 0, sizeof(kp));
  kp.T = T, kp.H = H, kp.I = I, kp.Is = Is, kp.E = E, kp.K = l->K;
  kp.x = l->x, kp.y = l->y;
  kp.status = l->status, kp.offsets = l->offsets, kp.tile_pre = l->tile_pre;
  kp.slot_row = l->slot_row, kp.row_w = l->row_w, kp.row_tok = l->row_tok;
  kp.red_pre = l->red_pre, kp.red_order = l->red_order;
  kp.counters = l->counters, kp.err = l->err;
  kp.yk = (void *)l->yk, kp.ys = (float *)l->ys;
  kp.a = p->a, kp.as = p->as;
  kp.g_out = p->g_out, kp.u_out = p->u_out, kp.gs_out = p->gs_out, kp.us_out = p->us_out;
  kp.timeout_ns = (uint64_t)((p->timeout_s > 0 ? p->timeout_s : tu->timeout_s) * 1e9);
  kp.sgu_base = (uint32_t)mok_fc_sgu(R, E);
  kp.sd_base = (uint32_t)mok_fc_sd(R, E, T);
  kp.dn_base = (uint32_t)mok_fc_dn(R, E, T);
  kp.shared_band = tu->fused_shared_band;
  // The reduce helpers from expert stage help_stage (src/common/task_plan.h's stages): by default
  // at 85% of the expert stages without a shared expert (about when the first tokens have all
  // their experts' DOWN tiles done), none with one (its tokens wait for the shared expert, which
  // comes last).
  const int help_pct = tu->fused_help_pct >= 0 ? tu->fused_help_pct : shared ? 100 : 85;
  kp.help_stage = (int32_t)(E * help_pct / 100);
  // With helpers during the expert stages, the reduce in the layout's order (tokens by their last
  // expert, fk_reduce_claims); else in token order after every DOWN tile, counted at once per
  // warpgroup (MOK_FC_DOWN): without early helpers no token is reduced before the expert stages
  // end, so the order buys nothing and per-expert releases would only add work to every DOWN
  // tile.
  kp.by_last = !shared && kp.help_stage < E;

  fk_maps_t m;
  if (fk_encode_maps(p, &m))
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused forward launch: encoding a TMA tensor map failed "
                    "(no CUDA driver with cuTensorMapEncodeTiled?)");

  // Staged stores (fk_cfg) when their buffers fit next to the E + 1 prefix sums (E up to about
  // 480); else stores from registers.
  int device = 0, sms = 0, per_sm = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  int staged = 1;
  cudaFuncAttributes fa;
  for (; e == cudaSuccess && staged > 0; staged--) {
    memset(&fa, 0, sizeof(fa));
    e = cudaFuncGetAttributes(&fa, fk_kernel(staged));
    if (e == cudaSuccess && fk_smem_bytes(staged, E) + fa.sharedSizeBytes <= (size_t)optin) break;
  }
  const fk_kernel_fn kernel = fk_kernel(staged);
  const size_t smem = fk_smem_bytes(staged, E);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, MOK_TP_THREADS, smem);
  if (e == cudaSuccess && per_sm < 1) e = cudaErrorInvalidConfiguration;
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused forward launch: setting up %zu bytes of shared "
                    "memory per CTA: %s", smem, cudaGetErrorString(e));
  }
  const int resident = sms * per_sm;
  const int grid = p->num_sms > 0 && p->num_sms < resident ? p->num_sms : resident;
  kp.lag = fk_lag(p, tu, grid);
  // Row tiles per band of the plan's blocks: by the size of an expert's gate and up weights.
  kp.group_m = mok_tile_group_m(tu->tile_group_m, 2 * I * H * 2);

  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.gridDim = dim3((unsigned)grid, 1, 1);
  cfg.blockDim = dim3(MOK_TP_THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, kernel, kp, m);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused forward kernel launch (%d CTAs, %zu bytes of "
                    "shared memory): %s", grid, smem, cudaGetErrorString(e));
  }
  return MOK_SUCCESS;
}
