/*
 * ref_backward.c: the reference layer's backward pass over W simulated expert-parallel ranks
 * (docs/design.md, "The layer"; ref.h).
 *
 * Backward starts from g and u rounded to bf16 (the saved context, or the same values recomputed
 * bit-identically) and derives everything else from them: s = silu(g) * u, a = bf16(w * s), the
 * SwiGLU backward, the router-weight gradient and the data gradient of every routed row on its
 * expert's rank, in layout order; the bf16 dxk of each row lands on its home rank, which adds the
 * shared expert's fp32 dxs and the dxk in slot order. Weight gradients are fp32 sums over the
 * expert's rows in layout order (source rank, token, slot), from the unquantized bf16 x, a, dy,
 * dg, du, so they keep bf16 accuracy in the fp8 precisions too.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu/ref_internal.h"

/* Scratch of one routed or shared row; every array is [max(I, Is)]. */
typedef struct {
  double *g, *u;     /* bf16 g and u */
  double *sact;      /* s = silu(g) * u, fp32 (routed) */
  double *a;         /* bf16 a (routed) or as (shared), for the down-projection gradient */
  double *dg, *du;   /* bf16 dg and du, for the gate/up weight gradients */
  double *dgq, *duq; /* dg and du quantize-dequantized along I (Is), for the data gradient */
} bwd_scratch_t;

/* The SwiGLU backward of one row of `rows` features, with router weight wk (1 for the shared
 * expert) and ds = the gradient w.r.t. the row's activation (fp32, [rows]), from the bf16 g, u in
 * sc: fills sc->dg, du (bf16) and their quantized copies dgq, duq. */
static void swiglu_backward(const mok_ref_num_t *n, int64_t rows, double wk, const double *ds,
                            bwd_scratch_t *sc) {
  for (int64_t i = 0; i < rows; i++) {
    const double da = mok_ref_mul(n, wk, ds[i]);
    const double g = sc->g[i], u = sc->u[i];
    sc->dg[i] = mok_ref_bf16(n, mok_ref_mul(n, mok_ref_mul(n, da, u), mok_ref_dsilu(n, g)));
    sc->du[i] = mok_ref_bf16(n, mok_ref_mul(n, da, mok_ref_silu(n, g)));
  }
  memcpy(sc->dgq, sc->dg, (size_t)rows * sizeof(double));
  memcpy(sc->duq, sc->du, (size_t)rows * sizeof(double));
  mok_ref_qdq_row(n, sc->dgq, rows); /* fp8: dg, du along I before the data-gradient GEMM */
  mok_ref_qdq_row(n, sc->duq, rows);
}

/* dx_h = dgq . Wg_b[:, h] + duq . Wu_b[:, h]: one fp32 accumulator over the 2 * rows terms, the
 * gate terms first. wg_b, wu_b: [rows, H]; returns the unrounded fp32 sum. */
static double data_grad(const mok_ref_num_t *n, const bwd_scratch_t *sc, const double *wg_b,
                        const double *wu_b, int64_t rows, int64_t H, int64_t h) {
  double acc = mok_ref_dot(n, 0.0, sc->dgq, wg_b + h, H, rows);
  return mok_ref_dot(n, acc, sc->duq, wu_b + h, H, rows);
}

/* Accumulates one row into the weight gradients of a gate/up/down triple:
 * dwd [H, rows] += dy^T a, dwg [rows, H] += dg^T x, dwu [rows, H] += du^T x (x, dy: [H], bf16). */
static void wgrad_row(const mok_ref_num_t *n, const bwd_scratch_t *sc, const double *x,
                      const double *dy, int64_t rows, int64_t H, double *dwg, double *dwu,
                      double *dwd) {
  for (int64_t h = 0; h < H; h++) {
    for (int64_t i = 0; i < rows; i++) {
      dwd[h * rows + i] = mok_ref_fma(n, dy[h], sc->a[i], dwd[h * rows + i]);
    }
  }
  for (int64_t i = 0; i < rows; i++) {
    for (int64_t h = 0; h < H; h++) {
      dwg[i * H + h] = mok_ref_fma(n, sc->dg[i], x[h], dwg[i * H + h]);
      dwu[i * H + h] = mok_ref_fma(n, sc->du[i], x[h], dwu[i * H + h]);
    }
  }
}

/* bf16 g and u of `rows` features into sc: copied from the saved context when there is one, else
 * recomputed from the quantized token row xq [H] exactly as forward did, then rounded. */
static void load_gate_up(const mok_ref_num_t *n, const double *g_saved, const double *u_saved,
                         const double *xq, const double *wg, const double *wu, int64_t rows,
                         int64_t H, bwd_scratch_t *sc) {
  if (g_saved) {
    memcpy(sc->g, g_saved, (size_t)rows * sizeof(double));
    memcpy(sc->u, u_saved, (size_t)rows * sizeof(double));
    return;
  }
  mok_ref_gate_up(n, xq, wg, wu, rows, H, sc->g, sc->u);
  for (int64_t i = 0; i < rows; i++) {
    sc->g[i] = mok_ref_bf16(n, sc->g[i]);
    sc->u[i] = mok_ref_bf16(n, sc->u[i]);
  }
}

mokResult_t mok_ref_backward(const mok_ref_cfg_t *cfg, const mok_ref_weights_t *w,
                             const mok_ref_in_t *in, mok_ref_out_t *out,
                             const mok_ref_saved_t *saved, char *err, size_t errlen) {
  mokResult_t res = mok_ref_check_args(cfg, w, in, out, saved, 1, err, errlen);
  if (res != MOK_SUCCESS) return res;

  const int W = cfg->W;
  const int64_t H = cfg->H, I = cfg->I, Is = cfg->Is, K = cfg->K, EL = cfg->E / W;
  const int64_t width = I > Is ? I : Is;
  mok_ref_num_t num;
  mok_ref_num_init(&num, cfg);
  const mok_ref_num_t *n = &num;

  mok_layout_t l;
  int have_layout = 0;
  double **xq = NULL;  /* [W][T_r, H] x quantized per row (recompute of g, u) */
  double **dyq = NULL; /* [W][T_r, H] dy quantized per row along H */
  double **dxk = NULL; /* [W][T_r * K, H] bf16 routed data gradients by home rank */
  /* [3, I, H] one expert's dwg, dwu, dwd for ranks with per-expert weights (ref.h) */
  int per_expert = 0;
  for (int r = 0; r < W; r++) per_expert |= w[r].experts != NULL;
  double *ew_grad = per_expert ? mok_ref_alloc(3 * I * H) : NULL;
  double *ds = mok_ref_alloc(width); /* [max(I, Is)] gradient w.r.t. a (fp32) */
  double *dxs = mok_ref_alloc(H);    /* [H] shared data gradient, fp32 */
  bwd_scratch_t sc = {mok_ref_alloc(width), mok_ref_alloc(width), mok_ref_alloc(width),
                      mok_ref_alloc(width), mok_ref_alloc(width), mok_ref_alloc(width),
                      mok_ref_alloc(width), mok_ref_alloc(width)};
  if ((per_expert && !ew_grad) || !ds || !dxs || !sc.g || !sc.u || !sc.sact || !sc.a || !sc.dg ||
      !sc.du || !sc.dgq || !sc.duq) {
    res = mok_ref_oom(err, errlen, "backward");
    goto done;
  }

  res = mok_ref_layout(cfg, in, &l, err, errlen);
  if (res != MOK_SUCCESS) goto done;
  have_layout = 1;
  if (mok_ref_quantize_rows(cfg, n, in, 0, &xq) != MOK_SUCCESS) {
    res = mok_ref_oom(err, errlen, "backward");
    goto done;
  }
  if (mok_ref_quantize_rows(cfg, n, in, 1, &dyq) != MOK_SUCCESS) {
    res = mok_ref_oom(err, errlen, "backward");
    goto done;
  }
  if (mok_ref_alloc_slots(cfg, in, H, &dxk) != MOK_SUCCESS) {
    res = mok_ref_oom(err, errlen, "backward");
    goto done;
  }

  /* Outputs are overwritten: weight gradients are sums from zero; empty slots get dtopk_w = 0. */
  for (int r = 0; r < W; r++) {
    if (!w[r].experts) {
      memset(out[r].dwg, 0, (size_t)(EL * I * H) * sizeof(double));
      memset(out[r].dwu, 0, (size_t)(EL * I * H) * sizeof(double));
      memset(out[r].dwd, 0, (size_t)(EL * H * I) * sizeof(double));
    }
    if (in[r].T > 0) memset(out[r].dtopk_w, 0, (size_t)(in[r].T * K) * sizeof(double));
  }

  /* Expert ranks: each local expert's rows in layout order; padding rows (src < 0) are skipped.
   * An expert without rows reads no weights; its gradients are zeros. */
  int grad_dirty = 0; /* ew_grad holds an expert's sums (it starts zeroed) */
  for (int r = 0; r < W; r++) {
    for (int64_t le = 0; le < EL; le++) {
      const int64_t e = r * EL + le;
      double *dwg, *dwu, *dwd; /* [I, H], [I, H], [H, I] */
      if (w[r].experts) {
        if (grad_dirty) memset(ew_grad, 0, (size_t)(3 * I * H) * sizeof(double));
        dwg = ew_grad, dwu = ew_grad + I * H, dwd = ew_grad + 2 * I * H;
        grad_dirty = l.expert_rows[e] > 0;
      } else {
        dwg = out[r].dwg + le * I * H, dwu = out[r].dwu + le * I * H;
        dwd = out[r].dwd + le * H * I;
      }
      mok_ref_expert_t ew = {NULL, NULL, NULL, NULL, NULL, NULL};
      if (l.expert_rows[e] > 0) mok_ref_expert_weights(cfg, w, r, le, 1, &ew);
      const double *wg = ew.wg, *wu = ew.wu;       /* [I, H] forward (recompute of g, u) */
      const double *wg_b = ew.wg_b, *wu_b = ew.wu_b; /* [I, H] */
      const double *wd_b = ew.wd_b;                  /* [H, I] */
      for (int64_t row = l.expert_start[e]; row < l.expert_start[e] + l.expert_rows[e]; row++) {
        const mok_row_origin_t o = l.row_from[r][row];
        if (o.src < 0) continue;
        const int64_t ts = o.token * K + o.slot; /* (token, slot) on the home rank */
        const double wk = in[o.src].topk_w[ts];
        const double *x = in[o.src].x + o.token * H;   /* [H] bf16, weight gradients */
        const double *dy = in[o.src].dy + o.token * H; /* [H] bf16, weight gradients */
        load_gate_up(n, saved ? saved[o.src].g + ts * I : NULL,
                     saved ? saved[o.src].u + ts * I : NULL, xq[o.src] + o.token * H, wg, wu, I,
                     H, &sc);
        for (int64_t i = 0; i < I; i++) {
          sc.sact[i] = mok_ref_mul(n, mok_ref_silu(n, sc.g[i]), sc.u[i]);
          sc.a[i] = mok_ref_bf16(n, mok_ref_mul(n, wk, sc.sact[i]));
          /* ds_i = dyq . Wd_b[:, i], reduction over H */
          ds[i] = mok_ref_dot(n, 0.0, dyq[o.src] + o.token * H, wd_b + i, I, H);
        }
        out[o.src].dtopk_w[ts] = mok_ref_dot(n, 0.0, ds, sc.sact, 1, I);
        swiglu_backward(n, I, wk, ds, &sc);
        for (int64_t h = 0; h < H; h++) {
          dxk[o.src][ts * H + h] = mok_ref_bf16(n, data_grad(n, &sc, wg_b, wu_b, I, H, h));
        }
        wgrad_row(n, &sc, x, dy, I, H, dwg, dwu, dwd);
      }
      if (w[r].experts) w[r].experts->store(w[r].experts->user, r, le, dwg, dwu, dwd);
    }
  }

  /* Home ranks: shared expert (weight 1, no routing) over the rank's own tokens in token order,
   * then dx = bf16(dxs + dxk(0) + ... + dxk(K-1)) in fp32, slot order. */
  for (int r = 0; r < W; r++) {
    if (Is > 0) {
      memset(out[r].dwsg, 0, (size_t)(Is * H) * sizeof(double));
      memset(out[r].dwsu, 0, (size_t)(Is * H) * sizeof(double));
      memset(out[r].dwsd, 0, (size_t)(H * Is) * sizeof(double));
    }
    for (int64_t t = 0; t < in[r].T; t++) {
      if (Is > 0) {
        load_gate_up(n, saved ? saved[r].gs + t * Is : NULL, saved ? saved[r].us + t * Is : NULL,
                     xq[r] + t * H, w[r].wsg, w[r].wsu, Is, H, &sc);
        for (int64_t j = 0; j < Is; j++) {
          sc.a[j] = mok_ref_bf16(n, mok_ref_mul(n, mok_ref_silu(n, sc.g[j]), sc.u[j]));
          ds[j] = mok_ref_dot(n, 0.0, dyq[r] + t * H, w[r].wsd_b + j, Is, H); /* dss */
        }
        swiglu_backward(n, Is, 1.0, ds, &sc);
        for (int64_t h = 0; h < H; h++) {
          dxs[h] = data_grad(n, &sc, w[r].wsg_b, w[r].wsu_b, Is, H, h);
        }
        wgrad_row(n, &sc, in[r].x + t * H, in[r].dy + t * H, Is, H, out[r].dwsg, out[r].dwsu,
                  out[r].dwsd);
      }
      for (int64_t h = 0; h < H; h++) {
        double acc = Is > 0 ? dxs[h] : 0.0;
        for (int64_t k = 0; k < K; k++) {
          if (in[r].topk_idx[t * K + k] < 0) continue;
          acc = mok_ref_add(n, acc, dxk[r][(t * K + k) * H + h]);
        }
        out[r].dx[t * H + h] = mok_ref_bf16(n, acc);
      }
    }
  }
  res = MOK_SUCCESS;
done:
  if (have_layout) mok_layout_free(&l);
  mok_ref_free_ranks(xq, W);
  mok_ref_free_ranks(dyq, W);
  mok_ref_free_ranks(dxk, W);
  free(ew_grad);
  free(ds);
  free(dxs);
  free(sc.g);
  free(sc.u);
  free(sc.sact);
  free(sc.a);
  free(sc.dg);
  free(sc.du);
  free(sc.dgq);
  free(sc.duq);
  return res;
}
