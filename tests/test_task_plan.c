/*
 * test_task_plan.c: the forward kernel's global task order (src/common/task_plan.h).
 *
 * 1. Enumeration: every task exists exactly once, of the right kinds and counts.
 * 2. Deadlock freedom, by simulation: G resident "CTAs" take tasks in the global order (static
 *    striding or a ticket counter), wait on the plan's counters and targets, and are stepped by
 *    adversarial schedulers (random; always the CTA holding the latest task; always the earliest).
 *    Every run must finish, and when a task starts, every task it reads from must be finished
 *    (checked against the layout directly, not through the counters: that checks the targets).
 *    Also with the fused kernel's deferred releases (a GATE_UP task's release held until the
 *    CTA's next task starts, when that one could start at once; a DOWN task's until the CTA's
 *    next task ends, unless that is a REDUCE).
 * 3. The checker can fail: an order that puts consumers before producers deadlocks in it, and so
 *    does holding every GATE_UP release until the next task starts.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/layout.h"
#include "common/task_plan.h"
#include "support/plan_layout.h"
#include "support/rng.h"
#include "test.h"

enum { BM = 4 }; /* rows per tile and tokens per reduce block in these small shapes */

typedef struct {
  mok_layout_t lay;
  int32_t mt_pre[65];
  mok_task_plan_t plan;
  int64_t T, K;
  int64_t *down_target; /* [t_tiles] */
} problem_t;

static int64_t tile_rows(const problem_t *pb, int32_t e, int32_t m) {
  return plan_tile_rows(&pb->lay, e, m, BM);
}

/* Token of row r of expert e's tile m. */
static int64_t row_token(const problem_t *pb, int32_t e, int32_t m, int64_t r) {
  return plan_row_token(&pb->lay, e, m, r, BM);
}

/* Calls f(block) once for each token block the rows of DOWN tile (e, m) touch. */
static void for_each_block(const problem_t *pb, int32_t e, int32_t m, void (*f)(void *, int64_t),
                           void *arg) {
  plan_for_each_block(&pb->lay, e, m, BM, f, arg);
}

static void add_target(void *arg, int64_t b) { ((problem_t *)arg)->down_target[b] += ((problem_t *)arg)->plan.n_down; }

/* A random routing of T tokens over E experts (K distinct or -1), then the plan. */
static int problem_init(problem_t *pb, uint64_t seed, int64_t T, int32_t E, int64_t K, int shared,
                        int32_t n_gu, int32_t n_down) {
  memset(pb, 0, sizeof(*pb));
  if (!plan_layout_random(&pb->lay, pb->mt_pre, seed, T, E, K, 0, BM)) return 0;
  pb->T = T, pb->K = K;
  pb->plan = (mok_task_plan_t){E, n_gu, n_down, shared ? 2 : 0, shared ? 3 : 0, (int32_t)((T + BM - 1) / BM), pb->mt_pre, 1, 0, 0, 0, 0};
  pb->down_target = calloc((size_t)pb->plan.t_tiles + 1, sizeof(int64_t));
  for (int32_t e = 0; e < E; e++)
    for (int32_t m = 0; m < pb->mt_pre[e + 1] - pb->mt_pre[e]; m++) for_each_block(pb, e, m, add_target, pb);
  return 1;
}

static void problem_free(problem_t *pb) {
  mok_layout_free(&pb->lay);
  free(pb->down_target);
}

/* ---- the simulator ---------------------------------------------------------------------------- */

typedef struct {
  const problem_t *pb;
  int64_t n;             /* tasks */
  const int64_t *order;  /* [n] position -> task number of mok_plan_task (identity: the plan) */
  int64_t *gu_done, *sgu_done, *down_done, *sd_done; /* counters */
  unsigned char *done;   /* [n] by task number */
  int64_t *index_of;     /* task number of (kind, e, m, n), see key() */
} sim_t;

static int64_t key(const mok_task_plan_t *p, mok_task_t t) { /* dense id of a task's coordinates */
  const int64_t mt = p->mt_pre[p->E] + 1, tt = p->t_tiles + 1, nn = 8;
  return (((int64_t)t.kind * (p->E + 1) + (t.expert + 1)) * (mt > tt ? mt : tt) + t.m) * nn + t.n;
}

static int64_t key_space(const mok_task_plan_t *p) {
  const int64_t mt = p->mt_pre[p->E] + 1, tt = p->t_tiles + 1;
  return 5 * (int64_t)(p->E + 1) * (mt > tt ? mt : tt) * 8;
}

static int deps_ready(const sim_t *s, mok_task_t t) {
  const mok_task_plan_t *p = &s->pb->plan;
  switch (t.kind) {
    case MOK_TASK_DOWN: return s->gu_done[p->mt_pre[t.expert] + t.m] >= p->n_gu;
    case MOK_TASK_SHARED_DOWN: return s->sgu_done[t.m] >= p->n_sgu;
    case MOK_TASK_REDUCE:
      return s->down_done[t.m] >= s->pb->down_target[t.m] && (p->n_sd == 0 || s->sd_done[t.m] >= p->n_sd);
    default: return 1;
  }
}

static int is_done(const sim_t *s, mok_task_t t) { return s->done[s->index_of[key(&s->pb->plan, t)]]; }

/* Independent of the counters: everything task t reads has been written. */
static int inputs_complete(const sim_t *s, mok_task_t t) {
  const mok_task_plan_t *p = &s->pb->plan;
  if (t.kind == MOK_TASK_DOWN) {
    for (int32_t n = 0; n < p->n_gu; n++)
      if (!is_done(s, (mok_task_t){MOK_TASK_GATE_UP, t.expert, t.m, n})) return 0;
  } else if (t.kind == MOK_TASK_SHARED_DOWN) {
    for (int32_t n = 0; n < p->n_sgu; n++)
      if (!is_done(s, (mok_task_t){MOK_TASK_SHARED_GATE_UP, -1, t.m, n})) return 0;
  } else if (t.kind == MOK_TASK_REDUCE) {
    for (int32_t n = 0; n < p->n_sd; n++)
      if (!is_done(s, (mok_task_t){MOK_TASK_SHARED_DOWN, -1, t.m, n})) return 0;
    for (int32_t e = 0; e < p->E; e++) /* every DOWN tile holding a row of a token of block m */
      for (int32_t m = 0; m < p->mt_pre[e + 1] - p->mt_pre[e]; m++)
        for (int64_t r = 0; r < tile_rows(s->pb, e, m); r++)
          if (row_token(s->pb, e, m, r) / BM == t.m)
            for (int32_t n = 0; n < p->n_down; n++)
              if (!is_done(s, (mok_task_t){MOK_TASK_DOWN, e, m, n})) return 0;
  }
  return 1;
}

static void add_down(void *arg, int64_t b) { ((sim_t *)arg)->down_done[b]++; }

static void complete(sim_t *s, int64_t task) {
  const mok_task_plan_t *p = &s->pb->plan;
  const mok_task_t t = mok_plan_task(p, task);
  s->done[task] = 1;
  if (t.kind == MOK_TASK_GATE_UP) s->gu_done[p->mt_pre[t.expert] + t.m]++;
  if (t.kind == MOK_TASK_SHARED_GATE_UP) s->sgu_done[t.m]++;
  if (t.kind == MOK_TASK_SHARED_DOWN) s->sd_done[t.m]++;
  if (t.kind == MOK_TASK_DOWN) for_each_block(s->pb, t.expert, t.m, add_down, s);
}

enum { POLICY_RANDOM, POLICY_LATEST, POLICY_EARLIEST };

/* Runs G CTAs to completion. Returns 1 when every task finished, 0 on deadlock; *bad counts tasks
 * that started before their inputs were complete. Each task takes 1-3 steps once started.
 * defer: a CTA that finishes a (SHARED_)GATE_UP task holds its release until its next task starts
 * when that task's inputs are already complete (then it could start at once), and releases at
 * once otherwise or when it has no next task: the fused kernel's deferred release
 * (forward/fused.cu, fk_deferred_release), modelled where it defers the most. A DOWN task's
 * release is held until the CTA's next task ends, unless that is a REDUCE (then at once): the
 * kernel's release of a DOWN tile under its next tile's last stage (fk_flush_down), modelled
 * later than it happens. defer = 2 holds GATE_UP releases whenever there is a next task (unsafe:
 * the checker must catch it). *held counts held releases. */
static int simulate_ex(const problem_t *pb, const int64_t *order, int G, int ticket, int policy,
                       uint64_t seed, int defer, int64_t *bad, int64_t *held) {
  sim_t s = {pb, mok_plan_num_tasks(&pb->plan), order, NULL, NULL, NULL, NULL, NULL, NULL};
  const int64_t tt = pb->plan.t_tiles + 1;
  s.gu_done = calloc((size_t)pb->plan.mt_pre[pb->plan.E] + 1, sizeof(int64_t));
  s.sgu_done = calloc((size_t)tt, sizeof(int64_t)), s.sd_done = calloc((size_t)tt, sizeof(int64_t));
  s.down_done = calloc((size_t)tt, sizeof(int64_t));
  s.done = calloc((size_t)s.n + 1, 1);
  s.index_of = malloc(sizeof(int64_t) * (size_t)key_space(&pb->plan));
  for (int64_t i = 0; i < s.n; i++) s.index_of[key(&pb->plan, mok_plan_task(&pb->plan, i))] = i;
  int64_t *cur = malloc(sizeof(int64_t) * (size_t)G), *left = calloc((size_t)G, sizeof(int64_t));
  int64_t *pending = malloc(sizeof(int64_t) * (size_t)G); /* a held release: task number, or -1 */
  int64_t *pending_down = malloc(sizeof(int64_t) * (size_t)G); /* a held DOWN release */
  for (int c = 0; c < G; c++) pending[c] = pending_down[c] = -1;
  int64_t next_ticket = 0, finished = 0;
  test_rng_t rng = test_rng(seed);
  *bad = 0;
  if (held) *held = 0;
  for (int c = 0; c < G; c++) cur[c] = ticket ? (next_ticket < s.n ? next_ticket++ : -1) : (c < s.n ? c : -1);
  for (;;) {
    int runnable[1024], nr = 0;
    for (int c = 0; c < G; c++)
      if (cur[c] >= 0 && (left[c] > 0 || deps_ready(&s, mok_plan_task(&pb->plan, order[cur[c]]))))
        runnable[nr++] = c;
    if (nr == 0) break;
    int c = runnable[0];
    if (policy == POLICY_RANDOM) c = runnable[test_rng_u64(&rng) % (uint64_t)nr];
    for (int j = 0; j < nr; j++) {
      if (policy == POLICY_LATEST && cur[runnable[j]] > cur[c]) c = runnable[j];
      if (policy == POLICY_EARLIEST && cur[runnable[j]] < cur[c]) c = runnable[j];
    }
    const int64_t task = order[cur[c]];
    if (left[c] == 0) { /* starts now */
      *bad += !inputs_complete(&s, mok_plan_task(&pb->plan, task));
      left[c] = 1 + (int64_t)(test_rng_u64(&rng) % 3);
      if (pending[c] >= 0) { /* its first stage is issued: the held release */
        complete(&s, pending[c]);
        finished++;
        pending[c] = -1;
      }
    }
    if (--left[c] > 0) continue;
    if (pending_down[c] >= 0) { /* the previous DOWN task's release, held through this task */
      complete(&s, pending_down[c]);
      finished++;
      pending_down[c] = -1;
    }
    cur[c] = ticket ? (next_ticket < s.n ? next_ticket++ : -1) : (cur[c] + G < s.n ? cur[c] + G : -1);
    const mok_task_t done_t = mok_plan_task(&pb->plan, task);
    if (defer && done_t.kind == MOK_TASK_DOWN && cur[c] >= 0 &&
        mok_plan_task(&pb->plan, order[cur[c]]).kind != MOK_TASK_REDUCE) {
      pending_down[c] = task;
      if (held) ++*held;
    } else if (defer &&
               (done_t.kind == MOK_TASK_GATE_UP || done_t.kind == MOK_TASK_SHARED_GATE_UP) &&
               cur[c] >= 0 && mok_plan_task(&pb->plan, order[cur[c]]).kind != MOK_TASK_REDUCE &&
               (defer == 2 || deps_ready(&s, mok_plan_task(&pb->plan, order[cur[c]])))) {
      pending[c] = task;
      if (held) ++*held;
    } else {
      complete(&s, task);
      finished++;
    }
  }
  free(s.gu_done), free(s.sgu_done), free(s.sd_done), free(s.down_done), free(s.done);
  free(s.index_of), free(cur), free(left), free(pending), free(pending_down);
  return finished == s.n;
}

static int simulate(const problem_t *pb, const int64_t *order, int G, int ticket, int policy,
                    uint64_t seed, int64_t *bad) {
  return simulate_ex(pb, order, G, ticket, policy, seed, 0, bad, NULL);
}

/* ---- tests ------------------------------------------------------------------------------------ */

MOK_TEST(task_plan_enumerates_every_task_once) {
  for (int variant = 0; variant < 32; variant++) {
    const int shared = variant & 1;
    problem_t pb;
    MOK_REQUIRE(problem_init(&pb, 11 + shared, 37, 6, 2, shared, 3, 2));
    pb.plan.lag = (variant / 2) % 4;   /* 0 (= 1), 1, 2, 3: with E = 6 */
    pb.plan.group_m = variant / 8;     /* 0 (row tile by row tile), 1, 2, 3 */
    pb.plan.shared_band = variant % 5; /* 0 (= 8), 1, 2, 3, 4 token tiles per band of 10 */
    const mok_task_plan_t *p = &pb.plan;
    const int64_t n = mok_plan_num_tasks(p);
    const int32_t sb = mok_plan_shared_band(p);
    unsigned char *seen = calloc((size_t)key_space(p), 1);
    int64_t count[5] = {0}, dup = 0, sgu_seen = 0, band_order_bad = 0;
    int prev_kind_rank = -1, order_ok = 1;
    for (int64_t i = 0; i < n; i++) {
      mok_task_t t = mok_plan_task(p, i);
      dup += seen[key(p, t)]++;
      count[t.kind]++;
      /* phase order: expert stages, the shared expert, reduce */
      int rank = t.kind <= MOK_TASK_DOWN && t.kind != MOK_TASK_SHARED_GATE_UP ? 0
                 : t.kind == MOK_TASK_REDUCE                                 ? 2
                                                                             : 1;
      order_ok &= rank >= prev_kind_rank;
      prev_kind_rank = rank;
      /* the shared expert's band lag: a SHARED_DOWN tile of band v comes after every
       * SHARED_GATE_UP tile of band v + 1 (or of all bands, for the last) */
      sgu_seen += t.kind == MOK_TASK_SHARED_GATE_UP;
      if (t.kind == MOK_TASK_SHARED_DOWN) {
        const int64_t before = (t.m / sb + 2) * sb;
        band_order_bad += sgu_seen < (before < p->t_tiles ? before : p->t_tiles) * p->n_sgu;
      }
    }
    MOK_EXPECT_MSG(band_order_bad == 0, "band %d: %lld SHARED_DOWN tiles before their band's lag",
                   sb, (long long)band_order_bad);
    /* bands: within a block, the next tile is the next row tile of the band at the same column
     * tile, or the band's first row tile at the next column tile, or the next band's first (row
     * tiles counted from the block's first: a shared band's first token tile) */
    int64_t group_breaks = 0;
    const int G = p->group_m;
    for (int64_t i = 0; G > 0 && i + 1 < n; i++) {
      const mok_task_t a = mok_plan_task(p, i), b = mok_plan_task(p, i + 1);
      if (a.kind != b.kind || a.expert != b.expert || a.kind == MOK_TASK_REDUCE) continue;
      const int shared_kind = a.kind == MOK_TASK_SHARED_GATE_UP || a.kind == MOK_TASK_SHARED_DOWN;
      if (shared_kind && a.m / sb != b.m / sb) continue; /* the next band: another block */
      const int32_t o = shared_kind ? a.m / sb * sb : 0, am = a.m - o, bm = b.m - o;
      const int32_t g0 = am / G * G;
      const int ok = (b.n == a.n && bm == am + 1 && bm % G != 0) ||
                     (b.n == a.n + 1 && bm == g0) || (b.n == 0 && bm == am + 1 && bm % G == 0);
      group_breaks += !ok;
    }
    MOK_EXPECT_MSG(group_breaks == 0, "group_m %d: %lld steps out of the band order", G,
                   (long long)group_breaks);
    const int64_t tiles = p->mt_pre[p->E];
    MOK_EXPECT(dup == 0 && order_ok);
    MOK_EXPECT(count[MOK_TASK_GATE_UP] == tiles * p->n_gu && count[MOK_TASK_DOWN] == tiles * p->n_down);
    MOK_EXPECT(count[MOK_TASK_SHARED_GATE_UP] == (shared ? p->t_tiles * p->n_sgu : 0));
    MOK_EXPECT(count[MOK_TASK_SHARED_DOWN] == (shared ? p->t_tiles * p->n_sd : 0));
    MOK_EXPECT(count[MOK_TASK_REDUCE] == p->t_tiles);
    /* the lag: the first DOWN task comes after the GATE_UP tiles of the first L non-empty stages */
    int64_t first_down = -1, gu_before = 0;
    for (int64_t i = 0; i < n && first_down < 0; i++) {
      mok_task_t t = mok_plan_task(p, i);
      if (t.kind == MOK_TASK_DOWN) first_down = i;
      else if (t.kind == MOK_TASK_GATE_UP) gu_before++;
    }
    const int32_t L = mok_plan_lag(p), gu_stages = L < p->E ? L : p->E;
    MOK_EXPECT_MSG(gu_before >= (int64_t)(p->mt_pre[gu_stages] - p->mt_pre[0]) * p->n_gu,
                   "lag %d: %lld GATE_UP tasks before the first DOWN", L, (long long)gu_before);
    free(seen);
    problem_free(&pb);
  }
}

/* Whatever the interleaving and assignment, the plan's order finishes, and no task starts
 * before the tasks it reads from have finished. */
MOK_TEST(task_plan_never_deadlocks_under_adversarial_schedules) {
  const int Gs[] = {1, 2, 3, 7, 64};
  int runs = 0, failures = 0;
  for (uint64_t seed = 1; seed <= 6; seed++) {
    problem_t pb;
    const int64_t T = 1 + (int64_t)(seed * 13 % 50), K = 1 + (int64_t)(seed % 3);
    MOK_REQUIRE(problem_init(&pb, seed, T, 5, K, (int)(seed & 1), 2, 3));
    pb.plan.lag = 1 + (int32_t)(seed % 3); /* 1, 2, 3; 5 experts */
    pb.plan.group_m = (int32_t)(seed / 2) % 3; /* 0, 1, 2 */
    pb.plan.shared_band = (int32_t)(seed % 4); /* 0 (= 8), 1, 2, 3 token tiles */
    const int64_t n = mok_plan_num_tasks(&pb.plan);
    int64_t *identity = malloc(sizeof(int64_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) identity[i] = i;
    for (size_t g = 0; g < sizeof(Gs) / sizeof(Gs[0]); g++)
      for (int ticket = 0; ticket < 2; ticket++)
        for (int policy = 0; policy < 3; policy++) {
          int64_t bad;
          int ok = simulate(&pb, identity, Gs[g], ticket, policy, seed * 977 + g, &bad);
          runs++;
          failures += !ok || bad;
          MOK_EXPECT_MSG(ok && bad == 0, "seed %llu G %d ticket %d policy %d: %s, %lld early starts",
                         (unsigned long long)seed, Gs[g], ticket, policy, ok ? "finished" : "DEADLOCK",
                         (long long)bad);
        }
    free(identity);
    problem_free(&pb);
  }
  MOK_EXPECT(runs == 6 * 5 * 2 * 3 && failures == 0);
}

/* The same with the fused kernel's deferred releases: a GATE_UP task's release held until the
 * CTA's next task starts, whenever that task could start at once; a DOWN task's until the next
 * task ends. */
MOK_TEST(task_plan_deferred_releases_never_deadlock) {
  const int Gs[] = {1, 2, 3, 7, 64};
  int runs = 0, failures = 0, unsafe_deadlocks = 0;
  int64_t held_total = 0;
  for (uint64_t seed = 1; seed <= 6; seed++) {
    problem_t pb;
    const int64_t T = 1 + (int64_t)(seed * 13 % 50), K = 1 + (int64_t)(seed % 3);
    MOK_REQUIRE(problem_init(&pb, seed, T, 5, K, (int)(seed & 1), 2, 3));
    pb.plan.lag = 1 + (int32_t)(seed % 3);
    pb.plan.group_m = (int32_t)(seed / 2) % 3;
    pb.plan.shared_band = (int32_t)(seed % 4);
    const int64_t n = mok_plan_num_tasks(&pb.plan);
    int64_t *identity = malloc(sizeof(int64_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) identity[i] = i;
    for (size_t g = 0; g < sizeof(Gs) / sizeof(Gs[0]); g++)
      for (int policy = 0; policy < 3; policy++) {
        int64_t bad, held;
        int ok = simulate_ex(&pb, identity, Gs[g], 1, policy, seed * 131 + g, 1, &bad, &held);
        runs++;
        held_total += held;
        failures += !ok || bad;
        MOK_EXPECT_MSG(ok && bad == 0, "seed %llu G %d policy %d, deferred releases: %s, %lld "
                       "early starts", (unsigned long long)seed, Gs[g], policy,
                       ok ? "finished" : "DEADLOCK", (long long)bad);
        /* holding the release whatever the next task: on one CTA a DOWN task right after the
         * last GATE_UP tile of its rows waits for it forever */
        unsafe_deadlocks += !simulate_ex(&pb, identity, Gs[g], 1, policy, seed, 2, &bad, NULL);
      }
    free(identity);
    problem_free(&pb);
  }
  MOK_EXPECT(runs == 6 * 5 * 3 && failures == 0);
  MOK_EXPECT_MSG(held_total > 0, "no release was ever held: the model tests nothing");
  MOK_EXPECT_MSG(unsafe_deadlocks > 0, "the unsafe rule never deadlocked: the checker is blind");
  printf("    %lld releases held over %d runs; the unsafe rule deadlocked %d of %d runs\n",
         (long long)held_total, runs, unsafe_deadlocks, runs);
}

/* The simulator can fail: reversed order (every consumer before its producers) deadlocks with
 * one CTA, and with several CTAs and striding; the empty-expert edge still finishes. */
MOK_TEST(task_plan_checker_detects_a_bad_order) {
  problem_t pb;
  MOK_REQUIRE(problem_init(&pb, 5, 20, 4, 2, 1, 2, 2));
  const int64_t n = mok_plan_num_tasks(&pb.plan);
  int64_t *reversed = malloc(sizeof(int64_t) * (size_t)n), bad;
  for (int64_t i = 0; i < n; i++) reversed[i] = n - 1 - i;
  MOK_EXPECT(!simulate(&pb, reversed, 1, 0, POLICY_RANDOM, 1, &bad));
  MOK_EXPECT(!simulate(&pb, reversed, 4, 0, POLICY_EARLIEST, 1, &bad));
  free(reversed);
  problem_free(&pb);
}

/* Experts without rows, one expert taking everything, T smaller than a tile. */
MOK_TEST(task_plan_edge_routings) {
  problem_t pb;
  MOK_REQUIRE(problem_init(&pb, 3, 1, 8, 1, 1, 2, 2)); /* one token: 7 empty experts */
  const int64_t n = mok_plan_num_tasks(&pb.plan);
  int64_t *id = malloc(sizeof(int64_t) * (size_t)n), bad;
  for (int64_t i = 0; i < n; i++) id[i] = i;
  MOK_EXPECT(simulate(&pb, id, 3, 1, POLICY_LATEST, 7, &bad) && bad == 0);
  free(id);
  problem_free(&pb);
  /* every token to expert 0 */
  MOK_REQUIRE(problem_init(&pb, 3, 10, 1, 1, 0, 1, 1));
  MOK_EXPECT(pb.lay.expert_rows[0] > 0 && pb.plan.mt_pre[1] == (pb.lay.expert_rows[0] + BM - 1) / BM);
  const int64_t n2 = mok_plan_num_tasks(&pb.plan);
  id = malloc(sizeof(int64_t) * (size_t)n2);
  for (int64_t i = 0; i < n2; i++) id[i] = i;
  MOK_EXPECT(simulate(&pb, id, 2, 0, POLICY_RANDOM, 9, &bad) && bad == 0);
  free(id);
  problem_free(&pb);
}

static int same_task(mok_task_t a, mok_task_t b) {
  return a.kind == b.kind && a.expert == b.expert && a.m == b.m && a.n == b.n;
}

/* mok_plan_task_from gives the task of mok_plan_task whatever its stage hint (the stage of an
 * earlier task, of a later one, out of range, or none), and reports the expert stage it found:
 * with empty experts (E = 16 over 9 tokens), lags and bands; hints carried along strides of
 * tasks as a CTA's tickets would be. */
MOK_TEST(task_plan_stage_hints_do_not_change_tasks) {
  int64_t checked = 0, bad = 0, bad_stage = 0;
  for (int variant = 0; variant < 12; variant++) {
    problem_t pb;
    MOK_REQUIRE(problem_init(&pb, 5 + variant, variant < 6 ? 9 : 37, variant < 6 ? 16 : 6, 2,
                             variant & 1, 3, 2));
    pb.plan.lag = variant % 3 + 1;
    pb.plan.group_m = variant % 4 == 3 ? 2 : 0;
    const mok_task_plan_t *p = &pb.plan;
    const int64_t n = mok_plan_num_tasks(p);
    const int32_t stages = p->E + mok_plan_lag(p);
    for (int64_t i = 0; i < n; i++) {
      const mok_task_t want = mok_plan_task(p, i);
      const int expert_task = want.kind == MOK_TASK_GATE_UP || want.kind == MOK_TASK_DOWN;
      const int32_t want_stage = want.kind == MOK_TASK_GATE_UP ? want.expert
                                 : want.kind == MOK_TASK_DOWN ? want.expert + mok_plan_lag(p)
                                                              : -1;
      for (int32_t h = -1; h <= stages + 1; h++) {
        int32_t s = h;
        bad += !same_task(mok_plan_task_from(p, i, &s), want);
        bad_stage += expert_task ? s != want_stage : s != h;
        checked++;
      }
    }
    for (int64_t stride = 1; stride <= 13; stride += 4) {
      int32_t s = 0;
      for (int64_t i = stride % 3; i < n; i += stride) {
        bad += !same_task(mok_plan_task_from(p, i, &s), mok_plan_task(p, i));
        checked++;
      }
    }
    problem_free(&pb);
  }
  MOK_EXPECT_MSG(bad == 0 && bad_stage == 0,
                 "%lld of %lld lookups gave another task, %lld another stage", (long long)bad,
                 (long long)checked, (long long)bad_stage);
}

/* no_reduce (the expert-parallel forward, whose reduce runs after the combine): the same tasks in
 * the same order, without the REDUCE tail, so every dependency argument above carries over. */
MOK_TEST(task_plan_without_reduce_is_the_prefix_before_reduce) {
  int64_t bad = 0, reduces = 0, checked = 0;
  for (int variant = 0; variant < 8; variant++) {
    problem_t pb;
    MOK_REQUIRE(problem_init(&pb, 21 + variant, variant < 4 ? 37 : 9, 6, 2, variant & 1, 3, 2));
    pb.plan.lag = variant % 3 + 1;
    pb.plan.group_m = variant & 2 ? 2 : 0;
    mok_task_plan_t q = pb.plan;
    q.no_reduce = 1;
    const int64_t n = mok_plan_num_tasks(&pb.plan), m = mok_plan_num_tasks(&q);
    MOK_EXPECT_MSG(m == n - pb.plan.t_tiles, "variant %d: %lld tasks without REDUCE, %lld with "
                   "(%d token tiles)", variant, (long long)m, (long long)n, pb.plan.t_tiles);
    for (int64_t i = 0; i < m; i++) {
      const mok_task_t t = mok_plan_task(&q, i);
      reduces += t.kind == MOK_TASK_REDUCE;
      bad += !same_task(t, mok_plan_task(&pb.plan, i));
      checked++;
    }
    for (int64_t i = m; i < n; i++) bad += mok_plan_task(&pb.plan, i).kind != MOK_TASK_REDUCE;
    problem_free(&pb);
  }
  MOK_EXPECT_MSG(bad == 0 && reduces == 0, "%lld of %lld tasks differ, %lld REDUCE tasks left",
                 (long long)bad, (long long)checked, (long long)reduces);
}

/* shared_first (the expert-parallel forward: no_reduce, the shared expert while rows are in
 * flight): the shared stages of the no_reduce order, then its expert stages, each in its own
 * order; stage hints give the same tasks; and under adversarial schedules it finishes with no
 * early start (every dependency stays inside its part, earlier in the order). */
MOK_TEST(task_plan_shared_first_puts_the_shared_stages_first_and_never_deadlocks) {
  const int Gs[] = {1, 3, 7, 64};
  int64_t bad = 0, checked = 0, bad_hint = 0;
  int runs = 0, failures = 0;
  for (int variant = 0; variant < 6; variant++) {
    problem_t pb;
    MOK_REQUIRE(problem_init(&pb, 71 + variant, variant < 3 ? 41 : 7, 5, 1 + variant % 3, 1, 2,
                             3));
    pb.plan.lag = variant % 3 + 1;
    pb.plan.group_m = variant & 1 ? 2 : 0;
    pb.plan.shared_band = variant % 4;
    pb.plan.no_reduce = 1;
    const mok_task_plan_t last = pb.plan; /* the shared expert after the experts */
    pb.plan.shared_first = 1;
    const mok_task_plan_t *q = &pb.plan;
    const int64_t n = mok_plan_num_tasks(q);
    const int64_t experts = mok_plan_stage_start(&last, last.E + mok_plan_lag(&last));
    const int64_t shared = n - experts;
    MOK_EXPECT(n == mok_plan_num_tasks(&last) && shared > 0);
    MOK_EXPECT(mok_plan_experts_begin(q) == shared && mok_plan_shared_begin(q) == 0);
    MOK_EXPECT(mok_plan_experts_begin(&last) == 0 && mok_plan_shared_begin(&last) == experts);
    int32_t hint = 0;
    for (int64_t i = 0; i < n; i++) {
      const mok_task_t t = mok_plan_task(q, i);
      bad += !same_task(t, mok_plan_task(&last, i < shared ? experts + i : i - shared));
      bad += (i < shared) != (t.kind == MOK_TASK_SHARED_GATE_UP || t.kind == MOK_TASK_SHARED_DOWN);
      bad_hint += !same_task(t, mok_plan_task_from(q, i, &hint));
      checked++;
    }
    int64_t *identity = malloc(sizeof(int64_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) identity[i] = i;
    for (size_t g = 0; g < sizeof(Gs) / sizeof(Gs[0]); g++)
      for (int ticket = 0; ticket < 2; ticket++)
        for (int policy = 0; policy < 3; policy++) {
          int64_t early;
          const int ok = simulate(&pb, identity, Gs[g], ticket, policy, 313 * variant + g, &early);
          runs++;
          failures += !ok || early;
          MOK_EXPECT_MSG(ok && early == 0, "variant %d G %d ticket %d policy %d: %s, %lld early "
                         "starts", variant, Gs[g], ticket, policy, ok ? "finished" : "DEADLOCK",
                         (long long)early);
        }
    free(identity);
    problem_free(&pb);
  }
  MOK_EXPECT_MSG(bad == 0 && bad_hint == 0, "%lld of %lld tasks out of place, %lld differ with "
                 "hints", (long long)bad, (long long)checked, (long long)bad_hint);
  MOK_EXPECT(runs == 6 * 4 * 2 * 3 && failures == 0);
}

/* A block too large for 32-bit tile arithmetic takes the 64-bit path, with the same tiles: in
 * its whole bands a tile does not depend on the block's height, so a block of 70000 x 40000
 * tiles must order its first bands as one of 24 x 40000 (32-bit path) does. */
MOK_TEST(task_plan_tile_order_is_the_same_in_64_bits) {
  mok_task_plan_t p;
  memset(&p, 0, sizeof p);
  int64_t bad = 0, checked = 0;
  for (int32_t G = 0; G <= 8; G += 8) {
    p.group_m = G;
    for (int64_t r = 0; r < (int64_t)24 * 40000; r += 997) {
      mok_task_t big = {0, 0, 0, 0}, small = {0, 0, 0, 0};
      mok_plan_tile(&p, r, 70000, 40000, &big);
      mok_plan_tile(&p, r, 24, 40000, &small);
      bad += big.m != small.m || big.n != small.n;
      checked++;
    }
  }
  MOK_EXPECT_MSG(bad == 0, "%lld of %lld tiles differ", (long long)bad, (long long)checked);
}
