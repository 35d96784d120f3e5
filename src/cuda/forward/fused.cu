/*
 * forward/fused.cu: the forward MoE layer on one GPU (W = 1, BF16) as one persistent kernel.
 *
 * It runs after the layout kernel (forward/layout.cu) and walks the global task order of
 * src/common/task_plan.h: per expert stage s the GATE_UP tiles of expert s and the DOWN tiles of expert
 * s - L, then the shared expert by bands of token tiles (SHARED_GATE_UP tiles of band u and
 * SHARED_DOWN tiles of band u - 1), then REDUCE; expert parallel, the shared expert first and no
 * REDUCE (forward/fused_ep.cuh). Each CTA takes the tasks a ticket counter deals
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
 *   GATE_UP tiles; the forward 1.0-2.5% faster (docs/performance.md, "Fused forward: reduce order").
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
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/task_plan.h"
#include "cuda/forward/fused_consumer.cuh"
#include "cuda/forward/fused_ep.cuh"
#include "cuda/forward/fused_params.cuh"
#include "cuda/forward/fused_producer.cuh"
#include "cuda/forward/fused_reduce.cuh"
#include "cuda/tile/pipeline.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's forward kernels target sm_90a (Hopper) and newer"
#endif

template <int STAGED>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    fk_forward_kernel(const __grid_constant__ fk_params_t p, const __grid_constant__ fk_maps_t m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Invalid routing: the call computes nothing (expert parallel: it still signals its dispatch).
  const bool valid = *(volatile int32_t *)p.status != 0;
  if (!valid && p.n_comm == 0) return;
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
    q.no_reduce = p.no_reduce;
    q.shared_first = p.no_reduce;  // expert parallel: the shared expert while rows are in flight
    s_plan = q;
    s_num_tasks = valid ? mok_plan_num_tasks(&q) : 0;
  }
  // Expert parallel: this call's dispatch epoch, then the dispatch units (fused_ep.cuh), by the
  // whole CTA before the roles and their register split.
  __shared__ uint64_t s_epoch;
  if (threadIdx.x == 0) s_epoch = fk_dispatch_epoch(p);
  __syncthreads();
  if (p.n_comm > 0) fk_dispatch(p, s_epoch);
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
    // forward took longer at all three benchmark shapes (docs/performance.md, "Fused forward: tickets").
    int32_t stage = 0;
    // gwarps: the producer warps still here (taking tickets, loading the ring). 2 from the first
    // task of stage help_stage (the others reduce); 1 from gather_end on, past the last GATE_UP
    // task (no more gathers).
    const int64_t experts0 = mok_plan_experts_begin(&plan);
    const int64_t gather_end = experts0 + mok_plan_stage_start(&plan, plan.E);
    const int64_t help_from =
        p.help_stage < plan.E ? experts0 + mok_plan_stage_start(&plan, p.help_stage) : gather_end;
    int gwarps = 4;
    bool reduce = false;  // this thread's warp reduces after the loop (fk_reduce_claims)
    uint32_t arrived = 1u << p.tp.rank;  // expert parallel (thread 0): ranks whose rows are here
    for (uint32_t k = 0;; k++) {  // k: this CTA's task count (s_ticket's buffer)
      if (lt == 0) s_ticket[k & 1] = (int64_t)atomicAdd(p.counters + MOK_FC_TICKET, 1u);
      __syncwarp();
      ptx_named_barrier_sync(MOK_BAR_FUSED_TICKET, 32 * gwarps);
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
      if (p.n_comm > 0 && t.kind == MOK_TASK_GATE_UP) {  // rows of other ranks: their dispatch
        const int64_t e0 = s_off[t.expert];
        const int64_t end = d.row0 + FK_BM < d.row_end ? d.row0 + FK_BM : d.row_end;
        if (lt == 0) fk_wait_sources(p, t.expert, d.row0 - e0, end - e0, s_epoch, &arrived);
        ptx_named_barrier_sync(MOK_BAR_FUSED_TICKET, 32 * gwarps);  // the gathers after it
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
    bool down_out = p.by_last || plan.no_reduce;  // no reduce: nothing waits for MOK_FC_DOWN
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
  if (p.n_comm > 0) tp_epoch_end(p.tp, TP_EPOCH_DISPATCH, s_epoch);  // every thread
#endif
}

fk_kernel_fn fk_kernel(int staged) { return staged ? fk_forward_kernel<1> : fk_forward_kernel<0>; }

size_t fk_smem_bytes(int staged, int64_t E) {
  return staged ? fk_cfg<1>::bytes(E) : fk_cfg<0>::bytes(E);
}

extern "C" int mok_fwd_fused_fault_take(mok_kernel_fault_t *out) { return ptx_fault_take(out); }

extern "C" mokResult_t mok_fwd_fused_preload(void) {
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, fk_forward_kernel<0>) != cudaSuccess ||
      cudaFuncGetAttributes(&a, fk_forward_kernel<1>) != cudaSuccess) {
    cudaGetLastError();
    return MOK_ERROR_CUDA;
  }
  return MOK_SUCCESS;
}
