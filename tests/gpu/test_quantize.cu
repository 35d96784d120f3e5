/*
 * test_quantize.cu: the GPU quantizers (src/cuda/quant/quantize.cuh, src/cuda/quant/quantize.cu) against the
 * host's (src/cpu/quant.c), bit for bit: every comparison is a memcmp of e4m3 bytes and of scale
 * bytes (fp32 NaN scales included), never a tolerance, because the spec (include/mok.h,
 * "Quantizers") defines one result. This file: the launcher's argument checks (they run
 * everywhere), and
 *
 *   element:   e4m3 encoding of structured fp32 patterns (every exponent; remainders just below,
 *              at and above each rounding tie; saturation; NaN, +-Inf, -0, subnormals) and of
 *              random bit patterns; decoding of all 256 codes
 *   scale:     the three scale kinds for amax at every exponent and at the 0.875 boundary,
 *              subnormal, zero, Inf, NaN; q = e4m3(v / s) for random (v, amax) pairs
 *   warp:      quant_warp_1x128 / quant_warp_1x32 on fp32 rows held in registers
 *
 * The launchers on matrices, the MXFP8 rows and the layer's weights: test_quantize_launch.cu.
 * GPU tests skip without a CUDA device.
 */
#include "quant_test_util.h"

/* ---------------------------------------------------------------------------------------------- */
/* Launcher argument checks (no GPU needed: they fail before touching the device)                 */
/* ---------------------------------------------------------------------------------------------- */

MOK_TEST(quant_launcher_rejects_bad_arguments) {
  static uint8_t buf[256] __attribute__((aligned(16)));
  mok_quantize_params_t base;
  memset(&base, 0, sizeof(base));
  base.in = buf;
  base.count = 1;
  base.rows = 4;
  base.cols = 64;
  base.block_rows = 1;
  base.block_cols = 32;
  base.kind = MOK_QUANT_FP32_SCALE;
  base.q = buf;
  base.scales = buf;
  mok_quantize_params_t p;
  MOK_EXPECT(mok_quantize_launch(NULL, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.in = NULL;      MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.q = NULL;       MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.scales = NULL;  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_NULL_POINTER);
  p = base; p.block_cols = 3; MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.block_rows = 0; MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.block_rows = 256;  // blocks must tile the 128x128 tiles
  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.kind = (mok_quant_scale_t)3;
  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.transpose = 2;  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_VALUE);
  p = base; p.rows = -1;      MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.count = -1;     MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.rows = p.cols = (int64_t)1 << 30;
  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.in_ld = 63;     MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.transpose = 1; p.in_ld = 3;  // a transposed source row holds `rows` elements
  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.count = 2; p.in_stride = 100;  // < one matrix
  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_INVALID_SHAPE);
  p = base; p.in = buf + 1;   MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.scales = buf + 2;
  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_ERROR_MISALIGNED);
  p = base; p.scales = buf + 1; p.kind = MOK_QUANT_E8M0_SCALE;  // bytes: any alignment
  p.count = 0;
  MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_SUCCESS);
  p = base; p.count = 0;      MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_SUCCESS);
  p = base; p.rows = 0;       MOK_EXPECT(mok_quantize_launch(&p, NULL) == MOK_SUCCESS);

  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = d.intermediate = 128;
  d.num_experts = 2;
  d.top_k = 1;
  d.max_tokens = 1;
  mok_weights_t w;
  memset(&w, 0, sizeof(w));
  w.wg = w.wu = w.wd = buf;
  MOK_EXPECT(mok_quantize_weights_gpu(NULL, 2, &w, buf, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_quantize_weights_gpu(&d, 2, &w, buf, NULL) == MOK_ERROR_INVALID_VALUE);  // BF16
  d.precision = MOK_PRECISION_FP8_BLOCK;
  MOK_EXPECT(mok_quantize_weights_gpu(&d, 0, &w, buf, NULL) == MOK_ERROR_INVALID_SHAPE);
  d.shared_intermediate = 128;  // wsg, wsu, wsd are NULL
  MOK_EXPECT(mok_quantize_weights_gpu(&d, 2, &w, buf, NULL) == MOK_ERROR_NULL_POINTER &&
             strstr(mok_last_error(), "wsg") != NULL);
}

/* ---------------------------------------------------------------------------------------------- */
/* Elements and scales                                                                            */
/* ---------------------------------------------------------------------------------------------- */

__global__ void qt_encode_kernel(const uint32_t *in, uint8_t *out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = quant_e4m3_from_float(__uint_as_float(in[i]));
}

__global__ void qt_decode_kernel(uint32_t *out) {
  out[threadIdx.x] = __float_as_uint(quant_e4m3_to_float((uint8_t)threadIdx.x));
}

// Per amax: the scale bits and E8M0 byte of each kind, and q of one value under that scale.
__global__ void qt_scale_kernel(const uint32_t *amax, const uint32_t *v, int n, uint32_t *scale,
                                uint8_t *e8m0, uint8_t *q) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  for (int k = 0; k < 3; k++) {
    const quant_block_t b = quant_block_make(amax[i], (mok_quant_scale_t)k);
    scale[k * n + i] = __float_as_uint(b.scale);
    e8m0[k * n + i] = b.e8m0;
    q[k * n + i] = quant_block_value(b, __uint_as_float(v[i]));
  }
}

// fp32 patterns around every rounding decision: for each sign and fp32 exponent, mantissas whose
// bits below the e4m3 cut (20 bits for normals, 21..24 in the subnormal range) are 0, 1, half - 1,
// half, half + 1 and all ones, under every kept-bit pattern; then named values and random bits.
static std::vector<uint32_t> qt_encode_patterns(void) {
  std::vector<uint32_t> v;
  for (uint32_t sign = 0; sign < 2; sign++) {
    for (uint32_t eb = 0; eb < 256; eb++) {
      for (int shift = 20; shift <= 24; shift++) {
        const uint32_t half = 1u << (shift - 1), low[6] = {0, 1, half - 1, half, half + 1,
                                                           2 * half - 1};
        // kept bits of the 23-bit field above the cut (none when shift > 23)
        const uint32_t kept = shift >= 23 ? 1 : 1u << (23 - shift);
        for (uint32_t hi = 0; hi < kept; hi++)
          for (int l = 0; l < 6; l++) {
            const uint32_t mant = ((hi << shift) | (low[l] & ((1u << shift) - 1))) & 0x7FFFFFu;
            v.push_back(sign << 31 | eb << 23 | mant);
          }
      }
    }
  }
  const float named[] = {0.0f, -0.0f, 448.0f, 464.0f, 464.00003f, 465.0f, 479.99997f, 480.0f,
                         496.0f, 511.9f, 512.0f, 1e30f, 3.4e38f, 0x1p-6f, 0x1p-7f, 0x1p-9f,
                         0x1p-10f, 0x1.0p-10f * 1.0000001f, 0x3p-10f, 0x5p-10f, 0x1p-11f,
                         0x1p-126f, 0x1p-149f, 17.0f, 19.0f, 1.0625f, 1.1875f, 240.0f, 248.0f,
                         0x1.ep-7f, 0x1.fp-7f};
  for (float f : named) {
    v.push_back(f32_bits(f));
    v.push_back(f32_bits(-f));
  }
  const uint32_t specials[] = {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00000u, 0x7F800001u,
                               0xFFBFFFFFu, 0x00000001u, 0x807FFFFFu};
  for (uint32_t s : specials) v.push_back(s);
  for (int i = 0; i < (1 << 22); i++) v.push_back(qt_u32());
  return v;
}

MOK_TEST(quant_gpu_e4m3_matches_host) {
  QT_SKIP_WITHOUT_GPU();
  const std::vector<uint32_t> in = qt_encode_patterns();
  const int64_t n = (int64_t)in.size();
  uint32_t *din = to_dev(in), *ddec = NULL;
  uint8_t *dout = NULL;
  cudaMalloc(&dout, (size_t)n);
  cudaMalloc(&ddec, 256 * 4);
  MOK_REQUIRE(din && dout && ddec);
  qt_encode_kernel<<<1024, 256>>>(din, dout, n);
  qt_decode_kernel<<<1, 256>>>(ddec);
  MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<uint8_t> out((size_t)n);
  std::vector<uint32_t> dec(256);
  MOK_REQUIRE(qt_host(out, dout) && qt_host(dec, ddec));
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    const uint8_t want = mok_e4m3_from_float(f32_of_bits(in[i]));
    if (out[i] != want && bad++ < 8)
      MOK_EXPECT_MSG(0, "e4m3(0x%08x = %g): gpu 0x%02x, host 0x%02x", in[i], f32_of_bits(in[i]),
                     out[i], want);
  }
  MOK_EXPECT_MSG(bad == 0, "%lld of %lld encodings differ", (long long)bad, (long long)n);
  for (int c = 0; c < 256; c++)
    MOK_EXPECT_MSG(dec[c] == f32_bits(mok_e4m3_to_float((uint8_t)c)),
                   "decode 0x%02x: gpu 0x%08x, host 0x%08x", c, dec[c],
                   f32_bits(mok_e4m3_to_float((uint8_t)c)));
  cudaFree(din);
  cudaFree(dout);
  cudaFree(ddec);
}

MOK_TEST(quant_gpu_block_scales_match_host) {
  QT_SKIP_WITHOUT_GPU();
  std::vector<uint32_t> amax, v;
  // every exponent, with mantissas around the POW2 boundary m = 0.875 (field 0x600000)
  const uint32_t mants[] = {0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF, 0x400000};
  for (uint32_t eb = 0; eb < 255; eb++)
    for (uint32_t m : mants) amax.push_back(eb << 23 | m);
  const uint32_t specials[] = {0x7F800000u, 0x7FC00000u, 0x7F800001u, 0x43E00000u /* 448 */,
                               0x43E00001u, 0x00000001u, 0x00400000u};
  for (uint32_t s : specials) amax.push_back(s);
  for (int i = 0; i < 1 << 16; i++) amax.push_back(qt_u32() & 0x7FFFFFFFu);  // any |value|
  // v: a value of the block, |v| <= amax (any fraction of it, any sign), or random bits
  for (size_t i = 0; i < amax.size(); i++) {
    const float a = f32_of_bits(amax[i]);
    const uint32_t r = qt_u32() % 4;
    const float small = ldexpf(fabsf(qt_unit()), -(int)(qt_u32() % 30));
    const float x = r == 0 ? a : r == 1 ? a * qt_unit() : r == 2 ? -a * small : 0.0f;
    v.push_back(r == 3 ? qt_u32() : f32_bits(isfinite(x) ? x : 1.0f));
  }
  const int n = (int)amax.size();
  uint32_t *da = to_dev(amax), *dv = to_dev(v), *ds = NULL;
  uint8_t *de = NULL, *dq = NULL;
  cudaMalloc(&ds, 3 * (size_t)n * 4);
  cudaMalloc(&de, 3 * (size_t)n);
  cudaMalloc(&dq, 3 * (size_t)n);
  MOK_REQUIRE(da && dv && ds && de && dq);
  qt_scale_kernel<<<(n + 255) / 256, 256>>>(da, dv, n, ds, de, dq);
  MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<uint32_t> s(3 * (size_t)n);
  std::vector<uint8_t> e(3 * (size_t)n), q(3 * (size_t)n);
  MOK_REQUIRE(qt_host(s, ds) && qt_host(e, de) && qt_host(q, dq));
  int bad = 0;
  for (int k = 0; k < 3; k++) {
    for (int i = 0; i < n; i++) {
      const float a = f32_of_bits(amax[i]);
      uint8_t he = 0;
      // the host's amax of a non-finite block is NaN
      const float hs = mok_block_scale(isfinite(a) ? a : NAN, qt_kinds[k], &he);
      const float x = f32_of_bits(v[i]);
      const uint8_t hq = isnan(hs) ? 0x7F : mok_e4m3_from_float(x / hs);
      const size_t j = (size_t)k * n + i;
      const bool ok = s[j] == f32_bits(hs) && q[j] == hq && (k == 0 || e[j] == he);
      if (!ok && bad++ < 8)
        MOK_EXPECT_MSG(0, "kind %d amax 0x%08x v 0x%08x: gpu s 0x%08x e8m0 %u q 0x%02x, host s "
                       "0x%08x e8m0 %u q 0x%02x", k, amax[i], v[i], s[j], e[j], q[j],
                       f32_bits(hs), he, hq);
    }
  }
  MOK_EXPECT_MSG(bad == 0, "%d of %d scale checks differ", bad, 3 * n);
  cudaFree(da);
  cudaFree(dv);
  cudaFree(ds);
  cudaFree(de);
  cudaFree(dq);
}

/* ---------------------------------------------------------------------------------------------- */
/* Warp helpers                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

// One warp per (row, 128-column chunk) of m [rows, cols] (cols % 128 == 0): 1x128 blocks when
// lanes_per_block = 32, four 1x32 blocks when 8. Scales: [rows, cols / block] fp32 or bytes.
__global__ void qt_warp_kernel(const float *m, int rows, int cols, int block32,
                               mok_quant_scale_t kind, uint32_t *q, void *scales) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int chunks = cols / 128;
  if (warp >= rows * chunks) return;  // whole warps leave together
  const int r = warp / chunks, c0 = warp % chunks * 128;
  float v[4];
  for (int i = 0; i < 4; i++) v[i] = m[(size_t)r * cols + c0 + 4 * lane + i];
  quant_block_t b;
  const uint32_t packed = block32 ? quant_warp_1x32(v, kind, &b) : quant_warp_1x128(v, kind, &b);
  q[((size_t)r * cols + c0) / 4 + lane] = packed;
  const int bc = block32 ? 32 : 128, nbc = cols / bc;
  if (lane % (bc / 4) == 0) {
    const size_t si = (size_t)r * nbc + (c0 + 4 * lane) / bc;
    if (kind == MOK_QUANT_E8M0_SCALE)
      ((uint8_t *)scales)[si] = b.e8m0;
    else
      ((float *)scales)[si] = b.scale;
  }
}

// fp32 values spanning many binades, with fp32 subnormals, ties and non-finite values in a few
// blocks (rows r % 7 == 3 get a NaN or an infinity; rows r % 5 == 1 are all zero).
static std::vector<float> qt_fp32_matrix(int rows, int cols) {
  std::vector<float> m((size_t)rows * cols);
  for (int r = 0; r < rows; r++) {
    const int p = (int)(qt_u32() % 270) - 150;  // up to 2^123: finite
    for (int c = 0; c < cols; c++) {
      float x = ldexpf(qt_unit(), p + (int)(qt_u32() % 9) - 4);
      if (qt_u32() % 16 == 0) x = (qt_u32() & 1) ? 17.0f : -0.0f;  // a tie under scale 1, -0
      if (r % 5 == 1) x = (c & 1) ? 0.0f : -0.0f;
      m[(size_t)r * cols + c] = x;
    }
    if (r % 7 == 3) {
      const float bad[3] = {NAN, INFINITY, -INFINITY};
      m[(size_t)r * cols + qt_u32() % cols] = bad[qt_u32() % 3];
    }
  }
  return m;
}

MOK_TEST(quant_gpu_warp_blocks_match_host) {
  QT_SKIP_WITHOUT_GPU();
  const int rows = 96, cols = 384;
  const std::vector<float> m = qt_fp32_matrix(rows, cols);
  float *dm = to_dev(m);
  uint32_t *dq = NULL;
  void *ds = NULL;
  cudaMalloc(&dq, (size_t)rows * cols);
  cudaMalloc(&ds, (size_t)rows * cols / 32 * 4);
  MOK_REQUIRE(dm && dq && ds);
  for (int block32 = 0; block32 < 2; block32++) {
    for (int k = 0; k < 3; k++) {
      const int bc = block32 ? 32 : 128;
      const size_t sbytes = (size_t)rows * (cols / bc) * (k == 2 ? 1 : 4);
      qt_warp_kernel<<<rows * cols / 128 / 4, 128>>>(dm, rows, cols, block32, qt_kinds[k], dq, ds);
      MOK_REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      std::vector<uint8_t> q((size_t)rows * cols), s(sbytes), hq(q.size()), hs(sbytes);
      MOK_REQUIRE(cudaMemcpy(q.data(), dq, q.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      MOK_REQUIRE(cudaMemcpy(s.data(), ds, sbytes, cudaMemcpyDeviceToHost) == cudaSuccess);
      MOK_REQUIRE(mok_quantize_host(m.data(), rows, cols, 1, bc, qt_kinds[k], hq.data(),
                                    hs.data()) == MOK_SUCCESS);
      const long long dq_at = (long long)test_first_diff(q.data(), hq.data(), q.size());
      const long long ds_at = (long long)test_first_diff(s.data(), hs.data(), sbytes);
      MOK_EXPECT_MSG(dq_at < 0, "1x%d kind %d: q differs first at [%lld, %lld]: gpu 0x%02x, host "
                     "0x%02x", bc, k, dq_at / cols, dq_at % cols, q[dq_at < 0 ? 0 : dq_at],
                     hq[dq_at < 0 ? 0 : dq_at]);
      MOK_EXPECT_MSG(ds_at < 0, "1x%d kind %d: scales differ first at byte %lld", bc, k, ds_at);
    }
  }
  cudaFree(dm);
  cudaFree(dq);
  cudaFree(ds);
}
