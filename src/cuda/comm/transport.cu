/*
 * transport.cu: the standalone kernels of the NVLink transport and their C launchers (comm.h):
 *
 *   layout kernel            one CTA: local ranks, all-gather through the window, global layout
 *                            (comm/layout.cuh)
 *   dispatch-and-combine     num_ctas communication CTAs (20 by default):
 *                              DISPATCH: send tokens to the other ranks, signal, wait for
 *                                        every source's tokens
 *                              COMBINE:  send f(row) of each (token, slot) received from another
 *                                        rank home, signal, wait for every expert rank
 *                              REDUCE:   sum each token's rows in slot order, the combined ones
 *                                        and those of its own rank's experts (local; in the
 *                                        persistent kernel these are compute tasks)
 *
 * Used by tests and benchmarks on its own, with a stand-in expert (tp_expert_scale) in place of
 * the layer's GEMMs; the reusable device functions (flags, waits, dispatch) are comm/transport.cuh.
 *
 * NOTE (reuse without clearing, for MOK_TP_ALL calls): rank s rewrites d's recv_x in call
 * n + 1 only after its own combine of call n finished, which needed d's combine rows of call n,
 * which d sends after reading recv_x; and d writes s's comb in call n + 1 only after waiting for
 * s's dispatch of call n + 1, which s starts after summing comb of call n. So every buffer is
 * free again when it is rewritten, and the counters carry the call number.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/comm/comm.h"
#include "cuda/comm/layout.cuh"
#include "cuda/comm/transport.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's transport targets sm_90a (Hopper) and newer"
#endif

/* ---------------------------------------------------------------------------------------------- */
/* The standalone combine: a stand-in expert in place of the layer's                              */
/* ---------------------------------------------------------------------------------------------- */

// The stand-in expert of the standalone kernel: f(row, e) = bf16(row * (e % 4 + 1)), exact for
// the tests' payloads, so a misplaced row or a wrong expert is visible bit for bit.
__device__ __forceinline__ float tp_expert_scale(int e) { return (float)(e % 4 + 1); }

// Sends the rows of the other ranks' tokens home: for received token q (from rank s != this
// rank, token t there) and every slot k whose expert is on this rank, f(recv_x[q], e_k) goes to
// comb[t, k] in s's window. Rows of this rank's own tokens are home already: the sum reads them
// where they are. A warp per received token: a chunk of its row is loaded once and stored once
// per slot. src_start: [W + 1] first received position of each source rank; estart: [EL] this
// rank's segment starts (shared memory, filled by the caller). Needs the dispatch counters
// waited for.
__device__ __forceinline__ void tp_combine_send(const mok_tp_params_t &p, const int32_t *src_start,
                                                const int32_t *estart, uint64_t epoch) {
  const int lane = threadIdx.x & 31;
  const int64_t K = p.K, H = p.H, chunks = H / 8;
  const int64_t items = tp_received_items(p, src_start);
  uint32_t *claim = p.lay.claim + TP_CLAIM_COMBINE + (epoch & 1);
  for (int64_t nx = tp_claim(claim, lane), i = __shfl_sync(0xffffffffu, nx, 0); i < items;
       i = __shfl_sync(0xffffffffu, nx, 0)) {
    nx = tp_claim(claim, lane);
    const tp_received_t it = tp_received(p, src_start, i);
    const int32_t *meta = it.meta;
    const char *src = p.peer[p.rank] + p.win.recv_x + it.q * H * 2;
    char *dst_tok = p.peer[it.s] + p.win.comb + (int64_t)it.t * K * H * 2;
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

// y[t] = bf16(sum over k in slot order of the slot's row), skipping empty slots (fp32 sum;
// docs/design.md, "The layer"): comb[t, k] for a slot whose expert is on another rank, and for
// one on this rank the stand-in expert's row computed here, f(x[t], e_k) (that row never left
// home). slots / scales: [TP_THREADS / 32, K] shared memory per warp. Needs the combine counters
// waited for.
__device__ __forceinline__ void tp_combine_reduce(const mok_tp_params_t &p, const char **slots,
                                                  float *scales) {
  const int lane = threadIdx.x & 31;
  const int64_t K = p.K, H = p.H, chunks = H / 8;
  const char *comb = p.peer[p.rank] + p.win.comb;
  const char **src = slots + (threadIdx.x >> 5) * K;
  float *scl = scales + (threadIdx.x >> 5) * K;
  for (int64_t t = tp_grid_warp(); t < p.T; t += tp_grid_warps()) {
    // The used slots in slot order, packed to the front: a remote slot's comb row (scale 0) or a
    // local slot's scale (row NULL). NOTE: the loads test the row and the sums the scale; testing
    // the scale in the loads too (one marker) added a shared-memory read ahead of every load and
    // made this latency-bound loop ~10% slower (docs/performance.md,
    // "Transport: the standalone sum").
    int n = 0, any_local = 0;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      const int64_t k = k0 + lane;
      int used = 0, local = 0;
      int32_t e = -1;
      if (k < K && p.lay.slot_row[t * K + k] >= 0) {
        used = 1;
        e = p.topk_idx[t * K + k];
        local = e / p.EL == p.rank;
      }
      const uint32_t um = __ballot_sync(0xffffffffu, used);
      any_local |= __ballot_sync(0xffffffffu, local) != 0;
      if (used) {
        const int j = n + __popc(um & ((1u << lane) - 1u));
        src[j] = local ? NULL : comb + (t * K + k) * H * 2;
        scl[j] = local ? tp_expert_scale(e) : 0.f;
      }
      n += __popc(um);
    }
    __syncwarp();
    const char *xrow = (const char *)p.x + t * H * 2;
    char *dst = (char *)p.y + t * H * 2;
    for (int64_t c = lane; c < chunks; c += 32) {
      float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      const uint4 xv = any_local ? tp_ld_input_v4(xrow + c * 16) : make_uint4(0, 0, 0, 0);
      for (int j0 = 0; j0 < n; j0 += 8) {
        // Up to 8 comb loads back to back (one at a time, a warp here is bound by latency): a
        // slot past the last or a local one reads as zeros, without a branch between the loads.
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
          const int used = j0 + j < n;
          const char *r = src[used ? j0 + j : 0];
          v[j] = tp_ld_peer_v4_if(r + c * 16, used && r != NULL);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
          if (j0 + j >= n) break;
          const float sk = scl[j0 + j];
          const uint4 w = sk != 0.f ? tp_scale_v4(xv, sk) : v[j];
          tp_acc_bf16x2(a[0], a[1], w.x);
          tp_acc_bf16x2(a[2], a[3], w.y);
          tp_acc_bf16x2(a[4], a[5], w.z);
          tp_acc_bf16x2(a[6], a[7], w.w);
        }
      }
      tp_st_v4(dst + c * 16, make_uint4(tp_pack_bf16x2(a[0], a[1]), tp_pack_bf16x2(a[2], a[3]),
                                        tp_pack_bf16x2(a[4], a[5]), tp_pack_bf16x2(a[6], a[7])));
    }
    __syncwarp();  // src and scl are rewritten for the next token
  }
}

__global__ void __launch_bounds__(LAYOUT_THREADS, 1)
    tp_layout_kernel(const __grid_constant__ mok_tp_params_t p) {
  extern __shared__ int32_t layout_smem[];
  layout_run(p, layout_smem);
}

__global__ void __launch_bounds__(TP_THREADS, 1)
    tp_run_kernel(const __grid_constant__ mok_tp_params_t p) {
  __shared__ int32_t src_start[MOK_MAX_RANKS + 1];  // first received position per source
  __shared__ int32_t estart[MOK_MAX_EXPERTS];       // [EL] segment starts of our experts
  __shared__ const char *warp_slots[TP_THREADS / 32 * 64];  // [warps, K] (K <= 64)
  __shared__ float warp_scales[TP_THREADS / 32 * 64];

  const int disp = p.phases & MOK_TP_DISPATCH, comb = p.phases & MOK_TP_COMBINE;
  const uint64_t disp_epoch = disp ? tp_epoch_begin(p, TP_EPOCH_DISPATCH) : 0;
  const uint64_t comb_epoch = comb ? tp_epoch_begin(p, TP_EPOCH_COMBINE) : 0;
  // First, before any wait can fail: the next call's work-item counters.
  if (disp) tp_claims_reset_next(p, TP_CLAIM_DISPATCH, disp_epoch);
  if (comb) tp_claims_reset_next(p, TP_CLAIM_COMBINE, comb_epoch);
  int ok = 1;
  if (disp) {
    tp_dispatch_send(p, disp_epoch);
    tp_cta_signal_ranks(p, p.win.disp_ctr);
    const uint64_t *ctr = (const uint64_t *)(p.peer[p.rank] + p.win.disp_ctr);
    ok = tp_cta_wait_ranks(ctr, disp_epoch, p, MOK_TP_WAIT_DISPATCH);
  }
  if (comb && ok) {
    if (threadIdx.x == 0) {
      int32_t acc = 0;
      for (int s = 0; s < p.nranks; s++) {
        src_start[s] = acc;
        acc += p.lay.token_count[s * p.nranks + p.rank];
      }
      src_start[p.nranks] = acc;
    }
    for (int64_t e = threadIdx.x; e < p.EL; e += blockDim.x)
      estart[e] = p.lay.expert_start[p.rank * p.EL + e];
    __syncthreads();
    tp_combine_send(p, src_start, estart, comb_epoch);
    tp_cta_signal_ranks(p, p.win.comb_ctr);
    const uint64_t *ctr = (const uint64_t *)(p.peer[p.rank] + p.win.comb_ctr);
    ok = tp_cta_wait_ranks(ctr, comb_epoch, p, MOK_TP_WAIT_COMBINE);
  }
  // The sum reads only this rank's comb, complete once every CTA passed the combine wait (in
  // this launch, or in an earlier one on the same stream).
  if ((p.phases & MOK_TP_REDUCE) && ok) tp_combine_reduce(p, warp_slots, warp_scales);
  // NOTE: a failed wait skips the rest but not the call counts: every rank's counts stay in step
  // with the calls made (the timeout has left the transport unusable anyway).
  if (disp) tp_epoch_end(p, TP_EPOCH_DISPATCH, disp_epoch);
  if (comb) tp_epoch_end(p, TP_EPOCH_COMBINE, comb_epoch);
}

/* ---------------------------------------------------------------------------------------------- */
/* Recovery after a timeout                                                                        */
/* ---------------------------------------------------------------------------------------------- */

// Lane s < W waits until rec[s] of this rank's window is at least v (rank s has reached that
// step of the recovery); 0 in every lane when a wait timed out (recorded with the rank).
__device__ __forceinline__ int tp_recover_wait(const mok_tp_params_t &p, uint64_t v) {
  int ok = 1;
  if (threadIdx.x < (unsigned)p.nranks) {
    const uint64_t *rec = (const uint64_t *)(p.peer[p.rank] + p.win.rec);
    ok = tp_wait_geq(rec + threadIdx.x, v, p, MOK_TP_WAIT_RECOVER, threadIdx.x);
  }
  return __all_sync(0xffffffffu, ok);
}

// Writes v into rec[this rank] of every rank's window (release, system scope).
__device__ __forceinline__ void tp_recover_signal(const mok_tp_params_t &p, uint64_t v) {
  __syncwarp();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int d = 0; d < p.nranks; d++)
      ptx_st_release_sys_u64((uint64_t *)(p.peer[d] + p.win.rec) + p.rank, v);
  }
  __syncwarp();
}

// Recovery number `gen` (one warp). Step 1: this rank's earlier kernels have ended (stream
// order), so it says so (rec = 2 gen - 1) and waits until every rank has: then no kernel of any
// rank still writes a counter. Step 2: it zeroes the counters other ranks add to in its window
// (layout flags, dispatch and combine counters), its call numbers and work-item counters, as a
// new transport has them, says so (2 gen), and waits until every rank has: then no rank's next
// call can meet a counter not yet zeroed. The error word is cleared first, so the next check
// reports only this kernel's own timeout: a rank that did not join.
__global__ void __launch_bounds__(32, 1)
    tp_recover_kernel(const __grid_constant__ mok_tp_params_t p, uint64_t gen) {
  const int W = p.nranks;
  if (threadIdx.x == 0) {
    volatile int32_t *e = (volatile int32_t *)p.err;
    for (size_t i = 0; i < sizeof(mok_tp_error_t) / 4; i++) e[i] = 0;
  }
  tp_recover_signal(p, 2 * gen - 1);
  if (!tp_recover_wait(p, 2 * gen - 1)) return;
  char *win = p.peer[p.rank];
  volatile uint64_t *flags = (volatile uint64_t *)(win + p.win.flags);
  volatile uint64_t *disp = (volatile uint64_t *)(win + p.win.disp_ctr);
  volatile uint64_t *comb = (volatile uint64_t *)(win + p.win.comb_ctr);
  for (int i = threadIdx.x; i < 2 * W; i += 32) flags[i] = 0;
  for (int i = threadIdx.x; i < W; i += 32) disp[i] = 0, comb[i] = 0;
  if (threadIdx.x < 3) ((volatile uint64_t *)p.lay.epoch)[threadIdx.x] = 0;
  if (threadIdx.x < 4) {
    ((volatile uint32_t *)p.lay.epoch_done)[threadIdx.x] = 0;
    ((volatile uint32_t *)p.lay.claim)[threadIdx.x] = 0;
  }
  tp_recover_signal(p, 2 * gen);
  tp_recover_wait(p, 2 * gen);
}

static mokResult_t tp_cuda(cudaError_t e) {
  if (e == cudaSuccess) return MOK_SUCCESS;
  cudaGetLastError();
  return MOK_ERROR_CUDA;
}

extern "C" size_t mok_tp_layout_smem_bytes(int64_t num_experts, int nranks) {
  return layout_smem_bytes(num_experts, nranks, num_experts + nranks + LAYOUT_HEADER_INTS);
}

extern "C" mokResult_t mok_tp_layout_launch(const mok_tp_params_t *p, void *stream) {
  if (!p) return MOK_ERROR_NULL_POINTER;
  if (p->E > MOK_MAX_EXPERTS || p->nranks > MOK_MAX_RANKS) return MOK_ERROR_INVALID_VALUE;
  const size_t smem = layout_smem_bytes(p->E, p->nranks, p->win.slot_ints);
  cudaError_t e = cudaFuncSetAttribute(tp_layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem);
  if (e != cudaSuccess) return tp_cuda(e);
  tp_layout_kernel<<<1, LAYOUT_THREADS, smem, (cudaStream_t)stream>>>(*p);
  return tp_cuda(cudaGetLastError());
}

extern "C" mokResult_t mok_tp_preload(void) {
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, tp_layout_kernel) != cudaSuccess ||
      cudaFuncGetAttributes(&a, tp_run_kernel) != cudaSuccess ||
      cudaFuncGetAttributes(&a, tp_recover_kernel) != cudaSuccess)
    return tp_cuda(cudaGetLastError());
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_tp_run_launch(const mok_tp_params_t *p, void *stream) {
  if (!p) return MOK_ERROR_NULL_POINTER;
  if (p->EL > MOK_MAX_EXPERTS || p->nranks > MOK_MAX_RANKS || p->num_ctas < 1)
    return MOK_ERROR_INVALID_VALUE;
  tp_run_kernel<<<p->num_ctas, TP_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return tp_cuda(cudaGetLastError());
}

extern "C" mokResult_t mok_tp_recover_launch(const mok_tp_params_t *p, uint64_t gen, void *stream) {
  if (!p) return MOK_ERROR_NULL_POINTER;
  if (p->nranks > 32 || gen < 1) return MOK_ERROR_INVALID_VALUE;  // one lane per rank
  tp_recover_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(*p, gen);
  return tp_cuda(cudaGetLastError());
}
