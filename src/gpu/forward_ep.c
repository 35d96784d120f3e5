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
 *              experts, with its rows' router weights and positions; BF16: by the first CTAs of
 *              the fused kernel below, whose gate/up tiles wait for their rows' source ranks;
 *              else a kernel of its own, which waits for every source
 *   experts    BF16: the W = 1 fused persistent kernel (forward/fused.cu) on this rank's experts
 *              and its shared expert, gathering each row into its gate/up tiles from the
 *              received tokens or x, without its REDUCE (ep_forward_fused);
 *              the chain (tuning forward_path = MOK_FORWARD_CHAIN, the fused kernel's oracle, and
 *              fp8-block): gather xg = the rows of this rank's experts, then the W = 1 chain's
 *              grouped GEMMs (gate/up with SwiGLU and the router weight, down -> yk; the shared
 *              expert on this rank's tokens -> ys); fp8-block: x quantized once per token
 *              before the dispatch, which sends each token's e4m3 row and scales; the fp8
 *              gather copies them into expert order, then the W = 1 fp8 GEMMs
 *              (mok_gpu_forward_fp8_experts); MXFP8 likewise: x quantized once per token
 *              (e4m3 rows and four E8M0 scales to a word, the bytes of fp8-block's rows), the
 *              MXFP8 gather dequantizing them into bf16 xg, then the W = 1 MXFP8 GEMMs
 *              (mok_gpu_forward_mx_experts)
 *   combine    a signal to every rank that this rank's yk (in its window) is complete, then
 *              the wait for every expert rank's
 *   reduce     y = bf16(ys + Σ_k yk) in slot order, each slot's row read where its expert rank
 *              wrote it (the pull reduce: one pass over the remote rows, no copy home)
 *
 * The context: its header (by prep, valid only when the call is), this rank's offsets, and in
 * SAVE mode bf16 g, u of this rank's rows (src/gpu/backward_ep.c reads them). yk lives in the
 * transport's window (its yk region, the layer's R rows): another rank's reduce reads it during
 * this call, and this rank rewrites it only after its next layout (forward or backward), whose
 * all-gather waits for every rank's next call, which its stream orders after its reduce. The
 * transport counts its calls (epochs) on the device, so a forward captured in a CUDA graph can
 * be replayed (tests/gpu/test_ep_backward.cu).
 */
#include <string.h>

#include "gpu/gpu.h"

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/quant/quant.h"

/* Whether the fused forward runs the dispatch itself (forward/fused_ep.cuh). Its tiles then wait
 * for other ranks' kernels, so every rank's kernel must be resident at once: always so for ranks
 * on GPUs of their own; virtual ranks share one GPU, so only when each rank's kernel has at most
 * (SMs - W) / W CTAs (the tuning's forward_sms). With the default (all SMs), virtual ranks use
 * the dispatch kernel, whose CTAs fit beside each other, and full-GPU fused kernels: on one GPU
 * the dispatch is a device-local copy and the partition costs more than its overlap gains
 * (docs/performance.md, "Expert parallelism"). */
static int ep_dispatch_in_kernel(mok_layer_t l) {
  if (!l->comm->vgroup) return 1;
  int sms = 0;
  if (l->tuning.forward_sms <= 0 ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, l->comm->device) != cudaSuccess)
    return 0;
  const int W = l->comm->nranks;
  return (int64_t)l->tuning.forward_sms * W + W <= sms;
}

/* BF16: the dispatch and this rank's experts and shared expert in the fused persistent kernel of
 * the W = 1 forward (p: the dispatch's params). The kernel dispatches first (forward/fused_ep.cuh);
 * GATE_UP waits for its rows' source ranks and gathers each row from the received tokens or from
 * x through the row's source (row_src), so there is no gather pass; the kernel stops before
 * REDUCE, which comes after the combine. Same tiles as the chain, so the same bits. */
static mokResult_t ep_forward_fused(mok_layer_t l, const mok_forward_args_t *a,
                                    const mok_tp_params_t *p, int dispatch, char *ctx,
                                    void *stream) {
  const int64_t Is = l->d.shared_intermediate, R = l->capacity_rows;
  mok_fwd_fused_params_t f;
  memset(&f, 0, sizeof(f));
  mok_fwd_local_params_t *q = &f.l;
  q->T = a->num_tokens, q->H = l->d.hidden, q->E = l->EL, q->K = l->d.top_k, q->Is = Is;
  q->capacity_rows = R;
  q->topk_idx = a->topk_idx, q->topk_w = a->topk_w, q->x = a->x;
  q->err = p->layer_err, q->status = p->status, q->offsets = p->offsets;
  q->shared_offsets = p->shared_offsets;
  q->row_w = (float *)(p->peer[p->rank] + p->win.row_w);
  q->row_tok = (int32_t *)(p->peer[p->rank] + p->win.row_src);
  q->tile_pre = p->tile_pre;
  q->yk = p->yk, q->ys = p->ys;
  /* not read without REDUCE; the launcher wants every region */
  q->slot_row = (int32_t *)mok_gpu_ws(l, MOK_WS_SLOT_ROW);
  q->red_pre = (int32_t *)mok_gpu_ws(l, MOK_WS_RED_PRE);
  q->red_order = (int32_t *)mok_gpu_ws(l, MOK_WS_RED_ORDER);
  q->counters = (uint32_t *)mok_gpu_ws(l, MOK_WS_COUNTERS);
  q->n_counters = mok_fc_count(R, l->EL, l->d.max_tokens);
  /* the W = 1 layout kernel zeroes them; here the stream does, after the previous call's kernel */
  cudaError_t ce = cudaMemsetAsync(q->counters, 0, (size_t)q->n_counters * 4,
                                   (cudaStream_t)stream);
  if (ce != cudaSuccess) return mok_gpu_cuda_fail(l, "mok_forward: cudaMemsetAsync", ce);
  mok_gpu_fused_params(l, a, ctx, &f);
  f.recv_x = p->peer[p->rank] + p->win.recv_x;
  f.dispatch = dispatch ? p : NULL;
  const mokResult_t r = mok_fwd_fused_launch(&f, stream);
  return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
}

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
    (q).tile_pre = (int32_t *)mok_gpu_ws(l, MOK_WS_TILE_PRE);               \
    (q).shared_offsets = (int32_t *)mok_gpu_ws(l, MOK_WS_SHARED_OFFSETS);   \
    (q).layer_err = mok_gpu_ws(l, MOK_WS_ERROR);                            \
    (q).xg = mok_gpu_ws(l, MOK_WS_XG);                                      \
    (q).yk = (q).peer[(q).rank] + (q).win.yk; /* home ranks read it in place */ \
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
  const int fp8 = l->d.precision == MOK_PRECISION_FP8_BLOCK;
  const int mx = l->d.precision == MOK_PRECISION_MXFP8;
  const int fused = l->d.precision == MOK_PRECISION_BF16 &&
                    l->tuning.forward_path != MOK_FORWARD_CHAIN;
  const int in_kernel = fused && ep_dispatch_in_kernel(l);
  const int64_t T4 = mok_ws_ld4(l->d.max_tokens), R4 = mok_ws_ld4(R);
  if (fp8 || mx) {
    /* fp8 rows on the wire: x quantized once per token, each token's e4m3 row and its H / 128
     * scale words dispatched (about half of x's bf16 bytes). fp8-block: as at W = 1 (the shared
     * expert's A too); MXFP8: four E8M0 scales to a word, and with a shared expert also the
     * rows' bf16 values into xdq, its A */
    uint8_t *xq = mok_gpu_ws(l, MOK_WS_XQT);
    void *xq_s = mok_gpu_ws(l, MOK_WS_XQT_S);
    if (T > 0 && fp8 &&
        (r = mok_gpu_quantize_rows(l, a->x, T, H, xq, xq_s, T4, NULL, stream)) != MOK_SUCCESS)
      return r;
    if (T > 0 && mx &&
        (r = mok_mx_quantize_rows_launch(a->x, xq, xq_s, T4,
                                         Is > 0 ? mok_gpu_ws(l, MOK_WS_XDQ) : NULL, T, H,
                                         stream)) != MOK_SUCCESS)
      return mok_gpu_launcher_failed(l, r);
    p.xq = xq, p.xq_s = xq_s, p.xq_s_ld = T4;
  }
  if (!in_kernel && (r = mok_tp_run_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_forward: the dispatch kernel failed to launch");
  if (fp8) /* the e4m3 rows of this rank's experts and their scales, from recv_x or xqt */
    r = mok_ep_gather_fp8_launch(&p, mok_gpu_ws(l, MOK_WS_XQ), (float *)mok_gpu_ws(l, MOK_WS_XQ_S),
                                 R4, stream);
  else if (mx) /* their MXFP8 values in bf16, xg */
    r = mok_ep_gather_mx_launch(&p, stream);
  else if (!fused)
    r = mok_ep_gather_launch(&p, stream);
  if (r != MOK_SUCCESS)
    return mok_fail(l, r, "mok_forward: the expert-parallel gather failed to launch");

  /* This rank's experts over the rows that arrived: the fused kernel, or the W = 1 chain's
   * GEMMs over the gathered rows (fp8-block, or the chain the tuning asks for). */
  const float *row_w = (const float *)((const char *)p.peer[p.rank] + p.win.row_w);
  if (fused) {
    if ((r = ep_forward_fused(l, a, &p, in_kernel, ctx, stream)) != MOK_SUCCESS) return r;
  } else if (fp8 || mx) {
    const mok_fp8_rows_t c = {p.offsets, p.shared_offsets, row_w, (void *)p.yk};
    if ((r = fp8 ? mok_gpu_forward_fp8_experts(l, a, &c, ctx, stream)
                 : mok_gpu_forward_mx_experts(l, a, &c, ctx, stream)) != MOK_SUCCESS)
      return r;
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
    dn.c = (void *)p.yk; /* the window's yk region */
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
