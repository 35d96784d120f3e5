"""test_checks.py: mok.Layer checks every argument against the layer before the C call.

numpy arrays on a CPU layer (no GPU, no torch needed). Each test passes one bad argument among
good ones and asserts the MokError's code and that its message names the argument and what was
expected; without the checks these read past an array's end (x [T, H/2] crashed, topk_idx [T-1, K]
aborted in free()) or reinterpreted memory (fp32 x, fp64 topk_w gave wrong numbers).
"""
import contextlib
import os
import sys

import pytest

np = pytest.importorskip("numpy")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import mok  # noqa: E402
from mok import _check  # noqa: E402
from checks_util import raises  # noqa: E402

H, I, E, K, IS, T, T_MAX = 128, 128, 4, 2, 128, 6, 8


def make(Is=IS, seed=3):
    """A good problem: x, topk_idx, topk_w, w, y, dy, grads (fp32 weight gradients)."""
    rng = np.random.default_rng(seed)
    bf = lambda *s: mok.bf16_from_float32(rng.standard_normal(s) * s[-1] ** -0.5)
    w = {"wg": bf(E, I, H), "wu": bf(E, I, H), "wd": bf(E, H, I)}
    if Is:
        w.update(wsg=bf(Is, H), wsu=bf(Is, H), wsd=bf(H, Is))
    idx = np.array([[0, 1], [2, -1], [3, 0], [1, 2], [0, 3], [-1, 2]], np.int32)
    p = {"x": bf(T, H), "topk_idx": idx,
         "topk_w": rng.uniform(0.2, 0.8, (T, K)).astype(np.float32), "w": w,
         "y": np.zeros((T, H), np.uint16), "dy": bf(T, H)}
    p["grads"] = {"dx": np.zeros((T, H), np.uint16), "dtopk_w": np.zeros((T, K), np.float32)}
    p["grads"].update({"d" + k: np.zeros(v.shape, np.float32) for k, v in w.items()})
    return p


@pytest.fixture(scope="module")
def layer():
    return mok.Layer(H, I, E, K, max_tokens=T_MAX, shared_intermediate=IS)


def forward(layer, p, **bad):
    a = {**p, **bad}
    ctx = a.get("ctx", np.zeros(layer.context_bytes(), np.uint8))
    layer.forward(a["x"], a["topk_idx"], a["topk_w"], a["w"], a["y"], ctx)
    return ctx


def backward(layer, p, **bad):
    a = {**p, **bad}
    ctx = forward(layer, {k: v for k, v in a.items() if k != "ctx"})
    layer.backward(a["x"], a["topk_idx"], a["topk_w"], a["w"], a.get("ctx", ctx), a["dy"],
                   a["grads"])


def test_good_problem_runs(layer):
    p = make()
    backward(layer, p)
    assert np.any(p["y"]) and np.any(p["grads"]["dwg"])


def test_zero_tokens_run(layer):
    p = make()
    z = {"x": p["x"][:0], "topk_idx": p["topk_idx"][:0], "topk_w": p["topk_w"][:0], "y": p["y"][:0],
         "dy": p["dy"][:0], "grads": {**p["grads"], "dx": p["grads"]["dx"][:0],
                                      "dtopk_w": p["grads"]["dtopk_w"][:0]}}
    backward(layer, p, **z)


# ---- the reported bugs --------------------------------------------------------------------------

def test_x_of_half_the_hidden_size_raises(layer):
    p = make()
    with raises("INVALID_SHAPE", "x:", "[6, 64]", "[T, H]", "128"):
        forward(layer, p, x=np.ascontiguousarray(p["x"][:, : H // 2]))


def test_topk_idx_one_row_short_raises(layer):
    p = make()
    with raises("INVALID_SHAPE", "topk_idx:", "[5, 2]", "[T, K] = [6, 2]"):
        forward(layer, p, topk_idx=p["topk_idx"][: T - 1].copy())


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_x_of_another_float_dtype_raises(layer, dtype):
    p = make()
    with raises("INVALID_VALUE", "x:", f"dtype {dtype}", "bf16"):
        forward(layer, p, x=mok.float32_from_bf16(p["x"]).astype(dtype))


def test_fp32_weights_raise(layer):
    p = make()
    w = {**p["w"], "wg": mok.float32_from_bf16(p["w"]["wg"])}
    with raises("INVALID_VALUE", "w['wg']", "dtype float32", "bf16"):
        forward(layer, p, w=w)


def test_int64_topk_idx_raises(layer):
    # mok.Layer casts nothing (the torch module copies integer ids to int32)
    p = make()
    with raises("INVALID_VALUE", "topk_idx:", "dtype int64", "int32"):
        forward(layer, p, topk_idx=p["topk_idx"].astype(np.int64))


def test_float64_topk_w_raises(layer):
    p = make()
    with raises("INVALID_VALUE", "topk_w:", "dtype float64", "fp32"):
        forward(layer, p, topk_w=p["topk_w"].astype(np.float64))


def test_device_strings(monkeypatch):
    assert _check.device_ordinal("cpu") == mok._lib.DEVICE_CPU
    assert _check.device_ordinal("cuda:3") == 3
    for bad in ("gpu", "cuda:x", "cuda:-1", "cuda:0:1", "CPU", "", 0, None):
        with raises("INVALID_VALUE", "device", "'cuda:N'"):
            _check.device_ordinal(bad)
    with raises("INVALID_VALUE", "device"):
        mok.Layer(H, I, E, K, T_MAX, device="gpu")


def test_device_cuda_without_torch_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with raises("INVALID_VALUE", "'cuda'", "torch is not installed", "'cuda:N'"):
        _check.device_ordinal("cuda")


# ---- every other argument -----------------------------------------------------------------------

def test_more_tokens_than_max_tokens_raise(layer):
    p = make()
    n = T_MAX + 1
    with raises("INVALID_SHAPE", "x:", f"T <= T_max = {T_MAX}"):
        forward(layer, p, x=np.zeros((n, H), np.uint16), topk_idx=np.zeros((n, K), np.int32),
                topk_w=np.zeros((n, K), np.float32), y=np.zeros((n, H), np.uint16))


def test_x_of_three_dims_raises(layer):
    p = make()
    with raises("INVALID_SHAPE", "x:", "[1, 6, 128]"):
        forward(layer, p, x=p["x"][None])


def test_expert_id_below_minus_one_raises(layer):
    p = make()
    idx = p["topk_idx"].copy()
    idx[4, 1] = -2
    with raises("INVALID_ROUTING", "topk_idx[4, 1] = -2", "[0, E = 4)", "-1"):
        forward(layer, p, topk_idx=idx)


def test_expert_id_of_E_raises(layer):
    p = make()
    idx = p["topk_idx"].copy()
    idx[2, 0] = E
    with raises("INVALID_ROUTING", "topk_idx[2, 0] = 4"):
        forward(layer, p, topk_idx=idx)


def test_non_contiguous_input_raises(layer):
    p = make()
    with raises("INVALID_VALUE", "topk_w:", "not contiguous"):
        forward(layer, p, topk_w=np.asfortranarray(p["topk_w"]))


def test_not_an_array_raises(layer):
    p = make()
    with raises("INVALID_VALUE", "x:", "numpy array or torch tensor", "list"):
        forward(layer, p, x=p["x"].tolist())


def test_y_of_another_dtype_raises(layer):
    p = make()
    with raises("INVALID_VALUE", "y:", "dtype float32"):
        forward(layer, p, y=np.zeros((T, H), np.float32))


def test_read_only_y_raises(layer):
    p = make()
    y = p["y"].copy()
    y.flags.writeable = False
    with raises("INVALID_VALUE", "y:", "read-only"):
        forward(layer, p, y=y)


def test_small_ctx_raises(layer):
    p = make()
    with raises("INVALID_SHAPE", "ctx:", f"expected at least {layer.context_bytes()}"):
        forward(layer, p, ctx=np.zeros(layer.context_bytes() - 1, np.uint8))


def test_missing_and_unknown_weights_raise(layer):
    p = make()
    with raises("NULL_POINTER", "w['wd']", "missing"):
        forward(layer, p, w={k: v for k, v in p["w"].items() if k != "wd"})
    with raises("INVALID_VALUE", "w:", "unknown keys ['w_gate']"):
        forward(layer, p, w={**p["w"], "w_gate": p["w"]["wg"]})


def test_transposed_weight_raises(layer):
    p = make()
    w = {**p["w"], "wsd": np.ascontiguousarray(p["w"]["wsd"][:, : IS // 2])}
    with raises("INVALID_SHAPE", "w['wsd']", "[H, Is] = [128, 128]"):
        forward(layer, p, w=w)


def test_shared_weights_without_shared_expert_raise():
    layer = mok.Layer(H, I, E, K, T_MAX)  # Is = 0
    p = make()  # with shared weights
    with raises("INVALID_SHAPE", "w['wsg']", "no shared expert"):
        forward(layer, p)


def test_dy_of_another_shape_raises(layer):
    p = make()
    with raises("INVALID_SHAPE", "dy:", "[T, H] = [6, 128]"):
        backward(layer, p, dy=p["dy"][:3].copy())


def test_bf16_weight_gradient_of_an_fp32_layer_raises(layer):
    p = make()
    grads = {**p["grads"], "dwu": np.zeros((E, I, H), np.uint16)}
    with raises("INVALID_VALUE", "grads['dwu']", "dtype uint16", "fp32"):
        backward(layer, p, grads=grads)


def test_bf16_weight_gradients_of_a_bf16_wgrad_layer_pass():
    layer = mok.Layer(H, I, E, K, T_MAX, IS, wgrad_fp32=False)
    p = make()
    grads = {k: (np.zeros(v.shape, np.uint16) if k.startswith("dw") else v)
             for k, v in p["grads"].items()}
    backward(layer, p, grads=grads)
    assert np.any(grads["dwg"])


def test_missing_and_misshaped_gradients_raise(layer):
    p = make()
    with raises("NULL_POINTER", "grads['dx']", "missing"):
        backward(layer, p, grads={k: v for k, v in p["grads"].items() if k != "dx"})
    with raises("INVALID_SHAPE", "grads['dtopk_w']", "[T, K] = [6, 2]"):
        backward(layer, p, grads={**p["grads"], "dtopk_w": np.zeros((T, K + 1), np.float32)})


def test_fp8_layer_needs_its_quantized_buffer():
    layer = mok.Layer(H, I, E, K, T_MAX, IS, precision="fp8-block")
    p = make()
    with raises("NULL_POINTER", "quantized", "quantize_weights"):
        forward(layer, p)
    with raises("INVALID_SHAPE", "out:", f"expected at least {layer.quantized_weights_bytes()}"):
        layer.quantize_weights(p["w"], np.zeros(layer.quantized_weights_bytes() // 2, np.uint8))


def test_gpu_layer_rejects_host_memory():
    # the checks alone (no GPU here): a GPU layer's arguments must be on its device
    dims = _check.Dims(mok.Layer(H, I, E, K, T_MAX, IS).desc, 0, 16, 0)
    p = make()
    with raises("WRONG_DEVICE", "x:", "host memory", "cuda:0"):
        _check.forward(dims, p["x"], p["topk_idx"], p["topk_w"], p["w"], None)
