/*
 * transport.c: the host side of the NVLink transport (src/cuda/comm/comm.h):
 * the symmetric window's lifetime and regions, the layout buffers and the error word, the call
 * counters (epochs) that let kernels reuse counters without clearing them, argument checks, and
 * the decoding of kernel errors into messages.
 *
 * One transport = one symmetric window of
 *   flags [2, W] u64 | disp_ctr [W] u64 | comb_ctr [W] u64 | rec [W] u64 |
 *   slots [2, W, E + W + 4] int32 |
 *   recv_x [W * T_max, H] bf16 | recv_meta [W * T_max, K + 1] int32 | comb [T_max, K, H] bf16
 *   (the standalone transport's; empty in a layer's) | row_w, row_src [W * T_max * K] |
 *   recv_x2 [W * T_max, H] | yk [yk_rows, H] bf16 | yk_w [yk_rows] fp32 (layers only: each row's
 *   router weight and token source; the backward's dy rows; the expert rows' outputs and router
 *   gradients, which the home ranks' reduce reads in place)
 * (regions 256-byte aligned), plus ordinary device memory for this rank's layout and error word.
 * A local communicator (W = 1, no NCCL) gets a plain cudaMalloc window.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/comm/comm.h"
#include "api/api.h"

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

#define TP_DEFAULT_SMS 20      /* 354-361 GB/s per direction on 16-20 SMs (docs/performance.md,
                                  "Transport: rows claimed by warps") */
#define TP_DEFAULT_TIMEOUT_S 10.0
#define TP_SLOT_HEADER_INTS 4  /* LAYOUT_HEADER_INTS: T, T_max, CTAs, status */

struct mok_transport {
  mok_comm_t comm;
  mok_transport_desc_t d;
  int W, rank, device, num_ctas;
  uint64_t timeout_ns;
  mok_nccl_window_t win; /* win.local is cudaMalloc'd when comm->nccl is NULL */
  int vwindow;           /* virtual ranks: the group's window index, else -1 */
  mok_tp_window_layout_t wl;
  void *dev;             /* layout buffers and the error word, one allocation */
  mok_tp_layout_buf_t lay;
  mok_tp_error_t *err;
  int64_t T;             /* tokens of the last layout, -1 before the first */
  const int32_t *topk_idx;
  void *last_stream;
  mokResult_t broken;    /* a timeout left the counters out of step: every call fails */
  int recovering;        /* mok_transport_recover enqueued, not yet confirmed by a check */
  int lost;              /* a recovery timed out: the transport stays unusable */
  uint64_t recoveries;   /* recoveries enqueued (the recovery kernel's generation) */
};

static mokResult_t tp_cuda(const char *call, cudaError_t e) {
  cudaGetLastError();
  return mok_fail(NULL, MOK_ERROR_CUDA, "%s: %s", call, cudaGetErrorString(e));
}

#define TP_CUDA_GOTO(call, res, label)            \
  do {                                            \
    cudaError_t tp_e_ = (call);                   \
    if (tp_e_ != cudaSuccess) {                   \
      res = tp_cuda(#call, tp_e_);                \
      goto label;                                 \
    }                                             \
  } while (0)

static size_t tp_align(size_t x) { return (x + 255) & ~(size_t)255; }

/* The one layout of the window (every rank computes the same from the same desc). */
static void tp_window_layout(const mok_transport_desc_t *d, int W, mok_tp_window_layout_t *wl) {
  const size_t T = (size_t)d->max_tokens, H = (size_t)d->hidden, K = (size_t)d->top_k;
  size_t off = 0;
  wl->slot_ints = d->num_experts + W + TP_SLOT_HEADER_INTS;
  wl->flags = off, off = tp_align(off + 2 * (size_t)W * 8);
  wl->disp_ctr = off, off = tp_align(off + (size_t)W * 8);
  wl->comb_ctr = off, off = tp_align(off + (size_t)W * 8);
  wl->rec = off, off = tp_align(off + (size_t)W * 8);
  wl->slots = off, off = tp_align(off + 2 * (size_t)W * (size_t)wl->slot_ints * 4);
  wl->recv_x = off, off = tp_align(off + (size_t)W * T * H * 2);
  wl->recv_meta = off, off = tp_align(off + (size_t)W * T * (K + 1) * 4);
  wl->comb = off, off = tp_align(off + (d->yk_rows > 0 ? 0 : T * K * H * 2)); /* standalone */
  wl->row_w = off, off = tp_align(off + (size_t)W * T * K * 4);
  wl->row_src = off, off = tp_align(off + (size_t)W * T * K * 4);
  wl->recv_x2 = off, off = tp_align(off + (size_t)W * T * H * 2);
  wl->yk = off, off = tp_align(off + (size_t)d->yk_rows * H * 2);
  wl->yk_w = off, off = tp_align(off + (size_t)d->yk_rows * 4);
  wl->bytes = off;
}

static mokResult_t tp_check_desc(const mok_transport_desc_t *d, int W) {
  if (d->max_tokens < 1 || d->max_tokens > (1 << 24))
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "transport: max_tokens %lld not in [1, 2^24]",
                    (long long)d->max_tokens);
  if (d->hidden < 8 || d->hidden % 8 || d->hidden > MOK_MAX_DIM) /* the window's sizes fit */
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "transport: hidden %lld must be a positive multiple of 8 (16-byte rows), at "
                    "most 2^20",
                    (long long)d->hidden);
  if (d->num_experts < 1 || d->num_experts % W || d->num_experts > MOK_MAX_EXPERTS)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "transport: num_experts %lld must be a multiple of W = %d, at most %d",
                    (long long)d->num_experts, W, MOK_MAX_EXPERTS);
  if (d->top_k < 1 || d->top_k > 64 || d->top_k > d->num_experts)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "transport: top_k %lld not in [1, min(E, 64)]",
                    (long long)d->top_k);
  if (d->tile_m < 1 || d->tile_m > 1024)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "transport: tile_m %lld not in [1, 1024]",
                    (long long)d->tile_m);
  if (d->num_sms < 0 || d->timeout_s < 0 || d->timeout_s > 3600)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "transport: num_sms %d must be >= 0 and timeout_s %g in [0, 3600]", d->num_sms,
                    d->timeout_s);
  if (d->yk_rows < 0 || d->yk_rows >= INT32_MAX)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "transport: yk_rows %lld not in [0, 2^31)",
                    (long long)d->yk_rows);
  /* Row and token indices are int32 on the device. */
  const int64_t rows = (int64_t)W * d->max_tokens * d->top_k + d->num_experts * d->tile_m;
  if (rows >= INT32_MAX || (int64_t)W * d->max_tokens * (d->top_k + 1) >= INT32_MAX)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "transport: W * max_tokens * top_k = %lld rows do not fit int32 indices",
                    (long long)rows);
  return MOK_SUCCESS;
}

/* Makes the transport's device current; returns the previous one in *prev. */
static mokResult_t tp_enter(const mok_transport_t t, int *prev) {
  cudaGetDevice(prev);
  cudaError_t e = cudaSetDevice(t->device);
  return e == cudaSuccess ? MOK_SUCCESS : tp_cuda("cudaSetDevice", e);
}

static void tp_free(mok_transport_t t) {
  if (t->comm && t->comm->nccl) mok_nccl_window_destroy(t->comm->nccl, &t->win);
  else if (t->vwindow >= 0) mok_vgroup_window_release(t->comm, t->vwindow);
  else if (t->win.local) cudaFree(t->win.local);
  if (t->dev) cudaFree(t->dev);
  free(t);
}

mokResult_t mok_transport_create(mok_transport_t *out, mok_comm_t comm,
                                 const mok_transport_desc_t *desc) {
  if (out) *out = NULL;
  if (!out || !desc)
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_create: NULL argument");
  mokResult_t res = mok_comm_valid(comm, "mok_transport_create");
  if (res != MOK_SUCCESS) return res;
  res = tp_check_desc(desc, comm->nranks);
  if (res != MOK_SUCCESS) return res;
  if (comm->device < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_transport_create: the communicator is on the CPU; the transport needs GPUs");
  if (!comm->nccl && !comm->vgroup && comm->nranks != 1)
    return mok_fail(NULL, MOK_ERROR_INTERNAL, "mok_transport_create: %d ranks without NCCL",
                    comm->nranks);

  mok_transport_t t = calloc(1, sizeof(*t));
  if (!t) return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_transport_create: calloc");
  t->comm = comm;
  t->d = *desc;
  t->W = comm->nranks;
  t->rank = comm->rank;
  t->device = comm->device;
  t->T = -1;
  t->vwindow = -1;
  int prev = 0, sms = 0, smem_optin = 0;
  if ((res = tp_enter(t, &prev)) != MOK_SUCCESS) {
    free(t);
    return res;
  }
  TP_CUDA_GOTO(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, t->device), res, fail);
  TP_CUDA_GOTO(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                      t->device),
               res, fail);
  /* Every CTA of the run kernel waits for the others' signals: all must be resident. */
  t->num_ctas = desc->num_sms ? desc->num_sms : TP_DEFAULT_SMS;
  if (t->num_ctas > sms) {
    res = mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "transport: num_sms %d > %d SMs", t->num_ctas,
                   sms);
    goto fail;
  }
  t->d.timeout_s = desc->timeout_s > 0 ? desc->timeout_s : TP_DEFAULT_TIMEOUT_S;
  t->timeout_ns = (uint64_t)(t->d.timeout_s * 1e9);
  tp_window_layout(&t->d, t->W, &t->wl);
  {
    const size_t smem = mok_tp_layout_smem_bytes(t->d.num_experts, t->W);
    if (smem > (size_t)smem_optin) {
      res = mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                     "transport: the layout needs %zu bytes of shared memory (E = %lld), the GPU "
                     "has %d",
                     smem, (long long)t->d.num_experts, smem_optin);
      goto fail;
    }
  }

  /* Layout buffers and the error word. */
  {
    const int64_t T = t->d.max_tokens, K = t->d.top_k, E = t->d.num_experts, W = t->W;
    const int64_t ints = T * K + T * W + W * E + W * W + E + 4 * W + 1 + 4 + 4;
    const size_t epoch_off = tp_align((size_t)ints * 4), err_off = epoch_off + 256;
    TP_CUDA_GOTO(cudaMalloc(&t->dev, err_off + sizeof(mok_tp_error_t)), res, fail);
    TP_CUDA_GOTO(cudaMemset(t->dev, 0, err_off + sizeof(mok_tp_error_t)), res, fail);
    int32_t *p = t->dev;
    t->lay.slot_row = p, p += T * K;
    t->lay.token_pos = p, p += T * W;
    t->lay.count = p, p += W * E;
    t->lay.token_count = p, p += W * W;
    t->lay.expert_start = p, p += E;
    t->lay.rank_rows = p, p += W;
    t->lay.recv_tokens = p, p += W;
    t->lay.num_ctas = p, p += W;
    t->lay.valid = p, p += 1;
    t->lay.claim = (uint32_t *)p, p += 4;
    t->lay.epoch_done = (uint32_t *)p, p += 4;
    t->lay.epoch = (uint64_t *)((char *)t->dev + epoch_off);
    t->err = (mok_tp_error_t *)((char *)t->dev + err_off);
  }

  /* The window (collective over the communicator). */
  if (comm->nccl) {
    res = mok_nccl_window_create(comm->nccl, comm->devcomm, t->device, t->wl.bytes, &t->win);
    if (res != MOK_SUCCESS) goto fail;
  } else if (comm->vgroup) {
    res = mok_vgroup_window(comm, t->wl.bytes, t->win.peer, &t->win.local, &t->vwindow);
    if (res != MOK_SUCCESS) goto fail;
    t->win.bytes = t->wl.bytes;
  } else {
    TP_CUDA_GOTO(cudaMalloc(&t->win.local, t->wl.bytes), res, fail);
    TP_CUDA_GOTO(cudaMemset(t->win.local, 0, t->wl.bytes), res, fail);
    t->win.bytes = t->wl.bytes;
    t->win.peer[0] = t->win.local;
  }
  TP_CUDA_GOTO(cudaDeviceSynchronize(), res, fail);
  cudaSetDevice(prev);
  *out = t;
  return MOK_SUCCESS;

fail:
  tp_free(t);
  cudaSetDevice(prev);
  return res;
}

mokResult_t mok_transport_destroy(mok_transport_t t) {
  if (!t) return MOK_SUCCESS;
  int prev = 0;
  mokResult_t res = tp_enter(t, &prev);
  /* No kernel of ours may still touch the window when it goes. */
  cudaError_t e = cudaDeviceSynchronize();
  if (res == MOK_SUCCESS && e != cudaSuccess) res = tp_cuda("cudaDeviceSynchronize", e);
  tp_free(t);
  cudaSetDevice(prev);
  return res;
}

mokResult_t mok_transport_set_timeout(mok_transport_t t, double seconds) {
  if (!t) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_set_timeout: t is NULL");
  if (!(seconds > 0 && seconds <= 3600))
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "timeout %g s not in (0, 3600]", seconds);
  t->d.timeout_s = seconds;
  t->timeout_ns = (uint64_t)(seconds * 1e9);
  return MOK_SUCCESS;
}

static void tp_params(const mok_transport_t t, mok_tp_params_t *p) {
  memset(p, 0, sizeof *p);
  p->rank = t->rank;
  p->nranks = t->W;
  p->num_ctas = t->num_ctas;
  p->T = t->T;
  p->T_max = t->d.max_tokens;
  p->H = t->d.hidden;
  p->E = t->d.num_experts;
  p->EL = t->d.num_experts / t->W;
  p->K = t->d.top_k;
  p->tile_m = t->d.tile_m;
  p->timeout_ns = t->timeout_ns;
  for (int r = 0; r < t->W; r++) p->peer[r] = (char *)t->win.peer[r];
  p->win = t->wl;
  p->lay = t->lay;
  p->err = t->err;
  p->topk_idx = t->topk_idx;
}

static mokResult_t tp_usable(const mok_transport_t t, const char *fn) {
  if (t->lost)
    return mok_fail(NULL, MOK_ERROR_TIMEOUT,
                    "%s: a recovery of this transport timed out (a rank did not join it); it "
                    "stays unusable: destroy it and create another",
                    fn);
  if (t->recovering)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "%s: a recovery is pending; the check after it (on every rank) makes the "
                    "transport usable again",
                    fn);
  if (t->broken)
    return mok_fail(NULL, t->broken,
                    "%s: an earlier wait of this transport timed out; its counters are out of "
                    "step with the other ranks: recover it on every rank, then check it",
                    fn);
  return MOK_SUCCESS;
}

mokResult_t mok_transport_layout(mok_transport_t t, int64_t num_tokens, const int32_t *topk_idx,
                                 void *stream) {
  return mok_transport_layout_checked(t, num_tokens, topk_idx, NULL, stream);
}

mokResult_t mok_transport_layout_checked(mok_transport_t t, int64_t num_tokens,
                                         const int32_t *topk_idx, const int32_t *local_ok,
                                         void *stream) {
  if (!t) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_layout: t is NULL");
  mokResult_t res = tp_usable(t, "mok_transport_layout");
  if (res != MOK_SUCCESS) return res;
  if (num_tokens < 0 || num_tokens > t->d.max_tokens)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "mok_transport_layout: T = %lld not in [0, %lld]",
                    (long long)num_tokens, (long long)t->d.max_tokens);
  if (num_tokens > 0 && !topk_idx)
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_layout: topk_idx is NULL");
  if (num_tokens > 0 && !mok_cuda_ptr_on_device(topk_idx, t->device))
    return mok_fail(NULL, MOK_ERROR_WRONG_DEVICE,
                    "mok_transport_layout: topk_idx is not memory of device %d", t->device);
  int prev = 0;
  if ((res = tp_enter(t, &prev)) != MOK_SUCCESS) return res;
  t->T = num_tokens;
  t->topk_idx = topk_idx;
  mok_tp_params_t p;
  tp_params(t, &p);
  p.local_ok = local_ok;
  res = mok_tp_layout_launch(&p, stream);
  if (res != MOK_SUCCESS) res = mok_fail(NULL, res, "mok_transport_layout: launch failed");
  t->last_stream = stream;
  cudaSetDevice(prev);
  return res;
}

mokResult_t mok_transport_params(mok_transport_t t, int phases, void *stream, mok_tp_params_t *p) {
  mokResult_t res = tp_usable(t, "mok_transport_params");
  if (res != MOK_SUCCESS) return res;
  if (t->T < 0)
    return mok_fail(NULL, MOK_ERROR_INTERNAL, "mok_transport_params: no layout yet");
  tp_params(t, p);
  p->phases = phases;
  t->last_stream = stream;
  return MOK_SUCCESS;
}

static mokResult_t tp_check_rows(const mok_transport_t t, const void *ptr, const char *name) {
  if (t->T == 0) return MOK_SUCCESS;
  if (!ptr) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_run: %s is NULL", name);
  if ((uintptr_t)ptr % 16)
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "mok_transport_run: %s is not 16-byte aligned",
                    name);
  if (!mok_cuda_ptr_on_device(ptr, t->device))
    return mok_fail(NULL, MOK_ERROR_WRONG_DEVICE, "mok_transport_run: %s is not on device %d",
                    name, t->device);
  return MOK_SUCCESS;
}

mokResult_t mok_transport_run(mok_transport_t t, int phases, const void *x, void *y, void *stream) {
  if (!t) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_run: t is NULL");
  mokResult_t res = tp_usable(t, "mok_transport_run");
  if (res != MOK_SUCCESS) return res;
  if (phases < 1 || phases > MOK_TP_ALL)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "mok_transport_run: phases %d", phases);
  if ((phases & (MOK_TP_COMBINE | MOK_TP_REDUCE)) && t->d.yk_rows > 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_transport_run: a layer's transport (yk_rows > 0) has no comb region: its "
                    "reduce reads the expert rows in place");
  if (t->T < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_transport_run: call mok_transport_layout first");
  if ((phases & (MOK_TP_DISPATCH | MOK_TP_REDUCE)) &&
      (res = tp_check_rows(t, x, "x")) != MOK_SUCCESS)
    return res;
  if ((phases & MOK_TP_REDUCE) && (res = tp_check_rows(t, y, "y")) != MOK_SUCCESS) return res;
  int prev = 0;
  if ((res = tp_enter(t, &prev)) != MOK_SUCCESS) return res;
  mok_tp_params_t p;
  tp_params(t, &p);
  p.x = x;
  p.y = y;
  p.phases = phases;
  res = mok_tp_run_launch(&p, stream);
  if (res != MOK_SUCCESS) res = mok_fail(NULL, res, "mok_transport_run: launch failed");
  t->last_stream = stream;
  cudaSetDevice(prev);
  return res;
}

static const char *tp_counter_name(int c) {
  switch (c) {
    case MOK_TP_WAIT_LAYOUT: return "layout flag";
    case MOK_TP_WAIT_DISPATCH: return "dispatch counter";
    case MOK_TP_WAIT_COMBINE: return "combine counter";
    default: return "counter";
  }
}

mokResult_t mok_transport_check(mok_transport_t t) {
  if (!t) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_check: t is NULL");
  int prev = 0;
  mokResult_t res = tp_enter(t, &prev);
  if (res != MOK_SUCCESS) return res;
  mok_tp_error_t e;
  TP_CUDA_GOTO(cudaStreamSynchronize((cudaStream_t)t->last_stream), res, done);
  TP_CUDA_GOTO(cudaMemcpy(&e, t->err, sizeof e, cudaMemcpyDeviceToHost), res, done);
  if (e.code == 0) {
    if (t->recovering) t->recovering = 0, t->broken = MOK_SUCCESS;  /* every rank joined */
    goto done;
  }
  TP_CUDA_GOTO(cudaMemset(t->err, 0, sizeof e), res, done);
  if (t->recovering) {
    /* Only the recovery kernel ran since it cleared the word: a rank did not join in time. */
    t->recovering = 0, t->lost = 1;
    res = mok_fail(NULL, MOK_ERROR_TIMEOUT,
                   "rank %d: rank %d did not join the recovery within %.0f ms (every rank must "
                   "recover; recovery flag at %llu, target %llu); the transport stays unusable: "
                   "destroy it and create another",
                   e.rank, e.peer, 1e3 * t->d.timeout_s, (unsigned long long)e.value,
                   (unsigned long long)e.target);
  } else if (e.code == MOK_ERROR_TIMEOUT) {
    t->broken = MOK_ERROR_TIMEOUT;
    res = mok_fail(NULL, MOK_ERROR_TIMEOUT,
                   "rank %d, SM %d: waited %.0f ms for the %s of rank %d: value %llu, target %llu "
                   "(did every rank make the same transport calls?)",
                   e.rank, e.sm, 1e3 * t->d.timeout_s, tp_counter_name(e.counter), e.peer,
                   (unsigned long long)e.value, (unsigned long long)e.target);
  } else if (e.code == MOK_ERROR_INVALID_ROUTING) {
    if (e.value == 1)
      res = mok_fail(NULL, MOK_ERROR_INVALID_ROUTING,
                     "rank %d token %lld slot %lld: expert id %lld is outside [-1, %llu); no rank "
                     "moved data in this call",
                     e.rank, (long long)e.a, (long long)e.b, (long long)e.c,
                     (unsigned long long)e.target);
    else
      res = mok_fail(NULL, MOK_ERROR_INVALID_ROUTING,
                     "rank %d token %lld slot %lld: expert id %lld already routed by slot %llu of "
                     "the same token; no rank moved data in this call",
                     e.rank, (long long)e.a, (long long)e.b, (long long)e.c,
                     (unsigned long long)e.target);
  } else {
    res = mok_fail(NULL, (mokResult_t)e.code, "transport kernel error on rank %d", e.rank);
  }
done:
  cudaSetDevice(prev);
  return res;
}

mokResult_t mok_transport_recover(mok_transport_t t, void *stream) {
  if (!t) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_recover: t is NULL");
  if (t->lost)
    return mok_fail(NULL, MOK_ERROR_TIMEOUT,
                    "mok_transport_recover: an earlier recovery timed out (a rank did not join "
                    "it); destroy the transport and create another");
  int prev = 0;
  mokResult_t res = tp_enter(t, &prev);
  if (res != MOK_SUCCESS) return res;
  mok_tp_params_t p;
  tp_params(t, &p);
  res = mok_tp_recover_launch(&p, t->recoveries + 1, stream);
  if (res != MOK_SUCCESS) {
    res = mok_fail(NULL, res, "mok_transport_recover: the recovery kernel failed to launch");
  } else {
    t->recoveries++;
    t->recovering = 1;
    t->last_stream = stream;
  }
  cudaSetDevice(prev);
  return res;
}

mokResult_t mok_transport_view(mok_transport_t t, mok_transport_view_t *v) {
  if (!t || !v) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_view: NULL argument");
  const char *w = t->win.local;
  v->num_tokens = t->T;
  v->recv_capacity = t->W * t->d.max_tokens;
  v->slot_row = t->lay.slot_row;
  v->token_pos = t->lay.token_pos;
  v->count = t->lay.count;
  v->expert_start = t->lay.expert_start;
  v->rank_rows = t->lay.rank_rows;
  v->recv_tokens = t->lay.recv_tokens;
  v->token_count = t->lay.token_count;
  v->recv_x = w + t->wl.recv_x;
  v->recv_meta = (const int32_t *)(w + t->wl.recv_meta);
  v->comb = w + t->wl.comb;
  return MOK_SUCCESS;
}

mokResult_t mok_transport_remote_bytes(mok_transport_t t, int64_t *dispatch_bytes,
                                       int64_t *combine_bytes) {
  if (!t || !dispatch_bytes || !combine_bytes)
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_transport_remote_bytes: NULL argument");
  const int W = t->W, me = t->rank;
  const int64_t E = t->d.num_experts, EL = E / W, H = t->d.hidden;
  int32_t *tc = malloc((size_t)W * W * 4), *cnt = malloc((size_t)W * E * 4);
  int prev = 0;
  mokResult_t res = MOK_ERROR_OUT_OF_MEMORY;
  if (!tc || !cnt) {
    res = mok_fail(NULL, res, "mok_transport_remote_bytes: malloc");
    goto out;
  }
  if ((res = tp_enter(t, &prev)) != MOK_SUCCESS) goto out;
  TP_CUDA_GOTO(cudaStreamSynchronize((cudaStream_t)t->last_stream), res, restore);
  TP_CUDA_GOTO(cudaMemcpy(tc, t->lay.token_count, (size_t)W * W * 4, cudaMemcpyDeviceToHost), res,
               restore);
  TP_CUDA_GOTO(cudaMemcpy(cnt, t->lay.count, (size_t)W * E * 4, cudaMemcpyDeviceToHost), res,
               restore);
  /* Dispatch: our tokens for other ranks. Combine: rows of our experts from other ranks. */
  int64_t disp = 0, comb = 0;
  for (int d = 0; d < W; d++)
    if (d != me) disp += tc[me * W + d];
  for (int s = 0; s < W; s++)
    for (int64_t e = me * EL; e < (me + 1) * EL && s != me; e++) comb += cnt[s * E + e];
  *dispatch_bytes = disp * H * 2;
  *combine_bytes = comb * H * 2;
  res = MOK_SUCCESS;
restore:
  cudaSetDevice(prev);
out:
  free(tc);
  free(cnt);
  return res;
}

#else /* !MOK_WITH_CUDA */

static mokResult_t tp_absent(void) {
  return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE, "this build of MoK has no CUDA transport");
}
mokResult_t mok_transport_create(mok_transport_t *out, mok_comm_t comm,
                                 const mok_transport_desc_t *desc) {
  (void)comm, (void)desc;
  if (out) *out = NULL;
  return tp_absent();
}
mokResult_t mok_transport_destroy(mok_transport_t t) { return t ? tp_absent() : MOK_SUCCESS; }
mokResult_t mok_transport_set_timeout(mok_transport_t t, double s) { (void)t, (void)s; return tp_absent(); }
mokResult_t mok_transport_layout(mok_transport_t t, int64_t n, const int32_t *i, void *s) {
  (void)t, (void)n, (void)i, (void)s;
  return tp_absent();
}
mokResult_t mok_transport_run(mok_transport_t t, int ph, const void *x, void *y, void *s) {
  (void)t, (void)ph, (void)x, (void)y, (void)s;
  return tp_absent();
}
mokResult_t mok_transport_check(mok_transport_t t) { (void)t; return tp_absent(); }
mokResult_t mok_transport_recover(mok_transport_t t, void *s) {
  (void)t, (void)s;
  return tp_absent();
}
mokResult_t mok_transport_view(mok_transport_t t, mok_transport_view_t *v) {
  (void)t, (void)v;
  return tp_absent();
}
mokResult_t mok_transport_remote_bytes(mok_transport_t t, int64_t *a, int64_t *b) {
  (void)t, (void)a, (void)b;
  return tp_absent();
}

#endif /* MOK_WITH_CUDA */
