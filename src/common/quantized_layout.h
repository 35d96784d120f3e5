/*
 * quantized_layout.h: the layout of the buffer mok_quantize_weights fills, one function for the
 * host quantizer (src/cpu/quantized_weights.c) and the GPU one (src/cuda/quant/quantize.cu).
 */
#ifndef MOK_COMMON_QUANTIZED_LAYOUT_H
#define MOK_COMMON_QUANTIZED_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One operand copy: e4m3 values [EL or 1, rows, cols] row-major (cols = the GEMM's reduction dim),
 * then scales [EL or 1, ceil(rows / br), ceil(cols / bc)] (fp32, or E8M0 bytes for MXFP8). */
typedef struct {
  size_t data, scales; /* byte offsets into the buffer */
  int64_t count, rows, cols;
  int br, bc;
  mok_quant_scale_t kind;
  int transposed;      /* a backward copy: stored as the transpose of its bf16 source */
  size_t scale_stride; /* bytes of one expert's scales */
} mok_qw_operand_t;

typedef enum {
  MOK_QW_WG = 0, MOK_QW_WU, MOK_QW_WD,        /* forward: [EL,I,H], [EL,I,H], [EL,H,I] */
  MOK_QW_WG_T, MOK_QW_WU_T, MOK_QW_WD_T,      /* backward, transposed: [EL,H,I], [EL,H,I], [EL,I,H] */
  MOK_QW_WSG, MOK_QW_WSU, MOK_QW_WSD,         /* shared forward */
  MOK_QW_WSG_T, MOK_QW_WSU_T, MOK_QW_WSD_T,   /* shared backward, transposed */
  MOK_QW_COUNT
} mok_qw_which_t;

typedef struct {
  mok_qw_operand_t op[MOK_QW_COUNT];
  size_t bytes;
} mok_qw_layout_t;

/* The one layout of the quantized-weight buffer (host and device agree by calling this). */
void mok_qw_layout(const mok_layer_desc_t *d, int64_t EL, mok_qw_layout_t *out);

#ifdef __cplusplus
}
#endif

#endif /* MOK_COMMON_QUANTIZED_LAYOUT_H */
