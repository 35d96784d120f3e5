/*
 * gpu.h: GPU fixtures. Whether a device is usable, device copies of host data, and a GPU layer
 * (device 0) with its inputs, weights, output and context in device memory, built from the same
 * host data as a CPU layer (tests/support/layer.h). Plain C11 that also compiles as C++ (nvcc);
 * header-only; needs the CUDA runtime.
 */
#ifndef MOK_TESTS_SUPPORT_GPU_H
#define MOK_TESTS_SUPPORT_GPU_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "layer.h"
#include "mok.h"

/* 1 when a CUDA device is usable; GPU tests skip otherwise. */
static inline int test_gpu_present(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError(); /* no driver or no device: clear the error for later calls */
    return 0;
  }
  return n > 0;
}

/* A device copy of the n bytes at h, with 16 bytes to spare past them (a 16-byte vector load of
 * the last element stays inside); NULL on failure. */
static inline void *test_dev_copy(const void *h, size_t n) {
  void *d = NULL;
  if (cudaMalloc(&d, n + 16) != cudaSuccess) return NULL;
  if (n && cudaMemcpy(d, h, n, cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaFree(d);
    return NULL;
  }
  return d;
}

/* A GPU layer and its device buffers (the layer's descriptor gives their shapes). */
typedef struct {
  mok_comm_t comm;
  mok_layer_t l;
  uint16_t *x;               /* [T_max, H] bf16 */
  int32_t *idx;              /* [T_max, K] */
  float *tw;                 /* [T_max, K] */
  uint16_t *wg, *wu, *wd;    /* [E, I, H], [E, I, H], [E, H, I] bf16 */
  uint16_t *wsg, *wsu, *wsd; /* [Is, H], [Is, H], [H, Is]; NULL when Is = 0 */
  uint16_t *y;               /* [T_max, H] bf16 */
  uint8_t *ctx;              /* mok_context_size bytes */
  size_t ctx_bytes;
  void *qw;                  /* fp8 layers: the weights quantized by mok_quantize_weights */
  size_t qw_bytes;
} test_gpu_layer_t;

/* Waits for the device, then frees everything (any field may be NULL). */
static inline void test_gpu_layer_close(test_gpu_layer_t *g) {
  cudaDeviceSynchronize();
  void *bufs[] = {g->x,   g->idx, g->tw, g->wg, g->wu,  g->wd,
                  g->wsg, g->wsu, g->wsd, g->y, g->ctx, g->qw};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    if (bufs[i]) cudaFree(bufs[i]);
  if (g->l) mok_layer_destroy(g->l);
  if (g->comm) mok_comm_destroy(g->comm);
  memset(g, 0, sizeof(*g));
}

/* A GPU layer of descriptor d with x [T_max, H], idx and tw [T_max, K] and the weights w (host
 * memory; the shared expert's when d has one) uploaded; y poisoned with 0xFF bytes (NaN in bf16:
 * rows a forward does not write show), the context zeroed. 1, or 0 on failure (the reason
 * printed, g closed). */
static inline int test_gpu_layer_open(test_gpu_layer_t *g, const mok_layer_desc_t *d,
                                      const uint16_t *x, const int32_t *idx, const float *tw,
                                      const mok_weights_t *w) {
  memset(g, 0, sizeof(*g));
  const int64_t T = d->max_tokens, H = d->hidden, I = d->intermediate, E = d->num_experts,
                K = d->top_k, Is = d->shared_intermediate;
  if (mok_comm_create_local(&g->comm, 0) != MOK_SUCCESS ||
      mok_layer_create(&g->l, g->comm, d) != MOK_SUCCESS ||
      mok_context_size(g->l, &g->ctx_bytes) != MOK_SUCCESS) {
    printf("    GPU layer: %s\n", mok_last_error());
    test_gpu_layer_close(g);
    return 0;
  }
  const size_t b = sizeof(uint16_t);
  g->x = (uint16_t *)test_dev_copy(x, (size_t)(T * H) * b);
  g->idx = (int32_t *)test_dev_copy(idx, (size_t)(T * K) * sizeof(int32_t));
  g->tw = (float *)test_dev_copy(tw, (size_t)(T * K) * sizeof(float));
  g->wg = (uint16_t *)test_dev_copy(w->wg, (size_t)(E * I * H) * b);
  g->wu = (uint16_t *)test_dev_copy(w->wu, (size_t)(E * I * H) * b);
  g->wd = (uint16_t *)test_dev_copy(w->wd, (size_t)(E * H * I) * b);
  if (Is > 0) {
    g->wsg = (uint16_t *)test_dev_copy(w->wsg, (size_t)(Is * H) * b);
    g->wsu = (uint16_t *)test_dev_copy(w->wsu, (size_t)(Is * H) * b);
    g->wsd = (uint16_t *)test_dev_copy(w->wsd, (size_t)(H * Is) * b);
  }
  if (cudaMalloc((void **)&g->y, (size_t)(T * H) * b + 16) != cudaSuccess) g->y = NULL;
  if (cudaMalloc((void **)&g->ctx, g->ctx_bytes) != cudaSuccess) g->ctx = NULL;
  if (!g->x || !g->idx || !g->tw || !g->wg || !g->wu || !g->wd || !g->y || !g->ctx ||
      (Is > 0 && (!g->wsg || !g->wsu || !g->wsd))) {
    printf("    GPU layer: device allocation failed\n");
    test_gpu_layer_close(g);
    return 0;
  }
  cudaMemset(g->y, 0xFF, (size_t)(T * H) * b);
  cudaMemset(g->ctx, 0, g->ctx_bytes);
  /* fp8 layers read their weights quantized, by the library's GPU quantizer */
  if (mok_quantized_weights_size(g->l, &g->qw_bytes) != MOK_SUCCESS) g->qw_bytes = 0;
  if (g->qw_bytes > 0) {
    mok_weights_t dw;
    memset(&dw, 0, sizeof(dw));
    dw.wg = g->wg, dw.wu = g->wu, dw.wd = g->wd, dw.wsg = g->wsg, dw.wsu = g->wsu, dw.wsd = g->wsd;
    if (cudaMalloc(&g->qw, g->qw_bytes) != cudaSuccess ||
        mok_quantize_weights(g->l, &dw, g->qw, g->qw_bytes, NULL) != MOK_SUCCESS ||
        cudaDeviceSynchronize() != cudaSuccess) {
      printf("    GPU layer: quantizing the weights: %s\n", mok_last_error());
      test_gpu_layer_close(g);
      return 0;
    }
  }
  return 1;
}

/* The device weights as the API takes them. */
static inline mok_weights_t test_gpu_layer_weights(const test_gpu_layer_t *g) {
  mok_weights_t w;
  memset(&w, 0, sizeof(w));
  w.wg = g->wg, w.wu = g->wu, w.wd = g->wd;
  w.wsg = g->wsg, w.wsu = g->wsu, w.wsd = g->wsd;
  w.quantized = g->qw, w.quantized_bytes = g->qw_bytes;
  return w;
}

/* The forward arguments of the first T tokens of g's inputs (also the backward's). */
static inline mok_forward_args_t test_gpu_layer_args(const test_gpu_layer_t *g, int64_t T) {
  return test_forward_args(T, g->x, g->idx, g->tw, test_gpu_layer_weights(g));
}

/* A forward of the first T tokens into g's y and context, on `stream` (a cudaStream_t). */
static inline mokResult_t test_gpu_layer_forward(test_gpu_layer_t *g, int64_t T, void *stream) {
  const mok_forward_args_t a = test_gpu_layer_args(g, T);
  return mok_forward(g->l, &a, T ? g->y : NULL, g->ctx, g->ctx_bytes, (mok_stream_t)stream);
}

#ifdef __cplusplus
#include <vector>

/* A device copy of a host vector (test_dev_copy); NULL on failure. */
template <class T>
static T *to_dev(const std::vector<T> &h) {
  return (T *)test_dev_copy(h.data(), h.size() * sizeof(T));
}
#endif

#endif /* MOK_TESTS_SUPPORT_GPU_H */
