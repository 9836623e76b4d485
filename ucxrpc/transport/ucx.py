"""The one module that imports ucxx: context, worker, endpoints, requests.

Everything above this module speaks in bytes, numpy arrays and torch
tensors; ucxx types and exceptions stop here (converted to
:mod:`ucxrpc.errors` with ``from exc``).

ucxx is imported lazily by :class:`Worker`, after the environment has
been prepared, because UCX reads ``UCX_*`` variables once, when the library
loads (UCX-NOTES pitfall 7).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from ..errors import BrokenError, ConnectError
from .gather import Gather
from .lifeline import keepalive_schedule
from .ucp import library, ucp

logger = logging.getLogger(__name__)

# Names users may pass in ``transports=``; UCX's own names pass through too.
_TRANSPORT_ALIASES = {
    "shm": "sm",
    "shared_memory": "sm",
    "cuda": "cuda_copy,cuda_ipc",
    "ib": "rc,ud,dc",
    "infiniband": "rc,ud,dc",
}
# CUDA transports that move device memory but cannot tell it from host
# memory: only cuda_copy's memory domain detects memory types (UCX 1.21
# cuda_copy_md.c sets detect_mem_types; cuda_ipc_md.c and gdr_copy_md.c do
# not), and UCX keeps a domain only when one of its transports is selected.
# Without cuda_copy, every pointer is "host" to UCX, device ones included.
_NEED_CUDA_COPY = {"cuda_ipc", "gdr_copy"}


def ucx_tls(transports: Sequence[str]) -> str:
    """``UCX_TLS`` for a ``transports=`` list: aliases expanded, and
    ``cuda_copy`` added where ``cuda_ipc`` or ``gdr_copy`` is named without it
    (UCX could not detect device memory otherwise: see ``_NEED_CUDA_COPY``).
    An exclusion list (``^...``) or ``all`` passes through as given."""
    names: list[str] = []
    for t in transports:
        for name in _TRANSPORT_ALIASES.get(t, t).split(","):
            if name and name not in names:
                names.append(name)
    bare = {n.split(":")[0] for n in names}  # UCX allows "name:aux"
    if not any(n.startswith("^") for n in names) and "all" not in bare \
            and bare & _NEED_CUDA_COPY and not bare & {"cuda_copy", "cuda"}:
        names.append("cuda_copy")
    return ",".join(names)


#: Within a host, messages below this size go eagerly (``UCX_RNDV_THRESH``,
#: see :func:`ucx_environment`); large host buffers from it are read by
#: address instead where the pipe allows it (cma.py).
INTRA_EAGER_MAX = 2 << 20


#: The largest shared-memory segment UCX 1.21 carries whole: its FIFO
#: element records a fragment's length in 16 bits (``uct_mm_fifo_element_t``
#: in ``uct/sm/mm/base/mm_iface.h``), and ``max_bcopy`` is the segment size,
#: so a larger ``UCX_{MM,SYSV,POSIX,XPMEM}_SEG_SIZE`` wraps the length of a
#: full fragment.  Measured: ``ucx_perftest``'s own 300 KB ping-pong over
#: sysv hangs with 65,536-byte segments and runs with 65,535, and between two
#: ucxrpc workers with larger segments, messages of 64 KiB and more never
#: arrived, or arrived altered and failed their MAC (benchmarks/runs/Y.md).
MAX_SHM_SEG_SIZE = 65535
_SHM_SEG_VARS = {"SYSV": "UCX_SYSV_SEG_SIZE", "POSIX": "UCX_POSIX_SEG_SIZE",
                 "XPMEM": "UCX_XPMEM_SEG_SIZE"}
_MEMUNITS = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)b?\s*", re.IGNORECASE)


def _memunits(text: str) -> float | None:
    """A UCX size setting in bytes (``inf`` is infinite), or None where it
    is ``auto`` or not a size (UCX itself then says what is wrong)."""
    if text.strip().lower() == "inf":
        return math.inf
    found = _MEMUNITS.fullmatch(text)
    if found is None:
        return None
    return float(found[1]) * 1024 ** "bkmgt".index((found[2] or "b").lower())


def environment_problem(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """What in the ``UCX_*`` settings is known to break pipes without a word
    from UCX, naming the variable and what to set instead; None if nothing.
    (:class:`Worker` refuses to start on it; ``ucxrpc info`` shows it.)"""
    for transport, name in _SHM_SEG_VARS.items():
        # A transport's own variable wins over the family's (UCX's prefixes).
        for var in (name, "UCX_MM_SEG_SIZE"):
            if var in environ:
                size = _memunits(environ[var])
                if size is not None and size > MAX_SHM_SEG_SIZE:
                    return (f"{var}={environ[var]} is over {MAX_SHM_SEG_SIZE} bytes: UCX's "
                            f"shared-memory queue ({transport.lower()}) records a fragment's "
                            "length in 16 bits, so larger segments lose or corrupt messages "
                            f"of more than one segment; set {var} to at most "
                            f"{MAX_SHM_SEG_SIZE} or leave it unset")
                break
    return None


def ucx_environment(transports: Sequence[str] | None, host_timeout: float = 10.0,
                    environ: dict[str, str] | os._Environ[str] = os.environ, *,
                    device_memory: bool = False) -> dict[str, str]:
    """Return the ``UCX_*`` settings ucxrpc needs, without applying them.

    They must be in the environment before ``ucxx`` is first imported: that
    import loads libucs, which reads its global options (``MEMTYPE_CACHE``,
    ``WARN_UNUSED_ENV_VARS``) once, there and then.

    Shared memory only works with endpoint error handling when
    ``UCX_MM_ERROR_HANDLING=y`` (UCX-NOTES pitfall 1); without it UCX falls
    back to TCP over loopback.  UCX's keepalive checks what a peer's kernel
    or hardware answers (a TCP segment acknowledged, a shared-memory peer's
    process still there), never the peer's own code, so a busy peer passes;
    its TCP keepalive gives up on a silent host after about
    ``host_timeout``, as the lifelines do.  Within a host, messages below
    2 MiB go eagerly (``UCX_RNDV_THRESH``), unless this process may send
    ``device_memory`` (it has a usable GPU): then UCX picks per memory
    type.  Variables the user already
    set win, except ``UCX_TLS`` when ``transports=`` is given explicitly
    (see :func:`ucx_tls`).
    """
    idle, interval = keepalive_schedule(host_timeout)
    wanted = {
        "UCX_MM_ERROR_HANDLING": "y",
        # UCX's memory-type cache off, as UCX's GPU guide asks (ucxx asks
        # too, but sets it after loading libucs, which has read its global
        # options by then: it never took effect).  With the cache on, UCX
        # patches CUDA's allocation calls in every loaded library to track
        # device memory, and misclassifies memory allocated before that.
        "UCX_MEMTYPE_CACHE": "n",
        # UCX's own default (1.18+): rendezvous pipelines may stage through
        # host or device fragments, whichever UCX rates faster for the pair
        # of memory types.  ucxx sets the deprecated UCX_RNDV_FRAG_MEM_TYPE=cuda
        # on import, which allows device fragments only: those need an
        # active CUDA context in the process (a worker receiving cuda:0 into
        # its CPU has none of its own), and a cross-host pipeline to host
        # memory over TCP has no use for them.  The plural wins over the alias.
        "UCX_RNDV_FRAG_MEM_TYPES": "host,cuda",
        # Within a host, messages below 2 MiB go eagerly through the peer's
        # shared-memory FIFO instead of by rendezvous.  With peer-failure
        # error handling UCX offers no CMA lane (its rendezvous then needs
        # memory domains that can revoke a peer's access, which CMA's cannot:
        # UCT_MD_FLAG_INVALIDATE_RMA in ucp/wireup/select.c), so its
        # rendezvous copies fragment by fragment through shared memory too,
        # and each step of its handshake costs a scheduler slice on a busy
        # host: 256 KiB one-way beside one busy process, p90 3.5 -> 0.7 ms
        # and CPU per call halved at 512 KiB (benchmarks/runs/G.md); 1 MiB, p50 684 -> 541
        # µs one-way and 976 -> 824 µs echoed beside one busy process,
        # 479 -> 391 µs echoed on a quiet host at 2 MiB (benchmarks/runs/J.md).  Larger ones
        # stay rendezvous: an eager message that lands before its receive is
        # posted is held in UCX's unexpected queue, so the threshold also
        # bounds what a receiver holds per message (16 MiB eagerly was twice
        # as slow).  Across hosts UCX keeps choosing.  (Large host buffers
        # within a host are read by address instead, where the pipe allows
        # it: cma.py.)
        #
        # Not for a process that sends device memory: the threshold is one
        # for every memory type, and an eager CUDA message is copied to the
        # peer's FIFO 8 KiB at a time, a synchronous device copy per
        # fragment on each side.  On an H100 (two processes, cuda_ipc
        # lane) a 1 MiB GPU-direct call took 1,975 µs eagerly and 727 µs
        # with UCX's own choice (rendezvous: cuda_ipc from 22 KB); ucxrpc
        # bench's bidirectional 1 MiB cost 58 ms of CPU per call eagerly
        # (benchmarks/runs/R.md).  Such a process takes UCX's
        # choice for its host messages too.
        "UCX_RNDV_THRESH": ("auto" if device_memory
                            else f"intra:{INTRA_EAGER_MAX >> 20}M,inter:auto"),
        "UCX_KEEPALIVE_INTERVAL": "1s",
        "UCX_KEEPALIVE_NUM_EPS": "inf",
        "UCX_TCP_KEEPIDLE": f"{idle}s",
        "UCX_TCP_KEEPINTVL": f"{interval}s",
        "UCX_TCP_KEEPCNT": str(max(1, math.ceil((host_timeout - idle) / interval))),
    }
    out = {k: v for k, v in wanted.items() if k not in environ}
    if "UCX_RNDV_FRAG_MEM_TYPE" in environ:  # the user's, under its old name
        out.pop("UCX_RNDV_FRAG_MEM_TYPES", None)
    if transports:
        out["UCX_TLS"] = ucx_tls(transports)
    tls = effective_tls(transports, environ)
    if tls not in ("", "all") and "UCX_WARN_UNUSED_ENV_VARS" not in environ:
        # A narrowed transport list leaves some of the settings above unread
        # (UCX_TCP_* without tcp, UCX_MM_ERROR_HANDLING without shared
        # memory), and UCX would warn about each at every start.  With all
        # transports the warning stays on: it is how a mistyped variable, or
        # one set too late to be read, shows.
        out["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    return out


def effective_tls(transports: Sequence[str] | None,
                  environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The ``UCX_TLS`` UCX runs with: ``transports=`` where given (it wins),
    else the user's, else all."""
    return ucx_tls(transports) if transports else environ.get("UCX_TLS", "all")


def cuda_memory(cuda_support: bool, resources: Sequence[tuple[str, str]]) -> bool:
    """Whether device memory is safe to hand to this UCX context: its build
    has CUDA (``cuda_support``, ucxx's test of the build and ``UCX_TLS``)
    and ``cuda_copy``, the one CUDA transport whose memory domain detects
    device memory, is among its ``resources`` (transport, device)."""
    return bool(cuda_support) and any(t == "cuda_copy" for t, _ in resources)


_retired: list[Any] = []


_PRINT_CONFIG_AND_HIDDEN = 1 | 8  # UCS_CONFIG_PRINT_CONFIG | UCS_CONFIG_PRINT_HIDDEN


def effective_settings() -> dict[str, str]:
    """Every ``UCX_*`` setting as UCX in this process really has it, printed
    by UCX itself: libucs's global options (read once, when libucs loaded:
    ``UCX_MEMTYPE_CACHE`` among them) and a UCP configuration read now.

    Loads UCX (imports ucxx), so call it once the environment is prepared.
    """
    importlib.import_module("ucxx._lib.libucxx")  # loads UCX as ucxx does

    ucs, ucp = library("libucs.so"), library("libucp.so")
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    ucs.ucs_global_opts_print.argtypes = [ctypes.c_void_p, ctypes.c_int]
    ucp.ucp_config_read.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                    ctypes.POINTER(ctypes.c_void_p)]
    ucp.ucp_config_print.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                     ctypes.c_int]
    ucp.ucp_config_release.argtypes = [ctypes.c_void_p]
    with tempfile.TemporaryFile("w+") as out:
        stream = libc.fdopen(os.dup(out.fileno()), b"w")
        if not stream:
            raise OSError(ctypes.get_errno(), "fdopen failed")
        try:
            ucs.ucs_global_opts_print(stream, _PRINT_CONFIG_AND_HIDDEN)
            config = ctypes.c_void_p()
            if ucp.ucp_config_read(None, None, ctypes.byref(config)) == 0:
                ucp.ucp_config_print(config, stream, None, _PRINT_CONFIG_AND_HIDDEN)
                ucp.ucp_config_release(config)
        finally:
            libc.fclose(stream)
        out.seek(0)
        text = out.read()
    return dict(re.findall(r"^(UCX_\w+)=(.*)$", text, re.MULTILINE))


def as_array_source(buf: torch.Tensor | np.ndarray | bytes | bytearray | memoryview) -> Any:
    """What ucxx's ``Array`` accepts for ``buf`` (UCX-NOTES pitfall 6)."""
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
            err = BrokenError(f"UCX request failed: {exc}")
            err.__cause__ = exc
            return err
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
            self._ep = worker.raw.create_endpoint_from_worker_address(addr, True)
        except Exception as exc:
            raise ConnectError(f"cannot open a UCX endpoint: {exc}") from exc
        self._ucx = ucx
        self._Array = worker.Array
        self._ucp = ucp()
        self._device_ucp = worker.device_ucp
        self._handle = int(self._ep.handle)  # 0 once closed: never sent on after
        self._ep.set_close_callback(self._closed, cb_args=(on_error,))

    @staticmethod
    def _closed(on_error: Callable[[BaseException], None], *args: Any) -> None:
        status = args[0] if args else "closed"
        on_error(BrokenError(f"UCX endpoint failed: {status}"))

    def tag_send(self, buf: Any, tag: int) -> Request:
        """Send ``buf`` with ``tag``: host arrays, a :class:`.Gather`'s parts
        and (by default) CUDA tensors directly, the rest through ucxx.  Only while open (callers
        hold the pipe's lock, as :meth:`close`'s callers do)."""
        if not self._handle:
            raise BrokenError("UCX endpoint already closed")
        if type(buf) is Gather:
            return self._ucp.send_iov(self._handle, buf.iov, tag, buf)
        arr = _host_array(buf)
        if arr is not None:
            return self._ucp.send(self._handle, arr, tag)
        if self._device_ucp and _device_buffer(buf):
            return self._ucp.send_device(self._handle, buf.data_ptr(),
                                         buf.numel() * buf.element_size(), tag, buf)
        src = as_array_source(buf)
        return UcxxRequest(self._ep.tag_send(self._Array(src), self._ucx.UCXXTag(tag)), (buf, src))

    def transports(self) -> list[tuple[str, str]]:
        try:
            return self._ucp.transports(int(self._ep.handle))
        except Exception:  # diagnostics must never break a pipe
            logger.debug("ucp_ep_query failed", exc_info=True)
            return []

    def close(self) -> None:
        self._handle = 0
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
    raw: Any  # the UCP message handle, for :meth:`Worker.recv_probed`


class Worker:
    """One UCX context and worker for the process, in blocking-progress mode.

    Blocking mode gives an epoll descriptor (``fd``) that :meth:`arm` makes
    readable on the next UCX event, so an idle progress loop can sleep.

    Raises:
        ValueError: a ``UCX_*`` setting known to break pipes
            (:func:`environment_problem`), before UCX loads.
    """

    def __init__(self, transports: Sequence[str] | None, host_timeout: float = 10.0, *,
                 device_memory: bool = False, device_path: str = DEVICE_PATHS[0]) -> None:
        # device_memory: this process may send CUDA memory (see ucx_environment)
        if (problem := environment_problem()) is not None:
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
        self._ucp = ucp()
        self._handle = int(self.raw.handle)

    def progress(self) -> None:
        self.raw.progress()

    def arm(self) -> bool:
        """True when armed (sleep is safe); False when events are pending."""
        return bool(self.raw.arm())

    def probe(self, tag: int, mask: int) -> Probe | None:
        """Take a message matching ``tag``/``mask`` off the unexpected queue;
        it must then be received with :meth:`recv_probed`."""
        found = self._ucp.probe(self._handle, tag, mask)
        return None if found is None else Probe(*found)

    def recv_probed(self, buf: np.ndarray, probe: Probe) -> Request:
        """Receive a probed message into host array ``buf``."""
        return self._ucp.receive(self._handle, buf, probe.raw)

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
        return UcxxRequest(self.raw.tag_recv(self.Array(src), self.ucx.UCXXTag(tag)), (buf, src))

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


def _resources(info: str) -> list[tuple[str, str]]:
    """(transport, device) pairs from a UCX context's printed info."""
    return [(t, d) for t, d in re.findall(r"resource \d+\s*:.*?--\s*(\S+?)/(\S+)", info)]


def local_resources() -> dict[str, Any]:
    """What UCX can use in this process: (transport, device) pairs and
    whether the UCX build has CUDA support, read from a throwaway context."""
    import ucxx._lib.libucxx as ucx  # noqa: PLC0415

    ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG,))
    return {"resources": _resources(str(ctx.info)), "cuda_support": bool(ctx.cuda_support)}
