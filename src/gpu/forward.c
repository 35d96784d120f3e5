/*
 * gpu/forward.c: mok_forward on a GPU layer, host side. W = 1 and BF16 run on the GPU, on the
 * caller's stream, with no host synchronization and no device data read on the host, so a forward
 * can be captured in a CUDA graph. The forward is two launches (src/cuda/forward/forward.h):
 *
 *   layout (count and    topk_idx [T, K] -> status, offsets [E + 1], slot_row [T, K], ctx header,
 *   finish, a CTA per    row_tok / row_w [R], row-tile prefix sums, the reduce order (tokens by
 *   chunk of tokens)     their last expert), the fused kernel's counters
 *   fused (persistent)   src/cuda/forward/fused.cu: gathers x rows into its gate/up tiles,
 *                        a = bf16(row_w · silu(g) · u) (SAVE: g, u -> ctx), yk = bf16(a · Wdᵀ),
 *                        the shared expert, and y = bf16(ys + yk(slot 0) + ... + yk(slot K-1))
 *
 * The layer's tuning (src/common/tuning.h) can select the kernel chain the fused kernel was built
 * from and is tested against, bit for bit (MOK_FORWARD_CHAIN): layout, gather (x -> xg), the
 * gate/up, down, shared gate/up and shared down grouped GEMMs, reduce. fp8-block layers run a
 * chain of the same shape with e4m3 GEMMs (gpu_forward_fp8), MXFP8 layers one with bf16 GEMMs
 * on MXFP8 values (gpu_forward_mx). No tuning value changes a
 * bit of the results. Buffers are the regions of src/common/workspace.h. Errors the kernels find
 * (bad routing, capacity overflow) make the call compute nothing and wait in the workspace's
 * error word for mok_layer_check (src/gpu/layer.c).
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"

#ifdef MOK_WITH_CUDA
#include "cuda/forward/forward.h"

/* The layout kernel's parameters for one call (the chain's kernels take them too). */
static mok_fwd_local_params_t gpu_local_params(mok_layer_t l, const mok_forward_args_t *a, void *y,
                                               char *ctx) {
  const struct mok_gpu_layer *g = l->gpu;
  const mok_ws_layout_t *lay = &g->lay;
  const int64_t T = a->num_tokens, H = l->d.hidden, Is = l->d.shared_intermediate, E = l->EL,
                R = l->capacity_rows;

  mok_fwd_local_params_t p;
  memset(&p, 0, sizeof(p));
  p.T = T, p.H = H, p.E = E, p.K = l->d.top_k, p.Is = Is, p.capacity_rows = R;
  p.topk_idx = a->topk_idx, p.topk_w = a->topk_w, p.x = a->x, p.y = y;
  p.err = mok_gpu_ws(l, MOK_WS_ERROR);
  p.status = (int32_t *)mok_gpu_ws(l, MOK_WS_STATUS);
  p.offsets = (int32_t *)mok_gpu_ws(l, MOK_WS_OFFSETS);
  p.shared_offsets = (int32_t *)mok_gpu_ws(l, MOK_WS_SHARED_OFFSETS);
  p.slot_row = (int32_t *)mok_gpu_ws(l, MOK_WS_SLOT_ROW);
  p.row_w = (float *)mok_gpu_ws(l, MOK_WS_ROW_W);
  p.xg = mok_gpu_ws(l, MOK_WS_XG);
  p.yk = mok_gpu_ws(l, MOK_WS_YK);
  p.ys = Is > 0 ? (const float *)mok_gpu_ws(l, MOK_WS_YS) : NULL;
  p.ctx_header = ctx + lay->ctx[MOK_CTX_HEADER];
  p.ctx_slot_row = (int32_t *)(ctx + lay->ctx[MOK_CTX_SLOT_ROW]);
  p.ctx_offsets = (int32_t *)(ctx + lay->ctx[MOK_CTX_OFFSETS]);
  p.layer_id = l->id;
  p.context_mode = l->d.context_mode;
  p.row_tok = (int32_t *)mok_gpu_ws(l, MOK_WS_ROW_TOK);
  p.tile_pre = (int32_t *)mok_gpu_ws(l, MOK_WS_TILE_PRE);
  p.red_pre = (int32_t *)mok_gpu_ws(l, MOK_WS_RED_PRE);
  p.red_order = (int32_t *)mok_gpu_ws(l, MOK_WS_RED_ORDER);
  p.counters = (uint32_t *)mok_gpu_ws(l, MOK_WS_COUNTERS);
  p.n_counters = mok_fc_count(R, E, l->d.max_tokens);
  p.layout_scratch = mok_gpu_ws(l, MOK_WS_LAYOUT);
  return p;
}

void mok_gpu_fused_params(mok_layer_t l, const mok_forward_args_t *a, char *ctx,
                          mok_fwd_fused_params_t *f) {
  const mok_ws_layout_t *lay = &l->gpu->lay;
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE, shared = l->d.shared_intermediate > 0;
  f->I = l->d.intermediate;
  f->wg = a->w.wg, f->wu = a->w.wu, f->wd = a->w.wd;
  f->wsg = a->w.wsg, f->wsu = a->w.wsu, f->wsd = a->w.wsd;
  f->a = mok_gpu_ws(l, MOK_WS_A);
  f->as = shared ? mok_gpu_ws(l, MOK_WS_AS) : NULL;
  f->g_out = save ? ctx + lay->ctx[MOK_CTX_G] : NULL;
  f->u_out = save ? ctx + lay->ctx[MOK_CTX_U] : NULL;
  f->gs_out = save && shared ? ctx + lay->ctx[MOK_CTX_GS] : NULL;
  f->us_out = save && shared ? ctx + lay->ctx[MOK_CTX_US] : NULL;
  f->num_sms = l->tuning.forward_sms;
  f->tuning = &l->tuning;
}

/* The fused kernel after this call's layout (p). */
static mokResult_t gpu_forward_fused(mok_layer_t l, const mok_forward_args_t *a,
                                     const mok_fwd_local_params_t *p, char *ctx, void *stream) {
  mok_fwd_fused_params_t f;
  memset(&f, 0, sizeof(f));
  f.l = *p;
  f.l.xg = NULL; /* GATE_UP gathers the rows of x itself */
  mok_gpu_fused_params(l, a, ctx, &f);
  const mokResult_t r = mok_fwd_fused_launch(&f, stream);
  return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
}

/* The kernel chain after this call's layout (p): the fused kernel's oracle. */
static mokResult_t gpu_forward_chain(mok_layer_t l, const mok_forward_args_t *a,
                                     const mok_fwd_local_params_t *pp, char *ctx, void *stream) {
  const mok_fwd_local_params_t p = *pp;
  const mok_ws_layout_t *lay = &l->gpu->lay;
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, E = l->EL, R = l->capacity_rows;
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE;
  mokResult_t r = mok_fwd_gather_launch(&p, stream);
  if (r != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);

  /* Routed experts: E groups over the R rows of xg; rows past offsets[E] are not touched. */
  mok_grouped_gemm_params_t gu = mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, E, R, I, H);
  gu.a = p.xg;                /* [R, H] */
  gu.b = a->w.wg;             /* [E, I, H] */
  gu.b2 = a->w.wu;            /* [E, I, H] */
  gu.offsets = p.offsets;     /* [E + 1] */
  gu.c = mok_gpu_ws(l, MOK_WS_A); /* [R, I] */
  gu.row_scale = p.row_w;     /* [R] */
  gu.g_out = save ? ctx + lay->ctx[MOK_CTX_G] : NULL; /* [R, I] */
  gu.u_out = save ? ctx + lay->ctx[MOK_CTX_U] : NULL;
  if ((r = mok_gpu_gemm(l, &gu, "mok_forward", "routed gate/up", stream)) != MOK_SUCCESS) return r;

  mok_grouped_gemm_params_t dn = mok_gg_bf16_params(MOK_GG_EPI_STORE_BF16, MOK_GG_B_KMAJOR, E, R, H, I);
  dn.a = gu.c;                /* [R, I] */
  dn.b = a->w.wd;             /* [E, H, I] */
  dn.offsets = p.offsets;
  dn.c = (void *)p.yk;        /* [R, H], over xg: the gate/up GEMM before it has read xg */
  if ((r = mok_gpu_gemm(l, &dn, "mok_forward", "routed down", stream)) != MOK_SUCCESS) return r;

  /* Shared expert: one group [0, T) of x itself ({0, 0} when the call is invalid). */
  if (Is > 0) {
    mok_grouped_gemm_params_t sgu = mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, 1, T, Is, H);
    sgu.a = a->x;             /* [T, H] */
    sgu.b = a->w.wsg;         /* [Is, H] */
    sgu.b2 = a->w.wsu;        /* [Is, H] */
    sgu.offsets = p.shared_offsets;
    sgu.c = mok_gpu_ws(l, MOK_WS_AS); /* [T, Is] */
    sgu.g_out = save ? ctx + lay->ctx[MOK_CTX_GS] : NULL; /* [T, Is] */
    sgu.u_out = save ? ctx + lay->ctx[MOK_CTX_US] : NULL;
    if ((r = mok_gpu_gemm(l, &sgu, "mok_forward", "shared gate/up", stream)) != MOK_SUCCESS)
      return r;

    mok_grouped_gemm_params_t sdn = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_KMAJOR, 1, T, H, Is);
    sdn.a = sgu.c;            /* [T, Is] */
    sdn.b = a->w.wsd;         /* [H, Is] */
    sdn.offsets = p.shared_offsets;
    sdn.c = (void *)p.ys;     /* [T, H] fp32 */
    if ((r = mok_gpu_gemm(l, &sdn, "mok_forward", "shared down", stream)) != MOK_SUCCESS) return r;
  }

  r = mok_fwd_reduce_launch(&p, stream);
  if (r != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);
  return MOK_SUCCESS;
}

/* gpu.h */
mok_grouped_gemm_params_t mok_gpu_fp8_swiglu_params(mok_layer_t l, const mok_weights_t *w,
                                                    int shared, int64_t T,
                                                    const int32_t *offsets, const float *row_w,
                                                    void *c, void *g_out, void *u_out) {
  const int64_t H = l->d.hidden, R = l->capacity_rows;
  mok_grouped_gemm_params_t p =
      shared ? mok_gg_fp8_params(MOK_GG_EPI_SWIGLU, 1, T, l->d.shared_intermediate, H)
             : mok_gg_fp8_params(MOK_GG_EPI_SWIGLU, l->EL, R, l->d.intermediate, H);
  p.a = mok_gpu_ws(l, shared ? MOK_WS_XQT : MOK_WS_XQ);
  p.a_scale = (const float *)mok_gpu_ws(l, shared ? MOK_WS_XQT_S : MOK_WS_XQ_S);
  p.a_scale_ld = mok_ws_ld4(shared ? l->d.max_tokens : R);
  mok_gpu_qw_operand(l, w, shared ? MOK_QW_WSG : MOK_QW_WG, 0, &p);
  mok_gpu_qw_operand(l, w, shared ? MOK_QW_WSU : MOK_QW_WU, 1, &p);
  p.offsets = offsets;
  p.row_scale = row_w;
  p.c = c, p.g_out = g_out, p.u_out = u_out;
  return p;
}

/* fp8-block: the experts' GEMMs after the e4m3 rows of this call are in place (xq [R, H]: the
 * routed rows in expert order; xqt [T, H]: the call's tokens, for the shared expert; scales K-block
 * major, src/common/workspace.h), for W = 1 and for one rank of an expert-parallel layer (gpu.h):
 *   gate/up    fp8 SwiGLU GEMM: aq = e4m3 of a = bf16(row_w · silu(g) · u) [R, I] along I,
 *              quantized in its epilogue (SAVE: g, u -> ctx)
 *   down       yk [R, H] bf16 = aq · Wdᵀ
 *   shared     SwiGLU GEMM on xqt -> asq (the same); ys [T, H] fp32 = asq · Wsdᵀ
 * Weights come from the caller's mok_quantize_weights buffer (the forward copies). */
mokResult_t mok_gpu_forward_fp8_experts(mok_layer_t l, const mok_forward_args_t *a,
                                        const mok_fp8_rows_t *c, char *ctx, void *stream) {
  const mok_ws_layout_t *lay = &l->gpu->lay;
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, E = l->EL, R = l->capacity_rows;
  const int64_t R4 = mok_ws_ld4(R), T4 = mok_ws_ld4(l->d.max_tokens);
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE;
  mokResult_t r;
#define WS(region) mok_gpu_ws(l, region)
  mok_grouped_gemm_params_t gu = mok_gpu_fp8_swiglu_params(
      l, &a->w, 0, T, c->offsets, c->row_w, WS(MOK_WS_A), save ? ctx + lay->ctx[MOK_CTX_G] : NULL,
      save ? ctx + lay->ctx[MOK_CTX_U] : NULL);
  gu.c = NULL, gu.c_q = WS(MOK_WS_AQ), gu.c_q_scale = (float *)WS(MOK_WS_AQ_S), gu.c_q_ld = R4;
  gu.c_q_kind = mok_gpu_fp8_kind(l);
  if ((r = mok_gpu_gemm(l, &gu, "mok_forward", "fp8 routed gate/up", stream)) != MOK_SUCCESS)
    return r;
  mok_grouped_gemm_params_t dn = mok_gg_fp8_params(MOK_GG_EPI_STORE_BF16, E, R, H, I);
  dn.a = WS(MOK_WS_AQ), dn.a_scale = (const float *)WS(MOK_WS_AQ_S), dn.a_scale_ld = R4;
  mok_gpu_qw_operand(l, &a->w, MOK_QW_WD, 0, &dn);
  dn.offsets = c->offsets;
  dn.c = c->yk; /* [R, H]: W = 1 the workspace's, over xg (no fp8 GEMM reads it); EP the window's */
  if ((r = mok_gpu_gemm(l, &dn, "mok_forward", "fp8 routed down", stream)) != MOK_SUCCESS) return r;

  if (Is > 0 && T > 0) {
    mok_grouped_gemm_params_t sgu = mok_gpu_fp8_swiglu_params(
        l, &a->w, 1, T, c->shared_offsets, NULL, WS(MOK_WS_AS),
        save ? ctx + lay->ctx[MOK_CTX_GS] : NULL, save ? ctx + lay->ctx[MOK_CTX_US] : NULL);
    sgu.c = NULL, sgu.c_q = WS(MOK_WS_ASQ), sgu.c_q_scale = (float *)WS(MOK_WS_ASQ_S);
    sgu.c_q_ld = T4, sgu.c_q_kind = mok_gpu_fp8_kind(l);
    if ((r = mok_gpu_gemm(l, &sgu, "mok_forward", "fp8 shared gate/up", stream)) != MOK_SUCCESS)
      return r;
    mok_grouped_gemm_params_t sdn = mok_gg_fp8_params(MOK_GG_EPI_STORE_F32, 1, T, H, Is);
    sdn.a = WS(MOK_WS_ASQ), sdn.a_scale = (const float *)WS(MOK_WS_ASQ_S), sdn.a_scale_ld = T4;
    mok_gpu_qw_operand(l, &a->w, MOK_QW_WSD, 0, &sdn);
    sdn.offsets = c->shared_offsets;
    sdn.c = WS(MOK_WS_YS);
    if ((r = mok_gpu_gemm(l, &sdn, "mok_forward", "fp8 shared down", stream)) != MOK_SUCCESS)
      return r;
  }
#undef WS
  return MOK_SUCCESS;
}

/* fp8-block, W = 1: x quantized once per token (xqt: the shared expert's A), its e4m3 rows copied
 * into expert order (xq), the experts' GEMMs (mok_gpu_forward_fp8_experts), the BF16 reduce. */
static mokResult_t gpu_forward_fp8(mok_layer_t l, const mok_forward_args_t *a,
                                   const mok_fwd_local_params_t *p, char *ctx, void *stream) {
  mokResult_t r = mok_gpu_fp8_rows(l, p, a->x, NULL, p->offsets, a->num_tokens, stream);
  if (r != MOK_SUCCESS) return r;
  const mok_fp8_rows_t c = {p->offsets, p->shared_offsets, p->row_w, (void *)p->yk};
  if ((r = mok_gpu_forward_fp8_experts(l, a, &c, ctx, stream)) != MOK_SUCCESS) return r;
  r = mok_fwd_reduce_launch(p, stream);
  return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
}

/* MXFP8: the experts' GEMMs (gpu.h), the bf16 chain's on MXFP8 values: a and as quantize-
 * dequantized in place after their SwiGLU GEMMs; every GEMM reads its weights as e4m3 with E8M0
 * scales (MOK_GG_MXFP8_B, dequantized to bf16 in shared memory). */
mokResult_t mok_gpu_forward_mx_experts(mok_layer_t l, const mok_forward_args_t *a,
                                       const mok_fp8_rows_t *c, char *ctx, void *stream) {
  const mok_ws_layout_t *lay = &l->gpu->lay;
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, E = l->EL, R = l->capacity_rows;
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE;
  mokResult_t r;
#define WS(region) mok_gpu_ws(l, region)
  mok_grouped_gemm_params_t gu = mok_gg_mx_params(MOK_GG_EPI_SWIGLU, E, R, I, H);
  gu.a = WS(MOK_WS_XG);
  mok_gpu_qw_operand(l, &a->w, MOK_QW_WG, 0, &gu);
  mok_gpu_qw_operand(l, &a->w, MOK_QW_WU, 1, &gu);
  gu.offsets = c->offsets, gu.row_scale = c->row_w, gu.c = WS(MOK_WS_A);
  gu.g_out = save ? ctx + lay->ctx[MOK_CTX_G] : NULL;
  gu.u_out = save ? ctx + lay->ctx[MOK_CTX_U] : NULL;
  if ((r = mok_gpu_gemm(l, &gu, "mok_forward", "MXFP8 routed gate/up", stream)) != MOK_SUCCESS)
    return r;
  if ((r = mok_gpu_mx_qdq(l, WS(MOK_WS_A), WS(MOK_WS_A), R, I, c->offsets + E, stream)) !=
      MOK_SUCCESS)
    return r;
  mok_grouped_gemm_params_t dn = mok_gg_mx_params(MOK_GG_EPI_STORE_BF16, E, R, H, I);
  dn.a = WS(MOK_WS_A);
  mok_gpu_qw_operand(l, &a->w, MOK_QW_WD, 0, &dn);
  dn.offsets = c->offsets, dn.c = c->yk; /* at W = 1 over xg, which gate/up has read */
  if ((r = mok_gpu_gemm(l, &dn, "mok_forward", "MXFP8 routed down", stream)) != MOK_SUCCESS)
    return r;

  if (Is > 0 && T > 0) {
    mok_grouped_gemm_params_t sgu = mok_gg_mx_params(MOK_GG_EPI_SWIGLU, 1, T, Is, H);
    sgu.a = WS(MOK_WS_XDQ);
    mok_gpu_qw_operand(l, &a->w, MOK_QW_WSG, 0, &sgu);
    mok_gpu_qw_operand(l, &a->w, MOK_QW_WSU, 1, &sgu);
    sgu.offsets = c->shared_offsets, sgu.c = WS(MOK_WS_AS);
    sgu.g_out = save ? ctx + lay->ctx[MOK_CTX_GS] : NULL;
    sgu.u_out = save ? ctx + lay->ctx[MOK_CTX_US] : NULL;
    if ((r = mok_gpu_gemm(l, &sgu, "mok_forward", "MXFP8 shared gate/up", stream)) != MOK_SUCCESS)
      return r;
    if ((r = mok_gpu_mx_qdq(l, WS(MOK_WS_AS), WS(MOK_WS_AS), T, Is, NULL, stream)) != MOK_SUCCESS)
      return r;
    mok_grouped_gemm_params_t sdn = mok_gg_mx_params(MOK_GG_EPI_STORE_F32, 1, T, H, Is);
    sdn.a = WS(MOK_WS_AS);
    mok_gpu_qw_operand(l, &a->w, MOK_QW_WSD, 0, &sdn);
    sdn.offsets = c->shared_offsets, sdn.c = WS(MOK_WS_YS);
    if ((r = mok_gpu_gemm(l, &sdn, "mok_forward", "MXFP8 shared down", stream)) != MOK_SUCCESS)
      return r;
  }
#undef WS
  return MOK_SUCCESS;
}

/* MXFP8 (W = 1): x quantize-dequantized once per token (xdq, the shared expert's A) and
 * gathered into xg, the experts' GEMMs, the BF16 reduce. The activations' values are those of
 * the reference's quantization points (src/cpu/ref.h) exactly (mok_mx_qdq_rows_launch says when
 * bf16 rounds the tiniest). */
static mokResult_t gpu_forward_mx(mok_layer_t l, const mok_forward_args_t *a,
                                  const mok_fwd_local_params_t *pp, char *ctx, void *stream) {
  void *xdq = mok_gpu_ws(l, MOK_WS_XDQ);
  mokResult_t r = mok_gpu_mx_qdq(l, a->x, xdq, a->num_tokens, l->d.hidden, NULL, stream);
  if (r != MOK_SUCCESS) return r;
  mok_fwd_local_params_t p = *pp;
  p.x = xdq;
  if ((r = mok_fwd_gather_launch(&p, stream)) != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);
  const mok_fp8_rows_t c = {p.offsets, p.shared_offsets, p.row_w, (void *)p.yk};
  if ((r = mok_gpu_forward_mx_experts(l, a, &c, ctx, stream)) != MOK_SUCCESS) return r;
  r = mok_fwd_reduce_launch(&p, stream);
  return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
}

mokResult_t mok_gpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx,
                            mok_stream_t stream) {
  int prev;
  mokResult_t r = mok_gpu_begin_call(l, "mok_forward", stream, &prev);
  if (r != MOK_SUCCESS) return r;
  if (l->comm->nranks > 1) {
    r = mok_gpu_forward_ep(l, a, y, (char *)ctx, stream);
    cudaSetDevice(prev);
    return r;
  }
  const mok_fwd_local_params_t p = gpu_local_params(l, a, y, (char *)ctx);
  r = mok_fwd_layout_launch(&p, stream);
  if (r != MOK_SUCCESS) r = mok_gpu_launcher_failed(l, r);
  else if (a->num_tokens > 0) /* else the layout wrote the context header; nothing else to do */
    r = l->d.precision == MOK_PRECISION_FP8_BLOCK ? gpu_forward_fp8(l, a, &p, ctx, stream)
        : l->d.precision == MOK_PRECISION_MXFP8   ? gpu_forward_mx(l, a, &p, ctx, stream)
        : l->tuning.forward_path == MOK_FORWARD_CHAIN ? gpu_forward_chain(l, a, &p, ctx, stream)
                                                      : gpu_forward_fused(l, a, &p, ctx, stream);
  cudaSetDevice(prev);
  return r;
}

#else /* !MOK_WITH_CUDA: no GPU layer can exist (mok_comm_create_local reports NO_DEVICE) */

mokResult_t mok_gpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx,
                            mok_stream_t stream) {
  (void)a, (void)y, (void)ctx, (void)stream;
  return mok_fail(l, MOK_ERROR_NO_DEVICE, "this build of MoK has no CUDA support");
}

#endif /* MOK_WITH_CUDA */
