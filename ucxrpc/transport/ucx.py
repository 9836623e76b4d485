"""The one module that imports ucxx: context, worker, endpoints, requests.

Everything above this module speaks in bytes, numpy arrays and torch
tensors; ucxx types and exceptions stop here (converted to
:mod:`ucxrpc.errors` with ``from exc``).

ucxx is imported lazily by :func:`open_worker`, after the environment has
been prepared, because UCX reads ``UCX_*`` variables once, when the library
loads (UCX-NOTES pitfall 7).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import BrokenError, ConnectError
from .lifeline import keepalive_schedule

logger = logging.getLogger(__name__)

# Names users may pass in ``transports=``; UCX's own names pass through too.
_TRANSPORT_ALIASES = {
    "shm": "sm",
    "shared_memory": "sm",
    "cuda": "cuda_copy,cuda_ipc",
    "ib": "rc,ud,dc",
    "infiniband": "rc,ud,dc",
}


def ucx_environment(transports: Sequence[str] | None, host_timeout: float = 10.0,
                    environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Return the ``UCX_*`` settings ucxrpc needs, without applying them.

    Shared memory only works with endpoint error handling when
    ``UCX_MM_ERROR_HANDLING=y`` (UCX-NOTES pitfall 1); without it UCX falls
    back to TCP over loopback.  UCX's keepalive checks what a peer's kernel
    or hardware answers (a TCP segment acknowledged, a shared-memory peer's
    process still there), never the peer's own code, so a busy peer passes;
    its TCP keepalive gives up on a silent host after about
    ``host_timeout``, as the lifelines do.  Within a host, messages up to
    512 KiB go eagerly (``UCX_RNDV_THRESH``).  Variables the user already
    set win, except ``UCX_TLS`` when ``transports=`` is given explicitly.
    """
    idle, interval = keepalive_schedule(host_timeout)
    wanted = {
        "UCX_MM_ERROR_HANDLING": "y",
        "UCX_WARN_UNUSED_ENV_VARS": "n",  # ucxx sets UCX_MEMTYPE_CACHE, unknown to UCX 1.21
        # Within a host, messages up to 512 KiB go eagerly through the peer's
        # shared-memory FIFO instead of by rendezvous, whose extra handshake
        # costs a scheduler slice per step on a busy host (256 KiB one-way
        # beside one busy process: p90 3.5 -> 0.7 ms, CPU per call halved;
        # unchanged on a quiet one; benchmarks/RESULTS.md, Run G).  Across
        # hosts UCX keeps choosing.
        "UCX_RNDV_THRESH": "intra:512K,inter:auto",
        "UCX_KEEPALIVE_INTERVAL": "1s",
        "UCX_KEEPALIVE_NUM_EPS": "inf",
        "UCX_TCP_KEEPIDLE": f"{idle}s",
        "UCX_TCP_KEEPINTVL": f"{interval}s",
        "UCX_TCP_KEEPCNT": str(max(1, math.ceil((host_timeout - idle) / interval))),
    }
    out = {k: v for k, v in wanted.items() if k not in environ}
    if transports:
        names = [_TRANSPORT_ALIASES.get(t, t) for t in transports]
        out["UCX_TLS"] = ",".join(names)
    return out


class _TransportEntry(ctypes.Structure):
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):
    _fields_ = [("entries", ctypes.POINTER(_TransportEntry)),
                ("num_entries", ctypes.c_uint),
                ("entry_size", ctypes.c_size_t)]


class _EpAttr(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64),
                ("name", ctypes.c_char * 32),
                ("local_sockaddr", ctypes.c_byte * 128),
                ("remote_sockaddr", ctypes.c_byte * 128),
                ("transports", _Transports),
                ("user_data", ctypes.c_void_p)]


_UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
_retired: list[Any] = []
_libucp: Any = None


def _ucp_ep_query(handle: int) -> list[tuple[str, str]]:
    """(transport, device) per lane of a UCP endpoint, as UCX reports them."""
    global _libucp
    if _libucp is None:
        import libucx  # type: ignore[import-untyped]

        path = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so")
        _libucp = ctypes.CDLL(path if os.path.exists(path) else "libucp.so")
        _libucp.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
        _libucp.ucp_ep_query.restype = ctypes.c_int
    entries = (_TransportEntry * 16)()
    attr = _EpAttr()
    attr.field_mask = _UCP_EP_ATTR_FIELD_TRANSPORTS
    attr.transports.entries = ctypes.cast(entries, ctypes.POINTER(_TransportEntry))
    attr.transports.num_entries = 16
    attr.transports.entry_size = ctypes.sizeof(_TransportEntry)
    status = _libucp.ucp_ep_query(handle, ctypes.byref(attr))
    if status != 0:
        return []
    return [(entries[i].transport_name.decode(), entries[i].device_name.decode())
            for i in range(attr.transports.num_entries)]


def as_array_source(buf: torch.Tensor | np.ndarray | bytes | bytearray | memoryview) -> Any:
    """What ucxx's ``Array`` accepts for ``buf`` (UCX-NOTES pitfall 6)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type == "cpu":
            return buf.numpy()
        return buf  # __cuda_array_interface__
    return buf


class Request:
    """An in-flight UCX operation; ``keep`` holds its memory alive (pitfall 4)."""

    __slots__ = ("req", "keep")

    def __init__(self, req: Any, keep: Any) -> None:
        self.req = req
        self.keep = keep

    @property
    def done(self) -> bool:
        return bool(self.req.completed)

    def error(self) -> BrokenError | None:
        """The request's failure, as a :class:`BrokenError` chained to
        ucxx's exception (this module is where ucxx's errors stop)."""
        try:
            self.req.check_error()
        except Exception as exc:  # any ucxx error: the peer or pipe broke
            err = BrokenError(f"UCX request failed: {exc}")
            err.__cause__ = exc
            return err
        return None


class Endpoint:
    """A UCP endpoint to one peer, created from the peer's worker address."""

    def __init__(self, worker: "Worker", address: bytes,
                 on_error: Callable[[BaseException], None]) -> None:
        ucx = worker.ucx
        try:
            addr = ucx.UCXAddress.create_from_buffer(address)
            self._ep = worker.raw.create_endpoint_from_worker_address(addr, True)
        except Exception as exc:
            raise ConnectError(f"cannot open a UCX endpoint: {exc}") from exc
        self._ucx = ucx
        self._Array = worker.Array
        self._ep.set_close_callback(self._closed, cb_args=(on_error,))

    @staticmethod
    def _closed(on_error: Callable[[BaseException], None], *args: Any) -> None:
        status = args[0] if args else "closed"
        on_error(BrokenError(f"UCX endpoint failed: {status}"))

    def tag_send(self, buf: Any, tag: Any) -> Request:
        """Send ``buf`` with ``tag`` (an int, or a tag from :meth:`Worker.tag`)."""
        src = as_array_source(buf)
        if isinstance(tag, int):
            tag = self._ucx.UCXXTag(tag)
        return Request(self._ep.tag_send(self._Array(src), tag), (buf, src))

    def transports(self) -> list[tuple[str, str]]:
        try:
            return _ucp_ep_query(int(self._ep.handle))
        except Exception:  # diagnostics must never break a pipe
            logger.debug("ucp_ep_query failed", exc_info=True)
            return []

    def close(self) -> None:
        try:
            self._ep.remove_close_callback()
            self._ep.close()
        except Exception:
            logger.debug("endpoint close failed", exc_info=True)
        _retired.append(self._ep)


@dataclass
class Probe:
    sender_tag: int
    length: int
    raw: Any


class Worker:
    """One UCX context and worker for the process, in blocking-progress mode.

    Blocking mode gives an epoll descriptor (``fd``) that :meth:`arm` makes
    readable on the next UCX event, so an idle progress loop can sleep.
    """

    def __init__(self, transports: Sequence[str] | None, host_timeout: float = 10.0) -> None:
        os.environ.update(ucx_environment(transports, host_timeout))
        import ucxx._lib.libucxx as ucx  # noqa: PLC0415  (lazy: env first)
        from ucxx._lib.arr import Array  # noqa: PLC0415

        self.ucx = ucx
        self.Array = Array
        feats = (ucx.Feature.TAG, ucx.Feature.WAKEUP)
        self._ctx = ucx.UCXContext(feature_flags=feats)
        self.raw = ucx.UCXWorker(self._ctx)
        self.raw.init_blocking_progress_mode()
        self.address: bytes = self.raw.address.tobytes()
        # Device memory is safe to hand UCX only where a CUDA transport is
        # loaded: otherwise UCX would read a device pointer as host memory.
        self.cuda_memory: bool = bool(self._ctx.cuda_support) and bool(
            {t for t, _ in _resources(str(self._ctx.info))} & _CUDA_TRANSPORTS)
        self.fd: int = self.raw.epoll_file_descriptor
        self._mask_cache: dict[tuple[int, int], Any] = {}

    def progress(self) -> None:
        self.raw.progress()

    def arm(self) -> bool:
        """True when armed (sleep is safe); False when events are pending."""
        return bool(self.raw.arm())

    def tag(self, value: int) -> Any:
        """A reusable UCX tag object (building one per message costs µs)."""
        return self.ucx.UCXXTag(value)

    def probe(self, tag: int, mask: int) -> Probe | None:
        key = (tag, mask)
        tm = self._mask_cache.get(key)
        if tm is None:
            tm = self._mask_cache[key] = (self.ucx.UCXXTag(tag), self.ucx.UCXXTagMask(mask))
        r = self.raw.tag_probe(tm[0], tm[1], True)
        if not r.matched:
            return None
        return Probe(int(r.sender_tag.value), int(r.length), r)

    def recv_probed(self, buf: np.ndarray, probe: Probe) -> Request:
        return Request(self.raw.tag_recv_with_handle(self.Array(buf), probe.raw), buf)

    def tag_recv(self, buf: Any, tag: int) -> Request:
        src = as_array_source(buf)
        return Request(self.raw.tag_recv(self.Array(src), self.ucx.UCXXTag(tag)), (buf, src))

    def info(self) -> str:
        return str(self._ctx.info)

    def close(self) -> None:
        # Destroying a worker with requests still posted (or calling
        # cancel_inflight_requests) crashed with SIGSEGV in ucxx 0.52; a closed
        # worker is parked instead and dies with the process.
        _retired.append((self._ctx, self.raw))


def ucx_version() -> str:
    import ucxx._lib.libucxx as ucx  # noqa: PLC0415

    return ".".join(str(v) for v in ucx.get_ucx_version())


_CUDA_TRANSPORTS = {"cuda_copy", "cuda_ipc", "gdr_copy"}


def _resources(info: str) -> list[tuple[str, str]]:
    """(transport, device) pairs from a UCX context's printed info."""
    return [(t, d) for t, d in re.findall(r"resource \d+\s*:.*?--\s*(\S+?)/(\S+)", info)]


def local_resources() -> dict[str, Any]:
    """What UCX can use in this process: (transport, device) pairs and
    whether the UCX build has CUDA support, read from a throwaway context."""
    import ucxx._lib.libucxx as ucx  # noqa: PLC0415

    ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG,))
    return {"resources": _resources(str(ctx.info)), "cuda_support": bool(ctx.cuda_support)}
