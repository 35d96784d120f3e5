/*
 * wgrad_store.cu: accumulating an fp32 weight gradient into the caller's bf16 buffer (backward.h,
 * "Layer backward"): dst = bf16(fp32(dst) + g), as src/cpu/backend.c's write_wgrad does, one
 * rounding. The weight-gradient GEMM's epilogues store bf16 or accumulate fp32, not this, so a
 * backward with bf16 gradients and wgrad_accumulate = 1 writes g into the workspace's wgrad32
 * region first (src/common/workspace.h). The plain store dst = bf16(g) is there for completeness.
 * Elementwise, 8 values per thread (16-byte bf16 and 2 x 16-byte fp32 vectors).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/backward/backward.h"
#include "common/status.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's backward kernels target sm_90a (Hopper) and newer"
#endif

#define WS_THREADS 256

__global__ void __launch_bounds__(WS_THREADS)
    ws_store_bf16_kernel(const float4 *__restrict__ g, uint4 *__restrict__ dst, int64_t n8,
                         int accumulate) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
    const float4 a = g[2 * i], b = g[2 * i + 1];
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    if (accumulate) {
      const uint4 old = dst[i];
      const __nv_bfloat162 *h = (const __nv_bfloat162 *)&old;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float2 f = __bfloat1622float2(h[j]);
        v[2 * j] = __fadd_rn(f.x, v[2 * j]);
        v[2 * j + 1] = __fadd_rn(f.y, v[2 * j + 1]);
      }
    }
    uint4 out;
    __nv_bfloat162 *o = (__nv_bfloat162 *)&out;
#pragma unroll
    for (int j = 0; j < 4; j++) o[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    dst[i] = out;
  }
}

extern "C" cudaError_t mok_bwd_cc_preload(void); /* context_check.cu */
extern "C" cudaError_t mok_bwd_sb_preload(void);  /* swiglu.cu */

extern "C" mokResult_t mok_bwd_preload(void) {
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, ws_store_bf16_kernel) != cudaSuccess ||
      mok_bwd_cc_preload() != cudaSuccess || mok_bwd_sb_preload() != cudaSuccess) {
    cudaGetLastError();
    return MOK_ERROR_CUDA;
  }
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_bwd_wgrad_store_bf16_launch(const float *g, void *dst, int64_t n,
                                                       int accumulate, void *stream) {
  if (!g || !dst) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "wgrad store launch: NULL buffer");
  if (n < 0 || n % 8)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "wgrad store launch: n = %lld (a multiple of 8)",
                    (long long)n);
  if (((uintptr_t)g & 15u) || ((uintptr_t)dst & 15u))
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "wgrad store launch: buffers must be 16-byte aligned");
  if (n == 0) return MOK_SUCCESS;
  const int64_t n8 = n / 8;
  int64_t blocks = (n8 + WS_THREADS - 1) / WS_THREADS;
  if (blocks > 65536) blocks = 65536;  // grid-stride beyond
  ws_store_bf16_kernel<<<(unsigned)blocks, WS_THREADS, 0, (cudaStream_t)stream>>>(
      (const float4 *)g, (uint4 *)dst, n8, accumulate);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "wgrad store kernel launch: %s", cudaGetErrorString(e));
  return MOK_SUCCESS;
}
