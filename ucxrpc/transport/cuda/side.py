"""This worker's CUDA side of the transport: which device UCX works
through, its context current where UCX is called, how this worker's device
memory goes to UCX, and where received device buffers are allocated.

The transport (engine.py) holds one :class:`CudaSide`; everything here is
CUDA plumbing it used to carry itself.  A worker with no usable GPU, or no
CUDA transport, has a side whose ``device`` is None: every method is then a
no-op or says so.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Callable

import torch

from ... import _cuda
from . import bounce, context

__all__ = ["CudaSide", "alloc"]

logger = logging.getLogger(__name__)

# Per CUDA device index: an empty uint8 tensor to allocate receives from
# (new_empty: torch.empty with a device string parsed it each time, 19 µs of
# a 16 MiB call's frame handling on an H200), and the stream they are
# allocated on.  torch's allocator hands a block freed on a stream to the
# next allocation on that stream at once, trusting that whoever writes it
# queues on that stream after the work that still reads it; UCX writes on
# streams of its own.  Allocated on the thread's current stream (the
# default one, which user code mostly runs on), a receive could land in a
# tensor the user just freed while kernels queued before the free still
# read it.  On a stream that only allocates, no queued work ever reads a
# block it hands out: a received tensor's uses on other streams are
# recorded on them (a served call's pool streams, a CUDA-aware future's
# waiter), so its block comes back only after those.  The stream is one of
# ucxrpc's own (context.py, private_stream), not one of torch's pooled
# streams, which torch hands out round-robin to user code too: a user
# kernel on it reading a received tensor would break that premise.
_RECEIVE_ALLOCS: dict[int, tuple[torch.Tensor, tuple[int, int, int], Any]] = {}


def alloc(nbytes: int, device: int) -> torch.Tensor:
    """Device memory for a receive, from torch's allocator on a stream of
    its own (:data:`_RECEIVE_ALLOCS`)."""
    entry = _RECEIVE_ALLOCS.get(device)
    if entry is None:
        stream = torch.cuda.ExternalStream(context.private_stream(device),
                                           device=torch.device("cuda", device))
        proto = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
        entry = _RECEIVE_ALLOCS[device] = (proto, _cuda.key_of(stream), stream)
    with _cuda.StreamScope([entry[1]]):
        return entry[0].new_empty(nbytes)


class CudaSide:
    """The CUDA device UCX works through here (``device``; None: none).

    Args:
        cuda_devices: the CUDA devices this worker declared; where a GPU is
            usable and a CUDA transport allowed, the first is UCX's
            (:func:`.context.wanted_device`).
        transports: the job's UCX transports (None: UCX's choice).
    """

    def __init__(self, cuda_devices: Sequence[torch.device | str | int],
                 transports: Sequence[str] | None) -> None:
        self.device = context.wanted_device(cuda_devices, transports)

    def make_current(self) -> str:
        """Make the CUDA context current on this thread if there is one to
        make; what happened, in words.  A failure is logged, not raised:
        host memory still moves, and a CUDA transfer fails with UCX's own
        error."""
        if self.device is None:
            return "none (no GPU usable, or no CUDA transport)"
        try:
            context.make_current(self.device)
        except (OSError, RuntimeError) as exc:
            logger.warning("UCX may fail to move CUDA memory: %s", exc)
            return f"failed: {exc}"
        return f"cuda:{self.device}"

    @contextlib.contextmanager
    def lent(self) -> Iterator[str]:
        """A ``with`` block with the device's context current on this thread
        (UCX's CUDA transports open under the calling thread's), and the
        thread's own context, or none, current again after it: the thread
        that starts the transport is the user's (``init_rpc``'s), and its
        current context is its torch device.  Yields what happened, in
        words, as :meth:`make_current` says it; a failure is logged, not
        raised."""
        if self.device is None:
            yield "none (no GPU usable, or no CUDA transport)"
            return
        pushed = context.Borrowed(self.device, always=True)
        try:
            pushed.__enter__()
        except (OSError, RuntimeError) as exc:
            logger.warning("UCX may fail to move CUDA memory: %s", exc)
            yield f"failed: {exc}"
            return
        try:
            yield f"cuda:{self.device}"
        finally:
            pushed.__exit__()

    def memory_way(self, loaded: Collection[str]) -> bounce.Way:
        """How this worker's device memory goes to UCX (:func:`.bounce.way`),
        where UCX loaded cuda_ipc (``loaded``: its transports): torch's
        allocator may make memory CUDA IPC cannot share, and UCX would pick
        cuda_ipc for a peer on this host and fall back inside each
        transfer.  Bouncing or staging, then, is for every pipe: a worker
        publishes one word, not one per peer."""
        if self.device is None or "cuda_ipc" not in loaded:
            return bounce.Way.AS_IS
        try:
            memory_way, why = bounce.way(self.device)
        except (OSError, RuntimeError) as exc:
            logger.warning("could not ask CUDA whether memory is shareable: %s", exc)
            return bounce.Way.AS_IS
        if memory_way is not bounce.Way.AS_IS:
            logger.warning("%s (to and from this worker)", why)
        return memory_way

    def drive(self, drive: Callable[[Callable[[], bool]], bool],
              done: Callable[[], bool]) -> bool:
        """``drive(done)`` on the calling thread, a CUDA context current
        meanwhile where the thread had none, and none again after (UCX's
        CUDA transports work through the calling thread's:
        :class:`.context.Borrowed`); False, driving nothing, where no
        context can be had."""
        if self.device is None:
            return drive(done)
        borrowed = context.Borrowed(self.device)
        try:
            borrowed.__enter__()
        except (OSError, RuntimeError) as exc:
            logger.debug("not driving UCX on this thread: %s", exc)
            return False
        try:
            return drive(done)
        finally:
            borrowed.__exit__()
