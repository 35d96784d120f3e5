/*
 * tma.cuh: host-side encoding of the TMA tensor maps the tile engine loads through.
 *
 * A map describes a row-major 2D tensor [rows, cols] in global memory and the box one copy moves.
 * Operand tiles are K-major boxes of 128 bytes per row (64 bf16) with the 128-byte swizzle, the
 * layout ptx_desc_kmajor_sw128 describes to wgmma. Maps are encoded per launch on the host with the
 * driver's cuTensorMapEncodeTiled and passed to kernels as __grid_constant__ parameters.
 *
 * The driver function is looked up through the runtime (cudaGetDriverEntryPointByVersion) instead
 * of being linked: a library that needs libcuda.so.1 at load time would not even load on the
 * GPU-less machines where CI runs the CPU tests.
 */
#ifndef MOK_CUDA_TMA_CUH
#define MOK_CUDA_TMA_CUH

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

typedef CUresult (*tma_encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                        const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                        const cuuint32_t *, CUtensorMapInterleave,
                                        CUtensorMapSwizzle, CUtensorMapL2promotion,
                                        CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, or NULL when no driver provides it.
static inline tma_encode_tiled_fn tma_encode_fn(void) {
  static tma_encode_tiled_fn fn = NULL;  // benign race: every thread stores the same pointer
  if (!fn) {
    void *ptr = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (tma_encode_tiled_fn)ptr;
  }
  return fn;
}

// map <- 2D tensor [rows, cols] of `elem_bytes`-byte elements (cols contiguous, 16-byte row
// stride), box [box_rows, box_cols]. Returns 0 on success. Loads read out-of-bounds box elements
// as zeros; stores skip them.
static inline int tma_encode_2d(CUtensorMap *map, CUtensorMapDataType dtype, uint32_t elem_bytes,
                                const void *base, uint64_t rows, uint64_t cols, uint32_t box_rows,
                                uint32_t box_cols, CUtensorMapSwizzle swizzle,
                                CUtensorMapL2promotion promotion) {
  cuuint64_t dims[2] = {cols, rows};
  cuuint64_t strides[1] = {cols * elem_bytes};  // bytes between rows
  cuuint32_t box[2] = {box_cols, box_rows};
  cuuint32_t elem_strides[2] = {1, 1};
  tma_encode_tiled_fn encode = tma_encode_fn();
  if (!encode) return 1;
  CUresult r = encode(map, dtype, 2, (void *)base, dims, strides, box, elem_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : 1;
}

// Box [box_rows, 128 bytes] with the 128-byte swizzle: operand and staged output tiles.
static inline int tma_encode_sw128(CUtensorMap *map, CUtensorMapDataType dtype, uint32_t elem_bytes,
                                   const void *base, uint64_t rows, uint64_t cols,
                                   uint32_t box_rows) {
  return tma_encode_2d(map, dtype, elem_bytes, base, rows, cols, box_rows,
                       128 / elem_bytes,  // 128 bytes = the swizzle span
                       CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// bf16 [rows, cols], box [box_rows, 64]: K-major operand tiles and staged output tiles.
static inline int tma_encode_bf16_sw128(CUtensorMap *map, const void *base, uint64_t rows,
                                        uint64_t cols, uint32_t box_rows) {
  return tma_encode_sw128(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rows, cols, box_rows);
}

// fp32 [rows, cols], box [box_rows, 32]: staged fp32 output tiles.
static inline int tma_encode_f32_sw128(CUtensorMap *map, const void *base, uint64_t rows,
                                       uint64_t cols, uint32_t box_rows) {
  return tma_encode_sw128(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, rows, cols, box_rows);
}

// e4m3 bytes [rows, cols], box [box_rows, 128]: K-major fp8 operand tiles.
static inline int tma_encode_e4m3_sw128(CUtensorMap *map, const void *base, uint64_t rows,
                                        uint64_t cols, uint32_t box_rows) {
  return tma_encode_sw128(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rows, cols, box_rows);
}

// fp32 [rows, cols], box [1, box_cols] without swizzle: a run of one row, such as the row scales
// of one K block in a K-block-major scale array.
static inline int tma_encode_f32_rows(CUtensorMap *map, const void *base, uint64_t rows,
                                      uint64_t cols, uint32_t box_cols) {
  return tma_encode_2d(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, rows, cols, 1, box_cols,
                       CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
}

#endif /* MOK_CUDA_TMA_CUH */
