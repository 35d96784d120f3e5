/* runner.c: runs the registered tests (see test.h) and prints one line per test and a summary. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support/timer.h"
#include "test.h"

enum { MAX_TESTS = 1024 };

typedef struct {
  const char *name, *file;
  mok_test_fn fn;
} test_entry_t;

static test_entry_t g_tests[MAX_TESTS];
static int g_ntests;
static int g_failures; /* failures recorded in the running test */
static const char *g_skip;

void mok_test_register(const char *name, const char *file, mok_test_fn fn) {
  if (g_ntests < MAX_TESTS) g_tests[g_ntests++] = (test_entry_t){name, file, fn};
}

void mok_test_fail(const char *file, int line, const char *fmt, ...) {
  if (g_failures < 10) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "    %s:%d: ", file, line);
    vfprintf(stdout, fmt, ap);
    fputc('\n', stdout);
    va_end(ap);
  } else if (g_failures == 10) {
    fprintf(stdout, "    (further failures of this test not shown)\n");
  }
  g_failures++;
}

void mok_test_skip(const char *reason) { g_skip = reason; }

static int by_file_then_name(const void *a, const void *b) {
  const test_entry_t *x = a, *y = b;
  int c = strcmp(x->file, y->file);
  return c ? c : strcmp(x->name, y->name);
}

/* Whether test t is selected: no filters, or its name or file contains one of them. */
static int selected(const test_entry_t *t, int nfilters, char **filters) {
  for (int f = 0; f < nfilters; f++)
    if (strstr(t->name, filters[f]) || strstr(t->file, filters[f])) return 1;
  return nfilters == 0;
}

/* mok_tests [FILTER...]: the tests whose name or file contains one of the filters (all without). */
int main(int argc, char **argv) {
  int passed = 0, failed = 0, skipped = 0;
  qsort(g_tests, g_ntests, sizeof(g_tests[0]), by_file_then_name);
  setvbuf(stdout, NULL, _IOLBF, 0);
  for (int i = 0; i < g_ntests; i++) {
    if (!selected(&g_tests[i], argc - 1, argv + 1)) continue;
    g_failures = 0;
    g_skip = NULL;
    double t0 = test_now_s();
    g_tests[i].fn();
    double ms = 1e3 * (test_now_s() - t0);
    if (g_failures) {
      failed++;
      printf("FAIL %s (%s, %.0f ms)\n", g_tests[i].name, g_tests[i].file, ms);
    } else if (g_skip) {
      skipped++;
      printf("SKIP %s: %s\n", g_tests[i].name, g_skip);
    } else {
      passed++;
      printf("PASS %s (%.0f ms)\n", g_tests[i].name, ms);
    }
  }
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed ? 1 : 0;
}
