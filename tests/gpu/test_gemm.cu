/*
 * test_gemm.cu: tests of the persistent grouped GEMM (src/cuda/gemm/grouped_gemm.cu).
 *
 * Small shapes against a CPU reference written here (fp64 sums of the bf16 operands), large ones
 * against cuBLAS (cublasGemmEx per group, fp32 accumulation); every epilogue; ragged, empty and
 * unused rows; bitwise equality run to run; the launcher's error codes (those run without a GPU).
 *
 * Tolerance, bf16 outputs: |gpu - ref| <= atol + 2^-7 |ref| (one bf16 rounding of the result plus
 * fp32 accumulation-order noise, which atol = 1e-3 * sqrt(K) * scale covers for unit-scale
 * operands). fp32 outputs: |gpu - ref| <= 1e-4 * sqrt(K) + 1e-5 |ref| (order of fp32 sums only).
 * Outputs are poisoned with 0xFF bytes (a NaN in bf16 and fp32) before each run; rows that belong
 * to no group must still hold the poison afterwards.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "gemm_test_util.h"

/* ---------------------------------------------------------------------------------------------- */
/* Launcher validation (no GPU needed)                                                             */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(gemm_launcher_rejects_bad_arguments) {
  char buf[64] __attribute__((aligned(16)));
  void *ok = buf;
  mok_grouped_gemm_params_t base;
  memset(&base, 0, sizeof(base));
  base.dtype = MOK_GG_BF16;
  base.b_layout = MOK_GG_B_KMAJOR;
  base.epilogue = MOK_GG_EPI_STORE_BF16;
  base.num_groups = 4;
  base.m_total = 256;
  base.n = 128;
  base.k = 128;
  base.a = base.b = base.offsets = ok;
  base.c = ok;

  mok_grouped_gemm_params_t p;
  MOK_EXPECT(mok_grouped_gemm_launch(NULL, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.a = NULL;        MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.c = NULL;        MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.offsets = NULL;  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.epilogue = MOK_GG_EPI_SWIGLU;  // no b2
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.k = 100;         MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.k = 0;           MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.n = 12;          MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.num_groups = 0;  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.num_groups = 3000000;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.m_total = -1;    MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.a = buf + 8;     MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.c = buf + 2;     MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.offsets_int64 = 1; p.offsets = buf + 4;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.epilogue = (mok_gg_epilogue_t)9;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.dtype = (mok_gg_dtype_t)7;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.dtype = MOK_GG_FP8_BLOCK;  // no scales
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  const float *fs = (const float *)ok;
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.a_scale = p.b_scale = fs; p.n = 136;  // N % 128
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.a_scale = p.b_scale = fs; p.k = 192;  // K % 128
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.a_scale = fs; p.b_scale = (const float *)(buf + 2);
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  // K-block-major a_scale: its row stride covers m_total, in 16-byte steps, from a 16-byte base
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.a_scale = p.b_scale = fs; p.a_scale_ld = 252;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.a_scale = p.b_scale = fs; p.a_scale_ld = 258;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.b_scale = fs; p.a_scale = (const float *)(buf + 4);
  p.a_scale_ld = 256;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  // fp8 SwiGLU needs up's scales; a second fp8 segment K-block-major scales over both segments,
  // K2 % 128 == 0 and a storing epilogue
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.a_scale = p.b_scale = fs;
  p.epilogue = MOK_GG_EPI_SWIGLU; p.b2 = ok;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.a_scale = p.b_scale = p.b2_scale = fs;
  p.k2 = 128; p.a2 = p.b2 = ok;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p.a_scale_ld = 256; p.k2 = 192;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p.k2 = 128; p.epilogue = MOK_GG_EPI_ACCUM_F32;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NOT_IMPLEMENTED);
  p.epilogue = MOK_GG_EPI_STORE_F32; p.b2_scale = NULL;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.dtype = MOK_GG_FP8_BLOCK; p.a_scale = p.b_scale = fs; p.b_layout = MOK_GG_B_NMAJOR;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NOT_IMPLEMENTED);
  // MXFP8 B: its E8M0 scales (up's with SwiGLU, B2's with a second segment), K % 64 == 0,
  // K-major B and a storing epilogue
  const uint8_t *e8 = (const uint8_t *)ok;
  p = base; p.dtype = MOK_GG_MXFP8_B;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p.b_e8m0 = e8; p.k = 96;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p.k = base.k; p.epilogue = MOK_GG_EPI_SWIGLU; p.b2 = ok;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p.epilogue = MOK_GG_EPI_ACCUM_F32;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NOT_IMPLEMENTED);
  p.epilogue = base.epilogue; p.b_layout = MOK_GG_B_NMAJOR;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NOT_IMPLEMENTED);
  p.b_layout = MOK_GG_B_KMAJOR; p.k2 = 64; p.a2 = p.b2 = ok;  // no b2_e8m0
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.b_layout = MOK_GG_B_NMAJOR; p.k = 72;  // N-major B needs K % 64 == 0
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.b_layout = MOK_GG_B_NMAJOR; p.epilogue = MOK_GG_EPI_SWIGLU; p.b2 = ok;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NOT_IMPLEMENTED);
  // a second reduction segment (a2, b2, k2): bf16 with N-major B, K2 % 64 == 0, both operands
  p = base; p.k2 = 64; p.a2 = p.b2 = ok;  // K-major bf16 B
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NOT_IMPLEMENTED);
  p = base; p.b_layout = MOK_GG_B_NMAJOR; p.k2 = 64; p.b2 = ok;  // no a2
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.b_layout = MOK_GG_B_NMAJOR; p.k2 = 64; p.a2 = ok;  // no b2
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.b_layout = MOK_GG_B_NMAJOR; p.k2 = 96; p.a2 = p.b2 = ok;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.b_layout = MOK_GG_B_NMAJOR; p.k2 = -64; p.a2 = p.b2 = ok;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.b_layout = MOK_GG_B_NMAJOR; p.k2 = 64; p.b2 = ok; p.a2 = buf + 8;
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.m_total = 0;  // nothing to do: succeeds without touching the device
  MOK_EXPECT(mok_grouped_gemm_launch(&p, NULL) == MOK_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------- */
/* Small shapes against the CPU reference                                                          */
/* ---------------------------------------------------------------------------------------------- */

// Runs one epilogue on `pr` and checks it against fp64 sums on the host. Returns failures seen.
static void check_small(const problem_t &pr, mok_gg_epilogue_t epi, int offsets_int64,
                        int with_gu = 1, int nmajor = 0, int group_m = 0) {
  const int G = pr.G, M = pr.M, N = pr.N, K = pr.K;
  const int swiglu = epi == MOK_GG_EPI_SWIGLU;
  std::vector<uint16_t> a((size_t)M * K), b((size_t)G * N * K), b2(swiglu ? (size_t)G * N * K : 1);
  std::vector<float> w(M);
  fill_bf16(a, 1.0f);
  fill_bf16(b, 1.0f);
  if (swiglu) fill_bf16(b2, 1.0f);
  for (int r = 0; r < M; r++) w[r] = 0.5f + 0.5f * rnd_unit();
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());

  const int out_f32 = epi == MOK_GG_EPI_STORE_F32 || epi == MOK_GG_EPI_ACCUM_F32;
  const size_t esz = out_f32 ? 4 : 2, cbytes = (size_t)M * N * esz;
  std::vector<float> c_init((size_t)M * N);
  for (size_t i = 0; i < c_init.size(); i++) c_init[i] = rnd_unit();

  uint16_t *da = to_dev(a), *db = to_dev(b), *db2 = swiglu ? to_dev(b2) : NULL;
  float *dw = to_dev(w), *dinit = to_dev(c_init);
  void *doffs = offsets_int64 ? (void *)to_dev(pr.offs) : (void *)to_dev(offs32);
  void *dc = NULL, *dg = NULL, *du = NULL;
  cudaMalloc(&dc, cbytes + 16);
  cudaMalloc(&dg, (size_t)M * N * 2 + 16);
  cudaMalloc(&du, (size_t)M * N * 2 + 16);
  MOK_REQUIRE(da && db && dw && doffs && dc && dg && du && (!swiglu || db2));
  cudaMemset(dc, 0xFF, cbytes);
  cudaMemset(dg, 0xFF, (size_t)M * N * 2);
  cudaMemset(du, 0xFF, (size_t)M * N * 2);
  if (epi == MOK_GG_EPI_ACCUM_F32) cudaMemcpy(dc, dinit, cbytes, cudaMemcpyDeviceToDevice);

  mok_grouped_gemm_params_t p = gemm_params(MOK_GG_BF16, epi, G, M, N, K, da, db, doffs, dc);
  p.b_layout = nmajor ? MOK_GG_B_NMAJOR : MOK_GG_B_KMAJOR;  // b holds [G, K, N] when N-major
  p.offsets_int64 = offsets_int64;
  p.b2 = db2;
  p.row_scale = dw;
  p.g_out = swiglu && with_gu ? dg : NULL;
  p.u_out = swiglu && with_gu ? du : NULL;
  p.num_sms = 7;  // few CTAs: each walks many tiles and groups
  p.group_m = group_m;
  mokResult_t res = mok_grouped_gemm_launch(&p, NULL);
  cudaError_t err = cudaDeviceSynchronize();
  MOK_REQUIRE_MSG(res == MOK_SUCCESS && err == cudaSuccess, "launch %d, cuda %s", (int)res,
                  cudaGetErrorString(err));

  std::vector<uint8_t> c(cbytes);
  std::vector<uint16_t> gh((size_t)M * N), uh((size_t)M * N);
  cudaMemcpy(c.data(), dc, cbytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(gh.data(), dg, gh.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(uh.data(), du, uh.size() * 2, cudaMemcpyDeviceToHost);

  int bad = 0;
  double worst = 0;
  const double atol_bf = 1e-3 * sqrt((double)K), atol_f32 = 1e-4 * sqrt((double)K);
  for (int r = 0; r < M; r++) {
    const int g = group_of_row(pr, r);
    for (int n = 0; n < N; n++) {
      const size_t i = (size_t)r * N + n;
      if (g < 0) {  // no group: must keep the poison (or the initial value when accumulating)
        int kept;
        if (epi == MOK_GG_EPI_ACCUM_F32) kept = !memcmp(&c[i * 4], &c_init[i], 4);
        else kept = out_f32 ? ((uint32_t *)c.data())[i] == 0xFFFFFFFFu
                            : ((uint16_t *)c.data())[i] == 0xFFFF;
        if (swiglu && with_gu) kept = kept && gh[i] == 0xFFFF && uh[i] == 0xFFFF;
        if (!kept && bad++ < 5) mok_test_fail(__FILE__, __LINE__, "row %d (no group) written", r);
        continue;
      }
      double s = 0, s2 = 0;
      const uint16_t *ar = &a[(size_t)r * K];
      for (int k = 0; k < K; k++) {
        const size_t bi = nmajor ? ((size_t)g * K + k) * N + n : ((size_t)g * N + n) * K + k;
        s += (double)bf2f(ar[k]) * bf2f(b[bi]);
      }
      if (swiglu) {
        const uint16_t *ur = &b2[((size_t)g * N + n) * K];
        for (int k = 0; k < K; k++) s2 += (double)bf2f(ar[k]) * bf2f(ur[k]);
      }
      double ref, got, tol;
      if (epi == MOK_GG_EPI_STORE_BF16) {
        ref = s;
        got = bf2f(((uint16_t *)c.data())[i]);
        tol = atol_bf + 0x1p-7 * fabs(ref);
      } else if (out_f32) {
        ref = s + (epi == MOK_GG_EPI_ACCUM_F32 ? c_init[i] : 0.0);
        got = ((float *)c.data())[i];
        tol = atol_f32 + 1e-5 * fabs(ref);
      } else {
        ref = w[r] * silu(s) * s2;
        got = bf2f(((uint16_t *)c.data())[i]);
        tol = atol_bf * (1 + fabs(s) + fabs(s2)) + 0x1p-7 * fabs(ref);
        const double eg = fabs(bf2f(gh[i]) - s), eu = fabs(bf2f(uh[i]) - s2);
        if (with_gu && (!(eg <= atol_bf + 0x1p-7 * fabs(s)) || !(eu <= atol_bf + 0x1p-7 * fabs(s2)))) {
          if (bad++ < 5)
            mok_test_fail(__FILE__, __LINE__, "g/u at (%d,%d): %g %g vs %g %g", r, n, bf2f(gh[i]),
                          bf2f(uh[i]), s, s2);
        }
      }
      const double e = fabs(got - ref);
      if (e > worst) worst = e;
      if (!(e <= tol) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "epi %d at (%d,%d) group %d: got %g, ref %g", (int)epi,
                      r, n, g, got, ref);
    }
  }
  MOK_EXPECT_MSG(bad == 0, "epilogue %d (group_m %d): %d bad elements, worst error %g", (int)epi,
                 group_m, bad, worst);
  cudaFree(da); cudaFree(db); cudaFree(db2); cudaFree(dw); cudaFree(dinit); cudaFree(doffs);
  cudaFree(dc); cudaFree(dg); cudaFree(du);
}

// check_small with each of gemm_group_ms.
static void check_small_bands(const problem_t &pr, mok_gg_epilogue_t epi, int offsets_int64,
                              int with_gu = 1, int nmajor = 0) {
  for (int i = 0; i < GEMM_GROUP_MS; i++)
    check_small(pr, epi, offsets_int64, with_gu, nmajor, gemm_group_ms[i]);
}

// Groups of 0, 1, 127, 128, 129, 300 rows, an empty last group, rows before and after the groups;
// N = 384 (a full and a half column tile, whose B box runs into the next group), K = 200 (a K tail).
static problem_t ragged_small(void) { return make_problem(384, 200, {0, 1, 127, 128, 129, 0, 300, 0}, 5, 37); }

MOK_TEST(gemm_bf16_store_bf16_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small_bands(ragged_small(), MOK_GG_EPI_STORE_BF16, 0);
}
MOK_TEST(gemm_bf16_store_bf16_int64_offsets) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small_bands(make_problem(256, 64, {64, 0, 200}, 0, 0), MOK_GG_EPI_STORE_BF16, 1);
}
MOK_TEST(gemm_bf16_store_f32_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small_bands(ragged_small(), MOK_GG_EPI_STORE_F32, 0);
}
MOK_TEST(gemm_bf16_accum_f32_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small_bands(ragged_small(), MOK_GG_EPI_ACCUM_F32, 1);
}
MOK_TEST(gemm_bf16_swiglu_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small_bands(make_problem(256, 192, {0, 3, 200, 128, 0, 77}, 9, 20), MOK_GG_EPI_SWIGLU, 0);
}
MOK_TEST(gemm_bf16_swiglu_without_gu_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small_bands(make_problem(384, 128, {0, 3, 200, 128, 0, 77, 64}, 9, 20), MOK_GG_EPI_SWIGLU,
                    1, 0);
}
MOK_TEST(gemm_bf16_nmajor_b_matches_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  problem_t pr = make_problem(384, 192, {0, 1, 127, 128, 129, 0, 300, 0}, 5, 37);
  check_small_bands(pr, MOK_GG_EPI_STORE_BF16, 0, 1, 1);
  check_small_bands(pr, MOK_GG_EPI_STORE_F32, 0, 1, 1);
  check_small_bands(pr, MOK_GG_EPI_ACCUM_F32, 1, 1, 1);
}

MOK_TEST(gemm_bf16_all_groups_empty) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small(make_problem(128, 64, {0, 0, 0}, 10, 50), MOK_GG_EPI_STORE_BF16, 0);
}

/* ---------------------------------------------------------------------------------------------- */
/* Large shapes against cuBLAS, and run-to-run determinism                                         */
/* ---------------------------------------------------------------------------------------------- */

// ref [M, N] fp32 (rows of no group untouched) = A_g · B_gᵀ per group through cublasGemmEx.
static int cublas_grouped(cublasHandle_t h, const problem_t &pr, const uint16_t *da,
                          const uint16_t *db, float *dref) {
  const float one = 1.0f, zero = 0.0f;
  for (int g = 0; g < pr.G; g++) {
    const int m = (int)(pr.offs[g + 1] - pr.offs[g]);
    if (m == 0) continue;
    // column-major view: ref_gᵀ [N, m] = (B_g as [K, N])ᵀ · (A_g as [K, m])
    cublasStatus_t st = cublasGemmEx(
        h, CUBLAS_OP_T, CUBLAS_OP_N, pr.N, m, pr.K, &one, db + (size_t)g * pr.N * pr.K,
        CUDA_R_16BF, pr.K, da + (size_t)pr.offs[g] * pr.K, CUDA_R_16BF, pr.K, &zero,
        dref + (size_t)pr.offs[g] * pr.N, CUDA_R_32F, pr.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) return 1;
  }
  return 0;
}

MOK_TEST(gemm_bf16_large_matches_cublas_and_is_deterministic) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  // 16 experts, skewed: one takes ~40% of the rows, some are empty, sizes not multiples of 128.
  problem_t pr = make_problem(1536, 2048, {5000, 0, 17, 1000, 2048, 513, 128, 255, 0, 1, 700,
                                           1300, 64, 999, 333, 1},
                              3, 100);
  const int M = pr.M, N = pr.N, K = pr.K, G = pr.G;
  std::vector<uint16_t> a((size_t)M * K), b((size_t)G * N * K), u((size_t)G * N * K);
  fill_bf16(a, 1.0f);
  fill_bf16(b, 0.05f);
  fill_bf16(u, 0.05f);
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  std::vector<float> w(M);
  for (int r = 0; r < M; r++) w[r] = 0.5f + 0.5f * rnd_unit();
  uint16_t *da = to_dev(a), *db = to_dev(b), *du = to_dev(u);
  int32_t *doffs = to_dev(offs32);
  float *dw = to_dev(w), *dref = NULL, *drefu = NULL;
  uint16_t *dc = NULL, *dc2 = NULL;
  cudaMalloc(&dref, (size_t)M * N * 4);
  cudaMalloc(&drefu, (size_t)M * N * 4);
  cudaMalloc(&dc, (size_t)M * N * 2);
  cudaMalloc(&dc2, (size_t)M * N * 2);
  MOK_REQUIRE(da && db && du && doffs && dw && dref && drefu && dc && dc2);
  cublasHandle_t h;
  MOK_REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  MOK_REQUIRE(cublas_grouped(h, pr, da, db, dref) == 0);
  pr.N = N;
  problem_t pu = pr;
  MOK_REQUIRE(cublas_grouped(h, pu, da, du, drefu) == 0);

  mok_grouped_gemm_params_t p =
      gemm_params(MOK_GG_BF16, MOK_GG_EPI_STORE_BF16, G, M, N, K, da, db, doffs, dc);
  std::vector<uint16_t> c((size_t)M * N), c2((size_t)M * N), first_plain, first_swiglu;
  std::vector<float> ref((size_t)M * N), refu((size_t)M * N);
  cudaMemcpy(ref.data(), dref, ref.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(refu.data(), drefu, refu.size() * 4, cudaMemcpyDeviceToHost);

  for (int epi_i = 0; epi_i < 2 * GEMM_GROUP_MS; epi_i++) {
    const int swiglu = epi_i & 1, group_m = gemm_group_ms[epi_i / 2];
    p.group_m = group_m;
    p.epilogue = swiglu ? MOK_GG_EPI_SWIGLU : MOK_GG_EPI_STORE_BF16;
    p.b2 = swiglu ? du : NULL;
    p.row_scale = swiglu ? dw : NULL;
    // run twice, each into poisoned memory; the two results must be bitwise equal
    char msg[128];
    MOK_REQUIRE_MSG(gemm_run_twice(&p, dc, dc2, c, c2, msg, sizeof(msg)) == 0, "%s", msg);
    MOK_EXPECT_MSG(memcmp(c.data(), c2.data(), c.size() * 2) == 0,
                   "epilogue %d (group_m %d): two runs differ bitwise", (int)p.epilogue,
                   group_m);
    if (epi_i >= 2) {  // every tile order gives the same bits (same K order, same roundings)
      MOK_EXPECT_MSG(memcmp(c.data(), swiglu ? first_swiglu.data() : first_plain.data(),
                            c.size() * 2) == 0,
                     "epilogue %d: group_m %d differs bitwise from group_m %d", (int)p.epilogue,
                     group_m, gemm_group_ms[0]);
    } else {
      (swiglu ? first_swiglu : first_plain) = c;
    }
    int bad = 0;
    double worst = 0, sum_e2 = 0, sum_r2 = 0;
    for (int row = 0; row < M; row++) {
      const int g = group_of_row(pr, row);
      for (int n = 0; n < N; n++) {
        const size_t i = (size_t)row * N + n;
        if (g < 0) {
          if (c[i] != 0xFFFF && bad++ < 5)
            mok_test_fail(__FILE__, __LINE__, "row %d (no group) written", row);
          continue;
        }
        const double gg = ref[i], uu = refu[i];
        const double rv = swiglu ? w[row] * silu(gg) * uu : gg;
        const double tol = 2e-3 * (swiglu ? 1 + fabs(gg) + fabs(uu) : 1.0) + 0x1p-7 * fabs(rv);
        const double e = fabs(bf2f(c[i]) - rv);
        sum_e2 += e * e;
        sum_r2 += rv * rv;
        if (e > worst) worst = e;
        if (!(e <= tol) && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "epi %d (%d,%d): got %g, cuBLAS %g", (int)p.epilogue,
                        row, n, bf2f(c[i]), rv);
      }
    }
    printf("    epilogue %d (group_m %d) vs cuBLAS: worst |err| %.3g, relative L2 %.3g\n",
           (int)p.epilogue, group_m, worst, sqrt(sum_e2 / (sum_r2 + 1e-30)));
    MOK_EXPECT_MSG(bad == 0, "epilogue %d (group_m %d): %d bad elements", (int)p.epilogue,
                   group_m, bad);
  }
  cublasDestroy(h);
  cudaFree(da); cudaFree(db); cudaFree(du); cudaFree(doffs); cudaFree(dw);
  cudaFree(dref); cudaFree(drefu); cudaFree(dc); cudaFree(dc2);
}

// B N-major ([G, K, N], what backward reads: dy·Wd with Wd [E, H, I]) against cuBLAS.
MOK_TEST(gemm_bf16_nmajor_large_matches_cublas) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  problem_t pr = make_problem(1280, 1536, {3000, 0, 17, 1000, 2048, 513, 128, 255, 1}, 7, 50);
  const int M = pr.M, N = pr.N, K = pr.K, G = pr.G;
  std::vector<uint16_t> a((size_t)M * K), b((size_t)G * K * N);  // b [G, K, N]
  fill_bf16(a, 1.0f);
  fill_bf16(b, 0.05f);
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  uint16_t *da = to_dev(a), *db = to_dev(b), *dc = NULL, *dc2 = NULL;
  int32_t *doffs = to_dev(offs32);
  float *dref = NULL;
  cudaMalloc(&dref, (size_t)M * N * 4);
  cudaMalloc(&dc, (size_t)M * N * 2);
  cudaMalloc(&dc2, (size_t)M * N * 2);
  MOK_REQUIRE(da && db && doffs && dref && dc && dc2);
  cublasHandle_t h;
  MOK_REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  const float one = 1.0f, zero = 0.0f;
  for (int g = 0; g < G; g++) {
    const int m = (int)(pr.offs[g + 1] - pr.offs[g]);
    if (m == 0) continue;
    // column-major: refᵀ [N, m] = (B_g as [N, K], ld N) · (A_g as [K, m], ld K)
    MOK_REQUIRE(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, m, K, &one,
                             db + (size_t)g * K * N, CUDA_R_16BF, N,
                             da + (size_t)pr.offs[g] * K, CUDA_R_16BF, K, &zero,
                             dref + (size_t)pr.offs[g] * N, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  }
  std::vector<float> ref((size_t)M * N);
  cudaMemcpy(ref.data(), dref, ref.size() * 4, cudaMemcpyDeviceToHost);
  mok_grouped_gemm_params_t p =
      gemm_params(MOK_GG_BF16, MOK_GG_EPI_STORE_BF16, G, M, N, K, da, db, doffs, NULL);
  p.b_layout = MOK_GG_B_NMAJOR;
  std::vector<uint16_t> c((size_t)M * N), c2((size_t)M * N), first;
  for (int gi = 0; gi < GEMM_GROUP_MS; gi++) {
    p.group_m = gemm_group_ms[gi];
    char msg[128];
    MOK_REQUIRE_MSG(gemm_run_twice(&p, dc, dc2, c, c2, msg, sizeof(msg)) == 0, "%s", msg);
    MOK_EXPECT_MSG(memcmp(c.data(), c2.data(), c.size() * 2) == 0,
                   "group_m %d: runs differ bitwise", p.group_m);
    if (gi == 0) first = c;  // every tile order gives the same bits
    MOK_EXPECT_MSG(c == first, "group_m %d differs bitwise from group_m %d", p.group_m,
                   gemm_group_ms[0]);
    int bad = 0;
    double worst = 0;
    for (int row = 0; row < M; row++) {
      const int g = group_of_row(pr, row);
      for (int n = 0; n < N; n++) {
        const size_t i = (size_t)row * N + n;
        if (g < 0) {
          if (c[i] != 0xFFFF && bad++ < 5)
            mok_test_fail(__FILE__, __LINE__, "row %d (no group) written", row);
          continue;
        }
        const double e = fabs(bf2f(c[i]) - ref[i]);
        if (e > worst) worst = e;
        if (!(e <= 2e-3 + 0x1p-7 * fabs(ref[i])) && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "(%d,%d): got %g, cuBLAS %g", row, n, bf2f(c[i]),
                        ref[i]);
      }
    }
    printf("    N-major B (group_m %d) vs cuBLAS: worst |err| %.3g\n", p.group_m, worst);
    MOK_EXPECT_MSG(bad == 0, "group_m %d: %d bad elements", p.group_m, bad);
  }
  cublasDestroy(h);
  cudaFree(da); cudaFree(db); cudaFree(doffs); cudaFree(dref); cudaFree(dc); cudaFree(dc2);
}


// A second reduction segment (a2, b2, k2; the backward's dxk = dg·Wg + du·Wu) is the GEMM of the
// operands concatenated along K, [A A2] and [B; B2] per group: bitwise, since the kernel runs
// the same K blocks in the same order into one accumulator. Both stores the backward uses (bf16
// dxk, fp32 dxs), every tile order; the concatenated GEMM itself is checked above against cuBLAS.
MOK_TEST(gemm_bf16_second_segment_is_the_concatenated_gemm) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  problem_t pr = make_problem(768, 320, {700, 0, 130, 1, 256, 64, 300}, 5, 20);
  const int M = pr.M, N = pr.N, K = pr.K, G = pr.G, K2 = 192, KC = K + K2;
  std::vector<uint16_t> a((size_t)M * K), a2((size_t)M * K2), b((size_t)G * K * N),
      b2((size_t)G * K2 * N);
  fill_bf16(a, 1.0f);
  fill_bf16(a2, 1.0f);
  fill_bf16(b, 0.05f);
  fill_bf16(b2, 0.05f);
  std::vector<uint16_t> ac((size_t)M * KC), bc((size_t)G * KC * N);  // [A A2], [B; B2] per group
  for (int r = 0; r < M; r++) {
    memcpy(&ac[(size_t)r * KC], &a[(size_t)r * K], (size_t)K * 2);
    memcpy(&ac[(size_t)r * KC + K], &a2[(size_t)r * K2], (size_t)K2 * 2);
  }
  for (int g = 0; g < G; g++) {
    memcpy(&bc[(size_t)g * KC * N], &b[(size_t)g * K * N], (size_t)K * N * 2);
    memcpy(&bc[((size_t)g * KC + K) * N], &b2[(size_t)g * K2 * N], (size_t)K2 * N * 2);
  }
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  uint16_t *da = to_dev(a), *da2 = to_dev(a2), *db = to_dev(b), *db2 = to_dev(b2);
  uint16_t *dac = to_dev(ac), *dbc = to_dev(bc);
  int32_t *doffs = to_dev(offs32);
  void *dc = NULL, *dcc = NULL;
  const size_t bytes = (size_t)M * N * 4;
  cudaMalloc(&dc, bytes);
  cudaMalloc(&dcc, bytes);
  MOK_REQUIRE(da && da2 && db && db2 && dac && dbc && doffs && dc && dcc);
  const mok_gg_epilogue_t epis[2] = {MOK_GG_EPI_STORE_BF16, MOK_GG_EPI_STORE_F32};
  std::vector<uint8_t> c(bytes), cc(bytes);
  for (int ei = 0; ei < 2; ei++)
    for (int gi = 0; gi < GEMM_GROUP_MS; gi++) {
      mok_grouped_gemm_params_t p =
          gemm_params(MOK_GG_BF16, epis[ei], G, M, N, K, da, db, doffs, dc);
      p.b_layout = MOK_GG_B_NMAJOR;
      p.a2 = da2, p.b2 = db2, p.k2 = K2;
      p.group_m = gemm_group_ms[gi];
      p.num_sms = 11;
      mok_grouped_gemm_params_t q =
          gemm_params(MOK_GG_BF16, epis[ei], G, M, N, KC, dac, dbc, doffs, dcc);
      q.b_layout = MOK_GG_B_NMAJOR;
      q.group_m = gemm_group_ms[gi];
      cudaMemset(dc, 0xFF, bytes);
      cudaMemset(dcc, 0xFF, bytes);
      const mokResult_t r1 = mok_grouped_gemm_launch(&p, NULL), r2 = mok_grouped_gemm_launch(&q, NULL);
      const cudaError_t err = cudaDeviceSynchronize();
      MOK_REQUIRE_MSG(r1 == MOK_SUCCESS && r2 == MOK_SUCCESS && err == cudaSuccess,
                      "launch %d %d, cuda %s", (int)r1, (int)r2, cudaGetErrorString(err));
      cudaMemcpy(c.data(), dc, bytes, cudaMemcpyDeviceToHost);
      cudaMemcpy(cc.data(), dcc, bytes, cudaMemcpyDeviceToHost);
      const size_t n = (size_t)M * N * (epis[ei] == MOK_GG_EPI_STORE_F32 ? 4 : 2);
      size_t diff = 0;
      for (size_t i = 0; i < n; i++) diff += c[i] != cc[i];
      MOK_EXPECT_MSG(diff == 0, "epilogue %d, group_m %d: %zu bytes differ from the "
                     "concatenated GEMM", (int)epis[ei], p.group_m, diff);
    }
  cudaFree(da); cudaFree(da2); cudaFree(db); cudaFree(db2); cudaFree(dac); cudaFree(dbc);
  cudaFree(doffs); cudaFree(dc); cudaFree(dcc);
}
