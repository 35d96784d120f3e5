/*
 * test_api.c: the public API on the CPU backend: every validation failure returns its own code and
 * a message and leaves outputs untouched; forward/backward through the API equal the reference
 * called directly (bitwise); saved and recomputed contexts agree bitwise; weight-gradient dtype and
 * accumulate modes; the quantized-weight buffer is what fp8 layers read.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/quant.h"
#include "cpu/ref.h"
#include "mok.h"
#include "support/compare.h"
#include "support/layer.h"
#include "test.h"

/* A small layer (H = I = 128, E = 4, K = 2, T_max = 8) on the CPU, its inputs and outputs, all
 * host memory. */
typedef struct {
  mok_layer_desc_t d;
  test_problem_t p;   /* x, dy, weights, routing of T tokens */
  test_cpu_layer_t c; /* comm, layer, ctx */
  int64_t T;
  uint16_t *y, *dx;
  float *dtw, *dw[6];
  void *qw;
  size_t qb; /* bytes of qw */
  mok_forward_args_t a;
  mok_backward_args_t g;
} fixture_t;

static mokResult_t fixture_init(fixture_t *f, mok_precision_t prec, int64_t Is, int64_t T) {
  memset(f, 0, sizeof(*f));
  const int64_t H = 128, I = 128, E = 4, K = 2;
  f->d = test_layer_desc(H, I, E, K, Is, 8);
  f->d.precision = prec;
  f->T = T;
  test_rng_t rng = test_rng(0x1234567887654321ull);
  if (!test_problem_init(&f->p, T, H, I, E, K, Is, &rng)) return MOK_ERROR_OUT_OF_MEMORY;
  f->y = test_alloc(2 * (size_t)(T * H)), f->dx = test_alloc(2 * (size_t)(T * H));
  f->dtw = test_alloc(sizeof(float) * (size_t)(T * K));
  for (int i = 0; i < 6; i++) f->dw[i] = test_alloc(sizeof(float) * (size_t)(E * I * H));
  for (int64_t t = 0; t < T; t++) { /* fixed routing: the tests below count its rows */
    int32_t *idx = &f->p.idx[t * K];
    idx[0] = (int32_t)(t % E);
    idx[1] = t % 3 == 2 ? -1 : (int32_t)((t + 1 + t / 4) % E);
    if (idx[1] == idx[0]) idx[1] = (idx[0] + 1) % E;
    f->p.tw[t * K] = 0.6f, f->p.tw[t * K + 1] = 0.4f;
  }
  mokResult_t r = test_cpu_layer_open(&f->c, &f->d);
  if (r != MOK_SUCCESS) return r;
  size_t qb;
  mok_quantized_weights_size(f->c.l, &qb);
  f->qw = qb ? test_alloc(qb) : NULL;
  f->a = test_forward_args(T, f->p.x, f->p.idx, f->p.tw, test_problem_weights(&f->p));
  f->a.w.quantized = f->qw;
  f->a.w.quantized_bytes = qb;
  f->qb = qb;
  void *dw[6];
  for (int i = 0; i < 6; i++) dw[i] = f->dw[i];
  f->g = test_backward_args(T, f->p.dy, f->dx, f->dtw, dw, Is > 0);
  if (qb) r = mok_quantize_weights(f->c.l, &f->a.w, f->qw, qb, NULL);
  return r;
}

static void fixture_free(fixture_t *f) {
  test_cpu_layer_close(&f->c);
  test_problem_free(&f->p);
  free(f->y), free(f->dx), free(f->dtw), free(f->qw);
  for (int i = 0; i < 6; i++) free(f->dw[i]);
}

static int msg_has(const char *needle) { return strstr(mok_last_error(), needle) != NULL; }

MOK_TEST(api_error_strings_are_distinct) {
  for (int i = 0; i < MOK_NUM_RESULTS; i++)
    for (int j = i + 1; j < MOK_NUM_RESULTS; j++)
      MOK_EXPECT_MSG(strcmp(mok_error_string(i), mok_error_string(j)), "codes %d and %d", i, j);
  MOK_EXPECT(mok_error_string((mokResult_t)999) != NULL);
  MOK_EXPECT(mok_version() == MOK_VERSION_CODE);
}

/* Virtual ranks: bad arguments, and without a GPU a clear NO_DEVICE, every out[] left NULL; with
 * one, W communicators of ranks 0..W-1 on the device (their layers: tests/gpu/test_ep*.cu). */
MOK_TEST(api_virtual_comm_errors) {
  mok_comm_t c[3] = {(mok_comm_t)0x1, (mok_comm_t)0x1, (mok_comm_t)0x1};
  MOK_EXPECT(mok_comm_create_virtual(NULL, 2, 0) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_comm_create_virtual(c, 0, 0) == MOK_ERROR_INVALID_VALUE && msg_has("0 ranks"));
  MOK_EXPECT(mok_comm_create_virtual(c, 9, 0) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_comm_create_virtual(c, 2, MOK_DEVICE_CPU) == MOK_ERROR_INVALID_VALUE &&
             !c[0] && !c[1] && msg_has("not a GPU"));
  MOK_EXPECT(mok_comm_create_virtual(c, 2, 4096) == MOK_ERROR_NO_DEVICE && !c[0] && !c[1]);
  mok_comm_t gpu = NULL;
  const int have_gpu = mok_comm_create_local(&gpu, 0) == MOK_SUCCESS;
  mok_comm_destroy(gpu);
  const mokResult_t r = mok_comm_create_virtual(c, 3, 0);
  if (!have_gpu) {
    MOK_EXPECT(r == MOK_ERROR_NO_DEVICE && !c[0] && !c[1] && !c[2]);
    return;
  }
  MOK_REQUIRE(r == MOK_SUCCESS);
  for (int q = 0; q < 3; q++) {
    int rank = -1, size = -1, dev = -1;
    MOK_EXPECT(mok_comm_rank(c[q], &rank) == MOK_SUCCESS && rank == q);
    MOK_EXPECT(mok_comm_size(c[q], &size) == MOK_SUCCESS && size == 3);
    MOK_EXPECT(mok_comm_device(c[q], &dev) == MOK_SUCCESS && dev == 0);
  }
  for (int q = 0; q < 3; q++) MOK_EXPECT(mok_comm_destroy(c[q]) == MOK_SUCCESS);
}

MOK_TEST(api_comm_errors) {
  mok_comm_t c = (mok_comm_t)0x1;
  MOK_EXPECT(mok_comm_create_local(NULL, MOK_DEVICE_CPU) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_comm_create_local(&c, -5) == MOK_ERROR_INVALID_VALUE && c == NULL);
  MOK_EXPECT(msg_has("device -5"));
  MOK_EXPECT(mok_comm_create_local(&c, 4096) == MOK_ERROR_NO_DEVICE && c == NULL);
  mok_unique_id_t id;
  MOK_EXPECT(mok_get_unique_id(NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_comm_create_unique_id(&c, &id, 2, 2, 0) == MOK_ERROR_INVALID_VALUE);
  MOK_EXPECT(mok_comm_create_unique_id(&c, NULL, 0, 2, 0) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_comm_create_nccl(&c, NULL, 0) == MOK_ERROR_NULL_POINTER);
  /* The NCCL constructors. A build without NCCL reports NOT_AVAILABLE, naming NCCL. With NCCL, a
   * unique id needs no GPU, and the constructors check the device before touching the id or the
   * communicator (0x10 is never dereferenced). Real communicators: tests/gpu/test_transport.cu. */
  mokResult_t rid = mok_get_unique_id(&id);
  MOK_EXPECT(rid == MOK_SUCCESS || (rid == MOK_ERROR_NOT_AVAILABLE && msg_has("NCCL")));
  mok_comm_t gpu = NULL;
  const int have_gpu = mok_comm_create_local(&gpu, 0) == MOK_SUCCESS;
  mok_comm_destroy(gpu);
  if (rid == MOK_ERROR_NOT_AVAILABLE) {
    MOK_EXPECT(mok_comm_create_unique_id(&c, &id, 0, 2, 0) == MOK_ERROR_NOT_AVAILABLE && !c);
    MOK_EXPECT(msg_has("NCCL"));
    MOK_EXPECT(mok_comm_create_nccl(&c, (struct ncclComm *)0x10, 0) == MOK_ERROR_NOT_AVAILABLE);
  } else {
    MOK_EXPECT(mok_comm_create_unique_id(&c, &id, 0, 2, 4096) == MOK_ERROR_NO_DEVICE && !c);
    MOK_EXPECT(mok_comm_create_nccl(&c, (struct ncclComm *)0x10, 4096) == MOK_ERROR_NO_DEVICE);
    if (!have_gpu) {
      MOK_EXPECT(mok_comm_create_unique_id(&c, &id, 0, 2, 0) == MOK_ERROR_NO_DEVICE && !c);
      MOK_EXPECT(mok_comm_create_nccl(&c, (struct ncclComm *)0x10, 0) == MOK_ERROR_NO_DEVICE);
    }
  }
  int v;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  MOK_EXPECT(mok_comm_rank(c, &v) == MOK_SUCCESS && v == 0);
  MOK_EXPECT(mok_comm_size(c, &v) == MOK_SUCCESS && v == 1);
  MOK_EXPECT(mok_comm_device(c, &v) == MOK_SUCCESS && v == MOK_DEVICE_CPU);
  MOK_EXPECT(mok_comm_rank(c, NULL) == MOK_ERROR_NULL_POINTER);
  mok_comm_destroy(c);
}

/* The i-th bad descriptor: sets one field wrong, names it and the code it must give. Returns 0
 * past the last case. */
static int bad_desc(int i, mok_layer_desc_t *d, const char **field, mokResult_t *code) {
  *code = MOK_ERROR_INVALID_VALUE;
  switch (i) {
    case 0: *field = "struct_size", *code = MOK_ERROR_VERSION_MISMATCH, d->struct_size = 8; break;
    case 1: *field = "version", *code = MOK_ERROR_VERSION_MISMATCH, d->version = 99999; break;
    case 2: *field = "hidden", *code = MOK_ERROR_INVALID_SHAPE, d->hidden = 100; break;
    case 3: *field = "hidden", *code = MOK_ERROR_INVALID_SHAPE, d->hidden = 0; break;
    case 4: *field = "intermediate", *code = MOK_ERROR_INVALID_SHAPE, d->intermediate = 64; break;
    case 5: *field = "shared_intermediate", *code = MOK_ERROR_INVALID_SHAPE, d->shared_intermediate = -128; break;
    case 6: *field = "shared_intermediate", *code = MOK_ERROR_INVALID_SHAPE, d->shared_intermediate = 100; break;
    case 7: *field = "num_experts", *code = MOK_ERROR_INVALID_SHAPE, d->num_experts = 0; break;
    case 8: *field = "top_k", *code = MOK_ERROR_INVALID_SHAPE, d->top_k = 9; break;
    case 9: *field = "top_k", *code = MOK_ERROR_INVALID_SHAPE, d->top_k = 0; break;
    case 10: *field = "max_tokens", d->max_tokens = 0; break;
    case 11: *field = "precision", d->precision = (mok_precision_t)7; break;
    case 12: *field = "fp8_scale", d->fp8_scale = (mok_fp8_scale_t)7; break;
    case 13: *field = "wgrad_dtype", d->wgrad_dtype = (mok_wgrad_dtype_t)7; break;
    case 14: *field = "wgrad_accumulate", d->wgrad_accumulate = 2; break;
    case 15: *field = "context_mode", d->context_mode = (mok_context_mode_t)7; break;
    case 16: *field = "comm_sms", d->comm_sms = -1; break;
    case 17: *field = "capacity_factor", d->capacity_factor = 1.5; break; /* > W = 1 */
    case 18: *field = "capacity_factor", d->capacity_factor = NAN; break;
    default: return 0;
  }
  return 1;
}

/* Each bad descriptor field gives its code and names the field. */
MOK_TEST(api_layer_create_validates_descriptor) {
  mok_comm_t c;
  MOK_REQUIRE(mok_comm_create_local(&c, MOK_DEVICE_CPU) == MOK_SUCCESS);
  mok_layer_desc_t ok = MOK_LAYER_DESC_INIT;
  ok.hidden = 256, ok.intermediate = 128, ok.num_experts = 8, ok.top_k = 2, ok.max_tokens = 16;
  mok_layer_t l = NULL;
  MOK_EXPECT(mok_layer_create(&l, c, &ok) == MOK_SUCCESS && l);
  mok_layer_destroy(l);
  const char *field;
  mokResult_t code;
  mok_layer_desc_t d = ok;
  for (int i = 0; bad_desc(i, &d, &field, &code); i++, d = ok) {
    l = (mok_layer_t)0x1;
    mokResult_t r = mok_layer_create(&l, c, &d);
    MOK_EXPECT_MSG(r == code && l == NULL && msg_has(field), "case %d (%s): got %d, message '%s'", i,
                   field, (int)r, mok_last_error());
  }
  MOK_EXPECT(mok_layer_create(NULL, c, &ok) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layer_create(&l, NULL, &ok) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layer_create(&l, c, NULL) == MOK_ERROR_NULL_POINTER);
  mok_comm_destroy(c);
}

MOK_TEST(api_forward_validates_arguments) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 128, 6) == MOK_SUCCESS);
  const size_t ybytes = 2 * 6 * 128;
  memset(f.y, 0xAB, ybytes);
  mok_forward_args_t a;
  MOK_EXPECT(mok_forward(NULL, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_forward(f.c.l, NULL, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_forward(f.c.l, &f.a, NULL, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("y"));
  MOK_EXPECT(mok_forward(f.c.l, &f.a, f.y, NULL, 0, NULL) == MOK_ERROR_NULL_POINTER && msg_has("ctx"));
  MOK_EXPECT(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, (mok_stream_t)0x1) == MOK_ERROR_INVALID_VALUE &&
             msg_has("stream"));
  a = f.a, a.x = NULL;
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("args.x"));
  a = f.a, a.topk_idx = NULL;
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("topk_idx"));
  a = f.a, a.topk_w = NULL;
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("topk_w"));
  a = f.a, a.w.wd = NULL;
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER && msg_has("wd"));
  a = f.a, a.w.wsu = NULL; /* the shared expert exists (Is = 128): its weights are required */
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("wsu"));
  a = f.a, a.x = (const char *)f.p.x + 2;
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_MISALIGNED &&
             msg_has("args.x"));
  a = f.a, a.topk_idx = (const int32_t *)((const char *)f.p.idx + 1);
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_MISALIGNED);
  MOK_EXPECT(mok_forward(f.c.l, &f.a, (char *)f.y + 8, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_MISALIGNED);
  a = f.a, a.num_tokens = 9; /* T_max = 8 */
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_INVALID_SHAPE &&
             msg_has("num_tokens"));
  a = f.a, a.num_tokens = -1;
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_INVALID_SHAPE);
  MOK_EXPECT(test_bytes_not(f.y, ybytes, 0xAB) == 0);
  /* The layer keeps the detail of its last failure. */
  MOK_EXPECT(strstr(mok_layer_last_error(f.c.l), "num_tokens") != NULL);
  fixture_free(&f);
}

MOK_TEST(api_bad_routing_is_reported_and_leaves_outputs_intact) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 0, 6) == MOK_SUCCESS);
  const size_t ybytes = 2 * 6 * 128;
  memset(f.y, 0xCD, ybytes);
  f.p.idx[5] = 4; /* E = 4: out of range */
  MOK_EXPECT(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_INVALID_ROUTING);
  f.p.idx[5] = -2;
  MOK_EXPECT(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_INVALID_ROUTING);
  f.p.idx[5] = f.p.idx[4]; /* token 2: the same expert in both slots */
  MOK_EXPECT(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_INVALID_ROUTING);
  MOK_EXPECT(test_bytes_not(f.y, ybytes, 0xCD) == 0);
  fixture_free(&f);
}

/* Random routings, valid or not, against a model of the contract (an id is -1 or in [0, E), no
 * expert twice in a token): a valid one gives MOK_SUCCESS and a written y, then a backward that
 * succeeds too; any other gives MOK_ERROR_INVALID_ROUTING with y untouched. 600 of them, on the
 * fixture's layer (E = 4, K = 2, T = 8). */
MOK_TEST(api_random_routing_is_computed_or_refused) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 0, 8) == MOK_SUCCESS);
  const int64_t T = 8, K = 2, E = 4, ybytes = 2 * T * 128;
  static const int32_t odd[] = {-2, 4, 5, INT32_MAX, INT32_MIN, -1000};
  test_rng_t rng = test_rng(0x5107eu);
  int bad = 0, valid_n = 0;
  for (int it = 0; it < 600; it++) {
    int valid = 1;
    for (int64_t t = 0; t < T; t++) {
      int32_t *idx = &f.p.idx[t * K];
      for (int64_t k = 0; k < K; k++) {
        const uint64_t pick = test_rng_below(&rng, 40);
        idx[k] = pick == 0 ? odd[test_rng_below(&rng, 6)]
                 : pick < 6 ? -1
                            : (int32_t)test_rng_below(&rng, (uint64_t)E);
        valid &= idx[k] == -1 || (idx[k] >= 0 && idx[k] < E);
      }
      valid &= !(idx[0] >= 0 && idx[0] == idx[1]);
    }
    valid_n += valid;
    memset(f.y, 0xCD, (size_t)ybytes);
    const mokResult_t r = mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL);
    if (!valid) {
      bad += r != MOK_ERROR_INVALID_ROUTING || test_bytes_not(f.y, (size_t)ybytes, 0xCD) != 0;
      continue;
    }
    bad += r != MOK_SUCCESS || test_bytes_not(f.y, (size_t)ybytes, 0xCD) == 0;
    if (r == MOK_SUCCESS)
      bad += mok_backward(f.c.l, &f.a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) != MOK_SUCCESS;
  }
  MOK_EXPECT_MSG(bad == 0, "%d of 600 routings answered outside the contract (%d valid)", bad,
                 valid_n);
  MOK_EXPECT_MSG(valid_n > 30 && valid_n < 570, "%d of 600 random routings valid", valid_n);
  fixture_free(&f);
}

MOK_TEST(api_capacity_overflow_is_reported) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 0, 8) == MOK_SUCCESS);
  mok_layer_t small;
  mok_layer_desc_t d = f.d;
  d.capacity_factor = 0.5; /* 0.5 x T_max 8 x K 2 = 8 rows; the fixture routes more */
  MOK_REQUIRE(mok_layer_create(&small, f.c.comm, &d) == MOK_SUCCESS);
  memset(f.y, 0xEE, 2 * 8 * 128);
  MOK_EXPECT(mok_forward(small, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_CAPACITY_OVERFLOW &&
             msg_has("capacity"));
  MOK_EXPECT(test_bytes_not(f.y, 2 * 8 * 128, 0xEE) == 0);
  mok_forward_args_t a = f.a;
  a.num_tokens = 4; /* 4 tokens route fewer than 8 rows: fits */
  MOK_EXPECT(mok_forward(small, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  mok_layer_destroy(small);
  fixture_free(&f);
}

MOK_TEST(api_backward_validates_arguments_and_context) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 128, 6) == MOK_SUCCESS);
  mok_backward_args_t g;
  /* Backward before any forward: the context is not one of this layer. */
  MOK_EXPECT(mok_backward(f.c.l, &f.a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_CONTEXT_MISMATCH);
  MOK_REQUIRE(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  MOK_EXPECT(mok_backward(f.c.l, &f.a, NULL, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER);
  g = f.g, g.dy = NULL;
  MOK_EXPECT(mok_backward(f.c.l, &f.a, &g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("dy"));
  g = f.g, g.dwsd = NULL;
  MOK_EXPECT(mok_backward(f.c.l, &f.a, &g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("dwsd"));
  g = f.g, g.dwg = (char *)f.dw[0] + 4;
  MOK_EXPECT(mok_backward(f.c.l, &f.a, &g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_MISALIGNED &&
             msg_has("dwg"));
  mok_forward_args_t a = f.a;
  a.num_tokens = 5; /* not the forward's tokens */
  MOK_EXPECT(mok_backward(f.c.l, &a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_CONTEXT_MISMATCH);
  int32_t saved = f.p.idx[0];
  f.p.idx[0] = (f.p.idx[0] + 2) % 4 == f.p.idx[1] ? (f.p.idx[0] + 3) % 4 : (f.p.idx[0] + 2) % 4;
  MOK_EXPECT(mok_backward(f.c.l, &f.a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_CONTEXT_MISMATCH &&
             msg_has("routing"));
  f.p.idx[0] = saved;
  MOK_EXPECT(mok_backward(f.c.l, &f.a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  fixture_free(&f);
}

/* What the reference gives for the fixture, called directly with W = 1. */
static int reference(const fixture_t *f, double *y, double *dx, double *dtw, double *dw[6]) {
  const int64_t T = f->T, H = 128, I = 128, E = 4, K = 2, Is = f->d.shared_intermediate;
  mok_ref_cfg_t cfg = {H, I, E, K, Is, 1, f->d.precision, f->d.fp8_scale, 0, 16};
  double *w[6], *x = malloc(sizeof(double) * (size_t)(T * H + 1)), *dy = malloc(sizeof(double) * (size_t)(T * H + 1));
  double *tw = malloc(sizeof(double) * (size_t)(T * K + 1));
  const uint16_t *src[6] = {f->p.wg, f->p.wu, f->p.wd, f->p.wsg, f->p.wsu, f->p.wsd};
  const int64_t n[6] = {E * I * H, E * I * H, E * H * I, Is * H, Is * H, H * Is};
  for (int i = 0; i < 6; i++) {
    w[i] = malloc(sizeof(double) * (size_t)(n[i] + 1));
    for (int64_t j = 0; j < n[i]; j++) w[i][j] = mok_bf16_to_float(src[i][j]);
  }
  for (int64_t j = 0; j < T * H; j++)
    x[j] = mok_bf16_to_float(f->p.x[j]), dy[j] = mok_bf16_to_float(f->p.dy[j]);
  for (int64_t j = 0; j < T * K; j++) tw[j] = f->p.tw[j];
  mok_ref_weights_t rw;
  int ok = mok_ref_weights_effective(&cfg, w[0], w[1], w[2], Is ? w[3] : NULL, Is ? w[4] : NULL,
                                     Is ? w[5] : NULL, &rw) == MOK_SUCCESS;
  mok_ref_in_t in = {T, x, f->p.idx, tw, dy};
  mok_ref_out_t out = {y, dx, dtw, dw[0], dw[1], dw[2], dw[3], dw[4], dw[5]};
  char err[256];
  ok = ok && mok_ref_forward(&cfg, &rw, &in, &out, NULL, err, sizeof(err)) == MOK_SUCCESS;
  ok = ok && mok_ref_backward(&cfg, &rw, &in, &out, NULL, err, sizeof(err)) == MOK_SUCCESS;
  if (ok) mok_ref_weights_free(&rw);
  for (int i = 0; i < 6; i++) free(w[i]);
  free(x), free(dy), free(tw);
  return ok;
}

/* Through the API (bf16 tensors, quantized buffer for fp8, saved context) the results are the
 * reference's bit for bit: this checks the conversions and, for fp8, the buffer's layout and
 * transposed copies against the reference's own quantize-dequantize of the bf16 weights. */
static void check_api_matches_reference(mok_precision_t prec, mok_context_mode_t mode, int64_t Is) {
  fixture_t f;
  mokResult_t r = fixture_init(&f, prec, Is, 7);
  MOK_REQUIRE_MSG(r == MOK_SUCCESS, "fixture: %s", mok_last_error());
  if (mode != MOK_CONTEXT_SAVE) {
    mok_layer_t l2;
    f.d.context_mode = mode;
    MOK_REQUIRE(mok_layer_create(&l2, f.c.comm, &f.d) == MOK_SUCCESS);
    mok_layer_destroy(f.c.l);
    f.c.l = l2;
  }
  MOK_REQUIRE_MSG(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS, "%s",
                  mok_last_error());
  MOK_REQUIRE_MSG(mok_backward(f.c.l, &f.a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS, "%s",
                  mok_last_error());
  const int64_t T = 7, H = 128, n[6] = {4 * 128 * 128, 4 * 128 * 128, 4 * 128 * 128, Is * H, Is * H, H * Is};
  double *y = calloc((size_t)(T * H), 8), *dx = calloc((size_t)(T * H), 8), *dtw = calloc(14, 8), *dw[6];
  for (int i = 0; i < 6; i++) dw[i] = calloc((size_t)(n[i] + 1), 8);
  MOK_REQUIRE(reference(&f, y, dx, dtw, dw));
  int bad = 0;
  for (int64_t i = 0; i < T * H; i++) {
    bad += f.y[i] != mok_bf16_from_float((float)y[i]);
    bad += f.dx[i] != mok_bf16_from_float((float)dx[i]);
  }
  for (int64_t i = 0; i < T * 2; i++) bad += f.dtw[i] != (float)dtw[i];
  for (int i = 0; i < 6; i++)
    for (int64_t j = 0; j < n[i]; j++) bad += f.dw[i][j] != (float)dw[i][j];
  MOK_EXPECT_MSG(bad == 0, "precision %d mode %d Is %lld: %d values differ", (int)prec, (int)mode,
                 (long long)Is, bad);
  for (int i = 0; i < 6; i++) free(dw[i]);
  free(y), free(dx), free(dtw);
  fixture_free(&f);
}

MOK_TEST(api_cpu_backend_matches_reference_bf16) {
  check_api_matches_reference(MOK_PRECISION_BF16, MOK_CONTEXT_SAVE, 128);
  check_api_matches_reference(MOK_PRECISION_BF16, MOK_CONTEXT_RECOMPUTE, 128);
  check_api_matches_reference(MOK_PRECISION_BF16, MOK_CONTEXT_SAVE, 0);
}

MOK_TEST(api_cpu_backend_matches_reference_fp8) {
  check_api_matches_reference(MOK_PRECISION_FP8_BLOCK, MOK_CONTEXT_SAVE, 128);
  check_api_matches_reference(MOK_PRECISION_MXFP8, MOK_CONTEXT_SAVE, 128);
  check_api_matches_reference(MOK_PRECISION_MXFP8, MOK_CONTEXT_RECOMPUTE, 0);
}

/* fp8 layers read the quantized buffer, not the bf16 weights: a stale buffer shows. */
MOK_TEST(api_fp8_reads_quantized_buffer) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_FP8_BLOCK, 0, 4) == MOK_SUCCESS);
  MOK_REQUIRE(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  uint16_t *y1 = malloc(2 * 4 * 128);
  memcpy(y1, f.y, 2 * 4 * 128);
  for (int64_t i = 0; i < 4 * 128 * 128; i++)
    f.p.wg[i] = mok_bf16_from_float(0.5f * mok_bf16_to_float(f.p.wg[i]));
  MOK_REQUIRE(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  MOK_EXPECT(memcmp(y1, f.y, 2 * 4 * 128) == 0); /* buffer unchanged: same result */
  MOK_REQUIRE(mok_quantize_weights(f.c.l, &f.a.w, f.qw, f.qb, NULL) == MOK_SUCCESS);
  MOK_REQUIRE(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  MOK_EXPECT(memcmp(y1, f.y, 2 * 4 * 128) != 0); /* requantized: the halved gate shows */
  mok_forward_args_t a = f.a;
  a.w.quantized = NULL;
  MOK_EXPECT(mok_forward(f.c.l, &a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("quantized"));
  free(y1);
  fixture_free(&f);
}

MOK_TEST(api_quantize_weights_validates) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 0, 2) == MOK_SUCCESS);
  size_t qb = 1;
  MOK_EXPECT(mok_quantized_weights_size(f.c.l, &qb) == MOK_SUCCESS && qb == 0);
  char buf[64];
  MOK_EXPECT(mok_quantize_weights(f.c.l, &f.a.w, buf, sizeof(buf), NULL) == MOK_ERROR_INVALID_VALUE &&
             msg_has("BF16"));
  fixture_free(&f);
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_MXFP8, 128, 2) == MOK_SUCCESS);
  mok_weights_t w = f.a.w;
  w.wsg = NULL;
  MOK_EXPECT(mok_quantize_weights(f.c.l, &w, f.qw, f.qb, NULL) == MOK_ERROR_NULL_POINTER &&
             msg_has("wsg"));
  MOK_EXPECT(mok_quantize_weights(f.c.l, &f.a.w, NULL, f.qb, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_quantize_weights(f.c.l, &f.a.w, (char *)f.qw + 1, f.qb, NULL) == MOK_ERROR_MISALIGNED);
  MOK_EXPECT(mok_quantize_weights(f.c.l, NULL, f.qw, f.qb, NULL) == MOK_ERROR_NULL_POINTER);
  fixture_free(&f);
}

/* Weight gradients: fp32 or bf16, overwritten or accumulated. */
MOK_TEST(api_wgrad_dtype_and_accumulate) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 0, 6) == MOK_SUCCESS);
  const int64_t n = 4 * 128 * 128;
  MOK_REQUIRE(mok_forward(f.c.l, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  MOK_REQUIRE(mok_backward(f.c.l, &f.a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  float *once = malloc(sizeof(float) * (size_t)n);
  memcpy(once, f.dw[1], sizeof(float) * (size_t)n);
  int bad = 0;
  /* accumulate: dst = fp32(dst + g), here dst = g from the first call */
  mok_layer_desc_t d = f.d;
  d.wgrad_accumulate = 1;
  mok_layer_t acc;
  MOK_REQUIRE(mok_layer_create(&acc, f.c.comm, &d) == MOK_SUCCESS);
  MOK_REQUIRE(mok_forward(acc, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  MOK_REQUIRE(mok_backward(acc, &f.a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  for (int64_t i = 0; i < n; i++) bad += f.dw[1][i] != once[i] + once[i];
  MOK_EXPECT_MSG(bad == 0, "fp32 accumulate: %d differ", bad);
  mok_layer_destroy(acc);
  /* bf16, overwrite: bf16(g) */
  d.wgrad_accumulate = 0, d.wgrad_dtype = MOK_WGRAD_BF16;
  mok_layer_t b16;
  MOK_REQUIRE(mok_layer_create(&b16, f.c.comm, &d) == MOK_SUCCESS);
  memset(f.dw[1], 0x5A, sizeof(float) * (size_t)n);
  MOK_REQUIRE(mok_forward(b16, &f.a, f.y, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  MOK_REQUIRE(mok_backward(b16, &f.a, &f.g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  const uint16_t *h = (const uint16_t *)f.dw[1];
  bad = 0;
  for (int64_t i = 0; i < n; i++) bad += h[i] != mok_bf16_from_float(once[i]);
  MOK_EXPECT_MSG(bad == 0, "bf16 overwrite: %d differ", bad);
  /* the bf16 gradient takes n * 2 bytes: the rest of the buffer is untouched */
  MOK_EXPECT(test_bytes_not((const char *)f.dw[1] + 2 * n, 2 * (size_t)n, 0x5A) == 0);
  mok_layer_destroy(b16);
  free(once);
  fixture_free(&f);
}

/* The tuning values tests and benchmarks set on a layer (src/api/internal.h): a copy of the
 * documented defaults at create (src/common/tuning.h), replaced only by a struct whose every field
 * is in its range; a rejected one leaves the layer's values as they were. */
static int same_tuning(const mok_tuning_t *a, const mok_tuning_t *b) {
  return a->struct_size == b->struct_size && a->forward_path == b->forward_path &&
         a->forward_sms == b->forward_sms && a->fused_lag == b->fused_lag &&
         a->fused_shared_band == b->fused_shared_band && a->fused_help_pct == b->fused_help_pct &&
         a->backward_path == b->backward_path && a->backward_sms == b->backward_sms &&
         a->backward_lag == b->backward_lag && a->tile_group_m == b->tile_group_m &&
         a->timeout_s == b->timeout_s;
}

MOK_TEST(api_layer_tuning_is_checked) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 0, 2) == MOK_SUCCESS);
  mok_tuning_t t, got;
  MOK_REQUIRE(mok_layer_tuning(f.c.l, &t) == MOK_SUCCESS);
  MOK_EXPECT(t.struct_size == sizeof(t) && t.forward_path == MOK_FORWARD_FUSED);
  MOK_EXPECT(t.forward_sms == 0 && t.fused_lag == 0 && t.fused_shared_band == 8);
  MOK_EXPECT(t.fused_help_pct == -1 && t.tile_group_m == 0 && t.timeout_s > 0);
  MOK_EXPECT(t.backward_path == MOK_BACKWARD_CHAIN && t.backward_sms == 0 && t.backward_lag == 0);
  mok_tuning_t ok = t;
  ok.forward_path = MOK_FORWARD_CHAIN, ok.forward_sms = 3, ok.fused_lag = 1;
  ok.fused_shared_band = 1, ok.fused_help_pct = 100, ok.tile_group_m = -1, ok.timeout_s = 0.5;
  ok.backward_path = MOK_BACKWARD_FUSED, ok.backward_sms = 5, ok.backward_lag = 2;
  MOK_EXPECT(mok_layer_set_tuning(f.c.l, &ok) == MOK_SUCCESS);
  MOK_EXPECT(mok_layer_tuning(f.c.l, &got) == MOK_SUCCESS && same_tuning(&got, &ok));
  for (int i = 0; i < 11; i++) {
    mok_tuning_t bad = t;
    mokResult_t code = MOK_ERROR_INVALID_VALUE;
    switch (i) {
      case 0: bad.struct_size = sizeof(bad) - 8, code = MOK_ERROR_VERSION_MISMATCH; break;
      case 1: bad.forward_path = (mok_forward_path_t)2; break;
      case 2: bad.forward_sms = -1; break;
      case 3: bad.fused_lag = -1; break;
      case 4: bad.fused_shared_band = 0; break;
      case 5: bad.fused_help_pct = 101; break;
      case 6: bad.tile_group_m = -2; break;
      case 7: bad.backward_path = (mok_backward_path_t)2; break;
      case 8: bad.backward_sms = -1; break;
      case 9: bad.backward_lag = -1; break;
      default: bad.timeout_s = 0; break;
    }
    MOK_EXPECT_MSG(mok_layer_set_tuning(f.c.l, &bad) == code, "case %d: %s", i, mok_last_error());
    MOK_EXPECT(mok_layer_tuning(f.c.l, &got) == MOK_SUCCESS && same_tuning(&got, &ok));
  }
  MOK_EXPECT(mok_layer_set_tuning(f.c.l, NULL) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layer_set_tuning(NULL, &t) == MOK_ERROR_NULL_POINTER);
  MOK_EXPECT(mok_layer_tuning(f.c.l, NULL) == MOK_ERROR_NULL_POINTER);
  fixture_free(&f);
}

MOK_TEST(api_zero_tokens) {
  fixture_t f;
  MOK_REQUIRE(fixture_init(&f, MOK_PRECISION_BF16, 128, 3) == MOK_SUCCESS);
  mok_forward_args_t a = f.a;
  a.num_tokens = 0, a.x = NULL, a.topk_idx = NULL, a.topk_w = NULL;
  MOK_EXPECT(mok_forward(f.c.l, &a, NULL, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  mok_backward_args_t g = f.g;
  g.dy = NULL, g.dx = NULL, g.dtopk_w = NULL;
  memset(f.dw[0], 0x7F, 4 * 128 * 128 * sizeof(float));
  MOK_EXPECT(mok_backward(f.c.l, &a, &g, f.c.ctx, f.c.ctx_bytes, NULL) == MOK_SUCCESS);
  /* no rows: zero gradients */
  MOK_EXPECT(test_bytes_not(f.dw[0], 4 * 128 * 128 * sizeof(float), 0) == 0);
  fixture_free(&f);
}

/* GPU layers exist only where a GPU does; without one the error says so. */
MOK_TEST(api_gpu_layer_without_gpu) {
  mok_comm_t c = NULL;
  mokResult_t r = mok_comm_create_local(&c, 0);
  if (r == MOK_SUCCESS) {
    mok_comm_destroy(c);
    MOK_SKIP("a GPU is present; this test checks the error without one");
  }
  MOK_EXPECT(r == MOK_ERROR_NO_DEVICE && c == NULL && strlen(mok_last_error()) > 0);
}
