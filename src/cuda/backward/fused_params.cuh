/*
 * backward/fused_params.cuh: the fused backward's compile-time shape (tile, ring, staging), its
 * tensor maps and its flat kernel parameters: what the kernel (backward/fused.cu) and its
 * launcher (backward/fused_launch.cu) share.
 */
#ifndef MOK_CUDA_BACKWARD_FUSED_PARAMS_CUH
#define MOK_CUDA_BACKWARD_FUSED_PARAMS_CUH

#include <cuda.h>
#include <stdint.h>

#include "cuda/tile/pipeline.cuh"

// Tiles of 128 rows x 256 columns for every task (DX: dxk rows x H columns; DW: rows of the
// weight gradient x its columns), the 3-stage ring of the grouped GEMMs' staged configuration, and
// 32 KB of output staging per consumer warpgroup (one fp32 round of 128 columns, or two bf16
// rounds of 16 KB): both task kinds store through it, so a DW tile's fp32 stores and a DX tile's
// bf16 ones drain under the next tile's MMA as in the standalone GEMMs.
enum { BK_BM = 128, BK_BN = 256, BK_STAGES = 3, BK_C_BYTES = 2 * 32768 };
typedef tp_plan<BK_BM, BK_BN, BK_STAGES, BK_C_BYTES> bk_plan;

// A stage's tag (the int4 of tp_plan's tags): {kind | BK_PAST_DX, expert, m, n} of the task the
// stage starts; kind BK_TAG_END: no task left. BK_PAST_DX: the task comes after every DX task in
// the order, so the consumers have stored all their DX tiles and publish them (the reduce waits).
enum { BK_TAG_END = -1, BK_KIND_MASK = 0xff, BK_PAST_DX = 0x100 };

typedef struct {
  CUtensorMap dg, du;        // [R, I], box [128, 64]: DX's A, two segments of one reduction
  CUtensorMap wg, wu;        // [E I, H], box [64, 64]: DX's B, N-major
  CUtensorMap dxk;           // [R, H], box [64, 64]: DX's staged stores
  CUtensorMap dyg_w, a_w;    // [R, H], [R, I], box [64, 64]: DW_DOWN's operands
  CUtensorMap dg_w, du_w;    // [R, I], box [64, 64]: DW_GATE_UP's A (gate, up)
  CUtensorMap xg_w;          // [R, H], box [64, 64]: DW_GATE_UP's B
  CUtensorMap dwd, dwg, dwu; // [E H, I], [E I, H], [E I, H]: DW's staged stores (fp32 box
                             // [64, 32], bf16 box [64, 64]; accumulation: unused)
} bk_maps_t;

typedef struct {
  int64_t T, H, I, E, K, R;  // tokens, hidden, intermediate, local experts, top-k, capacity rows
  const int32_t *status;     // [1] 0: the context did not match (offsets are all 0)
  const int32_t *offsets;    // [E + 1]
  void *dxk;                 // [R, H] bf16 (partial row tiles store from registers)
  void *dwg, *dwu, *dwd;     // the caller's weight gradients (stores from registers)
  // REDUCE_DX (reduce = 1): dx[t] = bf16(dxs[t] + Σ_k dxk[row(t, k)]), dtopk_w = dw_row[row]
  int32_t reduce;
  const int32_t *slot_row;   // [T, K] the context's
  const float *dxs;          // [T, H] fp32, NULL without a shared expert
  const float *dw_row;       // [R]
  void *dx;                  // [T, H] bf16
  float *dtopk_w;            // [T, K]
  uint32_t *counters;        // MOK_FC_DOWN (DX tiles), _ABORT, _TICKET, _CLAIM; zeroed before
  void *err;                 // mok_ws_error_t
  uint64_t timeout_ns;
  int32_t group_m;           // the plan's row tiles per band
  int32_t lag_dw;            // the plan's lag_dw (expert stages from DX tiles to DW tiles)
} bk_params_t;
static_assert(sizeof(bk_params_t) + sizeof(bk_maps_t) <= 4096, "a kernel's parameters");

typedef void (*bk_kernel_fn)(bk_params_t, bk_maps_t);
// The kernel of a weight-gradient epilogue (MOK_GG_EPI_STORE_F32, _ACCUM_F32 or _STORE_BF16)
// and its dynamic shared memory for E local experts.
bk_kernel_fn bk_kernel(int wgrad_epilogue);
size_t bk_smem_bytes(int64_t E);

#endif /* MOK_CUDA_BACKWARD_FUSED_PARAMS_CUH */
