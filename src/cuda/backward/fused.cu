/*
 * backward/fused.cu: the data and weight gradients of a layer's routed experts (W = 1, or one
 * rank's experts under expert parallelism, BF16) as one persistent kernel, and at W = 1 the dx
 * reduce in it.
 *
 * It runs after the backward's prologue (src/gpu/backward.c: the context check, the gathers of x
 * and dy, RECOMPUTE's gate/up, the ds GEMM and the SwiGLU backward, and the shared expert), which
 * leaves xg, dyg, a, dg, du [R, *] and the rows' router gradients dw_row in the workspace. It walks
 * the global task order of src/common/task_plan_bwd.h without its DS and shared-expert tasks (they
 * are in the prologue): for expert stage s, the DX tiles of expert s - 1 and the DW tiles of expert
 * s - lag_dw, then REDUCE_DX:
 *
 *   DX          (e, m, n)  dxk rows [128 m, +128) of e x columns [256 n, +256) of H =
 *                          bf16([dg du] · [Wg; Wu][e]), one reduction of 2I (the chain's dxk GEMM:
 *                          A by TMA in two segments, B N-major)
 *   DW_DOWN     (e, m, n)  dWd[e] rows [128 m, +128) of H x columns [256 n, +256) of I =
 *                          Σ over e's rows in layout order of dygᵀ a
 *   DW_GATE_UP  (e, m, n)  dWg[e] (m < I / 128) or dWu[e] (m - I / 128) rows of I x columns of H =
 *                          Σ rows dgᵀ xg, duᵀ xg
 *   REDUCE_DX   (b)        dx and dtopk_w of every token (forward/rows.cuh's sum), one warp per
 *                          token claimed from MOK_FC_CLAIM, once every DX tile is stored
 *
 * Mixing the tasks was the idea: DX tiles are long reductions (2I) with few stores, DW tiles short
 * ones (an expert's rows) that store a whole fp32 tile each. Measured, the order does not matter
 * and the kernel is 1.6-2.0% slower than the chain in forward + backward, so it is opt-in
 * (tuning backward_path; docs/performance.md, "Fused backward: the first kernel"): the base for
 * the DS tiles, the gathers and the expert-parallel dy dispatch and dxk combine.
 *
 * Roles, as in the fused forward (forward/fused.cu): one CTA per SM, 384 threads. Producer thread 0
 * takes tickets (MOK_FC_TICKET) in the plan's order, the next one as a task starts, and loads each
 * task's stages by TMA, the first tagged with the task (tp_plan's tags). The two consumer
 * warpgroups compute each tile (rows 0-63 and 64-127 of it) with the grouped GEMMs' mainloops
 * (tile/pipeline.cuh: tp_consume_tile_bf16_n256 with N-major B, tp_consume_tile_wgrad_n256) and
 * store it through their staging buffers; the consumers of a CTA whose ticket reaches REDUCE_DX
 * then reduce. So every tile is computed as the chain computes it, and the reduce is the chain's
 * sum: the results are bitwise the chain's, for any grid size.
 *
 * Counters (the fused forward's MOK_FC_* region, its first words zeroed before the launch):
 *   MOK_FC_DOWN   DX tiles stored: each consumer warpgroup adds its count once, at its first task
 *                 past the last DX task (BK_PAST_DX) or at the end, after its bulk stores have
 *                 completed; the reduce waits for 2 (DX tiles)
 *   MOK_FC_TICKET, MOK_FC_CLAIM, MOK_FC_ABORT   as in the forward
 *
 * NOTE (deadlock freedom): no tile waits on anything (their inputs come from the prologue), and
 * only reduce warps wait, on MOK_FC_DOWN. Every consumer warpgroup publishes its DX count before
 * it reduces (at its REDUCE_DX tag at the latest), and reaches that point: its producer takes
 * tickets until they run out, waiting only for its own consumers to free stages. Tickets are
 * taken only by running CTAs, so the launch needs no co-residency (it is not cooperative). A wait
 * that times out reports MOK_ERROR_TIMEOUT and raises MOK_FC_ABORT (tile/counters.cuh).
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/task_plan_bwd.h"
#include "common/workspace.h"
#include "cuda/backward/fused_params.cuh"
#include "cuda/forward/rows.cuh"
#include "cuda/gemm/gemm.h"
#include "cuda/gemm/wgrad_tile.cuh"
#include "cuda/tile/counters.cuh"
#include "cuda/tile/epilogue.cuh"
#include "cuda/tile/pipeline.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's backward kernels target sm_90a (Hopper) and newer"
#endif

// Register split after setmaxnreg (grouped_gemm.cu's note): the consumers hold 128 accumulators
// beside the staged epilogues (at the launch's 168 each they spilled 28-48 bytes); the producer's
// ticket loop fits 48 (at 40: 4 bytes of spills). With 88 for the producer warpgroup, whose warps
// 1-3 then reduced tokens beside the tiles, and 208 for the consumers, the backward measured the
// same within noise (docs/performance.md, "Fused backward: the first kernel").
enum { BK_PRODUCER_REGS = 48, BK_CONSUMER_REGS = 224 };
static_assert(BK_PRODUCER_REGS + 2 * BK_CONSUMER_REGS <= 3 * 168, "the launch's registers");

// Warp 0: pre[e] = row tiles of experts before e (pre[E] = all), from the offsets. Each lane sums
// a run of experts, a scan over the lanes gives the runs' starts.
__device__ __forceinline__ void bk_tile_prefix(const int32_t *off, int E, int32_t *pre, int lane) {
  const int per = (E + 31) / 32, e0 = lane * per, e1 = e0 + per < E ? e0 + per : E;
  int32_t sum = 0;
  for (int e = e0; e < e1; e++) sum += (__ldg(off + e + 1) - __ldg(off + e) + BK_BM - 1) / BK_BM;
  int32_t inc = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t v = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += v;
  }
  int32_t run = inc - sum;
  for (int e = e0; e < e1; e++) {
    pre[e] = run;
    run += (__ldg(off + e + 1) - __ldg(off + e) + BK_BM - 1) / BK_BM;
  }
  if (lane == 31) pre[E] = inc;
}

// The plan of this call (thread 0): task_plan_bwd.h's order with only DX, DW and REDUCE_DX tasks.
__device__ __forceinline__ mok_bwd_plan_t bk_make_plan(const bk_params_t &p, const int32_t *pre,
                                                       bool reduce) {
  mok_bwd_plan_t q;
  memset(&q, 0, sizeof(q));
  const int32_t mi = (int32_t)((p.I + BK_BM - 1) / BK_BM);
  const int32_t mh = (int32_t)((p.H + BK_BM - 1) / BK_BM);
  q.E = (int32_t)p.E;
  q.n_dx = (int32_t)((p.H + BK_BN - 1) / BK_BN);
  q.dwd_m = mh, q.dwd_n = (int32_t)((p.I + BK_BN - 1) / BK_BN);
  q.dwgu_m = 2 * mi, q.dwgu_n = q.n_dx;  // the gate's row tiles, then the up's
  q.t_tiles = reduce ? (int32_t)((p.T + BK_BM - 1) / BK_BM) : 0;
  q.mt_pre = pre;
  q.lag_dx = 1, q.lag_dw = p.lag_dw;
  q.group_m = p.group_m;
  return q;
}

// Producer thread: a stage that carries only a tag (no data): the end, a REDUCE_DX task, or a DW
// tile of an expert without rows. Its full barrier's one arrival completes the phase.
__device__ __forceinline__ void bk_post(tp_ring_t *ring, uint64_t *full, uint64_t *empty,
                                        int4 tag) {
  ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
  tp_post_tag<bk_plan>(full, ring->stage, tag);
  ptx_mbar_arrive(&full[ring->stage]);
  tp_ring_advance<BK_STAGES>(ring);
}

// Consumer side: releases a tag-only stage (lane 0 of each consumer warp, as for data stages).
__device__ __forceinline__ void bk_skip(tp_ring_t *ring, uint64_t *empty) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) ptx_mbar_arrive(&empty[ring->stage]);
  tp_ring_advance<BK_STAGES>(ring);
}

// One DW tile's operands and output: C[e] rows [c_row0, +128) x columns [c_col0, +256).
typedef struct {
  const CUtensorMap *a, *b, *c_map;
  void *c;
  int n, k;  // C[e] is [n, k]
  int c_row0, c_col0;
} bk_dw_t;

__device__ __forceinline__ bk_dw_t bk_dw(const bk_params_t &p, const bk_maps_t &m, int kind,
                                         int mt, int nt) {
  bk_dw_t d;
  const int mi = (int)((p.I + BK_BM - 1) / BK_BM);
  if (kind == MOK_BTASK_DW_DOWN) {  // dWd [H, I] = dygᵀ a
    d.a = &m.dyg_w, d.b = &m.a_w, d.c_map = &m.dwd, d.c = p.dwd;
    d.n = (int)p.H, d.k = (int)p.I;
  } else {  // dWg, dWu [I, H] = dgᵀ xg, duᵀ xg
    const bool gate = mt < mi;
    mt = gate ? mt : mt - mi;
    d.a = gate ? &m.dg_w : &m.du_w, d.b = &m.xg_w;
    d.c_map = gate ? &m.dwg : &m.dwu, d.c = gate ? p.dwg : p.dwu;
    d.n = (int)p.I, d.k = (int)p.H;
  }
  d.c_row0 = BK_BM * mt, d.c_col0 = BK_BN * nt;
  return d;
}

// Producer thread: the stages of task t (tag `tag` in its first stage).
__device__ __forceinline__ void bk_produce(const bk_params_t &p, const bk_maps_t &m, mok_task_t t,
                                           int4 tag, tp_ring_t *ring, uint8_t *smem,
                                           uint64_t *full, uint64_t *empty) {
  const int64_t e0 = __ldg(p.offsets + t.expert), e1 = __ldg(p.offsets + t.expert + 1);
  if (t.kind == MOK_BTASK_DX) {
    const int kb_i = (int)(p.I / 64);
    tp_b_nmajor_t b;
    b.map = &m.wg;
    b.k_row0 = t.expert * (int)p.I;  // [E I, H]: expert e's K rows
    b.n0 = BK_BN * t.n;
    b.k_split = kb_i;
    b.map_a2 = &m.du;
    b.map2 = &m.wu;
    b.k_row2 = b.k_row0;
    tp_produce_tile_bn<BK_BM, BK_BN, BK_STAGES, BK_C_BYTES>(
        ring, smem, full, empty, &m.dg, (int)(e0 + (int64_t)BK_BM * t.m), b, 2 * kb_i, tag);
    return;
  }
  const int k_blocks = (int)((e1 - e0 + 63) / 64);
  if (k_blocks == 0) {  // an expert without rows: its DW tiles store zeros (or nothing)
    bk_post(ring, full, empty, tag);
    return;
  }
  const bk_dw_t d = bk_dw(p, m, t.kind, t.m, t.n);
  ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
  tp_post_tag<bk_plan>(full, ring->stage, tag);
  tp_produce_tile_wgrad<BK_STAGES>(ring, smem, full, empty, d.a, d.b, (int)e0, k_blocks,
                                   d.c_row0, d.c_col0);
}

// Consumer warpgroup cw adds its `count` DX tiles to MOK_FC_DOWN once all its stores are done:
// the warpgroup meets (the stores from registers), then thread lt 0 waits for its bulk stores to
// complete and fences them against the release (fk_release's steps in the forward).
__device__ __forceinline__ void bk_publish(const bk_params_t &p, uint32_t count, int cw, int lt) {
  __syncwarp();
  ptx_named_barrier_sync(MOK_BAR_GEMM_EPI + cw, 128);
  if (lt == 0) {
    ptx_bulk_wait_group<0>();
    ptx_fence_proxy_async_global();
    __threadfence();
    if (count) ptx_red_release_gpu_add(p.counters + MOK_FC_DOWN, count);
  }
  __syncwarp();
}

// REDUCE_DX, token by token, one warp per token claimed from MOK_FC_CLAIM (any consumer warp,
// alone):
// once every DX tile is stored (MOK_FC_DOWN = 2 per tile), forward/rows.cuh's sum of the token's
// bf16 dxk rows in slot order from its fp32 dxs row, and its router-weight gradients.
// NOTE (deadlock freedom): it waits only on DX tiles, which wait on nothing.
__device__ __forceinline__ void bk_reduce_claims(const bk_params_t &p,
                                                 const mok_bwd_plan_t &plan) {
  if (plan.t_tiles == 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t H8 = p.H / 8, reduce0 = mok_bplan_num_tasks(&plan) - plan.t_tiles;
  const uint32_t target = 2u * (uint32_t)(plan.n_dx * plan.mt_pre[plan.E]);
  bool ready = false;
  for (;;) {
    int64_t t = p.T;
    if (lane == 0) {
      t = (int64_t)atomicAdd(p.counters + MOK_FC_CLAIM, 1u);
      if (t < p.T && !ready)
        tile_wait_inline(p.counters, MOK_FC_DOWN, target, reduce0 + t / BK_BM, p.timeout_ns,
                         p.err, 1000);
    }
    t = __shfl_sync(0xffffffffu, t, 0);
    if (t >= p.T) return;
    ready = true;
    __syncwarp();  // lane 0's acquire orders the other lanes' reads of dxk too
    const int32_t *rows = p.slot_row + t * p.K;
    for (int64_t k = lane; k < p.K; k += 32) {
      const int32_t r = rows[k];
      p.dtopk_w[t * p.K + k] = r >= 0 ? p.dw_row[r] : 0.0f;
    }
    rl_reduce_token<2>(rows, p.K, H8, (const uint4 *)p.dxk,
                       p.dxs ? (const float4 *)p.dxs + t * (H8 * 2) : NULL, (uint4 *)p.dx + t * H8,
                       lane);
  }
}

template <int WEPI>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    bk_backward_kernel(const __grid_constant__ bk_params_t p, const __grid_constant__ bk_maps_t m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  typedef bk_plan P;
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  uint64_t *full = (uint64_t *)(smem + P::FULL_OFFSET);
  uint64_t *empty = (uint64_t *)(smem + P::EMPTY_OFFSET);
  const int4 *tags = (const int4 *)(smem + P::TAGS_OFFSET);
  int32_t *s_pre = (int32_t *)(smem + P::TAGS_OFFSET + P::TAGS_BYTES);  // [E + 1]
  // A context that does not match: the offsets are all 0, so there are no DX tiles and the DW
  // tiles store zeros (or leave accumulated gradients); dx and dtopk_w keep their contents.
  const bool valid = *(volatile int32_t *)p.status != 0;

  if (threadIdx.x == 32) {
    tp_init_barriers<BK_STAGES>(full, empty);
    ptx_prefetch_tensormap(&m.dg);
    ptx_prefetch_tensormap(&m.wg);
    ptx_prefetch_tensormap(&m.xg_w);
    ptx_prefetch_tensormap(&m.dyg_w);
  }
  if (threadIdx.x < 32) bk_tile_prefix(p.offsets, (int)p.E, s_pre, threadIdx.x);
  __shared__ mok_bwd_plan_t s_plan;
  __shared__ int64_t s_num_tasks, s_dx_end;
  __syncthreads();
  if (threadIdx.x == 0) {
    s_plan = bk_make_plan(p, s_pre, p.reduce && valid);
    s_num_tasks = mok_bplan_num_tasks(&s_plan);
    s_dx_end = mok_bplan_stage_start(&s_plan, s_plan.E + 1);  // DX of expert E - 1: stage E
  }
  __syncthreads();
  const mok_bwd_plan_t &plan = s_plan;

  const int wg = threadIdx.x / 128, lt = threadIdx.x & 127;
  tp_ring_t ring = {0, 0};
  if (wg == 0) {
    // Producer thread 0; the warpgroup's other warps only give up their registers.
    ptx_setmaxnreg_dec<BK_PRODUCER_REGS>();
    if (lt == 0) {
      const int64_t num_tasks = s_num_tasks, dx_end = s_dx_end;
      // NOTE: the next ticket is taken as a task starts, so that the atomic's latency hides
      // under the task's stages (DW tiles have only an expert's rows: 8 to 16 K blocks at the
      // benchmark shapes). Taken after the task's stages were issued, the backward measured the
      // same within 1% (docs/performance.md, "Fused backward: the first kernel").
      int64_t i = (int64_t)atomicAdd(p.counters + MOK_FC_TICKET, 1u);
      for (;;) {
        if (i >= num_tasks) {
          bk_post(&ring, full, empty, make_int4(BK_TAG_END, 0, 0, 0));
          break;
        }
        const mok_task_t t = mok_bplan_task(&plan, i);
        const int4 tag = make_int4(t.kind | (i >= dx_end ? BK_PAST_DX : 0), t.expert, t.m, t.n);
        if (t.kind == MOK_BTASK_REDUCE_DX) {  // last in the order: this CTA's consumers reduce
          bk_post(&ring, full, empty, tag);
          bk_post(&ring, full, empty, make_int4(BK_TAG_END, 0, 0, 0));
          break;
        }
        const int64_t next = (int64_t)atomicAdd(p.counters + MOK_FC_TICKET, 1u);
        bk_produce(p, m, t, tag, &ring, smem, full, empty);
        i = next;
      }
    }
  } else {
    ptx_setmaxnreg_inc<BK_CONSUMER_REGS>();
    const int cw = wg - 1;
    uint8_t *stage_c = smem + P::C_OFFSET + cw * (BK_C_BYTES / 2);
    const int bar = MOK_BAR_GEMM_EPI + cw;
    uint32_t dx_tiles = 0;  // this warpgroup's DX tiles (thread lt 0 publishes them)
    bool published = false, reduce = false;
    {
      float acc[128];  // dead after the loop: the reduce gets the registers
      for (;;) {
        ptx_mbar_wait(&full[ring.stage], ring.phase);
        const int4 tag = tags[ring.stage];
        if (!published && (tag.x < 0 || (tag.x & BK_PAST_DX))) {
          bk_publish(p, dx_tiles, cw, lt);
          published = true;
        }
        if (tag.x < 0) {
          bk_skip(&ring, empty);
          break;
        }
        const int kind = tag.x & BK_KIND_MASK;
        if (kind == MOK_BTASK_REDUCE_DX) {
          bk_skip(&ring, empty);
          reduce = true;
          continue;
        }
        const int64_t e0 = __ldg(p.offsets + tag.y), e1 = __ldg(p.offsets + tag.y + 1);
        if (kind == MOK_BTASK_DX) {  // a warpgroup whose 64 rows are past the expert's end idles
          const int64_t row0 = e0 + (int64_t)BK_BM * tag.z, wr0 = row0 + 64 * cw;
          const int n0 = BK_BN * tag.w;
          tp_consume_tile_bf16_n256<BK_BM, BK_STAGES, BK_C_BYTES, 1>(
              &ring, smem, full, empty, (int)(2 * p.I / 64), cw, wr0 >= e1, acc);
          if (wr0 + 64 <= e1) {
            epi_store_staged_bf16<0, 0>(acc, stage_c, &m.dxk, n0, (int)p.H, (int)wr0, bar, lt);
            epi_store_staged_bf16<1, -1>(acc, stage_c + 16384, &m.dxk, n0, (int)p.H, (int)wr0,
                                         bar, lt);
          } else if (wr0 < e1) {
            epi_store_bf16<128>(acc, (__nv_bfloat16 *)p.dxk,
                                epi_coords(row0, e1, n0, (int)p.H, p.H, cw));
          }
          if (lt == 0) dx_tiles++;
          continue;
        }
        const bk_dw_t d = bk_dw(p, m, kind, tag.z, tag.w);
        const int k_blocks = (int)((e1 - e0 + 63) / 64);
        if (k_blocks == 0) {  // an expert without rows
          bk_skip(&ring, empty);
          gw_store_zeros<WEPI>(d.c, tag.y, d.n, d.k, d.c_row0, d.c_col0, cw);
          continue;
        }
        const int last_rows = (int)(e1 - e0) - (k_blocks - 1) * 64;
        tp_consume_tile_wgrad_n256<BK_STAGES>(&ring, smem, full, empty, k_blocks, last_rows, cw,
                                              acc);
        gw_store_tile<WEPI>(acc, stage_c, d.c_map, d.c, tag.y, d.n, d.k, d.c_row0, d.c_col0, cw,
                            bar, lt);
      }
    }
    if (reduce) bk_reduce_claims(p, plan);
    if (lt == 0) ptx_bulk_wait_group_all();  // stores done before the CTA retires
  }
#endif
}

bk_kernel_fn bk_kernel(int wgrad_epilogue) {
  switch (wgrad_epilogue) {
    case MOK_GG_EPI_STORE_BF16: return bk_backward_kernel<MOK_GG_EPI_STORE_BF16>;
    case MOK_GG_EPI_ACCUM_F32: return bk_backward_kernel<MOK_GG_EPI_ACCUM_F32>;
    default: return bk_backward_kernel<MOK_GG_EPI_STORE_F32>;
  }
}

size_t bk_smem_bytes(int64_t E) {
  return (size_t)bk_plan::ALLOC_BYTES + bk_plan::TAGS_BYTES + (size_t)(E + 1) * 4;
}

extern "C" mokResult_t mok_bwd_fused_preload(void) {
  cudaFuncAttributes a;
  const int epis[3] = {MOK_GG_EPI_STORE_BF16, MOK_GG_EPI_STORE_F32, MOK_GG_EPI_ACCUM_F32};
  for (int i = 0; i < 3; i++)
    if (cudaFuncGetAttributes(&a, bk_kernel(epis[i])) != cudaSuccess) {
      cudaGetLastError();
      return MOK_ERROR_CUDA;
    }
  return MOK_SUCCESS;
}
