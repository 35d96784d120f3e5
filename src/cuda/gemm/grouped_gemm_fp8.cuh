/*
 * gemm/grouped_gemm_fp8.cuh: the fp8-block grouped GEMM kernel (DeepSeek-V3 recipe), included by
 * grouped_gemm.cu, whose launcher validates and dispatches to it.
 *
 *   C[rows of g, :] = epilogue( Σ_kb (A_kb · B[g]_kbᵀ) · a_scale[r, kb] · b_scale[g, n/128, kb] )
 *   A       [M_total, K] e4m3        a_scale [M_total, K/128] or [K/128, ld] fp32 (1x128 blocks)
 *   B       [G, N, K] e4m3 (K-major) b_scale [G, N/128, K/128] fp32 (128x128 blocks)
 *   K % 128 == 0, N % 128 == 0 (scale blocks never straddle a tile)
 *
 * SwiGLU (BMODE TP_FP8_B_HALVES): a tile's B rows are 64 gate rows of Wg and the same 64 rows of
 * Wu, each half promoted with its own weight scale, so a 128 x 128 tile gives 64 output columns
 * c = bf16(row_scale · silu(g) · u) (and bf16 g, u). A second reduction segment (BMODE
 * TP_FP8_B_SEGMENTS, k2 > 0): K blocks past the first segment's come from A2 [M_total, K2] and
 * B2 [G, N, K2] with b2_scale, the activation scales of both in one K-block-major array
 * [(K + K2)/128, ld], so one accumulator holds A·B + A2·B2 (the backward's dxk = dg·Wg + du·Wu).
 *
 * Activation scales stored K-block major ([K/128, ld], SMEM_A) come into shared memory with each
 * stage (one more TMA box per stage), so the consumers read them there; row-major ones are read
 * by the consumers from global memory, one block ahead.
 *
 * Quantized a (QA, SwiGLU): c_q = e4m3(a) in 1x128 blocks, bit for bit what the quantizer makes
 * of the bf16 a, with no bf16 a in memory. A block spans 128 output columns, two of the tiles
 * above: a QA tile is such a pair, run back to back by one CTA (2 k_blocks stages, the second
 * half's B rows 64 further), the first half's bf16 a kept in shared memory until the second's
 * epilogue has the block's amax (gg8_store_swiglu_q).
 *
 * Same CTA shape as the bf16 kernel (1 producer + 2 consumer warpgroups, persistent, tiles from
 * tile/scheduler.cuh), with 128 x 128 tiles: the promotion keeps the stage's partial sums apart
 * from the fp32 total, in two sets so that the next stage's wgmmas run while one is promoted
 * (3 x 64 registers per thread; with N = 256 they would not fit). A stage holds 128 reduction
 * elements (128 bytes per row: the 128-byte swizzle span).
 */
#ifndef MOK_CUDA_GROUPED_GEMM_FP8_CUH
#define MOK_CUDA_GROUPED_GEMM_FP8_CUH

enum { GG8_BM = 128, GG8_BN = 128, GG8_BK = 128, GG8_STAGES = 6, GG8_C_BYTES = 2 * 64 * 128 * 2 };

// Shared memory of an fp8 kernel with STAGES stages: the ring plan P, then (SMEM_A) a slot of
// activation scales per stage, 128-byte aligned for TMA, after the plan's tags, then (QA) the
// first halves' bf16 a of both consumer warpgroups (16 words per thread).
enum { GG8_STASH_BYTES = 2 * 128 * 16 * 4 };
template <int EPI, int STAGES, int SMEM_A, int QA = 0>
struct gg8_plan {
  typedef tp_plan<GG8_BM, GG8_BN, STAGES, EPI == MOK_GG_EPI_STORE_BF16 ? GG8_C_BYTES : 0> P;
  static constexpr int SLOTS_OFFSET = (P::TAGS_OFFSET + P::TAGS_BYTES + 127) / 128 * 128;
  static constexpr int STASH_OFFSET = SLOTS_OFFSET + STAGES * MOK_TP_FP8_SLOT_BYTES;
  static constexpr int BYTES =
      (SMEM_A ? P::ALLOC_BYTES + (SLOTS_OFFSET - P::BYTES) + STAGES * MOK_TP_FP8_SLOT_BYTES
              : P::ALLOC_BYTES + P::TAGS_BYTES) +
      (QA ? GG8_STASH_BYTES : 0);
  static_assert(!QA || SMEM_A, "the stash follows the slots");
  static_assert(BYTES <= 227 * 1024, "over the 227 KB of shared memory of an sm_90 CTA");
};
// Register split: the consumers hold two `part` sets and the fp32 total (192 registers) in the
// mainloop (tile/pipeline.cuh), so they take 240 and the producer warpgroup (one thread issuing
// TMA) keeps 24. ptxas gives the code after setmaxnreg.inc the larger budget; keep it spill-free.
// NOTE: the warpgroups trade registers within what the CTA was launched with (168 per thread,
// __launch_bounds__(384, 1)), not the whole register file: with 32 + 2 x 240 the consumers'
// setmaxnreg.inc waited forever for registers nobody had freed, and the producer's bounded wait
// timed out (docs/performance.md, "ptxas: registers, traps and spills").
// With the activation scales in shared memory (SMEM_A) the consumers need no scale pointers and
// the producer loads one more box per stage: 32 and 232.
enum { GG8_PRODUCER_REGS = 24, GG8_CONSUMER_REGS = 240 };
enum { GG8_SMEM_A_PRODUCER_REGS = 32, GG8_SMEM_A_CONSUMER_REGS = 232 };
static_assert(GG8_PRODUCER_REGS + 2 * GG8_CONSUMER_REGS <= 3 * 168, "the launch's registers");
static_assert(GG8_SMEM_A_PRODUCER_REGS + 2 * GG8_SMEM_A_CONSUMER_REGS <= 3 * 168, "the same");

// The producer's extra load per stage with SMEM_A: the tile's 128 activation scales of the
// stage's K block, one TMA box [1, min(132, ld)] of a_scale [K/128, ld] from the tile's first row
// rounded down to a multiple of 4 (NOTE: an innermost coordinate that is not a multiple of 16
// bytes is an illegal instruction) into the stage's slot. With ld < 132 the box is the whole row
// (a box wider than the tensor is not allowed), which still covers the tile's rows in it.
enum { GG8_SCALE_BOX = 132 };
static_assert(4 * GG8_SCALE_BOX <= MOK_TP_FP8_SLOT_BYTES && MOK_TP_FP8_SLOT_BYTES % 128 == 0,
              "a slot holds the box, at a 128-byte aligned address");
struct gg8_scale_load {
  const CUtensorMap *map;
  uint8_t *slots;      // stage 0's slot
  int row0;            // the tile's first row, rounded down to a multiple of 4
  uint32_t box_bytes;  // 4 min(132, ld)
  __device__ __forceinline__ uint32_t extra_tx() const { return box_bytes; }
  __device__ __forceinline__ void operator()(int stage, int kb, uint64_t *bar) const {
    ptx_tma_load_2d(slots + stage * MOK_TP_FP8_SLOT_BYTES, map, bar, row0, kb);
  }
};

// Producer, one thread: the k_blocks stages of one tile. Stage kb holds A's K block from map_a
// (blocks from k_split on: map_a2's, counted from its start) and B's from map_b at row b_row
// (blocks from k_split on: map_b2's), or with HALVES B rows [0, 64) from map_b (gate) and
// [64, 128) from map_b2 (up), boxes of 64 rows. The tile's tag goes with its first stage, as in
// tp_produce_tile.
template <int STAGES, int C_BYTES, int HALVES, class StageHook>
__device__ __forceinline__ void gg8_produce_tile(tp_ring_t *ring, uint8_t *smem, uint64_t *full,
                                                 uint64_t *empty, const CUtensorMap *map_a,
                                                 const CUtensorMap *map_a2, int a_row,
                                                 const CUtensorMap *map_b,
                                                 const CUtensorMap *map_b2, int b_row,
                                                 int k_blocks, int k_split, int4 tag,
                                                 StageHook hook) {
  typedef tp_plan<GG8_BM, GG8_BN, STAGES, C_BYTES> P;
  ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
  tp_post_tag<P>(full, ring->stage, tag);
  for (int kb = 0; kb < k_blocks; kb++) {
    ptx_mbar_wait(&empty[ring->stage], ring->phase ^ 1u);
    uint8_t *a_tile = smem + ring->stage * P::STAGE_BYTES;
    uint8_t *b_tile = a_tile + P::A_BYTES;
    uint64_t *bar = &full[ring->stage];
    const bool second = !HALVES && kb >= k_split;
    const int kx = (second ? kb - k_split : kb) * GG8_BK;
    ptx_mbar_arrive_expect_tx(bar, P::STAGE_BYTES + hook.extra_tx());
    ptx_tma_load_2d(a_tile, second ? map_a2 : map_a, bar, kx, a_row);
    if (HALVES) {
      ptx_tma_load_2d(b_tile, map_b, bar, kx, b_row);
      ptx_tma_load_2d(b_tile + 64 * MOK_TP_ROW_BYTES, map_b2, bar, kx, b_row);
    } else {
      ptx_tma_load_2d(b_tile, second ? map_b2 : map_b, bar, kx, b_row);
    }
    hook(ring->stage, kb, bar);
    tp_ring_advance<STAGES>(ring);
  }
}

// QA, half 1 (gg8_store_swiglu_q): half 0's a pairs back from the stash beside this half's, the
// block's scale per row from the four lanes' amax, the e4m3 byte pairs and the scale out.
__device__ __forceinline__ void gg8_quantize_a_pairs(uint32_t (&a)[2][16], const uint32_t *stash,
                                                     const gg_kernel_params_t &p,
                                                     epi_coords_t e) {
#pragma unroll
  for (int j = 0; j < 8; j++) {
    a[0][j] = stash[128 * j];
    a[1][j] = stash[128 * (8 + j)];
  }
  const int64_t col0 = e.col - 64;  // this thread's first column of the block
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int64_t row = e.row + 8 * h;
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 16; i++)
      m = max(m, max(quant_abs_bits(__uint_as_float(a[h][i] << 16)),
                     quant_abs_bits(__uint_as_float(a[h][i] & 0xFFFF0000u))));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    const quant_block_t b = quant_block_make(m, p.c_q_kind);
    if (row >= e.row_end) continue;
    uint16_t *q = (uint16_t *)(p.c_q + row * e.ldc + col0);
#pragma unroll
    for (int i = 0; i < 16; i++)  // word i: columns col0 + 8 i (+ 1), i >= 8 in half 1
      q[4 * i] = (uint16_t)quant_block_e4m3x2(b, __uint_as_float(a[h][i] << 16),
                                               __uint_as_float(a[h][i] & 0xFFFF0000u));
    if ((threadIdx.x & 3) == 0) p.c_q_scale[(col0 / 128) * p.c_q_ld + row] = b.scale;
  }
}

// QA, consumer warpgroup thread: the SwiGLU epilogue of half H of a paired tile (acc: its [64
// rows, 64 g + 64 u] fragment; e: the half's coordinates). This thread's a of its two rows are 8
// bf16 pairs each per half (columns e.col + 8 j, + 1), computed as epi_store_swiglu computes them;
// g and u go out as there. Half 0 leaves its a pairs in `stash` (word i at stash[128 i], this
// thread's column); half 1 takes them back, and the four lanes of a row (lanes 4 q .. 4 q + 3)
// find the 128-column block's amax, make its scale (quant_block_make, the layer's kind) and
// convert the bf16 values exactly as the quantizer converts them (quant_block_e4m3x2): e4m3 byte
// pairs to c_q, the scale to c_q_scale by the row's first lane.
template <int H>
__device__ __forceinline__ void gg8_store_swiglu_q(const float (&acc)[64],
                                                   const gg_kernel_params_t &p, float2 w,
                                                   epi_coords_t e, uint32_t *stash) {
  epi_store_swiglu<64>(acc, NULL, (__nv_bfloat16 *)p.g_out, (__nv_bfloat16 *)p.u_out, w, e);
  uint32_t a[2][16];  // [row, row + 8][word]: half 0's words 0-7, half 1's 8-15
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const int ju = j + 8;
    const __nv_bfloat162 v0 = epi_swiglu_a2(w.x, acc[4 * j], acc[4 * j + 1], acc[4 * ju],
                                            acc[4 * ju + 1]);
    const __nv_bfloat162 v1 = epi_swiglu_a2(w.y, acc[4 * j + 2], acc[4 * j + 3], acc[4 * ju + 2],
                                            acc[4 * ju + 3]);
    a[0][8 * H + j] = *(const uint32_t *)&v0;
    a[1][8 * H + j] = *(const uint32_t *)&v1;
  }
  if (H == 0) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
      stash[128 * j] = a[0][j];
      stash[128 * (8 + j)] = a[1][j];
    }
  } else {
    gg8_quantize_a_pairs(a, stash, p, e);
  }
}

// STAGES: ring depth; SMEM_A: activation scales [K/128, ld] through shared memory (above), else
// [M_total, K/128] read from global memory by the consumers; BMODE: tile/pipeline.cuh's B scale
// modes (TP_FP8_B_HALVES with the SwiGLU epilogue, TP_FP8_B_SEGMENTS with a second segment);
// QA: paired SwiGLU tiles with quantized a (above).
template <int EPI, int STAGES, int SMEM_A, int BMODE, int QA = 0>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    gg_fp8_kernel(const __grid_constant__ gg_kernel_params_t p,
                  const __grid_constant__ CUtensorMap tm_a,   // A [M_total, K] e4m3, box [128, 128]
                  const __grid_constant__ CUtensorMap tm_b,   // B [G*N, K] e4m3, box [128, 128]
                                                              // (HALVES: gate, box [64, 128])
                  const __grid_constant__ CUtensorMap tm_c,   // C [M_total, N] bf16, box [64, 64]
                  const __grid_constant__ CUtensorMap tm_s,   // SMEM_A: a_scale, box [1, <= 132]
                  const __grid_constant__ CUtensorMap tm_a2,  // SEGMENTS: A2 [M_total, K2]
                  const __grid_constant__ CUtensorMap tm_b2)  // HALVES: up [G*N, K], box [64,
                                                              // 128]; SEGMENTS: B2 [G*N, K2]
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int STAGED = EPI == MOK_GG_EPI_STORE_BF16;
  constexpr int C_BYTES = STAGED ? GG8_C_BYTES : 0;
  constexpr int HALVES = BMODE == TP_FP8_B_HALVES;
  typedef gg8_plan<EPI, STAGES, SMEM_A, QA> Q;
  typedef typename Q::P P;
  static_assert((EPI == MOK_GG_EPI_SWIGLU) == HALVES, "SwiGLU tiles hold gate and up halves");
  static_assert(!QA || HALVES, "quantized a: SwiGLU");
  static_assert(BMODE != TP_FP8_B_SEGMENTS || SMEM_A, "two segments: scales in one K-major array");
  extern __shared__ uint8_t smem_raw[];
  uint64_t *full, *empty;
  uint8_t *smem = tp_kernel_start<P>(smem_raw, &full, &empty, &tm_a, &tm_b,
                                     STAGED ? &tm_c : NULL, SMEM_A ? &tm_s : NULL);
  const int wg = threadIdx.x / 128;

  gg_sched_t sched = gg_sched_init(p.offsets, p.offsets_int64, p.num_groups, p.m_total,
                                   p.n_tiles, p.group_m, GG8_BM, p.bn_out);
  tp_ring_t ring = {0, 0};
  gg_tile_t tile;

  if (wg == 0) {
    ptx_setmaxnreg_dec<SMEM_A ? GG8_SMEM_A_PRODUCER_REGS : GG8_PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      if (BMODE != TP_FP8_B_ONE) {
        ptx_prefetch_tensormap(&tm_b2);
        if (!HALVES) ptx_prefetch_tensormap(&tm_a2);
      }
      while (gg_sched_next(&sched, &tile)) {
        const int b_row = tile.group * p.n + tile.n0;  // HALVES: gate and up rows of the columns
        if (SMEM_A) {
          gg8_scale_load sl;
          sl.map = &tm_s;
          sl.slots = smem + Q::SLOTS_OFFSET;
          sl.row0 = tile.row0 & ~3;
          sl.box_bytes = 4 * (uint32_t)min(p.a_scale_ld, (int64_t)GG8_SCALE_BOX);
          gg8_produce_tile<STAGES, C_BYTES, HALVES>(&ring, smem, full, empty, &tm_a, &tm_a2,
                                                    tile.row0, &tm_b, &tm_b2, b_row, p.k_blocks,
                                                    p.k_split, gg_tag(tile), sl);
          if (QA)  // the second half: the next 64 columns, the same A (its stages tag nothing)
            gg8_produce_tile<STAGES, C_BYTES, HALVES>(&ring, smem, full, empty, &tm_a, &tm_a2,
                                                      tile.row0, &tm_b, &tm_b2, b_row + 64,
                                                      p.k_blocks, p.k_split, gg_tag(tile), sl);
        } else {
          gg8_produce_tile<STAGES, C_BYTES, HALVES>(&ring, smem, full, empty, &tm_a, &tm_a2,
                                                    tile.row0, &tm_b, &tm_b2, b_row, p.k_blocks,
                                                    p.k_split, gg_tag(tile), tp_no_stage_hook());
        }
      }
      gg_post_end<P>(&ring, full, empty);
    }
  } else {
    ptx_setmaxnreg_inc<SMEM_A ? GG8_SMEM_A_CONSUMER_REGS : GG8_CONSUMER_REGS>();
    const int cw = wg - 1;
    const int lt = threadIdx.x & 127;
    float total[64];  // [64, 128] fragment of this warpgroup
    const int4 *tags = gg_tags<P>(smem_raw, smem);
    while (gg_peek(&ring, full, tags, &tile)) {
#pragma unroll
     for (int h = 0; h < (QA ? 2 : 1); h++) {  // QA: the tile's two halves, back to back
      // scale rows of this thread's two accumulator rows, clamped into the tensor (rows past the
      // group's end are computed but never stored)
      {
        const int64_t row = epi_coords(tile.row0, tile.row_end, tile.n0, p.n, p.n, cw).row;
        const int64_t r0 = row < p.m_total ? row : p.m_total - 1;
        const int64_t r1 = row + 8 < p.m_total ? row + 8 : p.m_total - 1;
        tp_fp8_scales_t sc;
        sc.a0 = p.a_scale + r0 * p.k_blocks;
        sc.a1 = p.a_scale + r1 * p.k_blocks;
        // the tile's 128-row block of B (HALVES: of Wg and of Wu)
        const int64_t nb = (int64_t)tile.group * (p.n / GG8_BN) + tile.n0 / GG8_BN;
        sc.b = p.b_scale + nb * p.k_split;
        sc.b2 = HALVES ? p.b2_scale + nb * p.k_split : p.b2_scale + nb * (p.k_blocks - p.k_split);
        sc.k_split = p.k_split;
        // SMEM_A: this thread's first row in the slot, which starts at row0 & ~3
        sc.sa = ptx_smem_addr(smem) + Q::SLOTS_OFFSET + 4 * (int)(row - (tile.row0 & ~3));
        tp_consume_tile_fp8_n128<GG8_BM, STAGES, C_BYTES, SMEM_A, BMODE>(
            &ring, smem, full, empty, p.k_blocks, cw,
            gg_skip_rows(p, tile.row0 + 64 * cw, tile.row_end), sc, total);
      }
      // Everything else of the epilogue is computed after the mainloop, whose two `part` sets
      // leave little room.
      const epi_coords_t e = epi_coords(tile.row0, tile.row_end, tile.n0 + 64 * h, p.n, p.n, cw);
      const int wg_row0 = tile.row0 + 64 * cw;
      uint8_t *stage_c = smem + P::C_OFFSET + cw * (GG8_C_BYTES / 2);  // [2][64][128 B]
      if (QA) {
        uint32_t *stash = (uint32_t *)(smem + Q::STASH_OFFSET) + cw * (GG8_STASH_BYTES / 8) + lt;
        if (h == 0) gg8_store_swiglu_q<0>(total, p, epi_row_scales(p.row_scale, e), e, stash);
        else gg8_store_swiglu_q<1>(total, p, epi_row_scales(p.row_scale, e), e, stash);
      } else if (HALVES) {
        epi_store_swiglu<64>(total, (__nv_bfloat16 *)p.c, (__nv_bfloat16 *)p.g_out,
                             (__nv_bfloat16 *)p.u_out, epi_row_scales(p.row_scale, e), e);
      } else if (STAGED && wg_row0 + 64 <= tile.row_end) {
        epi_store_staged<0, 0, 0>(total, stage_c, &tm_c, make_float2(1.0f, 1.0f), tile.n0, p.n,
                                  wg_row0, MOK_BAR_GEMM_EPI + cw, lt);
      } else if (EPI == MOK_GG_EPI_STORE_BF16) {
        epi_store_bf16<64>(total, (__nv_bfloat16 *)p.c, e);
      } else if (EPI == MOK_GG_EPI_STORE_F32) {
        epi_store_f32<64, false>(total, (float *)p.c, e);
      } else {
        epi_store_f32<64, true>(total, (float *)p.c, e);
      }
     }
    }
    if (STAGED && lt == 0) ptx_bulk_wait_group_all();
  }
#endif
}

// The maps of an fp8 launch (unused ones are copies of `a`).
typedef struct {
  CUtensorMap a, b, c, s, a2, b2;
} gg8_maps_t;

template <int EPI, int STAGES, int SMEM_A, int BMODE, int QA = 0>
static cudaError_t gg_launch_fp8(const gg_kernel_params_t *kp, const gg8_maps_t *m, int grid,
                                 cudaStream_t stream) {
  const int bytes = gg8_plan<EPI, STAGES, SMEM_A, QA>::BYTES;
  cudaError_t err = cudaFuncSetAttribute(gg_fp8_kernel<EPI, STAGES, SMEM_A, BMODE, QA>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  gg_fp8_kernel<EPI, STAGES, SMEM_A, BMODE, QA><<<grid, MOK_TP_THREADS, bytes, stream>>>(
      *kp, m->a, m->b, m->c, m->s, m->a2, m->b2);
  return cudaGetLastError();
}

// The fp8 configurations: activation scales [K/128, ld] through shared memory (5 stages: with 6
// the slots do not fit beside the output staging), or [M_total, K/128] from global memory with 6
// stages. The first measured 0-4% faster at every benchmark shape (docs/performance.md, "fp8-block GEMM: activation scales").
// A second segment needs the first (its scales are one K-block-major array); so does quantized a
// (SwiGLU; validated).
template <int EPI>
static cudaError_t gg_launch_fp8_config(const gg_kernel_params_t *kp, const gg8_maps_t *m,
                                        int smem_a, int segments, int grid, cudaStream_t stream) {
  constexpr int ONE = EPI == MOK_GG_EPI_SWIGLU ? TP_FP8_B_HALVES : TP_FP8_B_ONE;
  if constexpr (EPI == MOK_GG_EPI_SWIGLU) {
    if (kp->c_q) return gg_launch_fp8<EPI, 5, 1, ONE, 1>(kp, m, grid, stream);
  }
  if constexpr (EPI == MOK_GG_EPI_STORE_BF16 || EPI == MOK_GG_EPI_STORE_F32) {
    if (segments) return gg_launch_fp8<EPI, 5, 1, TP_FP8_B_SEGMENTS>(kp, m, grid, stream);
  }
  (void)segments;  // validated: no second segment with the other epilogues
  return smem_a ? gg_launch_fp8<EPI, 5, 1, ONE>(kp, m, grid, stream)
                : gg_launch_fp8<EPI, GG8_STAGES, 0, ONE>(kp, m, grid, stream);
}

#endif /* MOK_CUDA_GROUPED_GEMM_FP8_CUH */
