"""mok: a thin Python binding over libmok.so, the fused Mixture-of-Experts layer.

Two levels:
- mok.Layer works on numpy arrays (bf16 as uint16 bits) and torch tensors; it owns the C layer
  handle. It casts nothing: every argument must already have the dtype, shape, device and layout
  the layer reads, and is checked for them (python/mok/_check.py) before any C call.
- mok.moe.MoE is a torch.nn.Module whose forward and backward run the layer through
  torch.autograd (a separate module, so numpy-only users never need torch); it casts what is safe
  to cast (integer ids to int32, router weights to fp32, parameters to bf16) and documents it.

Devices: "cpu" runs the plain-C reference backend; "cuda:N" (or "cuda", the current device
torch.cuda.current_device()) the GPU backend, which runs forward and backward of BF16,
fp8-block and MXFP8 layers at every W. A CPU layer takes host memory
(numpy arrays, torch CPU tensors), a GPU layer torch tensors on its device.

Expert parallelism: mok.Comm (python/mok/comm.py) is a communicator of W ranks (Comm.local,
Comm.virtual for W ranks on one GPU, Comm.from_unique_id with mok.unique_id(),
Comm.from_process_group); Layer(..., comm=c) and MoE(..., comm=c or process_group=g) hold
EL = E / W experts of rank c.rank.

mok.__version__ is the C library's version (MOK_VERSION_* of include/mok.h). `import mok` loads
libmok.so ($MOK_LIBRARY when set, else the one installed with the package, else the source tree's
build/libmok.so) and raises MokError(VERSION_MISMATCH) when its mok_version() is another.

Every failure raises MokError: .code is the name of a mokResult_t (INVALID_SHAPE, INVALID_VALUE,
WRONG_DEVICE, INVALID_ROUTING, ...), and the message names the argument ("x", "topk_idx",
"w['wg']", "grads['dx']", ...) with what was expected and what came.
"""
import ctypes

from . import _check
from ._lib import DEVICE_CPU, FP8_SCALES, PRECISIONS, MokError, lib, check
from ._lib import LayerDesc, Weights, ForwardArgs, BackwardArgs, VERSION_CODE
from ._version import VERSION
from .comm import Comm, unique_id

__version__ = ".".join(map(str, VERSION))
__all__ = ["Comm", "Layer", "MokError", "bf16_from_float32", "float32_from_bf16", "unique_id",
           "__version__"]

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
    """One MoE layer handle on one device; rank `rank` of `world_size` ranks, holding
    num_local_experts = EL = E / W experts (W = 1 unless created on a comm). Arguments, as
    include/mok.h defines them:

        x         [T, H]      bf16    T, 0 <= T <= max_tokens (this rank's tokens), read from x
        topk_idx  [T, K]      int32   GLOBAL ids in [0, E), distinct in a row; -1 = an empty slot
        topk_w    [T, K]      fp32
        w         dict: wg, wu [EL, I, H], wd [EL, H, I] bf16 (this rank's experts, global
                  [rank EL, (rank + 1) EL)); with shared_intermediate = Is > 0 also wsg, wsu
                  [Is, H], wsd [H, Is] (replicated on every rank). fp8 layers read `quantized`
        y, dy, grads['dx']    [T, H] bf16;  grads['dtopk_w'] [T, K] fp32
        grads['dwg'] ...      shaped like their weights, fp32 (bf16 with wgrad_fp32=False)
        ctx, quantized        byte buffers of context_bytes(), quantized_weights_bytes() bytes

    bf16 is torch.bfloat16, or for numpy uint16 holding the bits (bf16_from_float32). Nothing
    is cast: an argument of another dtype, shape or device, a non-contiguous one, a read-only
    numpy output, and on a CPU layer an expert id outside [-1, E) raise MokError naming the
    argument (a GPU layer's kernels find bad ids: check() reports them).
    device: "cpu" (the default), "cuda" (torch.cuda.current_device()), "cuda:N" or a
    torch.device; with a comm, the comm's device (another one raises WRONG_DEVICE).
    comm: a mok.Comm (python/mok/comm.py) to create the layer on, collectively (every rank
    creates its layers in the same order); E must be a multiple of its W ranks. The layer keeps
    a reference to it, and close() leaves it open. None: a W = 1 communicator of the layer's own.
    With W > 1 every rank calls forward (and backward) at every step, in the same order (T may
    be 0); results are bitwise those of one W = 1 layer over the ranks' tokens concatenated in
    rank order, but the shared expert's weight gradients, which are over this rank's tokens
    (sum them over the ranks, like data-parallel gradients). Virtual ranks (Comm.virtual): pass
    each rank's own stream.
    Arrays must stay alive for the duration of each call."""

    def __init__(self, hidden, intermediate, num_experts, top_k, max_tokens,
                 shared_intermediate=0, precision="bf16", device=None, wgrad_fp32=True,
                 wgrad_accumulate=False, recompute=False, capacity_factor=0.0, comm=None,
                 fp8_scale="fp32"):
        self._comm, self._layer, self.comm = ctypes.c_void_p(), ctypes.c_void_p(), None
        if precision not in PRECISIONS:
            raise MokError("INVALID_VALUE", f"precision {precision!r}: one of {list(PRECISIONS)}")
        if fp8_scale not in FP8_SCALES:
            raise MokError("INVALID_VALUE", f"fp8_scale {fp8_scale!r}: one of {list(FP8_SCALES)}")
        if comm is not None and not isinstance(comm, Comm):
            raise MokError("INVALID_VALUE", f"comm: expected a mok.Comm, got {type(comm).__name__}")
        if comm is not None and not comm._handle:
            raise MokError("INVALID_VALUE", f"comm: {comm!r} is closed")
        if comm is None:
            ordinal = _check.device_ordinal("cpu" if device is None else device)
        else:
            ordinal = comm.ordinal
            if device is not None and _check.device_ordinal(device) != ordinal:
                raise MokError("WRONG_DEVICE", f"device {str(device)!r}: the comm's ranks are on "
                                               f"{comm.device} (leave device out to take it)")
        self._lib = lib()
        self.device, self.ordinal = _check.device_name(ordinal), ordinal
        d = LayerDesc()
        d.struct_size, d.version = ctypes.sizeof(LayerDesc), VERSION_CODE
        d.hidden, d.intermediate, d.num_experts, d.top_k = hidden, intermediate, num_experts, top_k
        d.shared_intermediate, d.max_tokens = shared_intermediate, max_tokens
        d.precision, d.wgrad_dtype = PRECISIONS[precision], int(bool(wgrad_fp32))
        d.fp8_scale = FP8_SCALES[fp8_scale]
        d.wgrad_accumulate, d.context_mode = int(bool(wgrad_accumulate)), int(bool(recompute))
        d.capacity_factor = capacity_factor
        self.desc = d
        if comm is None:  # a W = 1 communicator of the layer's own, destroyed with it
            check(self._lib.mok_comm_create_local(ctypes.byref(self._comm), ordinal))
            handle = self._comm
        else:  # the caller's; kept referenced so that it outlives the layer
            self.comm, handle = comm, comm._handle
        try:
            check(self._lib.mok_layer_create(ctypes.byref(self._layer), handle, ctypes.byref(d)))
        except MokError:
            self.close()
            raise
        self.rank, self.world_size = (0, 1) if comm is None else (comm.rank, comm.size)
        self.num_local_experts = num_experts // self.world_size
        self._dims = _check.Dims(d, ordinal, self.context_bytes(), self.quantized_weights_bytes(),
                                 self.world_size)

    def close(self):
        if self._layer:
            self._lib.mok_layer_destroy(self._layer)
            self._layer = ctypes.c_void_p()
        if self._comm:
            self._lib.mok_comm_destroy(self._comm)
            self._comm = ctypes.c_void_p()
        comm, self.comm = self.comm, None
        if comm is not None:
            comm._layer_closed()

    def __del__(self):
        if hasattr(self, "_layer"):
            self.close()

    def check(self):
        """Raises MokError for an error a GPU kernel of this layer found (bad routing, capacity
        overflow); synchronizes with the stream of the last forward. A no-op on the CPU."""
        check(self._lib.mok_layer_check(self._layer))

    def recover(self, stream=None):
        """After a MokError of MOK_ERROR_TIMEOUT on an expert-parallel layer: puts the ranks'
        counters back in step (collective: every rank calls recover, then every rank calls
        check, which succeeds once all have joined). A no-op for one rank and on the CPU."""
        check(self._lib.mok_layer_recover(self._layer, stream))

    def _size(self, fn):
        n = ctypes.c_size_t()
        check(fn(self._layer, ctypes.byref(n)))
        return n.value

    def context_bytes(self):
        return self._size(self._lib.mok_context_size)

    def workspace_bytes(self):
        """Device memory the layer holds for its lifetime (0 on the CPU: it allocates per call)."""
        return self._size(self._lib.mok_layer_workspace_size)

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
