"""The BATCH frame's payload (ucxrpc/transport/wire/batch.py): messages packed
and cut apart again, each starting aligned, and tables that lie refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from ucxrpc.errors import FrameError
from ucxrpc.transport.wire import batch
from ucxrpc.transport.wire.frame import ALIGN, PREFIX, FrameKind, Limits, decode, encode

KEY = b"k" * 16
L = Limits()


def _message(i: int) -> np.ndarray:
    t = torch.arange(i, dtype=torch.float64)
    views = [(t.numel() * 8, t.numpy().data.cast("B"), -1)] if i else []
    frame, separate = encode(FrameKind.MESSAGE, 1000 + i, b"p" * i, views, b"", L, seal=False)
    assert separate == []
    return frame


def test_messages_come_back_whole_in_order_and_aligned():
    inner = [_message(i) for i in range(7)]
    payload = batch.pack(inner)
    assert len(payload) <= batch.size(inner)
    frame, _ = encode(FrameKind.BATCH, 5, payload, [], KEY, L)
    f = decode(frame, KEY, L)  # the batch's MAC covers every message
    got = batch.unpack(f.raw, PREFIX.size, len(f.payload))
    assert [m.tobytes() for m in got] == [m.tobytes() for m in inner]
    for i, raw in enumerate(got):
        assert (raw.ctypes.data - f.raw.ctypes.data) % ALIGN == 0
        m = decode(raw, None, L)
        assert (m.kind, m.seq, bytes(m.payload)) == (FrameKind.MESSAGE, 1000 + i, b"p" * i)
        if i:
            d = m.buffers[0]
            t = torch.from_numpy(raw[d.where:d.where + d.nbytes]).view(torch.float64)
            assert torch.equal(t, torch.arange(i, dtype=torch.float64))


def test_a_tampered_message_fails_the_batch_mac():
    frame, _ = encode(FrameKind.BATCH, 5, batch.pack([_message(3)]), [], KEY, L)
    frame[PREFIX.size + 200] ^= 1  # a byte of the message's pickle
    with pytest.raises(FrameError, match="MAC mismatch"):
        decode(frame, KEY, L)


@pytest.mark.parametrize("table, match", [
    (b"", "no message count"),
    (struct.pack("<I", 1000), "claims 1000 messages"),
    (struct.pack("<III", 1, 8, 1 << 20), "claims bytes"),
])
def test_tables_that_do_not_fit_are_refused(table, match):
    raw = np.frombuffer(bytes(PREFIX.size) + table + bytes(64), dtype=np.uint8)
    with pytest.raises(FrameError, match=match):
        batch.unpack(raw, PREFIX.size, len(table) if table else 2)


def test_a_batch_over_max_message_bytes_is_sent_when_each_message_in_it_is_under():
    """max_message_bytes is each message's limit, not a BATCH frame's: a
    callee with a small limit once refused its own batch of replies, and
    the calls in it timed out (tests/rpc/test_batching.py under load)."""
    limits = Limits(max_message_bytes=8 << 10)
    inner = [encode(FrameKind.MESSAGE, i, bytes(3000), [], b"", limits, seal=False)[0]
             for i in range(4)]
    frame, _ = encode(FrameKind.BATCH, 9, batch.pack(inner), [], KEY, limits)
    assert frame.nbytes > limits.max_message_bytes
    got = decode(frame, KEY, limits)
    held = list(batch.unpack(frame, PREFIX.size, len(got.payload)))
    assert [decode(raw, None, limits).seq for raw in held] == [0, 1, 2, 3]
    with pytest.raises(FrameError, match="exceeds max_message_bytes=8192"):
        encode(FrameKind.MESSAGE, 10, bytes(9000), [], KEY, limits)
