/*
 * ref_internal.h: what the reference layer's forward (ref_layer.c) and backward (ref_backward.c)
 * share: the arithmetic of one rounding mode, argument checks, and activation quantization.
 *
 * Every value is a double. In normal mode each helper rounds exactly where the fp32/bf16 hardware
 * would (an fp32 product of two fp32 values, an fmaf step of a GEMM, a bf16 store), so a chain of
 * helpers gives the same bits as the same chain written with float variables. In exact mode
 * (cfg->exact) every helper is the plain double operation and no rounding happens anywhere.
 */
#ifndef MOK_CPU_REF_INTERNAL_H
#define MOK_CPU_REF_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu/layout.h"
#include "cpu/quant.h"
#include "cpu/ref.h"

/* The arithmetic of one call: rounding mode and the activation quantizer of its precision. */
typedef struct {
  int exact;              /* 1: doubles throughout, no rounding */
  int fp8;                /* 1: quantize-dequantize GEMM activations along the reduction dim */
  int block;              /* activation block length along the reduction dim: 128 or 32 */
  mok_quant_scale_t kind; /* activation scale kind */
} mok_ref_num_t;

/* Values rounded to fp32 are represented exactly by float, so the casts below are lossless on
 * them; double rounding (double then float) of one +, *, / of two floats equals the direct
 * float operation because 53 >= 2 * 24 + 2, but we stay in float anyway to make that obvious. */
static inline double mok_ref_mul(const mok_ref_num_t *n, double a, double b) {
  return n->exact ? a * b : (double)((float)a * (float)b);
}

static inline double mok_ref_add(const mok_ref_num_t *n, double a, double b) {
  return n->exact ? a + b : (double)((float)a + (float)b);
}

/* One accumulation step of a GEMM: c + a * b with one rounding, like the tensor core's fp32
 * accumulate (fmaf), or exact in double. */
static inline double mok_ref_fma(const mok_ref_num_t *n, double a, double b, double c) {
  return n->exact ? a * b + c : (double)fmaf((float)a, (float)b, (float)c);
}

static inline double mok_ref_bf16(const mok_ref_num_t *n, double v) {
  return n->exact ? v : mok_round_bf16(v);
}

/* acc + sum_i a[i] * b[i * bstride], i = 0..len-1 in index order, one fp32 accumulator.
 * a: [len]; b: [len] with stride bstride (a row or a column of a weight matrix). */
static inline double mok_ref_dot(const mok_ref_num_t *n, double acc, const double *a,
                                 const double *b, int64_t bstride, int64_t len) {
  if (n->exact) {
    for (int64_t i = 0; i < len; i++) acc += a[i] * b[i * bstride];
    return acc;
  }
  float f = (float)acc;
  for (int64_t i = 0; i < len; i++) f = fmaf((float)a[i], (float)b[i * bstride], f);
  return f;
}

/* silu(g) = g / (1 + exp(-g)), in fp32 (expf) or in double. */
static inline double mok_ref_silu(const mok_ref_num_t *n, double g) {
  if (n->exact) return g / (1.0 + exp(-g));
  float gf = (float)g;
  return gf / (1.0f + expf(-gf));
}

/* silu'(g) = sig(g) * (1 + g * (1 - sig(g))), sig(g) = 1 / (1 + exp(-g)). */
static inline double mok_ref_dsilu(const mok_ref_num_t *n, double g) {
  if (n->exact) {
    double sig = 1.0 / (1.0 + exp(-g));
    return sig * (1.0 + g * (1.0 - sig));
  }
  float gf = (float)g;
  float sig = 1.0f / (1.0f + expf(-gf));
  return sig * (1.0f + gf * (1.0f - sig));
}

/* The arithmetic of cfg (which must have passed mok_ref_check_cfg). */
void mok_ref_num_init(mok_ref_num_t *n, const mok_ref_cfg_t *cfg);

/* Writes a formatted detail into err (when err is not NULL and errlen > 0). */
void mok_ref_set_error(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Records an allocation failure in `what` (forward, ...); returns MOK_ERROR_OUT_OF_MEMORY. */
mokResult_t mok_ref_oom(char *err, size_t errlen, const char *what);

/* MOK_ERROR_INVALID_VALUE (detail in err) unless 0 < H, I <= 2^20, 0 <= Is <= 2^20, W >= 1,
 * E % W == 0, E <= 2^16, 1 <= K <= E, tile_m >= 1, a known precision and fp8 scale, exact only
 * with BF16 (the bounds of common/limits.h: every per-rank size then fits in int64). */
mokResult_t mok_ref_check_cfg(const mok_ref_cfg_t *cfg, char *err, size_t errlen);

/* Checks the pointers and token counts of a forward (backward = 0) or backward (1) call of W
 * ranks: MOK_ERROR_NULL_POINTER or MOK_ERROR_INVALID_VALUE with a detail, else MOK_SUCCESS. */
mokResult_t mok_ref_check_args(const mok_ref_cfg_t *cfg, const mok_ref_weights_t *w,
                               const mok_ref_in_t *in, const mok_ref_out_t *out,
                               const mok_ref_saved_t *saved, int backward, char *err,
                               size_t errlen);

/* Allocates n doubles (zeroed); NULL on failure or when n * sizeof(double) overflows. A request
 * for 0 doubles still returns a valid pointer, so NULL always means failure. */
double *mok_ref_alloc(int64_t n);

/* Builds the layout of cfg->W ranks from in[W]'s routing (detail in err on failure). */
mokResult_t mok_ref_layout(const mok_ref_cfg_t *cfg, const mok_ref_in_t *in, mok_layout_t *l,
                           char *err, size_t errlen);

/* Quantize-dequantize one activation row v[len] in place along its length (the GEMM's reduction
 * dim) when the precision is fp8; nothing in BF16. */
void mok_ref_qdq_row(const mok_ref_num_t *n, double *v, int64_t len);

/* q[W] = per-rank copies of the [T_r, H] activations src(in[r]) (x or dy), each row quantized
 * once along H, so every expert that reads a token row reads the same values. Free with
 * mok_ref_free_ranks. */
mokResult_t mok_ref_quantize_rows(const mok_ref_cfg_t *cfg, const mok_ref_num_t *n,
                                  const mok_ref_in_t *in, int dy, double ***q);
/* Per-rank [T_r * K, width] buffers indexed by (token, slot), zeroed. */
mokResult_t mok_ref_alloc_slots(const mok_ref_cfg_t *cfg, const mok_ref_in_t *in, int64_t width,
                                double ***buf);
void mok_ref_free_ranks(double **p, int W);

/* The routed weights of local expert le of rank r (backward = 1: the backward copies too):
 * slices of w[r]'s arrays, or what w[r].experts->load gives (ref.h). */
void mok_ref_expert_weights(const mok_ref_cfg_t *cfg, const mok_ref_weights_t *w, int r,
                            int64_t le, int backward, mok_ref_expert_t *e);

/* The gate and up projections of one row, fp32 accumulations, not rounded:
 * g = x . Wg^T, u = x . Wu^T. x: [H]; wg, wu: [rows, H]; g, u: [rows]. */
void mok_ref_gate_up(const mok_ref_num_t *n, const double *x, const double *wg, const double *wu,
                     int64_t rows, int64_t H, double *g, double *u);

#endif /* MOK_CPU_REF_INTERNAL_H */
