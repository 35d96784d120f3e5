/*
 * test_misuse.c: what a caller gets wrong, answered with an error instead of a crash: handles
 * used after destroy or destroyed twice (refused without reading their freed memory: live handles
 * are registered, src/api/handles.c, whose set is checked here against a plain model), a
 * communicator destroyed under a live layer (refused: it counts its layers), a pointer that never
 * was a handle, NULL arguments at every entry point, caller buffers whose stated size is below
 * what the layer needs (refused, naming both sizes), random descriptors (made or refused, never
 * anything else), and threads racing to create and destroy layers.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "mok.h"
#include "support/rng.h"
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
  MOK_EXPECT(mok_comm_destroy(c) == MOK_ERROR_INVALID_VALUE &&
             msg_has("destroyed or invalid handle"));
  MOK_EXPECT(mok_comm_rank(c, &rank) == MOK_ERROR_INVALID_VALUE);
  mok_layer_t l = (mok_layer_t)0x1;
  MOK_EXPECT(mok_layer_create(&l, c, &d) == MOK_ERROR_INVALID_VALUE && l == NULL);
  MOK_EXPECT(mok_comm_destroy(NULL) == MOK_SUCCESS);
}

/* The set of live handles against a plain array of flags: 3000 addresses (a run of neighbours,
 * as an allocator hands out, so that probe runs form and deletions must shift them back), each
 * added, looked up and taken in random order, under both kinds; a taken or never-added address,
 * or one of the other kind, is not live, and a second take fails. */
MOK_TEST(misuse_handle_set_matches_a_model) {
  enum { N = 3000 };
  static uint64_t cells[N];
  static int live[N]; /* 0: not live, else its kind */
  test_rng_t rng = test_rng(0x4a11d1e5u);
  int bad = 0;
  for (int step = 0; step < 40000; step++) {
    const int i = (int)test_rng_below(&rng, N), kind = 1 + (int)test_rng_below(&rng, 2);
    const int op = (int)test_rng_below(&rng, 3);
    if (op == 0 && !live[i]) {
      bad += !mok_handle_add(&cells[i], kind);
      live[i] = kind;
    } else if (op == 1) {
      bad += mok_handle_take(&cells[i], kind) != (live[i] == kind);
      if (live[i] == kind) live[i] = 0;
    } else {
      bad += mok_handle_live(&cells[i], kind) != (live[i] == kind);
    }
  }
  for (int i = 0; i < N; i++) {
    bad += mok_handle_live(&cells[i], MOK_HANDLE_COMM) != (live[i] == MOK_HANDLE_COMM);
    bad += mok_handle_live(&cells[i], MOK_HANDLE_LAYER) != (live[i] == MOK_HANDLE_LAYER);
    if (live[i]) bad += !mok_handle_take(&cells[i], live[i]) || mok_handle_take(&cells[i], live[i]);
  }
  MOK_EXPECT_MSG(bad == 0, "%d answers of the handle set differ from the model", bad);
  MOK_EXPECT(!mok_handle_live(NULL, MOK_HANDLE_LAYER) && !mok_handle_add(NULL, MOK_HANDLE_LAYER));
}

/* A value of a descriptor field: mostly a multiple of 128 up to 8192, else near the bounds (0, 1,
 * multiples of 128 and their neighbours, the limits and past them, the int64 extremes) or any
 * 64-bit pattern. */
static int64_t rnd_dim(test_rng_t *rng) {
  static const int64_t edge[] = {0,         1,         -1,          127,
                                 128,       129,       256,         384,
                                 1024,      4096,      1 << 20,     (1 << 20) + 128,
                                 1 << 24,   (1 << 24) + 1,          INT32_MAX,
                                 (int64_t)INT32_MAX + 1, INT64_MAX, INT64_MIN,
                                 -128,      64,        8,           2};
  const uint64_t pick = test_rng_below(rng, 16);
  if (pick == 0) return (int64_t)test_rng_u64(rng);
  if (pick < 12) return 128 * (int64_t)(1 + test_rng_below(rng, 64));
  return edge[test_rng_below(rng, sizeof(edge) / sizeof(edge[0]))];
}

/* Random descriptors, 20,000 of them: mok_layer_create either makes a layer whose size queries
 * answer, or refuses with a message; never anything else (and, under make sanitize, without
 * overflow or any other undefined behaviour in the size arithmetic). */
MOK_TEST(misuse_random_descriptors_are_created_or_refused) {
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  test_rng_t rng = test_rng(0xde5c0000u);
  static const double cf[] = {0.0, 1.0, 0.5, 1e-300, -1.0, 2.0, 1e300, 0.0 / 0.0, 1.0 / 0.0};
  int created = 0, bad = 0;
  for (int i = 0; i < 20000; i++) {
    mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
    d.hidden = rnd_dim(&rng), d.intermediate = rnd_dim(&rng);
    /* each field valid most of the time, so that many layers are made and each refusal has few
     * causes */
#define SOMETIMES(valid, other) (test_rng_below(&rng, 8) ? (valid) : (other))
    d.shared_intermediate = SOMETIMES(0, rnd_dim(&rng));
    d.num_experts = SOMETIMES((int64_t)(1 + test_rng_below(&rng, 300)), rnd_dim(&rng));
    d.top_k = SOMETIMES((int64_t)(1 + test_rng_below(&rng, 9)), rnd_dim(&rng));
    d.max_tokens = SOMETIMES((int64_t)(1 + test_rng_below(&rng, 1 << 16)), rnd_dim(&rng));
    const int bad_precision = 5 * (int)test_rng_below(&rng, 2) - 1;  /* -1 or 4 */
    d.precision = (mok_precision_t)SOMETIMES((int)test_rng_below(&rng, 3), bad_precision);
    d.fp8_scale = (mok_fp8_scale_t)SOMETIMES((int)test_rng_below(&rng, 2), 7);
    d.wgrad_dtype = (mok_wgrad_dtype_t)SOMETIMES((int)test_rng_below(&rng, 2), -3);
    d.wgrad_accumulate = SOMETIMES((int)test_rng_below(&rng, 2), 2);
    d.context_mode = (mok_context_mode_t)SOMETIMES((int)test_rng_below(&rng, 2), 9);
    d.comm_sms = SOMETIMES((int)test_rng_below(&rng, 40), -1);
    d.capacity_factor = SOMETIMES(cf[test_rng_below(&rng, 3)], cf[test_rng_below(&rng, 9)]);
#undef SOMETIMES
    mok_layer_t l = (mok_layer_t)0x1;
    const mokResult_t r = mok_layer_create(&l, c, &d);
    if (r != MOK_SUCCESS) {
      bad += l != NULL || (r != MOK_ERROR_INVALID_SHAPE && r != MOK_ERROR_INVALID_VALUE) ||
             mok_last_error()[0] == '\0';
      continue;
    }
    created++;
    size_t ctx = 0, ws = 1, qw = 1;
    bad += mok_context_size(l, &ctx) != MOK_SUCCESS || ctx == 0;
    bad += mok_layer_workspace_size(l, &ws) != MOK_SUCCESS || ws != 0;  /* CPU: per call */
    bad += mok_quantized_weights_size(l, &qw) != MOK_SUCCESS;
    bad += mok_layer_destroy(l) != MOK_SUCCESS;
  }
  printf("    %d of 20000 random descriptors made a layer\n", created);
  MOK_EXPECT_MSG(bad == 0, "%d descriptors answered outside the contract", bad);
  MOK_EXPECT_MSG(created > 100 && created < 19000, "%d of 20000 random descriptors made a layer",
                 created);
  MOK_EXPECT(mok_comm_destroy(c) == MOK_SUCCESS);
}

/* Threads that create and destroy layers on one communicator at once, and pairs of threads that
 * destroy the same layer at the same moment: every create succeeds, of each pair exactly one
 * destroy succeeds (the other is refused: no double free, which make sanitize would report), and
 * the communicator's count of live layers ends at 0 (it can then be destroyed). */
typedef struct {
  mok_comm_t comm;
  mok_layer_t shared[64]; /* destroyed by two threads each */
  int thread, ok_creates, ok_destroys;
} race_arg_t;

static void *race_thread(void *p) {
  race_arg_t *a = p;
  const mok_layer_desc_t d = small_desc();
  for (int i = 0; i < 300; i++) {
    mok_layer_t l;
    if (mok_layer_create(&l, a->comm, &d) != MOK_SUCCESS) continue;
    a->ok_creates++;
    a->ok_destroys += mok_layer_destroy(l) == MOK_SUCCESS;
  }
  return NULL;
}

static void *race_destroy(void *p) {
  race_arg_t *a = p;
  for (int i = 0; i < 64; i++) a->ok_destroys += mok_layer_destroy(a->shared[i]) == MOK_SUCCESS;
  return NULL;
}

MOK_TEST(misuse_concurrent_creates_and_destroys) {
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  enum { NT = 6 };
  static race_arg_t args[NT];
  pthread_t th[NT];
  for (int t = 0; t < NT; t++) {
    memset(&args[t], 0, sizeof(args[t]));
    args[t].comm = c, args[t].thread = t;
    MOK_REQUIRE(pthread_create(&th[t], NULL, race_thread, &args[t]) == 0);
  }
  for (int t = 0; t < NT; t++) pthread_join(th[t], NULL);
  int creates = 0, destroys = 0;
  for (int t = 0; t < NT; t++) creates += args[t].ok_creates, destroys += args[t].ok_destroys;
  MOK_EXPECT_MSG(creates == NT * 300 && destroys == creates, "%d creates, %d destroys of %d",
                 creates, destroys, NT * 300);
  /* two threads destroying the same 64 layers */
  const mok_layer_desc_t d = small_desc();
  race_arg_t pair[2];
  memset(pair, 0, sizeof(pair));
  for (int i = 0; i < 64; i++)
    MOK_REQUIRE(mok_layer_create(&pair[0].shared[i], c, &d) == MOK_SUCCESS);
  memcpy(pair[1].shared, pair[0].shared, sizeof(pair[0].shared));
  for (int t = 0; t < 2; t++)
    MOK_REQUIRE(pthread_create(&th[t], NULL, race_destroy, &pair[t]) == 0);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  MOK_EXPECT_MSG(pair[0].ok_destroys + pair[1].ok_destroys == 64, "%d + %d destroys of 64 layers",
                 pair[0].ok_destroys, pair[1].ok_destroys);
  MOK_EXPECT(mok_comm_destroy(c) == MOK_SUCCESS);
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
  MOK_EXPECT(mok_layer_recover(l, NULL) == MOK_ERROR_INVALID_VALUE);
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
  MOK_EXPECT(mok_layer_recover(NULL, NULL) == MOK_ERROR_NULL_POINTER && msg_has("layer is NULL"));
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
  MOK_EXPECT(mok_layer_recover(l, NULL) == MOK_SUCCESS); /* a CPU layer: nothing to recover */
  MOK_EXPECT(mok_quantize_host(NULL, 1, 1, 1, 1, MOK_QUANT_FP32_SCALE, NULL, NULL) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_dequantize_host(NULL, NULL, 1, 1, 1, 1, MOK_QUANT_FP32_SCALE, NULL) ==
             MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layer_destroy(l) == MOK_SUCCESS);
  MOK_EXPECT(mok_comm_destroy(c) == MOK_SUCCESS);
}

/* ---- buffers come with their sizes ---------------------------------------------------------- */

/* A small CPU layer with zero weights and its buffers (values do not matter here). */
typedef struct {
  mok_comm_t c;
  mok_layer_t l;
  size_t cb, qb;
  uint16_t w[3][4 * 128 * 128], x[2 * 128], y[2 * 128], dx[2 * 128];
  float g[3][4 * 128 * 128], tw[4], dtw[4];
  int32_t idx[4];
  void *ctx, *qw;
  mok_forward_args_t a;
  mok_backward_args_t b;
} small_t;

static small_t g_s; /* large: static, not on the stack */

static int small_open(small_t *s, mok_precision_t prec) {
  memset(s, 0, sizeof(*s));
  mok_layer_desc_t d = small_desc();
  d.precision = prec;
  if (mok_comm_create_local(&s->c, MOK_DEVICE_CPU) != MOK_SUCCESS) return 0;
  if (mok_layer_create(&s->l, s->c, &d) != MOK_SUCCESS) return 0;
  mok_context_size(s->l, &s->cb);
  mok_quantized_weights_size(s->l, &s->qb);
  s->ctx = aligned_alloc(64, (s->cb + 63) / 64 * 64);
  s->qw = s->qb ? aligned_alloc(256, (s->qb + 255) / 256 * 256) : NULL;
  const int32_t idx[4] = {0, 1, 2, 3};
  memcpy(s->idx, idx, sizeof(idx));
  s->a = (mok_forward_args_t){2, s->x, s->idx, s->tw,
                              {s->w[0], s->w[1], s->w[2], NULL, NULL, NULL, s->qw, s->qb}};
  s->b = (mok_backward_args_t){s->x, s->dx, s->dtw, s->g[0], s->g[1], s->g[2], NULL, NULL, NULL};
  return s->ctx && (!s->qb || s->qw) &&
         (!s->qb || mok_quantize_weights(s->l, &s->a.w, s->qw, s->qb, NULL) == MOK_SUCCESS);
}

static void small_close(small_t *s) {
  mok_layer_destroy(s->l);
  mok_comm_destroy(s->c);
  free(s->ctx);
  free(s->qw);
}

/* The message names the given size and the needed one. */
static int names_sizes(size_t given, size_t need) {
  char a[32], b[32];
  snprintf(a, sizeof a, "%zu", given);
  snprintf(b, sizeof b, "= %zu", need);
  return msg_has(a) && msg_has(b);
}

MOK_TEST(misuse_small_context_buffer_is_refused) {
  small_t *s = &g_s;
  MOK_REQUIRE(small_open(s, MOK_PRECISION_BF16));
  memset(s->y, 0xAB, sizeof(s->y));
  memset(s->ctx, 0xCD, s->cb);
  MOK_EXPECT(mok_forward(s->l, &s->a, s->y, s->ctx, s->cb - 1, NULL) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT_MSG(msg_has("ctx_bytes") && names_sizes(s->cb - 1, s->cb), "%s", mok_last_error());
  MOK_EXPECT(mok_forward(s->l, &s->a, s->y, s->ctx, 0, NULL) == MOK_ERROR_INVALID_VALUE);
  for (size_t i = 0; i < sizeof(s->y); i++) MOK_EXPECT(((unsigned char *)s->y)[i] == 0xAB);
  for (size_t i = 0; i < s->cb; i++) MOK_EXPECT(((unsigned char *)s->ctx)[i] == 0xCD);
  /* A larger buffer is fine; so is exactly the size. */
  MOK_REQUIRE(mok_forward(s->l, &s->a, s->y, s->ctx, s->cb + 100, NULL) == MOK_SUCCESS);
  MOK_EXPECT(mok_forward(s->l, &s->a, s->y, s->ctx, s->cb, NULL) == MOK_SUCCESS);
  MOK_EXPECT(mok_backward(s->l, &s->a, &s->b, s->ctx, s->cb / 2, NULL) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT_MSG(names_sizes(s->cb / 2, s->cb), "%s", mok_last_error());
  MOK_EXPECT(mok_backward(s->l, &s->a, &s->b, s->ctx, s->cb, NULL) == MOK_SUCCESS);
  small_close(s);
}

MOK_TEST(misuse_small_quantized_buffer_is_refused) {
  small_t *s = &g_s;
  MOK_REQUIRE(small_open(s, MOK_PRECISION_MXFP8));
  MOK_REQUIRE(s->qb > 0);
  /* mok_quantize_weights: the output buffer */
  memset(s->qw, 0xEE, s->qb);
  MOK_EXPECT(mok_quantize_weights(s->l, &s->a.w, s->qw, s->qb - 1, NULL) ==
             MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT_MSG(msg_has("out_bytes") && names_sizes(s->qb - 1, s->qb), "%s", mok_last_error());
  for (size_t i = 0; i < s->qb; i++) MOK_EXPECT(((unsigned char *)s->qw)[i] == 0xEE);
  MOK_REQUIRE(mok_quantize_weights(s->l, &s->a.w, s->qw, s->qb, NULL) == MOK_SUCCESS);
  /* forward and backward: weights.quantized_bytes */
  mok_forward_args_t a = s->a;
  a.w.quantized_bytes = s->qb - 256;
  MOK_EXPECT(mok_forward(s->l, &a, s->y, s->ctx, s->cb, NULL) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT_MSG(msg_has("quantized_bytes") && names_sizes(s->qb - 256, s->qb), "%s",
                 mok_last_error());
  a.w.quantized_bytes = 0; /* a caller of 0.1 that never set it */
  MOK_EXPECT(mok_forward(s->l, &a, s->y, s->ctx, s->cb, NULL) == MOK_ERROR_INVALID_VALUE);
  MOK_REQUIRE(mok_forward(s->l, &s->a, s->y, s->ctx, s->cb, NULL) == MOK_SUCCESS);
  MOK_EXPECT(mok_backward(s->l, &a, &s->b, s->ctx, s->cb, NULL) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_backward(s->l, &s->a, &s->b, s->ctx, s->cb, NULL) == MOK_SUCCESS);
  small_close(s);
}

/* The calls that take tensors refuse a destroyed layer before reading any argument. */
MOK_TEST(misuse_layer_calls_after_destroy) {
  small_t *s = &g_s;
  MOK_REQUIRE(small_open(s, MOK_PRECISION_MXFP8));
  mok_layer_t l = s->l;
  MOK_REQUIRE(mok_layer_destroy(l) == MOK_SUCCESS);
  s->l = NULL;
  MOK_EXPECT(mok_forward(l, &s->a, s->y, s->ctx, s->cb, NULL) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(msg_has("mok_forward") && msg_has("destroyed or invalid handle"));
  MOK_EXPECT(mok_backward(l, &s->a, &s->b, s->ctx, s->cb, NULL) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_quantize_weights(l, &s->a.w, s->qw, s->qb, NULL) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_forward(NULL, &s->a, s->y, s->ctx, s->cb, NULL) == MOK_ERROR_NULL_POINTER);
  small_close(s);
}

/* The API changed in 0.2 (buffer sizes): a descriptor of 0.1 is refused, a later patch is not. */
MOK_TEST(misuse_descriptor_of_another_minor_version) {
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  mok_layer_desc_t d = small_desc();
  mok_layer_t l = NULL;
  MOK_EXPECT(MOK_VERSION_CODE == 200 && mok_version() == MOK_VERSION_CODE);
  d.version = 100; /* 0.1.0 */
  MOK_EXPECT(mok_layer_create(&l, c, &d) == MOK_ERROR_VERSION_MISMATCH && l == NULL);
  MOK_EXPECT(msg_has("MOK_LAYER_DESC_INIT"));
  d.version = MOK_VERSION_CODE + 1; /* 0.2.1 */
  MOK_EXPECT(mok_layer_create(&l, c, &d) == MOK_SUCCESS);
  mok_layer_destroy(l);
  mok_comm_destroy(c);
}
