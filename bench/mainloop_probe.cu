/*
 * bench/mainloop_probe.cu: loop-only ceilings of the MXFP8 mainloop designs on one H200 (no loads
 * from global memory, no epilogue): operands sit in shared memory, every CTA of the grid runs the
 * same reduction. A probe for docs/performance.md ("MXFP8 layers: the mainloop's ceiling"), not a
 * library kernel.
 *
 *   bf16        128 x 256 tile, m64n256k16 bf16 wgmmas, one group in flight (the bf16 GEMM's loop)
 *   conv-cons   the same, each 64-element stage's B first converted from e4m3 with its E8M0 scale
 *               by the two consumer warpgroups (today's MXFP8-B GEMM)
 *   conv-prod   the same, the conversion by warps 1-3 of the producer warpgroup, a ring of 3
 *               stages between them and the consumers (mbarriers)
 *   fp8         128 x 128 tile, m64n128k32 e4m3 wgmmas into one accumulator (no promotion)
 *   fp8-128     the fp8-block loop: two part sets, a promotion with one scale per row every 128
 *   mx32-fmul   fp8 wgmmas promoted every 32 reduction elements with sa(row) * sb(column) per
 *               element: an FMUL and an FFMA per accumulator (MXFP8 on fp8 tensor cores)
 *   mx32-iadd   the same with the power-of-two scale product as an integer add of exponents
 *
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/mainloop_probe.cu \
 *        -o build/mainloop_probe -lcuda && build/mainloop_probe
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/ptx/ptx.cuh"

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));          \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

enum { STAGES = 3, A_BYTES = 128 * 128, B_BYTES = 256 * 128, STAGE = A_BYTES + B_BYTES,
       SLOT = 256 * 64, SMEM = STAGES * STAGE + STAGES * SLOT + 8192 + 1024 };

// Valid operand bytes: bf16 with exponents near 1 (no inf/NaN), e4m3 without NaN.
__device__ void fill(uint8_t *s, int bytes, int e4m3) {
  for (int i = threadIdx.x * 4; i < bytes; i += blockDim.x * 4) {
    uint32_t h = (uint32_t)i * 2654435761u ^ 0x9E3779B9u;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    uint32_t v = e4m3 ? (h & 0x77777777u) : ((h & 0x807F807Fu) | 0x3F003F00u);
    *(uint32_t *)(s + i) = v;
  }
}

__device__ __forceinline__ uint32_t e4m3x2_bf16x2(uint32_t two, float s) {
  uint32_t h, r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((uint16_t)two));
  const float lo = __half2float(__ushort_as_half((uint16_t)h)) * s;
  const float hi = __half2float(__ushort_as_half((uint16_t)(h >> 16))) * s;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// 16 e4m3 of row r, chunk c (of 4) -> two 16-byte units of the swizzled bf16 row.
__device__ __forceinline__ void convert_chunk(uint32_t slot, uint32_t brow, int r, int c,
                                              float sc) {
  const uint4 w = ptx_ld_shared_v4(slot + r * 64 + 16 * c);
  const uint32_t in[4] = {w.x, w.y, w.z, w.w};
  uint32_t o[8];
#pragma unroll
  for (int j = 0; j < 4; j++) {
    o[2 * j] = e4m3x2_bf16x2(in[j] & 0xFFFFu, sc);
    o[2 * j + 1] = e4m3x2_bf16x2(in[j] >> 16, sc);
  }
  const int x = r & 7;
  const uint32_t row = brow + r * 128;
  ptx_st_shared_v4(row + 16 * ((2 * c) ^ x), make_int4(o[0], o[1], o[2], o[3]));
  ptx_st_shared_v4(row + 16 * ((2 * c + 1) ^ x), make_int4(o[4], o[5], o[6], o[7]));
}

template <int V>  // 0 bf16, 1 conv-cons, 2 conv-prod
__global__ void __launch_bounds__(384, 1) bf16_loop(int iters, const uint8_t *scales, float *out) {
  extern __shared__ uint8_t raw[];
  uint8_t *smem = (uint8_t *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
  uint64_t *full = (uint64_t *)(smem + STAGES * STAGE + STAGES * SLOT);
  uint64_t *empty = full + STAGES;
  fill(smem, STAGES * STAGE, 0);
  fill(smem + STAGES * STAGE, STAGES * SLOT, 1);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; s++) ptx_mbar_init(&full[s], 96), ptx_mbar_init(&empty[s], 8);
    ptx_fence_mbarrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, lt = threadIdx.x & 127;
  const uint32_t slot0 = ptx_smem_addr(smem + STAGES * STAGE);
  if (wg == 0) {
    ptx_setmaxnreg_dec<40>();
    if (V != 2 || threadIdx.x < 32) return;
    const int t = threadIdx.x - 32;  // 96 converters: chunks t, t + 96, ... of 1024
    uint32_t phase = 0;
    for (int it = 0; it < iters; it++) {
      const int st = it % STAGES;
      ptx_mbar_wait(&empty[st], phase ^ 1u);
      const uint32_t brow = ptx_smem_addr(smem + st * STAGE + A_BYTES);
      for (int q = t; q < 1024; q += 96) {
        const int r = q >> 2, c = q & 3;
        const float sc = __uint_as_float((uint32_t)__ldg(scales + r * 64 + (it & 31)) << 23);
        convert_chunk(slot0 + st * SLOT, brow, r, c, sc);
      }
      ptx_fence_proxy_async_smem();
      ptx_mbar_arrive(&full[st]);
      if (st == STAGES - 1) phase ^= 1u;
    }
    return;
  }
  ptx_setmaxnreg_inc<232>();
  const int cw = wg - 1, lane = threadIdx.x & 31;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; i++) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 128; i++) ptx_fence_operand(acc[i]);
  const uint64_t hi = ptx_desc_kmajor_sw128_hi();
  const uint32_t da0 = (uint32_t)ptx_desc_kmajor_sw128(smem + cw * 64 * 128);
  const uint32_t db0 = (uint32_t)ptx_desc_kmajor_sw128(smem + A_BYTES);
  uint32_t phase = 0;
  int prev = -1;
  for (int it = 0; it < iters; it++) {
    const int st = it % STAGES;
    if (V == 2) ptx_mbar_wait(&full[st], phase);
    if (V == 1) {  // this thread's 4 chunks: rows 128 cw + lt / 4 + 32 i, chunk lt % 4
      const uint32_t brow = ptx_smem_addr(smem + st * STAGE + A_BYTES);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int r = 128 * cw + (lt >> 2) + 32 * i;
        const float sc = __uint_as_float((uint32_t)__ldg(scales + r * 64 + (it & 31)) << 23);
        convert_chunk(slot0 + st * SLOT, brow, r, lt & 3, sc);
      }
      ptx_fence_proxy_async_smem();
      ptx_named_barrier_sync(4, 256);
    }
    const uint32_t off = st * (STAGE >> 4);
    ptx_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
      ptx_wgmma_m64n256k16_bf16<0>(acc, hi | (da0 + off + 2 * kk), hi | (db0 + off + 2 * kk), 1);
    ptx_wgmma_commit_group();
    ptx_wgmma_wait_group<1>();
    if (V == 2 && prev >= 0 && lane == 0) ptx_mbar_arrive(&empty[prev]);
    prev = st;
    if (st == STAGES - 1) phase ^= 1u;
  }
  ptx_wgmma_wait_group<0>();
#pragma unroll
  for (int i = 0; i < 128; i++) ptx_fence_operand(acc[i]);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 128; i++) s += acc[i];
  if (V == 2 && lane == 0 && prev >= 0) ptx_mbar_arrive(&empty[prev]);
  out[blockIdx.x * 256 + threadIdx.x - 128] = s;
}

__device__ __forceinline__ void issue_k32(float (&d)[64], uint32_t da, uint32_t db, int acc) {
  const uint64_t hi = ptx_desc_kmajor_sw128_hi();
#pragma unroll
  for (int i = 0; i < 64; i++) ptx_fence_operand(d[i]);
  ptx_wgmma_fence();
  ptx_wgmma_m64n128k32_e4m3(d, hi | da, hi | db, acc);
  ptx_wgmma_commit_group();
}

// total += part * sa(row) * sb(column), fragment element 4j + e: column 8j + 2(lane % 4) + e % 2,
// row +8 when e >= 2. sa: this thread's two rows' scales; sbt: the block's 128 column scales.
template <int IADD>
__device__ __forceinline__ void promote32(float (&total)[64], float (&part)[64], float sa0,
                                          float sa1, uint32_t sbt) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < 64; i++) ptx_fence_operand(part[i]);
#pragma unroll
  for (int j = 0; j < 16; j++) {
    uint32_t b0, b1;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                 : "=r"(b0), "=r"(b1)
                 : "r"(sbt + 4 * (8 * j + 2 * (lane & 3))));
    float s00, s01, s10, s11;
    if (IADD) {  // exponent bits: sa as (ea + 127) << 23, sb as eb << 23
      s00 = __uint_as_float(__float_as_uint(sa0) + b0);
      s01 = __uint_as_float(__float_as_uint(sa0) + b1);
      s10 = __uint_as_float(__float_as_uint(sa1) + b0);
      s11 = __uint_as_float(__float_as_uint(sa1) + b1);
    } else {
      s00 = sa0 * __uint_as_float(b0);
      s01 = sa0 * __uint_as_float(b1);
      s10 = sa1 * __uint_as_float(b0);
      s11 = sa1 * __uint_as_float(b1);
    }
    total[4 * j] = fmaf(part[4 * j], s00, total[4 * j]);
    total[4 * j + 1] = fmaf(part[4 * j + 1], s01, total[4 * j + 1]);
    total[4 * j + 2] = fmaf(part[4 * j + 2], s10, total[4 * j + 2]);
    total[4 * j + 3] = fmaf(part[4 * j + 3], s11, total[4 * j + 3]);
  }
}

// Issue block `blk`'s 128-element reduction into nxt (4 k32 wgmmas, one group).
__device__ __forceinline__ void issue128(float (&nxt)[64], uint32_t da, uint32_t db) {
  const uint64_t hi = ptx_desc_kmajor_sw128_hi();
#pragma unroll
  for (int i = 0; i < 64; i++) ptx_fence_operand(nxt[i]);
  ptx_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; kk++)
    ptx_wgmma_m64n128k32_e4m3(nxt, hi | (da + 2 * kk), hi | (db + 2 * kk), kk != 0);
  ptx_wgmma_commit_group();
}

// fp8-block step: issue the next block into nxt, retire cur with one scale per row.
__device__ __forceinline__ void step128(float (&nxt)[64], float (&cur)[64], float (&total)[64],
                                        uint32_t da, uint32_t db, uint32_t sat, int row0,
                                        int it) {
  issue128(nxt, da, db);
  const float s0 = ptx_ld_shared_f32(sat + 4 * ((it & 15) * 128 + row0));
  const float s1 = ptx_ld_shared_f32(sat + 4 * ((it & 15) * 128 + row0 + 8));
  ptx_wgmma_wait_group<1>();
#pragma unroll
  for (int i = 0; i < 64; i++) ptx_fence_operand(cur[i]);
#pragma unroll
  for (int j = 0; j < 16; j++) {
    total[4 * j] += cur[4 * j] * s0;
    total[4 * j + 1] += cur[4 * j + 1] * s0;
    total[4 * j + 2] += cur[4 * j + 2] * s1;
    total[4 * j + 3] += cur[4 * j + 3] * s1;
  }
}

// MXFP8 step `it` (k32 steps): issue step it into nxt, retire step it - 1 (cur) with
// per-element scales.
template <int IADD>
__device__ __forceinline__ void step32(float (&nxt)[64], float (&cur)[64], float (&total)[64],
                                       uint32_t da0, uint32_t db0, uint32_t sat, uint32_t sbt,
                                       int row0, int it) {
  const uint32_t off = ((it >> 2) & 3) * (32768 >> 4) + 2 * (it & 3);
  issue_k32(nxt, da0 + off, db0 + off, 0);
  const int blk = (it - 1) & 15;
  const float a0 = ptx_ld_shared_f32(sat + 4 * (blk * 128 + row0));
  const float a1 = ptx_ld_shared_f32(sat + 4 * (blk * 128 + row0 + 8));
  ptx_wgmma_wait_group<1>();
  promote32<IADD>(total, cur, a0, a1, sbt + 512 * blk);
}

template <int V>  // 0 fp8, 1 fp8-128, 2 mx32-fmul, 3 mx32-iadd
__global__ void __launch_bounds__(256, 1) fp8_loop(int iters, float *out) {
  extern __shared__ uint8_t raw[];
  uint8_t *smem = (uint8_t *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
  // 4 blocks of A [128, 128 B] and B [128, 128 B] e4m3, then the scale tables
  fill(smem, 4 * 32768, 1);
  float *sbt = (float *)(smem + 4 * 32768);      // [16 k32 blocks][128 columns]
  float *sat = sbt + 16 * 128;                   // [16 k32 blocks][128 rows]
  for (int i = threadIdx.x; i < 16 * 256; i += blockDim.x) {
    const int e = (int)((i * 2654435761u) >> 29) - 4;  // exponents -4..3
    sbt[i] = V == 3 ? __uint_as_float((uint32_t)(e & 0x1FF) << 23)
                    : ldexpf(1.0f, e);
  }
  for (int i = threadIdx.x; i < 16 * 128; i += blockDim.x) {
    const int e = (int)((i * 40503u) >> 13) % 7 - 3;
    sat[i] = V == 3 ? __uint_as_float((uint32_t)(e + 127) << 23) : ldexpf(1.0f, e);
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int row0 = 64 * wg + 16 * warp + (lane >> 2);
  const uint32_t da0 = (uint32_t)ptx_desc_kmajor_sw128(smem + wg * 64 * 128);
  const uint32_t db0 = (uint32_t)ptx_desc_kmajor_sw128(smem + A_BYTES);
  const uint32_t sb0 = ptx_smem_addr(sbt), sa0a = ptx_smem_addr(sat);
  float total[64], pa[64], pb[64];
#pragma unroll
  for (int i = 0; i < 64; i++) total[i] = 0.0f;
  if (V == 0) {
    for (int it = 0; it < iters; it++) {
      const uint32_t off = (it & 3) * (32768 >> 4);
#pragma unroll
      for (int kk = 0; kk < 4; kk++) {
#pragma unroll
        for (int i = 0; i < 64; i++) ptx_fence_operand(total[i]);
        ptx_wgmma_fence();
        ptx_wgmma_m64n128k32_e4m3(total, ptx_desc_kmajor_sw128_hi() | (da0 + off + 2 * kk),
                                  ptx_desc_kmajor_sw128_hi() | (db0 + off + 2 * kk), 1);
      }
      ptx_wgmma_commit_group();
      ptx_wgmma_wait_group<1>();
    }
  } else if (V == 1) {  // the library's order: block 0 into pa, then pairs of steps
    issue128(pa, da0, db0);
    for (int it = 1; it + 1 < iters; it += 2) {
      step128(pb, pa, total, da0 + (it & 3) * (32768 >> 4), db0 + (it & 3) * (32768 >> 4),
              sa0a, row0, it);
      step128(pa, pb, total, da0 + ((it + 1) & 3) * (32768 >> 4),
              db0 + ((it + 1) & 3) * (32768 >> 4), sa0a, row0, it + 1);
    }
  } else {  // one k32 wgmma per step into alternating part sets, the other set retired
    issue_k32(pa, da0, db0, 0);
    for (int it = 1; it + 1 < 4 * iters; it += 2) {
      step32<V == 3>(pb, pa, total, da0, db0, sa0a, sb0, row0, it);
      step32<V == 3>(pa, pb, total, da0, db0, sa0a, sb0, row0, it + 1);
    }
  }
  ptx_wgmma_wait_group<0>();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; i++) s += total[i];
  out[blockIdx.x * 256 + threadIdx.x] = s;
}

typedef struct {
  const char *name;
  void (*launch)(int grid, int iters, const uint8_t *sc, float *out);
  double flop_per_iter;  // per CTA
} variant_t;

template <int V> static void launch_bf16(int g, int it, const uint8_t *sc, float *o) {
  bf16_loop<V><<<g, 384, SMEM>>>(it, sc, o);
}
template <int V> static void launch_fp8(int g, int it, const uint8_t *sc, float *o) {
  (void)sc;
  fp8_loop<V><<<g, 256, SMEM>>>(it, o);
}

int main(int argc, char **argv) {
  int dev_sms = 0;
  CK(cudaDeviceGetAttribute(&dev_sms, cudaDevAttrMultiProcessorCount, 0));
  const int grid = argc > 1 ? atoi(argv[1]) : dev_sms, rounds = argc > 2 ? atoi(argv[2]) : 5;
  const int iters = 8192;  // stages (bf16: 64 K) or blocks (fp8: 128 K) per CTA
  variant_t v[] = {
      {"bf16", launch_bf16<0>, 2.0 * 128 * 256 * 64},
      {"conv-cons", launch_bf16<1>, 2.0 * 128 * 256 * 64},
      {"conv-prod", launch_bf16<2>, 2.0 * 128 * 256 * 64},
      {"fp8", launch_fp8<0>, 2.0 * 128 * 128 * 128},
      {"fp8-128", launch_fp8<1>, 2.0 * 128 * 128 * 128},
      {"mx32-fmul", launch_fp8<2>, 2.0 * 128 * 128 * 128},
      {"mx32-iadd", launch_fp8<3>, 2.0 * 128 * 128 * 128},
  };
  const int nv = sizeof v / sizeof v[0];
  CK(cudaFuncSetAttribute(bf16_loop<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  CK(cudaFuncSetAttribute(bf16_loop<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  CK(cudaFuncSetAttribute(bf16_loop<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  CK(cudaFuncSetAttribute(fp8_loop<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  CK(cudaFuncSetAttribute(fp8_loop<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  CK(cudaFuncSetAttribute(fp8_loop<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  CK(cudaFuncSetAttribute(fp8_loop<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  uint8_t *sc;
  float *out;
  CK(cudaMalloc(&sc, 256 * 64));
  CK(cudaMemset(sc, 127, 256 * 64));  // E8M0 127: 2^0
  CK(cudaMalloc(&out, (size_t)grid * 256 * 4));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  double best[16] = {0};
  for (int r = 0; r < rounds; r++) {  // interleaved: every variant once per round
    for (int i = 0; i < nv; i++) {
      v[i].launch(grid, iters / 8, sc, out);  // warm
      CK(cudaEventRecord(e0));
      v[i].launch(grid, iters, sc, out);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      CK(cudaGetLastError());
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      const double tf = v[i].flop_per_iter * iters * grid / (ms * 1e-3) * 1e-12;
      printf("round %d %-10s %8.3f ms %7.1f TF/s\n", r, v[i].name, ms, tf);
      if (tf > best[i]) best[i] = tf;
    }
  }
  printf("best of %d rounds, %d CTAs:\n", rounds, grid);
  for (int i = 0; i < nv; i++)
    printf("%-10s %7.1f TF/s  %.3fx bf16\n", v[i].name, best[i], best[i] / best[0]);
  return 0;
}
