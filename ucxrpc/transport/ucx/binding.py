"""The one module that imports ucxx: context, worker, endpoints, requests.

Everything above this module speaks in bytes, numpy arrays and torch
tensors; ucxx types and exceptions stop here (converted to
:mod:`ucxrpc.errors` with ``from exc``).

ucxx is imported lazily by :class:`Worker`, after the environment has
been prepared, because UCX reads ``UCX_*`` variables once, when the library
loads (docs/ucx-notes.md, pitfall 7): the settings are :mod:`.environment`'s.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from ...errors import BrokenError
from ..wire.gather import Gather
from .failures import endpoint_closed, endpoint_failed, open_failed, request_failed
from .environment import _NEED_CUDA_COPY, environment_problem, ucx_environment
from .sockets import cut_stuck, tcp_sockets
from .ucp import THREAD_MODE_MULTI, THREAD_MODES, UcpRequest, loaded_library, ucp, ucx_call

#: The longest silence (no acknowledgement of data retransmitted) after
#: which a discarded endpoint's connections are taken as stuck; half the
#: ``host_timeout`` where that is shorter (:attr:`Worker.stuck_after_s`).
#: A live link acknowledges within a round trip, and a retransmission
#: timer first fires after 200 ms.
STUCK_AFTER_S = 1.0

logger = logging.getLogger(__name__)


def cuda_memory(cuda_support: bool, resources: Sequence[tuple[str, str]]) -> bool:
    """Whether device memory is safe to hand to this UCX context: its build
    has CUDA (``cuda_support``, ucxx's test of the build and ``UCX_TLS``)
    and ``cuda_copy``, the one CUDA transport whose memory domain detects
    device memory, is among its ``resources`` (transport, device)."""
    return bool(cuda_support) and any(t == "cuda_copy" for t, _ in resources)


_retired: list[Any] = []


def as_array_source(buf: torch.Tensor | np.ndarray | bytes | bytearray | memoryview) -> Any:
    """What ucxx's ``Array`` accepts for ``buf`` (docs/ucx-notes.md, pitfall 6)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type == "cpu":
            return buf.numpy()
        return buf  # __cuda_array_interface__
    return buf


class Request(Protocol):
    """An operation UCX may leave in flight: ucxx's, or one made directly
    (:mod:`.ucp`).  Only its owner looks at it (see :mod:`.ucp`)."""

    @property
    def done(self) -> bool: ...

    def error(self) -> BrokenError | None: ...


class UcxxRequest:
    """A ucxx operation in flight; ``keep`` holds its memory alive (pitfall 4)."""

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
            return request_failed(str(exc), cause=exc)
        return None


def _host_array(buf: Any) -> np.ndarray | None:
    """``buf`` as what the direct path of :mod:`.ucp` takes (a writable,
    contiguous host array: frames, and the byte tensors a message's host
    buffers travel as), or None where it goes through ucxx: device memory,
    an empty tensor (no address to give), any other tensor."""
    cls = type(buf)
    if cls is np.ndarray:
        return buf if buf.flags.c_contiguous and buf.flags.writeable else None
    if (cls is torch.Tensor and buf.dtype is torch.uint8 and buf.is_cpu and buf.numel()
            and buf.is_contiguous() and not buf.requires_grad):
        return buf.numpy()  # a view: the request holds it, and it the tensor's memory
    return None


#: How device buffers reach UCX (``UCXRPC_DEVICE_PATH``): ``ucp``, the
#: direct calls of :mod:`.ucp` with the memory type given; ``ucxx``, through
#: ucxx's ``Array`` (``__cuda_array_interface__``), UCX detecting the type.
#: Kept for measuring one against the other on a GPU (benchmarks/gpu_check.sh,
#: step ``percall``); the faster stays, the other goes.
DEVICE_PATHS = ("ucp", "ucxx")


def device_path(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The device-buffer path ``UCXRPC_DEVICE_PATH`` asks for (default ``ucp``).

    Raises:
        ValueError: a value that is not one of :data:`DEVICE_PATHS`.
    """
    value = environ.get("UCXRPC_DEVICE_PATH", DEVICE_PATHS[0]).strip().lower()
    if value not in DEVICE_PATHS:
        raise ValueError(f"UCXRPC_DEVICE_PATH={value!r}: expected one of "
                         f"{', '.join(DEVICE_PATHS)}")
    return value


def _device_buffer(buf: Any) -> bool:
    """Whether ``buf`` is CUDA memory the direct path takes: a non-empty
    contiguous tensor on a CUDA device (a message's device buffers are
    1-D uint8 ones)."""
    return type(buf) is torch.Tensor and buf.is_cuda and buf.numel() > 0 and buf.is_contiguous()


class Endpoint:
    """A UCP endpoint to one peer, created from the peer's worker address."""

    def __init__(self, worker: "Worker", address: bytes,
                 on_error: Callable[[BaseException], None]) -> None:
        ucx = worker.ucx
        try:
            addr = ucx.UCXAddress.create_from_buffer(address)
            # (ucx_call: every call into UCX counts itself while inside, .ucp)
            self._ep = ucx_call(worker.raw.create_endpoint_from_worker_address, addr, True)
        except Exception as exc:
            raise open_failed(exc) from exc
        self._ucx = ucx
        self._Array = worker.Array
        self._ucp = ucp()
        self._device_ucp = worker.device_ucp
        self._worker_fd, self._stuck_after_s = worker.fd, worker.stuck_after_s
        self._handle = int(self._ep.handle)  # 0 once closed: never sent on after
        # send_frame bound to the handle, a C call (every message but the
        # largest leaves through it; issue 52); _end puts back the method,
        # which refuses, before the handle goes.
        self.send_frame = functools.partial(  # type: ignore[method-assign]
            self._ucp.send, self._handle)
        self._ep.set_close_callback(self._closed, cb_args=(on_error,))

    @staticmethod
    def _closed(on_error: Callable[[BaseException], None], *args: Any) -> None:
        status = args[0] if args else "closed"
        on_error(endpoint_failed(status))

    def tag_send(self, buf: Any, tag: int) -> Request:
        """Send ``buf`` with ``tag``: host arrays, a :class:`..wire.gather.Gather`'s parts
        and (by default) CUDA tensors directly, the rest through ucxx.  Only while open (callers
        hold the pipe's lock, as :meth:`close`'s callers do)."""
        if not self._handle:
            raise endpoint_closed()
        if type(buf) is Gather:
            return self._ucp.send_iov(self._handle, buf.iov, tag, buf)
        arr = _host_array(buf)
        if arr is not None:
            return self._ucp.send(self._handle, arr, tag)
        if self._device_ucp and _device_buffer(buf):
            return self._ucp.send_device(self._handle, buf.data_ptr(),
                                         buf.numel() * buf.element_size(), tag, buf)
        src = as_array_source(buf)
        return UcxxRequest(ucx_call(self._ep.tag_send, self._Array(src), self._ucx.UCXXTag(tag)),
                           (buf, src))

    def send_frame(self, frame: np.ndarray, tag: int) -> Request:
        """Send a frame as :func:`..wire.frame.encode` made it (a fresh,
        writable host byte array) with ``tag``: :meth:`tag_send`'s direct
        path, without its look at what the buffer is.  Only while open: an
        open endpoint's is libucp's call itself, bound in ``__init__``."""
        if not self._handle:
            raise endpoint_closed()
        return self._ucp.send(self._handle, frame, tag)

    def transports(self) -> list[tuple[str, str]]:
        try:
            return self._ucp.transports(int(self._ep.handle))
        except Exception:  # diagnostics must never break a pipe
            logger.debug("ucp_ep_query failed", exc_info=True)
            return []

    @property
    def alive(self) -> bool:
        """Whether UCX still holds the endpoint usable (not failed, not closed)."""
        return bool(self._handle) and bool(self._ep.alive)

    def close(self) -> None:
        """Close once what was sent is flushed (the peer is there to take it)."""
        self._end(force=False)

    def discard(self) -> int:
        """Close at once, by force: UCX fails what it still holds of this
        endpoint (sends, receives matched to a rendezvous from it, which no
        cancel reaches).  ``close`` flushes first, and a flush to a peer
        behind a partition never ends: what it held stayed held for good.
        (ucxx's ``close_blocking`` forces where errors are handled, as
        here; its ``close`` does not: UCX logs ``close_nbx(flags=0x0)``.)

        UCX keeps reading the connection after such a close, and one stuck
        behind an outage would resume after it into an endpoint UCX let go
        (memory corrupted: :mod:`.sockets`), so the worker's stuck
        connections are cut too (listed before the close, which may take
        the TCP transport out of the worker's epoll set).  Returns how many."""
        fds = tcp_sockets(self._worker_fd)
        self._end(force=True)
        return len(cut_stuck(fds, self._stuck_after_s))

    def _end(self, force: bool) -> None:
        self.__dict__.pop("send_frame", None)  # the method again: it refuses
        self._handle = 0
        try:
            self._ep.remove_close_callback()
            # Counted as inside UCX (.ucp): close_blocking progresses the
            # worker until the close ends, running other endpoints' callbacks.
            ucx_call(self._ep.close_blocking if force else self._ep.close)
        except Exception:
            logger.debug("endpoint %s failed", "discard" if force else "close", exc_info=True)
        _retired.append(self._ep)


@dataclass
class Probe:
    sender_tag: int
    length: int
    raw: Any  # the UCP message handle, for :meth:`Worker.recv_probed`


#: What :meth:`Worker.take` gives per message: (sender tag, length, the
#: request and buffer it was received into, or None and its handle).
Taken = tuple[int, int, Any, Any]

#: A frame's memory, as :meth:`Worker.take` makes it: a byte array.
_frame_buffer = functools.partial(np.empty, dtype=np.uint8)


class Worker:
    """One UCX context and worker for the process, in blocking-progress mode.

    Blocking mode gives an epoll descriptor (``fd``) that :meth:`arm` makes
    readable on the next UCX event, so an idle progress loop can sleep.

    Raises:
        ValueError: a ``UCX_*`` setting known to break pipes
            (:func:`environment_problem`), before UCX loads.
        RuntimeError: UCX made the worker single-threaded
            (:func:`check_thread_mode`).
    """

    def __init__(self, transports: Sequence[str] | None, host_timeout: float = 10.0, *,
                 device_memory: bool = False, device_path: str = DEVICE_PATHS[0]) -> None:
        # device_memory: this process may send CUDA memory (see ucx_environment)
        if (problem := environment_problem(device_memory=device_memory)) is not None:
            raise ValueError(problem)
        #: Device buffers go through :mod:`.ucp` (else ucxx): see DEVICE_PATHS.
        self.device_ucp = device_path == "ucp"
        os.environ.update(ucx_environment(transports, host_timeout,
                                          device_memory=device_memory))
        import ucxx._lib.libucxx as ucx  # noqa: PLC0415  (lazy: env first)
        from ucxx._lib.arr import Array  # noqa: PLC0415

        self.ucx = ucx
        self.Array = Array
        feats = (ucx.Feature.TAG, ucx.Feature.WAKEUP)
        self._ctx = ucx.UCXContext(feature_flags=feats)
        self.raw = ucx.UCXWorker(self._ctx)
        self.raw.init_blocking_progress_mode()
        self.address: bytes = self.raw.address.tobytes()
        # Device memory is safe to hand UCX only where it can detect it:
        # otherwise UCX would read a device pointer as host memory.
        resources = _resources(str(self._ctx.info))
        self.cuda_memory: bool = cuda_memory(bool(self._ctx.cuda_support), resources)
        loaded = self.loaded = frozenset(t for t, _ in resources)  # the transports UCX loaded
        if loaded & _NEED_CUDA_COPY and not self.cuda_memory:
            logger.warning("UCX loaded %s without cuda_copy, so it cannot detect device "
                           "memory: CUDA tensors are staged through host memory (add "
                           "cuda_copy to UCX_TLS)", ", ".join(sorted(loaded & _NEED_CUDA_COPY)))
        self.fd: int = self.raw.epoll_file_descriptor
        #: A discarded endpoint's connections silent this long with data
        #: unacknowledged are cut (:mod:`.sockets`): by then the lifeline
        #: has judged the peer's host unreachable, about ``host_timeout``
        #: into the outage.
        self.stuck_after_s = min(STUCK_AFTER_S, host_timeout / 2)
        self._ucp = ucp()
        self._handle = int(self.raw.handle)
        check_thread_mode(self._ucp.thread_mode(self._handle))
        #: ``progress()``: libucp's own, counted as inside UCX (.ucp), bound
        #: here rather than wrapped (the loop calls it once or more a turn;
        #: issue 52).  ucxx's progress adds only its own bookkeeping (the
        #: requests of its own it was asked to cancel; ucxrpc makes no
        #: delayed submissions): :meth:`arm` runs it each time the loop goes
        #: idle.  Not ucxx's every turn: it retakes the GIL inside ucxx,
        #: still counted, so a sender meanwhile releases the GIL, and each
        #: such release is one more for a thread waiting for it (.ucp).
        self.progress: Callable[[], Any] = functools.partial(self._ucp.progress, self._handle)

    def spinner(self, tag: int, mask: int, small: int
                ) -> Callable[[int, float, float], tuple[int, int, float, list[Taken] | None]]:
        """The native spin (``ucp_spin``, csrc/ucp.c) on this worker, looking
        for messages matching ``tag``/``mask``: ``spin(wake_fd, budget_s,
        late_s)``, for :class:`..loop.progress.ProgressThread`; the messages
        it finds come taken, as :meth:`taker`'s call takes them."""
        return functools.partial(self._ucp.spin, self._handle, tag, mask, small, _frame_buffer)

    def arm(self) -> bool:
        """True when armed (sleep is safe); False when events are pending.
        ucxx's own progress first (see ``progress``), both counted as
        inside UCX."""
        ucx_call(self.raw.progress)
        return bool(ucx_call(self.raw.arm))

    def probe(self, tag: int, mask: int) -> Probe | None:
        """Take a message matching ``tag``/``mask`` off the unexpected queue;
        it must then be received with :meth:`recv_probed`."""
        found = self._ucp.probe(self._handle, tag, mask)
        return None if found is None else Probe(*found)

    def recv_probed(self, buf: np.ndarray, probe: Probe) -> Request:
        """Receive a probed message into host array ``buf``."""
        return self._ucp.receive(self._handle, buf, probe.raw)

    def taker(self, tag: int, mask: int, small: int) -> Callable[[], list[Taken] | None]:
        """A native call without arguments (the receiver takes once a turn,
        and a Python wrapper would cost a call each time) that takes every
        message matching ``tag``/``mask`` off the unexpected queue:
        ``(sender tag, length, request, buffer)``, the ones of at most
        ``small`` bytes received into a byte array of their own (they are in
        UCX's memory already), the larger ones ``(sender tag, length, None,
        handle)``, to be received with :meth:`recv_taken`.  None where none
        matched."""
        return functools.partial(self._ucp.take, self._handle, tag, mask, small, _frame_buffer)

    def recv_taken(self, buf: np.ndarray, handle: Any) -> Request:
        """Receive a message :meth:`take` left to the caller into ``buf``."""
        return self._ucp.receive(self._handle, buf, handle)

    def cancel(self, req: Request) -> int:
        """Cancel a receive still in flight (it then completes, failed, at a
        later progress, and its owner frees it as any other); 1 if it was
        cancelled, 0 if it was done already or is ucxx's (which offers no
        cancel of one request: it ends when UCX ends it)."""
        if type(req) is not UcpRequest or req.done:
            return 0
        self._ucp.cancel(self._handle, req)
        return 1

    def tag_recv(self, buf: Any, tag: int) -> Request:
        """Post a receive of the message with exactly ``tag`` into ``buf``:
        host memory and (by default) CUDA memory directly (:mod:`.ucp`),
        the rest through ucxx."""
        arr = _host_array(buf)
        if arr is not None:
            return self._ucp.tag_recv(self._handle, arr, tag)
        if self.device_ucp and _device_buffer(buf):
            return self._ucp.tag_recv_device(self._handle, buf.data_ptr(),
                                             buf.numel() * buf.element_size(), tag, buf)
        src = as_array_source(buf)
        return UcxxRequest(ucx_call(self.raw.tag_recv, self.Array(src), self.ucx.UCXXTag(tag)),
                           (buf, src))

    def info(self) -> str:
        return str(self._ctx.info)

    def close(self) -> None:
        # Destroying a worker with requests still posted (or calling
        # cancel_inflight_requests) crashed with SIGSEGV in ucxx 0.52; a closed
        # worker is parked instead and dies with the process.
        _retired.append((self._ctx, self.raw))


def check_thread_mode(mode: int) -> None:
    """Refuse a worker UCX did not make multi-threaded: user and pool threads
    post sends and receives while another thread progresses it, which only
    ``UCS_THREAD_MODE_MULTI`` allows (ucxx asks for it, but a UCX built
    without ``--enable-mt`` runs single-threaded and only logs it; requests
    and queues would then be corrupted without a word).

    Raises:
        RuntimeError: ``mode`` is not MULTI, naming the UCX library loaded
            and how to get one that is.
    """
    if mode == THREAD_MODE_MULTI:
        return
    lib = loaded_library("libucp.so") or "libucp.so"
    raise RuntimeError(
        f"the UCX library {lib} runs its worker in thread mode "
        f"{THREAD_MODES.get(mode, f'unknown ({mode})')!r}, but ucxrpc posts sends and "
        "receives from several threads and needs 'multi': use a UCX built with "
        "--enable-mt (the libucx wheels are; for a system UCX, configure it with "
        "--enable-mt, or unset RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY to use the wheel's)")


def ucx_version() -> str:
    import ucxx._lib.libucxx as ucx  # noqa: PLC0415

    return ".".join(str(v) for v in ucx.get_ucx_version())


def _resources(info: str) -> list[tuple[str, str]]:
    """(transport, device) pairs from a UCX context's printed info."""
    return [(t, d) for t, d in re.findall(r"resource \d+\s*:.*?--\s*(\S+?)/(\S+)", info)]


def local_resources() -> dict[str, Any]:
    """What UCX can use in this process: (transport, device) pairs and
    whether the UCX build has CUDA support, read from a throwaway context."""
    import ucxx._lib.libucxx as ucx  # noqa: PLC0415

    ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG,))
    return {"resources": _resources(str(ctx.info)), "cuda_support": bool(ctx.cuda_support)}
