/*
 * task_plan.h: the global task order of the forward persistent kernel, and the counters and
 * targets its tasks wait on. Plain C, compiled for host and device (MOK_HD), so the kernel, the
 * host and the tests enumerate the same tasks in the same order.
 *
 * Tasks (W = 1; the expert-parallel kernel adds communication tasks in front of the same order):
 *   SHARED_GATE_UP (m, n)  shared expert, token tile m, column tile n of gate and up -> as
 *   GATE_UP     (e, m, n)  local expert e, row tile m of its rows, column tile n of gate and up
 *                          (SwiGLU and the router weight in the epilogue) -> a
 *   DOWN        (e, m, n)  expert e, row tile m, column tile n of H -> yk rows
 *   SHARED_DOWN (m, n)     shared expert down -> ys
 *   REDUCE      (b)        token block b: y = bf16(ys + yk(k=0) + ... + yk(K-1)), slot order
 *
 * The order: for s = 0 .. E + L - 1: GATE_UP tiles of expert s (s < E) followed by DOWN tiles of
 * expert s - L (s >= L); then the shared expert in bands of `shared_band` token tiles: for
 * u = 0 .. U (U bands), SHARED_GATE_UP tiles of band u (u < U) followed by SHARED_DOWN tiles of
 * band u - 1 (u >= 1); then REDUCE (none with no_reduce). The lag L >= 1 (field `lag`) keeps a
 * DOWN tile a few hundred tasks behind the GATE_UP tiles it reads, so that with a grid of ~132
 * CTAs they have finished by the time it is taken instead of running beside it; the shared
 * expert's band lag does the same for its down tiles. The shared expert comes last so that the reduce of a token block can start
 * as soon as its shared-expert tiles are done (every routed DOWN tile is done by then), beside the
 * shared expert's later bands (forward/fused.cu's reduce helpers; DeepSeek-V3's forward 3-9%
 * faster than with the shared expert's gate/up tiles first: docs/performance.md,
 * "Fused forward: the shared expert"). With `shared_first` (the expert-parallel kernel, which has
 * no REDUCE: no_reduce) the shared stages come first instead, then the expert stages: the shared
 * expert's tiles read this rank's own tokens and wait on no other rank, so they fill the SMs while
 * the other ranks' rows are dispatched.
 * Within a (kind, expert) block the tiles go row tile by row tile, column tiles inner, or, with
 * group_m > 0, in bands of group_m row tiles: column tile by column tile within a band, its row
 * tiles inner (mok_plan_tile). Consecutive tasks then share a weight tile (B), which the CTAs that
 * take them stream through L2 in step, while the band's few row tiles (A) stay in L2 across its
 * column tiles; row tile by row tile, the tiles that share a weight tile are a whole row of
 * column tiles apart, and the weights of an expert larger than L2 (DeepSeek-V3: 58 MB of gate
 * and up) come from HBM about twice. The host chooses group_m (mok_tile_group_m).
 *
 * Dependencies, each a counter that producers add 1 to (release) and the consumer waits on
 * (acquire) until it reaches its target:
 *   DOWN(e, m, *)        gu_done[e, m]        target n_gu       (every GATE_UP(e, m, *))
 *   SHARED_DOWN(m, *)    sgu_done[m]          target n_sgu      (every SHARED_GATE_UP(m, *))
 *   REDUCE(b)            down_done[b]         target down_target[b]: each DOWN tile adds 1 for
 *                                             every token block its rows touch (rows of an
 *                                             expert are sorted by token, so those are runs)
 *                        sd_done[b]           target n_sd (SHARED_DOWN(b, *); the reduce block
 *                                             equals the shared token tile)
 *   GATE_UP(e, m, *)     rows gathered by communication CTAs (or x read directly at W = 1).
 *
 * NOTE (deadlock freedom): every task waits only on tasks earlier in this order (or on
 * communication tasks, which wait only on the layout). Compute CTAs are all resident and each
 * takes its tasks in increasing order and finishes one before taking the next; then the earliest
 * unfinished task always has all its dependencies finished or running, so it finishes, and by
 * induction every task does, whatever the timing and whatever task -> CTA assignment is used
 * (static striding or a ticket counter). tests/test_task_plan.c checks this by simulation with
 * adversarial interleavings, and checks that an order violating it does deadlock there.
 */
#ifndef MOK_TASK_PLAN_H
#define MOK_TASK_PLAN_H

#include <stdint.h>

#ifdef __CUDACC__
#define MOK_HD __host__ __device__ __forceinline__
#else
#define MOK_HD static inline
#endif

typedef enum {
  MOK_TASK_SHARED_GATE_UP = 0,
  MOK_TASK_GATE_UP = 1,
  MOK_TASK_DOWN = 2,
  MOK_TASK_SHARED_DOWN = 3,
  MOK_TASK_REDUCE = 4
} mok_task_kind_t;

typedef struct {
  int32_t kind;   /* mok_task_kind_t */
  int32_t expert; /* local expert (GATE_UP, DOWN); -1 otherwise */
  int32_t m;      /* row tile within the expert, token tile (shared), or token block (REDUCE) */
  int32_t n;      /* column tile; 0 for REDUCE */
} mok_task_t;

typedef struct {
  int32_t E;              /* local experts */
  int32_t n_gu;           /* column tiles of a GATE_UP task row: I / BN */
  int32_t n_down;         /* column tiles of DOWN: H / BN */
  int32_t n_sgu;          /* shared gate/up column tiles: Is / BN (0 without a shared expert) */
  int32_t n_sd;           /* shared down column tiles: H / BN (0 without a shared expert) */
  int32_t t_tiles;        /* token tiles = reduce blocks: ceil(T / BM) */
  const int32_t *mt_pre;  /* [E + 1] prefix sums of row tiles per expert: ceil(rows_e / BM) */
  int32_t lag;            /* expert stages from an expert's GATE_UP tiles to its DOWN tiles; 0 = 1 */
  int32_t group_m;        /* row tiles per band of a block (see above); 0 = row tile by row tile */
  int32_t shared_band;    /* token tiles per band of the shared expert; 0 = 8 */
  int32_t no_reduce;      /* 1: the order ends before REDUCE (expert parallel: the tokens' expert
                             outputs must come home first, and a kernel after the combine sums
                             them) */
  int32_t shared_first;   /* 1: the shared stages before the expert stages (see above) */
} mok_task_plan_t;

MOK_HD int32_t mok_plan_lag(const mok_task_plan_t *p) { return p->lag > 0 ? p->lag : 1; }
MOK_HD int32_t mok_plan_shared_band(const mok_task_plan_t *p) {
  return p->shared_band > 0 ? p->shared_band : 8;
}

/* Tile r of a block of mt row tiles x nt column tiles, in the order described above. In 32-bit
 * arithmetic when the block's tiles fit: a 64-bit division is a long subroutine on the GPU, and
 * the persistent kernel's producer decodes a task between the last stage of one tile and the first
 * of the next. The fused launcher refuses plans of more than 2^30 tasks, so on the GPU the 64-bit
 * path is only reached with a band size (the tuning's tile_group_m) beyond any block; it keeps the function
 * right for every input (the CPU tests compare the two). */
MOK_HD void mok_plan_tile(const mok_task_plan_t *p, int64_t r, int32_t mt, int32_t nt,
                          mok_task_t *t) {
  if ((int64_t)(mt > p->group_m ? mt : p->group_m) * nt <= INT32_MAX) {
    const int32_t r32 = (int32_t)r;
    if (p->group_m <= 0) {
      t->m = r32 / nt, t->n = r32 % nt;
      return;
    }
    const int32_t per_band = p->group_m * nt, band = r32 / per_band;
    const int32_t g0 = band * p->group_m;                           /* first row tile of the band */
    const int32_t gm = mt - g0 < p->group_m ? mt - g0 : p->group_m; /* row tiles in the band */
    const int32_t local = r32 - band * per_band;
    t->n = local / gm, t->m = g0 + local % gm;
    return;
  }
  if (p->group_m <= 0) {
    t->m = (int32_t)(r / nt), t->n = (int32_t)(r % nt);
    return;
  }
  const int64_t per_band = (int64_t)p->group_m * nt;
  const int32_t g0 = (int32_t)(r / per_band) * p->group_m;        /* first row tile of the band */
  const int32_t gm = mt - g0 < p->group_m ? mt - g0 : p->group_m; /* row tiles in the band */
  const int64_t local = r % per_band;
  t->n = (int32_t)(local / gm), t->m = g0 + (int32_t)(local % gm);
}

/* First task of expert stage s in [0, E + L]: GATE_UP(s) (s < E), then DOWN(s - L) (s >= L).
 * Stage E + L is the end of the expert stages. */
MOK_HD int64_t mok_plan_stage_start(const mok_task_plan_t *p, int32_t s) {
  const int32_t g = s < p->E ? s : p->E, d = s - mok_plan_lag(p);
  return (int64_t)p->mt_pre[g] * p->n_gu +
         (int64_t)p->mt_pre[d < 0 ? 0 : (d > p->E ? p->E : d)] * p->n_down;
}

/* The shared expert's bands: U of them (0 without a shared expert), band v has
 * mok_plan_band_tiles(v) token tiles from token tile v * shared_band. */
MOK_HD int32_t mok_plan_bands(const mok_task_plan_t *p) {
  const int32_t sb = mok_plan_shared_band(p);
  return p->n_sgu > 0 ? (p->t_tiles + sb - 1) / sb : 0;
}
MOK_HD int32_t mok_plan_band_tiles(const mok_task_plan_t *p, int32_t v) {
  const int32_t sb = mok_plan_shared_band(p), left = p->t_tiles - v * sb;
  return v < 0 || v >= mok_plan_bands(p) ? 0 : (left < sb ? left : sb);
}
/* First task of shared stage u in [0, U + 1], counted from the end of the expert stages:
 * SHARED_GATE_UP tiles of band u (u < U), then SHARED_DOWN tiles of band u - 1 (u >= 1). Only
 * the last band can be short, so every stage before U - 1 ends a full band of each. */
MOK_HD int64_t mok_plan_shared_start(const mok_task_plan_t *p, int32_t u) {
  const int32_t U = mok_plan_bands(p), sb = mok_plan_shared_band(p);
  if (u <= 0 || U == 0) return 0;
  if (u > U) u = U + 1;
  /* bands 0 .. u - 1 of SHARED_GATE_UP (all full but the last band) and 0 .. u - 2 of SHARED_DOWN */
  const int64_t gu = u >= U ? p->t_tiles : (int64_t)u * sb;
  const int64_t sd = u - 1 >= U ? p->t_tiles : (int64_t)(u - 1) * sb;
  return gu * p->n_sgu + sd * p->n_sd;
}

MOK_HD int64_t mok_plan_num_tasks(const mok_task_plan_t *p) {
  return mok_plan_stage_start(p, p->E + mok_plan_lag(p)) +
         mok_plan_shared_start(p, mok_plan_bands(p) + 1) + (p->no_reduce ? 0 : p->t_tiles);
}

/* Task number of the first expert task (mok_plan_stage_start counts from it) and of the first
 * shared task (mok_plan_shared_start counts from it). */
MOK_HD int64_t mok_plan_experts_begin(const mok_task_plan_t *p) {
  return p->shared_first ? mok_plan_shared_start(p, mok_plan_bands(p) + 1) : 0;
}
MOK_HD int64_t mok_plan_shared_begin(const mok_task_plan_t *p) {
  return p->shared_first ? 0 : mok_plan_stage_start(p, p->E + mok_plan_lag(p));
}

/* The expert stage of expert task i (counted from mok_plan_experts_begin: mok_plan_stage_start(s)
 * <= i < the next stage's start, empty stages skipped). `hint`: the stage of an earlier task (0
 * if none). A CTA's next ticket is about one grid of tasks later, usually in the same stage or the next, so a
 * few steps forward from the hint end most searches; the rest (past runs of empty experts, or a
 * hint from a later task) take the binary search. */
MOK_HD int32_t mok_plan_stage_of(const mok_task_plan_t *p, int64_t i, int32_t hint) {
  int32_t lo = 0, hi = p->E + mok_plan_lag(p) - 1; /* the last stage s with stage_start(s) <= i */
  if (hint > 0 && hint <= hi && mok_plan_stage_start(p, hint) <= i) {
    lo = hint;
    for (int n = 0; n < 4 && lo < hi; n++) {
      if (mok_plan_stage_start(p, lo + 1) > i) {
        hi = lo;
        break;
      }
      lo++;
    }
  }
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (mok_plan_stage_start(p, mid) <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* Task number i (0 <= i < mok_plan_num_tasks) of the global order. *stage: in, a hint for
 * mok_plan_stage_of (the stage of an earlier task, or 0); out, the stage of task i when it is an
 * expert task (unchanged otherwise). The task does not depend on the hint. */
MOK_HD mok_task_t mok_plan_task_from(const mok_task_plan_t *p, int64_t i, int32_t *stage) {
  mok_task_t t = {MOK_TASK_REDUCE, -1, 0, 0};
  const int64_t experts = mok_plan_stage_start(p, p->E + mok_plan_lag(p));
  const int32_t U = mok_plan_bands(p);
  const int64_t shared = mok_plan_shared_start(p, U + 1);
  const int64_t e0 = p->shared_first ? shared : 0, s0 = p->shared_first ? 0 : experts;
  if (i >= e0 && i < e0 + experts) {
    i -= e0;
    const int32_t s = mok_plan_stage_of(p, i, *stage);
    *stage = s;
    int64_t r = i - mok_plan_stage_start(p, s);
    const int32_t mt = s < p->E ? p->mt_pre[s + 1] - p->mt_pre[s] : 0;
    const int64_t gu = (int64_t)mt * p->n_gu;
    if (r < gu) {
      t.kind = MOK_TASK_GATE_UP, t.expert = s;
      mok_plan_tile(p, r, mt, p->n_gu, &t);
    } else {
      r -= gu;
      t.kind = MOK_TASK_DOWN, t.expert = s - mok_plan_lag(p);
      mok_plan_tile(p, r, p->mt_pre[t.expert + 1] - p->mt_pre[t.expert], p->n_down, &t);
    }
    return t;
  }
  int64_t r = i - s0;
  if (r >= 0 && r < shared) {
    /* stage u: stages 1 .. U - 2 are all as long as stage 1, so divide, then step to the last
     * stage that starts at or before r */
    const int64_t s1 = mok_plan_shared_start(p, 1), len = mok_plan_shared_start(p, 2) - s1;
    int32_t u = r < s1 || len <= 0 ? 0 : 1 + (int32_t)((r - s1) / len);
    if (u > U) u = U;
    while (u > 0 && mok_plan_shared_start(p, u) > r) u--;
    while (u < U && mok_plan_shared_start(p, u + 1) <= r) u++;
    r -= mok_plan_shared_start(p, u);
    const int64_t gu = (int64_t)mok_plan_band_tiles(p, u) * p->n_sgu;
    const int32_t v = r < gu ? u : u - 1; /* the band */
    t.kind = r < gu ? MOK_TASK_SHARED_GATE_UP : MOK_TASK_SHARED_DOWN;
    mok_plan_tile(p, r < gu ? r : r - gu, mok_plan_band_tiles(p, v), r < gu ? p->n_sgu : p->n_sd,
                  &t);
    t.m += v * mok_plan_shared_band(p);
    return t;
  }
  t.m = (int32_t)(i - experts - shared);
  return t;
}

/* Task number i (0 <= i < mok_plan_num_tasks) of the global order. */
MOK_HD mok_task_t mok_plan_task(const mok_task_plan_t *p, int64_t i) {
  int32_t stage = 0;
  return mok_plan_task_from(p, i, &stage);
}

#endif /* MOK_TASK_PLAN_H */
