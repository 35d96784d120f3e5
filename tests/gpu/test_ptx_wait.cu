/*
 * test_ptx_wait.cu: a bounded mbarrier wait that never completes (a lost arrival) ends the kernel
 * instead of trapping (src/cuda/ptx/ptx.cuh): the wait records itself in its unit's fault word
 * and returns, later waits return at once, the CUDA context stays usable, and the host reads the
 * fault once (ptx_fault_take). This unit's waits time out after 50 ms instead of 20 s.
 */
#define MOK_PTX_WAIT_TIMEOUT_NS 50000000ull
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/ptx/ptx.cuh"
#include "../support/gpu.h"
#include "../test.h"

// Thread 0 of each block waits on a barrier nobody arrives at, `waits` times; done[b] counts the
// waits that returned.
__global__ void lost_arrival_kernel(int waits, int *done) {
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    ptx_mbar_init(&bar, 1);
    ptx_fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 0; i < waits; i++) {
      ptx_mbar_wait(&bar, 0);
      atomicAdd(&done[blockIdx.x], 1);
    }
  }
}

MOK_TEST(ptx_wait_timeout_ends_the_kernel_without_trapping) {
  if (!test_gpu_present()) MOK_SKIP("no GPU");
  mok_kernel_fault_t f;
  ptx_fault_take(&f);  // start clean
  int *done = NULL;
  MOK_REQUIRE(cudaMalloc(&done, 4 * sizeof(int)) == cudaSuccess);
  cudaMemset(done, 0, 4 * sizeof(int));
  lost_arrival_kernel<<<4, 64>>>(3, done);
  MOK_EXPECT_MSG(cudaDeviceSynchronize() == cudaSuccess, "the kernel trapped: %s",
                 cudaGetErrorString(cudaGetLastError()));
  int h[4] = {0, 0, 0, 0};
  MOK_EXPECT(cudaMemcpy(h, done, sizeof(h), cudaMemcpyDeviceToHost) == cudaSuccess);
  for (int b = 0; b < 4; b++) MOK_EXPECT_MSG(h[b] == 3, "block %d: %d of 3 waits returned", b, h[b]);
  MOK_EXPECT(ptx_fault_take(&f) == 1);
  MOK_EXPECT(f.code == 1);
  MOK_EXPECT_MSG(f.parity == 0, "parity %u", f.parity);
  MOK_EXPECT(ptx_fault_take(&f) == 0);  // taken: cleared
  // The context is still usable: a plain kernel and a copy run.
  cudaMemset(done, 0, 4 * sizeof(int));
  lost_arrival_kernel<<<1, 32>>>(0, done);
  MOK_EXPECT(cudaDeviceSynchronize() == cudaSuccess);
  cudaFree(done);
}
