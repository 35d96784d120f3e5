/*
 * internal.h: the library's internal entry points for its own tests and benchmarks. They are not
 * part of the public API and not exported from libmok.so (tests link the library's objects;
 * benchmarks reach them through bench/driver). Each takes the layer as the public calls do.
 */
#ifndef MOK_API_INTERNAL_H
#define MOK_API_INTERNAL_H

#include "common/tuning.h"
#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The layer's tuning values (a copy of the defaults made at mok_layer_create). */
mokResult_t mok_layer_tuning(mok_layer_t layer, mok_tuning_t *out);
/* Replaces them (checked by mok_tuning_check); later calls on the layer use them. */
mokResult_t mok_layer_set_tuning(mok_layer_t layer, const mok_tuning_t *t);


#ifdef __cplusplus
}
#endif

#endif /* MOK_API_INTERNAL_H */
