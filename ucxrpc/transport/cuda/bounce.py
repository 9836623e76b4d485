"""Device buffers CUDA IPC can share, for a process whose torch allocator
makes none.

With expandable segments or the ``cudaMallocAsync`` backend, torch's device
memory is of a kind UCX's ``cuda_ipc`` cannot export
(:func:`.context.ipc_shareable`).  Rather than stage such tensors through
host memory (5 GB/s on an H200 where a device copy moves 2 TB/s), a sender
copies each device buffer into one of these on a side stream and hands UCX
that, and a receiver lands each in one and copies it into the tensor torch
allocated.  They come from a pool
of CuPy's own, which takes its memory with plain ``cudaMalloc``: CUDA IPC
shares it, and UCX's cuda_ipc caches the peer's mapping of a block reused
from the pool instead of opening a new one each time.  A buffer goes back to
the pool when its tensor is dropped: the sender's once UCX completed the
send, the receiver's once its copy out ran (waited for: torch records no
stream on memory it did not allocate), so no stream can still use it.  The
pool keeps the blocks it gave out for the next message (the peer's cached
mapping of them is what makes reuse cheap), so a worker holds about as much
device memory in it as it had in flight at most; a worker's shutdown hands
back what is not in use (:func:`free`).  Without CuPy the worker stages
device memory instead: :func:`way` decides, for the transport and for
``ucxrpc info``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..._states import StateEnum
from . import context as cudactx

__all__ = ["Way", "free", "take", "usable", "way"]


class Way(StateEnum):
    """How a worker hands its device memory to UCX where UCX loaded cuda_ipc."""

    AS_IS = "as-is"      # CUDA IPC shares it
    BOUNCED = "bounced"  # through buffers that it can share (this module)
    STAGED = "staged"    # through pinned host memory: no CuPy for bouncing


def way(device: int) -> tuple[Way, str]:
    """How device memory on ``device`` goes to UCX's cuda_ipc, and why.

    Raises:
        OSError, RuntimeError: CUDA could not be asked.
    """
    shareable, why = cudactx.ipc_shareable(device)
    if shareable:
        return Way.AS_IS, why
    ok, bounce_why = usable()
    if ok:
        return Way.BOUNCED, (f"{why}: CUDA tensors go through device buffers it can share "
                             f"({bounce_why}), one device copy each side")
    return Way.STAGED, (f"{why}, and {bounce_why}: CUDA tensors are staged through pinned "
                        "host memory")


def usable() -> tuple[bool, str]:
    """Whether buffers can be taken here, and why not."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # missing, or a CuPy that cannot reach the driver
        return False, f"CuPy is not usable ({type(exc).__name__}: {exc})"
    return True, "CuPy's cudaMalloc pool"


_pools: dict[int, Any] = {}
_lock = threading.Lock()


def _pool(device: int) -> Any:
    with _lock:
        pool = _pools.get(device)
        if pool is None:
            import cupy

            # A pool of our own: the user's CuPy arrays keep theirs, and a
            # limit set on the default pool does not apply to buffers in flight.
            with cupy.cuda.Device(device):
                pool = _pools[device] = cupy.cuda.MemoryPool()
        return pool


def take(nbytes: int, device: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` on ``device`` in memory CUDA IPC can
    share; the memory returns to the pool when the tensor is dropped."""
    import cupy

    with cupy.cuda.Device(device):
        arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=_pool(device).malloc(nbytes))
    # torch keeps ``arr`` (and so the pool's block) alive as long as the tensor.
    return torch.as_tensor(arr, device=torch.device("cuda", device))


def free() -> None:
    """Give the blocks that no message uses back to CUDA (at shutdown)."""
    with _lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.free_all_blocks()
