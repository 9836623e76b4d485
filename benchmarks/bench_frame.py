"""One no-buffer MESSAGE frame (a no-op call's ~60-byte envelope) encoded
and decoded by the native core (ucxrpc._core through wire/frame.py), µs per
pair, and the core's MAC alone (SipHash-2-4-128) against hashlib's keyed
BLAKE2b, the frame MAC before Run AU; the figures of Run AL's spike
(benchmarks/runs/AL.md) are the before.  python benchmarks/bench_frame.py"""
import hashlib
import os
import timeit

from ucxrpc.transport.wire import frame as F

key = os.urandom(16)
payload = os.urandom(60)
limits = F.Limits()
few = [(n, memoryview(os.urandom(n)), -1) for n in (8, 64, 512)]


def pair():
    arr, _ = F.encode(F.FrameKind.MESSAGE, 7, payload, [], key, limits, ack=3)
    return F.decode(arr, key, limits).payload


def pair3():
    arr, _ = F.encode(F.FrameKind.MESSAGE, 7, payload, few, key, limits, ack=3)
    return F.decode(arr, key, limits).payload


def mac_core():
    return F.mac(key, payload, 88)


def mac_hashlib():
    h = hashlib.blake2b(payload, key=key, digest_size=16)
    h.update((88).to_bytes(8, "little"))
    return h.digest()


N = 50000
for name, fn in (("encode + decode, no buffers", pair), ("encode + decode, 3 inline", pair3),
                 ("mac (core)", mac_core), ("mac (hashlib blake2b)", mac_hashlib)):
    best = min(timeit.repeat(fn, number=N, repeat=5)) / N * 1e6
    print(f"{name:30s} {best:6.2f} µs")
