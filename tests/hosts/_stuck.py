"""The processes of tests/hosts/test_stuck.py: a TCP client on host 0 whose
connections sit in epoll sets nested as UCX's do, and a server on host 1.

    python -m tests.hosts._stuck CTL server ADDRESS
    python -m tests.hosts._stuck CTL client ADDRESS

The server listens (``listening``), accepts two connections (the client's ``stuck`` one, then its
``idle`` one), reads whatever comes, writes ``got-hello`` once the idle one
brought ``hello``, and on ``stop`` writes ``server.json``: the bytes each
connection delivered.  The client connects both and writes ``ready``; once
the test writes ``dropping`` (both hosts drop what arrives) it sends 64 KiB
on the stuck one, waits until :func:`ucxrpc.transport.ucx.sockets.stuck`
names it, cuts it, waits for the kernel to end it and writes ``cut.json``;
once the test writes ``healed`` it sends ``hello`` on the idle one.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.hosts._harness import write
from tests.hosts._outage import wait_file
from ucxrpc.transport.ucx import sockets

PORT = 29611
#: What the stuck connection is given to send while the hosts drop packets.
SENT = 64 << 10
#: How long the silence must be before the client's look names a
#: connection stuck (its first retransmission comes after 200 ms).
SILENCE_S = 0.5
STEP_S = 20.0
TCP_CLOSE = 7  # linux/tcp_states.h


def _state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def server(ctl: Path, address: str) -> None:
    lst = socket.create_server((address, PORT))
    write(ctl / "listening", "")
    conns = [lst.accept()[0] for _ in range(2)]  # stuck, then idle: the client's order
    live = {sock: i for i, sock in enumerate(conns)}
    got = [0, 0]
    hello = False
    while not (ctl / "stop").exists():
        ready, _, _ = select.select(list(live), [], [], 0.05)
        for sock in ready:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""  # reset
            if data:
                got[live[sock]] += len(data)
            else:
                del live[sock]
        if got[1] >= 5 and not hello:
            hello = True
            write(ctl / "got-hello", "")
    write(ctl / "server.json", json.dumps({"stuck": got[0], "idle": got[1]}))


def client(ctl: Path, address: str) -> None:
    stuck_one = socket.create_connection((address, PORT))
    idle_one = socket.create_connection((address, PORT))
    # As UCX's: ucxx's epoll holds UCP's, which holds the transport's, which
    # holds the connections.
    inner, middle, outer = select.epoll(), select.epoll(), select.epoll()
    for sock in (stuck_one, idle_one):
        inner.register(sock.fileno(), select.EPOLLIN)
    middle.register(inner.fileno(), select.EPOLLIN)
    outer.register(middle.fileno(), select.EPOLLIN)
    fds = sockets.tcp_sockets(outer.fileno())
    write(ctl / "ready", "")
    wait_file(ctl / "dropping", STEP_S)
    stuck_one.setblocking(False)
    stuck_one.send(b"x" * SENT)  # within the send buffer: all queued at once
    deadline = time.monotonic() + STEP_S
    while not (found := list(sockets.stuck(fds, SILENCE_S))) and time.monotonic() < deadline:
        time.sleep(0.05)
    cut = sockets.cut_stuck(fds, SILENCE_S)
    deadline = time.monotonic() + STEP_S
    while _state(stuck_one) != TCP_CLOSE and time.monotonic() < deadline:
        time.sleep(0.05)
    out: dict[str, Any] = {
        "listed": fds == sorted((stuck_one.fileno(), idle_one.fileno())),
        "found": [s.fd == stuck_one.fileno() for s in found],
        "cut": [s.fd == stuck_one.fileno() for s in cut],
        "silent_s": [s.silent_s for s in cut],
        "stuck_timeout_ms": stuck_one.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        "idle_timeout_ms": idle_one.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        "stuck_closed": _state(stuck_one) == TCP_CLOSE,
        "stuck_error": stuck_one.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR),
    }
    write(ctl / "cut.json", json.dumps(out))
    wait_file(ctl / "healed", STEP_S)
    idle_one.sendall(b"hello")
    out["idle_closed"] = _state(idle_one) == TCP_CLOSE
    write(ctl / "client.json", json.dumps(out))
    wait_file(ctl / "stop", STEP_S)


def main() -> None:
    ctl, role, address = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    try:
        (server if role == "server" else client)(ctl, address)
    except BaseException:
        write(ctl / f"{role}.json", json.dumps({"error": traceback.format_exc()}))
        raise


if __name__ == "__main__":
    main()
