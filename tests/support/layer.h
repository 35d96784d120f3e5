/*
 * layer.h: layer fixtures. A descriptor from a shape, random routing, a random layer problem in
 * host memory, the forward and backward arguments over host or device pointers, a CPU layer (the
 * reference) to run them on, and a layer's forward path (its tuning, src/api/internal.h);
 * tests/support/gpu.h puts a GPU layer on the same inputs. Plain
 * C11 that also compiles as C++ (nvcc), header-only; links with the library's objects.
 *
 *   test_problem_t p;
 *   test_rng_t r = test_rng(1);
 *   test_problem_init(&p, T, H, I, E, K, Is, &r);             // x, dy, weights drawn
 *   test_route(p.idx, p.tw, T, E, K, test_route_uniform(0.1), &r);
 *   mok_layer_desc_t d = test_layer_desc(H, I, E, K, Is, T);
 *   test_cpu_layer_t c;
 *   test_cpu_layer_open(&c, &d);
 *   mok_forward_args_t a = test_forward_args(T, p.x, p.idx, p.tw, test_problem_weights(&p));
 *   mok_forward(c.l, &a, y, c.ctx, c.ctx_bytes, NULL);
 */
#ifndef MOK_TESTS_SUPPORT_LAYER_H
#define MOK_TESTS_SUPPORT_LAYER_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/internal.h"
#include "bf16.h"
#include "mok.h"
#include "rng.h"

/* n zeroed bytes, 64-byte aligned, at least 64 of them (so n = 0 is a valid buffer too); NULL on
 * failure; free with free(). */
static inline void *test_alloc(size_t n) {
  const size_t bytes = (n / 64 + 1) * 64;
  void *p = aligned_alloc(64, bytes);
  if (p) memset(p, 0, bytes);
  return p;
}

/* A BF16 layer descriptor of the shape, every other field its default. */
static inline mok_layer_desc_t test_layer_desc(int64_t H, int64_t I, int64_t E, int64_t K,
                                               int64_t Is, int64_t T_max) {
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = H, d.intermediate = I, d.num_experts = E, d.top_k = K;
  d.shared_intermediate = Is, d.max_tokens = T_max;
  return d;
}

/* ---------------------------------------------------------------------------------------------- */
/* Routing                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* How to route: each slot empty with probability p_empty; the experts in `avoid` (bit e, for
 * E <= 64) never used; hot >= 0: slot 0 of every token goes to expert hot (not in avoid). */
typedef struct {
  double p_empty;
  uint64_t avoid;
  int hot;
} test_route_t;

static inline test_route_t test_route_uniform(double p_empty) {
  test_route_t r;
  r.p_empty = p_empty, r.avoid = 0, r.hot = -1;
  return r;
}

/* idx, tw [T, K]: per token, K distinct experts drawn uniformly (rejecting avoided and repeated
 * ones), then each slot emptied (-1) with probability p_empty, then router weights in [0.1, 1). */
static inline void test_route(int32_t *idx, float *tw, int64_t T, int64_t E, int64_t K,
                              test_route_t r, test_rng_t *rng) {
  for (int64_t t = 0; t < T; t++) {
    int32_t *row = &idx[t * K];
    for (int64_t k = 0; k < K; k++) {
      int32_t e;
      for (;;) {
        e = k == 0 && r.hot >= 0 ? r.hot : (int32_t)test_rng_below(rng, (uint64_t)E);
        int used = E <= 64 && ((r.avoid >> e) & 1);
        for (int64_t j = 0; j < k; j++) used |= row[j] == e;
        if (!used) break;
      }
      row[k] = e;
    }
    for (int64_t k = 0; k < K; k++)
      if (test_rng_uniform(rng) < r.p_empty) row[k] = -1;
    for (int64_t k = 0; k < K; k++) tw[t * K + k] = (float)(0.1 + 0.9 * test_rng_uniform(rng));
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* A layer problem in host memory                                                                 */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
  int64_t T, H, I, E, K, Is; /* T: the rows of x, dy, idx and tw */
  uint16_t *x, *dy;          /* [T, H] bf16 */
  uint16_t *wg, *wu;         /* [E, I, H] bf16 */
  uint16_t *wd;              /* [E, H, I] */
  uint16_t *wsg, *wsu;       /* [Is, H] (a 64-byte buffer when Is = 0) */
  uint16_t *wsd;             /* [H, Is] */
  int32_t *idx;              /* [T, K] expert ids, -1 = empty slot */
  float *tw;                 /* [T, K] router weights */
} test_problem_t;

static inline void test_problem_free(test_problem_t *p) {
  void *bufs[] = {p->x, p->dy, p->wg, p->wu, p->wd, p->wsg, p->wsu, p->wsd, p->idx, p->tw};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) free(bufs[i]);
  memset(p, 0, sizeof(*p));
}

/* Allocates p for T tokens of the shape and draws, in this order, x and dy ~ U(-1, 1) and the
 * weights wg, wu, wd, wsg, wsu, wsd ~ U(-1, 1) / sqrt(fan_in) (activations of unit scale), all
 * bf16. The routing is left for the caller (test_route): every slot expert 0, weight 0. Returns
 * 0 when out of memory (p then holds nothing). */
static inline int test_problem_init(test_problem_t *p, int64_t T, int64_t H, int64_t I, int64_t E,
                                    int64_t K, int64_t Is, test_rng_t *r) {
  memset(p, 0, sizeof(*p));
  p->T = T, p->H = H, p->I = I, p->E = E, p->K = K, p->Is = Is;
  const size_t b = sizeof(uint16_t);
  p->x = (uint16_t *)test_alloc((size_t)(T * H) * b);
  p->dy = (uint16_t *)test_alloc((size_t)(T * H) * b);
  p->wg = (uint16_t *)test_alloc((size_t)(E * I * H) * b);
  p->wu = (uint16_t *)test_alloc((size_t)(E * I * H) * b);
  p->wd = (uint16_t *)test_alloc((size_t)(E * H * I) * b);
  p->wsg = (uint16_t *)test_alloc((size_t)(Is * H) * b);
  p->wsu = (uint16_t *)test_alloc((size_t)(Is * H) * b);
  p->wsd = (uint16_t *)test_alloc((size_t)(H * Is) * b);
  p->idx = (int32_t *)test_alloc((size_t)(T * K) * sizeof(int32_t));
  p->tw = (float *)test_alloc((size_t)(T * K) * sizeof(float));
  if (!p->x || !p->dy || !p->wg || !p->wu || !p->wd || !p->wsg || !p->wsu || !p->wsd ||
      !p->idx || !p->tw) {
    test_problem_free(p);
    return 0;
  }
  const float gh = 1.0f / sqrtf((float)H), gi = 1.0f / sqrtf((float)I);
  bf16_fill(p->x, (size_t)(T * H), 1.0f, r);
  bf16_fill(p->dy, (size_t)(T * H), 1.0f, r);
  bf16_fill(p->wg, (size_t)(E * I * H), gh, r);
  bf16_fill(p->wu, (size_t)(E * I * H), gh, r);
  bf16_fill(p->wd, (size_t)(E * H * I), gi, r);
  if (Is > 0) {
    bf16_fill(p->wsg, (size_t)(Is * H), gh, r);
    bf16_fill(p->wsu, (size_t)(Is * H), gh, r);
    bf16_fill(p->wsd, (size_t)(H * Is), 1.0f / sqrtf((float)Is), r);
  }
  return 1;
}

/* p's weights as the API takes them (no shared expert's when Is = 0). */
static inline mok_weights_t test_problem_weights(const test_problem_t *p) {
  mok_weights_t w;
  memset(&w, 0, sizeof(w));
  w.wg = p->wg, w.wu = p->wu, w.wd = p->wd;
  if (p->Is > 0) w.wsg = p->wsg, w.wsu = p->wsu, w.wsd = p->wsd;
  return w;
}

/* ---------------------------------------------------------------------------------------------- */
/* Arguments                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* The forward arguments of T tokens (x, idx, tw NULL when T = 0, as the API allows). */
static inline mok_forward_args_t test_forward_args(int64_t T, const void *x, const int32_t *idx,
                                                   const float *tw, mok_weights_t w) {
  mok_forward_args_t a;
  memset(&a, 0, sizeof(a));
  a.num_tokens = T;
  a.x = T ? x : NULL;
  a.topk_idx = T ? idx : NULL;
  a.topk_w = T ? tw : NULL;
  a.w = w;
  return a;
}

/* The backward arguments of T tokens (dy, dx, dtw NULL when T = 0); dw: dwg, dwu, dwd, dwsg,
 * dwsu, dwsd, the shared expert's taken only when `shared`. */
static inline mok_backward_args_t test_backward_args(int64_t T, const void *dy, void *dx,
                                                     float *dtw, void *const dw[6], int shared) {
  mok_backward_args_t b;
  memset(&b, 0, sizeof(b));
  b.dy = T ? dy : NULL;
  b.dx = T ? dx : NULL;
  b.dtopk_w = T ? dtw : NULL;
  b.dwg = dw[0], b.dwu = dw[1], b.dwd = dw[2];
  if (shared) b.dwsg = dw[3], b.dwsu = dw[4], b.dwsd = dw[5];
  return b;
}

/* ---------------------------------------------------------------------------------------------- */
/* The CPU layer                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

/* A CPU layer (the reference behind the API) on its own local communicator, with a context
 * buffer of mok_context_size bytes. */
typedef struct {
  mok_comm_t comm;
  mok_layer_t l;
  void *ctx; /* 64-byte aligned, zeroed */
  size_t ctx_bytes;
  void *qw;  /* fp8 layers: the weights quantized (test_cpu_layer_weights) */
} test_cpu_layer_t;

static inline void test_cpu_layer_close(test_cpu_layer_t *c) {
  free(c->ctx);
  free(c->qw);
  if (c->l) mok_layer_destroy(c->l);
  if (c->comm) mok_comm_destroy(c->comm);
  memset(c, 0, sizeof(*c));
}

/* MOK_SUCCESS, or the failure (mok_last_error says why) with c closed. */
static inline mokResult_t test_cpu_layer_open(test_cpu_layer_t *c, const mok_layer_desc_t *d) {
  memset(c, 0, sizeof(*c));
  mokResult_t r = mok_comm_create_local(&c->comm, MOK_DEVICE_CPU);
  if (r == MOK_SUCCESS) r = mok_layer_create(&c->l, c->comm, d);
  if (r == MOK_SUCCESS) r = mok_context_size(c->l, &c->ctx_bytes);
  if (r == MOK_SUCCESS && !(c->ctx = test_alloc(c->ctx_bytes))) r = MOK_ERROR_OUT_OF_MEMORY;
  if (r != MOK_SUCCESS) test_cpu_layer_close(c);
  return r;
}

/* The weights w (host memory) as c's layer reads them: BF16 layers as they are; fp8 layers
 * quantized by mok_quantize_weights into c's buffer, which *w then names (w->quantized). */
static inline mokResult_t test_cpu_layer_weights(test_cpu_layer_t *c, mok_weights_t *w) {
  size_t bytes = 0;
  mokResult_t r = mok_quantized_weights_size(c->l, &bytes);
  if (r != MOK_SUCCESS || bytes == 0) return r;
  free(c->qw);
  if (!(c->qw = test_alloc(bytes))) return MOK_ERROR_OUT_OF_MEMORY;
  r = mok_quantize_weights(c->l, w, c->qw, bytes, NULL);
  w->quantized = c->qw, w->quantized_bytes = bytes;
  return r;
}

/* Sets the layer's forward path (src/common/tuning.h: the fused kernel, or the kernel chain that is
 * its oracle), its other tuning values kept. MOK_SUCCESS or the failure. */
static inline mokResult_t test_set_forward_path(mok_layer_t l, mok_forward_path_t path) {
  mok_tuning_t t;
  mokResult_t r = mok_layer_tuning(l, &t);
  if (r != MOK_SUCCESS) return r;
  t.forward_path = path;
  return mok_layer_set_tuning(l, &t);
}

#endif /* MOK_TESTS_SUPPORT_LAYER_H */
