/*
 * forward.h: the launchers of a GPU layer's forward: the layout, gather and reduce kernels, and the fused persistent forward.
 *
 * A host/device contract: plain C11 and C++, no CUDA types (streams are void *); every launcher
 * validates its arguments on the host, returns a mokResult_t, and never synchronizes.
 */
#ifndef MOK_CUDA_FORWARD_H
#define MOK_CUDA_FORWARD_H

#include <stdint.h>
#include <string.h>

#include "mok.h"
#include "common/limits.h"
#include "common/status.h"
#include "common/tuning.h"
#include "cuda/comm/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The short kernel chain src/gpu/forward.c runs for mok_forward on one GPU, around the grouped
 * GEMMs above: layout (two kernels, a CTA per chunk of tokens) -> gather -> [gate/up, down,
 * shared gate/up, shared down GEMMs] -> reduce. Buffers are the regions of src/common/workspace.h. No launcher synchronizes or reads device
 * memory on the host, so the chain can be captured in a CUDA graph. A failing launch returns
 * MOK_ERROR_CUDA with cudaGetErrorString's text in mok_last_error().
 */

typedef struct mok_fwd_local_params {
  int64_t T, H, E, K, Is;     /* this call's tokens; E = local experts (W = 1: all) */
  int64_t capacity_rows;      /* R: rows of the routed buffers */
  const int32_t *topk_idx;    /* [T, K] */
  const float *topk_w;        /* [T, K] */
  const void *x;              /* [T, H] bf16 */
  void *y;                    /* [T, H] bf16 */
  /* workspace regions */
  void *err;                  /* mok_ws_error_t */
  int32_t *status;            /* [1] */
  int32_t *offsets;           /* [E + 1] */
  int32_t *shared_offsets;    /* [2] */
  int32_t *slot_row;          /* [T_max, K] */
  float *row_w;               /* [R] */
  void *xg;                   /* [R, H] bf16 */
  const void *yk;             /* [R, H] bf16 */
  const float *ys;            /* [T, H] fp32, NULL when Is = 0 */
  int32_t *row_tok;           /* [R] token of each row; written by the layout when not NULL */
  int32_t *tile_pre;          /* [E + 1] row-tile prefix sums (128-row tiles); as row_tok */
  int32_t *red_pre;           /* [E + 2], with red_order [T]: the fused forward's reduce order
                                 (src/common/workspace.h); written by the layout when not NULL */
  int32_t *red_order;
  uint32_t *counters;         /* [n_counters] zeroed by the layout when not NULL */
  int64_t n_counters;
  void *layout_scratch;       /* mok_ll_bytes(T, E) (src/common/workspace.h): the layout's partials */
  /* context regions (the layout kernel writes the header and copies of slot_row and offsets) */
  void *ctx_header;           /* mok_ctx_header_t */
  int32_t *ctx_slot_row;      /* [T_max, K] */
  int32_t *ctx_offsets;       /* [E + 1] */
  uint64_t layer_id;
  int64_t context_mode;
} mok_fwd_local_params_t;

/* Validates routing (error word + status), counts rows per expert, offsets = exclusive prefix
 * sum, slot_row in (token, slot) order within each expert (src/cpu/layout.c with W = 1,
 * tile_m = 1), checks capacity, writes the context header; and, for the fused forward, row_w,
 * row_tok, tile_pre, the reduce order (red_pre, red_order) and zeroed counters. */
mokResult_t mok_fwd_layout_launch(const mok_fwd_local_params_t *p, void *stream);
/* xg[slot_row[t, k]] = x[t], row_w[slot_row[t, k]] = topk_w[t, k]. */
mokResult_t mok_fwd_gather_launch(const mok_fwd_local_params_t *p, void *stream);
/* fp8-block layers: rq[slot_row[t, k]] = xq[t] (e4m3 [T, H] -> [R, H]) with the row's scales,
 * K-block major on both sides (scale of row r, block b at s[b * ld + r]; xs_ld >= T), and row_w
 * as the gather writes it. H % 128 == 0. */
mokResult_t mok_fwd_gather_fp8_launch(const mok_fwd_local_params_t *p, const void *xq,
                                      const float *xq_s, int64_t xs_ld, void *rq, float *rq_s,
                                      int64_t rs_ld, void *stream);
/* y[t] = bf16(ys[t] + yk[row(t, 0)] + ... + yk[row(t, K-1)]), fp32, slot order, empty slots
 * skipped; y untouched when the call's status is 0. */
mokResult_t mok_fwd_reduce_launch(const mok_fwd_local_params_t *p, void *stream);

/* ---- the fused forward (src/cuda/forward/fused.cu) ---------------------------------------------- */
/*
 * After the layout kernel (which writes row_tok, row_w, tile_pre, the reduce order and zeroes the
 * counters), one persistent kernel runs every task of src/common/task_plan.h: SHARED_GATE_UP, GATE_UP
 * (rows of x gathered through row_tok straight into the tile, SwiGLU and the router weight in
 * the epilogue), DOWN, SHARED_DOWN and REDUCE, coordinated by the counters of src/common/workspace.h.
 * Its results are bitwise those of the kernel chain above (same tiles, same epilogues, same
 * reduce).
 */
typedef struct {
  mok_fwd_local_params_t l;   /* as for the chain; row_tok / tile_pre / red_pre / red_order /
                                 counters must be set (written by this call's layout kernel).
                                 xg is not read: GATE_UP gathers the rows of x itself */
  int64_t I;                  /* intermediate size of a routed expert */
  const void *wg, *wu, *wd;   /* [E, I, H], [E, I, H], [E, H, I] bf16 */
  const void *wsg, *wsu, *wsd;/* [Is, H], [Is, H], [H, Is] bf16 (Is > 0) */
  void *a;                    /* [R, I] bf16: bf16(w · silu(g) · u) */
  void *as;                   /* [T_max, Is] bf16 (Is > 0) */
  void *g_out, *u_out;        /* [R, I] bf16 (optional: the SAVE context) */
  void *gs_out, *us_out;      /* [T_max, Is] bf16 (optional) */
  int num_sms;                /* CTAs; 0 = one per SM. Any count gives the same bits */
  double timeout_s;           /* bound of each wait on a counter; 0 = the tuning's */
  const mok_tuning_t *tuning; /* the layer's tuning (lag, bands, reduce helpers); NULL = the
                                 defaults. The bits never depend on it */
  const void *recv_x;         /* expert parallel (src/gpu/forward_ep.c): the transport's received
                                 tokens [W T_max, H]; l.row_tok is then its row_src (>= 0: a row
                                 of recv_x, -(t + 1): token t of l.x), l.offsets and l.tile_pre
                                 the rank's local layout (EP prep), the counters zeroed by the
                                 caller; the kernel runs every tile task but no REDUCE (y is not
                                 written: the combine brings the rows home first), even with T =
                                 0 (other ranks' rows). NULL at W = 1 */
  const mok_tp_params_t *dispatch; /* expert parallel: the transport's params of this call's
                                 dispatch (mok_transport_params with MOK_TP_DISPATCH, the layer's
                                 fields filled), which the kernel then runs itself first
                                 (forward/fused_ep.cuh); NULL: the dispatch kernel ran before */
} mok_fwd_fused_params_t;

/* MOK_ERROR_NULL_POINTER / INVALID_SHAPE / MISALIGNED on bad arguments, MOK_ERROR_CUDA when the
 * launch fails (the kernel is launched cooperatively: every CTA resident at once, which the
 * counters' deadlock freedom needs). A wait that times out writes MOK_ERROR_TIMEOUT to the error
 * word and lets the kernel finish (with wrong results) instead of hanging. */
mokResult_t mok_fwd_fused_launch(const mok_fwd_fused_params_t *p, void *stream);

/* The fused kernel's fault record (src/common/status.h; as mok_gg_fault_take). */
int mok_fwd_fused_fault_take(mok_kernel_fault_t *out);
/* Loads the fused kernel now, not at its first launch (comm.h, mok_ep_preload: an expert-parallel
 * layer's create). */
mokResult_t mok_fwd_fused_preload(void);


#ifdef __cplusplus
}
#endif

#endif /* MOK_CUDA_FORWARD_H */
