"""_version.py: the package's version, which is the C library's: MOK_VERSION_* of include/mok.h.

The header is the one place the version is written. In the source tree (python/ on sys.path)
this file reads it; `pip install .` (setup.py) replaces this file in the installed package with
the numbers it read from the header at build time, since an installed package has no header.
"""
import os
import re


def _from_header(path):
    with open(path) as f:
        text = f.read()
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(r"^#define\s+MOK_VERSION_%s\s+(\d+)\s*$" % name, text, flags=re.M)
        if m is None:
            raise RuntimeError(f"{path}: no #define MOK_VERSION_{name}")
        parts.append(int(m.group(1)))
    return tuple(parts)


VERSION = _from_header(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "include", "mok.h"))
