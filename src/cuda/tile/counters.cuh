/*
 * tile/counters.cuh: the bounded wait on a task counter of a persistent kernel (the fused forward's
 * and the fused backward's): acquire loads until the counter reaches its target, the kernel's abort
 * flag is raised, or the timeout passes, which is reported through the layer's error word.
 */
#ifndef MOK_CUDA_TILE_COUNTERS_CUH
#define MOK_CUDA_TILE_COUNTERS_CUH

#include <stdint.h>

#include "common/workspace.h"
#include "cuda/error_word.cuh"
#include "cuda/ptx/ptx.cuh"

// Waits until ctr[c] reaches `target` (acquire at GPU scope), or ctr[MOK_FC_ABORT] is set, or
// timeout_ns pass: then MOK_ERROR_TIMEOUT goes into the error word `err` (task, counter, value,
// target) and MOK_FC_ABORT is raised, so that every other wait gives up at once and the kernel
// runs to its end with wrong results instead of hanging. sleep_ns: between polls.
// tile_wait_inline: the same, inlined, for kernels that trade registers between warpgroups
// (setmaxnreg): ptxas could not allocate their registers around a call (C7600).
__device__ __forceinline__ void tile_wait_inline(uint32_t *ctr, int c, uint32_t target,
                                                 int64_t task, uint64_t timeout_ns, void *err,
                                                 uint32_t sleep_ns) {
  uint32_t v = ptx_ld_acquire_gpu(ctr + c);
  if (v >= target) return;
  const uint64_t t0 = ptx_globaltimer_ns();
  for (;;) {
    __nanosleep(sleep_ns);
    v = ptx_ld_acquire_gpu(ctr + c);
    if (v >= target) return;
    if (*(volatile uint32_t *)(ctr + MOK_FC_ABORT)) return;
    if (ptx_globaltimer_ns() - t0 > timeout_ns) {
      mok_ws_record_error((mok_ws_error_t *)err, MOK_ERROR_TIMEOUT, MOK_WS_ERR_TIMEOUT, task, c,
                          v, target);
      atomicExch(ctr + MOK_FC_ABORT, 1u);
      return;
    }
  }
}

static __device__ __noinline__ void tile_wait(uint32_t *ctr, int c, uint32_t target, int64_t task,
                                       uint64_t timeout_ns, void *err, uint32_t sleep_ns) {
  tile_wait_inline(ctr, c, target, task, timeout_ns, err, sleep_ns);
}

#endif /* MOK_CUDA_TILE_COUNTERS_CUH */
