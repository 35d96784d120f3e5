"""test_moe_checks.py: what mok.moe.MoE casts and what it rejects, on a CPU layer.

Every documented cast is checked against the uncast call bit for bit (the casts are exact here,
or the comparison rounds the same way), every rejection for the MokError code and the argument's
name in the message. Skipped without torch.
"""
import contextlib
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import mok  # noqa: E402
from mok import _check  # noqa: E402
from mok.moe import MoE  # noqa: E402
from checks_util import raises  # noqa: E402

H, I, E, K, IS, T, T_MAX = 128, 128, 4, 2, 128, 6, 8
IDX = [[0, 1], [2, -1], [3, 0], [1, 2], [0, 3], [-1, 2]]


def module(**kw):
    torch.manual_seed(0)  # the same parameters for every module
    return MoE(H, I, E, K, max_tokens=T_MAX, shared_intermediate=IS, **kw)


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    tw = torch.rand(T, K, generator=g) * 0.6 + 0.2
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, torch.tensor(IDX, dtype=torch.int32), tw, dy


def run(moe, x, idx, tw, dy):
    """y and the gradients of x, topk_w and each parameter, for the loss sum(y * dy)."""
    moe.zero_grad()
    x, tw = x.detach().requires_grad_(), tw.detach().requires_grad_()
    y = moe(x, idx, tw)
    (y.float() * dy.float()).sum().backward()
    return y.detach(), x.grad, tw.grad, {k: p.grad for k, p in moe.named_parameters()}


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture(scope="module")
def reference():
    """The bf16 module on int32 ids and fp32 router weights: what every cast must reproduce."""
    x, idx, tw, dy = inputs()
    return run(module(), x, idx, tw, dy)


# ---- the reported bugs --------------------------------------------------------------------------

def test_x_of_half_the_hidden_size_raises():
    x, idx, tw, _ = inputs()
    with raises("INVALID_SHAPE", "x:", "[6, 64]", "[T, H]"):
        module()(x[:, : H // 2], idx, tw)


def test_topk_idx_one_row_short_raises():
    x, idx, tw, _ = inputs()
    with raises("INVALID_SHAPE", "topk_idx:", "[5, 2]", "[T, K] = [6, 2]"):
        module()(x, idx[: T - 1], tw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_x_of_another_float_dtype_raises(dtype):
    x, idx, tw, _ = inputs()
    with raises("INVALID_VALUE", "x:", f"dtype {dtype}", "bf16"):
        module()(x.to(dtype), idx, tw)


def test_float_parameters_are_rounded_to_bf16_for_the_call(reference):
    # bf16 -> fp32 -> bf16 is exact: the same y, and the fp32 weight gradients themselves
    y, dx, dtw, dw = reference
    moe = module().float()
    assert moe.wg.dtype == torch.float32
    y32, dx32, dtw32, dw32 = run(moe, *inputs())
    assert same(y32, y) and same(dx32, dx) and same(dtw32, dtw)
    for k, g in dw32.items():
        assert g.dtype == torch.float32 and same(g.to(torch.bfloat16), dw[k]), k


def test_half_parameters_are_rounded_to_bf16_for_the_call():
    moe16 = module().half()
    moe = module()
    with torch.no_grad():  # the bf16 values the half module's parameters round to
        for p, p16 in zip(moe.parameters(), moe16.parameters()):
            p.copy_(p16.to(torch.bfloat16))
    y16, _, _, dw16 = run(moe16, *inputs())
    y, _, _, dw = run(moe, *inputs())
    assert same(y16, y)
    assert all(g.dtype == torch.float16 for g in dw16.values())


def test_int64_ids_in_range_are_copied_to_int32(reference):
    x, idx, tw, dy = inputs()
    y64 = run(module(), x, idx.to(torch.int64), tw, dy)[0]
    assert same(y64, reference[0])


def test_int64_ids_beyond_int32_raise_instead_of_wrapping():
    x, idx, tw, _ = inputs()
    idx = idx.to(torch.int64)
    idx[3, 0] = 2 ** 32 + 1  # int32 would wrap it to expert 1
    with raises("INVALID_ROUTING", "topk_idx[3, 0] = 4294967297", "[0, E = 4)"):
        module()(x, idx, tw)


def test_device_cuda_raises_mok_error_not_value_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: MoE(device='cuda') is valid here")
    with raises("NO_DEVICE", "cuda"):
        module(device="cuda")


def test_device_cuda_means_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _check.device_ordinal("cuda") == 3
    assert _check.device_ordinal(torch.device("cuda")) == 3
    assert _check.device_ordinal(torch.device("cuda", 1)) == 1
    assert _check.device_ordinal(torch.device("cpu")) == mok._lib.DEVICE_CPU
    with raises("INVALID_VALUE", "device 'gpu'"):
        module(device="gpu")


# ---- the other casts and rejections -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_topk_w_is_rounded_to_fp32(dtype):
    x, idx, tw, dy = inputs()
    tw = tw.to(dtype)
    y, _, dtw, _ = run(module(), x, idx, tw, dy)
    y32, _, dtw32, _ = run(module(), x, idx, tw.float(), dy)  # the cast done by hand
    assert same(y, y32)
    assert dtw.dtype == dtype and same(dtw, dtw32.to(dtype))


def test_small_integer_ids_are_copied_to_int32(reference):
    x, idx, tw, dy = inputs()
    assert same(run(module(), x, idx.to(torch.int16), tw, dy)[0], reference[0])


def test_ids_and_weights_of_the_wrong_kind_raise():
    x, idx, tw, _ = inputs()
    with raises("INVALID_VALUE", "topk_idx:", "torch.float32", "integer"):
        module()(x, idx.float(), tw)
    with raises("INVALID_VALUE", "topk_w:", "torch.int32", "floating"):
        module()(x, idx, idx)


def test_non_contiguous_inputs_are_copied(reference):
    x, idx, tw, dy = inputs()
    xt, idxt, twt = x.t().contiguous().t(), idx.t().contiguous().t(), tw.t().contiguous().t()
    assert not (xt.is_contiguous() or idxt.is_contiguous() or twt.is_contiguous())
    y, dx, dtw, _ = run(module(), xt, idxt, twt, dy)
    assert same(y, reference[0]) and same(dx, reference[1]) and same(dtw, reference[2])


def test_expanded_dy_is_copied():
    # y.sum()'s gradient reaches backward as an expanded (stride 0) tensor
    x, idx, tw, _ = inputs()
    x.requires_grad_()
    module()(x, idx, tw).sum().backward()
    assert torch.isfinite(x.grad.float()).all() and x.grad.abs().sum() > 0


def test_parameters_moved_off_the_layer_device_raise():
    x, idx, tw, _ = inputs()
    moe = module().to("meta")
    with raises("WRONG_DEVICE", "w['wg']", "device meta", "host memory"):
        moe(x, idx, tw)


def test_too_many_tokens_raise():
    x, idx, tw, _ = inputs()
    n = T_MAX + 1
    with raises("INVALID_SHAPE", "x:", f"T <= T_max = {T_MAX}"):
        module()(torch.zeros(n, H, dtype=torch.bfloat16), torch.zeros(n, K, dtype=torch.int32),
                 torch.zeros(n, K))


def test_layer_takes_torch_cpu_tensors_like_numpy_arrays():
    # mok.Layer reads torch.bfloat16 as numpy's uint16 bits: the same bytes give the same y
    np = pytest.importorskip("numpy")

    def as_np(t):
        bits = t.dtype == torch.bfloat16
        return t.view(torch.int16).numpy().view(np.uint16) if bits else t.numpy()

    layer = mok.Layer(H, I, E, K, T_MAX, IS)
    x, idx, tw, _ = inputs()
    w = {k: p.detach() for k, p in module().named_parameters()}
    y = torch.empty(T, H, dtype=torch.bfloat16)
    layer.forward(x, idx, tw, w, y, torch.empty(layer.context_bytes(), dtype=torch.uint8))
    y_np = np.zeros((T, H), np.uint16)
    layer.forward(as_np(x), as_np(idx), as_np(tw), {k: as_np(v) for k, v in w.items()}, y_np,
                  np.zeros(layer.context_bytes(), np.uint8))
    assert np.array_equal(as_np(y), y_np)


def test_layer_rejects_torch_tensors_of_another_device():
    layer = mok.Layer(H, I, E, K, T_MAX, IS)
    x, idx, tw, _ = inputs()
    with raises("WRONG_DEVICE", "topk_w:", "device meta", "host memory"):
        layer.forward(x, idx, tw.to("meta"), {}, torch.empty_like(x),
                      torch.empty(16, dtype=torch.uint8))
