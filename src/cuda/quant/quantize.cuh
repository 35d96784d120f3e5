/*
 * quantize.cuh: the quantizers of include/mok.h ("Quantizers") as device functions, bit for bit
 * equal to the host's src/cpu/quant.c:
 *
 *   quant_e4m3_from_float / _to_float   one element (RNE, saturating to +-448, NaN -> 0x7F)
 *   quant_block_make                    a block's scale from its amax (FP32, POW2, E8M0 kinds)
 *   quant_block_value                   q = e4m3(v / s), 0x7F for a non-finite block
 *   quant_e8m0_scale, quant_mx_dequant8 MXFP8 values back to bf16 (q * 2^X)
 *   quant_warp_1x128, quant_warp_1x32   activation blocks held in registers, one warp
 *   quant_warp_1x128_cvt                the same 1x128 blocks with the hardware conversion (the
 *                                       SwiGLU backward's)
 *   quant_block_e4m3x2                  that conversion of a block's values, shared with the rows
 *                                       kernel and the fp8 SwiGLU GEMM's quantized a
 *   quant_cta_tile128                   a 128x128 tile in shared memory, one CTA of 256 threads:
 *                                       one 128x128 weight block, or any power-of-two block
 *                                       shape that divides the tile (1x128, 1x32, 32x1, ...)
 *
 * Block amax is a max over |v| bit patterns: for non-negative floats the unsigned order of the bits
 * is the numeric order, and NaN and infinities (>= 0x7F800000) sort above every finite value, so
 * one unsigned max both finds amax and detects a non-finite block, in any reduction order.
 *
 * NOTE (subnormals): POW2/E8M0 zero-block scales are 2^-127, an fp32 subnormal, bf16 and fp32
 * inputs may be subnormal, and v / s may be. The host never flushes them, so neither may we: every
 * value-changing step here is integer arithmetic on bit patterns or inline PTX div.rn.f32 /
 * mul.rn.f32 written without .ftz, which ptxas must honour whatever -ftz says. Still, never build
 * these files with -ftz=true or --use_fast_math: a flushed comparison or conversion added later
 * would silently break the bit-exactness that tests/gpu/test_quantize*.cu check.
 *
 * NOTE (hardware conversion): the functions above write the rounding out exactly like the host's.
 * quant_cvt_e4m3x2's cvt.rn.satfinite.e4m3x2.f32 takes only the finite values v / s of a finite
 * block (a block with a NaN or an infinity is all 0x7F, decided before), on which it rounds as
 * quant_e4m3_from_float does; tests/gpu/test_quantize*.cu check its bytes against the host's.
 */
#ifndef MOK_CUDA_QUANTIZE_CUH
#define MOK_CUDA_QUANTIZE_CUH

#include <stdint.h>

#include "mok.h"

enum {
  QUANT_E4M3_MAX_CODE = 0x7E,       // 448 = 1.75 * 2^8
  QUANT_E4M3_NAN = 0x7F,            // S.1111.111, positive for every NaN, as the spec writes
  QUANT_E8M0_NAN = 0xFF,
};
#define QUANT_F32_NAN_BITS 0x7FC00000u  // the host's NAN (glibc __builtin_nanf("")): stored as is
#define QUANT_F32_INF_BITS 0x7F800000u
#define QUANT_F32_MIN_NORMAL_BITS 0x00800000u  // 2^-126
#define QUANT_E4M3_MAX_F 448.0f

/* ---------------------------------------------------------------------------------------------- */
/* Arithmetic that never flushes subnormals                                                       */
/* ---------------------------------------------------------------------------------------------- */

// IEEE fp32 division, round to nearest even; subnormal operands and results kept (no .ftz).
__device__ __forceinline__ float quant_div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float quant_mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// |v| as bits; unsigned order = numeric order, non-finite values >= QUANT_F32_INF_BITS.
__device__ __forceinline__ uint32_t quant_abs_bits(float v) {
  return __float_as_uint(v) & 0x7FFFFFFFu;
}

// bf16 -> fp32 is exact (the bf16 bits are the high half of the fp32 bits), subnormals included.
__device__ __forceinline__ float quant_bf16_to_float(uint16_t b) {
  return __uint_as_float((uint32_t)b << 16);
}

/* ---------------------------------------------------------------------------------------------- */
/* e4m3 ("fn": bias 7, 3 mantissa bits, no infinities, max 448, subnormals k * 2^-9)              */
/* ---------------------------------------------------------------------------------------------- */

// mok_e4m3_from_float, line for line (see src/cpu/quant.c for the derivation of each step).
__device__ __forceinline__ uint8_t quant_e4m3_from_float(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > QUANT_F32_INF_BITS) return QUANT_E4M3_NAN;
  const int e = (int)(mag >> 23) - 127;  // -127 for zeros and fp32 subnormals
  if (e < -10) return (uint8_t)sign;     // below 2^-10 (or the tie 2^-10): +-0
  if (e > 8) return (uint8_t)(sign | QUANT_E4M3_MAX_CODE);  // >= 512 and infinities saturate
  const uint32_t mant = (mag & 0x7FFFFFu) | 0x800000u;  // value = mant * 2^(e - 23)
  // log2(e4m3 quantum) - (e - 23): 20 for normals (e >= -6), 21..24 for subnormals
  const int shift = e >= -6 ? 20 : 14 - e;
  uint32_t n = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (n & 1u))) n++;
  // normals: n in [8, 16] and n = 16 carries into the exponent by itself; subnormals: code = n
  uint32_t code = e >= -6 ? ((uint32_t)(e + 7) << 3) + (n - 8u) : n;
  // rounding first, then saturation: 464 -> 448 (tie, even); 480 and 512 would be NaN/overflow
  if (code > QUANT_E4M3_MAX_CODE) code = QUANT_E4M3_MAX_CODE;
  return (uint8_t)(sign | code);
}

// mok_e4m3_to_float: exact; 0x7F / 0xFF are +-NaN with the host's NaN bits.
__device__ __forceinline__ float quant_e4m3_to_float(uint8_t q) {
  const uint32_t exp = (q >> 3) & 0xFu, man = q & 7u;
  uint32_t bits;
  if (exp == 15 && man == 7) {
    bits = QUANT_F32_NAN_BITS;
  } else if (exp == 0) {
    // man * 2^-9, a normal fp32 value: (man normalized) with exponent -9 + msb position
    const int msb = 31 - __clz((int)man);  // undefined for man = 0, handled below
    bits = man == 0 ? 0u : ((uint32_t)(msb - 9 + 127) << 23) | ((man << (23 - msb)) & 0x7FFFFFu);
  } else {
    bits = ((exp - 7u + 127u) << 23) | (man << 20);
  }
  return __uint_as_float(bits | ((uint32_t)(q & 0x80u) << 24));
}

/* ---------------------------------------------------------------------------------------------- */
/* Block scales                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

// The smallest X in [-127, 127] with amax <= 448 * 2^X, for a finite amax (its bits). With
// amax = 1.f * 2^(eb - 127) and 448 = 1.75 * 2^8: X = eb - 135, plus 1 when the mantissa f > 0.75.
// Subnormal and zero amax (eb = 0) are below 448 * 2^-127: X = -127. The host's frexp form gives
// the same X (src/cpu/quant.c, quant_pow2_exponent); finite amax never needs the upper clamp.
__device__ __forceinline__ int quant_pow2_exponent(uint32_t amax_bits) {
  const int eb = (int)(amax_bits >> 23);
  if (eb == 0) return -127;
  int x = eb - 135 + ((amax_bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  x = x < -127 ? -127 : x;
  return x > 127 ? 127 : x;
}

// 2^x for x in [-149, 127], exactly (2^-127 .. 2^-149 are subnormal).
__device__ __forceinline__ float quant_pow2(int x) {
  return __uint_as_float(x >= -126 ? (uint32_t)(x + 127) << 23 : 0x00400000u >> (-127 - x));
}

// A block's quantization parameters, derived once from its amax.
typedef struct {
  float scale;  // fp32 scale s as the host stores it (NaN bits 0x7FC00000 for a non-finite block)
  float inv;    // POW2/E8M0: 2^-X, so v / s == v * inv exactly (see quant_block_value)
  uint8_t e8m0; // POW2/E8M0: X + 127 (0xFF for a non-finite block); 0 for FP32
  bool nan;     // the block holds a NaN or an infinity: every element is 0x7F
  bool pow2;
} quant_block_t;

// mok_block_scale for an amax given as bits (>= QUANT_F32_INF_BITS: the block is non-finite).
__device__ __forceinline__ quant_block_t quant_block_make(uint32_t amax_bits,
                                                         mok_quant_scale_t kind) {
  quant_block_t b;
  b.pow2 = kind == MOK_QUANT_POW2_SCALE || kind == MOK_QUANT_E8M0_SCALE;
  b.nan = amax_bits >= QUANT_F32_INF_BITS;
  b.inv = 1.0f;
  b.e8m0 = 0;
  if (b.nan) {
    b.scale = __uint_as_float(QUANT_F32_NAN_BITS);
    if (b.pow2) b.e8m0 = QUANT_E8M0_NAN;
  } else if (!b.pow2) {
    // amax / 448, floored at 2^-126 so v / s never divides by zero or by a subnormal
    const float s = quant_div_rn(__uint_as_float(amax_bits), QUANT_E4M3_MAX_F);
    b.scale = __float_as_uint(s) < QUANT_F32_MIN_NORMAL_BITS
                  ? __uint_as_float(QUANT_F32_MIN_NORMAL_BITS) : s;
  } else {
    const int x = quant_pow2_exponent(amax_bits);
    b.scale = quant_pow2(x);
    b.inv = quant_pow2(-x);
    b.e8m0 = (uint8_t)(x + 127);
  }
  return b;
}

// q = e4m3(v / s) with an IEEE fp32 division. For power-of-two scales v * 2^-X is the same
// operation: both round the same exact real number v * 2^-X once, to nearest even (subnormal
// results included, since neither flushes), and 2^-X is representable for every X used
// (X in [-127, 120]); the multiply saves the division's slow path.
__device__ __forceinline__ uint8_t quant_block_value(const quant_block_t &b, float v) {
  if (b.nan) return QUANT_E4M3_NAN;
  return quant_e4m3_from_float(b.pow2 ? quant_mul_rn(v, b.inv) : quant_div_rn(v, b.scale));
}

// An E8M0 byte's scale: 2^(e - 127), or NaN (the host's bits) for 0xFF: quant_block_make's
// scale of the block whose e8m0 is e.
__device__ __forceinline__ float quant_e8m0_scale(uint32_t e) {
  return e == QUANT_E8M0_NAN ? __uint_as_float(QUANT_F32_NAN_BITS) : quant_pow2((int)e - 127);
}

// Two fp32 values rounded to bf16, to nearest even, lo in the low half (subnormals kept).
__device__ __forceinline__ uint32_t quant_bf16x2_rn(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // hi: upper half
  return r;
}

// MXFP8 dequantized to bf16: eight e4m3 values of one block (element i in byte i of q) times the
// block's scale, bf16(q * 2^X) (mok_mx_qdq_rows_launch's values; exact unless the product is
// below bf16's normal range). Element i lands in bits 16 i of the result.
__device__ __forceinline__ uint4 quant_mx_dequant8(uint2 q, float scale) {
  const uint32_t w[2] = {q.x, q.y};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t v = w[i / 2] >> (16 * (i % 2));
    o[i] = quant_bf16x2_rn(quant_e4m3_to_float((uint8_t)v) * scale,
                           quant_e4m3_to_float((uint8_t)(v >> 8)) * scale);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

/* ---------------------------------------------------------------------------------------------- */
/* Warp helpers: activation blocks held in registers                                              */
/* ---------------------------------------------------------------------------------------------- */

// Every lane holds N consecutive values of a row; lanes [g * LANES, (g + 1) * LANES) hold block g
// (N * LANES values), so a warp holds 32 / LANES blocks. q[i] receives e4m3 of v[i]; returns the
// lane's block. All 32 lanes must call it (full-mask shuffles). A caller with a block clipped at a
// matrix edge passes 0 for the missing values (0 never raises amax) and drops their q.
template <int N, int LANES>
__device__ __forceinline__ quant_block_t quant_warp_blocks(const float (&v)[N],
                                                          mok_quant_scale_t kind,
                                                          uint8_t (&q)[N]) {
  static_assert(N >= 1, "values per lane");
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0,
                "a block spans a power-of-two number of lanes within one warp");
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < N; i++) m = max(m, quant_abs_bits(v[i]));
  if constexpr (LANES == 32) {
    m = __reduce_max_sync(0xFFFFFFFFu, m);  // one redux.sync
  } else {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  }
  const quant_block_t b = quant_block_make(m, kind);
#pragma unroll
  for (int i = 0; i < N; i++) q[i] = quant_block_value(b, v[i]);
  return b;
}

// Two finite fp32 values to e4m3 by the hardware (round to nearest even, subnormals kept,
// saturating to +-448), lo in the low byte.
__device__ __forceinline__ uint32_t quant_cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));  // hi: upper byte
  return r;
}

// Two values of block b (quant_block_make) as e4m3 bytes by quant_cvt_e4m3x2, lo in the low byte:
// v / s, or v · 2^-X for power-of-two scales; 0x7F7F for a non-finite block. The quantizers that
// use the hardware conversion share it (the rows kernel, quant_warp_1x128_cvt, the fp8 SwiGLU
// GEMM's quantized a).
__device__ __forceinline__ uint32_t quant_block_e4m3x2(const quant_block_t &b, float lo, float hi) {
  if (b.nan) return 0x7F7Fu;
  return b.pow2 ? quant_cvt_e4m3x2(quant_mul_rn(lo, b.inv), quant_mul_rn(hi, b.inv))
                : quant_cvt_e4m3x2(quant_div_rn(lo, b.scale), quant_div_rn(hi, b.scale));
}

// Four e4m3 bytes as one word, element i in byte i (little endian: the order of a 4-byte store).
__device__ __forceinline__ uint32_t quant_pack4(const uint8_t (&q)[4]) {
  return (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
}

// One 1x128 block per warp (fp8-block activations): lane l holds elements 4l .. 4l + 3 of the
// row's 128. Returns their e4m3 bytes packed; *blk receives the block (scale, kind as given).
__device__ __forceinline__ uint32_t quant_warp_1x128(const float (&v)[4], mok_quant_scale_t kind,
                                                    quant_block_t *blk) {
  uint8_t q[4];
  *blk = quant_warp_blocks<4, 32>(v, kind, q);
  return quant_pack4(q);
}

// quant_warp_1x128's bytes and block through quant_cvt_e4m3x2 (the cheap conversion, for kernels
// that quantize on the side of other work): *scale receives the block's scale as stored.
__device__ __forceinline__ uint32_t quant_warp_1x128_cvt(const float (&v)[4],
                                                        mok_quant_scale_t kind, float *scale) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) m = max(m, quant_abs_bits(v[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  const quant_block_t b = quant_block_make(m, kind);
  *scale = b.scale;
  return quant_block_e4m3x2(b, v[0], v[1]) | quant_block_e4m3x2(b, v[2], v[3]) << 16;
}

// Four 1x32 blocks per warp (MXFP8 activations: kind MOK_QUANT_E8M0_SCALE; a 128-element chunk of a
// row): lane l holds elements 4l .. 4l + 3 of the chunk, so lanes 8g .. 8g + 7 hold block g.
__device__ __forceinline__ uint32_t quant_warp_1x32(const float (&v)[4], mok_quant_scale_t kind,
                                                   quant_block_t *blk) {
  uint8_t q[4];
  *blk = quant_warp_blocks<4, 8>(v, kind, q);
  return quant_pack4(q);
}

/* ---------------------------------------------------------------------------------------------- */
/* CTA helper: a 128x128 tile in shared memory                                                    */
/* ---------------------------------------------------------------------------------------------- */

enum {
  QUANT_TILE = 128,           // tile rows and columns
  QUANT_CTA_THREADS = 256,    // threads of the CTA running quant_cta_tile128
  QUANT_PER_THREAD = QUANT_TILE * QUANT_TILE / QUANT_CTA_THREADS,
  QUANT_IN_PITCH = QUANT_TILE + 2,  // bf16 per input row: 65 words, odd, so column walks (the
                                    // transposed loads) touch 32 distinct banks
  QUANT_Q_PITCH = QUANT_TILE + 16,  // bytes per output row: rows stay 16-byte aligned
};
static_assert(QUANT_PER_THREAD == 64, "each thread owns 64 elements of the tile");
static_assert(QUANT_Q_PITCH % 16 == 0, "16-byte copies of output rows");
static_assert(QUANT_CTA_THREADS % 32 == 0 && QUANT_CTA_THREADS / 32 <= 32, "warps of the CTA");

// Where a tile's scales go: the matrix's [nbr, nbc] scale array and the tile's first block.
typedef struct {
  void *scales;          // fp32, or E8M0 bytes
  int64_t nbc;           // scale columns of the whole matrix
  int64_t ld_t;          // 0, or transposed scales: block (r, c) at [c * ld_t + r]
  int64_t brow0, bcol0;  // block coordinates of the tile's block (0, 0)
  int e8m0;              // 1: store bytes
} quant_scale_out_t;

// max of m over a team of T consecutive threads (T a power of two, 1..QUANT_CTA_THREADS), returned
// to every member. Every thread of the CTA calls it with the same T (T > 32 synchronizes the CTA).
__device__ __forceinline__ uint32_t quant_team_max(uint32_t m, int T, uint32_t *red) {
  if (T <= 32) {
    for (int o = T / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    return m;
  }
  const int warp = (int)threadIdx.x / 32, wpt = T / 32;
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if (threadIdx.x % 32 == 0) red[warp] = m;
  __syncthreads();
  uint32_t r = 0;
  for (int w = warp / wpt * wpt; w < (warp / wpt + 1) * wpt; w++) r = max(r, red[w]);
  return r;
}

// Quantizes the valid part [vr, vc] of a 128x128 bf16 tile in blocks of 2^lbr x 2^lbc (both <= 128,
// so blocks never straddle tiles; blocks clipped at the matrix edge hold only valid elements, as
// the host's do). Every thread of the CTA (QUANT_CTA_THREADS) calls it with the same arguments.
//   in   [128, QUANT_IN_PITCH] bf16, shared memory, in the stored copy's orientation
//   q    [128, QUANT_Q_PITCH] e4m3, shared memory; written at valid elements only
//   red  [QUANT_CTA_THREADS / 32] shared scratch
// Ownership: in block-major order (block by block, row-major tile of blocks; row-major within a
// block) thread t owns elements [64 t, 64 t + 64): a block of B <= 64 elements belongs to one
// thread, a larger one to a team of B / 64 consecutive threads (a 128x128 block: the whole CTA).
// The thread owning a block's first element writes its scale.
__device__ __forceinline__ void quant_cta_tile128(const uint16_t *in, uint8_t *q, int vr, int vc,
                                                  int lbr, int lbc, mok_quant_scale_t kind,
                                                  const quant_scale_out_t &so, uint32_t *red) {
  const int lb = lbr + lbc, B = 1 << lb;
  const int S = B < QUANT_PER_THREAD ? B : QUANT_PER_THREAD;  // elements per segment
  const int lnbc = 7 - lbc;                                   // log2 blocks per tile row
  const int cmask = (1 << lbc) - 1;
  for (int seg = 0; seg < QUANT_PER_THREAD / S; seg++) {
    const int base = (int)threadIdx.x * QUANT_PER_THREAD + seg * S;
    const int b = base >> lb, brow = b >> lnbc, bcol = b & ((1 << lnbc) - 1);
    const int rb = brow << lbr, cb = bcol << lbc;  // block origin in the tile
    const int j0 = base & (B - 1);
    uint32_t m = 0;
    for (int k = 0; k < S; k++) {
      const int j = j0 + k, r = rb + (j >> lbc), c = cb + (j & cmask);
      if (r < vr && c < vc) m = max(m, (uint32_t)(in[r * QUANT_IN_PITCH + c] & 0x7FFFu) << 16);
    }
    if (B > QUANT_PER_THREAD) m = quant_team_max(m, B / QUANT_PER_THREAD, red);  // CTA-uniform
    const quant_block_t blk = quant_block_make(m, kind);
    if (j0 == 0 && rb < vr && cb < vc) {
      const int64_t si = so.ld_t ? (so.bcol0 + bcol) * so.ld_t + so.brow0 + brow
                                 : (so.brow0 + brow) * so.nbc + so.bcol0 + bcol;
      if (so.e8m0)
        ((uint8_t *)so.scales)[si] = blk.e8m0;
      else
        ((float *)so.scales)[si] = blk.scale;
    }
    for (int k = 0; k < S; k++) {
      const int j = j0 + k, r = rb + (j >> lbc), c = cb + (j & cmask);
      if (r < vr && c < vc)
        q[r * QUANT_Q_PITCH + c] =
            quant_block_value(blk, quant_bf16_to_float(in[r * QUANT_IN_PITCH + c]));
    }
  }
}

#endif /* MOK_CUDA_QUANTIZE_CUH */
