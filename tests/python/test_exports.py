"""test_exports.py: libmok.so exports exactly the functions of include/mok.h.

The library links with src/api/exports.map; a public function that is hidden (as every one was
when the objects were built with -fvisibility=hidden under the map) makes the binding fail to
load, and an internal one that leaks becomes ABI by accident.
"""
import ctypes
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import mok._lib  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def public_functions():
    text = open(os.path.join(ROOT, "include", "mok.h")).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return sorted(set(re.findall(r"\b(mok_\w+)\s*\(", text)))


def exported_by_map():
    text = open(os.path.join(ROOT, "src", "api", "exports.map")).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    block = text.split("global:")[1].split("local:")[0]
    return sorted(n.strip() for n in block.split(";") if n.strip())


def test_every_public_function_is_exported_and_no_internal_one():
    names = public_functions()
    assert names == exported_by_map()
    lib = ctypes.CDLL(mok._lib._find_library())
    missing = [n for n in names if not hasattr(lib, n)]
    assert not missing, f"hidden in libmok.so: {missing}"
    for internal in ("mok_fail", "mok_ref_forward", "mok_cpu_forward", "mok_layer_valid"):
        assert not hasattr(lib, internal), f"{internal} leaks from libmok.so"
