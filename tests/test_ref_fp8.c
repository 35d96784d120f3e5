/*
 * test_ref_fp8.c: the fp8 precisions of the reference: the effective weights are quantized per
 * expert in the documented blocks, results stay within e4m3 accuracy of BF16 yet really differ
 * from it, the formats differ from each other, and weight gradients read unquantized operands.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/quant.h"
#include "ref_problem.h"
#include "support/rng.h"
#include "test.h"

/* ||a - b|| / ||b|| over n elements. */
static double rel_l2(const double *a, const double *b, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; i++) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return sqrt(num / den);
}

/* Expects m[nmat * rows * cols] to equal src quantize-dequantized per [rows, cols] matrix in
 * br x bc blocks (br = 0: an unchanged copy). */
static void expect_blocks(const char *what, const double *m, const double *src, int64_t nmat,
                          int64_t rows, int64_t cols, int br, int bc, mok_quant_scale_t kind) {
  const int64_t n = nmat * rows * cols;
  double *want = malloc((size_t)n * sizeof(double));
  MOK_REQUIRE(m && want);
  memcpy(want, src, (size_t)n * sizeof(double));
  if (br > 0) {
    for (int64_t e = 0; e < nmat; e++) {
      mok_qdq_matrix(want + e * rows * cols, rows, cols, br, bc, kind);
    }
  }
  int64_t bad = ref_first_diff(m, want, n), changed = 0;
  for (int64_t i = 0; i < n; i++) changed += m[i] != src[i];
  MOK_EXPECT_MSG(bad < 0, "%s[%lld]: %.9g, want %.9g", what, (long long)bad,
                 bad >= 0 ? m[bad] : 0.0, bad >= 0 ? want[bad] : 0.0);
  /* fp8 really rounds most bf16 values (8 significant bits to 4); BF16 keeps them all. */
  if (br > 0) {
    MOK_EXPECT_MSG(changed > n / 2, "%s: only %lld of %lld values quantized", what,
                   (long long)changed, (long long)n);
  } else {
    MOK_EXPECT(changed == 0);
  }
  free(want);
}

/* Two ranks of two experts; I = 80 and Is = 40 are not multiples of 32 or 128, so a block that
 * straddled two experts (or ran past a matrix edge) would change values. */
MOK_TEST(ref_weights_effective_quantizes_per_expert_blocks) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 160, 80, 40, 4, 2, 1, 71, 0.0, -1));
  const int64_t H = p.H, I = p.I, Is = p.Is, EL = 2;
  const mok_precision_t precs[4] = {MOK_PRECISION_BF16, MOK_PRECISION_FP8_BLOCK,
                                    MOK_PRECISION_FP8_BLOCK, MOK_PRECISION_MXFP8};
  const mok_fp8_scale_t scales[4] = {MOK_FP8_SCALE_FP32, MOK_FP8_SCALE_FP32, MOK_FP8_SCALE_POW2,
                                     MOK_FP8_SCALE_FP32};
  for (int c = 0; c < 4; c++) {
    mok_ref_cfg_t cfg = {H, I, p.E, p.K, Is, 2, precs[c], scales[c], 0, 1};
    for (int r = 0; r < 2; r++) {
      mok_ref_weights_t w;
      const double *wg = p.wg + r * EL * I * H, *wu = p.wu + r * EL * I * H;
      const double *wd = p.wd + r * EL * H * I;
      MOK_REQUIRE(mok_ref_weights_effective(&cfg, wg, wu, wd, p.wsg, p.wsu, p.wsd, &w) ==
                  MOK_SUCCESS);
      if (precs[c] == MOK_PRECISION_MXFP8) {
        /* forward copies 1x32 along the forward reduction dim, backward copies 32x1 */
        const mok_quant_scale_t k = MOK_QUANT_E8M0_SCALE;
        expect_blocks("wg", w.wg, wg, EL, I, H, 1, 32, k);
        expect_blocks("wu", w.wu, wu, EL, I, H, 1, 32, k);
        expect_blocks("wd", w.wd, wd, EL, H, I, 1, 32, k);
        expect_blocks("wg_b", w.wg_b, wg, EL, I, H, 32, 1, k);
        expect_blocks("wu_b", w.wu_b, wu, EL, I, H, 32, 1, k);
        expect_blocks("wd_b", w.wd_b, wd, EL, H, I, 32, 1, k);
        expect_blocks("wsg", w.wsg, p.wsg, 1, Is, H, 1, 32, k);
        expect_blocks("wsd", w.wsd, p.wsd, 1, H, Is, 1, 32, k);
        expect_blocks("wsu_b", w.wsu_b, p.wsu, 1, Is, H, 32, 1, k);
        expect_blocks("wsd_b", w.wsd_b, p.wsd, 1, H, Is, 32, 1, k);
      } else {
        /* BF16: plain copies; fp8-block: 128x128 blocks, forward and backward copies equal */
        const int b = precs[c] == MOK_PRECISION_BF16 ? 0 : 128;
        const mok_quant_scale_t k =
            scales[c] == MOK_FP8_SCALE_POW2 ? MOK_QUANT_POW2_SCALE : MOK_QUANT_FP32_SCALE;
        expect_blocks("wg", w.wg, wg, EL, I, H, b, b, k);
        expect_blocks("wu", w.wu, wu, EL, I, H, b, b, k);
        expect_blocks("wd", w.wd, wd, EL, H, I, b, b, k);
        expect_blocks("wsg", w.wsg, p.wsg, 1, Is, H, b, b, k);
        expect_blocks("wsu", w.wsu, p.wsu, 1, Is, H, b, b, k);
        expect_blocks("wsd", w.wsd, p.wsd, 1, H, Is, b, b, k);
        expect_blocks("wg_b", w.wg_b, wg, EL, I, H, b, b, k);
        expect_blocks("wd_b", w.wd_b, wd, EL, H, I, b, b, k);
        expect_blocks("wsu_b", w.wsu_b, p.wsu, 1, Is, H, b, b, k);
      }
      mok_ref_weights_free(&w);
      MOK_EXPECT(w.wg == NULL && w.wd_b == NULL); /* freed and cleared */
    }
  }
  /* Is = 0 leaves the shared pointers NULL. */
  mok_ref_cfg_t cfg = {H, I, p.E, p.K, 0, 1, MOK_PRECISION_MXFP8, MOK_FP8_SCALE_FP32, 0, 1};
  mok_ref_weights_t w;
  MOK_REQUIRE(mok_ref_weights_effective(&cfg, p.wg, p.wu, p.wd, NULL, NULL, NULL, &w) ==
              MOK_SUCCESS);
  MOK_EXPECT(w.wsg == NULL && w.wsu == NULL && w.wsd == NULL && w.wsg_b == NULL &&
             w.wsu_b == NULL && w.wsd_b == NULL);
  mok_ref_weights_free(&w);
  ref_problem_free(&p);
}

/* fp8 results against BF16. e4m3 keeps 4 significant bits: its relative step is 2^-3 and one
 * rounding moves a value by at most half a step, 2^-4 relative, about 2^-4 / sqrt(3) = 0.036 rms
 * (values in a block's subnormal range move by at most 2^-10 of the block's amax). Each GEMM
 * rounds both operands, so each product term is off by about 0.05 rms relative, and a sum of
 * random-sign terms is off in norm by that same relative amount; two chained GEMMs (gate/up,
 * then down; ds, then dx) compound to about 0.06-0.07 (measured 0.055-0.069 here). So the
 * norm-wise relative difference of y, dx and dtopk_w must stay below 2^-3, one whole e4m3 step:
 * more would mean values lost more than e4m3 resolution (a scale applied twice or not at all,
 * saturation). It must also be well above the bf16 level (2^-8): below that, nothing was
 * quantized. Block shapes and scale kinds are checked exactly by the tests above and below. */
MOK_TEST(ref_fp8_close_to_bf16_but_quantized) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 256, 160, 64, 4, 2, 16, 81, 0.1, -1));
  const int64_t NH = p.N * p.H, NK = p.N * p.K;
  ref_run_t run = ref_run_default(&p);
  ref_result_t b, q[3];
  char err[256];
  MOK_REQUIRE(ref_run(&p, &run, &b, err) == MOK_SUCCESS);
  const mok_precision_t precs[3] = {MOK_PRECISION_FP8_BLOCK, MOK_PRECISION_FP8_BLOCK,
                                    MOK_PRECISION_MXFP8};
  const mok_fp8_scale_t scales[3] = {MOK_FP8_SCALE_FP32, MOK_FP8_SCALE_POW2, MOK_FP8_SCALE_FP32};
  for (int c = 0; c < 3; c++) {
    run.precision = precs[c];
    run.fp8_scale = scales[c];
    MOK_REQUIRE(ref_run(&p, &run, &q[c], err) == MOK_SUCCESS);
    const double ey = rel_l2(q[c].y, b.y, NH), edx = rel_l2(q[c].dx, b.dx, NH);
    const double edw = rel_l2(q[c].dtw, b.dtw, NK);
    MOK_EXPECT_MSG(ey < 0x1p-3 && edx < 0x1p-3 && edw < 0x1p-3,
                   "precision %d scale %d: relative L2 y %.4f dx %.4f dtopk_w %.4f", (int)precs[c],
                   (int)scales[c], ey, edx, edw);
    MOK_EXPECT_MSG(ey > 0x1p-8 && edx > 0x1p-8 && edw > 0x1p-8,
                   "precision %d scale %d: too close to BF16: y %.5f dx %.5f dtopk_w %.5f",
                   (int)precs[c], (int)scales[c], ey, edx, edw);
  }
  /* fp32 scales give other bits than power-of-two scales (fp8-block) or MXFP8. */
  MOK_EXPECT(ref_first_diff(q[0].y, q[1].y, NH) >= 0);
  MOK_EXPECT(ref_first_diff(q[0].y, q[2].y, NH) >= 0);
  MOK_EXPECT(ref_first_diff(q[0].dx, q[2].dx, NH) >= 0);
  for (int c = 0; c < 3; c++) ref_result_free(&q[c]);

  ref_result_free(&b);
  ref_problem_free(&p);
}

/* Power-of-two scales (fp8-block POW2 and MXFP8) both round a value to 4 significant bits unless
 * it falls in its block's e4m3 subnormal range, below about 2^-15 of the block's amax, so on
 * well-scaled data the two formats nearly always agree. Here token 0's x is 1 at h = 0, tiny
 * (~2^-17) at h in [32, 64) and 0 elsewhere, and every gate/up weight column 0 is zero, so g and
 * u come from the tiny values only: fp8-block's 1x128 block (amax 1, scale 2^-8) holds them as
 * subnormals on a 2^-17 grid, MXFP8's own 1x32 block keeps 4 significant bits. The token's y must
 * differ; with fp32 scales the two fp8-block variants differ too. */
MOK_TEST(ref_fp8_block_pow2_and_mxfp8_differ_in_subnormal_range) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 128, 64, 32, 4, 2, 2, 85, 0.0, -1));
  for (int64_t h = 0; h < p.H; h++) p.x[h] = h == 0 ? 1.0 : 0.0;
  test_rng_t rng = test_rng_star(7);
  for (int64_t h = 32; h < 64; h++) p.x[h] = mok_round_bf16(0x1p-17 * test_rng_normal(&rng));
  for (int64_t i = 0; i < p.E * p.I; i++) p.wg[i * p.H] = p.wu[i * p.H] = 0.0;
  for (int64_t j = 0; j < p.Is; j++) p.wsg[j * p.H] = p.wsu[j * p.H] = 0.0;
  ref_run_t run = ref_run_default(&p);
  run.backward = 0;
  const mok_precision_t precs[3] = {MOK_PRECISION_FP8_BLOCK, MOK_PRECISION_FP8_BLOCK,
                                    MOK_PRECISION_MXFP8};
  const mok_fp8_scale_t scales[3] = {MOK_FP8_SCALE_POW2, MOK_FP8_SCALE_FP32, MOK_FP8_SCALE_FP32};
  ref_result_t q[3];
  char err[256];
  for (int c = 0; c < 3; c++) {
    run.precision = precs[c];
    run.fp8_scale = scales[c];
    MOK_REQUIRE(ref_run(&p, &run, &q[c], err) == MOK_SUCCESS);
  }
  double ymax = 0.0;
  for (int64_t h = 0; h < p.H; h++) ymax = fmax(ymax, fabs(q[2].y[h]));
  MOK_EXPECT(ymax > 0.0); /* the tiny values do reach y */
  MOK_EXPECT(ref_first_diff(q[0].y, q[2].y, p.H) >= 0);
  MOK_EXPECT(ref_first_diff(q[0].y, q[1].y, p.H) >= 0);
  for (int c = 0; c < 3; c++) ref_result_free(&q[c]);
  ref_problem_free(&p);
}

/* dWd = sum over an expert's rows of dy^T a, from the bf16 dy (not its fp8 copy) and
 * a = bf16(w * silu(g) * u) of the saved bf16 g, u; rows in (token, slot) order on one rank. */
MOK_TEST(ref_fp8_weight_gradients_read_unquantized_operands) {
  ref_problem_t p;
  MOK_REQUIRE(ref_problem_init(&p, 96, 64, 0, 4, 2, 12, 91, 0.1, -1));
  const int64_t H = p.H, I = p.I, K = p.K;
  ref_run_t run = ref_run_default(&p);
  run.precision = MOK_PRECISION_MXFP8;
  run.save = 1;
  ref_result_t r;
  char err[256];
  MOK_REQUIRE(ref_run(&p, &run, &r, err) == MOK_SUCCESS);
  float *dwd = calloc((size_t)(p.E * H * I), sizeof(float)); /* [E, H, I] */
  float *a = calloc((size_t)I, sizeof(float));               /* [I] */
  MOK_REQUIRE(dwd && a);
  for (int64_t t = 0; t < p.N; t++) {
    for (int64_t k = 0; k < K; k++) {
      const int32_t e = p.idx[t * K + k];
      if (e < 0) continue;
      for (int64_t i = 0; i < I; i++) {
        const float g = (float)r.g[(t * K + k) * I + i], u = (float)r.u[(t * K + k) * I + i];
        const float s = g / (1.0f + expf(-g)) * u;
        a[i] = (float)mok_round_bf16((float)p.tw[t * K + k] * s);
      }
      for (int64_t h = 0; h < H; h++) {
        for (int64_t i = 0; i < I; i++) {
          float *acc = &dwd[(e * H + h) * I + i];
          *acc = fmaf((float)p.dy[t * H + h], a[i], *acc);
        }
      }
    }
  }
  int64_t bad = -1;
  for (int64_t i = 0; i < p.E * H * I && bad < 0; i++) {
    if ((double)dwd[i] != r.dwd[i]) bad = i;
  }
  MOK_EXPECT_MSG(bad < 0, "dwd[%lld]: %.9g, reference %.9g", (long long)bad,
                 bad >= 0 ? dwd[bad] : 0.0f, bad >= 0 ? r.dwd[bad] : 0.0);
  free(dwd);
  free(a);
  ref_result_free(&r);
  ref_problem_free(&p);
}
