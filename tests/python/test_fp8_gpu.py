"""test_fp8_gpu.py: an fp8-block MoE module on the GPU (torch, W = 1) against the same module on
the CPU reference, with the same weights and inputs: y, dx, dtopk_w and the weight gradients,
forward and backward through torch.autograd, in SAVE and RECOMPUTE mode. Skipped without torch or
without a CUDA device.

Tolerance: relative L2 error 2^-6 per tensor. The two sides quantize the same values the same way
(bit-exact quantizers); they differ where a bf16 activation entering a quantizer already differs
by an ulp (GEMM accumulation order), which moves an e4m3 value by at most one step, 2^-3 of
itself, for the rare elements that cross a rounding boundary (about 2^-8 / 2^-4 of them): some
2^-9 of a tensor's norm; the C tests (tests/gpu/test_fp8_layer.cu) check element by element.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from mok.moe import MoE  # noqa: E402

H, I, E, K, T, Is = 256, 256, 8, 2, 64, 128
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def rel(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def copy_weights(dst, src):
    with torch.no_grad():
        for n in ("wg", "wu", "wd", "wsg", "wsu", "wsd"):
            getattr(dst, n).copy_(getattr(src, n))


def step(module, x, idx, tw):
    x, tw = x.clone().requires_grad_(), tw.clone().requires_grad_()
    y = module(x, idx, tw)
    y.float().square().sum().backward()
    return [y, x.grad, tw.grad] + [getattr(module, n).grad for n in ("wg", "wu", "wd", "wsg", "wsu", "wsd")]


@pytest.mark.parametrize("recompute", [False, True])
def test_fp8_block_gpu_module_matches_cpu(recompute):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    idx[3, 1] = -1  # an empty slot
    tw = torch.rand(T, K, generator=g) * 0.6 + 0.2
    out, cpu = [], None
    for dev in ("cpu", "cuda"):
        m = MoE(H, I, E, K, max_tokens=T, shared_intermediate=Is, precision="fp8-block",
                device=dev, recompute=recompute)
        if cpu is None:
            cpu = m
        else:
            copy_weights(m, cpu)  # the same weights on both sides
        out.append(step(m, x.to(dev), idx.to(dev), tw.to(dev)))
        m.layer.check()
    names = ["y", "dx", "dtopk_w", "dwg", "dwu", "dwd", "dwsg", "dwsu", "dwsd"]
    for name, c, gpu in zip(names, *out):
        assert rel(gpu, c) < 2 ** -6, f"{name}: relative error {rel(gpu, c):.3g} against the CPU"
    # and it is fp8: the same module in bf16 differs by e4m3's rounding
    b = MoE(H, I, E, K, max_tokens=T, shared_intermediate=Is, device="cuda", recompute=recompute)
    copy_weights(b, cpu)
    yb = step(b, x.cuda(), idx.cuda(), tw.cuda())[0]
    assert 2 ** -8 < rel(out[1][0], yb) < 2 ** -3
