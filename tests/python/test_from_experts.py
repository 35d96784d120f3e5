"""test_from_experts.py: MoE.from_experts from stacked weights, fused gate_up or split, on a CPU
layer: the same parameters, hence bit-identical outputs and gradients, as a MoE whose parameters
are set by hand; shape errors name the weight. Skipped without torch."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import mok  # noqa: E402
from mok.moe import MoE  # noqa: E402

H, I, E, K, IS, T = 128, 128, 4, 2, 128, 8


def weights(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(dtype)  # noqa: E731
    return r(E, I, H), r(E, I, H), r(E, H, I), r(IS, H), r(IS, H), r(H, IS)


def run(moe):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    tw = (torch.rand(T, K, generator=g) + 0.1).requires_grad_()
    y = moe(x, idx, tw)
    y.float().square().sum().backward()
    return [y.detach(), x.grad, tw.grad] + [p.grad for _, p in moe.named_parameters()]


def by_hand(wg, wu, wd, wsg=None, wsu=None, wsd=None):
    moe = MoE(H, I, E, K, max_tokens=T, shared_intermediate=IS if wsg is not None else 0)
    for name, t in zip(("wg", "wu", "wd", "wsg", "wsu", "wsd"), (wg, wu, wd, wsg, wsu, wsd)):
        if t is not None:
            setattr(moe, name, torch.nn.Parameter(t.clone()))
    return moe


def same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and torch.equal(u, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_and_split_match_hand_set_parameters(dtype):
    wg, wu, wd, wsg, wsu, wsd = weights(dtype)
    want = run(by_hand(wg, wu, wd))
    fused = MoE.from_experts(wd, torch.cat([wg, wu], dim=1), top_k=K, max_tokens=T)
    split = MoE.from_experts(wd, gate=wg, up=wu, top_k=K, max_tokens=T)
    for moe in (fused, split):
        assert moe.wg.dtype == dtype and moe.wsg is None
        assert moe.wg.is_contiguous() and moe.wu.is_contiguous()
        same(want, run(moe))
    assert fused.layer.device == "cpu"


def test_shared_expert_and_copies():
    wg, wu, wd, wsg, wsu, wsd = weights()
    moe = MoE.from_experts(wd, gate=wg, up=wu, top_k=K, max_tokens=T, shared_gate=wsg,
                           shared_up=wsu, shared_down=wsd, device="cpu")
    assert moe.layer.desc.shared_intermediate == IS
    same(run(by_hand(wg, wu, wd, wsg, wsu, wsd)), run(moe))
    moe.wg.data.zero_()
    assert wg.abs().sum() > 0  # a copy, not the caller's tensor


@pytest.mark.parametrize("kw, code, word", [
    (dict(gate_up=torch.zeros(E, I, H)), "INVALID_SHAPE", "gate_up"),
    (dict(gate=torch.zeros(E, I, H + 1), up=torch.zeros(E, I, H)), "INVALID_SHAPE", "gate"),
    (dict(gate=torch.zeros(E, I, H)), "INVALID_VALUE", "gate_up"),
    (dict(), "INVALID_VALUE", "gate_up"),
    (dict(gate_up=torch.zeros(E, 2 * I, H), gate=torch.zeros(E, I, H), up=torch.zeros(E, I, H)),
     "INVALID_VALUE", "gate_up"),
    (dict(gate_up=torch.zeros(E, 2 * I, H), shared_gate=torch.zeros(IS, H)), "INVALID_VALUE",
     "shared_up"),
    (dict(gate_up=torch.zeros(E, 2 * I, H), shared_gate=torch.zeros(IS, H),
          shared_up=torch.zeros(IS, H), shared_down=torch.zeros(H + 1, IS)), "INVALID_SHAPE",
     "shared_down"),
    (dict(gate_up=torch.zeros(E, 2 * I, H, dtype=torch.int32)), "INVALID_VALUE", "gate_up"),
])
def test_bad_weights_raise(kw, code, word):
    with pytest.raises(mok.MokError) as info:
        MoE.from_experts(torch.zeros(E, H, I), top_k=K, max_tokens=T, **kw)
    assert info.value.code == code and word in str(info.value)
