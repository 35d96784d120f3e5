/*
 * gpu/forward_ep.c: mok_forward of an expert-parallel GPU layer (W > 1), host side. Each
 * rank enqueues on its stream, with no host synchronization (src/cuda/comm/ep.cu has the
 * kernels and the EP-invariance argument):
 *
 *   layout     the transport's: counts per (expert, destination) all-gathered through the
 *              window; every rank derives the same rows of each expert, (source rank, token,
 *              slot) order, unpadded
 *   prep       status, the local layout (offsets of this rank's EL experts), own rows' weights
 *   dispatch   the transport's: each token crosses NVLink once per rank that holds any of its
 *              experts, with its rows' router weights and positions; waits for every source
 *   gather     xg = the rows of this rank's experts, from the received tokens or x
 *   GEMMs      the W = 1 chain's grouped GEMMs on this rank's experts (gate/up with SwiGLU and
 *              the router weight, down -> yk), and the shared expert on this rank's tokens -> ys;
 *              fp8-block: the rows and x quantized per row, then the W = 1 fp8 GEMMs
 *              (mok_gpu_forward_fp8_experts; rows cross NVLink in bf16)
 *   combine    yk rows of other ranks' tokens to their home ranks; waits for every expert rank
 *   reduce     y = bf16(ys + Σ_k yk) in slot order
 *
 * The context: its header (by prep, valid only when the call is), this rank's offsets, and in
 * SAVE mode bf16 g, u of this rank's rows (src/gpu/backward_ep.c reads them). Not yet fused into
 * one persistent kernel. Counters advance by host-side call numbers (epochs), so a forward
 * captured in a CUDA graph must not be replayed.
 */
#include <string.h>

#include "gpu/gpu.h"

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

mokResult_t mok_gpu_forward_ep(mok_layer_t l, const mok_forward_args_t *a, void *y, char *ctx,
                               void *stream) {
  struct mok_gpu_layer *g = l->gpu;
  const mok_ws_layout_t *lay = &g->lay;
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, EL = l->EL, R = l->capacity_rows;
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE;
  mokResult_t r;

  /* The context header stays invalid until the prep kernel has the call's verdict. */
  cudaError_t ce = cudaMemsetAsync(ctx + lay->ctx[MOK_CTX_HEADER], 0, sizeof(mok_ctx_header_t),
                                   (cudaStream_t)stream);
  if (ce != cudaSuccess) return mok_gpu_cuda_fail(l, "mok_forward: cudaMemsetAsync", ce);

  if ((r = mok_transport_set_timeout(g->tp, l->tuning.timeout_s)) != MOK_SUCCESS ||
      (r = mok_transport_layout(g->tp, T, a->topk_idx, stream)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
  mok_tp_params_t p;
  if ((r = mok_transport_params(g->tp, 0, stream, &p)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
#define EP_FILL(q)                                                          \
  do {                                                                      \
    (q).topk_w = a->topk_w, (q).x = a->x, (q).y = y, (q).R = R;             \
    (q).status = (int32_t *)mok_gpu_ws(l, MOK_WS_STATUS);                   \
    (q).offsets = (int32_t *)mok_gpu_ws(l, MOK_WS_OFFSETS);                 \
    (q).shared_offsets = (int32_t *)mok_gpu_ws(l, MOK_WS_SHARED_OFFSETS);   \
    (q).layer_err = mok_gpu_ws(l, MOK_WS_ERROR);                            \
    (q).xg = mok_gpu_ws(l, MOK_WS_XG);                                      \
    (q).yk = mok_gpu_ws(l, MOK_WS_YK);                                      \
    (q).ys = Is > 0 ? (const float *)mok_gpu_ws(l, MOK_WS_YS) : NULL;       \
    (q).ctx_header = ctx + lay->ctx[MOK_CTX_HEADER];                        \
    (q).ctx_offsets = (int32_t *)(ctx + lay->ctx[MOK_CTX_OFFSETS]);         \
    (q).layer_id = l->id, (q).context_mode = l->d.context_mode;             \
  } while (0)
  EP_FILL(p);
  if ((r = mok_ep_prep_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_forward: the expert-parallel prep kernel failed to launch");

  if ((r = mok_transport_params(g->tp, MOK_TP_DISPATCH, stream, &p)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
  EP_FILL(p);
  if ((r = mok_tp_run_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_forward: the dispatch kernel failed to launch");
  if ((r = mok_ep_gather_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_forward: the expert-parallel gather failed to launch");

  /* This rank's experts over the rows that arrived (the W = 1 chain's GEMMs). */
  const float *row_w = (const float *)((const char *)p.peer[p.rank] + p.win.row_w);
  if (l->d.precision == MOK_PRECISION_FP8_BLOCK) {
    /* the arrived bf16 rows quantized per row: the bytes W = 1 copies from each token's once */
    if ((r = mok_gpu_fp8_rows(l, NULL, a->x, p.xg, p.offsets, T, stream)) != MOK_SUCCESS) return r;
    const mok_fp8_rows_t c = {p.offsets, p.shared_offsets, row_w};
    if ((r = mok_gpu_forward_fp8_experts(l, a, &c, ctx, stream)) != MOK_SUCCESS) return r;
  } else {
    mok_grouped_gemm_params_t gu =
        mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, EL, R, I, H);
    gu.a = p.xg;
    gu.b = a->w.wg, gu.b2 = a->w.wu;
    gu.offsets = p.offsets;
    gu.c = mok_gpu_ws(l, MOK_WS_A);
    gu.row_scale = row_w;
    gu.g_out = save ? ctx + lay->ctx[MOK_CTX_G] : NULL;
    gu.u_out = save ? ctx + lay->ctx[MOK_CTX_U] : NULL;
    if ((r = mok_gpu_gemm(l, &gu, "mok_forward", "routed gate/up", stream)) != MOK_SUCCESS)
      return r;
    mok_grouped_gemm_params_t dn =
        mok_gg_bf16_params(MOK_GG_EPI_STORE_BF16, MOK_GG_B_KMAJOR, EL, R, H, I);
    dn.a = gu.c;
    dn.b = a->w.wd;
    dn.offsets = p.offsets;
    dn.c = (void *)p.yk; /* over xg, which the gate/up GEMM has read */
    if ((r = mok_gpu_gemm(l, &dn, "mok_forward", "routed down", stream)) != MOK_SUCCESS) return r;
    if (Is > 0 && T > 0) {
      mok_grouped_gemm_params_t sgu =
          mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, 1, T, Is, H);
      sgu.a = a->x;
      sgu.b = a->w.wsg, sgu.b2 = a->w.wsu;
      sgu.offsets = p.shared_offsets;
      sgu.c = mok_gpu_ws(l, MOK_WS_AS);
      sgu.g_out = save ? ctx + lay->ctx[MOK_CTX_GS] : NULL;
      sgu.u_out = save ? ctx + lay->ctx[MOK_CTX_US] : NULL;
      if ((r = mok_gpu_gemm(l, &sgu, "mok_forward", "shared gate/up", stream)) != MOK_SUCCESS)
        return r;
      mok_grouped_gemm_params_t sdn =
          mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_KMAJOR, 1, T, H, Is);
      sdn.a = sgu.c;
      sdn.b = a->w.wsd;
      sdn.offsets = p.shared_offsets;
      sdn.c = (void *)p.ys;
      if ((r = mok_gpu_gemm(l, &sdn, "mok_forward", "shared down", stream)) != MOK_SUCCESS)
        return r;
    }
  }

  if ((r = mok_transport_params(g->tp, MOK_TP_COMBINE, stream, &p)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
  EP_FILL(p);
#undef EP_FILL
  if ((r = mok_ep_combine_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_forward: the combine kernel failed to launch");
  if ((r = mok_ep_reduce_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_forward: the expert-parallel reduce failed to launch");
  return MOK_SUCCESS;
}

#endif /* MOK_WITH_CUDA */
