"""The agent's message header around a pickled body
(ucxrpc/serialization/envelope.py): round trip, hints, bad input."""

from __future__ import annotations

import pytest

from ucxrpc.errors import FrameError
from ucxrpc.serialization import envelope


def test_wire_header():
    payload = envelope.encode(envelope.MsgKind.RESPONSE, 99, b"body")
    hdr, body = envelope.decode(memoryview(payload))
    assert (hdr.kind, hdr.msg_id, bytes(body)) == (envelope.MsgKind.RESPONSE, 99, b"body")
    assert envelope.parse_hint(envelope.hint(envelope.MsgKind.REQUEST, 2**40 + 5)) == (1, 2**40 + 5)
    with pytest.raises(FrameError, match="truncated message"):
        envelope.decode(memoryview(payload[:5]))
    with pytest.raises(FrameError, match="unknown message kind 42"):
        envelope.decode(memoryview(bytes([42]) + payload[1:]))
    with pytest.raises(FrameError, match="message version 9"):
        envelope.decode(memoryview(payload[:1] + bytes([9]) + payload[2:]))
