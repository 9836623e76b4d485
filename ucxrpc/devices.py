"""Device maps: torch's validation rules, reverse maps and ``devices``.

A device map says, for tensors a worker sends to one peer, which of the
peer's devices each of its own devices lands on (``{"cuda:0": "cuda:1"}``);
replies travel the reverse map.  The rules are torch's
(``TensorPipeRpcBackendOptions`` and ``backend_registry._validate_device_maps``),
with its messages, so programs and tests written for torch keep working:

* per map: one-to-one (no two sources on one target);
* ``set_device_map`` twice for one peer: a source may not change target;
* ``set_devices``: CUDA devices only;
* across the job, checked on every worker at init with everyone's maps,
  devices and device counts: target names exist, no duplicated devices,
  indices within each worker's device count, sources within the worker's
  ``devices`` and targets within the peer's where those are given.

Pure functions over ``torch.device`` values, except the stream discipline
at the end (:func:`settle`, :func:`callee_streams`, :func:`on_streams`,
:class:`ReadyEvents`, :func:`future`, :func:`extracting_tensors`), the only
code here that touches a GPU, and only when CUDA is in use.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

import torch

from . import _cuda
from .errors import RpcError

__all__ = ["NO_STREAMS", "DeviceMap", "ReadyEvents", "callee_streams", "check_devices", "current_streams",
           "default_devices", "extracting_tensors", "future", "on_streams", "reverse_maps",
           "settle", "settle_indices", "target_devices",
           "to_device", "to_device_map", "validate"]

DeviceMap = dict[torch.device, torch.device]


def to_device(d: Any) -> torch.device:
    """``torch.device(d)``, with a bare int meaning that CUDA device (as torch)."""
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cuda", d)
    return torch.device(d)


def to_device_map(device_map: Mapping[Any, Any]) -> DeviceMap:
    """Normalize one map; raises ValueError unless it is one-to-one."""
    full: DeviceMap = {}
    reverse: DeviceMap = {}
    for k, v in device_map.items():
        src, dst = to_device(k), to_device(v)
        if dst in reverse:
            raise ValueError("`device_map` only supports 1-to-1 mapping, trying to map "
                             f"{src} and {reverse[dst]} to {dst}")
        full[src] = dst
        reverse[dst] = src
    return full


def merge_device_map(current: DeviceMap | None, to: str, update: DeviceMap) -> DeviceMap:
    """``current`` (the map to ``to`` so far) with ``update`` added."""
    merged = dict(current or {})
    for src, dst in update.items():
        if src in merged and merged[src] != dst:
            raise ValueError("`set_device_map` only supports 1-to-1 mapping, trying to map "
                             f"{src} to {dst} and {merged[src]} (for worker {to})")
        merged[src] = dst
    to_device_map(merged)  # still one-to-one as a whole
    return merged


def check_devices(devices: Iterable[Any]) -> list[torch.device]:
    """``set_devices``'s argument: CUDA devices only."""
    out = []
    for d in devices:
        device = to_device(d)
        if device.type != "cuda":
            raise ValueError("`set_devices` expect a list of CUDA devices, but got device "
                             f"type {device.type}.")
        out.append(device)
    return out


def _valid_indices(devices: Iterable[torch.device], device_count: int) -> bool:
    return all(d.type == "cpu" or (d.type == "cuda" and d.index is not None
                                   and 0 <= d.index < device_count) for d in devices)


def validate(names: list[str], device_counts: Mapping[str, int],
             device_maps: Mapping[str, Mapping[str, DeviceMap]],
             devices: Mapping[str, list[torch.device]]) -> None:
    """torch's job-wide checks; every worker runs them on the same inputs, so
    all of them raise the same ValueError, naming the worker at fault."""
    known = set(names)
    for node in names:
        devs = devices[node]
        if len(set(devs)) != len(devs):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {devs}")
        if not _valid_indices(devs, device_counts[node]):
            raise ValueError(f"Node {node} has devices with invalid indices\n"
                             f"devices = {devs}\ndevice count = {device_counts[node]}")
    for source in names:
        maps = device_maps[source]
        if not set(maps).issubset(known):
            raise ValueError(f"Node {source} has invalid target node names in its device "
                             f"maps\ndevice maps = {maps}\nnode names = {sorted(known)}")
        for target, map_ in maps.items():
            if len(set(map_.values())) != len(map_):
                raise ValueError(f"Node {source} has duplicated target devices in its device "
                                 f"map for {target}\ndevice map = {map_}")
            if devices[source]:
                if not set(map_).issubset(devices[source]):
                    raise ValueError(f"Node {source} has unexpected source devices in its device "
                                     f"map for {target}\ndevice map = {map_}\n"
                                     f"devices = {devices[source]}")
            elif not _valid_indices(map_, device_counts[source]):
                raise ValueError(f"Node {source} has source devices with invalid indices in its "
                                 f"device map for {target}\ndevice map = {map_}\n"
                                 f"device count = {device_counts[source]}")
            if devices[target]:
                if not set(map_.values()).issubset(devices[target]):
                    raise ValueError(f"Node {source} has unexpected target devices in its device "
                                     f"map for {target}\ndevice map = {map_}\n"
                                     f"devices = {devices[target]}")
            elif not _valid_indices(map_.values(), device_counts[target]):
                raise ValueError(f"Node {source} has target devices with invalid indices in its "
                                 f"device map for {target}\ndevice map = {map_}\n"
                                 f"device count = {device_counts[target]}")


def reverse_maps(me: str, device_maps: Mapping[str, Mapping[str, DeviceMap]]) -> dict[str, DeviceMap]:
    """For each peer whose map targets ``me``: how my replies' devices map back."""
    out: dict[str, DeviceMap] = {}
    for source, maps in device_maps.items():
        if me in maps:
            out[source] = {dst: src for src, dst in maps[me].items()}
    return out


def default_devices(my_maps: Mapping[str, DeviceMap],
                    reverse: Mapping[str, DeviceMap]) -> list[torch.device]:
    """``devices`` when not given: every CUDA device my maps send from or
    others' maps send to me, in index order."""
    found: set[torch.device] = set()
    for m in my_maps.values():
        found.update(d for d in m if d.type == "cuda")
    for m in reverse.values():
        found.update(d for d in m if d.type == "cuda")
    return sorted(found, key=lambda d: d.index or 0)


def target_devices(sources: Iterable[torch.device], device_map: DeviceMap | None,
                   dest: str, replying: bool = False) -> list[int]:
    """Where each buffer lands on ``dest``: -1 for host memory, else the CUDA
    index.  Host buffers stay on the host; a CUDA buffer follows the map.

    Raises:
        RpcError: a CUDA buffer whose device the map does not cover (torch
            refuses such a tensor the same way, at call time).
    """
    out = []
    for src in sources:
        if src.type == "cpu":
            out.append(-1)
            continue
        dst = device_map.get(src) if device_map else None
        if dst is None:
            how = (f"the reverse of {dest}'s device map to this worker" if replying
                   else f"set_device_map({dest!r}, {{{str(src)!r}: ...}}) on "
                        f"UcxRpcBackendOptions")
            raise RpcError(f"a tensor on {src} cannot go to {dest}: no device map entry covers "
                           f"{src}; configure it with {how}, or move the tensor to the CPU")
        out.append(-1 if dst.type == "cpu" else (dst.index or 0))
    return out


def settle(buffers: Iterable[Any]) -> None:
    """Wait until the work queued on each CUDA buffer's current stream is done
    (where any is pending), so that UCX, reading on its own streams, sees
    the final bytes: a message's buffers settle together, once per device,
    not a device-wide sync (other streams keep running)."""
    settle_indices({b.get_device() for b in buffers if b.is_cuda})


def settle_indices(indices: Iterable[int]) -> None:
    """:func:`settle` for buffers on the CUDA devices ``indices`` (each once)."""
    _cuda.settle(indices)


_POOL_SIZE = 8  # streams per device: calls served at once rarely need more
# Per device index: the pool's streams (kept alive) and their keys.
_pools: dict[int, tuple[list[Any], list[_cuda.Key]]] = {}
_turn = itertools.count()
_pools_lock = threading.Lock()


def _pool_stream(index: int) -> _cuda.Key:
    pool = _pools.get(index)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(index)
            if pool is None:
                streams = [torch.cuda.Stream(device=index) for _ in range(_POOL_SIZE)]
                pool = _pools[index] = (streams, [_cuda.key_of(s) for s in streams])
    return pool[1][next(_turn) % _POOL_SIZE]


def callee_streams(devs: list[torch.device], received: Iterable[torch.Tensor]
                   ) -> contextlib.AbstractContextManager[None]:
    """Run a served call as torch's agent does: on each of ``devs``, the
    current stream is one from a pool, so calls served at once do not
    serialize on the default stream.  Received CUDA buffers (complete when
    delivered) are recorded on those streams, so that their memory is not
    handed out again while the callee's queued work still reads it; the
    current device is left as it was."""
    if not devs:
        return NO_STREAMS
    keys = {d.index or 0: _pool_stream(d.index or 0) for d in devs}
    for b in received:
        if b.is_cuda:
            key = keys.get(b.get_device())
            if key is not None:
                b.record_stream(_cuda.stream(key))
    return _cuda.StreamScope(list(keys.values()))


def current_streams(devs: list[torch.device]) -> list[_cuda.Key]:
    """The current stream of each of ``devs`` (none, and no CUDA call, for
    none): to carry a call's streams to work it hands to another thread."""
    return [_cuda.current(d.index or 0) for d in devs]


def on_streams(streams: list[_cuda.Key]) -> contextlib.AbstractContextManager[None]:
    """Make ``streams`` (one per device, from :func:`current_streams`, maybe
    on another thread) current here; the current device is left as it
    was.  Work queued in the body follows the work already queued on them,
    and memory recorded on them (a served call's received buffers) stays
    guarded.  For no streams (a worker without CUDA devices), a context
    that does nothing, at no cost."""
    return _cuda.StreamScope(streams) if streams else NO_STREAMS


class _NoStreams:
    """No stream context: ``with`` on it runs no Python code.  Its
    ``__enter__`` and ``__exit__`` are one C function, ``"".format``, which
    takes any arguments and returns ``""``: falsy, so ``__exit__`` never
    suppresses an exception.  (contextlib.nullcontext's were two Python
    calls every request served on a worker without CUDA devices; issue 52.)"""

    __slots__ = ()
    __enter__ = __exit__ = "".format


#: No stream context: what a worker without CUDA devices runs in (reusable).
NO_STREAMS: contextlib.AbstractContextManager[None] = _NoStreams()  # type: ignore[assignment]


class ReadyEvents:
    """When values made on several streams are done: one CUDA event per
    device, recorded again each time more work is added (:meth:`record`).

    The stream recording waits first for the previous event of its device,
    so the event covers every earlier recording too (torch keeps one event
    per device the same way for a distributed autograd context's
    gradients).  Not thread-safe: callers hold their own lock.  Costs
    nothing until a CUDA device is recorded.
    """

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: dict[torch.device, Any] = {}

    def record(self, device: torch.device) -> None:
        """Mark the work queued so far on ``device``'s current stream (and,
        through the wait, on the streams recorded before)."""
        stream = torch.cuda.current_stream(device)
        event = self._events.get(device)
        if event is None:
            event = self._events[device] = torch.cuda.Event()
        else:
            event.wait(stream)
        event.record(stream)

    def block(self, device: torch.device | None = None) -> None:
        """Make the current stream of each recorded device (or of ``device``
        only) wait, on the GPU, for the work recorded so far."""
        for d, event in self._events.items():
            if device is None or d == device:
                event.wait(torch.cuda.current_stream(d))


def future(devs: list[torch.device]) -> torch.futures.Future:
    """A future for a call's result that knows the caller's devices: torch
    then makes the waiter's current streams wait for the result's CUDA
    tensors and records them on those streams (torch's ``Future(devices=)``).

    Completing such a future (and each future ``then()`` makes from it)
    finds the value's tensors by pickling it with plain pickle (see
    :func:`extracting_tensors`): ucxrpc objects that refuse plain pickle
    must let that one through."""
    if devs:
        return torch.futures.Future(devices=list(devs))
    return torch.futures.Future()


# torch's own tensor finder for CUDA-aware futures; None where this torch
# has no such function (then nothing is let through, as before).
_EXTRACT_CODE = getattr(getattr(torch._jit_internal, "_extract_tensors", None), "__code__", None)
_PICKLERS = frozenset({"pickle", "copyreg"})  # frames of the pure-Python pickler


def extracting_tensors() -> bool:
    """Whether the object whose ``__reduce__`` asks is being pickled by torch's
    ``_extract_tensors``, not for sending anywhere.

    A CUDA-aware future pickles the value it is completed with to find its
    tensors (``torch._jit_internal._TensorExtractor``: tensors are kept aside
    by ``persistent_id``, the bytes are thrown away), then records events
    for and guards the memory of what it found.  Objects that refuse plain
    pickle (an RRef outside an RPC, a GradCapture outside a Serializer)
    return a stand-in holding their tensors when this says True, and keep
    refusing every other pickle.  torch's extractor calls ``__reduce__``
    straight from C, so the frame below the asking ``__reduce__`` is
    ``_extract_tensors`` itself (below pure-Python pickle frames, if the C
    pickler is missing); it is found by code identity, not by name.
    """
    frame: FrameType | None = sys._getframe(2)  # 0: here; 1: the __reduce__ that asks
    while frame is not None and frame.f_globals.get("__name__") in _PICKLERS:
        frame = frame.f_back
    return frame is not None and frame.f_code is _EXTRACT_CODE
