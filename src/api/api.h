/*
 * api.h: what the front end (src/api/) and the backends share: the handle structs, argument
 * validation, and the backends' entry points. The contracts that device code compiles too
 * (context header, quantized-weight layout, error reporting) are in src/common/. Not installed; include/mok.h is the only public header.
 */
#ifndef MOK_API_H
#define MOK_API_H

#include <stddef.h>
#include <stdint.h>

#include "common/context.h"
#include "common/quantized_layout.h"
#include "common/status.h"
#include "common/tuning.h"
#include "mok.h"

#ifdef __cplusplus
extern "C" { /* the CUDA launchers report errors through mok_fail */
#endif

/* Live handles are registered (src/api/handles.c): every entry point looks its handle up before
 * it reads the memory behind it, so a destroyed handle, or a pointer that never was one, is
 * refused without that memory being read (it may have been freed, unmapped or reused). A handle
 * also carries a magic word, checked once the lookup found it live, against memory corruption.
 * mok_handle_add: 0 when the set could not grow; mok_handle_live: 1 when h is a live handle of
 * this kind; mok_handle_take: the same, and h is no longer live (destroy: exactly one caller
 * gets 1, so a handle is never freed twice). */
enum { MOK_HANDLE_COMM = 1, MOK_HANDLE_LAYER = 2 };
int mok_handle_add(const void *h, int kind);
int mok_handle_live(const void *h, int kind);
int mok_handle_take(const void *h, int kind);
#define MOK_COMM_MAGIC 0x316d6d6f436b6f6dull  /* "mokComm1" */
#define MOK_LAYER_MAGIC 0x3172796c4c6b6f6dull /* "mokLlyr1" */

struct mok_comm {
  int device; /* CUDA ordinal, or MOK_DEVICE_CPU */
  int rank, nranks;
  int owns_nccl; /* created from a unique id: destroyed with this communicator */
  void *nccl;    /* ncclComm_t; NULL for a local communicator */
  void *devcomm; /* NCCL device communicator: exists only where symmetric memory works */
  uint64_t magic;  /* MOK_COMM_MAGIC while the communicator lives */
  int live_layers; /* layers created on it and not destroyed (__atomic builtins) */
  struct mok_vgroup *vgroup; /* virtual ranks sharing one GPU (mok_comm_create_virtual), or NULL */
  int vwindows;              /* windows this rank has taken from its group so far */
};

/* Virtual ranks: W communicators on one GPU whose "peers" are buffers on the same device, so that
 * expert parallelism runs through the same kernels and peer-pointer transport without a second GPU
 * (include/mok.h, mok_comm_create_virtual). A window is collective: the n-th window any rank of
 * the group asks for allocates the n-th buffer of every rank at once (zeroed), so ranks driven from
 * one thread never wait for each other; each rank takes its own, and the last rank to give its
 * buffer back frees all W. */
mokResult_t mok_vgroup_window(mok_comm_t comm, size_t bytes, void *peer[], void **local,
                              int *index);
void mok_vgroup_window_release(mok_comm_t comm, int index);
void mok_vgroup_leave(mok_comm_t comm); /* mok_comm_destroy of a virtual rank */
struct mok_vgroup;
mokResult_t mok_vgroup_create(int nranks, int device, struct mok_vgroup **out);
void mok_vgroup_join(mok_comm_t comm, struct mok_vgroup *g);
void mok_vgroup_free(struct mok_vgroup *g); /* one that no communicator joined */

struct mok_layer {
  mok_comm_t comm;
  mok_layer_desc_t d;
  uint64_t magic;        /* MOK_LAYER_MAGIC while the layer lives */
  int64_t EL;            /* local experts, E / W */
  int64_t capacity_rows; /* routed rows (unpadded) this rank can receive */
  uint64_t id;           /* distinguishes layers in saved contexts */
  char err[MOK_ERR_LEN]; /* detail of the last failure on this layer */
  mok_tuning_t tuning;   /* mok_tuning_default at create; tests change it (src/api/internal.h) */
  struct mok_gpu_layer *gpu; /* GPU backend state (src/gpu/forward.c); NULL on the CPU */
};

/* MOK_SUCCESS when the handle is a live one; else MOK_ERROR_NULL_POINTER (NULL) or
 * MOK_ERROR_INVALID_VALUE (destroyed or never created), recorded with `fn`, the public call, in
 * the thread's last error only (an invalid handle's memory is never written). */
mokResult_t mok_comm_valid(mok_comm_t comm, const char *fn);
mokResult_t mok_layer_valid(mok_layer_t layer, const char *fn);

/* Validation shared by both backends; each returns MOK_SUCCESS or the failure already recorded. */
mokResult_t mok_check_forward_args(mok_layer_t l, const mok_forward_args_t *a, const void *y,
                                   const void *ctx, size_t ctx_bytes, mok_stream_t stream);
mokResult_t mok_check_backward_args(mok_layer_t l, const mok_forward_args_t *a,
                                    const mok_backward_args_t *g, const void *ctx,
                                    size_t ctx_bytes, mok_stream_t stream);
mokResult_t mok_check_weights(mok_layer_t l, const mok_weights_t *w, int need_quantized);

/* CPU context after the header (SAVE mode): bf16 g, u of each (token, slot): [T_max * K, I] each,
 * then the shared expert's gs, us: [T_max, Is] each. RECOMPUTE mode: the header only. */
size_t mok_cpu_context_bytes(const mok_layer_desc_t *d);

/* ---- backends --------------------------------------------------------------------------------- */
mokResult_t mok_cpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx);
mokResult_t mok_cpu_backward(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *g, const void *ctx);
mokResult_t mok_cpu_quantize_weights(mok_layer_t l, const mok_weights_t *w, void *out);

/* GPU backend (src/gpu/forward.c): W = 1, BF16 runs; other GPU layers report
 * MOK_ERROR_NOT_IMPLEMENTED from forward. create allocates the workspace (src/common/workspace.h). */
mokResult_t mok_gpu_layer_create(mok_layer_t l);
void mok_gpu_layer_destroy(mok_layer_t l);
size_t mok_gpu_workspace_bytes(mok_layer_t l);
size_t mok_gpu_context_bytes(mok_layer_t l);
mokResult_t mok_gpu_forward(mok_layer_t l, const mok_forward_args_t *a, void *y, void *ctx,
                            mok_stream_t stream);
mokResult_t mok_gpu_check(mok_layer_t l);
mokResult_t mok_gpu_recover(mok_layer_t l, mok_stream_t stream);
/* GPU backward (src/gpu/backward.c), W = 1 BF16 like the forward. */
mokResult_t mok_gpu_backward(mok_layer_t l, const mok_forward_args_t *a,
                             const mok_backward_args_t *g, const void *ctx, mok_stream_t stream);
/* CUDA helpers (src/gpu/cuda_host.c); without CUDA they report MOK_ERROR_NO_DEVICE. */
mokResult_t mok_cuda_device_count(int *count);
/* 1 if p is device (or managed) memory of `device`, 0 otherwise (host or another device). */
int mok_cuda_ptr_on_device(const void *p, int device);

#ifdef __cplusplus
}
#endif

#endif /* MOK_API_H */
