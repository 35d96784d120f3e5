/*
 * ep.cu: the kernels of an expert-parallel layer's forward around the transport (comm.h,
 * "expert-parallel layers"; the host side is src/gpu/forward_ep.c). On each rank, after the
 * transport's layout (rows of each expert in (source rank, token, slot) order, unpadded):
 *
 *   prep      the layout's verdict: status (1 when every rank's routing and row count are
 *             valid), the local layout (offsets of this rank's experts, the shared expert's
 *             {0, T}), and the router weight and source of the rows of this rank's own tokens
 *             (dispatch writes those of the other ranks' tokens into this rank's window)
 *   (dispatch: the transport's kernel, MOK_TP_DISPATCH, with topk_w)
 *   gather    xg[row] = recv_x[src] or x[t], in layout order: the A of the gate/up GEMM
 *             (fp8-block: the e4m3 rows and scales, from the received rows or this rank's
 *             quantized x, ep_gather_fp8_kernel; MXFP8: the same bytes, e4m3 rows and E8M0
 *             scales, dequantized into bf16 xg, ep_gather_mx_kernel)
 *   (the grouped GEMMs of the W = 1 chain on this rank's experts: yk [rows, H]; the shared
 *   expert on this rank's tokens: ys)
 *   combine   a signal that this rank's yk (the window's yk region: the forward's expert
 *             outputs, the backward's dxk rows and, in yk_w, their router-weight gradients) is
 *             complete, then the wait for every rank's
 *   reduce    y[t] = bf16(ys[t] + Σ_k yk(t, k)), slot order: the W = 1 reduce's additions
 *             (forward/rows.cuh), with each slot's row read where its expert rank wrote it (the
 *             pull: one pass over the remote rows)
 *
 * EP-invariance: an expert's rows are the rows of the W = 1 layer over the ranks' tokens
 * concatenated in rank order, in the same order, and each GEMM output row depends only on its
 * own A row; the reduce adds the same bf16 rows in the same order. So W ranks give bitwise the
 * W = 1 layer's y.
 *
 * Invalid calls (bad routing on any rank, or more rows for some rank than its capacity) compute
 * nothing on any rank: every rank derives the same verdict from the all-gathered layout; the
 * failing rank reports the detail and the others name that rank (mok_ws_error_t). Every rank
 * still signals every counter, so nobody waits for rows that never come.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/context.h"
#include "cuda/comm/comm.h"
#include "cuda/comm/layout.cuh"
#include "cuda/comm/transport.cuh"
#include "cuda/error_word.cuh"
#include "cuda/forward/rows.cuh"
#include "cuda/quant/quantize.cuh"

#define EP_THREADS 256
#define EP_REDUCE_BATCH 8 /* slots whose rows the reduce loads before adding them */
#define EP_BAD_T_MAX (-2) /* ep_verdict: a rank's layer has another max_tokens (*bad_rows) */

// The call's verdict, the same on every rank: the layout valid and no rank above capacity.
// *bad_rank: the first rank at fault (-1 when none), *bad_code its slot status (LAYOUT_BAD_*, or
// EP_BAD_T_MAX with its max_tokens in *bad_rows), *bad_rows its rows when over capacity.
__device__ __forceinline__ int ep_verdict(const mok_tp_params_t &p, int *bad_rank, int *bad_code,
                                          int *bad_rows) {
  *bad_rank = -1, *bad_code = 1, *bad_rows = 0;
  if (*p.lay.valid != 1) {
    // The layout was invalid: the first source whose all-gathered status says so (header int 3
    // after the E + W counts of its slot, this call's parity).
    const int64_t S = p.win.slot_ints, B = p.E + p.nranks;
    const int32_t *slots =
        (const int32_t *)(p.peer[p.rank] + p.win.slots) + (tp_layout_epoch(p) & 1) * p.nranks * S;
    for (int s = 0; s < p.nranks && *bad_rank < 0; s++) {
      const int32_t code = tp_ld_peer_i32(slots + s * S + B + 3);
      if (code != 1) *bad_rank = s, *bad_code = code;
    }
    // Every status valid: a rank whose layer was made for another max_tokens (header int 1),
    // which the layout refuses too.
    for (int s = 0; s < p.nranks && *bad_rank < 0; s++) {
      const int32_t t_max = tp_ld_peer_i32(slots + s * S + B + 1);
      if (t_max != p.T_max) *bad_rank = s, *bad_code = EP_BAD_T_MAX, *bad_rows = t_max;
    }
    return 0;
  }
  for (int r = 0; r < p.nranks; r++)
    if (p.lay.rank_rows[r] > p.R) {
      *bad_rank = r, *bad_rows = p.lay.rank_rows[r];
      return 0;
    }
  return 1;
}

// A forward's context header (block 0, all threads): magic once the call is valid, the routing
// hash of src/cuda/forward/layout.cu (an order-free sum), so the W = 1 context check serves.
__device__ __forceinline__ void ep_write_header(const mok_tp_params_t &p, int ok) {
  __shared__ unsigned long long s_hash;
  if (threadIdx.x == 0) s_hash = 0;
  __syncthreads();
  uint64_t hash = 0;
  for (int64_t i = threadIdx.x; i < p.T * p.K; i += blockDim.x)
    hash += mok_ws_routing_mix((uint64_t)i, p.topk_idx[i]);
  for (int o = 16; o > 0; o >>= 1) hash += __shfl_xor_sync(0xFFFFFFFFu, hash, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(&s_hash, (unsigned long long)hash);
  __syncthreads();
  if (threadIdx.x == 0) {
    mok_ctx_header_t *h = (mok_ctx_header_t *)p.ctx_header;
    h->layer_id = p.layer_id;
    h->num_tokens = p.T;
    h->routing_hash = s_hash;
    h->mode = p.context_mode;
    h->magic = ok ? MOK_CTX_MAGIC : 0;
  }
}

__global__ void __launch_bounds__(EP_THREADS)
    ep_prep_kernel(const __grid_constant__ mok_tp_params_t p) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    int bad_rank, bad_code, bad_rows;
    s_ok = ep_verdict(p, &bad_rank, &bad_code, &bad_rows);
    if (blockIdx.x == 0) {
      mok_ws_error_t *err = (mok_ws_error_t *)p.layer_err;
      *p.status = s_ok;
      p.shared_offsets[0] = 0;
      p.shared_offsets[1] = s_ok ? (int32_t)p.T : 0;
      if (!s_ok && bad_code == EP_BAD_T_MAX) {
        mok_ws_record_error(err, MOK_ERROR_INVALID_VALUE, MOK_WS_ERR_PEER_SHAPE, 0, bad_rows,
                            bad_rank, p.T_max);
      } else if (!s_ok && bad_rows > 0) {
        if (bad_rank == p.rank)
          mok_ws_record_error(err, MOK_ERROR_CAPACITY_OVERFLOW, MOK_WS_ERR_CAPACITY, 0, 0,
                              bad_rows, p.R);
        else
          mok_ws_record_error(err, MOK_ERROR_CAPACITY_OVERFLOW, MOK_WS_ERR_PEER_CAPACITY, 0,
                              bad_rows, bad_rank, p.R);
      } else if (!s_ok && bad_rank >= 0 && bad_rank != p.rank) {
        // This rank's own fault is reported where it was found (the layout's bad slot in the
        // transport's error word, the context check's mismatch in the layer's).
        if (bad_code == LAYOUT_BAD_CONTEXT)
          mok_ws_record_error(err, MOK_ERROR_CONTEXT_MISMATCH, MOK_WS_ERR_PEER_CONTEXT, 0, 0,
                              bad_rank, 0);
        else
          mok_ws_record_error(err, MOK_ERROR_INVALID_ROUTING, MOK_WS_ERR_PEER_ROUTING, 0, 0,
                              bad_rank, 0);
      }
    }
  }
  __syncthreads();
  const int ok = s_ok;
  const int64_t EL = p.EL;
  if (blockIdx.x == 0) {
    for (int64_t e = threadIdx.x; e <= EL; e += blockDim.x) {
      const int32_t o = !ok ? 0
                        : e < EL ? p.lay.expert_start[p.rank * EL + e]
                                 : p.lay.rank_rows[p.rank];
      p.offsets[e] = o;
      if (p.ctx_offsets) p.ctx_offsets[e] = o;
    }
    if (p.ctx_header) ep_write_header(p, ok);
    if (p.tile_pre) {  // the fused forward's row tiles (MOK_FC_TILE_M rows) per local expert
      __syncthreads();
      if (threadIdx.x == 0) {
        int32_t pre = 0;
        for (int64_t e = 0; e < EL; e++) {
          p.tile_pre[e] = pre;
          pre += (p.offsets[e + 1] - p.offsets[e] + MOK_FC_TILE_M - 1) / MOK_FC_TILE_M;
        }
        p.tile_pre[EL] = pre;
      }
    }
  }
  if (!ok) return;
  // The rows of this rank's own tokens on this rank's experts (the others' come with dispatch).
  const int64_t n = p.T * p.K;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int32_t row = p.lay.slot_row[i];
    if (row >= 0 && p.topk_idx[i] / EL == p.rank)
      tp_put_row_map(p, p.rank, row, p.topk_w[i], -(int32_t)(i / p.K) - 1);
  }
}

// One warp per row: xg[row] = recv_x[src] (a token of another rank, landed here) or x[t].
__global__ void __launch_bounds__(EP_THREADS)
    ep_gather_kernel(const __grid_constant__ mok_tp_params_t p) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = p.offsets[p.EL], H8 = p.H / 8;
  const int32_t *row_src = (const int32_t *)(p.peer[p.rank] + p.win.row_src);
  const uint4 *recv = (const uint4 *)(p.peer[p.rank] + p.win.recv_x);
  const uint4 *x = (const uint4 *)p.x;
  uint4 *xg = (uint4 *)p.xg;
  const uint4 *recv2 = (const uint4 *)(p.peer[p.rank] + p.win.recv_x2);
  const uint4 *x2 = (const uint4 *)p.x2;
  uint4 *xg2 = (uint4 *)p.xg2;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows;
       r += warps) {
    const int32_t src = tp_ld_peer_i32(row_src + r);
    const uint4 *from = src >= 0 ? recv + (int64_t)src * H8 : x + (int64_t)(-src - 1) * H8;
    for (int64_t c = lane; c < H8; c += 32)
      xg[r * H8 + c] = src >= 0 ? tp_ld_peer_v4(from + c) : tp_ld_input_v4(from + c);
    if (p.xg2) {  // the backward's dy rows, from recv_x2 or dy
      const uint4 *from2 = src >= 0 ? recv2 + (int64_t)src * H8 : x2 + (int64_t)(-src - 1) * H8;
      for (int64_t c = lane; c < H8; c += 32)
        xg2[r * H8 + c] = src >= 0 ? tp_ld_peer_v4(from2 + c) : tp_ld_input_v4(from2 + c);
    }
  }
}

// fp8-block, one warp per row: rq[row] = the e4m3 row of its token, from recv_x (a token of
// another rank: its H bytes, then its scales) or this rank's xq, and rq_s[b * rs_ld + row] its
// scales: the bytes the W = 1 layer copies from each token's quantized row.
__global__ void __launch_bounds__(EP_THREADS)
    ep_gather_fp8_kernel(const __grid_constant__ mok_tp_params_t p, uint8_t *rq, float *rq_s,
                         int64_t rs_ld) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = p.offsets[p.EL], H16 = p.H / 16, nb = p.H / 128;
  const int32_t *row_src = (const int32_t *)(p.peer[p.rank] + p.win.row_src);
  const char *recv = p.peer[p.rank] + p.win.recv_x;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows;
       r += warps) {
    const int32_t src = tp_ld_peer_i32(row_src + r);
    const int64_t t = -(int64_t)src - 1;  // this rank's token, when src < 0
    uint4 *to = (uint4 *)(rq + r * p.H);
    if (src >= 0) {
      const char *from = recv + (int64_t)src * p.H * 2;
      for (int64_t c = lane; c < H16; c += 32) to[c] = tp_ld_peer_v4(from + c * 16);
      const float *s = (const float *)(from + p.H);
      for (int64_t b = lane; b < nb; b += 32) rq_s[b * rs_ld + r] = __ldcg(s + b);
    } else {
      const char *from = (const char *)p.xq + t * p.H;
      for (int64_t c = lane; c < H16; c += 32) to[c] = tp_ld_input_v4(from + c * 16);
      for (int64_t b = lane; b < nb; b += 32) rq_s[b * rs_ld + r] = __uint_as_float(p.xq_s[b * p.xq_s_ld + t]);
    }
  }
}

// MXFP8, one warp per row: xg[row] = the bf16 values of its token's MXFP8 row (e4m3 bytes times
// their E8M0 scales, quant_mx_dequant8: what mok_mx_qdq_rows_launch gives for the token's x), from
// recv_x (a token of another rank: its H bytes, then its H / 128 words of four scales) or this
// rank's xq and xq_s (the words of mok_mx_quantize_rows_launch). 16 elements per lane and step:
// half a 1x32 block, one 16-byte load of e4m3.
__global__ void __launch_bounds__(EP_THREADS)
    ep_gather_mx_kernel(const __grid_constant__ mok_tp_params_t p) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = p.offsets[p.EL], H16 = p.H / 16, H8 = p.H / 8;
  const int32_t *row_src = (const int32_t *)(p.peer[p.rank] + p.win.row_src);
  const char *recv = p.peer[p.rank] + p.win.recv_x;
  uint4 *xg = (uint4 *)p.xg;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows;
       r += warps) {
    const int32_t src = tp_ld_peer_i32(row_src + r);
    const int64_t t = -(int64_t)src - 1;  // this rank's token, when src < 0
    const char *from = src >= 0 ? recv + (int64_t)src * p.H * 2 : (const char *)p.xq + t * p.H;
    for (int64_t c = lane; c < H16; c += 32) {  // elements 16 c .. 16 c + 15: block c / 2
      uint4 q;
      uint32_t word;
      if (src >= 0) {
        q = tp_ld_peer_v4(from + c * 16);
        word = (uint32_t)tp_ld_peer_i32((const int32_t *)(from + p.H) + c / 8);
      } else {
        q = tp_ld_input_v4(from + c * 16);
        word = p.xq_s[(c / 8) * p.xq_s_ld + t];
      }
      const float scale = quant_e8m0_scale((word >> (8 * ((c / 2) % 4))) & 0xFFu);
      xg[r * H8 + 2 * c] = quant_mx_dequant8(make_uint2(q.x, q.y), scale);
      xg[r * H8 + 2 * c + 1] = quant_mx_dequant8(make_uint2(q.z, q.w), scale);
    }
  }
}

// The combine of a layer: nothing moves (the pull: the home ranks' reduce reads the rows where
// this rank wrote them). Each CTA signals every rank that this rank's yk and yk_w, written by the
// kernels before this one on its stream, are complete (the release covers them), then waits for
// every rank's signal.
__global__ void __launch_bounds__(TP_THREADS, 1)
    ep_combine_kernel(const __grid_constant__ mok_tp_params_t p) {
  const uint64_t epoch = tp_epoch_begin(p, TP_EPOCH_COMBINE);
  tp_cta_signal_ranks(p, p.win.comb_ctr);
  const uint64_t *ctr = (const uint64_t *)(p.peer[p.rank] + p.win.comb_ctr);
  tp_cta_wait_ranks(ctr, epoch, p, MOK_TP_WAIT_COMBINE);
  tp_epoch_end(p, TP_EPOCH_COMBINE, epoch);
}

// y[t] = bf16(ys[t] + yk(t, 0) + ... + yk(t, K-1)): rows.cuh's additions in slot order, each
// slot's row read in the yk region of its expert rank's window at the slot's row there
// (slot_row), the backward's router-weight gradient in its yk_w region. A warp per token.
__global__ void __launch_bounds__(EP_THREADS)
    ep_reduce_kernel(const __grid_constant__ mok_tp_params_t p) {
  // A forward whose waits timed out (the combine came after them) has wrong rows: its context
  // must not serve a backward (mok_layer_recover's contract).
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.ctx_header &&
      *(volatile int32_t *)&p.err->code == MOK_ERROR_TIMEOUT)
    ((mok_ctx_header_t *)p.ctx_header)->magic = 0;
  if (!*p.status) return;
  const int lane = threadIdx.x & 31;
  const int64_t K = p.K, H8 = p.H / 8;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t t = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < p.T;
       t += warps) {
    const float4 *ys_t = p.ys ? (const float4 *)(p.ys + t * p.H) : NULL;
    uint4 *y_t = (uint4 *)p.y + t * H8;
    if (p.dtopk_w)  // the backward: each slot's router-weight gradient, 0 for an empty slot
      for (int64_t k = lane; k < K; k += 32) {
        const int32_t row = p.lay.slot_row[t * K + k];
        const int d = row < 0 ? p.rank : (int)(p.topk_idx[t * K + k] / p.EL);
        p.dtopk_w[t * K + k] =
            row < 0 ? 0.0f : __ldcg((const float *)(p.peer[d] + p.win.yk_w) + row);
      }
    for (int64_t c = lane; c < H8; c += 32) {
      float acc[8];
      rl_load_ys(ys_t, c, true, acc);
      // Slot order is the order of the fp32 additions; the rows of 8 slots are loaded first, so
      // that their (remote) loads wait on one round trip, then added in order.
      for (int64_t k0 = 0; k0 < K; k0 += EP_REDUCE_BATCH) {
        uint4 v[EP_REDUCE_BATCH];
        bool have[EP_REDUCE_BATCH];
#pragma unroll
        for (int j = 0; j < EP_REDUCE_BATCH; j++) {
          const int64_t k = k0 + j;
          const int32_t row = k < K ? p.lay.slot_row[t * K + k] : -1;
          have[j] = row >= 0;  // empty slots are skipped, not added as zeros
          if (!have[j]) continue;
          const int d = (int)(p.topk_idx[t * K + k] / p.EL);  // the expert's rank
          v[j] = tp_ld_peer_v4((const uint4 *)(p.peer[d] + p.win.yk) + (int64_t)row * H8 + c);
        }
#pragma unroll
        for (int j = 0; j < EP_REDUCE_BATCH; j++)
          if (have[j]) rl_add_bf16x8(acc, v[j]);
      }
      y_t[c] = rl_pack_bf16x8(acc);
    }
  }
}

static mokResult_t ep_launched(void) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? MOK_SUCCESS : MOK_ERROR_CUDA;
}

static int ep_blocks(int64_t work_per_block, int64_t work) {
  int64_t b = (work + work_per_block - 1) / work_per_block;
  return (int)(b < 1 ? 1 : b > 1024 ? 1024 : b);
}

extern "C" mokResult_t mok_ep_preload(void) {
  cudaFuncAttributes a;
  const cudaError_t e[] = {cudaFuncGetAttributes(&a, ep_prep_kernel),
                           cudaFuncGetAttributes(&a, ep_gather_kernel),
                           cudaFuncGetAttributes(&a, ep_gather_fp8_kernel),
                           cudaFuncGetAttributes(&a, ep_gather_mx_kernel),
                           cudaFuncGetAttributes(&a, ep_combine_kernel),
                           cudaFuncGetAttributes(&a, ep_reduce_kernel)};
  for (cudaError_t x : e)
    if (x != cudaSuccess) {
      cudaGetLastError();
      return MOK_ERROR_CUDA;
    }
  return mok_tp_preload();
}

extern "C" mokResult_t mok_ep_prep_launch(const mok_tp_params_t *p, void *stream) {
  if (!p || !p->status || !p->offsets || !p->shared_offsets || !p->layer_err ||
      (p->T > 0 && (!p->topk_w || !p->topk_idx)))
    return MOK_ERROR_NULL_POINTER;
  ep_prep_kernel<<<ep_blocks(EP_THREADS, p->T * p->K), EP_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return ep_launched();
}

extern "C" mokResult_t mok_ep_gather_launch(const mok_tp_params_t *p, void *stream) {
  if (!p || !p->offsets || !p->xg || (p->T > 0 && !p->x)) return MOK_ERROR_NULL_POINTER;
  ep_gather_kernel<<<ep_blocks(EP_THREADS / 32, p->R), EP_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return ep_launched();
}

extern "C" mokResult_t mok_ep_gather_fp8_launch(const mok_tp_params_t *p, void *rq, float *rq_s,
                                                int64_t rs_ld, void *stream) {
  if (!p || !p->offsets || !rq || !rq_s || (p->T > 0 && (!p->xq || !p->xq_s)))
    return MOK_ERROR_NULL_POINTER;
  if (p->H % 128 != 0 || rs_ld < p->R || (p->T > 0 && p->xq_s_ld < p->T))
    return MOK_ERROR_INVALID_SHAPE;
  ep_gather_fp8_kernel<<<ep_blocks(EP_THREADS / 32, p->R), EP_THREADS, 0,
                         (cudaStream_t)stream>>>(*p, (uint8_t *)rq, rq_s, rs_ld);
  return ep_launched();
}

extern "C" mokResult_t mok_ep_gather_mx_launch(const mok_tp_params_t *p, void *stream) {
  if (!p || !p->offsets || !p->xg || (p->T > 0 && (!p->xq || !p->xq_s)))
    return MOK_ERROR_NULL_POINTER;
  if (p->H % 128 != 0 || (p->T > 0 && p->xq_s_ld < p->T)) return MOK_ERROR_INVALID_SHAPE;
  ep_gather_mx_kernel<<<ep_blocks(EP_THREADS / 32, p->R), EP_THREADS, 0,
                        (cudaStream_t)stream>>>(*p);
  return ep_launched();
}

extern "C" mokResult_t mok_ep_combine_launch(const mok_tp_params_t *p, void *stream) {
  if (!p) return MOK_ERROR_NULL_POINTER;
  if (p->win.yk_w <= p->win.yk) return MOK_ERROR_INVALID_VALUE;  // a window without yk_rows
  if (p->num_ctas < 1 || p->nranks > MOK_MAX_RANKS) return MOK_ERROR_INVALID_VALUE;
  ep_combine_kernel<<<p->num_ctas, TP_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return ep_launched();
}

extern "C" mokResult_t mok_ep_reduce_launch(const mok_tp_params_t *p, void *stream) {
  if (!p || !p->status || (p->T > 0 && !p->y)) return MOK_ERROR_NULL_POINTER;
  if (p->win.yk_w <= p->win.yk) return MOK_ERROR_INVALID_VALUE;  // a window without yk_rows
  if (p->T == 0) return MOK_SUCCESS;
  ep_reduce_kernel<<<ep_blocks(EP_THREADS / 32, p->T), EP_THREADS, 0, (cudaStream_t)stream>>>(*p);
  return ep_launched();
}
