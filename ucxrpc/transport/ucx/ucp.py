"""libucp called directly for the per-frame calls of the hot path.

Sending a 200-byte frame through ucxx's Python layer costs 4–8 µs (a tag
object, an ``Array``, a C++ request and its Python wrapper, pybind11); the
same ``ucp_tag_send_nbx`` called here costs about 1 µs, and a frame found
and received costs ~3 µs less (benchmarks/runs/J.md).  A message's
host data buffers (a bundle of small tensors, a large tensor) take the same
calls, and their receives are posted here too: posting one through ucxx
took ~10 µs of the receiver's frame handling (benchmarks/runs/Z.md).  CUDA
buffers take them too (:meth:`Ucp.send_device`, :meth:`Ucp.tag_recv_device`),
each request saying its memory is CUDA memory.  That hint does not spare UCX
detecting the buffer's memory: with its default protocols
(``UCX_PROTO_ENABLE=y``), 1.19-1.21 skip detection for host memory only and
call ``ucp_memory_detect`` for a CUDA buffer anyway, on both sides (the hint
is used only by the legacy protocols); what the direct path saves over ucxx
is the Python work: through ucxx a 16 MiB buffer's send cost the caller
~130 µs on an H200 (benchmarks/runs/AH.md), with a Python ``Array`` read
from ``__cuda_array_interface__``.  Skipping detection and registration
would take a memory handle mapped once (``UCP_OP_ATTR_FIELD_MEMH`` over
``ucp_mem_map``'d regions).  Empty buffers go through ucxx.

The calls themselves are the native core's (``csrc/ucp.c``, which states
the two rules that keep them safe beside ucxx: the GIL released by a
thread that waits for the worker's lock while another thread is inside
UCX, where it may hold that lock and call back into Python, and a request
owned, looked at and freed by one thread, keeping its memory alive till it
completes).  Every call into UCX counts itself while inside: libucp's
here, ucxx's through :func:`ucx_call`; a small send or receive keeps the
GIL where no other thread is inside.
Through ctypes, as before, each call cost a foreign call and a Python
request object (~20 Python-level calls per round trip, Run AM).  This
module binds them to the very libucp ucxx loaded, and keeps in ctypes the
two queries made once per worker or pipe (thread mode, lanes).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from ..._core import UCP_DONE
from ..._core import UcpRequest as _Request
from ..._core import (ucp_bind, ucp_cancel, ucp_probe, ucp_progress, ucp_receive, ucp_send,
                      ucp_send_device, ucp_send_iov, ucp_spin, ucp_tag_recv,
                      ucp_tag_recv_device, ucp_take, ucx_call, ucx_inside)
from .failures import request_failed

__all__ = ["Ucp", "UcpRequest", "DONE", "FULL_MASK", "THREAD_MODES", "THREAD_MODE_MULTI",
           "library", "loaded_library", "ucx_call", "ucx_inside"]

#: A tag mask that matches every bit: the one message with exactly that tag.
FULL_MASK = (1 << 64) - 1


class _WorkerAttr(ctypes.Structure):
    """``ucp_worker_attr_t`` as far as ``thread_mode``, padded well past its
    end (UCX writes only the fields asked for, but the struct grows)."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("thread_mode", ctypes.c_int),
                ("_rest", ctypes.c_byte * 256)]


_WORKER_ATTR_FIELD_THREAD_MODE = 1 << 0
#: ``ucs_thread_mode_t``.
THREAD_MODES = {0: "single", 1: "serialized", 2: "multi"}
THREAD_MODE_MULTI = 2


class _TransportEntry(ctypes.Structure):
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):
    _fields_ = [("entries", ctypes.POINTER(_TransportEntry)),
                ("num_entries", ctypes.c_uint),
                ("entry_size", ctypes.c_size_t)]


class _EpAttr(ctypes.Structure):
    """``ucp_ep_attr_t``, as far as ``transports``."""

    _fields_ = [("field_mask", ctypes.c_uint64),
                ("name", ctypes.c_char * 32),
                ("local_sockaddr", ctypes.c_byte * 128),
                ("remote_sockaddr", ctypes.c_byte * 128),
                ("transports", _Transports),
                ("user_data", ctypes.c_void_p)]


_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
_MAX_LANES = 16


def loaded_library(name: str) -> str | None:
    """The path of UCX library ``name`` (``libucp.so``) as this process
    loaded it, or None before UCX is loaded.  ucxx loads the libucx wheel's
    copy, or a system UCX's where ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true``
    (how a cluster gets UCX built with InfiniBand; see README)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                base = os.path.basename(path)
                if base == name or base.startswith(name + "."):
                    return path
    except OSError:
        pass
    return None


def library(name: str, keep_gil: bool = False) -> Any:
    """One of UCX's libraries: the very copy ucxx loaded, so that handles it
    made (an endpoint) are read by the same code; else the libucx wheel's.
    ``keep_gil`` loads it for calls that hold the GIL (``PyDLL``)."""
    path = loaded_library(name)
    if path is None:
        try:
            import libucx  # type: ignore[import-untyped]  # noqa: PLC0415

            path = os.path.join(os.path.dirname(libucx.__file__), "lib", name)
        except ImportError:
            path = name
        if not os.path.exists(path):
            path = name
    return ctypes.PyDLL(path) if keep_gil else ctypes.CDLL(path)


#: A send or receive UCX left in flight (``csrc/ucp.c``): ``done`` (the
#: first True frees it and lets go of its memory), ``error()``, ``keep``.
UcpRequest = _Request


#: What every request UCX completed when it was made is (a
#: :class:`UcpRequest` with nothing to free: ``done``, no ``error()``).
DONE = UCP_DONE


class Ucp:
    """The libucp calls of the frame path, bound once per process.

    The per-message calls are the native core's functions, held as they
    are, so ``self._ucp.send(ep, buf, tag)`` calls C directly:

    * ``send(ep, buf, tag)``: host array ``buf`` on endpoint handle ``ep``;
    * ``send_iov(ep, iov, tag, keep)``: the host memory ``iov`` lists
      ((address, length) pairs, uint64) as one message; ``keep`` holds that
      memory and ``iov`` until UCX is done with them;
    * ``send_device(ep, address, nbytes, tag, keep)``: CUDA memory;
    * ``tag_recv(worker, buf, tag)``: post a receive of the message with
      exactly ``tag`` into host array ``buf`` (a longer message fails the
      request: truncated);
    * ``tag_recv_device(worker, address, nbytes, tag, keep)``: into CUDA
      memory;
    * ``probe(worker, tag, mask)``: (sender tag, length, message handle) of
      a message taken off the worker's unexpected queue, or None;
    * ``take(worker, tag, mask, small, alloc)``: every message matching
      ``tag``/``mask`` taken off the unexpected queue, as (sender tag,
      length, request, buffer): one of at most ``small`` bytes received
      into ``alloc(length)``, a larger one as (sender tag, length, None,
      message handle) to receive with ``receive``; None where none matched;
    * ``receive(worker, buf, msg)``: probed message ``msg`` into host array
      ``buf`` (a shorter buffer truncates it: the request fails, the data is
      gone);
    * ``progress(worker)``: libucp's progress, counted as inside UCX (the
      loop's turns; ucxx's own progress runs when the loop goes idle);
    * ``spin(worker, tag, mask, small, alloc, wake_fd, budget_s, late_s)``:
      a driver's idle turns while a message is awaited, the frames it finds
      taken as ``take`` takes them (csrc/ucp.c says when
      it returns).

    Each returns :data:`DONE`, a :class:`UcpRequest` in flight, or one that
    failed at once.
    """

    def __init__(self) -> None:
        self.send = ucp_send
        self.send_iov = ucp_send_iov
        self.send_device = ucp_send_device
        self.tag_recv = ucp_tag_recv
        self.tag_recv_device = ucp_tag_recv_device
        self.probe = ucp_probe
        self.take = ucp_take
        self.receive = ucp_receive
        self.spin = ucp_spin
        self.progress = ucp_progress
        # The same copies ucxx loaded, named by path, or the wheel's.
        ucp_bind(_path(library("libucp.so")), _path(library("libucs.so")),
                       request_failed)
        lib = library("libucp.so")
        vp = ctypes.c_void_p
        self._worker_query = lib.ucp_worker_query
        self._worker_query.argtypes = [vp, ctypes.POINTER(_WorkerAttr)]
        self._worker_query.restype = ctypes.c_int
        self._ep_query = lib.ucp_ep_query
        self._ep_query.argtypes = [vp, ctypes.POINTER(_EpAttr)]
        self._ep_query.restype = ctypes.c_int

    def cancel(self, worker: int, req: UcpRequest) -> None:
        """Cancel ``req`` (a receive posted on worker handle ``worker``, not
        yet seen complete by its owner, who calls this): UCX completes it
        with UCS_ERR_CANCELED, and the owner frees it when it sees that."""
        ucp_cancel(worker, req)

    def thread_mode(self, worker: int) -> int:
        """The thread mode UCX really gave worker handle ``worker``
        (``ucs_thread_mode_t``: :data:`THREAD_MODES`); -1 if it would not say."""
        attr = _WorkerAttr(field_mask=_WORKER_ATTR_FIELD_THREAD_MODE)
        if self._worker_query(worker, ctypes.byref(attr)) != 0:
            return -1
        return int(attr.thread_mode)

    def transports(self, ep: int) -> list[tuple[str, str]]:
        """(transport, device) per lane of endpoint handle ``ep``, as UCX
        reports them ([] where it cannot)."""
        entries = (_TransportEntry * _MAX_LANES)()
        attr = _EpAttr(field_mask=_EP_ATTR_FIELD_TRANSPORTS)
        attr.transports.entries = ctypes.cast(entries, ctypes.POINTER(_TransportEntry))
        attr.transports.num_entries = _MAX_LANES
        attr.transports.entry_size = ctypes.sizeof(_TransportEntry)
        if self._ep_query(ep, ctypes.byref(attr)) != 0:
            return []
        return [(entries[i].transport_name.decode(), entries[i].device_name.decode())
                for i in range(attr.transports.num_entries)]


def _path(lib: Any) -> str:
    """The file a ctypes library was loaded from (its ``_name``)."""
    return str(lib._name)


_ucp: Ucp | None = None


def ucp() -> Ucp:
    """The process's bindings (made on first use, once UCX is loaded)."""
    global _ucp
    if _ucp is None:
        _ucp = Ucp()
    return _ucp
