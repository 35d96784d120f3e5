/*
 * backward/fused_launch.cu: the fused backward's launcher (backward.h, mok_bwd_fused_launch): the
 * checks, the kernel's flat parameters, its tensor maps, the counters zeroed on the stream and a
 * plain launch of one CTA per SM (backward/fused.cu's NOTE: no co-residency is needed).
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "common/limits.h"
#include "common/status.h"
#include "common/workspace.h"
#include "cuda/backward/backward.h"
#include "cuda/backward/fused_params.cuh"
#include "cuda/gemm/gemm.h"
#include "cuda/ptx/tma.cuh"
#include "cuda/tile/launch.cuh"

static int bk_a16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

// The plan's lag_dw: an expert's DW tiles come lag_dw expert stages after its DX tiles, so that
// the two kinds of tile mix on the SMs. By default E / 16; 1 and E measured the same within 1%
// (docs/performance.md, "Fused backward: the first kernel").
static int32_t bk_lag_dw(int64_t E, int requested) {
  int64_t lag = requested > 0 ? requested : E / 16;
  if (lag < 1) lag = 1;
  return (int32_t)(lag > E ? E : lag);
}

static int bk_encode_maps(const mok_bwd_fused_params_t *p, bk_maps_t *m) {
  const uint64_t H = (uint64_t)p->H, I = (uint64_t)p->I, E = (uint64_t)p->E, R = (uint64_t)p->R;
  const int bf16 = p->wgrad_epilogue == MOK_GG_EPI_STORE_BF16;
  const int stores = p->wgrad_epilogue != MOK_GG_EPI_ACCUM_F32;
  int bad = tma_encode_bf16_sw128(&m->dg, p->dg, R, I, 128) ||
            tma_encode_bf16_sw128(&m->du, p->du, R, I, 128) ||
            tma_encode_bf16_sw128(&m->wg, p->wg, E * I, H, 64) ||
            tma_encode_bf16_sw128(&m->wu, p->wu, E * I, H, 64) ||
            tma_encode_bf16_sw128(&m->dxk, p->dxk, R, H, 64) ||
            tma_encode_bf16_sw128(&m->dyg_w, p->dyg, R, H, 64) ||
            tma_encode_bf16_sw128(&m->a_w, p->a, R, I, 64) ||
            tma_encode_bf16_sw128(&m->dg_w, p->dg, R, I, 64) ||
            tma_encode_bf16_sw128(&m->du_w, p->du, R, I, 64) ||
            tma_encode_bf16_sw128(&m->xg_w, p->xg, R, H, 64);
  if (!bad && stores && bf16)
    bad = tma_encode_bf16_sw128(&m->dwd, p->dwd, E * H, I, 64) ||
          tma_encode_bf16_sw128(&m->dwg, p->dwg, E * I, H, 64) ||
          tma_encode_bf16_sw128(&m->dwu, p->dwu, E * I, H, 64);
  else if (!bad && stores)
    bad = tma_encode_f32_sw128(&m->dwd, p->dwd, E * H, I, 64) ||
          tma_encode_f32_sw128(&m->dwg, p->dwg, E * I, H, 64) ||
          tma_encode_f32_sw128(&m->dwu, p->dwu, E * I, H, 64);
  else
    m->dwd = m->dwg = m->dwu = m->dxk;  // accumulation stores from registers: never used
  return bad;
}

extern "C" mokResult_t mok_bwd_fused_launch(const mok_bwd_fused_params_t *p, void *stream) {
  if (!p) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "fused backward launch: NULL params");
  const mok_bwd_local_params_t *r = p->reduce;
  if (!p->status || !p->offsets || !p->xg || !p->dyg || !p->a || !p->dg || !p->du || !p->wg ||
      !p->wu || !p->dxk || !p->dwg || !p->dwu || !p->dwd || !p->counters || !p->err ||
      (r && (!r->ctx_slot_row || !r->dw_row || !r->dx || !r->dtopk_w)))
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "fused backward launch: NULL buffer");
  const int64_t H = p->H, I = p->I, E = p->E, R = p->R;
  // The chain's rules (the grouped GEMMs' and the reduce's): K blocks of 64, N-major B rows of 16
  // bytes, int32 TMA coordinates and rows.
  if (H < 128 || I < 128 || H % 128 || I % 128 || E < 1 || R < 1 ||
      E * (H > I ? H : I) >= (1ll << 31) ||
      R >= (1ll << 31) ||
      (r && (r->T < 1 || r->K < 1 || r->K > MOK_MAX_TOP_K)))
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "fused backward launch: H = %lld, I = %lld, "
                    "E = %lld, R = %lld", (long long)H, (long long)I, (long long)E, (long long)R);
  if (p->wgrad_epilogue != MOK_GG_EPI_STORE_F32 && p->wgrad_epilogue != MOK_GG_EPI_STORE_BF16 &&
      p->wgrad_epilogue != MOK_GG_EPI_ACCUM_F32)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "fused backward launch: weight-gradient "
                    "epilogue %d", p->wgrad_epilogue);
  if (p->n_counters < MOK_FC_GU)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "fused backward launch: %lld counters",
                    (long long)p->n_counters);
  if (!bk_a16(p->xg) || !bk_a16(p->dyg) || !bk_a16(p->a) || !bk_a16(p->dg) || !bk_a16(p->du) ||
      !bk_a16(p->wg) || !bk_a16(p->wu) || !bk_a16(p->dxk) || !bk_a16(p->dwg) || !bk_a16(p->dwu) ||
      !bk_a16(p->dwd) || (r && (!bk_a16(r->dx) || (r->dxs && !bk_a16(r->dxs)))))
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "fused backward launch: a tensor is not 16-byte "
                    "aligned");

  bk_params_t kp;
  memset(&kp, 0, sizeof(kp));
  kp.H = H, kp.I = I, kp.E = E, kp.R = R;
  kp.status = p->status, kp.offsets = p->offsets;
  kp.dxk = p->dxk, kp.dwg = p->dwg, kp.dwu = p->dwu, kp.dwd = p->dwd;
  if (r) {
    kp.reduce = 1;
    kp.T = r->T, kp.K = r->K;
    kp.slot_row = r->ctx_slot_row, kp.dxs = r->dxs, kp.dw_row = r->dw_row;
    kp.dx = r->dx, kp.dtopk_w = r->dtopk_w;
  }
  kp.counters = p->counters, kp.err = p->err;
  kp.timeout_ns = (uint64_t)((p->timeout_s > 0 ? p->timeout_s : 10.0) * 1e9);
  // Row tiles per band of the plan's blocks, by the size of an expert's gate and up weights (the
  // DX tiles read them), as the chain's dxk GEMM.
  kp.group_m = mok_tile_group_m(p->tile_group_m, 2 * I * H * 2);
  kp.lag_dw = bk_lag_dw(E, p->lag_dw);

  bk_maps_t m;
  if (bk_encode_maps(p, &m))
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused backward launch: encoding a TMA tensor map "
                    "failed (no CUDA driver with cuTensorMapEncodeTiled?)");

  const bk_kernel_fn kernel = bk_kernel(p->wgrad_epilogue);
  const size_t smem = bk_smem_bytes(E);
  int fits = 0, grid = 0;
  cudaError_t e = tile_smem_fits((const void *)kernel, smem, &fits);
  if (e == cudaSuccess && !fits) e = cudaErrorInvalidValue;
  if (e == cudaSuccess) e = tile_persistent_grid((const void *)kernel, smem, p->num_sms, &grid);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused backward launch: setting up %zu bytes of shared "
                    "memory per CTA (E = %lld): %s", smem, (long long)E, cudaGetErrorString(e));
  }

  e = cudaMemsetAsync(p->counters, 0, MOK_FC_GU * sizeof(uint32_t), (cudaStream_t)stream);
  if (e == cudaSuccess) {
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.gridDim = dim3((unsigned)grid, 1, 1);
    cfg.blockDim = dim3(MOK_TP_THREADS, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = (cudaStream_t)stream;
    e = cudaLaunchKernelEx(&cfg, kernel, kp, m);
  }
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, MOK_ERROR_CUDA, "fused backward kernel launch (%d CTAs, %zu bytes of "
                    "shared memory): %s", grid, smem, cudaGetErrorString(e));
  }
  return MOK_SUCCESS;
}
