/*
 * gpu/backward.c: mok_backward on a GPU layer, host side. W = 1 runs the unfused GPU backward of
 * docs/design.md ("The layer"): a chain of kernels on the caller's stream
 * (src/cuda/backward/backward.h), with no host synchronization and no device data read on the
 * host, like the forward (gpu/forward.c):
 *
 *   context check (1 CTA)  ctx header vs this call -> status, offsets [E + 1], shared_offsets
 *   gathers                x -> xg [R, H], dy -> dyg [R, H] (expert order), topk_w -> row_w [R]
 *   RECOMPUTE mode only    gate/up GEMM on xg -> bf16 g, u [R, I] (the forward's, bit for bit);
 *                          shared gate/up on x -> gs, us [T, Is]
 *   ds GEMM                ds [R, I] fp32 = dyg · Wd[e]            (B N-major: Wd as [E, H, I])
 *   SwiGLU backward        a, dg, du [R, I] bf16, dw_row [R] fp32  (backward/swiglu.cu)
 *   dxk GEMM               dxk [R, H] bf16 = bf16(dg · Wg[e] + du · Wu[e]), one reduction of 2I
 *                          (Wg as [E, I, H]; the GEMM's second segment, gemm.h)
 *   shared expert (Is > 0) dss [T, Is] = dy · Wsd; SwiGLU backward with w = 1 -> as, dgs, dus;
 *                          dxs [T, H] fp32 = dgs · Wsg + dus · Wsu (one reduction of 2 Is)
 *   weight gradients       dWd[e] = dygᵀ · a, dWg[e] = dgᵀ · xg, dWu[e] = duᵀ · xg over the rows
 *                          of expert e in layout order; dWsd = dyᵀ · as, dWsg = dgsᵀ · x,
 *                          dWsu = dusᵀ · x (mok_grouped_wgrad_launch)
 *   dx reduce              dx [T, H] = bf16(dxs + Σ_k dxk[row(t, k)]), dtopk_w [T, K]
 *
 * fp8-block layers run the same chain with e4m3 GEMMs for the recompute, ds and the data
 * gradients: dyg, dy (along H) and dg, du (along I) quantized per row in 1x128 blocks, times the
 * transposed weight copies of mok_quantize_weights; the weight gradients stay bf16 GEMMs of the
 * unquantized rows, as the reference's (src/cpu/ref_backward.c). MXFP8 layers (W = 1) the same
 * with the rows quantize-dequantized in 1x32 E8M0 blocks to bf16 and MXFP8-B GEMMs (bf16 MMA on
 * the e4m3 weight copies, dequantized in shared memory).
 *
 * The steps from the gate/up recompute to the weight gradients are the local chain
 * (mok_gpu_backward_local), which the expert-parallel backward (gpu/backward_ep.c) runs too, on
 * the rows its rank's experts received.
 *
 * The routing (slot_row, offsets) and, in SAVE mode, g and u come from the context; the
 * workspace (src/common/workspace.h) is scratch, so a forward of other tokens between this call's forward
 * and this call does no harm. Weight gradients in the layer's dtype, overwritten or accumulated:
 * fp32 overwrite / accumulate and bf16 overwrite are epilogues of the weight-gradient GEMM; bf16
 * accumulate goes through the fp32 wgrad32 region and bf16(fp32(old) + g) (wgrad_store.cu).
 *
 * Context check: whether ctx belongs to this call is written in device memory, so the host
 * cannot decide it without synchronizing; the check kernel decides on the device. A mismatch
 * (another layer, a failed forward, other T or routing) makes the call compute nothing: dx and
 * dtopk_w keep their contents, weight gradients get zeros (overwrite) or stay (accumulate), and
 * MOK_ERROR_CONTEXT_MISMATCH is reported by mok_layer_check. T = 0: zero weight gradients
 * (cudaMemsetAsync) or nothing when accumulating.
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/backward/backward.h"
#include "cuda/forward/forward.h"

/* T = 0: nothing was routed; overwritten weight gradients become zeros. */
static mokResult_t bwd_zero_wgrads(mok_layer_t l, const mok_backward_args_t *g, void *stream) {
  if (l->d.wgrad_accumulate) return MOK_SUCCESS;
  const size_t el = l->d.wgrad_dtype == MOK_WGRAD_BF16 ? 2 : 4;
  const size_t H = (size_t)l->d.hidden, I = (size_t)l->d.intermediate,
               Is = (size_t)l->d.shared_intermediate, E = (size_t)l->EL;
  void *dst[6] = {g->dwg, g->dwu, g->dwd, g->dwsg, g->dwsu, g->dwsd};
  const size_t bytes[6] = {E * I * H * el, E * I * H * el, E * H * I * el,
                           Is * H * el,    Is * H * el,    H * Is * el};
  for (int i = 0; i < (Is > 0 ? 6 : 3); i++) {
    const cudaError_t e = cudaMemsetAsync(dst[i], 0, bytes[i], (cudaStream_t)stream);
    if (e != cudaSuccess) return mok_gpu_cuda_fail(l, "mok_backward: cudaMemsetAsync of a weight gradient", e);
  }
  return MOK_SUCCESS;
}

/* ---- the local chain ------------------------------------------------------------------------- */

/* fp8-block, RECOMPUTE mode: g, u (and gs, us) again, bit for bit the forward's: the forward's
 * e4m3 x rows (mok_gpu_fp8_rows) and its fp8 SwiGLU GEMMs. */
static mokResult_t fp8_recompute(mok_layer_t l, const mok_forward_args_t *a,
                                 const mok_bwd_rows_t *c, void *stream) {
  const int64_t T = a->num_tokens, Is = l->d.shared_intermediate;
#define WS(region) mok_gpu_ws(l, region)
  mokResult_t r = mok_gpu_fp8_rows(l, c->gather, a->x, WS(MOK_WS_XG), c->offsets, T, stream);
  if (r != MOK_SUCCESS) return r;
  /* a is overwritten by the SwiGLU backward */
  mok_grouped_gemm_params_t gu = mok_gpu_fp8_swiglu_params(
      l, &a->w, 0, T, c->offsets, c->row_w, WS(MOK_WS_A), WS(MOK_WS_G), WS(MOK_WS_U));
  if ((r = mok_gpu_gemm(l, &gu, "mok_backward", "fp8 recompute gate/up", stream)) != MOK_SUCCESS)
    return r;
  if (Is > 0 && T > 0) { /* x quantized in xqt by mok_gpu_fp8_rows */
    mok_grouped_gemm_params_t sgu = mok_gpu_fp8_swiglu_params(
        l, &a->w, 1, T, c->shared_offsets, NULL, WS(MOK_WS_AS), WS(MOK_WS_GS), WS(MOK_WS_US));
    r = mok_gpu_gemm(l, &sgu, "mok_backward", "fp8 recompute shared gate/up", stream);
  }
#undef WS
  return r;
}

/* fp8-block: the SwiGLU backward sb also writes dg and du quantized along n (1x128 blocks, the
 * layer's scale kind) into q, q2 [rows, n] with one K-block-major scale array [2 n / 128, ld]
 * (du's blocks after dg's), the data-gradient GEMM's A (fp8_dx_params). */
static void fp8_swiglu_outputs(mok_layer_t l, void *q, void *q2, float *scales, int64_t ld,
                               mok_bwd_swiglu_params_t *sb) {
  sb->dgq = q, sb->duq = q2, sb->q_scales = scales, sb->q_ld = ld;
  sb->q_kind = mok_gpu_fp8_kind(l);
}

/* fp8-block: the data-gradient GEMM p (dxk, or the shared dxs: its epilogue, groups and offsets
 * already set) as fp8 on dg and du quantized by the SwiGLU backward (fp8_swiglu_outputs: q, q2
 * with one K-block-major scale array, du's blocks after dg's), times the transposed copies of
 * the gate and up weights (`gate_t`, and the up copy right after it in mok_qw_which_t): one
 * reduction of 2n, gate first, as the reference's data_grad. */
static void fp8_dx_params(mok_layer_t l, const mok_forward_args_t *a, int64_t n, int64_t ld,
                          void *q, void *q2, float *scales, mok_qw_which_t gate_t,
                          mok_grouped_gemm_params_t *p) {
  mok_grouped_gemm_params_t f = mok_gg_fp8_params(p->epilogue, p->num_groups, p->m_total, p->n, n);
  f.a = q, f.a2 = q2, f.k2 = n;
  f.a_scale = scales, f.a_scale_ld = ld;
  mok_gpu_qw_operand(l, &a->w, gate_t, 0, &f);
  mok_gpu_qw_operand(l, &a->w, (mok_qw_which_t)(gate_t + 1), 1, &f); /* the up copy */
  f.offsets = p->offsets, f.c = p->c;
  *p = f;
}

/* MXFP8, RECOMPUTE mode: g, u (and gs, us) again, bit for bit the forward's: the same MXFP8 x
 * rows (quantize-dequantize is per row, so that of the gathered xg equals the gather of the
 * forward's xdq) into `xq` [R, H], and the forward's MXFP8-B SwiGLU GEMMs. */
static mokResult_t mx_recompute(mok_layer_t l, const mok_forward_args_t *a,
                                const mok_bwd_rows_t *c, void *xq, void *stream) {
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, E = l->EL, R = l->capacity_rows;
#define WS(region) mok_gpu_ws(l, region)
  mokResult_t r = mok_gpu_mx_qdq(l, WS(MOK_WS_XG), xq, R, H, c->offsets + E, stream);
  if (r != MOK_SUCCESS) return r;
  mok_grouped_gemm_params_t gu = mok_gg_mx_params(MOK_GG_EPI_SWIGLU, E, R, I, H);
  gu.a = xq;
  mok_gpu_qw_operand(l, &a->w, MOK_QW_WG, 0, &gu);
  mok_gpu_qw_operand(l, &a->w, MOK_QW_WU, 1, &gu);
  gu.offsets = c->offsets, gu.row_scale = c->row_w;
  gu.c = WS(MOK_WS_A), gu.g_out = WS(MOK_WS_G), gu.u_out = WS(MOK_WS_U); /* a: overwritten later */
  if ((r = mok_gpu_gemm(l, &gu, "mok_backward", "MXFP8 recompute gate/up", stream)) != MOK_SUCCESS)
    return r;
  if (Is > 0 && T > 0) {
    if ((r = mok_gpu_mx_qdq(l, a->x, WS(MOK_WS_XDQ), T, H, NULL, stream)) != MOK_SUCCESS) return r;
    mok_grouped_gemm_params_t sgu = mok_gg_mx_params(MOK_GG_EPI_SWIGLU, 1, T, Is, H);
    sgu.a = WS(MOK_WS_XDQ);
    mok_gpu_qw_operand(l, &a->w, MOK_QW_WSG, 0, &sgu);
    mok_gpu_qw_operand(l, &a->w, MOK_QW_WSU, 1, &sgu);
    sgu.offsets = c->shared_offsets;
    sgu.c = WS(MOK_WS_AS), sgu.g_out = WS(MOK_WS_GS), sgu.u_out = WS(MOK_WS_US);
    r = mok_gpu_gemm(l, &sgu, "mok_backward", "MXFP8 recompute shared gate/up", stream);
  }
#undef WS
  return r;
}

/* MXFP8: the data-gradient GEMM p (dxk, or the shared dxs) on dg and du [rows, n] quantize-
 * dequantized along n into q, q2, times the transposed MXFP8 copies of the gate and up weights
 * (gate_t, then the up copy after it): one reduction of 2n, gate first. */
static mokResult_t mx_dx_params(mok_layer_t l, const mok_forward_args_t *a, const void *dg,
                                const void *du, int64_t rows, const int32_t *limit, int64_t n,
                                void *q, void *q2, mok_qw_which_t gate_t,
                                mok_grouped_gemm_params_t *p, void *stream) {
  mokResult_t r = mok_gpu_mx_qdq(l, dg, q, rows, n, limit, stream);
  if (r == MOK_SUCCESS) r = mok_gpu_mx_qdq(l, du, q2, rows, n, limit, stream);
  if (r != MOK_SUCCESS) return r;
  mok_grouped_gemm_params_t f = mok_gg_mx_params(p->epilogue, p->num_groups, p->m_total, p->n, n);
  f.a = q, f.a2 = q2, f.k2 = n;
  mok_gpu_qw_operand(l, &a->w, gate_t, 0, &f);
  mok_gpu_qw_operand(l, &a->w, (mok_qw_which_t)(gate_t + 1), 1, &f);
  f.offsets = p->offsets, f.c = p->c;
  *p = f;
  return MOK_SUCCESS;
}

int mok_gpu_backward_fused(mok_layer_t l) {
  return l->tuning.backward_path == MOK_BACKWARD_FUSED &&
         l->d.precision == MOK_PRECISION_BF16 &&
         !(l->d.wgrad_dtype == MOK_WGRAD_BF16 && l->d.wgrad_accumulate);
}

/* The fused backward kernel (src/cuda/backward/fused.cu) on the rows the prologue left: the
 * routed experts' dxk and weight gradients, and with c->reduce dx and dtopk_w. */
static mokResult_t bwd_fused(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *gr, const mok_bwd_rows_t *c, void *stream) {
#define WS(region) mok_gpu_ws(l, region)
  mok_bwd_fused_params_t f;
  memset(&f, 0, sizeof(f));
  f.H = l->d.hidden, f.I = l->d.intermediate, f.E = l->EL, f.R = l->capacity_rows;
  f.status = (const int32_t *)WS(MOK_WS_STATUS), f.offsets = c->offsets;
  f.xg = WS(MOK_WS_XG), f.dyg = WS(MOK_WS_DYG);
  f.a = WS(MOK_WS_A), f.dg = WS(MOK_WS_DG), f.du = WS(MOK_WS_DU);
  f.wg = a->w.wg, f.wu = a->w.wu;
  f.dxk = c->dxk ? c->dxk : WS(MOK_WS_DXK);
  f.dwg = gr->dwg, f.dwu = gr->dwu, f.dwd = gr->dwd;
  f.wgrad_epilogue = l->d.wgrad_dtype == MOK_WGRAD_BF16 ? MOK_GG_EPI_STORE_BF16
                     : l->d.wgrad_accumulate           ? MOK_GG_EPI_ACCUM_F32
                                                       : MOK_GG_EPI_STORE_F32;
  f.reduce = c->reduce;
  f.counters = (uint32_t *)WS(MOK_WS_COUNTERS);
  f.n_counters = mok_fc_count(l->capacity_rows, l->EL, l->d.max_tokens);
  f.err = WS(MOK_WS_ERROR);
  f.num_sms = l->tuning.backward_sms;
  f.tile_group_m = l->tuning.tile_group_m;
  f.lag_dw = l->tuning.backward_lag;
  f.timeout_s = l->tuning.timeout_s;
#undef WS
  const mokResult_t r = mok_bwd_fused_launch(&f, stream);
  return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
}

mokResult_t mok_gpu_backward_local(mok_layer_t l, const mok_forward_args_t *a,
                                   const mok_backward_args_t *gr, const mok_bwd_rows_t *c,
                                   void *stream) {
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, E = l->EL, R = l->capacity_rows;
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE, shared = Is > 0 && T > 0;
  const int fp8 = l->d.precision == MOK_PRECISION_FP8_BLOCK, fused = mok_gpu_backward_fused(l);
  const int mx = l->d.precision == MOK_PRECISION_MXFP8;
  const int64_t R4 = mok_ws_ld4(R), T4 = mok_ws_ld4(l->d.max_tokens);
  const mok_ws_layout_t *lay = &l->gpu->lay; /* computed once, at mok_layer_create */
  mokResult_t r;
#define WS(region) mok_gpu_ws(l, region)
#define CTX(region) ((const void *)(c->ctx + lay->ctx[region]))
  /* MXFP8's dequantized rows, in regions free at the time (src/common/workspace.h): x or dy rows
   * [R, H] in dxk's (the dx GEMM writes it after the last reader), dg, du [R, I] in ds's halves
   * and dgs, dus in dss's (both dead once the SwiGLU backward has read them), x or dy [T, H] in
   * xdq. */
  uint8_t *xq = (uint8_t *)WS(MOK_WS_DXK), *gq = (uint8_t *)WS(MOK_WS_DS);
  uint8_t *sq = (uint8_t *)WS(MOK_WS_DSS);

  /* bf16 g, u: saved by forward, or recomputed here by the forward's own GEMMs. */
  const void *g = save ? CTX(MOK_CTX_G) : WS(MOK_WS_G), *u = save ? CTX(MOK_CTX_U) : WS(MOK_WS_U);
  const void *gs = save ? CTX(MOK_CTX_GS) : WS(MOK_WS_GS);
  const void *us = save ? CTX(MOK_CTX_US) : WS(MOK_WS_US);
  if (!save && fp8) {
    if ((r = fp8_recompute(l, a, c, stream)) != MOK_SUCCESS) return r;
  } else if (!save && mx) {
    if ((r = mx_recompute(l, a, c, xq, stream)) != MOK_SUCCESS) return r;
  } else if (!save) {
    mok_grouped_gemm_params_t gu =
        mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, E, R, I, H);
    gu.a = WS(MOK_WS_XG);         /* [R, H] */
    gu.b = a->w.wg;               /* [E, I, H] */
    gu.b2 = a->w.wu;
    gu.offsets = c->offsets;
    gu.c = WS(MOK_WS_A);          /* [R, I] forward's a: unused, overwritten below */
    gu.row_scale = c->row_w;
    gu.g_out = WS(MOK_WS_G), gu.u_out = WS(MOK_WS_U); /* [R, I] */
    if ((r = mok_gpu_gemm(l, &gu, "mok_backward", "recompute gate/up", stream)) != MOK_SUCCESS)
      return r;
    if (shared) {
      mok_grouped_gemm_params_t sgu =
          mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, 1, T, Is, H);
      sgu.a = a->x;               /* [T, H] */
      sgu.b = a->w.wsg, sgu.b2 = a->w.wsu; /* [Is, H] */
      sgu.offsets = c->shared_offsets;
      sgu.c = WS(MOK_WS_AS);      /* [T, Is], overwritten below */
      sgu.g_out = WS(MOK_WS_GS), sgu.u_out = WS(MOK_WS_US);
      if ((r = mok_gpu_gemm(l, &sgu, "mok_backward", "recompute shared gate/up", stream)) !=
          MOK_SUCCESS)
        return r;
    }
  }

  /* ds [R, I] = dyg · Wd[e] (Wd [E, H, I] is B [E, K = H, N = I], N-major; fp8: dyg quantized
   * along H times the transposed copy Wdᵀ [E, I, H], K-major). */
  mok_grouped_gemm_params_t dsp = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, E, R, I, H);
  dsp.a = WS(MOK_WS_DYG), dsp.b = a->w.wd, dsp.offsets = c->offsets, dsp.c = WS(MOK_WS_DS);
  if (fp8) {
    if ((r = mok_gpu_fp8_rows(l, c->gather, gr->dy, WS(MOK_WS_DYG), c->offsets, T, stream)) !=
        MOK_SUCCESS)
      return r;
    dsp = mok_gg_fp8_params(MOK_GG_EPI_STORE_F32, E, R, I, H);
    dsp.a = WS(MOK_WS_XQ), dsp.a_scale = (const float *)WS(MOK_WS_XQ_S), dsp.a_scale_ld = R4;
    mok_gpu_qw_operand(l, &a->w, MOK_QW_WD_T, 0, &dsp);
    dsp.offsets = c->offsets, dsp.c = WS(MOK_WS_DS);
  }
  if (mx) {
    if ((r = mok_gpu_mx_qdq(l, WS(MOK_WS_DYG), xq, R, H, c->offsets + E, stream)) != MOK_SUCCESS)
      return r;
    dsp = mok_gg_mx_params(MOK_GG_EPI_STORE_F32, E, R, I, H);
    dsp.a = xq;
    mok_gpu_qw_operand(l, &a->w, MOK_QW_WD_T, 0, &dsp);
    dsp.offsets = c->offsets, dsp.c = WS(MOK_WS_DS);
  }
  if ((r = mok_gpu_gemm(l, &dsp, "mok_backward", "routed ds", stream)) != MOK_SUCCESS) return r;

  /* SwiGLU backward: a, dg, du [R, I], dw_row [R]. */
  mok_bwd_swiglu_params_t sb;
  memset(&sb, 0, sizeof(sb));
  sb.num_groups = E, sb.m_total = R, sb.n = I, sb.offsets = c->offsets;
  sb.g = g, sb.u = u, sb.ds = (const float *)WS(MOK_WS_DS), sb.row_w = c->row_w;
  sb.a = WS(MOK_WS_A), sb.dg = WS(MOK_WS_DG), sb.du = WS(MOK_WS_DU);
  sb.dw_row = c->dw_row ? c->dw_row : (float *)WS(MOK_WS_DW_ROW);
  if (fp8) fp8_swiglu_outputs(l, WS(MOK_WS_AQ), WS(MOK_WS_AQ2), (float *)WS(MOK_WS_AQ_S), R4, &sb);
  if ((r = mok_bwd_swiglu_launch(&sb, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);

  /* dxk [R, H] bf16 = bf16(dg · Wg[e] + du · Wu[e]), one reduction of 2I (Wg [E, I, H] is
   * B [E, K = I, N = H]; Wu the second segment's). Fused: in the kernel below. */
  mok_grouped_gemm_params_t dx = mok_gg_bf16_params(MOK_GG_EPI_STORE_BF16, MOK_GG_B_NMAJOR, E, R, H, I);
  dx.a = WS(MOK_WS_DG), dx.b = a->w.wg, dx.offsets = c->offsets;
  dx.c = c->dxk ? c->dxk : WS(MOK_WS_DXK);
  dx.a2 = WS(MOK_WS_DU), dx.b2 = a->w.wu, dx.k2 = I;
  if (fp8)
    fp8_dx_params(l, a, I, R4, WS(MOK_WS_AQ), WS(MOK_WS_AQ2), (float *)WS(MOK_WS_AQ_S), MOK_QW_WG_T,
                  &dx);
  if (mx && (r = mx_dx_params(l, a, WS(MOK_WS_DG), WS(MOK_WS_DU), R, c->offsets + E, I, gq,
                              gq + R * I * 2, MOK_QW_WG_T, &dx, stream)) != MOK_SUCCESS)
    return r;
  if (!fused && (r = mok_gpu_gemm(l, &dx, "mok_backward", "routed dx", stream)) != MOK_SUCCESS)
    return r;

  /* Shared expert: one group [0, T) of dy and x themselves, weight 1, no router gradient. */
  if (shared) {
    mok_grouped_gemm_params_t ss = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, 1, T, Is, H);
    ss.a = gr->dy, ss.b = a->w.wsd, ss.offsets = c->shared_offsets; /* Wsd [H, Is] = [K, N] */
    ss.c = WS(MOK_WS_DSS);                                          /* [T, Is] */
    if (fp8) { /* dy quantized in xqt by mok_gpu_fp8_rows */
      ss = mok_gg_fp8_params(MOK_GG_EPI_STORE_F32, 1, T, Is, H);
      ss.a = WS(MOK_WS_XQT), ss.a_scale = (const float *)WS(MOK_WS_XQT_S), ss.a_scale_ld = T4;
      mok_gpu_qw_operand(l, &a->w, MOK_QW_WSD_T, 0, &ss); /* [Is, H] */
      ss.offsets = c->shared_offsets, ss.c = WS(MOK_WS_DSS);
    }
    if (mx) {
      if ((r = mok_gpu_mx_qdq(l, gr->dy, WS(MOK_WS_XDQ), T, H, NULL, stream)) != MOK_SUCCESS)
        return r;
      ss = mok_gg_mx_params(MOK_GG_EPI_STORE_F32, 1, T, Is, H);
      ss.a = WS(MOK_WS_XDQ);
      mok_gpu_qw_operand(l, &a->w, MOK_QW_WSD_T, 0, &ss); /* [Is, H] */
      ss.offsets = c->shared_offsets, ss.c = WS(MOK_WS_DSS);
    }
    if ((r = mok_gpu_gemm(l, &ss, "mok_backward", "shared ds", stream)) != MOK_SUCCESS) return r;
    mok_bwd_swiglu_params_t ssb;
    memset(&ssb, 0, sizeof(ssb));
    ssb.num_groups = 1, ssb.m_total = T, ssb.n = Is, ssb.offsets = c->shared_offsets;
    ssb.g = gs, ssb.u = us, ssb.ds = (const float *)WS(MOK_WS_DSS), ssb.row_w = NULL;
    ssb.a = WS(MOK_WS_AS), ssb.dg = WS(MOK_WS_DGS), ssb.du = WS(MOK_WS_DUS), ssb.dw_row = NULL;
    if (fp8)
      fp8_swiglu_outputs(l, WS(MOK_WS_ASQ), WS(MOK_WS_ASQ2), (float *)WS(MOK_WS_ASQ_S), T4, &ssb);
    if ((r = mok_bwd_swiglu_launch(&ssb, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);
    mok_grouped_gemm_params_t sx = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, 1, T, H, Is);
    sx.a = WS(MOK_WS_DGS), sx.b = a->w.wsg, sx.offsets = c->shared_offsets; /* Wsg [Is, H] */
    sx.a2 = WS(MOK_WS_DUS), sx.b2 = a->w.wsu, sx.k2 = Is; /* one reduction of 2 Is */
    sx.c = WS(MOK_WS_DXS);                                /* [T, H] fp32 */
    if (fp8)
      fp8_dx_params(l, a, Is, T4, WS(MOK_WS_ASQ), WS(MOK_WS_ASQ2), (float *)WS(MOK_WS_ASQ_S),
                    MOK_QW_WSG_T, &sx);
    if (mx && (r = mx_dx_params(l, a, WS(MOK_WS_DGS), WS(MOK_WS_DUS), T, NULL, Is, sq,
                                sq + T * Is * 2, MOK_QW_WSG_T, &sx, stream)) != MOK_SUCCESS)
      return r;
    if ((r = mok_gpu_gemm(l, &sx, "mok_backward", "shared dx", stream)) != MOK_SUCCESS) return r;
  }

  /* Weight gradients, reductions over each expert's rows in layout order (fused: the routed
   * experts' in the kernel below). */
  float *stage = (float *)WS(MOK_WS_WGRAD32);
  if (!fused &&
      ((r = mok_gpu_wgrad(l, E, R, H, I, WS(MOK_WS_DYG), WS(MOK_WS_A), c->offsets, gr->dwd, stage,
                          "routed down", stream)) != MOK_SUCCESS ||
       (r = mok_gpu_wgrad(l, E, R, I, H, WS(MOK_WS_DG), WS(MOK_WS_XG), c->offsets, gr->dwg, stage,
                          "routed gate", stream)) != MOK_SUCCESS ||
       (r = mok_gpu_wgrad(l, E, R, I, H, WS(MOK_WS_DU), WS(MOK_WS_XG), c->offsets, gr->dwu, stage,
                          "routed up", stream)) != MOK_SUCCESS))
    return r;
  if (shared) {
    if ((r = mok_gpu_wgrad(l, 1, T, H, Is, gr->dy, WS(MOK_WS_AS), c->shared_offsets, gr->dwsd,
                           stage, "shared down", stream)) != MOK_SUCCESS ||
        (r = mok_gpu_wgrad(l, 1, T, Is, H, WS(MOK_WS_DGS), a->x, c->shared_offsets, gr->dwsg,
                           stage, "shared gate", stream)) != MOK_SUCCESS ||
        (r = mok_gpu_wgrad(l, 1, T, Is, H, WS(MOK_WS_DUS), a->x, c->shared_offsets, gr->dwsu,
                           stage, "shared up", stream)) != MOK_SUCCESS)
      return r;
  } else if (Is > 0 && !l->d.wgrad_accumulate) { /* T = 0 on this rank: zero shared gradients */
    const size_t el = l->d.wgrad_dtype == MOK_WGRAD_BF16 ? 2 : 4, n = (size_t)(Is * H) * el;
    void *dst[3] = {gr->dwsg, gr->dwsu, gr->dwsd};
    for (int i = 0; i < 3; i++) {
      const cudaError_t e = cudaMemsetAsync(dst[i], 0, n, (cudaStream_t)stream);
      if (e != cudaSuccess) return mok_gpu_cuda_fail(l, "mok_backward: cudaMemsetAsync", e);
    }
  }
  if (fused) r = bwd_fused(l, a, gr, c, stream);
#undef WS
#undef CTX
  return r;
}

/* ---- the context check ------------------------------------------------------------------------ */

mokResult_t mok_gpu_backward_check(mok_layer_t l, const mok_forward_args_t *a, const char *ctx,
                                   mok_bwd_local_params_t *p, void *stream) {
  const mok_ws_layout_t *lay = &l->gpu->lay;
  memset(p, 0, sizeof(*p));
  p->T = a->num_tokens, p->H = l->d.hidden, p->E = l->EL, p->K = l->d.top_k;
  p->topk_idx = a->topk_idx;
  p->ctx_header = ctx + lay->ctx[MOK_CTX_HEADER];
  p->ctx_slot_row = (const int32_t *)(ctx + lay->ctx[MOK_CTX_SLOT_ROW]); /* [T_max, K] */
  p->ctx_offsets = (const int32_t *)(ctx + lay->ctx[MOK_CTX_OFFSETS]);   /* [E + 1] */
  p->layer_id = l->id;
  p->context_mode = l->d.context_mode;
  p->err = mok_gpu_ws(l, MOK_WS_ERROR);
  p->status = (int32_t *)mok_gpu_ws(l, MOK_WS_STATUS);
  p->offsets = (int32_t *)mok_gpu_ws(l, MOK_WS_OFFSETS);
  p->shared_offsets = (int32_t *)mok_gpu_ws(l, MOK_WS_SHARED_OFFSETS);
  const mokResult_t r = mok_bwd_context_check_launch(p, stream);
  return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
}

/* ---- W = 1 -------------------------------------------------------------------------------------- */

static mokResult_t bwd_chain(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *gr, const char *ctx, void *stream) {
  const int64_t T = a->num_tokens, H = l->d.hidden, Is = l->d.shared_intermediate, E = l->EL,
                K = l->d.top_k, R = l->capacity_rows;
#define WS(region) mok_gpu_ws(l, region)

  /* 1. Does the context belong to this call? (status, offsets, shared_offsets) */
  mok_bwd_local_params_t p;
  mokResult_t r = mok_gpu_backward_check(l, a, ctx, &p, stream);
  if (r != MOK_SUCCESS) return r;
  p.dxk = WS(MOK_WS_DXK);                                  /* [R, H] bf16 */
  p.dxs = Is > 0 ? (const float *)WS(MOK_WS_DXS) : NULL;   /* [T, H] */
  p.dw_row = (const float *)WS(MOK_WS_DW_ROW);             /* [R] */
  p.dx = gr->dx;
  p.dtopk_w = gr->dtopk_w;
  if (T == 0) return bwd_zero_wgrads(l, gr, stream);

  /* 2. Token rows into expert order: x -> xg (and topk_w -> row_w), dy -> dyg. */
  mok_fwd_local_params_t gp;
  memset(&gp, 0, sizeof(gp));
  gp.T = T, gp.H = H, gp.E = E, gp.K = K, gp.Is = Is, gp.capacity_rows = R;
  gp.topk_idx = a->topk_idx, gp.topk_w = a->topk_w;
  gp.y = gr->dx; /* not written by the gather */
  gp.status = p.status;
  gp.slot_row = (int32_t *)p.ctx_slot_row; /* read only by the gather */
  gp.row_w = (float *)WS(MOK_WS_ROW_W);
  gp.x = a->x, gp.xg = WS(MOK_WS_XG);
  if ((r = mok_fwd_gather_launch(&gp, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);
  gp.x = gr->dy, gp.xg = WS(MOK_WS_DYG);
  if ((r = mok_fwd_gather_launch(&gp, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);

  /* 3. The local chain on every expert, then dx and dtopk_w. */
  mok_bwd_rows_t c;
  c.ctx = ctx, c.row_w = gp.row_w, c.offsets = p.offsets, c.shared_offsets = p.shared_offsets;
  c.gather = &gp; /* x's and dy's: fp8 layers copy their e4m3 rows */
  c.reduce = &p;   /* the fused kernel reduces in it */
  c.dxk = NULL, c.dw_row = NULL; /* the workspace's */
  if ((r = mok_gpu_backward_local(l, a, gr, &c, stream)) != MOK_SUCCESS) return r;
  if (!mok_gpu_backward_fused(l) && (r = mok_bwd_reduce_launch(&p, stream)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
#undef WS
  return MOK_SUCCESS;
}

mokResult_t mok_gpu_backward(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *g, const void *ctx, mok_stream_t stream) {
  int prev;
  mokResult_t res = mok_gpu_begin_call(l, "mok_backward", stream, &prev);
  if (res != MOK_SUCCESS) return res;
  const mokResult_t r = l->comm->nranks > 1
                            ? mok_gpu_backward_ep(l, a, g, (const char *)ctx, stream)
                            : bwd_chain(l, a, g, (const char *)ctx, stream);
  cudaSetDevice(prev);
  return r;
}

#else /* !MOK_WITH_CUDA: no GPU layer can exist (mok_comm_create_local reports NO_DEVICE) */

mokResult_t mok_gpu_backward(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *g, const void *ctx, mok_stream_t stream) {
  (void)a, (void)g, (void)ctx, (void)stream;
  return mok_fail(l, MOK_ERROR_NO_DEVICE, "this build of MoK has no CUDA support");
}

#endif /* MOK_WITH_CUDA */
