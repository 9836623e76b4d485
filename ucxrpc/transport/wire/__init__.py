"""What crosses a pipe, as bytes: pure codecs, no UCX, no threads.

* :mod:`.frame`: a frame's byte layout (prefix, buffer descriptors, payload,
  MAC) and the limits every incoming frame is judged by before anything is
  allocated.
* :mod:`.tags`: the 64-bit UCX tags (kind, sender, sequence, buffer index).
* :mod:`.auth`: the handshake's HMAC proofs and per-direction keys.
* :mod:`.batch`: small messages packed into one BATCH frame.
* :mod:`.gather`: a host buffer sent from several tensors as one I/O vector.

The fuzz tests (tests/fuzz) drive these modules directly.
"""
