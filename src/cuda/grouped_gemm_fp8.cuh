/*
 * grouped_gemm_fp8.cuh: the fp8-block grouped GEMM kernel (DeepSeek-V3 recipe), included by
 * grouped_gemm.cu, whose launcher validates and dispatches to it.
 *
 *   C[rows of g, :] = epilogue( Σ_kb (A_kb · B[g]_kbᵀ) · a_scale[r, kb] · b_scale[g, n/128, kb] )
 *   A       [M_total, K] e4m3        a_scale [M_total, K/128] fp32 (1x128 blocks)
 *   B       [G, N, K] e4m3 (K-major) b_scale [G, N/128, K/128] fp32 (128x128 blocks)
 *   K % 128 == 0, N % 128 == 0 (scale blocks never straddle a tile)
 *
 * Same CTA shape as the bf16 kernel (1 producer + 2 consumer warpgroups, persistent, tiles from
 * tile_scheduler.cuh), with 128 x 128 tiles: the promotion keeps the stage's partial sums apart
 * from the fp32 total, in two sets so that the next stage's wgmmas run while one is promoted
 * (3 x 64 registers per thread; with N = 256 they would not fit). A stage holds 128 reduction
 * elements (128 bytes per row: the 128-byte swizzle span).
 */
#ifndef MOK_CUDA_GROUPED_GEMM_FP8_CUH
#define MOK_CUDA_GROUPED_GEMM_FP8_CUH

enum { GG8_BM = 128, GG8_BN = 128, GG8_BK = 128, GG8_STAGES = 6, GG8_C_BYTES = 2 * 64 * 128 * 2 };
// Register split: the consumers hold two `part` sets and the fp32 total (192 registers) in the
// mainloop (tile_pipeline.cuh), so they take 240 and the producer warpgroup (one thread issuing
// TMA) keeps 24. ptxas gives the code after setmaxnreg.inc the larger budget; keep it spill-free.
// NOTE: the warpgroups trade registers within what the CTA was launched with (168 per thread,
// __launch_bounds__(384, 1)), not the whole register file: with 32 + 2 x 240 the consumers'
// setmaxnreg.inc waited forever for registers nobody had freed, and the producer's bounded wait
// trapped (bench/NOTES.md v14).
enum { GG8_PRODUCER_REGS = 24, GG8_CONSUMER_REGS = 240 };
static_assert(GG8_PRODUCER_REGS + 2 * GG8_CONSUMER_REGS <= 3 * 168, "the launch's registers");

template <int EPI>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    gg_fp8_kernel(const __grid_constant__ gg_kernel_params_t p,
                  const __grid_constant__ CUtensorMap tm_a,  // A [M_total, K] e4m3, box [128, 128]
                  const __grid_constant__ CUtensorMap tm_b,  // B [G*N, K] e4m3, box [128, 128]
                  const __grid_constant__ CUtensorMap tm_c)  // C [M_total, N] bf16, box [64, 64]
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int STAGED = EPI == MOK_GG_EPI_STORE_BF16;
  constexpr int C_BYTES = STAGED ? GG8_C_BYTES : 0;
  typedef tp_plan<GG8_BM, GG8_BN, GG8_STAGES, C_BYTES> P;
  static_assert(EPI != MOK_GG_EPI_SWIGLU, "fp8-block SwiGLU is not implemented");
  extern __shared__ uint8_t smem_raw[];
  uint64_t *full, *empty;
  uint8_t *smem = tp_kernel_start<P, 1>(smem_raw, &full, &empty, &tm_a, &tm_b,
                                        STAGED ? &tm_c : NULL, NULL);
  const int wg = threadIdx.x / 128;

  gg_sched_t sched = gg_sched_init(p.offsets, p.offsets_int64, p.num_groups, p.m_total,
                                   p.n_tiles, p.group_m, GG8_BM, GG8_BN, 1, 0);
  tp_ring_t ring = {0, 0};
  gg_tile_t tile;

  if (wg == 0) {
    ptx_setmaxnreg_dec<GG8_PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      while (gg_sched_next(&sched, &tile)) {
        tp_b_source_t b;
        b.map_lo = b.map_hi = &tm_b;
        b.row_lo = tile.group * p.n + tile.n0;
        b.row_hi = b.row_lo;  // unused: BN = 128 is one box
        tp_produce_tile<GG8_BM, GG8_BN, GG8_STAGES, C_BYTES, 1>(
            &ring, smem, full, empty, &tm_a, tile.row0, b, p.k_blocks, GG8_BK, 0,
            gg_tag(tile));
      }
      gg_post_end<P>(&ring, full, empty);
    }
  } else {
    ptx_setmaxnreg_inc<GG8_CONSUMER_REGS>();
    const int cw = wg - 1;
    const int lt = threadIdx.x & 127;
    float total[64];  // [64, 128] fragment of this warpgroup
    const int4 *tags = gg_tags<P>(smem_raw, smem);
    while (gg_peek(&ring, full, tags, &tile)) {
      // scale rows of this thread's two accumulator rows, clamped into the tensor (rows past the
      // group's end are computed but never stored)
      {
        const int64_t row = epi_coords(tile.row0, tile.row_end, tile.n0, p.n, p.n, cw).row;
        const int64_t r0 = row < p.m_total ? row : p.m_total - 1;
        const int64_t r1 = row + 8 < p.m_total ? row + 8 : p.m_total - 1;
        tp_fp8_scales_t sc;
        sc.a0 = p.a_scale + r0 * p.k_blocks;
        sc.a1 = p.a_scale + r1 * p.k_blocks;
        sc.b = p.b_scale + ((int64_t)tile.group * (p.n / GG8_BN) + tile.n0 / GG8_BN) * p.k_blocks;
        tp_consume_tile_fp8_n128<GG8_BM, GG8_STAGES, C_BYTES>(
            &ring, smem, full, empty, p.k_blocks, cw, tile.row0 + 64 * cw >= tile.row_end, sc,
            total);
      }
      // Everything else of the epilogue is computed after the mainloop, whose two `part` sets
      // leave little room.
      const epi_coords_t e = epi_coords(tile.row0, tile.row_end, tile.n0, p.n, p.n, cw);
      const int wg_row0 = tile.row0 + 64 * cw;
      uint8_t *stage_c = smem + P::C_OFFSET + cw * (GG8_C_BYTES / 2);  // [2][64][128 B]
      if (STAGED && wg_row0 + 64 <= tile.row_end) {
        // NOTE: as in gg_store_staged: wait until the previous stores have read the staging
        // area, and fence ordinary smem stores before the copy engine reads them.
        if (lt == 0) ptx_bulk_wait_group_read<0>();
        ptx_named_barrier_sync(1 + cw, 128);
        epi_stage_bf16<64, 0, 16>(total, stage_c);
        ptx_fence_proxy_async_smem();
        ptx_named_barrier_sync(1 + cw, 128);
        if (lt == 0) {
          for (int ch = 0; ch < 2; ch++)
            ptx_tma_store_2d(&tm_c, stage_c + ch * 8192, tile.n0 + 64 * ch, wg_row0);
          ptx_bulk_commit_group();
        }
      } else if (EPI == MOK_GG_EPI_STORE_BF16) {
        epi_store_bf16<64>(total, (__nv_bfloat16 *)p.c, e);
      } else if (EPI == MOK_GG_EPI_STORE_F32) {
        epi_store_f32<64, false>(total, (float *)p.c, e);
      } else {
        epi_store_f32<64, true>(total, (float *)p.c, e);
      }
    }
    if (STAGED && lt == 0) ptx_bulk_wait_group_all();
  }
#endif
}

template <int EPI>
static cudaError_t gg_launch_fp8(const gg_kernel_params_t *kp, const CUtensorMap *ma,
                                 const CUtensorMap *mb, const CUtensorMap *mc, int grid,
                                 cudaStream_t stream) {
  typedef tp_plan<GG8_BM, GG8_BN, GG8_STAGES, EPI == MOK_GG_EPI_STORE_BF16 ? GG8_C_BYTES : 0> P;
  const int bytes = P::ALLOC_BYTES + P::TAGS_BYTES;
  cudaError_t err = cudaFuncSetAttribute(gg_fp8_kernel<EPI>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  gg_fp8_kernel<EPI><<<grid, MOK_TP_THREADS, bytes, stream>>>(*kp, *ma, *mb, *mc);
  return cudaGetLastError();
}

#endif /* MOK_CUDA_GROUPED_GEMM_FP8_CUH */
