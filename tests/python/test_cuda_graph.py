"""test_cuda_graph.py: a whole training step with mok.moe.MoE captured in a CUDA graph
(torch.cuda.graph) and replayed with new routing and new tokens in the same input buffers.

The step: the MoE layer, a loss, the gradients of every parameter (torch.autograd.grad) and an SGD
update in place, all inside the graph (no cuBLAS op, whose algorithm may differ under capture). The same steps run
eagerly on a copy of the model with the same inputs: every replay's loss and, after the last, every
parameter must equal the eager run's bit for bit (MoK's layer is deterministic, and the step has
no other source of nondeterminism). Also compiled with torch.compile(fullgraph=True) on the GPU:
no graph break, and the compiled step equal to eager. Skipped without a CUDA device.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the graph and GPU compile tests run on a GPU machine",
                allow_module_level=True)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from mok.moe import MoE  # noqa: E402

H, I, E, K, T, Is = 256, 256, 8, 2, 192, 128
LR = 0.05


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.moe = MoE(H, I, E, K, max_tokens=T, shared_intermediate=Is, device="cuda")

    def forward(self, x, topk_idx, topk_w):
        return self.moe(x, topk_idx, topk_w)


def batch(n):
    g = torch.Generator().manual_seed(100 + n)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    idx[torch.rand(T, K, generator=g) < 0.1] = -1  # some empty slots
    if n % 2:
        idx[:, 0] = 3  # every token on expert 3 in slot 0 (a hot expert)
        idx[:, 1] = torch.where(idx[:, 1] == 3, 4, idx[:, 1])
    tw = torch.rand(T, K, generator=g) * 0.6 + 0.2
    return x.cuda(), idx.cuda(), tw.cuda()


def step(model, x, idx, tw):
    """loss, then the gradients and an SGD update in place (capturable: no .grad fields)."""
    params = [p for p in model.parameters()]
    y = model(x, idx, tw)
    loss = (y.float() ** 2).mean()
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(LR * g.to(p.dtype))
    return loss.detach()


def test_training_step_replays_with_new_routing():
    model = Model()
    eager = Model()
    eager.load_state_dict(model.state_dict())
    sx, sidx, stw = (t.clone() for t in batch(0))
    # warm-up on a side stream, as torch.cuda.graph wants, then the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    warm = Model()
    warm.load_state_dict(model.state_dict())
    with torch.cuda.stream(s):
        step(warm, sx, sidx, stw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sloss = step(model, sx, sidx, stw)
    # capturing ran nothing: the model is still at its initial weights, like eager
    for n in range(5):
        x, idx, tw = batch(n)
        sx.copy_(x), sidx.copy_(idx), stw.copy_(tw)
        graph.replay()
        want = step(eager, x, idx, tw)
        torch.cuda.synchronize()
        model.moe.layer.check()
        assert torch.equal(sloss, want), f"replay {n}: loss {sloss.item()} vs eager {want.item()}"
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), f"{name} differs from eager after the replays"


def test_compile_fullgraph_on_gpu():
    model = Model()
    compiled_model = Model()
    compiled_model.load_state_dict(model.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True)
    x, idx, tw = batch(1)
    y = model(x, idx, tw)
    yc = compiled(x, idx, tw)
    assert torch.equal(y, yc)
    y.float().sum().backward()
    yc.float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), compiled_model.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}.grad: compiled differs from eager"
