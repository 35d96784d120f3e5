/*
 * gemm_test_util.h: helpers shared by the grouped-GEMM tests (test_gemm.cu, test_gemm_fp8.cu):
 * bf16 conversion, a deterministic RNG, device copies, ragged problems, and the loop over the
 * launcher's kernel configurations. Header-only, static: each test file gets its own copy.
 */
#ifndef MOK_TESTS_GPU_GEMM_TEST_UTIL_H
#define MOK_TESTS_GPU_GEMM_TEST_UTIL_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "../test.h"
#include "cuda/gemm/gemm.h"

/* ---------------------------------------------------------------------------------------------- */
/* Helpers                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

static inline int gpu_present(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

static inline uint16_t f2bf(float f) {  // round to nearest even (inputs here are finite)
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static inline float rnd_unit(void) {  // uniform in [-1, 1)
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (float)((g_rng >> 40) * (1.0 / 8388608.0)) - 1.0f;
}
static inline void fill_bf16(std::vector<uint16_t> &v, float scale) {
  for (size_t i = 0; i < v.size(); i++) v[i] = f2bf(scale * rnd_unit());
}

// Launcher parameters for G groups of a [M, K] x [N, K] problem: dtype, epilogue and the main
// operands; everything else zero (K-major B, int32 offsets, one CTA per SM) for the caller to set.
static inline mok_grouped_gemm_params_t gemm_params(mok_gg_dtype_t dtype, mok_gg_epilogue_t epi,
                                                    int64_t G, int64_t M, int64_t N, int64_t K,
                                                    const void *a, const void *b,
                                                    const void *offsets, void *c) {
  mok_grouped_gemm_params_t p = mok_gg_bf16_params(epi, MOK_GG_B_KMAJOR, G, M, N, K);
  p.dtype = dtype;
  p.a = a;
  p.b = b;
  p.offsets = offsets;
  p.c = c;
  return p;
}

// Device copy of a host vector; returns NULL on failure.
template <class T>
static T *to_dev(const std::vector<T> &h) {
  T *d = NULL;
  if (cudaMalloc(&d, h.size() * sizeof(T) + 16) != cudaSuccess) return NULL;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

static inline double silu(double g) { return g / (1.0 + exp(-g)); }

// A problem: groups over the rows of A, with rows before, between (none) and after the groups.
typedef struct {
  int G, M, N, K;
  std::vector<int64_t> offs;  // [G + 1]
} problem_t;

static inline problem_t make_problem(int N, int K, const std::vector<int> &counts, int lead, int tail) {
  problem_t pr;
  pr.G = (int)counts.size();
  pr.N = N;
  pr.K = K;
  pr.offs.resize(pr.G + 1);
  pr.offs[0] = lead;
  for (int g = 0; g < pr.G; g++) pr.offs[g + 1] = pr.offs[g] + counts[g];
  pr.M = (int)pr.offs[pr.G] + tail;
  return pr;
}

static inline int group_of_row(const problem_t &pr, int r) {
  for (int g = 0; g < pr.G; g++)
    if (r >= pr.offs[g] && r < pr.offs[g + 1]) return g;
  return -1;
}

// Runs `body` in each kernel configuration of the launcher's table: staged (TMA-store) epilogue
// with 2-CTA clusters sharing B (MOK_GG_CLUSTER=2), staged without clusters (the default), direct
// stores (MOK_GG_TMA_STORE=0), staged with 4 stages and 32 KB of staging (MOK_GG_STAGES=4). fp32
// stores are staged (3 stages) or direct only, so clusters and 4 stages run the staged kernel for
// them; fp32 accumulation is always direct. The first, third and fourth take their tiles in bands
// of 3, 2 and 2 row units (MOK_TILE_GROUP; in bands, a warpgroup whose rows are all past its
// group's end computes them anyway), the second row unit by row unit (the default for weights
// this small).
enum { GEMM_MODES = 4 };
static inline void set_gemm_mode(int mode) {
  setenv("MOK_GG_TMA_STORE", mode == 2 ? "0" : "1", 1);
  setenv("MOK_GG_CLUSTER", mode == 0 ? "2" : "1", 1);
  setenv("MOK_GG_STAGES", mode == 3 ? "4" : "3", 1);
  setenv("MOK_TILE_GROUP", mode == 0 ? "3" : mode >= 2 ? "2" : "0", 1);
}
static inline void clear_gemm_mode(void) {
  unsetenv("MOK_GG_TMA_STORE");
  unsetenv("MOK_GG_CLUSTER");
  unsetenv("MOK_GG_STAGES");
  unsetenv("MOK_TILE_GROUP");
}
static inline const char *gemm_mode_name(int mode) {
  return mode == 0 ? "staged+cluster" : mode == 1 ? "staged" : mode == 2 ? "direct" : "staged-4";
}
// Runs p twice, into dc and then dc2 (each [rows, cols] bf16, poisoned with 0xFF bytes first), and
// copies both results into c and c2 for the caller to compare bitwise. Returns 0, or 1 after
// writing why into msg when a launch or the device failed.
static inline int gemm_run_twice(mok_grouped_gemm_params_t *p, uint16_t *dc, uint16_t *dc2,
                                 std::vector<uint16_t> &c, std::vector<uint16_t> &c2, char *msg,
                                 size_t len) {
  const size_t bytes = c.size() * 2;
  cudaMemset(dc, 0xFF, bytes);
  cudaMemset(dc2, 0xFF, bytes);
  p->c = dc;
  const mokResult_t r1 = mok_grouped_gemm_launch(p, NULL);
  p->c = dc2;
  const mokResult_t r2 = mok_grouped_gemm_launch(p, NULL);
  const cudaError_t err = cudaDeviceSynchronize();
  if (r1 != MOK_SUCCESS || r2 != MOK_SUCCESS || err != cudaSuccess) {
    snprintf(msg, len, "launch %d %d, cuda %s", (int)r1, (int)r2, cudaGetErrorString(err));
    return 1;
  }
  cudaMemcpy(c.data(), dc, bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(c2.data(), dc2, bytes, cudaMemcpyDeviceToHost);
  return 0;
}

#define FOR_BOTH_STORE_MODES(body)                                                              \
  do {                                                                                          \
    for (int mode_ = 0; mode_ < GEMM_MODES; mode_++) {                                          \
      set_gemm_mode(mode_);                                                                     \
      body;                                                                                     \
    }                                                                                           \
    clear_gemm_mode();                                                                          \
  } while (0)

#endif /* MOK_TESTS_GPU_GEMM_TEST_UTIL_H */
