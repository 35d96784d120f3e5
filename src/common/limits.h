/*
 * limits.h: the limits of a layer that the host checks and the kernels size arrays by, each
 * defined once. Plain C, for host and device.
 */
#ifndef MOK_COMMON_LIMITS_H
#define MOK_COMMON_LIMITS_H

#include <stdint.h>

enum {
  /* Experts on one rank: the layout CTAs keep per-warp bins of every expert in shared memory,
   * and the transport's layout kernel one segment start per expert. */
  MOK_MAX_EXPERTS = 1024,
  /* Slots per token: a token's valid slots are one 64-bit mask in the layout kernels. */
  MOK_MAX_TOP_K = 64,
  /* Ranks of one NVLink domain on a host: the window's peer table, one lane per rank in the
   * transport's waits. */
  MOK_MAX_RANKS = 8
};

/* The descriptor bounds mok_layer_create checks (include/mok.h states them), chosen so that every
 * size the library derives from a descriptor fits in int64_t (and so in a 64-bit size_t) without
 * any further check: with H, I, Is <= 2^20, E <= 2^16, K <= 2^6, T_max <= 2^24 and R = capacity
 * rows < 2^31, the largest products are E * I * H = 2^56 elements (2^59 bytes as doubles),
 * T_max * K * I = 2^50 and R * max(H, I) = 2^51, and no size sums more than a few dozen of them
 * (the quantized buffer, the largest: 12 operand copies of at most 2^56 bytes each plus their
 * scales, under 2^60). tests/test_overflow.c computes the sizes at these bounds. */
#define MOK_MAX_DIM (INT64_C(1) << 20)     /* H, I, Is */
#define MOK_MAX_NUM_EXPERTS (INT64_C(1) << 16) /* E over all ranks */
#define MOK_MAX_TOKENS (INT64_C(1) << 24)  /* T_max per rank */
#define MOK_MAX_CAPACITY_ROWS (INT64_C(2147483647)) /* R: row indices are int32 on the GPU */

#endif /* MOK_COMMON_LIMITS_H */
