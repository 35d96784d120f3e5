/*
 * layout.h: the routing layout (docs/design.md, "The transport"), computed on the host from every
 * rank's routing. It is the oracle for the GPU layout phase and for the transport.
 *
 * Routed rows: rows of local expert e (on rank e / EL) are ordered by (source rank, token, slot);
 * each expert's segment starts at a multiple of tile_m in its rank's row buffer and is padded up to
 * a multiple of tile_m (an empty expert takes no rows). Segments follow each other in expert order.
 * Token dispatch: a token goes to a destination rank at most once, whatever number of its slots
 * route there; a rank's receive buffer holds its tokens ordered by (source rank, token).
 */
#ifndef MOK_CPU_LAYOUT_H
#define MOK_CPU_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

/* One row of an expert's segment: where it came from. src = -1 marks a padding row. */
typedef struct {
  int32_t src;   /* source rank */
  int32_t slot;  /* k in [0, K) */
  int64_t token; /* token index on the source rank */
} mok_row_origin_t;

typedef struct {
  int W;
  int64_t E, EL, K, tile_m;
  int64_t *T;                  /* [W] tokens per rank */
  int64_t *count;              /* [W * E] rows from source rank s to expert e: count[s * E + e] */
  int64_t *expert_rows;        /* [E] rows of expert e (sum over sources, no padding) */
  int64_t *expert_start;       /* [E] first row of expert e in the row buffer of rank e / EL */
  int64_t *rank_rows;          /* [W] padded rows on rank r */
  int64_t **slot_row;          /* [W][T_s * K] row of (token, slot) of rank s in its expert's
                                  rank's buffer, -1 for an empty slot */
  mok_row_origin_t **row_from; /* [W][rank_rows[r]] origin of each row of rank r */
  int64_t *recv_tokens;        /* [W] tokens rank d receives (own tokens included) */
  int64_t **token_pos;         /* [W][T_s * W] position of token t of rank s in rank d's receive
                                  buffer: token_pos[s][t * W + d], -1 when no slot goes to d */
  int64_t **recv_from;         /* [W][recv_tokens[d] * 2] (source rank, token) of each received row */
} mok_layout_t;

/* Builds the layout of W ranks; topk_idx[s] is rank s's [T[s], K] routing (may be NULL if T[s] = 0).
 * Returns MOK_ERROR_INVALID_ROUTING (detail in err) for an id outside [-1, E) or an expert twice in
 * one row; MOK_ERROR_OUT_OF_MEMORY. On failure *l holds nothing to free. */
mokResult_t mok_layout_build(mok_layout_t *l, int W, int64_t E, int64_t K, int64_t tile_m,
                             const int64_t *T, const int32_t *const *topk_idx, char *err,
                             size_t errlen);
void mok_layout_free(mok_layout_t *l);

#endif /* MOK_CPU_LAYOUT_H */
