"""test_exports.py: libmok.so exports every function that include/mok.h declares.

The binding reaches the library only through these symbols; a build that hides them (for example
-fvisibility=hidden on the objects that define them, under a version script) loads but finds none.
"""
import ctypes
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def header_functions():
    with open(os.path.join(ROOT, "include", "mok.h")) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    # a declaration: a return type, then mok_name( at the start of a line (macros are uppercase)
    return sorted(set(re.findall(r"^[a-zA-Z_][\w \*]*?\b(mok_[a-z0-9_]+)\(", text, flags=re.M)))


def test_library_exports_every_header_function():
    path = os.environ.get("MOK_LIBRARY") or os.path.join(ROOT, "build", "libmok.so")
    lib = ctypes.CDLL(path)
    names = header_functions()
    assert len(names) >= 20, names  # the parse found the API, not a fragment of it
    missing = [n for n in names if not hasattr(lib, n)]
    assert not missing, f"{path} does not export {missing}"
