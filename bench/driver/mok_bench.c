/* mok_bench.c: the benchmark driver of mok_bench.h over the library's internal launchers. */
#include <string.h>

#include "api/api.h"
#include "api/internal.h"
#include "mok_bench.h"

#include "cuda/comm/comm.h"
#ifdef MOK_WITH_CUDA
#include "cuda/gemm/gemm.h"
#endif

int mok_bench_version(void) { return MOK_BENCH_VERSION; }

mokResult_t mok_bench_gemm(const mok_bench_gemm_t *g, void *stream) {
  if (!g) return mok_fail(NULL, MOK_ERROR_NULL_POINTER, "mok_bench_gemm: NULL");
  if (g->struct_size != sizeof(*g))
    return mok_fail(NULL, MOK_ERROR_VERSION_MISMATCH, "mok_bench_gemm: struct_size %zu, expected %zu",
                    g->struct_size, sizeof(*g));
#ifdef MOK_WITH_CUDA
  if (g->kind == 0) {
    mok_grouped_gemm_params_t p;
    memset(&p, 0, sizeof(p));
    p.dtype = (mok_gg_dtype_t)g->dtype;
    p.b_layout = (mok_gg_layout_t)g->b_layout;
    p.epilogue = (mok_gg_epilogue_t)g->epilogue;
    p.offsets_int64 = g->offsets_int64;
    p.num_groups = g->num_groups, p.m_total = g->m_total, p.n = g->n, p.k = g->k;
    p.a = g->a, p.b = g->b, p.b2 = g->b2, p.offsets = g->offsets, p.c = g->c;
    p.row_scale = g->row_scale, p.g_out = g->g_out, p.u_out = g->u_out;
    p.num_sms = g->num_sms, p.group_m = g->group_m;
    p.a_scale = g->a_scale, p.b_scale = g->b_scale, p.a_scale_ld = g->a_scale_ld;
    return mok_grouped_gemm_launch(&p, stream);
  }
  if (g->kind == 1) {
    mok_grouped_wgrad_params_t p;
    memset(&p, 0, sizeof(p));
    p.epilogue = (mok_gg_epilogue_t)g->epilogue;
    p.offsets_int64 = g->offsets_int64;
    p.num_groups = g->num_groups, p.m_total = g->m_total, p.n = g->n, p.k = g->k;
    p.a = g->a, p.b = g->b, p.offsets = g->offsets, p.c = g->c, p.num_sms = g->num_sms;
    return mok_grouped_wgrad_launch(&p, stream);
  }
  return mok_fail(NULL, MOK_ERROR_INVALID_VALUE, "mok_bench_gemm: kind %d", g->kind);
#else
  (void)stream;
  return mok_fail(NULL, MOK_ERROR_NO_DEVICE, "mok_bench_gemm: built without CUDA");
#endif
}

mokResult_t mok_bench_layer_tune(mok_layer_t layer, const char *name, double value) {
  mok_tuning_t t;
  mokResult_t r = mok_layer_tuning(layer, &t);
  if (r != MOK_SUCCESS) return r;
  if (!name) return mok_fail(layer, MOK_ERROR_NULL_POINTER, "mok_bench_layer_tune: NULL name");
  const int iv = (int)value;
  if (strcmp(name, "forward_path") == 0) t.forward_path = (mok_forward_path_t)iv;
  else if (strcmp(name, "forward_sms") == 0) t.forward_sms = iv;
  else if (strcmp(name, "fused_lag") == 0) t.fused_lag = iv;
  else if (strcmp(name, "fused_shared_band") == 0) t.fused_shared_band = iv;
  else if (strcmp(name, "fused_help_pct") == 0) t.fused_help_pct = iv;
  else if (strcmp(name, "backward_path") == 0) t.backward_path = (mok_backward_path_t)iv;
  else if (strcmp(name, "backward_sms") == 0) t.backward_sms = iv;
  else if (strcmp(name, "backward_lag") == 0) t.backward_lag = iv;
  else if (strcmp(name, "tile_group_m") == 0) t.tile_group_m = iv;
  else if (strcmp(name, "timeout_s") == 0) t.timeout_s = value;
  else return mok_fail(layer, MOK_ERROR_INVALID_VALUE, "mok_bench_layer_tune: no tuning value \"%s\"", name);
  return mok_layer_set_tuning(layer, &t);
}

mokResult_t mok_bench_transport_create(mok_bench_transport_t *out, mok_comm_t comm,
                                       int64_t max_tokens, int64_t hidden, int64_t num_experts,
                                       int64_t top_k, int64_t tile_m, int num_sms,
                                       double timeout_s) {
  mok_transport_desc_t d;
  memset(&d, 0, sizeof(d));
  d.max_tokens = max_tokens, d.hidden = hidden, d.num_experts = num_experts, d.top_k = top_k;
  d.tile_m = tile_m, d.num_sms = num_sms, d.timeout_s = timeout_s;
  return mok_transport_create(out, comm, &d);
}
mokResult_t mok_bench_transport_destroy(mok_bench_transport_t t) { return mok_transport_destroy(t); }
mokResult_t mok_bench_transport_layout(mok_bench_transport_t t, int64_t num_tokens,
                                       const int32_t *topk_idx, void *stream) {
  return mok_transport_layout(t, num_tokens, topk_idx, stream);
}
mokResult_t mok_bench_transport_run(mok_bench_transport_t t, int phases, const void *x, void *y,
                                    void *stream) {
  return mok_transport_run(t, phases, x, y, stream);
}
mokResult_t mok_bench_transport_check(mok_bench_transport_t t) { return mok_transport_check(t); }
mokResult_t mok_bench_transport_remote_bytes(mok_bench_transport_t t, int64_t *dispatch_bytes,
                                             int64_t *combine_bytes) {
  return mok_transport_remote_bytes(t, dispatch_bytes, combine_bytes);
}
