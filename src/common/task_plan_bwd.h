/*
 * task_plan_bwd.h: the global task order of the fused backward kernel and the counters and targets
 * its tasks wait on. The kernel that exists (src/cuda/backward/fused.cu) runs its DX, DW and
 * REDUCE_DX tasks after the chain's prologue (src/gpu/backward.c); the GATE_UP, DS and shared
 * tasks are planned here, not yet in a kernel.
 * Plain C for host and device, like the forward's src/common/task_plan.h;
 * tests/test_task_plan_bwd.c checks it by simulation before any kernel depends on it.
 *
 * Tasks (W = 1; the expert-parallel kernel puts its dispatch of x, dy in front and its combine of
 * dxk rows in DX's epilogue):
 *   GATE_UP     (e, m, n)  RECOMPUTE only: bf16 g, u of row tile m, column tile n of I
 *   DS          (e, m, n)  ds = dyg · Wd[e] on column tile n of I (reduction H), with SwiGLU
 *                          backward in the epilogue: a, dg, du and the row's router-gradient
 *                          partial Σ ds s over the tile's columns (one slot per column tile)
 *   DX          (e, m, n)  dxk rows = [dg du] · [Wg; Wu][e] on column tile n of H (reduction 2I)
 *   DW_DOWN     (e, m, n)  dWd[e] tile (m of H, n of I) = Σ over e's rows, in layout order, of
 *                          dyᵀ a: an owned tile, written once (or accumulated) in fp32 registers
 *   DW_GATE_UP  (e, m, n)  dWg[e] and dWu[e] tiles (m of I, n of H) = Σ rows dgᵀ x, duᵀ x
 *   SHARED_*    (m, n)     the shared expert's GATE_UP (RECOMPUTE), DS, DX over token tiles m,
 *                          then its DW_DOWN and DW_GATE_UP tiles over all tokens
 *   REDUCE_DX   (b)        token block b: dx = bf16(dxs + Σ_k bf16(dxk)) in slot order, and
 *                          dtopk_w = the partials of each slot's row summed in column-tile order
 *
 * The order: for expert stage s = 0 .. E + L - 1 (L = max(lag_dx, lag_dw)): GATE_UP tiles of
 * expert s (RECOMPUTE, s < E), DS tiles of s (s < E), DX tiles of s - lag_dx, DW_DOWN then
 * DW_GATE_UP tiles of s - lag_dw (each when in [0, E)); then the shared expert in bands of
 * `shared_band` token tiles: for u = 0 .. U, its GATE_UP (RECOMPUTE) and DS tiles of band u
 * (u < U) and DX tiles of band u - 1 (u >= 1); then its DW_DOWN and DW_GATE_UP tiles; then
 * REDUCE_DX. Within a block the tiles go as in the forward (mok_plan_tile: row tile by row tile,
 * or bands of group_m row tiles; weight-gradient tiles in their own grid, m inner when banded).
 * An expert without rows still has its DW tiles (they write zeros, or leave an accumulated
 * gradient as it was) and nothing else.
 *
 * Dependencies (counters that producers add 1 to, with targets):
 *   DS(e, m, *)          RECOMPUTE: rgu_done[e, m]      target n_gu
 *   DX(e, m, *)          ds_done[e, m]                  target n_ds
 *   DW_*(e, *, *)        ds_expert_done[e]              target (row tiles of e) · n_ds
 *   SHARED_DS(m, *)      RECOMPUTE: sgu_done[m]         target n_sgu
 *   SHARED_DX(m, *)      sds_done[m]                    target n_sds
 *   SHARED_DW_*          sds_all                        target t_tiles · n_sds
 *   REDUCE_DX(b)         dx_done[b]                     target Σ over DX tiles of the token
 *                                                       blocks their rows touch (as the forward's
 *                                                       REDUCE counts DOWN tiles)
 *                        sdx_done[b]                    target n_sdx (with a shared expert)
 *
 * NOTE (deadlock freedom): with lag_dx, lag_dw >= 1 every task waits only on tasks earlier in the
 * order (a DS before its DX and DW a stage or more later, GATE_UP before DS in the same stage,
 * the shared expert's DS a band before its DX and before all its DW), so the forward's argument
 * holds as it is (task_plan.h's NOTE): resident CTAs taking tasks in order, each finishing one
 * before it takes the next, always finish.
 */
#ifndef MOK_TASK_PLAN_BWD_H
#define MOK_TASK_PLAN_BWD_H

#include "common/task_plan.h"

typedef enum {
  MOK_BTASK_GATE_UP = 0,
  MOK_BTASK_DS = 1,
  MOK_BTASK_DX = 2,
  MOK_BTASK_DW_DOWN = 3,
  MOK_BTASK_DW_GATE_UP = 4,
  MOK_BTASK_SHARED_GATE_UP = 5,
  MOK_BTASK_SHARED_DS = 6,
  MOK_BTASK_SHARED_DX = 7,
  MOK_BTASK_SHARED_DW_DOWN = 8,
  MOK_BTASK_SHARED_DW_GATE_UP = 9,
  MOK_BTASK_REDUCE_DX = 10
} mok_btask_kind_t;

typedef struct {
  int32_t E;              /* local experts */
  int32_t recompute;      /* 1: RECOMPUTE mode (the GATE_UP tasks exist) */
  int32_t n_gu, n_ds;     /* column tiles over I of GATE_UP and of DS */
  int32_t n_dx;           /* column tiles over H of DX */
  int32_t dwd_m, dwd_n;   /* DW_DOWN tiles of one expert: over H, over I */
  int32_t dwgu_m, dwgu_n; /* DW_GATE_UP tiles of one expert: over I, over H */
  int32_t n_sgu, n_sds, n_sdx;     /* the shared expert's column tiles (0: no shared expert) */
  int32_t sdwd_m, sdwd_n, sdwgu_m, sdwgu_n; /* its weight-gradient tiles */
  int32_t t_tiles;        /* token tiles = reduce blocks */
  const int32_t *mt_pre;  /* [E + 1] prefix sums of row tiles per expert */
  int32_t lag_dx, lag_dw; /* expert stages from an expert's DS tiles to its DX / DW tiles (>= 1) */
  int32_t group_m;        /* row tiles per band (task_plan.h); 0 = row tile by row tile */
  int32_t shared_band;    /* token tiles per band of the shared expert; 0 = 8 */
} mok_bwd_plan_t;

/* The forward plan's tile order, for a block of mt x nt tiles of this plan. */
MOK_HD void mok_bplan_tile(const mok_bwd_plan_t *p, int64_t r, int32_t mt, int32_t nt,
                           mok_task_t *t) {
  mok_task_plan_t f;
  f.group_m = p->group_m;
  mok_plan_tile(&f, r, mt, nt, t);
}

MOK_HD int32_t mok_bplan_lag(const mok_bwd_plan_t *p) {
  const int32_t dx = p->lag_dx > 0 ? p->lag_dx : 1, dw = p->lag_dw > 0 ? p->lag_dw : 1;
  return dx > dw ? dx : dw;
}
MOK_HD int32_t mok_bplan_clamp(int32_t s, int32_t E) { return s < 0 ? 0 : s > E ? E : s; }
MOK_HD int64_t mok_bplan_dw_tiles(const mok_bwd_plan_t *p) {
  return (int64_t)p->dwd_m * p->dwd_n + (int64_t)p->dwgu_m * p->dwgu_n;
}

/* First task of expert stage s in [0, E + L] (stage E + L: the end of the expert stages). */
MOK_HD int64_t mok_bplan_stage_start(const mok_bwd_plan_t *p, int32_t s) {
  const int32_t lx = p->lag_dx > 0 ? p->lag_dx : 1, lw = p->lag_dw > 0 ? p->lag_dw : 1;
  const int32_t g = mok_bplan_clamp(s, p->E);
  return (int64_t)p->mt_pre[g] * ((p->recompute ? p->n_gu : 0) + p->n_ds) +
         (int64_t)p->mt_pre[mok_bplan_clamp(s - lx, p->E)] * p->n_dx +
         (int64_t)mok_bplan_clamp(s - lw, p->E) * mok_bplan_dw_tiles(p);
}

MOK_HD int32_t mok_bplan_shared_band(const mok_bwd_plan_t *p) {
  return p->shared_band > 0 ? p->shared_band : 8;
}
MOK_HD int32_t mok_bplan_bands(const mok_bwd_plan_t *p) {
  const int32_t sb = mok_bplan_shared_band(p);
  return p->n_sds > 0 ? (p->t_tiles + sb - 1) / sb : 0;
}
/* Token tiles before band v (v in [0, U]). */
MOK_HD int64_t mok_bplan_band_start(const mok_bwd_plan_t *p, int32_t v) {
  const int64_t t = (int64_t)v * mok_bplan_shared_band(p);
  return v <= 0 ? 0 : t < p->t_tiles ? t : p->t_tiles;
}
/* First task of shared stage u in [0, U + 1] from the end of the expert stages: GATE_UP
 * (RECOMPUTE) and DS tiles of bands < u, DX tiles of bands < u - 1. */
MOK_HD int64_t mok_bplan_shared_start(const mok_bwd_plan_t *p, int32_t u) {
  const int32_t U = mok_bplan_bands(p);
  if (u <= 0 || U == 0) return 0;
  if (u > U + 1) u = U + 1;
  return mok_bplan_band_start(p, u) * ((p->recompute ? p->n_sgu : 0) + p->n_sds) +
         mok_bplan_band_start(p, u - 1) * p->n_sdx;
}
MOK_HD int64_t mok_bplan_shared_dw_tiles(const mok_bwd_plan_t *p) {
  return p->n_sds > 0 ? (int64_t)p->sdwd_m * p->sdwd_n + (int64_t)p->sdwgu_m * p->sdwgu_n : 0;
}

MOK_HD int64_t mok_bplan_num_tasks(const mok_bwd_plan_t *p) {
  return mok_bplan_stage_start(p, p->E + mok_bplan_lag(p)) +
         mok_bplan_shared_start(p, mok_bplan_bands(p) + 1) + mok_bplan_shared_dw_tiles(p) +
         p->t_tiles;
}

/* Task number i (0 <= i < mok_bplan_num_tasks) of the global order. */
MOK_HD mok_task_t mok_bplan_task(const mok_bwd_plan_t *p, int64_t i) {
  mok_task_t t = {MOK_BTASK_REDUCE_DX, -1, 0, 0};
  const int32_t lx = p->lag_dx > 0 ? p->lag_dx : 1, lw = p->lag_dw > 0 ? p->lag_dw : 1;
  const int32_t L = mok_bplan_lag(p);
  const int64_t experts_end = mok_bplan_stage_start(p, p->E + L);
  if (i < experts_end) {
    int32_t lo = 0, hi = p->E + L - 1; /* the last stage starting at or before i */
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (mok_bplan_stage_start(p, mid) <= i) lo = mid;
      else hi = mid - 1;
    }
    const int32_t s = lo;
    int64_t r = i - mok_bplan_stage_start(p, s);
    if (s < p->E) {
      const int32_t mt = p->mt_pre[s + 1] - p->mt_pre[s];
      const int64_t gu = p->recompute ? (int64_t)mt * p->n_gu : 0, ds = (int64_t)mt * p->n_ds;
      t.expert = s;
      if (r < gu) {
        t.kind = MOK_BTASK_GATE_UP;
        mok_bplan_tile(p, r, mt, p->n_gu, &t);
        return t;
      }
      r -= gu;
      if (r < ds) {
        t.kind = MOK_BTASK_DS;
        mok_bplan_tile(p, r, mt, p->n_ds, &t);
        return t;
      }
      r -= ds;
    }
    const int32_t ex = s - lx;
    if (ex >= 0 && ex < p->E) {
      const int32_t mt = p->mt_pre[ex + 1] - p->mt_pre[ex];
      const int64_t dx = (int64_t)mt * p->n_dx;
      if (r < dx) {
        t.kind = MOK_BTASK_DX, t.expert = ex;
        mok_bplan_tile(p, r, mt, p->n_dx, &t);
        return t;
      }
      r -= dx;
    }
    const int32_t ew = s - lw; /* this stage's DW tiles (the search put i in a stage that has r) */
    const int64_t dwd = (int64_t)p->dwd_m * p->dwd_n;
    t.expert = ew;
    if (r < dwd) {
      t.kind = MOK_BTASK_DW_DOWN;
      mok_bplan_tile(p, r, p->dwd_m, p->dwd_n, &t);
    } else {
      t.kind = MOK_BTASK_DW_GATE_UP;
      mok_bplan_tile(p, r - dwd, p->dwgu_m, p->dwgu_n, &t);
    }
    return t;
  }
  int64_t r = i - experts_end;
  const int32_t U = mok_bplan_bands(p);
  const int64_t shared = mok_bplan_shared_start(p, U + 1);
  if (r < shared) {
    int32_t u = 0; /* the last shared stage starting at or before r */
    while (u < U && mok_bplan_shared_start(p, u + 1) <= r) u++;
    r -= mok_bplan_shared_start(p, u);
    if (u < U) {
      const int32_t b0 = (int32_t)mok_bplan_band_start(p, u);
      const int32_t bt = (int32_t)(mok_bplan_band_start(p, u + 1) - b0);
      const int64_t gu = p->recompute ? (int64_t)bt * p->n_sgu : 0, ds = (int64_t)bt * p->n_sds;
      if (r < gu + ds) {
        t.kind = r < gu ? MOK_BTASK_SHARED_GATE_UP : MOK_BTASK_SHARED_DS;
        mok_bplan_tile(p, r < gu ? r : r - gu, bt, r < gu ? p->n_sgu : p->n_sds, &t);
        t.m += b0;
        return t;
      }
      r -= gu + ds;
    }
    const int32_t b0 = (int32_t)mok_bplan_band_start(p, u - 1); /* DX of band u - 1 */
    const int32_t bt = (int32_t)(mok_bplan_band_start(p, u) - b0);
    t.kind = MOK_BTASK_SHARED_DX;
    mok_bplan_tile(p, r, bt, p->n_sdx, &t);
    t.m += b0;
    return t;
  }
  r -= shared;
  const int64_t sdw = mok_bplan_shared_dw_tiles(p), sdwd = (int64_t)p->sdwd_m * p->sdwd_n;
  if (r < sdw) {
    if (r < sdwd) {
      t.kind = MOK_BTASK_SHARED_DW_DOWN;
      mok_bplan_tile(p, r, p->sdwd_m, p->sdwd_n, &t);
    } else {
      t.kind = MOK_BTASK_SHARED_DW_GATE_UP;
      mok_bplan_tile(p, r - sdwd, p->sdwgu_m, p->sdwgu_n, &t);
    }
    return t;
  }
  t.m = (int32_t)(r - sdw);
  return t;
}

#endif /* MOK_TASK_PLAN_BWD_H */
