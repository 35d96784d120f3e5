"""moe.py: the PyTorch face of MoK: the custom ops mok::forward, mok::backward over mok.Layer
(with fake implementations and autograd, so torch.compile(fullgraph=True) traces them) and an
nn.Module.

    from mok.moe import MoE
    moe = MoE(hidden=2048, intermediate=768, num_experts=128, top_k=8, max_tokens=16384,
              device="cuda")
    y = moe(x, topk_idx, topk_w)          # x [T, H] bf16, topk_idx [T, K] int, topk_w [T, K] float
    y.float().sum().backward()            # grads of x, topk_w and every weight

What forward takes, and what it casts. Everything is then checked by mok.Layer (python/mok/
_check.py) against the layer, and a bad argument raises mok.MokError naming it, before any C call.
    x         [T, H] torch.bfloat16, T <= max_tokens. Not cast: y and dx are bf16 whatever x is,
              so a float32 or float16 x would leave the layer as bf16 and its rounding would be
              hidden here; x of another dtype raises (pass x.to(torch.bfloat16)).
    topk_idx  [T, K] int32 or int64 (torch.topk's; also int16, int8, uint8), -1 = an empty slot:
              copied to int32. A CPU tensor is first checked to hold only ids in [-1, E), so
              2^32 + 1 raises instead of wrapping to expert 1. On a GPU a check would synchronize:
              int64 ids are clamped to int32's range, and the kernels report any id outside
              [-1, E) as bad routing through moe.layer.check(); no id wraps onto a valid expert.
    topk_w    [T, K] any floating dtype: rounded to fp32 (exact from bf16 and float16); its
              gradient comes back in topk_w's dtype.
    non-contiguous x, topk_idx, topk_w (and the dy of backward): a contiguous copy.
Parameters are bf16 in PyTorch Linear layout: wg, wu [EL, I, H], wd [EL, H, I] (EL = E / W; E
for W = 1: see MoE, "Expert parallelism"), and with a shared expert wsg, wsu [Is, H], wsd
[H, Is]. After moe.float(), .half() or .double() they are rounded to bf16 for each call (a copy
per forward; the layer computes in bf16), never reinterpreted, and their gradients (fp32 from the
library) come back in the parameters' dtype, so fp32 master weights get the fp32 gradient itself.
Parameters must stay on the layer's device: moe.to(another device) makes forward raise
WRONG_DEVICE. fp8 layers quantize the weights at every forward.
The ops take the layer as an int (MoE.layer_id) and the parameters as they are; backward rounds
non-bf16 parameters to bf16 again (a second copy) rather than keep the forward's copies.
"""
import itertools
import math
import weakref
from typing import List, Optional, Tuple

import torch

from . import Comm, Layer, MokError, _check

_NAMES = ("wg", "wu", "wd", "wsg", "wsu", "wsd")
_ID_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _expert_ids(layer, topk_idx):
    """topk_idx as int32, never wrapped (see the module docstring)."""
    if topk_idx.dtype not in _ID_DTYPES:
        raise MokError("INVALID_VALUE", f"topk_idx: dtype {topk_idx.dtype}, expected an integer "
                                        f"dtype (int32 or int64; int16, int8, uint8)")
    if topk_idx.dtype == torch.int32:
        return topk_idx.contiguous()
    if topk_idx.device.type == "cpu":
        _check.expert_ids("topk_idx", topk_idx, layer.desc.num_experts)
    elif topk_idx.dtype == torch.int64:
        topk_idx = topk_idx.clamp(_check.INT32_MIN, _check.INT32_MAX)
    return topk_idx.to(torch.int32).contiguous()


def _bf16(name, p):
    """A parameter as the layer reads it: bf16 and contiguous (a rounded copy when it is not)."""
    if not p.is_floating_point():
        raise MokError("INVALID_VALUE", f"w['{name}']: dtype {p.dtype}, expected a floating dtype "
                                        f"(bf16; others are rounded to bf16)")
    return p.detach().to(torch.bfloat16).contiguous()


# ---- the layer as torch.library custom ops -----------------------------------------------------
# torch.compile cannot trace a ctypes handle, so the ops name their layer by an int: a key into
# _LAYERS, which each MoE fills at construction (weakly: the module owns its layer). Dynamo sees
# the id as a constant of the module, the ops as opaque calls, and the fake (meta) implementations
# below give it the output shapes and dtypes; autograd reaches mok::backward through
# register_autograd. The real implementations call mok.Layer, so every check of _check.py runs.

_LAYERS = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count()


def _register(layer):
    layer_id = next(_NEXT_ID)
    _LAYERS[layer_id] = layer
    return layer_id


def _layer(layer_id):
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise MokError("INVALID_VALUE", f"layer id {layer_id}: no live mok.Layer has it (its MoE "
                                        f"module was freed)")
    return layer


def _weights(wg, wu, wd, wsg, wsu, wsd):
    return {k: _bf16(k, v) for k, v in zip(_NAMES, (wg, wu, wd, wsg, wsu, wsd)) if v is not None}


def _forward(layer_id: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, wsg: Optional[torch.Tensor],
                wsu: Optional[torch.Tensor], wsd: Optional[torch.Tensor]
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y [T, H], the saved context (context_bytes() bytes) and the quantized weights (empty for a
    bf16 layer). topk_idx: any integer dtype (_expert_ids); topk_w fp32; weights any float dtype."""
    layer = _layer(layer_id)
    w = _weights(wg, wu, wd, wsg, wsu, wsd)
    x, topk_w = x.contiguous(), topk_w.contiguous()
    topk_idx = _expert_ids(layer, topk_idx)
    y = torch.empty_like(x)
    saved = torch.empty(layer.context_bytes(), dtype=torch.uint8, device=x.device)
    quantized = torch.empty(0, dtype=torch.uint8, device=x.device)
    if layer.desc.precision != 0:
        quantized = torch.empty(layer.quantized_weights_bytes(), dtype=torch.uint8, device=x.device)
        layer.quantize_weights(w, quantized)
    layer.forward(x, topk_idx, topk_w, w, y, saved, quantized if quantized.numel() else None,
                  _stream(x))
    return y, saved, quantized


_forward_op = torch.library.custom_op("mok::forward", _forward, mutates_args=())


def _on_meta(*tensors):
    """Plain meta tensors (a module moved .to("meta")), not the fake tensors of a trace, whose
    device is the one they stand for: the Meta dispatch key runs the fake implementation for
    them, which hands them to the real one so that mok.Layer raises WRONG_DEVICE naming them."""
    return any(t is not None and t.device.type == "meta" for t in tensors)


@_forward_op.register_fake
def _(layer_id, x, topk_idx, topk_w, wg, wu, wd, wsg, wsu, wsd):
    if _on_meta(x, topk_idx, topk_w, wg, wu, wd, wsg, wsu, wsd):
        return _forward(layer_id, x, topk_idx, topk_w, wg, wu, wd, wsg, wsu, wsd)
    layer = _layer(layer_id)
    q = layer.quantized_weights_bytes() if layer.desc.precision != 0 else 0
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(layer.context_bytes(), dtype=torch.uint8),
            x.new_empty(q, dtype=torch.uint8))


@torch.library.custom_op("mok::backward", mutates_args=())
def _backward_op(layer_id: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                 wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, wsg: Optional[torch.Tensor],
                 wsu: Optional[torch.Tensor], wsd: Optional[torch.Tensor], saved: torch.Tensor,
                 quantized: torch.Tensor, dy: torch.Tensor) -> List[torch.Tensor]:
    """[dx, dtopk_w, then the gradient of each weight given], each weight's in its dtype."""
    layer = _layer(layer_id)
    given = [v for v in (wg, wu, wd, wsg, wsu, wsd) if v is not None]
    w = _weights(wg, wu, wd, wsg, wsu, wsd)
    x, topk_w = x.contiguous(), topk_w.contiguous()
    topk_idx = _expert_ids(layer, topk_idx)
    dy = dy.to(torch.bfloat16).contiguous()  # y is bf16, so dy is; a sum's dy is expanded
    grads = {"dx": torch.empty_like(x), "dtopk_w": torch.empty_like(topk_w)}
    wgrad = torch.float32 if layer.desc.wgrad_dtype else torch.bfloat16
    for k, v in w.items():
        grads["d" + k] = torch.empty(v.shape, dtype=wgrad, device=v.device)
    layer.backward(x, topk_idx, topk_w, w, saved, dy, grads,
                   quantized if quantized.numel() else None, _stream(x))
    return [grads["dx"], grads["dtopk_w"]] + [grads["d" + k].to(v.dtype)
                                              for k, v in zip(w, given)]


@_backward_op.register_fake
def _(layer_id, x, topk_idx, topk_w, wg, wu, wd, wsg, wsu, wsd, saved, quantized, dy):
    given = [v for v in (wg, wu, wd, wsg, wsu, wsd) if v is not None]
    fresh = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return [fresh(x), fresh(topk_w)] + [fresh(v) for v in given]


@torch.library.custom_op("mok::backward_main_grad",
                         mutates_args=("mg_wg", "mg_wu", "mg_wd", "mg_wsg", "mg_wsu", "mg_wsd"))
def _backward_main_grad_op(layer_id: int, x: torch.Tensor, topk_idx: torch.Tensor,
                           topk_w: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor,
                           wd: torch.Tensor, wsg: Optional[torch.Tensor],
                           wsu: Optional[torch.Tensor], wsd: Optional[torch.Tensor],
                           saved: torch.Tensor, quantized: torch.Tensor, dy: torch.Tensor,
                           mg_wg: torch.Tensor, mg_wu: torch.Tensor, mg_wd: torch.Tensor,
                           mg_wsg: Optional[torch.Tensor], mg_wsu: Optional[torch.Tensor],
                           mg_wsd: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dx, dtopk_w); the weight gradients are added, in fp32, into mg_* (each weight's
    main_grad): the layer accumulates (wgrad_accumulate)."""
    layer = _layer(layer_id)
    w = _weights(wg, wu, wd, wsg, wsu, wsd)
    x, topk_w = x.contiguous(), topk_w.contiguous()
    topk_idx = _expert_ids(layer, topk_idx)
    dy = dy.to(torch.bfloat16).contiguous()
    grads = {"dx": torch.empty_like(x), "dtopk_w": torch.empty_like(topk_w)}
    for k, g in zip(_NAMES, (mg_wg, mg_wu, mg_wd, mg_wsg, mg_wsu, mg_wsd)):
        if k in w:
            grads["d" + k] = g
    layer.backward(x, topk_idx, topk_w, w, saved, dy, grads,
                   quantized if quantized.numel() else None, _stream(x))
    return grads["dx"], grads["dtopk_w"]


@_backward_main_grad_op.register_fake
def _(layer_id, x, topk_idx, topk_w, wg, wu, wd, wsg, wsu, wsd, saved, quantized, dy, mg_wg,
      mg_wu, mg_wd, mg_wsg, mg_wsu, mg_wsd):
    fresh = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return fresh(x), fresh(topk_w)


def _setup_context(ctx, inputs, output):
    layer_id, x, topk_idx, topk_w, *weights = inputs
    _, saved, quantized = output
    # the layer outlives a temporary module until backward (eager: MoE(...)(x, ...).sum().backward())
    ctx.layer_id, ctx.layer = layer_id, _LAYERS.get(layer_id)
    ctx.present = [v is not None for v in weights]
    ctx.mark_non_differentiable(saved, quantized)
    ctx.save_for_backward(x, topk_idx, topk_w, *[v for v in weights if v is not None], saved,
                          quantized)


def _traced(t):
    """Whether this backward is being traced rather than run: under dynamo, or by AOT autograd
    (torch.compile's backends), whose fake tensors is_compiling() does not report in every
    torch version."""
    if torch.compiler.is_compiling():
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # a torch without it traces nothing this check could see
        return False
    return is_fake(t)


def _backward(ctx, dy, _dsaved, _dquantized):
    x, topk_idx, topk_w, *rest = ctx.saved_tensors
    given, (saved, quantized) = iter(rest[:-2]), rest[-2:]
    weights = [next(given) if p else None for p in ctx.present]
    main = getattr(ctx.layer, "main_grads", None)
    if main is not None:  # MoE(main_grad=True): the weight gradients go into param.main_grad
        if _traced(dy):
            raise MokError("INVALID_VALUE", "MoE(main_grad=True) runs eagerly only: its backward "
                                            "adds into param.main_grad, which a compiled graph "
                                            "cannot see; compile a module without main_grad")
        grads = torch.ops.mok.backward_main_grad(ctx.layer_id, x, topk_idx, topk_w, *weights,
                                                 saved, quantized, dy, *main())
        return (None, grads[0], None, grads[1], *[None for _ in ctx.present])
    grads = torch.ops.mok.backward(ctx.layer_id, x, topk_idx, topk_w, *weights, saved, quantized,
                                   dy)
    dws = iter(grads[2:])
    return (None, grads[0], None, grads[1], *[next(dws) if p else None for p in ctx.present])


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class MoE(torch.nn.Module):
    """A MoE layer with routed experts (and optionally a shared expert), on one device (W = 1)
    or as rank `rank` of `world_size` expert-parallel ranks.

    device: "cpu" (the plain-C reference backend; the default without comm or process_group),
    "cuda" (torch.cuda.current_device() at construction), "cuda:N", or a torch.device naming one
    of these; anything else raises MokError. forward(x [T, H] bf16, topk_idx [T, K] int, topk_w
    [T, K] float) -> y [T, H] bf16; the module docstring lists what is cast and what raises.

    Expert parallelism (EP): with comm (a mok.Comm, e.g. one of mok.Comm.virtual(W, 0)) or
    process_group (a torch.distributed group; the module then makes its own communicator with
    mok.Comm.from_process_group on `device`, default the current CUDA device: one NCCL
    communicator per module, so pass one comm to every layer of a model instead), the module
    holds only its rank's EL = E / W experts: wg, wu [EL, I, H], wd [EL, H, I], global experts
    [rank EL, (rank + 1) EL); the shared expert in full. forward takes this rank's tokens
    (any T <= max_tokens, 0 included) with GLOBAL expert ids in [-1, E). Outputs are bitwise
    those of one W = 1 module over the ranks' tokens concatenated in rank order: y, x.grad,
    topk_w.grad and each routed expert's weight gradients. Rules:
    - every rank constructs its modules in the same order (collective), and calls forward and
      backward of every module at every step, in the same order, even with no tokens (keep y in
      the loss, so that autograd reaches the backward);
    - virtual ranks are driven by one thread, each rank's calls on its own stream:
      `with torch.cuda.stream(s[r]): y[r] = moe[r](x[r], ...)`, and the backward of y[r] under
      the same stream (autograd runs it on the forward's stream); a rank's kernels wait for the
      other ranks', so nothing may synchronize the device in between (moe.layer.check() after
      every rank's call);
    - the shared expert's gradients on each rank are over that rank's tokens: all-reduce (sum)
      them over the ranks like data-parallel gradients. The routed ones are complete.
    main_grad=True (Megatron's main_grad convention): every parameter gets `main_grad`, an fp32
    buffer of its shape (zeros), and each backward ADDS the fp32 weight gradients into it (the
    layer's accumulate mode, one epilogue, no extra pass) instead of producing param.grad, which
    stays None; zero them with moe.zero_main_grad() (or your optimizer's) between steps. The
    backward then goes through the op mok::backward_main_grad, which mutates the buffers. Eager
    only: under torch.compile that backward raises MokError (the buffers are not graph inputs).
    precision "fp8-block" quantizes the weights at every forward (fp8_scale "fp32": amax / 448, or
    "pow2": powers of two) and runs the fp8 layer; "mxfp8" likewise (1x32 E8M0 blocks).
    Initialization: the parameters are drawn as a W = 1 module draws them (the full [E, ...]
    tensors, in the same order, from torch's default generator) and each rank keeps its slice,
    so rank r's experts are experts [r EL, (r + 1) EL) of the W = 1 module made after the same
    torch.manual_seed, and the shared expert is the same on every rank. Seed every rank alike
    (with virtual ranks, seed before each rank's module); or build from given weights with
    MoE.from_experts(..., comm=...), which slices global ones. The full tensors exist during
    construction (fp32, on the device), as they do for W = 1.
    """

    def __init__(self, hidden, intermediate, num_experts, top_k, max_tokens, shared_intermediate=0,
                 precision="bf16", device=None, recompute=False, *, process_group=None, comm=None,
                 main_grad=False, fp8_scale="fp32"):
        super().__init__()
        if process_group is not None and comm is not None:
            raise MokError("INVALID_VALUE", "MoE: pass process_group or comm, not both")
        if process_group is not None:
            comm = Comm.from_process_group(process_group, device)
        self.layer = Layer(hidden, intermediate, num_experts, top_k, max_tokens,
                           shared_intermediate, precision, device, recompute=recompute, comm=comm,
                           wgrad_fp32=True, wgrad_accumulate=main_grad, fp8_scale=fp8_scale)
        self.layer_id = _register(self.layer)  # how the ops (and torch.compile) name the layer
        device = torch.device(self.layer.device)  # "cuda" resolved to its ordinal
        H, I, E, Is = hidden, intermediate, num_experts, shared_intermediate
        EL, r = self.layer.num_local_experts, self.layer.rank

        def param(*shape, fan_in, routed=False):
            t = torch.randn(*shape, device=device) / math.sqrt(fan_in)
            if routed:  # this rank's experts of the W = 1 module's draw
                t = t[r * EL:(r + 1) * EL]
            return torch.nn.Parameter(t.to(torch.bfloat16))

        self.wg = param(E, I, H, fan_in=H, routed=True)
        self.wu = param(E, I, H, fan_in=H, routed=True)
        self.wd = param(E, H, I, fan_in=I, routed=True)
        if Is:
            self.wsg, self.wsu, self.wsd = param(Is, H, fan_in=H), param(Is, H, fan_in=H), param(H, Is, fan_in=Is)
        else:
            self.wsg = self.wsu = self.wsd = None
        if main_grad:
            self._make_main_grads()

    def _make_main_grads(self):
        """Each parameter gets main_grad, fp32 zeros of its shape on the layer's device, and the
        layer finds them at backward through a weak reference to this module."""
        for name in _NAMES:
            p = getattr(self, name)
            if p is not None:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=self.layer.device)
        ref = weakref.ref(self)
        self.layer.main_grads = lambda: [None if getattr(ref(), n) is None
                                         else getattr(ref(), n).main_grad for n in _NAMES]

    def zero_main_grad(self):
        """main_grad of every parameter to zero (MoE(main_grad=True))."""
        for name in _NAMES:
            p = getattr(self, name)
            if p is not None and hasattr(p, "main_grad"):
                p.main_grad.zero_()

    @property
    def rank(self):
        return self.layer.rank

    @property
    def world_size(self):
        return self.layer.world_size

    @property
    def num_local_experts(self):
        return self.layer.num_local_experts

    @property
    def comm(self):
        """The mok.Comm the layer runs on (None for W = 1 without one)."""
        return self.layer.comm

    @classmethod
    def from_experts(cls, down, gate_up=None, *, gate=None, up=None, top_k, max_tokens,
                     shared_gate=None, shared_up=None, shared_down=None, precision="bf16",
                     device=None, recompute=False, process_group=None, comm=None,
                     main_grad=False):
        """A MoE whose parameters are copies of stacked expert weights (PyTorch Linear layout):
        down [E, H, I] and either gate_up [E, 2I, H] (gate rows first, then up: gate =
        gate_up[:, :I]) or gate and up [E, I, H]; optionally a shared expert shared_gate,
        shared_up [Is, H], shared_down [H, Is]. The parameters keep the tensors' floating dtype
        (the layer rounds to bf16 per call). device: the layer's; None takes down's device (or
        comm's). A missing, extra or misshapen weight raises MokError naming it.
        With comm or process_group (see MoE), the weights are the GLOBAL E experts on every rank
        and the module keeps experts [rank EL, (rank + 1) EL) and the whole shared expert."""
        def shape(name, t, want):
            if not isinstance(t, torch.Tensor):
                raise MokError("INVALID_VALUE", f"{name}: expected a torch tensor, got "
                                                f"{type(t).__name__}")
            if not t.is_floating_point():
                raise MokError("INVALID_VALUE", f"{name}: dtype {t.dtype}, expected a floating dtype")
            if t.dim() != len(want) or any(w is not None and s != w for s, w in zip(t.shape, want)):
                text = ", ".join("?" if w is None else str(w) for w in want)
                raise MokError("INVALID_SHAPE", f"{name}: shape {list(t.shape)}, expected [{text}]")

        shape("down", down, (None, None, None))
        E, H, I = down.shape
        if (gate_up is None) == (gate is None and up is None) or (gate is None) != (up is None):
            raise MokError("INVALID_VALUE", "gate_up: pass either gate_up [E, 2I, H] or both gate "
                                            "and up [E, I, H]")
        if gate_up is not None:
            shape("gate_up", gate_up, (E, 2 * I, H))
            gate, up = gate_up[:, :I], gate_up[:, I:]
        shape("gate", gate, (E, I, H))
        shape("up", up, (E, I, H))
        shared = (shared_gate, shared_up, shared_down)
        Is = 0
        if any(t is not None for t in shared):
            if any(t is None for t in shared):
                raise MokError("INVALID_VALUE", "shared_gate, shared_up, shared_down: pass all "
                                                "three or none")
            shape("shared_down", shared_down, (H, None))
            Is = shared_down.shape[1]
            shape("shared_gate", shared_gate, (Is, H))
            shape("shared_up", shared_up, (Is, H))
        if device is None and comm is None and process_group is None:
            device = down.device
        moe = cls(H, I, E, top_k, max_tokens, Is, precision, device, recompute,
                  process_group=process_group, comm=comm, main_grad=main_grad)
        target = torch.device(moe.layer.device)
        EL, r = moe.num_local_experts, moe.rank
        for name, t in zip(_NAMES, (gate, up, down) + (shared if Is else (None,) * 3)):
            if t is not None:
                if name in ("wg", "wu", "wd"):
                    t = t[r * EL:(r + 1) * EL]
                p = torch.nn.Parameter(t.detach().to(target).clone(memory_format=torch.contiguous_format))
                setattr(moe, name, p)
        if main_grad:
            moe._make_main_grads()
        return moe

    def forward(self, x, topk_idx, topk_w):
        if not topk_w.is_floating_point():
            raise MokError("INVALID_VALUE", f"topk_w: dtype {topk_w.dtype}, expected a floating "
                                            f"dtype (fp32; others are rounded to fp32)")
        y, _, _ = torch.ops.mok.forward(self.layer_id, x, topk_idx, topk_w.to(torch.float32),
                                        self.wg, self.wu, self.wd, self.wsg, self.wsu, self.wsd)
        return y
