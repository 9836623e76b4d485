"""Coverage-guided fuzzing (atheris/libFuzzer) of what decodes peer bytes.

Targets, picked by the input's first byte: the frame decoder on raw bytes
(with and without a MAC key), damaged genuine frames (staged and packed
descriptors included), the handshake checks, and the message header.  A
finding is any exception other than the clear errors (FrameError,
AuthenticationError), or a broken frame invariant (an AssertionError from
``frames.check_frame``); libFuzzer then stops and writes the input to
``crash-*``.

Run from the repository root, with any libFuzzer flags::

    .venv/bin/python tests/fuzz/atheris_frames.py -runs=200000
    .venv/bin/python tests/fuzz/atheris_frames.py -max_total_time=600 corpus/

tests/fuzz/test_fuzz_atheris.py runs it briefly as part of the suite.
"""

from __future__ import annotations

import os
import random
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

with atheris.instrument_imports(include=["ucxrpc", "tests.fuzz"]):
    from tests.fuzz.frames import (CLEAR_ERRORS, Spec, as_array, build, decode_checked,
                                   random_mutation, touches_mac)
    from ucxrpc.serialization import envelope
    from ucxrpc.errors import FrameError
    from ucxrpc.transport.wire import auth
    from ucxrpc.transport.wire.frame import MIN_CHUNK_KIB, FrameKind, Limits

KEY = b"k" * 16
LIMITS = Limits()
_KINDS = [int(k) for k in FrameKind]


def _spec(fdp: atheris.FuzzedDataProvider) -> Spec:
    def count(hi: int) -> int:
        return fdp.ConsumeIntInRange(0, hi)

    plain = [(count(300), fdp.PickValueInList([-1, -1, 0, 5])) for _ in range(count(12))]
    staged = [(count(1 << 30), fdp.PickValueInList([-1, 0]),
               fdp.ConsumeIntInRange(MIN_CHUNK_KIB, 1 << 20)) for _ in range(count(2))]
    packs = [(fdp.PickValueInList([-1, 0]), fdp.ConsumeBool(),
              [1 + count(300) for _ in range(1 + count(8))]) for _ in range(count(2))]
    return Spec(fdp.PickValueInList(_KINDS), fdp.ConsumeIntInRange(0, 2**64 - 1),
                fdp.ConsumeBytes(count(64)), plain, staged, packs)


def _damaged_frame(fdp: atheris.FuzzedDataProvider) -> None:
    key = KEY if fdp.ConsumeBool() else None
    raw = build(_spec(fdp), key, LIMITS)
    rng = random.Random(fdp.ConsumeInt(8))
    bad = raw
    for _ in range(1 + fdp.ConsumeIntInRange(0, 3)):
        bad = random_mutation(bad, rng)
    frame = decode_checked(bad, key, LIMITS)
    if key is not None and touches_mac(raw, bad):
        assert frame is None, "a damaged frame passed its MAC check"


def _handshake(fdp: atheris.FuzzedDataProvider) -> None:
    which = fdp.ConsumeIntInRange(0, 2)
    x, y = fdp.ConsumeIntInRange(0, 0xFFFF), fdp.ConsumeIntInRange(0, 0xFFFF)
    nx, ny = fdp.ConsumeBytes(auth.NONCE_LEN).ljust(32, b"\0"), os.urandom(auth.NONCE_LEN)
    payload = memoryview(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200)))
    try:
        if which == 0:
            claimed, nonce, gen = auth.parse_hello(payload)
            assert auth.hello(claimed, nonce, gen) == bytes(payload)
        elif which == 1:
            auth.check_challenge(b"secret", payload, x, y, nx)
            raise AssertionError("a random CHALLENGE passed")
        else:
            auth.check_proof(b"secret", payload, x, y, nx, ny)
            raise AssertionError("a random PROOF passed")
    except CLEAR_ERRORS:
        pass


def _header(fdp: atheris.FuzzedDataProvider) -> None:
    payload = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
    try:
        hdr, body = envelope.decode(memoryview(payload))
    except FrameError:
        return
    assert isinstance(hdr.kind, envelope.MsgKind) and bytes(body) == payload[envelope.HEAD_SIZE:]


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    target = fdp.ConsumeIntInRange(0, 4)
    if target <= 1:
        decode_checked(as_array(fdp.ConsumeBytes(fdp.remaining_bytes())),
                       KEY if target else None, LIMITS)
    elif target == 2:
        _damaged_frame(fdp)
    elif target == 3:
        _handshake(fdp)
    else:
        _header(fdp)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
