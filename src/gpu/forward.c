/*
 * gpu/forward.c: the public calls on a GPU layer, host side. W = 1 and BF16 run on the GPU, on the
 * caller's stream, with no host synchronization and no device data read on the host, so a forward
 * can be captured in a CUDA graph. The forward is three kernels (src/cuda/forward/forward.h):
 *
 *   layout (count and    topk_idx [T, K] -> status, offsets [E + 1], slot_row [T, K], ctx header,
 *   finish, a CTA per    row_tok / row_w [R], row-tile prefix sums, the reduce order (tokens by
 *   chunk of tokens)     their last expert), the fused kernel's counters
 *   fused (persistent)   src/cuda/forward/fused.cu: gathers x rows into its gate/up tiles,
 *                        a = bf16(row_w · silu(g) · u) (SAVE: g, u -> ctx), yk = bf16(a · Wdᵀ),
 *                        the shared expert, and y = bf16(ys + yk(slot 0) + ... + yk(slot K-1))
 *
 * MOK_FORWARD=chain runs the same forward as the unfused chain it was built from (and is tested
 * against, bit for bit): layout, gather (x -> xg), the gate/up, down, shared gate/up and shared
 * down grouped GEMMs, reduce. MOK_FORWARD_SMS=n runs the fused kernel on n CTAs,
 * MOK_FUSED_GATHER=kernel lets the chain's gather kernel fill xg first, MOK_FUSED_LAG=n sets its
 * plan's lag, MOK_FUSED_STAGED=0 stores DOWN tiles from registers, MOK_FUSED_GU_STAGED=0 stores
 * a, g and u from registers, MOK_FUSED_A_STAGED=0 only a, MOK_FUSED_ORDER=1 makes the consumer
 * warpgroups issue in turns, MOK_FUSED_DEFER=0 releases a GATE_UP tile at the end of its
 * epilogue, MOK_FUSED_HELP_AT=<percent> sets from which expert stage two producer warps reduce
 * (100: only past the last GATE_UP task), MOK_FUSED_REDUCE_ORDER=0 reduces tokens in token order
 * after every DOWN tile, MOK_FUSED_TIMEOUT_S=<s> bounds its waits, and MOK_FUSED_TRACE=<device
 * address> writes a task trace (forward/fused.cu); none of these changes a bit of the results.
 * Buffers are the regions of src/common/workspace.h. Errors the kernels find (bad routing, capacity
 * overflow) make the call compute nothing and wait in the workspace's error word for
 * mok_layer_check. Other GPU layers (W > 1, fp8) allocate nothing and report
 * MOK_ERROR_NOT_IMPLEMENTED.
 */
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "common/workspace.h"

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/backward/backward.h"
#include "cuda/forward/forward.h"
#include "cuda/gemm/gemm.h"
#include "cuda/quant/quant.h"

struct mok_gpu_layer {
  mok_ws_layout_t lay;
  char *ws;          /* device workspace, lay.ws_bytes; NULL when the layer cannot run */
  void *last_stream; /* the stream of the last forward, synchronized by mok_layer_check */
  int ran;           /* a forward was enqueued since the layer was created */
};

static int gpu_runs(mok_layer_t l) {
  return l->comm->nranks == 1 && l->d.precision == MOK_PRECISION_BF16;
}

static mokResult_t gpu_cuda(mok_layer_t l, const char *call, cudaError_t e) {
  cudaGetLastError(); /* clear a non-sticky error so later calls start clean */
  return mok_fail(l, MOK_ERROR_CUDA, "%s: %s", call, cudaGetErrorString(e));
}

#define GPU_CUDA_GOTO(l, call, res, label)       \
  do {                                           \
    cudaError_t gpu_e_ = (call);                 \
    if (gpu_e_ != cudaSuccess) {                 \
      res = gpu_cuda((l), #call, gpu_e_);        \
      goto label;                                \
    }                                            \
  } while (0)

/* A launcher's failure, already described in this thread's last error: copies it to the layer. */
static mokResult_t gpu_launcher_failed(mok_layer_t l, mokResult_t r) {
  memcpy(l->err, mok_last_error(), sizeof(l->err));
  l->err[sizeof(l->err) - 1] = '\0';
  return r;
}

/* Makes the layer's device current; the previous one goes to *prev. */
static mokResult_t gpu_enter(mok_layer_t l, int *prev) {
  *prev = l->comm->device;
  cudaError_t e = cudaGetDevice(prev);
  if (e == cudaSuccess) e = cudaSetDevice(l->comm->device);
  return e == cudaSuccess ? MOK_SUCCESS : gpu_cuda(l, "cudaSetDevice", e);
}

static mok_ws_dims_t gpu_dims(mok_layer_t l) { return mok_ws_dims(&l->d, l->EL, l->capacity_rows); }

mokResult_t mok_gpu_layer_create(mok_layer_t l) {
  struct mok_gpu_layer *g = calloc(1, sizeof(*g));
  if (!g) return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_layer_create: calloc");
  const mok_ws_dims_t dims = gpu_dims(l);
  mok_ws_layout(&dims, &g->lay);
  l->gpu = g;
  if (!gpu_runs(l)) return MOK_SUCCESS; /* forward reports NOT_IMPLEMENTED; nothing to hold */
  if (l->EL > MOK_MAX_EXPERTS) {
    mok_gpu_layer_destroy(l);
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "num_experts (E) = %lld: GPU layers support up to %d experts per GPU",
                    (long long)l->EL, MOK_MAX_EXPERTS);
  }
  int prev;
  mokResult_t res = gpu_enter(l, &prev);
  if (res != MOK_SUCCESS) {
    mok_gpu_layer_destroy(l);
    return res;
  }
  cudaError_t e = cudaMalloc((void **)&g->ws, g->lay.ws_bytes);
  if (e != cudaSuccess) {
    g->ws = NULL;
    cudaGetLastError();
    res = mok_fail(NULL, e == cudaErrorMemoryAllocation ? MOK_ERROR_OUT_OF_MEMORY : MOK_ERROR_CUDA,
                   "mok_layer_create: cudaMalloc of the %zu-byte workspace on GPU %d: %s",
                   g->lay.ws_bytes, l->comm->device, cudaGetErrorString(e));
  } else if ((e = cudaMemset(g->ws, 0, g->lay.ws_bytes)) != cudaSuccess ||
             (e = cudaDeviceSynchronize()) != cudaSuccess) {
    res = gpu_cuda(NULL, "mok_layer_create: clearing the workspace", e);
  }
  cudaSetDevice(prev);
  if (res != MOK_SUCCESS) mok_gpu_layer_destroy(l);
  return res;
}

void mok_gpu_layer_destroy(mok_layer_t l) {
  if (!l || !l->gpu) return;
  if (l->gpu->ws) {
    int prev;
    if (gpu_enter(l, &prev) == MOK_SUCCESS) {
      cudaFree(l->gpu->ws); /* waits for kernels still using it */
      cudaSetDevice(prev);
    }
  }
  free(l->gpu);
  l->gpu = NULL;
}

size_t mok_gpu_workspace_bytes(mok_layer_t l) {
  return l->gpu && l->gpu->ws ? l->gpu->lay.ws_bytes : 0;
}

size_t mok_gpu_context_bytes(mok_layer_t l) {
  mok_ws_layout_t lay;
  const mok_ws_dims_t dims = gpu_dims(l);
  mok_ws_layout(&dims, &lay);
  return lay.ctx_bytes;
}

/* ---- forward ---------------------------------------------------------------------------------- */

/* One grouped GEMM of the chain; `what` names it in the error. */
static mokResult_t gpu_gemm(mok_layer_t l, const mok_grouped_gemm_params_t *p, const char *what,
                            void *stream) {
  mokResult_t r = mok_grouped_gemm_launch(p, stream);
  if (r != MOK_SUCCESS)
    return mok_fail(l, r, "the %s grouped GEMM (G = %lld, M = %lld, N = %lld, K = %lld) failed to "
                    "launch: %s", what, (long long)p->num_groups, (long long)p->m_total,
                    (long long)p->n, (long long)p->k, mok_error_string(r));
  return MOK_SUCCESS;
}

/* The fused kernel unless MOK_FORWARD=chain (read at every call). */
static int gpu_fused(void) {
  const char *e = getenv("MOK_FORWARD");
  return !(e && strcmp(e, "chain") == 0);
}

/* The kernels of one forward (see the banner). */
static mokResult_t gpu_forward_chain(mok_layer_t l, const mok_forward_args_t *a, void *y,
                                     char *ctx, void *stream) {
  const struct mok_gpu_layer *g = l->gpu;
  const mok_ws_layout_t *lay = &g->lay;
  const int64_t T = a->num_tokens, H = l->d.hidden, I = l->d.intermediate,
                Is = l->d.shared_intermediate, E = l->EL, R = l->capacity_rows;
  const int save = l->d.context_mode == MOK_CONTEXT_SAVE;
  char *ws = g->ws;

  mok_fwd_local_params_t p;
  memset(&p, 0, sizeof(p));
  p.T = T, p.H = H, p.E = E, p.K = l->d.top_k, p.Is = Is, p.capacity_rows = R;
  p.topk_idx = a->topk_idx, p.topk_w = a->topk_w, p.x = a->x, p.y = y;
  p.err = ws + lay->ws[MOK_WS_ERROR];
  p.status = (int32_t *)(ws + lay->ws[MOK_WS_STATUS]);
  p.offsets = (int32_t *)(ws + lay->ws[MOK_WS_OFFSETS]);
  p.shared_offsets = (int32_t *)(ws + lay->ws[MOK_WS_SHARED_OFFSETS]);
  p.slot_row = (int32_t *)(ws + lay->ws[MOK_WS_SLOT_ROW]);
  p.row_w = (float *)(ws + lay->ws[MOK_WS_ROW_W]);
  p.xg = ws + lay->ws[MOK_WS_XG];
  p.yk = ws + lay->ws[MOK_WS_YK];
  p.ys = Is > 0 ? (const float *)(ws + lay->ws[MOK_WS_YS]) : NULL;
  p.ctx_header = ctx + lay->ctx[MOK_CTX_HEADER];
  p.ctx_slot_row = (int32_t *)(ctx + lay->ctx[MOK_CTX_SLOT_ROW]);
  p.ctx_offsets = (int32_t *)(ctx + lay->ctx[MOK_CTX_OFFSETS]);
  p.layer_id = l->id;
  p.context_mode = l->d.context_mode;
  p.row_tok = (int32_t *)(ws + lay->ws[MOK_WS_ROW_TOK]);
  p.tile_pre = (int32_t *)(ws + lay->ws[MOK_WS_TILE_PRE]);
  p.red_pre = (int32_t *)(ws + lay->ws[MOK_WS_RED_PRE]);
  p.red_order = (int32_t *)(ws + lay->ws[MOK_WS_RED_ORDER]);
  p.counters = (uint32_t *)(ws + lay->ws[MOK_WS_COUNTERS]);
  p.n_counters = mok_fc_count(R, E, l->d.max_tokens);
  p.layout_scratch = ws + lay->ws[MOK_WS_LAYOUT];

  mokResult_t r = mok_fwd_layout_launch(&p, stream);
  if (r != MOK_SUCCESS) return gpu_launcher_failed(l, r);
  if (T == 0) return MOK_SUCCESS; /* the layout wrote the context header; nothing else to do */
  if (gpu_fused()) {
    mok_fwd_fused_params_t f;
    memset(&f, 0, sizeof(f));
    f.l = p;
    f.I = I;
    f.wg = a->w.wg, f.wu = a->w.wu, f.wd = a->w.wd;
    f.wsg = a->w.wsg, f.wsu = a->w.wsu, f.wsd = a->w.wsd;
    f.a = ws + lay->ws[MOK_WS_A];
    f.as = Is > 0 ? ws + lay->ws[MOK_WS_AS] : NULL;
    f.g_out = save ? ctx + lay->ctx[MOK_CTX_G] : NULL;
    f.u_out = save ? ctx + lay->ctx[MOK_CTX_U] : NULL;
    f.gs_out = save && Is > 0 ? ctx + lay->ctx[MOK_CTX_GS] : NULL;
    f.us_out = save && Is > 0 ? ctx + lay->ctx[MOK_CTX_US] : NULL;
    const char *sms = getenv("MOK_FORWARD_SMS");
    f.num_sms = sms ? atoi(sms) : 0;
    const char *gk = getenv("MOK_FUSED_GATHER");
    if (gk && strcmp(gk, "kernel") == 0) { /* x rows gathered by the chain's kernel first */
      r = mok_fwd_gather_launch(&p, stream);
      if (r != MOK_SUCCESS) return gpu_launcher_failed(l, r);
      f.l.xg = p.xg;
    } else {
      f.l.xg = NULL;
    }
    r = mok_fwd_fused_launch(&f, stream);
    return r == MOK_SUCCESS ? MOK_SUCCESS : gpu_launcher_failed(l, r);
  }
  r = mok_fwd_gather_launch(&p, stream);
  if (r != MOK_SUCCESS) return gpu_launcher_failed(l, r);

  /* Routed experts: E groups over the R rows of xg; rows past offsets[E] are not touched. */
  mok_grouped_gemm_params_t gu = mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, E, R, I, H);
  gu.a = p.xg;                /* [R, H] */
  gu.b = a->w.wg;             /* [E, I, H] */
  gu.b2 = a->w.wu;            /* [E, I, H] */
  gu.offsets = p.offsets;     /* [E + 1] */
  gu.c = ws + lay->ws[MOK_WS_A]; /* [R, I] */
  gu.row_scale = p.row_w;     /* [R] */
  gu.g_out = save ? ctx + lay->ctx[MOK_CTX_G] : NULL; /* [R, I] */
  gu.u_out = save ? ctx + lay->ctx[MOK_CTX_U] : NULL;
  if ((r = gpu_gemm(l, &gu, "routed gate/up", stream)) != MOK_SUCCESS) return r;

  mok_grouped_gemm_params_t dn = mok_gg_bf16_params(MOK_GG_EPI_STORE_BF16, MOK_GG_B_KMAJOR, E, R, H, I);
  dn.a = gu.c;                /* [R, I] */
  dn.b = a->w.wd;             /* [E, H, I] */
  dn.offsets = p.offsets;
  dn.c = (void *)p.yk;        /* [R, H], over xg: the gate/up GEMM before it has read xg */
  if ((r = gpu_gemm(l, &dn, "routed down", stream)) != MOK_SUCCESS) return r;

  /* Shared expert: one group [0, T) of x itself ({0, 0} when the call is invalid). */
  if (Is > 0) {
    mok_grouped_gemm_params_t sgu = mok_gg_bf16_params(MOK_GG_EPI_SWIGLU, MOK_GG_B_KMAJOR, 1, T, Is, H);
    sgu.a = a->x;             /* [T, H] */
    sgu.b = a->w.wsg;         /* [Is, H] */
    sgu.b2 = a->w.wsu;        /* [Is, H] */
    sgu.offsets = p.shared_offsets;
    sgu.c = ws + lay->ws[MOK_WS_AS]; /* [T, Is] */
    sgu.g_out = save ? ctx + lay->ctx[MOK_CTX_GS] : NULL; /* [T, Is] */
    sgu.u_out = save ? ctx + lay->ctx[MOK_CTX_US] : NULL;
    if ((r = gpu_gemm(l, &sgu, "shared gate/up", stream)) != MOK_SUCCESS) return r;

    mok_grouped_gemm_params_t sdn = mok_gg_bf16_params(MOK_GG_EPI_STORE_F32, MOK_GG_B_KMAJOR, 1, T, H, Is);
    sdn.a = sgu.c;            /* [T, Is] */
    sdn.b = a->w.wsd;         /* [H, Is] */
    sdn.offsets = p.shared_offsets;
    sdn.c = (void *)p.ys;     /* [T, H] fp32 */
    if ((r = gpu_gemm(l, &sdn, "shared down", stream)) != MOK_SUCCESS) return r;
  }

  r = mok_fwd_reduce_launch(&p, stream);
  if (r != MOK_SUCCESS) return gpu_launcher_failed(l, r);
  return MOK_SUCCESS;
}

mokResult_t mok_gpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx,
                            mok_stream_t stream) {
  mokResult_t sup = mok_gpu_check_supported(l, "mok_forward");
  if (sup != MOK_SUCCESS) return sup;
  int prev;
  mokResult_t r = gpu_enter(l, &prev);
  if (r != MOK_SUCCESS) return r;
  l->gpu->last_stream = stream;
  l->gpu->ran = 1;
  r = gpu_forward_chain(l, a, y, ctx, stream);
  cudaSetDevice(prev);
  return r;
}

/* ---- for the backward (src/gpu/backward.c) ---------------------------------------------------- */

void *mok_gpu_workspace(mok_layer_t l) { return l->gpu ? l->gpu->ws : NULL; }

mokResult_t mok_gpu_check_supported(mok_layer_t l, const char *fn) {
  if (l->comm->nranks != 1)
    return mok_fail(l, MOK_ERROR_NOT_IMPLEMENTED,
                    "%s on GPU %d with W = %d ranks: expert parallelism is not implemented on "
                    "the GPU yet (W = 1 is)",
                    fn, l->comm->device, l->comm->nranks);
  if (l->d.precision != MOK_PRECISION_BF16)
    return mok_fail(l, MOK_ERROR_NOT_IMPLEMENTED,
                    "%s on GPU %d: %s layers are not implemented on the GPU yet (BF16 is); use a "
                    "BF16 layer, or MOK_DEVICE_CPU for the reference",
                    fn, l->comm->device,
                    l->d.precision == MOK_PRECISION_FP8_BLOCK ? "fp8-block" : "MXFP8");
  if (!mok_gpu_workspace(l))
    return mok_fail(l, MOK_ERROR_INTERNAL, "%s: GPU layer without a workspace", fn);
  return MOK_SUCCESS;
}

void mok_gpu_track_stream(mok_layer_t l, mok_stream_t stream) {
  l->gpu->last_stream = stream;
  l->gpu->ran = 1;
}

/* ---- asynchronous errors ---------------------------------------------------------------------- */

mokResult_t mok_gpu_check(mok_layer_t l) {
  if (!l->gpu || !l->gpu->ws || !l->gpu->ran) return MOK_SUCCESS;
  int prev;
  mokResult_t res = gpu_enter(l, &prev);
  if (res != MOK_SUCCESS) return res;
  mok_ws_error_t e;
  void *word = l->gpu->ws + l->gpu->lay.ws[MOK_WS_ERROR];
  GPU_CUDA_GOTO(l, cudaStreamSynchronize((cudaStream_t)l->gpu->last_stream), res, done);
  GPU_CUDA_GOTO(l, cudaMemcpy(&e, word, sizeof(e), cudaMemcpyDeviceToHost), res, done);
  if (e.code == 0) goto done;
  GPU_CUDA_GOTO(l, cudaMemset(word, 0, sizeof(e)), res, done);
  GPU_CUDA_GOTO(l, cudaDeviceSynchronize(), res, done);
  if (e.kind == MOK_WS_ERR_ID_RANGE)
    res = mok_fail(l, MOK_ERROR_INVALID_ROUTING,
                   "topk_idx[%lld][%lld] = %lld is not an expert id in [-1, %lld); that forward "
                   "computed nothing and left y unchanged",
                   (long long)e.token, (long long)e.slot, (long long)e.value, (long long)e.limit);
  else if (e.kind == MOK_WS_ERR_REPEAT)
    res = mok_fail(l, MOK_ERROR_INVALID_ROUTING,
                   "topk_idx[%lld][%lld] = %lld repeats the expert of slot %lld (the experts of a "
                   "token must be distinct); that forward computed nothing and left y unchanged",
                   (long long)e.token, (long long)e.slot, (long long)e.value, (long long)e.limit);
  else if (e.kind == MOK_WS_ERR_CAPACITY)
    res = mok_fail(l, MOK_ERROR_CAPACITY_OVERFLOW,
                   "%lld routed rows, capacity is %lld (capacity_factor %g x T_max %lld x K "
                   "%lld); raise capacity_factor or use 0 (automatic); that forward computed "
                   "nothing and left y unchanged",
                   (long long)e.value, (long long)e.limit, l->d.capacity_factor,
                   (long long)l->d.max_tokens, (long long)l->d.top_k);
  else if (e.kind == MOK_WS_ERR_CONTEXT)
    res = mok_fail(l, MOK_ERROR_CONTEXT_MISMATCH,
                   "mok_backward: ctx was not written by a good forward of this layer with these "
                   "args (%s; the context's forward had %lld tokens); that backward computed "
                   "nothing and left dx and dtopk_w unchanged (weight gradients: zeroed when "
                   "overwritten, unchanged when accumulated)",
                   e.value == MOK_WS_CTX_MAGIC     ? "its forward did not complete with valid routing"
                   : e.value == MOK_WS_CTX_LAYER   ? "another layer wrote it"
                   : e.value == MOK_WS_CTX_TOKENS  ? "other number of tokens"
                   : e.value == MOK_WS_CTX_ROUTING ? "other topk_idx"
                                                   : "other context mode",
                   (long long)e.token);
  else if (e.kind == MOK_WS_ERR_TIMEOUT)
    res = mok_fail(l, MOK_ERROR_TIMEOUT,
                   "the fused forward's task %lld waited past the timeout on counter %lld (it "
                   "reached %lld of %lld): that forward's results are wrong. This points to a "
                   "scheduling bug, or to CTAs that could not all run at once; please report it",
                   (long long)e.token, (long long)e.slot, (long long)e.value, (long long)e.limit);
  else
    res = mok_fail(l, e.code > 0 && e.code < MOK_NUM_RESULTS ? (mokResult_t)e.code
                                                             : MOK_ERROR_INTERNAL,
                   "GPU kernel error of kind %d", (int)e.kind);
done:
  cudaSetDevice(prev);
  return res;
}

#else /* !MOK_WITH_CUDA: no GPU layer can exist (mok_comm_create_local reports NO_DEVICE) */

mokResult_t mok_gpu_layer_create(mok_layer_t l) {
  return mok_fail(l, MOK_ERROR_NO_DEVICE, "this build of MoK has no CUDA support");
}
void mok_gpu_layer_destroy(mok_layer_t l) { (void)l; }
size_t mok_gpu_workspace_bytes(mok_layer_t l) { (void)l; return 0; }
size_t mok_gpu_context_bytes(mok_layer_t l) {
  mok_ws_layout_t lay;
  const mok_ws_dims_t dims = mok_ws_dims(&l->d, l->EL, l->capacity_rows);
  mok_ws_layout(&dims, &lay);
  return lay.ctx_bytes;
}
mokResult_t mok_gpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx,
                            mok_stream_t stream) {
  (void)a, (void)y, (void)ctx, (void)stream;
  return mok_fail(l, MOK_ERROR_NO_DEVICE, "this build of MoK has no CUDA support");
}
mokResult_t mok_gpu_check(mok_layer_t l) { (void)l; return MOK_SUCCESS; }
void *mok_gpu_workspace(mok_layer_t l) { (void)l; return NULL; }
void mok_gpu_track_stream(mok_layer_t l, mok_stream_t stream) { (void)l, (void)stream; }

#endif /* MOK_WITH_CUDA */
