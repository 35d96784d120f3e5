/*
 * ptx.cuh: thin wrappers over the Hopper (sm_90a) PTX the tile engine uses, one instruction each:
 * mbarriers, bulk tensor copies (TMA) and their tensor-map prefetch, fences (including the proxy
 * fence between ordinary shared-memory stores and async-proxy reads), setmaxnreg, and wgmma for
 * bf16 and e4m3 with operands in 128-byte-swizzled shared memory.
 *
 * Nothing here knows about tiles or groups; tile/pipeline.cuh composes these into a ring.
 * Every function is device-only; the file compiles (to nothing) for other architectures so that
 * a host pass of nvcc can read it.
 */
#ifndef MOK_CUDA_PTX_CUH
#define MOK_CUDA_PTX_CUH

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/status.h"

/* ---------------------------------------------------------------------------------------------- */
/* Addresses and fences                                                                            */
/* ---------------------------------------------------------------------------------------------- */

__device__ __forceinline__ uint32_t ptx_smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// NOTE: ordinary stores to shared memory that the copy engine or the tensor cores read next need
// this fence in each writing thread before the barrier that publishes them.
__device__ __forceinline__ void ptx_fence_proxy_async_smem(void) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Makes mbarrier.init visible to the async proxy (TMA completes transactions on the barrier).
__device__ __forceinline__ void ptx_fence_mbarrier_init(void) {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ uint32_t ptx_cluster_ctarank(void) {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Barrier over every thread of every CTA in the cluster (release/acquire: shared-memory writes and
// barrier inits before it are visible to the cluster after it). All threads must execute it.
__device__ __forceinline__ void ptx_cluster_sync(void) {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}

__device__ __forceinline__ uint64_t ptx_globaltimer_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* ---------------------------------------------------------------------------------------------- */
/* mbarriers (64-bit, in shared memory, CTA scope)                                                 */
/* ---------------------------------------------------------------------------------------------- */

__device__ __forceinline__ void ptx_mbar_init(uint64_t *bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(ptx_smem_addr(bar)), "r"(arrivals)
               : "memory");
}

// A 16-byte store to shared memory at a shared-window address (ptx_smem_addr), for a thread short
// of registers: the address stays 32 bits (a generic pointer takes two).
__device__ __forceinline__ void ptx_st_shared_v4(uint32_t addr, int4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// A 4-byte load from shared memory at a shared-window address. NOTE: volatile, with a memory
// clobber: the same address holds new data every round of a ring, so the load must stay after the
// barrier wait that announces it.
__device__ __forceinline__ float ptx_ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// A 16-byte load from shared memory at a shared-window address (volatile, as ptx_ld_shared_f32).
__device__ __forceinline__ uint4 ptx_ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Barriers are named by their shared-memory address (ptx_smem_addr) in the *_at forms: hot loops
// compute it once, since converting a generic pointer costs several instructions at every use.
__device__ __forceinline__ void ptx_mbar_arrive_at(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void ptx_mbar_arrive(uint64_t *bar) {
  ptx_mbar_arrive_at(ptx_smem_addr(bar));
}
// `count` arrivals at once (one thread arriving for several).
__device__ __forceinline__ void ptx_mbar_arrive_count(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(ptx_smem_addr(bar)),
               "r"(count)
               : "memory");
}

// One arrival on the barrier at the same offset in CTA `cta` of the cluster (possibly this one).
// NOTE: default (CTA-scope) release semantics on purpose: it orders nothing but this thread's
// completed wgmma reads of the stage, and a cluster-scope release compiles to MEMBAR.ALL.GPU, which
// waits for every outstanding memory access of the thread (measured: the 2-CTA pipeline ran 1.6x
// slower than without clusters).
__device__ __forceinline__ void ptx_mbar_arrive_cluster(uint64_t *bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(
          ptx_smem_addr(bar)),
      "r"(cta)
      : "memory");
}

// One arrival that also announces `bytes` of transactions the copy engine will complete.
__device__ __forceinline__ void ptx_mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(ptx_smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ int ptx_mbar_try_wait_at(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return (int)ok;
}

// Waits until the phase with the given parity has completed. Bounded: a pipeline that makes no
// progress for MOK_PTX_WAIT_TIMEOUT_NS is a bug (a lost arrival or a bad tensor map). It does not
// trap, which would end the process's CUDA context: the first wait to time out records itself in
// its translation unit's fault word (ptx_fault, once) and returns as if the phase had completed;
// every later wait of that unit's kernels that has to spin finds the word set and returns at
// once, so each kernel runs to its end, with wrong results, instead of hanging. The unit's
// launcher reads the word on the host (ptx_fault_take) for mok_layer_check, which reports
// MOK_ERROR_TIMEOUT with the SM, the barrier and the parity.
#ifndef MOK_PTX_WAIT_TIMEOUT_NS
#define MOK_PTX_WAIT_TIMEOUT_NS 20000000000ull  // 20 s
#endif
static __device__ mok_kernel_fault_t ptx_fault;  // one per translation unit (no relocatable
                                                  // device code; src/common/status.h)

// The slow path of the waits below: 1 once the phase completed, 0 after a timeout (this wait's,
// recorded, or an earlier one's).
__device__ __forceinline__ int ptx_mbar_spin_at(uint32_t bar, uint32_t parity) {
  const uint64_t t0 = ptx_globaltimer_ns();
  while (!ptx_mbar_try_wait_at(bar, parity)) {
    if (*(volatile uint32_t *)&ptx_fault.code) return 0;
    if (ptx_globaltimer_ns() - t0 > MOK_PTX_WAIT_TIMEOUT_NS) {
      if (atomicCAS(&ptx_fault.code, 0u, 2u) == 0u) {  // 2: claimed, being written
        uint32_t sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        volatile mok_kernel_fault_t *f = &ptx_fault;
        f->sm = sm;
        f->bar = bar;
        f->parity = parity;
        __threadfence();
        f->code = 1u;
      }
      return 0;
    }
  }
  return 1;
}
__device__ __forceinline__ void ptx_mbar_wait_at(uint32_t bar, uint32_t parity) {
  if (ptx_mbar_try_wait_at(bar, parity)) return;
  ptx_mbar_spin_at(bar, parity);
}
// The same wait, returning 0 after a timeout (1 once the phase completed), for a caller that ends
// its loop on it (grouped_gemm.cu's gg_peek).
__device__ __forceinline__ int ptx_mbar_wait_bounded_at(uint32_t bar, uint32_t parity) {
  if (ptx_mbar_try_wait_at(bar, parity)) return 1;
  return ptx_mbar_spin_at(bar, parity);
}
__device__ __forceinline__ void ptx_mbar_wait(uint64_t *bar, uint32_t parity) {
  ptx_mbar_wait_at(ptx_smem_addr(bar), parity);
}

/* ---------------------------------------------------------------------------------------------- */
/* Bulk tensor copies (TMA)                                                                        */
/* ---------------------------------------------------------------------------------------------- */

// The tensor map must live in param, const or global memory (a __grid_constant__ kernel parameter).
// Same, multicast: the box lands at the same shared-memory offset in every CTA of the cluster
// whose bit is set in cta_mask, and completes its bytes on the barrier at the same offset in each.
__device__ __forceinline__ void ptx_tma_load_2d_multicast(void *dst, const CUtensorMap *map,
                                                          uint64_t *bar, int32_t c0, int32_t c1,
                                                          uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(ptx_smem_addr(dst)),
      "l"((uint64_t)map), "r"(ptx_smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ void ptx_prefetch_tensormap(const CUtensorMap *map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)map) : "memory");
}

// Box at coordinates (c0 innermost, c1) of a 2D map into shared memory; completes `box bytes` of
// transactions on `bar`. Out-of-bounds elements of the box are filled with zeros (and still count).
__device__ __forceinline__ void ptx_tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                                int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(ptx_smem_addr(dst)),
      "l"((uint64_t)map), "r"(ptx_smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// Shared memory box to global at (c0, c1); elements outside the tensor are not written.
__device__ __forceinline__ void ptx_tma_store_2d(const CUtensorMap *map, const void *src, int32_t c0,
                                                 int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   (uint64_t)map),
               "r"(ptx_smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void ptx_bulk_commit_group(void) {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N committed bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void ptx_bulk_wait_group_read(void) {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until at most N committed bulk groups (the most recent ones) are still pending: all
// older groups have completed (their global writes are performed).
template <int N>
__device__ __forceinline__ void ptx_bulk_wait_group(void) {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ptx_bulk_wait_group_all(void) { ptx_bulk_wait_group<0>(); }

// Barrier over `threads` threads (a multiple of 32) on hardware barrier `id` (1..15; 0 is
// __syncthreads): lets one warpgroup synchronize without stopping the others.
__device__ __forceinline__ void ptx_named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Counts this thread's warp towards barrier `id` of `threads` threads without waiting: the other
// side of a bar.sync, for one group of warps signalling another.
__device__ __forceinline__ void ptx_named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* ---------------------------------------------------------------------------------------------- */
/* cp.async (16-byte copies into shared memory) and counters in global memory                       */
/* ---------------------------------------------------------------------------------------------- */

// 16 bytes global -> shared, asynchronous; src_bytes = 0 reads nothing and writes zeros.
__device__ __forceinline__ void ptx_cp_async_16(void *dst, const void *src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(ptx_smem_addr(dst)),
               "l"(src), "r"(src_bytes)
               : "memory");
}

// An arrival on `bar` once this thread's earlier cp.async copies have landed. .noinc: it counts as
// one of the arrivals the barrier was initialized with.
__device__ __forceinline__ void ptx_cp_async_mbar_arrive_noinc(uint64_t *bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(ptx_smem_addr(bar))
               : "memory");
}

// GPU-scope acquire load and release add of a 32-bit counter in global memory.
__device__ __forceinline__ uint32_t ptx_ld_acquire_gpu(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void ptx_red_release_gpu_add(uint32_t *p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// System-scope (other GPUs) acquire load, release store and release add of a 64-bit flag or
// counter, which may live in a peer's memory mapped here.
__device__ __forceinline__ uint64_t ptx_ld_acquire_sys_u64(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void ptx_st_release_sys_u64(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void ptx_red_release_sys_add_u64(uint64_t *p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Orders this thread's view of global memory (generic proxy) before its later TMA reads (async
// proxy): data another SM stored with ordinary stores and published with a release, observed here
// with an acquire, is then what the TMA unit reads.
__device__ __forceinline__ void ptx_fence_proxy_async_global(void) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* ---------------------------------------------------------------------------------------------- */
/* Register reallocation between warpgroups                                                        */
/* ---------------------------------------------------------------------------------------------- */

// Takes effect only with a register cap at entry (__launch_bounds__(threads, 1)); every warp of
// the warpgroup must execute it.
template <int REGS>
__device__ __forceinline__ void ptx_setmaxnreg_inc(void) {
  static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void ptx_setmaxnreg_dec(void) {
  static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

/* ---------------------------------------------------------------------------------------------- */
/* wgmma                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

// Shared-memory matrix descriptor for a K-major operand tile stored as rows of 128 bytes with the
// 128-byte swizzle (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and a 128-byte inner box):
// 8-row core groups 1024 bytes apart (stride byte offset), leading byte offset unused, layout
// type 1 = SWIZZLE_128B in bits 62-63. The tile base must be 1024-byte aligned; stepping along K
// inside the 128-byte row is done by adding (bytes >> 4) to the start address.
__device__ __forceinline__ uint64_t ptx_desc_kmajor_sw128(const void *tile) {
  uint64_t addr = ptx_smem_addr(tile);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFFull) >> 4;           // bits  0-13: start address >> 4
  desc |= (uint64_t)1 << 16;                  // bits 16-29: leading byte offset (unused here)
  desc |= (uint64_t)(1024 >> 4) << 32;        // bits 32-45: stride byte offset >> 4
  desc |= (uint64_t)1 << 62;                  // bits 62-63: 128-byte swizzle
  return desc;
}

// The high word of every ptx_desc_kmajor_sw128 descriptor (stride byte offset and swizzle mode):
// loops that keep only the low word (the start address) in a register add it back at the issue.
__device__ __forceinline__ uint64_t ptx_desc_kmajor_sw128_hi(void) {
  return ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// Descriptor for an MN-major bf16 operand tile stored as chunks of 64 MN-elements: each chunk is
// [k rows][128 bytes] with the 128-byte swizzle (TMA box [k, 64] of a [K, MN] row-major tensor).
// Swizzle atoms are 8 k-rows x 64 MN-elements (1024 bytes): stride byte offset = 1024 between
// atoms along K, leading byte offset = chunk_bytes between atoms along MN. One k16 step is two
// atoms: add (2048 >> 4) to the start address. Serves the B operand of the data-gradient GEMM and
// both operands of the weight-gradient GEMM (an m64 A tile is one atom wide: LBO unused).
__device__ __forceinline__ uint64_t ptx_desc_mnmajor_sw128(const void *tile, uint32_t chunk_bytes) {
  uint64_t addr = ptx_smem_addr(tile);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFFull) >> 4;                          // bits  0-13: start address >> 4
  desc |= (uint64_t)((chunk_bytes >> 4) & 0x3FFF) << 16;     // bits 16-29: leading byte offset
  desc |= (uint64_t)(1024 >> 4) << 32;                       // bits 32-45: stride byte offset
  desc |= (uint64_t)1 << 62;                                 // bits 62-63: 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void ptx_wgmma_fence(void) {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void ptx_wgmma_commit_group(void) {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void ptx_wgmma_wait_group(void) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across wgmma fences and waits.
__device__ __forceinline__ void ptx_fence_operand(float &r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64, 256] (+)= A[64, 16] * B[256, 16]^T, bf16 operands from shared memory, fp32 accumulators.
// TRANS_B = 0: B tile K-major ([N][K] rows); 1: B tile MN-major ([K][N] rows), bf16 only.
// TRANS_A likewise for A: 0 = K-major ([M][K] rows), 1 = MN-major ([K][M] rows, the weight-gradient
// GEMM, whose reduction runs over the outer dimension of both operands).
template <int TRANS_B, int TRANS_A = 0>
__device__ __forceinline__ void ptx_wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a,
                                                          uint64_t desc_b, int scale_d) {
  static_assert(TRANS_B == 0 || TRANS_B == 1, "transpose flag");
  static_assert(TRANS_A == 0 || TRANS_A == 1, "transpose flag");
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, %132, %131;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B), "n"(TRANS_A));
}

// D[64, 128] (+)= A[64, 32] * B[128, 32]^T, e4m3 operands from shared memory, fp32 accumulators.
__device__ __forceinline__ void ptx_wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                     int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

/* ---------------------------------------------------------------------------------------------- */
/* The fault word on the host                                                                      */
/* ---------------------------------------------------------------------------------------------- */

// Host: this translation unit's fault word (ptx_mbar_spin_at), cleared once read. 1 with *out
// filled when a wait timed out since the last call, 0 when none did (or the read failed). The
// caller has synchronized with the kernels it asks about.
static inline int ptx_fault_take(mok_kernel_fault_t *out) {
  mok_kernel_fault_t f;
  if (cudaMemcpyFromSymbol(&f, ptx_fault, sizeof(f)) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (f.code == 0) return 0;
  const mok_kernel_fault_t zero = {0, 0, 0, 0};
  cudaMemcpyToSymbol(ptx_fault, &zero, sizeof(zero));
  *out = f;
  return 1;
}

#endif /* MOK_CUDA_PTX_CUH */
