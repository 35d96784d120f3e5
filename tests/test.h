/*
 * test.h: a small test harness. Each test registers itself at load time; build/mok_tests runs them
 * all (or those whose name contains argv[1]) and ends with the line "N passed, N failed, N skipped".
 *
 *   MOK_TEST(bf16_rounds_to_nearest_even) {
 *     MOK_EXPECT(mok_bf16_from_float(1.0f) == 0x3F80);
 *   }
 *
 * MOK_EXPECT records a failure and goes on; MOK_REQUIRE records it and returns from the test.
 * MOK_SKIP("reason") ends the test as skipped (GPU tests without a GPU).
 *
 * What tests share beyond this (random numbers, bf16 values, timers, comparisons, layer fixtures)
 * is in tests/support/.
 */
#ifndef MOK_TEST_H
#define MOK_TEST_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef void (*mok_test_fn)(void);
void mok_test_register(const char *name, const char *file, mok_test_fn fn);
void mok_test_fail(const char *file, int line, const char *fmt, ...);
void mok_test_skip(const char *reason);

#ifdef __cplusplus
}
#endif

#define MOK_TEST(name)                                                                  \
  static void name(void);                                                              \
  __attribute__((constructor)) static void mok_test_reg_##name(void) {                 \
    mok_test_register(#name, __FILE__, name);                                          \
  }                                                                                    \
  static void name(void)

#define MOK_EXPECT(cond)                                                                \
  do {                                                                                  \
    if (!(cond)) mok_test_fail(__FILE__, __LINE__, "%s", #cond);                       \
  } while (0)

#define MOK_EXPECT_MSG(cond, ...)                                                       \
  do {                                                                                  \
    if (!(cond)) mok_test_fail(__FILE__, __LINE__, __VA_ARGS__);                       \
  } while (0)

#define MOK_REQUIRE(cond)                                                               \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      mok_test_fail(__FILE__, __LINE__, "%s", #cond);                                  \
      return;                                                                           \
    }                                                                                   \
  } while (0)

#define MOK_REQUIRE_MSG(cond, ...)                                                      \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      mok_test_fail(__FILE__, __LINE__, __VA_ARGS__);                                  \
      return;                                                                           \
    }                                                                                   \
  } while (0)

#define MOK_SKIP(reason)                                                                \
  do {                                                                                  \
    mok_test_skip(reason);                                                              \
    return;                                                                             \
  } while (0)

#endif /* MOK_TEST_H */
