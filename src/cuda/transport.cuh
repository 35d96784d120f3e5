/*
 * transport.cuh: device functions of the NVLink transport, for communication CTAs: system-scope
 * flags and counters, bounded waits that report who waited for what, token dispatch to the ranks
 * that hold a token's experts, and the combine that sends expert rows back to their home rank and
 * sums them in slot order. The standalone kernel in transport.cu strings them together; the
 * persistent kernel will call the same functions from its communication CTAs.
 *
 * Everything here sees raw peer pointers (mok_tp_params_t::peer, read once at setup by
 * nccl_window.cu) and our own counters; no NCCL device code.
 *
 * Counters never get cleared. Each CTA of a sender adds 1 to a counter per call, so after call
 * number `epoch` the receiver waits for epoch * (sender's CTAs); the host counts calls.
 *
 * Window regions (mok_tp_window_layout_t, same offsets on every rank):
 *   disp_ctr  [W] u64             dispatch counters, by source rank
 *   comb_ctr  [W] u64             combine counters, by expert rank
 *   recv_x    [W * T_max, H] bf16 tokens received, in (source rank, token) order
 *   recv_meta [W * T_max, K + 1]  source token index, then this rank's row of each slot or -1
 *   comb      [T_max, K, H] bf16  expert rows of this rank's tokens, by (token, slot)
 */
#ifndef MOK_CUDA_TRANSPORT_CUH
#define MOK_CUDA_TRANSPORT_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda/launch.h"
#include "cuda/ptx.cuh"

#define TP_THREADS 512 /* threads of a communication CTA */
#define TP_UNROLL 4    /* 16-byte chunks in flight per lane: 16 warps x 2 KB = 32 KB per SM */

static_assert(TP_THREADS % 32 == 0 && TP_THREADS <= 1024, "whole warps");
static_assert(MOK_TP_MAX_RANKS <= 32, "one lane per rank in the waits");

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
__device__ __noinline__ int tp_wait_geq(const uint64_t *ctr, uint64_t target,
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

// The stand-in expert of the standalone kernel: f(row, e) = bf16(row * (e % 4 + 1)), exact for
// the tests' payloads, so a misplaced row or a wrong expert is visible bit for bit.
__device__ __forceinline__ float tp_expert_scale(int e) { return (float)(e % 4 + 1); }

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

// Items (tokens, received rows) go to warps round-robin over the whole grid, so every SM mixes
// remote and local destinations: a contiguous split would leave the SMs that hold the local
// half (received positions are in source order) idle on NVLink.
__device__ __forceinline__ int64_t tp_grid_warp(void) {
  return (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
}
__device__ __forceinline__ int64_t tp_grid_warps(void) {
  return (int64_t)gridDim.x * (blockDim.x >> 5);
}

/* ---------------------------------------------------------------------------------------------- */
/* Dispatch                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

// Sends this CTA's tokens: token t goes, once, to every rank d with token_pos[t, d] >= 0
// (any of its slots routes there): x[t] to recv_x[pos] and {t, rows of its slots on d} to
// recv_meta[pos] in d's window. A warp per token; the row is read once, stored once per rank.
__device__ __forceinline__ void tp_dispatch_send(const mok_tp_params_t &p) {
  const int lane = threadIdx.x & 31;
  const int W = p.nranks;
  const int64_t K = p.K, H = p.H, chunks = H / 8;  // 16-byte chunks per row
  const int64_t meta_ints = K + 1;
  for (int64_t t = tp_grid_warp(); t < p.T; t += tp_grid_warps()) {
    int32_t pos = lane < W ? p.lay.token_pos[t * W + lane] : -1;
    const uint32_t dmask = __ballot_sync(0xffffffffu, pos >= 0);
    if (dmask == 0) continue;
    // Meta first (K + 1 ints per rank); a lane per slot.
    for (uint32_t m = dmask; m; m &= m - 1) {
      const int d = __ffs(m) - 1;
      const int32_t pd = __shfl_sync(0xffffffffu, pos, d);
      int32_t *meta = (int32_t *)(p.peer[d] + p.win.recv_meta) + (int64_t)pd * meta_ints;
      for (int64_t j = lane; j < meta_ints; j += 32) {
        int32_t v = (int32_t)t;
        if (j > 0) {
          const int32_t row = p.lay.slot_row[t * K + j - 1];
          const int32_t e = p.topk_idx[t * K + j - 1];
          v = (row >= 0 && e / p.EL == d) ? row : -1;
        }
        meta[j] = v;
      }
    }
    const char *src = (const char *)p.x + t * H * 2;
    for (int64_t c0 = 0; c0 < chunks; c0 += 32 * TP_UNROLL) {
      uint4 v[TP_UNROLL];
#pragma unroll
      for (int u = 0; u < TP_UNROLL; u++) {
        const int64_t c = c0 + u * 32 + lane;
        if (c < chunks) v[u] = tp_ld_input_v4(src + c * 16);
      }
      for (uint32_t m = dmask; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const int32_t pd = __shfl_sync(0xffffffffu, pos, d);
        char *dst = p.peer[d] + p.win.recv_x + (int64_t)pd * H * 2;
#pragma unroll
        for (int u = 0; u < TP_UNROLL; u++) {
          const int64_t c = c0 + u * 32 + lane;
          if (c < chunks) tp_st_v4(dst + c * 16, v[u]);
        }
      }
    }
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* Combine                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

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

// Sends this CTA's received tokens back: for token p (from rank s, token t there) and
// every slot k whose row is on this rank, f(recv_x[p], e_k) goes to comb[t, k] in s's window.
// src_start: [W + 1] first received position of each source rank; estart: [EL] this rank's
// segment starts (shared memory, filled by the caller). Needs the dispatch counters waited for.
__device__ __forceinline__ void tp_combine_send(const mok_tp_params_t &p, const int32_t *src_start,
                                                const int32_t *estart) {
  const int lane = threadIdx.x & 31;
  const int W = p.nranks;
  const int64_t K = p.K, H = p.H, chunks = H / 8;
  const char *my_win = p.peer[p.rank];
  const int32_t *meta_all = (const int32_t *)(my_win + p.win.recv_meta);
  for (int64_t q = tp_grid_warp(); q < src_start[W]; q += tp_grid_warps()) {
    int s = 0;
    while (s + 1 < W && src_start[s + 1] <= q) s++;
    const int32_t *meta = meta_all + q * (K + 1);
    const int32_t t = tp_ld_peer_i32(meta);
    const char *src = my_win + p.win.recv_x + q * H * 2;
    char *dst_tok = p.peer[s] + p.win.comb + (int64_t)t * K * H * 2;
    // Slots in groups of 32: lane k holds slot (k0 + k)'s row and scale.
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      int32_t row = -1;
      if (k0 + lane < K) row = tp_ld_peer_i32(meta + 1 + k0 + lane);
      const uint32_t kmask = __ballot_sync(0xffffffffu, row >= 0);
      if (kmask == 0) continue;
      float scale = 0.f;
      if (row >= 0) {
        const int el = tp_local_expert_of_row(estart, (int)p.EL, row);
        scale = tp_expert_scale((int)(p.rank * p.EL + el));
      }
      for (int64_t c0 = 0; c0 < chunks; c0 += 32 * TP_UNROLL) {
        uint4 v[TP_UNROLL];
#pragma unroll
        for (int u = 0; u < TP_UNROLL; u++) {
          const int64_t c = c0 + u * 32 + lane;
          if (c < chunks) v[u] = tp_ld_peer_v4(src + c * 16);
        }
        for (uint32_t m = kmask; m; m &= m - 1) {
          const int k = __ffs(m) - 1;
          const float sk = __shfl_sync(0xffffffffu, scale, k);
          char *dst = dst_tok + (k0 + k) * H * 2;
#pragma unroll
          for (int u = 0; u < TP_UNROLL; u++) {
            const int64_t c = c0 + u * 32 + lane;
            if (c < chunks) tp_st_v4(dst + c * 16, tp_scale_v4(v[u], sk));
          }
        }
      }
    }
  }
}

// y[t] = bf16(sum over k in slot order of comb[t, k]) for this CTA's tokens, skipping
// empty slots (fp32 sum, DESIGN.md section 2). Needs the combine counters waited for.
__device__ __forceinline__ void tp_combine_reduce(const mok_tp_params_t &p) {
  const int lane = threadIdx.x & 31;
  const int64_t K = p.K, H = p.H, chunks = H / 8;
  const char *comb = p.peer[p.rank] + p.win.comb;
  for (int64_t t = tp_grid_warp(); t < p.T; t += tp_grid_warps()) {
    // kmask bit k: slot k holds a row (lane k reads slot_row; K <= 64).
    uint64_t kmask = 0;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      const int used = k0 + lane < K && p.lay.slot_row[t * K + k0 + lane] >= 0;
      kmask |= (uint64_t)__ballot_sync(0xffffffffu, used) << k0;
    }
    char *dst = (char *)p.y + t * H * 2;
    const char *src = comb + t * K * H * 2;
    for (int64_t c = lane; c < chunks; c += 32) {
      float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      // Slots in groups of 8 in ascending k (the slot order of the sum): the group's loads are
      // issued together, since one at a time a warp here is bound by latency, not bandwidth.
      for (uint64_t m = kmask; m;) {
        uint4 v[8];
        bool used[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
          used[j] = m != 0;
          if (used[j]) {
            const int64_t k = __ffsll((long long)m) - 1;
            m &= m - 1;
            v[j] = tp_ld_peer_v4(src + k * H * 2 + c * 16);
          }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
          if (!used[j]) break;
          tp_acc_bf16x2(a[0], a[1], v[j].x);
          tp_acc_bf16x2(a[2], a[3], v[j].y);
          tp_acc_bf16x2(a[4], a[5], v[j].z);
          tp_acc_bf16x2(a[6], a[7], v[j].w);
        }
      }
      tp_st_v4(dst + c * 16, make_uint4(tp_pack_bf16x2(a[0], a[1]), tp_pack_bf16x2(a[2], a[3]),
                                        tp_pack_bf16x2(a[4], a[5]), tp_pack_bf16x2(a[6], a[7])));
    }
  }
}

#endif /* MOK_CUDA_TRANSPORT_CUH */
