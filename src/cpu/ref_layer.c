/*
 * ref_layer.c: the reference layer's forward pass over W simulated expert-parallel ranks
 * (docs/design.md, "The layer"; ref.h), and the effective (quantize-dequantized) weights its GEMMs
 * read.
 *
 * Forward moves rows as the GPU does: every (token, slot) row goes to its expert's rank, which
 * computes the expert's rows in layout order (source rank, token, slot); each bf16 expert output
 * yk lands in a buffer of its home rank indexed by (token, slot); the home rank then adds the
 * shared expert and the yk in slot order. A row's arithmetic depends only on the row, never on the
 * rank that holds it, which is what makes the results EP-invariant.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu/ref_internal.h"

/* Scratch of one routed or shared row. */
typedef struct {
  double *g, *u; /* [max(I, Is)] gate and up accumulations, fp32, not rounded */
  double *a;     /* [max(I, Is)] bf16 activation, then quantize-dequantized for the down GEMM */
  double *ys;    /* [H] shared expert output, fp32, not rounded */
} fwd_scratch_t;

/* One routed row of local expert weights (wg, wu [I, H], wd [H, I]) for the token row x [H]
 * (already quantized) with router weight wk: writes yk [H] in bf16 and, when not NULL, the bf16
 * g and u [I] for backward. */
static void routed_row(const mok_ref_cfg_t *cfg, const mok_ref_num_t *n, const double *x,
                       double wk, const double *wg, const double *wu, const double *wd,
                       fwd_scratch_t *s, double *yk, double *g_saved, double *u_saved) {
  const int64_t H = cfg->H, I = cfg->I;
  mok_ref_gate_up(n, x, wg, wu, I, H, s->g, s->u);
  for (int64_t i = 0; i < I; i++) {
    if (g_saved) {
      g_saved[i] = mok_ref_bf16(n, s->g[i]);
      u_saved[i] = mok_ref_bf16(n, s->u[i]);
    }
    /* a = bf16(w * (silu(g) * u)): the same product order as backward's a = bf16(w * s). */
    double act = mok_ref_mul(n, mok_ref_silu(n, s->g[i]), s->u[i]);
    s->a[i] = mok_ref_bf16(n, mok_ref_mul(n, wk, act));
  }
  mok_ref_qdq_row(n, s->a, I); /* fp8: a along I before the down GEMM */
  for (int64_t h = 0; h < H; h++) {
    yk[h] = mok_ref_bf16(n, mok_ref_dot(n, 0.0, s->a, wd + h * I, 1, I));
  }
}

/* The shared expert on one token row x [H] (already quantized) of a rank with shared weights
 * wsg, wsu [Is, H], wsd [H, Is]: writes s->ys [H] (fp32, not rounded) and, when not NULL, the bf16
 * gs and us [Is] for backward. */
static void shared_row(const mok_ref_cfg_t *cfg, const mok_ref_num_t *n, const double *x,
                       const double *wsg, const double *wsu, const double *wsd,
                       fwd_scratch_t *s, double *gs_saved, double *us_saved) {
  const int64_t H = cfg->H, Is = cfg->Is;
  mok_ref_gate_up(n, x, wsg, wsu, Is, H, s->g, s->u);
  for (int64_t j = 0; j < Is; j++) {
    if (gs_saved) {
      gs_saved[j] = mok_ref_bf16(n, s->g[j]);
      us_saved[j] = mok_ref_bf16(n, s->u[j]);
    }
    s->a[j] = mok_ref_bf16(n, mok_ref_mul(n, mok_ref_silu(n, s->g[j]), s->u[j]));
  }
  mok_ref_qdq_row(n, s->a, Is); /* fp8: as along Is before the shared down GEMM */
  for (int64_t h = 0; h < H; h++) s->ys[h] = mok_ref_dot(n, 0.0, s->a, wsd + h * Is, 1, Is);
}

mokResult_t mok_ref_forward(const mok_ref_cfg_t *cfg, const mok_ref_weights_t *w,
                            const mok_ref_in_t *in, mok_ref_out_t *out,
                            const mok_ref_saved_t *saved, char *err, size_t errlen) {
  mokResult_t res = mok_ref_check_args(cfg, w, in, out, saved, 0, err, errlen);
  if (res != MOK_SUCCESS) return res;

  const int W = cfg->W;
  const int64_t H = cfg->H, I = cfg->I, Is = cfg->Is, K = cfg->K, EL = cfg->E / W;
  const int64_t width = I > Is ? I : Is;
  mok_ref_num_t num;
  mok_ref_num_init(&num, cfg);
  const mok_ref_num_t *n = &num;

  mok_layout_t l;
  int have_layout = 0;
  double **xq = NULL; /* [W][T_r, H] x, each token row quantized once */
  double **yk = NULL; /* [W][T_r * K, H] bf16 expert outputs by home rank, (token, slot) */
  fwd_scratch_t s = {mok_ref_alloc(width), mok_ref_alloc(width), mok_ref_alloc(width),
                     mok_ref_alloc(H)};
  if (!s.g || !s.u || !s.a || !s.ys) {
    res = mok_ref_oom(err, errlen, "forward");
    goto done;
  }

  res = mok_ref_layout(cfg, in, &l, err, errlen);
  if (res != MOK_SUCCESS) goto done;
  have_layout = 1;
  if (mok_ref_quantize_rows(cfg, n, in, 0, &xq) != MOK_SUCCESS) {
    res = mok_ref_oom(err, errlen, "forward");
    goto done;
  }
  if (mok_ref_alloc_slots(cfg, in, H, &yk) != MOK_SUCCESS) {
    res = mok_ref_oom(err, errlen, "forward");
    goto done;
  }

  /* Expert ranks: each local expert's rows in layout order; padding rows (src < 0) are skipped.
   * An expert without rows is never read (so per-expert weights are never loaded for it). */
  for (int r = 0; r < W; r++) {
    for (int64_t le = 0; le < EL; le++) {
      const int64_t e = r * EL + le;
      if (l.expert_rows[e] == 0) continue;
      mok_ref_expert_t ew;
      mok_ref_expert_weights(cfg, w, r, le, 0, &ew);
      const double *wg = ew.wg; /* [I, H] */
      const double *wu = ew.wu; /* [I, H] */
      const double *wd = ew.wd; /* [H, I] */
      for (int64_t row = l.expert_start[e]; row < l.expert_start[e] + l.expert_rows[e]; row++) {
        const mok_row_origin_t o = l.row_from[r][row];
        if (o.src < 0) continue;
        const int64_t ts = o.token * K + o.slot; /* (token, slot) on the home rank */
        double *g_saved = saved ? saved[o.src].g + ts * I : NULL;
        double *u_saved = saved ? saved[o.src].u + ts * I : NULL;
        routed_row(cfg, n, xq[o.src] + o.token * H, in[o.src].topk_w[ts], wg, wu, wd, &s,
                   yk[o.src] + ts * H, g_saved, u_saved);
      }
    }
  }

  /* Home ranks: shared expert, then y = bf16(ys + yk(0) + ... + yk(K-1)) in fp32, slot order. */
  for (int r = 0; r < W; r++) {
    for (int64_t t = 0; t < in[r].T; t++) {
      if (Is > 0) {
        shared_row(cfg, n, xq[r] + t * H, w[r].wsg, w[r].wsu, w[r].wsd, &s,
                   saved ? saved[r].gs + t * Is : NULL, saved ? saved[r].us + t * Is : NULL);
      }
      for (int64_t h = 0; h < H; h++) {
        double acc = Is > 0 ? s.ys[h] : 0.0;
        for (int64_t k = 0; k < K; k++) {
          if (in[r].topk_idx[t * K + k] < 0) continue;
          acc = mok_ref_add(n, acc, yk[r][(t * K + k) * H + h]);
        }
        out[r].y[t * H + h] = mok_ref_bf16(n, acc);
      }
    }
  }
  res = MOK_SUCCESS;
done:
  if (have_layout) mok_layout_free(&l);
  mok_ref_free_ranks(xq, W);
  mok_ref_free_ranks(yk, W);
  free(s.g);
  free(s.u);
  free(s.a);
  free(s.ys);
  return res;
}

/* ---------------------------------------------------------------------------------------------- */
/* Effective weights                                                                              */
/* ---------------------------------------------------------------------------------------------- */

/* *dst = a copy of nmat row-major [rows, cols] matrices, each quantize-dequantized on its own in
 * br x bc blocks (br = 0: no quantization), so no block straddles two experts. */
static mokResult_t copy_quantized(const double *src, int64_t nmat, int64_t rows, int64_t cols,
                                  int br, int bc, mok_quant_scale_t kind, const double **dst) {
  double *d = mok_ref_alloc(nmat * rows * cols);
  if (!d) return MOK_ERROR_OUT_OF_MEMORY;
  memcpy(d, src, (size_t)(nmat * rows * cols) * sizeof(double));
  if (br > 0) {
    for (int64_t m = 0; m < nmat; m++) {
      mok_qdq_matrix(d + m * rows * cols, rows, cols, br, bc, kind);
    }
  }
  *dst = d;
  return MOK_SUCCESS;
}

/* One weight tensor of nmat [rows, cols] matrices whose forward GEMM reduces over cols: fills
 * the forward copy *f and the backward copy *b (reducing over rows). Where both quantize the
 * same way (BF16: none; fp8-block: 128x128 blocks), *b aliases *f. */
static mokResult_t effective_pair(const mok_ref_cfg_t *cfg, const double *src, int64_t nmat,
                                  int64_t rows, int64_t cols, const double **f, const double **b) {
  mokResult_t res;
  if (cfg->precision == MOK_PRECISION_MXFP8) {
    /* 1x32 along the forward reduction dim (cols), 32x1 along the backward one (rows). */
    res = copy_quantized(src, nmat, rows, cols, 1, 32, MOK_QUANT_E8M0_SCALE, f);
    if (res == MOK_SUCCESS) {
      res = copy_quantized(src, nmat, rows, cols, 32, 1, MOK_QUANT_E8M0_SCALE, b);
    }
    return res;
  }
  if (cfg->precision == MOK_PRECISION_FP8_BLOCK) {
    mok_quant_scale_t kind =
        cfg->fp8_scale == MOK_FP8_SCALE_POW2 ? MOK_QUANT_POW2_SCALE : MOK_QUANT_FP32_SCALE;
    res = copy_quantized(src, nmat, rows, cols, 128, 128, kind, f);
  } else {
    res = copy_quantized(src, nmat, rows, cols, 0, 0, MOK_QUANT_FP32_SCALE, f);
  }
  *b = *f;
  return res;
}

mokResult_t mok_ref_weights_effective(const mok_ref_cfg_t *cfg, const double *wg,
                                      const double *wu, const double *wd, const double *wsg,
                                      const double *wsu, const double *wsd, mok_ref_weights_t *w) {
  if (!cfg || !w || !wg || !wu || !wd) return MOK_ERROR_NULL_POINTER;
  mokResult_t res = mok_ref_check_cfg(cfg, NULL, 0);
  if (res != MOK_SUCCESS) return res;
  if (cfg->Is > 0 && (!wsg || !wsu || !wsd)) return MOK_ERROR_NULL_POINTER;
  memset(w, 0, sizeof(*w));
  const int64_t H = cfg->H, I = cfg->I, Is = cfg->Is, EL = cfg->E / cfg->W;
  /* Wg, Wu [EL, I, H] and Wsg, Wsu [Is, H] reduce over H forward, over I (Is) backward;
   * Wd [EL, H, I] and Wsd [H, Is] reduce over I (Is) forward, over H backward. */
  res = effective_pair(cfg, wg, EL, I, H, &w->wg, &w->wg_b);
  if (res == MOK_SUCCESS) res = effective_pair(cfg, wu, EL, I, H, &w->wu, &w->wu_b);
  if (res == MOK_SUCCESS) res = effective_pair(cfg, wd, EL, H, I, &w->wd, &w->wd_b);
  if (Is > 0) {
    if (res == MOK_SUCCESS) res = effective_pair(cfg, wsg, 1, Is, H, &w->wsg, &w->wsg_b);
    if (res == MOK_SUCCESS) res = effective_pair(cfg, wsu, 1, Is, H, &w->wsu, &w->wsu_b);
    if (res == MOK_SUCCESS) res = effective_pair(cfg, wsd, 1, H, Is, &w->wsd, &w->wsd_b);
  }
  if (res != MOK_SUCCESS) mok_ref_weights_free(w);
  return res;
}

/* Frees a forward copy and its backward copy unless the two alias. */
static void free_pair(const double *f, const double *b) {
  if (b != f) free((void *)b);
  free((void *)f);
}

void mok_ref_weights_free(mok_ref_weights_t *w) {
  if (!w) return;
  free_pair(w->wg, w->wg_b);
  free_pair(w->wu, w->wu_b);
  free_pair(w->wd, w->wd_b);
  free_pair(w->wsg, w->wsg_b);
  free_pair(w->wsu, w->wsu_b);
  free_pair(w->wsd, w->wsd_b);
  memset(w, 0, sizeof(*w));
}
