/*
 * gemm/grouped_wgrad_fp8.cuh: the fp8-block weight-gradient (k-grouped) GEMM kernel, included by
 * grouped_wgrad.cu, whose launcher validates and dispatches to it.
 *
 *   C[g] [N, K] = Σ_kb (A_kb · B_kbᵀ) · sa[kb, n] · sb[kb, k]   kb over group g's K blocks
 *   A  [N, Kp] e4m3, K-major    sa [Kp/128, N] fp32   (mok_quantize_cols_launch of dy, dg, du)
 *   B  [K, Kp] e4m3, K-major    sb [Kp/128, K] fp32   (of a, x)
 *   group g's reduction: padded rows [padded[g], padded[g + 1]), multiples of 128, so a K block is
 *   one scale block of both operands and the zeros past a group's rows add nothing
 *   N % 128 == 0, K % 128 == 0
 *
 * Both operands carry activation scales (one per row and K block), so a 128 x 128 output tile
 * promotes every accumulator with its row's and its column's scale (tile/pipeline.cuh,
 * TP_FP8_B_COLS): the producer loads each stage's 128 row scales and 128 column scales into two
 * slots beside the operands. Otherwise the fp8 grouped GEMM's mainloop (two part sets, promotion
 * every 128 reduced rows), with the bf16 weight-gradient kernel's schedule (gw_sched: each output
 * tile of each group once, its rows in order, one CTA; deterministic for any grid). A tile's
 * result is stored once the next tile's first block is issued (gw8_deferred_store). Epilogues:
 * bf16 staged through shared memory and TMA bulk stores (as the fp8 grouped GEMM), fp32 stored or
 * accumulated from registers; an empty group stores zeros, or leaves C[g] when accumulating.
 */
#ifndef MOK_CUDA_GROUPED_WGRAD_FP8_CUH
#define MOK_CUDA_GROUPED_WGRAD_FP8_CUH

enum { GW8_BM = 128, GW8_BN = 128, GW8_BK = 128, GW8_STAGES = 5,
       GW8_C_BYTES = 2 * 64 * 128 * 2 };  // bf16 staging: 2 warpgroups x [64, 128]

// Shared memory: the ring plan P, then the row-scale slots and the column-scale slots of every
// stage (MOK_TP_FP8_SLOT_BYTES each, 128-byte aligned for TMA).
template <int EPI>
struct gw8_plan {
  typedef tp_plan<GW8_BM, GW8_BN, GW8_STAGES, EPI == MOK_GG_EPI_STORE_BF16 ? GW8_C_BYTES : 0> P;
  static constexpr int SLOTS_A = (P::BYTES + 127) / 128 * 128;
  static constexpr int SLOTS_B = SLOTS_A + GW8_STAGES * MOK_TP_FP8_SLOT_BYTES;
  static constexpr int BYTES = SLOTS_B + GW8_STAGES * MOK_TP_FP8_SLOT_BYTES + 1024;  // + align
  static_assert(BYTES <= 227 * 1024, "over the 227 KB of shared memory of an sm_90 CTA");
};
static_assert(4 * GW8_BN <= MOK_TP_FP8_SLOT_BYTES, "a slot holds a tile's 128 scales");
// Register split: the consumers hold two part sets and the total, as in the fp8 grouped GEMM
// with its activation scales in shared memory (gemm/grouped_gemm_fp8.cuh, its register note).
enum { GW8_PRODUCER_REGS = 32, GW8_CONSUMER_REGS = 232 };
static_assert(GW8_PRODUCER_REGS + 2 * GW8_CONSUMER_REGS <= 3 * 168, "the launch's registers");

typedef struct {
  const int32_t *padded;  // [G + 1] padded row offsets (multiples of 128), device memory
  int num_groups;
  int64_t kp;             // columns of A and B (>= padded[G])
  int n, k;               // C[g] is [N, K]
  int m_tiles, n_tiles;   // N / 128, K / 128
  void *c;                // [G, N, K] bf16 or fp32
} gw8_kernel_params_t;

// A consumer warpgroup's piece of an output tile: total (its [64, 128] fragment) -> C[g], or zeros
// for an empty group (nothing when accumulating). cw: the warpgroup, lt: its thread.
template <int EPI>
__device__ __forceinline__ void gw8_store_tile(const float (&total)[64],
                                               const gw8_kernel_params_t &p, const gw_tile_t &t,
                                               bool empty, uint8_t *stage_c,
                                               const CUtensorMap *tm_c, int cw, int lt) {
  const size_t c_off = (size_t)t.group * (size_t)p.n * (size_t)p.k;
  const epi_coords_t e = epi_coords(t.c_row0, p.n, t.c_col0, p.k, p.k, cw);
  if (empty) {
    if constexpr (EPI != MOK_GG_EPI_ACCUM_F32) {
      float zero[64];
#pragma unroll
      for (int i = 0; i < 64; i++) zero[i] = 0.0f;
      if (EPI == MOK_GG_EPI_STORE_BF16) epi_store_bf16<64>(zero, (__nv_bfloat16 *)p.c + c_off, e);
      else epi_store_f32<64, false>(zero, (float *)p.c + c_off, e);
    }
  } else if (EPI == MOK_GG_EPI_STORE_BF16) {
    epi_store_staged<0, 0, 0>(total, stage_c, tm_c, make_float2(1.0f, 1.0f), t.c_col0, p.k,
                              t.group * p.n + t.c_row0 + 64 * cw, MOK_BAR_GEMM_EPI + cw, lt);
  } else {
    epi_store_f32<64, EPI == MOK_GG_EPI_ACCUM_F32>(total, (float *)p.c + c_off, e);
  }
}

// The previous tile's store, run by the mainloop once the next tile's first block is issued
// (tp_consume_tile_fp8_n128's after_first): the epilogue runs under the tensor cores' work on
// that block instead of between tiles, where a tile reduces only ~4 blocks (DeepSeek-V3).
template <int EPI>
struct gw8_deferred_store {
  const float (&total)[64];
  const gw8_kernel_params_t &p;
  const gw_tile_t &prev;
  bool pending;
  uint8_t *stage_c;
  const CUtensorMap *tm_c;
  int cw, lt;
  __device__ __forceinline__ void operator()() const {
    if (pending) gw8_store_tile<EPI>(total, p, prev, false, stage_c, tm_c, cw, lt);
  }
};

template <int EPI>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    gw_fp8_kernel(const __grid_constant__ gw8_kernel_params_t p,
                  const __grid_constant__ CUtensorMap tm_a,   // A [N, Kp] e4m3, box [128, 128]
                  const __grid_constant__ CUtensorMap tm_b,   // B [K, Kp] e4m3, box [128, 128]
                  const __grid_constant__ CUtensorMap tm_sa,  // sa [Kp/128, N] fp32, box [1, 128]
                  const __grid_constant__ CUtensorMap tm_sb,  // sb [Kp/128, K] fp32, box [1, 128]
                  const __grid_constant__ CUtensorMap tm_c)   // bf16: C [G N, K], box [64, 64]
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(EPI == MOK_GG_EPI_STORE_BF16 || EPI == MOK_GG_EPI_STORE_F32 ||
                    EPI == MOK_GG_EPI_ACCUM_F32,
                "weight gradients: store bf16, store fp32 or accumulate fp32");
  constexpr int STAGED = EPI == MOK_GG_EPI_STORE_BF16;
  constexpr int C_BYTES = STAGED ? GW8_C_BYTES : 0;
  typedef gw8_plan<EPI> Q;
  typedef typename Q::P P;
  extern __shared__ uint8_t smem_raw[];
  uint64_t *full, *empty;
  uint8_t *smem = tp_kernel_start<P>(smem_raw, &full, &empty, &tm_a, &tm_b, &tm_sa,
                                     STAGED ? &tm_c : &tm_sb);
  const int wg = threadIdx.x / 128;

  gw_sched_t sched = gw_sched_init(p.padded, 0, p.num_groups, p.kp, p.m_tiles, p.n_tiles,
                                   GW8_BM, GW8_BN);
  tp_ring_t ring = {0, 0};
  gw_tile_t tile;

  if (wg == 0) {
    ptx_setmaxnreg_dec<GW8_PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      if (STAGED) ptx_prefetch_tensormap(&tm_sb);
      while (gw_sched_next(&sched, &tile)) {
        const int k_blocks = tile.rows / GW8_BK;
        for (int kb = 0; kb < k_blocks; kb++) {
          ptx_mbar_wait(&empty[ring.stage], ring.phase ^ 1u);
          uint8_t *a_tile = smem + ring.stage * P::STAGE_BYTES;
          uint64_t *bar = &full[ring.stage];
          const int kx = tile.row0 + GW8_BK * kb;  // the block's first padded row
          ptx_mbar_arrive_expect_tx(bar, P::STAGE_BYTES + 2 * 4 * GW8_BN);
          ptx_tma_load_2d(a_tile, &tm_a, bar, kx, tile.c_row0);
          ptx_tma_load_2d(a_tile + P::A_BYTES, &tm_b, bar, kx, tile.c_col0);
          ptx_tma_load_2d(smem + Q::SLOTS_A + ring.stage * MOK_TP_FP8_SLOT_BYTES, &tm_sa, bar,
                          tile.c_row0, kx / GW8_BK);
          ptx_tma_load_2d(smem + Q::SLOTS_B + ring.stage * MOK_TP_FP8_SLOT_BYTES, &tm_sb, bar,
                          tile.c_col0, kx / GW8_BK);
          tp_ring_advance<GW8_STAGES>(&ring);
        }
      }
    }
  } else {
    ptx_setmaxnreg_inc<GW8_CONSUMER_REGS>();
    const int cw = wg - 1;
    const int lt = threadIdx.x & 127;
    uint8_t *stage_c = smem + P::C_OFFSET + cw * (GW8_C_BYTES / 2);  // [2][64][128 B]
    float total[64];  // [64, 128] fragment of this warpgroup: the tile's, then stored
    gw_tile_t prev;   // the tile whose result waits in total (pending)
    bool pending = false;
    tp_fp8_scales_t sc = {};
    const int rr = 64 * cw + 16 * (lt / 32) + (lt & 31) / 4;  // this thread's first tile row
    sc.sa = ptx_smem_addr(smem) + Q::SLOTS_A + 4 * rr;
    sc.sbc = ptx_smem_addr(smem) + Q::SLOTS_B + 8 * (lt & 3);
    while (gw_sched_next(&sched, &tile)) {
      const int k_blocks = tile.rows / GW8_BK;
      if (k_blocks == 0) {  // empty group: zeros now; a pending tile keeps waiting in total
        gw8_store_tile<EPI>(total, p, tile, true, stage_c, &tm_c, cw, lt);
        continue;
      }
      const gw8_deferred_store<EPI> store_prev = {total, p, prev, pending, stage_c, &tm_c, cw, lt};
      tp_consume_tile_fp8_n128<GW8_BM, GW8_STAGES, C_BYTES, 1, TP_FP8_B_COLS>(
          &ring, smem, full, empty, k_blocks, cw, false, sc, total, store_prev);
      prev = tile;
      pending = true;
    }
    if (pending) gw8_store_tile<EPI>(total, p, prev, false, stage_c, &tm_c, cw, lt);
    if (STAGED && lt == 0) ptx_bulk_wait_group_all();
  }
#endif
}

template <int EPI>
static cudaError_t gw_launch_fp8(const gw8_kernel_params_t *kp, const CUtensorMap *m, int grid,
                                 cudaStream_t stream) {
  const int bytes = gw8_plan<EPI>::BYTES;
  cudaError_t err = cudaFuncSetAttribute(gw_fp8_kernel<EPI>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  gw_fp8_kernel<EPI><<<grid, MOK_TP_THREADS, bytes, stream>>>(*kp, m[0], m[1], m[2], m[3], m[4]);
  return cudaGetLastError();
}

#endif /* MOK_CUDA_GROUPED_WGRAD_FP8_CUH */
