/*
 * mok_bench.h: the benchmarks' way into MoK's internal kernels and tuning, built with the library's
 * objects into build/libmok_bench.so (which also exports the public API of include/mok.h). Not
 * part of the public API. Every struct starts with its size, which the driver checks, so a
 * benchmark built against another version gets MOK_ERROR_VERSION_MISMATCH, never a misread.
 */
#ifndef MOK_BENCH_H
#define MOK_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOK_BENCH_VERSION 1
int mok_bench_version(void);

/* One grouped GEMM (kind 0: src/cuda/gemm/gemm.h's mok_grouped_gemm_launch) or weight-gradient
 * GEMM (kind 1: mok_grouped_wgrad_launch), fields as those launchers document them. */
typedef struct {
  size_t struct_size;        /* sizeof(mok_bench_gemm_t) */
  int kind;                  /* 0: grouped GEMM, 1: weight-gradient GEMM */
  int dtype;                 /* 0: bf16, 1: fp8-block (grouped GEMM only) */
  int b_layout;              /* 0: K-major B [G, N, K], 1: N-major [G, K, N] */
  int epilogue;              /* 0: store bf16, 1: store fp32, 2: accumulate fp32, 3: SwiGLU */
  int offsets_int64;         /* 0: int32 offsets, 1: int64 */
  int num_sms;               /* CTAs; 0 = one per SM */
  int group_m;               /* row tiles per band: 0 = by B's size, -1 = none, n > 0 = n */
  int64_t num_groups, m_total, n, k;
  const void *a, *b, *b2;    /* b2: SwiGLU's up weights */
  const void *offsets;       /* [G + 1], device memory */
  void *c;
  const float *row_scale;    /* SwiGLU: [m_total] or NULL */
  void *g_out, *u_out;       /* SwiGLU: optional bf16 g, u */
  const float *a_scale, *b_scale; /* fp8-block */
  int64_t a_scale_ld;
} mok_bench_gemm_t;
mokResult_t mok_bench_gemm(const mok_bench_gemm_t *g, void *stream);

/* Sets one tuning value of a layer (src/common/tuning.h) by its field name: "forward_path"
 * (0 fused, 1 chain), "forward_sms", "fused_lag", "fused_shared_band", "fused_help_pct",
 * "backward_path" (0 chain, 1 fused), "backward_sms", "backward_lag", "tile_group_m",
 * "timeout_s". MOK_ERROR_INVALID_VALUE for another name or an out-of-range
 * value. */
mokResult_t mok_bench_layer_tune(mok_layer_t layer, const char *name, double value);

/* The NVLink transport (src/cuda/comm/comm.h), for bench/transport.py. */
typedef struct mok_transport *mok_bench_transport_t;
mokResult_t mok_bench_transport_create(mok_bench_transport_t *out, mok_comm_t comm,
                                       int64_t max_tokens, int64_t hidden, int64_t num_experts,
                                       int64_t top_k, int64_t tile_m, int num_sms,
                                       double timeout_s);
mokResult_t mok_bench_transport_destroy(mok_bench_transport_t t);
mokResult_t mok_bench_transport_layout(mok_bench_transport_t t, int64_t num_tokens,
                                       const int32_t *topk_idx, void *stream);
mokResult_t mok_bench_transport_run(mok_bench_transport_t t, int phases, const void *x, void *y,
                                    void *stream);
mokResult_t mok_bench_transport_check(mok_bench_transport_t t);
mokResult_t mok_bench_transport_remote_bytes(mok_bench_transport_t t, int64_t *dispatch_bytes,
                                             int64_t *combine_bytes);

#ifdef __cplusplus
}
#endif

#endif /* MOK_BENCH_H */
