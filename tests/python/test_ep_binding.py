"""test_ep_binding.py: expert parallelism through the binding: mok.Comm, Layer(comm=...) and
MoE(comm=..., process_group=...).

CPU: the communicator constructors' argument checks (virtual ranks on "cpu", a bad unique id,
the torch.distributed bootstrap over a one-rank gloo group), a layer keeping its comm alive and a
comm refusing to close under a layer, the EL = E / W shape checks (on _check.Dims of two ranks,
which needs no GPU: a real W > 1 communicator does), and MoE on an explicit local comm equal to
the default one bit for bit.

GPU (skipped without torch.cuda; tests/gpu/test_ep*.cu are the C side): W = 2 and 4 virtual ranks
on GPU 0 (mok.Comm.virtual), each rank's calls on its own torch.cuda.Stream, all enqueued from
this thread. EP-invariance is checked bitwise against a W = 1 layer (module) over the ranks'
tokens concatenated in rank order: y, dx (x.grad), dtopk_w (topk_w.grad) and each routed
expert's weight gradients; each rank's shared-expert gradients against a W = 1 layer over that
rank's tokens only. Token counts are uneven, one rank has none. Bad routing on one rank raises
MokError from check() on every rank. Shapes H = I = 256, E = 16, K = 4, Is = 128, T <= 300.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import mok  # noqa: E402
from mok import _check, _lib  # noqa: E402
from mok.moe import MoE  # noqa: E402
from checks_util import raises  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="no CUDA device: a W > 1 communicator needs a GPU "
                                "(mok.Comm.virtual); run on a GPU machine")


# ---- CPU: communicators -------------------------------------------------------------------------

def test_local_comm_on_the_cpu():
    c = mok.Comm.local("cpu")
    assert (c.rank, c.size, c.device) == (0, 1, "cpu")
    c.close()
    c.close()  # a second close does nothing
    assert "closed" in repr(c)


def test_virtual_ranks_on_the_cpu_raise():
    with raises("INVALID_VALUE", "Comm.virtual", "'cpu'", "GPU"):
        mok.Comm.virtual(2, "cpu")


@pytest.mark.parametrize("nranks", [0, -1, 2.0, True])
def test_virtual_bad_rank_count_raises(nranks):
    with raises("INVALID_VALUE", "Comm.virtual"):
        mok.Comm.virtual(nranks, 0)


def test_virtual_too_many_ranks_raises_from_the_library():
    with pytest.raises(mok.MokError) as e:
        mok.Comm.virtual(1000, 0)
    if e.value.code == "NO_DEVICE" and "no CUDA support" in str(e.value):
        pytest.skip("a build without CUDA (make NVCC=) has no virtual ranks")
    assert e.value.code == "INVALID_VALUE" and "ranks not in" in str(e.value), e.value


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: Comm.virtual(2, 0) works")
def test_virtual_without_a_gpu_raises_no_device():
    with raises("NO_DEVICE"):
        mok.Comm.virtual(2, 0)


def test_negative_ordinal_raises():
    with raises("INVALID_VALUE", "device -1"):
        mok.Comm.local(-1)


def test_unique_id_is_128_bytes_or_not_available():
    try:
        uid = mok.unique_id()
    except mok.MokError as e:  # a build or machine without NCCL
        assert e.code == "NOT_AVAILABLE", e
        return
    assert isinstance(uid, bytes) and len(uid) == 128


@pytest.mark.parametrize("uid", [b"\0" * 127, "x" * 128, None])
def test_from_unique_id_wants_128_bytes(uid):
    with raises("INVALID_VALUE", "Comm.from_unique_id", "128 bytes"):
        mok.Comm.from_unique_id(uid, 0, 2, 0)


def test_from_unique_id_rank_out_of_range_raises_from_the_library():
    with raises("INVALID_VALUE", "rank 2 of 2 ranks"):
        mok.Comm.from_unique_id(bytes(128), 2, 2, 0)


def test_from_unique_id_on_the_cpu_raises():
    with raises("INVALID_VALUE", "'cpu'"):
        mok.Comm.from_unique_id(bytes(128), 0, 2, "cpu")


def test_from_process_group_needs_torch_distributed():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with raises("INVALID_VALUE", "torch.distributed is not initialized"):
        mok.Comm.from_process_group()


def test_from_process_group_over_one_gloo_rank(tmp_path):
    """The bootstrap end to end on one rank: group rank 0 makes the id, broadcast_object_list
    sends it, the rank creates its communicator (without a GPU, the device check stops it)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        try:
            comm = mok.Comm.from_process_group(device=0)
        except mok.MokError as e:
            if torch.cuda.is_available() and e.code != "NOT_AVAILABLE":
                raise
            assert e.code in ("NO_DEVICE", "NOT_AVAILABLE"), e
            return
        assert (comm.rank, comm.size, comm.device) == (0, 1, "cuda:0")
        layer = mok.Layer(256, 256, 16, 4, max_tokens=8, comm=comm)  # W = 1 over NCCL
        assert layer.world_size == 1 and layer.num_local_experts == 16
        layer.close()
        comm.close()
    finally:
        dist.destroy_process_group()


# ---- CPU: a layer on a comm ---------------------------------------------------------------------

H, I, E, K, IS = 128, 128, 4, 2, 128


def test_layer_keeps_its_comm_and_the_comm_refuses_to_close_under_it():
    comm = mok.Comm.local("cpu")
    layer = mok.Layer(H, I, E, K, max_tokens=8, shared_intermediate=IS, comm=comm)
    assert (layer.rank, layer.world_size, layer.num_local_experts) == (0, 1, E)
    assert layer.comm is comm and layer.device == "cpu"
    with raises("INVALID_VALUE", "still alive"):
        comm.close()
    layer.close()
    comm.close()


def test_a_dropped_comm_lives_as_long_as_its_layer():
    layer = mok.Layer(H, I, E, K, max_tokens=8, comm=mok.Comm.local("cpu"))
    layer.context_bytes()  # the handle works: the comm was not destroyed under it
    comm = layer.comm
    layer.close()
    assert layer.comm is None and comm._handle  # the layer left it open
    comm.close()


def test_layer_comm_arguments_raise():
    comm = mok.Comm.local("cpu")
    with raises("WRONG_DEVICE", "cuda:0", "cpu"):
        mok.Layer(H, I, E, K, max_tokens=8, device="cuda:0", comm=comm)
    with raises("INVALID_VALUE", "comm:", "mok.Comm"):
        mok.Layer(H, I, E, K, max_tokens=8, comm="local")
    comm.close()
    with raises("INVALID_VALUE", "comm:", "closed"):
        mok.Layer(H, I, E, K, max_tokens=8, comm=comm)


def _dims(nranks):
    d = _lib.LayerDesc()
    d.hidden, d.intermediate, d.num_experts, d.top_k = H, I, E, K
    d.shared_intermediate, d.max_tokens, d.wgrad_dtype = IS, 8, 1
    return _check.Dims(d, _lib.DEVICE_CPU, 64, 0, nranks)


def _bf16(*shape):
    return np.zeros(shape, np.uint16)


def test_two_ranks_want_their_el_experts_weights():
    m, EL = _dims(2), E // 2
    w = {"wg": _bf16(EL, I, H), "wu": _bf16(EL, I, H), "wd": _bf16(EL, H, I),
         "wsg": _bf16(IS, H), "wsu": _bf16(IS, H), "wsd": _bf16(H, IS)}
    _check.weights(m, w)  # this rank's experts: fine
    for k, full in (("wg", _bf16(E, I, H)), ("wd", _bf16(E, H, I))):
        with raises("INVALID_SHAPE", f"w['{k}']", f"shape [{E},", "EL", f"= [{EL},",
                    f"EL = E / W = {E} / 2"):
            _check.weights(m, {**w, k: full})


def test_two_ranks_want_their_el_experts_gradients():
    m, EL, T = _dims(2), E // 2, 3
    g = {"dx": _bf16(T, H), "dtopk_w": np.zeros((T, K), np.float32)}
    shapes = {"dwg": (EL, I, H), "dwu": (EL, I, H), "dwd": (EL, H, I), "dwsg": (IS, H),
              "dwsu": (IS, H), "dwsd": (H, IS)}
    g.update({k: np.zeros(s, np.float32) for k, s in shapes.items()})
    ctx, dy = np.zeros(64, np.uint8), _bf16(T, H)
    _check.gradients(m, T, ctx, dy, g)
    with raises("INVALID_SHAPE", "grads['dwu']", f"= [{EL}, {I}, {H}]", "this rank's experts"):
        _check.gradients(m, T, ctx, dy, {**g, "dwu": np.zeros((E, I, H), np.float32)})
    # the shared expert is whole on every rank
    with raises("INVALID_SHAPE", "grads['dwsg']"):
        _check.gradients(m, T, ctx, dy, {**g, "dwsg": np.zeros((EL, H), np.float32)})


def test_expert_ids_stay_global():
    m = _dims(2)
    assert m.E == E and m.EL == E // 2
    with raises("INVALID_ROUTING", "topk_idx[0, 1] = 4", "E = 4"):
        _check.expert_ids("topk_idx", np.array([[3, 4]], np.int32), m.E)


# ---- CPU: the module on a comm ------------------------------------------------------------------

def _moe(**kw):
    torch.manual_seed(0)
    return MoE(H, I, E, K, max_tokens=8, shared_intermediate=IS, **kw)


def _run(moe, seed=1, T=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    tw = torch.rand(T, K, generator=g).requires_grad_()
    y = moe(x, idx, tw)
    (y.float() * torch.randn(T, H, generator=g)).sum().backward()
    return [y, x.grad, tw.grad] + [p.grad for p in moe.parameters()]


def test_moe_on_a_local_comm_is_the_default_module():
    comm = mok.Comm.local("cpu")
    a, b = _moe(), _moe(comm=comm)
    assert (b.rank, b.world_size, b.num_local_experts, b.comm) == (0, 1, E, comm)
    assert (a.rank, a.world_size, a.num_local_experts, a.comm) == (0, 1, E, None)
    assert b.layer.device == "cpu"
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for u, v in zip(_run(a), _run(b)):
        assert torch.equal(u, v)


def test_moe_from_experts_on_a_local_comm():
    src = _moe()
    comm = mok.Comm.local("cpu")
    b = MoE.from_experts(src.wd, gate=src.wg, up=src.wu, top_k=K, max_tokens=8,
                         shared_gate=src.wsg, shared_up=src.wsu, shared_down=src.wsd, comm=comm)
    assert b.comm is comm
    for p, q in zip(src.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_moe_takes_comm_or_process_group_not_both():
    with raises("INVALID_VALUE", "process_group or comm"):
        _moe(comm=mok.Comm.local("cpu"), process_group=object())


# ---- GPU: virtual ranks -------------------------------------------------------------------------

GH, GI, GE, GK, GIS = 256, 256, 16, 4, 128


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _problem(T, seed=5):
    """x, idx (distinct experts, 10% empty slots), tw, dy of T tokens and the E experts'
    weights, on GPU 0."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda:0"
    x = (torch.randn(T, GH, device=dev, generator=g) * 0.5).bfloat16()
    idx = torch.rand(T, GE, device=dev, generator=g).topk(GK, dim=1).indices.to(torch.int32)
    idx[torch.rand(T, GK, device=dev, generator=g) < 0.1] = -1
    tw = torch.rand(T, GK, device=dev, generator=g)
    dy = (torch.randn(T, GH, device=dev, generator=g) * 0.1).bfloat16()
    s = lambda *shape: (torch.randn(*shape, device=dev, generator=g)  # noqa: E731
                        * shape[-1] ** -0.5).bfloat16()
    w = {"wg": s(GE, GI, GH), "wu": s(GE, GI, GH), "wd": s(GE, GH, GI),
         "wsg": s(GIS, GH), "wsu": s(GIS, GH), "wsd": s(GH, GIS)}
    return x, idx, tw, dy, w


def _outputs(layer, x, tw, w):
    """y, ctx and the gradients of a forward + backward of `layer`, NaN-filled (a result left
    unwritten cannot pass), allocated before any rank enqueues work: a rank's kernels wait for
    the others', so nothing may wait on the device (or free memory) in between."""
    y = torch.full_like(x, float("nan"))
    ctx = torch.empty(layer.context_bytes(), dtype=torch.uint8, device=x.device)
    g = {"dx": torch.full_like(x, float("nan")), "dtopk_w": torch.full_like(tw, float("nan"))}
    g.update({"d" + k: torch.full(v.shape, float("nan"), device=x.device) for k, v in w.items()})
    return y, ctx, g


def _enqueue(layer, x, idx, tw, dy, w, out, stream):
    """forward + backward of a mok.Layer on `stream` (a torch.cuda.Stream), into out."""
    y, ctx, g = out
    layer.forward(x, idx, tw, w, y, ctx, stream=stream.cuda_stream)
    layer.backward(x, idx, tw, w, ctx, dy, g, stream=stream.cuda_stream)


def _w1_layer(x, idx, tw, dy, w):
    layer = mok.Layer(GH, GI, GE, GK, max_tokens=max(x.shape[0], 1), shared_intermediate=GIS,
                      device="cuda:0")
    out = _outputs(layer, x, tw, w)
    _enqueue(layer, x, idx, tw, dy, w, out, torch.cuda.current_stream())
    layer.check()
    return out[0], out[2]


def _split(Ts):
    starts = [sum(Ts[:r]) for r in range(len(Ts))]
    return [slice(a, a + t) for a, t in zip(starts, Ts)]


EP_CASES = [(2, [211, 89]), (2, [0, 300]), (4, [100, 0, 141, 59])]


@gpu
@pytest.mark.parametrize("W,Ts", EP_CASES, ids=[f"W{W}-{'+'.join(map(str, T))}" for W, T in EP_CASES])
def test_layer_ep_equals_one_rank(W, Ts):
    x, idx, tw, dy, w = _problem(sum(Ts))
    y1, g1 = _w1_layer(x, idx, tw, dy, w)
    comms = mok.Comm.virtual(W, 0)
    assert [(c.rank, c.size, c.device) for c in comms] == [(r, W, "cuda:0") for r in range(W)]
    EL = GE // W
    layers = [mok.Layer(GH, GI, GE, GK, max_tokens=max(Ts), shared_intermediate=GIS, comm=c)
              for c in comms]
    assert [l.num_local_experts for l in layers] == [EL] * W
    streams = [torch.cuda.Stream() for _ in range(W)]
    parts = [[t[sl].clone() for t in (x, idx, tw, dy)] for sl in _split(Ts)]
    ws = [{k: (v[r * EL:(r + 1) * EL] if k in ("wg", "wu", "wd") else v) for k, v in w.items()}
          for r in range(W)]  # rank r's experts; the shared expert whole
    out = [_outputs(layer, p[0], p[2], wr) for layer, p, wr in zip(layers, parts, ws)]
    torch.cuda.synchronize()  # inputs and outputs ready; from here on nothing waits until check()
    for layer, s, p, wr, o in zip(layers, streams, parts, ws, out):
        _enqueue(layer, *p, wr, o, s)
    for layer in layers:
        layer.check()
    for r, ((y, _, g), sl) in enumerate(zip(out, _split(Ts))):
        assert _same(y, y1[sl]), f"rank {r}: y"
        assert _same(g["dx"], g1["dx"][sl]), f"rank {r}: dx"
        assert _same(g["dtopk_w"], g1["dtopk_w"][sl]), f"rank {r}: dtopk_w"
        for k in ("dwg", "dwu", "dwd"):
            assert _same(g[k], g1[k][r * EL:(r + 1) * EL]), f"rank {r}: {k}"
        # the shared expert's gradients: over this rank's tokens only
        _, own = _w1_layer(*(t[sl].clone() for t in (x, idx, tw, dy)), w)
        for k in ("dwsg", "dwsu", "dwsd"):
            assert _same(g[k], own[k]), f"rank {r}: {k}"
    for layer in layers:
        layer.close()
    for c in comms:
        c.close()


def _moe_step(moe, x, idx, tw, dy):
    """Forward and backward through the module on the current stream; the tensors to compare."""
    x, tw = x.detach().clone().requires_grad_(), tw.detach().clone().requires_grad_()
    y = moe(x, idx, tw)
    y.backward(dy)
    return y, x, tw


@gpu
@pytest.mark.parametrize("W,Ts", EP_CASES, ids=[f"W{W}-{'+'.join(map(str, T))}" for W, T in EP_CASES])
def test_moe_ep_equals_one_rank(W, Ts):
    _moe_ep_case(W, Ts, "bf16")


@gpu
@pytest.mark.parametrize("precision", ["fp8-block", "mxfp8"])
def test_moe_fp8_ep_equals_one_rank(precision):
    """fp8 modules quantize their weights at every forward; rank r its experts' slice, whose
    bytes are those of the W = 1 module's (blocks never cross experts)."""
    _moe_ep_case(4, [100, 0, 141, 59], precision)


def _moe_ep_case(W, Ts, precision):
    x, idx, tw, dy, _ = _problem(sum(Ts), seed=9)
    idx = idx.long()  # the module casts torch.topk's int64 ids
    shape = dict(hidden=GH, intermediate=GI, num_experts=GE, top_k=GK, shared_intermediate=GIS,
                 precision=precision)
    torch.manual_seed(3)
    ref = MoE(**shape, max_tokens=sum(Ts), device="cuda:0")
    y1, x1, tw1 = _moe_step(ref, x, idx, tw, dy)
    torch.cuda.synchronize()
    ref.layer.check()

    comms = mok.Comm.virtual(W, 0)
    mods = []
    for c in comms:  # collective: every rank's module, in the same order; the same seed
        torch.manual_seed(3)
        mods.append(MoE(**shape, max_tokens=max(Ts), comm=c))
    EL = GE // W
    for r, m in enumerate(mods):
        assert (m.rank, m.world_size, m.num_local_experts) == (r, W, EL)
        assert m.wg.shape == (EL, GI, GH) and m.wd.shape == (EL, GH, GI)
        assert _same(m.wg, ref.wg[r * EL:(r + 1) * EL]) and _same(m.wsd, ref.wsd)
    streams = [torch.cuda.Stream() for _ in range(W)]
    parts = [[t[sl].clone() for t in (x, idx, tw, dy)] for sl in _split(Ts)]
    torch.cuda.synchronize()
    out = []
    for m, s, p in zip(mods, streams, parts):
        with torch.cuda.stream(s):  # each rank on its own stream, forward and backward
            out.append(_moe_step(m, *p))
    for m in mods:
        m.layer.check()
    torch.cuda.synchronize()
    for r, ((y, xr, twr), sl, m, p) in enumerate(zip(out, _split(Ts), mods, parts)):
        assert _same(y.detach(), y1.detach()[sl]), f"rank {r}: y"
        assert _same(xr.grad, x1.grad[sl]), f"rank {r}: x.grad"
        assert _same(twr.grad, tw1.grad[sl]), f"rank {r}: topk_w.grad"
        for k in ("wg", "wu", "wd"):
            assert _same(getattr(m, k).grad, getattr(ref, k).grad[r * EL:(r + 1) * EL]), \
                f"rank {r}: {k}.grad"
        # shared-expert gradients are this rank's tokens' (to be all-reduced by the caller)
        torch.manual_seed(3)
        own = MoE(**shape, max_tokens=max(Ts[r], 1), device="cuda:0")
        _moe_step(own, *p)
        torch.cuda.synchronize()
        for k in ("wsg", "wsu", "wsd"):
            assert _same(getattr(m, k).grad, getattr(own, k).grad), f"rank {r}: {k}.grad"


@gpu
def test_bad_routing_on_one_rank_raises_on_every_rank():
    Ts = [120, 80]
    x, idx, tw, dy, w = _problem(sum(Ts))
    idx[5, 2] = 99  # rank 0, token 5, slot 2: outside [-1, 16)
    comms = mok.Comm.virtual(2, 0)
    layers = [mok.Layer(GH, GI, GE, GK, max_tokens=128, shared_intermediate=GIS, comm=c)
              for c in comms]
    streams = [torch.cuda.Stream() for _ in comms]
    EL = GE // 2

    def forward_all(idx):
        parts = [[t[sl].clone() for t in (x, idx, tw)] for sl in _split(Ts)]
        ws = [{k: (v[r * EL:(r + 1) * EL] if k in ("wg", "wu", "wd") else v)
               for k, v in w.items()} for r in range(2)]
        out = [_outputs(layer, p[0], p[2], wr) for layer, p, wr in zip(layers, parts, ws)]
        torch.cuda.synchronize()
        for layer, s, (xr, ir, tr), wr, (y, ctx, _) in zip(layers, streams, parts, ws, out):
            layer.forward(xr, ir, tr, wr, y, ctx, stream=s.cuda_stream)
        return parts, out  # alive until the caller's check()

    alive = forward_all(idx)
    errors = []
    for layer in layers:
        with pytest.raises(mok.MokError) as e:
            layer.check()
        errors.append(e.value)
    assert all(e.code == "INVALID_ROUTING" for e in errors), errors
    assert "token 5 slot 2" in str(errors[0]), errors[0]
    assert "rank 0's routing" in str(errors[1]), errors[1]
    idx[5, 2] = -1
    alive = forward_all(idx)  # the layers work again
    for layer in layers:
        layer.check()
    del alive


@gpu
def test_layer_experts_not_a_multiple_of_the_ranks_raises():
    comms = mok.Comm.virtual(3, 0)
    with raises("INVALID_SHAPE", "num_experts", "3 ranks"):
        mok.Layer(GH, GI, GE, GK, max_tokens=8, comm=comms[0])


@gpu
def test_all_experts_weights_on_two_ranks_raise_naming_the_tensor():
    comms = mok.Comm.virtual(2, 0)
    layers = [mok.Layer(GH, GI, GE, GK, max_tokens=64, shared_intermediate=GIS, comm=c)
              for c in comms]
    x, idx, tw, dy, w = _problem(8)
    y = torch.empty_like(x)
    ctx = torch.empty(layers[0].context_bytes(), dtype=torch.uint8, device=x.device)
    with raises("INVALID_SHAPE", "w['wg']", f"[{GE}, {GI}, {GH}]", f"[EL, I, H] = [{GE // 2},",
                f"EL = E / W = {GE} / 2"):
        layers[0].forward(x, idx, tw, w, y, ctx)
    wr = {k: (v[:GE // 2] if k in ("wg", "wu", "wd") else v) for k, v in w.items()}
    g = {"dx": torch.empty_like(x), "dtopk_w": torch.empty_like(tw)}
    g.update({"d" + k: torch.empty(v.shape, device=x.device) for k, v in wr.items()})
    g["dwd"] = torch.empty(w["wd"].shape, device=x.device)
    with raises("INVALID_SHAPE", "grads['dwd']", f"[EL, H, I] = [{GE // 2},"):
        layers[0].backward(x, idx, tw, wr, ctx, dy, g)
    with raises("INVALID_VALUE", "still alive"):
        comms[0].close()
    for layer in layers:
        layer.close()
    for c in comms:
        c.close()


@gpu
def test_moe_on_virtual_ranks_takes_the_comms_device():
    comms = mok.Comm.virtual(2, 0)
    mods = [MoE(GH, GI, GE, GK, max_tokens=8, comm=c) for c in comms]
    assert all(m.wg.device == torch.device("cuda", 0) for m in mods)
    assert [m.layer.device for m in mods] == ["cuda:0", "cuda:0"]
