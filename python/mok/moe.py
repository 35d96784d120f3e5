"""moe.py: the PyTorch face of MoK: an autograd Function over mok.Layer and an nn.Module.

    from mok.moe import MoE
    moe = MoE(hidden=2048, intermediate=768, num_experts=128, top_k=8, max_tokens=16384)
    y = moe(x, topk_idx, topk_w)          # x [T, H] bf16, topk_idx [T, K] int32, topk_w [T, K] fp32
    y.float().sum().backward()            # grads of x, topk_w and every weight

Weights are bf16 Parameters in PyTorch Linear layout; weight gradients come back in fp32 from the
library and are cast to the parameters' dtype. fp8 layers quantize the weights at every forward.
"""
import math

import torch

from . import Layer


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, x, topk_idx, topk_w, *weights):
        names = ("wg", "wu", "wd", "wsg", "wsu", "wsd")
        w = {k: v.detach().contiguous() for k, v in zip(names, weights) if v is not None}
        x, topk_idx, topk_w = x.detach().contiguous(), topk_idx.contiguous(), topk_w.detach().contiguous()
        y = torch.empty_like(x)
        saved = torch.empty(layer.context_bytes(), dtype=torch.uint8, device=x.device)
        quantized = None
        if layer.desc.precision != 0:
            quantized = torch.empty(layer.quantized_weights_bytes(), dtype=torch.uint8, device=x.device)
            layer.quantize_weights(w, quantized)
        layer.forward(x, topk_idx, topk_w, w, y, saved, quantized, _stream(x))
        ctx.layer, ctx.w, ctx.quantized = layer, w, quantized
        ctx.save_for_backward(x, topk_idx, topk_w, saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_w, saved = ctx.saved_tensors
        layer, w = ctx.layer, ctx.w
        dy = dy.to(torch.bfloat16).contiguous()
        grads = {"dx": torch.empty_like(x), "dtopk_w": torch.empty_like(topk_w)}
        for k, v in w.items():
            grads["d" + k] = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        layer.backward(x, topk_idx, topk_w, w, saved, dy, grads, ctx.quantized, _stream(x))
        dws = [grads["d" + k].to(w[k].dtype) if k in w else None
               for k in ("wg", "wu", "wd", "wsg", "wsu", "wsd")]
        return (None, grads["dx"], None, grads["dtopk_w"], *dws)


class MoE(torch.nn.Module):
    """A MoE layer with routed experts (and optionally a shared expert) on one device (W = 1)."""

    def __init__(self, hidden, intermediate, num_experts, top_k, max_tokens, shared_intermediate=0,
                 precision="bf16", device="cpu", recompute=False):
        super().__init__()
        self.layer = Layer(hidden, intermediate, num_experts, top_k, max_tokens,
                           shared_intermediate, precision, str(device), recompute=recompute)
        H, I, E, Is = hidden, intermediate, num_experts, shared_intermediate

        def param(*shape, fan_in):
            t = torch.randn(*shape, device=device) / math.sqrt(fan_in)
            return torch.nn.Parameter(t.to(torch.bfloat16))

        self.wg, self.wu, self.wd = param(E, I, H, fan_in=H), param(E, I, H, fan_in=H), param(E, H, I, fan_in=I)
        if Is:
            self.wsg, self.wsu, self.wsd = param(Is, H, fan_in=H), param(Is, H, fan_in=H), param(H, Is, fan_in=Is)
        else:
            self.wsg = self.wsu = self.wsd = None

    def forward(self, x, topk_idx, topk_w):
        return _MoEFunction.apply(self.layer, x, topk_idx.to(torch.int32), topk_w.float(), self.wg,
                                  self.wu, self.wd, self.wsg, self.wsu, self.wsd)
