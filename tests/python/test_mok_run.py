"""test_mok_run.py: build/mok_run refuses bad arguments with its usage and exit status 2.

`mok_run 16 128 128 4 9 0` (K > E) used to hang: the routing generator searched forever for a
ninth distinct expert out of four. Arguments that are not integers were read as 0 by atoll.
MOK_RUN overrides the program's path.
"""
import os
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MOK_RUN = os.environ.get("MOK_RUN", os.path.join(ROOT, "build", "mok_run"))


@pytest.mark.parametrize("args, reason", [
    (["16", "128", "128", "4", "9", "0"], "top_k"),          # K > E
    (["16", "100", "128", "4", "2", "0"], "hidden"),         # H not a multiple of 128
    (["0", "128", "128", "4", "2", "0"], "max_tokens"),      # no tokens
    (["16", "128", "128", "4", "2", "-128"], "shared"),      # negative Is
    (["16", "128", "128", "4", "two", "0"], "not an integer"),
    (["16", "128", "128", "4", "2", "0x"], "not an integer"),
    (["16", "128", "128", "4", "2", "99999999999999999999"], "not an integer"),  # overflows
    (["16", "128", "128"], "all six"),
])
def test_bad_arguments_exit_2_with_usage(args, reason):
    if not os.path.exists(MOK_RUN):
        pytest.skip(f"{MOK_RUN} not built")
    p = subprocess.run([MOK_RUN] + args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "usage:" in p.stderr and reason in p.stderr, p.stderr
    assert p.stdout == ""  # refused before any work
