/*
 * test_misuse.c: what a caller gets wrong, answered with an error instead of a crash: handles
 * used after destroy or destroyed twice (refused while their memory has not been reused, because
 * destroy clears their magic word first), a communicator destroyed under a live layer (refused:
 * it counts its layers), a pointer that never was a handle, NULL arguments at every entry point.
 */
#include <stdint.h>
#include <string.h>

#include "mok.h"
#include "test.h"

static int msg_has(const char *needle) { return strstr(mok_last_error(), needle) != NULL; }

static mok_layer_desc_t small_desc(void) {
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = 128, d.intermediate = 128, d.num_experts = 4, d.top_k = 2, d.max_tokens = 8;
  return d;
}

/* Memory that never was a handle: zeros, and bytes that are no magic word. */
static uint64_t g_junk[128];

MOK_TEST(misuse_layer_destroyed_twice_or_used_after_destroy) {
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  const mok_layer_desc_t d = small_desc();
  mok_layer_t l;
  MOK_REQUIRE(mok_layer_create(&l, c, &d) == MOK_SUCCESS);
  MOK_EXPECT(mok_layer_destroy(l) == MOK_SUCCESS);
  /* Nothing has been allocated since: the freed handle still reads as destroyed. */
  MOK_EXPECT(mok_layer_destroy(l) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(msg_has("destroyed or invalid handle") && msg_has("mok_layer_destroy"));
  size_t n = 7;
  MOK_EXPECT(mok_context_size(l, &n) == MOK_ERROR_INVALID_VALUE && n == 7);
  MOK_EXPECT(msg_has("destroyed or invalid handle") && msg_has("mok_context_size"));
  MOK_EXPECT(mok_quantized_weights_size(l, &n) == MOK_ERROR_INVALID_VALUE && n == 7);
  MOK_EXPECT(mok_layer_workspace_size(l, &n) == MOK_ERROR_INVALID_VALUE && n == 7);
  MOK_EXPECT(mok_layer_check(l) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(strstr(mok_layer_last_error(l), "invalid") != NULL);
  MOK_EXPECT(mok_layer_destroy(NULL) == MOK_SUCCESS); /* like free(NULL) */
  MOK_EXPECT(mok_comm_destroy(c) == MOK_SUCCESS);
}

MOK_TEST(misuse_comm_destroyed_under_a_live_layer_is_refused) {
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  const mok_layer_desc_t d = small_desc();
  mok_layer_t a, b;
  MOK_REQUIRE(mok_layer_create(&a, c, &d) == MOK_SUCCESS);
  MOK_REQUIRE(mok_layer_create(&b, c, &d) == MOK_SUCCESS);
  MOK_EXPECT(mok_comm_destroy(c) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT_MSG(msg_has("2 layers") && msg_has("mok_layer_destroy"), "%s", mok_last_error());
  MOK_EXPECT(mok_layer_destroy(a) == MOK_SUCCESS);
  MOK_EXPECT(mok_comm_destroy(c) == MOK_ERROR_INVALID_VALUE && msg_has("1 layer "));
  /* The refused destroy left everything working. */
  int rank = -1;
  size_t n = 0;
  MOK_EXPECT(mok_comm_rank(c, &rank) == MOK_SUCCESS && rank == 0);
  MOK_EXPECT(mok_context_size(b, &n) == MOK_SUCCESS && n > 0);
  MOK_EXPECT(mok_layer_destroy(b) == MOK_SUCCESS);
  MOK_EXPECT(mok_comm_destroy(c) == MOK_SUCCESS);
  /* Destroyed: refused, not freed again. */
  MOK_EXPECT(mok_comm_destroy(c) == MOK_ERROR_INVALID_VALUE && msg_has("destroyed or invalid handle"));
  MOK_EXPECT(mok_comm_rank(c, &rank) == MOK_ERROR_INVALID_VALUE);
  mok_layer_t l = (mok_layer_t)0x1;
  MOK_EXPECT(mok_layer_create(&l, c, &d) == MOK_ERROR_INVALID_VALUE && l == NULL);
  MOK_EXPECT(mok_comm_destroy(NULL) == MOK_SUCCESS);
}

MOK_TEST(misuse_pointers_that_never_were_handles) {
  memset(g_junk, 0x5A, sizeof(g_junk));
  mok_layer_t l = (mok_layer_t)(void *)g_junk;
  mok_comm_t c = (mok_comm_t)(void *)g_junk;
  size_t n = 3;
  int v = 3;
  MOK_EXPECT(mok_layer_destroy(l) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_context_size(l, &n) == MOK_ERROR_INVALID_VALUE && n == 3);
  MOK_EXPECT(mok_comm_size(c, &v) == MOK_ERROR_INVALID_VALUE && v == 3);
  MOK_EXPECT(mok_comm_device(c, &v) == MOK_ERROR_INVALID_VALUE && v == 3);
  MOK_EXPECT(mok_comm_destroy(c) == MOK_ERROR_INVALID_VALUE);
  for (size_t i = 0; i < sizeof(g_junk); i++) /* nothing was written into them */
    MOK_EXPECT(((const unsigned char *)g_junk)[i] == 0x5A);
  memset(g_junk, 0, sizeof(g_junk));
  MOK_EXPECT(mok_layer_check(l) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_comm_rank(c, &v) == MOK_ERROR_INVALID_VALUE);
}

/* Every entry point that takes a handle or an output pointer refuses NULL with a message. */
MOK_TEST(misuse_null_arguments_everywhere) {
  size_t n;
  int v;
  MOK_EXPECT(mok_comm_rank(NULL, &v) == MOK_ERROR_NULL_POINTER && msg_has("comm is NULL"));
  MOK_EXPECT(mok_comm_size(NULL, &v) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_comm_device(NULL, &v) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layer_check(NULL) == MOK_ERROR_NULL_POINTER && msg_has("layer is NULL"));
  MOK_EXPECT(mok_layer_workspace_size(NULL, &n) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_context_size(NULL, &n) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_quantized_weights_size(NULL, &n) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(strcmp(mok_layer_last_error(NULL), "") == 0);
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  MOK_EXPECT(mok_comm_size(c, NULL) == MOK_ERROR_NULL_POINTER);
  const mok_layer_desc_t d = small_desc();
  mok_layer_t l;
  MOK_REQUIRE(mok_layer_create(&l, c, &d) == MOK_SUCCESS);
  MOK_EXPECT(mok_layer_workspace_size(l, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_context_size(l, NULL) == MOK_ERROR_NULL_POINTER && msg_has("bytes"));
  MOK_EXPECT(mok_quantized_weights_size(l, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(strstr(mok_layer_last_error(l), "bytes") != NULL); /* the layer keeps the detail */
  MOK_EXPECT(mok_quantize_host(NULL, 1, 1, 1, 1, MOK_QUANT_FP32_SCALE, NULL, NULL) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_dequantize_host(NULL, NULL, 1, 1, 1, 1, MOK_QUANT_FP32_SCALE, NULL) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layer_destroy(l) == MOK_SUCCESS);
  MOK_EXPECT(mok_comm_destroy(c) == MOK_SUCCESS);
}
