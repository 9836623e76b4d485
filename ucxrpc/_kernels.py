"""Pack and unpack many tensors into one byte buffer: one copy per side.

A message with many small tensors (gradients, parameter shards) costs the
transport per buffer; packed, it moves as one.  On CUDA the copy is one
launch of ``ucxrpc/kernels/multi_copy.cu``, compiled with CuPy at first use;
on the CPU it is one ``memmove`` per tensor.  CuPy is imported only when a
CUDA tensor is packed, so CPU-only runs never need it.

Where CuPy is missing, or installed but not working (no NVRTC, a CUDA
major or driver it does not support), :func:`cuda_problem` says why, once
per process in a warning: senders then send small CUDA tensors one by one
(:mod:`.transport.cuda.staging`), and a pack that arrives from a peer is still
cut apart, with one ``copy_`` per tensor instead of one launch.

The layout: tensors back to back in the order given, each at an offset
aligned to :data:`ALIGN` bytes, so every dtype can view the buffer in place.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import threading
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["ALIGN", "PackedSpec", "cuda_problem", "cut", "kernel_source", "kernel_usable",
           "layout", "multi_copy", "pack", "unpack"]

logger = logging.getLogger(__name__)

ALIGN = 64
_CHUNK = 64 * 1024  # bytes per CUDA block
_THREADS = 256
_lock = threading.Lock()
_warn_lock = threading.Lock()
_warned = False


@dataclass(frozen=True, slots=True)
class PackedSpec:
    """Where one tensor sits in a pack, and what it is."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[PackedSpec], int]:
    """The specs of ``tensors`` packed in order, and the pack's size in bytes."""
    specs, end = [], 0
    for t in tensors:
        offset = -(-end // ALIGN) * ALIGN
        specs.append(PackedSpec(offset, t.dtype, tuple(t.shape)))
        end = offset + t.nbytes
    return specs, end


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[PackedSpec]]:
    """One uint8 buffer holding ``tensors`` (all on one device) and their specs.

    CUDA work is enqueued on the current stream.
    """
    if not tensors:
        return torch.empty(0, dtype=torch.uint8), []
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("pack takes tensors on one device")
    srcs = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    specs, size = layout(srcs)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    if kernel_usable(device):
        base = buf.data_ptr()
        multi_copy([t.data_ptr() for t in srcs], [base + s.offset for s in specs],
                   [s.nbytes for s in specs], device)
    else:
        for t, s in zip(srcs, specs):
            if s.nbytes:
                buf[s.offset:s.offset + s.nbytes].copy_(_as_bytes(t))
    # The sources must live until the copy ran (CUDA: the caching allocator
    # may hand their memory out again before the stream reaches the kernel).
    if device.type == "cuda":
        for t in srcs:
            t.record_stream(torch.cuda.current_stream(device))
    return buf, specs


def unpack(buf: torch.Tensor, specs: Sequence[PackedSpec]) -> list[torch.Tensor]:
    """Fresh tensors with the contents ``pack`` put in ``buf`` (same device)."""
    out = [torch.empty(s.shape, dtype=s.dtype, device=buf.device) for s in specs]
    for s in specs:
        if s.offset + s.nbytes > buf.numel():
            raise ValueError(f"pack of {buf.numel()} bytes is too small for a tensor at "
                             f"offset {s.offset} of {s.nbytes} bytes")
    cut(buf, [s.offset for s in specs], out)
    return out


def cut(buf: torch.Tensor, offsets: Sequence[int], out: Sequence[torch.Tensor]) -> None:
    """Copy the bytes at ``offsets`` in ``buf`` into the contiguous tensors
    ``out`` (same device; each takes its own size): one launch on CUDA where
    the kernel works, else one ``copy_`` per tensor.  Work is enqueued on
    the current stream."""
    if kernel_usable(buf.device):
        base = buf.data_ptr()
        multi_copy([base + o for o in offsets], [t.data_ptr() for t in out],
                   [t.nbytes for t in out], buf.device)
        return
    for o, t in zip(offsets, out):
        if t.nbytes:
            _as_bytes(t).copy_(buf[o:o + t.nbytes])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def kernel_usable(device: torch.device) -> bool:
    """Whether packs on ``device`` are copied with one launch (always on the
    CPU).  The first time CUDA's cannot, one warning says why."""
    if device.type != "cuda":
        return True
    reason = cuda_problem(device.index or 0)
    if reason is None:
        return True
    global _warned
    with _warn_lock:
        first, _warned = not _warned, True
    if first:
        logger.warning("ucxrpc cannot pack CUDA tensors with its kernel: %s. Small CUDA "
                       "tensors are sent one by one, and packs from peers are cut apart "
                       "with one copy per tensor.", reason)
    return False


@functools.cache
def cuda_problem(device_index: int = 0) -> str | None:
    """Why the pack kernel cannot run on ``cuda:device_index``; None when it can.

    Tried once per process and device: CuPy is installed, imports, sees the
    device and compiles :func:`kernel_source`'s ``multi_copy.cu``.  Never
    raises.
    """
    if importlib.util.find_spec("cupy") is None:
        return ("CuPy is not installed (pip install 'ucxrpc[cuda13]', or cupy-cuda12x "
                "with a CUDA 12 torch)")
    try:
        import cupy
    except Exception as exc:  # a broken install raises anything at import
        return f"CuPy is installed but does not import ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        if device_index >= count:
            return f"CuPy sees {count} CUDA devices, not cuda:{device_index}"
        _kernel(device_index)
    except Exception as exc:  # CUDA runtime, driver or NVRTC trouble
        return (f"CuPy {getattr(cupy, '__version__', '?')} does not work on "
                f"cuda:{device_index} ({type(exc).__name__}: {exc})")
    return None


def multi_copy(src: Sequence[int], dst: Sequence[int], nbytes: Sequence[int],
               device: torch.device) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]``, for all i.

    On CUDA, one kernel launch on the current stream; on the CPU, a memmove each.
    """
    if device.type != "cuda":
        for s, d, n in zip(src, dst, nbytes):
            if n:
                ctypes.memmove(d, s, n)
        return
    _cuda_multi_copy(src, dst, nbytes, device)


def _cuda_multi_copy(src: Sequence[int], dst: Sequence[int], nbytes: Sequence[int],
                     device: torch.device) -> None:
    import cupy  # only here: CPU-only runs never import it

    chunk_range, chunk_start = [], []
    for r, size in enumerate(nbytes):
        for start in range(0, size, _CHUNK):
            chunk_range.append(r)
            chunk_start.append(start)
    if not chunk_range:
        return
    n, c = len(src), len(chunk_range)
    # One upload for all five arrays: each cupy.asarray is a copy and a sync.
    table = np.concatenate([np.asarray(a, dtype=np.uint64)
                            for a in (src, dst, nbytes, chunk_range, chunk_start)])
    with cupy.cuda.Device(device.index or 0):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            d = cupy.asarray(table)
            args = (d[:n], d[n:2 * n], d[2 * n:3 * n], d[3 * n:3 * n + c], d[3 * n + c:],
                    np.int64(_CHUNK))
            # Freeing d right after is safe: CuPy's pool hands its memory
            # out again only in this stream's order, after the kernel.
            _kernel(device.index or 0)((c,), (_THREADS,), args)


def kernel_source(name: str = "multi_copy.cu") -> str:
    """The CUDA source ``ucxrpc/kernels/<name>``, read as package data of
    ``ucxrpc``: found in a wheel, an editable install and a checkout on
    ``PYTHONPATH`` alike (``ucxrpc/kernels`` is a directory, not a package)."""
    return resources.files("ucxrpc").joinpath("kernels").joinpath(name).read_text()


@functools.cache
def _kernel(device_index: int) -> Any:
    import cupy

    with _lock:
        source = kernel_source("multi_copy.cu")
        with cupy.cuda.Device(device_index):
            return cupy.RawModule(code=source).get_function("multi_copy")
