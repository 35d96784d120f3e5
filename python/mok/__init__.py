"""mok: a thin Python binding over libmok.so, the fused Mixture-of-Experts layer.

Two levels:
- mok.Layer works on numpy arrays (bf16 as uint16 bits) and torch tensors; it owns the C layer
  handle. It casts nothing: every argument must already have the dtype, shape, device and layout
  the layer reads, and is checked for them (python/mok/_check.py) before any C call.
- mok.moe.MoE is a torch.nn.Module whose forward and backward run the layer through
  torch.autograd (a separate module, so numpy-only users never need torch); it casts what is safe
  to cast (integer ids to int32, router weights to fp32, parameters to bf16) and documents it.

Devices: "cpu" runs the plain-C reference backend; "cuda:N" (or "cuda", the current device
torch.cuda.current_device()) the GPU backend, which runs forward and backward of BF16 layers
(W = 1) and reports NOT_IMPLEMENTED for fp8 until those kernels land. A CPU layer takes host
memory (numpy arrays, torch CPU tensors), a GPU layer torch tensors on its device.

mok.__version__ is the C library's version (MOK_VERSION_* of include/mok.h). `import mok` loads
libmok.so ($MOK_LIBRARY when set, else the one installed with the package, else the source tree's
build/libmok.so) and raises MokError(VERSION_MISMATCH) when its mok_version() is another.

Every failure raises MokError: .code is the name of a mokResult_t (INVALID_SHAPE, INVALID_VALUE,
WRONG_DEVICE, INVALID_ROUTING, ...), and the message names the argument ("x", "topk_idx",
"w['wg']", "grads['dx']", ...) with what was expected and what came.
"""
import ctypes

from . import _check
from ._lib import DEVICE_CPU, PRECISIONS, MokError, lib, check
from ._lib import LayerDesc, Weights, ForwardArgs, BackwardArgs, VERSION_CODE
from ._version import VERSION

__version__ = ".".join(map(str, VERSION))
__all__ = ["Layer", "MokError", "bf16_from_float32", "float32_from_bf16", "__version__"]

lib()  # loads libmok.so now: a missing library or one of another version fails the import


def bf16_from_float32(a):
    """numpy float32 -> bf16 bits (uint16), round to nearest even, NaN kept (as the C library)."""
    import numpy as np
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def float32_from_bf16(b):
    import numpy as np
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _nbytes(t):
    """The size in bytes of a numpy array or torch tensor (0 for None)."""
    if t is None:
        return 0
    if hasattr(t, "data_ptr"):
        return t.numel() * t.element_size()
    return t.nbytes


def _ptr(t):
    """The data pointer of a numpy array or torch tensor (None stays None)."""
    if t is None:
        return None
    if hasattr(t, "data_ptr"):
        if not t.is_contiguous():
            raise MokError("INVALID_VALUE", "tensors passed to MoK must be contiguous")
        return t.data_ptr()
    if not t.flags["C_CONTIGUOUS"]:
        raise MokError("INVALID_VALUE", "arrays passed to MoK must be C-contiguous")
    return t.ctypes.data


class Layer:
    """One MoE layer handle on one device (W = 1, so EL = E). Arguments, as include/mok.h defines them:

        x         [T, H]      bf16    T, 0 <= T <= max_tokens, is read from x
        topk_idx  [T, K]      int32   ids in [0, E), distinct in a row; -1 = an empty slot
        topk_w    [T, K]      fp32
        w         dict: wg, wu [E, I, H], wd [E, H, I] bf16; with shared_intermediate = Is > 0
                  also wsg, wsu [Is, H], wsd [H, Is]. fp8 layers read `quantized` instead
        y, dy, grads['dx']    [T, H] bf16;  grads['dtopk_w'] [T, K] fp32
        grads['dwg'] ...      shaped like their weights, fp32 (bf16 with wgrad_fp32=False)
        ctx, quantized        byte buffers of context_bytes(), quantized_weights_bytes() bytes

    bf16 is torch.bfloat16, or for numpy uint16 holding the bits (bf16_from_float32). Nothing
    is cast: an argument of another dtype, shape or device, a non-contiguous one, a read-only
    numpy output, and on a CPU layer an expert id outside [-1, E) raise MokError naming the
    argument (a GPU layer's kernels find bad ids: check() reports them).
    device: "cpu", "cuda" (torch.cuda.current_device()), "cuda:N" or a torch.device.
    Arrays must stay alive for the duration of each call."""

    def __init__(self, hidden, intermediate, num_experts, top_k, max_tokens,
                 shared_intermediate=0, precision="bf16", device="cpu", wgrad_fp32=True,
                 wgrad_accumulate=False, recompute=False, capacity_factor=0.0):
        self._comm, self._layer = ctypes.c_void_p(), ctypes.c_void_p()
        if precision not in PRECISIONS:
            raise MokError("INVALID_VALUE", f"precision {precision!r}: one of {list(PRECISIONS)}")
        ordinal = _check.device_ordinal(device)
        self._lib = lib()
        self.device, self.ordinal = _check.device_name(ordinal), ordinal
        d = LayerDesc()
        d.struct_size, d.version = ctypes.sizeof(LayerDesc), VERSION_CODE
        d.hidden, d.intermediate, d.num_experts, d.top_k = hidden, intermediate, num_experts, top_k
        d.shared_intermediate, d.max_tokens = shared_intermediate, max_tokens
        d.precision, d.wgrad_dtype = PRECISIONS[precision], int(bool(wgrad_fp32))
        d.wgrad_accumulate, d.context_mode = int(bool(wgrad_accumulate)), int(bool(recompute))
        d.capacity_factor = capacity_factor
        self.desc = d
        check(self._lib.mok_comm_create_local(ctypes.byref(self._comm), ordinal))
        try:
            check(self._lib.mok_layer_create(ctypes.byref(self._layer), self._comm, ctypes.byref(d)))
        except MokError:
            self._lib.mok_comm_destroy(self._comm)
            self._comm = ctypes.c_void_p()
            raise
        self._dims = _check.Dims(d, ordinal, self.context_bytes(), self.quantized_weights_bytes())

    def close(self):
        if self._layer:
            self._lib.mok_layer_destroy(self._layer)
            self._layer = ctypes.c_void_p()
        if self._comm:
            self._lib.mok_comm_destroy(self._comm)
            self._comm = ctypes.c_void_p()

    def __del__(self):
        self.close()

    def check(self):
        """Raises MokError for an error a GPU kernel of this layer found (bad routing, capacity
        overflow); synchronizes with the stream of the last forward. A no-op on the CPU."""
        check(self._lib.mok_layer_check(self._layer))

    def _size(self, fn):
        n = ctypes.c_size_t()
        check(fn(self._layer, ctypes.byref(n)))
        return n.value

    def context_bytes(self):
        return self._size(self._lib.mok_context_size)

    def quantized_weights_bytes(self):
        return self._size(self._lib.mok_quantized_weights_size)

    @staticmethod
    def _weights(w, quantized=None):
        get = (lambda k: _ptr(w.get(k))) if isinstance(w, dict) else (lambda k: None)
        return Weights(*(get(k) for k in ("wg", "wu", "wd", "wsg", "wsu", "wsd")), _ptr(quantized),
                       _nbytes(quantized))

    def quantize_weights(self, w, out):
        """Fills `out` (quantized_weights_bytes() bytes, 16-byte aligned) from the bf16 weights."""
        _check.weights(self._dims, w)
        _check.buffer("out", out, self.ordinal, self._dims.quantized_bytes, out=True)
        check(self._lib.mok_quantize_weights(self._layer, ctypes.byref(self._weights(w)),
                                             _ptr(out), _nbytes(out), None))

    def _args(self, x, topk_idx, topk_w, w, quantized):
        return ForwardArgs(x.shape[0], _ptr(x), _ptr(topk_idx), _ptr(topk_w),
                           self._weights(w, quantized))

    def forward(self, x, topk_idx, topk_w, w, y, ctx, quantized=None, stream=None):
        """y <- the layer; ctx (context_bytes() bytes) is written for backward."""
        T = _check.forward(self._dims, x, topk_idx, topk_w, w, quantized)
        _check.outputs(self._dims, T, y, ctx)
        a = self._args(x, topk_idx, topk_w, w, quantized)
        check(self._lib.mok_forward(self._layer, ctypes.byref(a), _ptr(y), _ptr(ctx), _nbytes(ctx),
                                    stream))

    def backward(self, x, topk_idx, topk_w, w, ctx, dy, grads, quantized=None, stream=None):
        """grads: dict with dx, dtopk_w, dwg, dwu, dwd (and dwsg, dwsu, dwsd with a shared expert)."""
        T = _check.forward(self._dims, x, topk_idx, topk_w, w, quantized)
        _check.gradients(self._dims, T, ctx, dy, grads)
        a = self._args(x, topk_idx, topk_w, w, quantized)
        g = BackwardArgs(_ptr(dy), *(_ptr(grads.get(k)) for k in
                                     ("dx", "dtopk_w", "dwg", "dwu", "dwd", "dwsg", "dwsu", "dwsd")))
        check(self._lib.mok_backward(self._layer, ctypes.byref(a), ctypes.byref(g), _ptr(ctx),
                                     _nbytes(ctx), stream))
