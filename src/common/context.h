/*
 * context.h: the header of a saved context, written by a forward (host or GPU) and checked by
 * the backward that reads it. Plain C, for host and device.
 */
#ifndef MOK_COMMON_CONTEXT_H
#define MOK_COMMON_CONTEXT_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The context starts with this header, so backward can tell a context of another forward. */
typedef struct {
  uint64_t magic;      /* MOK_CTX_MAGIC once a forward completed */
  uint64_t layer_id;
  int64_t num_tokens;
  uint64_t routing_hash; /* FNV-1a of topk_idx */
  int64_t mode;          /* mok_context_mode_t */
  int64_t pad[3];
} mok_ctx_header_t;
#define MOK_CTX_MAGIC 0x4d6f4b4374780001ull

/* FNV-1a of topk_idx [n], for CPU contexts (host). */
uint64_t mok_routing_hash(const int32_t *topk_idx, int64_t n);

#ifdef __cplusplus
}
#endif

#endif /* MOK_COMMON_CONTEXT_H */
