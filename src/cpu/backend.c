/*
 * cpu/backend.c: the public calls on a MOK_DEVICE_CPU layer, run by the plain-C reference
 * (src/cpu/ref.h) with W = 1. Converts the caller's bf16/fp32 tensors to the reference's doubles
 * and back, reads fp8 weights from the quantized buffer (so the buffer's contents, not the bf16
 * weights, decide the result, as on the GPU), and writes and checks the saved context.
 * Outputs are written only after the whole computation succeeded: a failed call leaves them intact.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu/quant.h"
#include "cpu/ref.h"
#include "api/api.h"

enum { CPU_TILE_M = 128 }; /* layout padding of the reference; results do not depend on it */

size_t mok_cpu_context_bytes(const mok_layer_desc_t *d) {
  size_t bytes = sizeof(mok_ctx_header_t);
  if (d->context_mode == MOK_CONTEXT_SAVE)
    bytes += 2 * sizeof(uint16_t) *
             (size_t)(d->max_tokens * d->top_k * d->intermediate +
                      d->max_tokens * d->shared_intermediate);
  return bytes;
}

uint64_t mok_routing_hash(const int32_t *idx, int64_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a, 64-bit */
  for (int64_t i = 0; i < n; i++) {
    h ^= (uint32_t)idx[i];
    h *= 1099511628211ull;
  }
  return h;
}

static double *bf16_to_doubles(const void *src, int64_t n) {
  double *d = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  if (!d) return NULL;
  for (int64_t i = 0; i < n; i++) d[i] = mok_bf16_to_float(((const uint16_t *)src)[i]);
  return d;
}

static void doubles_to_bf16(const double *src, void *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = mok_bf16_from_float((float)src[i]);
}

/* Everything one call allocates, freed in one place. */
typedef struct {
  double *buf[32];
  int n;
} arena_t;

static double *arena_take(arena_t *a, double *p) {
  if (p && a->n < 32) a->buf[a->n++] = p;
  return p;
}

static double *arena_zeros(arena_t *a, int64_t n) {
  return arena_take(a, calloc((size_t)(n > 0 ? n : 1), sizeof(double)));
}

static void arena_free(arena_t *a) {
  for (int i = 0; i < a->n; i++) free(a->buf[i]);
  a->n = 0;
}

/* Dequantizes operand o into [count, R, C] doubles in the GEMM's orientation (a transposed copy
 * is transposed back). */
static double *dequant_operand(arena_t *ar, const mok_qw_operand_t *o, const uint8_t *buf) {
  const int64_t rows = o->rows, cols = o->cols, n = o->count * rows * cols;
  double *out = arena_zeros(ar, n);
  float *m = malloc(sizeof(float) * (size_t)(rows * cols > 0 ? rows * cols : 1));
  if (!out || !m) {
    free(m);
    return NULL;
  }
  for (int64_t e = 0; e < o->count; e++) {
    mok_dequantize_host(buf + o->data + (size_t)(e * rows * cols), buf + o->scales + (size_t)e * o->scale_stride,
                        rows, cols, o->br, o->bc, o->kind, m);
    double *dst = out + e * rows * cols;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < cols; c++) {
        if (o->transposed) dst[c * rows + r] = m[r * cols + c];
        else dst[r * cols + c] = m[r * cols + c];
      }
  }
  free(m);
  return out;
}

static mokResult_t effective_weights(mok_layer_t l, const mok_weights_t *w, arena_t *ar,
                                     mok_ref_weights_t *rw) {
  const mok_layer_desc_t *d = &l->d;
  const int64_t H = d->hidden, I = d->intermediate, Is = d->shared_intermediate, EL = l->EL;
  memset(rw, 0, sizeof(*rw));
  if (d->precision == MOK_PRECISION_BF16) {
    rw->wg = rw->wg_b = arena_take(ar, bf16_to_doubles(w->wg, EL * I * H));
    rw->wu = rw->wu_b = arena_take(ar, bf16_to_doubles(w->wu, EL * I * H));
    rw->wd = rw->wd_b = arena_take(ar, bf16_to_doubles(w->wd, EL * H * I));
    if (!rw->wg || !rw->wu || !rw->wd) goto oom;
    if (Is > 0) {
      rw->wsg = rw->wsg_b = arena_take(ar, bf16_to_doubles(w->wsg, Is * H));
      rw->wsu = rw->wsu_b = arena_take(ar, bf16_to_doubles(w->wsu, Is * H));
      rw->wsd = rw->wsd_b = arena_take(ar, bf16_to_doubles(w->wsd, H * Is));
      if (!rw->wsg || !rw->wsu || !rw->wsd) goto oom;
    }
    return MOK_SUCCESS;
  }
  mok_qw_layout_t q;
  mok_qw_layout(d, EL, &q);
  const uint8_t *buf = w->quantized;
  const double **dst[MOK_QW_COUNT] = {&rw->wg,   &rw->wu,   &rw->wd,   &rw->wg_b,  &rw->wu_b,  &rw->wd_b,
                                      &rw->wsg,  &rw->wsu,  &rw->wsd,  &rw->wsg_b, &rw->wsu_b, &rw->wsd_b};
  for (int i = 0; i < MOK_QW_COUNT; i++) {
    if (q.op[i].count == 0) continue;
    if (!(*dst[i] = dequant_operand(ar, &q.op[i], buf))) goto oom;
  }
  return MOK_SUCCESS;
oom:
  return mok_fail(l, MOK_ERROR_OUT_OF_MEMORY, "CPU backend: allocating weights");
}

static mok_ref_cfg_t ref_cfg(mok_layer_t l) {
  const mok_layer_desc_t *d = &l->d;
  mok_ref_cfg_t c = {d->hidden, d->intermediate, d->num_experts, d->top_k, d->shared_intermediate,
                     1, d->precision, d->fp8_scale, 0, CPU_TILE_M};
  return c;
}

static mokResult_t check_capacity(mok_layer_t l, const mok_forward_args_t *a) {
  int64_t rows = 0, n = a->num_tokens * l->d.top_k;
  for (int64_t i = 0; i < n; i++) rows += a->topk_idx[i] >= 0;
  if (rows > l->capacity_rows)
    return mok_fail(l, MOK_ERROR_CAPACITY_OVERFLOW,
                    "%lld routed rows arrive at rank 0, capacity is %lld (capacity_factor %g x "
                    "T_max %lld x K %lld); raise capacity_factor or use 0 (automatic)",
                    (long long)rows, (long long)l->capacity_rows, l->d.capacity_factor,
                    (long long)l->d.max_tokens, (long long)l->d.top_k);
  return MOK_SUCCESS;
}

/* Converts the forward inputs; fills in and the weights. */
static mokResult_t prepare(mok_layer_t l, const mok_forward_args_t *a, arena_t *ar, mok_ref_in_t *in,
                           mok_ref_weights_t *rw) {
  const int64_t T = a->num_tokens, H = l->d.hidden, K = l->d.top_k;
  mokResult_t r = check_capacity(l, a);
  if (r != MOK_SUCCESS) return r;
  memset(in, 0, sizeof(*in));
  in->T = T;
  in->topk_idx = a->topk_idx;
  double *x = arena_take(ar, T > 0 ? bf16_to_doubles(a->x, T * H) : calloc(1, sizeof(double)));
  double *tw = arena_zeros(ar, T * K);
  if (!x || !tw) return mok_fail(l, MOK_ERROR_OUT_OF_MEMORY, "CPU backend: allocating inputs");
  for (int64_t i = 0; i < T * K; i++) tw[i] = a->topk_w[i];
  in->x = x;
  in->topk_w = tw;
  return effective_weights(l, &a->w, ar, rw);
}

/* Saved g, u in the context, after the header: [T_max * K, I] g, u then [T_max, Is] gs, us. */
static uint16_t *ctx_part(const mok_layer_desc_t *d, const void *ctx, int part) {
  const size_t gu = (size_t)(d->max_tokens * d->top_k * d->intermediate);
  const size_t s = (size_t)(d->max_tokens * d->shared_intermediate);
  const size_t off[4] = {0, gu, 2 * gu, 2 * gu + s};
  return (uint16_t *)((char *)ctx + sizeof(mok_ctx_header_t)) + off[part];
}

mokResult_t mok_cpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx) {
  const mok_layer_desc_t *d = &l->d;
  const int64_t T = a->num_tokens, H = d->hidden, I = d->intermediate, K = d->top_k,
                Is = d->shared_intermediate;
  const int save = d->context_mode == MOK_CONTEXT_SAVE;
  arena_t ar = {{0}, 0};
  mok_ref_in_t in;
  mok_ref_weights_t rw;
  mokResult_t r = prepare(l, a, &ar, &in, &rw);
  if (r != MOK_SUCCESS) goto done;
  mok_ref_out_t out = {0};
  mok_ref_saved_t sv = {0};
  out.y = arena_zeros(&ar, T * H);
  if (save) {
    sv.g = arena_zeros(&ar, T * K * I);
    sv.u = arena_zeros(&ar, T * K * I);
    sv.gs = arena_zeros(&ar, T * Is);
    sv.us = arena_zeros(&ar, T * Is);
  }
  if (!out.y || (save && (!sv.g || !sv.u || !sv.gs || !sv.us))) {
    r = mok_fail(l, MOK_ERROR_OUT_OF_MEMORY, "CPU backend: allocating outputs");
    goto done;
  }
  mok_ref_cfg_t cfg = ref_cfg(l);
  char err[MOK_ERR_LEN] = "";
  r = mok_ref_forward(&cfg, &rw, &in, &out, save ? &sv : NULL, err, sizeof(err));
  if (r != MOK_SUCCESS) {
    r = mok_fail_msg(l, r, err);
    goto done;
  }
  doubles_to_bf16(out.y, y, T * H);
  mok_ctx_header_t hdr = {MOK_CTX_MAGIC, l->id, T, mok_routing_hash(a->topk_idx, T * K),
                          d->context_mode, {0, 0, 0}};
  memcpy(ctx, &hdr, sizeof(hdr));
  if (save) {
    doubles_to_bf16(sv.g, ctx_part(d, ctx, 0), T * K * I);
    doubles_to_bf16(sv.u, ctx_part(d, ctx, 1), T * K * I);
    doubles_to_bf16(sv.gs, ctx_part(d, ctx, 2), T * Is);
    doubles_to_bf16(sv.us, ctx_part(d, ctx, 3), T * Is);
  }
done:
  arena_free(&ar);
  return r;
}

static mokResult_t check_ctx(mok_layer_t l, const mok_forward_args_t *a, const void *ctx) {
  mok_ctx_header_t h;
  memcpy(&h, ctx, sizeof(h));
  if (h.magic != MOK_CTX_MAGIC || h.layer_id != l->id)
    return mok_fail(l, MOK_ERROR_CONTEXT_MISMATCH,
                    "ctx was not written by a forward of this layer");
  if (h.num_tokens != a->num_tokens ||
      h.routing_hash != mok_routing_hash(a->topk_idx, a->num_tokens * l->d.top_k))
    return mok_fail(l, MOK_ERROR_CONTEXT_MISMATCH,
                    "ctx was written by a forward of %lld tokens with other routing; backward got "
                    "%lld tokens: pass the same args as the forward that wrote ctx",
                    (long long)h.num_tokens, (long long)a->num_tokens);
  return MOK_SUCCESS;
}

/* Writes a weight gradient in the layer's dtype, overwriting or accumulating:
 * fp32: dst = fp32(g) or fp32(dst + g); bf16: dst = bf16(g) or bf16(fp32(dst) + g), g fp32. */
static void write_wgrad(const mok_layer_desc_t *d, const double *g, void *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (d->wgrad_dtype == MOK_WGRAD_FP32) {
      float *o = (float *)dst + i;
      *o = d->wgrad_accumulate ? *o + (float)g[i] : (float)g[i];
    } else {
      uint16_t *o = (uint16_t *)dst + i;
      float v = d->wgrad_accumulate ? mok_bf16_to_float(*o) + (float)g[i] : (float)g[i];
      *o = mok_bf16_from_float(v);
    }
  }
}

mokResult_t mok_cpu_backward(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *g, const void *ctx) {
  const mok_layer_desc_t *d = &l->d;
  const int64_t T = a->num_tokens, H = d->hidden, I = d->intermediate, K = d->top_k,
                Is = d->shared_intermediate, EL = l->EL;
  const int save = d->context_mode == MOK_CONTEXT_SAVE;
  arena_t ar = {{0}, 0};
  mok_ref_in_t in;
  mok_ref_weights_t rw;
  mokResult_t r = check_ctx(l, a, ctx);
  if (r != MOK_SUCCESS) return r;
  r = prepare(l, a, &ar, &in, &rw);
  if (r != MOK_SUCCESS) goto done;
  in.dy = arena_take(&ar, T > 0 ? bf16_to_doubles(g->dy, T * H) : calloc(1, sizeof(double)));
  mok_ref_out_t out = {0};
  out.dx = arena_zeros(&ar, T * H);
  out.dtopk_w = arena_zeros(&ar, T * K);
  out.dwg = arena_zeros(&ar, EL * I * H);
  out.dwu = arena_zeros(&ar, EL * I * H);
  out.dwd = arena_zeros(&ar, EL * H * I);
  out.dwsg = arena_zeros(&ar, Is * H);
  out.dwsu = arena_zeros(&ar, Is * H);
  out.dwsd = arena_zeros(&ar, H * Is);
  mok_ref_saved_t sv = {0};
  if (save) {
    sv.g = arena_take(&ar, bf16_to_doubles(ctx_part(d, ctx, 0), T * K * I));
    sv.u = arena_take(&ar, bf16_to_doubles(ctx_part(d, ctx, 1), T * K * I));
    sv.gs = arena_take(&ar, bf16_to_doubles(ctx_part(d, ctx, 2), T * Is));
    sv.us = arena_take(&ar, bf16_to_doubles(ctx_part(d, ctx, 3), T * Is));
  }
  if (!in.dy || !out.dx || !out.dtopk_w || !out.dwg || !out.dwu || !out.dwd || !out.dwsg ||
      !out.dwsu || !out.dwsd || (save && (!sv.g || !sv.u || !sv.gs || !sv.us))) {
    r = mok_fail(l, MOK_ERROR_OUT_OF_MEMORY, "CPU backend: allocating gradients");
    goto done;
  }
  mok_ref_cfg_t cfg = ref_cfg(l);
  char err[MOK_ERR_LEN] = "";
  r = mok_ref_backward(&cfg, &rw, &in, &out, save ? &sv : NULL, err, sizeof(err));
  if (r != MOK_SUCCESS) {
    r = mok_fail_msg(l, r, err);
    goto done;
  }
  doubles_to_bf16(out.dx, g->dx, T * H);
  for (int64_t i = 0; i < T * K; i++) g->dtopk_w[i] = (float)out.dtopk_w[i];
  write_wgrad(d, out.dwg, g->dwg, EL * I * H);
  write_wgrad(d, out.dwu, g->dwu, EL * I * H);
  write_wgrad(d, out.dwd, g->dwd, EL * H * I);
  if (Is > 0) {
    write_wgrad(d, out.dwsg, g->dwsg, Is * H);
    write_wgrad(d, out.dwsu, g->dwsu, Is * H);
    write_wgrad(d, out.dwsd, g->dwsd, H * Is);
  }
done:
  arena_free(&ar);
  return r;
}
