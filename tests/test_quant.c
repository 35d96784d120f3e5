/*
 * test_quant.c: the bf16 and e4m3 conversions, block scales and matrix quantizers of
 * src/cpu/quant.c against hand-derived vectors (each expected byte is derived in a comment) and
 * against properties: e4m3 encoding equals a brute-force nearest-even search over the code table,
 * dequantize(quantize(x)) stays within half an e4m3 step, and mok_qdq_matrix equals quantize then
 * dequantize bit for bit. The public quantizers' argument checks are tested path by path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/quant.h"
#include "mok.h"
#include "support/bf16.h"
#include "support/rng.h"
#include "test.h"

/* Uniform in [-1, 1) times 2^p with p uniform in [lo, hi]: values spanning many binades. */
static float random_value(test_rng_t *s, int lo, int hi) {
  double u = test_rng_uniform(s) * 2.0 - 1.0;
  int p = lo + (int)test_rng_below(s, (uint64_t)(hi - lo + 1));
  return (float)ldexp(u, p);
}

/* ---- bf16 ------------------------------------------------------------------------------------ */

MOK_TEST(bf16_rounds_to_nearest_even) {
  /* 0x3F80_8000: the dropped half is exactly 0x8000 (a tie); kept part 0x3F80 is even: stays. */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x3F808000u)) == 0x3F80);
  /* 0x3F81_8000: tie, kept part 0x3F81 is odd: rounds up to 0x3F82. */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x3F818000u)) == 0x3F82);
  /* Just above / below the tie go to the nearest. */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x3F808001u)) == 0x3F81);
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x3F817FFFu)) == 0x3F81);
  /* Negative tie with odd kept part 0xBF81 -> 0xBF82 (magnitude rounds, sign kept). */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0xBF818000u)) == 0xBF82);
  /* Mantissa carry into the exponent: 0x3FFF_8000 is a tie on odd 0x3FFF -> 0x4000 (= 2.0). */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x3FFF8000u)) == 0x4000);
  MOK_EXPECT(mok_bf16_from_float(1.0f) == 0x3F80);
  MOK_EXPECT(mok_bf16_to_float(0x3F80) == 1.0f);
  MOK_EXPECT(mok_bf16_to_float(0xC040) == -3.0f);
}

MOK_TEST(bf16_special_values) {
  /* Zeros keep their sign. */
  MOK_EXPECT(mok_bf16_from_float(0.0f) == 0x0000);
  MOK_EXPECT(mok_bf16_from_float(-0.0f) == 0x8000);
  /* Infinities pass unchanged (low half is 0, nothing to round). */
  MOK_EXPECT(mok_bf16_from_float(INFINITY) == 0x7F80);
  MOK_EXPECT(mok_bf16_from_float(-INFINITY) == 0xFF80);
  /* FLT_MAX 0x7F7F_FFFF rounds up past the largest bf16 0x7F7F: RNE overflows to +inf. */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x7F7FFFFFu)) == 0x7F80);
  /* Quiet NaN keeps its top bits. */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x7FC00000u)) == 0x7FC0);
  /* A signalling NaN with only low payload bits: truncation would give 0x7F80 (inf) and rounding
   * 0x7F80 too; the quiet bit 0x0040 keeps it a NaN: 0x7F80 | 0x40 = 0x7FC0, sign kept. */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x7F800001u)) == 0x7FC0);
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0xFF800001u)) == 0xFFC0);
  /* NaN with a high payload 0x7FA1_2345: keeps 0x7FA1 and gets the quiet bit: 0x7FE1. */
  MOK_EXPECT(mok_bf16_from_float(f32_of_bits(0x7FA12345u)) == 0x7FE1);
  MOK_EXPECT(isnan(mok_bf16_to_float(0x7FC0)));
  MOK_EXPECT(signbit(mok_bf16_to_float(0x8000)) && mok_bf16_to_float(0x8000) == 0.0f);
}

MOK_TEST(bf16_round_double_goes_through_fp32) {
  /* 1 + 2^-8 is the tie between bf16 1.0 and 1 + 2^-7 (7 mantissa bits): even -> 1.0. */
  MOK_EXPECT(mok_round_bf16(1.0 + 0x1p-8) == 1.0);
  /* 1 + 3 * 2^-8 is the tie between 1 + 2^-7 (odd) and 1 + 2^-6: -> 1 + 2^-6. */
  MOK_EXPECT(mok_round_bf16(1.0 + 3 * 0x1p-8) == 1.0 + 0x1p-6);
  /* 1 + 2^-8 + 2^-40 is above the tie, so direct rounding would give 1 + 2^-7; the spec rounds to
   * fp32 first, which drops 2^-40 and leaves the tie -> 1.0. */
  MOK_EXPECT(mok_round_bf16(1.0 + 0x1p-8 + 0x1p-40) == 1.0);
  MOK_EXPECT(mok_round_bf16(-2.5) == -2.5);
  MOK_EXPECT(isnan(mok_round_bf16(NAN)));
}

/* ---- e4m3 ------------------------------------------------------------------------------------ */

MOK_TEST(e4m3_encode_hand_vectors) {
  /* Zeros: sign bit only. */
  MOK_EXPECT(mok_e4m3_from_float(0.0f) == 0x00);
  MOK_EXPECT(mok_e4m3_from_float(-0.0f) == 0x80);
  /* 1.0 = 1.0 * 2^0: exponent field 0 + 7 = 7, mantissa 0 -> 0 0111 000 = 0x38. */
  MOK_EXPECT(mok_e4m3_from_float(1.0f) == 0x38);
  MOK_EXPECT(mok_e4m3_from_float(-1.0f) == 0xB8);
  /* 448 = 1.75 * 2^8: field 15, mantissa 6 -> 0 1111 110 = 0x7E (the largest finite). */
  MOK_EXPECT(mok_e4m3_from_float(448.0f) == 0x7E);
  MOK_EXPECT(mok_e4m3_from_float(-448.0f) == 0xFE);
  /* 240 = 1.875 * 2^7: field 14, mantissa 7 -> 0x77; 256 = 2^8: field 15, mantissa 0 -> 0x78. */
  MOK_EXPECT(mok_e4m3_from_float(240.0f) == 0x77);
  MOK_EXPECT(mok_e4m3_from_float(256.0f) == 0x78);
  /* 464 = 1.8125 * 2^8 is the tie between 448 (mantissa 6, even) and 480: -> 448 = 0x7E. */
  MOK_EXPECT(mok_e4m3_from_float(464.0f) == 0x7E);
  /* 465 rounds to 480 (would be 0x7F = NaN): saturates to 448. 480 and beyond likewise. */
  MOK_EXPECT(mok_e4m3_from_float(465.0f) == 0x7E);
  MOK_EXPECT(mok_e4m3_from_float(480.0f) == 0x7E);
  MOK_EXPECT(mok_e4m3_from_float(500.0f) == 0x7E); /* rounds to 512 (code 0x80): saturates */
  MOK_EXPECT(mok_e4m3_from_float(1e9f) == 0x7E);
  MOK_EXPECT(mok_e4m3_from_float(-1e9f) == 0xFE);
  MOK_EXPECT(mok_e4m3_from_float(f32_of_bits(0x7F7FFFFFu)) == 0x7E); /* FLT_MAX */
  /* Infinities: our reading of "satfinite" for the scalar conversion is to saturate them like any
   * value above 448 (+-448 = 0x7E / 0xFE). A block holding one never reaches this: the block rule
   * turns the whole block into NaN codes (tested below). */
  MOK_EXPECT(mok_e4m3_from_float(INFINITY) == 0x7E);
  MOK_EXPECT(mok_e4m3_from_float(-INFINITY) == 0xFE);
  /* NaN of either sign -> 0x7F. */
  MOK_EXPECT(mok_e4m3_from_float(NAN) == 0x7F);
  MOK_EXPECT(mok_e4m3_from_float(-NAN) == 0x7F);
  MOK_EXPECT(mok_e4m3_from_float(f32_of_bits(0x7F800001u)) == 0x7F);
  /* 0.1 = 1.6 * 2^-4: field 3, mantissa 0.6 * 8 = 4.8 -> 5 -> 0 0011 101 = 0x1D (0.1015625). */
  MOK_EXPECT(mok_e4m3_from_float(0.1f) == 0x1D);
}

MOK_TEST(e4m3_encode_ties_and_subnormals) {
  /* Normal ties: 1.0625 = 1 + 0.5/8 lies between mantissa 0 and 1: even 0 -> 0x38. */
  MOK_EXPECT(mok_e4m3_from_float(1.0625f) == 0x38);
  /* 1.1875 = 1 + 1.5/8: between mantissa 1 (odd) and 2 -> 2: 0 0111 010 = 0x3A. */
  MOK_EXPECT(mok_e4m3_from_float(1.1875f) == 0x3A);
  /* 1.9375 = 1 + 7.5/8: between 1.875 (mantissa 7, odd) and 2.0 -> 2.0 = field 8: 0x40. */
  MOK_EXPECT(mok_e4m3_from_float(1.9375f) == 0x40);
  /* Just above a tie goes up: nextafter(1.0625) -> mantissa 1: 0x39. */
  MOK_EXPECT(mok_e4m3_from_float(nextafterf(1.0625f, 2.0f)) == 0x39);
  /* Subnormals are k * 2^-9, code k. The smallest: 2^-9 -> 0x01. */
  MOK_EXPECT(mok_e4m3_from_float(0x1p-9f) == 0x01);
  MOK_EXPECT(mok_e4m3_from_float(-0x1p-9f) == 0x81);
  /* 2^-10 = 0.5 * 2^-9: tie between 0 (even) and 1 -> 0; -2^-10 -> -0 = 0x80. */
  MOK_EXPECT(mok_e4m3_from_float(0x1p-10f) == 0x00);
  MOK_EXPECT(mok_e4m3_from_float(-0x1p-10f) == 0x80);
  MOK_EXPECT(mok_e4m3_from_float(nextafterf(0x1p-10f, 1.0f)) == 0x01);
  /* 3 * 2^-10 = 1.5 * 2^-9: tie between 1 and 2 (even) -> 0x02. 5 * 2^-10 = 2.5: -> 2 = 0x02.
   * 7 * 2^-10 = 3.5: -> 4 = 0x04. */
  MOK_EXPECT(mok_e4m3_from_float(3 * 0x1p-10f) == 0x02);
  MOK_EXPECT(mok_e4m3_from_float(5 * 0x1p-10f) == 0x02);
  MOK_EXPECT(mok_e4m3_from_float(7 * 0x1p-10f) == 0x04);
  /* 7.5 * 2^-9: tie between 7 (odd) and 8 -> 8 * 2^-9 = 2^-6, the smallest normal: 0 0001 000. */
  MOK_EXPECT(mok_e4m3_from_float(7.5f * 0x1p-9f) == 0x08);
  /* 2^-6 + 2^-10 is half the normal quantum 2^-9 above 2^-6: tie, even mantissa 0 -> 0x08. */
  MOK_EXPECT(mok_e4m3_from_float(0x1p-6f + 0x1p-10f) == 0x08);
  /* Far below: 2^-11, an fp32 subnormal, fp32 min subnormal: all round to signed zero. */
  MOK_EXPECT(mok_e4m3_from_float(0x1p-11f) == 0x00);
  MOK_EXPECT(mok_e4m3_from_float(1e-40f) == 0x00);
  MOK_EXPECT(mok_e4m3_from_float(-1e-40f) == 0x80);
  MOK_EXPECT(mok_e4m3_from_float(f32_of_bits(1u)) == 0x00);
}

MOK_TEST(e4m3_decode_values_and_round_trip) {
  MOK_EXPECT(mok_e4m3_to_float(0x00) == 0.0f && !signbit(mok_e4m3_to_float(0x00)));
  MOK_EXPECT(mok_e4m3_to_float(0x80) == 0.0f && signbit(mok_e4m3_to_float(0x80)));
  MOK_EXPECT(mok_e4m3_to_float(0x01) == 0x1p-9f);
  MOK_EXPECT(mok_e4m3_to_float(0x07) == 7 * 0x1p-9f);
  MOK_EXPECT(mok_e4m3_to_float(0x08) == 0x1p-6f);
  MOK_EXPECT(mok_e4m3_to_float(0x38) == 1.0f);
  MOK_EXPECT(mok_e4m3_to_float(0x7E) == 448.0f);
  MOK_EXPECT(mok_e4m3_to_float(0xFE) == -448.0f);
  MOK_EXPECT(isnan(mok_e4m3_to_float(0x7F)) && isnan(mok_e4m3_to_float(0xFF)));
  /* Every non-NaN code decodes to a value that encodes back to the same code, and positive codes
   * are strictly increasing (the grid has no duplicates or gaps in the order). */
  float prev = -1.0f;
  for (int c = 0; c < 256; c++) {
    if ((c & 0x7F) == 0x7F) continue;
    float v = mok_e4m3_to_float((uint8_t)c);
    MOK_EXPECT_MSG(mok_e4m3_from_float(v) == c, "code 0x%02X -> %a -> 0x%02X", c, (double)v,
                   mok_e4m3_from_float(v));
    MOK_EXPECT(mok_e4m3_to_float((uint8_t)(c ^ 0x80)) == -v);
    if (c < 0x80) {
      MOK_EXPECT(v > prev || c == 0);
      prev = v;
    }
  }
}

/* Independent e4m3 oracle: the nearest of the 127 non-negative finite codes by exact distance,
 * ties to the even code, beyond 448 saturated. */
static uint8_t e4m3_brute(float f) {
  if (isnan(f)) return 0x7F;
  uint8_t sign = signbit(f) ? 0x80 : 0;
  double a = fabs((double)f);
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c <= 0x7E; c++) {
    double d = fabs((double)mok_e4m3_to_float((uint8_t)c) - a); /* exact in double */
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return (uint8_t)(sign | best);
}

MOK_TEST(e4m3_encode_matches_nearest_even_search) {
  /* Every midpoint between neighbouring codes and the floats next to it (the cases where the
   * rounding decides), then a sweep over fp32 bit patterns from 0 to above 448. */
  for (int c = 0; c < 0x7E; c++) {
    float lo = mok_e4m3_to_float((uint8_t)c), hi = mok_e4m3_to_float((uint8_t)(c + 1));
    float mid = (float)(((double)lo + hi) / 2); /* exact: one more bit than e4m3 */
    float cases[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, 1000.0f)};
    for (int i = 0; i < 3; i++) {
      for (int sgn = 0; sgn < 2; sgn++) {
        float v = sgn ? -cases[i] : cases[i];
        MOK_EXPECT_MSG(mok_e4m3_from_float(v) == e4m3_brute(v), "%a -> 0x%02X, expected 0x%02X",
                       (double)v, mok_e4m3_from_float(v), e4m3_brute(v));
      }
    }
  }
  for (uint32_t u = 0; u < 0x44000000u; u += 4093) { /* 0x44000000 = 512 */
    float v = f32_of_bits(u);
    MOK_EXPECT_MSG(mok_e4m3_from_float(v) == e4m3_brute(v), "%a -> 0x%02X, expected 0x%02X",
                   (double)v, mok_e4m3_from_float(v), e4m3_brute(v));
  }
}

/* ---- block scales ---------------------------------------------------------------------------- */

MOK_TEST(block_scale_fp32) {
  uint8_t b = 0xAB; /* FP32 kind does not write the byte */
  MOK_EXPECT(mok_block_scale(448.0f, MOK_QUANT_FP32_SCALE, &b) == 1.0f && b == 0xAB);
  MOK_EXPECT(mok_block_scale(896.0f, MOK_QUANT_FP32_SCALE, &b) == 2.0f);
  MOK_EXPECT(mok_block_scale(1.0f, MOK_QUANT_FP32_SCALE, &b) == 1.0f / 448.0f);
  /* Zero block and a block so small that amax / 448 < 2^-126: the 2^-126 floor. */
  MOK_EXPECT(mok_block_scale(0.0f, MOK_QUANT_FP32_SCALE, &b) == 0x1p-126f);
  MOK_EXPECT(mok_block_scale(448.0f * 0x1p-130f, MOK_QUANT_FP32_SCALE, &b) == 0x1p-126f);
  /* amax = 448 * 2^-126 gives exactly the floor; 448 * 2^-125 gives 2^-125 (above it). */
  MOK_EXPECT(mok_block_scale(448.0f * 0x1p-126f, MOK_QUANT_FP32_SCALE, &b) == 0x1p-126f);
  MOK_EXPECT(mok_block_scale(448.0f * 0x1p-125f, MOK_QUANT_FP32_SCALE, &b) == 0x1p-125f);
  MOK_EXPECT(isnan(mok_block_scale(NAN, MOK_QUANT_FP32_SCALE, &b)));
  MOK_EXPECT(isnan(mok_block_scale(INFINITY, MOK_QUANT_FP32_SCALE, &b)));
  MOK_EXPECT(b == 0xAB);
}

MOK_TEST(block_scale_pow2_and_e8m0) {
  const mok_quant_scale_t kinds[2] = {MOK_QUANT_POW2_SCALE, MOK_QUANT_E8M0_SCALE};
  for (int i = 0; i < 2; i++) {
    mok_quant_scale_t kind = kinds[i];
    uint8_t b = 0xAB;
    /* Zero block: X = -127, s = 2^-127 (an fp32 subnormal), byte -127 + 127 = 0. */
    MOK_EXPECT(mok_block_scale(0.0f, kind, &b) == 0x1p-127f && b == 0);
    /* amax = 448 * 2^k exactly: X = k (byte k + 127); one ulp above: X = k + 1. */
    for (int k = -120; k <= 119; k += 7) {
      float a = ldexpf(448.0f, k);
      MOK_EXPECT_MSG(mok_block_scale(a, kind, &b) == ldexpf(1.0f, k) && b == k + 127, "k %d", k);
      a = nextafterf(a, INFINITY);
      MOK_EXPECT_MSG(mok_block_scale(a, kind, &b) == ldexpf(1.0f, k + 1) && b == k + 128, "k %d",
                     k);
    }
    /* amax = 1: 448 * 2^-9 = 0.875 < 1 <= 448 * 2^-8 = 1.75: X = -8, byte 119. */
    MOK_EXPECT(mok_block_scale(1.0f, kind, &b) == 0x1p-8f && b == 119);
    /* amax = 0.875 * 2^-20: equals 448 * 2^-29 exactly: X = -29, byte 98. */
    MOK_EXPECT(mok_block_scale(0.875f * 0x1p-20f, kind, &b) == 0x1p-29f && b == 98);
    /* Subnormal amax 2^-140: already <= 448 * 2^-127 = 1.75 * 2^-119, X clamps at -127. */
    MOK_EXPECT(mok_block_scale(0x1p-140f, kind, &b) == 0x1p-127f && b == 0);
    MOK_EXPECT(mok_block_scale(f32_of_bits(1u), kind, &b) == 0x1p-127f && b == 0);
    /* The lowest boundary: 448 * 2^-127 -> X = -127; one ulp above -> X = -126. */
    MOK_EXPECT(mok_block_scale(448.0f * 0x1p-127f, kind, &b) == 0x1p-127f && b == 0);
    MOK_EXPECT(mok_block_scale(nextafterf(448.0f * 0x1p-127f, 1.0f), kind, &b) == 0x1p-126f &&
               b == 1);
    /* Huge amax: FLT_MAX ~ 2^128 lies between 448 * 2^119 = 1.75 * 2^127 and 448 * 2^120 =
     * 1.75 * 2^128, so X = 120 (byte 247). No finite fp32 amax reaches the clamp at 127. */
    MOK_EXPECT(mok_block_scale(f32_of_bits(0x7F7FFFFFu), kind, &b) == 0x1p120f && b == 247);
    /* Non-finite blocks: NaN scale and the E8M0 NaN byte. */
    b = 0;
    MOK_EXPECT(isnan(mok_block_scale(NAN, kind, &b)) && b == 0xFF);
    b = 0;
    MOK_EXPECT(isnan(mok_block_scale(INFINITY, kind, &b)) && b == 0xFF);
    /* The byte is optional. */
    MOK_EXPECT(mok_block_scale(448.0f, kind, NULL) == 1.0f);
  }
}

/* ---- matrix quantizers ----------------------------------------------------------------------- */

MOK_TEST(quantize_hand_matrix_pow2_ragged) {
  /* [2, 6] with 1x4 blocks: each row has a full block (cols 0..3) and a clipped one (4..5).
   * Row 0, block 0: amax 3; 448 * 2^-8 = 1.75 < 3 <= 448 * 2^-7 = 3.5 -> s = 2^-7 (byte 120).
   *   1 / 2^-7 = 128 = 2^7: field 14 -> 0x70;  -2 -> -256 = 2^8: field 15 -> 0xF8;
   *   3 -> 384 = 1.5 * 2^8: field 15, mantissa 4 -> 0x7C;  0.5 -> 64 = 2^6: field 13 -> 0x68.
   * Row 0, block 1: amax 1000; 896 < 1000 <= 1792 -> X = 2, s = 4 (byte 129).
   *   1000 / 4 = 250: grid step 16 in [128, 256): 240 or 256, nearer 256 -> 0x78;  -0 -> 0x80.
   * Row 1, block 0: holds a NaN -> NaN scale (byte 0xFF), all four codes 0x7F.
   * Row 1, block 1: amax 2^-20; 448 * 2^-29 = 0.875 * 2^-20 < 2^-20 <= 448 * 2^-28 -> X = -28
   *   (byte 99); 2^-20 / 2^-28 = 256 -> 0x78; 0 -> 0x00. */
  const float in[12] = {1, -2, 3, 0.5f, 1000, -0.0f, NAN, 1, 1, 1, 0x1p-20f, 0};
  const uint8_t want_q[12] = {0x70, 0xF8, 0x7C, 0x68, 0x78, 0x80,
                              0x7F, 0x7F, 0x7F, 0x7F, 0x78, 0x00};
  uint8_t q[12];
  float s[4];
  uint8_t e[4];
  MOK_REQUIRE(mok_quantize_host(in, 2, 6, 1, 4, MOK_QUANT_POW2_SCALE, q, s) == MOK_SUCCESS);
  MOK_EXPECT(memcmp(q, want_q, sizeof q) == 0);
  MOK_EXPECT(s[0] == 0x1p-7f && s[1] == 4.0f && isnan(s[2]) && s[3] == 0x1p-28f);
  MOK_REQUIRE(mok_quantize_host(in, 2, 6, 1, 4, MOK_QUANT_E8M0_SCALE, q, e) == MOK_SUCCESS);
  MOK_EXPECT(memcmp(q, want_q, sizeof q) == 0);
  MOK_EXPECT(e[0] == 120 && e[1] == 129 && e[2] == 0xFF && e[3] == 99);
  /* Dequantized: [1, -2, 3, 0.5, 1024, -0], [NaN x 4, 2^-20, 0]. */
  float out[12];
  MOK_REQUIRE(mok_dequantize_host(q, e, 2, 6, 1, 4, MOK_QUANT_E8M0_SCALE, out) == MOK_SUCCESS);
  const float want[6] = {1, -2, 3, 0.5f, 1024, -0.0f};
  for (int i = 0; i < 6; i++) MOK_EXPECT(f32_bits(out[i]) == f32_bits(want[i]));
  for (int i = 6; i < 10; i++) MOK_EXPECT(isnan(out[i]));
  MOK_EXPECT(out[10] == 0x1p-20f && out[11] == 0.0f);
}

MOK_TEST(quantize_hand_matrix_fp32_and_infinity) {
  /* [3, 4] with 1x2 blocks, FP32 scales.
   * Row 0: [448, -224] -> s = 448 / 448 = 1: 0x7E; 224 = 1.75 * 2^7: field 14, mantissa 6 -> 0xF6.
   *        [1, 0.3]: s = 1 / 448; 1 / s = 448.00000x at most one rounding off 448 -> 0x7E;
   *        0.3 / s = 134.4 (to fp32 rounding): grid step 16 in [128, 256) -> 128 = 0x70.
   * Row 1: [896, 1] -> s = 2: 448 -> 0x7E; 0.5 = 2^-1: field 6 -> 0x30.
   *        [inf, 5] -> NaN scale, both 0x7F (an infinity makes the whole block NaN).
   * Row 2: [0, -0] -> s = 2^-126 (floor): 0x00, 0x80.  [-1e-3, 7]: s = 7/448 = 2^-6;
   *        -1e-3 * 64 = -0.064 = -1.024 * 2^-4: field 3, mantissa 0.192 -> 0 -> 1 0011 000 = 0x98;
   *        7 -> 0x7E. */
  const float in[12] = {448, -224, 1, 0.3f, 896, 1, INFINITY, 5, 0, -0.0f, -1e-3f, 7};
  const uint8_t want_q[12] = {0x7E, 0xF6, 0x7E, 0x70, 0x7E, 0x30,
                              0x7F, 0x7F, 0x00, 0x80, 0x98, 0x7E};
  uint8_t q[12];
  float s[6];
  MOK_REQUIRE(mok_quantize_host(in, 3, 4, 1, 2, MOK_QUANT_FP32_SCALE, q, s) == MOK_SUCCESS);
  for (int i = 0; i < 12; i++) {
    MOK_EXPECT_MSG(q[i] == want_q[i], "q[%d] = 0x%02X, expected 0x%02X", i, q[i], want_q[i]);
  }
  MOK_EXPECT(s[0] == 1.0f && s[1] == 1.0f / 448.0f && s[2] == 2.0f && isnan(s[3]));
  MOK_EXPECT(s[4] == 0x1p-126f && s[5] == 0x1p-6f);
}

/* The quantizer written another way: one pass over the elements accumulates every block's amax
 * (and non-finite flag), then each element is encoded with its block's scale. Independent of
 * quant.c's block-by-block loop. */
static void quantize_naive(const float *in, int64_t rows, int64_t cols, int br, int bc,
                           mok_quant_scale_t kind, uint8_t *q, float *s_f32, uint8_t *s_e8) {
  int64_t nbc = (cols + bc - 1) / bc, nb = ((rows + br - 1) / br) * nbc;
  float *amax = calloc(nb, sizeof *amax), *scale = calloc(nb, sizeof *scale);
  MOK_REQUIRE(amax && scale);
  for (int64_t i = 0; i < rows * cols; i++) {
    int64_t b = (i / cols) / br * nbc + (i % cols) / bc;
    float a = fabsf(in[i]);
    amax[b] = !isfinite(a) || isnan(amax[b]) ? NAN : (a > amax[b] ? a : amax[b]);
  }
  for (int64_t b = 0; b < nb; b++) {
    uint8_t e8 = 0;
    scale[b] = mok_block_scale(amax[b], kind, &e8);
    if (kind == MOK_QUANT_E8M0_SCALE) {
      s_e8[b] = e8;
    } else {
      s_f32[b] = scale[b];
    }
  }
  for (int64_t i = 0; i < rows * cols; i++) {
    int64_t b = (i / cols) / br * nbc + (i % cols) / bc;
    q[i] = isnan(amax[b]) ? 0x7F : mok_e4m3_from_float(in[i] / scale[b]);
  }
  free(amax);
  free(scale);
}

/* Quantizes random data with the given blocks three ways (all kinds) and checks: bytes and scales
 * equal the naive quantizer; dequantized values are within half an e4m3 step of the input. */
static void check_matrix(int64_t rows, int64_t cols, int br, int bc, uint64_t seed, int specials) {
  int64_t n = rows * cols, nb = ((rows + br - 1) / br) * ((cols + bc - 1) / bc);
  float *in = malloc(n * sizeof *in), *out = malloc(n * sizeof *out);
  float *s = malloc(nb * sizeof *s), *s_ref = malloc(nb * sizeof *s_ref);
  uint8_t *q = malloc(n), *q_ref = malloc(n);
  uint8_t *e = malloc(nb), *e_ref = malloc(nb);
  MOK_REQUIRE(in && out && s && s_ref && q && q_ref && e && e_ref);
  test_rng_t rng = test_rng(seed);
  for (int64_t i = 0; i < n; i++) {
    /* Each row has its own magnitude range so blocks get different scales. */
    int base = (int)((i / cols) % 40) - 30;
    in[i] = random_value(&rng, base - 12, base);
  }
  if (specials && n > 3 * bc) {
    in[1] = NAN;
    in[n - 1] = -INFINITY;
    for (int64_t i = 0; i < n && i < bc; i++) in[n / 2 + i] = 0.0f; /* part of a block or more */
  }
  const mok_quant_scale_t kinds[3] = {MOK_QUANT_FP32_SCALE, MOK_QUANT_POW2_SCALE,
                                      MOK_QUANT_E8M0_SCALE};
  for (int k = 0; k < 3; k++) {
    mok_quant_scale_t kind = kinds[k];
    void *scales = kind == MOK_QUANT_E8M0_SCALE ? (void *)e : (void *)s;
    MOK_REQUIRE(mok_quantize_host(in, rows, cols, br, bc, kind, q, scales) == MOK_SUCCESS);
    quantize_naive(in, rows, cols, br, bc, kind, q_ref, s_ref, e_ref);
    MOK_EXPECT_MSG(memcmp(q, q_ref, n) == 0, "kind %d: e4m3 bytes differ", kind);
    if (kind == MOK_QUANT_E8M0_SCALE) {
      MOK_EXPECT(memcmp(e, e_ref, nb) == 0);
    } else {
      MOK_EXPECT(memcmp(s, s_ref, nb * sizeof *s) == 0); /* NaN bits are the same NAN */
    }
    MOK_REQUIRE(mok_dequantize_host(q, scales, rows, cols, br, bc, kind, out) == MOK_SUCCESS);
    int64_t nbc = (cols + bc - 1) / bc;
    for (int64_t i = 0; i < n; i++) {
      float v = in[i];
      int64_t si = (i / cols) / br * nbc + (i % cols) / bc;
      float sc = kind != MOK_QUANT_E8M0_SCALE ? s[si]
                 : e[si] == 0xFF              ? NAN
                                              : ldexpf(1.0f, e[si] - 127);
      if (isnan(sc)) {
        MOK_EXPECT(q[i] == 0x7F && isnan(out[i]));
        continue;
      }
      /* RNE on e4m3 is off by at most half a step of v / s: 2^-4 |v / s| for normals, 2^-10 for
       * subnormals; the fp32 division and product add at most 2^-24 relative each (the 2^-22
       * term covers them with room). Saturation is never hit: amax / s <= 448 up to rounding. */
      double bound = 0x1p-4 * fabs(v) + 0x1p-10 * sc + 0x1p-22 * (fabs(v) + sc);
      MOK_EXPECT_MSG(fabs((double)out[i] - v) <= bound, "kind %d: %a -> %a (s %a)", kind, (double)v,
                     (double)out[i], (double)sc);
    }
  }
  free(in);
  free(out);
  free(s);
  free(s_ref);
  free(q);
  free(q_ref);
  free(e);
  free(e_ref);
}

MOK_TEST(quantize_1x128_activations) { check_matrix(5, 512, 1, 128, 0x1234, 0); }
MOK_TEST(quantize_128x128_weights) { check_matrix(256, 384, 128, 128, 0x2345, 0); }
MOK_TEST(quantize_1x32_mxfp8) { check_matrix(7, 256, 1, 32, 0x3456, 0); }
MOK_TEST(quantize_ragged_edges) {
  check_matrix(130, 300, 128, 128, 0x4567, 0); /* 2 x 3 blocks, the last row and column clipped */
  check_matrix(3, 100, 1, 32, 0x5678, 0);      /* last block 4 wide */
  check_matrix(9, 77, 4, 16, 0x6789, 1);       /* with NaN, -inf and zero blocks */
  check_matrix(1, 1, 1024, 1024, 0x789A, 0);
}

MOK_TEST(quantize_amax_element_maps_to_448) {
  /* With FP32 scales, amax / (amax / 448) is 448 up to one fp32 rounding, which e4m3 rounds (or
   * saturates) to 448: the largest element of every block encodes as +-448. */
  test_rng_t rng = test_rng(99);
  for (int i = 0; i < 2000; i++) {
    float blk[32];
    float amax = 0;
    int at = 0;
    for (int j = 0; j < 32; j++) {
      blk[j] = random_value(&rng, -100, 100);
      if (fabsf(blk[j]) > amax) amax = fabsf(blk[j]), at = j;
    }
    uint8_t q[32];
    float s;
    MOK_REQUIRE(mok_quantize_host(blk, 1, 32, 1, 32, MOK_QUANT_FP32_SCALE, q, &s) == MOK_SUCCESS);
    MOK_EXPECT_MSG((q[at] & 0x7F) == 0x7E, "amax %a -> 0x%02X", (double)amax, q[at]);
  }
}

MOK_TEST(qdq_matrix_equals_quantize_dequantize) {
  const struct {
    int64_t rows, cols;
    int br, bc;
    mok_quant_scale_t kind;
  } cases[] = {{4, 300, 1, 128, MOK_QUANT_FP32_SCALE},
               {130, 260, 128, 128, MOK_QUANT_POW2_SCALE},
               {3, 100, 1, 32, MOK_QUANT_E8M0_SCALE},
               {6, 70, 2, 32, MOK_QUANT_FP32_SCALE}};
  test_rng_t rng = test_rng(0xABCDEF);
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int64_t rows = cases[c].rows, cols = cases[c].cols, n = rows * cols;
    int64_t nb =
        ((rows + cases[c].br - 1) / cases[c].br) * ((cols + cases[c].bc - 1) / cases[c].bc);
    double *m = malloc(n * sizeof *m);
    float *f = malloc(n * sizeof *f), *out = malloc(n * sizeof *out), *s = malloc(nb * 4);
    uint8_t *q = malloc(n);
    MOK_REQUIRE(m && f && out && s && q);
    for (int64_t i = 0; i < n; i++) {
      /* Doubles that are not fp32 values, so the first rounding to fp32 matters. */
      m[i] = (double)random_value(&rng, -20, 10) * (1.0 + 0x1p-30);
      f[i] = (float)m[i];
    }
    if (c == 0) m[5] = f[5] = NAN; /* a NaN block (row 0, cols 0..127) */
    if (c == 3) {
      m[n - 1] = 1e300; /* finite as a double, +inf in fp32: its block (2 x 6, clipped) is NaN */
      f[n - 1] = INFINITY;
    }
    mok_qdq_matrix(m, rows, cols, cases[c].br, cases[c].bc, cases[c].kind);
    MOK_REQUIRE(mok_quantize_host(f, rows, cols, cases[c].br, cases[c].bc, cases[c].kind, q, s) ==
                MOK_SUCCESS);
    MOK_REQUIRE(mok_dequantize_host(q, s, rows, cols, cases[c].br, cases[c].bc, cases[c].kind,
                                    out) == MOK_SUCCESS);
    int64_t diff = 0, nans = 0;
    for (int64_t i = 0; i < n; i++) {
      double want = (double)out[i];
      diff += memcmp(&m[i], &want, sizeof want) != 0;
      nans += isnan(want);
    }
    MOK_EXPECT_MSG(diff == 0, "case %zu: %lld values differ", c, (long long)diff);
    MOK_EXPECT(nans == (c == 0 ? 128 : c == 3 ? 2 * 6 : 0)); /* the NaN blocks' sizes */
    free(m);
    free(f);
    free(out);
    free(s);
    free(q);
  }
}

MOK_TEST(quantize_host_validation) {
  float in[4] = {1, 2, 3, 4}, out[4], s[4];
  uint8_t q[4] = {0xAA, 0xAA, 0xAA, 0xAA};
  const mok_quant_scale_t k = MOK_QUANT_FP32_SCALE;
  MOK_EXPECT(mok_quantize_host(NULL, 2, 2, 1, 2, k, q, s) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(strstr(mok_last_error(), "in is NULL") != NULL);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1, 2, k, NULL, s) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1, 2, k, q, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_quantize_host(in, -1, 2, 1, 2, k, q, s) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(strstr(mok_last_error(), "mok_quantize_host") != NULL);
  MOK_EXPECT(mok_quantize_host(in, 2, -1, 1, 2, k, q, s) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 0, 2, k, q, s) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1025, 2, k, q, s) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1, 0, k, q, s) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1, -5, k, q, s) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1, 1025, k, q, s) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1, 2, (mok_quant_scale_t)3, q, s) ==
             MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_quantize_host(in, INT64_MAX, 2, 1, 2, k, q, s) == MOK_ERROR_INVALID_VALUE);
  /* Nothing was written by a failed call; empty matrices succeed and write nothing. */
  MOK_EXPECT(q[0] == 0xAA && q[3] == 0xAA);
  MOK_EXPECT(mok_quantize_host(in, 0, 2, 1, 2, k, q, s) == MOK_SUCCESS);
  MOK_EXPECT(mok_quantize_host(in, 2, 0, 1, 2, k, q, s) == MOK_SUCCESS);
  MOK_EXPECT(q[0] == 0xAA && q[3] == 0xAA);
  /* The extremes of the block range are accepted. */
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1024, 1, k, q, s) == MOK_SUCCESS);
  MOK_EXPECT(mok_quantize_host(in, 2, 2, 1, 1024, k, q, s) == MOK_SUCCESS);

  out[0] = 123.0f;
  MOK_EXPECT(mok_dequantize_host(NULL, s, 2, 2, 1, 2, k, out) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(strstr(mok_last_error(), "q is NULL") != NULL);
  MOK_EXPECT(mok_dequantize_host(q, NULL, 2, 2, 1, 2, k, out) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_dequantize_host(q, s, 2, 2, 1, 2, k, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_dequantize_host(q, s, -1, 2, 1, 2, k, out) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_dequantize_host(q, s, 2, -1, 1, 2, k, out) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_dequantize_host(q, s, 2, 2, 0, 2, k, out) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_dequantize_host(q, s, 2, 2, 1025, 2, k, out) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_dequantize_host(q, s, 2, 2, 1, 0, k, out) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_dequantize_host(q, s, 2, 2, 1, 1025, k, out) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_dequantize_host(q, s, 2, 2, 1, 2, (mok_quant_scale_t)-1, out) ==
             MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(out[0] == 123.0f);
  MOK_EXPECT(mok_dequantize_host(q, s, 0, 0, 1, 2, k, out) == MOK_SUCCESS && out[0] == 123.0f);
}
