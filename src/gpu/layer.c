/*
 * gpu/layer.c: a GPU layer's lifetime (its workspace, src/common/workspace.h, and with W > 1 its
 * transport), its sizes, the start of every call on it, and the asynchronous errors its kernels
 * report through the workspace's error word and the transport's (mok_layer_check). Layers of
 * every precision (BF16, fp8-block, MXFP8) run on the GPU at every W.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/shape.h"
#include "gpu/gpu.h"

#ifdef MOK_WITH_CUDA
#include "cuda/backward/backward.h"
#include "cuda/forward/forward.h"
#include "cuda/quant/quant.h"
#endif

#ifdef MOK_WITH_CUDA

mokResult_t mok_gpu_cuda_fail(mok_layer_t l, const char *call, cudaError_t e) {
  cudaGetLastError(); /* clear a non-sticky error so later calls start clean */
  return mok_fail(l, MOK_ERROR_CUDA, "%s: %s", call, cudaGetErrorString(e));
}


mokResult_t mok_gpu_launcher_failed(mok_layer_t l, mokResult_t r) {
  memcpy(l->err, mok_last_error(), sizeof(l->err));
  l->err[sizeof(l->err) - 1] = '\0';
  return r;
}

mokResult_t mok_gpu_enter(mok_layer_t l, int *prev) {
  *prev = l->comm->device;
  cudaError_t e = cudaGetDevice(prev);
  if (e == cudaSuccess) e = cudaSetDevice(l->comm->device);
  return e == cudaSuccess ? MOK_SUCCESS : mok_gpu_cuda_fail(l, "cudaSetDevice", e);
}

static mok_ws_dims_t gpu_dims(mok_layer_t l) {
  mok_ws_dims_t d = mok_ws_dims(&l->d, l->EL, l->capacity_rows);
  d.mx_wire = d.mx && l->comm->nranks > 1;
  return d;
}

mokResult_t mok_gpu_layer_create(mok_layer_t l) {
  struct mok_gpu_layer *g = calloc(1, sizeof(*g));
  if (!g) return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_layer_create: calloc");
  const mok_ws_dims_t dims = gpu_dims(l);
  mok_ws_layout(&dims, &g->lay);
  l->gpu = g;
  /* The kernels' shape rules (src/common/shape.h), for T_max tokens and the layer's capacity. */
  const mok_shape_t shape = {l->d.max_tokens, l->d.hidden, l->d.intermediate,
                             l->d.shared_intermediate, l->EL, l->d.top_k, l->capacity_rows};
  char why[256];
  /* fp8: where the operand copies lie in the caller's quantized weights (H, I, Is are
   * multiples of 128, the scale blocks: src/api/layer.c) */
  if (l->d.precision != MOK_PRECISION_BF16) mok_qw_layout(&l->d, l->EL, &g->qw);
  if (mok_shape_check(&shape, why, sizeof(why)) != MOK_SUCCESS) {
    mok_gpu_layer_destroy(l);
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "mok_layer_create on a GPU: %s", why);
  }
  int prev;
  mokResult_t res = mok_gpu_enter(l, &prev);
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
    res = mok_gpu_cuda_fail(NULL, "mok_layer_create: clearing the workspace", e);
  }
  if (res == MOK_SUCCESS && l->comm->nranks > 1) {
    /* Collective: every rank creates its layers in the same order (the window is). Rows of an
     * expert unpadded (tile_m 1): the grouped GEMMs take the segments as they are. */
    mok_transport_desc_t td;
    memset(&td, 0, sizeof(td));
    td.max_tokens = l->d.max_tokens;
    td.hidden = l->d.hidden;
    td.num_experts = l->d.num_experts;
    td.top_k = l->d.top_k;
    td.tile_m = 1;
    td.yk_rows = l->capacity_rows; /* the forward's expert outputs, read by their home ranks */
    td.num_sms = l->d.comm_sms;
    td.timeout_s = l->tuning.timeout_s;
    if (l->comm->vgroup) {
      /* Virtual ranks share one GPU, and every rank's communication CTAs (one per SM) and layout
       * CTA wait for the others': all must be resident at once. Default: at most 20 (the real
       * ranks' default) and SMs / (2 W), which leaves half the SMs to the GEMMs (W = 8 with 20
       * each, 168 CTAs on 132 SMs, waited until the timeout). */
      const int W = l->comm->nranks;
      int sms = 0;
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, l->comm->device);
      const int fit = sms / (2 * W) > 1 ? sms / (2 * W) : 1;
      if (td.num_sms == 0) td.num_sms = fit < 20 ? fit : 20;
      else if ((td.num_sms + 1) * W > sms)
        res = mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                       "mok_layer_create: comm_sms %d with %d virtual ranks on one GPU of %d "
                       "SMs: every rank's %d communication CTAs and its layout CTA must fit at "
                       "once ((comm_sms + 1) W <= %d); use 0 (automatic: %d)",
                       td.num_sms, W, sms, td.num_sms, sms, fit < 20 ? fit : 20);
    }
    if (res == MOK_SUCCESS) res = mok_transport_create(&g->tp, l->comm, &td);
    /* Every kernel of the forward loaded now: a first launch that loads it may wait for the
     * kernels running, which wait for the other ranks' calls. */
    if (res == MOK_SUCCESS &&
        (mok_ep_preload() != MOK_SUCCESS || mok_fwd_fused_preload() != MOK_SUCCESS ||
         mok_gg_preload() != MOK_SUCCESS || mok_gw_preload() != MOK_SUCCESS ||
         mok_bwd_preload() != MOK_SUCCESS || mok_bwd_fused_preload() != MOK_SUCCESS ||
         mok_quant_preload() != MOK_SUCCESS))
      res = mok_fail(NULL, MOK_ERROR_CUDA, "mok_layer_create: loading the kernels failed");
  }
  cudaSetDevice(prev);
  if (res != MOK_SUCCESS) mok_gpu_layer_destroy(l);
  return res;
}

void mok_gpu_layer_destroy(mok_layer_t l) {
  if (!l || !l->gpu) return;
  if (l->gpu->tp) mok_transport_destroy(l->gpu->tp);
  if (l->gpu->ws) {
    int prev;
    if (mok_gpu_enter(l, &prev) == MOK_SUCCESS) {
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

/* ---- the start of a call ---------------------------------------------------------------------- */

mokResult_t mok_gpu_begin_call(mok_layer_t l, const char *fn, mok_stream_t stream, int *prev) {
  if (!l->gpu || !l->gpu->ws)
    return mok_fail(l, MOK_ERROR_INTERNAL, "%s: GPU layer without a workspace", fn);
  const mokResult_t r = mok_gpu_enter(l, prev);
  if (r != MOK_SUCCESS) return r;
  l->gpu->last_stream = stream;
  l->gpu->ran = 1;
  return MOK_SUCCESS;
}

mokResult_t mok_gpu_gemm(mok_layer_t l, const mok_grouped_gemm_params_t *p, const char *fn,
                         const char *what, void *stream) {
  mok_grouped_gemm_params_t q = *p;
  if (q.group_m == 0) q.group_m = l->tuning.tile_group_m; /* the layer's tuning */
  const mokResult_t r = mok_grouped_gemm_launch(&q, stream);
  if (r != MOK_SUCCESS)
    return mok_fail(l, r, "%s: the %s grouped GEMM (G = %lld, M = %lld, N = %lld, K = %lld) failed "
                    "to launch: %s", fn, what, (long long)p->num_groups, (long long)p->m_total,
                    (long long)p->n, (long long)p->k, mok_error_string(r));
  return MOK_SUCCESS;
}


/* gpu.h */
mokResult_t mok_gpu_mx_qdq(mok_layer_t l, const void *in, void *out, int64_t rows, int64_t cols,
                           const int32_t *limit, void *stream) {
  const mokResult_t r = mok_mx_qdq_rows_launch(in, out, rows, cols, limit, stream);
  return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
}

mok_quant_scale_t mok_gpu_fp8_kind(mok_layer_t l) {
  return l->d.fp8_scale == MOK_FP8_SCALE_POW2 ? MOK_QUANT_POW2_SCALE : MOK_QUANT_FP32_SCALE;
}

mokResult_t mok_gpu_quantize_rows(mok_layer_t l, const void *in, int64_t rows, int64_t cols,
                                  void *q, void *scales, int64_t ld, const int32_t *limit,
                                  void *stream) {
  mok_quantize_params_t p;
  memset(&p, 0, sizeof(p));
  p.in = in;
  p.count = 1;
  p.rows = rows;
  p.cols = cols;
  p.block_rows = 1;
  p.block_cols = 128;
  p.kind = mok_gpu_fp8_kind(l);
  p.q = (uint8_t *)q;
  p.scales = scales;
  p.scales_ld = ld;
  p.rows_limit = limit;
  const mokResult_t r = mok_quantize_launch(&p, stream);
  return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
}

mokResult_t mok_gpu_fp8_rows(mok_layer_t l, const mok_fwd_local_params_t *gather,
                             const void *src, const void *rows, const int32_t *offsets, int64_t T,
                             void *stream) {
  const int64_t H = l->d.hidden, R = l->capacity_rows;
  const int64_t R4 = mok_ws_ld4(R), T4 = mok_ws_ld4(l->d.max_tokens);
  mokResult_t r = MOK_SUCCESS;
  if (T > 0 && (gather || l->d.shared_intermediate > 0))
    r = mok_gpu_quantize_rows(l, src, T, H, mok_gpu_ws(l, MOK_WS_XQT), mok_gpu_ws(l, MOK_WS_XQT_S),
                              T4, NULL, stream);
  if (r != MOK_SUCCESS) return r;
  if (gather) {
    r = mok_fwd_gather_fp8_launch(gather, mok_gpu_ws(l, MOK_WS_XQT),
                                  (const float *)mok_gpu_ws(l, MOK_WS_XQT_S), T4,
                                  mok_gpu_ws(l, MOK_WS_XQ), (float *)mok_gpu_ws(l, MOK_WS_XQ_S), R4,
                                  stream);
    return r == MOK_SUCCESS ? MOK_SUCCESS : mok_gpu_launcher_failed(l, r);
  }
  return mok_gpu_quantize_rows(l, rows, R, H, mok_gpu_ws(l, MOK_WS_XQ), mok_gpu_ws(l, MOK_WS_XQ_S),
                               R4, offsets + l->EL, stream);
}

void mok_gpu_qw_operand(mok_layer_t l, const mok_weights_t *w, mok_qw_which_t which, int second,
                        mok_grouped_gemm_params_t *p) {
  const mok_qw_operand_t *o = &l->gpu->qw.op[which];
  const uint8_t *base = (const uint8_t *)w->quantized;
  const int mx = l->d.precision == MOK_PRECISION_MXFP8; /* E8M0 bytes, else fp32 scales */
  if (second) {
    p->b2 = base + o->data;
    if (mx) p->b2_e8m0 = base + o->scales;
    else p->b2_scale = (const float *)(base + o->scales);
  } else {
    p->b = base + o->data;
    if (mx) p->b_e8m0 = base + o->scales;
    else p->b_scale = (const float *)(base + o->scales);
  }
}

/* The weight-gradient GEMM of a backward chain (gpu.h). */
mokResult_t mok_gpu_wgrad(mok_layer_t l, int64_t groups, int64_t m, int64_t n, int64_t k,
                             const void *a, const void *b, const int32_t *offsets, void *dw,
                         float *stage, const char *what, void *stream) {
  const int bf16 = l->d.wgrad_dtype == MOK_WGRAD_BF16, acc = l->d.wgrad_accumulate;
  mok_grouped_wgrad_params_t p;
  memset(&p, 0, sizeof(p));
  p.epilogue = bf16 ? (acc ? MOK_GG_EPI_STORE_F32 : MOK_GG_EPI_STORE_BF16)
                    : (acc ? MOK_GG_EPI_ACCUM_F32 : MOK_GG_EPI_STORE_F32);
  p.num_groups = groups;
  p.m_total = m;
  p.n = n;
  p.k = k;
  p.a = a;
  p.b = b;
  p.offsets = offsets;
  p.c = bf16 && acc ? (void *)stage : dw;
  mokResult_t r = mok_grouped_wgrad_launch(&p, stream);
  if (r != MOK_SUCCESS)
    return mok_fail(l, r, "mok_backward: the %s weight-gradient GEMM (G = %lld, M = %lld, "
                    "N = %lld, K = %lld) failed to launch: %s", what, (long long)groups,
                    (long long)m, (long long)n, (long long)k, mok_error_string(r));
  if (bf16 && acc) {
    r = mok_bwd_wgrad_store_bf16_launch(stage, dw, groups * n * k, 1, stream);
    if (r != MOK_SUCCESS) return mok_gpu_launcher_failed(l, r);
  }
  return MOK_SUCCESS;
}


/* ---- asynchronous errors ---------------------------------------------------------------------- */

mokResult_t mok_gpu_check(mok_layer_t l) {
  if (!l->gpu || !l->gpu->ws || !l->gpu->ran) return MOK_SUCCESS;
  int prev;
  mokResult_t res = mok_gpu_enter(l, &prev);
  if (res != MOK_SUCCESS) return res;
  mok_ws_error_t e;
  void *word = l->gpu->ws + l->gpu->lay.ws[MOK_WS_ERROR];
  if (l->gpu->tp && (res = mok_transport_check(l->gpu->tp)) != MOK_SUCCESS) {
    /* This rank's own failure (a wait that timed out, its bad routing; the message names the
     * rank): the layer's word may only repeat it. */
    cudaMemset(word, 0, sizeof(e));
    res = mok_gpu_launcher_failed(l, res);
    goto done;
  }
  MOK_GPU_CUDA_GOTO(l, cudaStreamSynchronize((cudaStream_t)l->gpu->last_stream), res, done);
  MOK_GPU_CUDA_GOTO(l, cudaMemcpy(&e, word, sizeof(e), cudaMemcpyDeviceToHost), res, done);
  {
    /* A kernel's mbarrier wait that timed out (src/cuda/ptx/ptx.cuh): a bug, reported first. */
    mok_kernel_fault_t f;
    const char *kernel = mok_fwd_fused_fault_take(&f) ? "fused forward"
                         : mok_gg_fault_take(&f)      ? "grouped GEMM"
                         : mok_gw_fault_take(&f)      ? "weight-gradient GEMM"
                                                      : NULL;
    if (kernel) {
      if (e.code != 0) cudaMemset(word, 0, sizeof(e));
      res = mok_fail(l, MOK_ERROR_TIMEOUT,
                     "a %s kernel's wait on its shared-memory pipeline (SM %u, barrier 0x%x, "
                     "parity %u) timed out: the kernel ran to its end with wrong results instead "
                     "of hanging. This is a bug in MoK; please report it",
                     kernel, f.sm, f.bar, f.parity);
      goto done;
    }
  }
  if (e.code == 0) goto done;
  MOK_GPU_CUDA_GOTO(l, cudaMemset(word, 0, sizeof(e)), res, done);
  MOK_GPU_CUDA_GOTO(l, cudaDeviceSynchronize(), res, done);
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
  else if (e.kind == MOK_WS_ERR_PEER_ROUTING)
    res = mok_fail(l, MOK_ERROR_INVALID_ROUTING,
                   "rank %d of %d: rank %lld's routing was invalid (that rank's mok_layer_check "
                   "names the slot); no rank computed that forward, and y was left unchanged",
                   l->comm->rank, l->comm->nranks, (long long)e.value);
  else if (e.kind == MOK_WS_ERR_PEER_CAPACITY)
    res = mok_fail(l, MOK_ERROR_CAPACITY_OVERFLOW,
                   "rank %d of %d: rank %lld would receive %lld routed rows, its capacity is %lld "
                   "(capacity_factor %g); no rank computed that forward, and y was left unchanged",
                   l->comm->rank, l->comm->nranks, (long long)e.value, (long long)e.slot,
                   (long long)e.limit, l->d.capacity_factor);
  else if (e.kind == MOK_WS_ERR_PEER_CONTEXT)
    res = mok_fail(l, MOK_ERROR_CONTEXT_MISMATCH,
                   "rank %d of %d: rank %lld's ctx did not match its mok_backward call (that "
                   "rank's mok_layer_check says how); no rank computed that backward: dx and "
                   "dtopk_w unchanged, weight gradients zeroed when overwritten, unchanged when "
                   "accumulated",
                   l->comm->rank, l->comm->nranks, (long long)e.value);
  else if (e.kind == MOK_WS_ERR_PEER_SHAPE)
    res = mok_fail(l, MOK_ERROR_INVALID_VALUE,
                   "rank %d of %d: rank %lld's layer has max_tokens %lld, this rank's %lld: every "
                   "rank must create its layers with the same descriptor, in the same order; no "
                   "rank computed that call",
                   l->comm->rank, l->comm->nranks, (long long)e.value, (long long)e.slot,
                   (long long)e.limit);
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

/* After a timeout (include/mok.h): the transport's collective recovery on `stream`, the layer's
 * error word cleared before it; mok_gpu_check confirms it. A layer without a transport (W = 1)
 * has no counters shared with other ranks: nothing to do. */
mokResult_t mok_gpu_recover(mok_layer_t l, mok_stream_t stream) {
  if (!l->gpu || !l->gpu->ws || !l->gpu->tp) return MOK_SUCCESS;
  int prev;
  mokResult_t res = mok_gpu_enter(l, &prev);
  if (res != MOK_SUCCESS) return res;
  void *word = l->gpu->ws + l->gpu->lay.ws[MOK_WS_ERROR];
  cudaError_t ce = cudaMemsetAsync(word, 0, sizeof(mok_ws_error_t), (cudaStream_t)stream);
  if (ce != cudaSuccess) {
    res = mok_gpu_cuda_fail(l, "mok_layer_recover: cudaMemsetAsync", ce);
  } else if ((res = mok_transport_recover(l->gpu->tp, stream)) != MOK_SUCCESS) {
    res = mok_gpu_launcher_failed(l, res);
  } else {
    l->gpu->last_stream = stream;
    l->gpu->ran = 1;
  }
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
mokResult_t mok_gpu_check(mok_layer_t l) { (void)l; return MOK_SUCCESS; }
mokResult_t mok_gpu_recover(mok_layer_t l, mok_stream_t s) { (void)l, (void)s; return MOK_SUCCESS; }

#endif /* MOK_WITH_CUDA */
