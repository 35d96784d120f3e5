/*
 * forward/fused_launch.cu: the fused forward's launcher (forward.h, mok_fwd_fused_launch): the
 * call's checks (src/common/shape.h's rules), the kernel's flat parameters from the call and the
 * layer's tuning, its tensor maps, the configuration whose shared memory fits, and the
 * cooperative launch of one CTA per SM.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "common/shape.h"
#include "common/status.h"
#include "common/tuning.h"
#include "common/workspace.h"
#include "cuda/forward/forward.h"
#include "cuda/forward/fused_params.cuh"
#include "cuda/gemm/gemm.h"
#include "cuda/ptx/tma.cuh"
#include "cuda/tile/launch.cuh"


static int fk_a16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

// The plan's lag (src/common/task_plan.h) in expert stages: enough that the tasks between an
// expert's GATE_UP tiles and its DOWN tiles exceed one wave of the grid, from the average rows
// per expert (the host does not know the real counts), and at least 3: at Qwen3-235B and
// DeepSeek-V3 (2 by the first rule) 3 was as fast or faster in 7 of 8 same-run comparisons, by
// 0-2% (docs/performance.md, "Fused forward: task order and lag"). The tuning's fused_lag, when
// set, overrides it (the bits never depend on it).
static int32_t fk_lag(const mok_fwd_fused_params_t *p, const mok_tuning_t *t, int grid) {
  const mok_fwd_local_params_t *l = &p->l;
  if (t->fused_lag > 0) return (int32_t)(t->fused_lag > l->E ? l->E : t->fused_lag);
  const int64_t tiles = (l->T * l->K / l->E + FK_BM - 1) / FK_BM + 1;  // row tiles per expert
  const int64_t per_stage = tiles * (p->I / 128 + (l->H + FK_BN - 1) / FK_BN);
  int64_t lag = (grid + per_stage - 1) / per_stage + 1;
  if (lag < 3) lag = 3;
  return (int32_t)(lag > l->E ? l->E : lag);
}

// The tensor maps of one call (NULL-free: maps of absent tensors alias one that exists and are
// never read or written).
static int fk_encode_maps(const mok_fwd_fused_params_t *p, fk_maps_t *m) {
  const mok_fwd_local_params_t *l = &p->l;
  // T = 0 happens only in an expert-parallel call (other ranks' rows): then no task reads x or
  // the shared expert's rows, but the maps need a non-empty tensor.
  const uint64_t T = l->T > 0 ? (uint64_t)l->T : 1, H = (uint64_t)l->H, I = (uint64_t)p->I,
                 Is = (uint64_t)l->Is, E = (uint64_t)l->E, R = (uint64_t)l->capacity_rows;
  const int shared = l->Is > 0, save = p->g_out && p->u_out,
            shared_save = shared && p->gs_out && p->us_out;
  const void *x = l->T > 0 ? l->x : p->recv_x;
  const int bad =
      tma_encode_bf16_sw128(&m->x, x, T, H, 128) ||
      tma_encode_bf16_sw128(&m->wg, p->wg, E * I, H, 128) ||
      tma_encode_bf16_sw128(&m->wu, p->wu, E * I, H, 128) ||
      tma_encode_bf16_sw128(&m->a, p->a, R, I, 128) ||
      tma_encode_bf16_sw128(&m->wd, p->wd, E * H, I, 128) ||
      tma_encode_bf16_sw128(&m->yk, l->yk, R, H, 64) ||
      tma_encode_bf16_sw128(&m->a_st, p->a, R, I, 64) ||
      (save && (tma_encode_bf16_sw128(&m->g, p->g_out, R, I, 64) ||
                tma_encode_bf16_sw128(&m->u, p->u_out, R, I, 64))) ||
      (shared && (tma_encode_bf16_sw128(&m->as, p->as, T, Is, 128) ||
                  tma_encode_bf16_sw128(&m->wsg, p->wsg, Is, H, 128) ||
                  tma_encode_bf16_sw128(&m->wsu, p->wsu, Is, H, 128) ||
                  tma_encode_bf16_sw128(&m->wsd, p->wsd, H, Is, 128) ||
                  tma_encode_bf16_sw128(&m->as_st, p->as, T, Is, 64))) ||
      (shared_save && (tma_encode_bf16_sw128(&m->gs, p->gs_out, T, Is, 64) ||
                       tma_encode_bf16_sw128(&m->us, p->us_out, T, Is, 64)));
  if (bad) return 1;
  if (!shared) m->as = m->wsg = m->wsu = m->wsd = m->x;  // never read
  if (!shared) m->as_st = m->yk;                           // never written
  if (!shared_save) m->gs = m->us = m->yk;
  if (!save) m->g = m->u = m->yk;
  return 0;
}

extern "C" mokResult_t mok_fwd_fused_launch(const mok_fwd_fused_params_t *p, void *stream) {
  if (!p) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "fused forward launch: NULL params");
  const mok_fwd_local_params_t *l = &p->l;
  const int shared = l->Is > 0;
  if (!l->status || !l->offsets || !l->slot_row || !l->row_w || !l->row_tok || !l->tile_pre ||
      !l->red_pre || !l->red_order || !l->counters || !l->err || !l->yk || !p->wg || !p->wu ||
      !p->wd || !p->a ||
      (l->T > 0 && (!l->x || (!p->recv_x && !l->y))) ||
      (shared && (!p->wsg || !p->wsu || !p->wsd || !p->as || !l->ys)))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "fused forward launch: NULL buffer");
  const int64_t T = l->T, H = l->H, I = p->I, Is = l->Is, E = l->E, R = l->capacity_rows;
  const mok_shape_t shape = {T, H, I, Is, E, l->K, R};
  char why[256];
  if (mok_shape_check(&shape, why, sizeof(why)) != MOK_SUCCESS)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "fused forward launch: %s", why);
  if (l->n_counters < mok_fc_count(R, E, T))
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "fused forward launch: %lld counters, %lld "
                    "needed", (long long)l->n_counters, (long long)mok_fc_count(R, E, T));
  if (!fk_a16(l->x) || !fk_a16(l->y) || !fk_a16(p->recv_x) || !fk_a16(l->yk) ||
      !fk_a16(p->wg) || !fk_a16(p->wu) || !fk_a16(p->wd) || !fk_a16(p->a) ||
      (p->g_out && !fk_a16(p->g_out)) ||
      (p->u_out && !fk_a16(p->u_out)) ||
      (shared && (!fk_a16(p->wsg) || !fk_a16(p->wsu) || !fk_a16(p->wsd) || !fk_a16(p->as) ||
                  !fk_a16(l->ys))))
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "fused forward launch: a tensor is not 16-byte "
                    "aligned");
  mok_tuning_t defaults;
  const mok_tuning_t *tu = p->tuning;
  if (!tu) {
    mok_tuning_default(&defaults);  // an invalid MOK_DEBUG_TIMEOUT_S leaves the defaults
    tu = &defaults;
  }
  if (T == 0 && !p->recv_x) return MOK_SUCCESS;

  fk_params_t kp;
  memset(&kp, 0, sizeof(kp));
  kp.T = T, kp.H = H, kp.I = I, kp.Is = Is, kp.E = E, kp.K = l->K;
  kp.x = l->x, kp.y = l->y;
  kp.status = l->status, kp.offsets = l->offsets, kp.tile_pre = l->tile_pre;
  kp.slot_row = l->slot_row, kp.row_w = l->row_w, kp.row_tok = l->row_tok;
  kp.recv_x = p->recv_x;
  kp.no_reduce = p->recv_x != NULL;
  if (p->dispatch) {
    if (!p->recv_x || p->dispatch->num_ctas < 1 || p->dispatch->nranks > MOK_MAX_RANKS ||
        p->dispatch->EL != E)
      return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "fused forward launch: a dispatch without "
                      "expert-parallel rows, or of another layout");
    kp.tp = *p->dispatch;
    kp.n_comm = p->dispatch->num_ctas;
  }
  kp.red_pre = l->red_pre, kp.red_order = l->red_order;
  kp.counters = l->counters, kp.err = l->err;
  kp.yk = (void *)l->yk, kp.ys = (float *)l->ys;
  kp.a = p->a, kp.as = p->as;
  kp.g_out = p->g_out, kp.u_out = p->u_out, kp.gs_out = p->gs_out, kp.us_out = p->us_out;
  kp.timeout_ns = (uint64_t)((p->timeout_s > 0 ? p->timeout_s : tu->timeout_s) * 1e9);
  kp.sgu_base = (uint32_t)mok_fc_sgu(R, E);
  kp.sd_base = (uint32_t)mok_fc_sd(R, E, T);
  kp.dn_base = (uint32_t)mok_fc_dn(R, E, T);
  kp.shared_band = tu->fused_shared_band;
  // The reduce helpers from expert stage help_stage (src/common/task_plan.h's stages): by default
  // at 85% of the expert stages without a shared expert (about when the first tokens have all
  // their experts' DOWN tiles done), none with one (its tokens wait for the shared expert, which
  // comes last).
  const int help_pct = tu->fused_help_pct >= 0 ? tu->fused_help_pct : shared ? 100 : 85;
  kp.help_stage = kp.no_reduce ? (int32_t)E : (int32_t)(E * help_pct / 100);
  // With helpers during the expert stages, the reduce in the layout's order (tokens by their last
  // expert, fk_reduce_claims); else in token order after every DOWN tile, counted at once per
  // warpgroup (MOK_FC_DOWN): without early helpers no token is reduced before the expert stages
  // end, so the order buys nothing and per-expert releases would only add work to every DOWN
  // tile.
  kp.by_last = !shared && kp.help_stage < E;

  fk_maps_t m;
  if (fk_encode_maps(p, &m))
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused forward launch: encoding a TMA tensor map failed "
                    "(no CUDA driver with cuTensorMapEncodeTiled?)");

  // Staged stores (fk_cfg) when their buffers fit next to the E + 1 prefix sums (E up to about
  // 480); else stores from registers.
  int staged = 1, fits = 0, grid = 0;
  cudaError_t e = cudaSuccess;
  for (; e == cudaSuccess && staged > 0; staged--) {
    e = tile_smem_fits((const void *)fk_kernel(staged), fk_smem_bytes(staged, E), &fits);
    if (fits) break;
  }
  const fk_kernel_fn kernel = fk_kernel(staged);
  const size_t smem = fk_smem_bytes(staged, E);
  if (e == cudaSuccess) e = tile_persistent_grid((const void *)kernel, smem, p->num_sms, &grid);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused forward launch: setting up %zu bytes of shared "
                    "memory per CTA: %s", smem, cudaGetErrorString(e));
  }
  kp.lag = fk_lag(p, tu, grid);
  // Row tiles per band of the plan's blocks: by the size of an expert's gate and up weights.
  kp.group_m = mok_tile_group_m(tu->tile_group_m, 2 * I * H * 2);

  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  // Cooperative at W = 1. Expert parallel, a plain launch: the virtual ranks of one GPU run their
  // kernels side by side, and another rank's communication CTAs, spinning until this rank's
  // combine (after this kernel) signals, may hold SMs that a cooperative launch would wait for.
  // NOTE (deadlock freedom without co-residency): a CTA takes a ticket only while it runs, and a
  // task waits only on tasks of lower tickets, held by CTAs that already run; with no REDUCE (no
  // claims) nothing waits on a CTA that has not started, so any number of resident CTAs finishes.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = p->recv_x ? 0 : 1;
  cfg.gridDim = dim3((unsigned)grid, 1, 1);
  cfg.blockDim = dim3(MOK_TP_THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, kernel, kp, m);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused forward kernel launch (%d CTAs, %zu bytes of "
                    "shared memory): %s", grid, smem, cudaGetErrorString(e));
  }
  return MOK_SUCCESS;
}
