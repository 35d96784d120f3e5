/*
 * test_ref_naive.c: the rounding points of the reference, checked independently: a one-token case
 * worked out by hand, and a straightforward float implementation of DESIGN.md section 2 and of
 * the fp8 rounding points of ref.h (one rank, no layout, token by token) that must match the
 * reference bit for bit in every precision.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/quant.h"
#include "cpu/ref.h"
#include "ref_problem.h"
#include "test.h"

/* ---- hand-worked case ------------------------------------------------------------------------ */

/* H = I = 1, one expert, no shared expert: x = 1, Wg = 2, Wu = 1, Wd = 1, router weight 0.5,
 * dy = 1. g = 2, u = 1, silu(2) = 2 / (1 + e^-2) = 1.7615941559...
 *   a  = bf16(0.5 * 1.76159) = bf16(0.88080) = 225 / 256 = 0.87890625 (bf16 steps 2^-8 in [0.5, 1))
 *   y  = bf16(a * Wd) = 0.87890625                 (exact mode: 0.5 * silu(2) = 0.88079707797788)
 *   ds = dy . Wd = 1, dtopk_w = ds * silu(g) * u = 1.76159 (fp32)
 *   silu'(2) = sig(2) * (1 + 2 * (1 - sig(2))) = 1.09078; dg = bf16(0.5 * 1.09078) = 140 / 256
 *   du = bf16(0.5 * 1.76159) = 0.87890625
 *   dx = bf16(dg * Wg + du * Wu) = bf16(1.09375 + 0.87890625) = bf16(1.97265625): halfway between
 *        the bf16 values 252 / 128 and 253 / 128, ties to even: 1.96875
 *   dWd = dy * a = 0.87890625, dWg = dg * x = 0.546875, dWu = du * x = 0.87890625 */
static void hand_case(int exact, double *y, double *dx, double *dtw, double *dwg, double *dwu,
                      double *dwd, mokResult_t *rc) {
  const double x = 1.0, wg = 2.0, wu = 1.0, wd = 1.0, tw = 0.5, dy = 1.0;
  const int32_t idx = 0;
  mok_ref_cfg_t cfg = {1, 1, 1, 1, 0, 1, MOK_PRECISION_BF16, MOK_FP8_SCALE_FP32, exact, 1};
  mok_ref_weights_t w = {&wg, &wu, &wd, &wg, &wu, &wd, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
  mok_ref_in_t in = {1, &x, &idx, &tw, &dy};
  mok_ref_out_t out = {y, dx, dtw, dwg, dwu, dwd, NULL, NULL, NULL};
  char err[256];
  *rc = mok_ref_forward(&cfg, &w, &in, &out, NULL, err, sizeof(err));
  if (*rc == MOK_SUCCESS) *rc = mok_ref_backward(&cfg, &w, &in, &out, NULL, err, sizeof(err));
}

MOK_TEST(ref_hand_worked_single_token) {
  double y, dx, dtw, dwg, dwu, dwd;
  mokResult_t rc;
  hand_case(0, &y, &dx, &dtw, &dwg, &dwu, &dwd, &rc);
  MOK_REQUIRE(rc == MOK_SUCCESS);
  MOK_EXPECT_MSG(y == 0.87890625, "y = %.17g", y);
  MOK_EXPECT_MSG(dx == 1.96875, "dx = %.17g", dx);
  MOK_EXPECT_MSG(fabs(dtw - 1.7615941559557649) <= 0x1p-22, "dtopk_w = %.17g", dtw);
  MOK_EXPECT_MSG((double)(float)dtw == dtw, "dtopk_w is not an fp32 value: %.17g", dtw);
  MOK_EXPECT_MSG(dwd == 0.87890625, "dWd = %.17g", dwd);
  MOK_EXPECT_MSG(dwg == 0.546875, "dWg = %.17g", dwg);
  MOK_EXPECT_MSG(dwu == 0.87890625, "dWu = %.17g", dwu);

  /* Exact mode rounds nothing: y = 0.5 * silu(2), dx = 0.5 * (2 silu'(2) + silu(2)). */
  hand_case(1, &y, &dx, &dtw, &dwg, &dwu, &dwd, &rc);
  MOK_REQUIRE(rc == MOK_SUCCESS);
  const double sig = 1.0 / (1.0 + exp(-2.0)), silu = 2.0 * sig;
  const double dsilu = sig * (1.0 + 2.0 * (1.0 - sig));
  MOK_EXPECT_MSG(fabs(y - 0.5 * silu) <= 1e-15, "exact y = %.17g", y);
  MOK_EXPECT_MSG(fabs(dx - 0.5 * (2.0 * dsilu + silu)) <= 1e-15, "exact dx = %.17g", dx);
  MOK_EXPECT_MSG(fabs(dtw - silu) <= 1e-15, "exact dtopk_w = %.17g", dtw);
}

/* ---- naive float implementation ------------------------------------------------------------- */

/* bf16 round to nearest even of a finite float, on its bits. */
static float bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  memcpy(&f, &u, 4);
  return f;
}

static float silu(float g) { return g / (1.0f + expf(-g)); }

static float dsilu(float g) {
  float s = 1.0f / (1.0f + expf(-g));
  return s * (1.0f + g * (1.0f - s));
}

/* The activation quantizer of the precision under test (a no-op for BF16): quantize-dequantize
 * a row v[n] along its length, in 1 x block blocks. */
typedef struct {
  int fp8, block;
  mok_quant_scale_t kind;
} naive_quant_t;

static void qrow(const naive_quant_t *q, const float *v, float *out, int64_t n) {
  double buf[512];
  for (int64_t i = 0; i < n; i++) buf[i] = v[i];
  if (q->fp8) mok_qdq_matrix(buf, 1, n, 1, q->block, q->kind);
  for (int64_t i = 0; i < n; i++) out[i] = (float)buf[i];
}

static float *tof(const double *d, int64_t n) {
  float *f = calloc((size_t)n + 1, sizeof(float));
  if (f) {
    for (int64_t i = 0; i < n; i++) f[i] = (float)d[i];
  }
  return f;
}

/* One expert's weights as the GEMMs see them: forward and backward copies. */
typedef struct {
  const float *wg, *wu, *wd;       /* [R, H], [R, H], [H, R] forward */
  const float *wg_b, *wu_b, *wd_b; /* backward */
} naive_w_t;

/* One SwiGLU expert of R features on one token, forward then backward, written straight from
 * DESIGN.md section 2 and the fp8 rounding points of ref.h. x, dy: [H] bf16; xq, dyq: [H] their
 * quantized copies (GEMM inputs). Writes out [H] (bf16 for routed experts, fp32 for the shared
 * one), dx [H] (fp32, not rounded), *dtw, and accumulates dwg, dwu [R, H], dwd [H, R].
 * tw: the router weight (routed) or ignored (shared: weight 1). */
static void naive_expert(const naive_quant_t *q, int64_t H, int64_t R, const float *x,
                         const float *xq, const float *dy, const float *dyq, float tw, int shared,
                         const naive_w_t *w, float *out, float *dx, float *dtw, float *dwg,
                         float *dwu, float *dwd) {
  float g[512], u[512], a[512], aq[512], dgq[512], duq[512];
  float dg[512] = {0}, du[512] = {0}; /* (initialized only to quiet -Wmaybe-uninitialized) */
  for (int64_t i = 0; i < R; i++) {
    float gi = 0.0f, ui = 0.0f;
    for (int64_t h = 0; h < H; h++) {
      gi = fmaf(xq[h], w->wg[i * H + h], gi);
      ui = fmaf(xq[h], w->wu[i * H + h], ui);
    }
    g[i] = gi;
    u[i] = ui;
    a[i] = shared ? bf(silu(gi) * ui) : bf(tw * (silu(gi) * ui));
  }
  qrow(q, a, aq, R);
  for (int64_t h = 0; h < H; h++) {
    float acc = 0.0f;
    for (int64_t i = 0; i < R; i++) acc = fmaf(aq[i], w->wd[h * R + i], acc);
    out[h] = shared ? acc : bf(acc);
  }
  /* Backward from bf16 g and u. */
  if (shared) tw = 1.0f;
  float dw = 0.0f;
  for (int64_t i = 0; i < R; i++) {
    g[i] = bf(g[i]);
    u[i] = bf(u[i]);
    float s = silu(g[i]) * u[i];
    a[i] = bf(tw * s);
    float ds = 0.0f;
    for (int64_t h = 0; h < H; h++) ds = fmaf(dyq[h], w->wd_b[h * R + i], ds);
    dw = fmaf(ds, s, dw);
    float da = tw * ds;
    dg[i] = bf(da * u[i] * dsilu(g[i]));
    du[i] = bf(da * silu(g[i]));
  }
  *dtw = dw;
  qrow(q, dg, dgq, R);
  qrow(q, du, duq, R);
  for (int64_t h = 0; h < H; h++) {
    float acc = 0.0f;
    for (int64_t i = 0; i < R; i++) acc = fmaf(dgq[i], w->wg_b[i * H + h], acc);
    for (int64_t i = 0; i < R; i++) acc = fmaf(duq[i], w->wu_b[i * H + h], acc);
    dx[h] = acc;
    for (int64_t i = 0; i < R; i++) dwd[h * R + i] = fmaf(dy[h], a[i], dwd[h * R + i]);
  }
  for (int64_t i = 0; i < R; i++) {
    for (int64_t h = 0; h < H; h++) {
      dwg[i * H + h] = fmaf(dg[i], x[h], dwg[i * H + h]);
      dwu[i * H + h] = fmaf(du[i], x[h], dwu[i * H + h]);
    }
  }
}

/* The naive layer on one rank (token by token, no layout) against the reference, bitwise. */
static void naive_vs_reference(mok_precision_t prec, mok_fp8_scale_t scale) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 160, 48, 40, 4, 2, 9, 61, 0.2, -1));
  const int64_t H = p.H, I = p.I, Is = p.Is, K = p.K, N = p.N, E = p.E;
  naive_quant_t q = {prec != MOK_PRECISION_BF16, prec == MOK_PRECISION_MXFP8 ? 32 : 128,
                     prec == MOK_PRECISION_MXFP8    ? MOK_QUANT_E8M0_SCALE
                     : scale == MOK_FP8_SCALE_POW2 ? MOK_QUANT_POW2_SCALE
                                                   : MOK_QUANT_FP32_SCALE};
  mok_ref_cfg_t cfg = {H, I, E, K, Is, 1, prec, scale, 0, 1};
  mok_ref_weights_t ew; /* effective weights: their quantization is tested in test_ref_fp8.c */
  MOK_REQUIRE(mok_ref_weights_effective(&cfg, p.wg, p.wu, p.wd, p.wsg, p.wsu, p.wsd, &ew) ==
              MOK_SUCCESS);
  float *f[] = {tof(p.x, N * H),      tof(p.dy, N * H),      tof(p.tw, N * K),
                tof(ew.wg, E * I * H), tof(ew.wu, E * I * H), tof(ew.wd, E * H * I),
                tof(ew.wg_b, E * I * H), tof(ew.wu_b, E * I * H), tof(ew.wd_b, E * H * I),
                tof(ew.wsg, Is * H),  tof(ew.wsu, Is * H),   tof(ew.wsd, H * Is),
                tof(ew.wsg_b, Is * H), tof(ew.wsu_b, Is * H), tof(ew.wsd_b, H * Is),
                calloc(N * H, 4),     calloc(N * H, 4),      calloc(N * K, 4),
                calloc(E * I * H, 4), calloc(E * I * H, 4),  calloc(E * H * I, 4),
                calloc(Is * H, 4),    calloc(Is * H, 4),     calloc(H * Is, 4),
                calloc(H, 4),         calloc(H, 4),          calloc(H, 4),
                calloc(H, 4)};
  const size_t nf = sizeof(f) / sizeof(f[0]);
  for (size_t i = 0; i < nf; i++) MOK_REQUIRE(f[i]);
  const float *x = f[0], *dy = f[1], *tw = f[2];
  float *y = f[15], *dx = f[16], *dtw = f[17], *dwg = f[18], *dwu = f[19], *dwd = f[20];
  float *dwsg = f[21], *dwsu = f[22], *dwsd = f[23], *xq = f[24], *dyq = f[25];
  float *yk = f[26], *dxk = f[27];
  const naive_w_t ws = {f[9], f[10], f[11], f[12], f[13], f[14]};

  /* Token by token: shared expert, then the slots in order, summed in fp32 and rounded once.
   * Expert e's weight gradients accumulate its rows in (token, slot) order. */
  for (int64_t t = 0; t < N; t++) {
    float *yt = y + t * H, *dxt = dx + t * H, unused;
    qrow(&q, x + t * H, xq, H);
    qrow(&q, dy + t * H, dyq, H);
    naive_expert(&q, H, Is, x + t * H, xq, dy + t * H, dyq, 1.0f, 1, &ws, yt, dxt, &unused,
                 dwsg, dwsu, dwsd);
    for (int64_t k = 0; k < K; k++) {
      const int32_t e = p.idx[t * K + k];
      dtw[t * K + k] = 0.0f;
      if (e < 0) continue;
      const naive_w_t we = {f[3] + e * I * H, f[4] + e * I * H, f[5] + e * H * I,
                            f[6] + e * I * H, f[7] + e * I * H, f[8] + e * H * I};
      naive_expert(&q, H, I, x + t * H, xq, dy + t * H, dyq, tw[t * K + k], 0, &we, yk, dxk,
                   &dtw[t * K + k], dwg + e * I * H, dwu + e * I * H, dwd + e * H * I);
      for (int64_t h = 0; h < H; h++) {
        yt[h] += yk[h];
        dxt[h] += bf(dxk[h]);
      }
    }
    for (int64_t h = 0; h < H; h++) {
      yt[h] = bf(yt[h]);
      dxt[h] = bf(dxt[h]);
    }
  }

  ref_run_t run = ref_run_default(&p);
  run.precision = prec;
  run.fp8_scale = scale;
  ref_result_t r;
  char err[256];
  MOK_REQUIRE(ref_run(&p, &run, &r, err) == MOK_SUCCESS);
  const struct {
    const char *name;
    const float *naive;
    const double *ref;
    int64_t n;
  } cmp[] = {{"y", y, r.y, N * H},         {"dx", dx, r.dx, N * H},
             {"dtopk_w", dtw, r.dtw, N * K}, {"dwg", dwg, r.dwg, E * I * H},
             {"dwu", dwu, r.dwu, E * I * H}, {"dwd", dwd, r.dwd, E * H * I},
             {"dwsg", dwsg, r.dwsg, Is * H}, {"dwsu", dwsu, r.dwsu, Is * H},
             {"dwsd", dwsd, r.dwsd, H * Is}};
  for (size_t c = 0; c < sizeof(cmp) / sizeof(cmp[0]); c++) {
    int64_t bad = -1;
    for (int64_t i = 0; i < cmp[c].n && bad < 0; i++) {
      if (!((double)cmp[c].naive[i] == cmp[c].ref[i])) bad = i;
    }
    MOK_EXPECT_MSG(bad < 0, "precision %d: %s[%lld]: naive %.9g, reference %.9g", (int)prec,
                   cmp[c].name, (long long)bad, bad >= 0 ? cmp[c].naive[bad] : 0.0f,
                   bad >= 0 ? cmp[c].ref[bad] : 0.0);
  }
  ref_result_free(&r);
  for (size_t i = 0; i < nf; i++) free(f[i]);
  mok_ref_weights_free(&ew);
  ref_problem_free(&p);
}

MOK_TEST(ref_matches_naive_implementation_bf16) {
  naive_vs_reference(MOK_PRECISION_BF16, MOK_FP8_SCALE_FP32);
}
MOK_TEST(ref_matches_naive_implementation_fp8_block) {
  naive_vs_reference(MOK_PRECISION_FP8_BLOCK, MOK_FP8_SCALE_FP32);
}
MOK_TEST(ref_matches_naive_implementation_fp8_block_pow2) {
  naive_vs_reference(MOK_PRECISION_FP8_BLOCK, MOK_FP8_SCALE_POW2);
}
MOK_TEST(ref_matches_naive_implementation_mxfp8) {
  naive_vs_reference(MOK_PRECISION_MXFP8, MOK_FP8_SCALE_FP32);
}
