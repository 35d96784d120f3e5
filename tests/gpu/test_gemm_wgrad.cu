/*
 * test_gemm_wgrad.cu: tests of the k-grouped weight-gradient GEMM (src/cuda/gemm/grouped_wgrad.cu):
 * C[g] [N, K] = A_gᵀ · B_g, A [M, N], B [M, K], the groups' rows [offsets[g], offsets[g+1]).
 *
 * Small shapes against a CPU reference written here (fp64 sums of the bf16 operands), a large one
 * against cuBLAS (cublasGemmEx per group, fp32 output); every epilogue; empty groups, a group of
 * one row, groups not a multiple of the 64-row block and groups over several blocks; bitwise
 * equality run to run and across grid sizes; the launcher's error codes (those run without a GPU).
 * Stores (bf16, fp32) take the staged (TMA) kernel, accumulation the direct one.
 *
 * Rows outside every group (before offsets[0] and after offsets[G]) hold NaN in A and B: the last
 * block of the last group reads them, and they must add exactly zero (so must the next group's
 * rows read by every other group's last block, which the reference comparison checks).
 *
 * Tolerances, reduction over m rows of unit-scale operands: fp32 outputs |gpu - ref| <= 1e-4
 * sqrt(m) + 1e-5 |ref| (fp32 summation-order noise only; the products of bf16 values are exact in
 * fp32), bf16 outputs 1e-3 sqrt(m) + 2^-7 |ref| (plus one bf16 rounding of the result), as in
 * test_gemm.cu. Exact checks where the arithmetic is the same: the bf16 output is bitwise the
 * round-to-nearest-even of the fp32 output, and accumulate is bitwise c0 + (fp32 output).
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

MOK_TEST(gemm_wgrad_launcher_rejects_bad_arguments) {
  char buf[64] __attribute__((aligned(16)));
  void *ok = buf;
  mok_grouped_wgrad_params_t base;
  memset(&base, 0, sizeof(base));
  base.epilogue = MOK_GG_EPI_STORE_F32;
  base.num_groups = 4;
  base.m_total = 256;
  base.n = 128;
  base.k = 256;
  base.a = base.b = base.offsets = ok;
  base.c = ok;

  mok_grouped_wgrad_params_t p;
  MOK_EXPECT(mok_grouped_wgrad_launch(NULL, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.a = NULL;        MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.b = NULL;        MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.c = NULL;        MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.offsets = NULL;  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.n = 100;         MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.k = 12;          MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.n = 0;           MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.k = -8;          MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.num_groups = 0;  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.num_groups = 3000000;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.m_total = -1;    MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.m_total = (int64_t)1 << 31;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.num_groups = 1 << 20; p.n = 1 << 16; p.k = 1 << 16;  // > 2^31 output tiles
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.a = buf + 8;     MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.b = buf + 2;     MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.c = buf + 4;     MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.offsets = buf + 2;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.offsets_int64 = 1; p.offsets = buf + 4;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.offsets_int64 = 2;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.num_sms = -1;    MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.epilogue = (mok_gg_epilogue_t)9;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.epilogue = (mok_gg_epilogue_t)-1;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.epilogue = MOK_GG_EPI_SWIGLU;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_NOT_IMPLEMENTED);
  // no rows and accumulating: nothing to do, succeeds without touching the device
  p = base; p.m_total = 0; p.epilogue = MOK_GG_EPI_ACCUM_F32;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------- */
/* Small shapes against the CPU reference                                                          */
/* ---------------------------------------------------------------------------------------------- */

static const uint16_t BF16_NAN = 0x7FC0;

// Operands of a problem: A [M, N], B [M, K] bf16, uniform in [-sa, sa) and [-sb, sb) inside the
// groups, NaN outside.
static void make_operands(const problem_t &pr, std::vector<uint16_t> &a, std::vector<uint16_t> &b,
                          float sa = 1.0f, float sb = 1.0f) {
  a.resize((size_t)pr.M * pr.N);
  b.resize((size_t)pr.M * pr.K);
  fill_bf16(a, sa);
  fill_bf16(b, sb);
  for (int r = 0; r < pr.M; r++) {
    if (group_of_row(pr, r) >= 0) continue;
    for (int n = 0; n < pr.N; n++) a[(size_t)r * pr.N + n] = BF16_NAN;
    for (int k = 0; k < pr.K; k++) b[(size_t)r * pr.K + k] = BF16_NAN;
  }
}

// ref [G, N, K] = Σ_{r in g} A[r]ᵀ ⊗ B[r] in fp64.
static void cpu_wgrad(const problem_t &pr, const std::vector<uint16_t> &a,
                      const std::vector<uint16_t> &b, std::vector<double> &ref) {
  const int N = pr.N, K = pr.K;
  ref.assign((size_t)pr.G * N * K, 0.0);
  std::vector<double> bk(K);
  for (int g = 0; g < pr.G; g++) {
    double *cg = &ref[(size_t)g * N * K];
    for (int64_t r = pr.offs[g]; r < pr.offs[g + 1]; r++) {
      for (int k = 0; k < K; k++) bk[k] = bf2f(b[(size_t)r * K + k]);
      for (int n = 0; n < N; n++) {
        const double an = bf2f(a[(size_t)r * N + n]);
        double *row = cg + (size_t)n * K;
        for (int k = 0; k < K; k++) row[k] += an * bk[k];
      }
    }
  }
}

static mokResult_t run_wgrad(const problem_t &pr, mok_gg_epilogue_t epi, int offsets_int64,
                             const void *da, const void *db, const void *doffs, void *dc,
                             int num_sms) {
  mok_grouped_wgrad_params_t p;
  memset(&p, 0, sizeof(p));
  p.epilogue = epi;
  p.offsets_int64 = offsets_int64;
  p.num_groups = pr.G;
  p.m_total = pr.M;
  p.n = pr.N;
  p.k = pr.K;
  p.a = da;
  p.b = db;
  p.offsets = doffs;
  p.c = dc;
  p.num_sms = num_sms;
  return mok_grouped_wgrad_launch(&p, NULL);
}

// Runs the three epilogues on `pr` (fp32 store, bf16 store, fp32 accumulate onto random values),
// each twice with different grids into outputs poisoned with 0xFF bytes (NaN), and checks them
// against the CPU and against each other.
static void check_small(const problem_t &pr, int offsets_int64) {
  const int G = pr.G, N = pr.N, K = pr.K;
  const size_t nc = (size_t)G * N * K;
  std::vector<uint16_t> a, b;
  make_operands(pr, a, b);
  std::vector<double> ref;
  cpu_wgrad(pr, a, b, ref);
  std::vector<float> c0(nc);
  for (size_t i = 0; i < nc; i++) c0[i] = rnd_unit();
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());

  uint16_t *da = to_dev(a), *db = to_dev(b);
  void *doffs = offsets_int64 ? (void *)to_dev(pr.offs) : (void *)to_dev(offs32);
  float *dc0 = to_dev(c0);
  void *dc[2] = {NULL, NULL};
  cudaMalloc(&dc[0], nc * 4 + 16);
  cudaMalloc(&dc[1], nc * 4 + 16);
  MOK_REQUIRE(da && db && doffs && dc0 && dc[0] && dc[1]);

  std::vector<float> f32(nc), acc(nc), run2f(nc);
  std::vector<uint16_t> bf(nc), run2b(nc);
  const mok_gg_epilogue_t epis[3] = {MOK_GG_EPI_STORE_F32, MOK_GG_EPI_STORE_BF16,
                                     MOK_GG_EPI_ACCUM_F32};
  int bad = 0;
  for (int ei = 0; ei < 3; ei++) {
    const mok_gg_epilogue_t epi = epis[ei];
    const size_t bytes = nc * (epi == MOK_GG_EPI_STORE_BF16 ? 2 : 4);
    for (int run = 0; run < 2; run++) {
      if (epi == MOK_GG_EPI_ACCUM_F32) {
        cudaMemcpy(dc[run], dc0, bytes, cudaMemcpyDeviceToDevice);
        // empty groups must stay untouched: poison them
        for (int g = 0; g < G; g++)
          if (pr.offs[g + 1] == pr.offs[g])
            cudaMemset((float *)dc[run] + (size_t)g * N * K, 0xFF, (size_t)N * K * 4);
      } else {
        cudaMemset(dc[run], 0xFF, bytes);
      }
      // few CTAs (each walks many tiles and groups), then one per SM
      mokResult_t res = run_wgrad(pr, epi, offsets_int64, da, db, doffs, dc[run], run ? 0 : 7);
      cudaError_t err = cudaDeviceSynchronize();
      MOK_REQUIRE_MSG(res == MOK_SUCCESS && err == cudaSuccess, "epi %d: launch %d, cuda %s",
                      (int)epi, (int)res, cudaGetErrorString(err));
    }
    void *h0 = epi == MOK_GG_EPI_STORE_BF16 ? (void *)bf.data()
               : epi == MOK_GG_EPI_STORE_F32 ? (void *)f32.data() : (void *)acc.data();
    void *h1 = epi == MOK_GG_EPI_STORE_BF16 ? (void *)run2b.data() : (void *)run2f.data();
    cudaMemcpy(h0, dc[0], bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(h1, dc[1], bytes, cudaMemcpyDeviceToHost);
    MOK_EXPECT_MSG(memcmp(h0, h1, bytes) == 0,
                   "epi %d: grids of 7 and all SMs differ bitwise", (int)epi);
  }

  double worst_f32 = 0, worst_bf = 0;
  for (int g = 0; g < G; g++) {
    const int64_t m = pr.offs[g + 1] - pr.offs[g];
    const double sq = sqrt((double)(m > 0 ? m : 1));
    const double atol_f32 = 1e-4 * sq, atol_bf = 1e-3 * sq;
    for (size_t i = (size_t)g * N * K; i < (size_t)(g + 1) * N * K; i++) {
      const double r = ref[i];
      const double ef = fabs((double)f32[i] - r), eb = fabs((double)bf2f(bf[i]) - r);
      if (ef > worst_f32 || ef != ef) worst_f32 = ef;
      if (eb > worst_bf || eb != eb) worst_bf = eb;
      if (m == 0) {  // store: exact zeros; accumulate: untouched (still the poison)
        uint32_t au;
        memcpy(&au, &acc[i], 4);
        if ((f32[i] != 0.0f || bf[i] != 0 || au != 0xFFFFFFFFu) && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "empty group %d, element %zu: f32 %g bf16 %04x acc %08x",
                        g, i - (size_t)g * N * K, f32[i], bf[i], au);
        continue;
      }
      if (!(ef <= atol_f32 + 1e-5 * fabs(r)) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "f32 group %d (%zu, %zu): got %g, ref %g", g,
                      (i / K) % N, i % K, f32[i], r);
      if (!(eb <= atol_bf + 0x1p-7 * fabs(r)) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "bf16 group %d (%zu, %zu): got %g, ref %g", g,
                      (i / K) % N, i % K, bf2f(bf[i]), r);
      // same accumulator, one rounding: bitwise
      if (bf[i] != f2bf(f32[i]) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "bf16 %04x is not bf16(f32 %g)", bf[i], f32[i]);
      const float want = c0[i] + f32[i];
      if (memcmp(&want, &acc[i], 4) != 0 && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "accumulate: got %g, want %g + %g", acc[i], c0[i],
                      f32[i]);
    }
  }
  printf("    G=%d N=%d K=%d M=%d: worst |err| f32 %.3g, bf16 %.3g\n", G, N, K, pr.M, worst_f32,
         worst_bf);
  MOK_EXPECT_MSG(bad == 0, "N=%d K=%d: %d bad elements", N, K, bad);
  cudaFree(da); cudaFree(db); cudaFree(doffs); cudaFree(dc0); cudaFree(dc[0]); cudaFree(dc[1]);
}

// G = 5: 100 rows (not a multiple of 64), an empty group, 1 row, 333 rows (6 blocks, the last
// partial), 64 rows (exactly one block); 3 NaN rows before the groups and 29 after.
static problem_t ragged5(int N, int K) { return make_problem(N, K, {100, 0, 1, 333, 64}, 3, 29); }

MOK_TEST(gemm_wgrad_matches_cpu_n64_k384) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small(ragged5(64, 384), 0);
}
MOK_TEST(gemm_wgrad_matches_cpu_n384_k64) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small(ragged5(384, 64), 0);
}
MOK_TEST(gemm_wgrad_matches_cpu_n128_k256_int64_offsets) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small(ragged5(128, 256), 1);
}
MOK_TEST(gemm_wgrad_matches_cpu_n256_k128) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small(ragged5(256, 128), 0);
}
MOK_TEST(gemm_wgrad_matches_cpu_n384_k384_empty_first) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small(make_problem(384, 384, {0, 65, 127, 0, 200}, 0, 0), 0);  // no rows outside
}
MOK_TEST(gemm_wgrad_tails_n72_k136) {  // N, K not multiples of the tile or of 64
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small(make_problem(72, 136, {17, 0, 190, 1, 64}, 5, 11), 0);
}
MOK_TEST(gemm_wgrad_all_groups_empty) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_small(make_problem(128, 256, {0, 0, 0}, 10, 50), 0);
  check_small(make_problem(64, 64, {0, 0}, 0, 0), 0);  // M = 0: the store epilogues write zeros
}

/* ---------------------------------------------------------------------------------------------- */
/* Large shape against cuBLAS                                                                      */
/* ---------------------------------------------------------------------------------------------- */

// G = 16, M = 16384 rows (skewed, empty and tiny groups), N = 2048, K = 768. cuBLAS per group in
// fp32 (column-major: C[g]ᵀ [K, N] = (B_g as [K, m]) · (A_g as [N, m])ᵀ). Tolerance as for the
// small shapes with m up to 5000: the fp32 results differ only in summation order (fp32 atol
// 1e-4 sqrt(m) scaled by the operands' scales, rtol 1e-5), bf16 adds one rounding (2^-7 |ref|).
MOK_TEST(gemm_wgrad_large_matches_cublas_and_is_deterministic) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  problem_t pr = make_problem(2048, 768, {5000, 0, 17, 1000, 2048, 513, 128, 255, 0, 1, 700,
                                          1300, 64, 999, 333, 1},
                              3, 0);
  pr.M = 16384;  // the 4022 rows after the groups belong to none
  const int G = pr.G, M = pr.M, N = pr.N, K = pr.K;
  const size_t nc = (size_t)G * N * K;
  const float sa = 1.0f, sb = 0.05f;
  std::vector<uint16_t> a, b;
  make_operands(pr, a, b, sa, sb);  // NaN in the 3 rows before and the 4022 rows after the groups
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  uint16_t *da = to_dev(a), *db = to_dev(b);
  int32_t *doffs = to_dev(offs32);
  float *dref = NULL, *df = NULL, *df2 = NULL, *dacc = NULL;
  uint16_t *dbf = NULL;
  cudaMalloc(&dref, nc * 4);
  cudaMalloc(&df, nc * 4);
  cudaMalloc(&df2, nc * 4);
  cudaMalloc(&dacc, nc * 4);
  cudaMalloc(&dbf, nc * 2);
  MOK_REQUIRE(da && db && doffs && dref && df && df2 && dacc && dbf);
  MOK_REQUIRE(cudaMemset(dref, 0, nc * 4) == cudaSuccess);

  cublasHandle_t h;
  MOK_REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  const float one = 1.0f, zero = 0.0f;
  for (int g = 0; g < G; g++) {
    const int m = (int)(pr.offs[g + 1] - pr.offs[g]);
    if (m == 0) continue;  // C[g] = 0 (memset above)
    MOK_REQUIRE(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, K, N, m, &one,
                             db + (size_t)pr.offs[g] * K, CUDA_R_16BF, K,
                             da + (size_t)pr.offs[g] * N, CUDA_R_16BF, N, &zero,
                             dref + (size_t)g * N * K, CUDA_R_32F, K, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  }
  cublasDestroy(h);

  // fp32 twice (all SMs, then 37 CTAs), bf16 twice (likewise; the second run below), and
  // accumulate onto the first fp32 result
  cudaMemset(df, 0xFF, nc * 4);
  cudaMemset(df2, 0xFF, nc * 4);
  cudaMemset(dbf, 0xFF, nc * 2);
  mokResult_t r1 = run_wgrad(pr, MOK_GG_EPI_STORE_F32, 0, da, db, doffs, df, 0);
  mokResult_t r2 = run_wgrad(pr, MOK_GG_EPI_STORE_F32, 0, da, db, doffs, df2, 37);
  mokResult_t r3 = run_wgrad(pr, MOK_GG_EPI_STORE_BF16, 0, da, db, doffs, dbf, 0);
  cudaMemcpy(dacc, df, nc * 4, cudaMemcpyDeviceToDevice);
  mokResult_t r4 = run_wgrad(pr, MOK_GG_EPI_ACCUM_F32, 0, da, db, doffs, dacc, 0);
  cudaError_t err = cudaDeviceSynchronize();
  MOK_REQUIRE_MSG(r1 == MOK_SUCCESS && r2 == MOK_SUCCESS && r3 == MOK_SUCCESS &&
                      r4 == MOK_SUCCESS && err == cudaSuccess,
                  "launch %d %d %d %d, cuda %s", (int)r1, (int)r2, (int)r3, (int)r4,
                  cudaGetErrorString(err));
  std::vector<float> ref(nc), f(nc), f2(nc), acc(nc);
  std::vector<uint16_t> bf(nc), bf2(nc);
  cudaMemcpy(ref.data(), dref, nc * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(f.data(), df, nc * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(f2.data(), df2, nc * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(acc.data(), dacc, nc * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(bf.data(), dbf, nc * 2, cudaMemcpyDeviceToHost);
  MOK_EXPECT_MSG(memcmp(f.data(), f2.data(), nc * 4) == 0, "fp32: grids differ bitwise");
  cudaMemset(dbf, 0xFF, nc * 2);
  mokResult_t r5 = run_wgrad(pr, MOK_GG_EPI_STORE_BF16, 0, da, db, doffs, dbf, 37);
  err = cudaDeviceSynchronize();
  MOK_REQUIRE_MSG(r5 == MOK_SUCCESS && err == cudaSuccess, "launch %d, cuda %s", (int)r5,
                  cudaGetErrorString(err));
  cudaMemcpy(bf2.data(), dbf, nc * 2, cudaMemcpyDeviceToHost);
  MOK_EXPECT_MSG(memcmp(bf.data(), bf2.data(), nc * 2) == 0, "bf16: grids differ bitwise");

  int bad = 0;
  double worst_f = 0, worst_b = 0, e2 = 0, r2s = 0;
  const double scale = (double)sa * sb;
  for (int g = 0; g < G; g++) {
    const int64_t m = pr.offs[g + 1] - pr.offs[g];
    const double atol = 1e-4 * sqrt((double)(m > 0 ? m : 1)) * scale, atol_bf = 10 * atol;
    for (size_t i = (size_t)g * N * K; i < (size_t)(g + 1) * N * K; i++) {
      const double r = ref[i];
      const double ef = fabs((double)f[i] - r), eb = fabs((double)bf2f(bf[i]) - r);
      if (ef > worst_f || ef != ef) worst_f = ef;
      if (eb > worst_b || eb != eb) worst_b = eb;
      e2 += ef * ef;
      r2s += r * r;
      if (!(ef <= atol + 1e-5 * fabs(r)) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "f32 group %d (%zu,%zu): got %g, cuBLAS %g", g,
                      (i / K) % N, i % K, f[i], r);
      if (!(eb <= atol_bf + 0x1p-7 * fabs(r)) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "bf16 group %d (%zu,%zu): got %g, cuBLAS %g", g,
                      (i / K) % N, i % K, bf2f(bf[i]), r);
      if (bf[i] != f2bf(f[i]) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "bf16 %04x is not bf16(f32 %g)", bf[i], f[i]);
      const float want = f[i] + f[i];
      if (memcmp(&want, &acc[i], 4) != 0 && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "accumulate: got %g, want 2 x %g", acc[i], f[i]);
    }
  }
  printf("    wgrad G=%d M=%d N=%d K=%d vs cuBLAS: worst |err| f32 %.3g, bf16 %.3g, f32 "
         "relative L2 %.3g\n",
         G, M, N, K, worst_f, worst_b, sqrt(e2 / (r2s + 1e-30)));
  MOK_EXPECT_MSG(bad == 0, "%d bad elements", bad);
  cudaFree(da); cudaFree(db); cudaFree(doffs); cudaFree(dref); cudaFree(df); cudaFree(df2);
  cudaFree(dacc); cudaFree(dbf);
}
