/*
 * forward/layout.cu: the routing layout of one rank's tokens on the GPU (W = 1), the first kernels of
 * the forward (forward.h). Two kernels of mok_ll_ctas(T) CTAs each, CTA c taking
 * the tokens of chunk c (src/common/workspace.h, mok_ll_*), no atomics that decide an order:
 *
 *   count  1. Rounds of LL_THREADS tokens, one token per thread. Per warp and per expert a 32-bit
 *             mask marks the lanes whose token routes to the expert (atomicOr only sets bits, so
 *             the masks do not depend on timing); a prefix over the warps plus popc(mask & lanes
 *             below) gives each (token, slot) its rank among the chunk's rows of its expert in
 *             token order. An expert appears at most once per token, so token order is (token,
 *             slot) order. The chunk's counts per expert, its tokens per bin of the reduce order
 *             (the token's highest expert + 1), first bad slot and routing-hash part go to the
 *             layout region.
 *   finish 2. From all chunks' partials, every CTA derives the same totals, offsets = exclusive
 *             prefix sum of the totals, and validity; CTA 0 writes them, the error word and the
 *             context header, and for the fused forward tile_pre (128-row tiles per expert,
 *             prefix sums); all CTAs zero the fused kernel's counters.
 *          3. slot_row = rank + rows of the expert in earlier chunks + offsets[expert]: the rows of
 *             src/cpu/layout.c with W = 1 and tile_m = 1 (no padding), whatever the chunking;
 *             copies go to the context, and for the fused forward row_tok and row_w (the
 *             gather's row order).
 *          4. For the fused forward, the reduce order: red_order lists the tokens by their
 *             highest expert (bins red_pre, from the chunks' bin counts), so that the fused
 *             kernel can reduce a token as soon as the DOWN tiles of experts up to its last are
 *             done (forward/fused.cu).
 * (One CTA doing all of it took ~0.54 ms at T = 16384, K = 8 on an H200: 19% of a Qwen3-30B
 * forward.)
 *
 * Bad routing (an id outside [-1, E), an expert twice in a token) and capacity overflow (more rows
 * than capacity_rows) make the whole call invalid: status = 0, offsets all 0 (the GEMMs find no
 * rows), slot_row all -1, the context header's magic 0, and the first failing (token, slot) in
 * (token, slot) order (the minimum over the chunks: the same one whatever the timing) goes to the
 * error word.
 *
 * The routing hash of the context header is Σ_i mok_ws_routing_mix(i, topk_idx[i]) mod 2^64
 * (src/common/workspace.h; integer sums do not depend on order); FNV-1a, the CPU backend's, is
 * sequential.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/error_word.cuh"
#include "cuda/forward/forward.h"
#include "common/context.h"
#include "common/status.h"
#include "common/workspace.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's forward kernels target sm_90a (Hopper) and newer"
#endif

#define LL_THREADS MOK_LL_ROUND  // one token per thread and round
#define LL_WARPS (LL_THREADS / 32)

static_assert(LL_THREADS % 32 == 0, "whole warps");
static_assert(MOK_MAX_TOP_K <= 64, "valid slots of a token are one 64-bit mask");

// Shared memory of the count kernel for E experts: masks and warp prefixes [LL_WARPS, E], counts
// [E], tokens per bin of the reduce order [E + 1].
static size_t ll_smem_bytes(int64_t E) {
  return (size_t)(2 * LL_WARPS * E + 2 * E + 1) * sizeof(int32_t);
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

// The layout region's partials of chunk c (src/common/workspace.h).
typedef struct {
  int32_t *counts;  // [ctas, E]
  int32_t *last;    // [ctas, E + 1]
  unsigned long long *bad, *hash;  // [ctas] each
} ll_partials_t;

__device__ __forceinline__ ll_partials_t ll_partials(const mok_fwd_local_params_t &p, int64_t ctas) {
  ll_partials_t q;
  q.counts = (int32_t *)p.layout_scratch;
  q.last = q.counts + ctas * p.E;
  q.bad = (unsigned long long *)(q.counts + mok_ll_bad_index(ctas, p.E));
  q.hash = q.bad + ctas;
  return q;
}

__global__ void __launch_bounds__(LL_THREADS, 1)
    ll_count_kernel(const __grid_constant__ mok_fwd_local_params_t p) {
  extern __shared__ int32_t ll_smem[];
  __shared__ unsigned long long s_first_bad, s_hash;
  const int64_t E = p.E, K = p.K, T = p.T;
  uint32_t *mask = (uint32_t *)ll_smem;  // [LL_WARPS, E]
  int32_t *pre = ll_smem + LL_WARPS * E;  // [LL_WARPS, E] rows of the warps before, per expert
  int32_t *count = pre + LL_WARPS * E;    // [E] rows of this chunk so far
  int32_t *bins = count + E;              // [E + 1] tokens of this chunk by last expert + 1
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t below = (1u << lane) - 1u;
  const int64_t chunk = mok_ll_chunk(T), t0 = blockIdx.x * chunk;
  const int64_t t1 = t0 + chunk < T ? t0 + chunk : T;

  if (threadIdx.x == 0) {
    s_first_bad = ~0ull;
    s_hash = 0;
  }
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  for (int64_t b = threadIdx.x; b <= E; b += blockDim.x) bins[b] = 0;
  __syncthreads();  // before any atomic on s_first_bad, s_hash or bins (T = 0 skips the rounds)
  uint64_t hash = 0;

  // 1. Ranks within each expert among the chunk's rows (slot_row holds them until step 3).
  for (int64_t base = t0; base < t1; base += LL_THREADS) {
    const int64_t t = base + threadIdx.x;
    const bool has = t < t1;
    const int32_t *row = p.topk_idx + t * K;
    for (int64_t i = threadIdx.x; i < LL_WARPS * E; i += blockDim.x) mask[i] = 0;
    __syncthreads();
    uint64_t valid = 0;  // bit k: slot k routes to an expert
    int32_t last = -1;   // the token's highest expert
    if (has) {
      for (int64_t k = 0; k < K; k++) {
        const int32_t e = row[k];
        hash += mok_ws_routing_mix((uint64_t)(t * K + k), e);
        int64_t other;
        if (ll_slot_error(row, k, E, &other)) {
          atomicMin(&s_first_bad, (unsigned long long)(t * K + k));
          continue;
        }
        if (e < 0) continue;
        valid |= 1ull << k;
        last = e > last ? e : last;
        atomicOr(&mask[warp * E + e], 1u << lane);
      }
      atomicAdd(&bins[last + 1], 1);
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

  // The chunk's hash part: warp sums, then one integer atomic per warp (order-free).
  for (int o = 16; o > 0; o >>= 1) hash += __shfl_xor_sync(0xFFFFFFFFu, hash, o);
  if (lane == 0) atomicAdd(&s_hash, (unsigned long long)hash);
  __syncthreads();
  const ll_partials_t q = ll_partials(p, gridDim.x);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) q.counts[blockIdx.x * E + e] = count[e];
  for (int64_t b = threadIdx.x; b <= E; b += blockDim.x) q.last[blockIdx.x * (E + 1) + b] = bins[b];
  if (threadIdx.x == 0) {
    q.bad[blockIdx.x] = s_first_bad;
    q.hash[blockIdx.x] = s_hash;
  }
}

// The sum over the chunks of column `col` of a [ctas, stride] partial (pass col's address), and
// in *before the sum over the chunks before this CTA's.
__device__ __forceinline__ int32_t ll_total_before(const int32_t *col, int64_t stride, int64_t ctas,
                                                   int32_t *before) {
  int32_t total = 0;
  for (int64_t c = 0; c < ctas; c++) {
    if (c == blockIdx.x) *before = total;
    total += col[c * stride];
  }
  return total;
}

__global__ void __launch_bounds__(LL_THREADS, 1)
    ll_finish_kernel(const __grid_constant__ mok_fwd_local_params_t p) {
  extern __shared__ int32_t ll_smem[];
  __shared__ int s_ok;
  const int64_t E = p.E, K = p.K, T = p.T, ctas = gridDim.x;
  int32_t *offs = ll_smem;          // [E + 1]
  int32_t *earlier = offs + E + 1;  // [E] rows of each expert in the chunks before this one
  int32_t *tiles = earlier + E;     // [E + 1] row-tile prefix sums (CTA 0)
  int32_t *rbase = tiles + E + 1;   // [E + 1] tokens per bin, then this chunk's next position
  int32_t *rpre = rbase + E + 1;    // [E + 2] the reduce order's bins (red_pre)
  const ll_partials_t q = ll_partials(p, ctas);

  // 2. Totals and the rows before this chunk, per expert; offsets; validity.
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x)
    offs[e] = ll_total_before(q.counts + e, E, ctas, &earlier[e]);  // turned into offsets below
  for (int64_t b = threadIdx.x; b <= E; b += blockDim.x)  // rbase: turned into positions below
    rbase[b] = ll_total_before(q.last + b, E + 1, ctas, &rpre[b]);
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long first_bad = ~0ull, hash = 0;
    for (int64_t c = 0; c < ctas; c++) {
      first_bad = q.bad[c] < first_bad ? q.bad[c] : first_bad;
      hash += q.hash[c];
    }
    int32_t acc = 0, ntiles = 0;
    for (int64_t e = 0; e < E; e++) {
      const int32_t n = offs[e];
      offs[e] = acc;
      tiles[e] = ntiles;
      acc += n;
      ntiles += (n + MOK_FC_TILE_M - 1) / MOK_FC_TILE_M;
    }
    offs[E] = acc;
    tiles[E] = ntiles;
    int32_t pos = 0;  // bins of the reduce order: this chunk's tokens of bin b follow rpre[b]
    for (int64_t b = 0; b <= E; b++) {
      const int32_t n = rbase[b];
      rbase[b] = pos + rpre[b];
      rpre[b] = pos;
      pos += n;
    }
    rpre[E + 1] = pos;
    int ok = 1, kind = 0;
    int64_t other = 0;
    if (first_bad != ~0ull) {
      ok = 0;
      const int64_t i = (int64_t)first_bad;
      kind = ll_slot_error(p.topk_idx + (i / K) * K, i % K, E, &other);
    } else if (acc > p.capacity_rows) {
      ok = 0;
    }
    s_ok = ok;
    if (blockIdx.x == 0) {
      mok_ws_error_t *err = (mok_ws_error_t *)p.err;
      if (first_bad != ~0ull) {
        const int64_t i = (int64_t)first_bad;
        mok_ws_record_error(err, MOK_ERROR_INVALID_ROUTING, kind, i / K, i % K, p.topk_idx[i],
                            other);
      } else if (!ok) {
        mok_ws_record_error(err, MOK_ERROR_CAPACITY_OVERFLOW, MOK_WS_ERR_CAPACITY, -1, -1, acc,
                            p.capacity_rows);
      }
      *p.status = ok;
      p.shared_offsets[0] = 0;
      p.shared_offsets[1] = ok ? (int32_t)T : 0;
      mok_ctx_header_t *h = (mok_ctx_header_t *)p.ctx_header;
      h->magic = ok ? MOK_CTX_MAGIC : 0;
      h->layer_id = p.layer_id;
      h->num_tokens = T;
      h->routing_hash = hash;
      h->mode = p.context_mode;
      h->pad[0] = h->pad[1] = h->pad[2] = 0;
    }
  }
  __syncthreads();

  // 3. Final rows (or nothing, for an invalid call), and the context's copies.
  const int ok = s_ok;
  if (blockIdx.x == 0) {
    for (int64_t e = threadIdx.x; e <= E; e += blockDim.x) {
      const int32_t v = ok ? offs[e] : 0;
      p.offsets[e] = v;
      p.ctx_offsets[e] = v;
      if (p.tile_pre) p.tile_pre[e] = ok ? tiles[e] : 0;
    }
    if (p.red_pre)
      for (int64_t b = threadIdx.x; b <= E + 1; b += blockDim.x) p.red_pre[b] = ok ? rpre[b] : 0;
  }
  if (p.counters)
    for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n_counters;
         i += (int64_t)gridDim.x * blockDim.x)
      p.counters[i] = 0;
  const int64_t chunk = mok_ll_chunk(T), t0 = blockIdx.x * chunk;
  const int64_t i1 = (t0 + chunk < T ? t0 + chunk : T) * K;
  for (int64_t i = t0 * K + threadIdx.x; i < i1; i += blockDim.x) {
    int32_t r = p.slot_row[i];  // the rank within the chunk, from the count kernel
    if (r >= 0) {
      const int32_t e = p.topk_idx[i];
      r = ok ? r + earlier[e] + offs[e] : -1;
    }
    p.slot_row[i] = r;
    p.ctx_slot_row[i] = r;
    if (r >= 0 && p.row_tok) {
      p.row_tok[r] = (int32_t)(i / K);
      p.row_w[r] = p.topk_w[i];
    }
  }
  // 4. The reduce order: this chunk's tokens into their bins (last expert + 1). Within a bin the
  // order is whatever the shared-memory atomics give: it decides only when a token is reduced.
  if (ok && p.red_order) {
    const int64_t t1 = t0 + chunk < T ? t0 + chunk : T;
    for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
      int32_t last = -1;
      for (int64_t k = 0; k < K; k++) {
        const int32_t e = p.topk_idx[t * K + k];
        last = e > last ? e : last;
      }
      p.red_order[atomicAdd(&rbase[last + 1], 1)] = (int32_t)t;
    }
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* Launcher                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

extern "C" mokResult_t mok_fwd_layout_launch(const mok_fwd_local_params_t *p, void *stream) {
  if (!p || !p->err || !p->status || !p->offsets || !p->shared_offsets || !p->slot_row ||
      !p->ctx_header || !p->ctx_slot_row || !p->ctx_offsets || (p->T > 0 && !p->topk_idx) ||
      (p->row_tok && (!p->row_w || (p->T > 0 && !p->topk_w))) || (!p->red_pre != !p->red_order) ||
      (p->n_counters > 0 && !p->counters))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "layout launch: NULL buffer");
  if (p->E < 1 || p->E > MOK_MAX_EXPERTS || p->K < 1 || p->K > MOK_MAX_TOP_K ||
      p->T < 0 || p->T * p->K >= INT32_MAX || p->capacity_rows >= INT32_MAX)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "layout launch: E = %lld (1..%d), K = %lld (1..%d), T = %lld out of range",
                    (long long)p->E, MOK_MAX_EXPERTS, (long long)p->K, MOK_MAX_TOP_K,
                    (long long)p->T);
  if (!p->layout_scratch) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "layout launch: NULL buffer");
  const size_t smem = ll_smem_bytes(p->E);
  const unsigned ctas = (unsigned)mok_ll_ctas(p->T);
  const size_t smem2 = (size_t)(5 * p->E + 5) * sizeof(int32_t);
  cudaError_t e =
      cudaFuncSetAttribute(ll_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e == cudaSuccess) {
    ll_count_kernel<<<ctas, LL_THREADS, smem, (cudaStream_t)stream>>>(*p);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) {
    ll_finish_kernel<<<ctas, LL_THREADS, smem2, (cudaStream_t)stream>>>(*p);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "layout kernel launch (E = %lld, %u CTAs, %zu bytes of "
                    "shared memory): %s", (long long)p->E, ctas, smem, cudaGetErrorString(e));
  return MOK_SUCCESS;
}
