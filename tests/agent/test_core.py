"""When the agent lets its progress loop poll for the next message
(``spin_while_rules``, read by the native core's ``Expect``): calls in
flight, or a peer that called us within ``CALLED_WITHIN_S``, and never
while a pool thread runs code."""

from __future__ import annotations

import time
from types import SimpleNamespace

from ucxrpc import _core
from ucxrpc.serialization import envelope
from ucxrpc.agent import core
from ucxrpc.transport.loop.strategy import Why
from ucxrpc.agent.core import RpcAgent


class _Pool:
    def __init__(self) -> None:
        self.busy = False

    @property
    def running(self) -> int:  # WorkerPool's: > 0 while a pool thread runs code
        return int(self.busy)


class _NoCalls:
    by_id: dict = {}  # CallTable's: no call in flight

    def pop(self, msg_id: int) -> None:
        return None  # a reply to a call that timed out: dropped


def _agent() -> SimpleNamespace:
    """The parts of an agent its message handler and polling rule touch."""
    accepted: list[tuple] = []
    return SimpleNamespace(_pool=_Pool(), calls=_NoCalls(),
                           _server=SimpleNamespace(accept=lambda *a: accepted.append(a)),
                           _requested_at=-core.CALLED_WITHIN_S, accepted=accepted)


def _spin_while(agent: SimpleNamespace) -> Why:
    return _core.Expect(core.spin_while_rules(agent))()


def _message(agent: SimpleNamespace, kind: envelope.MsgKind, msg_id: int) -> None:
    RpcAgent._on_message(agent, 1, memoryview(envelope.encode(kind, msg_id, b"")), [])


def test_a_reply_after_a_request_leaves_the_peer_expected():
    # Each side of an exchange both serves and calls: worker1 gets a request,
    # calls back from inside it, and takes the reply.  Counting only the last
    # message, the reply made it stop expecting the peer's next request, and
    # its loop slept in epoll once per exchange (benchmarks/runs/W.md).
    agent = _agent()
    assert _spin_while(agent) is Why.NOTHING_DUE  # nobody called yet
    _message(agent, envelope.MsgKind.REQUEST, 7)
    assert len(agent.accepted) == 1
    _message(agent, envelope.MsgKind.RESPONSE, 8)
    assert _spin_while(agent) is Why.AWAITED
    agent._pool.busy = True  # a pool thread runs code: it needs the GIL
    assert _spin_while(agent) is Why.COMPUTING


def test_a_request_long_ago_is_no_reason_to_poll():
    agent = _agent()
    agent._requested_at = time.monotonic() - 2 * core.CALLED_WITHIN_S
    assert _spin_while(agent) is Why.NOTHING_DUE
