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
 *   xg             [R, H] bf16         gathered token rows, expert order
 *   yk             [R, H] bf16         expert outputs; NOTE: aliases xg (read by the gate/up GEMM,
 *                                      written by the down GEMM, which runs after it on the stream)
 *   a              [R, I] bf16         bf16(w · silu(g) · u)
 *   as             [T_max, Is] bf16    shared-expert activations
 *   ys             [T_max, H] fp32     shared-expert output
 *
 * Context (the caller's, mok_context_size bytes; written by forward, read by backward):
 *   header         mok_ctx_header_t    magic (0 when the call's routing was invalid), layer id, T,
 *                                      routing hash (GPU: Σ mix(i, topk_idx[i]), see layout_local.cu)
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

#include "mok_internal.h"

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
  MOK_WS_ERR_CAPACITY = 3  /* value routed rows, capacity limit rows */
} mok_ws_err_kind_t;

typedef struct {
  int32_t code; /* mokResult_t; 0 while there is none */
  int32_t kind; /* mok_ws_err_kind_t */
  int64_t token, slot, value, limit;
  int64_t pad[3];
} mok_ws_error_t;

typedef enum {
  MOK_WS_ERROR = 0, MOK_WS_STATUS, MOK_WS_OFFSETS, MOK_WS_SHARED_OFFSETS, MOK_WS_SLOT_ROW,
  MOK_WS_ROW_W, MOK_WS_XG, MOK_WS_YK, MOK_WS_A, MOK_WS_AS, MOK_WS_YS,
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
} mok_ws_dims_t;

typedef struct {
  size_t ws[MOK_WS_COUNT];   /* byte offsets into the workspace */
  size_t ctx[MOK_CTX_COUNT]; /* byte offsets into the context (SAVE regions: 0 in RECOMPUTE) */
  size_t ws_bytes, ctx_bytes;
} mok_ws_layout_t;

MOK_WS_FN size_t mok_ws_align(size_t x) { return (x + 255) & ~(size_t)255; }

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
  l->ws[MOK_WS_XG] = off, l->ws[MOK_WS_YK] = off, off = mok_ws_align(off + R * H * 2);
  l->ws[MOK_WS_A] = off, off = mok_ws_align(off + R * I * 2);
  l->ws[MOK_WS_AS] = off, off = mok_ws_align(off + T * Is * 2);
  l->ws[MOK_WS_YS] = off, off = mok_ws_align(off + (Is > 0 ? T * H * 4 : 0));
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
  return d;
}

#undef MOK_WS_FN

#endif /* MOK_WORKSPACE_H */
