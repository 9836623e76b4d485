"""Lifelines (ucxrpc/transport/watch/lifeline.py) between real processes.

A child process holds a lifeline port; this process watches it.  What the
kernel says decides: a killed child is cut at once, an orderly close says
goodbye, a stopped child is never cut however long it stays stopped, a
closed port or another process's port is a gone peer, and a lifeline that
cannot be set up at all gives no verdict.  A reset lifeline, or one asked to
verify, asks the port again: the same token is the same process (back), a
refusal a gone one.  All traffic is on loopback (a host gone silent, LOST,
needs two hosts: tests/hosts/test_outage.py).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import struct
import time
from pathlib import Path

import pytest

from tests.workers import sigstop, spawn_worker, stop_worker
from ucxrpc.transport.watch.lifeline import (GOODBYE, LOOPBACK, TOKEN_BYTES, LifelineAddress,
                                             Lifelines, LineState, host_key)

pytestmark = pytest.mark.timeout(60)

HOST_TIMEOUT = 0.5
#: Far above what a cut takes on loopback (microseconds to milliseconds).
CUT_BOUND_S = 1.0


def hold_port(address_file: str, go_file: str) -> None:
    """The child: hold a lifeline port and publish its address; once
    ``go_file`` appears, close it in order; then wait to be killed."""
    lines = Lifelines(HOST_TIMEOUT)
    lines.start()
    tmp = address_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(lines.address.encode())
    os.replace(tmp, address_file)
    while not os.path.exists(go_file):
        time.sleep(0.01)
    lines.close()
    time.sleep(60)


class Child:
    """A spawned :func:`hold_port` process and the address it published."""

    def __init__(self, tmp_path: Path) -> None:
        self.address_file = tmp_path / "address"
        self.go_file = tmp_path / "go"
        self.proc = spawn_worker(hold_port, str(self.address_file), str(self.go_file))
        deadline = time.monotonic() + 30
        while not self.address_file.exists():
            assert self.proc.is_alive(), f"the child exited with {self.proc.exitcode}"
            assert time.monotonic() < deadline, "the child published no address"
            time.sleep(0.02)
        self.address = self.address_file.read_text()


@pytest.fixture
def child(tmp_path):
    c = Child(tmp_path)
    try:
        yield c
    finally:
        stop_worker(c.proc)


@pytest.fixture
def lines():
    lines = Lifelines(HOST_TIMEOUT)
    lines.start()
    try:
        yield lines
    finally:
        lines.close()


class Cuts:
    """Records ``on_cut`` calls with their time."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def __call__(self, reason: str, orderly: bool) -> None:
        self.q.put((time.monotonic(), reason, orderly))

    def next(self, timeout: float = 10.0) -> tuple[float, str, bool]:
        return self.q.get(timeout=timeout)

    def none(self, wait: float) -> bool:
        try:
            got = self.q.get(timeout=wait)
        except queue.Empty:
            return True
        raise AssertionError(f"cut: {got}")


def wait_state(lines: Lifelines, key: object, state: LineState, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while lines.state(key) is not state:
        assert time.monotonic() < deadline, f"lifeline {lines.state(key)}, not {state}"
        time.sleep(0.01)


@pytest.mark.processes
def test_a_killed_process_is_cut_at_once(child, lines):
    cuts = Cuts()
    lines.watch("peer", "child", child.address, cuts)
    wait_state(lines, "peer", LineState.UP)
    os.kill(child.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    at, reason, orderly = cuts.next()
    print(f"\n  cut {1e3 * (at - killed):.2f} ms after SIGKILL: {reason}")
    assert at - killed < CUT_BOUND_S
    assert "process is gone" in reason and not orderly
    assert lines.state("peer") is LineState.CUT
    assert cuts.none(0.2)  # once


@pytest.mark.processes
def test_an_orderly_close_says_goodbye(child, lines):
    cuts = Cuts()
    lines.watch("peer", "child", child.address, cuts)
    wait_state(lines, "peer", LineState.UP)
    child.go_file.touch()
    _, reason, orderly = cuts.next()
    assert (reason, orderly) == ("it shut down", True)
    assert child.proc.is_alive()


@pytest.mark.processes
def test_a_stopped_process_is_never_cut(child, lines):
    cuts = Cuts()
    lines.watch("peer", "child", child.address, cuts)
    wait_state(lines, "peer", LineState.UP)
    sigstop(child.proc.pid)
    try:
        assert cuts.none(6 * HOST_TIMEOUT)  # its kernel answers keepalive for it
        assert lines.state("peer") is LineState.UP
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
    os.kill(child.proc.pid, signal.SIGKILL)
    _, reason, _ = cuts.next()
    assert "process is gone" in reason


@pytest.mark.processes
def test_a_process_stopped_before_we_connect_is_watched(child, lines):
    """The kernel accepts the connection; the token comes once it runs."""
    sigstop(child.proc.pid)
    cuts = Cuts()
    try:
        lines.watch("peer", "child", child.address, cuts)
        assert cuts.none(4 * HOST_TIMEOUT)
        assert lines.state("peer") is LineState.CONNECTING
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
    wait_state(lines, "peer", LineState.UP)
    os.kill(child.proc.pid, signal.SIGKILL)
    _, reason, _ = cuts.next()
    assert "process is gone" in reason


def _here(port: int, token: bytes = b"t" * TOKEN_BYTES) -> str:
    return LifelineAddress(token, port, host_key(), ()).encode()


def test_nothing_listening_is_a_gone_peer(lines):
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    cuts = Cuts()
    lines.watch("peer", "p", _here(port), cuts)
    _, reason, orderly = cuts.next()
    assert "nothing listens at its lifeline port" in reason and "refused" in reason, reason
    assert not orderly


def test_another_process_on_the_port_is_a_gone_peer(lines):
    with socket.socket() as server:
        server.bind((LOOPBACK, 0))
        server.listen(1)
        cuts = Cuts()
        lines.watch("peer", "p", _here(server.getsockname()[1]), cuts)
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"x" * TOKEN_BYTES)  # not the token published
            _, reason, _ = cuts.next()
    assert "another process holds that port now" in reason, reason


def test_goodbye_right_after_the_token(lines):
    token = os.urandom(TOKEN_BYTES)
    with socket.socket() as server:
        server.bind((LOOPBACK, 0))
        server.listen(1)
        cuts = Cuts()
        lines.watch("peer", "p", _here(server.getsockname()[1], token), cuts)
        conn, _ = server.accept()
        with conn:
            conn.sendall(token + GOODBYE)
            assert cuts.next()[1:] == ("it shut down", True)


def test_no_address_to_try_gives_no_verdict(lines, caplog):
    cuts = Cuts()
    addr = LifelineAddress(b"t" * TOKEN_BYTES, 1234, "another-host/net:[1]", ()).encode()
    lines.watch("peer", "elsewhere", addr, cuts)
    wait_state(lines, "peer", LineState.NONE)
    assert cuts.none(0.1)
    assert "no lifeline to elsewhere" in caplog.text


@pytest.mark.processes
def test_forgotten_lines_are_not_cut(child, lines):
    cuts = Cuts()
    lines.watch("peer", "child", child.address, cuts)
    wait_state(lines, "peer", LineState.UP)
    lines.forget("peer")
    deadline = time.monotonic() + 5
    while lines.state("peer") is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(child.proc.pid, signal.SIGKILL)
    assert cuts.none(0.5)


def test_malformed_addresses_are_refused(lines):
    for bad in ["", "{}", '{"token": "00", "port": 1, "host_key": "h", "hosts": []}',
                LifelineAddress(b"t" * TOKEN_BYTES, 0, "h", ()).encode()]:
        with pytest.raises(ValueError, match="malformed lifeline address"):
            lines.watch("peer", "p", bad, Cuts())


def test_candidates():
    addr = LifelineAddress(b"t" * TOKEN_BYTES, 1, "host-a/net:[1]", ("10.0.0.2", "172.17.0.1"))
    assert addr.candidates("host-a/net:[1]", set()) == [LOOPBACK]
    # Another namespace or host: its addresses, less those that are ours too
    # (a docker bridge every host has reaches only ourselves).
    assert addr.candidates("host-a/net:[2]", {"172.17.0.1"}) == ["10.0.0.2"]
    assert LifelineAddress.decode(addr.encode()) == addr


def test_close_is_idempotent_and_releases_the_port():
    lines = Lifelines(HOST_TIMEOUT)
    port = lines.address.port
    lines.start()
    lines.close()
    lines.close()
    with socket.socket() as s:
        assert s.connect_ex((LOOPBACK, port)) != 0  # refused: the port is closed


# -- losses, resets and verifications ------------------------------------------

class Events:
    """Records every verdict of one line: ("cut", reason, orderly),
    ("lost", reason), ("back",)."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def cut(self, reason: str, orderly: bool) -> None:
        self.q.put(("cut", reason, orderly))

    def lost(self, reason: str) -> None:
        self.q.put(("lost", reason))

    def back(self) -> None:
        self.q.put(("back",))

    def next(self, timeout: float = 10.0) -> tuple:
        return self.q.get(timeout=timeout)

    def watch(self, lines: Lifelines, address: str) -> None:
        lines.watch("peer", "p", address, self.cut, on_lost=self.lost, on_back=self.back)


class Peer:
    """A lifeline port of our own on loopback: it answers with ``token``;
    ``reset`` drops a connection with a reset (as a kernel that forgot it
    does), ``stop`` closes the port (a gone process's refuses)."""

    def __init__(self, token: bytes = b"p" * TOKEN_BYTES) -> None:
        self.token = token
        self.server = socket.socket()
        self.server.bind((LOOPBACK, 0))
        self.server.listen(8)
        self.conns: list[socket.socket] = []

    @property
    def address(self) -> str:
        return _here(self.server.getsockname()[1], self.token)

    def accept(self) -> socket.socket:
        self.server.settimeout(10)
        conn, _ = self.server.accept()
        conn.sendall(self.token)
        self.conns.append(conn)
        return conn

    @staticmethod
    def reset(conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    def stop(self) -> None:
        self.server.close()

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.server.close()


@pytest.fixture
def peer():
    p = Peer()
    try:
        yield p
    finally:
        p.close()


def test_first_contact_says_back_so_a_pipe_broken_meanwhile_is_renewed(lines, peer):
    events = Events()
    events.watch(lines, peer.address)
    peer.accept()
    assert events.next() == ("back",)
    wait_state(lines, "peer", LineState.UP)


def test_a_reset_lifeline_is_asked_again_and_the_same_process_is_back(lines, peer):
    """After a partition, the peer's end may have given up first: its kernel
    resets ours.  Its port answers with the same token: it lives."""
    events = Events()
    events.watch(lines, peer.address)
    first = peer.accept()
    assert events.next() == ("back",)
    Peer.reset(first)
    peer.accept()  # the line asks again on a new connection
    assert events.next() == ("back",)
    assert lines.state("peer") is LineState.UP


def test_a_reset_lifeline_whose_port_is_closed_is_a_gone_process(lines, peer):
    events = Events()
    events.watch(lines, peer.address)
    first = peer.accept()
    assert events.next() == ("back",)
    peer.stop()
    Peer.reset(first)
    kind, reason, orderly = events.next()
    assert kind == "cut" and "nothing listens at its lifeline port" in reason and not orderly
    assert lines.state("peer") is LineState.CUT


def test_a_verification_asks_the_port_and_says_back_or_gone(lines, peer):
    """A pipe failed while its lifeline held (a UCX error): the port is asked
    on a new connection; the same token is the same process."""
    events = Events()
    events.watch(lines, peer.address)
    peer.accept()
    assert events.next() == ("back",)
    lines.verify("peer")
    peer.accept()
    assert events.next() == ("back",)
    assert lines.state("peer") is LineState.UP
    # Asked again, with the port closed: refused, the process is gone.
    peer.stop()
    lines.verify("peer")
    kind, reason, _ = events.next()
    assert kind == "cut" and "refused" in reason, reason


def test_gone_reads_nothing_from_a_live_line(lines, peer):
    events = Events()
    events.watch(lines, peer.address)
    peer.accept()
    assert events.next() == ("back",)
    wait_state(lines, "peer", LineState.UP)
    assert lines.gone("peer") is None
    assert lines.gone("nobody") is None


def test_every_move_of_a_line_is_the_tables():
    from ucxrpc.transport.watch.lifeline import _MOVES
    assert not _MOVES[LineState.CUT] and not _MOVES[LineState.NONE]
    assert LineState.LOST not in _MOVES[LineState.CONNECTING]  # no answer at first: NONE
    assert _MOVES[LineState.LOST] == {LineState.UP, LineState.CUT}
