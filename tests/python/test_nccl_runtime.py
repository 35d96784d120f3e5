"""test_nccl_runtime.py: libmok.so loads NCCL at run time, on first use, and never a second one.

Each check runs in a fresh interpreter (what is loaded depends on the order of imports):
- import mok, create a CPU layer, then import torch: torch must load its own NCCL and work (when
  libmok.so linked the toolkit's libnccl.so.2, torch bound to it and failed to import with
  "undefined symbol: ncclCommResume");
- a CPU layer loads no NCCL at all; the first NCCL call (mok_get_unique_id) loads it, or reports
  NOT_AVAILABLE with the reason, never a crash;
- import torch first, then call NCCL through MoK: MoK takes torch's NCCL (or refuses it with the
  versions in the message) and never loads a second one.
The torch checks skip without torch.
"""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
LIBMOK = os.environ.get("MOK_LIBRARY") or os.path.join(ROOT, "build", "libmok.so")

pytestmark = pytest.mark.skipif(not os.path.exists(LIBMOK), reason="build/libmok.so not built (make)")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

PRELUDE = f"""
import ctypes, json, sys
sys.path.insert(0, {os.path.join(ROOT, "python")!r})

def nccl_files():
    # libnccl files mapped into this process
    with open("/proc/self/maps") as f:
        return sorted({{l.split()[-1] for l in f if "libnccl" in l.split()[-1]}})

def unique_id(lib):
    # mok_get_unique_id -> (result name, message)
    import mok._lib as L
    lib.mok_get_unique_id.argtypes, lib.mok_get_unique_id.restype = [ctypes.c_void_p], ctypes.c_int
    buf = ctypes.create_string_buffer(128)  # mok_unique_id_t
    r = lib.mok_get_unique_id(buf)
    return L.RESULTS[r], lib.mok_last_error().decode(errors="replace")
"""


def run(body):
    """Runs PRELUDE + body in a fresh interpreter; returns the JSON object its last line prints."""
    code = PRELUDE + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_torch
def test_torch_imports_after_a_cpu_layer():
    out = run("""
        import mok
        layer = mok.Layer(128, 128, 4, 2, max_tokens=8)  # device "cpu": MOK_DEVICE_CPU
        before = nccl_files()
        import torch
        y = torch.ones(2) + 1
        print(json.dumps({"nccl_before_torch": before, "y": y.tolist()}))
    """)
    assert out["nccl_before_torch"] == [], "a CPU layer loaded NCCL"
    assert out["y"] == [2.0, 2.0]


def test_nccl_loaded_on_first_use_only():
    out = run("""
        import mok
        layer = mok.Layer(128, 128, 4, 2, max_tokens=8)
        after_layer = nccl_files()
        code, msg = unique_id(layer._lib)
        print(json.dumps({"after_layer": after_layer, "code": code, "msg": msg,
                          "after_call": nccl_files()}))
    """)
    assert out["after_layer"] == [], "a CPU layer loaded NCCL"
    assert out["code"] in ("SUCCESS", "NOT_AVAILABLE", "NCCL"), out
    if out["code"] == "NOT_AVAILABLE":
        assert "NCCL" in out["msg"], out
    else:  # bound: exactly one NCCL, loaded by the call
        assert len(out["after_call"]) == 1, out


@needs_torch
def test_mok_takes_the_nccl_torch_loaded():
    out = run("""
        import torch
        import mok
        torch_nccl = nccl_files()
        code, msg = unique_id(mok._lib.lib())
        print(json.dumps({"torch_nccl": torch_nccl, "code": code, "msg": msg,
                          "after_call": nccl_files(), "y": (torch.ones(2) + 1).tolist()}))
    """)
    assert out["y"] == [2.0, 2.0]
    if out["torch_nccl"]:  # a CUDA build of torch: its NCCL is the only one, whatever MoK said
        assert out["after_call"] == out["torch_nccl"], out
        if out["code"] == "NOT_AVAILABLE":
            assert "already loaded in the process" in out["msg"], out
    assert out["code"] in ("SUCCESS", "NOT_AVAILABLE", "NCCL"), out
