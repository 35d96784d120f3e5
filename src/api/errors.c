/* errors.c: result names and the detail messages of the last failure (per thread, per layer). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "api/api.h"

static _Thread_local char g_last_error[MOK_ERR_LEN];

int mok_version(void) { return MOK_VERSION_CODE; }

const char *mok_error_string(mokResult_t r) {
  switch (r) {
    case MOK_SUCCESS: return "success";
    case MOK_ERROR_NULL_POINTER: return "a required pointer is NULL";
    case MOK_ERROR_INVALID_VALUE: return "an argument is out of its range";
    case MOK_ERROR_INVALID_SHAPE: return "shapes do not fit together";
    case MOK_ERROR_MISALIGNED: return "a pointer is misaligned";
    case MOK_ERROR_VERSION_MISMATCH: return "descriptor of another library version";
    case MOK_ERROR_WRONG_DEVICE: return "a pointer lives on the wrong device";
    case MOK_ERROR_NO_DEVICE: return "no such device, or CUDA not available";
    case MOK_ERROR_NOT_IMPLEMENTED: return "not implemented yet by this backend";
    case MOK_ERROR_NOT_AVAILABLE: return "a needed facility is not available";
    case MOK_ERROR_OUT_OF_MEMORY: return "out of memory";
    case MOK_ERROR_CUDA: return "a CUDA call failed";
    case MOK_ERROR_NCCL: return "an NCCL call failed";
    case MOK_ERROR_INVALID_ROUTING: return "invalid routing (expert id out of range or repeated)";
    case MOK_ERROR_CAPACITY_OVERFLOW: return "routed rows exceed the layer's capacity";
    case MOK_ERROR_TIMEOUT: return "a wait timed out";
    case MOK_ERROR_CONTEXT_MISMATCH: return "the saved context does not match this call";
    case MOK_ERROR_INTERNAL: return "internal error";
    default: return "unknown result code";
  }
}

const char *mok_last_error(void) { return g_last_error; }

const char *mok_layer_last_error(mok_layer_t layer) {
  if (!layer) return "";
  if (!mok_handle_live(layer, MOK_HANDLE_LAYER) || layer->magic != MOK_LAYER_MAGIC)
    return "destroyed or invalid layer handle";
  return layer->err;
}

mokResult_t mok_fail_msg(mok_layer_t layer, mokResult_t code, const char *msg) {
  /* Long details are cut at MOK_ERR_LEN on purpose. */
  if (snprintf(g_last_error, sizeof(g_last_error), "%s: %s", mok_error_string(code), msg) < 0)
    g_last_error[0] = '\0';
  if (layer) memcpy(layer->err, g_last_error, sizeof(layer->err));
  return code;
}

mokResult_t mok_fail(mok_layer_t layer, mokResult_t code, const char *fmt, ...) {
  char msg[MOK_ERR_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  return mok_fail_msg(layer, code, msg);
}
