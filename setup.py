"""setup.py: the build step of `pip install .` (pyproject.toml holds the metadata).

build_py, after copying python/mok:
- runs `make build/libmok.so`, with the CUDA code when nvcc is on the PATH, else `make NVCC=`
  (CPU-only); make's dependency tracking reuses an up-to-date build/libmok.so;
- copies the library into the package, next to _lib.py, which loads it before any other;
- replaces the package's _version.py (which reads include/mok.h, absent from an installed
  package) with the numbers it reads from the header now.
setuptools' own build files go to build/python, beside make's (`make clean` removes both).
"""
import os
import runpy
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = runpy.run_path(os.path.join(ROOT, "python", "mok", "_version.py"))["VERSION"]


class BuildPy(build_py):
    def run(self):
        super().run()
        cmd = ["make", f"-j{os.cpu_count() or 1}", "build/libmok.so"]
        if shutil.which("nvcc") is None:
            cmd.append("NVCC=")
        self.announce("running " + " ".join(cmd), level=2)
        subprocess.check_call(cmd, cwd=ROOT)
        pkg = os.path.join(self.build_lib, "mok")
        self.copy_file(os.path.join(ROOT, "build", "libmok.so"), os.path.join(pkg, "libmok.so"))
        version_py = os.path.join(pkg, "_version.py")
        if os.path.exists(version_py):
            os.remove(version_py)  # may be a hard link to the source tree's file
        with open(version_py, "w") as f:
            f.write('"""_version.py: MOK_VERSION_* of include/mok.h, written by setup.py at build '
                    'time."""\n' f"VERSION = {tuple(VERSION)!r}\n")


class BinaryDistribution(Distribution):
    """libmok.so is native code: the wheel is platform-specific, not pure Python."""

    def has_ext_modules(self):
        return True


os.makedirs(os.path.join(ROOT, "build", "python"), exist_ok=True)
setup(
    version=".".join(map(str, VERSION)),
    cmdclass={"build_py": BuildPy},
    distclass=BinaryDistribution,
    options={"build": {"build_base": "build/python"}, "egg_info": {"egg_base": "build/python"}},
)
