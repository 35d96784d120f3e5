"""_check.py: every array argument of mok.Layer checked against the layer before the C call.

The C library sees only pointers: it checks NULL, alignment and (on a GPU) the device of each, but
not shapes, dtypes or strides, so an x of [T, H/2] or an fp32 array where bf16 belongs is read past
its end or reinterpreted. Here each argument (a numpy array or a torch tensor) is checked for

    kind      a numpy array or a strided torch tensor, nothing else
    device    CPU layer: host memory (numpy, or a torch CPU tensor); GPU layer: its CUDA device
    dtype     bf16 (torch.bfloat16; numpy has none: uint16 holding the bits), fp32, int32,
              exactly; nothing is cast here (the torch module casts)
    layout    C-contiguous; outputs also writeable
    shape     against the layer: H, I, Is, K, EL (E / W: routed weights are this rank's),
              T <= T_max, T taken from x
    values    expert ids in [-1, E), on host memory only (on a GPU that needs a synchronization;
              the kernels check them and mok_layer_check reports them)

and a failure raises MokError whose message names the argument and says what was expected and
what came. The codes are the library's: INVALID_VALUE (kind, dtype, layout, missing or unknown
key), INVALID_SHAPE, WRONG_DEVICE, INVALID_ROUTING (ids), NULL_POINTER (a required tensor absent).
"""
import re

from ._lib import DEVICE_CPU, MokError

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
WEIGHTS = ("wg", "wu", "wd", "wsg", "wsu", "wsd")
WEIGHT_GRADS = tuple("d" + k for k in WEIGHTS)

# logical dtype -> accepted dtype names: str(torch dtype) for tensors, dtype.name for numpy
_DTYPES = {
    "bf16": ("torch.bfloat16", "uint16"),
    "fp32": ("torch.float32", "float32"),
    "int32": ("torch.int32", "int32"),
}
_DTYPE_TEXT = {
    "bf16": "bf16 (torch.bfloat16, or numpy uint16 holding bf16 bits: mok.bf16_from_float32)",
    "fp32": "fp32 (torch.float32 / numpy float32)",
    "int32": "int32 (torch.int32 / numpy int32)",
}


def fail(code, message):
    raise MokError(code, message)


# ---- devices ------------------------------------------------------------------------------------

def device_ordinal(device):
    """'cpu' -> DEVICE_CPU (the plain-C reference backend), 'cuda:N' -> N, 'cuda' -> the current
    CUDA device (torch.cuda.current_device()); a torch.device is read the same way."""
    if type(device).__name__ == "device" and type(device).__module__.startswith("torch"):
        device = str(device)
    if not isinstance(device, str):
        fail("INVALID_VALUE", f"device {device!r}: expected 'cpu', 'cuda' or 'cuda:N' "
                              f"(a str or torch.device), got {type(device).__name__}")
    if device == "cpu":
        return DEVICE_CPU
    if device == "cuda":
        return _current_cuda_device()
    m = re.fullmatch(r"cuda:([0-9]+)", device)
    if not m:
        fail("INVALID_VALUE", f"device {device!r}: expected 'cpu' (the CPU reference backend), "
                              f"'cuda' (the current CUDA device) or 'cuda:N'")
    return int(m.group(1))


def _current_cuda_device():
    try:
        import torch
    except ImportError:
        fail("INVALID_VALUE", "device 'cuda' means torch.cuda.current_device(), and torch is not "
                              "installed: pass 'cuda:N'")
    try:
        return torch.cuda.current_device()
    except (AssertionError, RuntimeError) as e:  # a CPU-only torch, or no GPU visible
        fail("NO_DEVICE", f"device 'cuda': torch has no current CUDA device ({e})")


def device_name(ordinal):
    return "cpu" if ordinal == DEVICE_CPU else f"cuda:{ordinal}"


# ---- one tensor ---------------------------------------------------------------------------------

def _kind(t):
    if hasattr(t, "data_ptr") and hasattr(t, "is_contiguous") and hasattr(t, "device"):
        return "torch"
    if hasattr(t, "__array_interface__") and hasattr(t, "flags") and hasattr(t, "ctypes"):
        return "numpy"
    return None


def _where(t, kind):
    return "host memory (a numpy array)" if kind == "numpy" else f"device {t.device}"


def _on_device(t, kind, ordinal):
    if kind == "numpy":
        return ordinal == DEVICE_CPU
    if ordinal == DEVICE_CPU:
        return t.device.type == "cpu"
    return t.device.type == "cuda" and t.device.index == ordinal


def _memory(name, t, ordinal, out):
    """Kind, device and layout, common to typed tensors and byte buffers; returns the kind."""
    kind = _kind(t)
    if kind is None:
        fail("INVALID_VALUE", f"{name}: expected a numpy array or torch tensor, "
                              f"got {type(t).__name__}")
    if kind == "torch" and str(t.layout) != "torch.strided":
        fail("INVALID_VALUE", f"{name}: layout {t.layout}, expected torch.strided")
    if not _on_device(t, kind, ordinal):
        want = ("host memory (the layer runs on the CPU)" if ordinal == DEVICE_CPU
                else f"device cuda:{ordinal} (the layer's GPU)")
        fail("WRONG_DEVICE", f"{name}: in {_where(t, kind)}, expected {want}")
    contiguous = t.is_contiguous() if kind == "torch" else t.flags["C_CONTIGUOUS"]
    if not contiguous:
        strides = tuple(t.stride()) if kind == "torch" else t.strides
        fail("INVALID_VALUE", f"{name}: not contiguous (shape {list(t.shape)}, strides "
                              f"{list(strides)}), expected a C-contiguous (row-major, dense) array")
    if out and kind == "numpy" and not t.flags["WRITEABLE"]:
        fail("INVALID_VALUE", f"{name}: read-only array, expected a writeable output")
    return kind


def tensor(name, t, ordinal, dtype, dims, out=False, hint=""):
    """t: `dtype` ('bf16', 'fp32', 'int32'), on the layer's device, C-contiguous, of shape `dims`,
    a list of (symbol, size) such as [("T", 6), ("H", 128)]; a size None matches any. `hint` is
    appended to a shape error's message."""
    kind = _memory(name, t, ordinal, out)
    got = str(t.dtype) if kind == "torch" else t.dtype.name
    if got not in _DTYPES[dtype]:
        fail("INVALID_VALUE", f"{name}: dtype {got}, expected {_DTYPE_TEXT[dtype]}")
    shape = tuple(t.shape)
    if len(shape) != len(dims) or any(w is not None and s != w for s, (_, w) in zip(shape, dims)):
        fail("INVALID_SHAPE", f"{name}: shape {[int(s) for s in shape]}, expected "
                              f"{_text(dims)}{hint}")


def _text(dims):
    """[("T", None), ("H", 128)] -> '[T, H] = [T, 128]'."""
    symbols = ", ".join(sym for sym, _ in dims)
    return f"[{symbols}] = [{', '.join(sym if w is None else str(w) for sym, w in dims)}]"


def buffer(name, t, ordinal, nbytes, out=False):
    """A byte buffer (the saved context, the quantized weights): any dtype, at least nbytes;
    None only when nbytes is 0."""
    if t is None:
        if nbytes:
            fail("NULL_POINTER", f"{name}: missing, expected a buffer of {nbytes} bytes")
        return
    kind = _memory(name, t, ordinal, out)
    got = t.nbytes if kind == "numpy" else t.numel() * t.element_size()
    if got < nbytes:
        fail("INVALID_SHAPE", f"{name}: {got} bytes, expected at least {nbytes}")


def expert_ids(name, t, num_experts):
    """Every id in [-1, E) (-1: an empty slot); any integer dtype, host memory. Run before an
    int64 -> int32 narrowing, so that 2^32 + 1 is reported instead of wrapping to expert 1."""
    kind = _kind(t)
    if (t.size if kind == "numpy" else t.numel()) == 0:
        return
    bad = (t < -1) | (t >= num_experts)
    if not bool(bad.any()):
        return
    pos = (tuple(int(a[0]) for a in bad.nonzero()) if kind == "numpy"
           else tuple(int(i) for i in bad.nonzero()[0]))
    fail("INVALID_ROUTING", f"{name}{list(pos)} = {int(t[pos])}: expert ids must be in "
                            f"[0, E = {num_experts}), or -1 for an empty slot")


# ---- the arguments of one call ------------------------------------------------------------------

class Dims:
    """The layer's sizes, read from its descriptor and its communicator's W ranks (EL = E / W
    experts per rank; W = 1: EL = E), and the byte sizes of its saved context and quantized
    weights. Routed weights and their gradients are this rank's [EL, ...]; expert ids stay
    global, in [-1, E)."""

    def __init__(self, desc, ordinal, ctx_bytes, quantized_bytes, nranks=1):
        self.H, self.I, self.Is = desc.hidden, desc.intermediate, desc.shared_intermediate
        self.E, self.W, self.K = desc.num_experts, nranks, desc.top_k
        self.EL = desc.num_experts // nranks
        self.T_max = desc.max_tokens
        self.bf16_only = desc.precision == 0
        self.wgrad = "fp32" if desc.wgrad_dtype else "bf16"
        self.ordinal, self.ctx_bytes, self.quantized_bytes = ordinal, ctx_bytes, quantized_bytes
        H, I, EL, Is = ("H", self.H), ("I", self.I), ("EL", self.EL), ("Is", self.Is)
        self._weight_dims = {"wg": [EL, I, H], "wu": [EL, I, H], "wd": [EL, H, I],
                             "wsg": [Is, H], "wsu": [Is, H], "wsd": [H, Is]}

    def weight_dims(self, k):
        return self._weight_dims[k]

    def weight_hint(self, k, t):
        """Why a routed weight (or its gradient) of E experts is refused on a W > 1 layer."""
        if self.W > 1 and k.lstrip("d") in ("wg", "wu", "wd") and tuple(t.shape)[:1] == (self.E,):
            return (f" (EL = E / W = {self.E} / {self.W}: this rank's experts only, global "
                    f"experts [rank * EL, (rank + 1) * EL), not all E)")
        return ""


def _keys(name, d, allowed):
    if not isinstance(d, dict):
        fail("INVALID_VALUE", f"{name}: expected a dict with keys {list(allowed)}, "
                              f"got {type(d).__name__}")
    unknown = [k for k in d if k not in allowed]
    if unknown:
        fail("INVALID_VALUE", f"{name}: unknown keys {unknown}, expected some of {list(allowed)}")


def weights(m, w, required=True, name="w"):
    """w: dict of bf16 weights; wg, wu, wd always and wsg, wsu, wsd with a shared expert (Is > 0)
    are required when `required` (BF16 layers, mok_quantize_weights), checked when present."""
    if w is None:
        w = {}
    _keys(name, w, WEIGHTS)
    for k in WEIGHTS:
        shared = k.startswith("ws")
        if shared and m.Is == 0:
            if w.get(k) is not None:
                fail("INVALID_SHAPE", f"{name}['{k}']: given, but the layer has no shared "
                                      f"expert (Is = 0)")
            continue
        if w.get(k) is None:
            if required:
                fail("NULL_POINTER", f"{name}['{k}']: missing, expected bf16 "
                                     f"{_text(m.weight_dims(k))}")
            continue
        tensor(f"{name}['{k}']", w[k], m.ordinal, "bf16", m.weight_dims(k),
               hint=m.weight_hint(k, w[k]))


def routing(m, x, topk_idx, topk_w):
    """x [T, H] bf16 with T <= T_max, topk_idx [T, K] int32, topk_w [T, K] fp32; returns T."""
    tensor("x", x, m.ordinal, "bf16", [("T", None), ("H", m.H)])
    T = int(x.shape[0])
    if T > m.T_max:
        fail("INVALID_SHAPE", f"x: shape {[T, m.H]}, expected T <= T_max = {m.T_max} tokens")
    tensor("topk_idx", topk_idx, m.ordinal, "int32", [("T", T), ("K", m.K)])
    tensor("topk_w", topk_w, m.ordinal, "fp32", [("T", T), ("K", m.K)])
    if m.ordinal == DEVICE_CPU:
        expert_ids("topk_idx", topk_idx, m.E)
    return T


def forward(m, x, topk_idx, topk_w, w, quantized):
    """The inputs shared by forward and backward; returns T. fp8 layers read only `quantized`."""
    T = routing(m, x, topk_idx, topk_w)
    weights(m, w, required=m.bf16_only)
    if not m.bf16_only:
        if quantized is None:
            fail("NULL_POINTER", "quantized: missing; fp8 layers read the buffer that "
                                 "quantize_weights fills")
        buffer("quantized", quantized, m.ordinal, m.quantized_bytes)
    return T


def outputs(m, T, y, ctx):
    """y [T, H] bf16 and the context forward writes."""
    tensor("y", y, m.ordinal, "bf16", [("T", T), ("H", m.H)], out=True)
    buffer("ctx", ctx, m.ordinal, m.ctx_bytes, out=True)


def gradients(m, T, ctx, dy, grads):
    """dy [T, H] bf16 in; grads: dx [T, H] bf16, dtopk_w [T, K] fp32 and the weight gradients in
    the layer's wgrad dtype (fp32 unless wgrad_fp32=False), each shaped like its weight."""
    buffer("ctx", ctx, m.ordinal, m.ctx_bytes)
    tensor("dy", dy, m.ordinal, "bf16", [("T", T), ("H", m.H)])
    _keys("grads", grads, ("dx", "dtopk_w") + WEIGHT_GRADS)
    need = [("dx", "bf16", [("T", T), ("H", m.H)]), ("dtopk_w", "fp32", [("T", T), ("K", m.K)])]
    need += [("d" + k, m.wgrad, m.weight_dims(k)) for k in WEIGHTS
             if m.Is or not k.startswith("ws")]
    for k, dtype, dims in need:
        if grads.get(k) is None:
            fail("NULL_POINTER", f"grads['{k}']: missing, expected {dtype} {_text(dims)}")
        tensor(f"grads['{k}']", grads[k], m.ordinal, dtype, dims, out=True,
               hint=m.weight_hint(k, grads[k]))
    if not m.Is:
        given = [k for k in ("dwsg", "dwsu", "dwsd") if grads.get(k) is not None]
        if given:
            fail("INVALID_SHAPE", f"grads{given}: given, but the layer has no shared expert "
                                  f"(Is = 0)")
