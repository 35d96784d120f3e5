/*
 * nccl_window.cu: everything MoK asks of NCCL, and the only file that includes nccl_device.h:
 * communicator bootstrap, the device communicator (whose creation tells us whether symmetric
 * memory works), and symmetric windows: ncclMemAlloc + ncclCommWindowRegister(SYMMETRIC), with
 * the peer base addresses read once by a setup kernel (ncclGetLsaPointer, NCCL 2.28) and handed
 * back as a plain table. Kernels elsewhere use those raw pointers and their own flags.
 *
 * NCCL's host functions are called through the table of src/gpu/nccl_loader.c, bound at run time
 * (libmok.so does not link libnccl); its signatures are checked against the headers' here. The
 * device functions of nccl_device.h are inline and compiled into the setup kernel: they read the
 * window struct that the headers lay out and need no NCCL symbol at link time, which is why the
 * loader accepts only the headers' major.minor version.
 *
 * NCCL falls back to plain memory without a word when symmetric memory is unavailable, so a window
 * is accepted only when (1) the device communicator exists (NCCL checked symmetric support and
 * every rank is in one NVLink domain), (2) every peer address is distinct and, where CUDA can
 * tell, device memory this GPU can access, and (3) a probe works: every rank writes a tag into
 * each peer's window through those addresses and, after a barrier, finds every peer's tag.
 *
 * Without NCCL headers (MOK_WITH_NCCL undefined) every function reports MOK_ERROR_NOT_AVAILABLE;
 * with them but no usable NCCL at run time, the loader's reason is reported the same way.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/comm/comm.h"
extern "C" {
#include "common/status.h"
}

#ifdef MOK_WITH_NCCL
#include <nccl.h>
#include <nccl_device.h>

#include <type_traits>

#include "common/nccl_loader.h"

// The loader's table has the headers' signatures, function by function.
#define NW_SAME_SIGNATURE(ret, name, params)                                               \
  static_assert(std::is_same<decltype(&::name), decltype(mok_nccl_api_t::name)>::value,   \
                "mok_nccl_api_t::" #name " differs from its declaration in the NCCL headers");
MOK_NCCL_FUNCTIONS(NW_SAME_SIGNATURE)
#undef NW_SAME_SIGNATURE

#define NW_ALIGN ((size_t)2 << 20) /* registration needs 4 KB; 2 MB is the cuMem granularity */

static mokResult_t nw_nccl_fail(const mok_nccl_api_t *lib, const char *fn, ncclResult_t r) {
  return mok_fail(NULL, MOK_ERROR_NCCL, "%s: %s", fn, lib->ncclGetErrorString(r));
}

static mokResult_t nw_cuda_fail(const char *call, cudaError_t e) {
  cudaGetLastError();
  return mok_fail(NULL, MOK_ERROR_CUDA, "%s: %s", call, cudaGetErrorString(e));
}

// NW_NCCL(lib, ncclCommCount, (c, &n)): calls lib->ncclCommCount(c, &n), returns its failure.
#define NW_NCCL(lib, fn, args)                                           \
  do {                                                                   \
    ncclResult_t nw_r_ = (lib)->fn args;                                 \
    if (nw_r_ != ncclSuccess) return nw_nccl_fail(lib, #fn, nw_r_);      \
  } while (0)

#define NW_CUDA_GOTO(call, res, label)                                   \
  do {                                                                   \
    cudaError_t nw_e_ = (call);                                          \
    if (nw_e_ != cudaSuccess) {                                          \
      res = nw_cuda_fail(#call, nw_e_);                                  \
      goto label;                                                        \
    }                                                                    \
  } while (0)

extern "C" mokResult_t mok_nccl_get_unique_id(void *id, size_t id_bytes) {
  static_assert(sizeof(ncclUniqueId) <= sizeof(mok_unique_id_t), "NCCL id fits MoK's id");
  if (id_bytes < sizeof(ncclUniqueId))
    return mok_fail(NULL, MOK_ERROR_INTERNAL, "unique id buffer of %zu bytes", id_bytes);
  const mok_nccl_api_t *lib;
  mokResult_t res = mok_nccl_api(&lib);
  if (res != MOK_SUCCESS) return res;
  ncclUniqueId u;
  NW_NCCL(lib, ncclGetUniqueId, (&u));
  memset(id, 0, id_bytes);
  memcpy(id, &u, sizeof u);
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_nccl_comm_init_rank(void **nccl, const void *id, int rank, int nranks,
                                               int device) {
  *nccl = NULL;
  const mok_nccl_api_t *lib;
  mokResult_t res = mok_nccl_api(&lib);
  if (res != MOK_SUCCESS) return res;
  ncclUniqueId u;
  memcpy(&u, id, sizeof u);
  int prev = 0;
  cudaGetDevice(&prev);
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return nw_cuda_fail("cudaSetDevice", e);
  ncclComm_t c = NULL;
  ncclResult_t r = lib->ncclCommInitRank(&c, nranks, u, rank);
  cudaSetDevice(prev);
  if (r != ncclSuccess) return nw_nccl_fail(lib, "ncclCommInitRank", r);
  *nccl = c;
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_nccl_comm_query(void *nccl, int *rank, int *nranks, int *device) {
  const mok_nccl_api_t *lib;
  mokResult_t res = mok_nccl_api(&lib);
  if (res != MOK_SUCCESS) return res;
  ncclComm_t c = (ncclComm_t)nccl;
  NW_NCCL(lib, ncclCommUserRank, (c, rank));
  NW_NCCL(lib, ncclCommCount, (c, nranks));
  NW_NCCL(lib, ncclCommCuDevice, (c, device));
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_nccl_comm_destroy(void *nccl) {
  if (!nccl) return MOK_SUCCESS;
  const mok_nccl_api_t *lib;
  mokResult_t res = mok_nccl_api(&lib);
  if (res != MOK_SUCCESS) return res;
  ncclComm_t c = (ncclComm_t)nccl;
  ncclResult_t r = lib->ncclCommFinalize(c);
  ncclResult_t r2 = lib->ncclCommDestroy(c);
  if (r != ncclSuccess) return nw_nccl_fail(lib, "ncclCommFinalize", r);
  if (r2 != ncclSuccess) return nw_nccl_fail(lib, "ncclCommDestroy", r2);
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_nccl_devcomm_create(void *nccl, void **devcomm) {
  *devcomm = NULL;
  const mok_nccl_api_t *lib;
  mokResult_t res = mok_nccl_api(&lib);
  if (res != MOK_SUCCESS) return res;
  ncclComm_t c = (ncclComm_t)nccl;
  ncclDevComm *dc = (ncclDevComm *)calloc(1, sizeof(ncclDevComm));
  if (!dc) return mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "ncclDevComm: calloc");
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements reqs;
  memset(&reqs, 0, sizeof reqs);  // no barriers, no multimem, no GIN: only the windows
#endif
  ncclResult_t r = lib->ncclDevCommCreate(c, &reqs, dc);
  if (r != ncclSuccess) {
    free(dc);
    return mok_fail(NULL, r == ncclInvalidUsage ? MOK_ERROR_NOT_AVAILABLE : MOK_ERROR_NCCL,
                    "ncclDevCommCreate: %s (%s); NCCL symmetric memory is not available on this "
                    "communicator (needs CUDA VMM/cuMem, peer access over NVLink, NCCL 2.28+)",
                    lib->ncclGetErrorString(r), lib->ncclGetLastError(c));
  }
  if (dc->lsaSize != dc->nRanks) {
    const int lsa = dc->lsaSize, n = dc->nRanks;
    lib->ncclDevCommDestroy(c, dc);
    free(dc);
    return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                    "only %d of %d ranks share this GPU's NVLink domain; MoK's transport needs "
                    "all ranks load/store accessible",
                    lsa, n);
  }
  if (dc->nRanks > MOK_MAX_RANKS) {
    const int n = dc->nRanks;
    lib->ncclDevCommDestroy(c, dc);
    free(dc);
    return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE, "%d ranks; the transport supports up to %d", n,
                    (int)MOK_MAX_RANKS);
  }
  *devcomm = dc;
  return MOK_SUCCESS;
}

extern "C" void mok_nccl_devcomm_destroy(void *nccl, void *devcomm) {
  const mok_nccl_api_t *lib;
  if (!devcomm) return;
  if (mok_nccl_api(&lib) == MOK_SUCCESS)  // a device communicator exists: the table does too
    lib->ncclDevCommDestroy((ncclComm_t)nccl, (ncclDevComm *)devcomm);
  free(devcomm);
}

// Setup kernel: peer[r] = rank r's window base as mapped on this GPU (LSA rank of world rank r).
__global__ void nw_peer_bases_kernel(ncclWindow_t win, int rank, int lsa_rank, int nranks,
                                     void **peer) {
  const int r = threadIdx.x;
  if (r < nranks) peer[r] = ncclGetLsaPointer(win, 0, lsa_rank + (r - rank));
}

// Probe: tag[rank] of every peer's window = 0x4d6f4b00 + rank (then the barrier, then checks).
__global__ void nw_probe_kernel(void *const *peer, int rank, int nranks) {
  const int d = threadIdx.x;
  if (d < nranks) {
    volatile uint32_t *tag = (volatile uint32_t *)peer[d] + rank;
    *tag = 0x4d6f4b00u + (uint32_t)rank;
  }
  __threadfence_system();
}

// A barrier over the communicator that also agrees on a verdict: returns in *bad_ranks the
// number of ranks that passed bad = 1 (a one-element all-reduce, waited for on the host). Every
// rank takes part whatever its own verdict, so one rank's failed check never hangs the others.
static mokResult_t nw_agree(const mok_nccl_api_t *lib, ncclComm_t c, int *scratch, cudaStream_t s,
                            int bad, int *bad_ranks) {
  cudaError_t e = cudaMemcpyAsync(scratch, &bad, sizeof(int), cudaMemcpyHostToDevice, s);
  if (e != cudaSuccess) return nw_cuda_fail("cudaMemcpyAsync (barrier)", e);
  NW_NCCL(lib, ncclAllReduce, (scratch, scratch, 1, ncclInt32, ncclSum, c, s));
  e = cudaMemcpyAsync(bad_ranks, scratch, sizeof(int), cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) return nw_cuda_fail("cudaStreamSynchronize (barrier)", e);
  return MOK_SUCCESS;
}

// After nw_agree: this rank's failure (already recorded), or the others'.
static mokResult_t nw_verdict(mokResult_t mine, int bad_ranks, const char *what) {
  if (mine != MOK_SUCCESS) return mine;
  if (bad_ranks > 0)
    return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                    "symmetric window: %d other rank(s) failed the %s (see their messages)",
                    bad_ranks, what);
  return MOK_SUCCESS;
}

// (2): distinct, non-local addresses that CUDA, where it can tell, calls device memory we reach.
static mokResult_t nw_check_peers(const mok_nccl_window_t *w, int rank, int nranks, int device) {
  for (int r = 0; r < nranks; r++) {
    if (!w->peer[r])
      return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE, "symmetric window: rank %d has no address", r);
    for (int q = 0; q < r; q++)
      if (w->peer[q] == w->peer[r])
        return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                        "symmetric window: ranks %d and %d map to the same address %p: NCCL fell "
                        "back to plain memory (no symmetric memory support)",
                        q, r, w->peer[r]);
    if (r == rank) continue;
    if (w->peer[r] == w->local)
      return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                      "symmetric window: rank %d's address is our own buffer: NCCL fell back to "
                      "plain memory",
                      r);
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, w->peer[r]) != cudaSuccess) {
      cudaGetLastError();  // CUDA cannot tell for this mapping; the probe decides
      continue;
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
      return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                      "symmetric window: rank %d's address %p is not device memory", r,
                      w->peer[r]);
    int can = 1;
    if (a.device != device && cudaDeviceCanAccessPeer(&can, device, a.device) != cudaSuccess) {
      cudaGetLastError();
      can = 0;
    }
    if (!can)
      return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                      "GPU %d cannot access GPU %d (rank %d) as a peer: no NVLink/P2P path",
                      device, a.device, r);
  }
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_nccl_window_create(void *nccl, void *devcomm, int device, size_t bytes,
                                              mok_nccl_window_t *w) {
  memset(w, 0, sizeof *w);
  ncclComm_t c = (ncclComm_t)nccl;
  int rank = 0, nranks = 0, cdev = 0, prev = 0;
  const mok_nccl_api_t *lib;
  mokResult_t res = mok_nccl_api(&lib);
  if (res != MOK_SUCCESS) return res;
  res = mok_nccl_comm_query(nccl, &rank, &nranks, &cdev);
  if (res != MOK_SUCCESS) return res;
  if (nranks > MOK_MAX_RANKS)
    return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE, "%d ranks; at most %d", nranks,
                    (int)MOK_MAX_RANKS);
  cudaGetDevice(&prev);
  cudaStream_t s = NULL;
  void **d_peer = NULL;
  int *scratch = NULL;
  uint32_t tags[MOK_MAX_RANKS];
  ncclResult_t r;
  const int lsa_rank = ((const ncclDevComm *)devcomm)->lsaRank;
  res = MOK_SUCCESS;
  NW_CUDA_GOTO(cudaSetDevice(device), res, fail);
  w->bytes = (bytes + NW_ALIGN - 1) / NW_ALIGN * NW_ALIGN;
  if ((r = lib->ncclMemAlloc(&w->local, w->bytes)) != ncclSuccess) {
    res = r == ncclSystemError ? mok_fail(NULL, MOK_ERROR_OUT_OF_MEMORY, "ncclMemAlloc(%zu): %s",
                                          w->bytes, lib->ncclGetErrorString(r))
                               : nw_nccl_fail(lib, "ncclMemAlloc", r);
    w->local = NULL;
    goto fail;
  }
  NW_CUDA_GOTO(cudaMemset(w->local, 0, w->bytes), res, fail);
  NW_CUDA_GOTO(cudaDeviceSynchronize(), res, fail);
  if ((r = lib->ncclCommWindowRegister(c, w->local, w->bytes, (ncclWindow_t *)&w->window,
                                       NCCL_WIN_COLL_SYMMETRIC)) != ncclSuccess) {
    res = nw_nccl_fail(lib, "ncclCommWindowRegister", r);
    w->window = NULL;
    goto fail;
  }
  if (!w->window) {
    res = mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE, "ncclCommWindowRegister returned no window");
    goto fail;
  }
  NW_CUDA_GOTO(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), res, fail);
  NW_CUDA_GOTO(cudaMalloc((void **)&d_peer, MOK_MAX_RANKS * sizeof(void *)), res, fail);
  NW_CUDA_GOTO(cudaMalloc((void **)&scratch, sizeof(int)), res, fail);
  nw_peer_bases_kernel<<<1, 32, 0, s>>>((ncclWindow_t)w->window, rank, lsa_rank, nranks,
                                        d_peer);
  NW_CUDA_GOTO(cudaGetLastError(), res, fail);
  NW_CUDA_GOTO(cudaMemcpyAsync(w->peer, d_peer, nranks * sizeof(void *), cudaMemcpyDeviceToHost, s),
               res, fail);
  NW_CUDA_GOTO(cudaStreamSynchronize(s), res, fail);
  {
    // (2) then (3), each rank's verdict shared so that all ranks fail together.
    int bad_ranks = 0;
    mokResult_t mine = nw_check_peers(w, rank, nranks, device);
    if (mine == MOK_SUCCESS) {
      nw_probe_kernel<<<1, 32, 0, s>>>(d_peer, rank, nranks);
      NW_CUDA_GOTO(cudaGetLastError(), res, fail);
      NW_CUDA_GOTO(cudaStreamSynchronize(s), res, fail);
    }
    res = nw_agree(lib, c, scratch, s, mine != MOK_SUCCESS, &bad_ranks);
    if (res != MOK_SUCCESS) goto fail;
    if ((res = nw_verdict(mine, bad_ranks, "peer address check")) != MOK_SUCCESS) goto fail;
    // Every probe has landed: read ours.
    NW_CUDA_GOTO(cudaMemcpy(tags, w->local, nranks * sizeof(uint32_t), cudaMemcpyDeviceToHost),
                 res, fail);
    for (int q = 0; q < nranks && mine == MOK_SUCCESS; q++) {
      if (tags[q] != 0x4d6f4b00u + (uint32_t)q)
        mine = mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                        "symmetric window probe: rank %d's write did not land in rank %d's window "
                        "(found 0x%08x): peer mappings do not work",
                        q, rank, tags[q]);
    }
    res = nw_agree(lib, c, scratch, s, mine != MOK_SUCCESS, &bad_ranks);
    if (res != MOK_SUCCESS) goto fail;
    if ((res = nw_verdict(mine, bad_ranks, "probe")) != MOK_SUCCESS) goto fail;
    // Back to zeros before anyone uses the window; nobody writes before everyone has zeroed.
    NW_CUDA_GOTO(cudaMemsetAsync(w->local, 0, MOK_MAX_RANKS * sizeof(uint32_t), s), res, fail);
    NW_CUDA_GOTO(cudaStreamSynchronize(s), res, fail);
    if ((res = nw_agree(lib, c, scratch, s, 0, &bad_ranks)) != MOK_SUCCESS) goto fail;
  }
  cudaFree(scratch);
  cudaFree(d_peer);
  cudaStreamDestroy(s);
  cudaSetDevice(prev);
  return MOK_SUCCESS;

fail:
  if (scratch) cudaFree(scratch);
  if (d_peer) cudaFree(d_peer);
  if (s) cudaStreamDestroy(s);
  mok_nccl_window_destroy(nccl, w);
  cudaSetDevice(prev);
  return res;
}

extern "C" void mok_nccl_window_destroy(void *nccl, mok_nccl_window_t *w) {
  const mok_nccl_api_t *lib;
  if (!w) return;
  if ((w->window || w->local) && mok_nccl_api(&lib) == MOK_SUCCESS) {  // it made them
    if (w->window) lib->ncclCommWindowDeregister((ncclComm_t)nccl, (ncclWindow_t)w->window);
    if (w->local) lib->ncclMemFree(w->local);
  }
  memset(w, 0, sizeof *w);
}

#else /* !MOK_WITH_NCCL */

static mokResult_t nw_absent(const char *fn) {
  return mok_fail(NULL, MOK_ERROR_NOT_AVAILABLE,
                  "%s: this build of MoK has no NCCL (nccl.h and nccl_device.h 2.28+ were not "
                  "found; set NCCL_HOME)",
                  fn);
}

extern "C" mokResult_t mok_nccl_get_unique_id(void *, size_t) {
  return nw_absent("mok_get_unique_id");
}
extern "C" mokResult_t mok_nccl_comm_init_rank(void **nccl, const void *, int, int, int) {
  *nccl = NULL;
  return nw_absent("ncclCommInitRank");
}
extern "C" mokResult_t mok_nccl_comm_query(void *, int *, int *, int *) {
  return nw_absent("ncclCommUserRank");
}
extern "C" mokResult_t mok_nccl_comm_destroy(void *) { return MOK_SUCCESS; }
extern "C" mokResult_t mok_nccl_devcomm_create(void *, void **devcomm) {
  *devcomm = NULL;
  return nw_absent("ncclDevCommCreate");
}
extern "C" void mok_nccl_devcomm_destroy(void *, void *) {}
extern "C" mokResult_t mok_nccl_window_create(void *, void *, int, size_t, mok_nccl_window_t *w) {
  memset(w, 0, sizeof *w);
  return nw_absent("ncclCommWindowRegister");
}
extern "C" void mok_nccl_window_destroy(void *, mok_nccl_window_t *) {}

#endif /* MOK_WITH_NCCL */
