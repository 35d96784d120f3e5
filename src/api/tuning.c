/* tuning.c: the tuning defaults and their checks (src/common/tuning.h); a layer's copy is read and
 * replaced by src/api/layer.c's mok_layer_tuning / mok_layer_set_tuning (src/api/internal.h). */
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

mokResult_t mok_tuning_default(mok_tuning_t *t) {
  memset(t, 0, sizeof(*t));
  t->struct_size = sizeof(*t);
  t->forward_path = MOK_FORWARD_FUSED;
  t->backward_path = MOK_BACKWARD_CHAIN;
  t->fused_shared_band = 8; /* docs/performance.md, "Fused forward: the shared expert" */
  t->fused_help_pct = -1;
  t->timeout_s = 10.0;
  /* The one environment variable: read here, when a layer is created, and validated. */
  const char *e = getenv("MOK_DEBUG_TIMEOUT_S");
  if (e && e[0]) {
    char *end = NULL;
    const double s = strtod(e, &end);
    if (end == e || *end != '\0' || !(s > 0.0) || s > 1e6)
      return mok_fail(NULL, MOK_ERROR_INVALID_VALUE,
                      "MOK_DEBUG_TIMEOUT_S = \"%s\": must be a number of seconds in (0, 1e6]", e);
    t->timeout_s = s;
  }
  return MOK_SUCCESS;
}

mokResult_t mok_tuning_check(mok_layer_t layer, const mok_tuning_t *t) {
  if (!t) return mok_fail(layer, MOK_ERROR_NULL_POINTER, "tuning: NULL");
  if (t->struct_size != sizeof(*t))
    return mok_fail(layer, MOK_ERROR_VERSION_MISMATCH, "tuning: struct_size %zu, expected %zu",
                    t->struct_size, sizeof(*t));
  if ((unsigned)t->forward_path > MOK_FORWARD_CHAIN)
    return mok_fail(layer, MOK_ERROR_INVALID_VALUE, "tuning: forward_path = %d", (int)t->forward_path);
  if ((unsigned)t->backward_path > MOK_BACKWARD_FUSED)
    return mok_fail(layer, MOK_ERROR_INVALID_VALUE, "tuning: backward_path = %d",
                    (int)t->backward_path);
  if (t->backward_sms < 0 || t->backward_lag < 0)
    return mok_fail(layer, MOK_ERROR_INVALID_VALUE, "tuning: backward_sms = %d, backward_lag = %d "
                    "out of range", t->backward_sms, t->backward_lag);
  if (t->forward_sms < 0 || t->fused_lag < 0 || t->fused_shared_band < 1 ||
      t->fused_help_pct < -1 || t->fused_help_pct > 100 || t->tile_group_m < -1 ||
      t->tile_group_m > 1024 || !(t->timeout_s > 0.0 && t->timeout_s <= 1e6))
    return mok_fail(layer, MOK_ERROR_INVALID_VALUE,
                    "tuning: forward_sms = %d, fused_lag = %d, fused_shared_band = %d, "
                    "fused_help_pct = %d, tile_group_m = %d, timeout_s = %g out of range",
                    t->forward_sms, t->fused_lag, t->fused_shared_band, t->fused_help_pct,
                    t->tile_group_m, t->timeout_s);
  return MOK_SUCCESS;
}
