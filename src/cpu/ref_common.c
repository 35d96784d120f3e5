/*
 * ref_common.c: the parts of the reference layer that forward and backward share: checks of the
 * config and of the arguments, per-rank buffers, the layout of W simulated ranks, activation
 * quantization at the rounding points of ref.h, and the gate/up projections of one row (forward
 * computes them, backward recomputes them bit-identically when no context was saved).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/limits.h"
#include "cpu/ref_internal.h"

void mok_ref_num_init(mok_ref_num_t *n, const mok_ref_cfg_t *cfg) {
  n->exact = cfg->exact != 0;
  n->fp8 = cfg->precision != MOK_PRECISION_BF16;
  if (cfg->precision == MOK_PRECISION_MXFP8) {
    n->block = 32;
    n->kind = MOK_QUANT_E8M0_SCALE;
  } else {
    n->block = 128;
    n->kind = cfg->fp8_scale == MOK_FP8_SCALE_POW2 ? MOK_QUANT_POW2_SCALE : MOK_QUANT_FP32_SCALE;
  }
}

void mok_ref_set_error(char *err, size_t errlen, const char *fmt, ...) {
  if (!err || errlen == 0) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

mokResult_t mok_ref_oom(char *err, size_t errlen, const char *what) {
  mok_ref_set_error(err, errlen, "reference %s: out of host memory", what);
  return MOK_ERROR_OUT_OF_MEMORY;
}

mokResult_t mok_ref_check_cfg(const mok_ref_cfg_t *cfg, char *err, size_t errlen) {
  if (!cfg) {
    mok_ref_set_error(err, errlen, "reference: cfg is NULL");
    return MOK_ERROR_NULL_POINTER;
  }
  const char *why = NULL;
  if (cfg->H <= 0 || cfg->H > MOK_MAX_DIM) why = "hidden size H must be in [1, 2^20]";
  else if (cfg->I <= 0 || cfg->I > MOK_MAX_DIM) why = "intermediate size I must be in [1, 2^20]";
  else if (cfg->Is < 0 || cfg->Is > MOK_MAX_DIM)
    why = "shared intermediate size Is must be in [0, 2^20]";
  else if (cfg->W < 1) why = "number of ranks W must be >= 1";
  else if (cfg->E < 1 || cfg->E % cfg->W != 0 || cfg->E > MOK_MAX_NUM_EXPERTS)
    why = "E must be a positive multiple of W, at most 2^16";
  else if (cfg->K < 1 || cfg->K > cfg->E) why = "top-k K must be in [1, E]";
  else if (cfg->tile_m < 1) why = "tile_m must be >= 1";
  else if (cfg->precision != MOK_PRECISION_BF16 && cfg->precision != MOK_PRECISION_FP8_BLOCK &&
           cfg->precision != MOK_PRECISION_MXFP8)
    why = "unknown precision";
  else if (cfg->fp8_scale != MOK_FP8_SCALE_FP32 && cfg->fp8_scale != MOK_FP8_SCALE_POW2)
    why = "unknown fp8 scale kind";
  else if (cfg->exact && cfg->precision != MOK_PRECISION_BF16)
    why = "exact (fp64) mode needs precision BF16";
  if (why) {
    mok_ref_set_error(err, errlen,
                      "reference: %s (H=%lld I=%lld Is=%lld E=%lld K=%lld W=%d tile_m=%lld "
                      "precision=%d exact=%d)",
                      why, (long long)cfg->H, (long long)cfg->I, (long long)cfg->Is,
                      (long long)cfg->E, (long long)cfg->K, cfg->W, (long long)cfg->tile_m,
                      (int)cfg->precision, cfg->exact);
    return MOK_ERROR_INVALID_VALUE;
  }
  return MOK_SUCCESS;
}

/* Records the first missing pointer: returns 1 (and the detail) when p is NULL. */
static int missing(const void *p, const char *what, int r, char *err, size_t errlen) {
  if (p) return 0;
  mok_ref_set_error(err, errlen, "reference: %s of rank %d is NULL", what, r);
  return 1;
}

mokResult_t mok_ref_check_args(const mok_ref_cfg_t *cfg, const mok_ref_weights_t *w,
                               const mok_ref_in_t *in, const mok_ref_out_t *out,
                               const mok_ref_saved_t *saved, int backward, char *err,
                               size_t errlen) {
  mokResult_t res = mok_ref_check_cfg(cfg, err, errlen);
  if (res != MOK_SUCCESS) return res;
  if (!w || !in || !out) {
    mok_ref_set_error(err, errlen, "reference: %s is NULL", !w ? "w" : !in ? "in" : "out");
    return MOK_ERROR_NULL_POINTER;
  }
  const int shared = cfg->Is > 0;
  for (int r = 0; r < cfg->W; r++) {
    if (in[r].T < 0) {
      mok_ref_set_error(err, errlen, "reference: token count %lld of rank %d is negative",
                        (long long)in[r].T, r);
      return MOK_ERROR_INVALID_VALUE;
    }
    const int tok = in[r].T > 0;
    /* Per-expert routed weights (ref.h) replace the routed arrays and weight gradients. */
    const mok_ref_experts_t *ex = w[r].experts;
    if (ex && (!ex->load || (backward && !ex->store))) {
      mok_ref_set_error(err, errlen, "reference: w.experts of rank %d lacks its %s function", r,
                        !ex->load ? "load" : "store");
      return MOK_ERROR_NULL_POINTER;
    }
    int bad = (!ex && (missing(w[r].wg, "w.wg", r, err, errlen) ||
                       missing(w[r].wu, "w.wu", r, err, errlen) ||
                       missing(w[r].wd, "w.wd", r, err, errlen))) ||
              (shared && (missing(w[r].wsg, "w.wsg", r, err, errlen) ||
                          missing(w[r].wsu, "w.wsu", r, err, errlen) ||
                          missing(w[r].wsd, "w.wsd", r, err, errlen))) ||
              (tok && (missing(in[r].x, "in.x", r, err, errlen) ||
                       missing(in[r].topk_idx, "in.topk_idx", r, err, errlen) ||
                       missing(in[r].topk_w, "in.topk_w", r, err, errlen))) ||
              (saved && tok &&
               (missing(saved[r].g, "saved.g", r, err, errlen) ||
                missing(saved[r].u, "saved.u", r, err, errlen) ||
                (shared && (missing(saved[r].gs, "saved.gs", r, err, errlen) ||
                            missing(saved[r].us, "saved.us", r, err, errlen)))));
    if (!backward) {
      bad = bad || (tok && missing(out[r].y, "out.y", r, err, errlen));
    } else {
      bad = bad ||
            (!ex && (missing(w[r].wg_b, "w.wg_b", r, err, errlen) ||
                     missing(w[r].wu_b, "w.wu_b", r, err, errlen) ||
                     missing(w[r].wd_b, "w.wd_b", r, err, errlen) ||
                     missing(out[r].dwg, "out.dwg", r, err, errlen) ||
                     missing(out[r].dwu, "out.dwu", r, err, errlen) ||
                     missing(out[r].dwd, "out.dwd", r, err, errlen))) ||
            (shared && (missing(w[r].wsg_b, "w.wsg_b", r, err, errlen) ||
                        missing(w[r].wsu_b, "w.wsu_b", r, err, errlen) ||
                        missing(w[r].wsd_b, "w.wsd_b", r, err, errlen) ||
                        missing(out[r].dwsg, "out.dwsg", r, err, errlen) ||
                        missing(out[r].dwsu, "out.dwsu", r, err, errlen) ||
                        missing(out[r].dwsd, "out.dwsd", r, err, errlen))) ||
            (tok && (missing(in[r].dy, "in.dy", r, err, errlen) ||
                     missing(out[r].dx, "out.dx", r, err, errlen) ||
                     missing(out[r].dtopk_w, "out.dtopk_w", r, err, errlen)));
    }
    if (bad) return MOK_ERROR_NULL_POINTER;
  }
  return MOK_SUCCESS;
}

double *mok_ref_alloc(int64_t n) {
  if (n < 0 || (uint64_t)n > SIZE_MAX / sizeof(double) - 1) return NULL;
  return calloc((size_t)n + 1, sizeof(double));
}

mokResult_t mok_ref_layout(const mok_ref_cfg_t *cfg, const mok_ref_in_t *in, mok_layout_t *l,
                           char *err, size_t errlen) {
  mokResult_t res = MOK_SUCCESS;
  int64_t *T = calloc((size_t)cfg->W, sizeof(*T));                  /* [W] */
  const int32_t **idx = calloc((size_t)cfg->W, sizeof(*idx));       /* [W] -> [T_r, K] */
  if (!T || !idx) {
    res = mok_ref_oom(err, errlen, "layout");
    goto done;
  }
  for (int r = 0; r < cfg->W; r++) {
    T[r] = in[r].T;
    idx[r] = in[r].topk_idx;
  }
  res = mok_layout_build(l, cfg->W, cfg->E, cfg->K, cfg->tile_m, T, idx, err, errlen);
done:
  free(T);
  free(idx);
  return res;
}

void mok_ref_qdq_row(const mok_ref_num_t *n, double *v, int64_t len) {
  if (n->fp8 && len > 0) mok_qdq_matrix(v, 1, len, 1, n->block, n->kind);
}

void mok_ref_free_ranks(double **p, int W) {
  if (!p) return;
  for (int r = 0; r < W; r++) free(p[r]);
  free(p);
}

mokResult_t mok_ref_alloc_slots(const mok_ref_cfg_t *cfg, const mok_ref_in_t *in, int64_t width,
                                double ***buf) {
  double **b = calloc((size_t)cfg->W, sizeof(*b));
  if (!b) return MOK_ERROR_OUT_OF_MEMORY;
  for (int r = 0; r < cfg->W; r++) {
    b[r] = mok_ref_alloc(in[r].T * cfg->K * width); /* [T_r * K, width] */
    if (!b[r]) {
      mok_ref_free_ranks(b, cfg->W);
      return MOK_ERROR_OUT_OF_MEMORY;
    }
  }
  *buf = b;
  return MOK_SUCCESS;
}

mokResult_t mok_ref_quantize_rows(const mok_ref_cfg_t *cfg, const mok_ref_num_t *n,
                                  const mok_ref_in_t *in, int dy, double ***q) {
  double **b = calloc((size_t)cfg->W, sizeof(*b));
  if (!b) return MOK_ERROR_OUT_OF_MEMORY;
  for (int r = 0; r < cfg->W; r++) {
    const int64_t T = in[r].T, H = cfg->H;
    b[r] = mok_ref_alloc(T * H); /* [T_r, H] */
    if (!b[r]) {
      mok_ref_free_ranks(b, cfg->W);
      return MOK_ERROR_OUT_OF_MEMORY;
    }
    if (T == 0) continue;
    memcpy(b[r], dy ? in[r].dy : in[r].x, (size_t)(T * H) * sizeof(double));
    for (int64_t t = 0; t < T; t++) mok_ref_qdq_row(n, b[r] + t * H, H);
  }
  *q = b;
  return MOK_SUCCESS;
}

void mok_ref_expert_weights(const mok_ref_cfg_t *cfg, const mok_ref_weights_t *w, int r,
                            int64_t le, int backward, mok_ref_expert_t *e) {
  memset(e, 0, sizeof(*e));
  const mok_ref_weights_t *wr = &w[r];
  if (wr->experts) {
    wr->experts->load(wr->experts->user, r, le, backward, e);
    return;
  }
  const int64_t n = cfg->I * cfg->H; /* elements of one expert's matrix */
  e->wg = wr->wg + le * n, e->wu = wr->wu + le * n, e->wd = wr->wd + le * n;
  if (backward) {
    e->wg_b = wr->wg_b + le * n, e->wu_b = wr->wu_b + le * n, e->wd_b = wr->wd_b + le * n;
  }
}

void mok_ref_gate_up(const mok_ref_num_t *n, const double *x, const double *wg, const double *wu,
                     int64_t rows, int64_t H, double *g, double *u) {
  for (int64_t i = 0; i < rows; i++) {
    g[i] = mok_ref_dot(n, 0.0, x, wg + i * H, 1, H);
    u[i] = mok_ref_dot(n, 0.0, x, wu + i * H, 1, H);
  }
}
