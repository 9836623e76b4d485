"""Cross-memory attach: a large host buffer read straight out of the
sender's memory by the receiver (``process_vm_readv``), one copy in all.

Why: with peer-failure handling on, UCX offers no CMA lane (its rendezvous
then needs memory domains that can revoke a peer's access, which CMA's
cannot: ucx/environment.py), so within a host it copies large messages twice, fragment
by fragment through a shared-memory FIFO, and both processes must keep
turning their loops for every fragment.  On a busy host each of those
turns waits for a scheduler slice.  Here the receiver copies the whole
buffer in one system call, below the GIL, while the sender sleeps; a
sender that dies meanwhile makes the call fail (``ESRCH``, ``EFAULT``), so
peer failure needs nothing from UCX.  TensorPipe's CMA channel works so.

How a pipe comes to use it (by_address.py): every worker publishes
:func:`offer` (its kernel, PID namespace and user, and the address of a
random token in its memory).  Once a peer's frames to us authenticate, we
read its token (:func:`probe`): that proves that the kernel lets us read
that process (same user, no Yama or seccomp rule against it, not in
another PID namespace), and only then do we tell the peer, in an
authenticated frame, that it may send us buffers by address.  Only where
UCX reaches the peer through shared memory: processes in two network
namespaces of one kernel talk over TCP, and their large buffers must not
go around it.  The sender holds each buffer until the receiver says it
read it (``ack`` in the next frame back, frame.py).

Only an authenticated frame makes us read anything, and only from the PID
the peer published: an unauthenticated sender cannot use us to look into
another process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from .pool import PAGE

__all__ = ["Offer", "allowed", "offer", "parse", "probe", "read", "write"]

#: Host buffers from this size travel by address where a pipe allows it,
#: instead of eagerly through UCX's shared-memory FIFO, fragment by
#: fragment, copied twice with both processes turning their loops for
#: every fragment.  Once from 2 MiB (where UCX switches to rendezvous
#: within a host, ucx/environment.py), when the read and the bookkeeping
#: around it were Python: then 256 KiB and 1 MiB echoes by address took
#: 8-30% longer on a quiet host (benchmarks/runs/W.md, the project's AMD
#: VM, where reading 1 MiB out of another process took 84-170 µs).  With
#: both ends in the native core (csrc/send.c, csrc/receive.c; Run BF, an
#: Intel VM where that read takes 52 µs), by address from 256 KiB: echoes
#: p50 on a quiet host 256 KiB 128 -> 90 µs, 512 KiB 225 -> 135, 1 MiB
#: 375 -> 270; beside a busy process of another session (its own
#: scheduler group: the adaptive strategy sees no contention there, and
#: our processes share one core's worth) 256 KiB 332 -> 166, 1 MiB 688 ->
#: 436.  ``ucxrpc bench`` quiet, 1 MiB: one-way 6.2 -> 10.3 GB/s, round
#: trip 5.5 -> 7.7, both ways 5.4 -> 9.0; 256 KiB both ways 0.84 -> 5.1.
MIN_BYTES = 256 << 10
#: ... and from this size while the sender's loop, or the receiver's (as
#: its last frame said), may not poll (a contended core, or the blocking
#: mode): there every wake-up and every copy costs a share of a core
#: someone else wants, and a receiver that sleeps takes an eager message as
#: a run of wake-ups.  128 KiB echoes beside a busy process: 242 -> 128 µs
#: by address (Run BF; 102 -> 68 on a quiet host, where MIN_BYTES rules:
#: the default sizes of ``ucxrpc bench`` have none between 64 and 256
#: KiB, and a host whose reads by address are slow, as the AMD VM's,
#: gains least there).  Below 64 KiB buffers go inline in their frame
#: (send.py's inline_max).
BUSY_MIN_BYTES = 128 << 10
#: Reads from this size are split in two halves, one copied on a helper
#: thread: a second core copies at once, as UCX's two copies through shared
#: memory do (one process copying in while the other copies out).  16 MiB
#: here: 1.0-1.1 ms in two halves, 1.5-1.6 in one call; at 4 MiB the
#: hand-off cost more than it saved (one-way p50 844-1,078 µs, against
#: 603-701 in one call).
SPLIT_BYTES = 8 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_call(name: str) -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _libc_call("process_vm_readv")
_writev = _libc_call("process_vm_writev")
# What a peer reads to learn whether it may read us: random, so that
# reading the right bytes proves it read this process.
_TOKEN = ctypes.create_string_buffer(secrets.token_bytes(16), 16)


class Offer(NamedTuple):
    """What a peer published: where its token is, and what must match."""

    domain: str
    address: int
    token: bytes


def _domain() -> str | None:
    """This kernel's boot id, PID namespace and user: a peer with the same
    can name this process by the PID it publishes."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{pidns}/{os.geteuid()}"


def offer() -> str | None:
    """What this worker publishes (None: it cannot be read by address)."""
    domain = _domain()
    if _readv is None or domain is None:
        return None
    return f"{domain}@{ctypes.addressof(_TOKEN):x}@{_TOKEN.raw.hex()}"


def parse(text: str | None) -> Offer | None:
    """A peer's published offer; None if absent or from another kernel,
    PID namespace or user (its PID would not name it here)."""
    if not text or _readv is None:
        return None
    try:
        domain, address, token = text.rsplit("@", 2)
        found = Offer(domain, int(address, 16), bytes.fromhex(token))
    except ValueError:
        return None
    return found if domain == _domain() and len(found.token) == 16 else None


def allowed(tls: str) -> bool:
    """Whether a ``UCX_TLS`` value leaves shared memory in: reading by
    address is a shared-memory transport, and a job limited to TCP (to
    measure it, say) must not find its bytes going another way."""
    names = [n.split(":")[0] for n in tls.split(",") if n]
    if not names or "all" in names:
        return True
    if all(n.startswith("^") for n in names):
        return not {"^cma", "^sm", "^all"} & set(names)
    return bool({"cma", "sm"} & set(names))


def read(pid: int, into: int, address: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``address`` in process ``pid`` to ``into`` here,
    without the GIL (ctypes drops it for the call); from
    :data:`SPLIT_BYTES`, half of it on a helper thread meanwhile.

    Raises:
        OSError: the kernel refused or the process is gone (``ESRCH``), or
            the range is not mapped there (``EFAULT``), with the errno.
    """
    _copy(_readv, "process_vm_readv from", pid, into, address, nbytes)


def write(pid: int, address: int, source: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``source`` here to ``address`` in process ``pid``,
    as :func:`read` does the other way round.

    Why both: the kernel pins the *other* process's pages, one page at a
    time, and a user's tensor sits on 4 KiB pages where ucxrpc's receive
    buffers sit on huge ones (pool.py).  16 MiB out of a user's tensor in
    two halves: read by the receiver 1.42 ms, written by its sender into
    the receiver's huge pages 0.68 ms (benchmarks/runs/AA.md).

    Raises:
        OSError: as :func:`read`.
    """
    _copy(_writev, "process_vm_writev into", pid, source, address, nbytes)


def _copy(fn: Any, name: str, pid: int, local: int, remote: int, nbytes: int) -> None:
    # ``name``: the call and its direction, as errors say it.
    if fn is None:
        raise OSError(errno.ENOSYS, f"{name.split()[0]} is not available")
    if nbytes < SPLIT_BYTES:
        _call(fn, name, pid, local, remote, nbytes)
        return
    half = (nbytes // 2) & ~(PAGE - 1)
    second = _second_half().submit(_call, fn, name, pid, local + half, remote + half,
                                   nbytes - half)
    try:
        _call(fn, name, pid, local, remote, half)
    finally:
        # Waits: never return while the other thread still copies.
        failed = second.exception()
    if failed is not None:
        raise failed


def _call(fn: Any, name: str, pid: int, local: int, remote: int, nbytes: int) -> None:
    done = 0
    while done < nbytes:
        here = _Iovec(local + done, nbytes - done)
        there = _Iovec(remote + done, nbytes - done)
        got = fn(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(err, f"{name} PID {pid}: {os.strerror(err)}")
        done += got


_copier_lock = threading.Lock()
_copier: ThreadPoolExecutor | None = None


def _second_half() -> ThreadPoolExecutor:
    """The thread that copies the second halves of split reads."""
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = ThreadPoolExecutor(1, thread_name_prefix="ucxrpc-cma-read")
        return _copier


def _forget_copier() -> None:
    # A forked child has the executor but not its thread: it starts its own.
    global _copier, _copier_lock
    _copier = None
    _copier_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_copier)


def probe(pid: int, peer: Offer) -> str | None:
    """Read ``peer``'s token from process ``pid``: None if that worked and
    the bytes are the ones it published, else why not."""
    buf = ctypes.create_string_buffer(16)
    try:
        read(pid, ctypes.addressof(buf), peer.address, 16)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if buf.raw == peer.token else "its token read back wrong"
