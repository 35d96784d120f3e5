/*
 * gemm_test_util.h: helpers of the grouped-GEMM tests (test_gemm.cu, test_gemm_fp8.cu,
 * test_gemm_wgrad.cu) on top of tests/support: the test file's random stream, ragged problems,
 * launcher parameters, and the tile-band settings every case runs with. Header-only, static: each
 * test file gets its own copy (and its own stream).
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

#include "../support/bf16.h"
#include "../support/gpu.h"
#include "../support/rng.h"
#include "../test.h"
#include "cuda/gemm/gemm.h"

// This file's random stream (every draw of a test file comes from it, in test order).
static test_rng_t g_rng = {0x9E3779B97F4A7C15ull, TEST_RNG_XORSHIFT64};
static inline float rnd_unit(void) { return test_rng_sym_f(&g_rng); }  // uniform in [-1, 1)
static inline void fill_bf16(std::vector<uint16_t> &v, float scale) {
  bf16_fill(v.data(), v.size(), scale, &g_rng);
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

// The row tiles per band of the tile order (mok_grouped_gemm_params_t.group_m) every case runs
// with: 0 (by the size of B against the L2: no bands for weights this small), -1 (none), 2 and 3
// (in bands, a warpgroup whose rows are all past its group's end computes them anyway and stores
// none). The kernel does not depend on it: bf16 and fp32 stores and SwiGLU take the staged
// (TMA-store) kernel, fp32 accumulation the direct one.
static const int gemm_group_ms[] = {0, -1, 2, 3};
enum { GEMM_GROUP_MS = sizeof(gemm_group_ms) / sizeof(gemm_group_ms[0]) };

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

#endif /* MOK_TESTS_GPU_GEMM_TEST_UTIL_H */
