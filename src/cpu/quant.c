/*
 * quant.c: the number formats of the reference, bit-exact (quant.h), and the public host quantizers
 * mok_quantize_host / mok_dequantize_host (include/mok.h, "Quantizers", is the specification).
 *
 * Every conversion is written as explicit integer rounding on the fp32 bit pattern, so the result
 * does not depend on the host's rounding mode or on library conversions; the GPU kernels must
 * reproduce these functions bit for bit. All arithmetic on values is fp32 (x86-64 SSE evaluates
 * float expressions in fp32; FLT_EVAL_METHOD is 0 there).
 */
#include "cpu/quant.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/checked.h"
#include "api/api.h" /* mok_fail: the detail behind mok_last_error() */

#define QUANT_E4M3_MAX 448.0f
#define QUANT_E4M3_MAX_CODE 0x7E /* 448 = 1.75 * 2^8 */
#define QUANT_E4M3_NAN 0x7F      /* S.1111.111; the spec writes positive NaN for any NaN input */
#define QUANT_E8M0_NAN 0xFF
#define QUANT_MAX_BLOCK 1024

static uint32_t quant_float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float quant_bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* ---------------------------------------------------------------------------------------------- */
/* bf16                                                                                            */
/* ---------------------------------------------------------------------------------------------- */

uint16_t mok_bf16_from_float(float f) {
  uint32_t u = quant_float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    /* NaN: truncation could turn a signalling NaN with only low payload bits into an infinity,
     * so set the quiet bit; the sign and the high payload bits are kept. */
    return (uint16_t)((u >> 16) | 0x0040u);
  }
  /* Round to nearest even on the 16 dropped bits. Infinities pass unchanged (low bits are 0);
   * finite values above the largest bf16 round to infinity, as IEEE RNE does. */
  uint32_t lsb = (u >> 16) & 1u;
  return (uint16_t)((u + 0x7FFFu + lsb) >> 16);
}

float mok_bf16_to_float(uint16_t b) { return quant_bits_float((uint32_t)b << 16); }

double mok_round_bf16(double v) {
  /* Double rounding (fp64 -> fp32 -> bf16) is the specification: it is what a GPU epilogue that
   * accumulates in fp32 and then converts does. */
  return (double)mok_bf16_to_float(mok_bf16_from_float((float)v));
}

/* ---------------------------------------------------------------------------------------------- */
/* e4m3 ("fn": bias 7, 3 mantissa bits, no infinities, max 448, subnormals k * 2^-9)               */
/* ---------------------------------------------------------------------------------------------- */

uint8_t mok_e4m3_from_float(float f) {
  uint32_t u = quant_float_bits(f);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return QUANT_E4M3_NAN;
  /* Infinities saturate like any other value above 448 (the "satfinite" reading of the spec). A
   * block holding an infinity never gets here: the block rule turns it into NaNs first. */
  if (mag == 0x7F800000u) return (uint8_t)(sign | QUANT_E4M3_MAX_CODE);

  int e = (int)(mag >> 23) - 127; /* unbiased fp32 exponent; -127 for fp32 zero/subnormals */
  /* |f| < 2^-10 rounds to zero (2^-10 itself is the tie between 0 and 2^-9, which the rounding
   * below sends to 0, the even code). fp32 subnormals and zeros land here too. The sign is kept,
   * so tiny negatives give -0 (0x80), as IEEE rounding does. */
  if (e < -10) return sign;
  if (e > 8) return (uint8_t)(sign | QUANT_E4M3_MAX_CODE); /* |f| >= 512 */

  uint32_t mant = (mag & 0x7FFFFFu) | 0x800000u; /* 24-bit significand, value = mant * 2^(e-23) */
  /* The e4m3 quantum is 2^(e-3) for normals (e >= -6) and 2^-9 for subnormals; n counts quanta.
   * shift = log2(quantum) - (e - 23): 20 for normals, 21..24 for e in [-7, -10]. */
  int shift = e >= -6 ? 20 : 14 - e;
  uint32_t n = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (n & 1u))) n++;

  uint32_t code;
  if (e >= -6) {
    /* n in [8, 16]; n = 16 carries into the next binade, which the addition does by itself. */
    code = ((uint32_t)(e + 7) << 3) + (n - 8u);
  } else {
    code = n; /* n in [0, 8]; n = 8 is 2^-6, the smallest normal, whose code is 0x08 */
  }
  /* Rounding first, then saturation: 464 rounds (tie, even) to 448; anything rounding to 480
   * (code 0x7F would be NaN) or to 512 (code 0x80 would overflow) becomes 448. */
  if (code > QUANT_E4M3_MAX_CODE) code = QUANT_E4M3_MAX_CODE;
  return (uint8_t)(sign | code);
}

float mok_e4m3_to_float(uint8_t q) {
  int exp = (q >> 3) & 0xF, man = q & 7;
  float mag;
  if (exp == 15 && man == 7) {
    mag = NAN;
  } else if (exp == 0) {
    mag = ldexpf((float)man, -9); /* subnormal: man * 2^-9, exact in fp32 */
  } else {
    mag = ldexpf((float)(8 + man), exp - 7 - 3); /* (1 + man/8) * 2^(exp-7), exact */
  }
  return (q & 0x80) ? -mag : mag;
}

/* ---------------------------------------------------------------------------------------------- */
/* Block scales                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/* The smallest integer X in [-127, 127] with amax <= 448 * 2^X, exactly (no log2): with
 * amax = m * 2^e, m in [0.5, 1) (frexp is exact), and 448 = 0.875 * 2^9,
 *   amax <= 0.875 * 2^(X+9)  <=>  X >= e - 9 when m <= 0.875, X >= e - 8 when m > 0.875.
 * A finite fp32 amax gives at most X = 120 (FLT_MAX), so the upper clamp is never reached; it is
 * kept because the spec states the range. */
static int quant_pow2_exponent(float amax) {
  if (!(amax > 0.0f)) return -127; /* zero block (or a negative amax, read as zero) */
  int e;
  float m = frexpf(amax, &e);
  int x = e - 9 + (m > 0.875f ? 1 : 0);
  if (x < -127) x = -127;
  if (x > 127) x = 127;
  return x;
}

float mok_block_scale(float amax, mok_quant_scale_t kind, uint8_t *e8m0) {
  int pow2 = kind == MOK_QUANT_POW2_SCALE || kind == MOK_QUANT_E8M0_SCALE;
  if (!isfinite(amax)) {
    if (pow2 && e8m0) *e8m0 = QUANT_E8M0_NAN;
    return NAN;
  }
  if (!pow2) {
    /* FP32: the floor keeps the division v / s away from zero and subnormal divisors. The e8m0
     * byte is not written for this kind. */
    float s = amax / QUANT_E4M3_MAX;
    return s < 0x1p-126f ? 0x1p-126f : s;
  }
  int x = quant_pow2_exponent(amax);
  if (e8m0) *e8m0 = (uint8_t)(x + 127);
  return ldexpf(1.0f, x); /* 2^-127 is an fp32 subnormal: exact */
}

/* The fp32 scale an E8M0 byte stands for: 2^(b - 127), NaN for 0xFF. */
static float quant_e8m0_to_float(uint8_t b) {
  return b == QUANT_E8M0_NAN ? NAN : ldexpf(1.0f, (int)b - 127);
}

/* ---------------------------------------------------------------------------------------------- */
/* Matrix quantizers                                                                               */
/* ---------------------------------------------------------------------------------------------- */

/* One block of a row-major matrix: rows [r0, r1), cols [c0, c1), already clipped at the edge. */
typedef struct {
  int64_t r0, r1, c0, c1;
} quant_block_t;

static quant_block_t quant_block(int64_t rows, int64_t cols, int block_rows, int block_cols,
                                 int64_t br, int64_t bc) {
  quant_block_t b;
  b.r0 = br * block_rows;
  b.r1 = rows - b.r0 > block_rows ? b.r0 + block_rows : rows; /* no overflow near INT64_MAX */
  b.c0 = bc * block_cols;
  b.c1 = cols - b.c0 > block_cols ? b.c0 + block_cols : cols;
  return b;
}

/* amax of a block of fp32 values; NaN when any value is NaN or infinite (fmaxf would drop a NaN,
 * so non-finite values are detected explicitly). */
static float quant_block_amax(const float *in, int64_t cols, quant_block_t b) {
  float amax = 0.0f;
  for (int64_t r = b.r0; r < b.r1; r++) {
    for (int64_t c = b.c0; c < b.c1; c++) {
      float a = fabsf(in[r * cols + c]);
      if (!isfinite(a)) return NAN;
      if (a > amax) amax = a;
    }
  }
  return amax;
}

/* q = e4m3(v / s) with an fp32 division; a non-finite block (NaN scale) is all NaN codes. */
static uint8_t quant_value(float v, float s) {
  if (isnan(s)) return QUANT_E4M3_NAN;
  return mok_e4m3_from_float(v / s);
}

static int quant_kind_valid(mok_quant_scale_t kind) {
  return kind == MOK_QUANT_FP32_SCALE || kind == MOK_QUANT_POW2_SCALE ||
         kind == MOK_QUANT_E8M0_SCALE;
}

/* 1 when the shape arguments are in range: rows, cols >= 0 with rows * cols addressable, block
 * sizes in 1..1024, a known scale kind. */
static int quant_shape_valid(int64_t rows, int64_t cols, int block_rows, int block_cols,
                             mok_quant_scale_t kind) {
  return rows >= 0 && cols >= 0 && (rows == 0 || cols <= INT64_MAX / rows) &&
         block_rows >= 1 && block_rows <= QUANT_MAX_BLOCK && block_cols >= 1 &&
         block_cols <= QUANT_MAX_BLOCK && quant_kind_valid(kind);
}

/* Argument checks of the public quantizers, recording the detail for mok_last_error(). Pointers
 * are required even for an empty matrix: a zero-sized call does nothing, but a NULL pointer is
 * still a caller bug. */
static mokResult_t quant_check_args(const char *fn, const void *a, const char *a_name,
                                    const void *b, const char *b_name, const void *c,
                                    const char *c_name, int64_t rows, int64_t cols,
                                    int block_rows, int block_cols, mok_quant_scale_t kind) {
  if (!a) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: %s is NULL", fn, a_name);
  if (!b) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: %s is NULL", fn, b_name);
  if (!c) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: %s is NULL", fn, c_name);
  if (!quant_shape_valid(rows, cols, block_rows, block_cols, kind)) {
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "%s: rows %lld, cols %lld, block %d x %d, scale kind %d: rows and cols must "
                    "be >= 0, block sizes in 1..%d, the kind a mok_quant_scale_t",
                    fn, (long long)rows, (long long)cols, block_rows, block_cols, (int)kind,
                    QUANT_MAX_BLOCK);
  }
  return MOK_SUCCESS;
}

mokResult_t mok_quantize_host(const float *in, int64_t rows, int64_t cols, int block_rows,
                              int block_cols, mok_quant_scale_t scale, uint8_t *q,
                              void *scales) {
  mokResult_t res = quant_check_args("mok_quantize_host", in, "in", q, "q", scales, "scales", rows,
                                     cols, block_rows, block_cols, scale);
  if (res != MOK_SUCCESS) return res;

  int64_t nbr = mok_ceil_div(rows, block_rows);
  int64_t nbc = mok_ceil_div(cols, block_cols);
  for (int64_t br = 0; br < nbr; br++) {
    for (int64_t bc = 0; bc < nbc; bc++) {
      quant_block_t b = quant_block(rows, cols, block_rows, block_cols, br, bc);
      uint8_t e8m0 = 0;
      float s = mok_block_scale(quant_block_amax(in, cols, b), scale, &e8m0);
      if (scale == MOK_QUANT_E8M0_SCALE) {
        ((uint8_t *)scales)[br * nbc + bc] = e8m0;
      } else {
        ((float *)scales)[br * nbc + bc] = s;
      }
      for (int64_t r = b.r0; r < b.r1; r++) {
        for (int64_t c = b.c0; c < b.c1; c++) q[r * cols + c] = quant_value(in[r * cols + c], s);
      }
    }
  }
  return MOK_SUCCESS;
}

mokResult_t mok_dequantize_host(const uint8_t *q, const void *scales, int64_t rows, int64_t cols,
                                int block_rows, int block_cols, mok_quant_scale_t scale,
                                float *out) {
  mokResult_t res = quant_check_args("mok_dequantize_host", q, "q", scales, "scales", out, "out",
                                     rows, cols, block_rows, block_cols, scale);
  if (res != MOK_SUCCESS) return res;

  int64_t nbc = mok_ceil_div(cols, block_cols);
  for (int64_t r = 0; r < rows; r++) {
    const int64_t br = r / block_rows;
    for (int64_t c = 0; c < cols; c++) {
      int64_t si = br * nbc + c / block_cols;
      float s = scale == MOK_QUANT_E8M0_SCALE ? quant_e8m0_to_float(((const uint8_t *)scales)[si])
                                              : ((const float *)scales)[si];
      out[r * cols + c] = mok_e4m3_to_float(q[r * cols + c]) * s; /* fp32 product */
    }
  }
  return MOK_SUCCESS;
}

void mok_qdq_matrix(double *m, int64_t rows, int64_t cols, int block_rows, int block_cols,
                    mok_quant_scale_t kind) {
  /* A void helper of the reference: invalid arguments (which the reference never passes) leave
   * the matrix untouched rather than writing out of bounds. */
  if (!m || !quant_shape_valid(rows, cols, block_rows, block_cols, kind)) return;

  int64_t nbr = mok_ceil_div(rows, block_rows);
  int64_t nbc = mok_ceil_div(cols, block_cols);
  for (int64_t br = 0; br < nbr; br++) {
    for (int64_t bc = 0; bc < nbc; bc++) {
      quant_block_t b = quant_block(rows, cols, block_rows, block_cols, br, bc);
      /* Same steps as quantize_host + dequantize_host, on fp32(v): amax, scale, e4m3, q * s. The
       * scale is used as returned; for E8M0 it equals quant_e8m0_to_float of the stored byte. */
      float amax = 0.0f;
      for (int64_t r = b.r0; r < b.r1 && !isnan(amax); r++) {
        for (int64_t c = b.c0; c < b.c1; c++) {
          float a = fabsf((float)m[r * cols + c]);
          if (!isfinite(a)) {
            amax = NAN;
            break;
          }
          if (a > amax) amax = a;
        }
      }
      float s = mok_block_scale(amax, kind, NULL);
      for (int64_t r = b.r0; r < b.r1; r++) {
        for (int64_t c = b.c0; c < b.c1; c++) {
          uint8_t q = quant_value((float)m[r * cols + c], s);
          m[r * cols + c] = (double)(mok_e4m3_to_float(q) * s);
        }
      }
    }
  }
}
