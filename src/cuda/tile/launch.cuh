/*
 * tile/launch.cuh: host side of a persistent kernel's launch (the fused forward's and the fused
 * backward's launchers): its dynamic shared memory set up and the grid of resident CTAs.
 */
#ifndef MOK_CUDA_TILE_LAUNCH_CUH
#define MOK_CUDA_TILE_LAUNCH_CUH

#include <cuda_runtime.h>

#include "cuda/tile/pipeline.cuh"

// *fits = 1 when `smem` bytes of dynamic shared memory next to the kernel's static ones fit a CTA
// of the current device (its opt-in maximum).
static inline cudaError_t tile_smem_fits(const void *kernel, size_t smem, int *fits) {
  int device = 0, optin = 0;
  cudaFuncAttributes fa;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kernel);
  *fits = e == cudaSuccess && smem + fa.sharedSizeBytes <= (size_t)optin;
  return e;
}

// Sets `kernel`'s dynamic shared memory to `smem` bytes and gives in *grid the CTAs of
// MOK_TP_THREADS threads that are resident at once on the current device, or num_sms when that is
// positive and smaller. cudaErrorInvalidConfiguration when not one CTA fits an SM.
static inline cudaError_t tile_persistent_grid(const void *kernel, size_t smem, int num_sms,
                                               int *grid) {
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, MOK_TP_THREADS, smem);
  if (e == cudaSuccess && per_sm < 1) e = cudaErrorInvalidConfiguration;
  if (e == cudaSuccess) {
    const int resident = sms * per_sm;
    *grid = num_sms > 0 && num_sms < resident ? num_sms : resident;
  }
  return e;
}

#endif /* MOK_CUDA_TILE_LAUNCH_CUH */
