/*
 * gemm/wgrad_tile.cuh: the epilogue of one k-grouped weight-gradient tile, shared by the
 * weight-gradient GEMM (gemm/grouped_wgrad.cu) and the fused backward's DW tiles
 * (backward/fused.cu), so that both store the same bits the same way.
 *
 * C[g] is [N, K] (rows >= N and columns >= K are not stored), in the [G N, K] view of C. A consumer
 * warpgroup cw holds rows [c_row0 + 64 cw, +64) x columns [c_col0, +256) of C[g] in acc (wgmma's
 * fragment layout, tile/epilogue.cuh).
 */
#ifndef MOK_CUDA_GEMM_WGRAD_TILE_CUH
#define MOK_CUDA_GEMM_WGRAD_TILE_CUH

#include <cuda.h>
#include <cuda_bf16.h>

#include "cuda/gemm/gemm.h"
#include "cuda/tile/epilogue.cuh"

// An empty group's piece of C[g]: zeros from constants, so that no ordinary instruction writes the
// wgmma accumulators (that would serialize the wgmma pipeline: ptxas warning C7515). Nothing when
// accumulating (C[g] keeps its value).
template <int EPI>
__device__ __forceinline__ void gw_store_zeros(void *c, int group, int n, int k, int c_row0,
                                               int c_col0, int cw) {
  if (EPI == MOK_GG_EPI_ACCUM_F32) return;
  const epi_coords_t e = epi_coords(c_row0, n, c_col0, k, k, cw);
  const size_t c_off = (size_t)group * (size_t)n * (size_t)k;
  float zero[128];
#pragma unroll
  for (int i = 0; i < 128; i++) zero[i] = 0.0f;
  if (EPI == MOK_GG_EPI_STORE_BF16) epi_store_bf16<128>(zero, (__nv_bfloat16 *)c + c_off, e);
  else epi_store_f32<128, false>(zero, (float *)c + c_off, e);
}

// The tile's stores: staged through `stage_c` (32 KB of this warpgroup) and TMA bulk copies over
// the [G N, K] map tm_c when all 64 rows are inside C[g] and the epilogue stores (bf16 in one round
// of two 16 KB buffers, fp32 in two rounds of 32 KB, the second waiting until the copy engine has
// read the first); from registers otherwise, and always when accumulating fp32. bar: a named
// barrier of the warpgroup's 128 threads; lt: the thread within it (0 issues the bulk copies).
template <int EPI>
__device__ __forceinline__ void gw_store_tile(const float (&acc)[128], uint8_t *stage_c,
                                              const CUtensorMap *tm_c, void *c, int group, int n,
                                              int k, int c_row0, int c_col0, int cw, int bar,
                                              int lt) {
  static_assert(EPI == MOK_GG_EPI_STORE_BF16 || EPI == MOK_GG_EPI_STORE_F32 ||
                    EPI == MOK_GG_EPI_ACCUM_F32,
                "weight gradients: store bf16, store fp32 or accumulate fp32");
  const int c_row = c_row0 + 64 * cw;  // first row of this warpgroup's piece in C[g]
  if (EPI != MOK_GG_EPI_ACCUM_F32 && c_row + 64 <= n) {
    const int row = group * n + c_row;  // in the [G N, K] view (< 2^31: the launchers check)
    if (EPI == MOK_GG_EPI_STORE_BF16) {
      epi_store_staged_bf16<0, 0>(acc, stage_c, tm_c, c_col0, k, row, bar, lt);
      epi_store_staged_bf16<1, -1>(acc, stage_c + 16384, tm_c, c_col0, k, row, bar, lt);
    } else {
      epi_store_staged_f32<0>(acc, stage_c, tm_c, c_col0, k, row, bar, lt);
      epi_store_staged_f32<1>(acc, stage_c, tm_c, c_col0, k, row, bar, lt);
    }
    return;
  }
  const epi_coords_t e = epi_coords(c_row0, n, c_col0, k, k, cw);
  const size_t c_off = (size_t)group * (size_t)n * (size_t)k;
  if (EPI == MOK_GG_EPI_STORE_BF16) epi_store_bf16<128>(acc, (__nv_bfloat16 *)c + c_off, e);
  else epi_store_f32<128, EPI == MOK_GG_EPI_ACCUM_F32>(acc, (float *)c + c_off, e);
}

#endif /* MOK_CUDA_GEMM_WGRAD_TILE_CUH */
