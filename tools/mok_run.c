/*
 * mok_run.c: the main job (`make run`). Runs a fused MoE layer forward and backward, checks it and
 * times it. With a GPU it first runs the GPU forward (W = 1, BF16: the layout kernel and one fused
 * persistent kernel) and backward (a kernel chain): checked against the CPU layer on a small
 * shape, then timed at Qwen3-30B-A3B size (CUDA events, median of 10 after 3 warm-ups), the
 * forward also through the unfused kernel chain (the layer's tuning, src/api/internal.h), which
 * must give the same bits. Then, with or without a GPU, it runs the CPU reference on a small
 * shape, in all three precisions, and checks: run-to-run bitwise determinism, finite outputs, and
 * that the fp8 results stay within the e4m3 error of the bf16 result. Layers, descriptors,
 * arguments, random numbers and timers come from the tests' fixtures (tests/support).
 *
 * Usage: mok_run [T H I E K Is]   (defaults: 256 256 256 8 2 256 on the CPU)
 * Arguments that are not integers, or a shape the library refuses (mok_layer_create's checks:
 * K > E, H not a multiple of 128, ...), print the usage and the reason and exit with status 2.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tests/support/layer.h"
#include "../tests/support/rng.h"
#include "../tests/support/timer.h"
#include "cpu/quant.h"
#include "mok.h"

typedef struct {
  int64_t T, H, I, E, K, Is;
} shape_t;

/* One stream for the whole run (xorshift64*: the values of README's output). */
static test_rng_t g_rng = {0x9E3779B97F4A7C15ull, TEST_RNG_XORSHIFT64_STAR};
static double rnd(void) { return test_rng_sym(&g_rng); } /* uniform in [-1, 1) */

static uint16_t *bf16_random(int64_t n, double scale) {
  uint16_t *p = malloc(sizeof(uint16_t) * (size_t)n);
  for (int64_t i = 0; p && i < n; i++) p[i] = mok_bf16_from_float((float)(scale * rnd()));
  return p;
}

static mok_layer_desc_t shape_desc(const shape_t *s) {
  return test_layer_desc(s->H, s->I, s->E, s->K, s->Is, s->T);
}

#define CHECK(call)                                                                            \
  do {                                                                                         \
    mokResult_t r_ = (call);                                                                   \
    if (r_ != MOK_SUCCESS) {                                                                   \
      fprintf(stderr, "%s failed: %s\n", #call, mok_last_error());                             \
      return r_;                                                                               \
    }                                                                                          \
  } while (0)

typedef struct {
  uint16_t *y, *dx;
  float *dtopk_w, *dw[6];
  double fwd_s, bwd_s;
} result_t;

/* One forward and backward of the layer on `comm` at `prec`; inputs are shared across runs. */
static mokResult_t run_layer(mok_comm_t comm, const shape_t *s, mok_precision_t prec,
                             const mok_forward_args_t *in, const uint16_t *dy, result_t *res) {
  mok_layer_desc_t d = shape_desc(s);
  d.precision = prec;
  mok_layer_t l;
  CHECK(mok_layer_create(&l, comm, &d));
  size_t ctx_bytes, qw_bytes;
  CHECK(mok_context_size(l, &ctx_bytes));
  CHECK(mok_quantized_weights_size(l, &qw_bytes));
  void *ctx = test_alloc(ctx_bytes);
  void *qw = qw_bytes ? aligned_alloc(256, (qw_bytes + 255) / 256 * 256) : NULL;
  mok_forward_args_t a = *in;
  if (qw) {
    CHECK(mok_quantize_weights(l, &a.w, qw, qw_bytes, NULL));
    a.w.quantized = qw;
    a.w.quantized_bytes = qw_bytes;
  }
  const int64_t EL = s->E, wsz[6] = {EL * s->I * s->H, EL * s->I * s->H, EL * s->H * s->I,
                                    s->Is * s->H, s->Is * s->H, s->H * s->Is};
  res->y = malloc(sizeof(uint16_t) * (size_t)(s->T * s->H));
  res->dx = malloc(sizeof(uint16_t) * (size_t)(s->T * s->H));
  res->dtopk_w = malloc(sizeof(float) * (size_t)(s->T * s->K));
  void *dw[6];
  for (int i = 0; i < 6; i++)
    dw[i] = res->dw[i] = test_alloc(sizeof(float) * (size_t)(wsz[i] + 16));
  const mok_backward_args_t g = test_backward_args(s->T, dy, res->dx, res->dtopk_w, dw, s->Is > 0);
  double t0 = test_now_s();
  CHECK(mok_forward(l, &a, res->y, ctx, ctx_bytes, NULL));
  double t1 = test_now_s();
  CHECK(mok_backward(l, &a, &g, ctx, ctx_bytes, NULL));
  res->fwd_s = t1 - t0;
  res->bwd_s = test_now_s() - t1;
  free(ctx);
  free(qw);
  mok_layer_destroy(l);
  return MOK_SUCCESS;
}

static void free_result(result_t *r) {
  free(r->y), free(r->dx), free(r->dtopk_w);
  for (int i = 0; i < 6; i++) free(r->dw[i]);
}

/* ||a - b|| / ||b|| over bf16 vectors. */
static double rel_err(const uint16_t *a, const uint16_t *b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    double x = mok_bf16_to_float(a[i]), y = mok_bf16_to_float(b[i]);
    num += (x - y) * (x - y), den += y * y;
  }
  return sqrt(num / (den > 0 ? den : 1));
}

static int all_finite(const uint16_t *a, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (!isfinite(mok_bf16_to_float(a[i]))) return 0;
  return 1;
}

/* The first expert id from e on (cyclically) that none of row[0..k) uses; -1 when all E are used
 * (K > E: without this bound the search never ended). */
static int32_t next_free_expert(const int32_t *row, int64_t k, int32_t e, int64_t E) {
  for (int64_t tries = 0; tries < E; tries++, e = (int32_t)((e + 1) % E)) {
    int taken = 0;
    for (int64_t j = 0; j < k; j++) taken |= row[j] == e;
    if (!taken) return e;
  }
  return -1;
}

static int run_cpu(const shape_t *s) {
  mok_comm_t comm;
  if (mok_comm_create_local(&comm, MOK_DEVICE_CPU) != MOK_SUCCESS) {
    fprintf(stderr, "mok_comm_create_local: %s\n", mok_last_error());
    return 1;
  }
  const int64_t T = s->T, H = s->H, I = s->I, E = s->E, K = s->K, Is = s->Is;
  uint16_t *x = bf16_random(T * H, 1.0), *dy = bf16_random(T * H, 1.0);
  uint16_t *wg = bf16_random(E * I * H, 1 / sqrt((double)H)), *wu = bf16_random(E * I * H, 1 / sqrt((double)H));
  uint16_t *wd = bf16_random(E * H * I, 1 / sqrt((double)I));
  uint16_t *wsg = bf16_random(Is * H + 1, 1 / sqrt((double)H)), *wsu = bf16_random(Is * H + 1, 1 / sqrt((double)H));
  uint16_t *wsd = bf16_random(H * Is + 1, 1 / sqrt((double)(Is ? Is : 1)));
  int32_t *idx = malloc(sizeof(int32_t) * (size_t)(T * K));
  float *tw = malloc(sizeof(float) * (size_t)(T * K));
  if (!x || !dy || !wg || !wu || !wd || !wsg || !wsu || !wsd || !idx || !tw) {
    fprintf(stderr, "mok_run: out of host memory for the inputs of this shape\n");
    return 1;
  }
  for (int64_t t = 0; t < T; t++) /* K distinct experts per token, every 17th slot empty */
    for (int64_t k = 0; k < K; k++) {
      idx[t * K + k] = (t * 7 + k * (E / K + 1) + t / 3) % E;
      if ((t * K + k) % 17 == 16) idx[t * K + k] = -1;
      tw[t * K + k] = (float)(0.5 + 0.5 * fabs(rnd())) / (float)K;
    }
  for (int64_t t = 0; t < T; t++) /* make rows distinct: bump repeats to the next free expert */
    for (int64_t k = 1; k < K; k++)
      if (idx[t * K + k] >= 0) idx[t * K + k] = next_free_expert(idx + t * K, k, idx[t * K + k], E);
  mok_weights_t w = {wg, wu, wd, Is ? wsg : NULL, Is ? wsu : NULL, Is ? wsd : NULL, NULL, 0};
  const mok_forward_args_t in = test_forward_args(T, x, idx, tw, w);
  const char *names[3] = {"bf16", "fp8-block", "mxfp8"};
  result_t ref = {0};
  double flops = 6.0 * (double)(T * K) * H * I + 6.0 * T * H * Is; /* forward; backward is 2x */
  int failures = 0;
  printf("CPU reference, T=%lld H=%lld I=%lld E=%lld K=%lld Is=%lld (W=1)\n", (long long)T,
         (long long)H, (long long)I, (long long)E, (long long)K, (long long)Is);
  printf("%-10s %10s %10s %12s %12s %14s %s\n", "precision", "fwd ms", "bwd ms", "fwd GFLOP/s",
         "bwd GFLOP/s", "y rel err", "checks");
  for (int p = 0; p < 3; p++) {
    result_t a = {0}, b = {0};
    if (run_layer(comm, s, (mok_precision_t)p, &in, dy, &a) != MOK_SUCCESS ||
        run_layer(comm, s, (mok_precision_t)p, &in, dy, &b) != MOK_SUCCESS)
      return 1;
    int det = !memcmp(a.y, b.y, sizeof(uint16_t) * (size_t)(T * H)) &&
              !memcmp(a.dx, b.dx, sizeof(uint16_t) * (size_t)(T * H)) &&
              !memcmp(a.dtopk_w, b.dtopk_w, sizeof(float) * (size_t)(T * K)) &&
              !memcmp(a.dw[0], b.dw[0], sizeof(float) * (size_t)(E * I * H));
    int fin = all_finite(a.y, T * H) && all_finite(a.dx, T * H);
    double err = p == 0 ? 0.0 : rel_err(a.y, ref.y, T * H);
    /* e4m3 keeps 3 mantissa bits: relative step 2^-3 to 2^-4 per element, about 3% rms after the
     * two quantized GEMMs; 0.1 flags a broken quantizer, not noise. */
    int close = p == 0 || err < 0.1;
    failures += !det + !fin + !close;
    printf("%-10s %10.1f %10.1f %12.2f %12.2f %14.3g %s%s%s\n", names[p], 1e3 * a.fwd_s,
           1e3 * a.bwd_s, flops / a.fwd_s * 1e-9, 2 * flops / a.bwd_s * 1e-9, err,
           det ? "deterministic" : "NOT DETERMINISTIC", fin ? ", finite" : ", NON-FINITE",
           close ? "" : ", TOO FAR FROM BF16");
    if (p == 0) ref = a;
    else free_result(&a);
    free_result(&b);
  }
  free_result(&ref);
  free(x), free(dy), free(wg), free(wu), free(wd), free(wsg), free(wsu), free(wsd), free(idx), free(tw);
  mok_comm_destroy(comm);
  printf("%s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* GPU forward (W = 1, BF16)                                                                       */
/* ---------------------------------------------------------------------------------------------- */

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

#include "../tests/support/gpu.h"

#define GPU_CHECK(call)                                                                        \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_));                      \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

#define MOK_OK(call)                                                                           \
  do {                                                                                         \
    if ((call) != MOK_SUCCESS) {                                                               \
      fprintf(stderr, "%s failed: %s\n", #call, mok_last_error());                             \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

/* Host inputs of one layer problem; weights of `distinct` experts, repeated over the rest (the
 * timing does not depend on the values, and 604M random weights take seconds on one core). */
typedef struct {
  shape_t s;
  uint16_t *x, *w[6]; /* x [T, H]; wg, wu [E, I, H], wd [E, H, I], wsg, wsu [Is, H], wsd [H, Is] */
  int32_t *idx;       /* [T, K] distinct experts per token */
  float *tw;          /* [T, K] */
} gpu_problem_t;

static void gpu_problem_free(gpu_problem_t *p) {
  free(p->x), free(p->idx), free(p->tw);
  for (int i = 0; i < 6; i++) free(p->w[i]);
}

static int gpu_problem_init(gpu_problem_t *p, shape_t s, int64_t distinct) {
  const int64_t T = s.T, H = s.H, I = s.I, E = s.E, K = s.K, Is = s.Is;
  memset(p, 0, sizeof(*p));
  p->s = s;
  p->x = bf16_random(T * H, 1.0);
  const int64_t n[6] = {I * H, I * H, H * I, Is * H, Is * H, H * Is};
  const double scale[6] = {1 / sqrt((double)H), 1 / sqrt((double)H), 1 / sqrt((double)I),
                           1 / sqrt((double)H), 1 / sqrt((double)H), 1 / sqrt((double)(Is ? Is : 1))};
  for (int i = 0; i < 6; i++) {
    const int64_t copies = i < 3 ? E : 1, d = i < 3 && distinct < E ? distinct : copies;
    p->w[i] = malloc(sizeof(uint16_t) * (size_t)(copies * n[i] + 8));
    if (!p->w[i]) return 0;
    for (int64_t c = 0; c < copies; c++) {
      if (c < d) {
        for (int64_t j = 0; j < n[i]; j++) p->w[i][c * n[i] + j] = mok_bf16_from_float((float)(scale[i] * rnd()));
      } else {
        memcpy(p->w[i] + c * n[i], p->w[i] + (c % d) * n[i], sizeof(uint16_t) * (size_t)n[i]);
      }
    }
  }
  p->idx = malloc(sizeof(int32_t) * (size_t)(T * K));
  p->tw = malloc(sizeof(float) * (size_t)(T * K));
  if (!p->x || !p->idx || !p->tw) return 0;
  for (int64_t t = 0; t < T; t++) /* K distinct uniformly random experts */
    for (int64_t k = 0; k < K; k++) {
      int32_t e;
      int again;
      if (k >= E) { /* no distinct expert left (the shapes here have K <= E) */
        p->idx[t * K + k] = -1;
        p->tw[t * K + k] = 0.0f;
        continue;
      }
      do {
        e = (int32_t)((rnd() + 1.0) * 0.5 * (double)E) % (int32_t)E;
        again = 0;
        for (int64_t j = 0; j < k; j++) again |= p->idx[t * K + j] == e;
      } while (again);
      p->idx[t * K + k] = e;
      p->tw[t * K + k] = (float)(0.5 + 0.5 * fabs(rnd())) / (float)K;
    }
  return 1;
}

/* A GPU layer (tests/support/gpu.h) with p's inputs and weights. 1 on failure (printed). */
static int gpu_job_open(test_gpu_layer_t *j, const gpu_problem_t *p) {
  const mok_layer_desc_t d = shape_desc(&p->s);
  const mok_weights_t w = {p->w[0], p->w[1], p->w[2], p->w[3], p->w[4], p->w[5], NULL, 0};
  return !test_gpu_layer_open(j, &d, p->x, p->idx, p->tw, &w);
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

/* Median of 10 forwards (g NULL) or backwards (g: the gradients) after 3 warm-ups, in ms (CUDA
 * events on the legacy stream). 1 on failure. */
static int median_ms(const test_gpu_layer_t *j, int64_t T, const mok_backward_args_t *g,
                     cudaEvent_t ev[2], double *med) {
  const mok_forward_args_t a = test_gpu_layer_args(j, T);
  float ms[10];
  for (int it = 0; it < 13; it++) {
    GPU_CHECK(cudaEventRecord(ev[0], NULL));
    if (g) MOK_OK(mok_backward(j->l, &a, g, j->ctx, j->ctx_bytes, NULL));
    else MOK_OK(mok_forward(j->l, &a, j->y, j->ctx, j->ctx_bytes, NULL));
    GPU_CHECK(cudaEventRecord(ev[1], NULL));
    GPU_CHECK(cudaEventSynchronize(ev[1]));
    if (it >= 3) GPU_CHECK(cudaEventElapsedTime(&ms[it - 3], ev[0], ev[1]));
  }
  MOK_OK(mok_layer_check(j->l));
  qsort(ms, 10, sizeof(float), cmp_float);
  *med = 0.5 * (ms[4] + ms[5]);
  return 0;
}

/* The small shape against the CPU layer; then the model-size shape, timed. 0 when all is well. */
static int run_gpu(void) {
  int failures = 0;
  printf("GPU 0: forward (fused persistent kernel) and backward (kernel chain), W = 1, BF16\n");
  { /* 1. small shape: the CPU layer is the reference */
    const shape_t s = {256, 256, 256, 8, 2, 256};
    gpu_problem_t p;
    test_gpu_layer_t j;
    if (!gpu_problem_init(&p, s, s.E) || gpu_job_open(&j, &p)) return 1;
    uint16_t *y = malloc((size_t)(s.T * s.H) * 2), *y2 = malloc((size_t)(s.T * s.H) * 2);
    uint16_t *ref = malloc((size_t)(s.T * s.H) * 2);
    MOK_OK(test_gpu_layer_forward(&j, s.T, NULL));
    MOK_OK(mok_layer_check(j.l));
    GPU_CHECK(cudaMemcpy(y, j.y, (size_t)(s.T * s.H) * 2, cudaMemcpyDeviceToHost));
    MOK_OK(test_gpu_layer_forward(&j, s.T, NULL));
    MOK_OK(mok_layer_check(j.l));
    GPU_CHECK(cudaMemcpy(y2, j.y, (size_t)(s.T * s.H) * 2, cudaMemcpyDeviceToHost));
    const mok_layer_desc_t d = shape_desc(&s);
    test_cpu_layer_t c;
    MOK_OK(test_cpu_layer_open(&c, &d));
    const mok_weights_t w = {p.w[0], p.w[1], p.w[2], p.w[3], p.w[4], p.w[5], NULL, 0};
    const mok_forward_args_t a = test_forward_args(s.T, p.x, p.idx, p.tw, w);
    MOK_OK(mok_forward(c.l, &a, ref, c.ctx, c.ctx_bytes, NULL));
    /* bf16 noise of yk, a and y (one rounding each, ~2^-9 relative rms) and fp32 order: ~0.3%;
     * 1% flags a wrong row or expert, not noise. tests/gpu/test_forward.cu checks elementwise. */
    const double err = rel_err(y, ref, s.T * s.H);
    const int det = !memcmp(y, y2, (size_t)(s.T * s.H) * 2), close = err < 1e-2;
    failures += !det + !close;
    printf("  small shape T=%lld H=%lld I=%lld E=%lld K=%lld Is=%lld: y rel err vs CPU %.3g (%s), "
           "%s\n", (long long)s.T, (long long)s.H, (long long)s.I, (long long)s.E, (long long)s.K,
           (long long)s.Is, err, close ? "ok" : "TOO FAR", det ? "deterministic" : "NOT DETERMINISTIC");
    free(y), free(y2), free(ref);
    test_cpu_layer_close(&c);
    test_gpu_layer_close(&j);
    gpu_problem_free(&p);
  }
  { /* 2. Qwen3-30B-A3B, timed */
    const shape_t s = {16384, 2048, 768, 128, 8, 0};
    gpu_problem_t p;
    test_gpu_layer_t j;
    if (!gpu_problem_init(&p, s, 4) || gpu_job_open(&j, &p)) return 1;
    cudaEvent_t ev[2];
    GPU_CHECK(cudaEventCreate(&ev[0]));
    GPU_CHECK(cudaEventCreate(&ev[1]));
    double med, cmed;
    if (median_ms(&j, s.T, NULL, ev, &med)) return 1;
    const double flops = 6.0 * (double)(s.T * s.K) * s.H * s.I + 6.0 * s.T * s.H * s.Is;
    uint16_t *y = malloc((size_t)(s.T * s.H) * 2), *yc = malloc((size_t)(s.T * s.H) * 2);
    GPU_CHECK(cudaMemcpy(y, j.y, (size_t)(s.T * s.H) * 2, cudaMemcpyDeviceToHost));
    const int fin = all_finite(y, s.T * s.H);
    failures += !fin;
    printf("  Qwen3-30B-A3B T=%lld H=%lld I=%lld E=%lld K=%lld Is=%lld: forward %.3f ms (median "
           "of 10), %.1f TFLOP/s, y %s\n", (long long)s.T, (long long)s.H, (long long)s.I,
           (long long)s.E, (long long)s.K, (long long)s.Is, med, flops / (med * 1e-3) * 1e-12,
           fin ? "finite" : "NON-FINITE");
    /* The same forward through the unfused kernel chain: the same bits, its own time. */
    MOK_OK(test_set_forward_path(j.l, MOK_FORWARD_CHAIN));
    const int crc = median_ms(&j, s.T, NULL, ev, &cmed);
    MOK_OK(test_set_forward_path(j.l, MOK_FORWARD_FUSED));
    if (crc) return 1;
    GPU_CHECK(cudaMemcpy(yc, j.y, (size_t)(s.T * s.H) * 2, cudaMemcpyDeviceToHost));
    const int same = !memcmp(y, yc, (size_t)(s.T * s.H) * 2);
    failures += !same;
    printf("  Qwen3-30B-A3B forward, unfused kernel chain (forward_path chain): %.3f ms, %.1f "
           "TFLOP/s, y %s\n", cmed, flops / (cmed * 1e-3) * 1e-12,
           same ? "bitwise equal to the fused kernel's" : "DIFFERS FROM THE FUSED KERNEL'S");
    free(yc);
    /* Backward, timed the same way, from the last forward's context; dy = that forward's y
     * (any bf16 values will do for timing). fp32 weight gradients, overwritten. */
    void *dx = NULL, *dtw = NULL, *dw[3] = {NULL, NULL, NULL};
    const size_t wn = (size_t)(s.E * s.I * s.H);
    GPU_CHECK(cudaMalloc(&dx, (size_t)(s.T * s.H) * 2));
    GPU_CHECK(cudaMalloc(&dtw, (size_t)(s.T * s.K) * 4));
    for (int i = 0; i < 3; i++) GPU_CHECK(cudaMalloc(&dw[i], wn * 4));
    void *const dws[6] = {dw[0], dw[1], dw[2], NULL, NULL, NULL};
    const mok_backward_args_t g = test_backward_args(s.T, j.y, dx, (float *)dtw, dws, 0);
    double bmed;
    if (median_ms(&j, s.T, &g, ev, &bmed)) return 1;
    GPU_CHECK(cudaMemcpy(y, dx, (size_t)(s.T * s.H) * 2, cudaMemcpyDeviceToHost));
    const int bfin = all_finite(y, s.T * s.H);
    failures += !bfin;
    printf("  Qwen3-30B-A3B backward %.3f ms (median of 10), %.1f TFLOP/s (2x the forward's "
           "FLOPs), dx %s\n", bmed, 2 * flops / (bmed * 1e-3) * 1e-12, bfin ? "finite" : "NON-FINITE");
    cudaFree(dx), cudaFree(dtw);
    for (int i = 0; i < 3; i++) cudaFree(dw[i]);
    free(y);
    cudaEventDestroy(ev[0]);
    cudaEventDestroy(ev[1]);
    test_gpu_layer_close(&j);
    gpu_problem_free(&p);
  }
  printf("  GPU %s\n", failures ? "FAILED" : "OK");
  return failures;
}

#else

static int run_gpu(void) { return 0; }

#endif /* MOK_WITH_CUDA */

static int usage(const char *prog, const char *why) {
  fprintf(stderr,
          "%s: %s\n"
          "usage: %s [T H I E K Is]\n"
          "  T tokens (also T_max), H hidden, I intermediate, E experts, K experts per token,\n"
          "  Is shared intermediate (0: none); defaults 256 256 256 8 2 256\n",
          prog, why, prog);
  return 2;
}

/* A whole decimal int64, nothing else. */
static int parse_i64(const char *s, int64_t *v) {
  char *end = NULL;
  errno = 0;
  const long long x = strtoll(s, &end, 10);
  if (errno || end == s || *end != '\0') return 0;
  *v = x;
  return 1;
}

/* 1 when the library accepts the shape as a layer (its checks are the contract, mok.h); else 0
 * with the reason in why. */
static int shape_ok(const shape_t *s, char *why, size_t n) {
  mok_comm_t c;
  mok_layer_t l;
  if (mok_comm_create_local(&c, MOK_DEVICE_CPU) != MOK_SUCCESS) {
    snprintf(why, n, "%s", mok_last_error());
    return 0;
  }
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = s->H, d.intermediate = s->I, d.num_experts = s->E, d.top_k = s->K;
  d.shared_intermediate = s->Is, d.max_tokens = s->T;
  const int ok = mok_layer_create(&l, c, &d) == MOK_SUCCESS;
  if (ok) mok_layer_destroy(l);
  else snprintf(why, n, "T H I E K Is = %lld %lld %lld %lld %lld %lld: %s", (long long)s->T,
                (long long)s->H, (long long)s->I, (long long)s->E, (long long)s->K,
                (long long)s->Is, mok_last_error());
  mok_comm_destroy(c);
  return ok;
}

int main(int argc, char **argv) {
  shape_t s = {256, 256, 256, 8, 2, 256};
  if (argc == 7) {
    int64_t v[6];
    for (int i = 0; i < 6; i++)
      if (!parse_i64(argv[i + 1], &v[i])) {
        char why[128];
        snprintf(why, sizeof why, "argument %d, \"%s\", is not an integer", i + 1, argv[i + 1]);
        return usage(argv[0], why);
      }
    s = (shape_t){v[0], v[1], v[2], v[3], v[4], v[5]};
    char why[640];
    if (!shape_ok(&s, why, sizeof why)) return usage(argv[0], why);
  } else if (argc != 1) {
    return usage(argv[0], "expected no arguments or all six");
  }
  printf("MoK %d.%d.%d\n", MOK_VERSION_MAJOR, MOK_VERSION_MINOR, MOK_VERSION_PATCH);
  mok_comm_t gpu; /* a communicator on GPU 0 exists when the GPU part can run */
  int failures = 0;
  if (mok_comm_create_local(&gpu, 0) == MOK_SUCCESS) {
    mok_comm_destroy(gpu);
    failures += run_gpu();
    printf("and the CPU reference:\n");
  } else {
    printf("no GPU (%s): running the CPU reference\n", mok_last_error());
  }
  failures += run_cpu(&s);
  return failures ? 1 : 0;
}
