/* cuda_host.c: the few CUDA runtime queries the host library makes (device count, where a pointer
 * lives). Without a CUDA build they report that no device exists. */
#include "api/api.h"

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

mokResult_t mok_cuda_device_count(int *count) {
  *count = 0;
  cudaError_t e = cudaGetDeviceCount(count);
  if (e != cudaSuccess) {
    *count = 0;
    cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
    return mok_fail(NULL, MOK_ERROR_NO_DEVICE, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
  }
  return MOK_SUCCESS;
}

int mok_cuda_ptr_on_device(const void *p, int device) {
  struct cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (attr.type == cudaMemoryTypeManaged) return 1;
  return attr.type == cudaMemoryTypeDevice && attr.device == device;
}

#else

mokResult_t mok_cuda_device_count(int *count) {
  *count = 0;
  return mok_fail(NULL, MOK_ERROR_NO_DEVICE, "this build of MoK has no CUDA support");
}

int mok_cuda_ptr_on_device(const void *p, int device) {
  (void)p;
  (void)device;
  return 0;
}

#endif
