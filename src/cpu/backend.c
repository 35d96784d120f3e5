/*
 * cpu/backend.c: the public calls on a MOK_DEVICE_CPU layer, run by the plain-C reference
 * (src/cpu/ref.h) with W = 1. Converts the caller's bf16/fp32 tensors to the reference's doubles
 * and back, reads fp8 weights from the quantized buffer (so the buffer's contents, not the bf16
 * weights, decide the result, as on the GPU), and writes and checks the saved context.
 * The routed weights are converted one expert at a time, when the reference reaches an expert
 * with rows (mok_ref_experts_t), and their gradients written back one expert at a time, so a
 * call holds one expert's doubles, not all of them: its memory stays near the size of its
 * token-sized inputs plus a few experts' (E = 128, H = 4096, I = 1536 took 19 GB before).
 * Outputs are written only once nothing can fail any more (the reference checks routing and
 * allocates before its first expert): a failed call leaves them intact.
 */
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
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
  size_t bytes;
  double *d = mok_bytes_ok(n > 0 ? n : 1, sizeof(double), &bytes) ? malloc(bytes) : NULL;
  if (!d) return NULL;
  for (int64_t i = 0; i < n; i++) d[i] = mok_bf16_to_float(((const uint16_t *)src)[i]);
  return d;
}

static void doubles_to_bf16(const double *src, void *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = mok_bf16_from_float((float)src[i]);
}

/* Everything one call allocates, freed in one place. */
enum { ARENA_MAX = 32 };
typedef struct {
  void *buf[ARENA_MAX];
  int n;
} arena_t;

/* Keeps p (NULL stays NULL). More than ARENA_MAX buffers is a bug of this file: p is freed and
 * NULL returned, which the caller reports as out of memory. */
static void *arena_take(arena_t *a, void *p) {
  if (p && a->n == ARENA_MAX) {
    free(p);
    return NULL;
  }
  if (p) a->buf[a->n++] = p;
  return p;
}

/* n zeroed doubles; NULL when n * 8 bytes do not fit or cannot be allocated. */
static double *arena_zeros(arena_t *a, int64_t n) {
  size_t bytes;
  if (!mok_bytes_ok(n > 0 ? n : 1, sizeof(double), &bytes)) return NULL;
  return arena_take(a, calloc(1, bytes));
}

static void arena_free(arena_t *a) {
  for (int i = 0; i < a->n; i++) free(a->buf[i]);
  a->n = 0;
}

/* Dequantizes expert e of operand o into dst [R, C] doubles in the GEMM's orientation (a
 * transposed copy is transposed back); m: [R, C] floats of scratch. */
static void dequant_expert(const mok_qw_operand_t *o, const uint8_t *buf, int64_t e, float *m,
                           double *dst) {
  const int64_t rows = o->rows, cols = o->cols;
  mok_dequantize_host(buf + o->data + (size_t)(e * rows * cols), buf + o->scales + (size_t)e * o->scale_stride,
                      rows, cols, o->br, o->bc, o->kind, m);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) {
      if (o->transposed) dst[c * rows + r] = m[r * cols + c];
      else dst[r * cols + c] = m[r * cols + c];
    }
}

/* The routed weights one expert at a time (ref.h, mok_ref_experts_t) and, in backward, their
 * gradients written to the caller's arrays one expert at a time. */
typedef struct {
  const mok_layer_desc_t *d;
  const mok_weights_t *w;        /* the caller's */
  mok_qw_layout_t q;             /* fp8: where each operand lives in w->quantized */
  double *buf[6];                /* [I * H] each: wg, wu, wd, and (fp8 backward) wg_b, wu_b, wd_b */
  float *m;                      /* [I * H] fp8 dequantization scratch */
  const mok_backward_args_t *g;  /* backward: the caller's weight gradients */
} experts_io_t;

static void experts_load(void *user, int rank, int64_t le, int backward, mok_ref_expert_t *e) {
  experts_io_t *io = user;
  const int64_t n = io->d->intermediate * io->d->hidden; /* one expert's matrix */
  (void)rank;                                           /* W = 1 */
  if (io->d->precision == MOK_PRECISION_BF16) { /* one copy serves forward and backward */
    const uint16_t *src[3] = {io->w->wg, io->w->wu, io->w->wd};
    for (int i = 0; i < 3; i++)
      for (int64_t k = 0; k < n; k++) io->buf[i][k] = mok_bf16_to_float(src[i][le * n + k]);
    e->wg = e->wg_b = io->buf[0];
    e->wu = e->wu_b = io->buf[1];
    e->wd = e->wd_b = io->buf[2];
    return;
  }
  static const mok_qw_which_t ops[6] = {MOK_QW_WG,   MOK_QW_WU,   MOK_QW_WD,
                                        MOK_QW_WG_T, MOK_QW_WU_T, MOK_QW_WD_T};
  for (int i = 0; i < (backward ? 6 : 3); i++)
    dequant_expert(&io->q.op[ops[i]], io->w->quantized, le, io->m, io->buf[i]);
  e->wg = io->buf[0], e->wu = io->buf[1], e->wd = io->buf[2];
  if (backward) e->wg_b = io->buf[3], e->wu_b = io->buf[4], e->wd_b = io->buf[5];
}

static void write_wgrad(const mok_layer_desc_t *d, const double *g, void *dst, int64_t off,
                        int64_t n);

static void experts_store(void *user, int rank, int64_t le, const double *dwg, const double *dwu,
                          const double *dwd) {
  experts_io_t *io = user;
  const int64_t n = io->d->intermediate * io->d->hidden;
  (void)rank;
  write_wgrad(io->d, dwg, io->g->dwg, le * n, n);
  write_wgrad(io->d, dwu, io->g->dwu, le * n, n);
  write_wgrad(io->d, dwd, io->g->dwd, le * n, n);
}

/* The reference's view of the weights: the routed ones through io (its buffers in the arena),
 * the shared expert's converted whole (it is one expert). */
static mokResult_t effective_weights(mok_layer_t l, const mok_weights_t *w, int backward,
                                     arena_t *ar, experts_io_t *io, mok_ref_experts_t *ex,
                                     mok_ref_weights_t *rw) {
  const mok_layer_desc_t *d = &l->d;
  const int64_t H = d->hidden, I = d->intermediate, Is = d->shared_intermediate;
  const int fp8 = d->precision != MOK_PRECISION_BF16;
  memset(rw, 0, sizeof(*rw));
  memset(io, 0, sizeof(*io));
  io->d = d, io->w = w;
  for (int i = 0; i < (fp8 && backward ? 6 : 3); i++)
    if (!(io->buf[i] = arena_zeros(ar, I * H))) goto oom;
  *ex = (mok_ref_experts_t){experts_load, experts_store, io};
  rw->experts = ex;
  if (!fp8) {
    if (Is > 0) {
      rw->wsg = rw->wsg_b = arena_take(ar, bf16_to_doubles(w->wsg, Is * H));
      rw->wsu = rw->wsu_b = arena_take(ar, bf16_to_doubles(w->wsu, Is * H));
      rw->wsd = rw->wsd_b = arena_take(ar, bf16_to_doubles(w->wsd, H * Is));
      if (!rw->wsg || !rw->wsu || !rw->wsd) goto oom;
    }
    return MOK_SUCCESS;
  }
  mok_qw_layout(d, l->EL, &io->q);
  const int64_t mn = (I > Is ? I : Is) * H; /* the largest matrix dequantized at once */
  size_t mbytes;
  io->m = mok_bytes_ok(mn, sizeof(float), &mbytes) ? arena_take(ar, malloc(mbytes)) : NULL;
  if (!io->m) goto oom;
  const double **dst[6] = {&rw->wsg, &rw->wsu, &rw->wsd, &rw->wsg_b, &rw->wsu_b, &rw->wsd_b};
  for (int i = 0; i < 6; i++) {
    const mok_qw_operand_t *o = &io->q.op[MOK_QW_WSG + i];
    if (o->count == 0) continue;
    double *p = arena_zeros(ar, o->rows * o->cols);
    if (!p) goto oom;
    dequant_expert(o, w->quantized, 0, io->m, p);
    *dst[i] = p;
  }
  return MOK_SUCCESS;
oom:
  return mok_fail(l, MOK_ERROR_OUT_OF_MEMORY,
                  "CPU backend: allocating one expert's weights as doubles (%lld x %lld)",
                  (long long)I, (long long)H);
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

/* Converts the forward inputs; fills in and the weights (backward: their backward copies too). */
static mokResult_t prepare(mok_layer_t l, const mok_forward_args_t *a, int backward, arena_t *ar,
                           mok_ref_in_t *in, experts_io_t *io, mok_ref_experts_t *ex,
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
  return effective_weights(l, &a->w, backward, ar, io, ex, rw);
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
  experts_io_t io;
  mok_ref_experts_t ex;
  mokResult_t r = prepare(l, a, 0, &ar, &in, &io, &ex, &rw);
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

/* Writes g [n] to elements [off, off + n) of a weight gradient in the layer's dtype, overwriting
 * or accumulating: fp32: dst = fp32(g) or fp32(dst + g); bf16: dst = bf16(g) or
 * bf16(fp32(dst) + g), g fp32. */
static void write_wgrad(const mok_layer_desc_t *d, const double *g, void *dst, int64_t off,
                        int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (d->wgrad_dtype == MOK_WGRAD_FP32) {
      float *o = (float *)dst + off + i;
      *o = d->wgrad_accumulate ? *o + (float)g[i] : (float)g[i];
    } else {
      uint16_t *o = (uint16_t *)dst + off + i;
      float v = d->wgrad_accumulate ? mok_bf16_to_float(*o) + (float)g[i] : (float)g[i];
      *o = mok_bf16_from_float(v);
    }
  }
}

mokResult_t mok_cpu_backward(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *g, const void *ctx) {
  const mok_layer_desc_t *d = &l->d;
  const int64_t T = a->num_tokens, H = d->hidden, I = d->intermediate, K = d->top_k,
                Is = d->shared_intermediate;
  const int save = d->context_mode == MOK_CONTEXT_SAVE;
  arena_t ar = {{0}, 0};
  mok_ref_in_t in;
  mok_ref_weights_t rw;
  experts_io_t io;
  mok_ref_experts_t ex;
  mokResult_t r = check_ctx(l, a, ctx);
  if (r != MOK_SUCCESS) return r;
  r = prepare(l, a, 1, &ar, &in, &io, &ex, &rw);
  if (r != MOK_SUCCESS) goto done;
  io.g = g; /* the routed weight gradients go straight to the caller's, expert by expert */
  in.dy = arena_take(&ar, T > 0 ? bf16_to_doubles(g->dy, T * H) : calloc(1, sizeof(double)));
  mok_ref_out_t out = {0};
  out.dx = arena_zeros(&ar, T * H);
  out.dtopk_w = arena_zeros(&ar, T * K);
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
  if (!in.dy || !out.dx || !out.dtopk_w || !out.dwsg || !out.dwsu || !out.dwsd ||
      (save && (!sv.g || !sv.u || !sv.gs || !sv.us))) {
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
  if (Is > 0) {
    write_wgrad(d, out.dwsg, g->dwsg, 0, Is * H);
    write_wgrad(d, out.dwsu, g->dwsu, 0, Is * H);
    write_wgrad(d, out.dwsd, g->dwsd, 0, H * Is);
  }
done:
  arena_free(&ar);
  return r;
}
