"""test_plot.py: bench/plot.py draws its four PNGs from the committed results, and takes each
case's last row (the benchmarks append in run order). Skips without matplotlib."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import plot  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_draws_the_four_pngs(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "plot.py"), "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    for name in ("forward", "gemm", "transport", "ep"):
        with open(tmp_path / f"{name}.png", "rb") as f:
            assert f.read(8) == PNG_MAGIC, name


def test_latest_takes_each_cases_last_row(tmp_path):
    rows = [{"case": "a", "commit": "old", "mok_ms": 2}, {"case": "b", "commit": "old"},
            {"case": "a", "commit": "new", "mok_ms": 1}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    got = plot.latest(str(path))
    assert got == {"a": rows[2], "b": rows[1]}
    assert plot.commits(got.values()) == "commits new, old"


def test_latest_skips_rows_of_reverted_code(tmp_path):
    rows = [{"case": "a", "commit": "kept", "mok_ms": 2},
            {"case": "a", "commit": "tried", "mok_ms": 3, "reverted": "taken out in kept2"}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot.latest(str(path)) == {"a": rows[0]}
