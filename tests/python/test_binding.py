"""test_binding.py: the Python binding on the CPU backend.

Checks the ctypes plumbing (struct layouts: a drift would fail layer creation with
VERSION_MISMATCH or give garbage), errors raised as MokError with the library's message, and the
layer against an independent float64 numpy implementation of DESIGN.md section 2, forward and
backward. Tolerance: the library rounds a, yk, y (and g, u, dg, du, dxk, dx in backward) to bf16,
each a relative error of at most 2^-9; a few such roundings in a chain stay far below the 2^-7
relative (norm-wise) bound used here, while any wrong index or formula lands at O(1).
"""
import os
import sys

import pytest

np = pytest.importorskip("numpy")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import mok  # noqa: E402

H, I, E, K, IS, T = 128, 128, 4, 2, 128, 6


def silu(g):
    return g / (1 + np.exp(-g))


def reference(x, idx, tw, wg, wu, wd, wsg, wsu, wsd, dy):
    """float64, no rounding: y, dx, dtopk_w and the weight gradients."""
    y = np.zeros((T, H)); dx = np.zeros((T, H)); dtw = np.zeros((T, K))
    dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
    gs, us = x @ wsg.T, x @ wsu.T
    as_ = silu(gs) * us
    y += as_ @ wsd.T
    dss = dy @ wsd
    sig = 1 / (1 + np.exp(-gs))
    dgs, dus = dss * us * sig * (1 + gs * (1 - sig)), dss * silu(gs)
    dx += dgs @ wsg + dus @ wsu
    dwsd, dwsg, dwsu = dy.T @ as_, dgs.T @ x, dus.T @ x
    for t in range(T):
        for k in range(K):
            e = idx[t, k]
            if e < 0:
                continue
            g, u = wg[e] @ x[t], wu[e] @ x[t]
            s = silu(g) * u
            a = tw[t, k] * s
            y[t] += wd[e] @ a
            ds = dy[t] @ wd[e]
            dtw[t, k] = ds @ s
            da = tw[t, k] * ds
            sg = 1 / (1 + np.exp(-g))
            dg, du = da * u * sg * (1 + g * (1 - sg)), da * silu(g)
            dx[t] += dg @ wg[e] + du @ wu[e]
            dwd[e] += np.outer(dy[t], a)
            dwg[e] += np.outer(dg, x[t])
            dwu[e] += np.outer(du, x[t])
    return y, dx, dtw, dwg, dwu, dwd, dwsg, dwsu, dwsd


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture
def problem():
    rng = np.random.default_rng(7)
    bf = lambda *s, scale=1.0: mok.bf16_from_float32(rng.standard_normal(s) * scale)
    p = dict(x=bf(T, H), dy=bf(T, H), wg=bf(E, I, H, scale=H ** -0.5), wu=bf(E, I, H, scale=H ** -0.5),
             wd=bf(E, H, I, scale=I ** -0.5), wsg=bf(IS, H, scale=H ** -0.5),
             wsu=bf(IS, H, scale=H ** -0.5), wsd=bf(H, IS, scale=IS ** -0.5))
    idx = np.array([[0, 1], [2, -1], [3, 0], [1, 2], [0, 3], [-1, 2]], dtype=np.int32)
    tw = rng.uniform(0.2, 0.8, (T, K)).astype(np.float32)
    return p, idx, tw


def run(layer, p, idx, tw):
    w = {k: p[k] for k in ("wg", "wu", "wd", "wsg", "wsu", "wsd")}
    q = None
    if layer.quantized_weights_bytes():
        q = np.zeros(layer.quantized_weights_bytes(), dtype=np.uint8)
        layer.quantize_weights(w, q)
    y = np.zeros((T, H), dtype=np.uint16)
    ctx = np.zeros(layer.context_bytes(), dtype=np.uint8)
    layer.forward(p["x"], idx, tw, w, y, ctx, quantized=q)
    grads = {"dx": np.zeros((T, H), np.uint16), "dtopk_w": np.zeros((T, K), np.float32)}
    for k in w:
        grads["d" + k] = np.zeros(w[k].shape, np.float32)
    layer.backward(p["x"], idx, tw, w, ctx, p["dy"], grads, quantized=q)
    return y, grads


def test_layer_matches_float64_numpy(problem):
    p, idx, tw = problem
    layer = mok.Layer(H, I, E, K, max_tokens=8, shared_intermediate=IS)
    y, g = run(layer, p, idx, tw)
    layer.check()  # the CPU backend reports synchronously: nothing pending
    layer.recover()  # one rank on the CPU: nothing to recover, and the layer still works
    y2, _ = run(layer, p, idx, tw)
    assert np.array_equal(y2, y)
    f = {k: mok.float32_from_bf16(v).astype(np.float64) for k, v in p.items()}
    ref = reference(f["x"], idx, tw.astype(np.float64), f["wg"], f["wu"], f["wd"], f["wsg"],
                    f["wsu"], f["wsd"], f["dy"])
    got = [mok.float32_from_bf16(y), mok.float32_from_bf16(g["dx"]), g["dtopk_w"], g["dwg"], g["dwu"],
           g["dwd"], g["dwsg"], g["dwsu"], g["dwsd"]]
    names = ["y", "dx", "dtopk_w", "dwg", "dwu", "dwd", "dwsg", "dwsu", "dwsd"]
    for name, a, b in zip(names, got, ref):
        assert rel(a, b) < 2 ** -7, f"{name}: relative error {rel(a, b):.3g}"
    assert np.all(g["dtopk_w"][idx < 0] == 0)


def test_fp8_layers_run_and_stay_close(problem):
    p, idx, tw = problem
    y16, _ = run(mok.Layer(H, I, E, K, 8, IS), p, idx, tw)
    for prec in ("fp8-block", "mxfp8"):
        y8, g8 = run(mok.Layer(H, I, E, K, 8, IS, precision=prec), p, idx, tw)
        err = rel(mok.float32_from_bf16(y8), mok.float32_from_bf16(y16))
        assert 2 ** -8 < err < 2 ** -3, f"{prec}: {err}"  # quantized, within e4m3's step


def test_fp8_block_scale_roundings_differ(problem):
    p, idx, tw = problem
    y32, _ = run(mok.Layer(H, I, E, K, 8, IS, precision="fp8-block"), p, idx, tw)
    y2, _ = run(mok.Layer(H, I, E, K, 8, IS, precision="fp8-block", fp8_scale="pow2"), p, idx, tw)
    err = rel(mok.float32_from_bf16(y2), mok.float32_from_bf16(y32))
    assert 0 < err < 2 ** -3, err  # other scales, other roundings; both within e4m3's step
    with pytest.raises(mok.MokError) as e:
        mok.Layer(H, I, E, K, 8, IS, precision="fp8-block", fp8_scale="e8m0")
    assert e.value.code == "INVALID_VALUE" and "fp8_scale" in str(e.value)


def test_errors_raise_with_message(problem):
    p, idx, tw = problem
    with pytest.raises(mok.MokError) as e:
        mok.Layer(100, I, E, K, 8)
    assert e.value.code == "INVALID_SHAPE" and "hidden" in str(e.value)
    with pytest.raises(mok.MokError) as e:
        mok.Layer(H, I, E, K, 8, precision="fp4")
    assert e.value.code == "INVALID_VALUE"
    layer = mok.Layer(H, I, E, K, 8, IS)
    bad = idx.copy()
    bad[1, 1] = E
    with pytest.raises(mok.MokError) as e:
        run(layer, p, bad, tw)
    assert e.value.code == "INVALID_ROUTING"
    with pytest.raises(mok.MokError) as e:
        layer.forward(p["x"][:, ::2], idx, tw, {}, np.zeros((T, H), np.uint16), np.zeros(8, np.uint8))
    assert e.value.code == "INVALID_VALUE" and "contiguous" in str(e.value)


def test_bf16_conversion_matches_library_rounding():
    v = np.array([1.0, 1.00390625, 1.01171875, -0.0, np.inf, np.nan, 3.0e38], dtype=np.float32)
    b = mok.bf16_from_float32(v)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa 0 wins; 1 + 3*2^-8 ties up to 1 + 2^-6
    assert list(b[:5]) == [0x3F80, 0x3F80, 0x3F82, 0x8000, 0x7F80]
    assert (b[5] & 0x7F80) == 0x7F80 and (b[5] & 0x7F) != 0  # NaN stays NaN
    assert b[6] == 0x7F62  # 3e38 rounds within range


def test_torch_module_on_cpu(problem):
    torch = pytest.importorskip("torch")
    from mok.moe import MoE
    p, idx, tw = problem
    torch.manual_seed(0)
    moe = MoE(H, I, E, K, max_tokens=8, shared_intermediate=IS)
    x = torch.randn(T, H).to(torch.bfloat16).requires_grad_()
    w = torch.tensor(tw, requires_grad=True)
    y = moe(x, torch.tensor(idx), w)
    (y.float() * torch.tensor(mok.float32_from_bf16(p["dy"]))).sum().backward()
    assert x.grad is not None and w.grad is not None and moe.wg.grad is not None
    assert moe.wg.grad.dtype == torch.bfloat16 and torch.isfinite(moe.wsd.grad.float()).all()
