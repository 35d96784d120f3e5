/*
 * virtual_ranks.c: W virtual ranks on one GPU (src/api/api.h, "Virtual ranks";
 * mok_comm_create_virtual in src/api/comm.c makes the communicators). A group is W
 * communicators on one device and a list of collective windows: the n-th window request of any
 * rank allocates the n-th buffer of every rank (so one thread can create the ranks' layers one
 * after another), and each rank's peer table is the W buffers. Requests of the same rank are
 * numbered by that rank's count (comm->vwindows): ranks create their transports in the same
 * order, as NCCL windows need too.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "common/limits.h"

#define VG_MAX_WINDOWS 64 /* windows of a group over its lifetime (a layer takes one) */

struct mok_vgroup {
  pthread_mutex_t mu;
  int W, device, members; /* members: communicators not yet destroyed */
  struct {
    void *buf[MOK_MAX_RANKS];
    size_t bytes;
    int users; /* ranks holding it */
  } win[VG_MAX_WINDOWS];
};

#ifdef MOK_WITH_CUDA
#include <cuda_runtime.h>

mokResult_t mok_vgroup_create(int nranks, int device, struct mok_vgroup **out) {
  struct mok_vgroup *g = calloc(1, sizeof(*g));
  if (!g) return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "mok_comm_create_virtual: calloc");
  pthread_mutex_init(&g->mu, NULL);
  g->W = nranks;
  g->device = device;
  *out = g;
  return MOK_SUCCESS;
}

mokResult_t mok_vgroup_window(mok_comm_t comm, size_t bytes, void *peer[], void **local,
                              int *index) {
  struct mok_vgroup *g = comm->vgroup;
  const int n = comm->vwindows;
  if (n >= VG_MAX_WINDOWS)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "virtual rank %d: more than %d windows over the group's lifetime", comm->rank,
                    VG_MAX_WINDOWS);
  mokResult_t res = MOK_SUCCESS;
  pthread_mutex_lock(&g->mu);
  if (!g->win[n].buf[0] && g->win[n].users == 0) {
    for (int r = 0; r < g->W && res == MOK_SUCCESS; r++) {
      cudaError_t e = cudaMalloc(&g->win[n].buf[r], bytes);
      if (e == cudaSuccess) e = cudaMemset(g->win[n].buf[r], 0, bytes);
      if (e != cudaSuccess) {
        cudaGetLastError();
        const mokResult_t code =
            e == cudaErrorMemoryAllocation ? MOK_ERROR_OUT_OF_MEMORY : MOK_ERROR_CUDA;
        res = mok_fail(NULL, code, "virtual ranks: a %zu-byte window on GPU %d: %s", bytes,
                       g->device, cudaGetErrorString(e));
      }
    }
    if (res != MOK_SUCCESS) {
      for (int r = 0; r < g->W; r++) cudaFree(g->win[n].buf[r]), g->win[n].buf[r] = NULL;
    } else {
      g->win[n].bytes = bytes;
    }
  } else if (g->win[n].bytes != bytes) {
    res = mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                   "virtual rank %d: window %d of %zu bytes, rank 0's has %zu (the ranks must "
                   "create the same layers in the same order)",
                   comm->rank, n, bytes, g->win[n].bytes);
  }
  if (res == MOK_SUCCESS) {
    g->win[n].users++;
    for (int r = 0; r < g->W; r++) peer[r] = g->win[n].buf[r];
    *local = g->win[n].buf[comm->rank];
    *index = n;
    comm->vwindows++;
  }
  pthread_mutex_unlock(&g->mu);
  return res;
}

void mok_vgroup_window_release(mok_comm_t comm, int index) {
  struct mok_vgroup *g = comm->vgroup;
  if (!g || index < 0 || index >= VG_MAX_WINDOWS) return;
  pthread_mutex_lock(&g->mu);
  if (g->win[index].users > 0 && --g->win[index].users == 0) {
    cudaDeviceSynchronize(); /* no kernel of any rank may still touch the buffers */
    for (int r = 0; r < g->W; r++) cudaFree(g->win[index].buf[r]);
    memset(g->win[index].buf, 0, sizeof(g->win[index].buf));
  }
  pthread_mutex_unlock(&g->mu);
}

#else /* !MOK_WITH_CUDA */

mokResult_t mok_vgroup_create(int nranks, int device, struct mok_vgroup **out) {
  (void)nranks, (void)device, (void)out;
  return mok_fail(NULL, MOK_ERROR_NO_DEVICE, "this build of MoK has no CUDA support");
}
mokResult_t mok_vgroup_window(mok_comm_t comm, size_t bytes, void *peer[], void **local,
                              int *index) {
  (void)comm, (void)bytes, (void)peer, (void)local, (void)index;
  return mok_fail(NULL, MOK_ERROR_NO_DEVICE, "this build of MoK has no CUDA support");
}
void mok_vgroup_window_release(mok_comm_t comm, int index) { (void)comm, (void)index; }

#endif /* MOK_WITH_CUDA */

/* A communicator joins the group (mok_comm_create_virtual) as rank `rank`. */
void mok_vgroup_join(mok_comm_t comm, struct mok_vgroup *g) {
  pthread_mutex_lock(&g->mu);
  g->members++;
  pthread_mutex_unlock(&g->mu);
  comm->vgroup = g;
}

/* A group no communicator joined (a failed mok_comm_create_virtual). */
void mok_vgroup_free(struct mok_vgroup *g) {
  if (!g) return;
  pthread_mutex_destroy(&g->mu);
  free(g);
}

/* A member leaves (mok_comm_destroy): the last one frees the group. Windows are released by
 * their transports first. */
void mok_vgroup_leave(mok_comm_t comm) {
  struct mok_vgroup *g = comm->vgroup;
  if (!g) return;
  comm->vgroup = NULL;
  pthread_mutex_lock(&g->mu);
  const int last = --g->members == 0;
  pthread_mutex_unlock(&g->mu);
  if (last) {
    pthread_mutex_destroy(&g->mu);
    free(g);
  }
}
