/*
 * backward_test_util.cuh: helpers of the GPU backward tests (test_backward.cu): a layer problem
 * with dy and the weight-gradient settings, the CPU layer's forward + backward on it (the
 * reference), a GPU layer with its gradient buffers, and the elementwise comparison with its
 * stated tolerance. Builds on forward_test_util.cuh and tests/support. Header-only, static.
 */
#ifndef MOK_TESTS_GPU_BACKWARD_TEST_UTIL_CUH
#define MOK_TESTS_GPU_BACKWARD_TEST_UTIL_CUH

#include <string>

#include "cuda/backward/backward.h"
#include "forward_test_util.cuh"

enum { BWD_NW = 6 };  // weight gradients: wg, wu, wd, wsg, wsu, wsd
static const char *const bwd_w_name[BWD_NW] = {"dwg", "dwu", "dwd", "dwsg", "dwsu", "dwsd"};

typedef struct {
  fwd_problem_t f;
  std::vector<uint16_t> dy;            // [T_max, H] bf16
  mok_wgrad_dtype_t wdt;
  int accumulate;
  std::vector<uint8_t> dw0[BWD_NW];    // starting weight gradients (accumulate), in wdt
} bwd_problem_t;

typedef struct {
  std::vector<uint16_t> dx;            // [T, H]
  std::vector<float> dtw;              // [T, K]
  std::vector<uint8_t> dw[BWD_NW];     // in wdt
} bwd_out_t;

// Elements of weight gradient i.
static int64_t bwd_w_elems(const bwd_problem_t *p, int i) {
  const fwd_problem_t &f = p->f;
  return i < 3 ? f.E * f.I * f.H : f.Is * f.H;
}
static size_t bwd_w_bytes(const bwd_problem_t *p, int i) {
  return (size_t)bwd_w_elems(p, i) * (p->wdt == MOK_WGRAD_BF16 ? 2 : 4);
}

// The forward problem of forward_test_util.cuh plus dy ~ U(-1, 1); fp32 weight gradients,
// overwritten.
static void bwd_problem_init(bwd_problem_t *p, int64_t H, int64_t I, int64_t E, int64_t K,
                             int64_t Is, int64_t T, int64_t T_max) {
  fwd_problem_init(&p->f, H, I, E, K, Is, T, T_max);
  p->dy.resize((size_t)(T_max * H));
  fill_bf16(p->dy, 1.0f);
  p->wdt = MOK_WGRAD_FP32;
  p->accumulate = 0;
}

// Sets the weight-gradient dtype and mode, with fresh starting gradients ~ U(-2, 2), about the
// size of one call's gradients, so that both terms of an accumulation show.
static void bwd_set_wgrad(bwd_problem_t *p, mok_wgrad_dtype_t wdt, int accumulate) {
  p->wdt = wdt;
  p->accumulate = accumulate;
  for (int i = 0; i < BWD_NW; i++) {
    const int64_t n = bwd_w_elems(p, i);
    p->dw0[i].assign(bwd_w_bytes(p, i), 0);
    for (int64_t j = 0; j < n; j++) {
      const float v = 2.0f * rnd_unit();
      if (wdt == MOK_WGRAD_BF16) ((uint16_t *)p->dw0[i].data())[j] = f2bf(v);
      else ((float *)p->dw0[i].data())[j] = v;
    }
  }
}

static mok_layer_desc_t bwd_desc(const bwd_problem_t *p) {
  mok_layer_desc_t d = fwd_desc(&p->f, p->f.Is, p->f.T_max);
  d.wgrad_dtype = p->wdt;
  d.wgrad_accumulate = p->accumulate;
  return d;
}

/* ---------------------------------------------------------------------------------------------- */
/* The CPU layer (reference)                                                                       */
/* ---------------------------------------------------------------------------------------------- */

// Forward then backward of the CPU layer on p's first T tokens; weight gradients start from dw0
// when accumulating.
// Copies the GPU forward's saved bf16 g, u (layout order) and gs, us into a CPU context
// (header, then g, u [T_max * K, I] in (token, slot) order, then gs, us [T_max, Is]).
static void bwd_inject_saved(const bwd_problem_t *p, const std::vector<uint8_t> &gpu_ctx, void *cpu_ctx) {
  const fwd_problem_t &f = p->f;
  const mok_ws_layout_t lay = fwd_ctx_layout(&f);
  const int64_t TK = f.T_max * f.K, I = f.I, Is = f.Is;
  const int32_t *slot_row = (const int32_t *)(gpu_ctx.data() + lay.ctx[MOK_CTX_SLOT_ROW]);
  const uint16_t *gg = (const uint16_t *)(gpu_ctx.data() + lay.ctx[MOK_CTX_G]);
  const uint16_t *gu = (const uint16_t *)(gpu_ctx.data() + lay.ctx[MOK_CTX_U]);
  uint16_t *cg = (uint16_t *)((char *)cpu_ctx + sizeof(mok_ctx_header_t));
  uint16_t *cu = cg + TK * I, *cgs = cu + TK * I, *cus = cgs + f.T_max * Is;
  for (int64_t i = 0; i < f.T * f.K; i++) {
    if (slot_row[i] < 0) continue;
    memcpy(cg + i * I, gg + (int64_t)slot_row[i] * I, (size_t)I * 2);
    memcpy(cu + i * I, gu + (int64_t)slot_row[i] * I, (size_t)I * 2);
  }
  if (Is > 0) {
    memcpy(cgs, gpu_ctx.data() + lay.ctx[MOK_CTX_GS], (size_t)(f.T * Is) * 2);
    memcpy(cus, gpu_ctx.data() + lay.ctx[MOK_CTX_US], (size_t)(f.T * Is) * 2);
  }
}

// The CPU layer's forward and backward on p's inputs. With gpu_ctx (a SAVE-mode GPU context of
// the same forward), the CPU backward reads the GPU forward's bf16 g, u instead of its own: those
// legitimately differ in the last bit (another accumulation order), and one flipped bit of a
// large a = bf16(w·silu(g)·u) moves a weight-gradient sum of few rows by more than its rms-scaled
// tolerance. Backward's inputs are then the same on both sides, and the comparison covers the
// backward alone (test_forward.cu checks the saved g, u against the CPU forward's).
static mokResult_t cpu_backward(const bwd_problem_t *p, bwd_out_t *o,
                                const std::vector<uint8_t> *gpu_ctx = NULL) {
  const fwd_problem_t &f = p->f;
  const int64_t T = f.T, H = f.H, K = f.K;
  mok_layer_desc_t d = bwd_desc(p);
  if (gpu_ctx) d.context_mode = MOK_CONTEXT_SAVE;
  test_cpu_layer_t c;
  mokResult_t r = test_cpu_layer_open(&c, &d);
  if (r != MOK_SUCCESS) return r;
  std::vector<uint16_t> y((size_t)(T * H) + 8);
  o->dx.assign((size_t)(T * H) + 8, 0);
  o->dtw.assign((size_t)(T * K) + 4, 0.0f);
  for (int i = 0; i < BWD_NW; i++) {
    o->dw[i].assign(bwd_w_bytes(p, i) + 16, 0);
    if (p->accumulate) memcpy(o->dw[i].data(), p->dw0[i].data(), bwd_w_bytes(p, i));
  }
  mok_weights_t w = fwd_weights(&f, 1);
  if ((r = test_cpu_layer_weights(&c, &w)) != MOK_SUCCESS) {
    test_cpu_layer_close(&c);
    return r;
  }
  const mok_forward_args_t a = test_forward_args(T, f.x.data(), f.idx.data(), f.tw.data(), w);
  void *dw[BWD_NW];
  for (int i = 0; i < BWD_NW; i++) dw[i] = o->dw[i].data();
  const mok_backward_args_t g =
      test_backward_args(T, p->dy.data(), o->dx.data(), o->dtw.data(), dw, f.Is > 0);
  r = mok_forward(c.l, &a, T ? y.data() : NULL, c.ctx, c.ctx_bytes, NULL);
  if (r == MOK_SUCCESS && gpu_ctx) bwd_inject_saved(p, *gpu_ctx, c.ctx);
  if (r == MOK_SUCCESS) r = mok_backward(c.l, &a, &g, c.ctx, c.ctx_bytes, NULL);
  o->dx.resize((size_t)(T * H));
  o->dtw.resize((size_t)(T * K));
  for (int i = 0; i < BWD_NW; i++) o->dw[i].resize(bwd_w_bytes(p, i));
  test_cpu_layer_close(&c);
  return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* Comparison                                                                                      */
/* ---------------------------------------------------------------------------------------------- */
/*
 * Tolerance for every gradient, per element (tests/support/compare.h):
 *     bf16 results (dx, bf16 weight gradients):   |gpu - ref| <= atol + rtol · (|ref| + M)
 *     fp32 results (dtopk_w, fp32 weight grads):  |gpu - ref| <= atol + rtol · max(|ref|, M)
 * rtol = 2^-7, atol = 2^-7 · rms(ref - start) (start: the starting weight gradients when
 * accumulating, else 0, so atol scales with what one call computes), and M the magnitude of the
 * element's outermost sum (tests/support/magnitude.h): |dxs| + Σ_k |dxk| for dx, Σ_i |ds s| for
 * dtopk_w, Σ_rows |dy a|, |dg x|, |du x| over the expert's rows (all T tokens for the shared
 * expert) for the weight gradients, never including start.
 * Why: (1) the GEMMs accumulate in fp32 in another order than the reference's sequential sums
 * (wgmma k-blocks; the weight gradients' row order is the same, but not the split into MMA
 * steps), and dxk = dg·Wg + du·Wu is two fp32 sums added, not one: ~2^-24 of M, negligible;
 * (2) the forward's bf16 g, u may differ from the CPU forward's by one ulp (RECOMPUTE against the
 * CPU's own; SAVE reads the GPU's), moving s, a, dg, du by up to 2^-8 of themselves; (3) so a bf16
 * rounding of a, dg, du or dxk may land one ulp apart, at most 2^-7 of that value, which moves a
 * sum by at most 2^-7 of the terms it feeds: the flips together stay within 2^-7 · M (a flip of
 * one a, dg or du inside a dxk is one term's: inside atol), however much the terms cancel: slots
 * in dx, rows of an expert in a weight gradient, the start in an accumulated one (ref = start + g
 * may be near 0 while g is not); (4) a result rounded to bf16 then rounds apart by at most one
 * ulp of its own, 2^-7 · |ref| more (a one-row gradient whose factor flips lands 2 ulps apart).
 * dtopk_w has no bf16 value inside its sum: only (1) and (2) reach it. In the fuzz campaign's
 * log of 1,008 cases (docs/design.md, "Testing"), 77 printed worst elements were beyond
 * atol + rtol · |ref|; with M computed on the host for the same inputs, one of them still is
 * (1.09 of its bound). The worst element is printed with its ratio to the bound and its M.
 */
static int bwd_compare(const char *what, const char *name, const std::vector<double> &gpu,
                       const std::vector<double> &ref, const std::vector<double> *start,
                       const std::vector<double> &mag, int fp32, int64_t cols) {
  const int64_t n = (int64_t)ref.size();
  test_tol_t t = test_tol_rms(ref.data(), start ? start->data() : NULL, n);
  t.fp32 = fp32;
  return test_compare_report(what, name, gpu.data(), ref.data(), mag.data(), n, cols, t);
}

static std::vector<double> bwd_w_values(const bwd_problem_t *p, const std::vector<uint8_t> &b) {
  if (p->wdt == MOK_WGRAD_BF16) return bf16_values((const uint16_t *)b.data(), b.size() / 2);
  std::vector<double> d(b.size() / 4);
  for (size_t i = 0; i < d.size(); i++) d[i] = ((const float *)b.data())[i];
  return d;
}

// The magnitudes of p's outputs (tests/support/magnitude.h): dx, dtopk_w, then the weight
// gradients in bwd_w_name's order (the shared expert's 0 when Is = 0), each one element longer
// than the output (a valid .data() when it is empty). 0 when out of memory.
static int bwd_magnitudes(const bwd_problem_t *p, std::vector<double> m[2 + BWD_NW]) {
  const fwd_problem_t &f = p->f;
  m[0].assign((size_t)(f.T * f.H) + 1, 0);
  m[1].assign((size_t)(f.T * f.K) + 1, 0);
  for (int i = 0; i < BWD_NW; i++) m[2 + i].assign((size_t)bwd_w_elems(p, i) + 1, 0);
  const test_mag_in_t in =
      fwd_mag_in(&f, f.T, f.x.data(), f.idx.data(), f.tw.data(), f.Is, p->dy.data());
  test_mag_out_t o;
  memset(&o, 0, sizeof(o));
  o.dx = m[0].data(), o.dtw = m[1].data();
  o.dwg = m[2].data(), o.dwu = m[3].data(), o.dwd = m[4].data();
  if (f.Is > 0) o.dwsg = m[5].data(), o.dwsu = m[6].data(), o.dwsd = m[7].data();
  return test_magnitudes(&in, &o);
}

// Every output of the GPU against the CPU layer; 1 when all are within the tolerance.
static int bwd_compare_all(const char *what, const bwd_problem_t *p, const bwd_out_t *gpu,
                           const bwd_out_t *ref) {
  const fwd_problem_t &f = p->f;
  std::vector<double> m[2 + BWD_NW];
  if (!bwd_magnitudes(p, m)) {
    printf("    %s: no memory for the magnitudes\n", what);
    return 0;
  }
  int ok = bwd_compare(what, "dx", bf16_values(gpu->dx.data(), gpu->dx.size()),
                       bf16_values(ref->dx.data(), ref->dx.size()), NULL, m[0], 0, f.H);
  ok &= bwd_compare(what, "dtopk_w", std::vector<double>(gpu->dtw.begin(), gpu->dtw.end()),
                    std::vector<double>(ref->dtw.begin(), ref->dtw.end()), NULL, m[1], 1, f.K);
  const int64_t cols[BWD_NW] = {f.H, f.H, f.I, f.H, f.H, f.Is};
  for (int i = 0; i < (f.Is > 0 ? BWD_NW : 3); i++) {
    std::vector<double> start;
    if (p->accumulate) start = bwd_w_values(p, p->dw0[i]);
    ok &= bwd_compare(what, bwd_w_name[i], bwd_w_values(p, gpu->dw[i]), bwd_w_values(p, ref->dw[i]),
                      p->accumulate ? &start : NULL, m[2 + i], p->wdt == MOK_WGRAD_FP32, cols[i]);
  }
  return ok;
}

/* ---------------------------------------------------------------------------------------------- */
/* The GPU layer                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
  test_gpu_layer_t f;
  uint16_t *dy, *dx;  // device [T_max, H]
  float *dtw;         // [T_max, K]
  void *dw[BWD_NW];
} bwd_gpu_t;

static void bwd_gpu_close(bwd_gpu_t *g) {
  cudaDeviceSynchronize();
  void *bufs[] = {g->dy, g->dx, g->dtw, g->dw[0], g->dw[1], g->dw[2], g->dw[3], g->dw[4], g->dw[5]};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    if (bufs[i]) cudaFree(bufs[i]);
  test_gpu_layer_close(&g->f);
  memset(g, 0, sizeof(*g));
}

// A GPU layer with p's descriptor (wgrad dtype and mode included); 0 on failure (printed).
static int bwd_gpu_open(bwd_gpu_t *g, const bwd_problem_t *p) {
  memset(g, 0, sizeof(*g));
  const fwd_problem_t &f = p->f;
  const mok_layer_desc_t d = bwd_desc(p);
  if (!fwd_gpu_open_desc(&g->f, &f, &d)) return 0;
  g->dy = to_dev(p->dy);
  if (cudaMalloc(&g->dx, (size_t)(f.T_max * f.H) * 2 + 16) != cudaSuccess) g->dx = NULL;
  if (cudaMalloc(&g->dtw, (size_t)(f.T_max * f.K) * 4 + 16) != cudaSuccess) g->dtw = NULL;
  int ok = g->dy && g->dx && g->dtw;
  for (int i = 0; i < (f.Is > 0 ? BWD_NW : 3); i++) {
    if (cudaMalloc(&g->dw[i], bwd_w_bytes(p, i) + 16) != cudaSuccess) g->dw[i] = NULL;
    ok &= g->dw[i] != NULL;
  }
  if (!ok) {
    printf("    GPU layer: device allocation failed\n");
    bwd_gpu_close(g);
    return 0;
  }
  return 1;
}

// Uploads x, routing, router weights and dy; dx and dtopk_w get NaN poison; weight gradients the
// starting values (accumulate) or NaN poison (overwrite: every element must be written).
static void bwd_gpu_inputs(bwd_gpu_t *g, const bwd_problem_t *p) {
  const fwd_problem_t &f = p->f;
  cudaMemcpy(g->dy, p->dy.data(), p->dy.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(g->dx, 0xFF, (size_t)(f.T_max * f.H) * 2);
  cudaMemset(g->dtw, 0xFF, (size_t)(f.T_max * f.K) * 4);
  for (int i = 0; i < (f.Is > 0 ? BWD_NW : 3); i++) {
    if (p->accumulate) cudaMemcpy(g->dw[i], p->dw0[i].data(), bwd_w_bytes(p, i), cudaMemcpyHostToDevice);
    else cudaMemset(g->dw[i], 0xFF, bwd_w_bytes(p, i));
  }
  fwd_gpu_inputs(&g->f, &f);  // ends with a device synchronization
}

static mokResult_t bwd_gpu_backward(bwd_gpu_t *g, const bwd_problem_t *p, int64_t T,
                                    const void *ctx, cudaStream_t stream) {
  const mok_forward_args_t a = test_gpu_layer_args(&g->f, T);
  const mok_backward_args_t b = test_backward_args(T, g->dy, g->dx, g->dtw, g->dw, p->f.Is > 0);
  return mok_backward(g->f.l, &a, &b, ctx ? ctx : g->f.ctx, g->f.ctx_bytes, (mok_stream_t)stream);
}

// Forward then backward of p's first T tokens on `stream`.
static mokResult_t bwd_gpu_run(bwd_gpu_t *g, const bwd_problem_t *p, cudaStream_t stream) {
  mokResult_t r = test_gpu_layer_forward(&g->f, p->f.T, stream);
  if (r != MOK_SUCCESS) return r;
  return bwd_gpu_backward(g, p, p->f.T, NULL, stream);
}

static void bwd_gpu_outputs(const bwd_gpu_t *g, const bwd_problem_t *p, bwd_out_t *o) {
  const fwd_problem_t &f = p->f;
  o->dx.assign((size_t)(f.T * f.H), 0);
  o->dtw.assign((size_t)(f.T * f.K), 0.0f);
  if (f.T > 0) {
    cudaMemcpy(o->dx.data(), g->dx, o->dx.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(o->dtw.data(), g->dtw, o->dtw.size() * 4, cudaMemcpyDeviceToHost);
  }
  for (int i = 0; i < BWD_NW; i++) {
    o->dw[i].assign(i < 3 || f.Is > 0 ? bwd_w_bytes(p, i) : 0, 0);
    if (!o->dw[i].empty()) cudaMemcpy(o->dw[i].data(), g->dw[i], o->dw[i].size(), cudaMemcpyDeviceToHost);
  }
}

static int bwd_same(const bwd_out_t *a, const bwd_out_t *b) {
  int same = a->dx == b->dx && memcmp(a->dtw.data(), b->dtw.data(), a->dtw.size() * 4) == 0;
  for (int i = 0; i < BWD_NW; i++) same &= a->dw[i] == b->dw[i];
  return same;
}

// Where two runs' gradients differ, for a failure message: per output, the elements that differ
// and the first of them ("dx: 12 of 4096 differ, first [3, 17]; dwd: ..."), or "" when bitwise
// equal. Byte-wise for the weight gradients (elements of `elem` bytes, rows of `cols`).
static void bwd_diff_part(std::string *out, const char *name, const uint8_t *a, const uint8_t *b,
                          size_t bytes, size_t elem, int64_t cols) {
  int64_t n = 0, first = -1;
  for (size_t i = 0; i < bytes / elem; i++)
    if (memcmp(a + i * elem, b + i * elem, elem)) n += 1, first = first < 0 ? (int64_t)i : first;
  if (n == 0) return;
  char line[160];
  snprintf(line, sizeof(line), "%s%s: %lld of %lld differ, first [%lld, %lld]",
           out->empty() ? "" : "; ", name, (long long)n, (long long)(bytes / elem),
           (long long)(first / cols), (long long)(first % cols));
  *out += line;
}
static std::string bwd_diff(const bwd_problem_t *p, const bwd_out_t *a, const bwd_out_t *b) {
  const fwd_problem_t &f = p->f;
  std::string out;
  if (a->dx.size() != b->dx.size() || a->dtw.size() != b->dtw.size()) return "sizes differ";
  bwd_diff_part(&out, "dx", (const uint8_t *)a->dx.data(), (const uint8_t *)b->dx.data(),
                a->dx.size() * 2, 2, f.H);
  bwd_diff_part(&out, "dtopk_w", (const uint8_t *)a->dtw.data(), (const uint8_t *)b->dtw.data(),
                a->dtw.size() * 4, 4, f.K);
  const size_t elem = p->wdt == MOK_WGRAD_BF16 ? 2 : 4;
  for (int i = 0; i < BWD_NW; i++) {
    if (a->dw[i].size() != b->dw[i].size()) return out + "; weight-gradient sizes differ";
    const int64_t cols = i == 2 ? f.I : i == 5 ? f.Is : f.H;  // dWd [E, H, I], dWsd [H, Is]
    bwd_diff_part(&out, bwd_w_name[i], a->dw[i].data(), b->dw[i].data(), a->dw[i].size(), elem,
                  cols);
  }
  return out;
}

// p's forward + backward on a layer of its own in context mode `mode`, `runs` times (each on
// freshly poisoned outputs), each run's gradients into o[run]. 1 when every call and check
// succeeded; failures are recorded on the running test.
static int bwd_gpu_runs_in_mode(bwd_problem_t *p, mok_context_mode_t mode, int runs,
                                bwd_out_t *o) {
  p->f.mode = mode;
  bwd_gpu_t g;
  if (!bwd_gpu_open(&g, p)) {
    MOK_EXPECT_MSG(0, "creating the layer: %s", mok_last_error());
    return 0;
  }
  int ok = 1;
  for (int n = 0; n < runs && ok; n++) {
    bwd_gpu_inputs(&g, p);  // poisoned outputs
    const mokResult_t r = bwd_gpu_run(&g, p, 0);
    MOK_EXPECT_MSG(r == MOK_SUCCESS, "mok_forward/mok_backward: %s", mok_last_error());
    const mokResult_t c = r == MOK_SUCCESS ? mok_layer_check(g.f.l) : r;
    MOK_EXPECT_MSG(c == MOK_SUCCESS, "mok_layer_check: %s", mok_last_error());
    ok = r == MOK_SUCCESS && c == MOK_SUCCESS;
    if (ok) bwd_gpu_outputs(&g, p, &o[n]);
  }
  bwd_gpu_close(&g);
  return ok;
}

// GPU forward + backward on p's inputs against the CPU layer. 1 when everything matched;
// failures are recorded on the running test.
static int bwd_check_against_cpu(bwd_gpu_t *g, const bwd_problem_t *p, const char *what) {
  bwd_gpu_inputs(g, p);
  mokResult_t r = bwd_gpu_run(g, p, 0);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: mok_forward/mok_backward: %s", what, mok_last_error());
  r = mok_layer_check(g->f.l);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: mok_layer_check: %s", what, mok_last_error());
  if (r != MOK_SUCCESS) return 0;
  bwd_out_t gpu, ref;
  bwd_gpu_outputs(g, p, &gpu);
  std::vector<uint8_t> gctx;
  if (p->f.mode == MOK_CONTEXT_SAVE) gctx = fwd_gpu_ctx(&g->f);
  r = cpu_backward(p, &ref, p->f.mode == MOK_CONTEXT_SAVE ? &gctx : NULL);
  MOK_EXPECT_MSG(r == MOK_SUCCESS, "%s: CPU layer: %s", what, mok_last_error());
  if (r != MOK_SUCCESS) return 0;
  const int ok = bwd_compare_all(what, p, &gpu, &ref);
  MOK_EXPECT_MSG(ok, "%s: GPU gradients differ from the CPU layer beyond the tolerance", what);
  return ok;
}

#endif /* MOK_TESTS_GPU_BACKWARD_TEST_UTIL_CUH */
