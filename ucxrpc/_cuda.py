"""torch's current CUDA streams and device, at the cost of one C call each.

The stream work of a message that carries device tensors (has the stream
that made them work pending, which pool streams a served call runs on) went
through ``torch.cuda``'s Python helpers: ``current_stream`` and
``Stream.__new__``, the ``torch.cuda.stream`` and ``torch.cuda.device``
context managers under an ``ExitStack``, ``_get_device_index``, and
``torch.cuda.is_available`` reading the environment on every request.  On
an H200 that was ~100 µs of a 16 MiB call's ~415 µs of the caller's own
work, and ~50 µs per request on the callee
(benchmarks/RESULTS.md, "CUDA per-call budget"; benchmarks/runs/AH.md).  These are the C calls those
helpers end in, bound once.

This is the one module that uses torch's private CUDA bindings
(``torch._C._cuda_getCurrentStream``, ``_cuda_setStream``,
``_cuda_getDevice``, ``_cuda_setDevice``: what ``torch.cuda`` itself calls,
with the same arguments); where a torch lacks one, the public helper it
stands for runs instead.  A stream is named by its key, the triple
``(stream_id, device_index, device_type)`` torch packs a stream into, so
nothing per message builds a ``torch.cuda.Stream``.

Callers reach this module only with CUDA in use (a CUDA tensor or device in
hand): nothing here initialises CUDA by itself, except through
:func:`stream`'s first use.

Private names may change with torch: on first use the bindings are checked
once against the public API (:func:`_check`: the current device, the
current stream's key); where they disagree or fail, a warning says so and
the public helpers run from then on.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Key", "StreamScope", "current", "device", "key_of", "set_device", "settle",
           "stream"]

#: A stream as torch packs it: (stream_id, device_index, device_type).
Key = tuple[int, int, int]

_C: Any = torch._C
_get_stream = getattr(_C, "_cuda_getCurrentStream", None)
_set_stream = getattr(_C, "_cuda_setStream", None)
_get_device = getattr(_C, "_cuda_getDevice", None)
_set_device = getattr(_C, "_cuda_setDevice", None)

# Stream objects by key, made once: query() and synchronize() need one.
_streams: dict[Key, Any] = {}
_checked = False


def _check() -> None:
    """Once, on first use: do the private bindings say what the public API
    says (this thread's device, its current stream's key), and does the
    stream setter take what ucxrpc passes it?  If not, or if one fails, warn
    and use the public helpers from now on."""
    global _checked, _get_stream, _set_stream, _get_device, _set_device
    _checked = True
    if _get_stream is None and _get_device is None:
        return
    why = ""
    try:
        index = torch.cuda.current_device()
        if _get_device is not None and _get_device() != index:
            why = f"_cuda_getDevice() gave {_get_device()}, torch.cuda {index}"
        elif _get_stream is not None:
            got, want = tuple(_get_stream(index)), key_of(torch.cuda.current_stream(index))
            if got != want:
                why = f"_cuda_getCurrentStream({index}) gave {got}, torch.cuda {want}"
        # The stream setter, to the stream current already (no change): a
        # changed signature raises here, once, not in a message's path.  (Not
        # the device setter: cudaSetDevice may make a context current on a
        # thread that had none, which the transport must leave as found.)
        if not why and _set_stream is not None:
            key = key_of(torch.cuda.current_stream(index))
            _set_stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    except Exception as exc:  # a changed signature, a missing symbol
        why = f"{type(exc).__name__}: {exc}"
    if why:
        warnings.warn(f"torch {torch.__version__}'s private CUDA stream bindings disagree with "
                      f"torch.cuda ({why}): ucxrpc uses the public helpers, which cost a few "
                      "microseconds more per CUDA message", RuntimeWarning, stacklevel=3)
        _get_stream = _set_stream = _get_device = _set_device = None


def key_of(s: Any) -> Key:
    """The key of ``torch.cuda.Stream`` ``s``."""
    return (s.stream_id, s.device_index, s.device_type)


def current(index: int) -> Key:
    """The key of the current stream of CUDA device ``index`` on this thread."""
    if not _checked:
        _check()
    if _get_stream is None:
        return key_of(torch.cuda.current_stream(index))
    return _get_stream(index)


def stream(key: Key) -> Any:
    """The ``torch.cuda.Stream`` with ``key`` (made once per key)."""
    s = _streams.get(key)
    if s is None:
        s = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                              device_type=key[2])
    return s


def device() -> int:
    """This thread's current CUDA device."""
    if not _checked:
        _check()
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def set_device(index: int) -> None:
    """Make CUDA device ``index`` current on this thread."""
    if not _checked:
        _check()
    if _set_device is not None:
        _set_device(index)
    else:
        torch.cuda.set_device(index)


def _make_current(key: Key) -> None:
    # As torch.cuda.set_stream: it also makes the stream's device current.
    if not _checked:
        _check()
    if _set_stream is not None:
        _set_stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    else:
        torch.cuda.set_stream(stream(key))


def settle(indices: Iterable[int]) -> int:
    """Wait until the work queued so far on the current stream of each CUDA
    device in ``indices`` is done, where any is still pending: UCX reads a
    message's device buffers on streams of its own, which do not wait for
    ours.  A stream with nothing pending costs one query and no wait (the
    usual case of a tensor made a while before it is sent); other streams
    keep running.  Returns how many streams had to be waited for."""
    waited = 0
    for index in indices:
        s = stream(current(index))
        if not s.query():
            s.synchronize()
            waited += 1
    return waited


class StreamScope:
    """A ``with`` block in which each of ``keys`` (one per device) is its
    device's current stream; the streams and the current device it found
    are current again after it.  For one block only (not re-entrant)."""

    __slots__ = ("_keys", "_saved", "_home")

    def __init__(self, keys: list[Key]) -> None:
        self._keys = keys
        self._saved: list[Key] = []
        self._home = -1

    def __enter__(self) -> None:
        self._home = device()
        self._saved = [current(k[1]) for k in self._keys]
        for k in self._keys:
            _make_current(k)
        set_device(self._home)  # making a stream current may switch the device

    def __exit__(self, *exc: object) -> None:
        for k in self._saved:
            _make_current(k)
        set_device(self._home)
