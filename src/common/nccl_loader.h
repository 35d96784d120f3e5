/*
 * nccl_loader.h: NCCL's host API, bound at run time. libmok.so never links libnccl: an
 * application that imports MoK first must still be free to load its own NCCL (PyTorch's), and
 * a layer that never communicates must never load one. The first call of mok_nccl_api binds a
 * table of every NCCL host function MoK calls, from (1) the NCCL already in the process (an
 * ncclComm_t handed to mok_comm_create_nccl belongs to it), else (2) libnccl.so.2 as the
 * dynamic loader finds it, else (3) libnccl.so.2 in the build's NCCL directory. The outcome,
 * table or reason, holds for the life of the process.
 *
 * NOTE: the first to load libnccl.so.2 decides for the whole process: a library loaded later that
 * needs libnccl.so.2 (PyTorch) binds to the one MoK loaded, whatever its version. Import PyTorch
 * before MoK's first NCCL call (a communicator from a unique id or an NCCL communicator); a layer
 * on a local communicator never loads NCCL.
 *
 * Only builds with NCCL headers (MOK_WITH_NCCL) have it. The device side (nccl_device.h, inline
 * functions compiled into a setup kernel) stays in src/cuda/comm/nccl_window.cu, which checks
 * this table's signatures against the headers' declarations at compile time.
 */
#ifndef MOK_GPU_NCCL_LOADER_H
#define MOK_GPU_NCCL_LOADER_H

#include <stddef.h>

#include <nccl.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Declared by nccl_device/core.h (C++ only); pointers to them are all the table needs. */
struct ncclDevComm;
struct ncclDevCommRequirements;

/* X(return type, name, parameters): every NCCL host function MoK calls, with the signature of
 * nccl.h / nccl_device/core.h. Adding a call to NCCL means adding its line here. */
#define MOK_NCCL_FUNCTIONS(X)                                                                    \
  X(ncclResult_t, ncclGetVersion, (int *version))                                               \
  X(const char *, ncclGetErrorString, (ncclResult_t result))                                    \
  X(const char *, ncclGetLastError, (ncclComm_t comm))                                          \
  X(ncclResult_t, ncclGetUniqueId, (ncclUniqueId * uniqueId))                                   \
  X(ncclResult_t, ncclCommInitRank, (ncclComm_t * comm, int nranks, ncclUniqueId commId,        \
                                     int rank))                                                 \
  X(ncclResult_t, ncclCommFinalize, (ncclComm_t comm))                                          \
  X(ncclResult_t, ncclCommDestroy, (ncclComm_t comm))                                           \
  X(ncclResult_t, ncclCommCount, (const ncclComm_t comm, int *count))                           \
  X(ncclResult_t, ncclCommUserRank, (const ncclComm_t comm, int *rank))                         \
  X(ncclResult_t, ncclCommCuDevice, (const ncclComm_t comm, int *device))                       \
  X(ncclResult_t, ncclAllReduce, (const void *sendbuff, void *recvbuff, size_t count,           \
                                  ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,     \
                                  cudaStream_t stream))                                         \
  X(ncclResult_t, ncclMemAlloc, (void **ptr, size_t size))                                      \
  X(ncclResult_t, ncclMemFree, (void *ptr))                                                     \
  X(ncclResult_t, ncclCommWindowRegister, (ncclComm_t comm, void *buff, size_t size,            \
                                           ncclWindow_t *win, int winFlags))                    \
  X(ncclResult_t, ncclCommWindowDeregister, (ncclComm_t comm, ncclWindow_t win))                \
  X(ncclResult_t, ncclDevCommCreate, (ncclComm_t comm,                                          \
                                      const struct ncclDevCommRequirements *reqs,               \
                                      struct ncclDevComm *outDevComm))                          \
  X(ncclResult_t, ncclDevCommDestroy, (ncclComm_t comm, const struct ncclDevComm *devComm))

/* One pointer per function, named as the function: api->ncclCommInitRank(&c, n, id, r). */
typedef struct {
#define MOK_NCCL_POINTER(ret, name, params) ret(*name) params;
  MOK_NCCL_FUNCTIONS(MOK_NCCL_POINTER)
#undef MOK_NCCL_POINTER
  int version;      /* ncclGetVersion of the bound library, e.g. 22809 */
  const char *path; /* the file the table was bound from, as the dynamic loader names it */
} mok_nccl_api_t;

/* The process's table, bound on the first call (thread-safe). MOK_ERROR_NOT_AVAILABLE, with the
 * reason recorded again on every call, when no NCCL could be loaded, when it is not the version
 * of the headers MoK was built with (same major.minor, at least 2.28: the device API's structs
 * change between minor versions), or when it lacks a function; the message names the library,
 * the version found, the version needed and the missing function. */
mokResult_t mok_nccl_api(const mok_nccl_api_t **api);

/* The steps of mok_nccl_api, for tests. mok_nccl_bind fills *api from an open library handle
 * (dlopen's) and records why it cannot; mok_nccl_check_version says whether an NCCL_VERSION_CODE
 * found at run time works with these headers (library names the library in the message). */
mokResult_t mok_nccl_bind(void *lib, mok_nccl_api_t *api);
mokResult_t mok_nccl_check_version(int version, const char *library);

#ifdef __cplusplus
}
#endif

#endif /* MOK_GPU_NCCL_LOADER_H */
