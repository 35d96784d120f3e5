/*
 * quantized_weights.c: the layout of the buffer mok_quantize_weights fills, and the host quantizer
 * that fills it for CPU layers (GPU layers: src/cuda/quant/quantize.cu).
 *
 * Every GEMM operand is stored K-major (its reduction dim contiguous), because FP8 wgmma reads both
 * operands K-major; backward's data-gradient GEMMs reduce over the other dim, hence the transposed
 * copies (*_T). fp8-block quantizes in 128x128 blocks (a transposed copy holds the same values);
 * MXFP8 in 1x32 blocks along each copy's reduction dim (a transposed copy has its own scales).
 */
#include <stdlib.h>

#include "cuda/quant/quant.h" /* mok_quantize_weights_gpu (its stub without CUDA) */
#include "common/checked.h"
#include "cpu/quant.h"
#include "api/api.h"

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

void mok_qw_layout(const mok_layer_desc_t *d, int64_t EL, mok_qw_layout_t *out) {
  const int64_t H = d->hidden, I = d->intermediate, Is = d->shared_intermediate;
  /* {count, rows, cols} of each operand, cols = its reduction dim */
  const int64_t shape[MOK_QW_COUNT][3] = {
      {EL, I, H}, {EL, I, H}, {EL, H, I},  /* wg, wu, wd */
      {EL, H, I}, {EL, H, I}, {EL, I, H},  /* wg_T, wu_T, wd_T */
      {1, Is, H}, {1, Is, H}, {1, H, Is},  /* wsg, wsu, wsd */
      {1, H, Is}, {1, H, Is}, {1, Is, H}}; /* wsg_T, wsu_T, wsd_T */
  const int mx = d->precision == MOK_PRECISION_MXFP8;
  const mok_quant_scale_t kind = mx ? MOK_QUANT_E8M0_SCALE
                                 : d->fp8_scale == MOK_FP8_SCALE_POW2 ? MOK_QUANT_POW2_SCALE
                                                                      : MOK_QUANT_FP32_SCALE;
  const int br = mx ? 1 : 128, bc = mx ? 32 : 128;
  const size_t scale_bytes = mx ? 1 : 4;
  size_t off = 0;
  for (int i = 0; i < MOK_QW_COUNT; i++) {
    mok_qw_operand_t *o = &out->op[i];
    o->count = shape[i][0];
    o->rows = shape[i][1];
    o->cols = shape[i][2];
    o->br = br;
    o->bc = bc;
    o->kind = kind;
    o->transposed = (i >= MOK_QW_WG_T && i <= MOK_QW_WD_T) || i >= MOK_QW_WSG_T;
    o->scale_stride = (size_t)(mok_ceil_div(o->rows, br) * mok_ceil_div(o->cols, bc)) * scale_bytes;
    if (d->precision == MOK_PRECISION_BF16 || o->rows == 0 || o->cols == 0) { /* nothing stored */
      o->count = o->rows == 0 || o->cols == 0 ? 0 : o->count; /* Is = 0: no shared copies */
      o->data = o->scales = off;
      continue;
    }
    o->data = off;
    off = align_up(off + (size_t)(o->count * o->rows * o->cols), 256);
    o->scales = off;
    off = align_up(off + (size_t)o->count * o->scale_stride, 256);
  }
  out->bytes = d->precision == MOK_PRECISION_BF16 ? 0 : off;
}

/* Quantizes the `count` bf16 source matrices of operand o (read transposed for a backward copy)
 * into the buffer. */
static mokResult_t quantize_operand(mok_layer_t l, const uint16_t *src, const mok_qw_operand_t *o,
                                    uint8_t *buf) {
  const int64_t rows = o->rows, cols = o->cols; /* of the stored copy */
  float *m = malloc(sizeof(float) * (size_t)(rows * cols));
  if (!m) return mok_fail(l, MOK_ERROR_OUT_OF_MEMORY, "mok_quantize_weights: malloc");
  for (int64_t e = 0; e < o->count; e++) {
    const uint16_t *w = src + e * rows * cols;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < cols; c++) /* the source is [cols, rows] when transposed */
        m[r * cols + c] = mok_bf16_to_float(o->transposed ? w[c * rows + r] : w[r * cols + c]);
    mokResult_t res = mok_quantize_host(m, rows, cols, o->br, o->bc, o->kind,
                                        buf + o->data + (size_t)(e * rows * cols),
                                        buf + o->scales + (size_t)e * o->scale_stride);
    if (res != MOK_SUCCESS) {
      free(m);
      return mok_fail(l, res, "mok_quantize_weights: %s", mok_last_error());
    }
  }
  free(m);
  return MOK_SUCCESS;
}

mokResult_t mok_cpu_quantize_weights(mok_layer_t l, const mok_weights_t *w, void *out) {
  mok_qw_layout_t q;
  mok_qw_layout(&l->d, l->EL, &q);
  const uint16_t *src[MOK_QW_COUNT] = {w->wg, w->wu, w->wd, w->wg, w->wu, w->wd,
                                       w->wsg, w->wsu, w->wsd, w->wsg, w->wsu, w->wsd};
  for (int i = 0; i < MOK_QW_COUNT; i++) {
    if (q.op[i].count == 0) continue;
    mokResult_t r = quantize_operand(l, src[i], &q.op[i], out);
    if (r != MOK_SUCCESS) return r;
  }
  return MOK_SUCCESS;
}

#ifndef MOK_WITH_CUDA
/* The GPU quantizer lives in src/cuda/quant/quantize.cu; a build without nvcc has no GPU layers, so
 * layer.c never gets here, but the symbol must exist for it to link. */
mokResult_t mok_quantize_weights_gpu(const mok_layer_desc_t *d, int64_t EL, const mok_weights_t *w,
                                     void *out, void *stream) {
  (void)d, (void)EL, (void)w, (void)out, (void)stream;
  return mok_fail(NULL, MOK_ERROR_NO_DEVICE, "this build of MoK has no CUDA support");
}
#endif
