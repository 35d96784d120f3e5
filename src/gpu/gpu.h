/*
 * gpu.h: the GPU backend's private state and the helpers its host files share (src/gpu/layer.c,
 * forward.c, backward.c). Only src/gpu/ includes it; src/api/ reaches the backend through the
 * entry points of src/api/api.h.
 */
#ifndef MOK_GPU_GPU_H
#define MOK_GPU_GPU_H

#include "api/api.h"
#include "common/quantized_layout.h"
#include "common/workspace.h"

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/backward/backward.h"
#include "cuda/comm/comm.h"
#include "cuda/forward/forward.h"
#include "cuda/gemm/gemm.h"

/* A GPU layer's state (mok_layer.gpu). */
struct mok_gpu_layer {
  mok_ws_layout_t lay;
  char *ws;          /* device workspace, lay.ws_bytes; NULL when the layer cannot run */
  void *last_stream; /* the stream of the last forward or backward, which mok_layer_check
                        synchronizes with */
  int ran;           /* a forward or backward was enqueued since the layer was created */
  mok_transport_t tp; /* W > 1: the transport (window, cross-rank layout, dispatch, combine) */
  mok_qw_layout_t qw; /* fp8-block: where each operand copy lies in the quantized weights */
};

/* W > 1: the forward and backward of an expert-parallel layer (src/gpu/forward_ep.c,
 * backward_ep.c), after begin_call. */
mokResult_t mok_gpu_forward_ep(mok_layer_t l, const mok_forward_args_t *a, void *y, char *ctx,
                               void *stream);
mokResult_t mok_gpu_backward_ep(mok_layer_t l, const mok_forward_args_t *a,
                                const mok_backward_args_t *g, const char *ctx, void *stream);

/* The first step of every backward (src/gpu/backward.c): fills *p with the call's context-check
 * fields (routing, context regions, the layer's status and offsets) and launches the check
 * kernel, which decides on the device whether ctx belongs to this call. The reduce's fields are
 * left zero for the caller. */
mokResult_t mok_gpu_backward_check(mok_layer_t l, const mok_forward_args_t *a, const char *ctx,
                                   mok_bwd_local_params_t *p, void *stream);

/* The fused forward's parameters beyond f->l (src/gpu/forward.c): the call's weights, the
 * workspace's a and as, the SAVE context's g, u, gs, us, and the layer's tuning; W = 1 or one
 * rank of an expert-parallel layer (which then sets recv_x and dispatch). */
void mok_gpu_fused_params(mok_layer_t l, const mok_forward_args_t *a, char *ctx,
                          mok_fwd_fused_params_t *f);

/* fp8-block: the experts' fp8 GEMMs of a forward (src/gpu/forward.c), W = 1 or one rank of an
 * expert-parallel layer, once the workspace's xq holds the routed rows' e4m3 values and xqt the
 * call's tokens' (the shared expert's): a [R, I], yk [R, H], as, ys; SAVE mode: g, u, gs, us into
 * ctx. offsets [EL + 1] of the rows, shared_offsets {0, T}, row_w [R] their router weights; yk:
 * where the expert outputs go (the workspace's, or the transport window's yk region). */
typedef struct {
  const int32_t *offsets, *shared_offsets;
  const float *row_w;
  void *yk;
} mok_fp8_rows_t;
mokResult_t mok_gpu_forward_fp8_experts(mok_layer_t l, const mok_forward_args_t *a,
                                        const mok_fp8_rows_t *c, char *ctx, void *stream);
/* MXFP8: the experts' GEMMs of a forward (src/gpu/forward.c), W = 1 or one rank of an
 * expert-parallel layer, once the workspace's xg holds the routed rows' MXFP8 values in bf16 and
 * xdq the call's tokens' (the shared expert's A); the same outputs as above. */
mokResult_t mok_gpu_forward_mx_experts(mok_layer_t l, const mok_forward_args_t *a,
                                       const mok_fp8_rows_t *c, char *ctx, void *stream);
/* fp8-block: the fp8 SwiGLU gate/up GEMM of the routed experts (shared = 0: EL groups over the
 * workspace's xq rows, router weights row_w) or of the shared expert (1 group over the T rows of
 * xqt), writing c (a or as) and, when not NULL, g_out and u_out; the forward's and RECOMPUTE's. */
mok_grouped_gemm_params_t mok_gpu_fp8_swiglu_params(mok_layer_t l, const mok_weights_t *w,
                                                    int shared, int64_t T,
                                                    const int32_t *offsets, const float *row_w,
                                                    void *c, void *g_out, void *u_out);

/* The rows a backward's local chain works on: xg, dyg (workspace regions, expert order) with
 * their router weights row_w and the local experts' offsets [EL + 1]; the shared expert on the
 * call's own tokens (x, dy) with shared_offsets; ctx: the call's context (saved g, u). */
typedef struct {
  const char *ctx;
  const float *row_w;
  const int32_t *offsets, *shared_offsets;
  /* W = 1: the gather's parameters (slot_row, status): an fp8-block layer quantizes x and dy
   * once per token and copies the e4m3 rows (mok_fwd_gather_fp8_launch); NULL: it quantizes the
   * gathered bf16 rows xg, dyg */
  const struct mok_fwd_local_params *gather;
  /* W = 1: the dx reduce's parameters, for the fused backward kernel to reduce in it; NULL: the
   * caller reduces (expert parallel: after the combine) */
  const mok_bwd_local_params_t *reduce;
  /* where the rows' bf16 dxk [R, H] and router-weight gradients [R] go: the workspace's (NULL),
   * or, expert parallel, the transport window's yk and yk_w regions (the home ranks read them) */
  void *dxk;
  float *dw_row;
} mok_bwd_rows_t;

/* 1 when l's backward runs the fused kernel (src/cuda/backward/fused.cu) for its routed experts'
 * dxk and weight gradients (and, at W = 1, the dx reduce): the tuning's backward_path is
 * MOK_BACKWARD_FUSED, the layer BF16, and its weight gradients not bf16 accumulated (those go
 * through one fp32 staging region per gradient, in turn). */
int mok_gpu_backward_fused(mok_layer_t l);

/* The local chain of a backward (src/gpu/backward.c), W = 1 or one rank's part of an
 * expert-parallel one: RECOMPUTE's gate/up, ds, SwiGLU backward (a, dg, du, the rows' router
 * gradients in dw_row), bf16 dxk, the shared expert's dxs, and every weight gradient; dx and
 * dtopk_w are left to the caller's reduce, or, with c->reduce and mok_gpu_backward_fused, done by
 * the fused kernel. */
mokResult_t mok_gpu_backward_local(mok_layer_t l, const mok_forward_args_t *a,
                                   const mok_backward_args_t *gr, const mok_bwd_rows_t *c,
                                   void *stream);

/* C[g] [n, k] = Σ_{rows r of group g} A[r]ᵀ ⊗ B[r] into the caller's dw in the layer's dtype
 * (written or accumulated; src/gpu/backward.c). a: [m, n] bf16, b: [m, k] bf16, dw: [G, n, k];
 * stage: the wgrad32 region (bf16 accumulate). */
mokResult_t mok_gpu_wgrad(mok_layer_t l, int64_t groups, int64_t m, int64_t n, int64_t k,
                          const void *a, const void *b, const int32_t *offsets, void *dw,
                          float *stage, const char *what, void *stream);

/* MOK_ERROR_CUDA for a failed CUDA call, recorded on the layer (a non-sticky error is cleared so
 * that later calls start clean). */
mokResult_t mok_gpu_cuda_fail(mok_layer_t l, const char *call, cudaError_t e);

#define MOK_GPU_CUDA_GOTO(l, call, res, label)         \
  do {                                                 \
    cudaError_t mok_gpu_e_ = (call);                   \
    if (mok_gpu_e_ != cudaSuccess) {                   \
      res = mok_gpu_cuda_fail((l), #call, mok_gpu_e_); \
      goto label;                                      \
    }                                                  \
  } while (0)

/* A launcher's failure, already described in this thread's last error: copies it to the layer. */
mokResult_t mok_gpu_launcher_failed(mok_layer_t l, mokResult_t r);

/* Makes the layer's device current; the caller's goes to *prev, restored with
 * cudaSetDevice(*prev). */
mokResult_t mok_gpu_enter(mok_layer_t l, int *prev);

/* The start of a forward or backward on the GPU: the layer can run there (else the failure,
 * naming `fn`), its device is current (the caller's in *prev) and `stream` is the one
 * mok_layer_check will synchronize with. */
mokResult_t mok_gpu_begin_call(mok_layer_t l, const char *fn, mok_stream_t stream, int *prev);

/* One grouped GEMM of a chain, in the layer's tile order (its tuning's tile_group_m, unless p sets
 * group_m); `fn` and `what` name it in the error. */
mokResult_t mok_gpu_gemm(mok_layer_t l, const mok_grouped_gemm_params_t *p, const char *fn,
                         const char *what, void *stream);

/* MXFP8: bf16 rows [rows, cols] of in (those below *limit when limit is set) quantize-dequantized
 * into out, which may be in (mok_mx_qdq_rows_launch); launch failures recorded on l. */
mokResult_t mok_gpu_mx_qdq(mok_layer_t l, const void *in, void *out, int64_t rows, int64_t cols,
                           const int32_t *limit, void *stream);

/* fp8-block layers: the quantizers' scale kind of the layer's scale rounding (fp32 or power of two). */
mok_quant_scale_t mok_gpu_fp8_kind(mok_layer_t l);
/* fp8-block layers: `rows` bf16 rows of `cols` (in, device memory) quantized along the row in 1x128
 * blocks with the layer's scale rounding, exactly as mok_quantize_host does, into e4m3 q [rows,
 * cols] and K-block-major scales (row r, block b at scales[b * ld + r], ld >= rows); with `limit`
 * (device memory, e.g. offsets + E) only rows below *limit: the routed rows of the call. */
mokResult_t mok_gpu_quantize_rows(mok_layer_t l, const void *in, int64_t rows, int64_t cols,
                                  void *q, void *scales, int64_t ld, const int32_t *limit,
                                  void *stream);

/* fp8-block layers: the e4m3 rows of a call's token rows src [T, H] (x or dy) for the GEMMs over the
 * experts' rows, into the workspace's xq with K-block-major scales. With `gather` (W = 1: the
 * gather's parameters) src is quantized once per token into xqt and its rows copied into expert
 * order; else the rows already in expert order (`rows` [R, H], those below offsets[EL]) are
 * quantized, and src into xqt only for the shared expert. Per row the same bytes either way. */
mokResult_t mok_gpu_fp8_rows(mok_layer_t l, const struct mok_fwd_local_params *gather,
                             const void *src, const void *rows, const int32_t *offsets, int64_t T,
                             void *stream);

/* fp8 layers: B and its scales of a GEMM (p->b and p->b_scale, or p->b_e8m0 for MXFP8; second =
 * 1: p->b2 and its scales) from operand copy `which` of the caller's quantized weights w. */
void mok_gpu_qw_operand(mok_layer_t l, const mok_weights_t *w, mok_qw_which_t which, int second,
                        mok_grouped_gemm_params_t *p);

/* A region of the layer's workspace. */
static inline void *mok_gpu_ws(mok_layer_t l, mok_ws_region_t r) {
  return l->gpu->ws + l->gpu->lay.ws[r];
}

#endif /* MOK_WITH_CUDA */

#endif /* MOK_GPU_GPU_H */
