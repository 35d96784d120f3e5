/*
 * test_overflow.c: size arithmetic. Descriptors whose sizes would not fit in 64 bits are refused
 * at mok_layer_create with the numbers in the message (before the bounds, I = 2^50 gave a context
 * size of 64 bytes and MXFP8 H = I = 2^40 a quantized size of 0), and at the largest descriptor
 * the bounds allow every size query returns the exact value, computed here independently.
 * Built with -fsanitize=undefined these tests also show that no size computation overflows.
 */
#include <stdint.h>
#include <string.h>

#include "common/context.h"
#include "common/limits.h"
#include "common/quantized_layout.h"
#include "common/workspace.h"
#include "mok.h"
#include "test.h"

static int msg_has(const char *needle) { return strstr(mok_last_error(), needle) != NULL; }

static mok_layer_desc_t small_desc(void) {
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = 128, d.intermediate = 128, d.num_experts = 64, d.top_k = 2, d.max_tokens = 16;
  return d;
}

/* create must fail with `code`, name `field` and print `number`. */
static void expect_refused(mok_comm_t c, const mok_layer_desc_t *d, mokResult_t code,
                           const char *field, const char *number) {
  mok_layer_t l = (mok_layer_t)0x1;
  const mokResult_t r = mok_layer_create(&l, c, d);
  MOK_EXPECT_MSG(r == code && l == NULL && msg_has(field) && msg_has(number),
                 "%s = %s: got %d, message '%s'", field, number, (int)r, mok_last_error());
  if (r == MOK_SUCCESS) mok_layer_destroy(l);
}

MOK_TEST(overflow_descriptors_are_refused_with_their_numbers) {
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  mok_layer_desc_t d = small_desc();
  /* The user's case: T_max K I = 2^80 wrapped the context size to 64 bytes. */
  d.intermediate = INT64_C(1) << 50, d.max_tokens = 1 << 24, d.top_k = 64;
  expect_refused(c, &d, MOK_ERROR_INVALID_SHAPE, "intermediate", "1125899906842624");
  /* MXFP8 with H = I = 2^40: the quantized size wrapped to 0. */
  d = small_desc();
  d.precision = MOK_PRECISION_MXFP8, d.hidden = d.intermediate = INT64_C(1) << 40;
  expect_refused(c, &d, MOK_ERROR_INVALID_SHAPE, "hidden", "1099511627776");
  d = small_desc();
  d.shared_intermediate = MOK_MAX_DIM + 128;
  expect_refused(c, &d, MOK_ERROR_INVALID_SHAPE, "shared_intermediate", "1048704");
  d = small_desc();
  d.num_experts = MOK_MAX_NUM_EXPERTS * 2;
  expect_refused(c, &d, MOK_ERROR_INVALID_SHAPE, "num_experts", "131072");
  d = small_desc();
  d.max_tokens = MOK_MAX_TOKENS + 1;
  expect_refused(c, &d, MOK_ERROR_INVALID_VALUE, "max_tokens", "16777217");
  d = small_desc();
  d.hidden = INT64_MAX - 127; /* a multiple of 128 */
  expect_refused(c, &d, MOK_ERROR_INVALID_SHAPE, "hidden", "9223372036854775680");
  mok_comm_destroy(c);
}

/* The largest descriptor the bounds allow: each size query returns the exact size. */
MOK_TEST(overflow_sizes_at_the_bounds_are_exact) {
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = d.intermediate = d.shared_intermediate = MOK_MAX_DIM;
  d.num_experts = MOK_MAX_NUM_EXPERTS, d.top_k = MOK_MAX_TOP_K, d.max_tokens = MOK_MAX_TOKENS;
  const uint64_t H = (uint64_t)MOK_MAX_DIM, I = H, Is = H, E = (uint64_t)MOK_MAX_NUM_EXPERTS;
  const uint64_t T = (uint64_t)MOK_MAX_TOKENS, K = MOK_MAX_TOP_K;
  for (int p = 0; p < 3; p++) {
    d.precision = (mok_precision_t)p;
    mok_layer_t l;
    MOK_REQUIRE_MSG(mok_layer_create(&l, c, &d) == MOK_SUCCESS, "%s", mok_last_error());
    size_t ctx = 0, q = 1;
    MOK_EXPECT(mok_context_size(l, &ctx) == MOK_SUCCESS);
    /* CPU context: the header, then bf16 g, u [T_max K, I] and gs, us [T_max, Is] */
    MOK_EXPECT_MSG(ctx == sizeof(mok_ctx_header_t) + 4 * (T * K * I + T * Is), "ctx %zu", ctx);
    MOK_EXPECT(mok_quantized_weights_size(l, &q) == MOK_SUCCESS);
    if (p == MOK_PRECISION_BF16) {
      MOK_EXPECT(q == 0);
    } else {
      /* 6 routed copies of E I H e4m3 bytes and 6 shared ones of Is H, each with its scales:
       * fp8-block one fp32 per 128 x 128 block, MXFP8 one byte per 1 x 32; every region is a
       * multiple of 256 bytes already, so there is no padding. */
      const uint64_t sc = p == MOK_PRECISION_MXFP8 ? I * H / 32 : I * H / (128 * 128) * 4;
      const uint64_t want = 6 * (E * I * H + E * sc) + 6 * (Is * H + sc);
      MOK_EXPECT_MSG(q == want, "precision %d: quantized %zu, expected %llu", p, q,
                     (unsigned long long)want);
    }
    mok_layer_destroy(l);
  }
  mok_comm_destroy(c);
}

/* The GPU layout (common/workspace.h, host and device) at the bounds, with the largest capacity:
 * the workspace holds at least its big routed regions, and the context exactly what it lists. */
MOK_TEST(overflow_gpu_layout_at_the_bounds_does_not_wrap) {
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = d.intermediate = d.shared_intermediate = MOK_MAX_DIM;
  d.num_experts = 1024, d.top_k = MOK_MAX_TOP_K, d.max_tokens = MOK_MAX_TOKENS;
  d.context_mode = MOK_CONTEXT_SAVE, d.wgrad_dtype = MOK_WGRAD_BF16, d.wgrad_accumulate = 1;
  const mok_ws_dims_t dims = mok_ws_dims(&d, d.num_experts, MOK_MAX_CAPACITY_ROWS);
  mok_ws_layout_t lay;
  mok_ws_layout(&dims, &lay);
  const uint64_t R = (uint64_t)MOK_MAX_CAPACITY_ROWS, H = (uint64_t)MOK_MAX_DIM, I = H;
  /* xg, dyg, dxk (bf16) [R, H]; a, dg, du (bf16), ds (fp32) [R, I]; wgrad32 [E I H] fp32 */
  const uint64_t big = R * H * 6 + R * I * 10 + 1024 * I * H * 4;
  MOK_EXPECT_MSG(lay.ws_bytes >= big && lay.ws_bytes < big + (big >> 4), "ws %zu, regions %llu",
                 lay.ws_bytes, (unsigned long long)big);
  MOK_EXPECT(lay.ctx_bytes >= 4 * R * I && lay.ctx[MOK_CTX_US] < lay.ctx_bytes);
}

/* fp8-block: the e4m3 regions (xqt, xq, aq, aq2, asq, asq2 and their K-block-major scales) at the
 * bounds are there, do not wrap, and are what workspace.h lists; BF16 layers have none of them. */
MOK_TEST(overflow_gpu_layout_fp8_regions_at_the_bounds) {
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = d.intermediate = d.shared_intermediate = MOK_MAX_DIM;
  d.num_experts = 1024, d.top_k = MOK_MAX_TOP_K, d.max_tokens = MOK_MAX_TOKENS;
  const uint64_t R = (uint64_t)MOK_MAX_CAPACITY_ROWS, H = (uint64_t)MOK_MAX_DIM, I = H, Is = H;
  const uint64_t T = (uint64_t)MOK_MAX_TOKENS;
  mok_ws_layout_t lay[2];
  for (int fp8 = 0; fp8 < 2; fp8++) {
    d.precision = fp8 ? MOK_PRECISION_FP8_BLOCK : MOK_PRECISION_BF16;
    const mok_ws_dims_t dims = mok_ws_dims(&d, d.num_experts, MOK_MAX_CAPACITY_ROWS);
    MOK_EXPECT(dims.fp8 == fp8);
    mok_ws_layout(&dims, &lay[fp8]);
  }
  /* e4m3 values, and 4-byte scales per 128 columns of rows padded to 4 */
  const uint64_t R4 = (R + 3) / 4 * 4, T4 = (T + 3) / 4 * 4;
  const uint64_t q = T * H + R * H + 2 * R * I + 2 * T * Is;
  const uint64_t sc = 4 * ((H / 128) * T4 + (H / 128) * R4 + (2 * I / 128) * R4 + (2 * Is / 128) * T4);
  const uint64_t grew = lay[1].ws_bytes - lay[0].ws_bytes;
  MOK_EXPECT_MSG(lay[1].ws_bytes > lay[0].ws_bytes && grew >= q + sc && grew < q + sc + 11 * 256,
                 "fp8 regions %llu bytes, expected %llu", (unsigned long long)grew,
                 (unsigned long long)(q + sc));
  MOK_EXPECT(lay[1].ws[MOK_WS_XQ] - lay[1].ws[MOK_WS_XQT] >= T * H);
  MOK_EXPECT(lay[1].ws[MOK_WS_AQ_S] - lay[1].ws[MOK_WS_AQ2] >= R * I);
  MOK_EXPECT(lay[1].ctx_bytes == lay[0].ctx_bytes); /* the context is the same */
  for (int r = MOK_WS_XQT; r < MOK_WS_COUNT; r++) /* BF16: empty, at the end */
    MOK_EXPECT(lay[0].ws[r] == lay[0].ws_bytes);
}

/* Without a shared expert the quantized weights hold no shared copies (count 0: nothing to read
 * from the NULL shared weights), with one they hold all six. */
MOK_TEST(overflow_quantized_layout_without_shared_expert) {
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = 256, d.intermediate = 384, d.num_experts = 4, d.top_k = 2, d.max_tokens = 16;
  d.precision = MOK_PRECISION_FP8_BLOCK;
  for (int shared = 0; shared < 2; shared++) {
    d.shared_intermediate = shared ? 128 : 0;
    mok_qw_layout_t q;
    mok_qw_layout(&d, 4, &q);
    for (int i = 0; i < MOK_QW_COUNT; i++) {
      const int is_shared = i >= MOK_QW_WSG;
      MOK_EXPECT_MSG(q.op[i].count == (is_shared ? shared : 4), "operand %d: count %lld", i,
                     (long long)q.op[i].count);
    }
  }
}

/* A zero-row matrix with cols near INT64_MAX is valid and empty; its block count must not
 * overflow (cols + block - 1 did: undefined behaviour that -fsanitize=undefined reports). */
MOK_TEST(overflow_host_quantizer_block_counts) {
  float in[1] = {1.0f}, out[1] = {0}, scales[1] = {0};
  uint8_t q[1] = {0};
  MOK_EXPECT(mok_quantize_host(in, 0, INT64_MAX, 1024, 1024, MOK_QUANT_FP32_SCALE, q, scales) ==
             MOK_SUCCESS);
  MOK_EXPECT(mok_dequantize_host(q, scales, 0, INT64_MAX, 1, 1024, MOK_QUANT_FP32_SCALE, out) ==
             MOK_SUCCESS);
  MOK_EXPECT(mok_quantize_host(in, INT64_MAX, 2, 1, 1, MOK_QUANT_FP32_SCALE, q, scales) ==
             MOK_ERROR_INVALID_VALUE); /* rows * cols overflows int64 */
}
