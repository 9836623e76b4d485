"""Property tests of every decoder that sees peer bytes (hypothesis, in process).

Each decoder, on any input, either returns something whose promises hold or
raises the clear error its docstring names (FrameError, AuthenticationError,
SerializationError); any other exception, a hang or a crash fails the test.

Serializer.loads unpickles, which runs code by design (only authenticated,
MAC-checked payloads reach it): random pickle bytes are not fuzzed.  What is
fuzzed is what loads does validate: the tensor rebuild calls a stream names
(buffer index, offset, dtype, shape, stride, flags, type) against the
buffers that actually arrived.
"""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, reject, settings
from hypothesis import strategies as st

from tests.fuzz.frames import (CLEAR_ERRORS, DESC_FIELDS, PREFIX_FIELDS, VALID_FLAGS, Spec,
                               as_array, build, decode_checked, desc_pos, extremes, put_int,
                               touches_mac)
from ucxrpc.serialization import envelope
from ucxrpc.serialization.tensors import _rebuild_tensor, _rebuild_vector
from ucxrpc.errors import AuthenticationError, FrameError, SerializationError
from ucxrpc.serialization.pickler import Serializer
from ucxrpc.transport.wire import auth
from ucxrpc.transport.wire.frame import (MAC_LEN, MAGIC, MIN_CHUNK_KIB, PREFIX, REMOTE, VERSION,
                                         WRITTEN, FrameKind, Limits, decode, encode, peek_seq)


KEY = b"k" * 16
LIMITS = Limits()

#: UCXRPC_FUZZ_SCALE=20 runs twenty times as many examples (a deeper, slower run).
SCALE = float(os.environ.get("UCXRPC_FUZZ_SCALE", "1"))
pytestmark = pytest.mark.timeout(60 * max(1.0, SCALE))


def fuzz(n: int) -> settings:
    """Bounded runs: the whole file stays well under 30 s on two cores."""
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------- strategies

specs = st.builds(
    Spec,
    kind=st.sampled_from([int(k) for k in FrameKind]),
    seq=st.integers(0, 2**64 - 1),
    payload=st.binary(max_size=96),
    plain=st.lists(st.tuples(st.integers(0, 300), st.sampled_from([-1, -1, 0, 3])), max_size=12),
    staged=st.lists(st.tuples(st.integers(0, 1 << 36), st.sampled_from([-1, 0, 7]),
                              st.integers(MIN_CHUNK_KIB, 2**32 - 1)), max_size=3),
    packs=st.lists(st.tuples(st.sampled_from([-1, 0, 2]), st.booleans(),
                             st.lists(st.integers(0, 512), min_size=1, max_size=9)),
                   max_size=2),
)

_WIDE = st.one_of(st.sampled_from([0, 1, 2, 63, 64, 65, 2**64 - 1, 2**63, 2**63 - 1, 2**32 - 1,
                                   2**32, 2**16 - 1, 2**15, -1, -2, -(2**15)]),
                  st.integers(-(2**63), 2**64 - 1))


def _fit(value: int, width: int, signed: bool) -> int:
    """``value`` wrapped into a field of ``width`` bytes."""
    bits = 8 * width
    value %= 1 << bits
    if signed and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("prefix"), st.sampled_from(sorted(PREFIX_FIELDS)), _WIDE),
    st.tuples(st.just("desc"), st.integers(0, 20), st.sampled_from(sorted(DESC_FIELDS)), _WIDE),
    st.tuples(st.just("flags"), st.integers(0, 20), st.sampled_from(VALID_FLAGS + (3, 8, 255))),
)


def apply(raw: np.ndarray, op: tuple) -> np.ndarray:
    n = raw.nbytes
    if op[0] == "flip":
        if not n:
            return raw
        out = raw.copy()
        out[op[1] % n] ^= 1 << op[2]
        return out
    if op[0] == "truncate":
        return raw[:op[1] % (n + 1)].copy()
    if op[0] == "extend":
        return np.concatenate([raw, as_array(op[1])])
    if op[0] == "prefix":
        pos, width, signed = PREFIX_FIELDS[op[1]]
        return put_int(raw, pos, width, _fit(op[2], width, signed), signed)
    nbuf = struct.unpack_from("<H", raw.data, 4)[0] if n >= 6 else 0
    if not nbuf:
        return raw
    if op[0] == "flags":
        pos, width, signed = desc_pos(op[1] % nbuf, "flags")
        return put_int(raw, pos, width, op[2], signed)
    pos, width, signed = desc_pos(op[1] % nbuf, op[2])
    return put_int(raw, pos, width, _fit(op[3], width, signed), signed)


def _frame(spec: Spec, key: bytes | None) -> np.ndarray:
    try:
        return build(spec, key, LIMITS)
    except FrameError:  # the spec itself breaks a limit (tested below)
        reject()


# ---------------------------------------------------------------- frames

@fuzz(400)
@given(data=st.binary(max_size=1024), key=st.sampled_from([None, KEY]))
@example(data=b"", key=None)
@example(data=b"UX", key=KEY)
def test_random_bytes_decode_to_a_checked_frame_or_frame_error(data, key):
    decode_checked(as_array(data), key, LIMITS)
    seq = peek_seq(as_array(data))
    assert (seq is None) if len(data) < PREFIX.size else 0 <= seq < 2**64


@fuzz(400)
@given(kind=st.integers(0, 255), nbuf=st.integers(0, 24), plen=st.integers(0, 300),
       seq=st.integers(0, 2**64 - 1), ack=st.integers(0, 2**64 - 1),
       rest=st.binary(max_size=900), key=st.sampled_from([None, KEY]))
def test_a_valid_prefix_over_random_bytes(kind, nbuf, plen, seq, ack, rest, key):
    """Past the magic and version checks: random descriptors and sizes."""
    raw = as_array(PREFIX.pack(MAGIC, VERSION, kind, nbuf, 0, plen, seq, ack) + rest)
    decode_checked(raw, key, LIMITS)


@fuzz(200)
@given(spec=specs, key=st.sampled_from([None, KEY]))
def test_encoded_frames_round_trip(spec, key):
    raw = _frame(spec, key)
    frame = decode_checked(raw, key, LIMITS)
    assert frame is not None
    assert (int(frame.kind), frame.seq, bytes(frame.payload)) == (spec.kind, spec.seq,
                                                                  spec.payload)
    nplain = len(spec.plain)
    assert [(d.nbytes, d.device) for d in frame.buffers[:nplain]] == spec.plain
    for d, (n, device) in zip(frame.buffers, spec.plain):
        if d.inline:  # the bytes made it, in place
            assert raw[d.where:d.where + n].tobytes() == bytes(i & 0xFF for i in range(n))
    staged = frame.buffers[nplain:nplain + len(spec.staged)]
    assert [(d.nbytes, d.device, d.arg) for d in staged] == spec.staged


@fuzz(600)
@given(spec=specs, ops=st.lists(mutations, min_size=1, max_size=4),
       key=st.sampled_from([None, KEY]))
def test_mutated_frames_never_escape_frame_error(spec, ops, key):
    raw = _frame(spec, key)
    bad = raw
    for op in ops:
        bad = apply(bad, op)
    frame = decode_checked(bad, key, LIMITS)
    if key is not None and touches_mac(raw, bad):
        # Layout, payload, length and the MAC itself are authenticated.
        assert frame is None, f"a mutated frame passed its MAC check: {ops}"


@fuzz(300)
@given(spec=specs, index=st.integers(0, 20), field=st.sampled_from(sorted(DESC_FIELDS)),
       pick=st.integers(0, 9))
def test_descriptor_fields_at_their_extremes(spec, index, field, pick):
    """2**64-1 sizes and offsets, negative devices, every flag byte: what a
    handshake frame (no MAC) or a buggy peer can put in a descriptor."""
    raw = _frame(spec, None)
    nbuf = struct.unpack_from("<H", raw.data, 4)[0]
    assume(nbuf)
    pos, width, signed = desc_pos(index % nbuf, field)
    values = extremes(width, signed)
    bad = put_int(raw, pos, width, values[pick % len(values)], signed)
    decode_checked(bad, None, LIMITS)
    keyed = _frame(spec, KEY)
    bad = put_int(keyed, pos, width, values[pick % len(values)], signed)
    if not np.array_equal(bad, keyed):
        with pytest.raises(FrameError):
            decode(bad, KEY, LIMITS)


# ---------------------------------------------------------------- oversize

@fuzz(100)
@given(limit=st.integers(0, 40), extra=st.integers(1, 30))
def test_more_buffers_than_max_buffers(limit, extra):
    limits = Limits(max_buffers=limit)
    bufs = [(1, None, 0)] * (limit + extra)
    with pytest.raises(FrameError, match=f"{limit + extra} buffers; the limit is {limit}$"):
        encode(FrameKind.MESSAGE, 1, b"", bufs, KEY, limits)
    raw, _ = encode(FrameKind.MESSAGE, 1, b"", bufs, KEY, Limits())
    with pytest.raises(FrameError, match=f"declares {limit + extra} buffers; the limit is {limit}$"):
        decode(raw, KEY, limits)


@fuzz(100)
@given(limit=st.integers(36, 4096), over=st.integers(1, 5000))
def test_frames_over_max_frame_bytes(limit, over):
    with pytest.raises(FrameError, match=f"exceeds max_frame_bytes={limit}$"):
        encode(FrameKind.MESSAGE, 1, b"x" * (limit + over), [], KEY, Limits(max_frame_bytes=limit))


@fuzz(100)
@given(sizes=st.lists(st.integers(0, 2**62), min_size=1, max_size=6),
       limit=st.integers(0, 2**63))
def test_messages_over_max_message_bytes(sizes, limit):
    """The sender refuses; the receiver gets the exact total, never wrapped."""
    bufs = [(n, None, 0) for n in sizes]
    raw, _ = encode(FrameKind.MESSAGE, 1, b"", bufs, KEY, Limits(max_message_bytes=2**80))
    total = raw.nbytes + sum(sizes)
    assert decode(raw, KEY, LIMITS).total == total
    if total > limit:
        with pytest.raises(FrameError, match=f"exceeds max_message_bytes={limit}$"):
            encode(FrameKind.MESSAGE, 1, b"", bufs, KEY, Limits(max_message_bytes=limit))


def test_lying_sizes_sum_past_two_to_the_64():
    """Twelve 2**64-1 byte buffers (the numpy decoder) must not wrap to a small total."""
    raw, _ = encode(FrameKind.MESSAGE, 1, b"", [(1, None, 0)] * 12, KEY, LIMITS)
    for i in range(12):
        pos, width, signed = desc_pos(i, "nbytes")
        raw = put_int(raw, pos, width, 2**64 - 1, signed)
    frame = decode_checked(raw, None, LIMITS)
    assert frame is not None and frame.total == raw.nbytes + 12 * (2**64 - 1)
    assert frame.total > LIMITS.max_message_bytes


def test_buffers_read_by_address_or_written_into_ours_decode_checked():
    """REMOTE and WRITTEN descriptors (host memory read by address, or
    written by the sender into a grant of ours) are valid flags, counted in
    the message's total; naming a device is refused.  (The checked
    invariants once lacked WRITTEN: atheris found it, 2026-11-29.)"""
    bufs = [(100, None, -1), (1 << 20, None, -1), (4, memoryview(b"abcd"), -1)]
    ways = [(REMOTE, 0, 0x7F0000001000), (WRITTEN, 3, 0), (0, 0, 0)]
    raw, separate = encode(FrameKind.MESSAGE, 1, b"p", bufs, KEY, LIMITS, ways)
    assert separate == []  # neither is sent as a tag message of its own
    frame = decode_checked(raw, KEY, LIMITS)
    assert frame is not None and [d.flags for d in frame.buffers] == [REMOTE, WRITTEN, 0]
    assert frame.total == raw.nbytes + 100 + (1 << 20)
    for i, flags in ((0, REMOTE), (1, WRITTEN)):
        pos, width, signed = desc_pos(i, "device")
        bad = put_int(raw, pos, width, 0, signed)
        assert decode_checked(bad, None, LIMITS) is None, flags


# ---------------------------------------------------------------- handshake

ids = st.integers(0, 0xFFFF)
nonces = st.binary(min_size=auth.NONCE_LEN, max_size=auth.NONCE_LEN)


@fuzz(300)
@given(payload=st.binary(max_size=80))
def test_parse_hello_on_random_payloads(payload):
    try:
        x, nx, gen = auth.parse_hello(memoryview(payload))
    except FrameError:
        assert len(payload) != 4 + auth.NONCE_LEN + 4
        return
    assert auth.hello(x, nx, gen) == payload


@fuzz(300)
@given(payload=st.binary(max_size=160), x=ids, y=ids, nx=nonces)
def test_check_challenge_on_random_payloads(payload, x, y, nx):
    with pytest.raises(CLEAR_ERRORS):
        auth.check_challenge(b"secret", memoryview(payload), x, y, nx)


@fuzz(300)
@given(payload=st.binary(max_size=80), x=ids, y=ids, nx=nonces, ny=nonces)
def test_check_proof_on_random_payloads(payload, x, y, nx, ny):
    with pytest.raises(CLEAR_ERRORS):
        auth.check_proof(b"secret", memoryview(payload), x, y, nx, ny)


@fuzz(300)
@given(x=ids, y=ids, nx=nonces, ny=nonces, pos=st.integers(0, 1000), bit=st.integers(0, 7),
       cut=st.integers(0, 1000), secret=st.binary(min_size=1, max_size=40))
def test_damaged_genuine_handshake_messages_are_refused(x, y, nx, ny, pos, bit, cut, secret):
    ch = bytearray(auth.challenge(secret, x, y, nx, ny))
    assert auth.check_challenge(secret, memoryview(bytes(ch)), x, y, nx) == ny
    flipped = bytearray(ch)
    flipped[pos % len(ch)] ^= 1 << bit
    with pytest.raises(CLEAR_ERRORS):
        auth.check_challenge(secret, memoryview(bytes(flipped)), x, y, nx)
    with pytest.raises(FrameError):
        auth.check_challenge(secret, memoryview(bytes(ch[:cut % len(ch)])), x, y, nx)
    # the responder's identity is bound: from anyone else it answers no HELLO
    # of ours, a stray frame dropped without breaking the pipe
    with pytest.raises(FrameError, match="answers a HELLO we did not send"):
        auth.check_challenge(secret, memoryview(bytes(ch)), x, y ^ 1, nx)
    pr = auth.proof(secret, x, y, nx, ny)
    flipped = bytearray(pr)
    flipped[pos % len(pr)] ^= 1 << bit
    with pytest.raises(AuthenticationError):
        auth.check_proof(secret, memoryview(bytes(flipped)), x, y, nx, ny)
    with pytest.raises(FrameError):
        auth.check_proof(secret, memoryview(pr[:cut % len(pr)]), x, y, nx, ny)
    with pytest.raises(AuthenticationError):  # the initiator's identity is bound
        auth.check_proof(secret, memoryview(pr), x ^ 1, y, nx, ny)
    with pytest.raises(AuthenticationError):  # a wrong secret
        auth.check_proof(secret + b"!", memoryview(pr), x, y, nx, ny)


@fuzz(100)
@given(x=ids, y=ids, nx=nonces, ny=nonces, ny2=nonces)
def test_a_replayed_proof_fails_against_a_fresh_nonce(x, y, nx, ny, ny2):
    assume(ny != ny2)
    pr = auth.proof(b"secret", x, y, nx, ny)
    with pytest.raises(AuthenticationError, match="replayed"):
        auth.check_proof(b"secret", memoryview(pr), x, y, nx, ny2)


# ---------------------------------------------------------------- message header

@fuzz(400)
@given(payload=st.binary(max_size=64))
@example(payload=bytes([1, 1]) + b"\0" * 14)
def test_wire_decode_on_random_payloads(payload):
    try:
        hdr, body = envelope.decode(memoryview(payload))
    except FrameError:
        return
    assert isinstance(hdr.kind, envelope.MsgKind)
    assert bytes(body) == payload[envelope.HEAD_SIZE:]
    assert envelope.encode(hdr.kind, hdr.msg_id, body, hdr.flags) == (payload[:4] + b"\0" * 4
                                                                  + payload[8:])


@fuzz(200)
@given(value=st.integers(0, 2**46 - 1))
def test_parse_hint_of_any_tag_hint(value):
    kind, msg_id = envelope.parse_hint(value)
    assert 0 <= kind < 8 and msg_id >= 0
    assert envelope.hint(kind, msg_id) == value


# ---------------------------------------------------------------- serializer

class _Sub(torch.Tensor):
    pass


class _Call:
    """Pickles as ``fn(*args)``: a stream naming a rebuild call directly."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


_BIG = torch.arange(512, dtype=torch.int64).to(torch.uint8)

small = st.integers(-3, 70)
huge = st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**62)])
dims = st.one_of(small, huge)
shapes = st.lists(dims, max_size=3).map(tuple)

rebuild_tensor = st.builds(
    lambda *a: _Call(_rebuild_tensor, a),
    st.one_of(st.integers(-2, 5), huge, st.just("0")),
    st.one_of(small, huge),
    st.sampled_from(["float32", "int64", "uint8", "bool", "complex128", "float16", "int16",
                     "Tensor", "nope", "__class__"]),
    shapes, shapes, st.integers(0, 3),
).flatmap(lambda call: st.one_of(
    st.just(call),
    st.sampled_from([_Sub, int, "str"]).map(lambda cls: _Call(_rebuild_tensor,
                                                              call.args + (cls,)))))

rebuild_vector = st.builds(lambda *a: _Call(_rebuild_vector, a),
                           st.one_of(st.integers(-2, 5), huge), st.integers(-1, 80),
                           st.one_of(small, huge))


def _buffer(kind: str, n: int, start: int) -> object:
    if kind == "slice":  # a view into a larger storage, as inline buffers are
        return _BIG[start:start + n]
    if kind == "float":
        return torch.zeros(n)
    if kind == "2d":
        return torch.zeros(1, n, dtype=torch.uint8)
    if kind == "strided":
        return _BIG[start:start + 2 * n:2]
    return b"not a tensor"


buffers = st.lists(st.builds(_buffer, st.sampled_from(["slice"] * 6 + ["float", "2d", "strided",
                                                                        "bytes"]),
                             st.integers(0, 64), st.integers(0, 100)), max_size=5)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * step for size, step in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@fuzz(500)
@given(calls=st.lists(st.one_of(rebuild_tensor, rebuild_vector), min_size=1, max_size=4),
       bufs=buffers)
def test_loads_checks_every_rebuild_against_the_buffers(calls, bufs):
    payload = pickle.dumps(calls, protocol=5)
    try:
        out = Serializer().loads(payload, bufs)
    except SerializationError:
        return
    # Whatever loaded views only bytes of the buffer it named (or a copy).
    big = _BIG.untyped_storage().data_ptr()
    for call, t in zip(calls, out):
        assert isinstance(t, torch.Tensor)
        if t.numel() == 0 or t.untyped_storage().data_ptr() != big:
            continue
        buf = bufs[call.args[0]]
        lo, hi = _byte_span(t)
        assert buf.data_ptr() <= lo and hi <= buf.data_ptr() + buf.numel(), (call.args, lo, hi)


@fuzz(200)
@given(values=st.lists(st.integers(0, 300), max_size=4), extra=st.integers(-2, 2))
def test_loads_with_too_few_or_too_many_buffers(values, extra):
    tensors = [torch.arange(n, dtype=torch.float32) for n in values]
    pickled = Serializer().dumps(tensors)
    bufs = list(pickled.buffers)
    if extra < 0:
        bufs = bufs[:max(0, len(bufs) + extra)]
    else:
        bufs += [torch.zeros(4, dtype=torch.uint8)] * extra
    if len(bufs) == len(pickled.buffers):
        assert all(torch.equal(a, b) for a, b in zip(Serializer().loads(pickled.payload, bufs),
                                                     tensors))
    else:
        with pytest.raises(SerializationError):
            Serializer().loads(pickled.payload, bufs)


def test_mac_covers_the_length():
    """A frame's MAC binds its total length: trailing bytes are refused."""
    raw, _ = encode(FrameKind.MESSAGE, 1, b"p", [], KEY, LIMITS)
    longer = np.concatenate([raw[:-MAC_LEN], as_array(b"\0" * 64), raw[-MAC_LEN:]])
    with pytest.raises(FrameError, match="MAC mismatch"):
        decode(longer, KEY, LIMITS)
