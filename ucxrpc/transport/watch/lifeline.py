"""Lifelines: the kernel tells us when a peer's process is gone.

A peer that is alive but not running Python (its GIL held by a long native
call, stopped by SIGSTOP, starved on an overloaded machine) is silent, and so
is a dead one; silence cannot tell them apart.  The kernel can: it closes a
process's sockets when the process ends, however it ends, and it answers TCP
keepalive for a process that is alive, whatever that process is doing.

So every transport listens on a TCP socket of its own (its *lifeline
port*), published with its worker address, and a pipe that opens to a peer
also connects to the peer's lifeline port.  The connection carries no data:
on accept the listener sends its 16-byte token, which tells the connector it
reached the right process (ports are reused; another host may hold the same
loopback port), and on an orderly close it sends one goodbye byte.  Then:

* the peer's process exits or is killed: its kernel closes the connection,
  and we read EOF at once (on this host: microseconds): CUT;
* nothing listens at the peer's port any more, or another process does: the
  peer is gone (a connection refused, or the wrong token): CUT;
* the peer's host goes silent (power, cable, partition; no FIN ever comes):
  TCP keepalive probes go unanswered and the kernel gives up after
  ``host_timeout`` seconds (``TCP_USER_TIMEOUT``).  That is no verdict on
  the process, which may well live behind a partition: the line is LOST,
  and a new round of connection attempts goes out every :data:`RETRY_S`
  until the peer's port answers: the same token, and the line is UP again
  (``on_back``); a refusal or another token, and it is CUT;
* the connection is reset: the peer's kernel forgot it, because its process
  is gone or because its end gave up first during a partition that has
  since healed.  The port is asked again (CHECKING), and its answer
  decides as above;
* the peer is alive, however busy: its kernel answers for it, and nothing
  is ever concluded from time alone.

One thread per process waits in ``epoll`` for all of this; it holds no GIL
while it waits and wakes only when something happened or a timed attempt is
due.  What it finds goes to the callbacks given to :meth:`Lifelines.watch`
(:class:`Verdicts`), from that thread.  The moves are :data:`_MOVES`.

A lifeline that cannot be set up at all (no answer to the first connection:
a firewall, a route missing) gives no verdict: the peer's death is then
noticed only through UCX's own errors, and a warning says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from ..._states import StateEnum
from ..ucx.environment import keepalive_schedule

logger = logging.getLogger(__name__)

TOKEN_BYTES = 16
GOODBYE = b"B"
LOOPBACK = "127.0.0.1"
#: On Linux, TCP_USER_TIMEOUT (milliseconds); not in every Python's socket.
_TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
#: Errors of a connection attempt that are a kernel's definite answer: the
#: port is closed at that address (the peer's process is gone).
_REFUSED = {errno.ECONNREFUSED}
_EVENTS_IN = select.EPOLLIN | select.EPOLLRDHUP
OnCut = Callable[[str, bool], None]


@dataclass(frozen=True)
class LifelineAddress:
    """Where a worker's lifeline port is, as published in its record.

    ``host_key`` names the kernel and network namespace it runs in: a peer
    with the same key reaches it over loopback, where a refused connection is
    a certain answer; others try ``hosts``, its non-loopback addresses.
    """

    token: bytes
    port: int
    host_key: str
    hosts: tuple[str, ...]

    def encode(self) -> str:
        return json.dumps({"token": self.token.hex(), "port": self.port,
                           "host_key": self.host_key, "hosts": list(self.hosts)})

    @staticmethod
    def decode(text: str) -> "LifelineAddress":
        """Raises ValueError on anything that is not a lifeline address."""
        try:
            d = json.loads(text)
            addr = LifelineAddress(bytes.fromhex(d["token"]), int(d["port"]), str(d["host_key"]),
                                   tuple(str(h) for h in d["hosts"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed lifeline address {text!r}: {exc}") from exc
        if len(addr.token) != TOKEN_BYTES or not 0 < addr.port < 65536:
            raise ValueError(f"malformed lifeline address {text!r}")
        return addr

    def candidates(self, here: str, mine: set[str]) -> list[str]:
        """The addresses to try from a process whose host key is ``here``
        and whose own addresses are ``mine`` (a peer address that is also
        ours, such as a docker bridge present on every host, cannot reach
        the peer)."""
        if self.host_key == here:
            return [LOOPBACK]
        return [h for h in self.hosts if h not in mine]


def host_key() -> str:
    """This kernel's boot id and this process's network namespace: equal for
    two processes exactly when one reaches the other over loopback."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "?"
    return f"{boot}/{netns}"


def interface_addresses(only: set[str] | None = None) -> list[str]:
    """IPv4 addresses of the interfaces that are up, loopback excluded;
    ``only``: interface names to keep (as in ``UCX_NET_DEVICES``)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            if only and name not in only:
                continue
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                out.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]))
            except OSError:  # no IPv4 address on it
                continue
    return out


def net_devices(environ: dict[str, str] | os._Environ[str] = os.environ) -> set[str] | None:
    """Interface names ``UCX_NET_DEVICES`` restricts UCX to (None: all), so
    lifelines take the paths UCX's own traffic takes."""
    value = environ.get("UCX_NET_DEVICES", "")
    names = {d.strip() for d in value.split(",") if d.strip() and ":" not in d}
    return None if not names or "all" in names else names




def keepalive(sock: socket.socket, host_timeout: float) -> None:
    """Have the kernel probe an idle connection and give up on it once the
    other host has answered nothing for ``host_timeout`` seconds."""
    idle, interval = keepalive_schedule(host_timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 16)  # TCP_USER_TIMEOUT decides
    sock.setsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT, max(1, int(host_timeout * 1000)))


def probe(address: str, timeout: float) -> str | None:
    """Ask the lifeline port at ``address`` (a published
    :meth:`LifelineAddress.encode`) once, now, blocking at most ``timeout``
    seconds per candidate: why its process is gone, by a kernel's answer
    (refused, another token, closed before saying who it is), or None where
    the same process answered or nothing did (no verdict).

    For a worker about to take the place of a member that may have died
    (a process restarted under the same name and rank): only a definite
    answer lets it.

    Raises:
        ValueError: ``address`` is malformed.
    """
    addr = LifelineAddress.decode(address)
    gone = []
    for host in addr.candidates(host_key(), set(interface_addresses())):
        try:
            with socket.create_connection((host, addr.port), timeout=timeout) as sock:
                sock.settimeout(timeout)
                got = b""
                while len(got) < TOKEN_BYTES:
                    data = sock.recv(TOKEN_BYTES - len(got))
                    if not data:
                        break
                    got += data
        except ConnectionRefusedError:
            gone.append(f"{host}:{addr.port}: nothing listens at its lifeline port")
            continue
        except OSError:  # no answer, no route: no verdict from this address
            continue
        if got == addr.token:
            return None  # the same process answered: it lives
        gone.append(f"{host}:{addr.port}: " + ("another process holds that port now"
                                               if len(got) == TOKEN_BYTES
                                               else "closed before saying who it is"))
    return "its process is gone: " + "; ".join(gone) if gone else None


class LineState(StateEnum):
    """Where the lifeline to one peer stands (moves: :data:`_MOVES`)."""

    CONNECTING = "connecting"  # first connection attempts out, no identity proved yet
    UP = "up"                  # connected to the peer's listener, its token checked
    #: The connection was reset (the peer's kernel forgot it: after a
    #: partition its end may have given up first): asking its port again.
    CHECKING = "checking"
    #: Its host answers nothing (keepalive unanswered for ``host_timeout``):
    #: asking its port again every :data:`RETRY_S` until it answers.
    LOST = "lost"
    NONE = "none"              # could not be set up: no kernel verdict for this peer
    CUT = "cut"                # the verdict was given (once)


#: The moves of a lifeline (:meth:`Lifelines._move`).  Only CUT is a
#: verdict that the process is gone; LOST and CHECKING end in UP once the
#: same process answers again, or in CUT once a kernel says it is gone.
_MOVES: dict[LineState, frozenset[LineState]] = {
    LineState.CONNECTING: frozenset({LineState.UP, LineState.CUT, LineState.NONE}),
    LineState.UP: frozenset({LineState.CHECKING, LineState.LOST, LineState.CUT}),
    LineState.CHECKING: frozenset({LineState.UP, LineState.LOST, LineState.CUT}),
    LineState.LOST: frozenset({LineState.UP, LineState.CUT}),
    LineState.NONE: frozenset(),
    LineState.CUT: frozenset(),
}

#: While a line is LOST, a new round of connection attempts starts this
#: often: each attempt is a new socket, whose first SYN goes out at once,
#: so a healed link is found within this, not after TCP's SYN back-off.
RETRY_S = 0.5
#: How long one attempt of a later round (not the first) may go unanswered.
RETRY_ATTEMPT_S = 2.0
#: Timed events due within this of a wake-up are handled in it: a LOST
#: line's attempts run out a few microseconds after a later round starts
#: (both timed from 0.5 s steps), and epoll's millisecond timeout may end
#: a wait just before what it waited for; handled one by one, they took a
#: third of the thread's wake-ups, each ~1 ms of CPU on a slow VM
#: (2026-11-30).
SLACK_S = 0.02
#: Verifications asked for by :meth:`Lifelines.verify` (a pipe failed
#: while its lifeline stayed up) start no sooner than this after the
#: previous one, doubling up to :data:`VERIFY_MAX_S` while they keep coming
#: within :data:`VERIFY_CALM_S` of each other: a pipe that fails again at
#: once is not re-established in a tight loop.
VERIFY_FIRST_S = 0.2
VERIFY_MAX_S = 8.0
VERIFY_CALM_S = 30.0


class Purpose(StateEnum):
    """Why a round of connection attempts runs: what its end means."""

    CONNECT = "connect"  # the first: no answer at all -> NONE
    CHECK = "check"      # after a reset: no answer -> LOST
    RETRY = "retry"      # while LOST: no answer -> still LOST
    VERIFY = "verify"    # while UP, asked for: no answer -> nothing


@dataclass(frozen=True)
class Verdicts:
    """What a line tells its watcher, each once per event, on the lifeline
    thread: ``cut(reason, orderly)`` the process is gone (once, final);
    ``lost(reason)`` its host answers nothing; ``back()`` the same process
    answered on a new connection (the first, and after a loss, a reset, or
    a verification)."""

    cut: OnCut
    lost: Callable[[str], None] | None = None
    back: Callable[[], None] | None = None


class _Round:
    """One connection attempt per candidate address, judged together: a
    kernel's definite answer on any (refused, a wrong token) says the peer is
    gone only if no attempt of the round reached it."""

    __slots__ = ("purpose", "patience", "pending", "definite", "indefinite")

    def __init__(self, purpose: Purpose, patience: float) -> None:
        self.purpose = purpose
        self.patience = patience  # seconds each attempt may go unanswered
        self.pending = 0
        self.definite: list[str] = []    # kernels' answers that the peer is gone
        self.indefinite: list[str] = []  # attempts that got no answer


class _Attempt:
    """One connection attempt to one candidate address."""

    __slots__ = ("sock", "host", "connected", "got", "deadline", "round")
    # ``deadline``: when to give up on a connection nobody answered.

    def __init__(self, sock: socket.socket, host: str, deadline: float, rnd: _Round) -> None:
        self.sock = sock
        self.host = host
        self.connected = False
        self.got = b""
        self.deadline = deadline
        self.round = rnd


class _Line:
    """The lifeline to one peer."""

    def __init__(self, key: Hashable, name: str, addr: LifelineAddress,
                 verdicts: Verdicts) -> None:
        self.key = key
        self.name = name
        self.addr = addr
        self.verdicts = verdicts
        self.state = LineState.CONNECTING
        self.attempts: dict[int, _Attempt] = {}
        self.sock: socket.socket | None = None
        self.retry_at = 0.0      # LOST: when the next round starts
        self.verify_at: float | None = None  # a verification asked for, due then
        self.verify_gap = VERIFY_FIRST_S
        self.verified_at = -VERIFY_CALM_S
        self.lost_at: float | None = None    # when it was found LOST or reset


class Lifelines:
    """The lifeline port of this process and its lifelines to peers.

    Thread-safety: :meth:`watch`, :meth:`forget`, :meth:`verify`,
    :meth:`state` and :meth:`close` may be called from any thread;
    everything else runs on the lifeline thread.

    Args:
        host_timeout: seconds a peer's host may leave TCP keepalive
            unanswered before its lifeline is lost.
    """

    def __init__(self, host_timeout: float) -> None:
        self.host_timeout = host_timeout
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        keepalive(self._listener, host_timeout)  # accepted sockets inherit it
        self._listener.bind(("0.0.0.0", 0))
        self._listener.listen(socket.SOMAXCONN)  # every peer may connect at once
        self._listener.setblocking(False)
        self._host_key = host_key()
        self._mine = set(interface_addresses())
        self.address = LifelineAddress(os.urandom(TOKEN_BYTES), self._listener.getsockname()[1],
                                       self._host_key,
                                       tuple(interface_addresses(net_devices())))
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Held to write to the eventfd and to close it: a write after the
        # close could land in whatever file reused the descriptor number.
        self._wake_lock = threading.Lock()
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._requests: deque[tuple[str, Hashable, _Line | None]] = deque()
        self._lines: dict[Hashable, _Line] = {}
        self._by_fd: dict[int, tuple[_Line, _Attempt | None]] = {}
        self._accepted: dict[int, socket.socket] = {}
        self._accepting = True
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ucxrpc-lifelines", daemon=True)
        self.cuts = 0
        #: Lifelines found LOST (keepalive unanswered), and found again.
        self.losses = 0
        self.returns = 0

    # ------------------------------------------------------------------ API

    def start(self) -> None:
        self._thread.start()

    def watch(self, key: Hashable, name: str, address: str, on_cut: OnCut, *,
              on_lost: Callable[[str], None] | None = None,
              on_back: Callable[[], None] | None = None) -> None:
        """Connect to the lifeline at ``address`` (a peer's published
        :meth:`LifelineAddress.encode`) and tell what the kernel says
        (:class:`Verdicts`): ``on_cut(reason, orderly)`` once if the peer is
        gone (``orderly``: it said goodbye first); ``on_lost(reason)`` when
        its host stops answering; ``on_back()`` when the same process
        answers again.  A key already watched is left as it is.

        Raises:
            ValueError: ``address`` is malformed.
        """
        line = _Line(key, name, LifelineAddress.decode(address),
                     Verdicts(on_cut, on_lost, on_back))
        self._request("watch", key, line)

    def forget(self, key: Hashable) -> None:
        """Stop watching ``key``; its callbacks will not be called."""
        self._request("forget", key, None)

    def verify(self, key: Hashable) -> None:
        """Ask ``key``'s peer again on a new connection (its pipe failed while
        its lifeline stayed up): ``on_back`` if the same process answers,
        ``on_cut`` if a kernel says it is gone, nothing if no answer comes
        (keepalive on the standing connection then decides).  Repeated
        requests back off (:data:`VERIFY_FIRST_S` to :data:`VERIFY_MAX_S`)."""
        self._request("verify", key, None)

    def state(self, key: Hashable) -> LineState | None:
        line = self._lines.get(key)
        return None if line is None else line.state

    def gone(self, key: Hashable) -> tuple[str, bool] | None:
        """Whether ``key``'s peer is gone by what already waits on its
        connection, read now without taking it (any thread): (reason,
        orderly), or None.  For a caller that must judge a failure at once:
        a peer's process that ends closes every socket of it together, and
        UCX may report its endpoint's failure before this thread has read
        the lifeline's end."""
        line = self._lines.get(key)
        sock = None if line is None else line.sock
        if line is None or line.state is not LineState.UP or sock is None:
            return None
        try:
            # A closed socket (the lifeline thread closing it meanwhile)
            # raises: no verdict then, the thread gives its own.
            data = sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return None
        if GOODBYE in data:
            return "it shut down", True
        if not data:
            return "its process is gone: its kernel closed the lifeline (exited or killed)", False
        return None

    def close(self) -> None:
        """Say goodbye on every accepted lifeline and close them all;
        idempotent.  Callbacks are not called after this returns."""
        if self._closing:
            return
        self._closing = True
        self._poke()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self._release()

    # ------------------------------------------------------------ the loop

    def _request(self, what: str, key: Hashable, line: _Line | None) -> None:
        self._requests.append((what, key, line))
        self._poke()

    def _poke(self) -> None:
        with self._wake_lock:
            if not self._closed:
                os.eventfd_write(self._wake_fd, 1)

    def _run(self) -> None:
        while not self._closing:
            try:
                for fd, events in self._epoll.poll(self._wait()):
                    self._dispatch(fd, events)
                self._take_requests()
                self._expire(time.monotonic())
            except Exception:
                logger.exception("lifeline loop error (continuing)")
        self._release()

    def _wait(self) -> float:
        """Seconds until the next timed event: an attempt running out, a LOST
        line's next round, a verification due (-1: none)."""
        due = [a.deadline for line in self._lines.values() for a in line.attempts.values()
               if not a.connected]
        for line in self._lines.values():
            if line.state is LineState.LOST:
                due.append(line.retry_at)
            if line.verify_at is not None:
                due.append(line.verify_at)
        if not due:
            return -1
        return max(0.0, min(due) - time.monotonic())

    def _dispatch(self, fd: int, events: int) -> None:
        if fd == self._wake_fd:
            try:
                os.eventfd_read(self._wake_fd)
            except BlockingIOError:
                pass
        elif fd == self._listener.fileno():
            self._accept()
        elif fd in self._accepted:
            self._on_accepted(fd)
        elif fd in self._by_fd:
            line, attempt = self._by_fd[fd]
            if attempt is None:
                self._on_line(line)
            else:
                self._on_attempt(line, attempt, events)

    def _take_requests(self) -> None:
        while self._requests:
            what, key, line = self._requests.popleft()
            if what == "forget":
                old = self._lines.pop(key, None)
                if old is not None:
                    self._drop(old)
            elif what == "verify":
                self._want_verify(self._lines.get(key), time.monotonic())
            elif key not in self._lines and line is not None:
                self._lines[key] = line
                self._round(line, Purpose.CONNECT, self.host_timeout)

    def _move(self, line: _Line, state: LineState) -> None:
        if state not in _MOVES[line.state]:
            raise AssertionError(f"lifeline to {line.name}: {line.state.value} -> "
                                 f"{state.value} is not a move of a lifeline")
        line.state = state

    # ---------------------------------------------------- accepting side

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors: stop accepting for now
                logger.warning("lifeline port: cannot accept (%s); peers may not see this "
                               "worker die until a connection closes", exc)
                self._epoll.unregister(self._listener.fileno())
                self._accepting = False
                return
            sock.setblocking(False)
            try:
                sock.send(self.address.token)  # a fresh socket's buffer takes 16 bytes
            except OSError:
                sock.close()
                continue
            self._accepted[sock.fileno()] = sock
            self._epoll.register(sock.fileno(), _EVENTS_IN)

    def _on_accepted(self, fd: int) -> None:
        """The connector closed its end (it shut down, died, or gave the
        connection up after a partition): let go."""
        sock = self._accepted[fd]
        try:
            if sock.recv(64):
                return  # nothing is expected from connectors; ignored
        except BlockingIOError:
            return
        except OSError:
            pass
        self._epoll.unregister(fd)
        del self._accepted[fd]
        sock.close()
        if not self._accepting:
            self._epoll.register(self._listener.fileno(), select.EPOLLIN)
            self._accepting = True

    # --------------------------------------------------- connecting side

    def _round(self, line: _Line, purpose: Purpose, patience: float) -> None:
        """Start a round of attempts at every candidate address, each given
        ``patience`` seconds to answer."""
        rnd = _Round(purpose, patience)
        hosts = line.addr.candidates(self._host_key, self._mine)
        deadline = time.monotonic() + patience
        for host in hosts:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            keepalive(sock, self.host_timeout)
            err = sock.connect_ex((host, line.addr.port))
            if err not in (0, errno.EINPROGRESS):
                sock.close()
                self._failed(rnd, line, host, os.strerror(err), err in _REFUSED)
                continue
            attempt = _Attempt(sock, host, deadline, rnd)
            rnd.pending += 1
            line.attempts[sock.fileno()] = attempt
            self._by_fd[sock.fileno()] = (line, attempt)
            self._epoll.register(sock.fileno(), select.EPOLLOUT | _EVENTS_IN)
        if rnd.pending == 0:
            self._judge(line, rnd)

    def _on_attempt(self, line: _Line, attempt: _Attempt, events: int) -> None:
        sock = attempt.sock
        if not attempt.connected:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._end_attempt(line, attempt)
                self._failed(attempt.round, line, attempt.host, os.strerror(err),
                             err in _REFUSED)
                return
            if not events & select.EPOLLOUT:
                return
            attempt.connected = True
            self._epoll.modify(sock.fileno(), _EVENTS_IN)
        try:
            data = sock.recv(64)
        except BlockingIOError:
            return
        except OSError as exc:
            data, why = b"", exc.strerror or str(exc)
        else:
            why = "closed before saying who it is"
        if not data:  # its process went away between listening and now
            self._end_attempt(line, attempt)
            self._failed(attempt.round, line, attempt.host, why, True)
            return
        attempt.got += data
        if len(attempt.got) < TOKEN_BYTES:
            return
        self._end_attempt(line, attempt)
        if attempt.got[:TOKEN_BYTES] == line.addr.token:
            self._up(line, attempt, GOODBYE in attempt.got[TOKEN_BYTES:])
            return
        attempt.sock.close()
        self._failed(attempt.round, line, attempt.host, "another process holds that port now",
                     True)

    def _end_attempt(self, line: _Line, attempt: _Attempt) -> None:
        fd = attempt.sock.fileno()
        self._epoll.unregister(fd)
        del self._by_fd[fd]
        del line.attempts[fd]
        attempt.round.pending -= 1
        if not attempt.connected or len(attempt.got) < TOKEN_BYTES:
            attempt.sock.close()

    def _failed(self, rnd: _Round, line: _Line, host: str, why: str, definite: bool) -> None:
        """An attempt of ``rnd`` ended without reaching the peer."""
        where = f"{host}:{line.addr.port}: {why}"
        (rnd.definite if definite else rnd.indefinite).append(where)
        if rnd.pending == 0:
            self._judge(line, rnd)

    def _judge(self, line: _Line, rnd: _Round) -> None:
        """Every attempt of ``rnd`` ended without reaching the peer: a
        verdict if a kernel answered, else what no answer means for the
        round's purpose."""
        if line.state is LineState.CUT or self._lines.get(line.key) is not line:
            return
        if rnd.definite:
            self._cut(line, "its process is gone: nothing listens at its lifeline port ("
                      + "; ".join(rnd.definite) + ")", False)
        elif rnd.purpose is Purpose.CONNECT and line.state is LineState.CONNECTING:
            self._move(line, LineState.NONE)
            logger.warning("no lifeline to %s (%s): its death will be noticed only through UCX "
                           "errors", line.name, "; ".join(rnd.indefinite) or "no address to try")
        elif rnd.purpose is Purpose.CHECK and line.state is LineState.CHECKING:
            self._lose(line, "its lifeline was reset and its host answers nothing since "
                       "(host down, or the network between us partitioned)")

    def _expire(self, now: float) -> None:
        due = now + SLACK_S  # (epoll may also end its wait a little early)
        for line in list(self._lines.values()):
            for attempt in list(line.attempts.values()):
                # A connected attempt reached a live kernel: its process may
                # be stopped or busy, and keepalive watches its host.
                if not attempt.connected and attempt.deadline <= due:
                    self._end_attempt(line, attempt)
                    attempt.sock.close()
                    self._failed(attempt.round, line, attempt.host,
                                 f"no answer within {attempt.round.patience:g} s", False)
            if line.state is LineState.LOST and due >= line.retry_at:
                line.retry_at = now + RETRY_S
                self._round(line, Purpose.RETRY, RETRY_ATTEMPT_S)
            if (line.verify_at is not None and due >= line.verify_at
                    and line.state is LineState.UP):
                line.verify_at = None
                line.verified_at = now
                self._round(line, Purpose.VERIFY, RETRY_ATTEMPT_S)

    def _want_verify(self, line: _Line | None, now: float) -> None:
        """Schedule a verification of an UP line (see :meth:`verify`)."""
        if line is None or line.state is not LineState.UP or line.verify_at is not None:
            return
        calm = now - line.verified_at > VERIFY_CALM_S
        line.verify_gap = VERIFY_FIRST_S if calm else min(VERIFY_MAX_S, line.verify_gap * 2)
        line.verify_at = max(now, line.verified_at + line.verify_gap)

    def _up(self, line: _Line, attempt: _Attempt, goodbye: bool) -> None:
        """An attempt reached the peer: it is this line's connection now."""
        for other in list(line.attempts.values()):
            self._end_attempt(line, other)
            other.sock.close()
        was = line.state
        if line.sock is not None:  # a verification's: the new one replaces it
            self._close_sock(line)
        if was is not LineState.UP:
            self._move(line, LineState.UP)
        line.sock = attempt.sock
        self._by_fd[attempt.sock.fileno()] = (line, None)
        self._epoll.register(attempt.sock.fileno(), _EVENTS_IN)
        logger.debug("lifeline to %s up through %s", line.name, attempt.host)
        if goodbye:
            self._cut(line, "it shut down", True)
            return
        if was in (LineState.LOST, LineState.CHECKING):
            self.returns += 1
            if line.lost_at is not None:
                logger.warning("lifeline to %s: its host answers again after %.1f s", line.name,
                               time.monotonic() - line.lost_at)
        line.lost_at = None
        # Every time, the first included: a pipe that failed meanwhile (a
        # UCX error while this line was still connecting) is renewed on it.
        self._tell(line, line.verdicts.back)

    def _on_line(self, line: _Line) -> None:
        assert line.sock is not None
        try:
            data = line.sock.recv(64)
        except BlockingIOError:
            return
        except TimeoutError:
            self._close_sock(line)
            self._lose(line, f"its host answered no TCP keepalive for {self.host_timeout:g} s "
                       "(host down, or the network between us partitioned)")
            return
        except OSError as exc:
            # A reset: its kernel no longer knows the connection.  Its process
            # may be gone, or its end may have given up during a partition
            # that has healed: its port says which.
            logger.info("lifeline to %s reset (%s): asking its port again", line.name,
                        exc.strerror or exc)
            self._close_sock(line)
            self._move(line, LineState.CHECKING)
            line.lost_at = time.monotonic()
            self._round(line, Purpose.CHECK, RETRY_ATTEMPT_S)
            return
        if GOODBYE in data:
            self._cut(line, "it shut down", True)
        elif not data:
            self._cut(line, "its process is gone: its kernel closed the lifeline "
                      "(exited or killed)", False)

    def _lose(self, line: _Line, reason: str) -> None:
        """Its host answers nothing: LOST, asked again every RETRY_S."""
        self._move(line, LineState.LOST)
        now = time.monotonic()
        if line.lost_at is None:
            line.lost_at = now
        line.retry_at = now  # at once: the next turn starts a round
        line.verify_at = None
        self.losses += 1
        logger.warning("lifeline to %s lost: %s", line.name, reason)
        self._tell(line, line.verdicts.lost, reason)

    def _cut(self, line: _Line, reason: str, orderly: bool) -> None:
        if line.state is LineState.CUT:
            return
        self._move(line, LineState.CUT)
        self._drop(line)
        self.cuts += 1
        self._tell(line, line.verdicts.cut, reason, orderly)

    def _tell(self, line: _Line, callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is None or self._lines.get(line.key) is not line:
            return  # none wanted, or forgotten meanwhile
        try:
            callback(*args)
        except Exception:
            logger.exception("lifeline callback for %s failed", line.name)

    def _close_sock(self, line: _Line) -> None:
        if line.sock is None:
            return
        fd = line.sock.fileno()
        if fd in self._by_fd:
            self._epoll.unregister(fd)
            del self._by_fd[fd]
        line.sock.close()
        line.sock = None

    def _drop(self, line: _Line) -> None:
        """Close every socket of ``line``; no callback."""
        for attempt in list(line.attempts.values()):
            self._end_attempt(line, attempt)
            attempt.sock.close()
        self._close_sock(line)
        line.verify_at = None

    def _release(self) -> None:
        """Close the port first (new connections are refused), then say
        goodbye on every accepted lifeline and close everything."""
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
        self._listener.close()
        for sock in self._accepted.values():
            try:
                sock.send(GOODBYE)
            except OSError:
                pass
            sock.close()
        self._accepted.clear()
        for line in self._lines.values():
            line.state = LineState.CUT  # closing ends every line, whatever its state: no verdict
            self._drop(line)
        self._epoll.close()
        with self._wake_lock:
            os.close(self._wake_fd)
