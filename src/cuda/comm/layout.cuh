/*
 * comm/layout.cuh: the cross-rank routing layout on the GPU (docs/design.md, "The transport"),
 * equal entry for entry to src/cpu/layout.c, computed by one CTA per rank with no atomics on
 * anything that orders rows:
 *
 *   1. Local ranks. Tokens go through in rounds of one token per thread. Per warp and per bin
 *      (E experts, then W destination ranks) a 32-bit mask marks the lanes whose token uses the
 *      bin; a prefix over warps plus popc(mask & lanes below) gives each (token, slot) its rank
 *      among this rank's rows of that expert, in token order, and each token its rank among the
 *      tokens this rank sends to d. (atomicOr only sets bits: the masks do not depend on timing.)
 *   2. All-gather. The bin totals (rows per expert, tokens per destination) and a header go into
 *      slot [parity][me] of every rank's window, then a flag = epoch (release, system scope).
 *   3. Global layout. Every rank reads all W slots and derives the same expert segments (padded
 *      to tile_m, expert order within a rank) and receive-buffer sizes; this rank's rows of
 *      expert e start at expert_start[e] + rows of e from lower source ranks, its tokens for d at
 *      the tokens lower source ranks send to d. A second pass adds those bases.
 *
 * Rows of an expert end up ordered by (source rank, token, slot) and receive buffers by (source
 * rank, token), as in the CPU layout (an expert appears once per token, so (token) order within a
 * source is (token, slot) order).
 *
 * Bad routing (an id outside [-1, E) or an expert twice in a token) is recorded in the error
 * word; the slot then counts as empty, and the all-gathered status makes every rank mark the
 * layout invalid, so no rank moves data but every rank still signals: nobody hangs.
 *
 * Slot header ints after the E + W counts: T, T_max, CTAs of the run kernel, status (1 = valid,
 * LAYOUT_BAD_*).
 */
#ifndef MOK_CUDA_LAYOUT_DEVICE_CUH
#define MOK_CUDA_LAYOUT_DEVICE_CUH

#include <stdint.h>

#include "cuda/comm/transport.cuh"

#define LAYOUT_THREADS 512
#define LAYOUT_WARPS (LAYOUT_THREADS / 32)
#define LAYOUT_HEADER_INTS 4
// A source's status in its slot header: 1 valid, else why not.
#define LAYOUT_BAD_ROUTING 0
#define LAYOUT_BAD_CONTEXT 2  // a layer's backward: that rank's context did not match its call

static_assert(LAYOUT_THREADS % 32 == 0, "whole warps");

// Shared memory of the layout CTA for B = E + W bins: masks and warp prefixes [LAYOUT_WARPS, B],
// running totals [B], all-gathered slots [W, slot_ints], bases [B].
__host__ __device__ inline size_t layout_smem_bytes(int64_t E, int W, int64_t slot_ints) {
  const int64_t B = E + W;
  return (size_t)(2 * LAYOUT_WARPS * B + B + W * slot_ints + B) * sizeof(int32_t);
}

// Expert of slot k of token t, or -1 when the slot is empty or invalid: an id outside [-1, E),
// or an expert that an earlier slot of the same token already used (the first one stands).
// With `report`, an invalid id goes to the error word.
__device__ __forceinline__ int32_t layout_slot_expert(const mok_tp_params_t &p, int64_t t, int64_t k,
                                                      int report) {
  const int32_t *row = p.topk_idx + t * p.K;
  const int32_t e = row[k];
  if (e == -1) return -1;
  if (e < -1 || e >= p.E) {
    if (report)
      tp_record_error(p.err, MOK_ERROR_INVALID_ROUTING, 0, p.rank, 0, 0, 1, (uint64_t)p.E, t, k, e);
    return -1;
  }
  for (int64_t j = 0; j < k; j++) {
    if (row[j] == e) {
      if (report)
        tp_record_error(p.err, MOK_ERROR_INVALID_ROUTING, 0, p.rank, 0, 0, 2, (uint64_t)j, t, k, e);
      return -1;
    }
  }
  return e;
}

// Step 1: local ranks into slot_row and token_pos (before the bases), totals into `running`.
// Returns 0 in every thread when this rank's routing had an invalid slot.
__device__ __forceinline__ int layout_local_ranks(const mok_tp_params_t &p, uint32_t *mask,
                                                  int32_t *pre, int32_t *running) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = p.nranks;
  const int64_t E = p.E, K = p.K, B = E + W;
  const uint32_t lt = (1u << lane) - 1u;
  int ok = 1;
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) running[b] = 0;
  for (int64_t base = 0; base < p.T; base += LAYOUT_THREADS) {
    const int64_t t = base + threadIdx.x;
    const int has = t < p.T;
    for (int64_t i = threadIdx.x; i < LAYOUT_WARPS * B; i += blockDim.x) mask[i] = 0;
    __syncthreads();
    if (has) {
      for (int64_t k = 0; k < K; k++) {
        const int32_t e = layout_slot_expert(p, t, k, 1);
        if (e < 0) {
          if (p.topk_idx[t * K + k] != -1) ok = 0;
          continue;
        }
        atomicOr(&mask[warp * B + e], 1u << lane);
        atomicOr(&mask[warp * B + E + e / p.EL], 1u << lane);
      }
    }
    __syncthreads();
    for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
      int32_t acc = running[b];
      for (int w = 0; w < LAYOUT_WARPS; w++) {
        pre[w * B + b] = acc;
        acc += __popc(mask[w * B + b]);
      }
      running[b] = acc;
    }
    __syncthreads();
    if (has) {
      for (int64_t k = 0; k < K; k++) {
        const int32_t e = layout_slot_expert(p, t, k, 0);
        p.lay.slot_row[t * K + k] =
            e < 0 ? -1 : pre[warp * B + e] + __popc(mask[warp * B + e] & lt);
      }
      for (int d = 0; d < W; d++) {
        const uint32_t m = mask[warp * B + E + d];
        p.lay.token_pos[t * W + d] =
            (m >> lane) & 1u ? pre[warp * B + E + d] + __popc(m & lt) : -1;
      }
    }
    __syncthreads();  // masks are cleared next round
  }
  return __syncthreads_and(ok);
}

// The layout of one call (see the banner). One CTA of LAYOUT_THREADS threads.
__device__ __forceinline__ void layout_run(const mok_tp_params_t &p, int32_t *smem) {
  const int W = p.nranks, me = p.rank;
  const int64_t E = p.E, EL = p.EL, B = E + W, S = p.win.slot_ints;
  uint32_t *mask = (uint32_t *)smem;               // [LAYOUT_WARPS, B]
  int32_t *pre = smem + LAYOUT_WARPS * B;          // [LAYOUT_WARPS, B]
  int32_t *running = pre + LAYOUT_WARPS * B;       // [B]
  int32_t *slots = running + B;                    // [W, S]
  int32_t *base = slots + W * S;                   // [B]
  __shared__ int32_t s_valid;

  const int ok = layout_local_ranks(p, mask, pre, running);
  const int local_ok = !p.local_ok || *p.local_ok == 1;

  // 2. All-gather: our totals and header into slot [parity][me] of every rank, then the flags.
  const uint64_t epoch = tp_epoch_begin(p, TP_EPOCH_LAYOUT), parity = epoch & 1;
  for (int d = 0; d < W; d++) {
    int32_t *dst = (int32_t *)(p.peer[d] + p.win.slots) + (parity * W + me) * S;
    for (int64_t i = threadIdx.x; i < S; i += blockDim.x) {
      int32_t v = 0;
      if (i < B) v = running[i];
      else if (i == B) v = (int32_t)p.T;
      else if (i == B + 1) v = (int32_t)p.T_max;
      else if (i == B + 2) v = p.num_ctas;
      else if (i == B + 3) v = !ok ? LAYOUT_BAD_ROUTING : local_ok ? 1 : LAYOUT_BAD_CONTEXT;
      dst[i] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int d = 0; d < W; d++)
      ptx_st_release_sys_u64((uint64_t *)(p.peer[d] + p.win.flags) + parity * W + me, epoch);
  }
  int arrived = 1;
  if (threadIdx.x < (unsigned)W) {
    const uint64_t *flag = (const uint64_t *)(p.peer[me] + p.win.flags) + parity * W + threadIdx.x;
    arrived = tp_wait_geq(flag, epoch, p, MOK_TP_WAIT_LAYOUT, threadIdx.x);
  }
  arrived = __syncthreads_and(arrived);

  // 3. Global layout, the same on every rank.
  if (arrived) {
    const int32_t *src = (const int32_t *)(p.peer[me] + p.win.slots) + parity * W * S;
    for (int64_t i = threadIdx.x; i < W * S; i += blockDim.x) slots[i] = tp_ld_peer_i32(src + i);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int valid = arrived;
    for (int s = 0; s < W && valid; s++) {
      const int32_t *h = slots + s * S + B;
      valid = h[3] == 1 && h[1] == p.T_max && h[0] >= 0 && h[0] <= h[1] && h[2] > 0;
    }
    s_valid = valid;
    *p.lay.valid = valid;
  }
  __syncthreads();
  const int valid = s_valid;
  for (int s = threadIdx.x; s < W; s += blockDim.x)
    p.lay.num_ctas[s] = arrived ? slots[s * S + B + 2] : 1;
  for (int64_t i = threadIdx.x; i < W * E; i += blockDim.x)
    p.lay.count[i] = valid ? slots[(i / E) * S + i % E] : 0;
  for (int64_t i = threadIdx.x; i < W * W; i += blockDim.x)
    p.lay.token_count[i] = valid ? slots[(i / W) * S + E + i % W] : 0;
  // Segments: thread r places rank r's experts; bases of our rows and tokens.
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    int32_t cursor = 0, recv = 0;
    for (int64_t e = r * EL; e < (r + 1) * EL; e++) {
      int32_t rows = 0, lower = 0;
      for (int s = 0; s < W; s++) {
        const int32_t c = valid ? slots[s * S + e] : 0;
        if (s < me) lower += c;
        rows += c;
      }
      p.lay.expert_start[e] = cursor;
      base[e] = cursor + lower;
      cursor += rows + (int32_t)((p.tile_m - rows % p.tile_m) % p.tile_m);
    }
    p.lay.rank_rows[r] = cursor;
    int32_t lower = 0;
    for (int s = 0; s < W; s++) {
      const int32_t c = valid ? slots[s * S + E + r] : 0;
      if (s < me) lower += c;
      recv += c;
    }
    p.lay.recv_tokens[r] = recv;
    base[E + r] = lower;
  }
  __syncthreads();

  // Second pass: add the bases (or mark everything empty when the layout is invalid).
  const int64_t K = p.K;
  for (int64_t t = threadIdx.x; t < p.T; t += blockDim.x) {
    for (int64_t k = 0; k < K; k++) {
      const int32_t r = p.lay.slot_row[t * K + k];
      if (r >= 0) {
        const int32_t e = layout_slot_expert(p, t, k, 0);
        p.lay.slot_row[t * K + k] = valid ? r + base[e] : -1;
      }
    }
    for (int d = 0; d < W; d++) {
      const int32_t q = p.lay.token_pos[t * W + d];
      if (q >= 0) p.lay.token_pos[t * W + d] = valid ? q + base[E + d] : -1;
    }
  }
  tp_epoch_end(p, TP_EPOCH_LAYOUT, epoch);
}

#endif /* MOK_CUDA_LAYOUT_DEVICE_CUH */
