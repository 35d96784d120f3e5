/*
 * context_check.cu: the first kernel of a GPU backward (backward.h): does the
 * saved context belong to this call? One CTA compares the context header, which the forward's
 * layout kernel wrote in device memory, with the call: magic (0 when that forward met bad routing
 * or a capacity overflow), layer id, number of tokens, context mode and the routing hash of
 * topk_idx. The host cannot decide this without reading device memory (a synchronization), so
 * the answer stays on the device:
 *
 *   match:    status = 1, offsets = the context's, shared_offsets = {0, T}
 *   mismatch: status = 0, offsets = shared_offsets = 0: every later kernel and GEMM of the call
 *             finds no rows (dx, dtopk_w untouched; see gpu/backward.c for weight gradients), and
 *             MOK_ERROR_CONTEXT_MISMATCH waits in the error word for mok_layer_check.
 *
 * What it cannot see: a context written by a forward of the same layer, tokens and routing but
 * other x or weights (the header does not hash them).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/error_word.cuh"
#include "cuda/backward/backward.h"
#include "common/context.h"
#include "common/status.h"
#include "common/workspace.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's backward kernels target sm_90a (Hopper) and newer"
#endif

#define CC_THREADS 1024

static_assert(CC_THREADS % 32 == 0, "whole warps");

__global__ void __launch_bounds__(CC_THREADS, 1)
    cc_check_kernel(const __grid_constant__ mok_bwd_local_params_t p) {
  __shared__ unsigned long long s_hash;
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_hash = 0;
  __syncthreads();

  // The routing hash: per-thread sums, warp sums, one integer atomic per warp (order-free).
  const int64_t n = p.T * p.K;
  uint64_t hash = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    hash += mok_ws_routing_mix((uint64_t)i, p.topk_idx[i]);
  for (int o = 16; o > 0; o >>= 1) hash += __shfl_xor_sync(0xFFFFFFFFu, hash, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(&s_hash, (unsigned long long)hash);
  __syncthreads();

  if (threadIdx.x == 0) {
    const mok_ctx_header_t *h = (const mok_ctx_header_t *)p.ctx_header;
    int64_t field = 0;  // the first field that differs, in the order of mok_ws_ctx_field_t
    if (h->magic != MOK_CTX_MAGIC) field = MOK_WS_CTX_MAGIC;
    else if (h->layer_id != p.layer_id) field = MOK_WS_CTX_LAYER;
    else if (h->num_tokens != p.T) field = MOK_WS_CTX_TOKENS;
    else if (h->routing_hash != (uint64_t)s_hash) field = MOK_WS_CTX_ROUTING;
    else if (h->mode != p.context_mode) field = MOK_WS_CTX_MODE;
    if (field)
      mok_ws_record_error((mok_ws_error_t *)p.err, MOK_ERROR_CONTEXT_MISMATCH,
                          MOK_WS_ERR_CONTEXT, h->num_tokens, -1, field, 0);
    s_ok = field == 0;
    *p.status = field == 0;
    p.shared_offsets[0] = 0;
    p.shared_offsets[1] = field == 0 ? (int32_t)p.T : 0;
  }
  __syncthreads();
  const int ok = s_ok;
  for (int64_t e = threadIdx.x; e <= p.E; e += blockDim.x) p.offsets[e] = ok ? p.ctx_offsets[e] : 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* Launcher                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

extern "C" cudaError_t mok_bwd_cc_preload(void) {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, cc_check_kernel);
}

extern "C" mokResult_t mok_bwd_context_check_launch(const mok_bwd_local_params_t *p, void *stream) {
  if (!p || !p->err || !p->status || !p->offsets || !p->shared_offsets || !p->ctx_header ||
      !p->ctx_offsets || (p->T > 0 && !p->topk_idx))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "context check launch: NULL buffer");
  if (p->E < 1 || p->K < 1 || p->T < 0 || p->T * p->K >= INT32_MAX)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "context check launch: E = %lld, K = %lld, "
                    "T = %lld out of range", (long long)p->E, (long long)p->K, (long long)p->T);
  cc_check_kernel<<<1, CC_THREADS, 0, (cudaStream_t)stream>>>(*p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "context check kernel launch: %s", cudaGetErrorString(e));
  return MOK_SUCCESS;
}
