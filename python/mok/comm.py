"""comm.py: mok.Comm, a communicator handle (mok_comm_t of include/mok.h), and mok.unique_id.

A layer is created on a communicator of W ranks and then holds EL = E / W experts: rank r holds
global experts [r EL, (r + 1) EL). The constructors, one per C constructor:

    Comm.local(device)                        W = 1 on "cpu" (the reference) or a GPU; no NCCL
    Comm.virtual(nranks, device)              W ranks on ONE GPU, for testing: a list, rank order
    Comm.from_unique_id(uid, rank, n, device) NCCL bootstrapped from mok.unique_id()'s 128 bytes
    Comm.from_process_group(group, device)    the same, the id sent over torch.distributed

A communicator must outlive its layers: a mok.Layer keeps a reference to the Comm it was created
on, and close() raises MokError (INVALID_VALUE, the C library's message) while layers created on
it are alive. Destroying an NCCL communicator is collective: close its layers, then it, on every
rank at the same point (garbage collection at different times on different ranks may wait for
the others). Expert-parallel rules (include/mok.h): every rank creates its layers in the same
order, and every rank calls forward (and backward) of each layer at every step, in the same
order, with its own number of tokens (0 is fine). Virtual ranks are driven by one thread, each
rank's calls on its own CUDA stream: its kernels wait for the other ranks', and no call blocks
on the host.

device: "cpu", "cuda", "cuda:N", a torch.device, or an int N >= 0 (a CUDA ordinal, as the C
API takes it).
"""
import contextlib
import ctypes

from . import _check
from ._lib import DEVICE_CPU, MokError, UniqueId, check, lib

UNIQUE_ID_BYTES = ctypes.sizeof(UniqueId)  # 128


def _ordinal(device):
    """A CUDA ordinal for an int N >= 0, else _check.device_ordinal's reading (DEVICE_CPU for
    "cpu")."""
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise MokError("INVALID_VALUE", f"device {device}: a CUDA ordinal is >= 0 (the CPU "
                                            f"is 'cpu')")
        return device
    return _check.device_ordinal(device)


def _gpu_ordinal(device, what):
    """_ordinal(device), which must name a GPU: expert parallelism runs on GPUs only."""
    ordinal = _ordinal(device)
    if ordinal == DEVICE_CPU:
        raise MokError("INVALID_VALUE", f"{what}: device 'cpu': expert-parallel ranks live on "
                                        f"GPUs (an ordinal N or 'cuda:N'); the CPU reference "
                                        f"runs W = 1 only (mok.Comm.local('cpu'))")
    return ordinal


def unique_id():
    """128 bytes from mok_get_unique_id (NCCL's unique id) for Comm.from_unique_id: made on one
    rank, sent to every rank. Loads NCCL on first use (import torch first: the process's first
    libnccl wins); MokError NOT_AVAILABLE where this build or machine has no NCCL."""
    uid = UniqueId()
    check(lib().mok_get_unique_id(ctypes.byref(uid)))
    return bytes(uid)


class Comm:
    """A MoK communicator: rank `rank` of `size` ranks on `device` ("cpu" or "cuda:N"). Make one
    with the class methods; close() (or garbage collection) destroys it once no layer uses it."""

    def __init__(self, handle):
        """Wraps a mok_comm_t handle (a ctypes.c_void_p) that this object then owns; use the
        class methods instead."""
        if not isinstance(handle, ctypes.c_void_p) or not handle:
            raise MokError("INVALID_VALUE", "mok.Comm(handle): use Comm.local, Comm.virtual, "
                                            "Comm.from_unique_id or Comm.from_process_group")
        self._lib, self._handle, self._closing = lib(), handle, False
        self.rank, self.size, self.ordinal = (self._query(f) for f in (
            self._lib.mok_comm_rank, self._lib.mok_comm_size, self._lib.mok_comm_device))
        self.device = _check.device_name(self.ordinal)

    def _query(self, fn):
        v = ctypes.c_int()
        check(fn(self._handle, ctypes.byref(v)))
        return v.value

    @classmethod
    def local(cls, device="cpu"):
        """W = 1 on `device`: what a Layer creates for itself when given no comm."""
        h = ctypes.c_void_p()
        check(lib().mok_comm_create_local(ctypes.byref(h), _ordinal(device)))
        return cls(h)

    @classmethod
    def virtual(cls, nranks, device):
        """[rank 0, ..., rank nranks - 1]: W = nranks virtual ranks on the one GPU `device`, whose
        peers are buffers on that GPU (mok_comm_create_virtual), for testing expert-parallel code
        without W GPUs. Each rank's calls must run on its own stream (torch.cuda.stream(s[r]))."""
        if isinstance(nranks, bool) or not isinstance(nranks, int):
            raise MokError("INVALID_VALUE", f"Comm.virtual: nranks {nranks!r}, expected an int")
        ordinal = _gpu_ordinal(device, "Comm.virtual")
        if nranks < 1:  # the C call checks the upper bound; an array of 0 cannot be passed
            raise MokError("INVALID_VALUE", f"Comm.virtual: {nranks} ranks, expected at least 1")
        out = (ctypes.c_void_p * nranks)()
        check(lib().mok_comm_create_virtual(out, nranks, ordinal))
        return [cls(ctypes.c_void_p(h)) for h in out]

    @classmethod
    def from_unique_id(cls, uid, rank, nranks, device):
        """Rank `rank` of `nranks` over NCCL (mok_comm_create_unique_id), from the 128 bytes of one
        mok.unique_id() that every rank received. Collective: every rank calls it."""
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != UNIQUE_ID_BYTES:
            got = f"{len(uid)} bytes" if isinstance(uid, (bytes, bytearray)) else type(uid).__name__
            raise MokError("INVALID_VALUE", f"Comm.from_unique_id: uid is {got}, expected the "
                                            f"{UNIQUE_ID_BYTES} bytes of mok.unique_id()")
        ordinal = _gpu_ordinal(device, "Comm.from_unique_id")
        h = ctypes.c_void_p()
        check(lib().mok_comm_create_unique_id(ctypes.byref(h),
                                              ctypes.byref(UniqueId.from_buffer_copy(bytes(uid))),
                                              rank, nranks, ordinal))
        return cls(h)

    @classmethod
    def from_process_group(cls, group=None, device=None):
        """This process's rank of the torch.distributed group (None: the default group) as a MoK
        communicator over NCCL: group rank 0 makes a unique id, broadcast_object_list sends it
        (any backend), and every rank calls from_unique_id with its group rank. Collective.
        device: the rank's GPU; None is torch.cuda.current_device(). MoK creates an NCCL
        communicator of its own; it never takes torch's."""
        import torch
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise MokError("INVALID_VALUE", "Comm.from_process_group: torch.distributed is not "
                                            "initialized (torch.distributed.init_process_group)")
        ordinal = _gpu_ordinal("cuda" if device is None else device, "Comm.from_process_group")
        rank, nranks = dist.get_rank(group), dist.get_world_size(group)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        box = [None]
        if rank == 0:
            try:
                box[0] = unique_id()
            except MokError as e:  # every rank must learn it, or the others wait in broadcast
                box[0] = e.code, str(e)
        # an NCCL group sends the object from the current device: make it this rank's GPU
        here = torch.cuda.device(ordinal) if torch.cuda.is_available() else contextlib.nullcontext()
        with here:
            dist.broadcast_object_list(box, src=src, group=group)
        if isinstance(box[0], tuple):
            raise MokError(box[0][0], f"Comm.from_process_group: group rank 0's "
                                      f"mok.unique_id(): {box[0][1]}")
        return cls.from_unique_id(box[0], rank, nranks, ordinal)

    def close(self):
        """Destroys the communicator (collective for NCCL ones). Raises MokError INVALID_VALUE,
        leaving it intact, while layers created on it are alive: close them first."""
        if self._handle:
            check(self._lib.mok_comm_destroy(self._handle))
            self._handle = ctypes.c_void_p()

    def _layer_closed(self):
        """A layer on this comm was destroyed: finish a close that __del__ could not do."""
        if self._closing:
            self._try_close()

    def _try_close(self):
        try:
            self.close()
        except MokError:  # layers still alive; the last one's close finishes (_layer_closed)
            pass

    def __del__(self):
        # Layers hold a reference, so this runs after them, except when the garbage collector
        # frees a cycle holding both in any order.
        self._closing = True
        if getattr(self, "_handle", None):
            self._try_close()

    def __repr__(self):
        state = "" if self._handle else ", closed"
        return f"mok.Comm(rank={self.rank}, size={self.size}, device={self.device!r}{state})"
