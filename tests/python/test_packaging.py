"""test_packaging.py: `pip install .` and `make install` give usable packages.

- pip installs the mok package (with libmok.so inside) into a temporary directory; imported from
  another directory, with no MOK_LIBRARY, it loads its own library and reports the header's
  version. --no-build-isolation: the installed setuptools builds it, no network needed.
- make install PREFIX=<tmp> installs mok.h, libmok.so and mok.pc; the flags pkg-config gives
  (or the .pc file's, without pkg-config) build a small C program that runs against the
  installed library.
Both reuse an up-to-date build/libmok.so (make's dependency tracking), so each takes seconds after
`make`; a build from nothing takes about 30 s on two cores. They skip, saying why, without pip,
setuptools 77+, make or a C compiler.
"""
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD_TIMEOUT_S = 240


def header_version():
    text = open(os.path.join(ROOT, "include", "mok.h")).read()
    return ".".join(re.search(r"^#define MOK_VERSION_%s (\d+)$" % n, text, flags=re.M).group(1)
                    for n in ("MAJOR", "MINOR", "PATCH"))


def clean_env():
    env = dict(os.environ)
    for k in ("MOK_LIBRARY", "PYTHONPATH"):
        env.pop(k, None)
    return env


def run_or_skip(cmd, what, **kw):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, **kw)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{what} took more than {BUILD_TIMEOUT_S} s")
    assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


def test_header_version_is_0_2_0_and_the_binding_reports_it():
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import mok
    assert header_version() == "0.2.0"
    assert mok.__version__ == header_version()
    assert mok._lib.lib().mok_version() == mok._lib.VERSION_CODE == 200


def test_pip_install_imports_from_another_directory(tmp_path):
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip("pip is not installed")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed (pip install setuptools)")
    import setuptools
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject.toml's SPDX license)")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    site = tmp_path / "site"
    run_or_skip([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                 "--no-cache-dir", "--target", str(site), ROOT], "pip install .", cwd=ROOT,
                env=clean_env())
    assert (site / "mok" / "libmok.so").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env()
    env["PYTHONPATH"] = str(site)
    code = "import mok; print(mok.__version__); print(mok._lib._find_library())"
    p = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    version, path = p.stdout.split()
    assert version == header_version() == "0.2.0"
    assert os.path.samefile(path, site / "mok" / "libmok.so")  # its own, not the source tree's
    # An explicit $MOK_LIBRARY comes first (the benchmarks' driver library, an A/B build).
    env["MOK_LIBRARY"] = os.path.join(ROOT, "build", "libmok.so")
    p = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert os.path.samefile(p.stdout.split()[1], env["MOK_LIBRARY"])


def pc_flags(prefix):
    """--cflags --libs of mok.pc: from pkg-config when installed, else read from the file."""
    pcdir = os.path.join(prefix, "lib", "pkgconfig")
    if shutil.which("pkg-config"):
        env = dict(os.environ, PKG_CONFIG_PATH=pcdir)
        out = subprocess.run(["pkg-config", "--cflags", "--libs", "mok"], env=env,
                             capture_output=True, text=True, check=True).stdout
        ver = subprocess.run(["pkg-config", "--modversion", "mok"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
        return out.split(), ver
    vars_, fields = {}, {}
    for line in open(os.path.join(pcdir, "mok.pc")):
        line = re.sub(r"\$\{(\w+)\}", lambda m: vars_[m.group(1)], line.strip())
        if "=" in line and (":" not in line or line.index("=") < line.index(":")):
            k, v = line.split("=", 1)
            vars_[k.strip()] = v.strip()
        elif ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip()] = v.strip()
    return (fields["Cflags"] + " " + fields["Libs"]).split(), fields["Version"]


PROGRAM = r"""
#include <stdio.h>
#include "mok.h"
int main(void) {
  mok_comm_t comm;
  mok_layer_t layer;
  mok_layer_desc_t d = MOK_LAYER_DESC_INIT;
  d.hidden = 128, d.intermediate = 128, d.num_experts = 4, d.top_k = 2, d.max_tokens = 8;
  if (mok_comm_create_local(&comm, MOK_DEVICE_CPU) != MOK_SUCCESS) return puts(mok_last_error()), 1;
  if (mok_layer_create(&layer, comm, &d) != MOK_SUCCESS) return puts(mok_last_error()), 1;
  mok_layer_destroy(layer);
  mok_comm_destroy(comm);
  printf("mok %d ok\n", mok_version());
  return mok_version() != MOK_VERSION_CODE;
}
"""


def test_make_install_and_pkg_config_build_a_c_program(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if shutil.which("make") is None or cc is None:
        pytest.skip("make or a C compiler is not installed")
    prefix = str(tmp_path / "prefix")
    run_or_skip(["make", "install", f"PREFIX={prefix}"], "make install", cwd=ROOT)
    for f in ("include/mok.h", "lib/libmok.so", "lib/pkgconfig/mok.pc"):
        assert os.path.isfile(os.path.join(prefix, f)), f
    flags, version = pc_flags(prefix)
    assert version == header_version()
    assert f"-I{prefix}/include" in flags and f"-L{prefix}/lib" in flags and "-lmok" in flags
    src, exe = tmp_path / "app.c", tmp_path / "app"
    src.write_text(PROGRAM)
    # Compiled outside the source tree, so only the installed header can be found.
    p = subprocess.run([cc, "-std=c11", "-Wall", "-Werror", str(src), "-o", str(exe)] + flags,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    env = dict(os.environ, LD_LIBRARY_PATH=f"{prefix}/lib")
    p = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "mok 200 ok", (p.stdout, p.stderr)
    if shutil.which("ldd"):
        out = subprocess.run(["ldd", str(exe)], env=env, capture_output=True, text=True).stdout
        assert f"{prefix}/lib/libmok.so" in out, out  # the installed copy, not build/'s
    run_or_skip(["make", "uninstall", f"PREFIX={prefix}"], "make uninstall", cwd=ROOT)
    assert not any(os.path.exists(os.path.join(prefix, f))
                   for f in ("include/mok.h", "lib/libmok.so", "lib/pkgconfig/mok.pc"))


def test_a_library_of_another_version_is_refused(tmp_path, monkeypatch):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / "libmok_old.so"
    src = tmp_path / "old.c"
    src.write_text("int mok_version(void) { return 100; }\n")  # 0.1.0, and nothing else
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(so)], check=True, timeout=60)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import mok
    monkeypatch.setattr(mok._lib, "_find_library", lambda: str(so))
    with pytest.raises(mok.MokError) as e:
        mok._lib.load()
    assert e.value.code == "VERSION_MISMATCH"
    assert "is MoK 0.1.0" in str(e.value) and "mok 0.2.0" in str(e.value), str(e.value)
