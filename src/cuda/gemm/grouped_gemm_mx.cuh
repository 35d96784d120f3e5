/*
 * gemm/grouped_gemm_mx.cuh: the grouped GEMM with MXFP8 weights (MOK_GG_MXFP8_B), included by
 * grouped_gemm.cu after the bf16 kernel, whose launcher validates and dispatches to it.
 *
 *   C[rows of g, :] = epilogue( A[rows of g, :] · deq(B[g])ᵀ ),  deq(B)[n, k] = B[n, k] · 2^X(n, k/32)
 *   A  [M_total, K] bf16 (the layer's MXFP8 activations, already dequantized)
 *   B  [G, N, K] e4m3, K-major, b_e8m0 [G N, K/32]: one E8M0 byte X + 127 per 1x32 block along K
 *
 * Hopper's wgmma has no block scales. Promoting a 32-long fp8 partial sum into fp32 would cost,
 * every 32 reduction elements, a multiply-add per accumulator with a scale that changes along
 * both M (the activation's) and N (the weight's): more FP32 work than the MMA itself. Instead B is
 * dequantized to bf16 in shared memory, exactly (e4m3 · 2^X has 4 significant bits and lies in
 * bf16's normal range for every scale a weight block of bf16 values gets, X >= -117), and the bf16
 * mainloop (tile/pipeline.cuh) runs on it: bf16 tensor throughput, with the weights crossing HBM
 * and the L2 as e4m3, half of bf16's bytes.
 *
 * A stage holds A [128, 64] bf16 and B [256, 64] bf16 (the ring's tp_plan stage), plus a slot of
 * 16 KB in the plan's C area into which TMA loads the e4m3 B [256 rows, 64 bytes] (no swizzle).
 * Once a stage lands, both consumer warpgroups convert it (ggx_prep: warpgroup cw the rows
 * [128 cw, 128 cw + 128), 64 elements per thread: the 16-byte chunk c of rows r, r + 32, r + 64,
 * r + 96), storing the 128-byte swizzle that the wgmma descriptors read, then fence for the async
 * proxy and meet at a barrier of both warpgroups. The conversion of stage kb runs while the
 * wgmmas of stage kb - 1 are in flight. bf16 outputs of whole row tiles go through 16 KB of
 * staging per warpgroup and TMA bulk stores (a plain tile's 256 columns in two rounds; the bf16
 * kernel's 64 KB do not fit beside the slots); SwiGLU with g and u outputs, fp32 outputs and
 * partial row tiles store from registers.
 *
 * SwiGLU: B rows [0, 128) are gate rows of Wg, rows [128, 256) the same rows of Wu (b2, b2_e8m0).
 * A second reduction segment (k2 > 0): K blocks from k_split on come from A2 [M_total, K2] and
 * B2 [G, N, K2] (b2_e8m0 [G N, K2/32]), one accumulator over K + K2.
 */
#ifndef MOK_CUDA_GROUPED_GEMM_MX_CUH
#define MOK_CUDA_GROUPED_GEMM_MX_CUH

#include <cuda_fp16.h>

// The plan's C area: the e4m3 slots, then 16 KB of output staging per consumer warpgroup.
enum {
  GGX_STAGES = 3,
  GGX_SLOT_BYTES = GG_BN * 64,  // e4m3 B [256 rows, 64 bytes]
  GGX_SLOTS_BYTES = GGX_STAGES * GGX_SLOT_BYTES,
  GGX_STAGING_BYTES = 16384     // [2 chunks][64 rows][128 B] bf16: 128 output columns
};
typedef tp_plan<GG_BM, GG_BN, GGX_STAGES, GGX_SLOTS_BYTES + 2 * GGX_STAGING_BYTES> ggx_plan;

// The fp32 value of an E8M0 byte: 2^(b - 127) (b = 0: 2^-127, an fp32 subnormal), NaN for 0xFF.
__device__ __forceinline__ float ggx_e8m0(uint32_t b) {
  return __uint_as_float(b == 0xFFu ? 0x7FC00000u : b != 0 ? b << 23 : 0x00400000u);
}

// Two e4m3 values (low byte first) times s as bf16x2 (low half first). The products are exact
// in fp32; their rounding to bf16 too wherever they are bf16 normals.
__device__ __forceinline__ uint32_t ggx_e4m3x2_bf16x2(uint32_t two, float s) {
  uint32_t h, r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((uint16_t)two));
  const float lo = __half2float(__ushort_as_half((uint16_t)h)) * s;
  const float hi = __half2float(__ushort_as_half((uint16_t)(h >> 16))) * s;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// One consumer thread's share of a tile's B conversion (tp_consume_tile_bf16_n256's prep).
struct ggx_prep {
  uint32_t slot;        // shared address: stage 0's slot, this thread's first row and chunk
  uint32_t bt;          // shared address: stage 0's bf16 B, this thread's first row
  uint32_t u0, u1;      // byte offsets of this thread's two 16-byte units in a swizzled row
  const uint8_t *s1;    // E8M0 byte of this thread's first row, chunk and K block 0 (segment 1)
  const uint8_t *s2;    // the same in the second segment's scales (or s1)
  int step1, step2;     // bytes between the scales of rows 32 apart, per segment
  int k_split;          // K blocks of the first segment
  uint32_t valid;       // bit i: row i of this thread's four exists in B (rows past G N do not)

  __device__ __forceinline__ void operator()(int stage, int kb) const {
    const bool second = kb >= k_split;
    const uint8_t *s = second ? s2 + 2 * (kb - k_split) : s1 + 2 * kb;
    const int step = second ? step2 : step1;
    float sc[4];
#pragma unroll
    for (int i = 0; i < 4; i++)  // rows past B read nothing; TMA zero-filled their values
      sc[i] = ggx_e8m0((valid >> i) & 1u ? (uint32_t)__ldg(s + i * step) : 0u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const uint4 w = ptx_ld_shared_v4(slot + stage * GGX_SLOT_BYTES + i * 32 * 64);
      const uint32_t row = bt + stage * ggx_plan::STAGE_BYTES + i * 32 * MOK_TP_ROW_BYTES;
      const uint32_t in[4] = {w.x, w.y, w.z, w.w};
      uint32_t o[8];
#pragma unroll
      for (int j = 0; j < 4; j++) {
        o[2 * j] = ggx_e4m3x2_bf16x2(in[j] & 0xFFFFu, sc[i]);
        o[2 * j + 1] = ggx_e4m3x2_bf16x2(in[j] >> 16, sc[i]);
      }
      ptx_st_shared_v4(row + u0, make_int4((int)o[0], (int)o[1], (int)o[2], (int)o[3]));
      ptx_st_shared_v4(row + u1, make_int4((int)o[4], (int)o[5], (int)o[6], (int)o[7]));
    }
    // NOTE: generic stores read next by wgmma (async proxy): fence in every writer, then meet.
    ptx_fence_proxy_async_smem();
    ptx_named_barrier_sync(MOK_BAR_GEMM_MX, 256);
  }
};

// Thread lt of consumer warpgroup cw, for the tile of group `group` at columns n0: chunk c = lt % 4
// (K elements [16 c, 16 c + 16) of the stage) of tile rows 128 cw + lt / 4 + 32 i. Conflict-free:
// a quarter warp reads two whole 64-byte rows and writes units 2c ^ x, distinct across its 8 lanes.
__device__ __forceinline__ ggx_prep ggx_prep_make(const gg_kernel_params_t &p, int swiglu,
                                                  const uint8_t *smem, int group, int n0, int cw,
                                                  int lt) {
  ggx_prep q;
  const int c = lt & 3, r = 128 * cw + (lt >> 2);       // tile row of i = 0
  const int x = (lt >> 2) & 7;                           // the swizzle: row % 8
  q.slot = ptx_smem_addr(smem + ggx_plan::C_OFFSET) + r * 64 + 16 * c;
  q.bt = ptx_smem_addr(smem + ggx_plan::A_BYTES) + r * MOK_TP_ROW_BYTES;
  q.u0 = 16 * ((2 * c) ^ x);
  q.u1 = 16 * ((2 * c + 1) ^ x);
  // SwiGLU: warpgroup 1's rows are up rows, the same B rows as warpgroup 0's gate rows.
  const int64_t brow = (int64_t)group * p.n + n0 + (swiglu ? r - 128 * cw : r);
  const uint8_t *sc1 = swiglu && cw ? p.b2_e8m0 : p.b_e8m0;
  q.s1 = sc1 + brow * p.kq1 + (c >> 1);
  q.s2 = p.kq2 > 0 ? p.b2_e8m0 + brow * p.kq2 + (c >> 1) : q.s1;
  q.step1 = 32 * p.kq1;
  q.step2 = 32 * p.kq2;
  q.k_split = p.k_split;
  q.valid = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) q.valid |= (brow + 32 * i < p.b_rows ? 1u : 0u) << i;
  return q;
}

template <int EPI>
__global__ void __launch_bounds__(MOK_TP_THREADS, 1)
    gg_mx_kernel(const __grid_constant__ gg_kernel_params_t p,
                 const __grid_constant__ CUtensorMap tm_a,   // A [M_total, K] bf16, box [128, 64]
                 const __grid_constant__ CUtensorMap tm_b,   // B [G N, K] e4m3, box [128, 64 B]
                 const __grid_constant__ CUtensorMap tm_b2,  // up (SwiGLU) or B2 [G N, K2], or
                                                             // = tm_b
                 const __grid_constant__ CUtensorMap tm_a2,  // A2 [M_total, K2], or = tm_a
                 const __grid_constant__ CUtensorMap tm_c)   // C [M_total, N] bf16, box [64, 64]
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  typedef ggx_plan P;
  constexpr int SWIGLU = EPI == MOK_GG_EPI_SWIGLU;
  extern __shared__ uint8_t smem_raw[];
  uint64_t *full, *empty;
  uint8_t *smem = tp_kernel_start<P>(smem_raw, &full, &empty, &tm_a, &tm_b, &tm_b2,
                                     p.k_blocks > p.k_split ? &tm_a2 : NULL);
  const int wg = threadIdx.x / 128;
  gg_sched_t sched = gg_sched_init(p.offsets, p.offsets_int64, p.num_groups, p.m_total,
                                   p.n_tiles, p.group_m, GG_BM, p.bn_out);
  tp_ring_t ring = {0, 0};
  gg_tile_t tile;

  if (wg == 0) {
    ptx_setmaxnreg_dec<GG_PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      while (gg_sched_next(&sched, &tile)) {
        const int row = tile.group * p.n + tile.n0;  // the tile's first row of B
        ptx_mbar_wait(&empty[ring.stage], ring.phase ^ 1u);
        tp_post_tag<P>(full, ring.stage, gg_tag(tile));
        for (int kb = 0; kb < p.k_blocks; kb++) {
          ptx_mbar_wait(&empty[ring.stage], ring.phase ^ 1u);
          uint8_t *a_tile = smem + ring.stage * P::STAGE_BYTES;
          uint8_t *slot = smem + P::C_OFFSET + ring.stage * GGX_SLOT_BYTES;
          uint64_t *bar = &full[ring.stage];
          const bool second = kb >= p.k_split;
          const int kx = (second ? kb - p.k_split : kb) * GG_BK_BF16;
          const CUtensorMap *mb = second ? &tm_b2 : &tm_b;
          ptx_mbar_arrive_expect_tx(bar, P::A_BYTES + GGX_SLOT_BYTES);
          ptx_tma_load_2d(a_tile, second ? &tm_a2 : &tm_a, bar, kx, tile.row0);
          ptx_tma_load_2d(slot, SWIGLU ? &tm_b : mb, bar, kx, row);
          ptx_tma_load_2d(slot + GGX_SLOT_BYTES / 2, SWIGLU ? &tm_b2 : mb, bar, kx,
                          SWIGLU ? row : row + 128);
          tp_ring_advance<GGX_STAGES>(&ring);
        }
      }
      gg_post_end<P>(&ring, full, empty);
    }
  } else {
    ptx_setmaxnreg_inc<GG_CONSUMER_REGS>();
    const int cw = wg - 1, lt = threadIdx.x & 127;
    constexpr int STAGED = EPI != MOK_GG_EPI_STORE_F32;
    uint8_t *stage_c = smem + P::C_OFFSET + GGX_SLOTS_BYTES + cw * GGX_STAGING_BYTES;
    float acc[128];
    const int4 *tags = gg_tags<P>(smem_raw, smem);
    while (gg_peek(&ring, full, tags, &tile)) {
      epi_coords_t e = epi_coords(tile.row0, tile.row_end, tile.n0, p.n, p.n, cw);
      float2 w = make_float2(1.0f, 1.0f);
      if (SWIGLU) w = epi_row_scales(p.row_scale, e);
      const ggx_prep prep = ggx_prep_make(p, SWIGLU, smem, tile.group, tile.n0, cw, lt);
      // never idle: the other warpgroup needs this one's half of every stage's conversion
      tp_consume_tile_bf16_n256<GG_BM, GGX_STAGES, GGX_SLOTS_BYTES + 2 * GGX_STAGING_BYTES, 0,
                                tp_no_hook, tp_no_hook, ggx_prep>(
          &ring, smem, full, empty, p.k_blocks, cw, false, acc, tp_no_hook(), tp_no_hook(), prep);
      const int wg_row0 = tile.row0 + 64 * cw;
      const bool staged = STAGED && wg_row0 + 64 <= tile.row_end &&
                          (EPI != MOK_GG_EPI_SWIGLU || (!p.g_out && !p.u_out));
      if (staged) {  // one buffer: each round waits until the copy engine has read the last
        gg_store_staged<EPI, 0, 0>(acc, stage_c, &tm_c, w, tile.n0, p.n, wg_row0, cw, lt);
        if (EPI == MOK_GG_EPI_STORE_BF16)
          gg_store_staged<EPI, 1, 0>(acc, stage_c, &tm_c, w, tile.n0, p.n, wg_row0, cw, lt);
      } else if (EPI == MOK_GG_EPI_STORE_BF16)
        epi_store_bf16<128>(acc, (__nv_bfloat16 *)p.c, e);
      else if (EPI == MOK_GG_EPI_STORE_F32)
        epi_store_f32<128, false>(acc, (float *)p.c, e);
      else
        epi_store_swiglu<128>(acc, (__nv_bfloat16 *)p.c, (__nv_bfloat16 *)p.g_out,
                              (__nv_bfloat16 *)p.u_out, w, e);
    }
    if (STAGED && lt == 0) ptx_bulk_wait_group_all();  // stores done before the CTA retires
  }
#endif
}

template <int EPI>
static cudaError_t gg_launch_mx(const gg_kernel_params_t *kp, const gg_maps_t *m, int grid,
                                cudaStream_t stream) {
  static_assert(ggx_plan::ALLOC_BYTES + ggx_plan::TAGS_BYTES <= 227 * 1024, "shared memory");
  return gg_launch(gg_mx_kernel<EPI>, ggx_plan::ALLOC_BYTES + ggx_plan::TAGS_BYTES, kp, m, grid,
                   stream);
}

// e4m3 [rows, cols], box [128 rows, 64 bytes] without swizzle: the MXFP8 B stage halves.
static inline int ggx_encode_b(CUtensorMap *map, const void *base, uint64_t rows, uint64_t cols) {
  return tma_encode_2d(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rows, cols, 128, 64,
                       CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// The launcher's MXFP8-B part (validated by gg_validate), kp filled as for bf16.
static mokResult_t gg_run_mx(const mok_grouped_gemm_params_t *p, gg_kernel_params_t *kp, int grid,
                             cudaStream_t s) {
  const int swiglu = p->epilogue == MOK_GG_EPI_SWIGLU, second = p->k2 > 0;
  const uint64_t rows_b = (uint64_t)(p->num_groups * p->n);
  kp->b_e8m0 = p->b_e8m0;
  kp->b2_e8m0 = p->b2_e8m0;
  kp->b_rows = (int64_t)rows_b;
  kp->kq1 = (int)(p->k / 32);
  kp->kq2 = (int)(p->k2 / 32);
  gg_maps_t m;
  if (tma_encode_bf16_sw128(&m.a, p->a, (uint64_t)p->m_total, (uint64_t)p->k, GG_BM) ||
      ggx_encode_b(&m.b, p->b, rows_b, (uint64_t)p->k))
    return MOK_ERROR_CUDA;
  m.a2 = m.a, m.b2 = m.b, m.c = m.a;  // unused unless SwiGLU, a second segment, bf16 output
  if (p->epilogue != MOK_GG_EPI_STORE_F32 &&
      tma_encode_bf16_sw128(&m.c, p->c, (uint64_t)p->m_total, (uint64_t)p->n, 64))
    return MOK_ERROR_CUDA;
  if (swiglu && ggx_encode_b(&m.b2, p->b2, rows_b, (uint64_t)p->k)) return MOK_ERROR_CUDA;
  if (second &&
      (tma_encode_bf16_sw128(&m.a2, p->a2, (uint64_t)p->m_total, (uint64_t)p->k2, GG_BM) ||
       ggx_encode_b(&m.b2, p->b2, rows_b, (uint64_t)p->k2)))
    return MOK_ERROR_CUDA;
  const cudaError_t err = swiglu ? gg_launch_mx<MOK_GG_EPI_SWIGLU>(kp, &m, grid, s)
                          : p->epilogue == MOK_GG_EPI_STORE_F32
                              ? gg_launch_mx<MOK_GG_EPI_STORE_F32>(kp, &m, grid, s)
                              : gg_launch_mx<MOK_GG_EPI_STORE_BF16>(kp, &m, grid, s);
  return err == cudaSuccess ? MOK_SUCCESS : MOK_ERROR_CUDA;
}

#endif /* MOK_CUDA_GROUPED_GEMM_MX_CUH */
