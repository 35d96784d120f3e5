/*
 * backward.h: the launchers of a GPU layer's backward kernels, around the grouped GEMMs.
 *
 * A host/device contract: plain C11 and C++, no CUDA types (streams are void *); every launcher
 * validates its arguments on the host, returns a mokResult_t, and never synchronizes.
 */
#ifndef MOK_CUDA_BACKWARD_H
#define MOK_CUDA_BACKWARD_H

#include <stdint.h>
#include <string.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ============================================================================================== */
/*
 * The kernels src/gpu/backward.c chains for mok_backward on one GPU, around the grouped GEMMs:
 * context check (one CTA) -> gathers of x and dy (mok_fwd_gather_launch) -> [RECOMPUTE: gate/up
 * GEMMs] -> ds GEMM -> SwiGLU backward -> dxk GEMM -> shared expert -> dx reduce -> weight
 * gradients (mok_grouped_wgrad_launch, and wgrad_store for accumulated bf16 gradients). Buffers
 * are the regions of src/common/workspace.h; the routing (slot_row, offsets) comes from the context.
 * No launcher synchronizes or reads device memory on the host.
 */

/* The per-call state of a backward: what the context check writes and the dx reduce reads. */
typedef struct {
  int64_t T, H, E, K;         /* this call's tokens; E = local experts */
  const int32_t *topk_idx;    /* [T, K] (context check: the routing hash) */
  /* context (read) */
  const void *ctx_header;     /* mok_ctx_header_t */
  const int32_t *ctx_slot_row;/* [T_max, K] */
  const int32_t *ctx_offsets; /* [E + 1] */
  uint64_t layer_id;
  int64_t context_mode;
  /* workspace */
  void *err;                  /* mok_ws_error_t */
  int32_t *status;            /* [1] 1: the context matches, the call computes; 0: it does nothing */
  int32_t *offsets;           /* [E + 1] ctx_offsets, or all 0 when the context does not match */
  int32_t *shared_offsets;    /* [2] {0, T}, or {0, 0} */
  const void *dxk;            /* [R, H] bf16 (dx reduce) */
  const float *dxs;           /* [T, H] fp32 shared-expert data gradient, NULL when Is = 0 */
  const float *dw_row;        /* [R] router-weight gradient of each row */
  /* outputs */
  void *dx;                   /* [T, H] bf16 */
  float *dtopk_w;             /* [T, K] */
} mok_bwd_local_params_t;

/* One CTA: compares the context header with this call (magic, layer id, T, the routing hash of
 * topk_idx as layout_local.cu computes it, the mode). Match: status = 1, offsets = the context's,
 * shared_offsets = {0, T}. Mismatch: status = 0, offsets and shared_offsets all 0 (every later
 * kernel and GEMM of the call finds no rows), and MOK_ERROR_CONTEXT_MISMATCH in the error word. */
mokResult_t mok_bwd_context_check_launch(const mok_bwd_local_params_t *p, void *stream);

/* dx[t] = bf16( dxs[t] + dxk[row(t, 0)] + ... + dxk[row(t, K-1)] ) with bf16 dxk, fp32 in slot
 * order, empty slots skipped (dxs = 0 when NULL); dtopk_w[t, k] = dw_row[row(t, k)], 0 for an
 * empty slot. Rows from ctx_slot_row. Nothing is written when status is 0. */
mokResult_t mok_bwd_reduce_launch(const mok_bwd_local_params_t *p, void *stream);

/* The SwiGLU backward of every row in [offsets[0], offsets[G]), one warp per row, from bf16 g, u,
 * the row's weight w and ds (fp32), with s = silu(g) · u in fp32:
 *   a = bf16(w · s)   dg = bf16((w · ds) · u · silu'(g))   du = bf16((w · ds) · silu(g))
 *   dw_row[r] = Σ_i ds_i · s_i in fp32: each lane sums its columns 4 (32 j + lane) + (0..3),
 *               j = 0, 1, ... with fmaf in that order, then a butterfly over the 32 lanes
 *               (xor 16, 8, 4, 2, 1). Fixed: bitwise the same run after run.
 * The products are those of src/cpu/ref_backward.c in its order, without contractions.
 * fp8-block layers (dgq not NULL): dg and du also quantized as they are written, their 1x128
 * blocks (e4m3 dgq, duq [m_total, n], fp32 or power-of-two scales by q_kind in one K-block-major
 * array q_scales [2 n / 128, q_ld], du's blocks after dg's) bit for bit mok_quantize_launch's of
 * the bf16 dg, du, so the dxk GEMM needs no quantizer pass. */
typedef struct {
  int64_t num_groups;         /* G */
  int64_t m_total;            /* rows of every buffer (>= offsets[G]) */
  int64_t n;                  /* I or Is: a multiple of 128 */
  const int32_t *offsets;     /* [G + 1] device memory */
  const void *g, *u;          /* [m_total, n] bf16 */
  const float *ds;            /* [m_total, n] fp32 */
  const float *row_w;         /* [m_total] router weight of each row; NULL = 1 (shared expert) */
  void *a, *dg, *du;          /* [m_total, n] bf16, written */
  float *dw_row;              /* [m_total] written; NULL: not computed (shared expert) */
  void *dgq, *duq;            /* NULL, or [m_total, n] e4m3, 4-byte aligned, written */
  float *q_scales;            /* with dgq: [2 n / 128, q_ld] */
  int64_t q_ld;               /* with dgq: >= m_total */
  mok_quant_scale_t q_kind;   /* with dgq: MOK_QUANT_FP32_SCALE or MOK_QUANT_POW2_SCALE */
} mok_bwd_swiglu_params_t;
mokResult_t mok_bwd_swiglu_launch(const mok_bwd_swiglu_params_t *p, void *stream);

/* The fused backward (backward/fused.cu): the routed experts' dxk and weight gradients as one
 * persistent kernel after the prologue of src/gpu/backward.c (which leaves xg, dyg, a, dg, du
 * and dw_row in the workspace), and, with `reduce`, dx and dtopk_w (the dx reduce's parameters:
 * slot_row, dxs, dw_row, dx, dtopk_w, T, K). BF16 operands; the weight gradients stored in fp32
 * or bf16, or accumulated in fp32 (wgrad_epilogue: MOK_GG_EPI_STORE_F32, _STORE_BF16,
 * _ACCUM_F32). Bitwise the chain's dxk GEMM, weight-gradient GEMMs and dx reduce, for any grid.
 * Zeroes the first MOK_FC_GU counters on the stream, then launches one CTA per SM (num_sms > 0:
 * at most that many). */
typedef struct {
  int64_t H, I, E, R;          /* hidden, intermediate, local experts, capacity rows */
  const int32_t *status;       /* [1] the context check's verdict */
  const int32_t *offsets;      /* [E + 1] */
  const void *xg, *dyg;        /* [R, H] bf16 */
  const void *a, *dg, *du;     /* [R, I] bf16 */
  const void *wg, *wu;         /* [E, I, H] bf16 */
  void *dxk;                   /* [R, H] bf16, written */
  void *dwg, *dwu, *dwd;       /* [E, I, H], [E, I, H], [E, H, I] fp32 or bf16 */
  int wgrad_epilogue;          /* mok_gg_epilogue_t, as above */
  const mok_bwd_local_params_t *reduce; /* NULL: no dx reduce (expert parallel: after the combine) */
  uint32_t *counters;          /* the workspace's MOK_FC_* counters */
  int64_t n_counters;
  void *err;                   /* mok_ws_error_t */
  int num_sms;                 /* CTAs; 0 = every SM */
  int tile_group_m;            /* the tuning's tile_group_m */
  int lag_dw;                  /* expert stages from an expert's DX tiles to its DW tiles; 0 = by
                                  the shape */
  double timeout_s;            /* bound of the reduce's wait */
} mok_bwd_fused_params_t;
mokResult_t mok_bwd_fused_launch(const mok_bwd_fused_params_t *p, void *stream);
mokResult_t mok_bwd_fused_preload(void);

/* Loads the backward's own kernels now (the context check, SwiGLU backward, wgrad store), not at
 * their first launch (src/cuda/gemm/gemm.h, mok_gg_preload, says why). */
mokResult_t mok_bwd_preload(void);

/* Stores an fp32 weight gradient g [n] into the caller's bf16 buffer: dst = bf16(g), or
 * bf16(fp32(dst) + g) when accumulate (src/cpu_backend.c's write_wgrad, bit for bit). n % 8 == 0,
 * both pointers 16-byte aligned. */
mokResult_t mok_bwd_wgrad_store_bf16_launch(const float *g, void *dst, int64_t n, int accumulate,
                                            void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOK_CUDA_BACKWARD_H */
