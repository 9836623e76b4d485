"""Device buffers on a pipe: staged through host memory, and packed.

A CUDA buffer normally travels as one tag message from device memory to
device memory, and UCX picks the path (cuda_ipc / NVLink on one node,
GPUDirect RDMA across nodes, its own pipelined cuda_copy otherwise).  Two
things change that, both decided by the sender and written into the frame
(see :mod:`..wire.frame`):

* **Staging.**  When either end's UCX has no CUDA transport (``transports=``
  without ``cuda``, or a build without it), UCX must never see a device
  pointer: it would read it as host memory.  The sender copies the buffer
  into pinned host chunks on a side stream and sends each chunk as it is
  ready, so the copy of chunk k+1 overlaps the send of chunk k; the receiver
  copies each chunk to the device as it lands, again on a side stream, and
  hands the message up only once those copies are done.
* **Packing.**  A message with many small device buffers (gradients,
  parameter shards) pays UCX's per-message cost for each.  At
  :data:`PACK_MIN_COUNT` or more buffers of at most :data:`PACK_MAX_BYTES`
  between the same pair of devices, the sender packs them into one buffer
  with one kernel launch and the receiver unpacks them, also with one
  launch, into tensors of their own (views of one pack would be compacted,
  one copy each, when sent on: measured slower on the host path).  The
  launches need CuPy: where it is missing or broken, a sender does not pack
  (one warning says why) and a receiver cuts packs apart one copy each.

Setting ``UCXRPC_DEBUG_HOST_AS_DEVICE=1`` makes host buffers take these
paths as if they were device buffers (with plain host memory for chunks),
so that machines without a GPU test the same code; it is for tests only.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import _kernels
from . import bounce
from ..wire.frame import PACK, PACKED, REMOTE, STAGED, WRITTEN, BufferDesc
from ..wire.gather import Buffer

__all__ = ["CHUNK_BYTES", "PACK_MAX_BYTES", "PACK_MIN_COUNT", "Outgoing", "Landing",
           "bounced_landing", "debug_host_as_device", "finish", "landings", "needed", "plan"]

CHUNK_BYTES = 4 << 20
PACK_MIN_COUNT = 8
PACK_MAX_BYTES = 256 << 10
# Host buffers over this go out in chunks too, sent in place (no copy).  The
# chunks were introduced so that data arriving proved a sender alive; death
# is now the kernel's word (lifeline.py), and whether chunking still pays for
# itself is for the hot path's measurements to say.
HOST_CHUNK_OVER = 32 << 20
HOST_CHUNK_BYTES = 16 << 20


def debug_host_as_device() -> bool:
    return os.environ.get("UCXRPC_DEBUG_HOST_AS_DEVICE") == "1"


@functools.cache
def _side_stream(device_index: int, direction: str) -> Any:
    """A stream per device and direction, kept for the process's life, so
    staging copies neither wait for nor hold up the user's streams."""
    return torch.cuda.Stream(device=device_index)


def _host(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def chunk_spans(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk; an empty buffer is one empty chunk, so
    that every staged buffer is at least one tag message."""
    return [(s, min(s + chunk, nbytes)) for s in range(0, nbytes, chunk)] or [(0, 0)]


def receives(d: BufferDesc) -> int:
    """How many data-tag messages buffer ``d`` arrives in: none inline,
    inside a pack, read by address or written by the sender, one per chunk
    when staged, else one."""
    if d.inline or d.flags == PACKED or d.flags == REMOTE or d.flags == WRITTEN:
        return 0
    if d.flags & STAGED:
        return max(1, -(-d.nbytes // (d.arg << 10)))  # an empty buffer is one chunk too
    return 1


def _can_pack(device: torch.device) -> bool:
    """Whether buffers on ``device`` are packed: on CUDA only where the pack
    kernel works (CuPy installed and working; else one warning says why and
    they go one by one, as without packing).  The receiver cuts a pack
    apart with or without the kernel."""
    return _kernels.kernel_usable(device)


@dataclass
class Outgoing:
    """How one message's buffers go out: what the frame says about each, and
    the tensors to send for each buffer sent separately."""

    buffers: list[torch.Tensor]
    views: list[tuple[int, memoryview | None, int]]
    ways: list[tuple[int, int, int]]
    chunk: int
    host_as_device: bool = False
    staged_bytes: int = 0
    packed: int = 0
    #: Device buffers sent directly go through a buffer CUDA IPC can share
    #: (this process's own memory cannot be shared: bounce.py).
    bounce: bool = False
    bounced_bytes: int = 0

    def parts(self, i: int) -> Iterator[torch.Tensor]:
        """What to send for buffer ``i``: itself, or its host chunks in order,
        each yielded once its copy is complete (the copies of later chunks
        keep running meanwhile)."""
        buf = self.buffers[i]
        if not self.ways[i][0] & STAGED:
            if self.bounce and buf.is_cuda and buf.numel():
                self.bounced_bytes += buf.numel()
                yield _bounced(buf)
            else:
                yield buf
            return
        if not buf.is_cuda and not self.host_as_device:  # a large host buffer
            for start, end in chunk_spans(buf.numel(), HOST_CHUNK_BYTES):
                yield buf[start:end]
            return
        spans = chunk_spans(buf.numel(), self.chunk)
        if not buf.is_cuda:  # the debug path: same chunks, host copies
            for start, end in spans:
                part = _host(end - start, False)
                part.copy_(buf[start:end])
                yield part
            return
        stream = _side_stream(buf.device.index or 0, "out")
        staged = []
        with torch.cuda.stream(stream):
            for start, end in spans:
                part = _host(end - start, True)
                part.copy_(buf[start:end], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                staged.append((part, done))
        for part, done in staged:
            done.synchronize()
            yield part


def _bounced(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` copied into a buffer CUDA IPC can share, once the copy is done
    (the sender's pending work on ``buf`` is complete already: devices.py)."""
    out = bounce.take(buf.numel(), buf.device.index or 0)
    _copy_waited(out, buf, "out")
    return out


def _copy_waited(dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
    """``dst.copy_(src)`` on the side stream of ``direction``, waited for:
    torch records no stream on a bounce buffer's memory (it did not allocate
    it), so the copy is over before that goes back to the pool (30 us for
    64 MiB at the device's 2 TB/s)."""
    stream = _side_stream(dst.device.index or 0, direction)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()


def needed(buffers: Sequence[Buffer], host_as_device: bool) -> bool:
    """Whether a message of ``buffers`` goes through :func:`plan`: it holds
    device buffers, host ones treated as such, or a host buffer large
    enough to go in chunks (then the rest are planned with it)."""
    return host_as_device or any(b.is_cuda or b.numel() > HOST_CHUNK_OVER for b in buffers)


def plan(buffers: Sequence[torch.Tensor], targets: Sequence[int] | None, *, staged: bool,
         host_as_device: bool, chunk: int = CHUNK_BYTES,
         bounced: bool = False) -> Outgoing | None:
    """The way out for a message with device buffers; None when it has none
    (the plain path, untouched).

    ``targets``: the peer's device for each buffer (-1 host), or None for
    where it is here.  ``staged``: the pipe cannot carry device memory.
    ``bounced``: device buffers it carries go through buffers CUDA IPC can
    share (:mod:`.bounce`).
    """
    def device_like(b: torch.Tensor) -> bool:
        return b.is_cuda or host_as_device

    def chunked(b: torch.Tensor) -> bool:
        return device_like(b) and staged or (not b.is_cuda and b.numel() > HOST_CHUNK_OVER)

    if not needed(buffers, host_as_device):
        return None
    dests = list(targets) if targets is not None else [
        (b.device.index or 0) if b.is_cuda else -1 for b in buffers]
    out_bufs = list(buffers)
    kib = chunk >> 10
    ways: list[tuple[int, int, int]] = [
        (STAGED, kib if device_like(b) else HOST_CHUNK_BYTES >> 10, 0) if chunked(b)
        else (0, 0, 0) for b in buffers]
    groups: dict[tuple[torch.device, int], list[int]] = {}
    for i, b in enumerate(buffers):
        if device_like(b) and b.numel() <= PACK_MAX_BYTES:
            groups.setdefault((b.device, dests[i]), []).append(i)
    packed = 0
    for (device, dest), members in groups.items():
        if len(members) < PACK_MIN_COUNT or not _can_pack(device):
            continue
        pack, specs = _kernels.pack([buffers[i] for i in members])
        if pack.is_cuda:  # UCX or the staging copy read it on other streams
            torch.cuda.current_stream(device).synchronize()
        index = len(out_bufs)
        out_bufs.append(pack)
        dests.append(dest)
        ways.append((PACK | STAGED, kib, 0) if staged else (PACK, 0, 0))
        for i, spec in zip(members, specs):
            ways[i] = (PACKED, index, spec.offset)
        packed += len(members)
    views: list[tuple[int, memoryview | None, int]] = []
    for b, dest, way in zip(out_bufs, dests, ways):
        host_view = b.numpy().data if not b.is_cuda and not way[0] else None
        views.append((b.numel(), host_view, dest))
    staged_bytes = sum(b.numel() for b, w in zip(out_bufs, ways)
                       if w[0] & STAGED and (b.is_cuda or host_as_device))
    return Outgoing(out_bufs, views, ways, chunk, host_as_device, staged_bytes, packed,
                    bounced and not staged)


@dataclass(frozen=True)
class Landing:
    """Where one chunk of a staged buffer is received, and what to do once
    it is there (None: it landed in its final place)."""

    into: torch.Tensor
    then: Callable[[], None] | None


def landings(target: torch.Tensor, desc: BufferDesc, host_as_device: bool) -> list[Landing]:
    """The receives for a staged buffer whose final memory is ``target``.

    A host target takes its chunks in place; a device target (or any target
    on the debug path) takes them in host chunks copied over as each lands.
    """
    spans = chunk_spans(desc.nbytes, desc.arg << 10)
    if not target.is_cuda and not host_as_device:
        return [Landing(target[s:e], None) for s, e in spans]
    out = []
    for s, e in spans:
        part = _host(e - s, target.is_cuda)
        out.append(Landing(part, functools.partial(_copy_in, target[s:e], part)))
    return out


def bounced_landing(target: torch.Tensor) -> Landing:
    """Where a device buffer sent directly lands when this process's own
    device memory cannot be shared by CUDA IPC: a buffer that can, copied
    into ``target`` once there (:mod:`.bounce`)."""
    into = bounce.take(target.numel(), target.device.index or 0)
    return Landing(into, functools.partial(_copy_waited, target, into, "in"))


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    if not dst.is_cuda:
        dst.copy_(src)
        return
    # The pinned chunk stays alive until the copy ran: torch records the
    # stream on it for non-blocking copies from pinned memory.
    with torch.cuda.stream(_side_stream(dst.device.index or 0, "in")):
        dst.copy_(src, non_blocking=True)


def finish(buffers: list[Any], descs: Sequence[BufferDesc], delivered: int,
           alloc: Callable[[int, int], torch.Tensor]) -> list[torch.Tensor]:
    """A message's buffers once every receive completed: staged copies done,
    packs cut into tensors of their own; only the first ``delivered``.
    ``alloc(nbytes, device)`` makes the cut tensors (-1: host memory), as
    every receive's target is made: where nothing the user queued can still
    read what it hands out (the transport's receive stream, engine.py)."""
    devices = {b.device.index or 0 for b in buffers if isinstance(b, torch.Tensor) and b.is_cuda}
    for p in range(delivered, len(descs)):
        members = [i for i in range(delivered) if descs[i].flags == PACKED and descs[i].arg == p]
        pack = buffers[p]
        where = (pack.device.index or 0) if pack.is_cuda else -1
        outs = [alloc(descs[i].nbytes, where) for i in members]
        # Only the copy runs on the side stream that the message waits for.
        side = (torch.cuda.stream(_side_stream(pack.device.index or 0, "in")) if pack.is_cuda
                else contextlib.nullcontext())
        with side:
            _kernels.cut(pack, [descs[i].where for i in members], outs)
        for i, t in zip(members, outs):
            buffers[i] = t
    for d in devices:  # the message is handed up complete, on any stream
        _side_stream(d, "in").synchronize()
    return buffers[:delivered]
