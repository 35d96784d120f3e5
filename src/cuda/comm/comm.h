/*
 * comm.h: the expert-parallel transport: NCCL symmetric windows, its layout and dispatch-and-combine kernels.
 *
 * A host/device contract: plain C11 and C++, no CUDA types (streams are void *); every launcher
 * validates its arguments on the host, returns a mokResult_t, and never synchronizes.
 */
#ifndef MOK_CUDA_COMM_H
#define MOK_CUDA_COMM_H

#include <stdint.h>
#include <string.h>

#include "mok.h"
#include "common/limits.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The NVLink transport (docs/design.md, "The transport"), usable on its own: a symmetric window
 * per transport, a layout kernel (per-(rank, expert) counts all-gathered through the window; every
 * rank derives the layout of src/cpu/layout.c) and a dispatch-and-combine kernel run by a few
 * communication CTAs.
 * Everything here is plain C; bench/transport.py calls the mok_transport_* functions through ctypes.
 */

/* ---- symmetric window (src/cuda/comm/nccl_window.cu: the only file with nccl_device.h) ------- */

/* One symmetric allocation registered with an NCCL communicator. peer[r] is rank r's base address
 * as mapped on this GPU, read once at setup (peer[rank] is NCCL's alias of `local` in its flat
 * window: the same memory at another address); kernels get these raw pointers. */
typedef struct {
  void *local;                    /* this rank's ncclMemAlloc'd bytes */
  size_t bytes;                   /* rounded up to the allocation granularity */
  void *window;                   /* ncclWindow_t */
  void *peer[MOK_MAX_RANKS];   /* [nranks] base addresses, valid on this GPU */
} mok_nccl_window_t;

/* The NCCL side of a communicator, an opaque pair (ncclComm_t, ncclDevComm). Every function
 * reports MOK_ERROR_NCCL / MOK_ERROR_CUDA with the library's message, or MOK_ERROR_NOT_AVAILABLE
 * with the reason (built without NCCL, no NCCL at run time or one too old or too new for the
 * headers: see src/common/nccl_loader.h, no symmetric memory, ranks outside one NVLink domain, no
 * peer access). */
mokResult_t mok_nccl_get_unique_id(void *id, size_t id_bytes);
mokResult_t mok_nccl_comm_init_rank(void **nccl, const void *id, int rank, int nranks, int device);
mokResult_t mok_nccl_comm_query(void *nccl, int *rank, int *nranks, int *device);
mokResult_t mok_nccl_comm_destroy(void *nccl); /* only for communicators MoK created */
/* Collective over the communicator: every rank calls it. */
mokResult_t mok_nccl_devcomm_create(void *nccl, void **devcomm);
void mok_nccl_devcomm_destroy(void *nccl, void *devcomm);
/* Collective: allocates `bytes` (zeroed) on every rank, registers it as a symmetric window and
 * fills w->peer (devcomm from mok_nccl_devcomm_create). Detects NCCL's silent fallback to plain
 * memory. */
mokResult_t mok_nccl_window_create(void *nccl, void *devcomm, int device, size_t bytes,
                                   mok_nccl_window_t *w);
void mok_nccl_window_destroy(void *nccl, mok_nccl_window_t *w);

/* ---- the error word kernels write (device memory, one per transport) -------------------------- */

typedef enum {
  MOK_TP_WAIT_NONE = 0,
  MOK_TP_WAIT_LAYOUT = 1,   /* layout flag of a source rank: its counts are in our window */
  MOK_TP_WAIT_DISPATCH = 2, /* dispatch counter of a source rank: its token rows have landed */
  MOK_TP_WAIT_COMBINE = 3,  /* combine counter of an expert rank: its result rows have landed */
  MOK_TP_WAIT_RECOVER = 4   /* recovery flag of a rank: it has joined mok_transport_recover */
} mok_tp_counter_t;

/* The first failure a kernel saw; `code` is 0 while there is none. For a timeout: who waited
 * (rank, sm), for what (counter, peer) and how far it got (value, target). For bad routing:
 * token, slot and the expert id in a, b, c. */
typedef struct {
  int32_t code;          /* mokResult_t */
  int32_t abort;         /* set with code: other waits of the same launch stop early */
  int32_t rank, sm, counter, peer;
  uint64_t value, target;
  int64_t a, b, c;
} mok_tp_error_t;

/* ---- transport --------------------------------------------------------------------------------- */

typedef struct mok_transport *mok_transport_t;

typedef struct {
  int64_t max_tokens;  /* T_max per rank; every rank of the communicator uses the same value */
  int64_t hidden;      /* H: bf16 elements per row, a multiple of 8 (16-byte rows) */
  int64_t num_experts; /* E, a multiple of W, at most 1024 */
  int64_t top_k;       /* K, 1..64 */
  int64_t tile_m;      /* expert segments are padded to a multiple of this (the GEMM tile height) */
  int num_sms;         /* CTAs of the dispatch-and-combine kernel; 0 = 20. Fixed for the lifetime */
  double timeout_s;    /* bound of every wait; 0 = 10 s */
  int64_t yk_rows;     /* rows of the window's yk region (a layer: its routed-row capacity R,
                          whose expert outputs the home ranks read in place; its window then has
                          no comb, and mok_transport_run refuses COMBINE and REDUCE); 0: none */
} mok_transport_desc_t;

/* Phases of mok_transport_run, in this order within a call. */
enum {
  MOK_TP_DISPATCH = 1, /* send tokens, wait for every source's tokens */
  MOK_TP_COMBINE = 2,  /* send f(row) of each received (token, slot) home, wait for every rank */
  MOK_TP_REDUCE = 4,   /* y = slot-order sum of the rows combined home (local, no waiting) */
  MOK_TP_ALL = 7
};

/* Collective over comm's ranks (each calls it with the same desc). */
mokResult_t mok_transport_create(mok_transport_t *out, mok_comm_t comm,
                                 const mok_transport_desc_t *desc);
mokResult_t mok_transport_destroy(mok_transport_t t); /* collective too */
mokResult_t mok_transport_set_timeout(mok_transport_t t, double seconds);
/* Layout of this call's routing, topk_idx [T, K] int32 in device memory (NULL when T = 0).
 * Every rank calls it once per routing before mok_transport_run. */
mokResult_t mok_transport_layout(mok_transport_t t, int64_t num_tokens, const int32_t *topk_idx,
                                 void *stream);
/* Dispatch x [T, H] bf16 to the other ranks (MOK_TP_DISPATCH), combine the expert rows home
 * (MOK_TP_COMBINE) and sum them into y [T, H] bf16 (MOK_TP_REDUCE): y[t] = bf16(sum over k in
 * slot order of f(x[t], e_k)), where the stand-in expert f(row, e) = bf16(row * (e % 4 + 1)) runs
 * on the expert's rank. Only rows that change rank move; the sum computes the rows of the token's
 * own rank's experts from x. A call is MOK_TP_ALL; every rank runs the same phases in the same
 * order, and topk_idx of the layout and x must stay valid until the call's REDUCE ran. Calls of
 * single phases exist for benchmarks: repeated DISPATCH-only or COMBINE-only calls are race-free,
 * a REDUCE-only call sums what the last COMBINE brought home (x is read again). */
mokResult_t mok_transport_run(mok_transport_t t, int phases, const void *x, void *y, void *stream);
/* Synchronizes with the last stream used and reports a kernel error (clearing it): the detail
 * names rank, SM, counter, value and target. A timeout leaves the counters out of step with the
 * other ranks': every later call returns MOK_ERROR_TIMEOUT until mok_transport_recover. */
mokResult_t mok_transport_check(mok_transport_t t);
/* Collective (every rank calls it, in any order, from one thread or many): puts every rank's
 * counters back in step after a timeout. Stream-ordered: on `stream`, after this rank's earlier
 * work there, one CTA waits (bounded by the timeout) until every rank has joined, zeroes this
 * rank's counters and call numbers, and waits until every rank has. Errors not yet reported
 * are dropped. Calls are refused until mok_transport_check confirms the recovery; a recovery
 * that a rank did not join reports MOK_ERROR_TIMEOUT there and the transport stays unusable. */
mokResult_t mok_transport_recover(mok_transport_t t, void *stream);

/* Device buffers of the last layout and run, for tests (shapes per rank, W ranks). */
typedef struct {
  int64_t num_tokens;        /* T of the last layout call */
  int64_t recv_capacity;     /* rows of recv_x: W * T_max */
  const int32_t *slot_row;   /* [T_max, K] row of (token, slot) in its expert's rank, -1 empty */
  const int32_t *token_pos;  /* [T_max, W] position in rank d's receive buffer, -1 when none */
  const int32_t *count;      /* [W, E] rows from source s to expert e */
  const int32_t *expert_start; /* [E] first row of expert e in its rank's row buffer */
  const int32_t *rank_rows;  /* [W] padded rows per rank */
  const int32_t *recv_tokens; /* [W] tokens each rank receives */
  const int32_t *token_count; /* [W, W] tokens source s sends to rank d (own tokens included) */
  const void *recv_x;        /* [recv_capacity, H] bf16 tokens received, (source, token) order;
                                this rank's own block is not written */
  const int32_t *recv_meta;  /* [recv_capacity, K + 1]: source token, then row of each slot on
                                this rank (-1 for slots elsewhere) */
  const void *comb;          /* [T_max, K, H] bf16 rows combined back to this rank (slots whose
                                expert is on another rank) */
} mok_transport_view_t;
mokResult_t mok_transport_view(mok_transport_t t, mok_transport_view_t *v);

/* ---- kernel parameters and launchers (src/cuda/comm/transport.cu), filled by src/gpu/transport.c ------ */

/* Byte offsets of the regions of one transport's symmetric window; identical on every rank. */
typedef struct {
  size_t flags;     /* [2, W] u64 layout flags, by call parity and source rank */
  size_t disp_ctr;  /* [W] u64 dispatch counters, by source rank */
  size_t comb_ctr;  /* [W] u64 combine counters, by expert rank */
  size_t rec;       /* [W] u64 recovery flags, by rank: 2g - 1 joined, 2g zeroed in recovery g
                       (never zeroed) */
  size_t slots;     /* [2, W, slot_ints] int32 all-gathered counts, by parity and source rank */
  size_t recv_x;    /* [W * T_max, H] bf16 received tokens */
  size_t recv_meta; /* [W * T_max, K + 1] int32 */
  size_t comb;      /* [T_max, K, H] bf16 combined rows (the standalone transport; a layer's
                       window has none: yk_rows > 0) */
  size_t row_w;     /* [W * T_max * K] fp32 (layers) router weight of each row of this rank's
                       experts, written by the row's home rank */
  size_t row_src;   /* [W * T_max * K] int32 (layers) where the row's token is: its recv_x
                       position p >= 0, or -(t + 1) for token t of this rank */
  size_t recv_x2;   /* [W * T_max, H] bf16 (layers' backward) dy of the tokens in recv_x */
  size_t yk;        /* [yk_rows, H] bf16 (layers) outputs of this rank's expert rows, read by
                       the rows' home ranks (the pull reduce): the forward's yk, the backward's
                       dxk */
  size_t yk_w;      /* [yk_rows] fp32 (layers' backward) router-weight gradient of each row */
  size_t bytes;
  int64_t slot_ints; /* E + W + 4 per source: counts per expert, tokens per destination, header */
} mok_tp_window_layout_t;

/* Device-resident layout outputs of this rank (ordinary device memory, one allocation). */
typedef struct {
  int32_t *slot_row;     /* [T_max, K] */
  int32_t *token_pos;    /* [T_max, W] */
  int32_t *count;        /* [W, E] */
  int32_t *token_count;  /* [W, W] */
  int32_t *expert_start; /* [E] */
  int32_t *rank_rows;    /* [W] */
  int32_t *recv_tokens;  /* [W] */
  int32_t *num_ctas;     /* [W] dispatch-and-combine CTAs of each rank (targets of counters) */
  int32_t *valid;        /* [1] 1 when every rank's routing and sizes were valid */
  uint32_t *claim;       /* [4] work-item counters: dispatch, combine, by the call's parity */
  uint64_t *epoch;       /* [3] calls so far of the layout, dispatch and combine kernels: kept on
                            the device, so a CUDA graph's replays count as calls */
  uint32_t *epoch_done;  /* [3] CTAs of the running launch that have finished */
} mok_tp_layout_buf_t;

typedef struct {
  int rank, nranks;
  int num_ctas;               /* CTAs of the dispatch-and-combine kernel on this rank */
  int64_t T, T_max, H, E, EL, K, tile_m;
  uint64_t timeout_ns;
  char *peer[MOK_MAX_RANKS]; /* window base of each rank, as mapped here */
  mok_tp_window_layout_t win;
  mok_tp_layout_buf_t lay;
  mok_tp_error_t *err;
  const int32_t *topk_idx;    /* [T, K] (layout) */
  const void *x;              /* [T, H] bf16 (dispatch) */
  const void *xq;             /* fp8 layers (dispatch, ep fp8 and MXFP8 gathers), else NULL:
                                 each token's e4m3 row [T, H] and its H / 128 4-byte scale words
                                 (xq_s[b * xq_s_ld + t]) cross instead of x's bf16 row; a
                                 received row is the H bytes, then the words. fp8-block: fp32
                                 scales; MXFP8: four E8M0 bytes per word (the bits, copied as
                                 they are: mok_mx_quantize_rows_launch) */
  const uint32_t *xq_s;
  int64_t xq_s_ld;
  void *y;                    /* [T, H] bf16 (combine) */
  int phases;                 /* MOK_TP_DISPATCH | MOK_TP_COMBINE | MOK_TP_REDUCE (run) */
  /* Expert-parallel layers (src/cuda/comm/ep.cu; NULL / 0 for the standalone transport): */
  const float *topk_w;        /* [T, K]: dispatch also writes row_w and row_src of each row */
  int64_t R;                  /* the layer's routed-row capacity per rank */
  int32_t *status;            /* [1] 1: every rank's routing and row counts are valid */
  int32_t *offsets;           /* [EL + 1] this rank's experts' rows (the local layout) */
  int32_t *tile_pre;          /* [EL + 1] or NULL: prep writes the local layout's 128-row tile
                                 prefix sums (the fused forward's plan) */
  int32_t *shared_offsets;    /* [2] {0, T} (or {0, 0}) for the shared expert's GEMMs */
  void *layer_err;            /* the layer's mok_ws_error_t */
  void *xg;                   /* [R, H] bf16 rows of this rank's experts, in layout order */
  const void *yk;             /* [R, H] bf16 expert outputs of those rows (the window's yk
                                 region; the reduce reads every rank's) */
  const float *ys;            /* [T, H] fp32 shared-expert output, or NULL */
  /* ... and their backward (x, xg: the tokens' x; x2, xg2: their dy; y, ys: dx, the shared
   * expert's fp32 dxs; the rows' bf16 dxk are in the window's yk region): */
  const void *x2;             /* [T, H] bf16 dy (gather: its rows from recv_x2 or here) */
  int recv_x2;                /* dispatch: x's rows go to recv_x2 (the backward's dy) */
  void *xg2;                  /* [R, H] bf16 dy rows of this rank's experts (gather) */
  float *dtopk_w;             /* [T, K] (reduce), or NULL in the forward */
  const int32_t *local_ok;    /* [1] the layout's all-gathered status is valid only if this is 1
                                 (the backward's context check), or NULL */
  /* The saved context (forward prep writes its header and this rank's offsets): */
  void *ctx_header;
  int32_t *ctx_offsets;       /* [EL + 1] */
  uint64_t layer_id;
  int64_t context_mode;
} mok_tp_params_t;

mokResult_t mok_tp_layout_launch(const mok_tp_params_t *p, void *stream);
/* Shared memory the layout kernel needs for E experts and W ranks (its one CTA). */
size_t mok_tp_layout_smem_bytes(int64_t num_experts, int nranks);
mokResult_t mok_tp_run_launch(const mok_tp_params_t *p, void *stream);
/* The recovery kernel of mok_transport_recover: recovery number `gen` (1, 2, ...). */
mokResult_t mok_tp_recover_launch(const mok_tp_params_t *p, uint64_t gen, void *stream);

/* ---- expert-parallel layers (src/cuda/comm/ep.cu): the layer's forward around the transport --- */

/* The transport's params for a layer's call (src/gpu/transport.c): `phases` (MOK_TP_DISPATCH,
 * MOK_TP_COMBINE or 0) counts the next call of those phases, as mok_transport_run does, and the
 * stream becomes the one mok_transport_check synchronizes with. After mok_transport_layout. */
mokResult_t mok_transport_params(mok_transport_t t, int phases, void *stream, mok_tp_params_t *p);
/* mok_transport_layout whose all-gathered status is invalid, on every rank, unless *local_ok
 * (device memory, written earlier on the stream) is 1: a layer's backward whose context check
 * failed on one rank computes on none. */
mokResult_t mok_transport_layout_checked(mok_transport_t t, int64_t num_tokens,
                                         const int32_t *topk_idx, const int32_t *local_ok,
                                         void *stream);
/* Loads the transport's kernels (mok_tp_preload) and the layer's (mok_ep_preload) now, not at
 * their first launch, which may wait for kernels already running (gemm.h, mok_gg_preload). */
mokResult_t mok_tp_preload(void);
mokResult_t mok_ep_preload(void);
/* The layout's verdict for the layer (after the layout): status, local offsets, shared offsets,
 * the router weight and source of this rank's own rows, errors of other ranks. */
mokResult_t mok_ep_prep_launch(const mok_tp_params_t *p, void *stream);
/* xg[row] = the token row of each row of this rank's experts (recv_x or x). After dispatch. */
mokResult_t mok_ep_gather_launch(const mok_tp_params_t *p, void *stream);
/* fp8-block: rq[row] = the e4m3 row of each row's token and rq_s[b * rs_ld + row] its scales,
 * from the received rows (a dispatch with p->xq) or this rank's xq. After dispatch. */
mokResult_t mok_ep_gather_fp8_launch(const mok_tp_params_t *p, void *rq, float *rq_s,
                                     int64_t rs_ld, void *stream);
/* MXFP8: xg[row] = the bf16 values of each row's token's MXFP8 row (its e4m3 bytes times their
 * E8M0 scales: mok_mx_qdq_rows_launch's values of x), from the received rows (a dispatch with
 * p->xq) or this rank's xq. After dispatch. */
mokResult_t mok_ep_gather_mx_launch(const mok_tp_params_t *p, void *stream);
/* A signal to every rank that this rank's yk (and yk_w) regions are complete, then the waits for
 * every rank's: nothing moves (the reduce pulls). After the kernels that wrote them. */
mokResult_t mok_ep_combine_launch(const mok_tp_params_t *p, void *stream);
/* y[t] = bf16(ys[t] + Σ_k yk(t, k)) in slot order, each yk row read in its expert rank's window
 * (the backward: dtopk_w from yk_w too). After the combine. */
mokResult_t mok_ep_reduce_launch(const mok_tp_params_t *p, void *stream);

/* Remote bytes (crossing NVLink) this rank sent in the last layout's dispatch and combine. */
mokResult_t mok_transport_remote_bytes(mok_transport_t t, int64_t *dispatch_bytes,
                                       int64_t *combine_bytes);


#ifdef __cplusplus
}
#endif

#endif /* MOK_CUDA_COMM_H */
