/*
 * gpu/backward_ep.c: mok_backward of an expert-parallel GPU layer (W > 1, BF16), host side: the
 * W = 1 backward chain (src/gpu/backward.c) around the transport, on each rank's stream with no
 * host synchronization:
 *
 *   context check  the W = 1 kernel: does ctx belong to this call on this rank?
 *   layout         the transport's again (the same rows as the forward's, derived from the same
 *                  routing), its all-gathered status valid only where every rank's context
 *                  matched: a mismatch on one rank makes every rank compute nothing
 *   prep           the verdict, the local layout, the own rows' router weights
 *   dispatch       x, then dy, of each token to the ranks of its experts, once per rank each
 *                  (two launches: one kernel sending both rows spilled registers)
 *   gather         xg, dyg: the rows of this rank's experts
 *   local chain    RECOMPUTE: gate/up -> g, u; ds = dyg · Wd; SwiGLU backward -> a, dg, du and
 *                  the rows' router-weight gradients; dxk = dg · Wg + du · Wu (fp32); the shared
 *                  expert on this rank's tokens -> dxs; the weight gradients of this rank's
 *                  experts over their rows in layout order, and of the shared expert over this
 *                  rank's tokens
 *   combine        bf16(dxk) rows and the router-weight gradients home
 *   reduce         dx = bf16(dxs + Σ_k bf16(dxk)) in slot order, dtopk_w
 *
 * EP-invariance: an expert's rows and their order are the W = 1 layer's over the ranks' tokens in
 * rank order, every GEMM row depends on its own A row, and each weight-gradient tile sums the
 * rows of its expert in that order; the reduce adds the same bf16 rows in the same order. So dx,
 * dtopk_w and each routed expert's weight gradients are bitwise the W = 1 layer's; the shared
 * expert's are this rank's tokens' (data-parallel: the caller reduces them over ranks).
 *
 * Not yet fused into the backward kernel, and x crosses NVLink again (the forward's dispatched
 * rows are not kept in the context).
 */
#include <string.h>

#include "gpu/gpu.h"

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/backward/backward.h"

mokResult_t mok_gpu_backward_ep(mok_layer_t l, const mok_forward_args_t *a,
                                const mok_backward_args_t *gr, const char *ctx, void *stream) {
  struct mok_gpu_layer *gl = l->gpu;
  const mok_ws_layout_t *lay = &gl->lay;
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, EL = l->EL, K = l->d.top_k,
                R = l->capacity_rows;
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE;
  mokResult_t r;
#define WS(region) mok_gpu_ws(l, region)
#define CTX(region) ((const void *)(ctx + lay->ctx[region]))

  /* 1. Does the context belong to this call, here? (status: the layout's local_ok) */
  mok_bwd_local_params_t c;
  memset(&c, 0, sizeof(c));
  c.T = T, c.H = H, c.E = EL, c.K = K;
  c.topk_idx = a->topk_idx;
  c.ctx_header = CTX(MOK_CTX_HEADER);
  c.ctx_slot_row = (const int32_t *)CTX(MOK_CTX_SLOT_ROW);
  c.ctx_offsets = (const int32_t *)CTX(MOK_CTX_OFFSETS);
  c.layer_id = l->id;
  c.context_mode = l->d.context_mode;
  c.err = WS(MOK_WS_ERROR);
  c.status = (int32_t *)WS(MOK_WS_STATUS);
  c.offsets = (int32_t *)WS(MOK_WS_OFFSETS);
  c.shared_offsets = (int32_t *)WS(MOK_WS_SHARED_OFFSETS);
  if ((r = mok_bwd_context_check_launch(&c, stream)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);

  /* 2-4. Layout (gated by every rank's check), prep, dispatch of x and dy, gather. */
  if ((r = mok_transport_set_timeout(gl->tp, l->tuning.timeout_s)) != MOK_SUCCESS ||
      (r = mok_transport_layout_checked(gl->tp, T, a->topk_idx, c.status, stream)) !=
          MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
  mok_tp_params_t p;
#define EP_FILL(q)                                                          \
  do {                                                                      \
    (q).topk_w = a->topk_w, (q).x = a->x, (q).x2 = gr->dy, (q).R = R;       \
    (q).status = c.status, (q).offsets = c.offsets;                         \
    (q).shared_offsets = c.shared_offsets, (q).layer_err = c.err;           \
    (q).xg = WS(MOK_WS_XG), (q).xg2 = WS(MOK_WS_DYG);                       \
    (q).yk = WS(MOK_WS_XG); /* bf16(dxk), once the weight gradients read xg */ \
    (q).ys = Is > 0 ? (const float *)WS(MOK_WS_DXS) : NULL;                 \
    (q).y = gr->dx, (q).dtopk_w = gr->dtopk_w;                              \
    (q).row_val = (const float *)WS(MOK_WS_DW_ROW);                         \
  } while (0)
  if ((r = mok_transport_params(gl->tp, 0, stream, &p)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
  EP_FILL(p);
  if ((r = mok_ep_prep_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_backward: the expert-parallel prep kernel failed to launch");
  for (int pass = 0; pass < 2; pass++) { /* x into recv_x, then dy into recv_x2 */
    if ((r = mok_transport_params(gl->tp, MOK_TP_DISPATCH, stream, &p)) != MOK_SUCCESS)
      return mok_gpu_launcher_failed(l, r);
    EP_FILL(p);
    p.x = pass ? gr->dy : a->x;
    p.recv_x2 = pass;
    if ((r = mok_tp_run_launch(&p, stream)) != MOK_SUCCESS)
      return mok_fail(l, r, "mok_backward: the dispatch kernel failed to launch");
  }
  p.x = a->x, p.recv_x2 = 0;
  if ((r = mok_ep_gather_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_backward: the expert-parallel gather failed to launch");

  /* 5. The local chain on this rank's experts (gpu/backward.c's steps, E = EL). */
  const float *row_w = (const float *)((const char *)p.peer[p.rank] + p.win.row_w);
  const int32_t *off = c.offsets, *soff = c.shared_offsets;
  const int shared = Is > 0 && T > 0;
  const void *g = save ? CTX(MOK_CTX_G) : WS(MOK_WS_G), *u = save ? CTX(MOK_CTX_U) : WS(MOK_WS_U);
  const void *gs = save ? CTX(MOK_CTX_GS) : WS(MOK_WS_GS);
  const void *us = save ? CTX(MOK_CTX_US) : WS(MOK_WS_US);
  if (!save) {
    mok_grouped_gemm_params_t gu =
        mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, EL, R, I, H);
    gu.a = WS(MOK_WS_XG), gu.b = a->w.wg, gu.b2 = a->w.wu, gu.offsets = off;
    gu.c = WS(MOK_WS_A), gu.row_scale = row_w;
    gu.g_out = WS(MOK_WS_G), gu.u_out = WS(MOK_WS_U);
    if ((r = mok_gpu_gemm(l, &gu, "mok_backward", "recompute gate/up", stream)) != MOK_SUCCESS)
      return r;
    if (shared) {
      mok_grouped_gemm_params_t sgu =
          mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, 1, T, Is, H);
      sgu.a = a->x, sgu.b = a->w.wsg, sgu.b2 = a->w.wsu, sgu.offsets = soff;
      sgu.c = WS(MOK_WS_AS), sgu.g_out = WS(MOK_WS_GS), sgu.u_out = WS(MOK_WS_US);
      if ((r = mok_gpu_gemm(l, &sgu, "mok_backward", "recompute shared gate/up", stream)) !=
          MOK_SUCCESS)
        return r;
    }
  }
  mok_grouped_gemm_params_t dsp =
      mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, EL, R, I, H);
  dsp.a = WS(MOK_WS_DYG), dsp.b = a->w.wd, dsp.offsets = off, dsp.c = WS(MOK_WS_DS);
  if ((r = mok_gpu_gemm(l, &dsp, "mok_backward", "routed ds", stream)) != MOK_SUCCESS) return r;
  mok_bwd_swiglu_params_t sb;
  memset(&sb, 0, sizeof(sb));
  sb.num_groups = EL, sb.m_total = R, sb.n = I, sb.offsets = off;
  sb.g = g, sb.u = u, sb.ds = (const float *)WS(MOK_WS_DS), sb.row_w = row_w;
  sb.a = WS(MOK_WS_A), sb.dg = WS(MOK_WS_DG), sb.du = WS(MOK_WS_DU);
  sb.dw_row = (float *)WS(MOK_WS_DW_ROW);
  if ((r = mok_bwd_swiglu_launch(&sb, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);
  mok_grouped_gemm_params_t dxg =
      mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, EL, R, H, I);
  dxg.a = WS(MOK_WS_DG), dxg.b = a->w.wg, dxg.offsets = off, dxg.c = WS(MOK_WS_DXK);
  if ((r = mok_gpu_gemm(l, &dxg, "mok_backward", "routed dx (gate)", stream)) != MOK_SUCCESS)
    return r;
  mok_grouped_gemm_params_t dxu = dxg;
  dxu.epilogue = MOK_GG_EPI_ACCUM_F32, dxu.a = WS(MOK_WS_DU), dxu.b = a->w.wu;
  if ((r = mok_gpu_gemm(l, &dxu, "mok_backward", "routed dx (up)", stream)) != MOK_SUCCESS)
    return r;
  if (shared) {
    mok_grouped_gemm_params_t ss =
        mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, 1, T, Is, H);
    ss.a = gr->dy, ss.b = a->w.wsd, ss.offsets = soff, ss.c = WS(MOK_WS_DSS);
    if ((r = mok_gpu_gemm(l, &ss, "mok_backward", "shared ds", stream)) != MOK_SUCCESS) return r;
    mok_bwd_swiglu_params_t ssb;
    memset(&ssb, 0, sizeof(ssb));
    ssb.num_groups = 1, ssb.m_total = T, ssb.n = Is, ssb.offsets = soff;
    ssb.g = gs, ssb.u = us, ssb.ds = (const float *)WS(MOK_WS_DSS), ssb.row_w = NULL;
    ssb.a = WS(MOK_WS_AS), ssb.dg = WS(MOK_WS_DGS), ssb.du = WS(MOK_WS_DUS), ssb.dw_row = NULL;
    if ((r = mok_bwd_swiglu_launch(&ssb, stream)) != MOK_SUCCESS)
      return mok_gpu_launcher_failed(l, r);
    mok_grouped_gemm_params_t sg =
        mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_NMAJOR, 1, T, H, Is);
    sg.a = WS(MOK_WS_DGS), sg.b = a->w.wsg, sg.offsets = soff, sg.c = WS(MOK_WS_DXS);
    if ((r = mok_gpu_gemm(l, &sg, "mok_backward", "shared dx (gate)", stream)) != MOK_SUCCESS)
      return r;
    mok_grouped_gemm_params_t su = sg;
    su.epilogue = MOK_GG_EPI_ACCUM_F32, su.a = WS(MOK_WS_DUS), su.b = a->w.wsu;
    if ((r = mok_gpu_gemm(l, &su, "mok_backward", "shared dx (up)", stream)) != MOK_SUCCESS)
      return r;
  }

  /* Weight gradients (before xg turns into bf16 dxk). */
  float *stage = (float *)WS(MOK_WS_WGRAD32);
  if ((r = mok_gpu_wgrad(l, EL, R, H, I, WS(MOK_WS_DYG), WS(MOK_WS_A), off, gr->dwd, stage,
                         "routed down", stream)) != MOK_SUCCESS ||
      (r = mok_gpu_wgrad(l, EL, R, I, H, WS(MOK_WS_DG), WS(MOK_WS_XG), off, gr->dwg, stage,
                         "routed gate", stream)) != MOK_SUCCESS ||
      (r = mok_gpu_wgrad(l, EL, R, I, H, WS(MOK_WS_DU), WS(MOK_WS_XG), off, gr->dwu, stage,
                         "routed up", stream)) != MOK_SUCCESS)
    return r;
  if (shared) {
    if ((r = mok_gpu_wgrad(l, 1, T, H, Is, gr->dy, WS(MOK_WS_AS), soff, gr->dwsd, stage,
                           "shared down", stream)) != MOK_SUCCESS ||
        (r = mok_gpu_wgrad(l, 1, T, Is, H, WS(MOK_WS_DGS), a->x, soff, gr->dwsg, stage,
                           "shared gate", stream)) != MOK_SUCCESS ||
        (r = mok_gpu_wgrad(l, 1, T, Is, H, WS(MOK_WS_DUS), a->x, soff, gr->dwsu, stage,
                           "shared up", stream)) != MOK_SUCCESS)
      return r;
  } else if (Is > 0 && !l->d.wgrad_accumulate) { /* T = 0 here: no token, zero gradients */
    const size_t el = l->d.wgrad_dtype == MOK_WGRAD_BF16 ? 2 : 4, n = (size_t)(Is * H) * el;
    void *dst[3] = {gr->dwsg, gr->dwsu, gr->dwsd};
    for (int i = 0; i < 3; i++) {
      const cudaError_t e = cudaMemsetAsync(dst[i], 0, n, (cudaStream_t)stream);
      if (e != cudaSuccess) return mok_gpu_cuda_fail(l, "mok_backward: cudaMemsetAsync", e);
    }
  }

  /* 6-7. bf16(dxk) and the router-weight gradients home; dx and dtopk_w there. */
  if ((r = mok_ep_round_rows_launch((const float *)WS(MOK_WS_DXK), WS(MOK_WS_XG), off, EL, R, H,
                                    stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_backward: the dxk rounding kernel failed to launch");
  if ((r = mok_transport_params(gl->tp, MOK_TP_COMBINE, stream, &p)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
  EP_FILL(p);
#undef EP_FILL
  if ((r = mok_ep_combine_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_backward: the combine kernel failed to launch");
  if ((r = mok_ep_reduce_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_backward: the expert-parallel reduce failed to launch");
#undef WS
#undef CTX
  return MOK_SUCCESS;
}

#endif /* MOK_WITH_CUDA */
