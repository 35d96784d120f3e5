/*
 * ref.h: the plain-C reference of the whole layer (docs/design.md, "The layer"), forward and
 * backward, over W simulated expert-parallel ranks in one process. Values travel as doubles so the
 * same code runs in two modes:
 *   - normal: every rounding point of the spec is applied (bf16 rounding of a, yk, y, g, u, dg, du,
 *     dxk, dx; fp32 accumulation; for fp8 precisions quantize-dequantize of the GEMM activations at
 *     the points listed below and of the weights via mok_ref_weights_effective);
 *   - exact (fp64): no rounding at all and double accumulation, for finite-difference checks
 *     (precision must be BF16).
 * Rows move through the layout (layout.h) as they would on the GPU: dispatched to each expert's
 * rank, computed there in (source rank, token, slot) order, combined back to their home rank. So
 * W ranks give bitwise the same y, dx, dtopk_w and routed weight gradients as 1 rank holding all
 * tokens concatenated in rank order. Shared-expert weight gradients are per rank (each rank's own
 * tokens; a data-parallel all-reduce sums them).
 *
 * fp8 rounding points (activations quantized along the GEMM's reduction dim; weights by caller):
 *   forward : x (per row, blocks along H) before gate/up; a before down (blocks along I);
 *             shared likewise: x, as.
 *   backward: dy (blocks along H) before ds = dy . Wd; dg and du (blocks along I) before
 *             dxk = dg . Wg + du . Wu; shared likewise. Weight-gradient GEMMs use the bf16 values
 *             (x, a, dy, dg, du) unquantized: they keep bf16 accuracy.
 *   fp8-block: activation blocks 1x128; MXFP8: 1x32, E8M0 scales.
 */
#ifndef MOK_CPU_REF_H
#define MOK_CPU_REF_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

typedef struct {
  int64_t H, I, E, K, Is;
  int W;                     /* simulated ranks, E % W == 0 */
  mok_precision_t precision;
  mok_fp8_scale_t fp8_scale; /* fp8-block activation scales (MXFP8 always E8M0) */
  int exact;                 /* 1: fp64 mode, no rounding (BF16 only) */
  int64_t tile_m;            /* layout padding (rows); any value >= 1 gives the same results */
} mok_ref_cfg_t;

/* One local expert's routed weights as the GEMMs see them (the slices of mok_ref_weights_t's
 * arrays): wg, wu, wg_b, wu_b [I, H]; wd, wd_b [H, I]. */
typedef struct {
  const double *wg, *wu, *wd;       /* forward */
  const double *wg_b, *wu_b, *wd_b; /* backward */
} mok_ref_expert_t;

/* Routed weights fetched one expert at a time, and their gradients handed back one expert at a
 * time, for a caller that cannot hold every expert as doubles (the CPU backend: the README's
 * E = 128, H = 4096, I = 1536 layer takes 19 GB that way, 4x its bf16 weights). When a rank's
 * mok_ref_weights_t.experts is set, the reference reads none of that rank's routed arrays
 * (wg .. wd_b) and writes none of its outputs' dwg, dwu, dwd:
 *   load   fills *e with local expert le of `rank` (forward: wg, wu, wd; backward: all six) just
 *          before the reference reads them, only for experts that have rows; the arrays stay
 *          valid until the next load.
 *   store  (backward) receives local expert le's finished weight gradients dwg, dwu [I, H],
 *          dwd [H, I] (the values mok_ref_out_t's arrays would hold), once for every local
 *          expert in order, with or without rows; valid during the call.
 * Neither can fail (the caller allocates what they need first), and the reference fails only
 * before its first load or store (config, routing, allocation): a failed call stored nothing.
 * The results are bitwise the same as with arrays holding the same values. */
typedef struct {
  void (*load)(void *user, int rank, int64_t le, int backward, mok_ref_expert_t *e);
  void (*store)(void *user, int rank, int64_t le, const double *dwg, const double *dwu,
                const double *dwd);
  void *user;
} mok_ref_experts_t;

/* The weights of one rank, as the GEMMs see them (already quantize-dequantized for fp8):
 * forward copies are quantized along the forward reduction dim, backward copies along the
 * backward (data-gradient) reduction dim. In BF16 both copies may point to the same arrays. */
typedef struct {
  const double *wg, *wu;     /* [EL, I, H] forward */
  const double *wd;          /* [EL, H, I] forward */
  const double *wg_b, *wu_b; /* [EL, I, H] backward (dx = dg . Wg + du . Wu reduces over I) */
  const double *wd_b;        /* [EL, H, I] backward (ds = dy . Wd reduces over H) */
  const double *wsg, *wsu, *wsd;       /* shared forward, [Is, H], [Is, H], [H, Is] */
  const double *wsg_b, *wsu_b, *wsd_b; /* shared backward */
  const mok_ref_experts_t *experts;    /* not NULL: routed weights per expert, see above */
} mok_ref_weights_t;

/* One rank's inputs. topk_w values are fp32 values (as doubles). dy only for backward. */
typedef struct {
  int64_t T;
  const double *x;         /* [T, H] */
  const int32_t *topk_idx; /* [T, K] */
  const double *topk_w;    /* [T, K] */
  const double *dy;        /* [T, H] */
} mok_ref_in_t;

/* One rank's outputs; forward writes y, backward the rest (fp32-rounded values in normal mode;
 * the caller converts weight gradients to its dtype). Weight gradients are overwritten; the
 * routed ones go to w.experts->store instead where the rank's weights have `experts`. */
typedef struct {
  double *y;             /* [T, H] */
  double *dx;            /* [T, H] */
  double *dtopk_w;       /* [T, K] (0 for empty slots) */
  double *dwg, *dwu;     /* [EL, I, H] */
  double *dwd;           /* [EL, H, I] */
  double *dwsg, *dwsu;   /* [Is, H] (unused when Is = 0) */
  double *dwsd;          /* [H, Is] */
} mok_ref_out_t;

/* Optional saved context per rank, in (token, slot) order: g and u of every routed slot as bf16
 * values ([T * K, I]; rows of empty slots untouched) and of the shared expert ([T, Is]).
 * Forward fills it when not NULL; backward uses it when not NULL (else recomputes: same bits). */
typedef struct {
  double *g, *u;   /* [T * K, I] */
  double *gs, *us; /* [T, Is] */
} mok_ref_saved_t;

/* Forward of W ranks: in[W], w[W], out[W], saved NULL or [W]. Errors (detail in err):
 * MOK_ERROR_INVALID_ROUTING, MOK_ERROR_INVALID_VALUE (bad cfg), MOK_ERROR_OUT_OF_MEMORY. */
mokResult_t mok_ref_forward(const mok_ref_cfg_t *cfg, const mok_ref_weights_t *w,
                            const mok_ref_in_t *in, mok_ref_out_t *out,
                            const mok_ref_saved_t *saved, char *err, size_t errlen);
mokResult_t mok_ref_backward(const mok_ref_cfg_t *cfg, const mok_ref_weights_t *w,
                             const mok_ref_in_t *in, mok_ref_out_t *out,
                             const mok_ref_saved_t *saved, char *err, size_t errlen);

/* Builds the effective weights of one rank from its bf16-valued weights (doubles): copies, then
 * quantize-dequantize for fp8 precisions (fp8-block: 128x128 blocks with cfg->fp8_scale kind;
 * MXFP8: 1x32 blocks along the reduction dim of each copy, E8M0). The arrays are allocated in
 * *w (free with mok_ref_weights_free). Is = 0 leaves the shared pointers NULL. */
mokResult_t mok_ref_weights_effective(const mok_ref_cfg_t *cfg, const double *wg,
                                      const double *wu, const double *wd, const double *wsg,
                                      const double *wsu, const double *wsd, mok_ref_weights_t *w);
void mok_ref_weights_free(mok_ref_weights_t *w);

#endif /* MOK_CPU_REF_H */
