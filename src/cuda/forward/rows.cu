/*
 * forward/rows.cu: moving rows between token order and expert order on one GPU (W = 1), the
 * kernels around the grouped GEMMs of the unfused forward (forward.h):
 *
 *   gather:  xg[slot_row[t, k]] = x[t]  and  row_w[slot_row[t, k]] = topk_w[t, k]
 *            (fp8-block layers: the quantized rows of x and their scales)
 *   reduce:  y[t] = bf16( ys[t] + yk[row(t, 0)] + ... + yk[row(t, K-1)] )
 *            (forward/rows.cuh, shared with the fused forward), so equal yk and ys give bitwise
 *            equal y.
 *
 * One warp per token, 16-byte loads and stores (H % 128 == 0, so every row is 16-byte aligned).
 * Both kernels return at once when the call's status (written by the layout kernel) is 0.
 * The backward's dx reduce (the same shape, bf16-rounded fp32 rows in) is the last section.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/backward/backward.h"
#include "cuda/forward/forward.h"
#include "cuda/forward/rows.cuh"
#include "common/status.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's forward kernels target sm_90a (Hopper) and newer"
#endif

#define RL_THREADS 256
#define RL_WARPS (RL_THREADS / 32)

static_assert(RL_THREADS % 32 == 0, "whole warps");

// The rows of token t's slots (slot_row [T, K]: the workspace's or the context's) into this warp's
// smem array rows [K]. Returns 0 past the last token.
__device__ __forceinline__ int rl_token_rows(const int32_t *slot_row, int64_t T, int64_t K,
                                             int64_t t, int32_t *rows) {
  if (t >= T) return 0;
  for (int64_t k = threadIdx.x & 31; k < K; k += 32) rows[k] = slot_row[t * K + k];
  __syncwarp();
  return 1;
}

__global__ void __launch_bounds__(RL_THREADS)
    rl_gather_kernel(const __grid_constant__ mok_fwd_local_params_t p) {
  __shared__ int32_t s_rows[RL_WARPS][MOK_MAX_TOP_K];
  if (*p.status == 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = (int64_t)blockIdx.x * RL_WARPS + warp;
  int32_t *rows = s_rows[warp];
  if (!rl_token_rows(p.slot_row, p.T, p.K, t, rows)) return;
  const int64_t K = p.K, H8 = p.H / 8;  // 16-byte chunks per row
  for (int64_t k = lane; k < K; k += 32)
    if (rows[k] >= 0) p.row_w[rows[k]] = p.topk_w[t * K + k];
  const uint4 *src = (const uint4 *)p.x + t * H8;  // [H / 8] of token t
  uint4 *xg = (uint4 *)p.xg;                       // [R, H / 8]
  for (int64_t c = lane; c < H8; c += 32) {
    const uint4 v = src[c];
    for (int64_t k = 0; k < K; k++) {
      const int32_t r = rows[k];
      if (r >= 0) xg[(int64_t)r * H8 + c] = v;
    }
  }
}

// fp8-block layers: the token rows quantized once (e4m3 [T, H], scales K-block major
// [H/128, xs_ld]) copied to their rows (rq [R, H], rq_s [H/128, rs_ld]); quantizing per row, the
// copy of a quantized row is the quantized copy.
typedef struct {
  const uint4 *xq;  // [T, H / 16]
  const float *xs;
  int64_t xs_ld;
  uint4 *rq;        // [R, H / 16]
  float *rs;
  int64_t rs_ld;
} rl_fp8_rows_t;

__global__ void __launch_bounds__(RL_THREADS)
    rl_gather_fp8_kernel(const __grid_constant__ mok_fwd_local_params_t p,
                         const __grid_constant__ rl_fp8_rows_t f) {
  __shared__ int32_t s_rows[RL_WARPS][MOK_MAX_TOP_K];
  if (*p.status == 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = (int64_t)blockIdx.x * RL_WARPS + warp;
  int32_t *rows = s_rows[warp];
  if (!rl_token_rows(p.slot_row, p.T, p.K, t, rows)) return;
  const int64_t K = p.K, H16 = p.H / 16, HB = p.H / 128;
  for (int64_t k = lane; k < K; k += 32)
    if (rows[k] >= 0) p.row_w[rows[k]] = p.topk_w[t * K + k];
  for (int64_t c = lane; c < H16; c += 32) {
    const uint4 v = f.xq[t * H16 + c];
    for (int64_t k = 0; k < K; k++)
      if (rows[k] >= 0) f.rq[(int64_t)rows[k] * H16 + c] = v;
  }
  for (int64_t b = lane; b < HB; b += 32) {
    const float v = f.xs[b * f.xs_ld + t];
    for (int64_t k = 0; k < K; k++)
      if (rows[k] >= 0) f.rs[b * f.rs_ld + rows[k]] = v;
  }
}

__global__ void __launch_bounds__(RL_THREADS)
    rl_reduce_kernel(const __grid_constant__ mok_fwd_local_params_t p) {
  __shared__ int32_t s_rows[RL_WARPS][MOK_MAX_TOP_K];
  if (*p.status == 0) return;  // an invalid call leaves y as it was
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = (int64_t)blockIdx.x * RL_WARPS + warp;
  int32_t *rows = s_rows[warp];
  if (!rl_token_rows(p.slot_row, p.T, p.K, t, rows)) return;
  const int64_t H8 = p.H / 8;
  rl_reduce_token<1>(rows, p.K, H8, (const uint4 *)p.yk,
                     p.ys ? (const float4 *)p.ys + t * (H8 * 2) : NULL, (uint4 *)p.y + t * H8,
                     lane);
}

/* ---------------------------------------------------------------------------------------------- */
/* Launchers                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

static mokResult_t rl_check(const mok_fwd_local_params_t *p, const char *what) {
  if (!p || !p->status || !p->slot_row || (p->T > 0 && (!p->x || !p->y || !p->topk_w)))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s launch: NULL buffer", what);
  if (p->K < 1 || p->K > MOK_MAX_TOP_K || p->H < 8 || p->H % 8 || p->T < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "%s launch: K = %lld, H = %lld, T = %lld",
                    what, (long long)p->K, (long long)p->H, (long long)p->T);
  return MOK_SUCCESS;
}

static mokResult_t rl_launched(const char *what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "%s kernel launch: %s", what, cudaGetErrorString(e));
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_fwd_gather_launch(const mok_fwd_local_params_t *p, void *stream) {
  mokResult_t r = rl_check(p, "gather");
  if (r != MOK_SUCCESS) return r;
  if (!p->row_w || !p->xg) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "gather launch: NULL buffer");
  if (p->T == 0) return MOK_SUCCESS;
  const unsigned blocks = (unsigned)((p->T + RL_WARPS - 1) / RL_WARPS);
  rl_gather_kernel<<<blocks, RL_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return rl_launched("gather");
}

extern "C" mokResult_t mok_fwd_gather_fp8_launch(const mok_fwd_local_params_t *p, const void *xq,
                                                 const float *xq_s, int64_t xs_ld, void *rq,
                                                 float *rq_s, int64_t rs_ld, void *stream) {
  mokResult_t r = rl_check(p, "fp8 gather");
  if (r != MOK_SUCCESS) return r;
  if (!p->row_w || !xq || !xq_s || !rq || !rq_s)
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "fp8 gather launch: NULL buffer");
  if (p->H % 128 || xs_ld < p->T || rs_ld < 1 || ((uintptr_t)xq | (uintptr_t)rq) % 16)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "fp8 gather launch: H = %lld (a multiple of 128), scale strides %lld, %lld",
                    (long long)p->H, (long long)xs_ld, (long long)rs_ld);
  if (p->T == 0) return MOK_SUCCESS;
  rl_fp8_rows_t f = {(const uint4 *)xq, xq_s, xs_ld, (uint4 *)rq, rq_s, rs_ld};
  const unsigned blocks = (unsigned)((p->T + RL_WARPS - 1) / RL_WARPS);
  rl_gather_fp8_kernel<<<blocks, RL_THREADS, 0, (cudaStream_t)stream>>>(*p, f);
  return rl_launched("fp8 gather");
}

extern "C" mokResult_t mok_fwd_reduce_launch(const mok_fwd_local_params_t *p, void *stream) {
  mokResult_t r = rl_check(p, "reduce");
  if (r != MOK_SUCCESS) return r;
  if (!p->yk || (p->Is > 0 && !p->ys))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "reduce launch: NULL buffer");
  if (p->T == 0) return MOK_SUCCESS;
  const unsigned blocks = (unsigned)((p->T + RL_WARPS - 1) / RL_WARPS);
  rl_reduce_kernel<<<blocks, RL_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return rl_launched("reduce");
}

/* ============================================================================================== */
/* Layer backward: the dx reduce (backward.h)                                      */
/* ============================================================================================== */
/*
 *   dx[t] = bf16( dxs[t] + dxk[row(t, 0)] + ... + dxk[row(t, K-1)] )
 *   dtopk_w[t, k] = dw_row[row(t, k)], 0 for an empty slot
 *
 * As in docs/design.md, "The layer": each slot's dxk is bf16 (the dxk GEMM's epilogue rounds it,
 * as on its expert's rank), the shared expert's dxs is fp32; an fp32 sum in slot order starting
 * from dxs (or 0), the additions of src/cpu/ref_backward.c in its order. The gathers of x and dy
 * are the forward's gather kernel.
 */

__global__ void __launch_bounds__(RL_THREADS)
    rl_dx_reduce_kernel(const __grid_constant__ mok_bwd_local_params_t p) {
  __shared__ int32_t s_rows[RL_WARPS][MOK_MAX_TOP_K];
  if (*p.status == 0) return;  // a context that does not match: dx, dtopk_w stay as they were
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = (int64_t)blockIdx.x * RL_WARPS + warp;
  int32_t *rows = s_rows[warp];
  if (!rl_token_rows(p.ctx_slot_row, p.T, p.K, t, rows)) return;
  const int64_t K = p.K, H4 = p.H / 4;  // 4-column chunks per row
  for (int64_t k = lane; k < K; k += 32) p.dtopk_w[t * K + k] = rows[k] >= 0 ? p.dw_row[rows[k]] : 0.0f;
  const uint2 *dxk = (const uint2 *)p.dxk;                       // [R, H / 4] of 4 bf16
  const float4 *dxs = p.dxs ? (const float4 *)p.dxs + t * H4 : NULL;  // [H / 4] of token t
  uint2 *dx = (uint2 *)p.dx + t * H4;                            // [H / 4] of token t
  for (int64_t c = lane; c < H4; c += 32) {
    float4 acc = dxs ? dxs[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int64_t k = 0; k < K; k++) {  // slot order: the order of the fp32 additions
      const int32_t r = rows[k];
      if (r < 0) continue;
      const uint2 v = dxk[(int64_t)r * H4 + c];
      const float2 lo = __bfloat1622float2(*(const __nv_bfloat162 *)&v.x);
      const float2 hi = __bfloat1622float2(*(const __nv_bfloat162 *)&v.y);
      acc.x = __fadd_rn(acc.x, lo.x);
      acc.y = __fadd_rn(acc.y, lo.y);
      acc.z = __fadd_rn(acc.z, hi.x);
      acc.w = __fadd_rn(acc.w, hi.y);
    }
    uint2 out;
    __nv_bfloat162 *o = (__nv_bfloat162 *)&out;
    o[0] = __floats2bfloat162_rn(acc.x, acc.y);
    o[1] = __floats2bfloat162_rn(acc.z, acc.w);
    dx[c] = out;
  }
}

extern "C" mokResult_t mok_bwd_reduce_launch(const mok_bwd_local_params_t *p, void *stream) {
  if (!p || !p->status || (p->T > 0 && (!p->ctx_slot_row || !p->dxk || !p->dw_row || !p->dx ||
                                        !p->dtopk_w)))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "dx reduce launch: NULL buffer");
  if (p->K < 1 || p->K > MOK_MAX_TOP_K || p->H < 8 || p->H % 8 || p->T < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "dx reduce launch: K = %lld, H = %lld, T = %lld",
                    (long long)p->K, (long long)p->H, (long long)p->T);
  if (p->T == 0) return MOK_SUCCESS;
  const unsigned blocks = (unsigned)((p->T + RL_WARPS - 1) / RL_WARPS);
  rl_dx_reduce_kernel<<<blocks, RL_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return rl_launched("dx reduce");
}
