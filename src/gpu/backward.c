/*
 * gpu/backward.c: mok_backward on a GPU layer, host side. W = 1 and BF16 run the unfused GPU
 * backward of docs/design.md ("The layer"): a chain of kernels on the caller's stream
 * (src/cuda/backward/backward.h), with no host synchronization and no device data read on the
 * host, like the forward (gpu/forward.c):
 *
 *   context check (1 CTA)  ctx header vs this call -> status, offsets [E + 1], shared_offsets
 *   gathers                x -> xg [R, H], dy -> dyg [R, H] (expert order), topk_w -> row_w [R]
 *   RECOMPUTE mode only    gate/up GEMM on xg -> bf16 g, u [R, I] (the forward's, bit for bit);
 *                          shared gate/up on x -> gs, us [T, Is]
 *   ds GEMM                ds [R, I] fp32 = dyg · Wd[e]            (B N-major: Wd as [E, H, I])
 *   SwiGLU backward        a, dg, du [R, I] bf16, dw_row [R] fp32  (backward/swiglu.cu)
 *   dxk GEMMs              dxk [R, H] fp32 = dg · Wg[e], += du · Wu[e]   (Wg as [E, I, H])
 *   shared expert (Is > 0) dss [T, Is] = dy · Wsd; SwiGLU backward with w = 1 -> as, dgs, dus;
 *                          dxs [T, H] fp32 = dgs · Wsg + dus · Wsu
 *   dx reduce              dx [T, H] = bf16(dxs + Σ_k bf16(dxk[row(t, k)])), dtopk_w [T, K]
 *   weight gradients       dWd[e] = dygᵀ · a, dWg[e] = dgᵀ · xg, dWu[e] = duᵀ · xg over the rows
 *                          of expert e in layout order; dWsd = dyᵀ · as, dWsg = dgsᵀ · x,
 *                          dWsu = dusᵀ · x (mok_grouped_wgrad_launch)
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

/* ---- the chain -------------------------------------------------------------------------------- */

static mokResult_t bwd_chain(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *gr, const char *ctx, void *stream) {
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, E = l->EL, K = l->d.top_k, R = l->capacity_rows;
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE;
  const mok_ws_layout_t *lay = &l->gpu->lay; /* computed once, at mok_layer_create */
#define WS(region) mok_gpu_ws(l, region)
#define CTX(region) ((const void *)(ctx + lay->ctx[region]))

  /* 1. Does the context belong to this call? (status, offsets, shared_offsets) */
  mok_bwd_local_params_t p;
  memset(&p, 0, sizeof(p));
  p.T = T, p.H = H, p.E = E, p.K = K;
  p.topk_idx = a->topk_idx;
  p.ctx_header = CTX(MOK_CTX_HEADER);
  p.ctx_slot_row = (const int32_t *)CTX(MOK_CTX_SLOT_ROW); /* [T_max, K] */
  p.ctx_offsets = (const int32_t *)CTX(MOK_CTX_OFFSETS);   /* [E + 1] */
  p.layer_id = l->id;
  p.context_mode = l->d.context_mode;
  p.err = WS(MOK_WS_ERROR);
  p.status = (int32_t *)WS(MOK_WS_STATUS);
  p.offsets = (int32_t *)WS(MOK_WS_OFFSETS);
  p.shared_offsets = (int32_t *)WS(MOK_WS_SHARED_OFFSETS);
  p.dxk = (const float *)WS(MOK_WS_DXK);                   /* [R, H] */
  p.dxs = Is > 0 ? (const float *)WS(MOK_WS_DXS) : NULL;   /* [T, H] */
  p.dw_row = (const float *)WS(MOK_WS_DW_ROW);             /* [R] */
  p.dx = gr->dx;
  p.dtopk_w = gr->dtopk_w;
  mokResult_t r = mok_bwd_context_check_launch(&p, stream);
  if (r != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);
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

  /* bf16 g, u: saved by forward, or recomputed here by the forward's own GEMMs. */
  const void *g = save ? CTX(MOK_CTX_G) : WS(MOK_WS_G), *u = save ? CTX(MOK_CTX_U) : WS(MOK_WS_U);
  const void *gs = save ? CTX(MOK_CTX_GS) : WS(MOK_WS_GS);
  const void *us = save ? CTX(MOK_CTX_US) : WS(MOK_WS_US);
  if (!save) {
    mok_grouped_gemm_params_t gu =
        mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, E, R, I, H);
    gu.a = WS(MOK_WS_XG);         /* [R, H] */
    gu.b = a->w.wg;               /* [E, I, H] */
    gu.b2 = a->w.wu;
    gu.offsets = p.offsets;
    gu.c = WS(MOK_WS_A);          /* [R, I] forward's a: unused, overwritten below */
    gu.row_scale = gp.row_w;
    gu.g_out = WS(MOK_WS_G), gu.u_out = WS(MOK_WS_U); /* [R, I] */
    if ((r = mok_gpu_gemm(l, &gu, "mok_backward", "recompute gate/up", stream)) !=
        MOK_SUCCESS)
      return r;
    if (Is > 0) {
      mok_grouped_gemm_params_t sgu =
          mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, 1, T, Is, H);
      sgu.a = a->x;               /* [T, H] */
      sgu.b = a->w.wsg, sgu.b2 = a->w.wsu; /* [Is, H] */
      sgu.offsets = p.shared_offsets;
      sgu.c = WS(MOK_WS_AS);      /* [T, Is], overwritten below */
      sgu.g_out = WS(MOK_WS_GS), sgu.u_out = WS(MOK_WS_US);
      if ((r = mok_gpu_gemm(l, &sgu, "mok_backward", "recompute shared gate/up", stream)) !=
          MOK_SUCCESS)
        return r;
    }
  }

  /* 3. ds [R, I] = dyg · Wd[e] (Wd [E, H, I] is B [E, K = H, N = I], N-major). */
  mok_grouped_gemm_params_t dsp = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, E, R, I, H);
  dsp.a = WS(MOK_WS_DYG), dsp.b = a->w.wd, dsp.offsets = p.offsets, dsp.c = WS(MOK_WS_DS);
  if ((r = mok_gpu_gemm(l, &dsp, "mok_backward", "routed ds", stream)) != MOK_SUCCESS) return r;

  /* 4. SwiGLU backward: a, dg, du [R, I], dw_row [R]. */
  mok_bwd_swiglu_params_t sb;
  memset(&sb, 0, sizeof(sb));
  sb.num_groups = E, sb.m_total = R, sb.n = I, sb.offsets = p.offsets;
  sb.g = g, sb.u = u, sb.ds = (const float *)WS(MOK_WS_DS), sb.row_w = gp.row_w;
  sb.a = WS(MOK_WS_A), sb.dg = WS(MOK_WS_DG), sb.du = WS(MOK_WS_DU);
  sb.dw_row = (float *)WS(MOK_WS_DW_ROW);
  if ((r = mok_bwd_swiglu_launch(&sb, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);

  /* 5. dxk [R, H] fp32 = dg · Wg[e] + du · Wu[e] (Wg [E, I, H] is B [E, K = I, N = H]). */
  mok_grouped_gemm_params_t dxg = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, E, R, H, I);
  dxg.a = WS(MOK_WS_DG), dxg.b = a->w.wg, dxg.offsets = p.offsets, dxg.c = WS(MOK_WS_DXK);
  if ((r = mok_gpu_gemm(l, &dxg, "mok_backward", "routed dx (gate)", stream)) !=
      MOK_SUCCESS)
    return r;
  mok_grouped_gemm_params_t dxu = dxg;
  dxu.epilogue = MOK_GG_EPI_ACCUM_F32, dxu.a = WS(MOK_WS_DU), dxu.b = a->w.wu;
  if ((r = mok_gpu_gemm(l, &dxu, "mok_backward", "routed dx (up)", stream)) !=
      MOK_SUCCESS)
    return r;

  /* 6. Shared expert: one group [0, T) of dy and x themselves, weight 1, no router gradient. */
  if (Is > 0) {
    mok_grouped_gemm_params_t ss = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, 1, T, Is, H);
    ss.a = gr->dy, ss.b = a->w.wsd, ss.offsets = p.shared_offsets; /* Wsd [H, Is] = [K, N] */
    ss.c = WS(MOK_WS_DSS);                                         /* [T, Is] */
    if ((r = mok_gpu_gemm(l, &ss, "mok_backward", "shared ds", stream)) != MOK_SUCCESS) return r;
    mok_bwd_swiglu_params_t ssb;
    memset(&ssb, 0, sizeof(ssb));
    ssb.num_groups = 1, ssb.m_total = T, ssb.n = Is, ssb.offsets = p.shared_offsets;
    ssb.g = gs, ssb.u = us, ssb.ds = (const float *)WS(MOK_WS_DSS), ssb.row_w = NULL;
    ssb.a = WS(MOK_WS_AS), ssb.dg = WS(MOK_WS_DGS), ssb.du = WS(MOK_WS_DUS), ssb.dw_row = NULL;
    if ((r = mok_bwd_swiglu_launch(&ssb, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);
    mok_grouped_gemm_params_t sg = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, 1, T, H, Is);
    sg.a = WS(MOK_WS_DGS), sg.b = a->w.wsg, sg.offsets = p.shared_offsets; /* Wsg [Is, H] */
    sg.c = WS(MOK_WS_DXS);                                                 /* [T, H] fp32 */
    if ((r = mok_gpu_gemm(l, &sg, "mok_backward", "shared dx (gate)", stream)) !=
        MOK_SUCCESS)
      return r;
    mok_grouped_gemm_params_t su = sg;
    su.epilogue = MOK_GG_EPI_ACCUM_F32, su.a = WS(MOK_WS_DUS), su.b = a->w.wsu;
    if ((r = mok_gpu_gemm(l, &su, "mok_backward", "shared dx (up)", stream)) !=
        MOK_SUCCESS)
      return r;
  }

  /* 7. dx and dtopk_w. */
  if ((r = mok_bwd_reduce_launch(&p, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);

  /* 8. Weight gradients, reductions over each expert's rows in layout order. */
  float *stage = (float *)WS(MOK_WS_WGRAD32);
  if ((r = mok_gpu_wgrad(l, E, R, H, I, WS(MOK_WS_DYG), WS(MOK_WS_A), p.offsets, gr->dwd, stage,
                     "routed down", stream)) != MOK_SUCCESS)
    return r;
  if ((r = mok_gpu_wgrad(l, E, R, I, H, WS(MOK_WS_DG), WS(MOK_WS_XG), p.offsets, gr->dwg, stage,
                     "routed gate", stream)) != MOK_SUCCESS)
    return r;
  if ((r = mok_gpu_wgrad(l, E, R, I, H, WS(MOK_WS_DU), WS(MOK_WS_XG), p.offsets, gr->dwu, stage,
                     "routed up", stream)) != MOK_SUCCESS)
    return r;
  if (Is > 0) {
    if ((r = mok_gpu_wgrad(l, 1, T, H, Is, gr->dy, WS(MOK_WS_AS), p.shared_offsets, gr->dwsd, stage,
                       "shared down", stream)) != MOK_SUCCESS)
      return r;
    if ((r = mok_gpu_wgrad(l, 1, T, Is, H, WS(MOK_WS_DGS), a->x, p.shared_offsets, gr->dwsg, stage,
                       "shared gate", stream)) != MOK_SUCCESS)
      return r;
    if ((r = mok_gpu_wgrad(l, 1, T, Is, H, WS(MOK_WS_DUS), a->x, p.shared_offsets, gr->dwsu, stage,
                       "shared up", stream)) != MOK_SUCCESS)
      return r;
  }
#undef WS
#undef CTX
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
