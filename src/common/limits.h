/*
 * limits.h: the limits of a layer that the host checks and the kernels size arrays by, each
 * defined once. Plain C, for host and device.
 */
#ifndef MOK_COMMON_LIMITS_H
#define MOK_COMMON_LIMITS_H

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

#endif /* MOK_COMMON_LIMITS_H */
