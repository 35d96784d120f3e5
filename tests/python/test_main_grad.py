"""test_main_grad.py: MoE(main_grad=True) adds the fp32 weight gradients into each parameter's
main_grad across backward passes, and leaves param.grad None; dx and dtopk_w are those of a plain
module. On the CPU reference (its accumulation is dw0 + g to an ulp), and bitwise on a GPU when
one is present. Skipped without torch.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from mok.moe import MoE  # noqa: E402

H, I, E, K, T, Is = 128, 128, 4, 2, 16, 128


def batch(n, device):
    g = torch.Generator().manual_seed(7 + n)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, K, generator=g) * 0.6 + 0.2
    return x.to(device), idx.to(device), tw.to(device)


def run(device, exact):
    torch.manual_seed(0)
    acc = MoE(H, I, E, K, max_tokens=T, shared_intermediate=Is, device=device, main_grad=True)
    torch.manual_seed(0)
    plain = MoE(H, I, E, K, max_tokens=T, shared_intermediate=Is, device=device).float()
    names = ["wg", "wu", "wd", "wsg", "wsu", "wsd"]
    want = {n: torch.zeros_like(getattr(plain, n), dtype=torch.float32) for n in names}
    for n in range(2):
        x, idx, tw = batch(n, device)
        xa, twa = x.clone().requires_grad_(), tw.clone().requires_grad_()
        xp, twp = x.clone().requires_grad_(), tw.clone().requires_grad_()
        acc(xa, idx, twa).float().square().sum().backward()
        plain.zero_grad()
        plain(xp, idx, twp).float().square().sum().backward()
        assert torch.equal(xa.grad, xp.grad) and torch.equal(twa.grad, twp.grad)
        for name in names:
            want[name] += getattr(plain, name).grad
    acc.layer.check()
    for name in names:
        p = getattr(acc, name)
        assert p.grad is None, f"{name}.grad was written in main_grad mode"
        if exact:
            assert torch.equal(p.main_grad, want[name]), f"{name}.main_grad"
        else:
            torch.testing.assert_close(p.main_grad, want[name], rtol=1e-6, atol=1e-9,
                                       msg=f"{name}.main_grad is not the sum of two gradients")
    acc.zero_main_grad()
    assert all(getattr(acc, n).main_grad.abs().sum() == 0 for n in names)


def test_main_grad_accumulates_on_cpu():
    run("cpu", exact=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: bitwise on a GPU")
def test_main_grad_accumulates_on_gpu_bitwise():
    run("cuda", exact=True)


def test_main_grad_under_compile_raises_clearly():
    """main_grad mode is eager only: compiled, its backward raises MokError saying so (the buffers
    are not inputs of the compiled graph)."""
    torch.manual_seed(0)
    m = MoE(H, I, E, K, max_tokens=T, device="cpu", main_grad=True)
    x, idx, tw = batch(0, "cpu")
    x.requires_grad_()
    c = torch.compile(m, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="eagerly only"):
        c(x, idx, tw).float().sum().backward()
