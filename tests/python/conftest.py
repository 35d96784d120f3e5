"""conftest.py: torch, when installed, is imported before mok.

NOTE: libmok.so links libnccl.so.2 at load time; loaded first, that (older) NCCL satisfies the
symbols libtorch_cuda.so needs from its own and `import torch` then fails (undefined symbol
ncclCommResume). Remove this once libmok.so loads NCCL at run time.
"""
try:
    import torch  # noqa: F401
except ImportError:
    pass
