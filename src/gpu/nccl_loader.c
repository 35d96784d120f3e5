/*
 * nccl_loader.c: binds NCCL's host API at run time (see nccl_loader.h for why and in what order).
 *
 * The search, on the first mok_nccl_api call, under pthread_once:
 *   1. dlopen("libnccl.so.2", RTLD_NOLOAD): an NCCL some other part of the process loaded (the
 *      application, PyTorch). It is the only candidate then: a second NCCL in one process would
 *      not know the first one's communicators.
 *   2. dlopen("libnccl.so.2"): the dynamic loader's search (LD_LIBRARY_PATH, libmok.so's run
 *      path, ldconfig's cache).
 *   3. MOK_NCCL_LIBDIR "/libnccl.so.2", the directory the build found NCCL in, when the build
 *      defines it.
 * A library that cannot serve (another minor version, a missing function) is closed again, so
 * that the application may still load the NCCL it wants; the reason is kept and reported on
 * every later call.
 */
#define _GNU_SOURCE /* dlinfo */
#include "common/status.h"

#ifdef MOK_WITH_NCCL
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/nccl_loader.h"

#define NL_SONAME "libnccl.so.2"

/* NCCL_VERSION_CODE -> major, minor, patch (codes below 2.9 are X * 1000 + Y * 100 + Z). */
static void nl_split(int v, int *major, int *minor, int *patch) {
  const int big = v >= 10000;
  *major = big ? v / 10000 : v / 1000;
  *minor = big ? v % 10000 / 100 : v % 1000 / 100;
  *patch = v % 100;
}

/* The steps below write the reason for a failure into why[MOK_ERR_LEN] and return its code; the
 * public functions record it (mok_fail prefixes the code's name, so a reason is recorded once). */
static mokResult_t nl_check_version(int version, const char *library, char *why) {
  int major, minor, patch;
  nl_split(version, &major, &minor, &patch);
  if (major == NCCL_MAJOR && minor == NCCL_MINOR && version >= 22800) return MOK_SUCCESS;
  snprintf(why, MOK_ERR_LEN,
           "%s is NCCL %d.%d.%d, but MoK was built against NCCL %d.%d.%d headers "
           "(NCCL_VERSION_CODE %d) and needs NCCL %d.%d.x at run time: the device API (2.28+) "
           "lays out its structs per minor version",
           library, major, minor, patch, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, NCCL_VERSION_CODE,
           NCCL_MAJOR, NCCL_MINOR);
  return MOK_ERROR_NOT_AVAILABLE;
}

/* The file behind a dlopen handle, as the dynamic loader names it. */
static const char *nl_path(void *lib) {
  struct link_map *lm = NULL;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &lm) != 0 || !lm || !lm->l_name || !lm->l_name[0])
    return NL_SONAME;
  return lm->l_name;
}

static mokResult_t nl_bind(void *lib, mok_nccl_api_t *api, char *why) {
  memset(api, 0, sizeof *api);
  api->path = nl_path(lib);
  // The version first: a missing function of an older NCCL is best explained by its version.
  api->ncclGetVersion = (ncclResult_t(*)(int *))dlsym(lib, "ncclGetVersion");
  if (!api->ncclGetVersion) {
    snprintf(why, MOK_ERR_LEN, "%s has no ncclGetVersion: not an NCCL library", api->path);
    return MOK_ERROR_NOT_AVAILABLE;
  }
  ncclResult_t r = api->ncclGetVersion(&api->version);
  if (r != ncclSuccess) {
    snprintf(why, MOK_ERR_LEN, "%s: ncclGetVersion returned %d", api->path, (int)r);
    return MOK_ERROR_NOT_AVAILABLE;
  }
  mokResult_t res = nl_check_version(api->version, api->path, why);
  if (res != MOK_SUCCESS) return res;
  int major, minor, patch;
  nl_split(api->version, &major, &minor, &patch);
#define NL_RESOLVE(ret, name, params)                                                         \
  api->name = (ret(*) params)dlsym(lib, #name);                                               \
  if (!api->name) {                                                                           \
    snprintf(why, MOK_ERR_LEN,                                                                \
             "%s (NCCL %d.%d.%d) has no %s, which MoK calls (built against NCCL %d.%d.%d "    \
             "headers)",                                                                      \
             api->path, major, minor, patch, #name, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);      \
    return MOK_ERROR_NOT_AVAILABLE;                                                           \
  }
  MOK_NCCL_FUNCTIONS(NL_RESOLVE)
#undef NL_RESOLVE
  return MOK_SUCCESS;
}

mokResult_t mok_nccl_check_version(int version, const char *library) {
  char why[MOK_ERR_LEN];
  mokResult_t res = nl_check_version(version, library, why);
  return res == MOK_SUCCESS ? res : mok_fail_msg(NULL, res, why);
}

mokResult_t mok_nccl_bind(void *lib, mok_nccl_api_t *api) {
  char why[MOK_ERR_LEN];
  mokResult_t res = nl_bind(lib, api, why);
  return res == MOK_SUCCESS ? res : mok_fail_msg(NULL, res, why);
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static mok_nccl_api_t g_api;
static mokResult_t g_res;
static char g_why[MOK_ERR_LEN + 128]; /* why g_res is not MOK_SUCCESS (cut when recorded) */

static void nl_load(void) {
  char tried[MOK_ERR_LEN / 2] = "";
  void *lib = dlopen(NL_SONAME, RTLD_NOW | RTLD_NOLOAD);
  const int in_process = lib != NULL;
  if (!lib && !(lib = dlopen(NL_SONAME, RTLD_NOW | RTLD_LOCAL)))
    snprintf(tried, sizeof tried, "%s", dlerror());
#ifdef MOK_NCCL_LIBDIR
  if (!lib && !(lib = dlopen(MOK_NCCL_LIBDIR "/" NL_SONAME, RTLD_NOW | RTLD_LOCAL))) {
    const size_t n = strlen(tried);
    snprintf(tried + n, sizeof tried - n, "; %s", dlerror());
  }
#endif
  if (!lib) {
    g_res = MOK_ERROR_NOT_AVAILABLE;
    snprintf(g_why, sizeof g_why,
             "NCCL is not available (%s); MoK's expert parallelism needs NCCL %d.%d (the version "
             "of its headers) at run time: install it or put the directory of its " NL_SONAME
             " in LD_LIBRARY_PATH",
             tried, NCCL_MAJOR, NCCL_MINOR);
    return;
  }
  char why[MOK_ERR_LEN];
  if ((g_res = nl_bind(lib, &g_api, why)) == MOK_SUCCESS) return;
  snprintf(g_why, sizeof g_why, "%s%s", why,
           in_process ? "; this NCCL was already loaded in the process (by the application or "
                        "another library) and MoK can only share it"
                      : "");
  memset(&g_api, 0, sizeof g_api);
  dlclose(lib);  // ours no more: the application may still load the NCCL it wants
}

mokResult_t mok_nccl_api(const mok_nccl_api_t **api) {
  *api = NULL;
  if (pthread_once(&g_once, nl_load) != 0)
    return mok_fail(NULL, MOK_ERROR_INTERNAL, "pthread_once failed while loading NCCL");
  if (g_res != MOK_SUCCESS) return mok_fail_msg(NULL, g_res, g_why);
  *api = &g_api;
  return MOK_SUCCESS;
}

#endif /* MOK_WITH_NCCL */
