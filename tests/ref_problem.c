/*
 * ref_problem.c: the random problems and the multi-rank driver of ref_problem.h, shared by the
 * reference tests (tests/test_ref_*.c).
 */
#include "ref_problem.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/quant.h"
#include "support/compare.h"
#include "support/rng.h"

/* n bf16 values ~ N(0, std^2). */
static double *random_bf16(test_rng_t *rng, int64_t n, double std) {
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  if (!v) return NULL;
  for (int64_t i = 0; i < n; i++) v[i] = mok_round_bf16(std * test_rng_normal(rng));
  return v;
}

int ref_problem_init(ref_problem_t *p, int64_t H, int64_t I, int64_t Is, int64_t E, int64_t K,
                     int64_t N, uint64_t seed, double p_empty, int64_t unused_expert) {
  memset(p, 0, sizeof(*p));
  p->H = H, p->I = I, p->Is = Is, p->E = E, p->K = K, p->N = N;
  test_rng_t rng = test_rng_star(seed * 0x9E3779B97F4A7C15ULL + 1);
  p->x = random_bf16(&rng, N * H, 1.0);
  p->dy = random_bf16(&rng, N * H, 1.0);
  p->wg = random_bf16(&rng, E * I * H, 1.0 / sqrt((double)H));
  p->wu = random_bf16(&rng, E * I * H, 1.0 / sqrt((double)H));
  p->wd = random_bf16(&rng, E * H * I, 1.0 / sqrt((double)I));
  if (Is > 0) {
    p->wsg = random_bf16(&rng, Is * H, 1.0 / sqrt((double)H));
    p->wsu = random_bf16(&rng, Is * H, 1.0 / sqrt((double)H));
    p->wsd = random_bf16(&rng, H * Is, 1.0 / sqrt((double)Is));
  }
  p->idx = malloc((size_t)(N * K + 1) * sizeof(int32_t));
  p->tw = malloc((size_t)(N * K + 1) * sizeof(double));
  if (!p->x || !p->dy || !p->wg || !p->wu || !p->wd || !p->idx || !p->tw ||
      (Is > 0 && (!p->wsg || !p->wsu || !p->wsd))) {
    ref_problem_free(p);
    return 0;
  }
  for (int64_t t = 0; t < N; t++) {
    for (int64_t k = 0; k < K; k++) {
      int32_t e;
      int fresh;
      do { /* K distinct experts, never the unused one (the caller leaves enough others) */
        e = (int32_t)(test_rng_uniform(&rng) * (double)E);
        fresh = e != unused_expert;
        for (int64_t j = 0; j < k; j++) fresh = fresh && p->idx[t * K + j] != e;
      } while (!fresh);
      p->idx[t * K + k] = e;
      p->tw[t * K + k] = (double)(float)(0.1 + 0.9 * test_rng_uniform(&rng));
    }
    for (int64_t k = 0; k < K; k++) {
      if (test_rng_uniform(&rng) < p_empty) p->idx[t * K + k] = -1;
    }
  }
  return 1;
}

void ref_problem_free(ref_problem_t *p) {
  free(p->x);
  free(p->dy);
  free(p->idx);
  free(p->tw);
  free(p->wg);
  free(p->wu);
  free(p->wd);
  free(p->wsg);
  free(p->wsu);
  free(p->wsd);
  memset(p, 0, sizeof(*p));
}

ref_run_t ref_run_default(const ref_problem_t *p) {
  ref_run_t r;
  memset(&r, 0, sizeof(r));
  r.W = 1;
  r.T[0] = p->N;
  r.tile_m = 1;
  r.precision = MOK_PRECISION_BF16;
  r.fp8_scale = MOK_FP8_SCALE_FP32;
  r.backward = 1;
  return r;
}

int64_t ref_routed_w_elems(const ref_problem_t *p) { return p->E * p->I * p->H; }
int64_t ref_shared_w_elems(const ref_problem_t *p) { return p->Is * p->H; }

int64_t ref_first_diff(const double *a, const double *b, int64_t n) {
  const int64_t byte = test_first_diff(a, b, (size_t)n * sizeof(double));
  return byte < 0 ? -1 : byte / (int64_t)sizeof(double);
}

static double *filled(int64_t n, double v) {
  double *a = malloc((size_t)(n + 1) * sizeof(double));
  if (a) {
    for (int64_t i = 0; i < n; i++) a[i] = v;
  }
  return a;
}

void ref_result_free(ref_result_t *res) {
  double *arrs[] = {res->y,   res->dx,   res->dtw,  res->dwg, res->dwu, res->dwd, res->dwsg,
                    res->dwsu, res->dwsd, res->g,    res->u,   res->gs,  res->us};
  for (size_t i = 0; i < sizeof(arrs) / sizeof(arrs[0]); i++) free(arrs[i]);
  memset(res, 0, sizeof(*res));
}

mokResult_t ref_run(const ref_problem_t *p, const ref_run_t *run, ref_result_t *res, char *err) {
  const int W = run->W;
  const int64_t H = p->H, I = p->I, Is = p->Is, K = p->K, N = p->N, EL = p->E / W;
  const double f = run->fill;
  mok_ref_cfg_t cfg = {H, I, p->E, K, Is, W, run->precision, run->fp8_scale, run->exact,
                       run->tile_m};
  mok_ref_weights_t w[REF_MAX_W];
  mok_ref_in_t in[REF_MAX_W];
  mok_ref_out_t out[REF_MAX_W];
  mok_ref_saved_t sv[REF_MAX_W];
  memset(w, 0, sizeof(w));
  memset(res, 0, sizeof(*res));
  res->W = W;
  err[0] = '\0';
  mokResult_t rc = MOK_ERROR_OUT_OF_MEMORY;
  res->y = filled(N * H, f);
  res->dx = filled(N * H, f);
  res->dtw = filled(N * K, f);
  res->dwg = filled(p->E * I * H, f);
  res->dwu = filled(p->E * I * H, f);
  res->dwd = filled(p->E * H * I, f);
  res->dwsg = filled(W * Is * H, f);
  res->dwsu = filled(W * Is * H, f);
  res->dwsd = filled(W * H * Is, f);
  res->g = filled(N * K * I, f);
  res->u = filled(N * K * I, f);
  res->gs = filled(N * Is, f);
  res->us = filled(N * Is, f);
  if (!res->y || !res->dx || !res->dtw || !res->dwg || !res->dwu || !res->dwd || !res->dwsg ||
      !res->dwsu || !res->dwsd || !res->g || !res->u || !res->gs || !res->us)
    goto done;

  int64_t off = 0; /* first token of rank r in the concatenation */
  for (int r = 0; r < W; r++) {
    rc = mok_ref_weights_effective(&cfg, p->wg + r * EL * I * H, p->wu + r * EL * I * H,
                                   p->wd + r * EL * H * I, p->wsg, p->wsu, p->wsd, &w[r]);
    if (rc != MOK_SUCCESS) goto done;
    in[r] = (mok_ref_in_t){run->T[r], p->x + off * H, p->idx + off * K, p->tw + off * K,
                           p->dy + off * H};
    out[r] = (mok_ref_out_t){res->y + off * H,        res->dx + off * H,
                             res->dtw + off * K,      res->dwg + r * EL * I * H,
                             res->dwu + r * EL * I * H, res->dwd + r * EL * H * I,
                             res->dwsg + r * Is * H,  res->dwsu + r * Is * H,
                             res->dwsd + r * H * Is};
    sv[r] = (mok_ref_saved_t){res->g + off * K * I, res->u + off * K * I, res->gs + off * Is,
                              res->us + off * Is};
    off += run->T[r];
  }
  rc = mok_ref_forward(&cfg, w, in, out, run->save ? sv : NULL, err, 256);
  if (rc == MOK_SUCCESS && run->backward) {
    rc = mok_ref_backward(&cfg, w, in, out, run->save ? sv : NULL, err, 256);
  }
done:
  for (int r = 0; r < W; r++) mok_ref_weights_free(&w[r]);
  if (rc != MOK_SUCCESS) ref_result_free(res);
  return rc;
}
