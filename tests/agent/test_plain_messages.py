"""Plain messages (envelope.PLAIN): a call or a result with no tensor is
pickled in one C call and marked, and its receiver unpickles it with
pickle's own loads.  The flag is honoured only on a message without
buffers, and a plain body that does not unpickle gets the serializer's
words, as any other would."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import torch

from ucxrpc.agent.calls import Call
from ucxrpc.agent.core import RpcAgent
from ucxrpc.agent.info import WorkerInfo
from ucxrpc.agent.serving import Server
from ucxrpc.errors import SerializationError
from ucxrpc.serialization import envelope
from ucxrpc.serialization.pickler import Serializer


class _Calls:
    """The call table's part a reply touches: one call in flight."""

    def __init__(self) -> None:
        self.fut = torch.futures.Future()
        self.left = {5: Call(self.fut, 1)}
        self.completed: list[tuple[Any, Any]] = []

    def pop(self, msg_id: int) -> Call | None:
        return self.left.pop(msg_id, None)

    def complete(self, call: Call, value: Any = None, exc: BaseException | None = None) -> None:
        self.completed.append((value, exc))


class _Counting(Serializer):
    """A serializer that counts its loads (the usual way)."""

    def __init__(self) -> None:
        super().__init__()
        self.loads_called = 0

    def loads(self, payload: Any, buffers: Any) -> object:
        self.loads_called += 1
        return super().loads(payload, buffers)


def _agent() -> SimpleNamespace:
    accepted: list[tuple] = []
    return SimpleNamespace(calls=_Calls(), serializer=_Counting(), accepted=accepted,
                           _server=SimpleNamespace(accept=lambda *a: accepted.append(a)),
                           members=SimpleNamespace(name_of=lambda peer: f"worker{peer}"),
                           info=WorkerInfo("worker0", 0), _requested_at=0.0,
                           counters={"remote_errors": 0})


def _receive(agent: SimpleNamespace, kind: envelope.MsgKind, body: bytes, flags: int,
             buffers: list | None = None) -> None:
    payload = memoryview(envelope.encode(kind, 5, body, flags))
    RpcAgent._on_message(agent, 1, payload, buffers or [])


def test_a_plain_reply_is_unpickled_without_the_serializer():
    agent = _agent()
    _receive(agent, envelope.MsgKind.RESPONSE, pickle.dumps({"a": (1, "b")}, protocol=5),
             envelope.PLAIN)
    assert agent.calls.completed == [({"a": (1, "b")}, None)]
    assert agent.serializer.loads_called == 0


def test_an_unmarked_reply_takes_the_usual_way():
    agent = _agent()
    _receive(agent, envelope.MsgKind.RESPONSE, pickle.dumps(7, protocol=5), 0)
    assert agent.calls.completed == [(7, None)]
    assert agent.serializer.loads_called == 1


def test_the_flag_on_a_message_with_buffers_is_not_honoured():
    # A sender's error: the usual way takes its buffers (and, here, says the
    # pickle left one unused rather than dropping it unseen).
    agent = _agent()
    _receive(agent, envelope.MsgKind.RESPONSE, pickle.dumps(7, protocol=5), envelope.PLAIN,
             [torch.zeros(4, dtype=torch.uint8)])
    assert agent.serializer.loads_called == 1
    (value, exc), = agent.calls.completed
    assert isinstance(exc, SerializationError) and "uses 0" in str(exc)


def test_a_plain_reply_that_does_not_unpickle_is_named_as_any_other():
    agent = _agent()
    _receive(agent, envelope.MsgKind.RESPONSE, b"\x80\x05garbage", envelope.PLAIN)
    (value, exc), = agent.calls.completed
    assert isinstance(exc, SerializationError)
    assert "cannot decode the response from worker1: cannot unpickle message" in str(exc)


def test_a_request_goes_to_the_server_marked_as_it_came():
    agent = _agent()
    body = pickle.dumps((len, ((),), {}), protocol=5)
    _receive(agent, envelope.MsgKind.REQUEST, body, envelope.PLAIN)
    _receive(agent, envelope.MsgKind.REQUEST, body, 0)
    _receive(agent, envelope.MsgKind.REQUEST, body, envelope.PLAIN, [torch.zeros(1)])
    assert [a[-1] for a in agent.accepted] == [True, False, False]


def test_unknown_flags_are_ignored():
    agent = _agent()
    _receive(agent, envelope.MsgKind.RESPONSE, pickle.dumps(7, protocol=5), 0x8000)
    assert agent.calls.completed == [(7, None)]


class _ServedAgent:
    """What Server._serve and its replies use of an agent."""

    def __init__(self) -> None:
        self.info = WorkerInfo("worker1", 1)
        self.members = SimpleNamespace(name_of=lambda peer: f"worker{peer}")
        self.serializer = _Counting()
        self.devices: list = []
        self.counters = {"calls_served": 0}
        self.sent: list[tuple] = []

    def dumps_for(self, dest: int, obj: Any) -> Any:
        return self.serializer.dumps(obj)

    def send_message(self, peer, kind, msg_id, body, buffers, targets=None, flags=0) -> None:
        self.sent.append((kind, msg_id, bytes(body), list(buffers), flags))


def _serve(body: bytes, plain: bool) -> _ServedAgent:
    agent = _ServedAgent()
    server = Server(agent, pool=None)  # type: ignore[arg-type]
    server.unanswered = 1
    server._serve(0, 9, body, (), plain)
    assert server.unanswered == 0
    return agent


def test_a_plain_request_is_served_and_its_plain_result_marked():
    agent = _serve(pickle.dumps((divmod, (7, 2), {}), protocol=5), True)
    assert agent.serializer.loads_called == 0
    assert agent.sent == [(envelope.MsgKind.RESPONSE, 9, pickle.dumps((3, 1), protocol=5), [],
                           envelope.PLAIN)]


def test_a_result_with_a_tensor_is_not_marked():
    agent = _serve(pickle.dumps((torch.ones, (3,), {}), protocol=5), True)
    (kind, msg_id, body, buffers, flags), = agent.sent
    assert (kind, flags) == (envelope.MsgKind.RESPONSE, 0)
    assert torch.equal(agent.serializer.loads(body, buffers), torch.ones(3))


def test_a_plain_request_naming_a_missing_function_gets_the_usual_words_and_hint():
    # As the usual way words it: "cannot unpickle message", and torch's hint
    # for a function missing on the callee.
    body = pickle.dumps((divmod, (), {}), protocol=5).replace(b"divmod", b"nomod_")
    for plain in (True, False):
        agent = _serve(body, plain)
        (kind, msg_id, desc, buffers, flags), = agent.sent
        assert (kind, msg_id, flags) == (envelope.MsgKind.ERROR, 9, 0)
        tb = pickle.loads(desc)["tb"]
        assert "worker1 cannot decode a request from worker0: cannot unpickle message: " \
               "AttributeError" in tb
        assert "Ensure that UDFs are defined on both caller and callee modules" in tb
