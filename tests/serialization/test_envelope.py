"""The agent's message header around a pickled body
(ucxrpc/serialization/envelope.py): round trip, hints, bad input."""

from __future__ import annotations

import pytest

from ucxrpc.errors import FrameError
from ucxrpc.serialization import envelope as wire


def test_wire_header():
    payload = wire.encode(wire.MsgKind.RESPONSE, 99, b"body")
    hdr, body = wire.decode(memoryview(payload))
    assert (hdr.kind, hdr.msg_id, bytes(body)) == (wire.MsgKind.RESPONSE, 99, b"body")
    assert wire.parse_hint(wire.hint(wire.MsgKind.REQUEST, 2**40 + 5)) == (1, 2**40 + 5)
    with pytest.raises(FrameError, match="truncated message"):
        wire.decode(memoryview(payload[:5]))
    with pytest.raises(FrameError, match="unknown message kind 42"):
        wire.decode(memoryview(bytes([42]) + payload[1:]))
    with pytest.raises(FrameError, match="message version 9"):
        wire.decode(memoryview(payload[:1] + bytes([9]) + payload[2:]))
