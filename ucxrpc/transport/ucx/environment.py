"""The ``UCX_*`` settings ucxrpc runs UCX with, and what of them UCX really has.

UCX reads its variables once, when the library loads (docs/ucx-notes.md,
pitfall 7), so they are decided here, before :mod:`.binding` imports ucxx:
:func:`ucx_environment` (what ucxrpc needs, each with its reason),
:func:`ucx_tls` (``transports=`` as ``UCX_TLS``), :func:`environment_problem`
(settings known to break pipes without a word from UCX), and, once UCX is
loaded, :func:`effective_settings` (what UCX really read).  No ucxx type
crosses this module.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import os
import re
import tempfile
from typing import Sequence

from .ucp import library

__all__ = ["INTER_EAGER_MAX", "INTRA_EAGER_MAX", "MAX_SHM_SEG_SIZE", "TCP_SEG_SIZE",
           "effective_settings", "effective_tls",
           "environment_problem", "keepalive_schedule", "tcp_segment", "ucx_environment",
           "ucx_tls"]

def keepalive_schedule(host_timeout: float) -> tuple[int, int]:
    """TCP keepalive's idle time and probe interval, in whole seconds, for
    a connection to be given up after ``host_timeout`` seconds of silence
    (the lifelines' and UCX's own TCP endpoints alike).

    The kernel counts ``TCP_USER_TIMEOUT`` from the last segment the peer
    acknowledged, which on an idle connection is the last probe's answer:
    a host silent since just after one counts from there, so a cut is given
    up after ``host_timeout`` minus up to one idle time.  Probing every
    tenth of it (TCP's whole seconds allowing) keeps a blip well under
    ``host_timeout`` from being taken for a partition (with a third, a
    7 s cut ended a 10 s timeout's connections); one empty segment a
    second per connection costs nothing."""
    step = max(1, int(host_timeout / 10))
    return step, step


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
#: see :func:`ucx_environment`); host buffers from cma.MIN_BYTES (256 KiB)
#: are read by address instead where the pipe allows it (cma.py).
INTRA_EAGER_MAX = 2 << 20


#: Across hosts, messages from this size go by rendezvous
#: (``UCX_RNDV_THRESH``, see :func:`ucx_environment`).
INTER_EAGER_MAX = 4 << 20


#: The size of UCX's TCP fragments and receive buffers
#: (``UCX_TCP_RX_SEG_SIZE``, see :func:`ucx_environment`); every process of
#: a job must have the same (docs/ucx-notes.md, pitfall 20).
TCP_SEG_SIZE = "512K"


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


def tcp_segment(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """The size of UCX's TCP fragments in this process, in bytes
    (``UCX_TCP_RX_SEG_SIZE``, once :func:`ucx_environment` is applied), or
    None where it is not a size ucxrpc can read (UCX then says what is
    wrong).  Published with the worker's address: every worker of a job
    must have the same (docs/ucx-notes.md, pitfall 20)."""
    size = _memunits(environ.get("UCX_TCP_RX_SEG_SIZE", "64K"))
    return None if size is None or size == math.inf else int(size)


def environment_problem(environ: dict[str, str] | os._Environ[str] = os.environ, *,
                        device_memory: bool = False) -> str | None:
    """What in the ``UCX_*`` settings is known to break pipes without a word
    from UCX, naming the variable and what to set instead; None if nothing.
    (:class:`Worker` refuses to start on it; ``ucxrpc info`` shows it.)
    ``device_memory``: the process may hand UCX device memory."""
    cache = environ.get("UCX_MEMTYPE_CACHE", "").strip().lower()
    if device_memory and cache in ("y", "yes", "on", "1", "true"):
        # With the cache on but empty (torch allocated its segments before
        # UCX's hooks existed), UCX 1.19-1.21 may send a small buffer inline
        # as host memory whatever its memory type says (ucp_proto_is_inline
        # asks ucs_memtype_cache_is_empty): a lone CUDA scalar is read from a
        # device address on the host.
        return (f"UCX_MEMTYPE_CACHE={environ['UCX_MEMTYPE_CACHE']} in a process that sends "
                "CUDA memory: UCX's memory-type cache misses torch's allocations and may "
                "then read a small device buffer as host memory; unset it or set "
                "UCX_MEMTYPE_CACHE=n (ucxrpc's default)")
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
    ``UCX_MM_ERROR_HANDLING=y`` (docs/ucx-notes.md, pitfall 1); without it UCX falls
    back to TCP over loopback.  UCP's endpoint keepalive is off (the
    lifelines judge peers; it crashed after a forced close, pitfall 22);
    the TCP keepalive of UCX's sockets gives up on a silent host after about
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
        #
        # Across hosts (TCP), messages from 4 MiB go by rendezvous, where
        # UCX's own estimate sent everything below 22-25 MB eagerly.  A data
        # buffer's receive is posted once its frame has been read, so an
        # eager one landed in UCX's unexpected queue first (copied there out
        # of TCP's receive buffer, then again into the tensor), and its
        # sender pushed it into the socket inside ucp_tag_send_nbx, holding
        # the worker's lock for a millisecond or more while the progress
        # thread spun on that lock (10-16% of the sender's samples at
        # 16 MiB).  By rendezvous only a request goes at once, and the data
        # follows into the posted receive.  Below 4 MiB eagerly stays
        # faster: the rendezvous' extra round trip waits for the receiver's
        # frame handling (2 MiB one-way 1.4 GB/s eagerly, 0.9-1.1 by
        # rendezvous from 256 KiB or 1 MiB).  Two hosts over TCP, 512 KiB
        # segments (below), a loop of rpc_sync, medians of 3: 16 MiB
        # one-way 1.6 -> 2.1 GB/s, round trip 1.2 -> 2.0, CPU per call 21
        # -> 16 ms one-way, 48 -> 34 ms round trip (benchmarks/runs/AJ.md).
        "UCX_RNDV_THRESH": ("auto" if device_memory
                            else f"intra:{INTRA_EAGER_MAX >> 20}M,inter:{INTER_EAGER_MAX >> 20}M"),
        # UCX's TCP transport sends an active message (an eager fragment,
        # a rendezvous' data fragment) of at most this size, and reads at
        # most this much from a socket per progress call before copying it
        # out: 64 KiB by default, so 16 MiB took 256 fragments, receive
        # calls and turns of the loop.  With 512 KiB and the threshold
        # above, two hosts over TCP (ucxrpc bench --hosts netns, two
        # invocations of medians of 3 each way): 16 MiB one-way / round
        # trip / bidirectional 1.19 / 0.84-1.31 / 1.01-1.23 -> 1.80-1.91 /
        # 1.90-1.94 / 1.42-1.81 GB/s, 256 MiB 1.17-1.99 / 1.45-1.54 /
        # 1.38-2.40 -> 2.01-2.53 / 2.09-2.36 / 1.78-2.07; CPU per 16 MiB
        # one-way call 27 -> 18 ms (raw ucxx, which takes these settings
        # too: 16 MiB one-way 1.4-2.0 -> 2.3-3.5 GB/s)
        # (benchmarks/runs/AJ.md).  Within a host shared memory carries
        # everything: unchanged.  Every process of a job must have the same
        # size: a sender's fragments are sized by its own, and a receiver
        # with a smaller one overruns its buffer (docs/ucx-notes.md,
        # pitfall 20).
        "UCX_TCP_RX_SEG_SIZE": TCP_SEG_SIZE,
        # UCP's own keepalive (an endpoint check every interval) off: the
        # lifelines judge a peer (transport/watch/lifeline.py), and UCX
        # 1.21's keepalive can crash the process once an endpoint it was
        # checking is closed by force, as a broken pipe's is
        # (Transport._let_go_of_endpoint): its iterator is left on the freed
        # endpoint (openucx/ucx#11217).  tests/hosts/test_outage.py's worker
        # died of SIGSEGV in ucp_worker_progress in 3 of 7 runs with a 1 s
        # interval, in none of 31 with it off (docs/ucx-notes.md, pitfall
        # 22).  The sockets' own TCP keepalive below stays.
        "UCX_KEEPALIVE_INTERVAL": "inf",
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

