/*
 * status.h: how every part of the library records a failure (src/api/errors.c): the detail goes
 * to the calling thread's last error and, when a layer is given, to the layer's. Host code only
 * (the CUDA launchers call it on the host).
 */
#ifndef MOK_COMMON_STATUS_H
#define MOK_COMMON_STATUS_H

#include <stdint.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MOK_ERR_LEN = 512 };

/* A bounded wait on an mbarrier that timed out in a kernel (src/cuda/ptx/ptx.cuh): which SM, which
 * barrier (its shared-memory address) and which phase parity. The kernel ran on to its end with
 * wrong results instead of trapping; each kernel family's launcher file hands its record to the
 * host (mok_gg_fault_take, mok_gw_fault_take, mok_fwd_fused_fault_take). */
typedef struct {
  uint32_t code; /* 0: none; 1: a wait timed out (2 while it is being written) */
  uint32_t sm, bar, parity;
} mok_kernel_fault_t;

/* Records a failure: formats the detail into the thread's last error and, when layer is not NULL,
 * the layer's; returns `code` so callers can write `return mok_fail(l, CODE, "...", ...)`. */
mokResult_t mok_fail(mok_layer_t layer, mokResult_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Propagates code and the detail in `msg` (from a function that wrote into a buffer). */
mokResult_t mok_fail_msg(mok_layer_t layer, mokResult_t code, const char *msg);

#ifdef __cplusplus
}
#endif

#endif /* MOK_COMMON_STATUS_H */
