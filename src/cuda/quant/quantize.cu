/*
 * quantize.cu: the block quantizer kernel and its C launchers (quant.h):
 *
 *   mok_quantize_launch        count bf16 matrices (strided, optionally transposed on read) ->
 *                              e4m3 + block scales, laid out as mok_quantize_host lays them out
 *   mok_quantize_weights_gpu   every operand copy of the quantized-weight buffer (mok_qw_layout),
 *                              byte for byte what mok_cpu_quantize_weights writes on the host
 *
 * One kernel serves both: a launch carries up to QUANT_MAX_JOBS jobs (one per operand copy) and a
 * flat grid over all their 128x128 tiles, so the twelve operand copies of a layer take one launch.
 * Per tile a CTA of 256 threads
 *   1. loads the bf16 tile into shared memory in the stored copy's orientation, with reads that
 *      run along the source's contiguous dim (a transposed read is a column walk in shared memory,
 *      conflict-free thanks to the odd word pitch),
 *   2. quantizes it with quant_cta_tile128 (quantize.cuh) into a shared e4m3 tile and the scales,
 *   3. copies the e4m3 tile out, 16 bytes per thread and store when rows allow it.
 * The per-element work (an IEEE division for fp32 scales, the explicit e4m3 rounding) bounds the
 * speed, not the bytes; weights are quantized once per optimizer step.
 *
 * NOTE: no -ftz / --use_fast_math for this file (quantize.cuh says why).
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "cuda/quant/quant.h"
#include "cuda/quant/quantize.cuh"
#include "common/status.h"
#include "common/quantized_layout.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "MoK's quantizer targets sm_90a (Hopper) and newer"
#endif

enum { QUANT_MAX_JOBS = 12 };
static_assert((int)QUANT_MAX_JOBS >= (int)MOK_QW_COUNT,
              "one job per operand copy of the weight buffer");

// Shared memory of one CTA: the bf16 tile, the e4m3 tile, the team-reduction scratch.
enum {
  QUANT_SMEM_IN = QUANT_TILE * QUANT_IN_PITCH * 2,
  QUANT_SMEM_Q = QUANT_TILE * QUANT_Q_PITCH,
  QUANT_SMEM_BYTES = QUANT_SMEM_IN + QUANT_SMEM_Q + QUANT_CTA_THREADS / 32 * 4,
};
static_assert(QUANT_SMEM_IN % 16 == 0, "the e4m3 tile starts 16-byte aligned");
// 4 CTAs (1024 threads) per SM fit the 228 KB of an H100/H200 SM with room to spare.
static_assert(4 * (QUANT_SMEM_BYTES + 1024) <= 228 * 1024, "4 CTAs per SM");

// One job: `count` matrices of one shape, block shape and scale kind.
typedef struct {
  const uint16_t *src;     // bf16; stored (e, r, c) at src[e * src_stride + r * ld + c], or
  int64_t src_stride;      //   at src[e * src_stride + c * ld + r] when transpose
  int64_t ld;
  int transpose;
  int lbr, lbc;            // log2 of the block shape
  mok_quant_scale_t kind;
  int q_vec16;             // 1: q rows are 16-byte aligned (q 16-aligned, cols % 16 == 0)
  uint8_t *q;              // [count, rows, cols]
  uint8_t *scales;         // [count, nbr, nbc] fp32 or bytes
  int64_t rows, cols, nbc;
  int64_t scales_ld;       // 0, or transposed scales (mok_quantize_params_t.scales_ld)
  int64_t scale_stride;    // bytes of one matrix's scales
  int64_t tiles_r, tiles_c;
  int64_t tile_begin;      // first flat tile index of this job
} quant_job_t;

typedef struct {
  quant_job_t job[QUANT_MAX_JOBS];
  int num_jobs;
  int64_t total_tiles;
} quant_params_t;
static_assert(sizeof(quant_params_t) <= 4096, "kernel parameters");

__global__ void __launch_bounds__(QUANT_CTA_THREADS, 4)
    quant_kernel(const __grid_constant__ quant_params_t p) {
  extern __shared__ __align__(16) uint8_t quant_smem[];
  uint16_t *in = (uint16_t *)quant_smem;                 // [128, QUANT_IN_PITCH] bf16
  uint8_t *qt = quant_smem + QUANT_SMEM_IN;              // [128, QUANT_Q_PITCH] e4m3
  uint32_t *red = (uint32_t *)(qt + QUANT_SMEM_Q);       // [8]
  const int t = (int)threadIdx.x;

  for (int64_t tile = blockIdx.x; tile < p.total_tiles; tile += gridDim.x) {
    int ji = 0;
    while (ji + 1 < p.num_jobs && tile >= p.job[ji + 1].tile_begin) ji++;
    const quant_job_t &jb = p.job[ji];
    int64_t tt = tile - jb.tile_begin;
    const int64_t per_matrix = jb.tiles_r * jb.tiles_c;
    const int64_t e = tt / per_matrix;
    tt -= e * per_matrix;
    const int64_t r0 = tt / jb.tiles_c * QUANT_TILE, c0 = tt % jb.tiles_c * QUANT_TILE;
    const int vr = (int)min((int64_t)QUANT_TILE, jb.rows - r0);
    const int vc = (int)min((int64_t)QUANT_TILE, jb.cols - c0);

    // 1. load: consecutive threads read consecutive source elements (64 bytes per warp load)
    const uint16_t *src = jb.src + e * jb.src_stride;
#pragma unroll 8
    for (int i = t; i < QUANT_TILE * QUANT_TILE; i += QUANT_CTA_THREADS) {
      const int outer = i / QUANT_TILE, inner = i % QUANT_TILE;
      const int r = jb.transpose ? inner : outer, c = jb.transpose ? outer : inner;
      if (r < vr && c < vc) {
        const int64_t off = jb.transpose ? (c0 + c) * jb.ld + r0 + r : (r0 + r) * jb.ld + c0 + c;
        in[r * QUANT_IN_PITCH + c] = src[off];
      }
    }
    __syncthreads();

    // 2. quantize
    quant_scale_out_t so;
    so.scales = jb.scales + e * jb.scale_stride;
    so.nbc = jb.nbc;
    so.ld_t = jb.scales_ld;
    so.brow0 = r0 >> jb.lbr;
    so.bcol0 = c0 >> jb.lbc;
    so.e8m0 = jb.kind == MOK_QUANT_E8M0_SCALE;
    quant_cta_tile128(in, qt, vr, vc, jb.lbr, jb.lbc, jb.kind, so, red);
    __syncthreads();

    // 3. store the valid part of the e4m3 tile
    uint8_t *q = jb.q + (e * jb.rows + r0) * jb.cols + c0;
    if (jb.q_vec16) {  // vc is a multiple of 16 here
      for (int i = t; i < QUANT_TILE * QUANT_TILE / 16; i += QUANT_CTA_THREADS) {
        const int r = i / (QUANT_TILE / 16), c = i % (QUANT_TILE / 16) * 16;
        if (r < vr && c < vc)
          *(uint4 *)(q + r * jb.cols + c) = *(const uint4 *)(qt + r * QUANT_Q_PITCH + c);
      }
    } else {
      for (int i = t; i < QUANT_TILE * QUANT_TILE; i += QUANT_CTA_THREADS) {
        const int r = i / QUANT_TILE, c = i % QUANT_TILE;
        if (r < vr && c < vc) q[r * jb.cols + c] = qt[r * QUANT_Q_PITCH + c];
      }
    }
    // The next tile's load writes `in` (read only before the sync above) and its quantization
    // writes `qt` only after the next sync, when every thread has finished this store.
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* Activation rows: 1x128 blocks along rows whose length is a multiple of 128                     */
/* ---------------------------------------------------------------------------------------------- */
// The layer's activations (x, a, dy, dg, du per row, every call): one warp per pair of 1x128
// blocks of a row, lanes 16h .. 16h + 15 holding block h, lane l elements 8l .. 8l + 7 of the
// pair (one 16-byte load, one 8-byte store), each block's amax by four shuffles within its half,
// its scale stored by the half's first lane (a row with an odd number of blocks leaves the second
// half of its last pair idle). A CTA's 8 warps take the same block pair of 8 consecutive rows, so
// with K-block-major scales (scales_ld > 0) the CTA writes runs of 8 contiguous scales. The tile
// kernel above stages every 128x128 tile in shared memory for any block shape and orientation;
// on DeepSeek-V3's activations (2.1 G elements per training step) it took 14 ms of a 68 ms fp8
// step, this kernel with one block per warp and 8-byte loads 4.1 ms (docs/performance.md,
// "fp8-block layers: the activation quantizer").
// Elements of a finite block are converted by cvt.rn.satfinite.e4m3x2.f32, which rounds to
// nearest even with subnormals and saturates to +-448 as quant_e4m3_from_float does, on the
// finite values v / s that reach it (a block with a NaN or an infinity is all 0x7F, decided
// before); tests/gpu/test_quantize_launch.cu checks the bytes against the host's on this path too.
enum { QROW_WARPS = 8, QROW_THREADS = 32 * QROW_WARPS };

typedef struct {
  const uint4 *in;     // [rows, cols / 8] of 8 bf16
  uint2 *q;            // [rows, cols / 8] of 8 e4m3
  float *scales;       // [rows, cols / 128], or [cols / 128, ld] with ld > 0
  int64_t rows, kb;    // rows, and 1x128 blocks per row
  int64_t pairs;       // block pairs per row, ceil(kb / 2)
  int64_t ld;          // 0: row-major scales
  int64_t groups;      // row groups of QROW_WARPS
  const int32_t *limit;  // NULL, or the rows to quantize, *limit <= rows (device memory)
  mok_quant_scale_t kind;
} quant_rows_t;

// Eight bf16 (16 bytes, element i in bits 16 i of the vector) as fp32 values.
__device__ __forceinline__ void quant_bf16x8_to_float(uint4 raw, float (&v)[8]) {
  const uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    v[2 * i] = quant_bf16_to_float((uint16_t)w4[i]);
    v[2 * i + 1] = quant_bf16_to_float((uint16_t)(w4[i] >> 16));
  }
}

__global__ void __launch_bounds__(QROW_THREADS)
    quant_rows_kernel(const __grid_constant__ quant_rows_t p) {
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
  const int64_t rows = p.limit ? min(p.rows, (int64_t)max(*p.limit, 0)) : p.rows;
  const int64_t units = (rows + QROW_WARPS - 1) / QROW_WARPS * p.pairs;  // block pair fastest
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t g = u / p.pairs, pr = u - g * p.pairs, row = g * QROW_WARPS + warp;
    if (row >= rows) continue;  // the whole warp
    const int64_t c = 2 * pr + lane / 16;  // this half's block
    const bool live = c < p.kb;
    const int64_t at = row * p.kb * 16 + c * 16 + lane % 16;  // this lane's 8 elements
    float v[8];
    quant_bf16x8_to_float(live ? p.in[at] : make_uint4(0u, 0u, 0u, 0u), v);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) m = max(m, quant_abs_bits(v[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    const quant_block_t b = quant_block_make(m, p.kind);
    uint2 out;
    out.x = quant_block_e4m3x2(b, v[0], v[1]) | quant_block_e4m3x2(b, v[2], v[3]) << 16;
    out.y = quant_block_e4m3x2(b, v[4], v[5]) | quant_block_e4m3x2(b, v[6], v[7]) << 16;
    if (live) {
      p.q[at] = out;
      if (lane % 16 == 0) p.scales[p.ld ? c * p.ld + row : row * p.kb + c] = b.scale;
    }
  }
}

// The rows kernel takes a job of mok_quantize_launch when it is one of these.
static int quant_rows_fits(const mok_quantize_params_t *p) {
  return p->block_rows == 1 && p->block_cols == 128 && !p->transpose && p->count == 1 &&
         p->cols % 128 == 0 && (p->in_ld == 0 || p->in_ld == p->cols) &&
         p->kind != MOK_QUANT_E8M0_SCALE && (uintptr_t)p->in % 16 == 0 && (uintptr_t)p->q % 8 == 0;
}

static mokResult_t quant_rows_run(const mok_quantize_params_t *p, void *stream) {
  quant_rows_t r;
  r.in = (const uint4 *)p->in;
  r.q = (uint2 *)p->q;
  r.scales = (float *)p->scales;
  r.rows = p->rows;
  r.kb = p->cols / 128;
  r.pairs = (r.kb + 1) / 2;
  r.ld = p->scales_ld;
  r.groups = (p->rows + QROW_WARPS - 1) / QROW_WARPS;
  r.kind = p->kind;
  r.limit = p->rows_limit;
  // a few waves of CTAs (8 per SM fit), each looping over units
  const int64_t units = r.groups * r.pairs, max_grid = 8192;
  const unsigned grid = (unsigned)(units < max_grid ? units : max_grid);
  quant_rows_kernel<<<grid, QROW_THREADS, 0, (cudaStream_t)stream>>>(r);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "mok_quantize_launch: kernel launch: %s",
                    cudaGetErrorString(e));
  return MOK_SUCCESS;
}

// mok_mx_qdq_rows_launch and mok_mx_quantize_rows_launch: the rows as one flat run of 1x32 blocks
// (cols % 128 == 0: no block spans two rows), 8 elements (16 bytes) per lane, so a warp holds 8
// blocks (lanes 4g .. 4g + 3: block g), two 128-element groups of one row (lanes 0-15, 16-31), and
// each iteration moves 512 bytes per warp each way; warps strided over the run. (With 8 bytes per
// lane and a warp per 128 elements it ran at about 40% of HBM's bandwidth.)
typedef struct {
  const uint4 *in;       // [n / 8] of 8 bf16
  uint4 *out;            // NULL, or the dequantized bf16 values
  uint2 *q;              // NULL, or the e4m3 values
  uint32_t *s;           // with q: the E8M0 scales, four to a word (mok_mx_quantize_rows_launch)
  int64_t s_ld;
  int64_t cols;          // elements per row
  int64_t rows;
  const int32_t *limit;  // NULL, or the rows to convert (device memory)
} quant_mx_rows_t;

__global__ void __launch_bounds__(QROW_THREADS)
    quant_mx_rows_kernel(const __grid_constant__ quant_mx_rows_t p) {
  const int lane = (int)threadIdx.x % 32;
  const int64_t rows = p.limit ? min(p.rows, (int64_t)max(*p.limit, 0)) : p.rows;
  const int64_t vecs = rows * p.cols / 8;  // a multiple of 16: whole 128-element groups
  const int64_t warps = (int64_t)gridDim.x * QROW_WARPS, groups = p.cols / 128;
  for (int64_t u = blockIdx.x * (int64_t)QROW_WARPS + threadIdx.x / 32; u * 32 < vecs; u += warps) {
    const int64_t at = u * 32 + lane;
    const bool live = at < vecs;  // all 32 lanes shuffle; a dead lane's block is all dead
    float v[8];
    quant_bf16x8_to_float(live ? p.in[at] : make_uint4(0u, 0u, 0u, 0u), v);
    uint8_t q[8];
    const quant_block_t b = quant_warp_blocks<8, 4>(v, MOK_QUANT_E8M0_SCALE, q);
    uint32_t w[2] = {0u, 0u};  // element i in byte i
#pragma unroll
    for (int i = 0; i < 8; i++) w[i / 4] |= (uint32_t)q[i] << (8 * (i % 4));
    const uint2 packed = make_uint2(w[0], w[1]);
    if (p.out && live) p.out[at] = quant_mx_dequant8(packed, b.scale);
    if (p.q) {
      // The word of this lane's 128-element group: byte j = block j of the group (lane 4j of it).
      const int g0 = lane & 16;
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; j++)
        word |= (uint32_t)__shfl_sync(0xFFFFFFFFu, (uint32_t)b.e8m0, g0 + 4 * j) << (8 * j);
      if (live) {
        p.q[at] = packed;
        if ((lane & 15) == 0) {
          const int64_t grp = at / 16, row = grp / groups;  // the run's 128-element group
          p.s[(grp - row * groups) * p.s_ld + row] = word;
        }
      }
    }
  }
}

static mokResult_t quant_mx_rows_run(const char *fn, const quant_mx_rows_t *k, void *stream) {
  const int64_t rows = k->rows, cols = k->cols;
  if (!k->in) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: in is NULL", fn);
  if (rows < 0 || cols < 0 || cols % 128 != 0 || rows * cols > ((int64_t)1 << 40))
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "%s: rows = %lld, cols = %lld: cols must be a multiple of 128", fn,
                    (long long)rows, (long long)cols);
  if ((uintptr_t)k->in % 16 != 0 || (uintptr_t)k->out % 16 != 0 || (uintptr_t)k->limit % 4 != 0 ||
      (uintptr_t)k->q % 8 != 0 || (uintptr_t)k->s % 4 != 0)
    return mok_fail(NULL, MOK_ERROR_MISALIGNED,
                    "%s: in, out 16-byte, q 8-byte, scales and rows_limit 4-byte aligned", fn);
  if (rows == 0 || cols == 0) return MOK_SUCCESS;
  const int64_t units = (rows * cols / 8 + 31) / 32, max_grid = 8192;  // warps' iterations
  const int64_t ctas = (units + QROW_WARPS - 1) / QROW_WARPS;
  quant_mx_rows_kernel<<<(unsigned)(ctas < max_grid ? ctas : max_grid), QROW_THREADS, 0,
                         (cudaStream_t)stream>>>(*k);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "%s: kernel launch: %s", fn, cudaGetErrorString(e));
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_mx_qdq_rows_launch(const void *in, void *out, int64_t rows,
                                              int64_t cols, const int32_t *rows_limit,
                                              void *stream) {
  const char *fn = "mok_mx_qdq_rows_launch";
  if (!out) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: out is NULL", fn);
  quant_mx_rows_t k;
  memset(&k, 0, sizeof(k));
  k.in = (const uint4 *)in, k.out = (uint4 *)out;
  k.rows = rows, k.cols = cols, k.limit = rows_limit;
  return quant_mx_rows_run(fn, &k, stream);
}

extern "C" mokResult_t mok_mx_quantize_rows_launch(const void *in, uint8_t *q, uint32_t *scales,
                                                   int64_t scales_ld, void *out, int64_t rows,
                                                   int64_t cols, void *stream) {
  const char *fn = "mok_mx_quantize_rows_launch";
  if (!q || !scales) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: q or scales is NULL", fn);
  if (scales_ld < rows)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "%s: scales_ld = %lld below rows = %lld", fn,
                    (long long)scales_ld, (long long)rows);
  quant_mx_rows_t k;
  memset(&k, 0, sizeof(k));
  k.in = (const uint4 *)in, k.out = (uint4 *)out, k.q = (uint2 *)q, k.s = scales;
  k.s_ld = scales_ld, k.rows = rows, k.cols = cols;
  return quant_mx_rows_run(fn, &k, stream);
}

/* ---------------------------------------------------------------------------------------------- */
/* Host side                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

static int64_t quant_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// log2 of a power of two in 1..128, or -1.
static int quant_log2_block(int v) {
  for (int l = 0; l <= 7; l++)
    if (v == 1 << l) return l;
  return -1;
}

static int quant_kind_valid(mok_quant_scale_t k) {
  return k == MOK_QUANT_FP32_SCALE || k == MOK_QUANT_POW2_SCALE || k == MOK_QUANT_E8M0_SCALE;
}

// Validates one matrix description and appends it as a job. The shape checks keep every index
// the kernel forms within int64.
static mokResult_t quant_add_job(quant_params_t *qp, const char *fn,
                                 const mok_quantize_params_t *p) {
  if (!p->in) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: in is NULL", fn);
  if (!p->q) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: q is NULL", fn);
  if (!p->scales) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: scales is NULL", fn);
  const int lbr = quant_log2_block(p->block_rows), lbc = quant_log2_block(p->block_cols);
  if (lbr < 0 || lbc < 0 || !quant_kind_valid(p->kind) || (p->transpose != 0 && p->transpose != 1))
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "%s: block %d x %d, kind %d, transpose %d: block sizes must be powers of two "
                    "in 1..128 (they tile the kernel's 128x128 tiles), the kind a "
                    "mok_quant_scale_t, transpose 0 or 1",
                    fn, p->block_rows, p->block_cols, (int)p->kind, p->transpose);
  const int64_t rows = p->rows, cols = p->cols, count = p->count;
  const int64_t lim = (int64_t)1 << 40;  // 1 T elements per matrix, 2^20 matrices: far above need
  if (rows < 0 || cols < 0 || count < 0 || count > (1 << 20) || rows > lim || cols > lim ||
      (rows > 0 && cols > lim / rows))
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "%s: count %lld, rows %lld, cols %lld: must be >= 0 with count <= 2^20 and "
                    "rows * cols <= 2^40",
                    fn, (long long)count, (long long)rows, (long long)cols);
  const int64_t inner = p->transpose ? rows : cols, outer = p->transpose ? cols : rows;
  const int64_t ld = p->in_ld ? p->in_ld : inner;
  const int64_t extent = outer > 0 ? (outer - 1) * ld + inner : 0;
  const int64_t stride = p->in_stride ? p->in_stride : rows * cols;
  if (ld < inner || ld > lim || stride < extent || stride > lim * 2)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "%s: in_ld %lld, in_stride %lld: a source row holds %lld elements and a "
                    "source matrix spans %lld (0 means packed)",
                    fn, (long long)p->in_ld, (long long)p->in_stride, (long long)inner,
                    (long long)extent);
  const size_t sbytes = p->kind == MOK_QUANT_E8M0_SCALE ? 1 : 4;
  const int64_t nbr = quant_ceil_div(rows, p->block_rows);
  if (p->scales_ld < 0 || (p->scales_ld > 0 && p->scales_ld < nbr) || p->scales_ld > lim)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE,
                    "%s: scales_ld %lld: 0 (row-major scales) or at least the %lld block rows",
                    fn, (long long)p->scales_ld, (long long)nbr);
  if ((uintptr_t)p->in % 2 || (uintptr_t)p->scales % sbytes)
    return mok_fail(NULL, MOK_ERROR_MISALIGNED,
                    "%s: in = %p must be 2-byte aligned, scales = %p %zu-byte aligned", fn, p->in,
                    p->scales, sbytes);
  if (count == 0 || rows == 0 || cols == 0) return MOK_SUCCESS;  // nothing to read or write
  if (qp->num_jobs == QUANT_MAX_JOBS)
    return mok_fail(NULL, MOK_ERROR_INTERNAL, "%s: more than %d jobs in one launch", fn,
                    QUANT_MAX_JOBS);

  quant_job_t *j = &qp->job[qp->num_jobs++];
  j->src = (const uint16_t *)p->in;
  j->src_stride = stride;
  j->ld = ld;
  j->transpose = p->transpose;
  j->lbr = lbr;
  j->lbc = lbc;
  j->kind = p->kind;
  j->q_vec16 = (uintptr_t)p->q % 16 == 0 && cols % 16 == 0;
  j->q = p->q;
  j->scales = (uint8_t *)p->scales;
  j->rows = rows;
  j->cols = cols;
  j->nbc = quant_ceil_div(cols, p->block_cols);
  j->scales_ld = p->scales_ld;
  j->scale_stride = (p->scales_ld ? p->scales_ld : nbr) * j->nbc * (int64_t)sbytes;
  j->tiles_r = quant_ceil_div(rows, QUANT_TILE);
  j->tiles_c = quant_ceil_div(cols, QUANT_TILE);
  j->tile_begin = qp->total_tiles;
  qp->total_tiles += count * j->tiles_r * j->tiles_c;
  return MOK_SUCCESS;
}

// Enqueues the jobs on the current device; never synchronizes.
static mokResult_t quant_run(const quant_params_t *qp, const char *fn, void *stream) {
  if (qp->total_tiles == 0) return MOK_SUCCESS;
  cudaError_t e = cudaFuncSetAttribute(quant_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       QUANT_SMEM_BYTES);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver
                              ? MOK_ERROR_NO_DEVICE : MOK_ERROR_CUDA,
                    "%s: cudaFuncSetAttribute: %s", fn, cudaGetErrorString(e));
  }
  // One CTA per tile up to a grid that covers every SM many times; beyond that CTAs loop.
  const int64_t max_grid = (int64_t)1 << 20;
  const unsigned grid = (unsigned)(qp->total_tiles < max_grid ? qp->total_tiles : max_grid);
  quant_kernel<<<grid, QUANT_CTA_THREADS, QUANT_SMEM_BYTES, (cudaStream_t)stream>>>(*qp);
  e = cudaGetLastError();
  if (e != cudaSuccess)
    return mok_fail(NULL, MOK_ERROR_CUDA, "%s: kernel launch: %s", fn, cudaGetErrorString(e));
  return MOK_SUCCESS;
}

extern "C" mokResult_t mok_quantize_launch(const mok_quantize_params_t *p, void *stream) {
  if (!p) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_quantize_launch: params is NULL");
  quant_params_t qp;
  memset(&qp, 0, sizeof(qp));
  mokResult_t r = quant_add_job(&qp, "mok_quantize_launch", p);
  if (r != MOK_SUCCESS) return r;
  if (qp.total_tiles > 0 && quant_rows_fits(p)) return quant_rows_run(p, stream);
  if (p->rows_limit)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                    "mok_quantize_launch: rows_limit needs one matrix of 1x128 blocks, rows a "
                    "multiple of 128 long, in 16-byte and q 8-byte aligned, not transposed");
  return quant_run(&qp, "mok_quantize_launch", stream);
}

extern "C" mokResult_t mok_quantize_weights_gpu(const mok_layer_desc_t *d, int64_t EL,
                                                const mok_weights_t *w, void *out, void *stream) {
  const char *fn = "mok_quantize_weights_gpu";
  if (!d || !w || !out) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: NULL argument", fn);
  if (d->precision != MOK_PRECISION_FP8_BLOCK && d->precision != MOK_PRECISION_MXFP8)
    return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "%s: precision %d has no quantized weights", fn,
                    (int)d->precision);
  if (EL < 1 || d->hidden < 1 || d->intermediate < 1 || d->shared_intermediate < 0)
    return mok_fail(NULL, MOK_ERROR_INVALID_SHAPE, "%s: EL %lld, H %lld, I %lld, Is %lld", fn,
                    (long long)EL, (long long)d->hidden, (long long)d->intermediate,
                    (long long)d->shared_intermediate);
  mok_qw_layout_t lay;
  mok_qw_layout(d, EL, &lay);
  const void *src[MOK_QW_COUNT] = {w->wg,  w->wu,  w->wd,  w->wg,  w->wu,  w->wd,
                                   w->wsg, w->wsu, w->wsd, w->wsg, w->wsu, w->wsd};
  static const char *const names[MOK_QW_COUNT] = {"wg", "wu", "wd", "wg", "wu", "wd",
                                                  "wsg", "wsu", "wsd", "wsg", "wsu", "wsd"};
  quant_params_t qp;
  memset(&qp, 0, sizeof(qp));
  for (int i = 0; i < MOK_QW_COUNT; i++) {
    const mok_qw_operand_t *o = &lay.op[i];
    if (o->count == 0) continue;
    if (!src[i])
      return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "%s: weights.%s is NULL", fn, names[i]);
    // Transposed copies read the [count, cols, rows] source (as quantize_operand does on the host).
    mok_quantize_params_t p;
    memset(&p, 0, sizeof(p));
    p.in = src[i];
    p.transpose = o->transposed;
    p.count = o->count;
    p.rows = o->rows;
    p.cols = o->cols;
    p.block_rows = o->br;
    p.block_cols = o->bc;
    p.kind = o->kind;
    p.q = (uint8_t *)out + o->data;
    p.scales = (uint8_t *)out + o->scales;
    mokResult_t r = quant_add_job(&qp, fn, &p);
    if (r != MOK_SUCCESS) return r;
  }

  // Launch on the device that holds `out` (the layer's, checked by the caller), which need not be
  // the calling thread's current device; the current device is restored afterwards.
  cudaPointerAttributes attr;
  int prev = 0;
  if (cudaPointerGetAttributes(&attr, out) != cudaSuccess || cudaGetDevice(&prev) != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, MOK_ERROR_WRONG_DEVICE, "%s: out = %p is not CUDA device memory", fn,
                    out);
  }
  const int dev = attr.type == cudaMemoryTypeDevice ? attr.device : prev;
  cudaError_t e = dev == prev ? cudaSuccess : cudaSetDevice(dev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(NULL, MOK_ERROR_CUDA, "%s: cudaSetDevice(%d): %s", fn, dev,
                    cudaGetErrorString(e));
  }
  mokResult_t r = quant_run(&qp, fn, stream);
  if (dev != prev && (e = cudaSetDevice(prev)) != cudaSuccess && r == MOK_SUCCESS) {
    cudaGetLastError();
    r = mok_fail(NULL, MOK_ERROR_CUDA, "%s: cudaSetDevice(%d): %s", fn, prev,
                 cudaGetErrorString(e));
  }
  return r;
}

extern "C" mokResult_t mok_quant_preload(void) {
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, quant_kernel) != cudaSuccess ||
      cudaFuncGetAttributes(&a, quant_rows_kernel) != cudaSuccess ||
      cudaFuncGetAttributes(&a, quant_mx_rows_kernel) != cudaSuccess) {
    cudaGetLastError();
    return MOK_ERROR_CUDA;
  }
  return MOK_SUCCESS;
}
