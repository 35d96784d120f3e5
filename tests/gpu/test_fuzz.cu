/*
 * test_fuzz.cu: a randomized campaign of GPU layers against the CPU layer, and a soak of many
 * forward + backward calls. Both run with every `make test` on a GPU machine at a small count;
 * `make fuzz` runs them at the counts of the hardening campaign (docs/design.md, "Testing"):
 *
 *   MOK_FUZZ_CASES=1000 MOK_FUZZ_SEED=1 build/mok_tests fuzz_gpu_layers_match_cpu
 *   MOK_SOAK_CALLS=10000 build/mok_tests fuzz_gpu_soak
 *
 * Each case draws a shape (H, I, Is with or without a shared expert; E, K <= E; T from 0 up, odd
 * sizes included; T_max above T), a routing (uniform, skewed onto one hot expert, some experts
 * never used, slots emptied with probability 0 to 1), the context mode (SAVE or RECOMPUTE) and the
 * weight gradients (fp32 or bf16, overwritten or accumulated), then checks the GPU forward and
 * backward against the CPU layer with forward_test_util.cuh's and backward_test_util.cuh's
 * tolerances (in SAVE mode; a RECOMPUTE case must give the SAVE layer's bits), and every fourth
 * case the GPU layer's bitwise determinism. The seed and the case's
 * parameters are printed with any failure, so a failing case can be run again by itself.
 */
#include <stdlib.h>

#include "backward_test_util.cuh"

// A count from the environment (a test's own knob; the library reads none), else `dflt`.
static long fuzz_env_count(const char *name, long dflt) {
  const char *e = getenv(name);
  if (!e || !e[0]) return dflt;
  char *end = NULL;
  const long v = strtol(e, &end, 10);
  return end != e && *end == '\0' && v >= 0 ? v : dflt;
}

typedef struct {
  int64_t H, I, Is, E, K, T, T_max;
  int route;  // 0 uniform, 1 one hot expert, 2 a quarter of the experts never used
  double p_empty;
  mok_context_mode_t mode;
  mok_wgrad_dtype_t wdt;
  int accumulate;
} fuzz_case_t;

static fuzz_case_t fuzz_draw(test_rng_t *r) {
  fuzz_case_t c;
  c.H = 128 * (1 + (int64_t)test_rng_below(r, 3));   // 128, 256, 384
  c.I = 128 * (1 + (int64_t)test_rng_below(r, 2));   // 128, 256
  c.Is = test_rng_below(r, 3) == 0 ? 128 * (1 + (int64_t)test_rng_below(r, 2)) : 0;
  static const int64_t experts[] = {1, 2, 3, 5, 8, 16, 33, 64, 128};
  c.E = experts[test_rng_below(r, sizeof(experts) / sizeof(experts[0]))];
  c.K = 1 + (int64_t)test_rng_below(r, (uint64_t)(c.E < 8 ? c.E : 8));
  const uint64_t t = test_rng_below(r, 10);
  c.T = t == 0 ? 0 : t == 1 ? 1 : (int64_t)test_rng_below(r, 200) + 2;  // 0, 1, odd sizes
  c.T_max = c.T + (int64_t)test_rng_below(r, 64) + (c.T == 0 ? 1 : 0);
  c.route = (int)test_rng_below(r, 3);
  static const double empty[] = {0.0, 0.0, 0.1, 0.5, 1.0};
  c.p_empty = empty[test_rng_below(r, 5)];
  c.mode = test_rng_below(r, 2) ? MOK_CONTEXT_RECOMPUTE : MOK_CONTEXT_SAVE;
  c.wdt = test_rng_below(r, 2) ? MOK_WGRAD_BF16 : MOK_WGRAD_FP32;
  c.accumulate = (int)test_rng_below(r, 2);
  return c;
}

static test_route_t fuzz_route(const fuzz_case_t *c, test_rng_t *r) {
  test_route_t rt = test_route_uniform(c->p_empty);
  if (c->route == 1) rt.hot = (int)test_rng_below(r, (uint64_t)c->E);
  // Experts never used: a quarter of them (E <= 64), as long as K distinct ones remain.
  if (c->route == 2 && c->E <= 64)
    for (int64_t e = 0; e < c->E && c->E - __builtin_popcountll(rt.avoid) > c->K; e += 4)
      rt.avoid |= 1ull << e;
  return rt;
}

MOK_TEST(fuzz_gpu_layers_match_cpu) {
  if (!test_gpu_present()) MOK_SKIP("no GPU");
  const long cases = fuzz_env_count("MOK_FUZZ_CASES", 24);
  const uint64_t seed = (uint64_t)fuzz_env_count("MOK_FUZZ_SEED", 1);
  test_rng_t r = test_rng(0x6a09e667f3bcc909ull ^ seed);
  long failed = 0, run = 0;
  for (long n = 0; n < cases; n++, run++) {
    const fuzz_case_t c = fuzz_draw(&r);
    char what[200];
    snprintf(what, sizeof(what),
             "seed %llu case %ld: H=%lld I=%lld Is=%lld E=%lld K=%lld T=%lld T_max=%lld route=%d "
             "empty=%.1f %s %s%s",
             (unsigned long long)seed, n, (long long)c.H, (long long)c.I, (long long)c.Is,
             (long long)c.E, (long long)c.K, (long long)c.T, (long long)c.T_max, c.route,
             c.p_empty, c.mode == MOK_CONTEXT_SAVE ? "save" : "recompute",
             c.wdt == MOK_WGRAD_BF16 ? "bf16" : "fp32", c.accumulate ? " accumulate" : "");
    // The CPU comparison runs in SAVE mode, where the CPU layer reads the GPU's saved bf16 g, u
    // (backward_test_util.cuh): recomputed independently, the two sides' g and u round apart
    // wherever fp32 and fp64 sums straddle a bf16 boundary, which the tolerance does not model. A
    // RECOMPUTE layer must then give bitwise the SAVE layer's results (docs/design.md, "The
    // layer"), which is checked instead.
    bwd_problem_t p;
    bwd_problem_init(&p, c.H, c.I, c.E, c.K, c.Is, c.T, c.T_max);
    p.f.mode = MOK_CONTEXT_SAVE;
    fwd_route(&p.f, fuzz_route(&c, &r));
    bwd_set_wgrad(&p, c.wdt, c.accumulate);
    bwd_gpu_t g;
    if (!bwd_gpu_open(&g, &p)) {
      MOK_EXPECT_MSG(0, "%s: could not open the GPU layer", what);
      failed++;
      continue;
    }
    int ok = fwd_check_against_cpu(&g.f, &p.f, what);
    ok &= bwd_check_against_cpu(&g, &p, what);
    bwd_out_t a, b;
    if (ok && (n % 4 == 0 || c.mode == MOK_CONTEXT_RECOMPUTE)) bwd_gpu_outputs(&g, &p, &a);
    if (ok && n % 4 == 0) {  // the same inputs again: bitwise the same gradients
      bwd_gpu_inputs(&g, &p);
      ok &= bwd_gpu_run(&g, &p, 0) == MOK_SUCCESS && mok_layer_check(g.f.l) == MOK_SUCCESS;
      bwd_gpu_outputs(&g, &p, &b);
      ok &= bwd_same(&a, &b);
      MOK_EXPECT_MSG(ok, "%s: a second run gave other bits", what);
    }
    bwd_gpu_close(&g);
    if (ok && c.mode == MOK_CONTEXT_RECOMPUTE) {
      bwd_problem_t q = p;
      q.f.mode = MOK_CONTEXT_RECOMPUTE;
      bwd_gpu_t h;
      ok = bwd_gpu_open(&h, &q);
      if (ok) {
        bwd_gpu_inputs(&h, &q);
        ok = bwd_gpu_run(&h, &q, 0) == MOK_SUCCESS && mok_layer_check(h.f.l) == MOK_SUCCESS;
        bwd_gpu_outputs(&h, &q, &b);
        ok &= bwd_same(&a, &b);
        bwd_gpu_close(&h);
      }
      MOK_EXPECT_MSG(ok, "%s: RECOMPUTE gave other bits than SAVE", what);
    }
    failed += !ok;
  }
  printf("    %ld random layers (seed %llu), %ld failed\n", run, (unsigned long long)seed, failed);
}

// Many forward + backward calls on one layer with new routing each time (empty slots and a hot
// expert now and then): no call and no mok_layer_check reports an error, and the device memory in
// use is the same after the calls as after the first (the library allocates nothing per call).
MOK_TEST(fuzz_gpu_soak) {
  if (!test_gpu_present()) MOK_SKIP("no GPU");
  const long calls = fuzz_env_count("MOK_SOAK_CALLS", 200);
  test_rng_t r = test_rng(0xbb67ae8584caa73bull);
  bwd_problem_t p;
  bwd_problem_init(&p, 512, 256, 32, 4, 256, 512, 512);
  bwd_gpu_t g;
  MOK_REQUIRE(bwd_gpu_open(&g, &p));
  bwd_gpu_inputs(&g, &p);
  size_t free0 = 0, free1 = 0, total = 0;
  long errors = 0;
  for (long n = 0; n < calls; n++) {
    test_route_t rt = test_route_uniform(n % 7 == 0 ? 0.5 : 0.05);
    if (n % 5 == 0) rt.hot = (int)test_rng_below(&r, 32);
    fwd_route(&p.f, rt);
    const int64_t T = 1 + (int64_t)test_rng_below(&r, 512);
    cudaMemcpyAsync(g.f.idx, p.f.idx.data(), (size_t)(T * p.f.K) * 4, cudaMemcpyHostToDevice, 0);
    const mok_forward_args_t a = test_gpu_layer_args(&g.f, T);
    const mok_backward_args_t b = test_backward_args(T, g.dy, g.dx, g.dtw, g.dw, 1);
    mokResult_t res = mok_forward(g.f.l, &a, g.f.y, g.f.ctx, g.f.ctx_bytes, NULL);
    if (res == MOK_SUCCESS) res = mok_backward(g.f.l, &a, &b, g.f.ctx, g.f.ctx_bytes, NULL);
    if (res == MOK_SUCCESS && (n % 100 == 99 || n + 1 == calls)) res = mok_layer_check(g.f.l);
    if (res != MOK_SUCCESS && errors++ < 3) printf("    call %ld: %s\n", n, mok_last_error());
    if (n == 0) {
      cudaDeviceSynchronize();
      cudaMemGetInfo(&free0, &total);
    }
  }
  cudaDeviceSynchronize();
  cudaMemGetInfo(&free1, &total);
  printf("    %ld forward + backward calls, %ld errors, free device memory %zu -> %zu bytes\n",
         calls, errors, free0, free1);
  MOK_EXPECT(errors == 0);
  MOK_EXPECT_MSG(free1 == free0, "device memory in use grew by %lld bytes over the calls",
                 (long long)free0 - (long long)free1);
  bwd_gpu_close(&g);
}
