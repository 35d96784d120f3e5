/*
 * tile/epilogue.cuh: what a consumer warpgroup does with its fp32 accumulator tile.
 *
 * Fragment layout of wgmma m64nN with fp32 accumulators, per warpgroup thread t (warp w = t / 32,
 * lane l): acc[4j + e] holds row 16w + l/4 + 8(e/2) and column 8j + 2(l%4) + (e%2) of the
 * warpgroup's [64, N] tile. So each thread owns pairs of adjacent columns, and the column pair j
 * and j + N/2 (gate and up of the same output column in SwiGLU) sit in the same thread.
 *
 * Stores are masked: rows at or past the group's end and columns at or past N are never written,
 * so rows outside every group keep whatever the caller had there.
 */
#ifndef MOK_CUDA_GEMM_EPILOGUE_CUH
#define MOK_CUDA_GEMM_EPILOGUE_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda/ptx/ptx.cuh"

// Where a warpgroup's [64, NCOLS] piece of the tile lands in C.
typedef struct {
  int64_t row;      // first row of this thread's fragment: tile row0 + 64 wg + 16 warp + lane / 4
  int64_t row_end;  // rows >= row_end are not stored
  int col;          // first column of this thread: tile n0 + 2 (lane % 4)
  int n;            // columns >= n are not stored
  int64_t ldc;      // row stride of C in elements
} epi_coords_t;

__device__ __forceinline__ epi_coords_t epi_coords(int64_t row0, int64_t row_end, int n0, int n,
                                                   int64_t ldc, int wg) {
  const int t = threadIdx.x & 127;
  epi_coords_t e;
  e.row = row0 + 64 * wg + 16 * (t / 32) + (t & 31) / 4;
  e.row_end = row_end;
  e.col = n0 + 2 * (t & 3);
  e.n = n;
  e.ldc = ldc;
  return e;
}

// silu(g) = g / (1 + e^-g) with the fast exponential and divide (a few ulp; the result is rounded
// to bf16). For g < -88, e^-g is inf and __fdividef returns 0, the limit.
// The exponential is ex2.approx.ftz(-g log2 e): an FMUL and a MUFU.EX2. __expf (ex2.approx
// without .ftz) adds three instructions per element to rescale results below 2^-126, which here
// only ever get added to 1: the same bits with fewer instructions (docs/performance.md,
// "Grouped GEMM: the SwiGLU epilogue").
__device__ __forceinline__ float epi_silu(float g) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  return __fdividef(g, 1.0f + e);
}

// Router weights of this thread's two rows (1 where there is no row or no weight array). Loaded
// before the tile's mainloop so that the global-load latency hides behind the MMA. Read at L2:
// under expert parallelism the fused forward reads weights that other GPUs wrote during the
// launch (forward/fused_ep.cuh), and L1 is not coherent with their stores.
__device__ __forceinline__ float2 epi_row_scales(const float *row_scale, epi_coords_t e) {
  float2 w = make_float2(1.0f, 1.0f);
  if (row_scale) {
    if (e.row < e.row_end) w.x = __ldcg(row_scale + e.row);
    if (e.row + 8 < e.row_end) w.y = __ldcg(row_scale + e.row + 8);
  }
  return w;
}

// c [.., ldc] bf16 = bf16(acc), NACC accumulators = NACC / 4 column chunks of 8.
template <int NACC>
__device__ __forceinline__ void epi_store_bf16(const float (&acc)[NACC], __nv_bfloat16 *c,
                                               epi_coords_t e) {
  const bool r0 = e.row < e.row_end, r1 = e.row + 8 < e.row_end;
  __nv_bfloat16 *p0 = c + e.row * e.ldc;
  __nv_bfloat16 *p1 = p0 + 8 * e.ldc;
#pragma unroll
  for (int j = 0; j < NACC / 4; j++) {
    const int col = e.col + 8 * j;
    if (col < e.n) {
      if (r0) *(__nv_bfloat162 *)(p0 + col) = __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
      if (r1) *(__nv_bfloat162 *)(p1 + col) = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
}

// c fp32 = acc (ACCUM = false) or c += acc (ACCUM = true). One writer per element: deterministic.
template <int NACC, bool ACCUM>
__device__ __forceinline__ void epi_store_f32(const float (&acc)[NACC], float *c, epi_coords_t e) {
  const bool r0 = e.row < e.row_end, r1 = e.row + 8 < e.row_end;
  float *p0 = c + e.row * e.ldc;
  float *p1 = p0 + 8 * e.ldc;
#pragma unroll
  for (int j = 0; j < NACC / 4; j++) {
    const int col = e.col + 8 * j;
    if (col < e.n) {
      float2 v0 = make_float2(acc[4 * j], acc[4 * j + 1]);
      float2 v1 = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
      if (ACCUM) {
        if (r0) {
          float2 o = *(float2 *)(p0 + col);
          v0.x += o.x;
          v0.y += o.y;
        }
        if (r1) {
          float2 o = *(float2 *)(p1 + col);
          v1.x += o.x;
          v1.y += o.y;
        }
      }
      if (r0) *(float2 *)(p0 + col) = v0;
      if (r1) *(float2 *)(p1 + col) = v1;
    }
  }
}

// a = bf16(w · silu(g) · u) of two adjacent columns, lo in the low half: every SwiGLU epilogue's.
__device__ __forceinline__ __nv_bfloat162 epi_swiglu_a2(float w, float g0, float g1, float u0,
                                                        float u1) {
  return __floats2bfloat162_rn(w * epi_silu(g0) * u0, w * epi_silu(g1) * u1);
}

// SwiGLU (docs/design.md, "The layer"): the accumulator holds g in columns [0, N/2) and u in
// [N/2, N) of the same output columns; a = bf16(w_row · silu(g) · u) with fp32 g and u (a_out:
// NULL when the caller stores a itself), plus optional bf16 g and u. w: this thread's router
// weights (epi_row_scales).
template <int NACC>
__device__ __forceinline__ void epi_store_swiglu(const float (&acc)[NACC], __nv_bfloat16 *a_out,
                                                 __nv_bfloat16 *g_out, __nv_bfloat16 *u_out,
                                                 float2 w, epi_coords_t e) {
  constexpr int HALF = NACC / 8;  // column chunks per half
  const bool r0 = e.row < e.row_end, r1 = e.row + 8 < e.row_end;
  const float w0 = w.x, w1 = w.y;
  const int64_t o0 = e.row * e.ldc, o1 = o0 + 8 * e.ldc;
#pragma unroll
  for (int j = 0; j < HALF; j++) {
    const int col = e.col + 8 * j;
    if (col < e.n) {
      const float g00 = acc[4 * j], g01 = acc[4 * j + 1], g10 = acc[4 * j + 2], g11 = acc[4 * j + 3];
      const int ju = j + HALF;
      const float u00 = acc[4 * ju], u01 = acc[4 * ju + 1], u10 = acc[4 * ju + 2],
                  u11 = acc[4 * ju + 3];
      if (r0) {
        if (a_out) *(__nv_bfloat162 *)(a_out + o0 + col) = epi_swiglu_a2(w0, g00, g01, u00, u01);
        if (g_out) *(__nv_bfloat162 *)(g_out + o0 + col) = __floats2bfloat162_rn(g00, g01);
        if (u_out) *(__nv_bfloat162 *)(u_out + o0 + col) = __floats2bfloat162_rn(u00, u01);
      }
      if (r1) {
        if (a_out) *(__nv_bfloat162 *)(a_out + o1 + col) = epi_swiglu_a2(w1, g10, g11, u10, u11);
        if (g_out) *(__nv_bfloat162 *)(g_out + o1 + col) = __floats2bfloat162_rn(g10, g11);
        if (u_out) *(__nv_bfloat162 *)(u_out + o1 + col) = __floats2bfloat162_rn(u10, u11);
      }
    }
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* Staged stores: registers -> swizzled shared memory -> TMA bulk store                           */
/* ---------------------------------------------------------------------------------------------- */
// A warpgroup whose 64 rows all belong to the group writes its bf16 [64, NCOLS] piece into a
// staging area laid out as NCOLS / 64 chunks of [64 rows, 128 B] with the 128-byte swizzle (the
// layout a TMA map with CU_TENSOR_MAP_SWIZZLE_128B and box [64, 64] reads), then one thread issues
// the bulk stores and goes on: the stores drain while the warpgroup runs the next tile's MMA.
// With the swizzle, the 32 lanes of a warp (8 rows x 4 words of one 16-byte unit) hit 32
// different banks. Columns at or past N are skipped by the TMA unit (tensor bounds).

__device__ __forceinline__ uint32_t epi_pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *(uint32_t *)&v;
}

__device__ __forceinline__ void epi_st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// Shared address of this thread's first pair in the staging area: row rr0 = 16 warp + lane / 4,
// byte 4 (lane % 4) of a 16-byte unit. The pair of column chunk j (8 columns) and row rr0 + 8h
// then sits at epi_stage_addr(base, j) + 1024 h: unit j % 8 of row rr0 is swizzled to
// (j % 8) ^ (rr0 % 8), and since base has zeros in bits 4-6 that is one XOR with a constant.
__device__ __forceinline__ uint32_t epi_stage_base(const uint8_t *stage) {
  const int t = threadIdx.x & 127, rr0 = 16 * (t / 32) + (t & 31) / 4;
  return ptx_smem_addr(stage) + rr0 * 128 + ((rr0 & 7) << 4) + 4 * (t & 3);
}
__device__ __forceinline__ uint32_t epi_stage_addr(uint32_t base, int j) {
  return (base ^ (uint32_t)((j & 7) << 4)) + (uint32_t)((j >> 3) * 8192);
}

// Column chunks [J0, J0 + NJ) of the fragment (8 columns each) -> staging, bf16.
template <int NACC, int J0, int NJ>
__device__ __forceinline__ void epi_stage_bf16(const float (&acc)[NACC], const uint8_t *stage) {
  static_assert(J0 >= 0 && NJ > 0 && J0 + NJ <= NACC / 4, "chunk range");
  const uint32_t base = epi_stage_base(stage);
#pragma unroll
  for (int j = J0; j < J0 + NJ; j++) {
    const uint32_t addr = epi_stage_addr(base, j - J0);
    epi_st_shared_u32(addr, epi_pack_bf16x2(acc[4 * j], acc[4 * j + 1]));
    epi_st_shared_u32(addr + 1024, epi_pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]));
  }
}

// SwiGLU into staging: a = bf16(w · silu(g) · u); g in chunks [0, NACC/8), u in [NACC/8, NACC/4).
// All 64 rows of the warpgroup are in the group here.
template <int NACC>
__device__ __forceinline__ void epi_stage_swiglu(const float (&acc)[NACC], const uint8_t *stage,
                                                 float2 w) {
  constexpr int HALF = NACC / 8;
  const uint32_t base = epi_stage_base(stage);
  const float w0 = w.x, w1 = w.y;
#pragma unroll
  for (int j = 0; j < HALF; j++) {
    const int ju = j + HALF;
    const uint32_t addr = epi_stage_addr(base, j);
    epi_st_shared_u32(addr, epi_pack_bf16x2(w0 * epi_silu(acc[4 * j]) * acc[4 * ju],
                                            w0 * epi_silu(acc[4 * j + 1]) * acc[4 * ju + 1]));
    epi_st_shared_u32(addr + 1024, epi_pack_bf16x2(w1 * epi_silu(acc[4 * j + 2]) * acc[4 * ju + 2],
                                                   w1 * epi_silu(acc[4 * j + 3]) * acc[4 * ju + 3]));
  }
}

// fp32 staging: column chunks [J0, J0 + 16) of a [64, 256] fragment (128 columns) as 4 chunks of
// [64 rows, 32 columns] = [64][128 B] with the 128-byte swizzle (32 KB; what a TMA map of fp32 with
// box [64, 32] reads). The pair of column chunk j sits at byte 32 ((j - J0) % 4) + 8 (lane % 4) of
// its row in fp32 chunk (j - J0) / 4, i.e. 16-byte unit 2 ((j - J0) % 4) + (lane % 4) / 2; with the
// swizzle's XOR by the row (mod 8) the 32 lanes' 8-byte stores fill two wavefronts, the minimum.
__device__ __forceinline__ void epi_st_shared_f32x2(uint32_t addr, float lo, float hi) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(lo), "f"(hi) : "memory");
}
template <int J0>
__device__ __forceinline__ void epi_stage_f32(const float (&acc)[128], const uint8_t *stage) {
  static_assert(J0 == 0 || J0 == 16, "one half of the [64, 256] fragment");
  const int t = threadIdx.x & 127, rr0 = 16 * (t / 32) + (t & 31) / 4, q = t & 3;
  // bits 4-6 of the row's address are zero, so the swizzled unit is one XOR away
  const uint32_t base = (ptx_smem_addr(stage) + rr0 * 128 + 8 * (q & 1)) |
                        (uint32_t)((((q >> 1) ^ rr0) & 7) << 4);
#pragma unroll
  for (int j = J0; j < J0 + 16; j++) {
    const int jj = j - J0;
    const uint32_t addr = (base ^ (uint32_t)((jj & 3) << 5)) + (uint32_t)((jj >> 2) * 8192);
    epi_st_shared_f32x2(addr, acc[4 * j], acc[4 * j + 1]);
    epi_st_shared_f32x2(addr + 1024, acc[4 * j + 2], acc[4 * j + 3]);  // row + 8: same swizzle
  }
}

// Staged store of 128 columns of a consumer warpgroup's [64, 256] accumulator (NACC = 128; the
// fp8 kernel's [64, 128] one: NACC = 64): column chunks [J0, J0 + 16) of the fragment
// (SWIGLU = 0), or the SwiGLU of g in chunks 0-15 and u in chunks 16-31 with router weights w
// (SWIGLU = 1, J0 = 0, NACC = 128). bf16: registers -> swizzled staging [2 chunks][64 rows][128 B]
// (16 KB) -> two TMA bulk stores of [64, 64] at (col + 64 ch, row0) of the map; F32 (NACC = 128,
// SWIGLU = 0): epi_stage_f32's [4 chunks][64 rows][128 B] (32 KB) -> four bulk stores of [64, 32]
// at (col + 32 ch, row0) of an fp32 map. Committed as one bulk group; chunks at or past column n
// are skipped (TMA clips the rest at the map's bounds).
// bar_id: a named barrier of this warpgroup's 128 threads; lt: the thread within it (0 issues).
// NOTE: the staging buffer may still be read by earlier bulk stores of the issuing thread: with
// WAIT >= 0 that thread first waits until at most WAIT of its latest bulk groups still read shared
// memory (those must use other buffers), then the warpgroup meets; WAIT = -1 when nothing earlier
// reads this buffer. Ordinary shared-memory stores need the proxy fence before the copy engine
// reads them.
template <int J0, int SWIGLU, int WAIT, int NACC, int F32 = 0>
__device__ __forceinline__ void epi_store_staged(const float (&acc)[NACC], uint8_t *stage_c,
                                                 const CUtensorMap *tm_c, float2 w, int col, int n,
                                                 int row0, int bar_id, int lt) {
  static_assert(!SWIGLU || (J0 == 0 && NACC == 128), "SwiGLU reads g and u from all 32 chunks");
  static_assert(!F32 || (!SWIGLU && NACC == 128), "fp32: half of a [64, 256] fragment");
  constexpr int BOX = F32 ? 32 : 64, STORES = 128 / BOX;  // columns per bulk store, stores
  if (WAIT >= 0) {
    if (lt == 0) ptx_bulk_wait_group_read<WAIT < 0 ? 0 : WAIT>();
    ptx_named_barrier_sync(bar_id, 128);
  }
  if constexpr (F32)
    epi_stage_f32<J0>(acc, stage_c);
  else if (SWIGLU)
    epi_stage_swiglu<NACC>(acc, stage_c, w);
  else
    epi_stage_bf16<NACC, J0, 16>(acc, stage_c);
  ptx_fence_proxy_async_smem();
  ptx_named_barrier_sync(bar_id, 128);
  if (lt == 0) {
#pragma unroll
    for (int ch = 0; ch < STORES; ch++)
      if (col + BOX * ch < n) ptx_tma_store_2d(tm_c, stage_c + ch * 8192, col + BOX * ch, row0);
    ptx_bulk_commit_group();
  }
}

// Output columns [col0 + 128 H, col0 + 128 H + 128) of a plain [64, 256] tile (half H).
template <int H, int WAIT>
__device__ __forceinline__ void epi_store_staged_bf16(const float (&acc)[128], uint8_t *stage_c,
                                                      const CUtensorMap *tm_c, int col0, int n,
                                                      int row0, int bar_id, int lt) {
  epi_store_staged<16 * H, 0, WAIT>(acc, stage_c, tm_c, make_float2(1.0f, 1.0f), col0 + 128 * H,
                                    n, row0, bar_id, lt);
}

// The same in fp32 (an fp32 map, box [64, 32]). Both halves use the same 32 KB buffer: each first
// waits until the copy engine has read the previous one.
template <int H>
__device__ __forceinline__ void epi_store_staged_f32(const float (&acc)[128], uint8_t *stage_c,
                                                     const CUtensorMap *tm_c, int col0, int n,
                                                     int row0, int bar_id, int lt) {
  epi_store_staged<16 * H, 0, 0, 128, 1>(acc, stage_c, tm_c, make_float2(1.0f, 1.0f),
                                         col0 + 128 * H, n, row0, bar_id, lt);
}

#endif /* MOK_CUDA_GEMM_EPILOGUE_CUH */
