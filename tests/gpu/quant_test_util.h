/*
 * quant_test_util.h: helpers of the quantizer tests (test_quantize.cu, test_quantize_launch.cu):
 * the includes, the skip without a GPU, the test file's random stream (each file gets its own),
 * device-to-host copies and the scale kinds. Header-only, static.
 */
#ifndef MOK_TESTS_GPU_QUANT_TEST_UTIL_H
#define MOK_TESTS_GPU_QUANT_TEST_UTIL_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "../support/bf16.h"
#include "../support/compare.h"
#include "../support/gpu.h"
#include "../support/rng.h"
#include "../test.h"
#include "cuda/quant/quant.h"
#include "cuda/quant/quantize.cuh"
#include "api/api.h"
extern "C" {
#include "cpu/quant.h"
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "the quantizer tests target sm_90a (Hopper) and newer"
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Helpers                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

#define QT_SKIP_WITHOUT_GPU()                              \
  do {                                                     \
    if (!test_gpu_present()) MOK_SKIP("no CUDA device");   \
  } while (0)

// This file's random stream: 32 random bits, or uniform in [-1, 1).
static test_rng_t qt_rng = {0x2545F4914F6CDD1Dull, TEST_RNG_XORSHIFT64};
static inline uint32_t qt_u32(void) { return test_rng_u32(&qt_rng); }
static inline float qt_unit(void) { return test_rng_sym_f(&qt_rng); }

template <class T>
static inline bool qt_host(std::vector<T> &h, const T *d) {
  return cudaMemcpy(h.data(), d, h.size() * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess;
}


static const mok_quant_scale_t qt_kinds[3] = {MOK_QUANT_FP32_SCALE, MOK_QUANT_POW2_SCALE,
                                              MOK_QUANT_E8M0_SCALE};

#endif /* MOK_TESTS_GPU_QUANT_TEST_UTIL_H */
