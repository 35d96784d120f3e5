/*
 * workspace.h: the device memory of a GPU layer with W = 1: the layer's workspace and the saved
 * context, laid out by one function (mok_ws_layout) that compiles as C11 (the host library) and
 * in CUDA files (kernels, tests), so host and device can never disagree.
 *
 * Workspace (the layer's own; cudaMalloc'd by mok_layer_create, mok_layer_workspace_size bytes),
 * R = capacity_rows (routed rows the layer can hold, T_max * K by default):
 *   error          mok_ws_error_t      first asynchronous error since the last mok_layer_check
 *   status         [1] int32           1 when this call's routing was valid; 0: the call does nothing
 *   offsets        [E + 1] int32       rows of expert e are [offsets[e], offsets[e+1]) (no padding)
 *   shared_offsets [2] int32           {0, T}: the one group of the shared GEMMs ({0, 0}: invalid)
 *   slot_row       [T_max, K] int32    row of (token, slot) in expert order, -1 for an empty slot
 *   row_w          [R] fp32            router weight of each row
 *   row_tok        [R] int32           token of each row (the fused forward gathers x through it)
 *   tile_pre       [E + 1] int32       prefix sums of row tiles per expert, ceil(rows_e / 128)
 *   red_pre        [E + 2] int32       the fused forward's reduce order (red_order) by bins: the
 *                                      tokens whose last expert is b - 1 (b = 0: none) are
 *                                      red_order[red_pre[b] .. red_pre[b + 1])
 *   red_order      [T_max] int32       tokens sorted by their last (highest) expert, so that a
 *                                      token's reduce comes after its experts' DOWN tiles
 *   counters       [mok_fc_count] u32  the fused forward's task counters (MOK_FC_*), zeroed by
 *                                      the layout kernel of every call
 *   layout         mok_ll_bytes        the layout kernels' per-CTA partials (mok_ll_*)
 *   xg             [R, H] bf16         gathered token rows, expert order
 *   yk             [R, H] bf16         expert outputs; NOTE: aliases xg (read by the gate/up GEMM,
 *                                      written by the down GEMM, which runs after it on the stream)
 *   a              [R, I] bf16         bf16(w · silu(g) · u)
 *   as             [T_max, Is] bf16    shared-expert activations
 *   ys             [T_max, H] fp32     shared-expert output
 * Backward only (src/gpu/backward.c; forward's regions above are reused as scratch: xg holds the
 * re-gathered x rows, a and as the backward's a = bf16(w · s), ys the shared dxs):
 *   dyg            [R, H] bf16         gathered dy rows, expert order
 *   ds             [R, I] fp32         dy_g · Wd[e]: gradient w.r.t. a
 *   dg, du         [R, I] bf16         SwiGLU backward
 *   dxk            [R, H] bf16         bf16(dg · Wg[e] + du · Wu[e]), one reduction of 2I
 *   dw_row         [R] fp32            Σ_i ds_i · s_i of each row (dtopk_w in expert order)
 *   dss            [T_max, Is] fp32    shared dy · Wsd
 *   dgs, dus       [T_max, Is] bf16    shared SwiGLU backward
 *   dxs            [T_max, H] fp32     shared dgs · Wsg + dus · Wsu; NOTE: aliases ys
 *   g, u           [R, I] bf16         RECOMPUTE mode only: recomputed bf16 g, u
 *   gs, us         [T_max, Is] bf16    RECOMPUTE mode only
 *   wgrad32        [wgrad_stage] fp32  bf16 weight gradients accumulated (wgrad_accumulate = 1)
 *                                      only: one fp32 gradient before bf16(old + g); else empty
 * fp8-block layers only (empty otherwise): GEMM operands in e4m3, each with its 1x128 scales
 * stored K-block major (scale of row r, block b at [b * ld + r], ld = mok_ws_ld4(rows)):
 *   xqt, xqt_s     [T_max, H]          forward: x (the shared expert's A, gathered into xq);
 *                                      backward: dy (the shared ds GEMM's A)
 *   xq, xq_s       [R, H]              forward: x rows (gate/up); backward: dyg (ds), after the
 *                                      RECOMPUTE gate/up's x rows
 *   aq, aq2, aq_s  [R, I] x 2, scales  forward: a (down; aq2 unused); backward: dg, du (dxk,
 *                  [2I/128, ld]        whose two segments share one scale array, du's after dg's)
 *   asq, asq2,     [T_max, Is] x 2     the shared expert's as; dgs, dus
 *   asq_s
 * MXFP8 layers only (empty otherwise): bf16 activations quantize-dequantized (1x32 E8M0 blocks,
 * mok_mx_qdq_rows_launch), which the MXFP8-B GEMMs read as A (the routed rows: xg and a, in place):
 *   xdq            [T_max, H] bf16     forward: x (the shared expert's A; at W = 1 gathered into
 *                                      xg)
 *   xqt, xqt_s     [T_max, H] e4m3,    W > 1 only: x's MXFP8 rows as the dispatch sends them (the
 *                  [H / 128, ld] words  scales four E8M0 bytes to a word: mok_mx_quantize_rows_launch)
 *
 * Context (the caller's, mok_context_size bytes; written by forward, read by backward):
 *   header         mok_ctx_header_t    magic (0 when the call's routing was invalid), layer id, T,
 *                                      routing hash (GPU: Σ mok_ws_routing_mix(i, topk_idx[i]), below)
 *   slot_row       [T_max, K] int32    as in the workspace
 *   offsets        [E + 1] int32
 *   SAVE mode only:
 *   g, u           [R, I] bf16         bf16(g), bf16(u) of each row, expert (layout) order
 *   gs, us         [T_max, Is] bf16    the shared expert's, token order
 * Every region starts at a multiple of 256 bytes (16-byte vector and TMA alignment).
 */
#ifndef MOK_WORKSPACE_H
#define MOK_WORKSPACE_H

#include <stddef.h>
#include <stdint.h>

#include "common/context.h"

#ifdef __CUDACC__
#define MOK_WS_FN static inline __host__ __device__
#else
#define MOK_WS_FN static inline
#endif

/* The error word. `code` is written last, and only while it is 0: the first error stays until
 * mok_layer_check reads and clears it. */
typedef enum {
  MOK_WS_ERR_ID_RANGE = 1, /* topk_idx[token][slot] = value is outside [-1, limit = E) */
  MOK_WS_ERR_REPEAT = 2,   /* topk_idx[token][slot] = value, already used by slot `limit` */
  MOK_WS_ERR_CAPACITY = 3, /* value routed rows, capacity limit rows */
  MOK_WS_ERR_CONTEXT = 4,  /* backward: the context's header differs in field `value`
                              (mok_ws_ctx_field_t); token = the header's num_tokens */
  MOK_WS_ERR_TIMEOUT = 5,  /* fused forward: a task waited past the timeout on counter `slot`
                              (MOK_FC_*), which had reached `value` of `limit`; token = the task */
  MOK_WS_ERR_PEER_ROUTING = 6, /* expert parallelism: rank `value`'s routing was invalid (that
                                  rank reports which slot), so no rank computed this call */
  MOK_WS_ERR_PEER_CAPACITY = 7, /* expert parallelism: rank `value` would receive `slot` routed
                                   rows, its capacity is `limit`, so no rank computed this call */
  MOK_WS_ERR_PEER_CONTEXT = 8,  /* expert parallelism: rank `value`'s context did not match its
                                   backward, so no rank computed this backward */
  MOK_WS_ERR_PEER_SHAPE = 9     /* expert parallelism: rank `value`'s layer was created with
                                   max_tokens `slot`, this rank's with `limit` */
} mok_ws_err_kind_t;

/* Which field of the context header told a backward that its context does not match. */
typedef enum {
  MOK_WS_CTX_MAGIC = 1,   /* not written by a forward that completed with valid routing */
  MOK_WS_CTX_LAYER = 2,   /* written by another layer */
  MOK_WS_CTX_TOKENS = 3,  /* written for another number of tokens */
  MOK_WS_CTX_ROUTING = 4, /* written for other topk_idx */
  MOK_WS_CTX_MODE = 5     /* written in another context mode */
} mok_ws_ctx_field_t;

typedef struct {
  int32_t code; /* mokResult_t; 0 while there is none */
  int32_t kind; /* mok_ws_err_kind_t */
  int64_t token, slot, value, limit;
  int64_t pad[3];
} mok_ws_error_t;

typedef enum {
  MOK_WS_ERROR = 0, MOK_WS_STATUS, MOK_WS_OFFSETS, MOK_WS_SHARED_OFFSETS, MOK_WS_SLOT_ROW,
  MOK_WS_ROW_W, MOK_WS_ROW_TOK, MOK_WS_TILE_PRE, MOK_WS_RED_PRE, MOK_WS_RED_ORDER,
  MOK_WS_COUNTERS, MOK_WS_LAYOUT, MOK_WS_XG, MOK_WS_YK, MOK_WS_A, MOK_WS_AS, MOK_WS_YS,
  /* backward */
  MOK_WS_DYG, MOK_WS_DS, MOK_WS_DG, MOK_WS_DU, MOK_WS_DXK, MOK_WS_DW_ROW, MOK_WS_DSS, MOK_WS_DGS,
  MOK_WS_DUS, MOK_WS_DXS, MOK_WS_G, MOK_WS_U, MOK_WS_GS, MOK_WS_US, MOK_WS_WGRAD32,
  /* fp8-block */
  MOK_WS_XQT, MOK_WS_XQT_S, MOK_WS_XQ, MOK_WS_XQ_S, MOK_WS_AQ, MOK_WS_AQ2, MOK_WS_AQ_S,
  MOK_WS_ASQ, MOK_WS_ASQ2, MOK_WS_ASQ_S,
  /* MXFP8 */
  MOK_WS_XDQ,
  MOK_WS_COUNT
} mok_ws_region_t;

typedef enum {
  MOK_CTX_HEADER = 0, MOK_CTX_SLOT_ROW, MOK_CTX_OFFSETS, MOK_CTX_G, MOK_CTX_U, MOK_CTX_GS,
  MOK_CTX_US,
  MOK_CTX_COUNT
} mok_ctx_region_t;

/* What the layout depends on. */
typedef struct {
  int64_t T_max, H, I, Is, E, K;
  int64_t R;    /* capacity_rows */
  int save;     /* context_mode == MOK_CONTEXT_SAVE */
  int64_t wgrad_stage; /* fp32 elements of the wgrad32 region (0: bf16 gradients not accumulated) */
  int fp8;      /* precision == MOK_PRECISION_FP8_BLOCK: the e4m3 operand regions */
  int mx;       /* precision == MOK_PRECISION_MXFP8: the dequantized activation regions */
  int mx_wire;  /* MXFP8 with W > 1 (set by the GPU layer; mok_ws_dims leaves 0): xqt and xqt_s
                   hold the e4m3 rows and E8M0 words the dispatch sends */
} mok_ws_dims_t;

typedef struct {
  size_t ws[MOK_WS_COUNT];   /* byte offsets into the workspace */
  size_t ctx[MOK_CTX_COUNT]; /* byte offsets into the context (SAVE regions: 0 in RECOMPUTE) */
  size_t ws_bytes, ctx_bytes;
} mok_ws_layout_t;

MOK_WS_FN size_t mok_ws_align(size_t x) { return (x + 255) & ~(size_t)255; }
/* The row stride of K-block-major scales of `rows` rows (the fp8 GEMM's a_scale_ld). */
MOK_WS_FN int64_t mok_ws_ld4(int64_t rows) { return (rows + 3) & ~(int64_t)3; }

/* The fused forward's counters (uint32, src/cuda/forward/fused.cu), each counting warpgroup
 * releases (2 per finished tile):
 *   MOK_FC_DOWN      routed DOWN tiles (when the reduce does not follow the reduce order)
 *   MOK_FC_ABORT     nonzero once a wait timed out: every later wait gives up at once
 *   MOK_FC_TICKET    the next task number to hand out (one atomicAdd per task)
 *   MOK_FC_CLAIM     the next token to reduce, a position in red_order or a token (one atomicAdd
 *                    per token, by any warp)
 *   MOK_FC_COMM      expert parallel: the next dispatch unit (one atomicAdd per unit and CTA)
 *   MOK_FC_GU + j    GATE_UP tiles of routed row tile j (tile_pre numbering), j < R/128 + E
 *   mok_fc_sgu + m   SHARED_GATE_UP tiles of token tile m, m < ceil(T_max / 128)
 *   mok_fc_sd + m    SHARED_DOWN tiles of token tile m
 *   mok_fc_dn + e    DOWN tiles of expert e, e < E (when it does) */
enum { MOK_FC_DOWN = 0, MOK_FC_ABORT = 2, MOK_FC_TICKET = 3, MOK_FC_CLAIM = 4, MOK_FC_COMM = 5,
       MOK_FC_GU = 32,
       MOK_FC_TILE_M = 128 };
MOK_WS_FN int64_t mok_fc_sgu(int64_t R, int64_t E) { return MOK_FC_GU + R / MOK_FC_TILE_M + E; }
MOK_WS_FN int64_t mok_fc_token_tiles(int64_t T_max) {
  return (T_max + MOK_FC_TILE_M - 1) / MOK_FC_TILE_M;
}
MOK_WS_FN int64_t mok_fc_sd(int64_t R, int64_t E, int64_t T_max) {
  return mok_fc_sgu(R, E) + mok_fc_token_tiles(T_max);
}
MOK_WS_FN int64_t mok_fc_dn(int64_t R, int64_t E, int64_t T_max) {
  return mok_fc_sd(R, E, T_max) + mok_fc_token_tiles(T_max);
}
MOK_WS_FN int64_t mok_fc_count(int64_t R, int64_t E, int64_t T_max) {
  return mok_fc_dn(R, E, T_max) + E;
}

/* The layout kernels (src/cuda/forward/layout.cu) split a call's T tokens into mok_ll_ctas(T)
 * chunks of mok_ll_chunk(T) tokens, whole rounds of MOK_LL_ROUND (one token per thread), at most
 * MOK_LL_MAX_CTAS chunks. Chunk c leaves its partials in the workspace's layout region:
 *   counts [ctas, E] int32   its rows per expert
 *   last   [ctas, E + 1]     its tokens per bin of the reduce order (red_pre: last expert + 1)
 *   bad    [ctas] u64        its first bad (token, slot) index, ~0 when none
 *   hash   [ctas] u64        its part of the routing hash */
enum { MOK_LL_ROUND = 512, MOK_LL_MAX_CTAS = 128 };
MOK_WS_FN int64_t mok_ll_chunk(int64_t T) {
  const int64_t rounds = T > 0 ? (T + MOK_LL_ROUND - 1) / MOK_LL_ROUND : 1;
  return (rounds + MOK_LL_MAX_CTAS - 1) / MOK_LL_MAX_CTAS * MOK_LL_ROUND;
}
MOK_WS_FN int64_t mok_ll_ctas(int64_t T) {
  const int64_t chunk = mok_ll_chunk(T);
  return T > 0 ? (T + chunk - 1) / chunk : 1;
}
/* The int32 index of `bad` in the layout region of a call split into `ctas` chunks: after the
 * counts and the bins, rounded up to 16 bytes (`hash` follows `bad`). */
MOK_WS_FN int64_t mok_ll_bad_index(int64_t ctas, int64_t E) {
  return (ctas * (2 * E + 1) + 3) & ~(int64_t)3;
}
/* Room for every T <= T_max (the chunk count is not monotonic in T: up to MOK_LL_MAX_CTAS chunks
 * of one round, then fewer, longer ones), the bad and hash arrays 16-byte aligned. */
MOK_WS_FN size_t mok_ll_bytes(int64_t T_max, int64_t E) {
  const int64_t rounds = (T_max + MOK_LL_ROUND - 1) / MOK_LL_ROUND;
  const int64_t ctas = rounds < 1 ? 1 : (rounds < MOK_LL_MAX_CTAS ? rounds : MOK_LL_MAX_CTAS);
  return (size_t)ctas * ((size_t)(2 * E + 1) * 4 + 16) + 16;
}

/* One term of the context header's routing hash, Σ_i mok_ws_routing_mix(i, topk_idx[i]) mod 2^64
 * over the call's T K routing entries (an integer sum: any order gives the same hash): splitmix64
 * of (index, id). The forward's layout kernels write it, the backward's context check recomputes
 * it. */
MOK_WS_FN uint64_t mok_ws_routing_mix(uint64_t i, int32_t e) {
  uint64_t z = ((i << 32) | (uint32_t)e) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* The one layout of a GPU layer's workspace and context. */
MOK_WS_FN void mok_ws_layout(const mok_ws_dims_t *d, mok_ws_layout_t *l) {
  const size_t T = (size_t)d->T_max, H = (size_t)d->H, I = (size_t)d->I, Is = (size_t)d->Is,
               E = (size_t)d->E, K = (size_t)d->K, R = (size_t)d->R;
  size_t off = 0;
  l->ws[MOK_WS_ERROR] = off, off = mok_ws_align(off + sizeof(mok_ws_error_t));
  l->ws[MOK_WS_STATUS] = off, off = mok_ws_align(off + 4);
  l->ws[MOK_WS_OFFSETS] = off, off = mok_ws_align(off + (E + 1) * 4);
  l->ws[MOK_WS_SHARED_OFFSETS] = off, off = mok_ws_align(off + 2 * 4);
  l->ws[MOK_WS_SLOT_ROW] = off, off = mok_ws_align(off + T * K * 4);
  l->ws[MOK_WS_ROW_W] = off, off = mok_ws_align(off + R * 4);
  l->ws[MOK_WS_ROW_TOK] = off, off = mok_ws_align(off + R * 4);
  l->ws[MOK_WS_TILE_PRE] = off, off = mok_ws_align(off + (E + 1) * 4);
  l->ws[MOK_WS_RED_PRE] = off, off = mok_ws_align(off + (E + 2) * 4);
  l->ws[MOK_WS_RED_ORDER] = off, off = mok_ws_align(off + T * 4);
  l->ws[MOK_WS_COUNTERS] = off,
  off = mok_ws_align(off + (size_t)mok_fc_count((int64_t)R, (int64_t)E, (int64_t)T) * 4);
  l->ws[MOK_WS_LAYOUT] = off, off = mok_ws_align(off + mok_ll_bytes((int64_t)T, (int64_t)E));
  l->ws[MOK_WS_XG] = off, l->ws[MOK_WS_YK] = off, off = mok_ws_align(off + R * H * 2);
  l->ws[MOK_WS_A] = off, off = mok_ws_align(off + R * I * 2);
  l->ws[MOK_WS_AS] = off, off = mok_ws_align(off + T * Is * 2);
  l->ws[MOK_WS_YS] = off, off = mok_ws_align(off + (Is > 0 ? T * H * 4 : 0));
  l->ws[MOK_WS_DYG] = off, off = mok_ws_align(off + R * H * 2);
  l->ws[MOK_WS_DS] = off, off = mok_ws_align(off + R * I * 4);
  l->ws[MOK_WS_DG] = off, off = mok_ws_align(off + R * I * 2);
  l->ws[MOK_WS_DU] = off, off = mok_ws_align(off + R * I * 2);
  l->ws[MOK_WS_DXK] = off, off = mok_ws_align(off + R * H * 2);
  l->ws[MOK_WS_DW_ROW] = off, off = mok_ws_align(off + R * 4);
  l->ws[MOK_WS_DSS] = off, off = mok_ws_align(off + T * Is * 4);
  l->ws[MOK_WS_DGS] = off, off = mok_ws_align(off + T * Is * 2);
  l->ws[MOK_WS_DUS] = off, off = mok_ws_align(off + T * Is * 2);
  l->ws[MOK_WS_DXS] = l->ws[MOK_WS_YS];
  const size_t rec = d->save ? 0 : 1; /* recomputed g, u live in the workspace */
  l->ws[MOK_WS_G] = off, off = mok_ws_align(off + rec * R * I * 2);
  l->ws[MOK_WS_U] = off, off = mok_ws_align(off + rec * R * I * 2);
  l->ws[MOK_WS_GS] = off, off = mok_ws_align(off + rec * T * Is * 2);
  l->ws[MOK_WS_US] = off, off = mok_ws_align(off + rec * T * Is * 2);
  l->ws[MOK_WS_WGRAD32] = off, off = mok_ws_align(off + (size_t)d->wgrad_stage * 4);
  const size_t q = d->fp8 ? 1 : 0, T4 = (size_t)mok_ws_ld4(d->T_max), R4 = (size_t)mok_ws_ld4(d->R);
  const size_t qt = d->fp8 || d->mx_wire ? 1 : 0;
  l->ws[MOK_WS_XQT] = off, off = mok_ws_align(off + qt * T * H);
  l->ws[MOK_WS_XQT_S] = off, off = mok_ws_align(off + qt * (H / 128) * T4 * 4);
  l->ws[MOK_WS_XQ] = off, off = mok_ws_align(off + q * R * H);
  l->ws[MOK_WS_XQ_S] = off, off = mok_ws_align(off + q * (H / 128) * R4 * 4);
  l->ws[MOK_WS_AQ] = off, off = mok_ws_align(off + q * R * I);
  l->ws[MOK_WS_AQ2] = off, off = mok_ws_align(off + q * R * I);
  l->ws[MOK_WS_AQ_S] = off, off = mok_ws_align(off + q * (2 * I / 128) * R4 * 4);
  l->ws[MOK_WS_ASQ] = off, off = mok_ws_align(off + q * T * Is);
  l->ws[MOK_WS_ASQ2] = off, off = mok_ws_align(off + q * T * Is);
  l->ws[MOK_WS_ASQ_S] = off, off = mok_ws_align(off + q * (2 * Is / 128) * T4 * 4);
  l->ws[MOK_WS_XDQ] = off, off = mok_ws_align(off + (d->mx ? T * H * 2 : 0));
  l->ws_bytes = off;

  off = 0;
  l->ctx[MOK_CTX_HEADER] = off, off = mok_ws_align(off + sizeof(mok_ctx_header_t));
  l->ctx[MOK_CTX_SLOT_ROW] = off, off = mok_ws_align(off + T * K * 4);
  l->ctx[MOK_CTX_OFFSETS] = off, off = mok_ws_align(off + (E + 1) * 4);
  l->ctx[MOK_CTX_G] = l->ctx[MOK_CTX_U] = l->ctx[MOK_CTX_GS] = l->ctx[MOK_CTX_US] = 0;
  if (d->save) {
    l->ctx[MOK_CTX_G] = off, off = mok_ws_align(off + R * I * 2);
    l->ctx[MOK_CTX_U] = off, off = mok_ws_align(off + R * I * 2);
    l->ctx[MOK_CTX_GS] = off, off = mok_ws_align(off + T * Is * 2);
    l->ctx[MOK_CTX_US] = off, off = mok_ws_align(off + T * Is * 2);
  }
  l->ctx_bytes = off;
}

/* The dimensions of a layer (W = 1: E local experts). */
MOK_WS_FN mok_ws_dims_t mok_ws_dims(const mok_layer_desc_t *desc, int64_t EL, int64_t capacity_rows) {
  mok_ws_dims_t d;
  d.T_max = desc->max_tokens;
  d.H = desc->hidden;
  d.I = desc->intermediate;
  d.Is = desc->shared_intermediate;
  d.E = EL;
  d.K = desc->top_k;
  d.R = capacity_rows;
  d.save = desc->context_mode == MOK_CONTEXT_SAVE;
  /* bf16(old + g) needs g in fp32 first: one weight at a time, the largest of them */
  const int64_t routed = EL * desc->intermediate * desc->hidden,
                shared = desc->shared_intermediate * desc->hidden;
  d.wgrad_stage = desc->wgrad_dtype == MOK_WGRAD_BF16 && desc->wgrad_accumulate
                      ? (routed > shared ? routed : shared)
                      : 0;
  d.fp8 = desc->precision == MOK_PRECISION_FP8_BLOCK;
  d.mx = desc->precision == MOK_PRECISION_MXFP8;
  d.mx_wire = 0;
  return d;
}

#undef MOK_WS_FN

#endif /* MOK_WORKSPACE_H */
