"""libucp called directly (ctypes) for the per-frame calls of the hot path.

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

Two rules keep it safe beside ucxx:

* **The GIL.**  Every call that takes the worker's lock (send, probe,
  receive, posting a receive, free) releases the GIL (``CDLL``): a thread
  inside ucxx's progress holds that lock and may call back into Python (an
  endpoint's close callback), so holding the GIL while waiting for the lock
  could deadlock.  ``ucp_request_check_status`` only reads the request and keeps
  the GIL (``PyDLL``), saving a GIL hand-off per look.
* **Ownership.**  A request left in flight belongs to whoever holds its
  :class:`UcpRequest`: only that thread looks at it, and it frees it the
  first time it sees it complete.  The request keeps its buffer alive till
  then (UCX reads or writes it until completion).  An endpoint handle is
  used only while its :class:`~.binding.Endpoint` is open, which the pipe's
  lock guarantees (ucxx closes a UCP endpoint only when told to, never in
  its error callback).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from ...errors import BrokenError
from .failures import request_failed

__all__ = ["Ucp", "UcpRequest", "DONE", "FULL_MASK", "THREAD_MODES", "THREAD_MODE_MULTI",
           "host_address", "library", "loaded_library"]

_INPROGRESS = 1
_ERR_LAST = -100  # UCS_ERR_LAST: status pointers at or above (2**64 - 100) are errors
_ERR_FLOOR = (1 << 64) + _ERR_LAST
_OP_ATTR_FIELD_DATATYPE = 1 << 3
_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
_MEMORY_TYPE_HOST = 0
_MEMORY_TYPE_CUDA = 1  # ucs_memory_type_t: UCS_MEMORY_TYPE_CUDA
_DATATYPE_IOV = 2  # ucp_dt_make_iov(): the buffer is an array of ucp_dt_iov_t
#: A tag mask that matches every bit: the one message with exactly that tag.
FULL_MASK = (1 << 64) - 1


class _RequestParam(ctypes.Structure):
    """``ucp_request_param_t`` (UCX 1.x; the layout is part of its ABI)."""

    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("request", ctypes.c_void_p), ("cb", ctypes.c_void_p),
                ("datatype", ctypes.c_uint64), ("user_data", ctypes.c_void_p),
                ("reply_buffer", ctypes.c_void_p), ("memory_type", ctypes.c_int),
                ("recv_info", ctypes.c_void_p), ("memh", ctypes.c_void_p)]


class _TagRecvInfo(ctypes.Structure):
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


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


def host_address(buf: np.ndarray) -> int:
    """The address of a writable host array's first byte (a third of the
    cost of ``buf.ctypes.data``)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # type: ignore[arg-type]  # an ndarray is a buffer


class UcpRequest:
    """A send or receive UCX left in flight, looked at by its owner only."""

    __slots__ = ("_ucp", "_ptr", "_status", "keep")

    def __init__(self, ucp: Ucp, ptr: int, keep: Any) -> None:
        self._ucp = ucp
        self._ptr = ptr
        self._status = _INPROGRESS
        self.keep = keep

    @property
    def done(self) -> bool:
        if self._status == _INPROGRESS:
            status = self._ucp.check_status(self._ptr)
            if status == _INPROGRESS:
                return False
            self._ucp.free(self._ptr)  # first sight of completion: the owner frees
            self._status = status
            self.keep = None
        return True

    def error(self) -> BrokenError | None:
        """Why it failed (once :attr:`done`), else None."""
        return None if self._status in (0, _INPROGRESS) else self._ucp.failure(self._status)


class _Completed:
    """A request that completed when it was made, with ``status``."""

    __slots__ = ("_err",)
    done = True

    def __init__(self, err: BrokenError | None) -> None:
        self._err = err

    def error(self) -> BrokenError | None:
        return self._err


DONE = _Completed(None)


class Ucp:
    """The libucp calls of the frame path, bound once per process."""

    def __init__(self) -> None:
        lib = library("libucp.so")
        keeps_gil = library("libucp.so", keep_gil=True)
        ucs = library("libucs.so")
        vp, u64, size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        self._send = lib.ucp_tag_send_nbx
        self._send.argtypes = [vp, vp, size, u64, vp]
        self._send.restype = vp
        self._probe = lib.ucp_tag_probe_nb
        self._probe.argtypes = [vp, u64, u64, ctypes.c_int, vp]
        self._probe.restype = vp
        self._tag_recv = lib.ucp_tag_recv_nbx
        self._tag_recv.argtypes = [vp, vp, size, u64, u64, vp]
        self._tag_recv.restype = vp
        self._recv = lib.ucp_tag_msg_recv_nbx
        self._recv.argtypes = [vp, vp, size, vp, vp]
        self._recv.restype = vp
        self.check_status = keeps_gil.ucp_request_check_status
        self.check_status.argtypes = [vp]
        self.check_status.restype = ctypes.c_int
        self.free = lib.ucp_request_free
        self.free.argtypes = [vp]
        self.free.restype = None
        self._cancel = lib.ucp_request_cancel
        self._cancel.argtypes = [vp, vp]
        self._cancel.restype = None
        self._worker_query = lib.ucp_worker_query
        self._worker_query.argtypes = [vp, ctypes.POINTER(_WorkerAttr)]
        self._worker_query.restype = ctypes.c_int
        self._ep_query = lib.ucp_ep_query
        self._ep_query.argtypes = [vp, ctypes.POINTER(_EpAttr)]
        self._ep_query.restype = ctypes.c_int
        self._status_string = ucs.ucs_status_string
        self._status_string.argtypes = [ctypes.c_int]
        self._status_string.restype = ctypes.c_char_p
        # Read-only to UCX, so one for every thread: frames are host memory,
        # which spares UCX a memory-type lookup per call.
        self._param = _RequestParam(op_attr_mask=_OP_ATTR_FIELD_MEMORY_TYPE,
                                    memory_type=_MEMORY_TYPE_HOST)
        self._param_address = ctypes.addressof(self._param)
        self._iov_param = _RequestParam(
            op_attr_mask=_OP_ATTR_FIELD_MEMORY_TYPE | _OP_ATTR_FIELD_DATATYPE,
            memory_type=_MEMORY_TYPE_HOST, datatype=_DATATYPE_IOV)
        self._iov_param_address = ctypes.addressof(self._iov_param)
        self._cuda_param = _RequestParam(op_attr_mask=_OP_ATTR_FIELD_MEMORY_TYPE,
                                         memory_type=_MEMORY_TYPE_CUDA)
        self._cuda_param_address = ctypes.addressof(self._cuda_param)

    def cancel(self, worker: int, req: UcpRequest) -> None:
        """Cancel ``req`` (a receive posted on worker handle ``worker``, not
        yet seen complete by its owner, who calls this): UCX completes it
        with UCS_ERR_CANCELED, and the owner frees it when it sees that."""
        self._cancel(worker, req._ptr)

    def failure(self, status: int) -> BrokenError:
        return request_failed(self._status_string(status).decode(), status)

    def _outcome(self, ptr: int | None, keep: Any) -> UcpRequest | _Completed:
        if ptr is None:
            return DONE
        if ptr >= _ERR_FLOOR:
            return _Completed(self.failure(ptr - (1 << 64)))
        return UcpRequest(self, ptr, keep)

    def send(self, ep: int, buf: np.ndarray, tag: int) -> UcpRequest | _Completed:
        """Send host array ``buf`` on endpoint handle ``ep``."""
        return self._outcome(self._send(ep, host_address(buf), buf.nbytes, tag,
                                        self._param_address), buf)

    def send_iov(self, ep: int, iov: np.ndarray, tag: int, keep: Any) -> UcpRequest | _Completed:
        """Send the host memory that ``iov`` lists ((address, length) pairs,
        uint64) as one message on endpoint handle ``ep``; ``keep`` holds
        that memory and ``iov`` until UCX is done with them."""
        return self._outcome(self._send(ep, host_address(iov), iov.size // 2, tag,
                                        self._iov_param_address), keep)

    def send_device(self, ep: int, address: int, nbytes: int, tag: int,
                    keep: Any) -> UcpRequest | _Completed:
        """Send ``nbytes`` of CUDA memory at ``address`` on endpoint handle
        ``ep``, as CUDA memory; ``keep`` holds that memory until UCX is done."""
        return self._outcome(self._send(ep, address, nbytes, tag, self._cuda_param_address), keep)

    def tag_recv_device(self, worker: int, address: int, nbytes: int, tag: int,
                        keep: Any) -> UcpRequest | _Completed:
        """Post a receive of the message with exactly ``tag`` into ``nbytes``
        of CUDA memory at ``address``; ``keep`` holds that memory."""
        return self._outcome(self._tag_recv(worker, address, nbytes, tag, FULL_MASK,
                                            self._cuda_param_address), keep)

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

    def probe(self, worker: int, tag: int, mask: int) -> tuple[int, int, int] | None:
        """(sender tag, length, message handle) of a message taken off the
        worker's unexpected queue, or None."""
        info = _TagRecvInfo()
        msg = self._probe(worker, tag, mask, 1, ctypes.byref(info))
        return None if msg is None else (info.sender_tag, info.length, msg)

    def receive(self, worker: int, buf: np.ndarray, msg: int) -> UcpRequest | _Completed:
        """Receive probed message ``msg`` into host array ``buf`` (a
        shorter buffer truncates it: the request fails, the data is gone)."""
        return self._outcome(self._recv(worker, host_address(buf), buf.nbytes, msg,
                                        self._param_address), buf)

    def tag_recv(self, worker: int, buf: np.ndarray, tag: int) -> UcpRequest | _Completed:
        """Post a receive of the message with exactly ``tag`` into host
        array ``buf`` (a longer message fails the request: truncated)."""
        return self._outcome(self._tag_recv(worker, host_address(buf), buf.nbytes, tag,
                                            FULL_MASK, self._param_address), buf)


_ucp: Ucp | None = None


def ucp() -> Ucp:
    """The process's bindings (made on first use, once UCX is loaded)."""
    global _ucp
    if _ucp is None:
        _ucp = Ucp()
    return _ucp
