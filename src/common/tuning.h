/*
 * tuning.h: the values that stay tunable for tests and benchmarks, one struct with measured
 * defaults (docs/performance.md has the measurements). A layer copies the defaults when it is
 * created; tests and benchmarks change a layer's copy through mok_layer_set_tuning
 * (src/api/internal.h), never through the environment. Nothing here changes a result's bits:
 * every value only moves work between SMs or in time.
 *
 * The one environment variable the library reads is MOK_DEBUG_TIMEOUT_S (seconds, > 0), read by
 * mok_tuning_default: the bound of every wait on a counter, for debugging a hang.
 */
#ifndef MOK_COMMON_TUNING_H
#define MOK_COMMON_TUNING_H

#include <stddef.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MOK_FORWARD_FUSED = 0, /* the persistent kernel after the layout (the default) */
  MOK_FORWARD_CHAIN = 1  /* layout, gather, four grouped GEMMs, reduce: the fused kernel's oracle */
} mok_forward_path_t;

typedef enum {
  MOK_BACKWARD_CHAIN = 0, /* the kernel chain of src/gpu/backward.c (the default) */
  MOK_BACKWARD_FUSED = 1  /* the chain's prologue, then one persistent kernel for the routed
                             experts' dxk, weight gradients and the dx reduce (BF16 layers, except
                             bf16 weight gradients accumulated, which keep the chain): bitwise the
                             chain's, but 1-3% slower so far (docs/performance.md, "Fused backward:
                             the first kernel"), so not the default */
} mok_backward_path_t;

typedef struct {
  size_t struct_size;              /* sizeof(mok_tuning_t), checked by mok_layer_set_tuning */
  mok_forward_path_t forward_path; /* default MOK_FORWARD_FUSED */
  int forward_sms;                 /* CTAs of the fused forward; 0 = every SM (default). Virtual
                                      ranks: at most (SMs - W) / W, and the expert-parallel
                                      forward runs its dispatch inside the fused kernel
                                      (src/gpu/forward_ep.c) */
  int fused_lag;                   /* expert stages between an expert's GATE_UP and DOWN tiles;
                                      0 = from the shape (default) */
  int fused_shared_band;           /* token tiles per band of the shared expert; default 8 */
  int fused_help_pct;              /* expert stage (percent of E) from which two producer warps
                                      reduce; -1 = by the shape (default: 85 without a shared
                                      expert, 100 = none with one) */
  mok_backward_path_t backward_path; /* default MOK_BACKWARD_CHAIN */
  int backward_sms;                /* CTAs of the fused backward; 0 = every SM (default) */
  int backward_lag;                /* expert stages from an expert's DX tiles to its DW tiles in
                                      the fused backward; 0 = from the shape (default) */
  int tile_group_m;                /* row tiles per band of the GEMM tile orders; 0 = by the size
                                      of B against the L2 (default), -1 = no bands */
  double timeout_s;                /* bound of every wait on a counter; default 10, or
                                      MOK_DEBUG_TIMEOUT_S */
} mok_tuning_t;

/* The defaults above. MOK_ERROR_INVALID_VALUE when MOK_DEBUG_TIMEOUT_S is set but is not a
 * positive number (t holds the defaults then too). */
mokResult_t mok_tuning_default(mok_tuning_t *t);

/* MOK_SUCCESS when every field is in its range; else the failure, recorded (on `layer` too when
 * not NULL) with the fields. */
mokResult_t mok_tuning_check(mok_layer_t layer, const mok_tuning_t *t);

#ifdef __cplusplus
}
#endif

#endif /* MOK_COMMON_TUNING_H */
