/*
 * quant.h: the quantizer launchers (include/mok.h "Quantizers" is the bit-exact specification).
 *
 * A host/device contract: plain C11 and C++, no CUDA types (streams are void *); every launcher
 * validates its arguments on the host, returns a mokResult_t, and never synchronizes.
 */
#ifndef MOK_CUDA_QUANT_H
#define MOK_CUDA_QUANT_H

#include <stdint.h>
#include <string.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif


/* `count` bf16 matrices quantized to e4m3 values and block scales, each exactly as
 * mok_quantize_host quantizes it (bf16 -> fp32 is exact). The stored copy is [rows, cols]; its
 * element (e, r, c) is read from
 *   in[e * in_stride + r * in_ld + c]   transpose = 0, or
 *   in[e * in_stride + c * in_ld + r]   transpose = 1 (the source is [cols, rows]: the transposed
 *                                       copies of mok_quantize_weights)
 * and the outputs are packed matrix after matrix, each as mok_quantize_host writes it:
 *   q      [count, rows, cols] e4m3
 *   scales [count, ceil(rows / block_rows), ceil(cols / block_cols)] fp32 (FP32, POW2) or E8M0
 *          bytes. */
typedef struct {
  const void *in;             /* bf16, device memory, 2-byte aligned */
  int transpose;              /* 0 or 1 */
  int64_t in_ld;              /* elements between source rows; 0 = packed (cols, or rows when
                                 transposed) */
  int64_t in_stride;          /* elements between source matrices; 0 = packed (rows * cols) */
  int64_t count, rows, cols;  /* >= 0; rows * cols <= 2^40, count <= 2^20 */
  int block_rows, block_cols; /* powers of two in 1..128 (blocks tile the kernel's 128x128 tiles) */
  mok_quant_scale_t kind;
  uint8_t *q;                 /* device memory */
  void *scales;               /* device memory, 4-byte aligned for fp32 scales */
  int64_t scales_ld;          /* 0: scales as above; > 0: transposed, scale (b_r, b_c) of a
                                 matrix at [b_c * scales_ld + b_r] (scales_ld >= ceil(rows /
                                 block_rows); matrices scales_ld * ceil(cols / block_cols) apart):
                                 the K-block-major activation scales of the fp8 grouped GEMM */
  const int32_t *rows_limit;  /* NULL, or device memory: rows at or past *rows_limit are neither
                                 read nor written (a layer's routed rows, offsets[E], which the
                                 host does not know); only for 1x128 blocks of rows a multiple
                                 of 128 long, one matrix, 16-byte aligned in, 8-byte aligned q */
} mok_quantize_params_t;

/* Validates `p` (MOK_ERROR_NULL_POINTER, MOK_ERROR_INVALID_VALUE, MOK_ERROR_INVALID_SHAPE,
 * MOK_ERROR_MISALIGNED, with the detail in mok_last_error()) and enqueues the kernel on `stream`
 * (a cudaStream_t of the current device); MOK_ERROR_CUDA when the launch fails. An empty matrix
 * succeeds without touching the device. */
mokResult_t mok_quantize_launch(const mok_quantize_params_t *p, void *stream);

/* MXFP8 activations as the layer's bf16 GEMMs read them: out [rows, cols] bf16 holds, for every
 * element of in [rows, cols] bf16, its MXFP8 value (1x32 blocks along cols, E8M0 scales, exactly
 * as mok_quantize_host quantizes them) dequantized, q * 2^X, rounded to bf16. That rounding is
 * exact (q has 4 significant bits) whenever q * 2^X is a bf16 normal, i.e. for every block whose
 * scale exponent X is at least -117 (amax above about 2^-109); below that the tiniest values
 * round to bf16 subnormals. A non-finite block gives NaN elements. `in` may be `out`. cols % 128
 * == 0; in and out 16-byte aligned; rows_limit: NULL, or device memory, as in
 * mok_quantize_params_t. */
mokResult_t mok_mx_qdq_rows_launch(const void *in, void *out, int64_t rows, int64_t cols,
                                   const int32_t *rows_limit, void *stream);

/* MXFP8 activations as an expert-parallel layer sends them (src/gpu/forward_ep.c): the rows of
 * in [rows, cols] bf16 quantized exactly as mok_quantize_host quantizes them (1x32 blocks along
 * cols, E8M0 scales) into q [rows, cols] e4m3 and their scales four to a 32-bit word: word b of
 * row r, at scales[b * scales_ld + r] (scales_ld >= rows), holds the scales of blocks 4b .. 4b + 3
 * of the row (elements 128 b .. 128 b + 127), block 4b + j in byte j. That is the shape of the
 * fp8-block activation scales (one 4-byte word per 128 elements), so the transport carries both
 * alike. out: NULL, or also the dequantized bf16 values, as mok_mx_qdq_rows_launch writes them.
 * cols % 128 == 0; in and out 16-byte, q 8-byte, scales 4-byte aligned. */
mokResult_t mok_mx_quantize_rows_launch(const void *in, uint8_t *q, uint32_t *scales,
                                        int64_t scales_ld, void *out, int64_t rows, int64_t cols,
                                        void *stream);

/* Fills the whole quantized-weight buffer `out` (mok_qw_layout(d, EL) bytes, device memory) from
 * the bf16 weights `w` (device memory), byte for byte as mok_cpu_quantize_weights does on the
 * host; bytes between operands (alignment gaps) are not written. One launch on `stream`, on the
 * device that holds `out`; the caller's current device is kept. Without CUDA (a build without
 * nvcc) it reports MOK_ERROR_NO_DEVICE. */
mokResult_t mok_quantize_weights_gpu(const mok_layer_desc_t *d, int64_t EL, const mok_weights_t *w,
                                     void *out, void *stream);


/* Loads the quantizer's kernels now (as mok_gg_preload: virtual ranks' first launches must not
 * wait for kernels that wait for later calls of the same thread). */
mokResult_t mok_quant_preload(void);

#ifdef __cplusplus
}
#endif

#endif /* MOK_CUDA_QUANT_H */
