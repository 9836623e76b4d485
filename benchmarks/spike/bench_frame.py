"""Spike (Run AL): one no-buffer MESSAGE frame encoded and decoded, µs per
pair, in ucxrpc's Python (transport/wire/frame.py), in C with the CPython API
(frame_c.c) and in Cython (frame_cy.pyx), the MAC by hashlib's blake2b in
all three; and what the MAC costs alone.  Build the two modules into
SPIKE_DIR (see Run AL), then: python bench_frame.py SPIKE_DIR."""
import hashlib, os, sys, timeit
sys.path.insert(0, sys.argv[1])
import frame_c, frame_cy
from ucxrpc.transport.wire import frame as F

key = os.urandom(32)
payload = os.urandom(60)  # a no-op call's pickled envelope is ~60 bytes
limits = F.Limits()

def py():
    arr, _ = F.encode(F.FrameKind.MESSAGE, 7, payload, [], key, limits, ack=3)
    f = F.decode(arr, key, limits)
    return f.payload

def c():
    b = frame_c.encode(0, 7, payload, key, 3, False, True)
    return frame_c.decode(b, key)[2]

def cy():
    b = frame_cy.encode(0, 7, payload, key, 3, False, True)
    return frame_cy.decode(b, key)[2]

assert bytes(py()) == bytes(c()) == bytes(cy()) == payload
# The same bytes on the wire: the C frame decodes in Python and back.
b = frame_c.encode(0, 7, payload, key, 3, False, True)
import numpy as np
assert bytes(F.decode(np.frombuffer(b, dtype=np.uint8), key, limits).payload) == payload
arr, _ = F.encode(F.FrameKind.MESSAGE, 7, payload, [], key, limits, ack=3)
assert bytes(frame_c.decode(arr.tobytes(), key)[2]) == payload

def mac():
    h = hashlib.blake2b(payload, key=key, digest_size=16)
    h.update((88).to_bytes(8, "little"))
    return h.digest()

N = 50000
for name, fn in (("python", py), ("c-api", c), ("cython", cy), ("mac alone (hashlib)", mac)):
    best = min(timeit.repeat(fn, number=N, repeat=5)) / N * 1e6
    print(f"{name:22s} {best:6.2f} µs")
