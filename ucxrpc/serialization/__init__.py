"""How a message's Python objects become bytes and buffers, and back.

* :mod:`.pickler`: pickle protocol 5 with tensors out of band
  (:class:`Serializer`, :class:`Pickled`, :class:`GradCapture`), the sending
  side and the wire forms a tensor takes (its docstring and
  :mod:`.tensors`: in-band, vector, tensor, bundled, sparse, torch's own).
* :mod:`.tensors`: those forms' rebuild functions, the dtype table and the
  receiving side.
* :mod:`.bundle`: small host tensors packed one buffer per dtype.
* :mod:`.envelope`: the agent's message header (kind, version, message id)
  around a pickled body.

Sits on the transport (a :class:`~ucxrpc.transport.wire.gather.Gather` is
how a bundle goes out) and below the agent.
"""

from __future__ import annotations

from .pickler import BufferSpec, GradCapture, Pickled, Serializer, dumps, loads

__all__ = ["BufferSpec", "GradCapture", "Pickled", "Serializer", "dumps", "loads"]
