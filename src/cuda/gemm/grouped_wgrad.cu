/*
 * grouped_wgrad.cu: the k-grouped GEMM of the weight gradients (docs/design.md, "The layer") and its C
 * launcher.
 *
 *   C[g] = epilogue( A_gᵀ · B_g )   for g in [0, G), A_g = A[offsets[g] : offsets[g+1], :]
 *   A    [M_total, N] bf16 row-major      e.g. dy [R, H]   (dWd) or dg, du [R, I] (dWg, dWu)
 *   B    [M_total, K] bf16 row-major      e.g. a  [R, I]   (dWd) or x [R, H]      (dWg, dWu)
 *   C    [G, N, K] fp32 or bf16           e.g. dWd [E, H, I], dWg [E, I, H]
 *
 * The groups split the reduction, not the output: every group owns all of C[g], whatever its row
 * count, and the rows of a group are known only on the device. Same CTA shape as the grouped GEMM
 * (grouped_gemm.cu): one CTA per SM, 384 threads, warpgroup 0 produces (TMA), warpgroups 1 and 2
 * consume (wgmma, transposed A and B from MN-major 128B-swizzled tiles) and run the epilogue. A
 * tile is 128 rows x 256 columns of C[g]; one stage is 64 reduced rows (tile/pipeline.cuh, k-grouped
 * section, which also explains how a group's last partial block is made to add exactly zero).
 *
 * Determinism: each output tile belongs to one CTA, which sums its group's rows in row order with
 * fp32 accumulators (4 k16 wgmmas per stage, stages in order); no atomics. The result does not
 * depend on the grid size. An empty group stores zeros (store epilogues) or leaves C[g] untouched
 * (accumulate).
 *
 * Configurations (one dispatch table in mok_grouped_wgrad_launch), as in grouped_gemm.cu:
 *   staged (bf16 and fp32 stores): 3 stages + 64 KB output staging; each consumer warpgroup stages its
 *          [64, 256] piece in swizzled shared memory and leaves it to TMA bulk copies over the
 *          [G N, K] view of C, which drain while the next tile's MMA runs (a tile reduces only
 *          R / E rows, ~8 blocks at DeepSeek-V3, so an unhidden epilogue costs a lot): bf16 in
 *          one round of 32 KB per warpgroup, fp32 in two rounds of 32 KB (the second waits until
 *          the copy engine has read the first); row tiles that end past N[g] fall back to direct
 *          stores;
 *   direct (fp32 accumulation): 4 stages, stores from registers.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/tile/epilogue.cuh"
#include "cuda/gemm/gemm.h"
#include "cuda/gemm/wgrad_tile.cuh"
#include "cuda/ptx/ptx.cuh"
#include "cuda/tile/barriers.cuh"
#include "cuda/tile/pipeline.cuh"
#include "cuda/tile/scheduler.cuh"
#include "cuda/ptx/tma.cuh"

enum { GW_BM = 128, GW_BN = 256, GW_BK = 64, GW_STAGES_DIRECT = 4, GW_STAGES_STAGED = 3,
       GW_C_BYTES = 2 * 2 * 64 * 128 * 2 };  // staging: 2 warpgroups x 2 rounds x [64, 128] bf16

// Register split after setmaxnreg, as in grouped_gemm.cu: 40 (producer) + 2 x 232 (consumers),
// within the 168 per thread the CTA is launched with (grouped_gemm.cu's note).
enum { GW_PRODUCER_REGS = 40, GW_CONSUMER_REGS = 232 };
static_assert(GW_PRODUCER_REGS + 2 * GW_CONSUMER_REGS <= 3 * 168,
              "the launch's registers (gemm/grouped_gemm_fp8.cuh)");
static_assert(GW_BK * MOK_TP_ROW_BYTES == MOK_TP_WGRAD_CHUNK_BYTES, "a chunk: 64 rows of 64 bf16");

static_assert(tp_plan<GW_BM, GW_BN, GW_STAGES_DIRECT, 0>::STAGE_BYTES % 1024 == 0,
              "128B swizzle needs 1024-byte aligned stages");
static_assert(tp_plan<GW_BM, GW_BN, GW_STAGES_STAGED, GW_C_BYTES>::ALLOC_BYTES <= 227 * 1024,
              "staged configuration fits the shared memory of a CTA");

typedef struct {
  const void *offsets;  // [G + 1] int32 or int64, device
  int offsets_int64;
  int num_groups;       // G
  int64_t m_total;      // rows of A and B
  int n, k;             // C[g] is [N, K]
  int m_tiles, n_tiles; // ceil(N / 128), ceil(K / 256)
  void *c;              // [G, N, K] bf16 or fp32
} gw_kernel_params_t;

template <int EPI, int STAGES, int TMA_STORE>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    gw_bf16_kernel(const __grid_constant__ gw_kernel_params_t p,
                   const __grid_constant__ CUtensorMap tm_a,  // A [M_total, N], box [64, 64]
                   const __grid_constant__ CUtensorMap tm_b,  // B [M_total, K], box [64, 64]
                   const __grid_constant__ CUtensorMap tm_c)  // C [G N, K]: bf16, box [64, 64];
                                                              // fp32, box [64, 32]
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(EPI == MOK_GG_EPI_STORE_BF16 || EPI == MOK_GG_EPI_STORE_F32 ||
                    EPI == MOK_GG_EPI_ACCUM_F32,
                "weight gradients: store bf16, store fp32 or accumulate fp32");
  static_assert(!TMA_STORE || EPI != MOK_GG_EPI_ACCUM_F32, "staged: stores only");
  constexpr int C_BYTES = TMA_STORE ? GW_C_BYTES : 0;
  typedef tp_plan<GW_BM, GW_BN, STAGES, C_BYTES> P;
  extern __shared__ uint8_t smem_raw[];
  uint64_t *full, *empty;
  uint8_t *smem = tp_kernel_start<P>(smem_raw, &full, &empty, &tm_a, &tm_b,
                                        TMA_STORE ? &tm_c : NULL, NULL);
  const int wg = threadIdx.x / 128;

  gw_sched_t sched = gw_sched_init(p.offsets, p.offsets_int64, p.num_groups, p.m_total,
                                   p.m_tiles, p.n_tiles, GW_BM, GW_BN);
  tp_ring_t ring = {0, 0};
  gw_tile_t tile;

  if (wg == 0) {
    ptx_setmaxnreg_dec<GW_PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      while (gw_sched_next(&sched, &tile)) {
        const int k_blocks = (tile.rows + GW_BK - 1) / GW_BK;
        tp_produce_tile_wgrad<STAGES>(&ring, smem, full, empty, &tm_a, &tm_b, tile.row0,
                                      k_blocks, tile.c_row0, tile.c_col0);
      }
    }
  } else {
    ptx_setmaxnreg_inc<GW_CONSUMER_REGS>();
    const int cw = wg - 1;             // consumer warpgroup: rows [64 cw, 64 cw + 64) of the tile
    const int lt = threadIdx.x & 127;  // thread within the warpgroup
    uint8_t *stage_c = smem + P::C_OFFSET + cw * (C_BYTES / 2);  // 32 KB: [4][64][128 B]
    float acc[128];                    // [64, 256] fragment of this warpgroup
    while (gw_sched_next(&sched, &tile)) {
      const int k_blocks = (tile.rows + GW_BK - 1) / GW_BK;
      if (k_blocks == 0) {  // empty group: zeros, or C[g] untouched when accumulating
        gw_store_zeros<EPI>(p.c, tile.group, p.n, p.k, tile.c_row0, tile.c_col0, cw);
        continue;
      }
      const int last_rows = tile.rows - (k_blocks - 1) * GW_BK;  // 1..64
      tp_consume_tile_wgrad_n256<STAGES>(&ring, smem, full, empty, k_blocks, last_rows, cw,
                                         acc);
      gw_store_tile<EPI>(acc, stage_c, &tm_c, p.c, tile.group, p.n, p.k, tile.c_row0,
                         tile.c_col0, cw, MOK_BAR_GEMM_EPI + cw, lt);
    }
    if (TMA_STORE && lt == 0) ptx_bulk_wait_group_all();  // stores done before the CTA retires
  }
#endif
}

/* ---------------------------------------------------------------------------------------------- */
/* Launcher                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static int gw_aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

static mokResult_t gw_validate(const mok_grouped_wgrad_params_t *p) {
  if (!p) return MOK_ERROR_NULL_POINTER;
  if (!p->a || !p->b || !p->c || !p->offsets) return MOK_ERROR_NULL_POINTER;
  if ((int)p->epilogue < 0 || p->epilogue > MOK_GG_EPI_SWIGLU) return MOK_ERROR_INVALID_VALUE;
  if (p->epilogue == MOK_GG_EPI_SWIGLU) return MOK_ERROR_NOT_IMPLEMENTED;
  if (p->offsets_int64 != 0 && p->offsets_int64 != 1) return MOK_ERROR_INVALID_VALUE;
  if (p->num_sms < 0) return MOK_ERROR_INVALID_VALUE;
  if (p->num_groups < 1 || p->num_groups > MOK_GG_MAX_GROUPS) return MOK_ERROR_INVALID_SHAPE;
  if (p->m_total < 0 || p->n < 1 || p->k < 1) return MOK_ERROR_INVALID_SHAPE;
  if (p->n % 8 != 0 || p->k % 8 != 0) return MOK_ERROR_INVALID_SHAPE;  // 16-byte row strides
  // int32 rows, TMA coordinates and tile indices
  if (p->m_total >= ((int64_t)1 << 31) || p->n >= ((int64_t)1 << 31) ||
      p->k >= ((int64_t)1 << 31))
    return MOK_ERROR_INVALID_SHAPE;
  if (p->num_groups * p->n >= ((int64_t)1 << 31)) return MOK_ERROR_INVALID_SHAPE;  // [G N, K]
  const int64_t tiles = ((p->n + GW_BM - 1) / GW_BM) * ((p->k + GW_BN - 1) / GW_BN);
  if (tiles * p->num_groups >= ((int64_t)1 << 31)) return MOK_ERROR_INVALID_SHAPE;
  if (!gw_aligned16(p->a) || !gw_aligned16(p->b) || !gw_aligned16(p->c) ||
      ((uintptr_t)p->offsets & (p->offsets_int64 ? 7u : 3u)))
    return MOK_ERROR_MISALIGNED;
  return MOK_SUCCESS;
}

template <int EPI, int STAGES, int TMA_STORE>
static cudaError_t gw_launch(const gw_kernel_params_t *kp, const CUtensorMap *ma,
                             const CUtensorMap *mb, const CUtensorMap *mc, int grid,
                             cudaStream_t stream) {
  const int bytes = tp_plan<GW_BM, GW_BN, STAGES, TMA_STORE ? GW_C_BYTES : 0>::ALLOC_BYTES;
  void (*kernel)(gw_kernel_params_t, CUtensorMap, CUtensorMap, CUtensorMap) =
      gw_bf16_kernel<EPI, STAGES, TMA_STORE>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(MOK_TP_THREADS, 1, 1);
  cfg.dynamicSmemBytes = bytes;
  cfg.stream = stream;
  err = cudaLaunchKernelEx(&cfg, kernel, *kp, *ma, *mb, *mc);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

extern "C" mokResult_t mok_grouped_wgrad_launch(const mok_grouped_wgrad_params_t *p,
                                                void *stream) {
  mokResult_t res = gw_validate(p);
  if (res != MOK_SUCCESS) return res;
  // No rows: every group is empty. Accumulating adds nothing; the store epilogues still write
  // zeros into every C[g] (through the kernel, so the call stays asynchronous).
  if (p->m_total == 0 && p->epilogue == MOK_GG_EPI_ACCUM_F32) return MOK_SUCCESS;

  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return MOK_ERROR_NO_DEVICE;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return MOK_ERROR_NO_DEVICE;

  gw_kernel_params_t kp;
  kp.offsets = p->offsets;
  kp.offsets_int64 = p->offsets_int64;
  kp.num_groups = (int)p->num_groups;
  kp.m_total = p->m_total;
  kp.n = (int)p->n;
  kp.k = (int)p->k;
  kp.m_tiles = (int)((p->n + GW_BM - 1) / GW_BM);
  kp.n_tiles = (int)((p->k + GW_BN - 1) / GW_BN);
  kp.c = p->c;
  const int64_t tiles = (int64_t)kp.num_groups * kp.m_tiles * kp.n_tiles;
  int grid = p->num_sms > 0 && p->num_sms < sms ? p->num_sms : sms;
  if (grid > tiles) grid = (int)tiles;

  // Maps over [max(M_total, 1), cols]: with M_total = 0 no tile loads anything, but the encoder
  // needs a non-empty tensor.
  const uint64_t rows = p->m_total > 0 ? (uint64_t)p->m_total : 1;
  const int staged = p->epilogue != MOK_GG_EPI_ACCUM_F32;  // the configuration table below
  const int bf16_out = p->epilogue == MOK_GG_EPI_STORE_BF16;
  const uint64_t c_rows = (uint64_t)(p->num_groups * p->n);
  CUtensorMap ma, mb, mc;
  if (tma_encode_bf16_sw128(&ma, p->a, rows, (uint64_t)p->n, GW_BK) ||
      tma_encode_bf16_sw128(&mb, p->b, rows, (uint64_t)p->k, GW_BK) ||
      (staged && (bf16_out ? tma_encode_bf16_sw128(&mc, p->c, c_rows, (uint64_t)p->k, 64)
                           : tma_encode_f32_sw128(&mc, p->c, c_rows, (uint64_t)p->k, 64))))
    return MOK_ERROR_CUDA;
  if (!staged) mc = ma;  // unused

  cudaStream_t s = (cudaStream_t)stream;
  const int S4 = GW_STAGES_DIRECT, S3 = GW_STAGES_STAGED;
  cudaError_t err;
  switch (p->epilogue) {
    case MOK_GG_EPI_STORE_BF16:
      err = gw_launch<MOK_GG_EPI_STORE_BF16, S3, 1>(&kp, &ma, &mb, &mc, grid, s);
      break;
    case MOK_GG_EPI_STORE_F32:
      err = gw_launch<MOK_GG_EPI_STORE_F32, S3, 1>(&kp, &ma, &mb, &mc, grid, s);
      break;
    default:  // accumulation stays direct, as in grouped_gemm.cu (its NOTE)
      err = gw_launch<MOK_GG_EPI_ACCUM_F32, S4, 0>(&kp, &ma, &mb, &mc, grid, s);
      break;
  }
  return err == cudaSuccess ? MOK_SUCCESS : MOK_ERROR_CUDA;
}

extern "C" mokResult_t mok_gw_preload(void) {
  cudaFuncAttributes a;
  const cudaError_t e[] = {
      cudaFuncGetAttributes(&a, gw_bf16_kernel<MOK_GG_EPI_STORE_BF16, GW_STAGES_STAGED, 1>),
      cudaFuncGetAttributes(&a, gw_bf16_kernel<MOK_GG_EPI_STORE_F32, GW_STAGES_STAGED, 1>),
      cudaFuncGetAttributes(&a, gw_bf16_kernel<MOK_GG_EPI_ACCUM_F32, GW_STAGES_DIRECT, 0>)};
  for (cudaError_t x : e)
    if (x != cudaSuccess) {
      cudaGetLastError();
      return MOK_ERROR_CUDA;
    }
  return MOK_SUCCESS;
}

extern "C" int mok_gw_fault_take(mok_kernel_fault_t *out) { return ptx_fault_take(out); }
