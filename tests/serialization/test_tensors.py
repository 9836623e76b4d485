"""The tensor wire forms' own code (ucxrpc/serialization/tensors.py): the
in-band form, and the checks the receiving side makes before it views a
buffer.

Small host tensors inside the pickle stream (serialization.INBAND_MAX_*):
the first few small tensors of a message travel as their bytes in the
stream, so a message carrying a scalar needs no buffer and no bundle; what
does not qualify, or does not fit, takes the bundle (test_bundle.py) or its
own buffer, exactly as before.

A message's metadata is checked against the buffers it carried: a forged or
damaged one is refused with a SerializationError that says what was wrong.
Round trips of the per-buffer forms are in test_pickler.py.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from tests.serialization._helpers import ALL_DTYPES
from tests.serialization._helpers import assert_same as _assert_same
from tests.serialization._helpers import copied as _wire
from tests.serialization._helpers import copied_at as _wire_at
from tests.serialization._helpers import same as _same
from tests.serialization._helpers import sample as _sample
from ucxrpc.serialization.bundle import MARK
from ucxrpc.errors import SerializationError
from ucxrpc.serialization import pickler as serialization
from ucxrpc.serialization.pickler import (INBAND_MAX_BYTES, INBAND_MAX_TENSORS, GradCapture,
                                          Serializer, loads)
from ucxrpc.serialization.tensors import _DTYPE_CODES, _rebuild_inband


SER = Serializer()
# The per-buffer forms, nothing bundled or in band (as in test_pickler.py).
dumps = Serializer(bundle=False).dumps


def _roundtrip(obj, ser: Serializer = SER):
    p = ser.dumps(obj)
    return ser.loads(p.payload, _wire(p)), p


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (5, 3), (0,), (2, 0, 3)], ids=str)
def test_every_dtype_and_shape_travels_in_the_stream(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    t = _sample(dtype, (15,))[:n].reshape(shape).clone() if n else torch.empty(shape, dtype=dtype)
    back, p = _roundtrip(t)
    assert back.dtype == dtype and back.shape == t.shape
    assert _same(back, t)
    if n:  # an empty tensor has no bytes: it keeps the ordinary path
        assert p.buffers == []
        # A tensor of its own, as torch's agent makes: not a view of anything,
        # and resizable.
        assert back.untyped_storage().nbytes() == back.nbytes
        back.resize_(n + 7)


def test_a_scalar_reply_needs_no_buffer():
    back, p = _roundtrip((torch.tensor(2), {"loss": torch.tensor(0.25)}))
    assert p.buffers == [] and p.payload[:1] != MARK  # no bundle table either
    assert back[0].item() == 2 and back[1]["loss"].item() == 0.25


def test_the_budget_per_message_sends_the_rest_by_the_bundle():
    scalars = [torch.tensor(float(i)) for i in range(INBAND_MAX_TENSORS + 3)]
    back, p = _roundtrip(tuple(scalars))  # a tuple under RUN_MIN: tensor by tensor
    # The three over the count: the first as its own buffer, two bundled.
    assert [b.numel() for b in p.buffers] == [4, 2 * 4] and p.payload[:1] == MARK
    assert all(torch.equal(a, b) for a, b in zip(back, scalars))

    half = INBAND_MAX_BYTES // 2 // 4
    three = [torch.full((half,), float(i)) for i in range(3)]
    back, p = _roundtrip(three)
    # The third is over the bytes, and alone: its own buffer, no bundle.
    assert [b.numel() for b in p.buffers] == [half * 4] and p.payload[:1] != MARK
    assert all(torch.equal(a, b) for a, b in zip(back, three))

    big = torch.arange(INBAND_MAX_BYTES // 4 + 1, dtype=torch.float32)
    back, p = _roundtrip(big)
    assert [b.numel() for b in p.buffers] == [big.nbytes]
    assert torch.equal(back, big)


def test_bytes_are_taken_at_dumps():
    t = torch.arange(4.0)
    p = SER.dumps(t)
    t.add_(100)
    assert torch.equal(SER.loads(p.payload, _wire(p)), torch.arange(4.0))


def test_what_must_not_travel_as_raw_bytes_keeps_its_path():
    # requires_grad (its place in a capture), a Parameter, lazy negation and
    # conjugation (the bytes hold the unresolved values), a zero tensor (no
    # bytes at all): the bundle or the general path, values resolved.
    z = torch.complex(torch.arange(3.0), torch.ones(3))
    msg = {
        "grad": torch.ones(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.ones(2)),
        "neg": torch._neg_view(torch.arange(3.0)),
        "conj": z.conj(),
        "zero": torch._efficientzerotensor(4),
    }
    capture = GradCapture()
    back, p = _roundtrip((capture, msg))
    got_capture, got = back
    # Both require grad (a Parameter does by default), in the capture's order.
    assert [id(t) for t in capture.tensors] == [id(msg["grad"]), id(msg["param"])]
    assert [id(t) for t in got_capture.tensors] == [id(got["grad"]), id(got["param"])]
    assert got["grad"].requires_grad and torch.equal(got["grad"].detach(), torch.ones(3))
    assert isinstance(got["param"], torch.nn.Parameter)
    assert torch.equal(got["neg"], -torch.arange(3.0))
    assert torch.equal(got["conj"], z.conj().resolve_conj())
    assert torch.equal(got["zero"], torch.zeros(4))
    assert p.buffers  # none of them went in band


def test_shared_storage_still_arrives_shared():
    base = torch.arange(6.0)
    back, p = _roundtrip((base, base[2:4]))
    assert p.buffers  # two tensors of one storage: the per-storage path
    back[0][2] = 100.0
    assert back[1][0].item() == 100.0


def test_a_compacted_view_travels_in_band_as_its_own_copy():
    base = torch.arange(10_000.0)  # 40 KB: torch's rule sends a small view compacted
    back, p = _roundtrip(base[100:110])
    assert p.buffers == []
    assert torch.equal(back, base[100:110]) and back.untyped_storage().nbytes() == 40


def test_off_with_a_budget_of_nothing_or_without_bundling():
    t = torch.tensor(3.0)
    for ser in (Serializer(inband_tensors=0), Serializer(inband_bytes=0), Serializer(bundle=False)):
        back, p = _roundtrip(t, ser)
        assert len(p.buffers) == 1 and back.item() == 3.0


def _payload(*args) -> bytes:
    class Forged:
        def __reduce__(self):
            return (_rebuild_inband, args)
    return pickle.dumps(Forged(), protocol=5)


FLOAT = _DTYPE_CODES[torch.float32][0]


@pytest.mark.parametrize("args, why", [
    ((FLOAT, (3,), b"\0" * 8), "8 bytes for torch.float32 of shape"),
    ((FLOAT, (1 << 40, 1 << 40), b"\0" * 4), "bytes for torch.float32"),
    ((FLOAT, (-1, -1), b"\0" * 4), "malformed in-band tensor"),
    ((FLOAT, (1.0,), b"\0" * 4), "malformed in-band tensor"),
    ((FLOAT, [1], b"\0" * 4), "list shape"),
    ((FLOAT, (1,), bytearray(4)), "bytearray data"),
    ((FLOAT | 1, (1,), b"\0" * 4), "unknown tensor dtype code"),  # a grad flag
    ((999, (1,), b"\0" * 4), "unknown tensor dtype code"),
    (("float32", (1,), b"\0" * 4), "unknown tensor dtype code"),
])
def test_a_forged_in_band_tensor_is_refused_by_name(args, why):
    with pytest.raises(SerializationError, match=why):
        SER.loads(_payload(*args), [])


def test_the_shape_is_checked_before_anything_is_allocated():
    # 2**40 x 2**40 float32 would be 4 EiB: refused on its byte count alone.
    with pytest.raises(SerializationError):
        _rebuild_inband(FLOAT, (1 << 40, 1 << 40), b"")
    assert torch.equal(_rebuild_inband(FLOAT, (0, 5), b""), torch.empty(0, 5))


# --------------------------------------------------------------------------
# Errors on loads: SerializationError that says what was wrong


def test_too_few_buffers():
    pickled = dumps([torch.ones(3), torch.zeros(3)])
    with pytest.raises(SerializationError, match=r"^tensor 1 needs buffer 1 but the message has only 1 buffers$"):
        loads(pickled.payload, _wire_at(pickled)[:1])


def test_no_buffers_for_numpy():
    pickled = dumps(np.ones(20000))
    with pytest.raises(SerializationError, match=r"^pickle buffer 0 needs buffer 0 but the message has only 0 buffers$"):
        loads(pickled.payload, [])


def test_too_many_buffers():
    pickled = dumps(torch.ones(3))
    bufs = _wire_at(pickled) + [torch.zeros(4, dtype=torch.uint8)]
    with pytest.raises(SerializationError, match="^message has 2 buffers but its pickle uses 1$"):
        loads(pickled.payload, bufs)


def test_more_buffers_than_allowed():
    with pytest.raises(SerializationError, match="^message has 3 buffers; the limit is 2$"):
        Serializer(max_buffers=2).loads(dumps(None).payload, [torch.zeros(1, dtype=torch.uint8)] * 3)


def test_buffer_too_small():
    t = torch.ones(4, 256)
    pickled = dumps([torch.ones(2), t])
    bufs = _wire_at(pickled)
    bufs[1] = bufs[1][:100]
    with pytest.raises(SerializationError,
                       match=r"^tensor 1 needs bytes \[0, 4096\) but buffer 1 has 100 bytes$"):
        loads(pickled.payload, bufs)


def test_buffer_of_wrong_kind():
    pickled = dumps(torch.ones(2))
    with pytest.raises(SerializationError, match="^buffer 0 is not a 1-D contiguous uint8 tensor$"):
        loads(pickled.payload, [torch.ones(2)])


@pytest.mark.parametrize("payload", [b"", b"garbage", b"\x80\x05\x95", b"\x80\x05K\x01"],
                         ids=["empty", "garbage", "truncated", "no-stop"])
def test_garbage_payload(payload):
    with pytest.raises(SerializationError, match="cannot unpickle message"):
        loads(payload, [])


def test_truncated_real_payload():
    pickled = dumps({"a": torch.ones(3), "b": [1, 2, 3]})
    with pytest.raises(SerializationError, match="cannot unpickle message"):
        loads(pickled.payload[:-5], _wire_at(pickled))


class _Forged:
    """Pickles as a direct call of the rebuild function with chosen arguments."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (serialization._rebuild_tensor, self.args)


@pytest.mark.parametrize("args, message", [
    ((0, 0, "float32", (4,), (-1,), 0), "^tensor has negative shape"),
    ((0, 0, "float32", (4, 4), (1,), 0), "^tensor shape .* differ in length$"),
    ((0, 0, "no_such_dtype", (4,), (1,), 0), "^unknown tensor dtype 'no_such_dtype' in message$"),
    ((0, 3, "float32", (4,), (1,), 0), r"^tensor 0 needs bytes \[12, 28\) but buffer 0 has 16 bytes$"),
    ((0, -1, "float32", (4,), (1,), 0), r"^tensor 0 needs bytes \[-4, 12\)"),
    ((1, 0, "float32", (4,), (1,), 0), "^tensor 0 refers to buffer 1 out of order"),
    ((0, 0, "float32", (4,), (1,), 0, int), "^tensor 0 has type <class 'int'>, not a Tensor subclass$"),
])
def test_forged_metadata_is_rejected(args, message):
    payload = pickle.dumps(_Forged(*args), protocol=5)
    bufs = [torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]
    with pytest.raises(SerializationError, match=message):
        loads(payload, bufs)


class _ForgedVector:
    """Pickles as a direct call of the vector rebuild function."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (serialization._rebuild_vector, self.args)


_FLOAT32 = serialization._DTYPE_CODES[torch.float32][0]


@pytest.mark.parametrize("args, nbufs, message", [
    ((0, "x", 4), 2, "^unknown tensor dtype code 'x' in message$"),
    ((0, 1 << 20, 4), 2, "^unknown tensor dtype code 1048576 in message$"),
    ((1, _FLOAT32, 4), 2, "^tensor 0 refers to buffer 1 out of order"),
    ((0, _FLOAT32, 5), 2, r"^tensor 0 needs bytes \[0, 20\) but buffer 0 has 16 bytes$"),
    ((0, _FLOAT32, -1), 2, "^tensor has negative shape"),
    ((0, _FLOAT32, 4), 0, "^tensor 0 needs buffer 0 but the message has only 0 buffers$"),
], ids=["code-type", "code-range", "order", "too-small", "negative", "no-buffer"])
def test_forged_vector_metadata_is_rejected(args, nbufs, message):
    payload = pickle.dumps([_ForgedVector(*args), 0], protocol=5)
    bufs = [torch.zeros(16, dtype=torch.uint8) for _ in range(nbufs)]
    with pytest.raises(SerializationError, match=message):
        loads(payload, bufs)


@pytest.mark.parametrize("buf", [torch.ones(4), torch.zeros(2, 8, dtype=torch.uint8),
                                 torch.zeros(32, dtype=torch.uint8)[::2]],
                         ids=["float", "2-d", "strided"])
def test_vector_buffer_of_wrong_kind(buf):
    pickled = dumps(torch.ones(4))
    with pytest.raises(SerializationError, match="^buffer 0 is not a 1-D contiguous uint8 tensor$"):
        loads(pickled.payload, [buf])


def test_one_byte_buffer_with_any_stride_is_accepted():
    t = torch.tensor([7], dtype=torch.uint8)
    buf = torch.zeros(10, dtype=torch.uint8)[::5][:1]  # contiguous: one element
    assert buf.stride() == (5,)
    buf[0] = 7
    got = loads(dumps(t).payload, [buf])
    _assert_same(got, t)


@pytest.mark.parametrize("t", [torch.ones(2), torch.ones(2, 2)], ids=["vector", "general"])
def test_plain_unpickling_of_a_message_is_refused(t):
    pickled = dumps(t)
    with pytest.raises(SerializationError, match="^a ucxrpc tensor can only be unpickled by Serializer.loads$"):
        pickle.loads(pickled.payload)
