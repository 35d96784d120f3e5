/*
 * test_task_plan_bwd.c: the fused backward's global task order (src/common/task_plan_bwd.h),
 * checked before any kernel uses it.
 *
 * 1. Enumeration: every task exists exactly once, of the right kinds and counts, in SAVE and
 *    RECOMPUTE mode, with and without a shared expert, with bands of row tiles, with experts
 *    without rows.
 * 2. Order: every task's inputs come from tasks earlier in the order (derived here from the
 *    layout, not from the plan's counters), the property the deadlock-freedom argument needs.
 * 3. Deadlock freedom and the targets, by simulation: G resident "CTAs" take tasks by ticket,
 *    wait on the plan's counters until their targets, and are stepped by adversarial schedulers;
 *    every run finishes, and no task starts before every task it reads from has finished.
 * 4. The checker can fail: a DX ahead of its DS (lag_dx = 0 forced into the order) deadlocks or
 *    reads unfinished inputs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/task_plan_bwd.h"
#include "support/plan_layout.h"
#include "test.h"

enum { BM = 4, MAXE = 16 }; /* rows per tile and tokens per block in these small shapes */

typedef struct {
  mok_layout_t lay;
  int32_t mt_pre[MAXE + 1];
  mok_bwd_plan_t plan;
  int64_t T;
  int64_t *dx_target; /* [t_tiles] */
} bproblem_t;

static void add_dx_target(void *arg, int64_t b) {
  bproblem_t *pb = arg;
  pb->dx_target[b] += pb->plan.n_dx;
}

/* A random routing (expert 0 hot, some experts without rows, empty slots), then the plan. */
static int bproblem_init(bproblem_t *pb, uint64_t seed, int64_t T, int32_t E, int64_t K,
                         int shared, int recompute, int group_m, int lag_dx, int lag_dw) {
  memset(pb, 0, sizeof(*pb));
  if (!plan_layout_random(&pb->lay, pb->mt_pre, seed, T, E, K, 1, BM)) return 0;
  pb->T = T;
  mok_bwd_plan_t p;
  memset(&p, 0, sizeof(p));
  p.E = E, p.recompute = recompute, p.n_gu = 2, p.n_ds = 2, p.n_dx = 3;
  p.dwd_m = 3, p.dwd_n = 2, p.dwgu_m = 2, p.dwgu_n = 3;
  if (shared) {
    p.n_sgu = p.n_sds = 2, p.n_sdx = 3;
    p.sdwd_m = 3, p.sdwd_n = 2, p.sdwgu_m = 2, p.sdwgu_n = 3;
  }
  p.t_tiles = (int32_t)((T + BM - 1) / BM), p.mt_pre = pb->mt_pre;
  p.lag_dx = lag_dx, p.lag_dw = lag_dw, p.group_m = group_m, p.shared_band = 3;
  pb->plan = p;
  pb->dx_target = calloc((size_t)p.t_tiles + 1, sizeof(int64_t));
  for (int32_t e = 0; e < E; e++)  /* each DX tile adds 1 for each block its rows touch */
    for (int32_t m = 0; m < pb->mt_pre[e + 1] - pb->mt_pre[e]; m++)
      plan_for_each_block(&pb->lay, e, m, BM, add_dx_target, pb);
  return 1;
}

static void bproblem_free(bproblem_t *pb) {
  mok_layout_free(&pb->lay);
  free(pb->dx_target);
}

/* A dense id of a task's coordinates. */
static int64_t bkey(const mok_bwd_plan_t *p, mok_task_t t) {
  const int64_t mt = p->mt_pre[p->E] + p->t_tiles + 8;
  return (((int64_t)t.kind * (MAXE + 1) + (t.expert + 1)) * mt + t.m) * 8 + t.n;
}
static int64_t bkey_space(const mok_bwd_plan_t *p) {
  return 11 * (int64_t)(MAXE + 1) * (p->mt_pre[p->E] + p->t_tiles + 8) * 8;
}

typedef struct {
  const bproblem_t *pb;
  int64_t n;
  int64_t *index_of;      /* bkey -> task number, -1 none */
  unsigned char *done;    /* by task number */
  int64_t *rgu, *ds, *ds_exp, *sgu, *sds, *dx, *sdx; /* counters */
  int64_t sds_all;
} bsim_t;

static int64_t find(const bsim_t *s, mok_task_t t) { return s->index_of[bkey(&s->pb->plan, t)]; }

/* plan_for_each_block callbacks: a touched block's mark ({block, touched}), a DX release. */
static void mark_block(void *arg, int64_t b) {
  int64_t *m = arg;
  m[1] |= b == m[0];
}
static void add_dx(void *arg, int64_t b) { ((bsim_t *)arg)->dx[b]++; }

/* Calls f(task) for every task whose output t reads, derived from the layout. */
static void for_each_input(const bsim_t *s, mok_task_t t, void (*f)(void *, int64_t), void *arg) {
  const mok_bwd_plan_t *p = &s->pb->plan;
  mok_task_t u = {0, t.expert, t.m, 0};
  const int32_t mt = t.expert >= 0 ? p->mt_pre[t.expert + 1] - p->mt_pre[t.expert] : 0;
  switch (t.kind) {
    case MOK_BTASK_DS:
      if (p->recompute) {
        u.kind = MOK_BTASK_GATE_UP, u.n = t.n; /* g, u of the same columns */
        f(arg, find(s, u));
      }
      break;
    case MOK_BTASK_DX:
      u.kind = MOK_BTASK_DS;
      for (u.n = 0; u.n < p->n_ds; u.n++) f(arg, find(s, u));
      break;
    case MOK_BTASK_DW_DOWN:
    case MOK_BTASK_DW_GATE_UP:
      u.kind = MOK_BTASK_DS;
      for (u.m = 0; u.m < mt; u.m++)
        for (u.n = 0; u.n < p->n_ds; u.n++) f(arg, find(s, u));
      break;
    case MOK_BTASK_SHARED_DS:
      if (p->recompute) {
        u.kind = MOK_BTASK_SHARED_GATE_UP, u.n = t.n;
        f(arg, find(s, u));
      }
      break;
    case MOK_BTASK_SHARED_DX:
      u.kind = MOK_BTASK_SHARED_DS;
      for (u.n = 0; u.n < p->n_sds; u.n++) f(arg, find(s, u));
      break;
    case MOK_BTASK_SHARED_DW_DOWN:
    case MOK_BTASK_SHARED_DW_GATE_UP:
      u.kind = MOK_BTASK_SHARED_DS;
      for (u.m = 0; u.m < p->t_tiles; u.m++)
        for (u.n = 0; u.n < p->n_sds; u.n++) f(arg, find(s, u));
      break;
    case MOK_BTASK_REDUCE_DX:
      for (int32_t e = 0; e < p->E; e++)
        for (int32_t m = 0; m < p->mt_pre[e + 1] - p->mt_pre[e]; m++) {
          int64_t touches[2] = {t.m, 0};
          plan_for_each_block(&s->pb->lay, e, m, BM, mark_block, touches);
          if (!touches[1]) continue;
          mok_task_t d = {MOK_BTASK_DX, e, m, 0};
          for (d.n = 0; d.n < p->n_dx; d.n++) f(arg, find(s, d));
        }
      if (p->n_sdx) {
        mok_task_t d = {MOK_BTASK_SHARED_DX, -1, t.m, 0};
        for (d.n = 0; d.n < p->n_sdx; d.n++) f(arg, find(s, d));
      }
      break;
    default: break;
  }
}

typedef struct {
  const bsim_t *s;
  int64_t before; /* a position: inputs must be below it */
  int64_t bad;
} input_check_t;

static void check_earlier(void *arg, int64_t task) {
  input_check_t *c = arg;
  c->bad += task < 0 || task >= c->before;
}
static void check_done(void *arg, int64_t task) {
  input_check_t *c = arg;
  c->bad += task < 0 || !c->s->done[task];
}

/* The plan's counters (task_plan_bwd.h's table) for task t: 1 when every wait is satisfied. */
static int waits_satisfied(const bsim_t *s, mok_task_t t) {
  const mok_bwd_plan_t *p = &s->pb->plan;
  const int32_t row = t.expert >= 0 ? p->mt_pre[t.expert] + t.m : 0;
  switch (t.kind) {
    case MOK_BTASK_DS: return !p->recompute || s->rgu[row] >= p->n_gu;
    case MOK_BTASK_DX: return s->ds[row] >= p->n_ds;
    case MOK_BTASK_DW_DOWN:
    case MOK_BTASK_DW_GATE_UP:
      return s->ds_exp[t.expert] >=
             (int64_t)(p->mt_pre[t.expert + 1] - p->mt_pre[t.expert]) * p->n_ds;
    case MOK_BTASK_SHARED_DS: return !p->recompute || s->sgu[t.m] >= p->n_sgu;
    case MOK_BTASK_SHARED_DX: return s->sds[t.m] >= p->n_sds;
    case MOK_BTASK_SHARED_DW_DOWN:
    case MOK_BTASK_SHARED_DW_GATE_UP: return s->sds_all >= (int64_t)p->t_tiles * p->n_sds;
    case MOK_BTASK_REDUCE_DX:
      return s->dx[t.m] >= s->pb->dx_target[t.m] && (p->n_sdx == 0 || s->sdx[t.m] >= p->n_sdx);
    default: return 1;
  }
}

/* Task t finished: its releases. */
static void release(bsim_t *s, mok_task_t t) {
  const mok_bwd_plan_t *p = &s->pb->plan;
  const int32_t row = t.expert >= 0 ? p->mt_pre[t.expert] + t.m : 0;
  switch (t.kind) {
    case MOK_BTASK_GATE_UP: s->rgu[row]++; break;
    case MOK_BTASK_DS: s->ds[row]++, s->ds_exp[t.expert]++; break;
    case MOK_BTASK_DX: plan_for_each_block(&s->pb->lay, t.expert, t.m, BM, add_dx, s); break;
    case MOK_BTASK_SHARED_GATE_UP: s->sgu[t.m]++; break;
    case MOK_BTASK_SHARED_DS: s->sds[t.m]++, s->sds_all++; break;
    case MOK_BTASK_SHARED_DX: s->sdx[t.m]++; break;
    default: break;
  }
}

static void bsim_init(bsim_t *s, const bproblem_t *pb) {
  memset(s, 0, sizeof(*s));
  s->pb = pb;
  s->n = mok_bplan_num_tasks(&pb->plan);
  const int64_t keys = bkey_space(&pb->plan);
  s->index_of = malloc(sizeof(int64_t) * (size_t)keys);
  for (int64_t k = 0; k < keys; k++) s->index_of[k] = -1;
  const size_t rows = (size_t)pb->plan.mt_pre[pb->plan.E] + 1, tt = (size_t)pb->plan.t_tiles + 1;
  s->done = calloc((size_t)s->n + 1, 1);
  s->rgu = calloc(rows, 8), s->ds = calloc(rows, 8), s->ds_exp = calloc(MAXE, 8);
  s->sgu = calloc(tt, 8), s->sds = calloc(tt, 8), s->dx = calloc(tt, 8), s->sdx = calloc(tt, 8);
}

static void bsim_free(bsim_t *s) {
  free(s->index_of), free(s->done), free(s->rgu), free(s->ds), free(s->ds_exp);
  free(s->sgu), free(s->sds), free(s->dx), free(s->sdx);
}

/* Enumerates the tasks in `order` (positions -> task numbers; NULL: the plan's). 0 when a task
 * repeats or a coordinate is out of range. */
static int enumerate(bsim_t *s, const int64_t *order, int64_t counts[11]) {
  memset(counts, 0, 11 * sizeof(int64_t));
  for (int64_t i = 0; i < s->n; i++) {
    const mok_task_t t = mok_bplan_task(&s->pb->plan, order ? order[i] : i);
    if (t.kind < 0 || t.kind > MOK_BTASK_REDUCE_DX || t.m < 0 || t.n < 0 || t.n >= 8) return 0;
    const int64_t k = bkey(&s->pb->plan, t);
    if (s->index_of[k] >= 0) return 0;
    s->index_of[k] = order ? order[i] : i;
    counts[t.kind]++;
  }
  return 1;
}

enum { POLICY_RANDOM = 0, POLICY_LATEST = 1, POLICY_EARLIEST = 2 };

/* G CTAs take tasks in `order` by ticket; returns 1 when every task finished. *bad: tasks that
 * started before all their inputs were done. */
static int simulate(const bproblem_t *pb, const int64_t *order, int G, int policy, uint64_t seed,
                    int64_t *bad) {
  bsim_t s;
  bsim_init(&s, pb);
  int64_t counts[11];
  enumerate(&s, NULL, counts);
  int64_t cur[64], left[64], next = 0, finished = 0;
  test_rng_t rng = test_rng(seed);
  *bad = 0;
  for (int c = 0; c < G; c++) cur[c] = next < s.n ? next++ : -1, left[c] = 0;
  for (;;) {
    int runnable[64], nr = 0;
    for (int c = 0; c < G; c++) {
      if (cur[c] < 0) continue;
      const mok_task_t t = mok_bplan_task(&pb->plan, order ? order[cur[c]] : cur[c]);
      if (left[c] > 0 || waits_satisfied(&s, t)) runnable[nr++] = c;
    }
    if (nr == 0) break;
    int c = runnable[policy == POLICY_RANDOM ? test_rng_u64(&rng) % (uint64_t)nr : 0];
    for (int j = 0; j < nr && policy != POLICY_RANDOM; j++) {
      if (policy == POLICY_LATEST && cur[runnable[j]] > cur[c]) c = runnable[j];
      if (policy == POLICY_EARLIEST && cur[runnable[j]] < cur[c]) c = runnable[j];
    }
    const int64_t task = order ? order[cur[c]] : cur[c];
    const mok_task_t t = mok_bplan_task(&pb->plan, task);
    if (left[c] == 0) {  /* starts now: everything it reads is written */
      input_check_t ic = {&s, 0, 0};
      for_each_input(&s, t, check_done, &ic);
      *bad += ic.bad != 0;
      left[c] = 1 + (int64_t)(test_rng_u64(&rng) % 3);
    }
    if (--left[c] > 0) continue;
    s.done[task] = 1;
    release(&s, t);
    finished++;
    cur[c] = next < s.n ? next++ : -1;
  }
  bsim_free(&s);
  return finished == s.n;
}

static void check_plan(const bproblem_t *pb, const char *what) {
  bsim_t s;
  bsim_init(&s, pb);
  int64_t counts[11];
  MOK_REQUIRE_MSG(enumerate(&s, NULL, counts), "%s: a task repeats or is out of range", what);
  const mok_bwd_plan_t *p = &pb->plan;
  const int64_t rt = p->mt_pre[p->E], shared = p->n_sds > 0;
  const int64_t want[11] = {p->recompute ? rt * p->n_gu : 0, rt * p->n_ds, rt * p->n_dx,
                            (int64_t)p->E * p->dwd_m * p->dwd_n,
                            (int64_t)p->E * p->dwgu_m * p->dwgu_n,
                            shared && p->recompute ? (int64_t)p->t_tiles * p->n_sgu : 0,
                            shared ? (int64_t)p->t_tiles * p->n_sds : 0,
                            shared ? (int64_t)p->t_tiles * p->n_sdx : 0,
                            shared ? (int64_t)p->sdwd_m * p->sdwd_n : 0,
                            shared ? (int64_t)p->sdwgu_m * p->sdwgu_n : 0, p->t_tiles};
  for (int k = 0; k < 11; k++)
    MOK_EXPECT_MSG(counts[k] == want[k], "%s: %lld tasks of kind %d, expected %lld", what,
                   (long long)counts[k], k, (long long)want[k]);
  int64_t late = 0;
  for (int64_t i = 0; i < s.n; i++) {
    input_check_t ic = {&s, i, 0};
    for_each_input(&s, mok_bplan_task(p, i), check_earlier, &ic);
    late += ic.bad != 0;
  }
  MOK_EXPECT_MSG(late == 0, "%s: %lld tasks read a task that comes later (or none)", what,
                 (long long)late);
  bsim_free(&s);
  for (int policy = 0; policy < 3; policy++)
    for (int G = 1; G <= 33; G += 8) {
      int64_t bad = 0;
      const int ok = simulate(pb, NULL, G, policy, 0x51u + (uint64_t)G, &bad);
      MOK_EXPECT_MSG(ok && bad == 0, "%s: G = %d, policy %d: %s, %lld tasks started early", what,
                     G, policy, ok ? "finished" : "DEADLOCK", (long long)bad);
    }
}

MOK_TEST(bwd_plan_enumerates_orders_and_never_deadlocks) {
  const struct {
    int64_t T;
    int32_t E;
    int shared, recompute, group_m, lag_dx, lag_dw;
  } cases[] = {{57, 6, 1, 0, 0, 1, 1},  {57, 6, 1, 1, 0, 1, 2}, {101, 8, 0, 1, 2, 2, 1},
               {101, 8, 1, 1, 3, 1, 3}, {9, 3, 1, 1, 0, 1, 1},  {64, 16, 0, 0, 2, 3, 3}};
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    bproblem_t pb;
    MOK_REQUIRE(bproblem_init(&pb, 0xb0u + c, cases[c].T, cases[c].E, 3, cases[c].shared,
                              cases[c].recompute, cases[c].group_m, cases[c].lag_dx,
                              cases[c].lag_dw));
    char what[96];
    snprintf(what, sizeof(what), "T=%lld E=%d shared=%d recompute=%d group_m=%d lags %d/%d",
             (long long)cases[c].T, cases[c].E, cases[c].shared, cases[c].recompute,
             cases[c].group_m, cases[c].lag_dx, cases[c].lag_dw);
    check_plan(&pb, what);
    bproblem_free(&pb);
  }
}

/* The fused backward kernel's plan (src/cuda/backward/fused.cu): no DS tiles (the prologue's),
 * no shared expert, DX tiles an expert stage ahead of DW ones by lag_dw: every DX, DW and REDUCE
 * task once, and no deadlock. */
MOK_TEST(bwd_plan_without_ds_is_dx_dw_then_reduce) {
  const int32_t lags[3] = {1, 2, 5};
  for (int c = 0; c < 3; c++) {
    bproblem_t pb;
    MOK_REQUIRE(bproblem_init(&pb, 0xd0u + c, 101, 8, 3, 0, 0, c, 1, lags[c]));
    pb.plan.n_ds = 0, pb.plan.n_gu = 0;
    char what[64];
    snprintf(what, sizeof(what), "no DS, lag_dw %d", lags[c]);
    check_plan(&pb, what);
    const int64_t n = mok_bplan_num_tasks(&pb.plan);
    int64_t first_dw_of_last = n, last_dx = -1;
    for (int64_t i = 0; i < n; i++) {
      const mok_task_t t = mok_bplan_task(&pb.plan, i);
      if (t.kind == MOK_BTASK_DX) last_dx = i;
      if (t.kind == MOK_BTASK_DW_DOWN && t.expert == 7 && i < first_dw_of_last)
        first_dw_of_last = i;
    }
    /* the kernel's BK_PAST_DX: every DX task lies before stage E + 1 */
    MOK_EXPECT_MSG(last_dx < mok_bplan_stage_start(&pb.plan, pb.plan.E + 1), "%s: a DX task at "
                   "%lld, past stage E + 1", what, (long long)last_dx);
    MOK_EXPECT_MSG(lags[c] == 1 || first_dw_of_last > last_dx, "%s: the last expert's DW tiles "
                   "start before the last DX tile", what);
    bproblem_free(&pb);
  }
}

/* The checker can fail: the plan's order with every expert's DX tiles moved in front of its DS
 * tiles must deadlock or start a task early under some schedule. */
MOK_TEST(bwd_plan_checker_detects_dx_before_ds) {
  bproblem_t pb;
  MOK_REQUIRE(bproblem_init(&pb, 0xbadu, 57, 6, 3, 0, 0, 0, 1, 1));
  const int64_t n = mok_bplan_num_tasks(&pb.plan);
  int64_t *order = malloc(sizeof(int64_t) * (size_t)n), w = 0;
  for (int64_t i = 0; i < n; i++)  /* every DX first, then the rest in plan order */
    if (mok_bplan_task(&pb.plan, i).kind == MOK_BTASK_DX) order[w++] = i;
  for (int64_t i = 0; i < n; i++)
    if (mok_bplan_task(&pb.plan, i).kind != MOK_BTASK_DX) order[w++] = i;
  int caught = 0;
  for (int G = 1; G <= 9; G += 4) {
    int64_t bad = 0;
    caught |= !simulate(&pb, order, G, POLICY_EARLIEST, 7, &bad) || bad > 0;
  }
  MOK_EXPECT_MSG(caught, "an order with DX before DS passed the simulation");
  free(order);
  bproblem_free(&pb);
}
