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
 * Used by tests and benchmarks on its own; the persistent kernel takes the same device functions.
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

  // First, before any wait can fail: the next call's work-item counters.
  if (p.phases & MOK_TP_DISPATCH) tp_claims_reset_next(p, TP_CLAIM_DISPATCH, p.disp_epoch);
  if (p.phases & MOK_TP_COMBINE) tp_claims_reset_next(p, TP_CLAIM_COMBINE, p.comb_epoch);
  if (p.phases & MOK_TP_DISPATCH) {
    tp_dispatch_send(p);
    tp_cta_signal_ranks(p, p.win.disp_ctr);
    const uint64_t *ctr = (const uint64_t *)(p.peer[p.rank] + p.win.disp_ctr);
    if (!tp_cta_wait_ranks(ctr, p.disp_epoch, p, MOK_TP_WAIT_DISPATCH)) return;
  }
  if (p.phases & MOK_TP_COMBINE) {
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
    tp_combine_send(p, src_start, estart);
    tp_cta_signal_ranks(p, p.win.comb_ctr);
    const uint64_t *ctr = (const uint64_t *)(p.peer[p.rank] + p.win.comb_ctr);
    if (!tp_cta_wait_ranks(ctr, p.comb_epoch, p, MOK_TP_WAIT_COMBINE)) return;
  }
  // The sum reads only this rank's comb, complete once every CTA passed the combine wait (in
  // this launch, or in an earlier one on the same stream).
  if (p.phases & MOK_TP_REDUCE) tp_combine_reduce(p, warp_slots, warp_scales);
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

extern "C" mokResult_t mok_tp_run_launch(const mok_tp_params_t *p, void *stream) {
  if (!p) return MOK_ERROR_NULL_POINTER;
  if (p->EL > MOK_MAX_EXPERTS || p->nranks > MOK_MAX_RANKS || p->num_ctas < 1)
    return MOK_ERROR_INVALID_VALUE;
  tp_run_kernel<<<p->num_ctas, TP_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return tp_cuda(cudaGetLastError());
}
