/*
 * test_gemm_fp8.cu: the fp8-block path of the grouped GEMM (e4m3 operands, 1x128 activation and
 * 128x128 weight scales, promotion every 128 reduction elements) against fp64 sums on the host;
 * ragged and empty groups, rows outside every group untouched, bitwise run to run, whatever
 * the CTA count and whichever layout the activation scales come in.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "gemm_test_util.h"

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
