"""_lib.py: ctypes declarations of include/mok.h and the loading of libmok.so.

The structs mirror the C header field for field; mok_layer_create checks struct_size and version,
so a drift between the two shows up as MokError(VERSION_MISMATCH), never as silent corruption.
"""
import ctypes
import os

from ._version import VERSION

RESULTS = [
    "SUCCESS", "NULL_POINTER", "INVALID_VALUE", "INVALID_SHAPE", "MISALIGNED", "VERSION_MISMATCH",
    "WRONG_DEVICE", "NO_DEVICE", "NOT_IMPLEMENTED", "NOT_AVAILABLE", "OUT_OF_MEMORY", "CUDA", "NCCL",
    "INVALID_ROUTING", "CAPACITY_OVERFLOW", "TIMEOUT", "CONTEXT_MISMATCH", "INTERNAL",
]
PRECISIONS = {"bf16": 0, "fp8-block": 1, "mxfp8": 2}
FP8_SCALES = {"fp32": 0, "pow2": 1}  # mok_fp8_scale_t: fp8-block scales as fp32, or powers of two
DEVICE_CPU = -1
VERSION_CODE = VERSION[0] * 10000 + VERSION[1] * 100 + VERSION[2]  # MOK_VERSION_CODE


class MokError(RuntimeError):
    """A failed MoK call: .code is the result name (e.g. 'INVALID_ROUTING'), str() the detail."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class LayerDesc(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("version", ctypes.c_int),
        ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
        ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
        ("shared_intermediate", ctypes.c_int64), ("max_tokens", ctypes.c_int64),
        ("precision", ctypes.c_int), ("fp8_scale", ctypes.c_int), ("wgrad_dtype", ctypes.c_int),
        ("wgrad_accumulate", ctypes.c_int), ("context_mode", ctypes.c_int),
        ("comm_sms", ctypes.c_int), ("capacity_factor", ctypes.c_double),
    ]


class UniqueId(ctypes.Structure):  # mok_unique_id_t: 128 opaque bytes (NCCL's unique id)
    _fields_ = [("internal", ctypes.c_char * 128)]


class Weights(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_void_p) for n in ("wg", "wu", "wd", "wsg", "wsu", "wsd", "quantized")]
                + [("quantized_bytes", ctypes.c_size_t)])


class ForwardArgs(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_int64), ("x", ctypes.c_void_p),
                ("topk_idx", ctypes.c_void_p), ("topk_w", ctypes.c_void_p), ("w", Weights)]


class BackwardArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p)
                for n in ("dy", "dx", "dtopk_w", "dwg", "dwu", "dwd", "dwsg", "dwsu", "dwsd")]


def _find_library():
    """The library to load: $MOK_LIBRARY when set (an explicit choice: the benchmarks' driver
    library, another build for an A/B), else the one installed next to the package (`pip install
    .`), else the source tree's build/libmok.so (`make`)."""
    env = os.environ.get("MOK_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    packaged = os.path.join(here, "libmok.so")
    if os.path.exists(packaged):
        return packaged
    return os.path.join(here, "..", "..", "build", "libmok.so")


def load():
    path = _find_library()
    lib = ctypes.CDLL(path)
    # The version first: a library of another version may lack a function declared below.
    lib.mok_version.argtypes, lib.mok_version.restype = [], ctypes.c_int
    code = lib.mok_version()
    if code != VERSION_CODE:
        got = f"{code // 10000}.{code // 100 % 100}.{code % 100}"
        raise MokError("VERSION_MISMATCH", f"{path} is MoK {got}, this binding (mok "
                       f"{'.'.join(map(str, VERSION))}) needs the same version: rebuild the "
                       "library (make) or reinstall the package (pip install .)")
    vp, res, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    sigs = {
        "mok_version": ([], ctypes.c_int),
        "mok_error_string": ([res], ctypes.c_char_p),
        "mok_last_error": ([], ctypes.c_char_p),
        "mok_comm_create_local": ([ctypes.POINTER(vp), ctypes.c_int], res),
        "mok_comm_create_virtual": ([ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int], res),
        "mok_get_unique_id": ([ctypes.POINTER(UniqueId)], res),
        "mok_comm_create_unique_id": ([ctypes.POINTER(vp), ctypes.POINTER(UniqueId), ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int], res),
        "mok_comm_destroy": ([vp], res),
        "mok_comm_rank": ([vp, ctypes.POINTER(ctypes.c_int)], res),
        "mok_comm_size": ([vp, ctypes.POINTER(ctypes.c_int)], res),
        "mok_comm_device": ([vp, ctypes.POINTER(ctypes.c_int)], res),
        "mok_layer_create": ([ctypes.POINTER(vp), vp, ctypes.POINTER(LayerDesc)], res),
        "mok_layer_destroy": ([vp], res),
        "mok_layer_check": ([vp], res),
        "mok_layer_recover": ([vp, vp], res),
        "mok_layer_workspace_size": ([vp, ctypes.POINTER(ctypes.c_size_t)], res),
        "mok_context_size": ([vp, ctypes.POINTER(ctypes.c_size_t)], res),
        "mok_quantized_weights_size": ([vp, ctypes.POINTER(ctypes.c_size_t)], res),
        "mok_quantize_weights": ([vp, ctypes.POINTER(Weights), vp, sz, vp], res),
        "mok_forward": ([vp, ctypes.POINTER(ForwardArgs), vp, vp, sz, vp], res),
        "mok_backward": ([vp, ctypes.POINTER(ForwardArgs), ctypes.POINTER(BackwardArgs), vp, sz,
                          vp], res),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


_LIB = None


def lib():
    global _LIB
    if _LIB is None:
        _LIB = load()
    return _LIB


def check(result):
    """Raises MokError with the library's detail message when a call failed."""
    if result != 0:
        code = RESULTS[result] if 0 <= result < len(RESULTS) else str(result)
        raise MokError(code, lib().mok_last_error().decode(errors="replace"))
