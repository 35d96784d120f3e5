/*
 * backward/row_grad.cu: the router-weight gradient of each routed row, from the DS GEMM's partials.
 *
 * The DS GEMM's SwiGLU-backward epilogue (tile/epilogue.cuh, epi_swiglu_bwd) leaves one partial
 * per row and 256-column tile of I, part[r, j] = Σ over the tile's columns of ds s; here
 *   dw_row[r] = (((0 + part[r, 0]) + part[r, 1]) + ...)       fp32, tile order
 * for every row r in [offsets[0], offsets[G]), one thread per row. The order is fixed by the
 * tiles, not by the grid: bitwise the same run after run, and on every rank of an
 * expert-parallel layer (each row's tiles are the same wherever its expert lives).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/status.h"
#include "cuda/backward/backward.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's backward kernels target sm_90a (Hopper) and newer"
#endif

#define RG_THREADS 256

__global__ void __launch_bounds__(RG_THREADS)
    rg_row_sum_kernel(const float *part, int64_t tiles, const int32_t *offsets, int64_t G,
                      float *dw_row) {
  const int64_t begin = offsets[0], end = offsets[G];
  for (int64_t r = begin + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < end;
       r += (int64_t)gridDim.x * blockDim.x) {
    float dw = 0.0f;
    for (int64_t j = 0; j < tiles; j++) dw = __fadd_rn(dw, part[r * tiles + j]);
    dw_row[r] = dw;
  }
}

extern "C" cudaError_t mok_bwd_rg_preload(void) {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, rg_row_sum_kernel);
}

extern "C" mokResult_t mok_bwd_row_grad_launch(const float *part, int64_t tiles,
                                               const int32_t *offsets, int64_t num_groups,
                                               int64_t m_total, float *dw_row, void *stream) {
  if (!part || !offsets || !dw_row)
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "router-gradient launch: NULL buffer");
  if (tiles < 1 || num_groups < 1 || m_total < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "router-gradient launch: %lld tiles, G = %lld, "
                    "M = %lld", (long long)tiles, (long long)num_groups, (long long)m_total);
  if (((uintptr_t)part & 3u) || ((uintptr_t)dw_row & 3u) || ((uintptr_t)offsets & 3u))
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "router-gradient launch: misaligned buffer");
  if (m_total == 0) return MOK_SUCCESS;
  int64_t blocks = (m_total + RG_THREADS - 1) / RG_THREADS;
  if (blocks > 4096) blocks = 4096;
  rg_row_sum_kernel<<<(unsigned)blocks, RG_THREADS, 0, (cudaStream_t)stream>>>(part, tiles, offsets,
                                                                               num_groups, dw_row);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "router-gradient kernel launch: %s", cudaGetErrorString(e));
  return MOK_SUCCESS;
}
