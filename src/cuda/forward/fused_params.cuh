/*
 * forward/fused_params.cuh: the fused forward's compile-time shape (tile, ring, staging), its named
 * barriers, its tensor maps and its one flat kernel parameter struct: what the kernel
 * (forward/fused.cu) and its launcher (forward/fused_launch.cu) share.
 */
#ifndef MOK_CUDA_FORWARD_FUSED_PARAMS_CUH
#define MOK_CUDA_FORWARD_FUSED_PARAMS_CUH

#include <cuda.h>
#include <stdint.h>

#include "common/workspace.h"
#include "cuda/comm/comm.h"
#include "cuda/tile/barriers.cuh"
#include "cuda/tile/pipeline.cuh"
enum { FK_BM = MOK_FC_TILE_M, FK_BN = 256, FK_STAGES = 4 };
// The kernel's configurations (STAGED). DOWN tiles and (SHARED_)GATE_UP's a, g and u are stored
// through shared memory and TMA (STAGED = 1: a [64, 128] bf16 staging buffer per consumer
// warpgroup, each round of 128 columns waiting until the copy engine has read the previous one)
// when the E + 1 row-tile prefix sums still fit next to it; else from registers (STAGED = 0).
// The ring is the same either way.
// NOTE: 3 stages and two staging buffers per warpgroup (so that consecutive rounds alternate)
// measured 4-7% slower at all three benchmark shapes: the rounds got shorter, the next task's
// first stage came later (docs/performance.md, "Fused forward: epilogue staging").
template <int STAGED>
struct fk_cfg {
  static constexpr int WG_C_BYTES = STAGED * 64 * 128 * 2;  // per consumer warpgroup
  typedef tp_plan<FK_BM, FK_BN, FK_STAGES, 2 * WG_C_BYTES> P;
  static size_t bytes(int64_t E) { return P::ALLOC_BYTES + (size_t)(E + 1) * 4; }  // + s_pre
};
typedef tp_plan<FK_BM, FK_BN, FK_STAGES, 0> fk_plan;
static_assert(FK_BM == 128, "tile height = the layout's row tile (MOK_FC_TILE_M)");

// A full barrier's arrivals: GATE_UP's gathered stages, each gathering thread's cp.async arrival,
// thread 0's with the stage's TMA byte count, and thread 0's for the producer threads that have
// left to reduce; stages loaded by TMA alone (and tag-only stages), thread 0 for all.
#define FK_FULL_ARRIVALS (128 + 1)
#define FK_TAG_END (-1)  // tag of the stage that tells the consumers there is no task left


typedef struct {
  CUtensorMap x;        // [T, H], box [128, 64]: SHARED_GATE_UP's A
  CUtensorMap wg, wu;   // [E I, H], box [128, 64]
  CUtensorMap a;        // [R, I]: DOWN's A
  CUtensorMap wd;       // [E H, I]
  CUtensorMap as;       // [T, Is]: SHARED_DOWN's A
  CUtensorMap wsg, wsu; // [Is, H]
  CUtensorMap wsd;      // [H, Is]
  CUtensorMap yk;       // [R, H], box [64, 64]: DOWN's staged stores
  CUtensorMap g, u;     // [R, I], box [64, 64]: GATE_UP's staged stores of g and u
  CUtensorMap a_st;     // [R, I], box [64, 64]: GATE_UP's staged stores of a
  CUtensorMap as_st;    // [T, Is], box [64, 64]: SHARED_GATE_UP's staged stores of as, gs, us
  CUtensorMap gs, us;
} fk_maps_t;

// The kernel's one parameter struct (flat, passed as __grid_constant__), filled by the launcher
// from mok_fwd_fused_params_t and the layer's tuning. R = capacity rows of the routed buffers.
typedef struct {
  int64_t T, H, I, Is, E, K;    // tokens, hidden, intermediate, shared intermediate, local experts
  const void *x;                // [T, H] bf16
  void *y;                      // [T, H] bf16
  const int32_t *status;        // [1] 0: the call's routing was invalid, nothing is computed
  const int32_t *offsets;       // [E + 1] rows of expert e are [offsets[e], offsets[e + 1])
  const int32_t *tile_pre;      // [E + 1] row-tile prefix sums
  const int32_t *slot_row;      // [T, K] row of (token, slot), -1 for an empty slot
  const float *row_w;           // [R] router weight of each row
  const int32_t *row_tok;       // [R] token of each row (GATE_UP gathers x through it); expert
                                // parallel: the row's source (>= 0: a row of recv_x; -(t + 1):
                                // token t of x), written by the dispatch
  const void *recv_x;           // expert parallel: [W T_max, H] bf16 tokens received; else NULL
  const int32_t *red_pre;       // [E + 2] the reduce order's bins (by_last)
  const int32_t *red_order;     // [T] tokens by their last expert
  uint32_t *counters;           // the MOK_FC_* counters (src/common/workspace.h)
  void *err;                    // mok_ws_error_t
  void *yk;                     // [R, H] bf16 expert outputs
  float *ys;                    // [T, H] fp32 shared-expert output (NULL when Is = 0)
  void *a;                      // [R, I] bf16 bf16(w · silu(g) · u)
  void *as;                     // [T, Is] bf16
  void *g_out, *u_out;          // [R, I] bf16 (NULL: RECOMPUTE mode)
  void *gs_out, *us_out;        // [T, Is] bf16 (NULL: RECOMPUTE mode, or Is = 0)
  uint64_t timeout_ns;          // bound of each wait on a counter
  uint32_t sgu_base;            // counter index of SGU[0]
  uint32_t sd_base;             // counter index of SD[0]
  uint32_t dn_base;             // counter index of DN[0]
  int32_t shared_band;          // the plan's token tiles per band of the shared expert
  int32_t lag;                  // the plan's lag (fk_lag)
  int32_t group_m;              // the plan's row tiles per band (src/common/task_plan.h)
  int32_t by_last;              // without a shared expert, reduce in the layout's order
                                // (fk_reduce_claims)
  int32_t help_stage;           // expert stage from which 2 producer warps reduce (E: none
                                // before the last GATE_UP task)
  int32_t no_reduce;            // 1: the order ends before REDUCE (expert parallel: the combine
                                // brings the tokens' rows home, then a kernel reduces)
  int32_t n_comm;               // expert parallel: dispatch units at the start of the kernel
                                // (forward/fused_ep.cuh), = the transport's CTA count; 0: none
  mok_tp_params_t tp;           // expert parallel: the transport's params of the call's dispatch
} fk_params_t;
static_assert(sizeof(fk_params_t) + sizeof(fk_maps_t) <= 4096, "a kernel's parameters");

// The kernel of a configuration (STAGED = 1: outputs through the staging buffers) and its dynamic
// shared memory for E local experts.
typedef void (*fk_kernel_fn)(fk_params_t, fk_maps_t);
fk_kernel_fn fk_kernel(int staged);
size_t fk_smem_bytes(int staged, int64_t E);

#endif /* MOK_CUDA_FORWARD_FUSED_PARAMS_CUH */
