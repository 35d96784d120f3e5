/*
 * layer.c: the layer handle: descriptor validation, create/destroy, size queries, argument
 * validation shared by both backends, and the dispatch of forward/backward/quantize to the backend
 * chosen by the communicator's device (MOK_DEVICE_CPU: the plain-C reference, src/cpu/backend.c;
 * a GPU: src/gpu/forward.c and src/gpu/backward.c, which run W = 1 BF16 layers; the rest
 * reports MOK_ERROR_NOT_IMPLEMENTED until it lands).
 */
#include <math.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/quant/quant.h"
#include "api/api.h"
#include "api/internal.h"
#include "common/limits.h"

/* The bounds of common/limits.h make every size fit in int64_t; size_t must hold them too. */
_Static_assert(sizeof(size_t) >= sizeof(int64_t), "MoK needs a 64-bit size_t");

static atomic_uint_fast64_t g_next_layer_id = 1; /* distinguishes layers in saved contexts */

static int is_gpu(mok_layer_t l) { return l->comm->device != MOK_DEVICE_CPU; }

/* Routed rows (unpadded) a rank can receive: ceil(cf * T_max * K), cf = W when 0. Exact: the
 * product is below 2^53 within the bounds of check_desc (cf <= W <= E <= 2^16, T_max K <= 2^30). */
static int64_t capacity_rows(const mok_layer_desc_t *d, int W) {
  const double cf = d->capacity_factor > 0 ? d->capacity_factor : (double)W;
  return (int64_t)ceil(cf * (double)(d->max_tokens * d->top_k));
}

static mokResult_t check_desc(const mok_layer_desc_t *d, int W) {
  if (d->struct_size != sizeof(mok_layer_desc_t) || d->version / 100 != MOK_VERSION_CODE / 100)
    return mok_fail(NULL, MOK_ERROR_VERSION_MISMATCH,
                    "descriptor has struct_size %zu and version %d; this library expects %zu and "
                    "%d: initialize it with MOK_LAYER_DESC_INIT",
                    d->struct_size, d->version, sizeof(mok_layer_desc_t), MOK_VERSION_CODE);
  /* The bounds of common/limits.h: with them every size derived from the descriptor fits. */
  const struct {
    const char *name;
    int64_t v;
    int zero_ok;
  } dims[3] = {{"hidden (H)", d->hidden, 0},
               {"intermediate (I)", d->intermediate, 0},
               {"shared_intermediate (Is)", d->shared_intermediate, 1}};
  for (int i = 0; i < 3; i++)
    if (dims[i].v < (dims[i].zero_ok ? 0 : 1) || dims[i].v % 128 || dims[i].v > MOK_MAX_DIM)
      return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                      "%s = %lld: must be %sa positive multiple of 128, at most 2^20 = %lld",
                      dims[i].name, (long long)dims[i].v, dims[i].zero_ok ? "0 or " : "",
                      (long long)MOK_MAX_DIM);
  if (d->num_experts < 1 || d->num_experts % W || d->num_experts > MOK_MAX_NUM_EXPERTS)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "num_experts (E) = %lld: must be a positive multiple of the %d ranks, at most "
                    "2^16 = %lld",
                    (long long)d->num_experts, W, (long long)MOK_MAX_NUM_EXPERTS);
  if (d->top_k < 1 || d->top_k > d->num_experts || d->top_k > MOK_MAX_TOP_K)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "top_k (K) = %lld: must be in [1, min(E = %lld, %d)]",
                    (long long)d->top_k, (long long)d->num_experts, MOK_MAX_TOP_K);
  if (d->max_tokens < 1 || d->max_tokens > MOK_MAX_TOKENS)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "max_tokens (T_max) = %lld: must be in [1, 2^24]",
                    (long long)d->max_tokens);
  if ((unsigned)d->precision > MOK_PRECISION_MXFP8)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "precision = %d is not a mok_precision_t",
                    (int)d->precision);
  if ((unsigned)d->fp8_scale > MOK_FP8_SCALE_POW2)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "fp8_scale = %d is not a mok_fp8_scale_t",
                    (int)d->fp8_scale);
  if ((unsigned)d->wgrad_dtype > MOK_WGRAD_FP32)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "wgrad_dtype = %d is not a mok_wgrad_dtype_t",
                    (int)d->wgrad_dtype);
  if (d->wgrad_accumulate != 0 && d->wgrad_accumulate != 1)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "wgrad_accumulate = %d: must be 0 or 1",
                    d->wgrad_accumulate);
  if ((unsigned)d->context_mode > MOK_CONTEXT_RECOMPUTE)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "context_mode = %d is not a mok_context_mode_t",
                    (int)d->context_mode);
  if (d->comm_sms < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "comm_sms = %d: must be >= 0 (0 = automatic)",
                    d->comm_sms);
  if (!(d->capacity_factor >= 0.0 && d->capacity_factor <= (double)W))
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "capacity_factor = %g: must be 0 (automatic) or in (0, W = %d]",
                    d->capacity_factor, W);
  const int64_t rows = capacity_rows(d, W);
  if (rows > MOK_MAX_CAPACITY_ROWS)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "capacity_factor %g (0 = W = %d) x max_tokens %lld x top_k %lld = %lld routed "
                    "rows per rank: must be below 2^31 (lower max_tokens or capacity_factor)",
                    d->capacity_factor, W, (long long)d->max_tokens, (long long)d->top_k,
                    (long long)rows);
  return MOK_SUCCESS;
}

static mokResult_t invalid_layer(mok_layer_t l, const char *fn) {
  return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                  "%s: layer %p is a destroyed or invalid handle (not from mok_layer_create, or "
                  "already passed to mok_layer_destroy)",
                  fn, (void *)l);
}

mokResult_t mok_layer_valid(mok_layer_t l, const char *fn) {
  if (!l) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: layer is NULL", fn);
  if (!mok_handle_live(l, MOK_HANDLE_LAYER) || l->magic != MOK_LAYER_MAGIC)
    return invalid_layer(l, fn);
  return MOK_SUCCESS;
}

/* Checks the handle at the top of an entry point; returns its failure. */
#define LAYER_ENTRY(l, fn)                           \
  do {                                               \
    mokResult_t v_ = mok_layer_valid((l), (fn));     \
    if (v_ != MOK_SUCCESS) return v_;                \
  } while (0)

mokResult_t mok_layer_create(mok_layer_t *out, mok_comm_t comm, const mok_layer_desc_t *desc) {
  if (!out) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_layer_create: out is NULL");
  *out = NULL;
  mokResult_t r = mok_comm_valid(comm, "mok_layer_create");
  if (r != MOK_SUCCESS) return r;
  if (!desc) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_layer_create: desc is NULL");
  r = check_desc(desc, comm->nranks);
  if (r != MOK_SUCCESS) return r;
  mok_layer_t l = calloc(1, sizeof(*l));
  if (!l) return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_layer_create: calloc");
  l->comm = comm;
  l->d = *desc;
  l->EL = desc->num_experts / comm->nranks;
  l->capacity_rows = capacity_rows(desc, comm->nranks);
  l->id = atomic_fetch_add(&g_next_layer_id, 1);
  if ((r = mok_tuning_default(&l->tuning)) != MOK_SUCCESS) {
    free(l);
    return r;
  }
  if (is_gpu(l) && (r = mok_gpu_layer_create(l)) != MOK_SUCCESS) {
    free(l);
    return r;
  }
  l->magic = MOK_LAYER_MAGIC;
  if (!mok_handle_add(l, MOK_HANDLE_LAYER)) {
    if (is_gpu(l)) mok_gpu_layer_destroy(l);
    free(l);
    return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_layer_create: the set of live handles");
  }
  __atomic_fetch_add(&comm->live_layers, 1, __ATOMIC_ACQ_REL);
  *out = l;
  return MOK_SUCCESS;
}

mokResult_t mok_layer_destroy(mok_layer_t layer) {
  if (!layer) return MOK_SUCCESS; /* like free() */
  LAYER_ENTRY(layer, "mok_layer_destroy");
  /* Before anything else, so that a second destroy (or a concurrent one) is refused, never a
   * double free. */
  if (!mok_handle_take(layer, MOK_HANDLE_LAYER)) return invalid_layer(layer, "mok_layer_destroy");
  *(volatile uint64_t *)&layer->magic = 0; /* volatile: not dropped as dead before free() */
  if (is_gpu(layer)) mok_gpu_layer_destroy(layer);
  __atomic_fetch_sub(&layer->comm->live_layers, 1, __ATOMIC_ACQ_REL);
  free(layer);
  return MOK_SUCCESS;
}

mokResult_t mok_layer_check(mok_layer_t layer) {
  LAYER_ENTRY(layer, "mok_layer_check");
  /* The CPU backend reports everything synchronously. */
  return is_gpu(layer) ? mok_gpu_check(layer) : MOK_SUCCESS;
}

mokResult_t mok_layer_recover(mok_layer_t layer, mok_stream_t stream) {
  LAYER_ENTRY(layer, "mok_layer_recover");
  /* Only expert-parallel GPU layers share counters with other ranks. */
  return is_gpu(layer) ? mok_gpu_recover(layer, stream) : MOK_SUCCESS;
}

mokResult_t mok_layer_workspace_size(mok_layer_t layer, size_t *bytes) {
  LAYER_ENTRY(layer, "mok_layer_workspace_size");
  if (!bytes)
    return mok_fail(layer, MOK_ERROR_NULL_POINTER, "mok_layer_workspace_size: bytes is NULL");
  *bytes = is_gpu(layer) ? mok_gpu_workspace_bytes(layer) : 0; /* the CPU allocates per call */
  return MOK_SUCCESS;
}

/* Bytes of the context of l (no handle check). */
static size_t context_bytes(mok_layer_t l) {
  return is_gpu(l) ? mok_gpu_context_bytes(l) : mok_cpu_context_bytes(&l->d);
}

/* Bytes of the quantized-weight buffer of l (no handle check). */
static size_t quantized_bytes(mok_layer_t l) {
  mok_qw_layout_t q;
  mok_qw_layout(&l->d, l->EL, &q);
  return q.bytes;
}

mokResult_t mok_context_size(mok_layer_t layer, size_t *bytes) {
  LAYER_ENTRY(layer, "mok_context_size");
  if (!bytes) return mok_fail(layer, MOK_ERROR_NULL_POINTER, "mok_context_size: bytes is NULL");
  *bytes = context_bytes(layer);
  return MOK_SUCCESS;
}

mokResult_t mok_quantized_weights_size(mok_layer_t layer, size_t *bytes) {
  LAYER_ENTRY(layer, "mok_quantized_weights_size");
  if (!bytes)
    return mok_fail(layer, MOK_ERROR_NULL_POINTER, "mok_quantized_weights_size: bytes is NULL");
  *bytes = quantized_bytes(layer);
  return MOK_SUCCESS;
}

/* ---- argument validation ---------------------------------------------------------------------- */

/* A tensor argument: present when required, aligned, and on the layer's device. */
static mokResult_t check_tensor(mok_layer_t l, const void *p, int required, size_t align,
                                const char *name) {
  if (!p) {
    if (required) return mok_fail(l, MOK_ERROR_NULL_POINTER, "%s is NULL", name);
    return MOK_SUCCESS;
  }
  if ((uintptr_t)p % align)
    return mok_fail(l, MOK_ERROR_MISALIGNED, "%s = %p must be %zu-byte aligned", name, p, align);
  if (is_gpu(l) && !mok_cuda_ptr_on_device(p, l->comm->device))
    return mok_fail(l, MOK_ERROR_WRONG_DEVICE, "%s = %p is not device memory of GPU %d", name, p,
                    l->comm->device);
  return MOK_SUCCESS;
}

#define CHECK_TENSOR(p, req, align, name)                           \
  do {                                                              \
    mokResult_t r_ = check_tensor(l, (p), (req), (align), (name)); \
    if (r_ != MOK_SUCCESS) return r_;                               \
  } while (0)

mokResult_t mok_check_weights(mok_layer_t l, const mok_weights_t *w, int need_quantized) {
  int shared = l->d.shared_intermediate > 0;
  if (need_quantized) {
    CHECK_TENSOR(w->quantized, 1, 16, "weights.quantized (fp8 layers read the buffer filled by mok_quantize_weights)");
    const size_t need = quantized_bytes(l);
    if (w->quantized_bytes < need)
      return mok_fail(l, MOK_ERROR_INVALID_VALUE,
                      "weights.quantized_bytes = %zu: the quantized weights of this layer take "
                      "mok_quantized_weights_size = %zu bytes",
                      w->quantized_bytes, need);
    return MOK_SUCCESS;
  }
  CHECK_TENSOR(w->wg, 1, 16, "weights.wg");
  CHECK_TENSOR(w->wu, 1, 16, "weights.wu");
  CHECK_TENSOR(w->wd, 1, 16, "weights.wd");
  CHECK_TENSOR(w->wsg, shared, 16, "weights.wsg");
  CHECK_TENSOR(w->wsu, shared, 16, "weights.wsu");
  CHECK_TENSOR(w->wsd, shared, 16, "weights.wsd");
  return MOK_SUCCESS;
}

static mokResult_t check_common(mok_layer_t l, const mok_forward_args_t *a, const void *ctx,
                                size_t ctx_bytes, mok_stream_t stream) {
  if (!a) return mok_fail(l, MOK_ERROR_NULL_POINTER, "args is NULL");
  if (!is_gpu(l) && stream)
    return mok_fail(l, MOK_ERROR_INVALID_VALUE,
                    "stream must be NULL for a layer on MOK_DEVICE_CPU (it runs synchronously)");
  if (a->num_tokens < 0 || a->num_tokens > l->d.max_tokens)
    return mok_fail(l, MOK_ERROR_INVALID_SHAPE, "num_tokens = %lld: must be in [0, max_tokens = %lld]",
                    (long long)a->num_tokens, (long long)l->d.max_tokens);
  int any = a->num_tokens > 0;
  CHECK_TENSOR(a->x, any, 16, "args.x");
  CHECK_TENSOR(a->topk_idx, any, 4, "args.topk_idx");
  CHECK_TENSOR(a->topk_w, any, 4, "args.topk_w");
  CHECK_TENSOR(ctx, 1, 16, "ctx");
  const size_t need = context_bytes(l);
  if (ctx_bytes < need)
    return mok_fail(l, MOK_ERROR_INVALID_VALUE,
                    "ctx_bytes = %zu: the context of this layer takes mok_context_size = %zu bytes",
                    ctx_bytes, need);
  return mok_check_weights(l, &a->w, l->d.precision != MOK_PRECISION_BF16);
}

mokResult_t mok_check_forward_args(mok_layer_t l, const mok_forward_args_t *a, const void *y,
                                   const void *ctx, size_t ctx_bytes, mok_stream_t stream) {
  mokResult_t r = check_common(l, a, ctx, ctx_bytes, stream);
  if (r != MOK_SUCCESS) return r;
  CHECK_TENSOR(y, a->num_tokens > 0, 16, "y");
  return MOK_SUCCESS;
}

mokResult_t mok_check_backward_args(mok_layer_t l, const mok_forward_args_t *a,
                                    const mok_backward_args_t *g, const void *ctx,
                                    size_t ctx_bytes, mok_stream_t stream) {
  mokResult_t r = check_common(l, a, ctx, ctx_bytes, stream);
  if (r != MOK_SUCCESS) return r;
  if (!g) return mok_fail(l, MOK_ERROR_NULL_POINTER, "grads is NULL");
  int any = a->num_tokens > 0, shared = l->d.shared_intermediate > 0;
  const size_t walign = 16; /* bf16 and fp32 gradients alike: 16-byte vector stores */
  CHECK_TENSOR(g->dy, any, 16, "grads.dy");
  CHECK_TENSOR(g->dx, any, 16, "grads.dx");
  CHECK_TENSOR(g->dtopk_w, any, 4, "grads.dtopk_w");
  CHECK_TENSOR(g->dwg, 1, walign, "grads.dwg");
  CHECK_TENSOR(g->dwu, 1, walign, "grads.dwu");
  CHECK_TENSOR(g->dwd, 1, walign, "grads.dwd");
  CHECK_TENSOR(g->dwsg, shared, walign, "grads.dwsg");
  CHECK_TENSOR(g->dwsu, shared, walign, "grads.dwsu");
  CHECK_TENSOR(g->dwsd, shared, walign, "grads.dwsd");
  return MOK_SUCCESS;
}

/* ---- calls ------------------------------------------------------------------------------------ */

mokResult_t mok_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx,
                        size_t ctx_bytes, mok_stream_t stream) {
  LAYER_ENTRY(l, "mok_forward");
  mokResult_t r = mok_check_forward_args(l, a, y, ctx, ctx_bytes, stream);
  if (r != MOK_SUCCESS) return r;
  if (is_gpu(l)) return mok_gpu_forward(l, a, y, ctx, stream);
  return mok_cpu_forward(l, a, y, ctx);
}

mokResult_t mok_backward(mok_layer_t l, const mok_forward_args_t *a, const mok_backward_args_t *g,
                         const void *ctx, size_t ctx_bytes, mok_stream_t stream) {
  LAYER_ENTRY(l, "mok_backward");
  mokResult_t r = mok_check_backward_args(l, a, g, ctx, ctx_bytes, stream);
  if (r != MOK_SUCCESS) return r;
  if (is_gpu(l)) return mok_gpu_backward(l, a, g, ctx, stream);
  return mok_cpu_backward(l, a, g, ctx);
}

mokResult_t mok_quantize_weights(mok_layer_t l, const mok_weights_t *w, void *out,
                                 size_t out_bytes, mok_stream_t stream) {
  LAYER_ENTRY(l, "mok_quantize_weights");
  if (!w) return mok_fail(l, MOK_ERROR_NULL_POINTER, "mok_quantize_weights: weights is NULL");
  if (l->d.precision == MOK_PRECISION_BF16)
    return mok_fail(l, MOK_ERROR_INVALID_VALUE,
                    "mok_quantize_weights: the layer's precision is BF16; nothing to quantize");
  if (!is_gpu(l) && stream)
    return mok_fail(l, MOK_ERROR_INVALID_VALUE, "stream must be NULL for a layer on MOK_DEVICE_CPU");
  mokResult_t r = mok_check_weights(l, w, 0);
  if (r != MOK_SUCCESS) return r;
  r = check_tensor(l, out, 1, 16, "out");
  if (r != MOK_SUCCESS) return r;
  const size_t need = quantized_bytes(l);
  if (out_bytes < need)
    return mok_fail(l, MOK_ERROR_INVALID_VALUE,
                    "mok_quantize_weights: out_bytes = %zu: the quantized weights of this layer "
                    "take mok_quantized_weights_size = %zu bytes",
                    out_bytes, need);
  if (is_gpu(l)) {
    r = mok_quantize_weights_gpu(&l->d, l->EL, w, out, stream);
    return r == MOK_SUCCESS ? r
                            : mok_fail(l, r, "mok_quantize_weights on GPU %d: %s", l->comm->device,
                                       mok_last_error());
  }
  return mok_cpu_quantize_weights(l, w, out);
}

/* ---- the layer's tuning (src/api/internal.h) ---------------------------------------------- */

mokResult_t mok_layer_tuning(mok_layer_t layer, mok_tuning_t *out) {
  mokResult_t r = mok_layer_valid(layer, "mok_layer_tuning");
  if (r != MOK_SUCCESS) return r;
  if (!out) return mok_fail(layer, MOK_ERROR_NULL_POINTER, "mok_layer_tuning: out is NULL");
  *out = layer->tuning;
  return MOK_SUCCESS;
}

mokResult_t mok_layer_set_tuning(mok_layer_t layer, const mok_tuning_t *t) {
  mokResult_t r = mok_layer_valid(layer, "mok_layer_set_tuning");
  if (r != MOK_SUCCESS) return r;
  r = mok_tuning_check(layer, t);
  if (r != MOK_SUCCESS) return r;
  layer->tuning = *t;
  return MOK_SUCCESS;
}
