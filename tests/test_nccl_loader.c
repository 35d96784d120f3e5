/*
 * test_nccl_loader.c: NCCL is bound at run time, never linked. libmok.so's ELF dynamic section
 * names no libnccl and its dynamic symbol table needs no nccl* symbol (read from the file here,
 * not from ldd); the loader (src/gpu/nccl_loader.c) accepts only the headers' major.minor,
 * rejects a library that is not NCCL with a message naming it, binds once for all threads (to
 * the NCCL already in this process: mok_tests links it, as an application would), and the comm
 * constructors give a defined result whether NCCL is usable or not. A fresh process without NCCL
 * and the import order with PyTorch: tests/python/test_nccl_runtime.py.
 */
#define _GNU_SOURCE /* dlinfo, RTLD_NOLOAD */
#include <dlfcn.h>
#include <elf.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mok.h"
#include "test.h"
#ifdef MOK_WITH_NCCL
#include "common/nccl_loader.h"
#endif

/* ---- the dynamic section of an ELF64 file ---------------------------------------------------- */

enum { MAX_NAMES = 64, NAME_LEN = 128, PATH_LEN = 1024, WHY_LEN = PATH_LEN + 64 };

typedef struct {
  char needed[MAX_NAMES][NAME_LEN]; /* DT_NEEDED entries, in order */
  int n_needed;
  char undef_nccl[MAX_NAMES][NAME_LEN]; /* undefined dynamic symbols named nccl* or pnccl* */
  int n_undef_nccl;
} elf_deps_t;

static int in_file(size_t size, uint64_t off, uint64_t len) {
  return off <= size && len <= size - off;
}

/* The NUL-terminated string at offset `at` of string table section `strtab`, or NULL. */
static const char *elf_str(const unsigned char *f, size_t size, const Elf64_Shdr *strtab,
                           uint64_t at) {
  if (at >= strtab->sh_size || !in_file(size, strtab->sh_offset, strtab->sh_size)) return NULL;
  const char *s = (const char *)f + strtab->sh_offset + at;
  return memchr(s, 0, strtab->sh_size - at) ? s : NULL;
}

/* Reads `path`'s DT_NEEDED names and undefined nccl symbols; 0 and a reason in `why` on failure. */
static int elf_read_deps(const char *path, elf_deps_t *d, char *why, size_t why_len) {
  memset(d, 0, sizeof *d);
  FILE *fp = fopen(path, "rb");
  if (!fp) return snprintf(why, why_len, "cannot open %s", path), 0;
  fseek(fp, 0, SEEK_END);
  const long n = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  unsigned char *f = n > 0 ? malloc((size_t)n) : NULL;
  const int read_all = f && fread(f, 1, (size_t)n, fp) == (size_t)n;
  fclose(fp);
  const size_t size = read_all ? (size_t)n : 0;
  int ok = 0;
  const Elf64_Ehdr *eh = (const Elf64_Ehdr *)f;
  if (!read_all || size < sizeof *eh || memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 ||
      eh->e_ident[EI_CLASS] != ELFCLASS64 || eh->e_shentsize != sizeof(Elf64_Shdr) ||
      !in_file(size, eh->e_shoff, (uint64_t)eh->e_shnum * sizeof(Elf64_Shdr))) {
    snprintf(why, why_len, "%s is not a readable ELF64 file", path);
    goto done;
  }
  const Elf64_Shdr *sh = (const Elf64_Shdr *)(f + eh->e_shoff);
  int saw_dynamic = 0;
  for (int i = 0; i < eh->e_shnum; i++) {
    const Elf64_Shdr *s = &sh[i];
    if ((s->sh_type != SHT_DYNAMIC && s->sh_type != SHT_DYNSYM) || s->sh_link >= eh->e_shnum ||
        !in_file(size, s->sh_offset, s->sh_size))
      continue;
    const Elf64_Shdr *strtab = &sh[s->sh_link];
    if (s->sh_type == SHT_DYNAMIC) {
      saw_dynamic = 1;
      const Elf64_Dyn *dyn = (const Elf64_Dyn *)(f + s->sh_offset);
      for (size_t k = 0; k < s->sh_size / sizeof *dyn && dyn[k].d_tag != DT_NULL; k++) {
        const char *name =
            dyn[k].d_tag == DT_NEEDED ? elf_str(f, size, strtab, dyn[k].d_un.d_val) : NULL;
        if (name && d->n_needed < MAX_NAMES)
          snprintf(d->needed[d->n_needed++], NAME_LEN, "%s", name);
      }
    } else {
      const Elf64_Sym *sym = (const Elf64_Sym *)(f + s->sh_offset);
      for (size_t k = 0; k < s->sh_size / sizeof *sym; k++) {
        const char *name = elf_str(f, size, strtab, sym[k].st_name);
        if (!name || sym[k].st_shndx != SHN_UNDEF) continue;
        if ((!strncmp(name, "nccl", 4) || !strncmp(name, "pnccl", 5)) &&
            d->n_undef_nccl < MAX_NAMES)
          snprintf(d->undef_nccl[d->n_undef_nccl++], NAME_LEN, "%s", name);
      }
    }
  }
  if (!saw_dynamic) snprintf(why, why_len, "%s has no dynamic section", path);
  ok = saw_dynamic;
done:
  free(f);
  return ok;
}

static int needs(const elf_deps_t *d, const char *part) {
  for (int i = 0; i < d->n_needed; i++)
    if (strstr(d->needed[i], part)) return 1;
  return 0;
}

/* build/libmok.so, found next to this executable (build/mok_tests). */
static int libmok_path(char *path, size_t len) {
  char exe[PATH_LEN];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return 0;
  exe[n] = 0;
  char *slash = strrchr(exe, '/');
  if (!slash) return 0;
  *slash = 0;
  snprintf(path, len, "%s/libmok.so", exe);
  return access(path, R_OK) == 0;
}

MOK_TEST(nccl_libmok_does_not_link_nccl) {
  char path[PATH_LEN + 16], why[WHY_LEN + 16] = "";
  if (!libmok_path(path, sizeof path))
    MOK_SKIP("libmok.so is not built next to mok_tests (make all)");
  elf_deps_t d;
  MOK_REQUIRE_MSG(elf_read_deps(path, &d, why, sizeof why), "%s", why);
  MOK_EXPECT_MSG(needs(&d, "libc.so"), "no DT_NEEDED libc in %s: the reader is wrong", path);
  for (int i = 0; i < d.n_needed; i++)
    MOK_EXPECT_MSG(!strstr(d.needed[i], "nccl"), "%s needs %s: NCCL must be loaded at run time",
                   path, d.needed[i]);
  for (int i = 0; i < d.n_undef_nccl; i++)
    MOK_EXPECT_MSG(0,
                   "%s needs the symbol %s: call it through mok_nccl_api (src/common/nccl_loader.h)",
                   path, d.undef_nccl[i]);
}

/* The same reader sees NCCL where it is linked on purpose: in this executable. */
MOK_TEST(nccl_elf_reader_sees_linked_nccl) {
#if defined(MOK_WITH_NCCL) && defined(MOK_NCCL_LIBDIR)
  char why[WHY_LEN + 16] = "";
  elf_deps_t d;
  MOK_REQUIRE_MSG(elf_read_deps("/proc/self/exe", &d, why, sizeof why), "%s", why);
  MOK_EXPECT_MSG(needs(&d, "libnccl.so"), "mok_tests links libnccl.so.2, but the reader missed it");
  MOK_EXPECT(d.n_undef_nccl > 0); /* tests/gpu/transport_team.cuh calls ncclCommInitAll */
#else
  MOK_SKIP("this build does not link NCCL into mok_tests");
#endif
}

#ifdef MOK_WITH_NCCL

static int msg_has(const char *needle) { return strstr(mok_last_error(), needle) != NULL; }

/* The last error names its code once: "<mok_error_string>: <reason>". */
static int code_named_once(mokResult_t code) {
  const char *name = mok_error_string(code), *first = strstr(mok_last_error(), name);
  return first == mok_last_error() && !strstr(first + 1, name);
}

/* Only the headers' major.minor (2.28+) binds; the message gives the version found and needed. */
MOK_TEST(nccl_loader_accepts_only_the_headers_minor) {
  MOK_EXPECT(mok_nccl_check_version(NCCL_VERSION_CODE, "x") == MOK_SUCCESS);
  MOK_EXPECT(mok_nccl_check_version(NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, 0), "x") == MOK_SUCCESS);
  MOK_EXPECT(mok_nccl_check_version(NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, 99), "x") == MOK_SUCCESS);
  char built[64];
  snprintf(built, sizeof built, "built against NCCL %d.%d.%d", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
  const int other[] = {
      NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR - 1, 5), NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR + 1, 0),
      NCCL_VERSION(NCCL_MAJOR + 1, NCCL_MINOR, 0), 2708 /* 2.7.8: the old encoding */};
  const char *found[] = {"", "", "", "is NCCL 2.7.8"};
  for (int i = 0; i < 4; i++) {
    MOK_EXPECT_MSG(mok_nccl_check_version(other[i], "libnccl-test.so") == MOK_ERROR_NOT_AVAILABLE,
                   "version code %d accepted", other[i]);
    MOK_EXPECT_MSG(msg_has("libnccl-test.so") && msg_has(built) && msg_has(found[i]) &&
                       code_named_once(MOK_ERROR_NOT_AVAILABLE),
                   "%d: '%s'", other[i], mok_last_error());
  }
}

/* A library without NCCL's functions is refused, by name, and nothing is called. */
MOK_TEST(nccl_loader_rejects_a_library_that_is_not_nccl) {
  void *libm = dlopen("libm.so.6", RTLD_NOW | RTLD_LOCAL);
  MOK_REQUIRE_MSG(libm, "dlopen(libm.so.6): %s", dlerror());
  mok_nccl_api_t api;
  MOK_EXPECT(mok_nccl_bind(libm, &api) == MOK_ERROR_NOT_AVAILABLE);
  MOK_EXPECT_MSG(msg_has("libm") && msg_has("no ncclGetVersion") &&
                     code_named_once(MOK_ERROR_NOT_AVAILABLE),
                 "'%s'", mok_last_error());
  dlclose(libm);
}

enum { THREADS = 4 };

typedef struct {
  mokResult_t res;
  const mok_nccl_api_t *api;
  char msg[512];
} bind_result_t;

static void *bind_on_thread(void *arg) {
  bind_result_t *b = arg;
  b->res = mok_nccl_api(&b->api);
  snprintf(b->msg, sizeof b->msg, "%s", b->res == MOK_SUCCESS ? "" : mok_last_error());
  return NULL;
}

/* Threads racing for the first bind all get the same outcome; a table is complete and belongs to
 * the NCCL already in this process, a refusal names NCCL and repeats on every call. */
MOK_TEST(nccl_loader_binds_once_for_all_threads) {
  bind_result_t b[THREADS];
  pthread_t th[THREADS];
  memset(b, 0, sizeof b);
  for (int i = 0; i < THREADS; i++)
    MOK_REQUIRE(pthread_create(&th[i], NULL, bind_on_thread, &b[i]) == 0);
  for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 1; i < THREADS; i++)
    MOK_EXPECT_MSG(b[i].res == b[0].res && b[i].api == b[0].api && !strcmp(b[i].msg, b[0].msg),
                   "thread %d got %d '%s', thread 0 got %d '%s'", i, (int)b[i].res, b[i].msg,
                   (int)b[0].res, b[0].msg);
  MOK_REQUIRE_MSG(b[0].res == MOK_SUCCESS || b[0].res == MOK_ERROR_NOT_AVAILABLE, "result %d: %s",
                  (int)b[0].res, b[0].msg);
  const mok_nccl_api_t *api = (const mok_nccl_api_t *)0x1;
  MOK_EXPECT(mok_nccl_api(&api) == b[0].res);
  if (b[0].res != MOK_SUCCESS) {
    MOK_EXPECT(api == NULL && msg_has("NCCL") && !strcmp(mok_last_error(), b[0].msg) &&
               code_named_once(MOK_ERROR_NOT_AVAILABLE));
    return;
  }
  MOK_REQUIRE(api == b[0].api && api);
#define CHECK_BOUND(ret, name, params) MOK_EXPECT_MSG(api->name != NULL, "%s is not bound", #name);
  MOK_NCCL_FUNCTIONS(CHECK_BOUND)
#undef CHECK_BOUND
  MOK_EXPECT(mok_nccl_check_version(api->version, api->path) == MOK_SUCCESS);
  int v = 0;
  MOK_EXPECT(api->ncclGetVersion(&v) == ncclSuccess && v == api->version);
  void *in_process = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  MOK_REQUIRE_MSG(in_process, "the bound NCCL (%s) is not the process's libnccl.so.2", api->path);
  MOK_EXPECT_MSG(dlsym(in_process, "ncclGetVersion") == (void *)api->ncclGetVersion,
                 "the table's ncclGetVersion is not that of the libnccl.so.2 in the process");
  dlclose(in_process);
}

#endif /* MOK_WITH_NCCL */

/* The constructors that need NCCL return a defined code, NCCL or not, GPU or not; never a crash. */
MOK_TEST(nccl_comm_constructors_give_a_defined_result) {
  mok_comm_t gpu = NULL;
  const int have_gpu = mok_comm_create_local(&gpu, 0) == MOK_SUCCESS;
  mok_comm_destroy(gpu);
  mok_unique_id_t id;
  memset(&id, 0, sizeof id);
  const mokResult_t rid = mok_get_unique_id(&id);
  MOK_EXPECT_MSG(rid == MOK_SUCCESS || rid == MOK_ERROR_NOT_AVAILABLE || rid == MOK_ERROR_NCCL,
                 "mok_get_unique_id: %d (%s)", (int)rid, mok_last_error());
#ifdef MOK_WITH_NCCL
  const mok_nccl_api_t *api;
  if (mok_nccl_api(&api) != MOK_SUCCESS) MOK_EXPECT(rid == MOK_ERROR_NOT_AVAILABLE);
#else
  MOK_EXPECT(rid == MOK_ERROR_NOT_AVAILABLE);
#endif
  if (have_gpu)
    MOK_SKIP("a GPU is present: tests/gpu/test_transport.cu creates real communicators");
  /* Without a GPU (or without CUDA in the build) the device check or the missing NCCL answers;
   * 0x10 is never dereferenced. */
  mok_comm_t c = (mok_comm_t)0x1;
  mokResult_t r = mok_comm_create_unique_id(&c, &id, 0, 1, 0);
  MOK_EXPECT_MSG((r == MOK_ERROR_NO_DEVICE || r == MOK_ERROR_NOT_AVAILABLE) && c == NULL,
                 "mok_comm_create_unique_id: %d (%s)", (int)r, mok_last_error());
  c = (mok_comm_t)0x1;
  r = mok_comm_create_nccl(&c, (struct ncclComm *)0x10, 0);
  MOK_EXPECT_MSG((r == MOK_ERROR_NO_DEVICE || r == MOK_ERROR_NOT_AVAILABLE) && c == NULL,
                 "mok_comm_create_nccl: %d (%s)", (int)r, mok_last_error());
}
