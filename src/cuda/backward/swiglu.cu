/*
 * backward/swiglu.cu: the SwiGLU backward of a GPU backward (backward.h), one
 * elementwise pass per routed (or shared) row between the ds GEMM and the dxk GEMMs:
 *
 *   s  = silu(g) · u                      fp32, from the bf16 g, u of the context
 *   a  = bf16(w · s)                      for dWd = dyᵀ · a
 *   dw = Σ_i ds_i · s_i                   router-weight gradient of the row (fp32, fixed order)
 *   da = w · ds
 *   dg = bf16((da · u) · silu'(g))        silu'(g) = sig · (1 + g · (1 - sig))
 *   du = bf16(da · silu(g))
 *
 * Every product and sum is an explicit _rn intrinsic in src/cpu/ref_backward.c's order, so the
 * compiler contracts nothing into an fma the reference does not have; expf and the IEEE division
 * are the accurate ones (the reference uses libm's expf). The dw sum: lane l of the row's warp
 * owns columns 4 (32 j + l) + (0..3) for j = 0, 1, ... and sums them with fmaf in that order;
 * then a butterfly over the lanes (xor 16, 8, 4, 2, 1), which gives every lane the same bits.
 * One warp per row, 8-byte bf16 and 16-byte fp32 vectors (n % 128 == 0), so that each step of a
 * row's loop holds one 1x128 block of it across the warp: fp8-block layers quantize dg and du
 * there (quant_warp_1x128_cvt) from the bf16 values just stored, as the quantizer would read them.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/backward/backward.h"
#include "cuda/quant/quantize.cuh"
#include "common/status.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's backward kernels target sm_90a (Hopper) and newer"
#endif

#define SB_THREADS 256
#define SB_WARPS (SB_THREADS / 32)

static_assert(SB_THREADS % 32 == 0, "whole warps");

// Four bf16 values of an 8-byte vector, as floats (exact).
__device__ __forceinline__ void sb_load4(const uint2 v, float (&f)[4]) {
  const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}

__device__ __forceinline__ uint2 sb_pack4(const float (&f)[4]) {
  uint2 v;
  __nv_bfloat162 *h = (__nv_bfloat162 *)&v;
  h[0] = __floats2bfloat162_rn(f[0], f[1]);
  h[1] = __floats2bfloat162_rn(f[2], f[3]);
  return v;
}

__global__ void __launch_bounds__(SB_THREADS)
    sb_swiglu_backward_kernel(const __grid_constant__ mok_bwd_swiglu_params_t p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * SB_WARPS + warp;
  const int64_t begin = p.offsets[0], end = p.offsets[p.num_groups];
  if (r < begin || r >= end || r >= p.m_total) return;
  const float w = p.row_w ? p.row_w[r] : 1.0f;
  const int64_t n4 = p.n / 4;                           // 4-column chunks per row
  const uint2 *g4 = (const uint2 *)p.g + r * n4;        // [n / 4] of row r
  const uint2 *u4 = (const uint2 *)p.u + r * n4;
  const float4 *ds4 = (const float4 *)p.ds + r * n4;
  uint2 *a4 = (uint2 *)p.a + r * n4, *dg4 = (uint2 *)p.dg + r * n4, *du4 = (uint2 *)p.du + r * n4;
  float dw = 0.0f;
  for (int64_t c = lane; c < n4; c += 32) {
    float g[4], u[4], a[4], dg[4], du[4];
    sb_load4(g4[c], g);
    sb_load4(u4[c], u);
    const float4 d4 = ds4[c];
    const float ds[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const float den = __fadd_rn(1.0f, expf(-g[j]));   // 1 + e^-g (inf for g < -88)
      const float silu = __fdiv_rn(g[j], den);
      const float sig = __fdiv_rn(1.0f, den);
      const float s = __fmul_rn(silu, u[j]);
      a[j] = __fmul_rn(w, s);
      dw = __fmaf_rn(ds[j], s, dw);
      const float da = __fmul_rn(w, ds[j]);
      const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(g[j], __fsub_rn(1.0f, sig))));
      dg[j] = __fmul_rn(__fmul_rn(da, u[j]), dsilu);
      du[j] = __fmul_rn(da, silu);
    }
    a4[c] = sb_pack4(a);
    const uint2 dgb = sb_pack4(dg), dub = sb_pack4(du);
    dg4[c] = dgb;
    du4[c] = dub;
    if (p.dgq) {  // block c / 32 of the row (c = 32 j + lane: the whole warp takes this branch)
      float v[4], sg, su;
      sb_load4(dgb, v);
      ((uint32_t *)p.dgq)[r * n4 + c] = quant_warp_1x128_cvt(v, p.q_kind, &sg);
      sb_load4(dub, v);
      ((uint32_t *)p.duq)[r * n4 + c] = quant_warp_1x128_cvt(v, p.q_kind, &su);
      if (lane == 0) {  // scales [2 n / 128, q_ld]: dg's block c / 32, then du's
        p.q_scales[(c >> 5) * p.q_ld + r] = sg;
        p.q_scales[(p.n / 128 + (c >> 5)) * p.q_ld + r] = su;
      }
    }
  }
  if (!p.dw_row) return;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) dw = __fadd_rn(dw, __shfl_xor_sync(0xFFFFFFFFu, dw, o));
  if (lane == 0) p.dw_row[r] = dw;
}

/* ---------------------------------------------------------------------------------------------- */
/* Launcher                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static int sb_aligned(const void *ptr, unsigned a) { return ((uintptr_t)ptr & (a - 1)) == 0; }

extern "C" cudaError_t mok_bwd_sb_preload(void) {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, sb_swiglu_backward_kernel);
}

extern "C" mokResult_t mok_bwd_swiglu_launch(const mok_bwd_swiglu_params_t *p, void *stream) {
  if (!p || !p->offsets || !p->g || !p->u || !p->ds || !p->a || !p->dg || !p->du)
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "SwiGLU backward launch: NULL buffer");
  if (p->num_groups < 1 || p->m_total < 0 || p->n < 128 || p->n % 128 ||
      p->m_total >= ((int64_t)1 << 31) * SB_WARPS)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "SwiGLU backward launch: G = %lld, M = %lld, "
                    "n = %lld (a multiple of 128)", (long long)p->num_groups,
                    (long long)p->m_total, (long long)p->n);
  if (p->dgq && (!p->duq || !p->q_scales))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "SwiGLU backward launch: NULL e4m3 buffer");
  if (p->dgq && (p->q_ld < p->m_total || (p->q_kind != MOK_QUANT_FP32_SCALE &&
                                           p->q_kind != MOK_QUANT_POW2_SCALE)))
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "SwiGLU backward launch: scale stride %lld "
                    "(>= %lld rows), scale kind %d", (long long)p->q_ld, (long long)p->m_total,
                    (int)p->q_kind);
  if (p->dgq && (!sb_aligned(p->dgq, 4) || !sb_aligned(p->duq, 4) || !sb_aligned(p->q_scales, 4)))
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "SwiGLU backward launch: misaligned e4m3 buffer");
  if (!sb_aligned(p->g, 8) || !sb_aligned(p->u, 8) || !sb_aligned(p->ds, 16) ||
      !sb_aligned(p->a, 8) || !sb_aligned(p->dg, 8) || !sb_aligned(p->du, 8) ||
      !sb_aligned(p->offsets, 4) || !sb_aligned(p->row_w, 4) || !sb_aligned(p->dw_row, 4))
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "SwiGLU backward launch: misaligned buffer");
  if (p->m_total == 0) return MOK_SUCCESS;
  const unsigned blocks = (unsigned)((p->m_total + SB_WARPS - 1) / SB_WARPS);
  sb_swiglu_backward_kernel<<<blocks, SB_THREADS, 0, (cudaStream_t)stream>>>(*p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "SwiGLU backward kernel launch: %s", cudaGetErrorString(e));
  return MOK_SUCCESS;
}
