"""UCX's TCP connections as the kernel sees them, and the cut of a stuck one.

Why this exists.  A partition longer than ``peer_timeout`` ends a pipe, and
its endpoint is closed by force (``Transport._let_go_of_endpoint``): UCX
then fails what it held, and its TCP transport keeps the connection's
socket open to read on.  TCP does not give up on data it could not deliver
for ~15 minutes (``tcp_retries2``), so once the link is back the old
connection resumes: its retransmitted bytes, a message cut in the middle by
the close's purge among them, are parsed by UCX 1.21 on the endpoint it
had already let go.  Its memory is then corrupted: the outage test's
workers died of SIGSEGV inside ``uct_tcp_iface_handle_events`` (an event
for a freed endpoint) or of ``malloc``'s abort, in up to 1 run of 2 of
the test with the driver's spin taking frames (docs/ucx-notes.md,
pitfall 22; benchmarks/runs/AW.md).  With the
namespaces' ``tcp_retries2`` at 4 (the kernel ends such a connection in
~6 s, inside the partition) it died in none of 20.

So when an endpoint is discarded, its connections that are stuck (data
sent, retransmitted, and no acknowledgement for ``silence_s``) get
``TCP_USER_TIMEOUT`` of 1 ms: the kernel ends them at their next
retransmission, before it would retransmit, so no byte of them is
delivered after a heal.  UCX then sees the connection fail (``ETIMEDOUT``)
and frees its endpoint as it does for a dead peer.  UCX 1.22 has the setting itself
(``UCX_TCP_USER_TIMEOUT``); 1.21, which ucxx 0.52 requires, does not.

Which sockets are UCX's: the descriptors registered in the epoll sets
under the worker's wake-up descriptor (``/proc/self/fdinfo``: an epoll
lists each descriptor it watches as ``tfd:``); UCX's TCP transport
registers every connection it reads.  They are listed before the
endpoint is closed: the close of a transport's last endpoint takes its
epoll set out of the worker's (UCP stops progressing it until an
endpoint uses it again, which is when the old connection would resume).  Nothing of UCX's internals is read,
and a socket is never closed or read here: only its options are set.

Why not every connection, or a user timeout from the start: a peer that is
busy and reads nothing (its window closed) answers the kernel's window
probes, so its connection is not stuck by this test; ``TCP_USER_TIMEOUT``
set from the start would end it after the timeout all the same (Linux
5.11 and later), taking a busy peer for an unreachable one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

logger = logging.getLogger(__name__)

__all__ = ["Stuck", "cut_stuck", "stuck", "tcp_sockets"]

#: ``struct tcp_info`` up to ``tcpi_last_ack_recv`` (linux/tcp.h): eight
#: one-byte fields (state, ca_state, retransmits, probes, backoff, options,
#: the window scales, the rate flags), then 32-bit ones.
_TCP_INFO = struct.Struct("8B13I")
_RETRANSMITS, _BACKOFF = 2, 4
_UNACKED, _LAST_ACK_RECV = 8 + 4, 8 + 12
#: How deep epoll sets nest under the worker's descriptor (ucxx's, UCP's,
#: a transport's): a bound, not an expectation.
_MAX_DEPTH = 4
#: The user timeout a cut sets, ms (0 would mean the system's default).
_CUT_MS = 1


class Stuck(NamedTuple):
    """One of UCX's TCP connections that has data unacknowledged under
    retransmission: its descriptor, peer and silence (seconds since the
    last acknowledgement)."""

    fd: int
    peer: str
    silent_s: float


def _watched(epoll_fd: int) -> list[int]:
    """The descriptors an epoll set watches (empty if it is none)."""
    try:
        with open(f"/proc/self/fdinfo/{epoll_fd}") as f:
            return [int(line.split()[1]) for line in f if line.startswith("tfd:")]
    except (OSError, ValueError, IndexError):
        return []


def tcp_sockets(epoll_fd: int) -> list[int]:
    """The TCP sockets watched by ``epoll_fd`` or by the epoll sets under
    it, in ascending order."""
    seen: set[int] = set()
    found: set[int] = set()
    level = [epoll_fd]
    for _ in range(_MAX_DEPTH):
        nxt: list[int] = []
        for fd in level:
            if fd in seen:
                continue
            seen.add(fd)
            for watched in _watched(fd):
                if _is_tcp(watched):
                    found.add(watched)
                else:
                    nxt.append(watched)
        if not nxt:
            break
        level = nxt
    return sorted(found)


def _is_tcp(fd: int) -> bool:
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return False
    except OSError:
        return False
    with _borrowed(fd) as sock:
        return sock is not None and sock.type == socket.SOCK_STREAM and sock.family in (
            socket.AF_INET, socket.AF_INET6)


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """A socket object on a copy of descriptor ``fd`` (None if it is gone):
    closing the copy leaves UCX's own descriptor, and its connection, as
    they were."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None
        return
    with sock:
        yield sock


def stuck(fds: Iterable[int], silence_s: float) -> Iterator[Stuck]:
    """The TCP connections among ``fds`` with data retransmitted and not
    acknowledged for ``silence_s`` or longer."""
    for fd in fds:
        with _borrowed(fd) as sock:
            if sock is None:
                continue
            try:
                raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
                peer = sock.getpeername()
            except OSError:
                continue  # not connected, or not a TCP socket any more
            if len(raw) < _TCP_INFO.size:
                continue
            info = _TCP_INFO.unpack_from(raw)
            silent_s = info[_LAST_ACK_RECV] / 1000.0
            retransmitting = info[_RETRANSMITS] > 0 or info[_BACKOFF] > 0
            if retransmitting and info[_UNACKED] > 0 and silent_s >= silence_s:
                yield Stuck(fd, f"{peer[0]}:{peer[1]}", silent_s)


def cut_stuck(fds: Iterable[int], silence_s: float) -> list[Stuck]:
    """Have the kernel end every stuck connection among ``fds``
    (:func:`stuck`) at its next retransmission; what was cut.  Never
    raises: a descriptor that went meanwhile is skipped (one that now
    names a new connection is not stuck)."""
    cut = []
    for s in stuck(fds, silence_s):
        with _borrowed(s.fd) as sock:
            if sock is None:
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _CUT_MS)
            except OSError:
                continue
        cut.append(s)
    if cut:
        logger.info("cut %d TCP connection(s) of UCX stuck behind an outage (%s): they must "
                    "not resume after it", len(cut),
                    ", ".join(f"{s.peer}, silent {s.silent_s:.1f} s" for s in cut))
    return cut
