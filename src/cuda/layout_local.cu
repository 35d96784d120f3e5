/*
 * layout_local.cu: the routing layout of one rank's tokens on the GPU (W = 1), the first kernel of
 * the unfused forward (launch.h, "Layer forward"). One CTA, no atomics that decide an order:
 *
 *   1. Rounds of LL_THREADS tokens, one token per thread. Per warp and per expert a 32-bit mask
 *      marks the lanes whose token routes to the expert (atomicOr only sets bits, so the masks do
 *      not depend on timing); a prefix over the warps plus popc(mask & lanes below) gives each
 *      (token, slot) its rank among the rows of its expert in token order. An expert appears at
 *      most once per token, so token order is (token, slot) order: the rows of src/cpu/layout.c
 *      with W = 1 and tile_m = 1 (no padding).
 *   2. offsets = exclusive prefix sum of the counts (one thread: E <= 1024 adds).
 *   3. slot_row += offsets[expert]; copies of slot_row and offsets go to the context; for the
 *      fused forward also row_tok, row_w (the gather's row order), tile_pre (128-row tiles per
 *      expert, prefix sums) and the fused kernel's counters, zeroed for this call.
 *
 * Bad routing (an id outside [-1, E), an expert twice in a token) and capacity overflow (more rows
 * than capacity_rows) make the whole call invalid: status = 0, offsets all 0 (the GEMMs find no
 * rows), slot_row all -1, the context header's magic 0, and the first failing (token, slot) in
 * (token, slot) order (atomicMin: the same one whatever the timing) goes to the error word.
 *
 * The routing hash of the context header is Σ_i mix(i, topk_idx[i]) mod 2^64 (integer sums do
 * not depend on order); FNV-1a, the CPU backend's, is sequential.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/error_word.cuh"
#include "cuda/launch.h"
#include "mok_internal.h"
#include "workspace.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's forward kernels target sm_90a (Hopper) and newer"
#endif

#define LL_THREADS 512
#define LL_WARPS (LL_THREADS / 32)

static_assert(LL_THREADS % 32 == 0, "whole warps");
static_assert(MOK_FWD_MAX_TOP_K <= 64, "valid slots of a token are one 64-bit mask");

// Shared memory for E experts: masks and warp prefixes [LL_WARPS, E], counts [E], offsets [E + 1].
static size_t ll_smem_bytes(int64_t E) {
  return (size_t)(2 * LL_WARPS * E + E + E + 1) * sizeof(int32_t);
}

// splitmix64 of (index, id): a hash term per routing entry.
__device__ __forceinline__ uint64_t ll_mix(uint64_t i, int32_t e) {
  uint64_t z = ((i << 32) | (uint32_t)e) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 0 when slot k of `row` is empty or valid; else the mok_ws_err_kind_t, with *other = E (range)
// or the earlier slot holding the same expert (repeat).
__device__ __forceinline__ int ll_slot_error(const int32_t *row, int64_t k, int64_t E,
                                             int64_t *other) {
  const int32_t e = row[k];
  if (e == -1) return 0;
  if (e < -1 || e >= E) {
    *other = E;
    return MOK_WS_ERR_ID_RANGE;
  }
  for (int64_t j = 0; j < k; j++) {
    if (row[j] == e) {
      *other = j;
      return MOK_WS_ERR_REPEAT;
    }
  }
  return 0;
}

__global__ void __launch_bounds__(LL_THREADS, 1)
    ll_layout_kernel(const __grid_constant__ mok_fwd_local_params_t p) {
  extern __shared__ int32_t ll_smem[];
  __shared__ unsigned long long s_first_bad, s_hash;
  __shared__ int s_ok;
  const int64_t E = p.E, K = p.K, T = p.T;
  uint32_t *mask = (uint32_t *)ll_smem;  // [LL_WARPS, E]
  int32_t *pre = ll_smem + LL_WARPS * E;  // [LL_WARPS, E] rows of the warps before, per expert
  int32_t *count = pre + LL_WARPS * E;    // [E] rows so far
  int32_t *offs = count + E;              // [E + 1]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t below = (1u << lane) - 1u;

  if (threadIdx.x == 0) {
    s_first_bad = ~0ull;
    s_hash = 0;
  }
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();  // before any atomic on s_first_bad or s_hash (T = 0 skips the rounds)
  uint64_t hash = 0;

  // 1. Ranks within each expert, round by round (slot_row holds the rank until step 3).
  for (int64_t base = 0; base < T; base += LL_THREADS) {
    const int64_t t = base + threadIdx.x;
    const bool has = t < T;
    const int32_t *row = p.topk_idx + t * K;
    for (int64_t i = threadIdx.x; i < LL_WARPS * E; i += blockDim.x) mask[i] = 0;
    __syncthreads();
    uint64_t valid = 0;  // bit k: slot k routes to an expert
    if (has) {
      for (int64_t k = 0; k < K; k++) {
        const int32_t e = row[k];
        hash += ll_mix((uint64_t)(t * K + k), e);
        int64_t other;
        if (ll_slot_error(row, k, E, &other)) {
          atomicMin(&s_first_bad, (unsigned long long)(t * K + k));
          continue;
        }
        if (e < 0) continue;
        valid |= 1ull << k;
        atomicOr(&mask[warp * E + e], 1u << lane);
      }
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
      int32_t acc = count[e];
      for (int w = 0; w < LL_WARPS; w++) {
        pre[w * E + e] = acc;
        acc += __popc(mask[w * E + e]);
      }
      count[e] = acc;
    }
    __syncthreads();
    if (has) {
      for (int64_t k = 0; k < K; k++) {
        const int32_t e = row[k];
        p.slot_row[t * K + k] =
            (valid >> k) & 1 ? pre[warp * E + e] + __popc(mask[warp * E + e] & below) : -1;
      }
    }
    __syncthreads();  // masks are cleared next round
  }

  // The routing hash: warp sums, then one integer atomic per warp (order-free).
  for (int o = 16; o > 0; o >>= 1) hash += __shfl_xor_sync(0xFFFFFFFFu, hash, o);
  if (lane == 0) atomicAdd(&s_hash, (unsigned long long)hash);
  __syncthreads();

  // 2. Offsets, validity, error word, context header.
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int64_t e = 0; e < E; e++) {
      offs[e] = acc;
      acc += count[e];
    }
    offs[E] = acc;
    int ok = 1;
    mok_ws_error_t *err = (mok_ws_error_t *)p.err;
    if (s_first_bad != ~0ull) {
      ok = 0;
      const int64_t i = (int64_t)s_first_bad, t = i / K, k = i % K;
      int64_t other = 0;
      const int kind = ll_slot_error(p.topk_idx + t * K, k, E, &other);
      mok_ws_record_error(err, MOK_ERROR_INVALID_ROUTING, kind, t, k, p.topk_idx[i], other);
    } else if (acc > p.capacity_rows) {
      ok = 0;
      mok_ws_record_error(err, MOK_ERROR_CAPACITY_OVERFLOW, MOK_WS_ERR_CAPACITY, -1, -1, acc,
                      p.capacity_rows);
    }
    s_ok = ok;
    *p.status = ok;
    int32_t tiles = 0;  // row-tile prefix sums into pre[0..E] (the warp prefixes are done)
    for (int64_t e = 0; e < E; e++) {
      pre[e] = ok ? tiles : 0;
      tiles += (count[e] + MOK_FC_TILE_M - 1) / MOK_FC_TILE_M;
    }
    pre[E] = ok ? tiles : 0;
    p.shared_offsets[0] = 0;
    p.shared_offsets[1] = ok ? (int32_t)T : 0;
    mok_ctx_header_t *h = (mok_ctx_header_t *)p.ctx_header;
    h->magic = ok ? MOK_CTX_MAGIC : 0;
    h->layer_id = p.layer_id;
    h->num_tokens = T;
    h->routing_hash = s_hash;
    h->mode = p.context_mode;
    h->pad[0] = h->pad[1] = h->pad[2] = 0;
  }
  __syncthreads();

  // 3. Final rows (or nothing, for an invalid call), and the context's copies.
  const int ok = s_ok;
  for (int64_t e = threadIdx.x; e <= E; e += blockDim.x) {
    const int32_t v = ok ? offs[e] : 0;
    p.offsets[e] = v;
    p.ctx_offsets[e] = v;
    if (p.tile_pre) p.tile_pre[e] = pre[e];
  }
  if (p.counters)
    for (int64_t i = threadIdx.x; i < p.n_counters; i += blockDim.x) p.counters[i] = 0;
  for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) {
    int32_t r = p.slot_row[i];  // written by this CTA before the barriers above
    if (r >= 0) r = ok ? r + offs[p.topk_idx[i]] : -1;
    p.slot_row[i] = r;
    p.ctx_slot_row[i] = r;
    if (r >= 0 && p.row_tok) {
      p.row_tok[r] = (int32_t)(i / K);
      p.row_w[r] = p.topk_w[i];
    }
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* Launcher                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

extern "C" mokResult_t mok_fwd_layout_launch(const mok_fwd_local_params_t *p, void *stream) {
  if (!p || !p->err || !p->status || !p->offsets || !p->shared_offsets || !p->slot_row ||
      !p->ctx_header || !p->ctx_slot_row || !p->ctx_offsets || (p->T > 0 && !p->topk_idx) ||
      (p->row_tok && (!p->row_w || (p->T > 0 && !p->topk_w))) || (p->n_counters > 0 && !p->counters))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "layout launch: NULL buffer");
  if (p->E < 1 || p->E > MOK_FWD_MAX_EXPERTS || p->K < 1 || p->K > MOK_FWD_MAX_TOP_K ||
      p->T < 0 || p->T * p->K >= INT32_MAX || p->capacity_rows >= INT32_MAX)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "layout launch: E = %lld (1..%d), K = %lld (1..%d), T = %lld out of range",
                    (long long)p->E, MOK_FWD_MAX_EXPERTS, (long long)p->K, MOK_FWD_MAX_TOP_K,
                    (long long)p->T);
  const size_t smem = ll_smem_bytes(p->E);
  cudaError_t e =
      cudaFuncSetAttribute(ll_layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e == cudaSuccess) {
    ll_layout_kernel<<<1, LL_THREADS, smem, (cudaStream_t)stream>>>(*p);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "layout kernel launch (E = %lld, %zu bytes of shared "
                    "memory): %s", (long long)p->E, smem, cudaGetErrorString(e));
  return MOK_SUCCESS;
}
