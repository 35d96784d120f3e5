/*
 * launch.h: the C launchers of MoK's CUDA kernels, callable from the host C11 library.
 *
 * This is the one internal header between host C and device code: it compiles as plain C11 and as
 * C++, uses no CUDA types (streams are void *), and every launcher returns a mokResult_t after
 * validating its arguments on the host. Launchers never synchronize with the device.
 */
#ifndef MOK_CUDA_LAUNCH_H
#define MOK_CUDA_LAUNCH_H

#include <stdint.h>
#include <string.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Grouped GEMM                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/* Operand precision. */
typedef enum {
  MOK_GG_BF16 = 0,      /* bf16 A and B, fp32 accumulation */
  MOK_GG_FP8_BLOCK = 1  /* e4m3 A (1x128 scales) and B (128x128 scales), fp32 promotion every
                           128 reduction elements; K % 128 == 0, N % 128 == 0, B K-major, no
                           SwiGLU yet */
} mok_gg_dtype_t;

/* Memory layout of B per group. */
typedef enum {
  MOK_GG_B_KMAJOR = 0,  /* B [G, N, K]: PyTorch Linear layout, K contiguous */
  MOK_GG_B_NMAJOR = 1   /* B [G, K, N]: N contiguous (backward: dy·Wd, dgu·[Wg; Wu]); needs
                           K % 64 == 0; not with SwiGLU */
} mok_gg_layout_t;

/* What the epilogue does with the fp32 tile acc = A[rows] · B[g]ᵀ. */
typedef enum {
  MOK_GG_EPI_STORE_BF16 = 0, /* c [M_total, N] bf16  = bf16(acc) */
  MOK_GG_EPI_STORE_F32 = 1,  /* c [M_total, N] fp32  = acc */
  MOK_GG_EPI_ACCUM_F32 = 2,  /* c [M_total, N] fp32 += acc */
  MOK_GG_EPI_SWIGLU = 3      /* b = gate [G, N, K], b2 = up [G, N, K]; c [M_total, N] bf16 =
                                bf16(row_scale[r] · silu(g) · u) with fp32 g, u; optionally
                                g_out, u_out [M_total, N] bf16 = bf16(g), bf16(u) */
} mok_gg_epilogue_t;

/* C[rows of g] = epilogue(A[rows of g] · B[g]ᵀ) for every group g, where the rows of group g are
 * [offsets[g], offsets[g+1]) of A and C. `offsets` lives in device memory (G+1 entries, int32 or
 * int64, non-decreasing, offsets[G] <= m_total) and is never read by the host: rows outside every
 * group are neither read into a result nor written. Results are bitwise deterministic. */
typedef struct {
  mok_gg_dtype_t dtype;
  mok_gg_layout_t b_layout;
  mok_gg_epilogue_t epilogue;
  int offsets_int64;         /* 0: offsets are int32, 1: int64 */
  int64_t num_groups;        /* G, 1..2^20 */
  int64_t m_total;           /* rows of A and C (>= offsets[G]) */
  int64_t n;                 /* N: columns of C per group (SwiGLU: I) */
  int64_t k;                 /* K: reduction length */
  const void *a;             /* [m_total, K] bf16 (fp8-block: e4m3), 16-byte aligned */
  const void *b;             /* [G, N, K] bf16 (or [G, K, N] with MOK_GG_B_NMAJOR), 16-byte
                                aligned (SwiGLU: gate weights) */
  const void *b2;            /* SwiGLU only: up weights [G, N, K] bf16 */
  const void *offsets;       /* [G + 1] int32 or int64, device memory */
  void *c;                   /* [m_total, N] bf16 or fp32 (see epilogue), 16-byte aligned */
  const float *row_scale;    /* SwiGLU only: [m_total] fp32 router weight per row; NULL = 1 */
  void *g_out, *u_out;       /* SwiGLU only, optional: [m_total, N] bf16 */
  int num_sms;               /* CTAs of the persistent grid; 0 = one per SM (as many as can be
                                resident at once); else taken as given (rounded to the cluster) */
  const float *a_scale;      /* fp8-block: scale of A[r, 128 kb ..], fp32, [m_total, K/128]
                                (a_scale_ld = 0) or [K/128, a_scale_ld] (a_scale_ld > 0) */
  const float *b_scale;      /* fp8-block: [G, N/128, K/128] fp32, 128x128 blocks of B[g] */
  int64_t a_scale_ld;        /* fp8-block: 0, or the row stride of a_scale stored K-block major
                                (>= m_total, a multiple of 4; a_scale 16-byte aligned): each K
                                block's row scales are then contiguous, and the kernel loads a
                                tile's with the tile's operands (faster) */
} mok_grouped_gemm_params_t;

/* Validates `p` (MOK_ERROR_NULL_POINTER, MOK_ERROR_INVALID_VALUE, MOK_ERROR_INVALID_SHAPE,
 * MOK_ERROR_MISALIGNED, MOK_ERROR_NOT_IMPLEMENTED) and enqueues the kernel on `stream` (a
 * cudaStream_t; NULL = the legacy default stream). MOK_ERROR_CUDA when the launch fails, and
 * MOK_ERROR_NO_DEVICE without a usable device. Shape rules: K % 8 == 0 and N % 8 == 0 (16-byte
 * row strides for TMA); SwiGLU also needs b2. */
mokResult_t mok_grouped_gemm_launch(const mok_grouped_gemm_params_t *p, void *stream);

/* Row tiles per band of a grouped GEMM's tile order (tile_scheduler.cuh, src/task_plan.h), for
 * groups whose B (weights) takes b_bytes: 8 when that is over a sixth of the device's L2 cache,
 * so that the tiles that share a B tile are taken together (else B comes from HBM up to twice:
 * less HBM traffic, less power, a higher clock at the power limit); else 0, row tile by row tile,
 * which measured as fast for small B (bench/NOTES.md, v11, v16, v22). MOK_TILE_GROUP=n sets n
 * (0: off). */
int mok_tile_group_m(int64_t b_bytes);

/* Parameters of a bf16 grouped GEMM with the given epilogue and B layout, every other field zero
 * (pointers, int32 offsets, one CTA per SM): the callers fill in their tensors. */
static inline mok_grouped_gemm_params_t mok_gg_bf16_params(mok_gg_epilogue_t epi,
                                                           mok_gg_layout_t b_layout, int64_t groups,
                                                           int64_t m, int64_t n, int64_t k) {
  mok_grouped_gemm_params_t p;
  memset(&p, 0, sizeof(p));
  p.dtype = MOK_GG_BF16;
  p.b_layout = b_layout;
  p.epilogue = epi;
  p.num_groups = groups;
  p.m_total = m;
  p.n = n;
  p.k = k;
  return p;
}

/* Weight-gradient ("k-grouped") GEMM, src/cuda/grouped_wgrad.cu: the groups split the reduction.
 *   C[g] [N, K] = epilogue( A_gᵀ · B_g ) = epilogue( Σ_{r in group g} A[r]ᵀ ⊗ B[r] )
 * for every group g, rows of g = [offsets[g], offsets[g+1]) of A and B (offsets in device memory,
 * as above, never read by the host). Example: dWd[e] [H, I] = dy_gᵀ · a_g (a = dy [R, H],
 * b = a [R, I]); dWg[e] [I, H] = dg_gᵀ · x_g. fp32 accumulation over the rows of a group in row
 * order, one CTA per output tile, no atomics: bitwise deterministic, whatever num_sms. Epilogues:
 * MOK_GG_EPI_STORE_BF16 (c bf16), MOK_GG_EPI_STORE_F32, MOK_GG_EPI_ACCUM_F32 (c fp32 += result);
 * an empty group stores zeros, or leaves C[g] untouched when accumulating. */
typedef struct {
  mok_gg_epilogue_t epilogue; /* STORE_BF16, STORE_F32 or ACCUM_F32 (SwiGLU: not implemented) */
  int offsets_int64;          /* 0: offsets are int32, 1: int64 */
  int64_t num_groups;         /* G, 1..2^20 */
  int64_t m_total;            /* rows of A and B (>= offsets[G]); 0 is allowed */
  int64_t n;                  /* N: columns of A = rows of each C[g], N % 8 == 0 */
  int64_t k;                  /* K: columns of B = columns of each C[g], K % 8 == 0 */
  const void *a;              /* [m_total, N] bf16, 16-byte aligned */
  const void *b;              /* [m_total, K] bf16, 16-byte aligned */
  const void *offsets;        /* [G + 1] int32 or int64, device memory */
  void *c;                    /* [G, N, K] bf16 or fp32 (see epilogue), 16-byte aligned */
  int num_sms;                /* CTAs of the persistent grid; 0 = one per SM */
} mok_grouped_wgrad_params_t;

/* Validates `p` (MOK_ERROR_NULL_POINTER, MOK_ERROR_INVALID_VALUE, MOK_ERROR_INVALID_SHAPE,
 * MOK_ERROR_MISALIGNED, MOK_ERROR_NOT_IMPLEMENTED) and enqueues the kernel on `stream`;
 * MOK_ERROR_CUDA when the launch fails, MOK_ERROR_NO_DEVICE without a usable device. */
mokResult_t mok_grouped_wgrad_launch(const mok_grouped_wgrad_params_t *p, void *stream);

/* ============================================================================================== */
/* Expert-parallel transport (src/transport.c, src/cuda/nccl_window.cu, src/cuda/transport.cu)     */
/* ============================================================================================== */
/*
 * The NVLink transport of DESIGN.md section 5, usable on its own: a symmetric window per transport,
 * a layout kernel (per-(rank, expert) counts all-gathered through the window; every rank derives
 * the layout of src/cpu/layout.c) and a dispatch-and-combine kernel run by a few communication CTAs.
 * Everything here is plain C; bench/transport.py calls the mok_transport_* functions through ctypes.
 */

enum { MOK_TP_MAX_RANKS = 8 }; /* one NVLink domain on a host */

/* ---- symmetric window (src/cuda/nccl_window.cu: the only file that includes nccl_device.h) ---- */

/* One symmetric allocation registered with an NCCL communicator. peer[r] is rank r's base address
 * as mapped on this GPU, read once at setup (peer[rank] is NCCL's alias of `local` in its flat
 * window: the same memory at another address); kernels get these raw pointers. */
typedef struct {
  void *local;                    /* this rank's ncclMemAlloc'd bytes */
  size_t bytes;                   /* rounded up to the allocation granularity */
  void *window;                   /* ncclWindow_t */
  void *peer[MOK_TP_MAX_RANKS];   /* [nranks] base addresses, valid on this GPU */
} mok_nccl_window_t;

/* The NCCL side of a communicator, an opaque pair (ncclComm_t, ncclDevComm). Every function
 * reports MOK_ERROR_NCCL / MOK_ERROR_CUDA with the library's message, or MOK_ERROR_NOT_AVAILABLE
 * with the reason (built without NCCL, NCCL too old or too new for the headers, no symmetric
 * memory, ranks outside one NVLink domain, no peer access). */
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
  MOK_TP_WAIT_COMBINE = 3   /* combine counter of an expert rank: its result rows have landed */
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
 * names rank, SM, counter, value and target. A timeout leaves the transport unusable (every
 * later call returns MOK_ERROR_TIMEOUT); destroy it and create another. */
mokResult_t mok_transport_check(mok_transport_t t);

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

/* ---- kernel parameters and launchers (src/cuda/transport.cu), filled by src/transport.c ------ */

/* Byte offsets of the regions of one transport's symmetric window; identical on every rank. */
typedef struct {
  size_t flags;     /* [2, W] u64 layout flags, by call parity and source rank */
  size_t disp_ctr;  /* [W] u64 dispatch counters, by source rank */
  size_t comb_ctr;  /* [W] u64 combine counters, by expert rank */
  size_t slots;     /* [2, W, slot_ints] int32 all-gathered counts, by parity and source rank */
  size_t recv_x;    /* [W * T_max, H] bf16 received tokens */
  size_t recv_meta; /* [W * T_max, K + 1] int32 */
  size_t comb;      /* [T_max, K, H] bf16 combined rows */
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
} mok_tp_layout_buf_t;

typedef struct {
  int rank, nranks;
  int num_ctas;               /* CTAs of the dispatch-and-combine kernel on this rank */
  int64_t T, T_max, H, E, EL, K, tile_m;
  uint64_t layout_epoch;      /* calls of each kind so far, this one included (1, 2, ...): */
  uint64_t disp_epoch;        /* counters are never cleared; a wait's target is epoch * CTAs */
  uint64_t comb_epoch;
  uint64_t timeout_ns;
  char *peer[MOK_TP_MAX_RANKS]; /* window base of each rank, as mapped here */
  mok_tp_window_layout_t win;
  mok_tp_layout_buf_t lay;
  mok_tp_error_t *err;
  const int32_t *topk_idx;    /* [T, K] (layout) */
  const void *x;              /* [T, H] bf16 (dispatch) */
  void *y;                    /* [T, H] bf16 (combine) */
  int phases;                 /* MOK_TP_DISPATCH | MOK_TP_COMBINE | MOK_TP_REDUCE (run) */
} mok_tp_params_t;

mokResult_t mok_tp_layout_launch(const mok_tp_params_t *p, void *stream);
/* Shared memory the layout kernel needs for E experts and W ranks (its one CTA). */
size_t mok_tp_layout_smem_bytes(int64_t num_experts, int nranks);
mokResult_t mok_tp_run_launch(const mok_tp_params_t *p, void *stream);

/* Remote bytes (crossing NVLink) this rank sent in the last layout's dispatch and combine. */
mokResult_t mok_transport_remote_bytes(mok_transport_t t, int64_t *dispatch_bytes,
                                       int64_t *combine_bytes);

/* ============================================================================================== */
/* Layer forward, W = 1, unfused (src/cuda/layout_local.cu, src/cuda/rows_local.cu)                */
/* ============================================================================================== */
/*
 * The short kernel chain src/gpu_backend.c runs for mok_forward on one GPU, around the grouped
 * GEMMs above: layout (two kernels, a CTA per chunk of tokens) -> gather -> [gate/up, down,
 * shared gate/up, shared down GEMMs] -> reduce. Buffers are the regions of src/workspace.h. No launcher synchronizes or reads device
 * memory on the host, so the chain can be captured in a CUDA graph. A failing launch returns
 * MOK_ERROR_CUDA with cudaGetErrorString's text in mok_last_error().
 */

enum { MOK_FWD_MAX_EXPERTS = 1024, /* a layout CTA keeps per-warp bins of every expert in smem */
       MOK_FWD_MAX_TOP_K = 64 };

typedef struct {
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
                                 (src/workspace.h); written by the layout when not NULL */
  int32_t *red_order;
  uint32_t *counters;         /* [n_counters] zeroed by the layout when not NULL */
  int64_t n_counters;
  void *layout_scratch;       /* mok_ll_bytes(T, E) (src/workspace.h): the layout's partials */
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
/* y[t] = bf16(ys[t] + yk[row(t, 0)] + ... + yk[row(t, K-1)]), fp32, slot order, empty slots
 * skipped; y untouched when the call's status is 0. */
mokResult_t mok_fwd_reduce_launch(const mok_fwd_local_params_t *p, void *stream);

/* ---- the fused forward (src/cuda/forward_fused.cu) ---------------------------------------------- */
/*
 * After the layout kernel (which writes row_tok, row_w, tile_pre, the reduce order and zeroes the
 * counters), one persistent kernel runs every task of src/task_plan.h: SHARED_GATE_UP, GATE_UP
 * (rows of x gathered through row_tok straight into the tile, SwiGLU and the router weight in
 * the epilogue), DOWN, SHARED_DOWN and REDUCE, coordinated by the counters of src/workspace.h.
 * Its results are bitwise those of the kernel chain above (same tiles, same epilogues, same
 * reduce).
 */
typedef struct {
  mok_fwd_local_params_t l;   /* as for the chain; row_tok / tile_pre / red_pre / red_order /
                                 counters must be set (written by this call's layout kernel).
                                 xg NULL: GATE_UP gathers x rows itself; else GATE_UP reads xg,
                                 filled by the gather kernel before this launch */
  int64_t I;                  /* intermediate size of a routed expert */
  const void *wg, *wu, *wd;   /* [E, I, H], [E, I, H], [E, H, I] bf16 */
  const void *wsg, *wsu, *wsd;/* [Is, H], [Is, H], [H, Is] bf16 (Is > 0) */
  void *a;                    /* [R, I] bf16: bf16(w · silu(g) · u) */
  void *as;                   /* [T_max, Is] bf16 (Is > 0) */
  void *g_out, *u_out;        /* [R, I] bf16 (optional: the SAVE context) */
  void *gs_out, *us_out;      /* [T_max, Is] bf16 (optional) */
  int num_sms;                /* CTAs; 0 = one per SM. Any count gives the same bits */
  double timeout_s;           /* bound of each wait on a counter; 0 = 10 s */
} mok_fwd_fused_params_t;

/* MOK_ERROR_NULL_POINTER / INVALID_SHAPE / MISALIGNED on bad arguments, MOK_ERROR_CUDA when the
 * launch fails (the kernel is launched cooperatively: every CTA resident at once, which the
 * counters' deadlock freedom needs). A wait that times out writes MOK_ERROR_TIMEOUT to the error
 * word and lets the kernel finish (with wrong results) instead of hanging. */
mokResult_t mok_fwd_fused_launch(const mok_fwd_fused_params_t *p, void *stream);

/* ============================================================================================== */
/* Quantizers (src/cuda/quantize.cu; include/mok.h "Quantizers" is the bit-exact specification)    */
/* ============================================================================================== */

/* `count` bf16 matrices quantized to e4m3 values and block scales, each exactly as
 * mok_quantize_host quantizes it (bf16 -> fp32 is exact). The stored copy is [rows, cols]; its
 * element (e, r, c) is read from
 *   in[e * in_stride + r * in_ld + c]   transpose = 0, or
 *   in[e * in_stride + c * in_ld + r]   transpose = 1 (the source is [cols, rows]: the transposed
 *                                       copies of mok_quantize_weights)
 * and the outputs are packed matrix after matrix, each as mok_quantize_host writes it:
 *   q      [count, rows, cols] e4m3
 *   scales [count, ceil(rows / block_rows), ceil(cols / block_cols)] fp32 (FP32, POW2) or E8M0
 *          bytes. */
typedef struct {
  const void *in;             /* bf16, device memory, 2-byte aligned */
  int transpose;              /* 0 or 1 */
  int64_t in_ld;              /* elements between source rows; 0 = packed (cols, or rows when
                                 transposed) */
  int64_t in_stride;          /* elements between source matrices; 0 = packed (rows * cols) */
  int64_t count, rows, cols;  /* >= 0; rows * cols <= 2^40, count <= 2^20 */
  int block_rows, block_cols; /* powers of two in 1..128 (blocks tile the kernel's 128x128 tiles) */
  mok_quant_scale_t kind;
  uint8_t *q;                 /* device memory */
  void *scales;               /* device memory, 4-byte aligned for fp32 scales */
} mok_quantize_params_t;

/* Validates `p` (MOK_ERROR_NULL_POINTER, MOK_ERROR_INVALID_VALUE, MOK_ERROR_INVALID_SHAPE,
 * MOK_ERROR_MISALIGNED, with the detail in mok_last_error()) and enqueues the kernel on `stream`
 * (a cudaStream_t of the current device); MOK_ERROR_CUDA when the launch fails. An empty matrix
 * succeeds without touching the device. */
mokResult_t mok_quantize_launch(const mok_quantize_params_t *p, void *stream);

/* Fills the whole quantized-weight buffer `out` (mok_qw_layout(d, EL) bytes, device memory) from
 * the bf16 weights `w` (device memory), byte for byte as mok_cpu_quantize_weights does on the
 * host; bytes between operands (alignment gaps) are not written. One launch on `stream`, on the
 * device that holds `out`; the caller's current device is kept. Without CUDA (a build without
 * nvcc) it reports MOK_ERROR_NO_DEVICE. */
mokResult_t mok_quantize_weights_gpu(const mok_layer_desc_t *d, int64_t EL, const mok_weights_t *w,
                                     void *out, void *stream);

/* ============================================================================================== */
/* Layer backward, W = 1, unfused (src/cuda/context_check.cu, src/cuda/swiglu_backward.cu,         */
/* src/cuda/rows_local.cu "Layer backward", src/cuda/wgrad_store.cu)                               */
/* ============================================================================================== */
/*
 * The kernels src/gpu_backward.c chains for mok_backward on one GPU, around the grouped GEMMs:
 * context check (one CTA) -> gathers of x and dy (mok_fwd_gather_launch) -> [RECOMPUTE: gate/up
 * GEMMs] -> ds GEMM -> SwiGLU backward -> dxk GEMMs -> shared expert -> dx reduce -> weight
 * gradients (mok_grouped_wgrad_launch, and wgrad_store for accumulated bf16 gradients). Buffers
 * are the regions of src/workspace.h; the routing (slot_row, offsets) comes from the context.
 * No launcher synchronizes or reads device memory on the host.
 */

/* The per-call state of a backward: what the context check writes and the dx reduce reads. */
typedef struct {
  int64_t T, H, E, K;         /* this call's tokens; E = local experts */
  const int32_t *topk_idx;    /* [T, K] (context check: the routing hash) */
  /* context (read) */
  const void *ctx_header;     /* mok_ctx_header_t */
  const int32_t *ctx_slot_row;/* [T_max, K] */
  const int32_t *ctx_offsets; /* [E + 1] */
  uint64_t layer_id;
  int64_t context_mode;
  /* workspace */
  void *err;                  /* mok_ws_error_t */
  int32_t *status;            /* [1] 1: the context matches, the call computes; 0: it does nothing */
  int32_t *offsets;           /* [E + 1] ctx_offsets, or all 0 when the context does not match */
  int32_t *shared_offsets;    /* [2] {0, T}, or {0, 0} */
  const float *dxk;           /* [R, H] fp32 (dx reduce) */
  const float *dxs;           /* [T, H] fp32 shared-expert data gradient, NULL when Is = 0 */
  const float *dw_row;        /* [R] router-weight gradient of each row */
  /* outputs */
  void *dx;                   /* [T, H] bf16 */
  float *dtopk_w;             /* [T, K] */
} mok_bwd_local_params_t;

/* One CTA: compares the context header with this call (magic, layer id, T, the routing hash of
 * topk_idx as layout_local.cu computes it, the mode). Match: status = 1, offsets = the context's,
 * shared_offsets = {0, T}. Mismatch: status = 0, offsets and shared_offsets all 0 (every later
 * kernel and GEMM of the call finds no rows), and MOK_ERROR_CONTEXT_MISMATCH in the error word. */
mokResult_t mok_bwd_context_check_launch(const mok_bwd_local_params_t *p, void *stream);

/* dx[t] = bf16( dxs[t] + bf16(dxk[row(t, 0)]) + ... + bf16(dxk[row(t, K-1)]) ), fp32 in slot
 * order, empty slots skipped (dxs = 0 when NULL); dtopk_w[t, k] = dw_row[row(t, k)], 0 for an
 * empty slot. Rows from ctx_slot_row. Nothing is written when status is 0. */
mokResult_t mok_bwd_reduce_launch(const mok_bwd_local_params_t *p, void *stream);

/* The SwiGLU backward of every row in [offsets[0], offsets[G]), one warp per row, from bf16 g, u,
 * the row's weight w and ds (fp32), with s = silu(g) · u in fp32:
 *   a = bf16(w · s)   dg = bf16((w · ds) · u · silu'(g))   du = bf16((w · ds) · silu(g))
 *   dw_row[r] = Σ_i ds_i · s_i in fp32: each lane sums its columns 4 (32 j + lane) + (0..3),
 *               j = 0, 1, ... with fmaf in that order, then a butterfly over the 32 lanes
 *               (xor 16, 8, 4, 2, 1). Fixed: bitwise the same run after run.
 * The products are those of src/cpu/ref_backward.c in its order, without contractions. */
typedef struct {
  int64_t num_groups;         /* G */
  int64_t m_total;            /* rows of every buffer (>= offsets[G]) */
  int64_t n;                  /* I or Is: a multiple of 128 */
  const int32_t *offsets;     /* [G + 1] device memory */
  const void *g, *u;          /* [m_total, n] bf16 */
  const float *ds;            /* [m_total, n] fp32 */
  const float *row_w;         /* [m_total] router weight of each row; NULL = 1 (shared expert) */
  void *a, *dg, *du;          /* [m_total, n] bf16, written */
  float *dw_row;              /* [m_total] written; NULL: not computed (shared expert) */
} mok_bwd_swiglu_params_t;
mokResult_t mok_bwd_swiglu_launch(const mok_bwd_swiglu_params_t *p, void *stream);

/* Stores an fp32 weight gradient g [n] into the caller's bf16 buffer: dst = bf16(g), or
 * bf16(fp32(dst) + g) when accumulate (src/cpu_backend.c's write_wgrad, bit for bit). n % 8 == 0,
 * both pointers 16-byte aligned. */
mokResult_t mok_bwd_wgrad_store_bf16_launch(const float *g, void *dst, int64_t n, int accumulate,
                                            void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOK_CUDA_LAUNCH_H */
