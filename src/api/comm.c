/* comm.c: communicators. W = 1 needs nothing; expert parallelism wraps an NCCL communicator
 * (the caller's, or one we create from a unique id) and its device communicator, whose creation
 * is where NCCL tells us that symmetric memory works. Windows and the transport live in
 * transport.c; the NCCL calls themselves in cuda/comm/nccl_window.cu. Builds without NCCL keep the
 * constructors and report MOK_ERROR_NOT_AVAILABLE. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include "api/api.h"
#include "common/limits.h"

static mokResult_t invalid_comm(mok_comm_t comm, const char *fn) {
  return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                  "%s: comm %p is a destroyed or invalid handle (not from mok_comm_create_*, or "
                  "already passed to mok_comm_destroy)",
                  fn, (void *)comm);
}

/* Makes a new communicator a live handle (its magic set, registered); MOK_ERROR_OUT_OF_MEMORY
 * when the handle set could not grow, and then c is the caller's to free. */
static mokResult_t comm_register(mok_comm_t c) {
  c->magic = MOK_COMM_MAGIC;
  if (mok_handle_add(c, MOK_HANDLE_COMM)) return MOK_SUCCESS;
  c->magic = 0;
  return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_comm_create: the set of live handles");
}

mokResult_t mok_comm_valid(mok_comm_t comm, const char *fn) {
  if (!comm) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: comm is NULL", fn);
  if (!mok_handle_live(comm, MOK_HANDLE_COMM) || comm->magic != MOK_COMM_MAGIC)
    return invalid_comm(comm, fn);
  return MOK_SUCCESS;
}

static mokResult_t check_device(int device) {
  if (device == MOK_DEVICE_CPU) return MOK_SUCCESS;
  if (device < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "device %d: use a CUDA ordinal >= 0 or MOK_DEVICE_CPU (-1)", device);
  int n = 0;
  mokResult_t r = mok_cuda_device_count(&n);
  if (r != MOK_SUCCESS) return r;
  if (device >= n)
    return mok_fail(NULL, MOK_ERROR_NO_DEVICE, "device %d does not exist (%d CUDA devices)", device, n);
  return MOK_SUCCESS;
}

mokResult_t mok_comm_create_local(mok_comm_t *out, int device) {
  if (!out) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_comm_create_local: out is NULL");
  *out = NULL;
  mokResult_t r = check_device(device);
  if (r != MOK_SUCCESS) return r;
  mok_comm_t c = calloc(1, sizeof(*c));
  if (!c) return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_comm_create_local: calloc");
  c->device = device;
  c->rank = 0;
  c->nranks = 1;
  if ((r = comm_register(c)) != MOK_SUCCESS) {
    free(c);
    return r;
  }
  *out = c;
  return MOK_SUCCESS;
}

mokResult_t mok_comm_create_virtual(mok_comm_t out[], int nranks, int device) {
  if (!out) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_comm_create_virtual: out is NULL");
  if (nranks < 1 || nranks > MOK_MAX_RANKS)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_comm_create_virtual: %d ranks not in [1, %d]", nranks, MOK_MAX_RANKS);
  for (int r = 0; r < nranks; r++) out[r] = NULL;
  if (device < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_comm_create_virtual: device %d is not a GPU", device);
  struct mok_vgroup *g = NULL;
  mokResult_t r = check_device(device);
  if (r == MOK_SUCCESS) r = mok_vgroup_create(nranks, device, &g);
  for (int q = 0; q < nranks && r == MOK_SUCCESS; q++) r = mok_comm_create_local(&out[q], device);
  if (r != MOK_SUCCESS) {
    for (int q = 0; q < nranks; q++) {
      mok_comm_destroy(out[q]);
      out[q] = NULL;
    }
    mok_vgroup_free(g);
    return r;
  }
  for (int q = 0; q < nranks; q++) {
    out[q]->rank = q;
    out[q]->nranks = nranks;
    mok_vgroup_join(out[q], g);
  }
  return MOK_SUCCESS;
}

#ifdef MOK_WITH_NCCL
#include "cuda/comm/comm.h"

/* Wraps an NCCL communicator on `device`; creates the device communicator (collective), which
 * is where NCCL tells us whether symmetric memory works. */
static mokResult_t comm_from_nccl(mok_comm_t *out, void *nccl, int owns, int device) {
  int rank = 0, nranks = 0, cdev = 0;
  mokResult_t r = mok_nccl_comm_query(nccl, &rank, &nranks, &cdev);
  if (r != MOK_SUCCESS) return r;
  if (cdev != device)
    return mok_fail(NULL, MOK_ERROR_WRONG_DEVICE,
                    "the NCCL communicator runs on CUDA device %d, not device %d", cdev, device);
  mok_comm_t c = calloc(1, sizeof(*c));
  if (!c) return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_comm: calloc");
  c->device = device;
  c->rank = rank;
  c->nranks = nranks;
  c->nccl = nccl;
  c->owns_nccl = owns;
  r = mok_nccl_devcomm_create(nccl, &c->devcomm);
  if (r != MOK_SUCCESS) {
    free(c);
    return r;
  }
  if ((r = comm_register(c)) != MOK_SUCCESS) {  /* the caller destroys an owned nccl */
    mok_nccl_devcomm_destroy(nccl, c->devcomm);
    free(c);
    return r;
  }
  *out = c;
  return MOK_SUCCESS;
}
#endif

mokResult_t mok_comm_create_nccl(mok_comm_t *out, struct ncclComm *nccl, int device) {
  if (!out) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_comm_create_nccl: out is NULL");
  *out = NULL;
  if (!nccl) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_comm_create_nccl: nccl is NULL");
  if (device < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "mok_comm_create_nccl: device %d is not a GPU",
                    device);
#ifdef MOK_WITH_NCCL
  mokResult_t r = check_device(device);
  if (r != MOK_SUCCESS) return r;
  return comm_from_nccl(out, nccl, 0, device);
#else
  return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                  "mok_comm_create_nccl: this build of MoK has no NCCL (set NCCL_HOME to an NCCL "
                  "2.28+ with nccl_device.h); use mok_comm_create_local (W = 1)");
#endif
}

mokResult_t mok_get_unique_id(mok_unique_id_t *id) {
  if (!id) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_get_unique_id: id is NULL");
#ifdef MOK_WITH_NCCL
  return mok_nccl_get_unique_id(id->internal, sizeof(id->internal));
#else
  return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                  "mok_get_unique_id: this build of MoK has no NCCL; use mok_comm_create_local "
                  "(W = 1)");
#endif
}

mokResult_t mok_comm_create_unique_id(mok_comm_t *out, const mok_unique_id_t *id, int rank,
                                      int nranks, int device) {
  if (!out) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_comm_create_unique_id: out is NULL");
  *out = NULL;
  if (!id) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_comm_create_unique_id: id is NULL");
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_comm_create_unique_id: rank %d of %d ranks", rank, nranks);
  if (device < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_comm_create_unique_id: device %d is not a GPU", device);
#ifdef MOK_WITH_NCCL
  mokResult_t r = check_device(device);
  if (r != MOK_SUCCESS) return r;
  void *nccl = NULL;
  r = mok_nccl_comm_init_rank(&nccl, id->internal, rank, nranks, device);
  if (r != MOK_SUCCESS) return r;
  r = comm_from_nccl(out, nccl, 1, device);
  if (r != MOK_SUCCESS) {
    char msg[MOK_ERR_LEN]; /* keep the first failure's detail, not the cleanup's */
    snprintf(msg, sizeof msg, "%s", mok_last_error());
    mok_nccl_comm_destroy(nccl);
    mok_fail_msg(NULL, r, msg);
  }
  return r;
#else
  return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                  "mok_comm_create_unique_id: this build of MoK has no NCCL; use "
                  "mok_comm_create_local (W = 1)");
#endif
}

/* Collective for NCCL communicators (the device communicator's teardown). Refused while layers
 * created on the communicator live: they read it at every call. */
mokResult_t mok_comm_destroy(mok_comm_t comm) {
  if (!comm) return MOK_SUCCESS; /* like free() */
  mokResult_t r = mok_comm_valid(comm, "mok_comm_destroy");
  if (r != MOK_SUCCESS) return r;
  const int live = __atomic_load_n(&comm->live_layers, __ATOMIC_ACQUIRE);
  if (live > 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_comm_destroy: %d layer%s created on this communicator %s still alive; "
                    "destroy %s with mok_layer_destroy first (the communicator is left intact)",
                    live, live == 1 ? "" : "s", live == 1 ? "is" : "are",
                    live == 1 ? "it" : "them");
  /* Only one of several concurrent destroys gets past this: a handle is never freed twice. */
  if (!mok_handle_take(comm, MOK_HANDLE_COMM)) return invalid_comm(comm, "mok_comm_destroy");
  *(volatile uint64_t *)&comm->magic = 0; /* volatile: not dropped as dead before free() */
  mok_vgroup_leave(comm);
#ifdef MOK_WITH_NCCL
  if (comm->devcomm) mok_nccl_devcomm_destroy(comm->nccl, comm->devcomm);
  if (comm->owns_nccl) r = mok_nccl_comm_destroy(comm->nccl);
#endif
  free(comm);
  return r;
}

#define COMM_GETTER(fn, field)                                                          \
  mokResult_t fn(mok_comm_t comm, int *v) {                                             \
    mokResult_t r_ = mok_comm_valid(comm, #fn);                                         \
    if (r_ != MOK_SUCCESS) return r_;                                                   \
    if (!v) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, #fn ": the output is NULL");  \
    *v = comm->field;                                                                   \
    return MOK_SUCCESS;                                                                 \
  }
COMM_GETTER(mok_comm_rank, rank)
COMM_GETTER(mok_comm_size, nranks)
COMM_GETTER(mok_comm_device, device)
