/*
 * grouped_gemm.cu: the standalone persistent grouped GEMM (tests and benchmarks) and its C launcher.
 *
 *   C[rows of g, :] = epilogue( A[rows of g, :] · B[g]ᵀ )   for g in [0, G)
 *   A [M_total, K] bf16, rows of g = [offsets[g], offsets[g+1])
 *   B [G, N, K] bf16 (K-major, PyTorch Linear layout) or [G, K, N] (N-major, backward)
 *
 * One CTA per SM, 384 threads: warpgroup 0 produces (TMA into the ring of tile/pipeline.cuh),
 * warpgroups 1 and 2 consume (wgmma) and run the epilogue (tile/epilogue.cuh). Tiles are BM x BN
 * = 128 x 256 (128 x 128 output columns for SwiGLU, whose B tile holds 128 gate and 128 up rows).
 * Group sizes are read from device memory by every CTA (tile/scheduler.cuh); the host never
 * synchronizes.
 *
 * Two configurations, fixed by the epilogue (gg_cfg; one dispatch table in
 * mok_grouped_gemm_launch):
 *   staged (bf16 outputs, SwiGLU, fp32 stores): 3 stages + 64 KB of output staging, TMA bulk
 *          stores that drain while the next tile's MMA runs (fp32: two rounds of 32 KB per
 *          warpgroup); partial row tiles fall back to stores from registers;
 *   direct (fp32 accumulation): 4 stages, stores from registers.
 * Measured on an H200 in docs/performance.md ("Grouped GEMM").
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/tile/epilogue.cuh"
#include "cuda/gemm/gemm.h"
#include "cuda/ptx/ptx.cuh"
#include "cuda/tile/barriers.cuh"
#include "cuda/tile/pipeline.cuh"
#include "cuda/tile/scheduler.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/quant/quantize.cuh"

enum { GG_BM = 128, GG_BN = 256, GG_BK_BF16 = 64 };

// The configuration of an epilogue:
//   direct (fp32 accumulation): 4 stages, the epilogue stores from registers; staged through TMA's
//           reduce-add it was slower (below, at the launcher);
//   staged (every other epilogue), 3 stages + 64 KB of output staging: each consumer warpgroup
//           stages its whole [64, 256] bf16 piece (fp32: in two rounds of 128 columns) and leaves
//           it to TMA bulk stores.
// NOTE: a consumer holds two stages at a time (the block it issues and the one still in flight),
// so 3 stages leave the producer 1 block of lookahead; still, on the H200 it beat 4 stages with
// 32 KB of staging on every case measured (0-14%): the wait between two store rounds costs more
// than the deeper ring gains (docs/performance.md, "Variants removed").
template <int EPI>
struct gg_cfg {
  static constexpr int TMA_STORE = EPI != MOK_GG_EPI_ACCUM_F32;
  static constexpr int STAGES = TMA_STORE ? 3 : 4;
  static constexpr int C_BYTES = TMA_STORE ? 2 * 64 * 256 * 2 : 0;
};

// Register split after setmaxnreg: 40 (producer) + 2 x 232 (consumers) per 3 x 128 threads, the
// 168 per thread the CTA is launched with: the warpgroups only trade those (a split beyond them
// leaves setmaxnreg.inc waiting forever; gemm/grouped_gemm_fp8.cuh). NOTE: ptxas (13.0) reports
// "Used 168 registers", the entry budget of __launch_bounds__(384, 1), but allocates the code
// after setmaxnreg.inc within its count and reports spills against that (the fp8 kernel's
// consumers reach R236 at 240; docs/performance.md, "ptxas: registers, traps and spills"); check -Xptxas -v after every change
// (make check-spills).
enum { GG_PRODUCER_REGS = 40, GG_CONSUMER_REGS = 232 };
static_assert(GG_PRODUCER_REGS + 2 * GG_CONSUMER_REGS <= 3 * 168, "the launch's registers");

typedef struct {
  const void *offsets;     // [G + 1] int32 or int64, device
  int offsets_int64;
  int num_groups;          // G
  int n;                   // output columns per group (SwiGLU: I)
  int k_blocks;            // ceil(K / 64), plus K2 / 64 with a second segment (N-major B)
  int k_split;             // K blocks of the first segment (= k_blocks without a second)
  int n_tiles;             // column tiles per group
  int group_m;             // row units per band of the tile order (tile/scheduler.cuh)
  int bn_out;              // output columns per tile: 256, or 128 for SwiGLU
  int64_t m_total;
  void *c;                 // [M_total, N] bf16 or fp32
  const float *row_scale;  // [M_total] (SwiGLU)
  void *g_out, *u_out;     // [M_total, N] bf16 (SwiGLU, optional)
  const float *a_scale;    // fp8-block: [M_total, K/128], or [K/128, a_scale_ld]
  const float *b_scale;    // fp8-block: [G, N/128, K/128]
  const float *b2_scale;   // fp8-block: up's (SwiGLU) or the second segment's [G, N/128, K2/128]
  int64_t a_scale_ld;      // fp8-block: 0, or the row stride of K-block-major a_scale
  const uint8_t *b_e8m0;   // MXFP8 B: [G N, K/32] E8M0
  const uint8_t *b2_e8m0;  // MXFP8 B: up's [G N, K/32] (SwiGLU) or B2's [G N, K2/32]
  int64_t b_rows;          // MXFP8 B: G N, the rows of B (and B2)
  int kq1, kq2;            // MXFP8 B: scale bytes per row of B (K/32) and of B2 (K2/32)
  uint8_t *c_q;            // fp8-block SwiGLU, quantized a: [M_total, N] e4m3 (c not written)
  float *c_q_scale;        // its 1x128 blocks' scales, [N/128, c_q_ld]
  int64_t c_q_ld;
  mok_quant_scale_t c_q_kind;
} gg_kernel_params_t;

// How the consumers learn their tiles: the producer thread walks the order (gg_sched_next) and
// posts each tile in a slot beside the ring stage that starts it (tp_produce_tile's tags), before
// the arrival that the consumers' wait acquires; the slot is not reused before all consumer warps
// have released that stage. A stage whose tag has group -1 and no data is the end.
// Walking the order themselves, as they did before, the consumers paid its cost at the start of
// every tile, on the tensor cores' critical path: a new group's offsets from global memory and a
// 64-bit division, which at these shapes is nearly every tile (a group has about one wave of
// units). With the tags the fp8 GEMM ran 3-7% faster at the benchmark shapes and bf16 0.1-4%
// (docs/performance.md, "Grouped GEMM: tiles posted beside their stage").
__device__ __forceinline__ int4 gg_tag(const gg_tile_t &t) {
  return make_int4(t.group, t.row0, t.row_end, t.n0);
}

// Producer thread, after the last tile: the end, at the ring's position once that stage is free.
template <typename P>
__device__ __forceinline__ void gg_post_end(tp_ring_t *ring, uint64_t *full, uint64_t *empty) {
  ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
  tp_post_tag<P>(full, ring->stage, make_int4(-1, 0, 0, 0));
  ptx_mbar_arrive(&full[ring->stage]);
}

// The plan's tags, as a pointer the compiler knows is shared memory (indexed from smem_raw: LDS
// with 32-bit addresses).
template <typename P>
__device__ __forceinline__ const int4 *gg_tags(const uint8_t *smem_raw, const uint8_t *smem) {
  return (const int4 *)(smem_raw + (smem + P::TAGS_OFFSET - smem_raw));
}

// Consumer: waits for the stage at the ring's position and reads the tile posted with it (the
// stage is not consumed); 0 at the end.
// NOTE: a wait that times out (ptx.cuh: recorded in the fault word) reads as the end, so the
// consumers leave their loop; a trap here made ptxas spill the fp8 consumers' accumulators (~700
// bytes; docs/performance.md, "ptxas: registers, traps and spills").
// NOTE (racecheck): the tag is written (tp_post_tag) before the producer's mbarrier.arrive on the
// stage's full barrier and read here after the wait on it succeeded, which orders the two
// (release / acquire at CTA scope), as in the fused forward's fk_tag; compute-sanitizer's
// racecheck, which orders shared memory only by bar.sync, reports the pair as a hazard (the
// backward chain's GEMMs: its only reports in this kernel).
__device__ __forceinline__ int gg_peek(const tp_ring_t *ring, uint64_t *full, const int4 *tags,
                                       gg_tile_t *t) {
  if (!ptx_mbar_wait_bounded_at(ptx_smem_addr(&full[ring->stage]), ring->phase)) return 0;
  // NOTE: a plain load (the wait's asm is a compiler barrier for memory). Through a volatile
  // pointer, ptxas treated the rest of the loop as divergent and moved the wgmma descriptors into
  // uniform registers before every wgmma (SASS of the first version; docs/performance.md,
  // "ptxas: registers, traps and spills").
  const int4 v = tags[ring->stage];
  t->group = v.x;
  t->row0 = v.y;
  t->row_end = v.z;
  t->n0 = v.w;
  return v.x >= 0;
}

// Whether consumer warpgroup rows [wg_row0, wg_row0 + 64) of a tile, all past its group's end,
// may skip the tile's MMA (the consumer loops' `idle`: it only releases the stages, and the tile
// takes about half the time). Not when the tiles come in bands (group_m > 0): there the CTAs
// that share a B column block take consecutive units of the fixed order, and a CTA whose tile is
// cut short runs ahead of its band's partners onto other column blocks, which B streamed from
// HBM then pays for. Computing the unused rows instead (never stored) kept the CTAs in step and
// was faster wherever groups end in short row tiles: DeepSeek-V3 skewed gate/up 13.10 against
// 14.13 ms, SwiGLU 13.15 against 13.61, down 7.00 against 7.18; the same elsewhere
// (docs/performance.md, "Grouped GEMM: tile order and L2 bands").
__device__ __forceinline__ bool gg_skip_rows(const gg_kernel_params_t &p, int wg_row0,
                                             int row_end) {
  return p.group_m == 0 && wg_row0 >= row_end;
}

// Staged store of output columns [128 H, 128 H + 128) of a consumer warpgroup's tile (or of its
// 128 SwiGLU columns): tile/epilogue.cuh's epi_store_staged on named barrier MOK_BAR_GEMM_EPI + cw.
// WAIT = -1 when round H has a buffer of its own (the 64 KB staging area), so that only the first
// round waits for the previous tile's stores (WAIT = 0).
template <int EPI, int H, int WAIT>
__device__ __forceinline__ void gg_store_staged(const float (&acc)[128], uint8_t *stage_c,
                                                const CUtensorMap *tm_c, float2 w, int n0, int n,
                                                int wg_row0, int cw, int lt) {
  epi_store_staged<EPI == MOK_GG_EPI_SWIGLU ? 0 : 16 * H, EPI == MOK_GG_EPI_SWIGLU, WAIT>(
      acc, stage_c, tm_c, w, n0 + 128 * H, n, wg_row0, MOK_BAR_GEMM_EPI + cw, lt);
}

template <int EPI, int B_NMAJOR>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    gg_bf16_kernel(const __grid_constant__ gg_kernel_params_t p,
                   const __grid_constant__ CUtensorMap tm_a,   // A [M_total, K], box [128, 64]
                   const __grid_constant__ CUtensorMap tm_b,   // B [G*N, K], box [128, 64], or
                                                               // N-major [G*K, N], box [64, 64]
                   const __grid_constant__ CUtensorMap tm_b2,  // up [G*N, K] (SwiGLU), the
                                                               // second segment's [G*K2, N]
                                                               // (N-major), or = tm_b
                   const __grid_constant__ CUtensorMap tm_a2,  // the second segment's A, or = tm_a
                   const __grid_constant__ CUtensorMap tm_c)   // C [M_total, N] bf16, box [64, 64]
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int STAGES = gg_cfg<EPI>::STAGES, TMA_STORE = gg_cfg<EPI>::TMA_STORE;
  constexpr int C_BYTES = gg_cfg<EPI>::C_BYTES;
  typedef tp_plan<GG_BM, GG_BN, STAGES, C_BYTES> P;
  static_assert(!B_NMAJOR || EPI != MOK_GG_EPI_SWIGLU, "N-major B: plain GEMM");
  extern __shared__ uint8_t smem_raw[];
  uint64_t *full, *empty;
  uint8_t *smem = tp_kernel_start<P>(smem_raw, &full, &empty, &tm_a, &tm_b,
                                     EPI == MOK_GG_EPI_SWIGLU ? &tm_b2 : NULL,
                                     TMA_STORE ? &tm_c : NULL);
  const int wg = threadIdx.x / 128;

  gg_sched_t sched = gg_sched_init(p.offsets, p.offsets_int64, p.num_groups, p.m_total,
                                   p.n_tiles, p.group_m, GG_BM, p.bn_out);
  tp_ring_t ring = {0, 0};
  gg_tile_t tile;

  if (wg == 0) {
    // Producer warpgroup: one thread issues every copy; the others only give up registers.
    ptx_setmaxnreg_dec<GG_PRODUCER_REGS>();
    if (threadIdx.x == 0 && B_NMAJOR) {
      while (gg_sched_next(&sched, &tile)) {
        tp_b_nmajor_t b;
        b.map = &tm_b;
        b.k_row0 = tile.group * p.k_split * GG_BK_BF16;  // K % 64 == 0 for N-major B
        b.n0 = tile.n0;
        b.k_split = p.k_split;
        b.map_a2 = &tm_a2;
        b.map2 = &tm_b2;
        b.k_row2 = tile.group * (p.k_blocks - p.k_split) * GG_BK_BF16;
        tp_produce_tile_bn<GG_BM, GG_BN, STAGES, C_BYTES>(&ring, smem, full, empty, &tm_a,
                                                          tile.row0, b, p.k_blocks, gg_tag(tile));
      }
      gg_post_end<P>(&ring, full, empty);
    } else if (threadIdx.x == 0) {
      while (gg_sched_next(&sched, &tile)) {
        tp_b_source_t b;
        b.map_lo = &tm_b;
        b.row_lo = tile.group * p.n + tile.n0;
        if (EPI == MOK_GG_EPI_SWIGLU) {
          b.map_hi = &tm_b2;  // up rows of the same columns
          b.row_hi = b.row_lo;
        } else {
          b.map_hi = &tm_b;
          b.row_hi = b.row_lo + 128;
        }
        tp_produce_tile<GG_BM, GG_BN, STAGES, C_BYTES>(&ring, smem, full, empty, &tm_a, tile.row0,
                                                       b, p.k_blocks, GG_BK_BF16, gg_tag(tile));
      }
      gg_post_end<P>(&ring, full, empty);
    }
  } else {
    ptx_setmaxnreg_inc<GG_CONSUMER_REGS>();
    const int cw = wg - 1;              // consumer warpgroup: rows [64 cw, 64 cw + 64) of the tile
    const int lt = threadIdx.x & 127;   // thread within the warpgroup
    uint8_t *stage_c = smem + P::C_OFFSET + cw * (C_BYTES / 2);  // [2 or 4][64][128 B]
    float acc[128];                     // [64, 256] fragment of this warpgroup
    const int4 *tags = gg_tags<P>(smem_raw, smem);
    while (gg_peek(&ring, full, tags, &tile)) {
      epi_coords_t e = epi_coords(tile.row0, tile.row_end, tile.n0, p.n, p.n, cw);
      float2 w = make_float2(1.0f, 1.0f);
      if (EPI == MOK_GG_EPI_SWIGLU) w = epi_row_scales(p.row_scale, e);
      const int wg_row0 = tile.row0 + 64 * cw;
      tp_consume_tile_bf16_n256<GG_BM, STAGES, C_BYTES, B_NMAJOR>(
          &ring, smem, full, empty, p.k_blocks, cw, gg_skip_rows(p, wg_row0, tile.row_end), acc);
      // SwiGLU with bf16 g, u outputs too stores everything from registers (3 outputs per tile).
      const bool staged = TMA_STORE && wg_row0 + 64 <= tile.row_end &&
                          (EPI != MOK_GG_EPI_SWIGLU || (!p.g_out && !p.u_out));
      if (staged) {
        if (EPI == MOK_GG_EPI_STORE_F32) {  // two rounds of 32 KB through the same buffer
          epi_store_staged_f32<0>(acc, stage_c, &tm_c, tile.n0, p.n, wg_row0, MOK_BAR_GEMM_EPI + cw, lt);
          epi_store_staged_f32<1>(acc, stage_c, &tm_c, tile.n0, p.n, wg_row0, MOK_BAR_GEMM_EPI + cw, lt);
        } else if (EPI == MOK_GG_EPI_SWIGLU) {
          gg_store_staged<EPI, 0, 0>(acc, stage_c, &tm_c, w, tile.n0, p.n, wg_row0, cw, lt);
        } else {  // 256 columns: two rounds of 128
          gg_store_staged<EPI, 0, 0>(acc, stage_c, &tm_c, w, tile.n0, p.n, wg_row0, cw, lt);
          gg_store_staged<EPI, 1, -1>(acc, stage_c + 16384, &tm_c, w, tile.n0, p.n, wg_row0, cw,
                                      lt);
        }
      } else if (EPI == MOK_GG_EPI_STORE_BF16) {
        epi_store_bf16<128>(acc, (__nv_bfloat16 *)p.c, e);
      } else if (EPI == MOK_GG_EPI_STORE_F32) {
        epi_store_f32<128, false>(acc, (float *)p.c, e);
      } else if (EPI == MOK_GG_EPI_ACCUM_F32) {
        epi_store_f32<128, true>(acc, (float *)p.c, e);
      } else {
        epi_store_swiglu<128>(acc, (__nv_bfloat16 *)p.c, (__nv_bfloat16 *)p.g_out,
                              (__nv_bfloat16 *)p.u_out, w, e);
      }
    }
    if (TMA_STORE && lt == 0) ptx_bulk_wait_group_all();  // stores done before the CTA retires
  }
#endif
}

// The tensor maps of a bf16 or MXFP8-B kernel, and its launch (`bytes` of dynamic shared memory).
typedef struct {
  CUtensorMap a, b, b2, a2, c;
} gg_maps_t;

static cudaError_t gg_launch(void (*kernel)(gg_kernel_params_t, CUtensorMap, CUtensorMap,
                                            CUtensorMap, CUtensorMap, CUtensorMap),
                             int bytes, const gg_kernel_params_t *kp, const gg_maps_t *m, int grid,
                             cudaStream_t stream) {
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.blockDim = dim3(MOK_TP_THREADS, 1, 1);
  cfg.dynamicSmemBytes = bytes;
  cfg.stream = stream;
  cfg.gridDim = dim3(grid, 1, 1);
  err = cudaLaunchKernelEx(&cfg, kernel, *kp, m->a, m->b, m->b2, m->a2, m->c);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

#include "cuda/gemm/grouped_gemm_fp8.cuh"
#include "cuda/gemm/grouped_gemm_mx.cuh"

/* ---------------------------------------------------------------------------------------------- */
/* Launcher                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static int gg_aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

static mokResult_t gg_validate(const mok_grouped_gemm_params_t *p) {
  if (!p) return MOK_ERROR_NULL_POINTER;
  if (!p->a || !p->b || (!p->c && !p->c_q) || !p->offsets) return MOK_ERROR_NULL_POINTER;
  if (p->c_q) {  // quantized a: fp8-block SwiGLU with its activation scales K-block major
    if (p->dtype != MOK_GG_FP8_BLOCK || p->epilogue != MOK_GG_EPI_SWIGLU)
      return MOK_ERROR_NOT_IMPLEMENTED;
    if (!p->c_q_scale) return MOK_ERROR_NULL_POINTER;
    if (p->a_scale_ld == 0 || (p->c_q_kind != MOK_QUANT_FP32_SCALE &&
                               p->c_q_kind != MOK_QUANT_POW2_SCALE))
      return MOK_ERROR_INVALID_VALUE;
    if (p->c_q_ld < p->m_total) return MOK_ERROR_INVALID_SHAPE;
    if (!gg_aligned16(p->c_q) || ((uintptr_t)p->c_q_scale & 3u)) return MOK_ERROR_MISALIGNED;
  }
  if (p->dtype != MOK_GG_BF16 && p->dtype != MOK_GG_FP8_BLOCK && p->dtype != MOK_GG_MXFP8_B)
    return MOK_ERROR_INVALID_VALUE;
  if (p->b_layout != MOK_GG_B_KMAJOR && p->b_layout != MOK_GG_B_NMAJOR)
    return MOK_ERROR_INVALID_VALUE;
  if ((int)p->epilogue < 0 || p->epilogue > MOK_GG_EPI_SWIGLU) return MOK_ERROR_INVALID_VALUE;
  if (p->offsets_int64 != 0 && p->offsets_int64 != 1) return MOK_ERROR_INVALID_VALUE;
  if (p->num_sms < 0 || p->group_m < -1) return MOK_ERROR_INVALID_VALUE;
  if (p->num_groups < 1 || p->num_groups > MOK_GG_MAX_GROUPS) return MOK_ERROR_INVALID_SHAPE;
  if (p->m_total < 0 || p->n < 1 || p->k < 1) return MOK_ERROR_INVALID_SHAPE;
  if (p->k % 8 != 0 || p->n % 8 != 0) return MOK_ERROR_INVALID_SHAPE;  // 16-byte row strides
  // int32 tile indices and TMA coordinates
  if (p->m_total >= ((int64_t)1 << 31) || p->k >= ((int64_t)1 << 31) ||
      p->num_groups * p->n >= ((int64_t)1 << 31))
    return MOK_ERROR_INVALID_SHAPE;
  const int64_t n_tiles = (p->n + 255) / 256 * 2;  // SwiGLU's count bounds the plain one
  if ((p->m_total / GG_BM + p->num_groups) * n_tiles >= ((int64_t)1 << 31))
    return MOK_ERROR_INVALID_SHAPE;
  if (p->epilogue == MOK_GG_EPI_SWIGLU && !p->b2) return MOK_ERROR_NULL_POINTER;
  if (!gg_aligned16(p->a) || !gg_aligned16(p->b) || !gg_aligned16(p->c) ||
      (p->b2 && !gg_aligned16(p->b2)) || (p->g_out && !gg_aligned16(p->g_out)) ||
      (p->u_out && !gg_aligned16(p->u_out)) ||
      ((uintptr_t)p->offsets & (p->offsets_int64 ? 7u : 3u)) || ((uintptr_t)p->row_scale & 3u))
    return MOK_ERROR_MISALIGNED;
  if (p->b_layout == MOK_GG_B_NMAJOR) {
    if (p->k % 64 != 0) return MOK_ERROR_INVALID_SHAPE;  // a K block never spans two groups
    if (p->num_groups * p->k >= ((int64_t)1 << 31)) return MOK_ERROR_INVALID_SHAPE;
    if (p->epilogue == MOK_GG_EPI_SWIGLU) return MOK_ERROR_NOT_IMPLEMENTED;
  }
  if (p->k2 != 0) {  // a second reduction segment: N-major bf16, or fp8-block (K-major)
    if (p->dtype == MOK_GG_BF16 && p->b_layout != MOK_GG_B_NMAJOR) return MOK_ERROR_NOT_IMPLEMENTED;
    if (p->dtype != MOK_GG_BF16 && p->epilogue != MOK_GG_EPI_STORE_BF16 &&
        p->epilogue != MOK_GG_EPI_STORE_F32)
      return MOK_ERROR_NOT_IMPLEMENTED;
    if (!p->a2 || !p->b2) return MOK_ERROR_NULL_POINTER;
    if (p->k2 < 0 || p->k2 % 64 != 0 || p->k2 >= ((int64_t)1 << 31) ||
        p->num_groups * p->k2 >= ((int64_t)1 << 31))
      return MOK_ERROR_INVALID_SHAPE;
    if (!gg_aligned16(p->a2)) return MOK_ERROR_MISALIGNED;
  }
  if (p->dtype == MOK_GG_FP8_BLOCK) {
    if (!p->a_scale || !p->b_scale) return MOK_ERROR_NULL_POINTER;
    if ((p->epilogue == MOK_GG_EPI_SWIGLU || p->k2 != 0) && !p->b2_scale)
      return MOK_ERROR_NULL_POINTER;
    if (((uintptr_t)p->a_scale & 3u) || ((uintptr_t)p->b_scale & 3u) ||
        ((uintptr_t)p->b2_scale & 3u))
      return MOK_ERROR_MISALIGNED;
    if (p->a_scale_ld != 0) {  // K-block major: TMA rows of 16-byte multiples
      if (p->a_scale_ld < p->m_total || p->a_scale_ld % 4 != 0 ||
          p->a_scale_ld >= ((int64_t)1 << 31))
        return MOK_ERROR_INVALID_SHAPE;
      if ((uintptr_t)p->a_scale & 15u) return MOK_ERROR_MISALIGNED;
    } else if (p->k2 != 0) {
      return MOK_ERROR_INVALID_VALUE;  // both segments' scales: one K-block-major array
    }
    if (p->k % 128 != 0 || p->n % 128 != 0 || p->k2 % 128 != 0)
      return MOK_ERROR_INVALID_SHAPE;  // scale blocks
    if (p->b_layout != MOK_GG_B_KMAJOR) return MOK_ERROR_NOT_IMPLEMENTED;  // fp8 wgmma: K-major
  }
  if (p->dtype == MOK_GG_MXFP8_B) {
    if (!p->b_e8m0 || ((p->epilogue == MOK_GG_EPI_SWIGLU || p->k2 != 0) && !p->b2_e8m0))
      return MOK_ERROR_NULL_POINTER;
    if (p->k % 64 != 0) return MOK_ERROR_INVALID_SHAPE;  // two scale blocks per stage
    if (p->b_layout != MOK_GG_B_KMAJOR || p->epilogue == MOK_GG_EPI_ACCUM_F32)
      return MOK_ERROR_NOT_IMPLEMENTED;
  }
  return MOK_SUCCESS;
}

template <int EPI, int B_NMAJOR>
static cudaError_t gg_launch_bf16(const gg_kernel_params_t *kp, const gg_maps_t *m, int grid,
                                  cudaStream_t stream) {
  typedef tp_plan<GG_BM, GG_BN, gg_cfg<EPI>::STAGES, gg_cfg<EPI>::C_BYTES> P;
  return gg_launch(gg_bf16_kernel<EPI, B_NMAJOR>, P::ALLOC_BYTES + P::TAGS_BYTES, kp, m, grid,
                   stream);
}

extern "C" int mok_tile_group_m(int requested, int64_t b_bytes) {
  if (requested != 0) return requested > 0 ? requested : 0;
  int device = 0, l2 = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  // NOTE: from a sixth of the L2 (10.5 MB on the H200, which reports 60 MiB). Timed with each
  // kernel at the clock its own power draw allows (bench/gemm.py's blocked timing), Qwen3-235B's
  // 25.2 MB (gate/up) and 12.6 MB (down) ran 4% faster in bands (ncu: 5.3 GB read from HBM
  // against 8.7 for gate/up), and its fused forward 1%; interleaved with other kernels, which
  // lends them clock, the bands had measured even or up to 1% slower, hence the former rule of
  // 0.45 of the L2. Qwen3-30B's 6.3 MB gained nothing (docs/performance.md, "Grouped GEMM: tile
  // order and L2 bands").
  return b_bytes * 6 > (int64_t)l2 ? 8 : 0;
}

extern "C" mokResult_t mok_grouped_gemm_launch(const mok_grouped_gemm_params_t *p, void *stream) {
  mokResult_t res = gg_validate(p);
  if (res != MOK_SUCCESS) return res;
  if (p->m_total == 0) return MOK_SUCCESS;  // no rows: nothing to read or write

  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return MOK_ERROR_NO_DEVICE;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return MOK_ERROR_NO_DEVICE;
  const int grid = p->num_sms > 0 && p->num_sms < sms ? p->num_sms : sms;

  const int swiglu = p->epilogue == MOK_GG_EPI_SWIGLU;
  gg_kernel_params_t kp;
  memset(&kp, 0, sizeof(kp));
  kp.offsets = p->offsets;
  kp.offsets_int64 = p->offsets_int64;
  kp.num_groups = (int)p->num_groups;
  kp.n = (int)p->n;
  kp.k_split = (int)((p->k + GG_BK_BF16 - 1) / GG_BK_BF16);
  kp.k_blocks = kp.k_split + (int)(p->k2 / GG_BK_BF16);
  kp.bn_out = swiglu ? 128 : 256;
  kp.n_tiles = (int)((p->n + kp.bn_out - 1) / kp.bn_out);
  kp.m_total = p->m_total;
  kp.c = p->c;
  kp.row_scale = p->row_scale;
  kp.g_out = swiglu ? p->g_out : NULL;
  kp.u_out = swiglu ? p->u_out : NULL;
  // one group's B: N x K elements (SwiGLU: gate and up, N each)
  kp.group_m = mok_tile_group_m(p->group_m, (swiglu ? 2 : 1) * p->n * p->k *
                                                 (p->dtype == MOK_GG_BF16 ? 2 : 1));

  kp.a_scale = p->a_scale;
  kp.a_scale_ld = p->a_scale_ld;
  kp.b_scale = p->b_scale;
  cudaStream_t s = (cudaStream_t)stream;
  kp.b2_scale = p->b2_scale;
  if (p->dtype == MOK_GG_FP8_BLOCK) {
    const int segments = p->k2 > 0;
    kp.k_split = (int)(p->k / GG8_BK);
    kp.k_blocks = kp.k_split + (int)(p->k2 / GG8_BK);
    kp.bn_out = swiglu ? 64 : GG8_BN;  // SwiGLU: 64 gate and 64 up rows per B tile
    if (p->c_q) {  // quantized a: pairs of SwiGLU tiles, 128 output columns (a scale block)
      kp.bn_out = 128;
      kp.c_q = (uint8_t *)p->c_q, kp.c_q_scale = p->c_q_scale, kp.c_q_ld = p->c_q_ld;
      kp.c_q_kind = p->c_q_kind;
    }
    kp.n_tiles = (int)(p->n / kp.bn_out);
    gg8_maps_t m;
    const uint64_t rows_b = (uint64_t)(p->num_groups * p->n);
    const uint32_t box_b = swiglu ? 64 : 128;
    if (tma_encode_e4m3_sw128(&m.a, p->a, (uint64_t)p->m_total, (uint64_t)p->k, GG8_BM) ||
        tma_encode_e4m3_sw128(&m.b, p->b, rows_b, (uint64_t)p->k, box_b))
      return MOK_ERROR_CUDA;
    m.c = m.s = m.a2 = m.b2 = m.a;  // unused unless bf16 output, K-block major a_scale, ...
    if (p->epilogue == MOK_GG_EPI_STORE_BF16 &&
        tma_encode_bf16_sw128(&m.c, p->c, (uint64_t)p->m_total, (uint64_t)p->n, 64))
      return MOK_ERROR_CUDA;
    if (swiglu && tma_encode_e4m3_sw128(&m.b2, p->b2, rows_b, (uint64_t)p->k, box_b))
      return MOK_ERROR_CUDA;
    if (segments &&
        (tma_encode_e4m3_sw128(&m.a2, p->a2, (uint64_t)p->m_total, (uint64_t)p->k2, GG8_BM) ||
         tma_encode_e4m3_sw128(&m.b2, p->b2, rows_b, (uint64_t)p->k2, 128)))
      return MOK_ERROR_CUDA;
    const int smem_a = p->a_scale_ld != 0;
    if (smem_a && tma_encode_f32_rows(&m.s, p->a_scale, (uint64_t)kp.k_blocks,
                                      (uint64_t)p->a_scale_ld,
                                      (uint32_t)(p->a_scale_ld < GG8_SCALE_BOX ? p->a_scale_ld
                                                                               : GG8_SCALE_BOX)))
      return MOK_ERROR_CUDA;
#define GG8_LAUNCH(EPI) gg_launch_fp8_config<EPI>(&kp, &m, smem_a, segments, grid, s)
    cudaError_t err = p->epilogue == MOK_GG_EPI_STORE_BF16 ? GG8_LAUNCH(MOK_GG_EPI_STORE_BF16)
                      : p->epilogue == MOK_GG_EPI_STORE_F32 ? GG8_LAUNCH(MOK_GG_EPI_STORE_F32)
                      : p->epilogue == MOK_GG_EPI_SWIGLU    ? GG8_LAUNCH(MOK_GG_EPI_SWIGLU)
                                                            : GG8_LAUNCH(MOK_GG_EPI_ACCUM_F32);
#undef GG8_LAUNCH
    return err == cudaSuccess ? MOK_SUCCESS : MOK_ERROR_CUDA;
  }

  if (p->dtype == MOK_GG_MXFP8_B) return gg_run_mx(p, &kp, grid, s);

  gg_maps_t m;
  const uint64_t rows_b = (uint64_t)(p->num_groups * p->n);
  const int bf16_out = p->epilogue == MOK_GG_EPI_STORE_BF16 || swiglu;
  const int nmajor = p->b_layout == MOK_GG_B_NMAJOR, second = p->k2 > 0;
  if (tma_encode_bf16_sw128(&m.a, p->a, (uint64_t)p->m_total, (uint64_t)p->k, GG_BM) ||
      (nmajor ? tma_encode_bf16_sw128(&m.b, p->b, (uint64_t)(p->num_groups * p->k),
                                      (uint64_t)p->n, 64)
              : tma_encode_bf16_sw128(&m.b, p->b, rows_b, (uint64_t)p->k, 128)) ||
      (bf16_out && tma_encode_bf16_sw128(&m.c, p->c, (uint64_t)p->m_total, (uint64_t)p->n, 64)) ||
      (p->epilogue == MOK_GG_EPI_STORE_F32 &&
       tma_encode_f32_sw128(&m.c, p->c, (uint64_t)p->m_total, (uint64_t)p->n, 64)))
    return MOK_ERROR_CUDA;
  if (second) {  // N-major: the second segment's A [m_total, K2] and B [G K2, N]
    if (tma_encode_bf16_sw128(&m.a2, p->a2, (uint64_t)p->m_total, (uint64_t)p->k2, GG_BM) ||
        tma_encode_bf16_sw128(&m.b2, p->b2, (uint64_t)(p->num_groups * p->k2), (uint64_t)p->n,
                              64))
      return MOK_ERROR_CUDA;
  } else {
    m.a2 = m.a;  // unused
    if (tma_encode_bf16_sw128(&m.b2, swiglu ? p->b2 : p->b, rows_b, (uint64_t)p->k, 128))
      return MOK_ERROR_CUDA;
  }
  if (p->epilogue == MOK_GG_EPI_ACCUM_F32) m.c = m.a;  // unused: accumulation stores directly

  // The dispatch table: the epilogue and B's layout (gg_cfg fixes the rest).
#define GG_LAUNCH(EPI) (nmajor ? gg_launch_bf16<EPI, 1>(&kp, &m, grid, s) \
                               : gg_launch_bf16<EPI, 0>(&kp, &m, grid, s))
  cudaError_t err;
  switch (p->epilogue) {
    case MOK_GG_EPI_STORE_BF16: err = GG_LAUNCH(MOK_GG_EPI_STORE_BF16); break;
    case MOK_GG_EPI_STORE_F32: err = GG_LAUNCH(MOK_GG_EPI_STORE_F32); break;
    case MOK_GG_EPI_ACCUM_F32:
      // NOTE: staged through TMA's reduce-add (c += acc by the memory system, the same bits),
      // the backward's dx accumulation at DeepSeek-V3 took 12.06 ms against 10.92 from registers
      // (at Qwen3-235B 4.44 against 4.74; docs/performance.md, "Grouped GEMM: epilogues"): it
      // stays direct.
      err = GG_LAUNCH(MOK_GG_EPI_ACCUM_F32);
      break;
    default:  // SwiGLU (K-major B only: validated)
      err = gg_launch_bf16<MOK_GG_EPI_SWIGLU, 0>(&kp, &m, grid, s);
      break;
  }
#undef GG_LAUNCH
  return err == cudaSuccess ? MOK_SUCCESS : MOK_ERROR_CUDA;
}

extern "C" mokResult_t mok_gg_preload(void) {
  cudaFuncAttributes a;
  const cudaError_t e[] = {
      cudaFuncGetAttributes(&a, gg_bf16_kernel<MOK_GG_EPI_SWIGLU, 0>),
      cudaFuncGetAttributes(&a, gg_bf16_kernel<MOK_GG_EPI_STORE_BF16, 0>),
      cudaFuncGetAttributes(&a, gg_bf16_kernel<MOK_GG_EPI_STORE_BF16, 1>),
      cudaFuncGetAttributes(&a, gg_bf16_kernel<MOK_GG_EPI_STORE_F32, 0>),
      cudaFuncGetAttributes(&a, gg_bf16_kernel<MOK_GG_EPI_STORE_F32, 1>),
      cudaFuncGetAttributes(&a, gg_bf16_kernel<MOK_GG_EPI_ACCUM_F32, 0>),
      cudaFuncGetAttributes(&a, gg_bf16_kernel<MOK_GG_EPI_ACCUM_F32, 1>),
      // the fp8-block layers' (K-block-major activation scales)
      cudaFuncGetAttributes(&a, gg_fp8_kernel<MOK_GG_EPI_SWIGLU, 5, 1, TP_FP8_B_HALVES>),
      cudaFuncGetAttributes(&a, gg_fp8_kernel<MOK_GG_EPI_SWIGLU, 5, 1, TP_FP8_B_HALVES, 1>),
      cudaFuncGetAttributes(&a, gg_fp8_kernel<MOK_GG_EPI_STORE_BF16, 5, 1, TP_FP8_B_ONE>),
      cudaFuncGetAttributes(&a, gg_fp8_kernel<MOK_GG_EPI_STORE_F32, 5, 1, TP_FP8_B_ONE>),
      cudaFuncGetAttributes(&a, gg_fp8_kernel<MOK_GG_EPI_STORE_BF16, 5, 1, TP_FP8_B_SEGMENTS>),
      cudaFuncGetAttributes(&a, gg_fp8_kernel<MOK_GG_EPI_STORE_F32, 5, 1, TP_FP8_B_SEGMENTS>),
      // the MXFP8 layers'
      cudaFuncGetAttributes(&a, gg_mx_kernel<MOK_GG_EPI_SWIGLU>),
      cudaFuncGetAttributes(&a, gg_mx_kernel<MOK_GG_EPI_STORE_BF16>),
      cudaFuncGetAttributes(&a, gg_mx_kernel<MOK_GG_EPI_STORE_F32>)};
  for (cudaError_t x : e)
    if (x != cudaSuccess) {
      cudaGetLastError();
      return MOK_ERROR_CUDA;
    }
  return MOK_SUCCESS;
}

extern "C" int mok_gg_fault_take(mok_kernel_fault_t *out) { return ptx_fault_take(out); }
