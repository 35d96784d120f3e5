/*
 * gpu/backward_ep.c: mok_backward of an expert-parallel GPU layer (W > 1), host side: the
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
 *                  the rows' router-weight gradients; bf16 dxk = bf16(dg · Wg + du · Wu); the shared
 *                  expert on this rank's tokens -> dxs; the weight gradients of this rank's
 *                  experts over their rows in layout order, and of the shared expert over this
 *                  rank's tokens
 *                  (fp8-block: the chain's fp8 steps on the arrived rows, quantized per row)
 *   combine        a signal that this rank's dxk rows and router-weight gradients (the window's
 *                  yk and yk_w regions, where the local chain wrote them) are complete
 *   reduce         dx = bf16(dxs + Σ_k dxk) in slot order, dtopk_w, each slot's row and gradient
 *                  read in its expert rank's window (the pull, as in the forward)
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
  const int64_t T = a->num_tokens, Is = l->d.shared_intermediate, R = l->capacity_rows;
  mokResult_t r;
#define WS(region) mok_gpu_ws(l, region)

  /* 1. Does the context belong to this call, here? (status: the layout's local_ok) */
  mok_bwd_local_params_t c;
  if ((r = mok_gpu_backward_check(l, a, ctx, &c, stream)) != MOK_SUCCESS) return r;

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
    (q).ys = Is > 0 ? (const float *)WS(MOK_WS_DXS) : NULL;                 \
    (q).y = gr->dx, (q).dtopk_w = gr->dtopk_w;                              \
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

  /* 5. The local chain on this rank's experts (gpu/backward.c, E = EL). */
  mok_bwd_rows_t rows;
  rows.ctx = ctx;
  rows.row_w = (const float *)((const char *)p.peer[p.rank] + p.win.row_w);
  rows.offsets = c.offsets, rows.shared_offsets = c.shared_offsets;
  rows.gather = NULL; /* the rows arrived through the transport */
  rows.reduce = NULL; /* after the combine */
  rows.dxk = p.peer[p.rank] + p.win.yk; /* the window's: the home ranks' reduce reads them */
  rows.dw_row = (float *)(p.peer[p.rank] + p.win.yk_w);
  if ((r = mok_gpu_backward_local(l, a, gr, &rows, stream)) != MOK_SUCCESS) return r;

  /* 6-7. The signal that this rank's dxk rows and router-weight gradients are complete; dx and
   * dtopk_w at each home rank from every rank's window. */
  if ((r = mok_transport_params(gl->tp, MOK_TP_COMBINE, stream, &p)) != MOK_SUCCESS)
    return mok_gpu_launcher_failed(l, r);
  EP_FILL(p);
#undef EP_FILL
  if ((r = mok_ep_combine_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_backward: the combine kernel failed to launch");
  if ((r = mok_ep_reduce_launch(&p, stream)) != MOK_SUCCESS)
    return mok_fail(l, r, "mok_backward: the expert-parallel reduce failed to launch");
#undef WS
  return MOK_SUCCESS;
}

#endif /* MOK_WITH_CUDA */
