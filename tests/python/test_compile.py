"""test_compile.py: mok.moe.MoE under torch.compile(fullgraph=True) through the mok:: custom ops.

A small model (a bf16 Linear, the MoE layer on the CPU reference backend, a Linear after it) is
compiled with backend="aot_eager": fullgraph=True raises on any graph break, torch._dynamo.explain
(where it exists) must count none, and the compiled forward and backward (y, x.grad, topk_w.grad,
every parameter's grad) must equal eager bit for bit. Also the fake (meta) implementations against
the real ops' shapes and dtypes, and torch.library.opcheck where this torch has it. Skipped
without torch.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from mok.moe import MoE  # noqa: E402

H, I, E, K, T = 128, 128, 4, 2, 8


class Model(torch.nn.Module):
    def __init__(self, shared=0, dtype=torch.bfloat16):
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(H, H, bias=False, dtype=torch.bfloat16)
        self.moe = MoE(H, I, E, K, max_tokens=T, shared_intermediate=shared, device="cpu").to(dtype)

    def forward(self, x, topk_idx, topk_w):
        return self.moe(self.pre(x), topk_idx, topk_w) * 2


def inputs(idx_dtype=torch.int32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(idx_dtype)
    idx[1, 1] = -1  # an empty slot
    tw = torch.rand(T, K, generator=g) * 0.6 + 0.2
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, idx, tw, dy


def run(model, x, idx, tw, dy):
    model.zero_grad()
    x, tw = x.detach().clone().requires_grad_(), tw.detach().clone().requires_grad_()
    y = model(x, idx, tw)
    (y.float() * dy.float()).sum().backward()
    return [y.detach(), x.grad, tw.grad] + [p.grad for _, p in model.named_parameters()]


def same(eager, compiled):
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert a is not None and b is not None, i
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), f"result {i} differs"


@pytest.mark.parametrize("shared, dtype, idx_dtype", [(0, torch.bfloat16, torch.int32),
                                                      (128, torch.float32, torch.int64)])
def test_compiled_equals_eager(shared, dtype, idx_dtype):
    torch._dynamo.reset()
    model = Model(shared, dtype)
    args = inputs(idx_dtype)
    eager = run(model, *args)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    same(eager, run(compiled, *args))
    same(eager, run(compiled, *args))  # the cached graph too


def test_no_graph_breaks():
    explain = getattr(torch._dynamo, "explain", None)
    if explain is None:
        pytest.skip("torch._dynamo.explain is missing in this torch")
    torch._dynamo.reset()
    model = Model()
    x, idx, tw, _ = inputs()
    result = explain(model)(x, idx, tw)
    assert result.graph_break_count == 0, result.break_reasons
    assert result.graph_count == 1


def test_fake_shapes_match_the_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode
    moe = MoE(H, I, E, K, max_tokens=T, shared_intermediate=128)
    x, idx, tw, dy = inputs()
    ws = [moe.wg, moe.wu, moe.wd, moe.wsg, moe.wsu, moe.wsd]
    real = torch.ops.mok.forward(moe.layer_id, x, idx, tw, *ws)
    grads = torch.ops.mok.backward(moe.layer_id, x, idx, tw, *ws, real[1], real[2], dy)
    with FakeTensorMode() as mode:
        fake_in = [mode.from_tensor(t) for t in (x, idx, tw, *ws, dy)]
        fake = torch.ops.mok.forward(moe.layer_id, *fake_in[:9])
        fake_grads = torch.ops.mok.backward(moe.layer_id, *fake_in[:9], fake[1], fake[2],
                                            fake_in[9])
    for r, f in zip(list(real) + list(grads), list(fake) + list(fake_grads)):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device)
    assert len(grads) == len(fake_grads) == 8


def test_opcheck():
    opcheck = getattr(torch.library, "opcheck", None)
    if opcheck is None:
        pytest.skip("torch.library.opcheck is missing in this torch")
    moe = MoE(H, I, E, K, max_tokens=T)
    x, idx, tw, _ = inputs()
    tw.requires_grad_()
    opcheck(torch.ops.mok.forward.default,
            (moe.layer_id, x, idx, tw, moe.wg, moe.wu, moe.wd, None, None, None),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_compiled_model_still_raises_the_layer_errors():
    import mok
    model = Model()
    x, idx, tw, _ = inputs(torch.int64)
    idx[0, 0] = 2 ** 32 + 1  # would wrap to expert 1 as int32
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(mok.MokError) as info:
        compiled(x, idx, tw)
    assert info.value.code == "INVALID_ROUTING" and "topk_idx[0, 0]" in str(info.value)
