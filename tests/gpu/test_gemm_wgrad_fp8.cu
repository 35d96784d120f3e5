/*
 * test_gemm_wgrad_fp8.cu: tests of the fp8-block weight gradients: the operands' quantizer
 * (mok_wgrad_padded_offsets_launch, mok_quantize_cols_launch, src/cuda/quant/quantize_cols.cu)
 * and the fp8 k-grouped GEMM (mok_grouped_wgrad_launch with MOK_GG_FP8_BLOCK,
 * src/cuda/gemm/grouped_wgrad_fp8.cuh).
 *
 *   - the quantizer against mok_quantize_host on each group's rows (128x1 blocks of the group's
 *     [rows, n] slice), bit for bit, both scale kinds: bytes, scales, the zeros of the padding,
 *     and the padded offsets; rows outside every group hold NaN and must never be read;
 *   - the GEMM against an fp64 sum of the dequantized operands (the bytes and scales the
 *     quantizer made, checked above), every epilogue, grids of 7 CTAs and of all SMs bitwise
 *     equal, bf16 bitwise the rounding of the fp32 result, accumulation bitwise c0 + the fp32
 *     result, empty groups zero (stores) or untouched (accumulation);
 *   - the launchers' error codes (without a GPU too).
 *
 * GEMM tolerance, as test_gemm_fp8.cu derives it for the same accumulator: the products of e4m3
 * values are exact in fp32, but the tensor cores add a K block's 128 products into an accumulator
 * that keeps about 14 mantissa bits (DeepSeek-V3's report; the reason for the promotion every 128
 * rows), aligned to the largest addend, so a block's error is about 2^-14 · 128 times its largest
 * term, which the terms' L2 norm bounds: atol = 2^-8 · sqrt(Σ term²) over the group's rows, for
 * fp32 results, plus 2^-8 |ref| (half a bf16 ulp) for bf16 ones. A block whose largest term
 * dominates shows it: with the rows of b scaled by 300 below, errors reached 2^-11 of Σ |term|
 * (a bound of 2^-12 · Σ |term| failed). A wrong scale or operand tile errs by whole terms.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cuda/quant/quant.h"
#include "gemm_test_util.h"

static const uint16_t BF16_NAN = 0x7FC0;

/* ---------------------------------------------------------------------------------------------- */
/* Launcher validation (no GPU needed)                                                             */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(gemm_wgrad_fp8_launchers_reject_bad_arguments) {
  char buf[64] __attribute__((aligned(16)));
  void *ok = buf;
  mok_grouped_wgrad_params_t base;
  memset(&base, 0, sizeof(base));
  base.dtype = MOK_GG_FP8_BLOCK;
  base.epilogue = MOK_GG_EPI_STORE_F32;
  base.num_groups = 4;
  base.m_total = 1024;
  base.n = 128;
  base.k = 256;
  base.a = base.b = base.offsets = ok;
  base.c = ok;
  base.a_scale = base.b_scale = (const float *)ok;
  mok_grouped_wgrad_params_t p;
  p = base; p.a_scale = NULL;   MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.b_scale = NULL;   MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.offsets_int64 = 1;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.m_total = 1000;   MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.n = 192;          MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.k = 64;           MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.a_scale = (const float *)(buf + 4);
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.dtype = MOK_GG_MXFP8_B;
  MOK_EXPECT(mok_grouped_wgrad_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);

  mok_quantize_cols_params_t q;
  memset(&q, 0, sizeof(q));
  q.x = ok;
  q.m_total = 300;
  q.n = 128;
  q.offsets = ok;
  q.num_groups = 3;
  q.padded = (const int32_t *)ok;
  q.q = (uint8_t *)ok;
  q.scales = (float *)ok;
  q.ld = mok_wgrad_padded_rows_max(300, 3);
  MOK_EXPECT(q.ld == 640);
  mok_quantize_cols_params_t b;
  MOK_EXPECT(mok_quantize_cols_launch(NULL, NULL) == MOK_ERROR_NULL_POINTER);
  b = q; b.x = NULL;            MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_NULL_POINTER);
  b = q; b.padded = NULL;       MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_NULL_POINTER);
  b = q; b.n = 96;              MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_INVALID_SHAPE);
  b = q; b.ld = 512;            MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_INVALID_SHAPE);
  b = q; b.ld = 700;            MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_INVALID_SHAPE);
  b = q; b.num_groups = 0;      MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_INVALID_SHAPE);
  b = q; b.kind = MOK_QUANT_E8M0_SCALE;
  MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_INVALID_VALUE);
  b = q; b.q = (uint8_t *)(buf + 8);
  MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_MISALIGNED);
  b = q; b.m_total = ((int64_t)1 << 31) - 200;
  b.ld = mok_wgrad_padded_rows_max(b.m_total, 3);
  MOK_EXPECT(mok_quantize_cols_launch(&b, NULL) == MOK_ERROR_INVALID_SHAPE);  // padded >= 2^31
  MOK_EXPECT(mok_wgrad_padded_offsets_launch(ok, 0, 3, 300, NULL, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_wgrad_padded_offsets_launch(NULL, 0, 3, 300, (int32_t *)ok, NULL) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_wgrad_padded_offsets_launch(ok, 2, 3, 300, (int32_t *)ok, NULL) ==
             MOK_ERROR_INVALID_VALUE);
}

/* ---------------------------------------------------------------------------------------------- */
/* The quantizer and the GEMM against the host                                                    */
/* ---------------------------------------------------------------------------------------------- */

// One operand on the device and its transposed e4m3 copy, as the layer would make it.
typedef struct {
  std::vector<uint16_t> x;    // [M, n] bf16 (NaN outside the groups)
  std::vector<uint8_t> q;     // [n, ld]
  std::vector<float> s;       // [ld / 128, n]
  uint8_t *dq;
  float *ds;
  int n;
} col_operand_t;

static std::vector<int32_t> host_padded(const problem_t &pr) {
  std::vector<int32_t> pad(pr.G + 1, 0);
  for (int g = 0; g < pr.G; g++)
    pad[g + 1] = pad[g] + (int32_t)((pr.offs[g + 1] - pr.offs[g] + 127) / 128 * 128);
  return pad;
}

// Quantizes x's columns on the device and checks bytes, scales and padding against
// mok_quantize_host on every group's rows, adding the mismatches to *bad_out.
static void quantize_and_check(const problem_t &pr, col_operand_t *op, const void *doffs,
                               const int32_t *dpad, int64_t ld, mok_quant_scale_t kind,
                               int *bad_out) {
  const int n = op->n;
  uint16_t *dx = to_dev(op->x);
  cudaMalloc(&op->dq, (size_t)n * ld);
  cudaMalloc(&op->ds, (size_t)(ld / 128) * n * 4);
  MOK_REQUIRE(dx && op->dq && op->ds);
  cudaMemset(op->dq, 0xEE, (size_t)n * ld);  // poison: the padding must be written as zeros
  mok_quantize_cols_params_t p;
  memset(&p, 0, sizeof(p));
  p.x = dx;
  p.m_total = pr.M;
  p.n = n;
  p.offsets = doffs;
  p.num_groups = pr.G;
  p.padded = dpad;
  p.q = op->dq;
  p.scales = op->ds;
  p.ld = ld;
  p.kind = kind;
  const mokResult_t r = mok_quantize_cols_launch(&p, NULL);
  const cudaError_t err = cudaDeviceSynchronize();
  MOK_REQUIRE_MSG(r == MOK_SUCCESS && err == cudaSuccess, "quantize: %d, cuda %s", (int)r,
                  cudaGetErrorString(err));
  op->q.resize((size_t)n * ld);
  op->s.resize((size_t)(ld / 128) * n);
  cudaMemcpy(op->q.data(), op->dq, op->q.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(op->s.data(), op->ds, op->s.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(dx);

  const std::vector<int32_t> pad = host_padded(pr);
  int bad = 0;
  for (int g = 0; g < pr.G; g++) {
    const int64_t lo = pr.offs[g], rows = pr.offs[g + 1] - lo;
    if (rows == 0) continue;
    std::vector<float> in((size_t)rows * n);
    for (size_t i = 0; i < in.size(); i++) in[i] = bf2f(op->x[(size_t)lo * n + i]);
    std::vector<uint8_t> hq(in.size());
    std::vector<float> hs((size_t)((rows + 127) / 128) * n);
    MOK_REQUIRE(mok_quantize_host(in.data(), rows, n, 128, 1, kind, hq.data(), hs.data()) ==
                MOK_SUCCESS);
    for (int c = 0; c < n; c++) {
      for (int64_t i = 0; i < pad[g + 1] - pad[g]; i++) {
        const uint8_t got = op->q[(size_t)c * ld + pad[g] + i];
        const uint8_t want = i < rows ? hq[(size_t)i * n + c] : 0;
        if (got != want && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "group %d column %d row %lld: byte %02x, host %02x",
                        g, c, (long long)i, got, want);
      }
      for (int64_t b = 0; b < (rows + 127) / 128; b++) {
        const float got = op->s[(size_t)(pad[g] / 128 + b) * n + c], want = hs[b * n + c];
        if (memcmp(&got, &want, 4) != 0 && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "group %d column %d block %lld: scale %a, host %a",
                        g, c, (long long)b, got, want);
      }
    }
  }
  *bad_out += bad;
}

static mokResult_t run_fp8_wgrad(const problem_t &pr, mok_gg_epilogue_t epi, int64_t ld,
                                 const col_operand_t &a, const col_operand_t &b,
                                 const int32_t *dpad, void *dc, int num_sms) {
  mok_grouped_wgrad_params_t p;
  memset(&p, 0, sizeof(p));
  p.dtype = MOK_GG_FP8_BLOCK;
  p.epilogue = epi;
  p.num_groups = pr.G;
  p.m_total = ld;
  p.n = a.n;
  p.k = b.n;
  p.a = a.dq;
  p.b = b.dq;
  p.a_scale = a.ds;
  p.b_scale = b.ds;
  p.offsets = dpad;
  p.c = dc;
  p.num_sms = num_sms;
  return mok_grouped_wgrad_launch(&p, NULL);
}

// The dequantized value of element (c, padded row j) of an operand.
static double deq(const col_operand_t &o, int64_t ld, int c, int64_t j) {
  return (double)e4m3_to_double(o.q[(size_t)c * ld + j]) * (double)o.s[(size_t)(j / 128) * o.n + c];
}

static void check_fp8_wgrad(const problem_t &pr, mok_quant_scale_t kind) {
  const int G = pr.G, N = pr.N, K = pr.K;
  col_operand_t a, b;
  a.n = N;
  b.n = K;
  a.x.resize((size_t)pr.M * N);
  b.x.resize((size_t)pr.M * K);
  fill_bf16(a.x, 1.0f);
  fill_bf16(b.x, 0.25f);
  for (int r = 0; r < pr.M; r++) {  // a column of small values and a row of large ones too
    if (group_of_row(pr, r) < 0) {
      for (int c = 0; c < N; c++) a.x[(size_t)r * N + c] = BF16_NAN;
      for (int c = 0; c < K; c++) b.x[(size_t)r * K + c] = BF16_NAN;
      continue;
    }
    a.x[(size_t)r * N + 5] = f2bf(bf2f(a.x[(size_t)r * N + 5]) * 0x1p-20f);
    if (r % 97 == 3)
      for (int c = 0; c < K; c++) b.x[(size_t)r * K + c] = f2bf(bf2f(b.x[(size_t)r * K + c]) * 300);
  }
  std::vector<int32_t> offs32(pr.offs.begin(), pr.offs.end());
  int32_t *doffs = to_dev(offs32), *dpad = NULL;
  const int64_t ld = mok_wgrad_padded_rows_max(pr.M, G);
  cudaMalloc(&dpad, (G + 1) * 4);
  MOK_REQUIRE(doffs && dpad);
  MOK_REQUIRE(mok_wgrad_padded_offsets_launch(doffs, 0, G, pr.M, dpad, NULL) == MOK_SUCCESS);
  std::vector<int32_t> pad(G + 1);
  MOK_REQUIRE(cudaMemcpy(pad.data(), dpad, (G + 1) * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  MOK_EXPECT_MSG(pad == host_padded(pr), "padded offsets differ from the host's");
  int bad = 0;
  quantize_and_check(pr, &a, doffs, dpad, ld, kind, &bad);
  quantize_and_check(pr, &b, doffs, dpad, ld, kind, &bad);
  MOK_EXPECT_MSG(bad == 0, "quantizer: %d mismatches", bad);

  // fp64 reference of the dequantized operands, and the scale of its roundings
  const size_t nc = (size_t)G * N * K;
  std::vector<double> ref(nc, 0.0), mag(nc, 0.0);  // Σ term, Σ term²
  for (int g = 0; g < G; g++)
    for (int n = 0; n < N; n++)
      for (int64_t j = pad[g]; j < pad[g + 1]; j++) {
        const double an = deq(a, ld, n, j);
        if (an == 0.0) continue;
        double *rr = &ref[((size_t)g * N + n) * K], *mm = &mag[((size_t)g * N + n) * K];
        for (int k = 0; k < K; k++) {
          const double v = an * deq(b, ld, k, j);
          rr[k] += v;
          mm[k] += v * v;
        }
      }

  std::vector<float> c0(nc);
  for (size_t i = 0; i < nc; i++) c0[i] = rnd_unit();
  float *dc0 = to_dev(c0);
  void *dc[2] = {NULL, NULL};
  cudaMalloc(&dc[0], nc * 4);
  cudaMalloc(&dc[1], nc * 4);
  MOK_REQUIRE(dc0 && dc[0] && dc[1]);
  std::vector<float> f32(nc), acc(nc), f2(nc);
  std::vector<uint16_t> bf(nc), b2(nc);
  const mok_gg_epilogue_t epis[3] = {MOK_GG_EPI_STORE_F32, MOK_GG_EPI_STORE_BF16,
                                     MOK_GG_EPI_ACCUM_F32};
  for (int ei = 0; ei < 3; ei++) {
    const mok_gg_epilogue_t epi = epis[ei];
    const size_t bytes = nc * (epi == MOK_GG_EPI_STORE_BF16 ? 2 : 4);
    for (int run = 0; run < 2; run++) {
      if (epi == MOK_GG_EPI_ACCUM_F32) {
        cudaMemcpy(dc[run], dc0, bytes, cudaMemcpyDeviceToDevice);
        for (int g = 0; g < G; g++)  // empty groups must stay untouched: poison them
          if (pr.offs[g + 1] == pr.offs[g])
            cudaMemset((float *)dc[run] + (size_t)g * N * K, 0xFF, (size_t)N * K * 4);
      } else {
        cudaMemset(dc[run], 0xFF, bytes);
      }
      const mokResult_t r = run_fp8_wgrad(pr, epi, ld, a, b, dpad, dc[run], run ? 0 : 7);
      const cudaError_t err = cudaDeviceSynchronize();
      MOK_REQUIRE_MSG(r == MOK_SUCCESS && err == cudaSuccess, "epi %d: launch %d, cuda %s",
                      (int)epi, (int)r, cudaGetErrorString(err));
    }
    void *h0 = epi == MOK_GG_EPI_STORE_BF16 ? (void *)bf.data()
               : epi == MOK_GG_EPI_STORE_F32 ? (void *)f32.data() : (void *)acc.data();
    void *h1 = epi == MOK_GG_EPI_STORE_BF16 ? (void *)b2.data() : (void *)f2.data();
    cudaMemcpy(h0, dc[0], bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(h1, dc[1], bytes, cudaMemcpyDeviceToHost);
    MOK_EXPECT_MSG(memcmp(h0, h1, bytes) == 0, "epi %d: grids of 7 and all SMs differ bitwise",
                   (int)epi);
  }

  double worst = 0;
  for (int g = 0; g < G; g++) {
    const bool empty = pr.offs[g + 1] == pr.offs[g];
    for (size_t i = (size_t)g * N * K; i < (size_t)(g + 1) * N * K; i++) {
      if (empty) {  // stores: zeros; accumulate: the poison, untouched
        uint32_t au;
        memcpy(&au, &acc[i], 4);
        if ((f32[i] != 0.0f || bf[i] != 0 || au != 0xFFFFFFFFu) && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "empty group %d: f32 %g bf16 %04x acc %08x", g,
                        f32[i], bf[i], au);
        continue;
      }
      const double r = ref[i], tol = 0x1p-8 * sqrt(mag[i]) + 1e-30;
      const double ef = fabs((double)f32[i] - r);
      if (ef / tol > worst || ef != ef) worst = ef / tol;
      if (!(ef <= tol) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "f32 group %d (%zu, %zu): got %.9g, ref %.9g, tol %.3g",
                      g, (i / K) % N, i % K, f32[i], r, tol);
      if (!(fabs((double)bf2f(bf[i]) - r) <= tol + 0x1p-8 * fabs(r)) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "bf16 group %d: got %g, ref %g", g, bf2f(bf[i]), r);
      if (bf[i] != f2bf(f32[i]) && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "bf16 %04x is not bf16(f32 %g)", bf[i], f32[i]);
      const float want = c0[i] + f32[i];
      if (memcmp(&want, &acc[i], 4) != 0 && bad++ < 5)
        mok_test_fail(__FILE__, __LINE__, "accumulate: got %g, want %g + %g", acc[i], c0[i],
                      f32[i]);
    }
  }
  printf("    G=%d N=%d K=%d M=%d kind %d: worst |err| / tol %.3g\n", G, N, K, pr.M, (int)kind,
         worst);
  MOK_EXPECT_MSG(bad == 0, "%d bad elements", bad);
  cudaFree(doffs); cudaFree(dpad); cudaFree(a.dq); cudaFree(a.ds); cudaFree(b.dq);
  cudaFree(b.ds); cudaFree(dc0); cudaFree(dc[0]); cudaFree(dc[1]);
}

// G = 6: 100 rows (one partial block), an empty group, 1 row, 333 rows (3 blocks, the last
// partial), 128 rows (exactly one block), 257; 3 NaN rows before the groups and 29 after.
MOK_TEST(gemm_wgrad_fp8_matches_host_n256_k384) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_fp8_wgrad(make_problem(256, 384, {100, 0, 1, 333, 128, 257}, 3, 29), MOK_QUANT_FP32_SCALE);
}
MOK_TEST(gemm_wgrad_fp8_matches_host_pow2_n384_k128_empty_first) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_fp8_wgrad(make_problem(384, 128, {0, 65, 640, 0, 200}, 0, 0), MOK_QUANT_POW2_SCALE);
}
MOK_TEST(gemm_wgrad_fp8_all_groups_empty) {
  if (!test_gpu_present()) MOK_SKIP("no CUDA device");
  check_fp8_wgrad(make_problem(128, 128, {0, 0, 0}, 10, 50), MOK_QUANT_FP32_SCALE);
}
