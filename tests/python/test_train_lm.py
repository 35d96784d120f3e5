"""test_train_lm.py: examples/train_lm.py runs on the CPU with a tiny model and gives what it says.

One run of the example in a fresh interpreter (2 layers, H = I = 128, E = 4, top-2, 2 x 32 tokens,
4 steps; MoK's layer on the CPU device is the plain-C reference): it must exit 0, write the JSON
and the PNG, and the JSON must show
- the same first loss for MoK and the PyTorch MoE (same weights, same batch): they differ only by
  bf16 rounding (torch._grouped_mm rounds g and u to bf16, MoK keeps them in fp32), measured
  5e-4 relative here; 5e-3 is ten times that;
- the loss of both runs falling over the 4 steps: from ln 256 = 5.55 nats a byte the byte
  frequencies alone are learned at about 0.1 a step at lr 1e-3 (measured 5.54 -> 5.19 in 3).
Then --replot draws the PNG again from the JSON. About 10 s on two cores. Skips without torch
(or one without torch._grouped_mm), matplotlib, or the library (make).
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "train_lm.py")
LIBMOK = os.environ.get("MOK_LIBRARY") or os.path.join(ROOT, "build", "libmok.so")
STEPS = 4
TINY = ["--device", "cpu", "--steps", str(STEPS), "--layers", "2", "--hidden", "128",
        "--intermediate", "128", "--experts", "4", "--top-k", "2", "--batch", "2", "--seq", "32",
        "--val-batches", "2", "--log-every", "1"]


def need(module, why):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed ({why})")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    need("torch", "the example's model")
    need("matplotlib", "the example's plot")
    if not os.path.exists(LIBMOK):
        pytest.skip(f"{LIBMOK} not built (make)")
    import torch
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm (the PyTorch MoE's GEMM)")
    out = str(tmp_path_factory.mktemp("train_lm") / "train_lm")
    p = subprocess.run([sys.executable, EXAMPLE, *TINY, "--out", out], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out + ".json") as f:
        return out, json.load(f), p.stdout


def test_writes_json_and_png(result):
    out, r, stdout = result
    assert os.path.getsize(out + ".png") > 0
    assert set(r["runs"]) == {"mok", "torch"}
    for name, run in r["runs"].items():
        assert len(run["loss"]) == STEPS and len(run["step_s"]) == STEPS, name
        assert all(math.isfinite(v) for v in run["loss"] + [run["val_loss"]]), name
        assert run["tokens_per_s"] > 0, name
    assert r["config"]["hidden"] == 128 and r["data"]["train_bytes"] > r["data"]["val_bytes"] > 0
    assert "max |loss difference|" in stdout and "ratio mok/torch" in stdout


def test_first_losses_agree(result):
    _, r, _ = result
    m, t = r["runs"]["mok"]["loss"][0], r["runs"]["torch"]["loss"][0]
    assert abs(m - t) / t < 5e-3, (m, t)
    assert abs(t - math.log(256)) < 0.1, t  # an untrained byte model: about uniform


def test_loss_falls_in_both_runs(result):
    _, r, _ = result
    for name, run in r["runs"].items():
        assert run["loss"][-1] < run["loss"][0] - 0.1, (name, run["loss"])


def test_replot(result):
    out, _, _ = result
    os.remove(out + ".png")
    p = subprocess.run([sys.executable, EXAMPLE, "--replot", out + ".json"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert os.path.getsize(out + ".png") > 0 and "tokens/s" in p.stdout
