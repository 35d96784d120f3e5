/*
 * ref_problem.h: random layer problems for the reference tests (tests/test_ref_*.c) and a driver
 * that runs the reference over W simulated ranks with every rank's arrays pointing into one
 * concatenated array, so a W-rank result reads exactly like the 1-rank result of the same tokens.
 */
#ifndef MOK_TESTS_REF_PROBLEM_H
#define MOK_TESTS_REF_PROBLEM_H

#include <stdint.h>

#include "cpu/ref.h"

enum { REF_MAX_W = 8 };

/* One layer problem over N tokens; W, tile_m, precision and mode are chosen per run. */
typedef struct {
  int64_t H, I, E, K, Is, N;
  double *x, *dy;          /* [N, H] bf16 values */
  int32_t *idx;            /* [N, K] */
  double *tw;              /* [N, K] fp32 values */
  double *wg, *wu;         /* [E, I, H] bf16 values */
  double *wd;              /* [E, H, I] */
  double *wsg, *wsu, *wsd; /* [Is, H], [Is, H], [H, Is] (NULL when Is = 0) */
} ref_problem_t;

/* Fills p with random bf16 inputs scaled so activations are O(1) (x, dy ~ N(0, 1); weights
 * ~ N(0, 1 / fan_in); tests/support/rng.h's xorshift64* from the seed: the same problem on every
 * machine), router weights in [0.1, 1), and routing with K distinct experts per token
 * (never `unused_expert`, -1 for none), each slot empty with probability p_empty.
 * Returns 0 on allocation failure. */
int ref_problem_init(ref_problem_t *p, int64_t H, int64_t I, int64_t Is, int64_t E, int64_t K,
                     int64_t N, uint64_t seed, double p_empty, int64_t unused_expert);
void ref_problem_free(ref_problem_t *p);

/* Results of a run, in the 1-rank shapes (rank r's tokens follow rank r-1's). */
typedef struct {
  int W;
  double *y, *dx;          /* [N, H] */
  double *dtw;             /* [N, K] */
  double *dwg, *dwu;       /* [E, I, H]: rank r holds experts [r * EL, (r + 1) * EL) */
  double *dwd;             /* [E, H, I] */
  double *dwsg, *dwsu;     /* [W, Is, H]: per rank */
  double *dwsd;            /* [W, H, Is] */
  double *g, *u;           /* [N * K, I] saved context (when the run saved one) */
  double *gs, *us;         /* [N, Is] */
} ref_result_t;

/* How to run a problem. */
typedef struct {
  int W;
  int64_t T[REF_MAX_W]; /* tokens per rank; sum = p->N */
  int64_t tile_m;
  mok_precision_t precision;
  mok_fp8_scale_t fp8_scale;
  int exact;
  int save;     /* forward fills a saved context and backward reads it */
  int backward; /* 0: forward only */
  double fill;  /* every output element is set to this before the run (to see unwritten ones) */
} ref_run_t;

/* A run config of W = 1 holding all tokens, BF16, tile_m = 1, forward and backward. */
ref_run_t ref_run_default(const ref_problem_t *p);

/* Runs forward (and backward) over run->W ranks, effective weights built per rank from its slice of
 * the experts. Allocates *res (free with ref_result_free). Returns the reference's result; the
 * detail goes to err[256]. */
mokResult_t ref_run(const ref_problem_t *p, const ref_run_t *run, ref_result_t *res, char *err);
void ref_result_free(ref_result_t *res);

/* Element counts of each result array, for comparisons. */
int64_t ref_routed_w_elems(const ref_problem_t *p); /* E * I * H */
int64_t ref_shared_w_elems(const ref_problem_t *p); /* Is * H */

/* Index of the first element where a and b differ bitwise, -1 when equal (test_first_diff of
 * tests/support/compare.h, by element). */
int64_t ref_first_diff(const double *a, const double *b, int64_t n);

#endif /* MOK_TESTS_REF_PROBLEM_H */
