"""What the fuzz tests share: frame invariants, mutations, and a rogue's corpus.

Imports only numpy and ucxrpc's codecs (no hypothesis, no ucxx): the rogue
process of ``test_fuzz_live`` and the atheris harness import it too.

Layout offsets below restate ``ucxrpc.transport.wire.frame``'s docstring::

    prefix  magic 2s | version u8 | kind u8 | nbuf u16 | state u16
            | payload_len u32 | seq u64 | ack u64                (28 bytes)
    desc    nbytes u64 | offset u64 | device i16 | flags u8 | pad u8 | arg u32
"""

from __future__ import annotations

import random
from typing import NamedTuple

import numpy as np

from ucxrpc.errors import AuthenticationError, FrameError
from ucxrpc.transport.wire import auth
from ucxrpc.transport.wire.frame import (DESC, MAC_LEN, MIN_CHUNK_KIB, NOT_INLINE, PACK, PACKED,
                                         PREFIX, REMOTE, STAGED, WRITTEN, Frame, FrameKind, Limits,
                                         decode, encode)

#: The only exceptions bad input may raise from a decoder or a handshake check.
CLEAR_ERRORS = (FrameError, AuthenticationError)

#: Every flag combination a descriptor may carry (frame.py's docstring).
VALID_FLAGS = (0, STAGED, PACK, PACK | STAGED, PACKED, REMOTE, WRITTEN)

# (offset, width, signed) of each field, relative to its struct.
PREFIX_FIELDS = {"magic": (0, 2, False), "version": (2, 1, False), "kind": (3, 1, False),
                 "nbuf": (4, 2, False), "state": (6, 2, False), "plen": (8, 4, False),
                 "seq": (12, 8, False), "ack": (20, 8, False)}
DESC_FIELDS = {"nbytes": (0, 8, False), "off": (8, 8, False), "device": (16, 2, True),
               "flags": (18, 1, False), "pad": (19, 1, False), "arg": (20, 4, False)}

# Tag layout (ucxrpc/transport/wire/tags.py): kind in bits 63-62, sender in 61-46.
KIND_SHIFT, ID_SHIFT = 62, 46
HANDSHAKE, FRAME = 0, 1
HINT_MASK = (1 << ID_SHIFT) - 1


def tag_of(kind: int, sender: int, hint: int = 0) -> int:
    return (kind << KIND_SHIFT) | (sender << ID_SHIFT) | (hint & HINT_MASK)


def as_array(data: bytes | bytearray | memoryview) -> np.ndarray:
    """A writable uint8 array owning a copy of ``data`` (what UCX hands decode)."""
    return np.frombuffer(bytes(data), dtype=np.uint8).copy()


def extremes(width: int, signed: bool) -> list[int]:
    """Boundary values for an integer field of ``width`` bytes."""
    bits = 8 * width
    if signed:
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        return [0, 1, -1, -2, lo, hi, lo + 1, hi - 1, 63, 64]
    top = (1 << bits) - 1
    vals = [0, 1, 2, 63, 64, 65, top, top - 1, 1 << (bits - 1), (1 << (bits - 1)) - 1]
    return [v for v in vals if v <= top]


def put_int(raw: np.ndarray, pos: int, width: int, value: int, signed: bool) -> np.ndarray:
    """A copy of ``raw`` with ``value`` written little endian at ``pos`` (clipped)."""
    out = raw.copy()
    data = value.to_bytes(width, "little", signed=signed)
    end = min(pos + width, out.nbytes)
    if pos < end:
        out[pos:end] = np.frombuffer(data[:end - pos], dtype=np.uint8)
    return out


def desc_pos(index: int, field: str) -> tuple[int, int, bool]:
    off, width, signed = DESC_FIELDS[field]
    return PREFIX.size + DESC.size * index + off, width, signed


def head_len_of(raw: np.ndarray) -> int | None:
    """Header length (prefix, descriptors, payload) a frame declares, or None."""
    if raw.nbytes < PREFIX.size:
        return None
    _, _, _, nbuf, _, plen, _, _ = PREFIX.unpack_from(raw.data, 0)
    return PREFIX.size + DESC.size * nbuf + plen


def check_frame(frame: Frame, raw: np.ndarray, limits: Limits) -> None:
    """Assert what a decoded frame promises its receiver.

    Inline buffers and the payload lie inside the frame's header-to-MAC span,
    every flag set is a known one, packs come last, packed members lie inside
    their pack on the pack's device, staged chunks are not tiny, and
    ``total`` is the frame plus every out-of-band byte the engine will post a
    receive for.
    """
    n = raw.nbytes
    assert frame.raw is raw
    assert isinstance(frame.kind, FrameKind)
    descs = frame.buffers
    nbuf = len(descs)
    assert nbuf <= limits.max_buffers
    plen = frame.payload.nbytes
    head_len = PREFIX.size + DESC.size * nbuf + plen
    assert head_len + MAC_LEN <= n, (head_len, n)
    assert bytes(frame.payload) == raw[head_len - plen:head_len].tobytes()
    first_pack = next((i for i, d in enumerate(descs) if d.flags & PACK), nbuf)
    oob = 0
    for i, d in enumerate(descs):
        assert d.flags in VALID_FLAGS, (i, d)
        assert -(1 << 15) <= d.device < (1 << 15)
        assert 0 <= d.nbytes < (1 << 64) and 0 <= d.arg < (1 << 32)
        if d.flags == 0:
            if d.where == NOT_INLINE:
                assert not d.inline
                oob += d.nbytes
            else:
                assert d.inline
                assert head_len <= d.where, (i, d, head_len)
                assert d.where + d.nbytes <= n - MAC_LEN, (i, d, n)
            continue
        assert not d.inline, (i, d)
        assert bool(d.flags & PACK) == (i >= first_pack), (i, d, first_pack)
        if d.flags & STAGED:
            assert d.arg >= MIN_CHUNK_KIB, (i, d)
        if d.flags & (STAGED | PACK) or d.flags in (REMOTE, WRITTEN):
            oob += d.nbytes
        if d.flags in (REMOTE, WRITTEN):  # host memory: read by address, or written into ours
            assert d.device == -1, (i, d)
        if d.flags == PACKED:
            assert first_pack <= d.arg < nbuf, (i, d)
            pack = descs[d.arg]
            assert pack.flags & PACK
            assert d.where + d.nbytes <= pack.nbytes, (i, d, pack)
            assert d.device == pack.device, (i, d, pack)
    assert frame.total == n + oob, (frame.total, n, oob)
    assert frame.total >= n
    flagged = any(d.flags for d in descs)
    assert frame.delivered == (first_pack if flagged else -1), (frame.delivered, first_pack)
    assert frame.nbuf == (first_pack if flagged else nbuf)


def decode_checked(raw: np.ndarray, key: bytes | None, limits: Limits) -> Frame | None:
    """Decode; the frame (invariants checked) or None when FrameError was raised.

    Any other exception propagates: that is the failure being looked for.
    """
    try:
        frame = decode(raw, key, limits)
    except FrameError:
        return None
    check_frame(frame, raw, limits)
    return frame


def touches_mac(original: np.ndarray, mutated: np.ndarray) -> bool:
    """Whether ``mutated`` differs from ``original`` in what the MAC covers:
    the header (prefix, descriptors, payload), the MAC itself, or the length."""
    if mutated.nbytes != original.nbytes:
        return True
    head = head_len_of(original)
    assert head is not None
    n = original.nbytes
    return (not np.array_equal(original[:head], mutated[:head])
            or not np.array_equal(original[n - MAC_LEN:], mutated[n - MAC_LEN:]))


# --------------------------------------------------------------- building

class Spec(NamedTuple):
    """A message to encode: plain buffers, staged ones, and packs of members."""

    kind: int
    seq: int
    payload: bytes
    plain: list[tuple[int, int]]          # (nbytes, device); host ones carry bytes
    staged: list[tuple[int, int, int]]    # (nbytes, device, chunk KiB)
    packs: list[tuple[int, bool, list[int]]]  # (device, staged, member sizes)


def build(spec: Spec, key: bytes | None, limits: Limits = Limits()) -> np.ndarray:
    """Encode ``spec`` the way the engine does (``ways`` when flags are
    used), sealed with ``key`` (16 bytes), or unsealed (a zero MAC) for
    None."""
    buffers: list[tuple[int, memoryview | None, int]] = []
    ways: list[tuple[int, int, int]] = []
    for n, device in spec.plain:
        view = memoryview(np.arange(n, dtype=np.uint8)) if device < 0 else None
        buffers.append((n, view, device))
        ways.append((0, 0, 0))
    for n, device, kib in spec.staged:
        buffers.append((n, None, device))
        ways.append((STAGED, kib, 0))
    first_pack = len(buffers) + sum(len(m) for _, _, m in spec.packs)
    pack_ways = []
    for p, (device, staged, members) in enumerate(spec.packs):
        offset = 0
        for size in members:
            buffers.append((size, None, device))
            ways.append((PACKED, first_pack + p, offset))
            offset += (size + 63) & ~63
        pack_ways.append(((PACK | STAGED, MIN_CHUNK_KIB, 0) if staged else (PACK, 0, 0),
                          offset, device))
    for way, nbytes, device in pack_ways:
        buffers.append((nbytes, None, device))
        ways.append(way)
    flagged = any(w[0] for w in ways)
    frame, _ = encode(FrameKind(spec.kind), spec.seq, spec.payload, buffers, key or b"", limits,
                      ways if flagged else None, seal=key is not None)
    return frame


# ----------------------------------------------------- a rogue's corpus

class Shot(NamedTuple):
    """One tag message a rogue sends, and what the target must make of it."""

    tag: int
    data: bytes
    outcome: str  # "counted": refused or frame_errors += 1; "hello": answered


def classify(tag: int, data: bytes, real_id: int, limits: Limits) -> str:
    """What a worker whose only peer is ``real_id`` (authenticated both ways)
    must do with this tag message from an unauthenticated sender.

    "hello": a well-formed HELLO for ``real_id`` on its handshake tag; the
    worker answers it with a CHALLENGE sent to the real peer (who refuses it).
    "ignored": a valid non-handshake frame on the handshake tag, which the
    engine once dropped without counting (test_fuzz_engine checks they are counted; not sent live).
    "counted": everything else is refused or dropped as a frame error.
    """
    kind, sender = tag >> KIND_SHIFT, (tag >> ID_SHIFT) & 0xFFFF
    if len(data) > limits.max_frame_bytes or sender != real_id or kind != HANDSHAKE:
        return "counted"
    try:
        frame = decode(as_array(data), None, limits)
    except FrameError:
        return "counted"
    if frame.kind is FrameKind.HELLO:
        try:
            claimed, _, _ = auth.parse_hello(frame.payload)
        except FrameError:
            return "counted"
        return "hello" if claimed == real_id else "counted"
    if frame.kind in (FrameKind.CHALLENGE, FrameKind.PROOF):
        return "counted"
    return "ignored"


def _random_spec(rng: random.Random) -> Spec:
    plain = [(rng.choice([0, 1, 7, 64, 100, 300]), rng.choice([-1, -1, 0, 1]))
             for _ in range(rng.choice([0, 1, 2, 3, 9, 12]))]
    staged = [(rng.randrange(1 << 20), rng.choice([-1, 0]), rng.choice([64, 256, 1 << 20]))
              for _ in range(rng.choice([0, 0, 1, 2]))]
    packs = [(rng.choice([-1, 0]), rng.random() < 0.5,
              [rng.randrange(1, 200) for _ in range(rng.randrange(1, 9))])
             for _ in range(rng.choice([0, 0, 1, 2]))]
    return Spec(rng.choice(list(FrameKind)), rng.randrange(1 << 64),
                rng.randbytes(rng.randrange(64)), plain, staged, packs)


def random_mutation(raw: np.ndarray, rng: random.Random) -> np.ndarray:
    """One random damage: bit flips, truncation, extension or a field overwritten
    with an extreme value (prefix or descriptor)."""
    what = rng.randrange(6)
    n = raw.nbytes
    if what == 0 and n:
        out = raw.copy()
        for _ in range(rng.randrange(1, 4)):
            pos = rng.randrange(n)
            out[pos] ^= 1 << rng.randrange(8)
        return out
    if what == 1:
        return raw[:rng.randrange(n + 1)].copy()
    if what == 2:
        return np.concatenate([raw, as_array(rng.randbytes(rng.randrange(1, 200)))])
    if what == 3:
        field = rng.choice(list(PREFIX_FIELDS))
        pos, width, signed = PREFIX_FIELDS[field]
        return put_int(raw, pos, width, rng.choice(extremes(width, signed)), signed)
    nbuf = int(raw[4]) | (int(raw[5]) << 8) if n >= 6 else 0
    if nbuf == 0:
        return raw[:-1].copy()
    field = rng.choice(list(DESC_FIELDS))
    pos, width, signed = desc_pos(rng.randrange(nbuf), field)
    value = (rng.choice(extremes(width, signed)) if what == 4
             else rng.choice([0, STAGED, PACK, PACKED, PACK | STAGED, REMOTE, 3, 6, 7, 9, 255])
             if field == "flags" else rng.randrange(1 << (8 * width - signed)))
    return put_int(raw, pos, width, value, signed)


def handshake_frame(kind: FrameKind, payload: bytes) -> bytes:
    frame, _ = encode(kind, 0, payload, [], b"", Limits(), seal=False)
    return frame.tobytes()


def rogue_corpus(seed: int, count: int, real_id: int, limits: Limits) -> list[Shot]:
    """``count`` malformed or unauthenticated tag messages for a worker whose
    peer ``real_id`` is authenticated, each with the outcome it must have.

    Seeded: the same seed gives the same corpus (reported on failure).
    Frames the engine ignores without counting are left out (see classify).
    """
    rng = random.Random(seed)
    senders = [real_id] * 6 + [real_id + 1, 7, 0xFFFF]
    shots: list[Shot] = []
    while len(shots) < count:
        sender = rng.choice(senders)
        kind = rng.choice([HANDSHAKE, FRAME])
        hint = rng.randrange(1 << ID_SHIFT) if kind == FRAME and rng.random() < 0.5 else 0
        what = rng.randrange(10)
        if what == 0:
            data = rng.randbytes(rng.randrange(300))
        elif what in (1, 2, 3):
            key = rng.choice([None, b"wrong-key-16byte", rng.randbytes(16)])
            data = random_mutation(build(_random_spec(rng), key), rng).tobytes()
        elif what == 4:  # truncated or padded HELLO, sometimes claiming the real peer
            claimed = rng.choice([real_id, real_id, real_id + 1, 0xFFFF_FFFF])
            payload = auth.hello(claimed, rng.randbytes(auth.NONCE_LEN))
            cut = rng.choice([len(payload), len(payload), 0, 4, len(payload) - 1,
                              len(payload) + 1])
            data = handshake_frame(FrameKind.HELLO, (payload + b"\0")[:cut])
            kind = HANDSHAKE if rng.random() < 0.8 else kind
        elif what == 5:  # a PROOF out of nowhere, right size or not
            data = handshake_frame(FrameKind.PROOF, rng.randbytes(rng.choice([32, 32, 0, 31, 33])))
            kind = HANDSHAKE if rng.random() < 0.8 else kind
        elif what == 6:  # a CHALLENGE nobody asked for
            data = handshake_frame(FrameKind.CHALLENGE, rng.randbytes(rng.choice([100, 99, 0])))
        elif what == 7:  # well formed, wrong MAC
            data = build(_random_spec(rng)._replace(kind=FrameKind.MESSAGE),
                         b"guess-a-16-b-key").tobytes()
            kind = FRAME
        elif what == 8:  # truncated anywhere, the prefix included
            frame = build(_random_spec(rng), None)
            data = frame[:rng.randrange(frame.nbytes)].tobytes()
        else:  # a valid frame with one descriptor or prefix field at an extreme
            frame = build(_random_spec(rng), None)
            for _ in range(rng.randrange(1, 3)):
                frame = random_mutation(frame, rng)
            data = frame.tobytes()
        tag = tag_of(kind, sender, hint)
        outcome = classify(tag, data, real_id, limits)
        if outcome != "ignored":
            shots.append(Shot(tag, data, outcome))
    return shots


def oversize_shots(real_id: int, limits: Limits, count: int, seed: int) -> list[Shot]:
    """Frames just over ``limits.max_frame_bytes``; hint 0 so that nothing is answered."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        data = rng.randbytes(limits.max_frame_bytes + 1 + rng.randrange(4096))
        out.append(Shot(tag_of(i % 2, rng.choice([real_id, real_id, 9]), 0), data, "counted"))
    return out
