/*
 * transport.cuh: device functions of the NVLink transport, for communication CTAs: system-scope
 * flags and counters, bounded waits that report who waited for what, token dispatch to the other
 * ranks that hold a token's experts, and the combine that sends expert rows back to their home
 * rank and sums them in slot order. Only rows that change rank move: a token's row for its own
 * rank's experts, and those experts' result rows, stay where they are (the sum reads them there).
 * The standalone kernel in transport.cu strings them together; the persistent kernel will call
 * the same functions from its communication CTAs.
 *
 * Everything here sees raw peer pointers (mok_tp_params_t::peer, read once at setup by
 * nccl_window.cu) and our own counters; no NCCL device code.
 *
 * Counters never get cleared. Each CTA of a sender adds 1 to a counter per call, so after call
 * number `epoch` the receiver waits for epoch * (sender's CTAs). The calls are counted on the
 * device (tp_epoch_begin / tp_epoch_end), so a call captured in a CUDA graph counts at every
 * replay. (The work-item counters, in ordinary device memory, are zeroed one call ahead:
 * tp_claim.)
 *
 * Window regions (mok_tp_window_layout_t, same offsets on every rank):
 *   disp_ctr  [W] u64             dispatch counters, by source rank
 *   comb_ctr  [W] u64             combine counters, by expert rank
 *   recv_x    [W * T_max, H] bf16 tokens received, in (source rank, token) order; the block of
 *                                 this rank's own tokens is left unwritten (fp8-block layers: each
 *                                 row the token's H e4m3 bytes, then its H / 128 fp32 scales)
 *   recv_meta [W * T_max, K + 1]  source token index, then this rank's row of each slot or -1
 *                                 (same blocks as recv_x)
 *   comb      [T_max, K, H] bf16  expert rows of this rank's tokens from other ranks' experts,
 *                                 by (token, slot)
 *   (layers: no comb, but row_w, row_src, recv_x2, and yk [R, H] bf16 and yk_w [R] fp32, the
 *   expert outputs of this rank's rows (the forward's yk, the backward's dxk and router-weight
 *   gradients), which the home ranks' reduce reads in place: comm.h)
 *
 * Measured on two H200s (docs/performance.md, "Transport: push, pull and local rows"): 16-byte
 * stores from registers into the peer's window carry ~345 GB/s per direction once the local rows
 * stay out of the stream; pulling rows (loads from the peer, the sum fused) carried ~325.
 */
#ifndef MOK_CUDA_TRANSPORT_CUH
#define MOK_CUDA_TRANSPORT_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda/comm/comm.h"
#include "cuda/ptx/ptx.cuh"

#define TP_THREADS 512 /* threads of a communication CTA */
#define TP_UNROLL 8    /* 16-byte chunks in flight per lane: 16 warps x 4 KB = 64 KB per SM */

static_assert(TP_THREADS % 32 == 0 && TP_THREADS <= 1024, "whole warps");
static_assert(MOK_MAX_RANKS <= 32, "one lane per rank in the waits");

/* ---------------------------------------------------------------------------------------------- */
/* PTX: 16-byte accesses and the SM id (system-scope counters and the timer are in ptx.cuh)       */
/* ---------------------------------------------------------------------------------------------- */

__device__ __forceinline__ int tp_smid(void) {
  uint32_t r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return (int)r;
}

// Inputs of this rank that nobody writes during the launch: the read-only path.
__device__ __forceinline__ uint4 tp_ld_input_v4(const void *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// NOTE: data other GPUs wrote during this launch is read at L2 (.cg), after an acquire of the
// counter that published it; L1 is not coherent with peer writes.
__device__ __forceinline__ uint4 tp_ld_peer_v4(const void *p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// tp_ld_peer_v4 when `pred`, else zeros: straight-line code, so a batch of these stays a batch.
__device__ __forceinline__ uint4 tp_ld_peer_v4_if(const void *p, int pred) {
  uint4 v;
  asm volatile(
      "{\n\t.reg .pred q;\n\t"
      "setp.ne.b32 q, %5, 0;\n\t"
      "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
      "@q ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(pred)
      : "memory");
  return v;
}

__device__ __forceinline__ int32_t tp_ld_peer_i32(const int32_t *p) {
  int32_t v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void tp_st_v4(void *p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

/* ---------------------------------------------------------------------------------------------- */
/* Call numbers (epochs)                                                                           */
/* ---------------------------------------------------------------------------------------------- */

enum { TP_EPOCH_LAYOUT = 0, TP_EPOCH_DISPATCH = 1, TP_EPOCH_COMBINE = 2 };

// The call number of this launch for its kind: one more than the calls before it. Every CTA reads
// the same value: only the last CTA of the launch to finish advances it (tp_epoch_end), after
// every CTA has read it.
__device__ __forceinline__ uint64_t tp_epoch_begin(const mok_tp_params_t &p, int kind) {
  return *(volatile uint64_t *)&p.lay.epoch[kind] + 1;
}

// The end of every CTA of a launch that began call `e` of `kind` (all threads): the last CTA to
// get here makes e the kind's count, which the next launch on the stream reads.
__device__ __forceinline__ void tp_epoch_end(const mok_tp_params_t &p, int kind, uint64_t e) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&p.lay.epoch_done[kind], 1u) == gridDim.x - 1) {
      p.lay.epoch_done[kind] = 0;
      *(volatile uint64_t *)&p.lay.epoch[kind] = e;
    }
  }
}

// The current layout call's number, after its layout kernel (the all-gathered slots' parity).
__device__ __forceinline__ uint64_t tp_layout_epoch(const mok_tp_params_t &p) {
  return *(volatile uint64_t *)&p.lay.epoch[TP_EPOCH_LAYOUT];
}

/* ---------------------------------------------------------------------------------------------- */
/* Errors and bounded waits                                                                        */
/* ---------------------------------------------------------------------------------------------- */

// Records the first failure of the launch; later ones are dropped. `fatal` also raises `abort`,
// which makes every other wait of the launch give up at its next poll.
__device__ __forceinline__ void tp_record_error(mok_tp_error_t *err, int code, int fatal, int rank,
                                                int counter, int peer, uint64_t value,
                                                uint64_t target, int64_t a, int64_t b,
                                                int64_t c) {
  if (atomicCAS(&err->code, 0, code) == 0) {
    err->rank = rank;
    err->sm = tp_smid();
    err->counter = counter;
    err->peer = peer;
    err->value = value;
    err->target = target;
    err->a = a;
    err->b = b;
    err->c = c;
  }
  if (fatal) atomicExch(&err->abort, 1);
}

// One thread waits until *ctr >= target (acquire, system scope). On timeout it records
// {rank, sm, counter, peer, value, target} and returns 0; it also returns 0, silently, once
// another wait of the launch has failed.
static __device__ __noinline__ int tp_wait_geq(const uint64_t *ctr, uint64_t target,
                                        const mok_tp_params_t &p, int counter, int peer) {
  uint64_t v = ptx_ld_acquire_sys_u64(ctr);
  if (v >= target) return 1;
  const uint64_t t0 = ptx_globaltimer_ns();
  for (uint32_t i = 1;; i++) {
    v = ptx_ld_acquire_sys_u64(ctr);
    if (v >= target) return 1;
    if ((i & 63) == 0) {
      if (*(volatile int32_t *)&p.err->abort) return 0;
      if (ptx_globaltimer_ns() - t0 > p.timeout_ns) {
        tp_record_error(p.err, MOK_ERROR_TIMEOUT, 1, p.rank, counter, peer, v, target, 0, 0, 0);
        return 0;
      }
    }
  }
}

// The whole CTA waits for counters[s] >= epoch * ctas[s] for every rank s (lane s of warp 0
// polls rank s). Returns 0 in every thread when any wait failed. Call from all threads.
__device__ __forceinline__ int tp_cta_wait_ranks(const uint64_t *counters, uint64_t epoch,
                                                 const mok_tp_params_t &p, int counter) {
  int ok = 1;
  if (threadIdx.x < (unsigned)p.nranks) {
    const int s = threadIdx.x;
    ok = tp_wait_geq(counters + s, epoch * (uint64_t)p.lay.num_ctas[s], p, counter, s);
  }
  return __syncthreads_and(ok);
}

// Publishes everything this CTA wrote, then adds 1 to counter `me` in every rank's window.
// NOTE: bar.sync orders the other threads' stores before thread 0's fence and release, and the
// release is cumulative at system scope: data before flag, for every peer.
__device__ __forceinline__ void tp_cta_signal_ranks(const mok_tp_params_t &p, size_t region) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int d = 0; d < p.nranks; d++)
      ptx_red_release_sys_add_u64((uint64_t *)(p.peer[d] + region) + p.rank, 1);
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* Row arithmetic                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

// Two floats to a bf16 pair (round to nearest even), low half first.
__device__ __forceinline__ uint32_t tp_pack_bf16x2(float lo, float hi) {
  return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
         ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

__device__ __forceinline__ float tp_bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float tp_bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ uint32_t tp_scale_bf16x2(uint32_t v, float s) {
  return tp_pack_bf16x2(tp_bf16_lo(v) * s, tp_bf16_hi(v) * s);
}

__device__ __forceinline__ uint4 tp_scale_v4(uint4 v, float s) {
  return make_uint4(tp_scale_bf16x2(v.x, s), tp_scale_bf16x2(v.y, s), tp_scale_bf16x2(v.z, s),
                    tp_scale_bf16x2(v.w, s));
}

__device__ __forceinline__ void tp_acc_bf16x2(float &a, float &b, uint32_t v) {
  a += tp_bf16_lo(v);
  b += tp_bf16_hi(v);
}

// The sum's tokens go to warps round-robin over the whole grid.
__device__ __forceinline__ int64_t tp_grid_warp(void) {
  return (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
}
__device__ __forceinline__ int64_t tp_grid_warps(void) {
  return (int64_t)gridDim.x * (blockDim.x >> 5);
}

// The items that cross NVLink (dispatch's tokens, the combine's received tokens) are claimed one at
// a time from a counter by whichever warp is free (lane 0 adds 1; the claim for the next item is
// made while the current one moves). A warp moves an 8 KB row at a few GB/s (latency-bound), so a
// static split that leaves some warps one item behind costs microseconds at the end of each call:
// claiming took dispatch from 321-329 to 342-354 GB/s (docs/performance.md,
// "Transport: rows claimed by warps"). Consecutive items still land on different SMs, so every SM
// mixes destinations. The counters are used by the parity of the call (epoch) and each call zeroes
// the next call's (tp_claims_reset_next), so nothing clears them between calls, and a call that
// failed half-way leaves its successor clean.
enum { TP_CLAIM_DISPATCH = 0, TP_CLAIM_COMBINE = 2 };  // p.lay.claim[kind + epoch % 2]
__device__ __forceinline__ int64_t tp_claim(uint32_t *ctr, int lane) {
  return lane == 0 ? (int64_t)atomicAdd(ctr, 1u) : 0;
}
__device__ __forceinline__ void tp_claims_reset_next(const mok_tp_params_t &p, int kind,
                                                     uint64_t epoch) {
  if (blockIdx.x == 0 && threadIdx.x == 0) p.lay.claim[kind + ((epoch + 1) & 1)] = 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* Dispatch                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

// A layer's row `row` of rank d's experts: its router weight and its token's source (recv_x
// position pos >= 0 on d, or -(t + 1) for d's own token t), into d's window.
__device__ __forceinline__ void tp_put_row_map(const mok_tp_params_t &p, int d, int32_t row,
                                               float w, int32_t src) {
  ((float *)(p.peer[d] + p.win.row_w))[row] = w;
  ((int32_t *)(p.peer[d] + p.win.row_src))[row] = src;
}

// Sends the tokens: token t goes, once, to every other rank d with token_pos[t, d] >= 0 (any of
// its slots routes there): x[t] to recv_x[pos] and {t, rows of its slots on d} to recv_meta[pos]
// in d's window. A token's own rank gets nothing: its rows stay in x, where the sum and (in the
// persistent kernel) the GEMMs read them, and its block of recv_x stays unwritten. A warp per
// token (whole rows: splitting rows into 2 KB items dealt to different warps was slower;
// docs/performance.md, "Transport: push, pull and local rows").
// FP8 (p.xq): a row is the token's H e4m3 bytes, then its H / 128 scale words (a template
// argument: a run-time choice made the transport kernel spill).
template <bool FP8>
__device__ __forceinline__ void tp_dispatch_rows(const mok_tp_params_t &p, uint64_t epoch) {
  const int lane = threadIdx.x & 31;
  const int W = p.nranks;
  const int64_t K = p.K, H = p.H, chunks = FP8 ? H / 16 : H / 8;  // 16-byte chunks per row
  const int64_t meta_ints = K + 1;
  const size_t recv = p.recv_x2 ? p.win.recv_x2 : p.win.recv_x;  // a layer's backward: dy
  uint32_t *claim = p.lay.claim + TP_CLAIM_DISPATCH + (epoch & 1);
  for (int64_t nx = tp_claim(claim, lane), t = __shfl_sync(0xffffffffu, nx, 0); t < p.T;
       t = __shfl_sync(0xffffffffu, nx, 0)) {
    nx = tp_claim(claim, lane);
    // Everything the token needs is loaded at once, so its row loads wait on one round trip, not
    // three: lane d the token's position on rank d, lane j in [1, K] slot j - 1's row and expert.
    const int32_t pos = (lane < W && lane != p.rank) ? p.lay.token_pos[t * W + lane] : -1;
    int32_t mrow = -1, mexp = -1;
    if (lane >= 1 && lane <= K) {
      mrow = p.lay.slot_row[t * K + lane - 1];
      mexp = p.topk_idx[t * K + lane - 1];
    }
    const uint32_t dmask = __ballot_sync(0xffffffffu, pos >= 0);
    if (dmask == 0) continue;
    const char *src = FP8 ? (const char *)p.xq + t * H : (const char *)p.x + t * H * 2;
    for (int64_t c0 = 0; c0 < chunks; c0 += 32 * TP_UNROLL) {
      uint4 v[TP_UNROLL];
#pragma unroll
      for (int u = 0; u < TP_UNROLL; u++) {
        const int64_t c = c0 + u * 32 + lane;
        if (c < chunks) v[u] = tp_ld_input_v4(src + c * 16);
      }
      if (c0 == 0) {
        // Meta (K + 1 ints per rank: the token, then its slots' rows on that rank or -1) while
        // the row's loads are on their way.
        for (uint32_t m = dmask; m; m &= m - 1) {
          const int d = __ffs(m) - 1;
          const int32_t pd = __shfl_sync(0xffffffffu, pos, d);
          int32_t *meta = (int32_t *)(p.peer[d] + p.win.recv_meta) + (int64_t)pd * meta_ints;
          if (lane < meta_ints)
            meta[lane] = lane == 0 ? (int32_t)t : (mrow >= 0 && mexp / p.EL == d ? mrow : -1);
          // A layer's rows also get their router weight and where their token landed.
          if (p.topk_w && lane >= 1 && lane <= K && mrow >= 0 && mexp / p.EL == d)
            tp_put_row_map(p, d, mrow, p.topk_w[t * K + lane - 1], pd);
          for (int64_t j = 32 + lane; j < meta_ints; j += 32) {  // K > 31
            const int32_t row = p.lay.slot_row[t * K + j - 1];
            const int32_t e = p.topk_idx[t * K + j - 1];
            meta[j] = (row >= 0 && e / p.EL == d) ? row : -1;
            if (p.topk_w && row >= 0 && e / p.EL == d)
              tp_put_row_map(p, d, row, p.topk_w[t * K + j - 1], pd);
          }
        }
      }
      for (uint32_t m = dmask; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const int32_t pd = __shfl_sync(0xffffffffu, pos, d);
        char *dst = p.peer[d] + recv + (int64_t)pd * H * 2;
#pragma unroll
        for (int u = 0; u < TP_UNROLL; u++) {
          const int64_t c = c0 + u * 32 + lane;
          if (c < chunks) tp_st_v4(dst + c * 16, v[u]);
        }
      }
    }
    if (FP8) {  // the row's scales after its H bytes, one lane per 1x128 block
      for (uint32_t m = dmask; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const int32_t pd = __shfl_sync(0xffffffffu, pos, d);
        // copied as bits: MXFP8's words are four E8M0 bytes, not fp32 values
        uint32_t *dst = (uint32_t *)(p.peer[d] + recv + (int64_t)pd * H * 2 + H);
        for (int64_t b = lane; b < H / 128; b += 32) dst[b] = p.xq_s[b * p.xq_s_ld + t];
      }
    }
  }
}

__device__ __forceinline__ void tp_dispatch_send(const mok_tp_params_t &p, uint64_t epoch) {
  if (p.xq) tp_dispatch_rows<true>(p, epoch);
  else tp_dispatch_rows<false>(p, epoch);
}

/* ---------------------------------------------------------------------------------------------- */
/* Combine                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

// The combine's items: the tokens this rank received from the other ranks (its own tokens' block
// of recv_x is skipped). src_start: [W + 1] first received position of each source rank.
__device__ __forceinline__ int64_t tp_received_items(const mok_tp_params_t &p,
                                                     const int32_t *src_start) {
  return src_start[p.nranks] - (src_start[p.rank + 1] - src_start[p.rank]);
}

// Item i of them: its position q in recv_x and recv_meta, its home rank s and its token t there.
typedef struct {
  int64_t q;
  int s;
  int32_t t;
  const int32_t *meta;  // recv_meta[q]: t, then this rank's row of each slot or -1
} tp_received_t;
__device__ __forceinline__ tp_received_t tp_received(const mok_tp_params_t &p,
                                                     const int32_t *src_start, int64_t i) {
  const int32_t own0 = src_start[p.rank], own1 = src_start[p.rank + 1];
  tp_received_t r;
  r.q = i < own0 ? i : i + (own1 - own0);
  r.s = 0;
  while (r.s + 1 < p.nranks && src_start[r.s + 1] <= r.q) r.s++;
  r.meta = (const int32_t *)(p.peer[p.rank] + p.win.recv_meta) + r.q * (p.K + 1);
  r.t = tp_ld_peer_i32(r.meta);
  return r;
}

// The local expert that owns `row` of this rank's row buffer: the last local expert whose
// segment starts at or before it (empty experts start where the next one does, so the last one
// wins). start: [EL] segment starts of this rank's experts, in shared memory.
__device__ __forceinline__ int tp_local_expert_of_row(const int32_t *start, int EL, int32_t row) {
  int lo = 0, hi = EL - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (start[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

#endif /* MOK_CUDA_TRANSPORT_CUH */
