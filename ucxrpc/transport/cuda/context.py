"""A current CUDA context for UCX, on the threads that call into it.

UCX's CUDA transports work through whatever CUDA context is current on the
calling thread, and none of them makes one: ``cuda_copy`` allocates its
pipeline fragments only in an *active* primary context, arming the worker
for epoll queries CUDA events in the current one, and a context current at
``ucp_init`` is how the CUDA resources learn which GPU they sit on (UCX
1.21: ``cuda_copy_md.c``, ``cuda_iface.c``).  torch's own agent
initialises CUDA before it starts for the same reason, and ucxx's progress
thread makes a context current first thing.

A process that only ever receives CUDA tensors into host memory (a
``"cuda:0": "cpu"`` device map) never touches CUDA itself, so the
transport does it: :func:`make_current` before the UCX context exists and
again at the start of the progress thread.  It retains the device's
*primary* context, the one torch and every CUDA runtime user share, so no
second context is made; it is never released (it lives as long as the
process, as torch's does).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Sequence

import torch

__all__ = ["Borrowed", "ipc_shareable", "make_current", "private_stream", "wanted_device"]

_CUDA_NAMES = ("cuda", "gdr")  # transports= names that bring UCX's CUDA support


def wanted_device(declared: Sequence[torch.device | str | int],
                  transports: Sequence[str] | None) -> int | None:
    """The CUDA device whose context UCX should see, or None for none.

    None when torch sees no GPU (a CPU-only build or machine: no CUDA call
    is made) or ``transports`` leaves UCX's CUDA support out; else the first
    CUDA device this worker declared, or the current one.  Any process with
    a GPU gets one, as torch's agent does, because a peer may send it CUDA
    tensors whatever it declared.
    """
    if transports is not None and not any(
            name.startswith(_CUDA_NAMES) for t in transports for name in t.split(",")):
        return None
    if not torch.cuda.is_available():
        return None
    for d in declared:
        dev = torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
        if dev.type == "cuda":
            return dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.cuda.current_device()


def uses_device_memory(transports: Sequence[str] | None) -> bool:
    """Whether UCX in this process must be set up for device memory: a GPU
    is usable and ``transports`` keeps UCX's CUDA support (as
    :func:`wanted_device` decides, for a worker that declared no device)."""
    return wanted_device((), transports) is not None


def make_current(device: int) -> None:
    """Make ``device``'s primary context current on the calling thread.

    Raises:
        RuntimeError: the CUDA driver refused, naming the call and its code.
    """
    # The driver API, not torch: torch only binds a context to a thread at
    # its first runtime call that needs one, and UCX asks the driver
    # (cuCtxGetCurrent) before torch may have made any on this thread.
    lib = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_int()
    ctx = ctypes.c_void_p()
    for call, args in (("cuInit", (0,)),
                       ("cuDeviceGet", (ctypes.byref(handle), device)),
                       ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), handle)),
                       ("cuCtxSetCurrent", (ctx,))):
        code = getattr(lib, call)(*args)
        if code != 0:
            raise RuntimeError(f"{call} failed with CUDA error {code} making cuda:{device}'s "
                               "context current for UCX")


_local = threading.local()
_driver: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _push(ctx: ctypes.c_void_p) -> int:
    """cuCtxPushCurrent as cuda.h names it: the ``_v2`` entry point.  The
    bare symbol is the pre-CUDA-4 ABI, which the 580 driver (CUDA 13.0)
    answers with CUDA_ERROR_INVALID_CONTEXT (201) for a primary context:
    every borrowed context failed on the first GPU run of this code (an
    H200, 2026-11-29)."""
    return int(_lib().cuCtxPushCurrent_v2(ctx))


def _pop() -> int:
    """cuCtxPopCurrent_v2, as cuda.h names it (see :func:`_push`)."""
    return int(_lib().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())))


def _primary(device: int) -> ctypes.c_void_p:
    """``device``'s primary context, retained (once per process and device:
    it lives as long as the process, as torch's does)."""
    ctxs = _primaries
    ctx = ctxs.get(device)
    if ctx is None:
        lib, handle, ctx = _lib(), ctypes.c_int(), ctypes.c_void_p()
        for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(handle), device)),
                           ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), handle))):
            code = getattr(lib, call)(*args)
            if code != 0:
                raise RuntimeError(f"{call} failed with CUDA error {code} for cuda:{device}")
        ctxs[device] = ctx
    return ctx


_primaries: dict[int, ctypes.c_void_p] = {}


class Borrowed:
    """A ``with`` block in which a CUDA context is current on the calling
    thread, for a caller that drives UCX (progresses it to wait for its
    reply): UCX's CUDA transports work through the calling thread's
    context.  A thread with a context of its own keeps it (a thread that
    used CUDA has the one torch made current for its device; switching it
    would switch torch's current device under the user).  A thread with
    none has ``device``'s primary context pushed for the block and popped
    after it, so the thread is left as it was found: its torch device
    (``cudaGetDevice``) does not change for good.  Whether a thread has a
    context of its own is asked once per thread.

    Raises (on entry):
        RuntimeError: the CUDA driver refused, naming the call and its code.
    """

    __slots__ = ("_device", "_pushed", "_always")

    def __init__(self, device: int, always: bool = False) -> None:
        self._device = device
        self._pushed = False
        #: Push even over a context of the thread's own (and pop it again):
        #: for work that must run under ``device``'s context whatever the
        #: thread's is (the transport's start, on the user's init_rpc thread).
        self._always = always

    def __enter__(self) -> None:
        if self._always or not self._own():
            code = _push(_primary(self._device))
            if code != 0:
                raise RuntimeError(f"cuCtxPushCurrent failed with CUDA error {code} for "
                                   f"cuda:{self._device}")
            self._pushed = True

    @staticmethod
    def _own() -> bool:
        """Whether this thread has a context of its own (asked once)."""
        own: bool | None = getattr(_local, "own", None)
        if own is None:
            ctx = ctypes.c_void_p()
            code = _lib().cuCtxGetCurrent(ctypes.byref(ctx))
            own = _local.own = code == 0 and bool(ctx.value)
        return own

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            self._pushed = False
            _pop()


def private_stream(device: int) -> int:
    """A CUDA stream of ucxrpc's own on ``device`` (``cuStreamCreate``,
    non-blocking, never destroyed), as the address torch's
    ``ExternalStream`` takes: one no user code can be handed, as it can
    any of the streams torch pools.

    Raises:
        RuntimeError: the CUDA driver refused, naming the call and its code.
    """
    stream = ctypes.c_void_p()
    with Borrowed(device, always=True):
        code = _lib().cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING)
    if code != 0:
        raise RuntimeError(f"cuStreamCreate failed with CUDA error {code} on cuda:{device}")
    return int(stream.value or 0)


_CU_STREAM_NON_BLOCKING = 1


# cuPointerGetAttribute's selector (cuda.h; the driver API keeps it stable).
_IS_LEGACY_CUDA_IPC_CAPABLE = 10


def ipc_shareable(device: int) -> tuple[bool, str]:
    """Whether torch's allocator gives memory on ``device`` that another
    process can map through CUDA IPC, and why not.

    UCX's ``cuda_ipc`` shares plain ``cudaMalloc`` memory, and of memory
    made by CUDA's virtual memory API only allocations exported as fabric
    handles (UCX 1.21, ``cuda_ipc_md.c``).  torch's expandable segments and
    its ``cudaMallocAsync`` backend make neither, and UCX then falls back
    inside the rendezvous: 0.5 GB/s and progress calls of 1.4-2.1 s for 64
    MiB-1 GiB on an H200, against 35-339 GB/s through buffers that can be
    shared (:mod:`.bounce`; 2026-11-27, benchmarks/runs/AC.md).  A
    probe tensor asks the driver, so a setting made at run time
    (``torch.cuda.memory._set_allocator_settings``) counts as well as
    PYTORCH_CUDA_ALLOC_CONF.  In a worker that never touched CUDA itself the
    probe is torch's first CUDA allocation there.  It is made with
    ``device``'s context pushed, and popped after: the caller is the
    transport's start, on the user's ``init_rpc`` thread, where torch's lazy
    initialisation would otherwise bind a context for good (the first GPU
    run of this code, an H200, 2026-11-29).

    Raises:
        RuntimeError: the CUDA driver refused to push the context.
    """
    lib = _lib()
    with Borrowed(device, always=True):
        probe = torch.empty(1, dtype=torch.uint8, device=torch.device("cuda", device))
    flag = ctypes.c_int(0)
    code = lib.cuPointerGetAttribute(ctypes.byref(flag), _IS_LEGACY_CUDA_IPC_CAPABLE,
                                     ctypes.c_uint64(probe.data_ptr()))
    if code != 0:
        return False, f"cuPointerGetAttribute failed with CUDA error {code}"
    if flag.value:
        return True, "torch's allocator gives memory CUDA IPC shares"
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return False, ("torch's allocator gives memory CUDA IPC cannot share (expandable segments "
                   "or cudaMallocAsync" + (f"; PYTORCH_CUDA_ALLOC_CONF={conf!r}" if conf else "")
                   + ")")
