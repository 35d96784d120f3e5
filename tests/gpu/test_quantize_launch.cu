/*
 * test_quantize_launch.cu: the GPU quantizers' launchers against the host's (src/cpu/quant.c),
 * bit for bit, as test_quantize.cu checks the device functions:
 *
 *   launcher:  mok_quantize_launch for 1x128, 128x128, 1x32, 32x1 and other power-of-two blocks,
 *              plain and transposed reads, padded strides, ragged edges, random bits, several
 *              magnitudes, and special values (NaN, +-Inf, -0, huge, subnormal, rounding ties);
 *              the MXFP8 rows (quantize-dequantize, and e4m3 with packed E8M0 scales); transposed
 *              (K-block-major) scales against row-major ones
 *   layer:     mok_quantize_weights on a GPU layer equals the CPU layer's buffer byte for byte
 *              (fp8-block with fp32 and pow2 scales, MXFP8; with a shared expert)
 * GPU tests skip without a CUDA device.
 */
#include "quant_test_util.h"


/* ---------------------------------------------------------------------------------------------- */
/* The launcher                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

enum { QT_RANDOM_BITS = 0, QT_MAGNITUDES = 1, QT_SPECIALS = 2 };

// One source element in the given mode; (r, c) are the stored copy's coordinates.
static uint16_t qt_source_value(int mode, int64_t r, int64_t c, int p_row) {
  if (mode == QT_RANDOM_BITS) {  // any finite bf16: amax and the rest far apart, subnormals
    uint16_t b = (uint16_t)qt_u32();
    return (b & 0x7F80) == 0x7F80 ? (uint16_t)(b ^ 0x0080) : b;
  }
  if (mode == QT_MAGNITUDES) return f2bf(ldexpf(qt_unit(), p_row + (int)(qt_u32() % 5) - 2));
  // specials: a 448 every 16 positions along rows and columns fixes amax = 448 (scale 1 for every
  // kind) in blocks without a special, so the rounding ties land exactly on e4m3 ties
  if ((r + c) % 16 == 0) return f2bf((r & 1) ? -448.0f : 448.0f);
  const uint16_t ties[] = {
      f2bf(17.0f),    f2bf(19.0f),    f2bf(-1.0625f), f2bf(1.1875f),
      f2bf(0x1p-10f), f2bf(0x3p-10f), f2bf(-0x5p-10f), f2bf(232.0f),
      f2bf(0x1.1p-6f), 0x8000 /* -0 */,  0x0000,            0x0001 /* bf16 subnormal */,
      0x8080 /* -2^-126 */};
  const uint32_t pick = qt_u32() % 1000;
  if (pick == 0) return 0x7FC0;                             // NaN
  if (pick == 1) return 0xFFC1;                             // negative NaN with payload
  if (pick == 2) return 0x7F80;                             // +Inf
  if (pick == 3) return 0xFF80;                             // -Inf
  if (pick == 4) return 0x7F7F;                             // largest bf16, ~3.39e38
  if (pick < 300) return f2bf(ldexpf(qt_unit(), 8));     // ordinary values below 448
  return ties[qt_u32() % (sizeof(ties) / sizeof(ties[0]))];
}

typedef struct {
  int64_t count, rows, cols;
  int br, bc, transpose;
  int64_t ld_pad, stride_pad;  // extra source elements per row / per matrix
} qt_case_t;

// Runs one case on the GPU and on the host; returns 1 when q and scales agree byte for byte.
static int qt_run_case(const qt_case_t &tc, mok_quant_scale_t kind, int mode) {
  const int64_t inner = tc.transpose ? tc.rows : tc.cols, outer = tc.transpose ? tc.cols : tc.rows;
  const int64_t ld = inner + tc.ld_pad, stride = outer * ld + tc.stride_pad;
  const int64_t nbr = (tc.rows + tc.br - 1) / tc.br, nbc = (tc.cols + tc.bc - 1) / tc.bc;
  const size_t sbytes = kind == MOK_QUANT_E8M0_SCALE ? 1 : 4;
  const size_t qn = (size_t)(tc.count * tc.rows * tc.cols);
  const size_t sn = (size_t)(tc.count * nbr * nbc) * sbytes;
  std::vector<uint16_t> src((size_t)(tc.count * stride), 0x7FC0);  // padding holds NaN: never read
  for (int64_t e = 0; e < tc.count; e++)
    for (int64_t r = 0; r < tc.rows; r++) {
      const int p_row = (int)(qt_u32() % 200) - 120;
      for (int64_t c = 0; c < tc.cols; c++) {
        const int64_t off = e * stride + (tc.transpose ? c * ld + r : r * ld + c);
        src[(size_t)off] = qt_source_value(mode, r, c, p_row);
      }
    }
  // host: the stored copy in fp32, quantized matrix by matrix
  std::vector<uint8_t> hq(qn + 1), hs(sn + 1);
  std::vector<float> m((size_t)(tc.rows * tc.cols));
  for (int64_t e = 0; e < tc.count; e++) {
    for (int64_t r = 0; r < tc.rows; r++)
      for (int64_t c = 0; c < tc.cols; c++)
        m[(size_t)(r * tc.cols + c)] = mok_bf16_to_float(
            src[(size_t)(e * stride + (tc.transpose ? c * ld + r : r * ld + c))]);
    if (mok_quantize_host(m.data(), tc.rows, tc.cols, tc.br, tc.bc, kind,
                          hq.data() + e * tc.rows * tc.cols, hs.data() + e * nbr * nbc * sbytes) !=
        MOK_SUCCESS)
      return 0;
  }
  // device, outputs poisoned first so unwritten bytes show
  uint16_t *dsrc = to_dev(src);
  uint8_t *dq = NULL, *ds = NULL;
  cudaMalloc(&dq, qn + 16);
  cudaMalloc(&ds, sn + 16);
  int ok = dsrc && dq && ds && cudaMemset(dq, 0xA5, qn) == cudaSuccess &&
           cudaMemset(ds, 0xA5, sn) == cudaSuccess;
  mok_quantize_params_t p;
  memset(&p, 0, sizeof(p));
  p.in = dsrc;
  p.transpose = tc.transpose;
  p.in_ld = ld;
  p.in_stride = stride;
  p.count = tc.count;
  p.rows = tc.rows;
  p.cols = tc.cols;
  p.block_rows = tc.br;
  p.block_cols = tc.bc;
  p.kind = kind;
  p.q = dq;
  p.scales = ds;
  std::vector<uint8_t> gq(qn + 1), gs(sn + 1);
  if (ok) {
    const mokResult_t r = mok_quantize_launch(&p, NULL);
    MOK_EXPECT_MSG(r == MOK_SUCCESS, "mok_quantize_launch: %s", mok_last_error());
    ok = r == MOK_SUCCESS && cudaDeviceSynchronize() == cudaSuccess &&
         cudaMemcpy(gq.data(), dq, qn, cudaMemcpyDeviceToHost) == cudaSuccess &&
         cudaMemcpy(gs.data(), ds, sn, cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  cudaFree(dsrc);
  cudaFree(dq);
  cudaFree(ds);
  if (!ok) {
    MOK_EXPECT_MSG(0, "case %lldx%lldx%lld block %dx%d: CUDA failure", (long long)tc.count,
                   (long long)tc.rows, (long long)tc.cols, tc.br, tc.bc);
    return 0;
  }
  const long long qd = (long long)test_first_diff(gq.data(), hq.data(), qn);
  const long long sd = (long long)test_first_diff(gs.data(), hs.data(), sn);
  if (qd >= 0 || sd >= 0) {
    const long long mat = tc.rows * tc.cols;
    MOK_EXPECT_MSG(0, "count %lld rows %lld cols %lld block %dx%d transpose %d kind %d mode %d: "
                   "q first differs at [%lld, %lld, %lld] (gpu 0x%02x host 0x%02x), scales at byte "
                   "%lld", (long long)tc.count, (long long)tc.rows, (long long)tc.cols, tc.br,
                   tc.bc, tc.transpose, (int)kind, mode, qd < 0 ? -1 : qd / mat,
                   qd < 0 ? -1 : qd % mat / tc.cols, qd < 0 ? -1 : qd % tc.cols,
                   gq[qd < 0 ? 0 : qd], hq[qd < 0 ? 0 : qd], sd);
    return 0;
  }
  return 1;
}

MOK_TEST(quant_gpu_launch_matches_host) {
  QT_SKIP_WITHOUT_GPU();
  // block shapes: the library's (1x128 activations, 128x128 weights, 1x32 MXFP8), a column block
  // (32x1), and shapes that exercise every team size of quant_cta_tile128 (1, 2, 64, 128 threads)
  const int shapes[][2] = {{1, 128}, {128, 128}, {1, 32}, {32, 1}, {1, 1},
                           {2, 64},  {64, 128},  {128, 1}, {4, 16}};
  // sizes: ragged at every edge with padded strides; 16-byte aligned rows (vector stores); tiny
  const qt_case_t sizes[] = {{2, 200, 300, 0, 0, 0, 8, 24},
                             {1, 256, 384, 0, 0, 0, 0, 0},
                             {3, 5, 7, 0, 0, 0, 3, 1}};
  int cases = 0, passed = 0;
  for (const auto &sh : shapes)
    for (const qt_case_t &sz : sizes)
      for (int transpose = 0; transpose < 2; transpose++)
        for (int k = 0; k < 3; k++)
          for (int mode = 0; mode < 3; mode++) {
            qt_case_t tc = sz;
            tc.br = sh[0];
            tc.bc = sh[1];
            tc.transpose = transpose;
            cases++;
            passed += qt_run_case(tc, qt_kinds[k], mode);
          }
  MOK_EXPECT_MSG(passed == cases, "%d of %d launcher cases agree with the host", passed, cases);
}

// mok_mx_qdq_rows_launch (the MXFP8 layer's activations): each element bf16(q * 2^X) of the host's
// 1x32 E8M0 quantization (mok_quantize_host, mok_dequantize_host, round to nearest bf16), bit for
// bit (NaN: any NaN), in every source mode; in place; rows at or past rows_limit untouched.
MOK_TEST(quant_gpu_mx_qdq_matches_host) {
  QT_SKIP_WITHOUT_GPU();
  const int64_t rows = 37, cols = 384;
  const size_t n = (size_t)(rows * cols);
  int bad = 0;
  for (int mode = 0; mode < 3; mode++)
    for (int variant = 0; variant < 3; variant++) {  // separate out, in place, rows_limit 20
      std::vector<uint16_t> in(n), got(n), want(n);
      std::vector<float> f(n), deq(n);
      for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) in[(size_t)(r * cols + c)] = qt_source_value(mode, r, c, (int)(r % 9) - 4);
      for (size_t i = 0; i < n; i++) f[i] = bf2f(in[i]);
      std::vector<uint8_t> q(n), sc(n / 32);
      MOK_REQUIRE(mok_quantize_host(f.data(), rows, cols, 1, 32, MOK_QUANT_E8M0_SCALE, q.data(),
                                    sc.data()) == MOK_SUCCESS);
      MOK_REQUIRE(mok_dequantize_host(q.data(), sc.data(), rows, cols, 1, 32,
                                      MOK_QUANT_E8M0_SCALE, deq.data()) == MOK_SUCCESS);
      const int64_t limit = variant == 2 ? 20 : rows;
      for (size_t i = 0; i < n; i++)
        want[i] = (int64_t)(i / cols) < limit ? f2bf(deq[i]) : (uint16_t)0xFFFF;
      uint16_t *din = to_dev(in), *dout = NULL;
      int32_t *dlim = to_dev(std::vector<int32_t>{(int32_t)limit});
      cudaMalloc(&dout, n * 2);
      MOK_REQUIRE(din && dout && dlim);
      cudaMemset(dout, 0xFF, n * 2);
      uint16_t *dst = variant == 1 ? din : dout;
      if (variant == 2) cudaMemset(din + 20 * cols, 0xFF, (size_t)(rows - 20) * cols * 2);
      if (variant == 2) dst = din;  // in place, the rows past the limit poisoned and kept
      MOK_REQUIRE(mok_mx_qdq_rows_launch(din, dst, rows, cols, variant == 2 ? dlim : NULL, NULL) ==
                  MOK_SUCCESS);
      MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      cudaMemcpy(got.data(), dst, n * 2, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < n; i++) {
        const bool nan = (want[i] & 0x7FFF) > 0x7F80 && (int64_t)(i / cols) < limit;
        const bool ok = nan ? (got[i] & 0x7FFF) > 0x7F80 : got[i] == want[i];
        if (!ok && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "mode %d variant %d element %zu: got %04x, want %04x",
                        mode, variant, i, got[i], want[i]);
      }
      cudaFree(din);
      cudaFree(dout);
      cudaFree(dlim);
    }
  MOK_EXPECT_MSG(bad == 0, "%d elements differ from the host", bad);
  // argument checks
  uint16_t *d = NULL;
  cudaMalloc(&d, 1024);
  MOK_EXPECT(mok_mx_qdq_rows_launch(d, d, 2, 96, NULL, NULL) == MOK_ERROR_INVALID_SHAPE);
  MOK_EXPECT(mok_mx_qdq_rows_launch(NULL, d, 2, 128, NULL, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_mx_qdq_rows_launch(d + 1, d, 2, 128, NULL, NULL) == MOK_ERROR_MISALIGNED);
  MOK_EXPECT(mok_mx_qdq_rows_launch(d + 4, d, 2, 128, NULL, NULL) == MOK_ERROR_MISALIGNED);
  cudaFree(d);
}

// mok_mx_quantize_rows_launch (an expert-parallel MXFP8 layer's rows on the wire): the e4m3 bytes
// of the host's 1x32 E8M0 quantization, bit for bit, its scales four to a word (word b of row r at
// [b * ld + r], block 4b + j in byte j), the words past the rows untouched; the bf16 values, when
// asked for, bit for bit those of mok_mx_qdq_rows_launch (NaN bits included: one device function).
MOK_TEST(quant_gpu_mx_quantize_rows_matches_host) {
  QT_SKIP_WITHOUT_GPU();
  const int64_t rows = 37, cols = 384, ld = 40, nw = cols / 128;
  const size_t n = (size_t)(rows * cols);
  int bad = 0;
  for (int mode = 0; mode < 3; mode++)
    for (int with_out = 0; with_out < 2; with_out++) {
      std::vector<uint16_t> in(n), out(n), qdq(n);
      std::vector<float> f(n);
      for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
          in[(size_t)(r * cols + c)] = qt_source_value(mode, r, c, (int)(r % 9) - 4);
      for (size_t i = 0; i < n; i++) f[i] = bf2f(in[i]);
      std::vector<uint8_t> want_q(n), sc(n / 32), q(n);
      MOK_REQUIRE(mok_quantize_host(f.data(), rows, cols, 1, 32, MOK_QUANT_E8M0_SCALE,
                                    want_q.data(), sc.data()) == MOK_SUCCESS);
      std::vector<uint32_t> words((size_t)(nw * ld));
      uint16_t *din = to_dev(in), *dout = NULL, *dqdq = NULL;
      uint8_t *dq = NULL;
      uint32_t *ds = NULL;
      cudaMalloc(&dout, n * 2), cudaMalloc(&dqdq, n * 2), cudaMalloc(&dq, n);
      cudaMalloc(&ds, words.size() * 4);
      MOK_REQUIRE(din && dout && dqdq && dq && ds);
      cudaMemset(ds, 0xA5, words.size() * 4);
      cudaMemset(dout, 0xFF, n * 2);
      MOK_REQUIRE(mok_mx_quantize_rows_launch(din, dq, ds, ld, with_out ? dout : NULL, rows, cols,
                                              NULL) == MOK_SUCCESS);
      MOK_REQUIRE(mok_mx_qdq_rows_launch(din, dqdq, rows, cols, NULL, NULL) == MOK_SUCCESS);
      MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      cudaMemcpy(q.data(), dq, n, cudaMemcpyDeviceToHost);
      cudaMemcpy(words.data(), ds, words.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(out.data(), dout, n * 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(qdq.data(), dqdq, n * 2, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < n; i++)
        if (q[i] != want_q[i] && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "mode %d: q[%zu] = %02x, want %02x", mode, i, q[i],
                        want_q[i]);
      for (int64_t b = 0; b < nw; b++)
        for (int64_t r = 0; r < ld; r++) {
          uint32_t want = 0xA5A5A5A5u;
          if (r < rows) {
            want = 0;
            for (int j = 0; j < 4; j++) want |= (uint32_t)sc[(size_t)(r * (cols / 32) + 4 * b + j)] << (8 * j);
          }
          if (words[(size_t)(b * ld + r)] != want && bad++ < 5)
            mok_test_fail(__FILE__, __LINE__, "mode %d: word %lld of row %lld = %08x, want %08x",
                          mode, (long long)b, (long long)r, words[(size_t)(b * ld + r)], want);
        }
      for (size_t i = 0; i < n; i++) {
        const uint16_t want = with_out ? qdq[i] : (uint16_t)0xFFFF;  // untouched without out
        if (out[i] != want && bad++ < 5)
          mok_test_fail(__FILE__, __LINE__, "mode %d, out %d: element %zu = %04x, want %04x",
                        mode, with_out, i, out[i], want);
      }
      cudaFree(din), cudaFree(dout), cudaFree(dqdq), cudaFree(dq), cudaFree(ds);
    }
  MOK_EXPECT_MSG(bad == 0, "%d values differ", bad);
  // argument checks
  uint8_t *d = NULL;
  cudaMalloc(&d, 4096);
  uint32_t *w = (uint32_t *)(d + 2048);
  MOK_EXPECT(mok_mx_quantize_rows_launch(d, d + 1024, w, 1, NULL, 2, 128, NULL) ==
             MOK_ERROR_INVALID_SHAPE);  // scales_ld below rows
  MOK_EXPECT(mok_mx_quantize_rows_launch(d, d + 1024, w, 2, NULL, 2, 96, NULL) ==
             MOK_ERROR_INVALID_SHAPE);
  MOK_EXPECT(mok_mx_quantize_rows_launch(d, NULL, w, 2, NULL, 2, 128, NULL) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_mx_quantize_rows_launch(d, d + 1025, w, 2, NULL, 2, 128, NULL) ==
             MOK_ERROR_MISALIGNED);
  MOK_EXPECT(mok_mx_quantize_rows_launch(d, d + 1024, (uint32_t *)(d + 2050), 2, NULL, 2, 128,
                                         NULL) == MOK_ERROR_MISALIGNED);
  cudaFree(d);
}

// Transposed scales (scales_ld > 0, the fp8 GEMM's K-block-major activation scales): the same
// e4m3 values, and every scale where the row-major launch put it, transposed, with the padding
// past the block rows untouched; 2 matrices, 1x128 and 1x32 blocks, ragged rows and columns.
MOK_TEST(quant_gpu_transposed_scales_match_row_major) {
  QT_SKIP_WITHOUT_GPU();
  const int64_t count = 2, rows = 203, cols = 640, ld = 212;
  for (int bc = 32; bc <= 128; bc *= 4) {
    const mok_quant_scale_t kind = bc == 32 ? MOK_QUANT_E8M0_SCALE : MOK_QUANT_FP32_SCALE;
    const size_t sb = kind == MOK_QUANT_E8M0_SCALE ? 1 : 4, nbc = (size_t)(cols / bc);
    std::vector<uint16_t> src((size_t)(count * rows * cols));
    for (size_t i = 0; i < src.size(); i++)
      src[i] = f2bf(ldexpf(qt_unit(), (int)(i / 977 % 9) * 13 - 60));  // 2^-60 .. 2^44
    src[5 * cols + 7] = 0x7FC0;        // NaN: its block is all 0x7F
    src[9 * cols + 300] = 0xFF80;      // -Inf
    src[11 * cols + 3] = 0x0001;       // a bf16 subnormal
    for (int64_t c = 0; c < 128; c++) src[13 * cols + c] = (c & 1) ? 0x8000 : 0x0000;  // +-0
    const size_t qn = src.size(), sn = (size_t)count * rows * nbc * sb,
                 tn = (size_t)count * ld * nbc * sb;
    uint16_t *dsrc = to_dev(src);
    uint8_t *dq = NULL, *dq2 = NULL, *ds = NULL, *dt = NULL;
    cudaMalloc(&dq, qn);
    cudaMalloc(&dq2, qn);
    cudaMalloc(&ds, sn);
    cudaMalloc(&dt, tn);
    MOK_REQUIRE(dsrc && dq && dq2 && ds && dt);
    cudaMemset(dt, 0xA5, tn);
    mok_quantize_params_t p;
    memset(&p, 0, sizeof(p));
    p.in = dsrc, p.count = count, p.rows = rows, p.cols = cols;
    p.block_rows = 1, p.block_cols = bc, p.kind = kind, p.q = dq, p.scales = ds;
    mok_quantize_params_t t = p;
    t.q = dq2, t.scales = dt, t.scales_ld = ld;
    MOK_REQUIRE(mok_quantize_launch(&p, NULL) == MOK_SUCCESS);
    MOK_REQUIRE_MSG(mok_quantize_launch(&t, NULL) == MOK_SUCCESS, "%s", mok_last_error());
    MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<uint8_t> q(qn), q2(qn), hs(sn), ht(tn);
    cudaMemcpy(q.data(), dq, qn, cudaMemcpyDeviceToHost);
    cudaMemcpy(q2.data(), dq2, qn, cudaMemcpyDeviceToHost);
    cudaMemcpy(hs.data(), ds, sn, cudaMemcpyDeviceToHost);
    cudaMemcpy(ht.data(), dt, tn, cudaMemcpyDeviceToHost);
    MOK_EXPECT_MSG(q == q2, "block 1x%d: e4m3 values differ", bc);
    // and both as the host quantizes (1x128 rows of a multiple of 128 take the rows kernel)
    std::vector<uint8_t> wq(qn), ws(sn);
    std::vector<float> m((size_t)(rows * cols));
    for (int64_t e = 0; e < count; e++) {
      for (size_t i = 0; i < m.size(); i++) m[i] = mok_bf16_to_float(src[e * rows * cols + i]);
      MOK_REQUIRE(mok_quantize_host(m.data(), rows, cols, 1, bc, kind, wq.data() + e * rows * cols,
                                    ws.data() + e * rows * nbc * sb) == MOK_SUCCESS);
    }
    MOK_EXPECT_MSG(q == wq && hs == ws, "block 1x%d: the launch differs from mok_quantize_host", bc);
    int bad = 0;
    for (int64_t e = 0; e < count; e++)
      for (int64_t c = 0; c < (int64_t)nbc; c++)
        for (int64_t r = 0; r < ld; r++) {
          const uint8_t *got = &ht[((e * (int64_t)nbc + c) * ld + r) * sb];
          if (r < rows) {
            const uint8_t *want = &hs[((e * rows + r) * (int64_t)nbc + c) * sb];
            if (memcmp(got, want, sb) && bad++ < 3)
              MOK_EXPECT_MSG(0, "block 1x%d: scale (%lld, %lld, %lld) misplaced", bc,
                             (long long)e, (long long)r, (long long)c);
          } else if (got[0] != 0xA5 && bad++ < 3) {
            MOK_EXPECT_MSG(0, "block 1x%d: padding (%lld, %lld, %lld) written", bc, (long long)e,
                           (long long)r, (long long)c);
          }
        }
    MOK_EXPECT_MSG(bad == 0, "block 1x%d: %d scales wrong", bc, bad);
    if (bc == 128) {  // rows_limit (device memory): rows below it as before, none past it touched
      const int32_t lim = 150;
      int32_t *dlim = (int32_t *)test_dev_copy(&lim, sizeof(lim));
      mok_quantize_params_t u = p;
      u.count = 1, u.rows_limit = dlim;
      cudaMemset(dq2, 0xA5, qn);
      cudaMemset(dt, 0xA5, tn);
      u.q = dq2, u.scales = dt;
      MOK_EXPECT(mok_quantize_launch(&u, NULL) == MOK_SUCCESS);
      MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      std::vector<uint8_t> lq((size_t)(rows * cols)), ls((size_t)(rows * nbc) * sb);
      cudaMemcpy(lq.data(), dq2, lq.size(), cudaMemcpyDeviceToHost);
      cudaMemcpy(ls.data(), dt, ls.size(), cudaMemcpyDeviceToHost);
      int lbad = 0;
      for (size_t i = 0; i < lq.size(); i++)
        lbad += (int64_t)(i / cols) < lim ? lq[i] != q[i] : lq[i] != 0xA5;
      for (size_t i = 0; i < ls.size(); i++)
        lbad += (int64_t)(i / sb / nbc) < lim ? ls[i] != hs[i] : ls[i] != 0xA5;
      MOK_EXPECT_MSG(lbad == 0, "rows_limit: %d bytes wrong", lbad);
      u.block_cols = 32, u.kind = MOK_QUANT_E8M0_SCALE;  // another block shape: refused
      MOK_EXPECT(mok_quantize_launch(&u, NULL) == MOK_ERROR_INVALID_VALUE);
      cudaFree(dlim);
    }
    t.scales_ld = rows - 1;  // fewer than the block rows
    MOK_EXPECT(mok_quantize_launch(&t, NULL) == MOK_ERROR_INVALID_SHAPE);
    cudaFree(dsrc); cudaFree(dq); cudaFree(dq2); cudaFree(ds); cudaFree(dt);
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* mok_quantize_weights: a GPU layer against a CPU layer                                          */
/* ---------------------------------------------------------------------------------------------- */

// bf16 weights of one tensor: several magnitudes per expert, and a few special values.
static std::vector<uint16_t> qt_weights(size_t n, int p) {
  std::vector<uint16_t> w(n);
  for (size_t i = 0; i < n; i++) w[i] = f2bf(ldexpf(qt_unit(), p + (int)(i / 4096 % 7) - 3));
  w[n / 3] = 0x7FC0;   // NaN: one 128x128 block (or 1x32 block) of the copy and its transpose
  w[n / 2] = 0xFF80;   // -Inf
  w[n / 5] = 0x7F7F;   // huge
  for (size_t i = n - 300; i < n; i++) w[i] = (i & 1) ? 0x8000 : 0x0000;  // a zero tail (+-0)
  return w;
}

static void qt_check_layer(mok_precision_t prec, mok_fp8_scale_t scale, int64_t Is_ = 128) {
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = 256;
  d.intermediate = 384;
  d.num_experts = 3;
  d.top_k = 2;
  d.shared_intermediate = Is_;
  d.max_tokens = 16;
  d.precision = prec;
  d.fp8_scale = scale;
  const size_t EL = 3, H = 256, I = 384, Is = (size_t)Is_;

  mok_comm_t cg = NULL, cc = NULL;
  mok_layer_t lg = NULL, lc = NULL;
  MOK_REQUIRE(mok_comm_create_local(&cg, 0) == MOK_SUCCESS);
  MOK_REQUIRE(mok_comm_create_local(&cc, MOK_DEVICE_CPU) == MOK_SUCCESS);
  MOK_REQUIRE_MSG(mok_layer_create(&lg, cg, &d) == MOK_SUCCESS, "%s", mok_last_error());
  MOK_REQUIRE(mok_layer_create(&lc, cc, &d) == MOK_SUCCESS);
  size_t bytes = 0, bytes_c = 0;
  MOK_REQUIRE(mok_quantized_weights_size(lg, &bytes) == MOK_SUCCESS &&
              mok_quantized_weights_size(lc, &bytes_c) == MOK_SUCCESS && bytes == bytes_c &&
              bytes > 0);

  std::vector<uint16_t> h[6] = {qt_weights(EL * I * H, 0), qt_weights(EL * I * H, -20),
                                qt_weights(EL * H * I, 30)};
  if (Is > 0) h[3] = qt_weights(Is * H, -100), h[4] = qt_weights(Is * H, 5), h[5] = qt_weights(H * Is, 100);
  uint16_t *dw[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
  for (int i = 0; i < (Is > 0 ? 6 : 3); i++) {
    dw[i] = to_dev(h[i]);
    MOK_REQUIRE(dw[i]);
  }
  // without a shared expert its weights are NULL, and nothing of them is quantized
  mok_weights_t wh = {h[0].data(), h[1].data(), h[2].data(), Is ? h[3].data() : NULL,
                      Is ? h[4].data() : NULL, Is ? h[5].data() : NULL, NULL};
  mok_weights_t wd = {dw[0], dw[1], dw[2], dw[3], dw[4], dw[5], NULL};

  std::vector<uint8_t> hbuf(bytes), gbuf(bytes);
  memset(hbuf.data(), 0, bytes);  // the buffer has alignment gaps between operands
  void *dbuf = NULL;
  cudaStream_t s = NULL;
  MOK_REQUIRE(cudaMalloc(&dbuf, bytes) == cudaSuccess && cudaMemset(dbuf, 0, bytes) == cudaSuccess);
  MOK_REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

  MOK_REQUIRE_MSG(mok_quantize_weights(lc, &wh, hbuf.data(), bytes, NULL) == MOK_SUCCESS, "%s",
                  mok_last_error());
  const mokResult_t r = mok_quantize_weights(lg, &wd, dbuf, bytes, (mok_stream_t)s);
  MOK_REQUIRE_MSG(r == MOK_SUCCESS, "GPU mok_quantize_weights: %s", mok_last_error());
  MOK_REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  MOK_REQUIRE(cudaMemcpy(gbuf.data(), dbuf, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);

  mok_qw_layout_t lay;
  mok_qw_layout(&d, (int64_t)EL, &lay);
  const long long at = (long long)test_first_diff(gbuf.data(), hbuf.data(), bytes);
  if (at >= 0) {  // name the operand copy for the report
    int op = -1, in_scales = 0;
    for (int i = 0; i < MOK_QW_COUNT; i++) {
      if ((size_t)at >= lay.op[i].data) op = i, in_scales = 0;
      if ((size_t)at >= lay.op[i].scales) op = i, in_scales = 1;
    }
    MOK_EXPECT_MSG(0, "precision %d scale %d: buffers differ first at byte %lld of %zu (operand "
                   "%d, %s): gpu 0x%02x, cpu 0x%02x", (int)prec, (int)scale, at, bytes, op,
                   in_scales ? "scales" : "values", gbuf[at], hbuf[at]);
  }
  // the NaN put in each weight made NaN blocks (e4m3 0x7F arises from nothing else), so the
  // comparison covered the block rule
  MOK_EXPECT(memchr(hbuf.data() + lay.op[MOK_QW_WG].data, 0x7F, EL * I * H) != NULL);
  if (Is > 0) MOK_EXPECT(memchr(hbuf.data() + lay.op[MOK_QW_WSD_T].data, 0x7F, H * Is) != NULL);
  for (int i = MOK_QW_WSG; Is == 0 && i < MOK_QW_COUNT; i++) MOK_EXPECT(lay.op[i].count == 0);

  cudaStreamDestroy(s);
  cudaFree(dbuf);
  for (int i = 0; i < 6; i++) cudaFree(dw[i]);
  mok_layer_destroy(lg);
  mok_layer_destroy(lc);
  mok_comm_destroy(cg);
  mok_comm_destroy(cc);
}

MOK_TEST(quant_gpu_weights_match_cpu_layer) {
  QT_SKIP_WITHOUT_GPU();
  qt_check_layer(MOK_PRECISION_FP8_BLOCK, MOK_FP8_SCALE_FP32);
  qt_check_layer(MOK_PRECISION_FP8_BLOCK, MOK_FP8_SCALE_POW2);
  qt_check_layer(MOK_PRECISION_MXFP8, MOK_FP8_SCALE_FP32);
  qt_check_layer(MOK_PRECISION_FP8_BLOCK, MOK_FP8_SCALE_FP32, 0);  // no shared expert
  qt_check_layer(MOK_PRECISION_MXFP8, MOK_FP8_SCALE_FP32, 0);
}
