/* comm.c: communicators. W = 1 needs nothing; the NCCL-backed constructors exist with their final
 * signatures and report MOK_ERROR_NOT_AVAILABLE until the expert-parallel transport lands. */
#include <stdlib.h>

#include "mok_internal.h"

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
  *out = c;
  return MOK_SUCCESS;
}

static mokResult_t no_transport_yet(const char *fn) {
  return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                  "%s: expert parallelism over NCCL is not available in this version yet; use "
                  "mok_comm_create_local (W = 1)",
                  fn);
}

mokResult_t mok_comm_create_nccl(mok_comm_t *out, struct ncclComm *nccl, int device) {
  if (!out) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_comm_create_nccl: out is NULL");
  *out = NULL;
  if (!nccl) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_comm_create_nccl: nccl is NULL");
  if (device < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "mok_comm_create_nccl: device %d is not a GPU",
                    device);
  return no_transport_yet("mok_comm_create_nccl");
}

mokResult_t mok_get_unique_id(mok_unique_id_t *id) {
  if (!id) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_get_unique_id: id is NULL");
  return no_transport_yet("mok_get_unique_id");
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
  return no_transport_yet("mok_comm_create_unique_id");
}

mokResult_t mok_comm_destroy(mok_comm_t comm) {
  free(comm); /* NULL is fine, like free() */
  return MOK_SUCCESS;
}

#define COMM_GETTER(fn, field)                                                          \
  mokResult_t fn(mok_comm_t comm, int *v) {                                             \
    if (!comm || !v) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, #fn ": NULL argument"); \
    *v = comm->field;                                                                   \
    return MOK_SUCCESS;                                                                 \
  }
COMM_GETTER(mok_comm_rank, rank)
COMM_GETTER(mok_comm_size, nranks)
COMM_GETTER(mok_comm_device, device)
