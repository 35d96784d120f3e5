/*
 * forward/rows.cuh: the forward's combine of one token on one GPU, shared by the unfused reduce
 * kernel (forward/rows.cu) and the fused forward's REDUCE tasks (forward/fused.cu):
 *
 *   y[t] = bf16( ys[t] + yk[rows[0]] + ... + yk[rows[K-1]] )
 *
 * an fp32 sum in slot order that skips empty slots (rows[k] < 0; docs/design.md, "The layer"),
 * the same additions in the same order as src/cpu/ref_layer.c. One warp per token, 16-byte chunks.
 * NOTE: yk and ys are read at L2 (.cg): in the fused kernel other SMs wrote them during this
 * launch, and this SM's L1 could hold older lines of the same addresses.
 */
#ifndef MOK_CUDA_ROWS_LOCAL_CUH
#define MOK_CUDA_ROWS_LOCAL_CUH

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ void rl_add_bf16x8(float (&acc)[8], uint4 v) {
  const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

// A chunk's sum starts from the shared expert's fp32 row (ys_t) or from zero; a chunk past the
// row (has false) reads nothing.
__device__ __forceinline__ void rl_load_ys(const float4 *ys_t, int64_t c, bool has,
                                           float (&acc)[8]) {
  if (ys_t && has) {
    const float4 a = __ldcg(ys_t + 2 * c), b = __ldcg(ys_t + 2 * c + 1);
    acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w;
    acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = 0.0f;
  }
}

__device__ __forceinline__ uint4 rl_pack_bf16x8(const float (&acc)[8]) {
  uint4 out;
  __nv_bfloat162 *o = (__nv_bfloat162 *)&out;
#pragma unroll
  for (int j = 0; j < 4; j++) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return out;
}

// rows [K]: the expert-order row of each slot of the token (< 0: empty); yk [R, H/8] of 16-byte
// chunks; ys_t: the token's fp32 shared-expert row or NULL; y_t: the token's bf16 output row.
// Latency, not bandwidth, bounds a warp here: each lane keeps the loads of CHUNKS chunks (8 slot
// rows and 2 shared-expert halves each) in flight. The fused forward's reduce, 3 to 12 warps per
// SM, uses 2 (docs/performance.md, "Fused forward: reduce helpers"); the unfused reduce kernel,
// with many warps per SM, 1.
template <int CHUNKS>
__device__ __forceinline__ void rl_reduce_token(const int32_t *rows, int64_t K, int64_t H8,
                                                const uint4 *yk, const float4 *ys_t, uint4 *y_t,
                                                int lane) {
  for (int64_t c0 = lane; c0 < H8; c0 += 32 * CHUNKS) {
    bool has[CHUNKS];
    float acc[CHUNKS][8];
#pragma unroll
    for (int u = 0; u < CHUNKS; u++) {
      has[u] = c0 + 32 * u < H8;
      rl_load_ys(ys_t, c0 + 32 * u, has[u], acc[u]);
    }
    // Slots in groups of 8: the loads of a group are issued together, then added in slot order;
    // empty slots are skipped, not added as zeros (-0 + 0 would turn a -0 sum into +0).
    for (int64_t k0 = 0; k0 < K; k0 += 8) {
      int32_t r[8];
      uint4 v[CHUNKS][8];
#pragma unroll
      for (int j = 0; j < 8; j++) {
        r[j] = k0 + j < K ? rows[k0 + j] : -1;
        const uint4 *src = yk + (int64_t)r[j] * H8 + c0;
#pragma unroll
        for (int u = 0; u < CHUNKS; u++)
          v[u][j] = r[j] >= 0 && has[u] ? __ldcg(src + 32 * u) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < 8; j++)  // slot order: the order of the fp32 additions
        if (r[j] >= 0) {
#pragma unroll
          for (int u = 0; u < CHUNKS; u++) rl_add_bf16x8(acc[u], v[u][j]);
        }
    }
#pragma unroll
    for (int u = 0; u < CHUNKS; u++)
      if (has[u]) y_t[c0 + 32 * u] = rl_pack_bf16x8(acc[u]);
  }
}

#endif /* MOK_CUDA_ROWS_LOCAL_CUH */
