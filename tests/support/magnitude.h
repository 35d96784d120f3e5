/*
 * magnitude.h: the magnitude of the sum behind each output of the layer, for the
 * cancellation-aware tolerance of compare.h. Plain C11 that also compiles as C++ (nvcc),
 * header-only.
 *
 * An output element is a sum, and where its terms cancel, the error the two sides may
 * legitimately differ by (one bf16 ulp of a term, at most 2^-7 of it) follows the terms, not
 * the sum. M is the sum of |term| over the terms of the element's outermost sum:
 *   y[t, h]        = bf16(ys + Σ_k yk),        M = |ys| + Σ_k |yk|,
 *                    yk = Σ_i a_ki Wd[e_k][h, i], ys = Σ_j as_j Wsd[h, j]
 *   dx[t, h]       = bf16(dxs + Σ_k dxk),      M = |dxs| + Σ_k |dxk|,
 *                    dxk = Σ_i (dg_ki Wg[e_k][i, h] + du_ki Wu[e_k][i, h]), dxs alike
 *   dtopk_w[t, k]  = Σ_i ds_ki s_ki,           M = Σ_i |ds_ki s_ki|
 *   dWd[e][h, i]   = Σ_rows dy_h a_i,          M = Σ_rows |dy_h a_i|
 *   dWg[e][i, h]   = Σ_rows dg_i x_h,          M = Σ_rows |dg_i x_h|   (dWu: du_i)
 * (rows: those routed to e; the shared dWsd, dWsg, dWsu over all T tokens, weight 1), with the
 * intermediates of a float64 model of one row (router weight w; the shared expert w = 1):
 *   g = Wg x, u = Wu x, s = silu(g) u, a = w s, ds = Wdᵀ dy, da = w ds,
 *   dg = da u silu'(g), du = da silu(g).
 * Nothing is rounded: M is a magnitude, not a reference value (the layer's bf16 g, u, a, ... are
 * within about 2^-8 of these), and it never includes a starting weight gradient (the same on both
 * sides). The sums inside yk and dxk are not expanded: a flip of one a, dg or du moves them by
 * one term's 2^-7, which atol covers; a flip of yk or dxk itself is 2^-7 |yk| or |dxk|. An empty
 * slot (id < 0) adds nothing; a row the layer would drop at capacity is counted all the same (M
 * only grows). Cost: about 10 T K I H multiply-adds, for T K routed rows.
 */
#ifndef MOK_TESTS_SUPPORT_MAGNITUDE_H
#define MOK_TESTS_SUPPORT_MAGNITUDE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* The inputs of T tokens; every tensor bf16 unless said otherwise. */
typedef struct {
  int64_t T, H, I, E, K, Is;
  const uint16_t *x;         /* [T, H] */
  const uint16_t *dy;        /* [T, H]; NULL: the forward's magnitudes only */
  const uint16_t *wg, *wu;   /* [E, I, H] */
  const uint16_t *wd;        /* [E, H, I] */
  const uint16_t *wsg, *wsu; /* [Is, H] (not read when Is = 0) */
  const uint16_t *wsd;       /* [H, Is] */
  const int32_t *idx;        /* [T, K] expert ids, < 0: empty slot */
  const float *tw;           /* [T, K] router weights */
} test_mag_in_t;

/* The magnitudes, each filled where not NULL; all but y need dy. */
typedef struct {
  double *y, *dx;             /* [T, H] */
  double *dtw;                /* [T, K] */
  double *dwg, *dwu, *dwd;    /* [E, I, H], [E, I, H], [E, H, I] */
  double *dwsg, *dwsu, *dwsd; /* [Is, H], [Is, H], [H, Is] */
} test_mag_out_t;

/* p + off, or NULL for NULL. */
static inline double *test_mag_at(double *p, int64_t off) { return p ? p + off : NULL; }

/* One row of n features (wg, wu [n, H], wd [H, n]; router weight w) for the token xv, dyv [H]
 * (float64; dyv NULL: forward only): adds |yk| to y [H] and |dxk| to dx [H], its terms' |.| to
 * dwg, dwu [n, H] and dwd [H, n], and sets *dtw; any of them NULL is skipped. sc: [5 n + H]
 * scratch. */
static inline void test_mag_row(int64_t H, int64_t n, double w, const double *xv,
                                const double *dyv, const uint16_t *wg, const uint16_t *wu,
                                const uint16_t *wd, double *sc, double *y, double *dx,
                                double *dtw, double *dwg, double *dwu, double *dwd) {
  /* s, a, then u silu'(g) and silu(g), which become dg and du once ds is known; dxk. */
  double *s = sc, *a = sc + n, *dg = sc + 2 * n, *du = sc + 3 * n, *ds = sc + 4 * n;
  double *dxk = sc + 5 * n;
  for (int64_t i = 0; i < n; i++) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < H; h++) {
      g += xv[h] * bf2f(wg[i * H + h]);
      u += xv[h] * bf2f(wu[i * H + h]);
    }
    const double sig = 1.0 / (1.0 + exp(-g)), silu = g * sig;
    s[i] = silu * u;
    a[i] = w * s[i];
    dg[i] = u * sig * (1.0 + g * (1.0 - sig));
    du[i] = silu;
    ds[i] = 0;
  }
  for (int64_t h = 0; h < H; h++) { /* yk = a . Wd[h, :] and ds = Σ_h dy_h Wd[h, :] */
    const uint16_t *wdh = wd + h * n;
    double yk = 0;
    for (int64_t i = 0; i < n; i++) {
      const double v = bf2f(wdh[i]);
      yk += a[i] * v;
      if (dyv) ds[i] += dyv[h] * v;
    }
    if (y) y[h] += fabs(yk);
  }
  if (!dyv) return;
  double dw = 0;
  for (int64_t i = 0; i < n; i++) {
    dw += fabs(ds[i] * s[i]);
    dg[i] *= w * ds[i];
    du[i] *= w * ds[i];
  }
  if (dtw) *dtw = dw;
  for (int64_t h = 0; h < H; h++) dxk[h] = 0;
  for (int64_t i = 0; i < n; i++) {
    for (int64_t h = 0; h < H; h++) {
      dxk[h] += dg[i] * bf2f(wg[i * H + h]) + du[i] * bf2f(wu[i * H + h]);
      if (dwg) dwg[i * H + h] += fabs(dg[i] * xv[h]);
      if (dwu) dwu[i * H + h] += fabs(du[i] * xv[h]);
    }
  }
  if (dx)
    for (int64_t h = 0; h < H; h++) dx[h] += fabs(dxk[h]);
  if (dwd)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < n; i++) dwd[h * n + i] += fabs(dyv[h] * a[i]);
}

/* Fills o's non-NULL magnitudes for the T tokens of in. 0 when out of memory. */
static inline int test_magnitudes(const test_mag_in_t *in, const test_mag_out_t *o) {
  const int64_t T = in->T, H = in->H, I = in->I, E = in->E, K = in->K, Is = in->Is;
  const int64_t n = I > Is ? I : Is;
  double *const outs[9] = {o->y, o->dx, o->dtw, o->dwg, o->dwu, o->dwd, o->dwsg, o->dwsu, o->dwsd};
  const int64_t sizes[9] = {T * H, T * H, T * K, E * I * H, E * I * H, E * H * I,
                            Is * H, Is * H, H * Is};
  for (int j = 0; j < 9; j++)
    if (outs[j]) memset(outs[j], 0, (size_t)sizes[j] * sizeof(double));
  double *sc = (double *)malloc((size_t)(5 * n + 3 * H + 1) * sizeof(double));
  if (!sc) return 0;
  double *xv = sc + 5 * n + H, *dyv = in->dy ? xv + H : NULL;
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h++) {
      xv[h] = bf2f(in->x[t * H + h]);
      if (dyv) dyv[h] = bf2f(in->dy[t * H + h]);
    }
    double *y = test_mag_at(o->y, t * H), *dx = test_mag_at(o->dx, t * H);
    if (Is > 0)
      test_mag_row(H, Is, 1.0, xv, dyv, in->wsg, in->wsu, in->wsd, sc, y, dx, NULL, o->dwsg,
                   o->dwsu, o->dwsd);
    for (int64_t k = 0; k < K; k++) {
      const int64_t e = in->idx[t * K + k];
      if (e < 0 || e >= E) continue;
      test_mag_row(H, I, in->tw[t * K + k], xv, dyv, in->wg + e * I * H, in->wu + e * I * H,
                   in->wd + e * H * I, sc, y, dx, test_mag_at(o->dtw, t * K + k),
                   test_mag_at(o->dwg, e * I * H), test_mag_at(o->dwu, e * I * H),
                   test_mag_at(o->dwd, e * H * I));
    }
  }
  free(sc);
  return 1;
}

#endif /* MOK_TESTS_SUPPORT_MAGNITUDE_H */
