/*
 * mok_internal.h: what the host files of the library share: the handle structs, error reporting,
 * argument validation, the saved-context and quantized-weight layouts, and the backends' entry
 * points. Not installed; include/mok.h is the only public header.
 */
#ifndef MOK_INTERNAL_H
#define MOK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" { /* the CUDA launchers report errors through mok_fail */
#endif

enum { MOK_ERR_LEN = 512 };

struct mok_comm {
  int device; /* CUDA ordinal, or MOK_DEVICE_CPU */
  int rank, nranks;
  void *nccl;    /* ncclComm_t; NULL for a local communicator */
  int owns_nccl; /* created from a unique id: destroyed with this communicator */
  void *devcomm; /* NCCL device communicator: exists only where symmetric memory works */
};

struct mok_layer {
  mok_comm_t comm;
  mok_layer_desc_t d;
  int64_t EL;            /* local experts, E / W */
  int64_t capacity_rows; /* routed rows (unpadded) this rank can receive */
  uint64_t id;           /* distinguishes layers in saved contexts */
  char err[MOK_ERR_LEN]; /* detail of the last failure on this layer */
  struct mok_gpu_layer *gpu; /* GPU backend state (src/gpu_backend.c); NULL on the CPU */
};

/* Records a failure: formats the detail into the thread's last error and, when layer is not NULL,
 * the layer's; returns `code` so callers can write `return mok_fail(l, CODE, "...", ...)`. */
mokResult_t mok_fail(mok_layer_t layer, mokResult_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Propagates code and the detail in `msg` (from a function that wrote into a buffer). */
mokResult_t mok_fail_msg(mok_layer_t layer, mokResult_t code, const char *msg);

/* Validation shared by both backends; each returns MOK_SUCCESS or the failure already recorded. */
mokResult_t mok_check_forward_args(mok_layer_t l, const mok_forward_args_t *a, const void *y,
                                   const void *ctx, mok_stream_t stream);
mokResult_t mok_check_backward_args(mok_layer_t l, const mok_forward_args_t *a,
                                    const mok_backward_args_t *g, const void *ctx,
                                    mok_stream_t stream);
mokResult_t mok_check_weights(mok_layer_t l, const mok_weights_t *w, int need_quantized);

/* ---- saved context ---------------------------------------------------------------------------- */
/* The context starts with this header, so backward can tell a context of another forward. */
typedef struct {
  uint64_t magic;      /* MOK_CTX_MAGIC once a forward completed */
  uint64_t layer_id;
  int64_t num_tokens;
  uint64_t routing_hash; /* FNV-1a of topk_idx */
  int64_t mode;          /* mok_context_mode_t */
  int64_t pad[3];
} mok_ctx_header_t;
#define MOK_CTX_MAGIC 0x4d6f4b4374780001ull

/* CPU context after the header (SAVE mode): bf16 g, u of each (token, slot): [T_max * K, I] each,
 * then the shared expert's gs, us: [T_max, Is] each. RECOMPUTE mode: the header only. */
size_t mok_cpu_context_bytes(const mok_layer_desc_t *d);
uint64_t mok_routing_hash(const int32_t *topk_idx, int64_t n);

/* ---- quantized weights ------------------------------------------------------------------------ */
/* One operand copy: e4m3 values [EL or 1, rows, cols] row-major (cols = the GEMM's reduction dim),
 * then scales [EL or 1, ceil(rows / br), ceil(cols / bc)] (fp32, or E8M0 bytes for MXFP8). */
typedef struct {
  size_t data, scales; /* byte offsets into the buffer */
  int64_t count, rows, cols;
  int br, bc;
  mok_quant_scale_t kind;
  int transposed;      /* a backward copy: stored as the transpose of its bf16 source */
  size_t scale_stride; /* bytes of one expert's scales */
} mok_qw_operand_t;

typedef enum {
  MOK_QW_WG = 0, MOK_QW_WU, MOK_QW_WD,        /* forward: [EL,I,H], [EL,I,H], [EL,H,I] */
  MOK_QW_WG_T, MOK_QW_WU_T, MOK_QW_WD_T,      /* backward, transposed: [EL,H,I], [EL,H,I], [EL,I,H] */
  MOK_QW_WSG, MOK_QW_WSU, MOK_QW_WSD,         /* shared forward */
  MOK_QW_WSG_T, MOK_QW_WSU_T, MOK_QW_WSD_T,   /* shared backward, transposed */
  MOK_QW_COUNT
} mok_qw_which_t;

typedef struct {
  mok_qw_operand_t op[MOK_QW_COUNT];
  size_t bytes;
} mok_qw_layout_t;

/* The one layout of the quantized-weight buffer (host and device agree by calling this). */
void mok_qw_layout(const mok_layer_desc_t *d, int64_t EL, mok_qw_layout_t *out);

/* ---- backends --------------------------------------------------------------------------------- */
mokResult_t mok_cpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx);
mokResult_t mok_cpu_backward(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *g, const void *ctx);
mokResult_t mok_cpu_quantize_weights(mok_layer_t l, const mok_weights_t *w, void *out);

/* GPU backend (src/gpu_backend.c): W = 1, BF16 runs; other GPU layers report
 * MOK_ERROR_NOT_IMPLEMENTED from forward. create allocates the workspace (src/workspace.h). */
mokResult_t mok_gpu_layer_create(mok_layer_t l);
void mok_gpu_layer_destroy(mok_layer_t l);
size_t mok_gpu_workspace_bytes(mok_layer_t l);
size_t mok_gpu_context_bytes(mok_layer_t l);
mokResult_t mok_gpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx,
                            mok_stream_t stream);
mokResult_t mok_gpu_check(mok_layer_t l);
/* GPU backward (src/gpu_backward.c), W = 1 BF16 like the forward. */
mokResult_t mok_gpu_backward(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *g, const void *ctx, mok_stream_t stream);
/* For src/gpu_backward.c: the layer's device workspace (NULL when the layer cannot run), and
 * the stream of a call, which mok_layer_check then synchronizes with. */
void *mok_gpu_workspace(mok_layer_t l);
/* MOK_SUCCESS when the GPU backend runs this layer (W = 1, BF16, workspace held); else the
 * failure, recorded with `fn` (the public call) in the message. */
mokResult_t mok_gpu_check_supported(mok_layer_t l, const char *fn);
void mok_gpu_track_stream(mok_layer_t l, mok_stream_t stream);

/* CUDA helpers (src/cuda_host.c); without CUDA they report MOK_ERROR_NO_DEVICE. */
mokResult_t mok_cuda_device_count(int *count);
/* 1 if p is device (or managed) memory of `device`, 0 otherwise (host or another device). */
int mok_cuda_ptr_on_device(const void *p, int device);

#ifdef __cplusplus
}
#endif

#endif /* MOK_INTERNAL_H */
