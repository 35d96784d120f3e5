/*
 * test_quantize.cu: the GPU quantizers (src/cuda/quant/quantize.cuh, src/cuda/quant/quantize.cu) against the
 * host's (src/cpu/quant.c), bit for bit: every comparison is a memcmp of e4m3 bytes and of scale
 * bytes (fp32 NaN scales included), never a tolerance, because the spec (include/mok.h,
 * "Quantizers") defines one result.
 *
 *   element:   e4m3 encoding of structured fp32 patterns (every exponent; remainders just below,
 *              at and above each rounding tie; saturation; NaN, +-Inf, -0, subnormals) and of
 *              random bit patterns; decoding of all 256 codes
 *   scale:     the three scale kinds for amax at every exponent and at the 0.875 boundary,
 *              subnormal, zero, Inf, NaN; q = e4m3(v / s) for random (v, amax) pairs
 *   warp:      quant_warp_1x128 / quant_warp_1x32 on fp32 rows held in registers
 *   launcher:  mok_quantize_launch for 1x128, 128x128, 1x32, 32x1 and other power-of-two blocks,
 *              plain and transposed reads, padded strides, ragged edges, random bits, several
 *              magnitudes, and special values (NaN, +-Inf, -0, huge, subnormal, rounding ties)
 *   layer:     mok_quantize_weights on a GPU layer equals the CPU layer's buffer byte for byte
 *              (fp8-block with fp32 and pow2 scales, MXFP8; with a shared expert)
 * GPU tests skip without a CUDA device; the launcher's argument checks run everywhere.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "../support/bf16.h"
#include "../support/compare.h"
#include "../support/gpu.h"
#include "../support/rng.h"
#include "../test.h"
#include "cuda/quant/quant.h"
#include "cuda/quant/quantize.cuh"
#include "api/api.h"
extern "C" {
#include "cpu/quant.h"
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "the quantizer tests target sm_90a (Hopper) and newer"
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Helpers                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

#define QT_SKIP_WITHOUT_GPU()                              \
  do {                                                     \
    if (!test_gpu_present()) MOK_SKIP("no CUDA device");   \
  } while (0)

// This file's random stream: 32 random bits, or uniform in [-1, 1).
static test_rng_t qt_rng = {0x2545F4914F6CDD1Dull, TEST_RNG_XORSHIFT64};
static uint32_t qt_u32(void) { return test_rng_u32(&qt_rng); }
static float qt_unit(void) { return test_rng_sym_f(&qt_rng); }

template <class T>
static bool qt_host(std::vector<T> &h, const T *d) {
  return cudaMemcpy(h.data(), d, h.size() * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess;
}


static const mok_quant_scale_t qt_kinds[3] = {MOK_QUANT_FP32_SCALE, MOK_QUANT_POW2_SCALE,
                                              MOK_QUANT_E8M0_SCALE};

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
