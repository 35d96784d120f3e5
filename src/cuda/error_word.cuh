/*
 * error_word.cuh: how kernels of a GPU layer report an asynchronous error (the workspace's
 * mok_ws_error_t, read and cleared by mok_layer_check).
 *
 * The first error wins: a writer claims the word by moving `kind` from 0 (atomicCAS), fills the
 * fields, and publishes `code` last, so mok_layer_check never sees a half-written report and a
 * later error never overwrites an earlier one.
 */
#ifndef MOK_CUDA_ERROR_WORD_CUH
#define MOK_CUDA_ERROR_WORD_CUH

#include <stdint.h>

#include "common/workspace.h"

__device__ __forceinline__ void mok_ws_record_error(mok_ws_error_t *err, int code, int kind,
                                                    int64_t token, int64_t slot, int64_t value,
                                                    int64_t limit) {
  if (atomicCAS((int *)&err->kind, 0, kind) != 0) return;  // an earlier report stays
  volatile mok_ws_error_t *v = err;
  v->token = token;
  v->slot = slot;
  v->value = value;
  v->limit = limit;
  __threadfence();
  v->code = code;
}

#endif /* MOK_CUDA_ERROR_WORD_CUH */
