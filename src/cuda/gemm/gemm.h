/*
 * gemm.h: the grouped GEMM and the weight-gradient (k-grouped) GEMM launchers.
 *
 * A host/device contract: plain C11 and C++, no CUDA types (streams are void *); every launcher
 * validates its arguments on the host, returns a mokResult_t, and never synchronizes.
 */
#ifndef MOK_CUDA_GEMM_H
#define MOK_CUDA_GEMM_H

#include <stdint.h>
#include <string.h>

#include "common/status.h"
#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Operand precision. */
typedef enum {
  MOK_GG_BF16 = 0,      /* bf16 A and B, fp32 accumulation */
  MOK_GG_FP8_BLOCK = 1, /* e4m3 A (1x128 scales) and B (128x128 scales), fp32 promotion every
                           128 reduction elements; K % 128 == 0, N % 128 == 0, B K-major;
                           SwiGLU (b2 = up, b2_scale) and a second segment (a2, b2, b2_scale,
                           K2 % 128 == 0, a_scale K-block major over both) as below */
  MOK_GG_MXFP8_B = 2    /* bf16 A (the layer's MXFP8 activations, already dequantized:
                           mok_mx_qdq_rows_launch) and MXFP8 B: e4m3 [G, N, K] K-major with one
                           E8M0 byte per 1x32 block along K (b_e8m0 [G N, K / 32]), dequantized to
                           bf16 in shared memory (gemm/grouped_gemm_mx.cuh), fp32 accumulation;
                           K % 64 == 0 (and K2), epilogues STORE_BF16, STORE_F32 and SWIGLU (b2 =
                           up, b2_e8m0), a second segment (a2 bf16, b2, b2_e8m0: K-major B2
                           [G, N, K2]) with STORE_BF16 or STORE_F32 */
} mok_gg_dtype_t;

/* Memory layout of B per group. */
typedef enum {
  MOK_GG_B_KMAJOR = 0,  /* B [G, N, K]: PyTorch Linear layout, K contiguous */
  MOK_GG_B_NMAJOR = 1   /* B [G, K, N]: N contiguous (backward: dy·Wd, dgu·[Wg; Wu]); needs
                           K % 64 == 0; not with SwiGLU; may have a second reduction segment
                           (a2, b2, k2 below) */
} mok_gg_layout_t;

/* What the epilogue does with the fp32 tile acc = A[rows] · B[g]ᵀ. */
typedef enum {
  MOK_GG_EPI_STORE_BF16 = 0, /* c [M_total, N] bf16  = bf16(acc) */
  MOK_GG_EPI_STORE_F32 = 1,  /* c [M_total, N] fp32  = acc */
  MOK_GG_EPI_ACCUM_F32 = 2,  /* c [M_total, N] fp32 += acc */
  MOK_GG_EPI_SWIGLU = 3      /* b = gate [G, N, K], b2 = up [G, N, K]; c [M_total, N] bf16 =
                                bf16(row_scale[r] · silu(g) · u) with fp32 g, u; optionally
                                g_out, u_out [M_total, N] bf16 = bf16(g), bf16(u) */
} mok_gg_epilogue_t;

/* C[rows of g] = epilogue(A[rows of g] · B[g]ᵀ) for every group g, where the rows of group g are
 * [offsets[g], offsets[g+1]) of A and C. `offsets` lives in device memory (G+1 entries, int32 or
 * int64, non-decreasing, offsets[G] <= m_total) and is never read by the host: rows outside every
 * group are neither read into a result nor written. Results are bitwise deterministic. */
typedef struct {
  mok_gg_dtype_t dtype;
  mok_gg_layout_t b_layout;
  mok_gg_epilogue_t epilogue;
  int offsets_int64;         /* 0: offsets are int32, 1: int64 */
  int64_t num_groups;        /* G, 1..2^20 */
  int64_t m_total;           /* rows of A and C (>= offsets[G]) */
  int64_t n;                 /* N: columns of C per group (SwiGLU: I) */
  int64_t k;                 /* K: reduction length */
  const void *a;             /* [m_total, K] bf16 (fp8-block: e4m3), 16-byte aligned */
  const void *b;             /* [G, N, K] bf16 (or [G, K, N] with MOK_GG_B_NMAJOR), 16-byte
                                aligned (SwiGLU: gate weights) */
  const void *b2;            /* SwiGLU: up weights [G, N, K]; k2 > 0: the second segment's B,
                                [G, K2, N] (bf16, N-major) or [G, N, K2] (fp8-block, K-major) */
  const void *a2;            /* k2 > 0: the second segment's A [m_total, K2] */
  int64_t k2;                /* 0, or K2: the reduction goes on over a second pair, acc = A·B +
                                A2·B2, one reduction of K + K2 in that order (bitwise the GEMM of
                                [A A2] and [B B2]). bf16: N-major B, K2 % 64 == 0; fp8-block:
                                K2 % 128 == 0, STORE_BF16 or STORE_F32, a_scale K-block major
                                [(K + K2)/128, a_scale_ld] (A2's blocks after A's) */
  const void *offsets;       /* [G + 1] int32 or int64, device memory */
  void *c;                   /* [m_total, N] bf16 or fp32 (see epilogue), 16-byte aligned */
  const float *row_scale;    /* SwiGLU only: [m_total] fp32 router weight per row; NULL = 1 */
  void *g_out, *u_out;       /* SwiGLU only, optional: [m_total, N] bf16 */
  int num_sms;               /* CTAs of the persistent grid; 0 = one per SM (as many as can be
                                resident at once); else taken as given (rounded to the cluster) */
  const float *a_scale;      /* fp8-block: scale of A[r, 128 kb ..], fp32, [m_total, K/128]
                                (a_scale_ld = 0) or [K/128, a_scale_ld] (a_scale_ld > 0) */
  const float *b_scale;      /* fp8-block: [G, N/128, K/128] fp32, 128x128 blocks of B[g] */
  const float *b2_scale;     /* fp8-block SwiGLU: up's [G, N/128, K/128]; with k2 > 0: B2's
                                [G, N/128, K2/128] */
  int64_t a_scale_ld;        /* fp8-block: 0, or the row stride of a_scale stored K-block major
                                (>= m_total, a multiple of 4; a_scale 16-byte aligned): each K
                                block's row scales are then contiguous, and the kernel loads a
                                tile's with the tile's operands (faster) */
  const uint8_t *b_e8m0;     /* MXFP8 B: [G N, K / 32] E8M0 scales of B (row-major, the layout
                                of mok_quantize_weights' MXFP8 copies) */
  const uint8_t *b2_e8m0;    /* MXFP8 B, SwiGLU: up's [G N, K / 32]; with k2 > 0: B2's
                                [G N, K2 / 32] */
  int group_m;               /* row tiles per band of the tile order: 0 = by B's size against
                                the L2 (mok_tile_group_m; the default), -1 = none, n > 0 = n */
  void *c_q;                 /* fp8-block SwiGLU, optional: a quantized instead of stored, e4m3
                                [m_total, N] in 1x128 blocks along N, bit for bit
                                mok_quantize_launch's of the bf16 a (c is then not written and
                                may be NULL); 16-byte aligned; needs K-block-major a_scale */
  float *c_q_scale;          /* with c_q: the blocks' scales, K-block major [N/128, c_q_ld] */
  int64_t c_q_ld;            /* with c_q: >= m_total */
  mok_quant_scale_t c_q_kind; /* with c_q: MOK_QUANT_FP32_SCALE or MOK_QUANT_POW2_SCALE */
} mok_grouped_gemm_params_t;

/* Validates `p` (MOK_ERROR_NULL_POINTER, MOK_ERROR_INVALID_VALUE, MOK_ERROR_INVALID_SHAPE,
 * MOK_ERROR_MISALIGNED, MOK_ERROR_NOT_IMPLEMENTED) and enqueues the kernel on `stream` (a
 * cudaStream_t; NULL = the legacy default stream). MOK_ERROR_CUDA when the launch fails, and
 * MOK_ERROR_NO_DEVICE without a usable device. Shape rules: K % 8 == 0 and N % 8 == 0 (16-byte
 * row strides for TMA); SwiGLU also needs b2. */
mokResult_t mok_grouped_gemm_launch(const mok_grouped_gemm_params_t *p, void *stream);

/* Row tiles per band of a grouped GEMM's tile order (tile/scheduler.cuh, src/common/task_plan.h):
 * `requested` when it is not 0 (-1: none), else by the size of the groups' B (weights): 8 when
 * b_bytes is over a sixth of the device's L2 cache, so that the tiles that share a B tile are
 * taken together (else B comes from HBM up to twice: less HBM traffic, less power, a higher clock
 * at the power limit); else 0, row tile by row tile, which measured as fast for small B
 * (docs/performance.md, "Grouped GEMM: tile order and L2 bands"). */
int mok_tile_group_m(int requested, int64_t b_bytes);

/* The kernels' fault records (src/common/status.h): 1 with *out filled, and cleared, when a wait
 * of a grouped GEMM (mok_gg_) or weight-gradient GEMM (mok_gw_) kernel timed out since the last
 * call; 0 otherwise. Call after synchronizing with those kernels. */
int mok_gg_fault_take(mok_kernel_fault_t *out);
int mok_gw_fault_take(mok_kernel_fault_t *out);

/* Loads the grouped-GEMM kernels the layers launch (bf16, and fp8-block's) now (CUDA loads a
 * kernel at its first launch by default, and a load may wait for kernels already running: with
 * virtual ranks those spin on ranks whose calls come later from the same thread). */
mokResult_t mok_gg_preload(void);
mokResult_t mok_gw_preload(void); /* the weight-gradient GEMM's kernels */

/* Parameters of a bf16 grouped GEMM with the given epilogue and B layout, every other field zero
 * (pointers, int32 offsets, one CTA per SM): the callers fill in their tensors. */
static inline mok_grouped_gemm_params_t mok_gg_bf16_params(mok_gg_epilogue_t epi,
                                                           mok_gg_layout_t b_layout, int64_t groups,
                                                           int64_t m, int64_t n, int64_t k) {
  mok_grouped_gemm_params_t p;
  memset(&p, 0, sizeof(p));
  p.dtype = MOK_GG_BF16;
  p.b_layout = b_layout;
  p.epilogue = epi;
  p.num_groups = groups;
  p.m_total = m;
  p.n = n;
  p.k = k;
  return p;
}

/* The same for an fp8-block GEMM (K-major B); the callers add the scales. */
static inline mok_grouped_gemm_params_t mok_gg_fp8_params(mok_gg_epilogue_t epi, int64_t groups,
                                                          int64_t m, int64_t n, int64_t k) {
  mok_grouped_gemm_params_t p = mok_gg_bf16_params(epi, MOK_GG_B_KMAJOR, groups, m, n, k);
  p.dtype = MOK_GG_FP8_BLOCK;
  return p;
}

/* The same for a GEMM with MXFP8 B (K-major); the callers add b_e8m0 (and b2_e8m0). */
static inline mok_grouped_gemm_params_t mok_gg_mx_params(mok_gg_epilogue_t epi, int64_t groups,
                                                         int64_t m, int64_t n, int64_t k) {
  mok_grouped_gemm_params_t p = mok_gg_bf16_params(epi, MOK_GG_B_KMAJOR, groups, m, n, k);
  p.dtype = MOK_GG_MXFP8_B;
  return p;
}

/* Weight-gradient ("k-grouped") GEMM, src/cuda/gemm/grouped_wgrad.cu: the groups split the reduction.
 *   C[g] [N, K] = epilogue( A_gᵀ · B_g ) = epilogue( Σ_{r in group g} A[r]ᵀ ⊗ B[r] )
 * for every group g, rows of g = [offsets[g], offsets[g+1]) of A and B (offsets in device memory,
 * as above, never read by the host). Example: dWd[e] [H, I] = dy_gᵀ · a_g (a = dy [R, H],
 * b = a [R, I]); dWg[e] [I, H] = dg_gᵀ · x_g. fp32 accumulation over the rows of a group in row
 * order, one CTA per output tile, no atomics: bitwise deterministic, whatever num_sms. Epilogues:
 * MOK_GG_EPI_STORE_BF16 (c bf16), MOK_GG_EPI_STORE_F32, MOK_GG_EPI_ACCUM_F32 (c fp32 += result);
 * an empty group stores zeros, or leaves C[g] untouched when accumulating. */
typedef struct {
  mok_gg_epilogue_t epilogue; /* STORE_BF16, STORE_F32 or ACCUM_F32 (SwiGLU: not implemented) */
  int offsets_int64;          /* 0: offsets are int32, 1: int64 */
  int64_t num_groups;         /* G, 1..2^20 */
  int64_t m_total;            /* rows of A and B (>= offsets[G]); 0 is allowed */
  int64_t n;                  /* N: columns of A = rows of each C[g], N % 8 == 0 */
  int64_t k;                  /* K: columns of B = columns of each C[g], K % 8 == 0 */
  const void *a;              /* [m_total, N] bf16, 16-byte aligned */
  const void *b;              /* [m_total, K] bf16, 16-byte aligned */
  const void *offsets;        /* [G + 1] int32 or int64, device memory */
  void *c;                    /* [G, N, K] bf16 or fp32 (see epilogue), 16-byte aligned */
  int num_sms;                /* CTAs of the persistent grid; 0 = one per SM */
} mok_grouped_wgrad_params_t;

/* Validates `p` (MOK_ERROR_NULL_POINTER, MOK_ERROR_INVALID_VALUE, MOK_ERROR_INVALID_SHAPE,
 * MOK_ERROR_MISALIGNED, MOK_ERROR_NOT_IMPLEMENTED) and enqueues the kernel on `stream`;
 * MOK_ERROR_CUDA when the launch fails, MOK_ERROR_NO_DEVICE without a usable device. */
mokResult_t mok_grouped_wgrad_launch(const mok_grouped_wgrad_params_t *p, void *stream);


#ifdef __cplusplus
}
#endif

#endif /* MOK_CUDA_GEMM_H */
