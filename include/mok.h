/*
 * mok.h: the public C API of MoK, a fused Mixture-of-Experts layer for training.
 *
 * One header, shaped like NCCL's: opaque handles, one result enum, a versioned descriptor with an
 * initializer macro, size queries, and calls that take the stream last. The layer computes exactly
 * what docs/design.md, "The layer", writes down; the plain-C reference backend (a layer created on
 * MOK_DEVICE_CPU) is the specification, the GPU backend must agree with it.
 *
 * Shapes, per rank (row-major; weights in PyTorch Linear layout [out, in]):
 *   x        [T, H]      bf16            topk_idx [T, K] int32 (-1 = empty slot)
 *   topk_w   [T, K]      fp32            y        [T, H] bf16
 *   wg, wu   [EL, I, H]  bf16            wd       [EL, H, I] bf16
 *   wsg, wsu [Is, H]     bf16            wsd      [H, Is] bf16   (shared expert, Is may be 0)
 * where EL = E / W experts live on each of the W ranks; expert e lives on rank e / EL.
 *
 * Errors: every call validates its arguments before touching memory and returns a mokResult_t; the
 * detail of the most recent failure is in mok_last_error() (this thread) and mok_layer_last_error()
 * (that layer). Problems found while a GPU kernel runs (bad expert ids, capacity overflow, a timeout)
 * are written to an error word and reported by the next call on the layer or by mok_layer_check().
 * Library code never exits, aborts or prints.
 */
#ifndef MOK_H
#define MOK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOK_VERSION_MAJOR 0
#define MOK_VERSION_MINOR 2
#define MOK_VERSION_PATCH 0
#define MOK_VERSION_CODE (MOK_VERSION_MAJOR * 10000 + MOK_VERSION_MINOR * 100 + MOK_VERSION_PATCH)

/* The library's run-time version, MOK_VERSION_CODE of the build. */
int mok_version(void);

/* ---------------------------------------------------------------------------------------------- */
/* Results                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

typedef enum {
  MOK_SUCCESS = 0,
  MOK_ERROR_NULL_POINTER = 1,      /* a required pointer argument is NULL */
  MOK_ERROR_INVALID_VALUE = 2,     /* a scalar argument or descriptor field is out of its range */
  MOK_ERROR_INVALID_SHAPE = 3,     /* shapes do not fit together (H % 128, E % W, T > T_max, ...) */
  MOK_ERROR_MISALIGNED = 4,        /* a pointer is not aligned as the call requires */
  MOK_ERROR_VERSION_MISMATCH = 5,  /* descriptor built for another version of this header */
  MOK_ERROR_WRONG_DEVICE = 6,      /* a pointer lives on another device (or host vs device) */
  MOK_ERROR_NO_DEVICE = 7,         /* the requested GPU does not exist or CUDA is not available */
  MOK_ERROR_NOT_IMPLEMENTED = 8,   /* the call exists but this backend does not run it yet */
  MOK_ERROR_NOT_AVAILABLE = 9,     /* a needed facility (NCCL, symmetric memory) is not available */
  MOK_ERROR_OUT_OF_MEMORY = 10,    /* host or device allocation failed */
  MOK_ERROR_CUDA = 11,             /* a CUDA call failed; the detail message names it */
  MOK_ERROR_NCCL = 12,             /* an NCCL call failed; the detail message names it */
  MOK_ERROR_INVALID_ROUTING = 13,  /* expert id out of range, or the same expert twice in a row */
  MOK_ERROR_CAPACITY_OVERFLOW = 14,/* more routed rows arrived than the layer's capacity */
  MOK_ERROR_TIMEOUT = 15,          /* a wait for another rank or SM did not finish in time */
  MOK_ERROR_CONTEXT_MISMATCH = 16, /* the saved context was not written by a matching forward */
  MOK_ERROR_INTERNAL = 17,         /* a bug in MoK; please report the detail message */
  MOK_NUM_RESULTS
} mokResult_t;

/* A fixed, human-readable name of a result, never NULL. */
const char *mok_error_string(mokResult_t result);
/* Detail of the most recent failing call made by this thread ("" when none); valid until the next
 * failing call in this thread. */
const char *mok_last_error(void);

/* ---------------------------------------------------------------------------------------------- */
/* Types                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

/* The same type as cudaStream_t and ncclComm_t, declared here so this header needs neither. */
typedef struct CUstream_st *mok_stream_t;
struct ncclComm;

/* Handles. A layer uses its communicator: create the communicator first and destroy it last
 * (mok_comm_destroy refuses while layers created on it live). Destroying NULL does nothing. The
 * library keeps the set of live handles: every call refuses a destroyed handle, a handle of the
 * other kind and any pointer that never was a handle with MOK_ERROR_INVALID_VALUE, "destroyed or
 * invalid handle", without reading the memory it points to (only a new handle that happens to
 * get a destroyed one's address is live again). Of two threads destroying the same handle, one
 * succeeds and the other is refused. */
typedef struct mok_comm *mok_comm_t;
typedef struct mok_layer *mok_layer_t;

/* The precision of every GEMM in the layer (routed and shared). */
typedef enum {
  MOK_PRECISION_BF16 = 0,      /* bf16 operands, fp32 accumulation */
  MOK_PRECISION_FP8_BLOCK = 1, /* e4m3; activations 1x128, weights 128x128 blocks (DeepSeek-V3) */
  MOK_PRECISION_MXFP8 = 2      /* e4m3; 1x32 blocks along the reduction dim, E8M0 scales (OCP MX) */
} mok_precision_t;

/* How fp8-block scales are rounded (MXFP8 scales are always powers of two). */
typedef enum {
  MOK_FP8_SCALE_FP32 = 0, /* scale = amax / 448 in fp32 */
  MOK_FP8_SCALE_POW2 = 1  /* scale = 2^X, the smallest X with amax <= 448 * 2^X (UE8M0) */
} mok_fp8_scale_t;

typedef enum {
  MOK_WGRAD_BF16 = 0,
  MOK_WGRAD_FP32 = 1
} mok_wgrad_dtype_t;

typedef enum {
  MOK_CONTEXT_SAVE = 0,     /* forward saves dispatched rows and bf16 g, u for backward */
  MOK_CONTEXT_RECOMPUTE = 1 /* backward recomputes them, bit-identically; smaller context */
} mok_context_mode_t;

/* A CPU "device": a layer on a communicator created with it runs the plain-C reference backend. */
#define MOK_DEVICE_CPU (-1)

/* ---------------------------------------------------------------------------------------------- */
/* Communicators                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

/* W = 1 on one device (a CUDA ordinal, or MOK_DEVICE_CPU); needs no NCCL. */
mokResult_t mok_comm_create_local(mok_comm_t *out, int device);

/* Expert parallelism over an existing NCCL communicator (for example PyTorch's), on `device`.
 * MoK never destroys `nccl`; it must outlive the returned communicator. */
mokResult_t mok_comm_create_nccl(mok_comm_t *out, struct ncclComm *nccl, int device);

/* Expert parallelism bootstrapped from a unique id: rank 0 calls mok_get_unique_id and passes the
 * id to every rank (a pipe, a file, torch.distributed), then each rank calls create. */
typedef struct {
  char internal[128];
} mok_unique_id_t;
mokResult_t mok_get_unique_id(mok_unique_id_t *id);
mokResult_t mok_comm_create_unique_id(mok_comm_t *out, const mok_unique_id_t *id, int rank,
                                      int nranks, int device);

/* W "virtual" ranks on one GPU: out[r] is rank r of W, all on `device`, and a layer created on
 * each of them is a W-rank expert-parallel layer whose peers are buffers on the same GPU, through
 * the same kernels, counters and transport as W GPUs (no NCCL). For testing expert-parallel code
 * without W GPUs. Each rank's calls must go to its own stream (its kernels wait for the other
 * ranks'); one thread may drive all ranks, since no call waits for another rank on the host.
 * Layers are created collectively: every rank creates its layers in the same order. */
mokResult_t mok_comm_create_virtual(mok_comm_t out[], int nranks, int device);

/* Fails with MOK_ERROR_INVALID_VALUE, leaving the communicator intact, while layers created on it
 * are alive (the message says how many): destroy them first. */
mokResult_t mok_comm_destroy(mok_comm_t comm);
mokResult_t mok_comm_rank(mok_comm_t comm, int *rank);
mokResult_t mok_comm_size(mok_comm_t comm, int *nranks);
mokResult_t mok_comm_device(mok_comm_t comm, int *device);

/* ---------------------------------------------------------------------------------------------- */
/* Layer                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

/* Constraints checked by mok_layer_create: H, I and Is (when not 0) are positive multiples of 128
 * (Is may be 0), at most 2^20; 1 <= E <= 2^16 with E % W == 0; 1 <= K <= min(E, 64);
 * 1 <= T_max <= 2^24; capacity_factor is 0 or in (0, W], and the routed rows a rank can receive,
 * ceil(capacity_factor * T_max * K) (capacity_factor 0: W), are below 2^31; comm_sms >= 0.
 * Within these bounds every size the library computes (context, workspace, quantized weights)
 * fits in 64 bits; a descriptor outside them gives MOK_ERROR_INVALID_SHAPE (MOK_ERROR_INVALID_VALUE
 * for T_max) naming the field and the numbers. */
typedef struct {
  size_t struct_size;              /* sizeof(mok_layer_desc_t); set by MOK_LAYER_DESC_INIT */
  int version;                     /* MOK_VERSION_CODE; set by MOK_LAYER_DESC_INIT */
  int64_t hidden;                  /* H */
  int64_t intermediate;            /* I, per routed expert */
  int64_t num_experts;             /* E, over all ranks */
  int64_t top_k;                   /* K */
  int64_t shared_intermediate;     /* Is; 0 = no shared expert */
  int64_t max_tokens;              /* T_max, per rank */
  mok_precision_t precision;       /* default BF16 */
  mok_fp8_scale_t fp8_scale;       /* fp8-block only; default FP32 */
  mok_wgrad_dtype_t wgrad_dtype;   /* default FP32 */
  int wgrad_accumulate;            /* 0: backward overwrites the weight gradients; 1: adds to them */
  mok_context_mode_t context_mode; /* default SAVE */
  int comm_sms;                    /* SMs that move tokens; 0 = automatic. Results never depend on it */
  double capacity_factor;          /* routed rows a rank can receive, as a multiple of T_max * K;
                                      0 = automatic: W (the worst case, never overflows). A smaller
                                      value saves memory; overflow is reported, never dropped */
} mok_layer_desc_t;

#define MOK_LAYER_DESC_INIT                                                                   \
  {                                                                                           \
    sizeof(mok_layer_desc_t), MOK_VERSION_CODE, 0, 0, 0, 0, 0, 0, MOK_PRECISION_BF16,         \
        MOK_FP8_SCALE_FP32, MOK_WGRAD_FP32, 0, MOK_CONTEXT_SAVE, 0, 0.0                       \
  }

mokResult_t mok_layer_create(mok_layer_t *out, mok_comm_t comm, const mok_layer_desc_t *desc);
mokResult_t mok_layer_destroy(mok_layer_t layer);
/* Detail of the most recent failure on this layer ("" when none; a fixed message for a destroyed
 * or invalid handle). */
const char *mok_layer_last_error(mok_layer_t layer);
/* Reports an error found asynchronously by a kernel of this layer (MOK_SUCCESS when none) and
 * clears it. Like ncclCommGetAsyncError; synchronizes with the stream of the layer's last
 * forward or backward (which must still exist and must not be capturing a graph when this is called).
 * On a GPU layer, mok_forward returns once its kernels are enqueued, so bad routing (an id
 * outside [-1, E), an expert twice in a token) and capacity overflow surface only here: the
 * forward that met them computes nothing (y is left as it was, and its context is marked as
 * written by no forward), later forwards run normally, and the first such error waits in the
 * layer until this call reports it, with the (token, slot) and id at fault in the message. */
mokResult_t mok_layer_check(mok_layer_t layer);
/* After MOK_ERROR_TIMEOUT on an expert-parallel layer (a rank that did not make the same calls in
 * time), the ranks' counters are out of step and every call on the layer is refused. This puts
 * them back in step without creating the layer again. Collective: every rank of the layer's
 * communicator calls it, once per recovery, in any order and from one thread or several (the
 * same as any call); then every rank calls mok_layer_check, which reports MOK_SUCCESS once all
 * ranks have joined, and the layer is usable again. Stream-ordered on `stream`: it waits for
 * this rank's earlier work there, then (bounded by the layer's timeout) for every rank; errors
 * that no check has reported yet are dropped. The call that timed out is lost on every rank:
 * its y or gradients are wrong (also on a rank whose late call reported nothing), and a forward
 * that timed out leaves its context refused by the backward. If a rank does not join in time, that
 * check reports MOK_ERROR_TIMEOUT naming it and the layer stays unusable: destroy it and create
 * another. Layers on one rank, and CPU layers, have nothing to recover: MOK_SUCCESS. Added
 * after version 0.2.0. */
mokResult_t mok_layer_recover(mok_layer_t layer, mok_stream_t stream);

/* Bytes of device (or host, on the CPU) workspace the layer holds for its lifetime. */
mokResult_t mok_layer_workspace_size(mok_layer_t layer, size_t *bytes);
/* Bytes of the saved context that forward writes and backward reads, for T_max tokens. */
mokResult_t mok_context_size(mok_layer_t layer, size_t *bytes);
/* Bytes of the buffer mok_quantize_weights fills (0 for BF16 layers). */
mokResult_t mok_quantized_weights_size(mok_layer_t layer, size_t *bytes);

/* The layer's weights on this rank. BF16 layers read the bf16 pointers; fp8 layers read only
 * `quantized`, the buffer filled by mok_quantize_weights from the bf16 weights, whose size the
 * caller states in `quantized_bytes` (at least mok_quantized_weights_size; BF16 layers ignore it;
 * new in version 0.2). */
typedef struct {
  const void *wg;        /* [EL, I, H] bf16 routed gate projection */
  const void *wu;        /* [EL, I, H] bf16 routed up projection */
  const void *wd;        /* [EL, H, I] bf16 routed down projection */
  const void *wsg;       /* [Is, H] bf16 shared gate (NULL when Is = 0) */
  const void *wsu;       /* [Is, H] bf16 shared up */
  const void *wsd;       /* [H, Is] bf16 shared down */
  const void *quantized; /* fp8 layers: mok_quantized_weights_size bytes from mok_quantize_weights */
  size_t quantized_bytes; /* bytes of the `quantized` buffer */
} mok_weights_t;

/* Quantizes the bf16 weights into `out` (out_bytes >= mok_quantized_weights_size) in the library's
 * layout: e4m3 values and scales of every GEMM operand, including the transposed copies that
 * backward reads (FP8 wgmma reads both operands K-major). The quantizer is mok_quantize_host's,
 * bit for bit. */
mokResult_t mok_quantize_weights(mok_layer_t layer, const mok_weights_t *w, void *out,
                                 size_t out_bytes, mok_stream_t stream);

typedef struct {
  int64_t num_tokens;      /* T on this rank, 0 <= T <= T_max */
  const void *x;           /* [T, H] bf16 */
  const int32_t *topk_idx; /* [T, K] expert ids in [0, E), distinct within a row; -1 = empty */
  const float *topk_w;     /* [T, K] router weights */
  mok_weights_t w;
} mok_forward_args_t;

typedef struct {
  const void *dy;    /* [T, H] bf16 */
  void *dx;          /* [T, H] bf16, written */
  float *dtopk_w;    /* [T, K] fp32, written (0 for empty slots) */
  void *dwg, *dwu;   /* [EL, I, H] in wgrad_dtype, written or accumulated */
  void *dwd;         /* [EL, H, I] */
  void *dwsg, *dwsu; /* [Is, H] (NULL when Is = 0) */
  void *dwsd;        /* [H, Is] */
} mok_backward_args_t;

/* Buffers whose size the library cannot derive from the arguments come with their size: a
 * smaller buffer than needed is refused with MOK_ERROR_INVALID_VALUE naming both sizes (the
 * tensors of the argument structs have the shapes above, set by num_tokens and the descriptor). */

/* y[T, H] = the MoE layer on this rank's tokens. Writes `ctx`, a buffer of ctx_bytes >=
 * mok_context_size bytes, for backward. Asynchronous on `stream` for GPU layers; on a CPU layer
 * the call runs to completion and `stream` must be NULL. */
mokResult_t mok_forward(mok_layer_t layer, const mok_forward_args_t *args, void *y, void *ctx,
                        size_t ctx_bytes, mok_stream_t stream);

/* Gradients of the layer for dy, given the same forward arguments and the context forward wrote
 * (ctx_bytes >= mok_context_size bytes). */
mokResult_t mok_backward(mok_layer_t layer, const mok_forward_args_t *args,
                         const mok_backward_args_t *grads, const void *ctx, size_t ctx_bytes,
                         mok_stream_t stream);

/* ---------------------------------------------------------------------------------------------- */
/* Quantizers, defined bit-exactly (the GPU kernels reproduce them bit for bit)                    */
/* ---------------------------------------------------------------------------------------------- */
/*
 * Element format: OCP FP8 E4M3 ("fn": no infinities, max normal 448, NaN = S.1111.111).
 *   e4m3(v): round to nearest, ties to even, on the e4m3 grid (subnormals down to 2^-9);
 *            |v| above 448 saturates to +-448 (the rounding happens first: 464 rounds to 448,
 *            anything that would round above 448 becomes 448); NaN -> 0x7F; -0 -> 0x80.
 * A block of values (block_rows x block_cols of a row-major matrix, clipped at the matrix edge)
 * shares one scale s, and q = e4m3(v / s) with an IEEE fp32 division; dequantized value = q * s.
 * amax = max |v| over the block.
 *   MOK_QUANT_FP32_SCALE: s = amax / 448 (fp32 division). If s is below 2^-126 (including a zero
 *            block), s = 2^-126 is used instead, so no division by zero or by a subnormal.
 *   MOK_QUANT_POW2_SCALE: s = 2^X, the smallest integer X in [-127, 127] with amax <= 448 * 2^X
 *            (X = -127 for a zero block); stored as an fp32 value.
 *   MOK_QUANT_E8M0_SCALE: the same s = 2^X, stored as one E8M0 byte X + 127 (the MXFP8 format).
 *            The OCP spec's floor(log2(amax)) - 8 rule would saturate up to 12.5% of the largest
 *            values; rounding the scale up (as NVIDIA's MXFP8 recipe does) never saturates.
 * Non-finite inputs: a block holding a NaN or an infinity gets a NaN scale (fp32 NaN, or the E8M0
 * NaN byte 0xFF) and every element of the block becomes 0x7F (NaN).
 * Blocks: fp8-block activations 1x128, weights 128x128; MXFP8 1x32 (along the reduction dim).
 */
typedef enum {
  MOK_QUANT_FP32_SCALE = 0,
  MOK_QUANT_POW2_SCALE = 1,
  MOK_QUANT_E8M0_SCALE = 2
} mok_quant_scale_t;

/* Quantizes a row-major [rows, cols] fp32 matrix on the host. q: rows * cols e4m3 bytes, row-major.
 * scales: [ceil(rows / block_rows), ceil(cols / block_cols)] row-major, fp32 for FP32 and POW2,
 * one byte each for E8M0. block_rows, block_cols in 1..1024. */
mokResult_t mok_quantize_host(const float *in, int64_t rows, int64_t cols, int block_rows,
                              int block_cols, mok_quant_scale_t scale, uint8_t *q, void *scales);
/* The inverse: out[r, c] = e4m3_to_float(q[r, c]) * s(block of r, c), in fp32. */
mokResult_t mok_dequantize_host(const uint8_t *q, const void *scales, int64_t rows, int64_t cols,
                                int block_rows, int block_cols, mok_quant_scale_t scale,
                                float *out);

#ifdef __cplusplus
}
#endif

#endif /* MOK_H */
