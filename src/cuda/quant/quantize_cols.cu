/*
 * quantize_cols.cu: the operands of the fp8-block weight gradients (quant.h,
 * mok_wgrad_padded_offsets_launch and mok_quantize_cols_launch).
 *
 * A weight gradient reduces over an expert's rows (dWd[e] = dy_eᵀ · a_e), so its fp8 operands are
 * the activations quantized along the rows, in blocks of 128 rows of one group, and stored
 * transposed (fp8 wgmma reads both operands K-major): x [R, n] bf16 -> q [n, ld] e4m3 with group
 * g's rows at columns [padded[g], padded[g + 1]) of q, padded[g] the exclusive prefix sum of the
 * groups' row counts rounded up to 128. A K block of the GEMM is then one scale block of one group,
 * and the columns past a group's rows hold zeros, so its last block adds exactly nothing.
 *
 * One CTA of 256 threads per (block of 128 padded rows, 64 columns): the bf16 [128, 64] tile into
 * shared memory (16-byte loads along the rows), each column's amax by four threads (32 rows
 * each, lanes on consecutive columns so every shared read is one 64-byte run), the values
 * converted as the rows kernel converts them (quant_block_e4m3x2, quantize.cuh) into a transposed
 * e4m3 tile [64 columns][128 bytes], then 128-byte runs of q and 64 contiguous scales out.
 *
 * NOTE: no -ftz / --use_fast_math for this file (quantize.cuh says why).
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "common/status.h"
#include "cuda/quant/quant.h"
#include "cuda/quant/quantize.cuh"
#include "cuda/tile/scheduler.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's quantizer targets sm_90a (Hopper) and newer"
#endif

enum {
  QCOL_THREADS = 256,
  QCOL_ROWS = 128,                        // rows of a block (the GEMM's K block)
  QCOL_COLS = 64,                         // columns of a CTA's tile
  QCOL_QUARTER = QCOL_ROWS / 4,           // rows per thread: 4 threads share a column
  QCOL_Q_PITCH = QCOL_ROWS + 16,          // bytes per transposed row: 16-byte aligned, and 8
                                          // lanes' 16-byte stores 144 bytes apart hit 32 banks
  QCOL_SCAN_THREADS = 1024,
};
static_assert(4 * QCOL_COLS == QCOL_THREADS, "four threads per column");
static_assert(QCOL_Q_PITCH % 16 == 0, "16-byte rows of the transposed tile");

typedef struct {
  const uint4 *x;         // [m_total, n / 8] of 8 bf16
  int64_t m_total, n;
  const void *offsets;    // [G + 1], device
  int offsets_int64;
  int num_groups;
  const int32_t *padded;  // [G + 1], device
  uint8_t *q;             // [n, ld]
  float *scales;          // [ld / 128, n]
  int64_t ld;
  int64_t blocks;         // ld / 128: padded row blocks the grid covers (those past padded[G]
                          // have nothing to do)
  int64_t chunks;         // n / 64
  mok_quant_scale_t kind;
} quant_cols_t;

// The group whose padded rows hold padded row p < padded[G]: the last g with padded[g] <= p
// (empty groups before it share its start).
__device__ __forceinline__ int quant_cols_group(const int32_t *padded, int num_groups, int32_t p) {
  int lo = 0, hi = num_groups;  // padded[lo] <= p < padded[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (padded[mid] <= p) lo = mid;
    else hi = mid;
  }
  return lo;
}

__global__ void __launch_bounds__(QCOL_THREADS)
    quant_cols_kernel(const __grid_constant__ quant_cols_t p) {
  __shared__ __align__(16) uint16_t in[QCOL_ROWS * QCOL_COLS];     // [128 rows][64 cols] bf16
  __shared__ __align__(16) uint8_t qt[QCOL_COLS * QCOL_Q_PITCH];   // [64 cols][128 rows] e4m3
  __shared__ uint32_t red[4][QCOL_COLS];                           // amax of each quarter
  const int t = (int)threadIdx.x;
  const int32_t total = p.padded[p.num_groups];
  for (int64_t u = blockIdx.x; u < p.blocks * p.chunks; u += gridDim.x) {
    const int64_t jb = u / p.chunks, c0 = (u - jb * p.chunks) * QCOL_COLS;
    const int32_t prow = (int32_t)(jb * QCOL_ROWS);
    if (prow >= total) break;  // u grows: every later unit is past the groups too
    const int g = quant_cols_group(p.padded, p.num_groups, prow);
    int lo, hi;
    gg_group_rows(p.offsets, p.offsets_int64, g, p.m_total, &lo, &hi);
    const int64_t src0 = lo + (prow - p.padded[g]);        // the block's first source row
    const int valid = (int)min((int64_t)QCOL_ROWS, hi - src0);  // 1..128

    // 1. the tile: row r, 16-byte unit k (columns 8k .. 8k + 7); rows past the group read as 0
#pragma unroll
    for (int i = t; i < QCOL_ROWS * QCOL_COLS / 8; i += QCOL_THREADS) {
      const int r = i / (QCOL_COLS / 8), k = i % (QCOL_COLS / 8);
      const uint4 v = r < valid ? p.x[(src0 + r) * (p.n / 8) + c0 / 8 + k] : make_uint4(0, 0, 0, 0);
      *(uint4 *)&in[r * QCOL_COLS + 8 * k] = v;
    }
    __syncthreads();

    // 2. column c's quarter h: amax, then the block's scale from all four quarters
    const int c = t % QCOL_COLS, h = t / QCOL_COLS, r0 = QCOL_QUARTER * h;
    float v[QCOL_QUARTER];
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < QCOL_QUARTER; i++) {
      v[i] = quant_bf16_to_float(in[(r0 + i) * QCOL_COLS + c]);
      m = max(m, quant_abs_bits(v[i]));
    }
    red[h][c] = m;
    __syncthreads();
    m = max(max(red[0][c], red[1][c]), max(red[2][c], red[3][c]));
    const quant_block_t b = quant_block_make(m, p.kind);
    uint32_t w[QCOL_QUARTER / 4];
#pragma unroll
    for (int i = 0; i < QCOL_QUARTER / 4; i++) {
      const int r = r0 + 4 * i;  // rows r .. r + 3 in bytes 0 .. 3; rows past the group: 0
      uint32_t x4 = quant_block_e4m3x2(b, v[4 * i], v[4 * i + 1]) |
                    quant_block_e4m3x2(b, v[4 * i + 2], v[4 * i + 3]) << 16;
      if (r + 4 > valid) x4 = r >= valid ? 0u : x4 & (0xFFFFFFFFu >> (8 * (r + 4 - valid)));
      w[i] = x4;
    }
#pragma unroll
    for (int i = 0; i < QCOL_QUARTER / 16; i++)
      *(uint4 *)&qt[c * QCOL_Q_PITCH + r0 + 16 * i] =
          make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    if (h == 0) p.scales[jb * p.n + c0 + c] = b.scale;
    __syncthreads();

    // 3. q: column c's 128 bytes at q[c0 + c, prow], eight threads per column
#pragma unroll
    for (int i = t; i < QCOL_COLS * QCOL_ROWS / 16; i += QCOL_THREADS) {
      const int cc = i / (QCOL_ROWS / 16), k = i % (QCOL_ROWS / 16);
      *(uint4 *)(p.q + (c0 + cc) * p.ld + prow + 16 * k) =
          *(const uint4 *)&qt[cc * QCOL_Q_PITCH + 16 * k];
    }
    // The next unit writes `in` after this sync's readers are done (its first sync orders the
    // reads of qt above before the next unit's writes of qt).
  }
}

// padded[g + 1] = padded[g] + round_up(rows of g, 128), padded[0] = 0; one CTA, the groups in
// chunks of 1024 (a block-wide inclusive scan per chunk, carried over).
__global__ void __launch_bounds__(QCOL_SCAN_THREADS)
    quant_padded_offsets_kernel(const void *offsets, int offsets_int64, int num_groups,
                                int64_t m_total, int32_t *padded) {
  __shared__ int32_t warp_sum[QCOL_SCAN_THREADS / 32];
  const int t = (int)threadIdx.x, lane = t % 32, warp = t / 32;
  int32_t carry = 0;
  if (t == 0) padded[0] = 0;
  for (int base = 0; base < num_groups; base += QCOL_SCAN_THREADS) {
    const int g = base + t;
    int32_t len = 0;
    if (g < num_groups) {
      int lo, hi;
      gg_group_rows(offsets, offsets_int64, g, m_total, &lo, &hi);
      len = (hi - lo + QCOL_ROWS - 1) / QCOL_ROWS * QCOL_ROWS;
    }
    int32_t s = len;  // inclusive scan within the warp
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int32_t y = __shfl_up_sync(0xFFFFFFFFu, s, o);
      if (lane >= o) s += y;
    }
    if (lane == 31) warp_sum[warp] = s;
    __syncthreads();
    int32_t before = carry;
    for (int w = 0; w < warp; w++) before += warp_sum[w];
    if (g < num_groups) padded[g + 1] = before + s;
    int32_t chunk = 0;
    for (int w = 0; w < QCOL_SCAN_THREADS / 32; w++) chunk += warp_sum[w];
    carry += chunk;
    __syncthreads();  // warp_sum is rewritten by the next chunk
  }
}

static mokResult_t quant_cols_launched(const char *fn) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver
                              ? MOK_ERROR_NO_DEVICE : MOK_ERROR_CUDA,
                    "%s: kernel launch: %s", fn, cudaGetErrorString(e));
  return MOK_SUCCESS;
}

static mokResult_t quant_cols_check_groups(const char *fn, const void *offsets, int offsets_int64,
                                           int64_t num_groups, int64_t m_total) {
  if (!offsets) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: offsets is NULL", fn);
  if (offsets_int64 != 0 && offsets_int64 != 1)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "%s: offsets_int64 %d", fn, offsets_int64);
  if (num_groups < 1 || num_groups > MOK_GG_MAX_GROUPS || m_total < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "%s: %lld groups, %lld rows", fn,
                    (long long)num_groups, (long long)m_total);
  if (mok_wgrad_padded_rows_max(m_total, num_groups) >= ((int64_t)1 << 31))
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "%s: %lld rows in %lld groups pad to more than 2^31 rows", fn,
                    (long long)m_total, (long long)num_groups);
  if ((uintptr_t)offsets & (offsets_int64 ? 7u : 3u))
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "%s: offsets misaligned", fn);
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_wgrad_padded_offsets_launch(const void *offsets, int offsets_int64,
                                                       int64_t num_groups, int64_t m_total,
                                                       int32_t *padded, void *stream) {
  const char *fn = "mok_wgrad_padded_offsets_launch";
  mokResult_t r = quant_cols_check_groups(fn, offsets, offsets_int64, num_groups, m_total);
  if (r != MOK_SUCCESS) return r;
  if (!padded) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: padded is NULL", fn);
  if ((uintptr_t)padded & 3u) return mok_fail(NULL, MOK_ERROR_MISALIGNED, "%s: padded", fn);
  quant_padded_offsets_kernel<<<1, QCOL_SCAN_THREADS, 0, (cudaStream_t)stream>>>(
      offsets, offsets_int64, (int)num_groups, m_total, padded);
  return quant_cols_launched(fn);
}

extern "C" mokResult_t mok_quantize_cols_launch(const mok_quantize_cols_params_t *p,
                                                void *stream) {
  const char *fn = "mok_quantize_cols_launch";
  if (!p) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: params is NULL", fn);
  mokResult_t r = quant_cols_check_groups(fn, p->offsets, p->offsets_int64, p->num_groups,
                                          p->m_total);
  if (r != MOK_SUCCESS) return r;
  if (!p->x || !p->padded || !p->q || !p->scales)
    return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: x, padded, q or scales is NULL", fn);
  if (p->kind != MOK_QUANT_FP32_SCALE && p->kind != MOK_QUANT_POW2_SCALE)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "%s: scale kind %d (FP32 or POW2)", fn,
                    (int)p->kind);
  if (p->n < QCOL_COLS || p->n % QCOL_COLS != 0 || p->n >= ((int64_t)1 << 31))
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "%s: n = %lld, a multiple of 64", fn,
                    (long long)p->n);
  const int64_t need = mok_wgrad_padded_rows_max(p->m_total, p->num_groups);
  if (p->ld % QCOL_ROWS != 0 || p->ld < need)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "%s: ld = %lld, a multiple of 128 of at least %lld (%lld rows, %lld groups)",
                    fn, (long long)p->ld, (long long)need, (long long)p->m_total,
                    (long long)p->num_groups);
  if (((uintptr_t)p->x | (uintptr_t)p->q) & 15u || (uintptr_t)p->scales & 3u ||
      (uintptr_t)p->padded & 3u)
    return mok_fail(NULL, MOK_ERROR_MISALIGNED, "%s: x and q 16-byte, scales 4-byte", fn);
  if (p->m_total == 0) return MOK_SUCCESS;  // no rows: no block (padded[G] = 0)
  quant_cols_t k;
  k.x = (const uint4 *)p->x;
  k.m_total = p->m_total;
  k.n = p->n;
  k.offsets = p->offsets;
  k.offsets_int64 = p->offsets_int64;
  k.num_groups = (int)p->num_groups;
  k.padded = p->padded;
  k.q = p->q;
  k.scales = p->scales;
  k.ld = p->ld;
  k.blocks = need / QCOL_ROWS;  // blocks past padded[G] (which the host does not know) exit
  k.chunks = p->n / QCOL_COLS;
  k.kind = p->kind;
  const int64_t units = k.blocks * k.chunks, max_grid = (int64_t)1 << 20;
  const unsigned grid = (unsigned)(units < max_grid ? units : max_grid);
  quant_cols_kernel<<<grid, QCOL_THREADS, 0, (cudaStream_t)stream>>>(k);
  return quant_cols_launched(fn);
}
