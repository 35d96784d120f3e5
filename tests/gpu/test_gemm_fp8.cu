/*
 * test_gemm_fp8.cu: the fp8-block path of the grouped GEMM (e4m3 operands, 1x128 activation and
 * 128x128 weight scales, promotion every 128 reduction elements) and its MXFP8-B path (bf16 A,
 * e4m3 B with 1x32 E8M0 scales) against fp64 sums on the host; ragged and empty groups, rows
 * outside every group untouched, bitwise run to run, whatever the CTA count and whichever layout
 * the activation scales come in; a quantized in the SwiGLU epilogue bitwise the quantizer's.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "gemm_test_util.h"
#include "cuda/quant/quant.h"

/* ---------------------------------------------------------------------------------------------- */
/* fp8-block                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

static double e4m3_to_double(uint8_t v) {  // OCP E4M3 (fn): bias 7, no infinities, 0x7F/0xFF NaN
  const int sign = v >> 7, e = (v >> 3) & 15, m = v & 7;
  const double mag = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -mag : mag;
}
static uint8_t rnd_e4m3(void) {  // any finite e4m3 value
  uint8_t v = (uint8_t)test_rng_u32(&g_rng);
  if ((v & 0x7F) == 0x7F) v ^= 1;  // NaN -> 448 or -448 neighbour
  return v;
}

// fp8-block against fp64 sums of the dequantized operands. Tolerance: the result is rounded to
// bf16 (2^-7 |ref|), and the tensor cores add fp8 products into an accumulator that keeps about
// 14 mantissa bits (DeepSeek-V3 report; the reason for promoting every 128 elements): with
// running sums of ~sqrt(128) terms that is ~2^-14 · 128 |t| per block, ~1e-3 of the terms' L2
// norm over K = 512. Hence atol = 2^-8 · sqrt(Σ term²). Measured on an H200: worst 1.5e-3 (fp32
// output) and 1.8e-3 (accumulate); a wrong scale or operand tile gives errors of order 0.1-1.
static void check_fp8(const problem_t &pr, mok_gg_epilogue_t epi, int group_m = 0) {
  const int G = pr.G, M = pr.M, N = pr.N, K = pr.K, KB = K / 128, NB = N / 128;
  std::vector<uint8_t> a((size_t)M * K), b((size_t)G * N * K);
  std::vector<float> sa((size_t)M * KB), sb((size_t)G * NB * KB);
  for (auto &v : a) v = rnd_e4m3();
  for (auto &v : b) v = rnd_e4m3();
  for (auto &v : sa) v = ldexp(1.0f + 0.5f * rnd_unit(), -9);
  for (auto &v : sb) v = ldexp(1.0f + 0.5f * rnd_unit(), -9);
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  const int out_f32 = epi != MOK_GG_EPI_STORE_BF16;
  const size_t esz = out_f32 ? 4 : 2, cbytes = (size_t)M * N * esz;
  std::vector<float> c_init((size_t)M * N);
  for (auto &v : c_init) v = rnd_unit();
  // the same activation scales K-block major, [KB, ld] with ld past M and a multiple of 4
  const int ld = (M + 3) / 4 * 4 + 4;
  std::vector<float> sa_t((size_t)KB * ld, NAN);
  for (int r = 0; r < M; r++)
    for (int kb = 0; kb < KB; kb++) sa_t[(size_t)kb * ld + r] = sa[(size_t)r * KB + kb];
  uint8_t *da = to_dev(a), *db = to_dev(b);
  float *dsa = to_dev(sa), *dsb = to_dev(sb), *dinit = to_dev(c_init), *dsa_t = to_dev(sa_t);
  int32_t *doffs = to_dev(offs32);
  void *dc = NULL;
  cudaMalloc(&dc, cbytes + 16);
  MOK_REQUIRE(da && db && dsa && dsb && dinit && doffs && dc && dsa_t);
  cudaMemset(dc, 0xFF, cbytes);
  if (epi == MOK_GG_EPI_ACCUM_F32) cudaMemcpy(dc, dinit, cbytes, cudaMemcpyDeviceToDevice);
  mok_grouped_gemm_params_t p = gemm_params(MOK_GG_FP8_BLOCK, epi, G, M, N, K, da, db, doffs, dc);
  p.a_scale = dsa;
  p.b_scale = dsb;
  p.num_sms = 5;
  p.group_m = group_m;
  std::vector<uint8_t> c(cbytes), c2(cbytes);
  mokResult_t res = mok_grouped_gemm_launch(&p, NULL);
  cudaError_t err = cudaDeviceSynchronize();
  MOK_REQUIRE_MSG(res == MOK_SUCCESS && err == cudaSuccess, "launch %d, cuda %s", (int)res,
                  cudaGetErrorString(err));
  cudaMemcpy(c.data(), dc, cbytes, cudaMemcpyDeviceToHost);
  if (epi != MOK_GG_EPI_ACCUM_F32) {
    // bitwise the same: run to run, with a CTA per SM (most of them find no tile), and with the
    // activation scales K-block major (loaded through shared memory), on 5 CTAs and one per SM
    const char *what[4] = {"a second run", "a CTA per SM", "K-block-major scales",
                           "K-block-major scales, a CTA per SM"};
    for (int v = 0; v < 4; v++) {
      mok_grouped_gemm_params_t q = p;
      q.num_sms = v % 2 ? 0 : 5;
      if (v >= 2) {
        q.a_scale = dsa_t;
        q.a_scale_ld = ld;
      }
      cudaMemset(dc, 0xFF, cbytes);
      MOK_REQUIRE(mok_grouped_gemm_launch(&q, NULL) == MOK_SUCCESS);
      MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      cudaMemcpy(c2.data(), dc, cbytes, cudaMemcpyDeviceToHost);
      MOK_EXPECT_MSG(memcmp(c.data(), c2.data(), cbytes) == 0,
                     "fp8 epilogue %d (group_m %d): %s differs", (int)epi, group_m, what[v]);
    }
  } else {
    // accumulating: the K-block-major scales add the same bits to the same initial values
    cudaMemcpy(dc, dinit, cbytes, cudaMemcpyDeviceToDevice);
    mok_grouped_gemm_params_t q = p;
    q.a_scale = dsa_t;
    q.a_scale_ld = ld;
    MOK_REQUIRE(mok_grouped_gemm_launch(&q, NULL) == MOK_SUCCESS);
    MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    cudaMemcpy(c2.data(), dc, cbytes, cudaMemcpyDeviceToHost);
    MOK_EXPECT_MSG(memcmp(c.data(), c2.data(), cbytes) == 0,
                   "fp8 accumulate (group_m %d): K-block-major scales differ", group_m);
  }
  int bad = 0;
  double worst_rel = 0;
  for (int r = 0; r < M; r++) {
    const int g = group_of_row(pr, r);
    for (int n = 0; n < N; n++) {
      const size_t i = (size_t)r * N + n;
      if (g < 0) {
        int kept = epi == MOK_GG_EPI_ACCUM_F32 ? !memcmp(&c[i * 4], &c_init[i], 4)
                   : out_f32 ? ((uint32_t *)c.data())[i] == 0xFFFFFFFFu
                             : ((uint16_t *)c.data())[i] == 0xFFFF;
        if (!kept && bad++ < 5) mok_test_fail(__FILE__, __LINE__, "row %d (no group) written", r);
        continue;
      }
      double ref = epi == MOK_GG_EPI_ACCUM_F32 ? c_init[i] : 0.0, sq = 0;
      for (int kb = 0; kb < KB; kb++) {
        const double scale = (double)sa[(size_t)r * KB + kb] *
                             sb[((size_t)g * NB + n / 128) * KB + kb];
        double blk = 0;
        for (int k = 128 * kb; k < 128 * kb + 128; k++) {
          const double t = e4m3_to_double(a[(size_t)r * K + k]) *
                           e4m3_to_double(b[((size_t)g * N + n) * K + k]);
          blk += t;
          sq += t * t * scale * scale;
        }
        ref += blk * scale;
      }
      const double got = out_f32 ? ((float *)c.data())[i] : bf2f(((uint16_t *)c.data())[i]);
      const double tol = 0x1p-8 * sqrt(sq) + (out_f32 ? 1e-6 : 0x1p-7) * fabs(ref);
      const double e = fabs(got - ref);
      if (sqrt(sq) > 0 && e / sqrt(sq) > worst_rel) worst_rel = e / sqrt(sq);
      if (!(e <= tol) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "fp8 epi %d (%d,%d): got %.6g, ref %.6g (tol %.3g)",
                      (int)epi, r, n, got, ref, tol);
    }
  }
  printf("    fp8-block epilogue %d: worst |err| / sqrt(sum term^2) = %.3g\n", (int)epi,
         worst_rel);
  MOK_EXPECT_MSG(bad == 0, "fp8 epilogue %d (group_m %d): %d bad elements", (int)epi, group_m,
                 bad);
  cudaFree(da); cudaFree(db); cudaFree(dsa); cudaFree(dsb); cudaFree(dinit); cudaFree(doffs);
  cudaFree(dc); cudaFree(dsa_t);
}

// The mainloop runs blocks in pairs, then a tail of one or two (tile/pipeline.cuh): K = 1, 2, 3 and
// 5 blocks of 128 cover every tail, and one block alone.
MOK_TEST(gemm_fp8_block_every_k_tail_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  const int ks[] = {128, 256, 384, 640};
  for (int i = 0; i < 4; i++) {
    problem_t pr = make_problem(256, ks[i], {0, 130, 1, 64}, 3, 5);
    check_fp8(pr, MOK_GG_EPI_STORE_BF16);
    check_fp8(pr, MOK_GG_EPI_ACCUM_F32);
  }
}

MOK_TEST(gemm_fp8_block_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  problem_t pr = make_problem(384, 512, {0, 1, 127, 128, 129, 0, 300, 64}, 5, 37);
  check_fp8(pr, MOK_GG_EPI_STORE_BF16);
  check_fp8(pr, MOK_GG_EPI_STORE_F32);
  check_fp8(pr, MOK_GG_EPI_ACCUM_F32);
  // tiles in bands of 2 row units: a warpgroup with no row in its group computes its rows anyway
  // (grouped_gemm.cu's gg_skip_rows), and stores none of them
  check_fp8(pr, MOK_GG_EPI_STORE_BF16, 2);
  check_fp8(pr, MOK_GG_EPI_ACCUM_F32, 2);
  // fewer rows than a tile: the K-block-major scales are one TMA box narrower than a tile's
  problem_t small = make_problem(256, 256, {5, 0, 40}, 2, 3);
  check_fp8(small, MOK_GG_EPI_STORE_BF16);
  check_fp8(small, MOK_GG_EPI_ACCUM_F32);
}

/* ---------------------------------------------------------------------------------------------- */
/* fp8-block SwiGLU and the second reduction segment                                              */
/* ---------------------------------------------------------------------------------------------- */

// Random e4m3 operands and scales near 2^-9 (products of the size the layer's GEMMs see).
struct fp8_operand {
  std::vector<uint8_t> q;
  std::vector<float> s;
  fp8_operand(size_t n, size_t ns) : q(n), s(ns) {
    for (auto &v : q) v = rnd_e4m3();
    for (auto &v : s) v = ldexp(1.0f + 0.5f * rnd_unit(), -9);
  }
};

// Σ_kb scale_kb · Σ_{k in kb} a_k b_k over one [K] pair, and the sum of the squared scaled terms
// (for the tolerance of check_fp8).
static double fp8_dot(const uint8_t *a, const float *sa, int sa_stride, const uint8_t *b,
                      const float *sb, int KB, double *sq) {
  double ref = 0;
  for (int kb = 0; kb < KB; kb++) {
    const double scale = (double)sa[(size_t)kb * sa_stride] * sb[kb];
    double blk = 0;
    for (int k = 128 * kb; k < 128 * kb + 128; k++) {
      const double t = e4m3_to_double(a[k]) * e4m3_to_double(b[k]);
      blk += t;
      *sq += t * t * scale * scale;
    }
    ref += blk * scale;
  }
  return ref;
}

// SwiGLU: gate B = Wg, B2 = Wu (each with its 128x128 scales), row scales w; a = bf16(w silu(g) u)
// and bf16 g, u against fp64 on the host (g, u with check_fp8's tolerance, carried through the
// SwiGLU's derivatives into a), rows outside every group untouched; bitwise run to run, on a CTA
// per SM, and with the activation scales K-block major.
static void check_fp8_swiglu(const problem_t &pr) {
  const int G = pr.G, M = pr.M, N = pr.N, K = pr.K, KB = K / 128, NB = N / 128;
  fp8_operand A((size_t)M * K, (size_t)M * KB), Bg((size_t)G * N * K, (size_t)G * NB * KB),
      Bu((size_t)G * N * K, (size_t)G * NB * KB);
  std::vector<float> w(M);
  for (auto &v : w) v = 0.25f + 0.75f * fabsf(rnd_unit());
  const int ld = (M + 3) / 4 * 4 + 4;
  std::vector<float> sa_t((size_t)KB * ld, NAN);
  for (int r = 0; r < M; r++)
    for (int kb = 0; kb < KB; kb++) sa_t[(size_t)kb * ld + r] = A.s[(size_t)r * KB + kb];
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  uint8_t *da = to_dev(A.q), *dbg = to_dev(Bg.q), *dbu = to_dev(Bu.q);
  float *dsa = to_dev(A.s), *dsg = to_dev(Bg.s), *dsu = to_dev(Bu.s), *dw = to_dev(w),
        *dsa_t = to_dev(sa_t);
  int32_t *doffs = to_dev(offs32);
  const size_t cbytes = (size_t)M * N * 2;
  uint16_t *dc = NULL, *dg = NULL, *du = NULL;
  cudaMalloc(&dc, cbytes);
  cudaMalloc(&dg, cbytes);
  cudaMalloc(&du, cbytes);
  MOK_REQUIRE(da && dbg && dbu && dsa && dsg && dsu && dw && dsa_t && doffs && dc && dg && du);
  mok_grouped_gemm_params_t p =
      gemm_params(MOK_GG_FP8_BLOCK, MOK_GG_EPI_SWIGLU, G, M, N, K, da, dbg, doffs, dc);
  p.b2 = dbu;
  p.a_scale = dsa;
  p.b_scale = dsg;
  p.b2_scale = dsu;
  p.row_scale = dw;
  p.g_out = dg;
  p.u_out = du;
  p.num_sms = 5;
  std::vector<uint16_t> c[3], first[3];
  for (int v = 0; v < 4; v++) {  // 5 CTAs, one per SM, K-block-major scales on 5 and on all
    mok_grouped_gemm_params_t q = p;
    q.num_sms = v % 2 ? 0 : 5;
    if (v >= 2) q.a_scale = dsa_t, q.a_scale_ld = ld;
    cudaMemset(dc, 0xFF, cbytes);
    cudaMemset(dg, 0xFF, cbytes);
    cudaMemset(du, 0xFF, cbytes);
    const mokResult_t res = mok_grouped_gemm_launch(&q, NULL);
    const cudaError_t err = cudaDeviceSynchronize();
    MOK_REQUIRE_MSG(res == MOK_SUCCESS && err == cudaSuccess, "fp8 SwiGLU launch %d, cuda %s",
                    (int)res, cudaGetErrorString(err));
    uint16_t *src[3] = {dc, dg, du};
    for (int o = 0; o < 3; o++) {
      c[o].resize((size_t)M * N);
      cudaMemcpy(c[o].data(), src[o], cbytes, cudaMemcpyDeviceToHost);
      if (v == 0) first[o] = c[o];
      else MOK_EXPECT_MSG(c[o] == first[o], "fp8 SwiGLU output %d differs in variant %d", o, v);
    }
  }
  int bad = 0;
  double worst = 0;
  for (int r = 0; r < M; r++) {
    const int g = group_of_row(pr, r);
    for (int n = 0; n < N; n++) {
      const size_t i = (size_t)r * N + n;
      if (g < 0) {
        if ((c[0][i] != 0xFFFF || c[1][i] != 0xFFFF || c[2][i] != 0xFFFF) && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "fp8 SwiGLU: row %d (no group) written", r);
        continue;
      }
      double sqg = 0, squ = 0;
      const size_t brow = (size_t)g * N + n, bs = ((size_t)g * NB + n / 128) * KB;
      const double rg = fp8_dot(&A.q[(size_t)r * K], &A.s[(size_t)r * KB], 1, &Bg.q[brow * K],
                                &Bg.s[bs], KB, &sqg);
      const double ru = fp8_dot(&A.q[(size_t)r * K], &A.s[(size_t)r * KB], 1, &Bu.q[brow * K],
                                &Bu.s[bs], KB, &squ);
      const double tg = 0x1p-8 * sqrt(sqg), tu = 0x1p-8 * sqrt(squ);
      const double sg = 1.0 / (1.0 + exp(-rg)), dsilu = sg * (1.0 + rg * (1.0 - sg));
      const double ra = w[r] * silu(rg) * ru;
      const double ta = w[r] * (fabs(dsilu * ru) * tg + fabs(silu(rg)) * tu + tg * tu) +
                        0x1p-7 * fabs(ra) + 1e-30;
      const double got[3] = {bf2f(c[0][i]), bf2f(c[1][i]), bf2f(c[2][i])};
      const double ref[3] = {ra, rg, ru};
      const double tol[3] = {ta, tg + 0x1p-7 * fabs(rg), tu + 0x1p-7 * fabs(ru)};
      for (int o = 0; o < 3; o++) {
        const double e = fabs(got[o] - ref[o]);
        if (e / tol[o] > worst) worst = e / tol[o];
        if (!(e <= tol[o]) && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "fp8 SwiGLU output %d (%d,%d): got %.6g, ref %.6g "
                        "(tol %.3g)", o, r, n, got[o], ref[o], tol[o]);
      }
    }
  }
  printf("    fp8-block SwiGLU: worst |err| / tol = %.3g\n", worst);
  MOK_EXPECT_MSG(bad == 0, "fp8 SwiGLU: %d bad elements", bad);
  cudaFree(da); cudaFree(dbg); cudaFree(dbu); cudaFree(dsa); cudaFree(dsg); cudaFree(dsu);
  cudaFree(dw); cudaFree(dsa_t); cudaFree(doffs); cudaFree(dc); cudaFree(dg); cudaFree(du);
}

MOK_TEST(gemm_fp8_block_swiglu_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  // N = 256: four 64-column tiles, two per 128-row scale block of Wg and Wu; K = 384 an odd
  // number of blocks (the mainloop's tail of one)
  check_fp8_swiglu(make_problem(256, 384, {0, 1, 127, 128, 129, 0, 70}, 5, 37));
  check_fp8_swiglu(make_problem(128, 128, {5, 0, 40}, 2, 3));
}

// Quantized a (c_q): the SwiGLU GEMM's a quantized in its epilogue, in 1x128 blocks over pairs of
// its 64-column tiles, is bit for bit what mok_quantize_launch makes of the bf16 a the same GEMM
// stores without c_q (checked against fp64 above), for both scale kinds, on 5 CTAs and on all,
// with g and u unchanged; rows outside every group keep their poison. Large and small weights give
// blocks whose scales cover a range of magnitudes.
static void check_fp8_swiglu_quantized(const problem_t &pr) {
  const int G = pr.G, M = pr.M, N = pr.N, K = pr.K, KB = K / 128, NB = N / 128;
  fp8_operand A((size_t)M * K, 0), Bg((size_t)G * N * K, (size_t)G * NB * KB),
      Bu((size_t)G * N * K, (size_t)G * NB * KB);
  const int ld = (M + 3) / 4 * 4 + 4;
  std::vector<float> sa_t((size_t)KB * ld), w(M);
  for (auto &v : sa_t) v = ldexp(1.0f + 0.5f * rnd_unit(), -9 - (int)(test_rng_u32(&g_rng) % 6));
  for (auto &v : w) v = 0.25f + 0.75f * fabsf(rnd_unit());
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  uint8_t *da = to_dev(A.q), *dbg = to_dev(Bg.q), *dbu = to_dev(Bu.q);
  float *dsa = to_dev(sa_t), *dsg = to_dev(Bg.s), *dsu = to_dev(Bu.s), *dw = to_dev(w);
  int32_t *doffs = to_dev(offs32);
  const size_t cbytes = (size_t)M * N * 2, qbytes = (size_t)M * N, sbytes = (size_t)NB * ld * 4;
  uint16_t *dc = NULL, *dg = NULL, *du = NULL;
  uint8_t *dq = NULL, *dref = NULL;
  float *dqs = NULL, *drefs = NULL;
  cudaMalloc(&dc, cbytes);
  cudaMalloc(&dg, cbytes);
  cudaMalloc(&du, cbytes);
  cudaMalloc(&dq, qbytes);
  cudaMalloc(&dref, qbytes);
  cudaMalloc(&dqs, sbytes);
  cudaMalloc(&drefs, sbytes);
  MOK_REQUIRE(da && dbg && dbu && dsa && dsg && dsu && dw && doffs && dc && dg && du && dq &&
              dref && dqs && drefs);
  mok_grouped_gemm_params_t p =
      gemm_params(MOK_GG_FP8_BLOCK, MOK_GG_EPI_SWIGLU, G, M, N, K, da, dbg, doffs, dc);
  p.b2 = dbu, p.a_scale = dsa, p.a_scale_ld = ld, p.b_scale = dsg, p.b2_scale = dsu;
  p.row_scale = dw, p.g_out = dg, p.u_out = du;
  cudaMemset(dc, 0xFF, cbytes);
  cudaMemset(dg, 0xFF, cbytes);  // poisoned as in the runs below: rows outside the groups compare
  cudaMemset(du, 0xFF, cbytes);
  MOK_REQUIRE(mok_grouped_gemm_launch(&p, NULL) == MOK_SUCCESS);
  MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<uint16_t> g0((size_t)M * N), u0((size_t)M * N), g1((size_t)M * N), u1((size_t)M * N);
  cudaMemcpy(g0.data(), dg, cbytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(u0.data(), du, cbytes, cudaMemcpyDeviceToHost);
  const mok_quant_scale_t kinds[2] = {MOK_QUANT_FP32_SCALE, MOK_QUANT_POW2_SCALE};
  for (int v = 0; v < 4; v++) {
    const mok_quant_scale_t kind = kinds[v % 2];
    mok_quantize_params_t qp;  // the quantizer on the bf16 a
    memset(&qp, 0, sizeof(qp));
    qp.in = dc, qp.count = 1, qp.rows = M, qp.cols = N, qp.block_rows = 1, qp.block_cols = 128;
    qp.kind = kind, qp.q = dref, qp.scales = drefs, qp.scales_ld = ld;
    MOK_REQUIRE_MSG(mok_quantize_launch(&qp, NULL) == MOK_SUCCESS, "%s", mok_last_error());
    mok_grouped_gemm_params_t q = p;
    q.c = NULL, q.c_q = dq, q.c_q_scale = dqs, q.c_q_ld = ld, q.c_q_kind = kind;
    q.num_sms = v < 2 ? 5 : 0;
    cudaMemset(dq, 0x5A, qbytes);
    cudaMemset(dqs, 0x5A, sbytes);
    cudaMemset(dg, 0xFF, cbytes);
    cudaMemset(du, 0xFF, cbytes);
    const mokResult_t res = mok_grouped_gemm_launch(&q, NULL);
    const cudaError_t err = cudaDeviceSynchronize();
    MOK_REQUIRE_MSG(res == MOK_SUCCESS && err == cudaSuccess, "quantized a (variant %d): launch "
                    "%d, cuda %s", v, (int)res, cudaGetErrorString(err));
    std::vector<uint8_t> got((size_t)M * N), want((size_t)M * N);
    std::vector<float> got_s((size_t)NB * ld), want_s((size_t)NB * ld);
    cudaMemcpy(got.data(), dq, qbytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(want.data(), dref, qbytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(got_s.data(), dqs, sbytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(want_s.data(), drefs, sbytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(g1.data(), dg, cbytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(u1.data(), du, cbytes, cudaMemcpyDeviceToHost);
    MOK_EXPECT_MSG(g1 == g0 && u1 == u0, "quantized a (variant %d): g or u differ", v);
    int64_t bad = 0, kept = 0;
    for (int r = 0; r < M; r++) {
      const bool in = group_of_row(pr, r) >= 0;
      for (int n = 0; n < N; n++) {
        const size_t i = (size_t)r * N + n;
        if (in) bad += got[i] != want[i];
        else kept += got[i] != 0x5A;
      }
      for (int b = 0; b < NB; b++) {
        uint32_t gb, wb;
        memcpy(&gb, &got_s[(size_t)b * ld + r], 4);
        memcpy(&wb, &want_s[(size_t)b * ld + r], 4);
        if (in) bad += gb != wb;
        else kept += gb != 0x5A5A5A5Au;
      }
    }
    MOK_EXPECT_MSG(bad == 0, "quantized a (variant %d): %lld bytes or scales differ from the "
                   "quantizer's", v, (long long)bad);
    MOK_EXPECT_MSG(kept == 0, "quantized a (variant %d): %lld written outside the groups", v,
                   (long long)kept);
  }
  mok_grouped_gemm_params_t bad_p = p;  // misuse
  bad_p.c_q = dq, bad_p.c_q_scale = dqs, bad_p.c_q_ld = M - 1;
  MOK_EXPECT(mok_grouped_gemm_launch(&bad_p, NULL) == MOK_ERROR_INVALID_SHAPE);
  bad_p.c_q_ld = ld, bad_p.a_scale_ld = 0; // quantized a needs K-block-major scales
  MOK_EXPECT(mok_grouped_gemm_launch(&bad_p, NULL) == MOK_ERROR_INVALID_VALUE);
  void *bufs[] = {da, dbg, dbu, dsa, dsg, dsu, dw, doffs, dc, dg, du, dq, dref, dqs, drefs};
  for (void *b : bufs) cudaFree(b);
}

MOK_TEST(gemm_fp8_block_swiglu_quantized_a_equals_quantizer) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_fp8_swiglu_quantized(make_problem(256, 384, {0, 1, 127, 128, 129, 0, 70}, 5, 37));
  check_fp8_swiglu_quantized(make_problem(128, 128, {5, 0, 40}, 2, 3));
}

// A second segment: acc = A·B + A2·B2 with K-block-major activation scales over both. Bitwise the
// one-segment GEMM of [A A2] and [B B2] (the same blocks in the same order), and within
// check_fp8's tolerance of the fp64 sum; bf16 and fp32 outputs; rows outside every group
// untouched.
static void check_fp8_segments(const problem_t &pr, int K2, mok_gg_epilogue_t epi) {
  const int G = pr.G, M = pr.M, N = pr.N, K = pr.K, KB = K / 128, KB2 = K2 / 128, NB = N / 128;
  const int KT = K + K2, KBT = KB + KB2;
  fp8_operand A((size_t)M * K, 0), A2((size_t)M * K2, 0), B((size_t)G * N * K, (size_t)G * NB * KB),
      B2((size_t)G * N * K2, (size_t)G * NB * KB2);
  const int ld = (M + 3) / 4 * 4 + 4;
  std::vector<float> sa_t((size_t)KBT * ld, NAN);
  for (int kb = 0; kb < KBT; kb++)
    for (int r = 0; r < M; r++) sa_t[(size_t)kb * ld + r] = ldexp(1.0f + 0.5f * rnd_unit(), -9);
  // the concatenation [A A2], [B B2] and its B scales
  std::vector<uint8_t> ac((size_t)M * KT), bc((size_t)G * N * KT);
  std::vector<float> sbc((size_t)G * NB * KBT);
  for (int r = 0; r < M; r++) {
    memcpy(&ac[(size_t)r * KT], &A.q[(size_t)r * K], K);
    memcpy(&ac[(size_t)r * KT + K], &A2.q[(size_t)r * K2], K2);
  }
  for (int n = 0; n < G * N; n++) {
    memcpy(&bc[(size_t)n * KT], &B.q[(size_t)n * K], K);
    memcpy(&bc[(size_t)n * KT + K], &B2.q[(size_t)n * K2], K2);
  }
  for (int nb = 0; nb < G * NB; nb++) {
    memcpy(&sbc[(size_t)nb * KBT], &B.s[(size_t)nb * KB], KB * 4);
    memcpy(&sbc[(size_t)nb * KBT + KB], &B2.s[(size_t)nb * KB2], KB2 * 4);
  }
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  uint8_t *da = to_dev(A.q), *da2 = to_dev(A2.q), *db = to_dev(B.q), *db2 = to_dev(B2.q),
          *dac = to_dev(ac), *dbc = to_dev(bc);
  float *dsb = to_dev(B.s), *dsb2 = to_dev(B2.s), *dsbc = to_dev(sbc), *dsa_t = to_dev(sa_t);
  int32_t *doffs = to_dev(offs32);
  const int f32 = epi == MOK_GG_EPI_STORE_F32;
  const size_t cbytes = (size_t)M * N * (f32 ? 4 : 2);
  void *dc = NULL;
  cudaMalloc(&dc, cbytes);
  MOK_REQUIRE(da && da2 && db && db2 && dac && dbc && dsb && dsb2 && dsbc && dsa_t && doffs && dc);
  mok_grouped_gemm_params_t p = gemm_params(MOK_GG_FP8_BLOCK, epi, G, M, N, K, da, db, doffs, dc);
  p.a2 = da2, p.b2 = db2, p.k2 = K2;
  p.a_scale = dsa_t, p.a_scale_ld = ld;
  p.b_scale = dsb, p.b2_scale = dsb2;
  p.num_sms = 5;
  mok_grouped_gemm_params_t one = gemm_params(MOK_GG_FP8_BLOCK, epi, G, M, N, KT, dac, dbc, doffs, dc);
  one.a_scale = dsa_t, one.a_scale_ld = ld, one.b_scale = dsbc;
  one.num_sms = 0;
  std::vector<uint8_t> c(cbytes), c1(cbytes);
  cudaMemset(dc, 0xFF, cbytes);
  mokResult_t res = mok_grouped_gemm_launch(&p, NULL);
  cudaError_t err = cudaDeviceSynchronize();
  MOK_REQUIRE_MSG(res == MOK_SUCCESS && err == cudaSuccess, "two segments: launch %d, cuda %s",
                  (int)res, cudaGetErrorString(err));
  cudaMemcpy(c.data(), dc, cbytes, cudaMemcpyDeviceToHost);
  cudaMemset(dc, 0xFF, cbytes);
  MOK_REQUIRE(mok_grouped_gemm_launch(&one, NULL) == MOK_SUCCESS);
  MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaMemcpy(c1.data(), dc, cbytes, cudaMemcpyDeviceToHost);
  MOK_EXPECT_MSG(c == c1, "two segments (epilogue %d) differ from the concatenated GEMM", (int)epi);
  int bad = 0;
  for (int r = 0; r < M; r++) {
    const int g = group_of_row(pr, r);
    for (int n = 0; n < N; n++) {
      const size_t i = (size_t)r * N + n;
      const double got = f32 ? ((float *)c.data())[i] : bf2f(((uint16_t *)c.data())[i]);
      if (g < 0) {
        const int kept = f32 ? ((uint32_t *)c.data())[i] == 0xFFFFFFFFu
                             : ((uint16_t *)c.data())[i] == 0xFFFF;
        if (!kept && bad++ < 5) mok_test_fail(__FILE__, __LINE__, "row %d (no group) written", r);
        continue;
      }
      double sq = 0;
      const double ref = fp8_dot(&ac[(size_t)r * KT], &sa_t[r], ld, &bc[((size_t)g * N + n) * KT],
                                 &sbc[((size_t)g * NB + n / 128) * KBT], KBT, &sq);
      const double tol = 0x1p-8 * sqrt(sq) + (f32 ? 1e-6 : 0x1p-7) * fabs(ref);
      if (!(fabs(got - ref) <= tol) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "two segments (%d,%d): got %.6g, ref %.6g (tol %.3g)",
                      r, n, got, ref, tol);
    }
  }
  MOK_EXPECT_MSG(bad == 0, "two segments (epilogue %d): %d bad elements", (int)epi, bad);
  cudaFree(da); cudaFree(da2); cudaFree(db); cudaFree(db2); cudaFree(dac); cudaFree(dbc);
  cudaFree(dsb); cudaFree(dsb2); cudaFree(dsbc); cudaFree(dsa_t); cudaFree(doffs); cudaFree(dc);
}

MOK_TEST(gemm_fp8_block_two_segments_equal_one) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  // segments of 1 + 2 and 2 + 2 blocks: the switch lands inside a pair of steps and at its start
  const problem_t pr = make_problem(256, 128, {0, 1, 127, 128, 129, 0, 70}, 5, 37);
  check_fp8_segments(pr, 256, MOK_GG_EPI_STORE_BF16);
  check_fp8_segments(pr, 256, MOK_GG_EPI_STORE_F32);
  check_fp8_segments(make_problem(128, 256, {5, 0, 40}, 2, 3), 256, MOK_GG_EPI_STORE_BF16);
}

/* ---------------------------------------------------------------------------------------------- */
/* MXFP8 B (bf16 A, e4m3 B with 1x32 E8M0 scales, dequantized to bf16 in shared memory)            */
/* ---------------------------------------------------------------------------------------------- */

// C = A · deq(B)ᵀ (+ A2 · deq(B2)ᵀ with k2 > 0) against fp64 sums. Every product of a bf16 and an
// e4m3 value times a power of two is exact in fp32 (8 + 4 significant bits), so the GPU's only
// errors are fp32 additions, at most about K · 2^-24 of Σ|t| (atol 2^-12 Σ|t|, far above that),
// and the output's rounding (bf16: 2^-8 |ref|). A wrong scale, chunk or swizzle gives errors of
// the order of the terms. Rows outside every group stay untouched; 5 CTAs and one per SM give
// the same bits. N = 384 makes each group's second column tile read the next group's B rows and
// the last group's read past B (zero-filled, their scales not loaded). Rows of subnormal e4m3
// values and scales above 2^7 take the conversion's two rare paths (gemm/grouped_gemm_mx.cuh).
static void check_mx(const problem_t &pr, int K2, mok_gg_epilogue_t epi) {
  const int G = pr.G, M = pr.M, N = pr.N, K = pr.K, KT = K + K2;
  std::vector<uint16_t> a((size_t)M * K), a2((size_t)M * (K2 ? K2 : 1));
  std::vector<uint8_t> b((size_t)G * N * K), b2((size_t)G * N * (K2 ? K2 : 1));
  std::vector<uint8_t> sb((size_t)G * N * (K / 32)), sb2((size_t)G * N * (K2 ? K2 / 32 : 1));
  fill_bf16(a, 1.0f);
  fill_bf16(a2, 1.0f);
  for (auto &v : b) v = rnd_e4m3();
  for (auto &v : b2) v = rnd_e4m3();
  // every 7th row of B only e4m3 subnormals (flushed ones would zero those columns, far outside
  // the tolerance, which scales with the row's own terms), and
  // scales 2^-9 .. 2^2, with 2^9 .. 2^10 (past bf16's 2^127 once times 2^120) in every 5th row
  for (size_t r = 3; r < (size_t)G * N; r += 7)
    for (int k = 0; k < K; k++) b[r * K + k] &= 0x87;
  for (auto &v : sb) v = (uint8_t)(118 + test_rng_u32(&g_rng) % 12);
  for (auto &v : sb2) v = (uint8_t)(118 + test_rng_u32(&g_rng) % 12);
  for (size_t r = 1; r < (size_t)G * N; r += 5) sb[r * (K / 32)] = (uint8_t)(136 + r % 2);
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  const int f32 = epi == MOK_GG_EPI_STORE_F32;
  const size_t cbytes = (size_t)M * N * (f32 ? 4 : 2);
  uint16_t *da = to_dev(a), *da2 = to_dev(a2);
  uint8_t *db = to_dev(b), *db2 = to_dev(b2), *dsb = to_dev(sb), *dsb2 = to_dev(sb2);
  int32_t *doffs = to_dev(offs32);
  void *dc = NULL;
  cudaMalloc(&dc, cbytes);
  MOK_REQUIRE(da && da2 && db && db2 && dsb && dsb2 && doffs && dc);
  mok_grouped_gemm_params_t p = gemm_params(MOK_GG_MXFP8_B, epi, G, M, N, K, da, db, doffs, dc);
  p.b_e8m0 = dsb;
  if (K2) p.a2 = da2, p.b2 = db2, p.k2 = K2, p.b2_e8m0 = dsb2;
  p.num_sms = 5;
  std::vector<uint8_t> c(cbytes), c2(cbytes);
  cudaMemset(dc, 0xFF, cbytes);
  mokResult_t res = mok_grouped_gemm_launch(&p, NULL);
  cudaError_t err = cudaDeviceSynchronize();
  MOK_REQUIRE_MSG(res == MOK_SUCCESS && err == cudaSuccess, "MXFP8 B: launch %d, cuda %s",
                  (int)res, cudaGetErrorString(err));
  cudaMemcpy(c.data(), dc, cbytes, cudaMemcpyDeviceToHost);
  p.num_sms = 0;
  cudaMemset(dc, 0xFF, cbytes);
  MOK_REQUIRE(mok_grouped_gemm_launch(&p, NULL) == MOK_SUCCESS);
  MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaMemcpy(c2.data(), dc, cbytes, cudaMemcpyDeviceToHost);
  MOK_EXPECT_MSG(c == c2, "MXFP8 B (epilogue %d, K2 %d): a CTA per SM differs", (int)epi, K2);
  int bad = 0;
  for (int r = 0; r < M; r++) {
    const int g = group_of_row(pr, r);
    for (int n = 0; n < N; n++) {
      const size_t i = (size_t)r * N + n;
      const double got = f32 ? ((float *)c.data())[i] : bf2f(((uint16_t *)c.data())[i]);
      if (g < 0) {
        const int kept = f32 ? ((uint32_t *)c.data())[i] == 0xFFFFFFFFu
                             : ((uint16_t *)c.data())[i] == 0xFFFF;
        if (!kept && bad++ < 5) mok_test_fail(__FILE__, __LINE__, "row %d (no group) written", r);
        continue;
      }
      const size_t brow = (size_t)g * N + n;
      double ref = 0, mag = 0;
      for (int k = 0; k < KT; k++) {
        const int s = k >= K;  // the second segment
        const int kk = s ? k - K : k, ks = s ? K2 : K;
        const double t = bf2f((s ? a2 : a)[(size_t)r * ks + kk]) *
                         e4m3_to_double((s ? b2 : b)[brow * ks + kk]) *
                         ldexp(1.0, (int)(s ? sb2 : sb)[brow * (ks / 32) + kk / 32] - 127);
        ref += t;
        mag += fabs(t);
      }
      const double tol = 0x1p-12 * mag + (f32 ? 0.0 : 0x1p-8) * fabs(ref);
      if (!(fabs(got - ref) <= tol) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "MXFP8 B (%d,%d): got %.6g, ref %.6g (tol %.3g)", r, n,
                      got, ref, tol);
    }
  }
  MOK_EXPECT_MSG(bad == 0, "MXFP8 B (epilogue %d, K2 %d): %d bad elements", (int)epi, K2, bad);
  cudaFree(da); cudaFree(da2); cudaFree(db); cudaFree(db2); cudaFree(dsb); cudaFree(dsb2);
  cudaFree(doffs); cudaFree(dc);
}

MOK_TEST(gemm_mx_b_matches_host) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  const problem_t pr = make_problem(384, 192, {130, 0, 1, 75}, 3, 5);
  check_mx(pr, 0, MOK_GG_EPI_STORE_F32);
  check_mx(pr, 0, MOK_GG_EPI_STORE_BF16);
  check_mx(pr, 128, MOK_GG_EPI_STORE_F32);  // a second segment: 3 + 2 K blocks
  check_mx(make_problem(256, 64, {200, 64}, 0, 0), 64, MOK_GG_EPI_STORE_BF16);
}
