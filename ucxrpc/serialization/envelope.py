"""The agent's message format, carried as the payload of a transport frame.

::

    kind u8 | version u8 | flags u16 | reserved u32 | msg_id u64 | body

``body`` is a pickle (protocol 5, tensors out of band) whose shape depends
on ``kind``; the transport has already checked sizes and authenticated the
frame before the agent sees it, and the body is unpickled only then.

``flags``: :data:`PLAIN`, or 0.  Before PLAIN every sender wrote 0 and
every receiver ignored the field; a receiver still ignores the flags it
does not know, so a flag changes nothing for one that does not look.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from ..errors import FrameError

VERSION = 1
_HEAD = struct.Struct("<BBHIQ")
HEAD_SIZE = _HEAD.size


class MsgKind(enum.IntEnum):
    REQUEST = 1     # body: (func, args, kwargs)
    RESPONSE = 2    # body: the return value
    ERROR = 3       # body: a RemoteException description (see agent)


_KINDS = {int(k): k for k in MsgKind}

#: The body is a plain pickle (``Serializer.dumps_plain``'s: no tensor,
#: nothing pickled by a hook) and the message has no buffers: the receiver
#: unpickles it with pickle's ``loads`` alone, without the serializer's
#: loader for buffers (issue 52: three Python calls a message).  Honoured
#: only on a message without buffers; on one with buffers, a sender's error,
#: the body is unpickled the usual way.
PLAIN = 1


class Header(NamedTuple):
    kind: MsgKind
    msg_id: int
    flags: int = 0


# Builds a Header without its Python __new__: every message's header is
# decoded on the way to its handler (issue 52).
_new_header = tuple.__new__


#: The header alone, ``pack(kind, VERSION, flags, 0, msg_id)``: for the
#: agent's message without buffers, whose header and body the transport
#: copies into the frame as two parts (issue 52: no join, no call here).
pack = _HEAD.pack


#: The header's fields, ``unpack(payload) -> (kind, version, flags, 0,
#: msg_id)``, unchecked: for the agent's handler, which checks the version
#: and the kind itself and calls :func:`decode` to name what is wrong
#: (every message; issue 52).
unpack = _HEAD.unpack_from


def encode(kind: MsgKind, msg_id: int, body: bytes | memoryview, flags: int = 0) -> bytes:
    return _HEAD.pack(kind, VERSION, flags, 0, msg_id) + body


def decode(payload: memoryview) -> tuple[Header, memoryview]:
    """Split a payload into its header and body.

    Raises:
        FrameError: too short, unknown kind or unsupported version.
    """
    if payload.nbytes < HEAD_SIZE:
        raise FrameError(f"truncated message: {payload.nbytes} bytes, header needs {HEAD_SIZE}")
    kind, version, flags, _, msg_id = _HEAD.unpack_from(payload, 0)
    if version != VERSION:
        raise FrameError(f"message version {version} not supported (this side speaks {VERSION})")
    k = _KINDS.get(kind)
    if k is None:
        raise FrameError(f"unknown message kind {kind}")
    return _new_header(Header, (k, msg_id, flags)), payload[HEAD_SIZE:]


def hint(kind: MsgKind, msg_id: int) -> int:
    """The transport's per-frame hint for a message: its kind and id.

    It rides in the frame's tag.  The receiver acts on it only for a frame
    it authenticated: a message over ``max_message_bytes`` is answered (the
    request refused, or the call failed) by the id here; a frame it will not
    even read (over ``max_frame_bytes``, or from a stranger) is dropped,
    since its tag is only a claim (transport/receive.py, ``dropped``).
    """
    return (msg_id << 3) | kind


def parse_hint(value: int) -> tuple[int, int]:
    """(kind number, msg_id) from :func:`hint`; 0 as kind means none."""
    return value & 7, value >> 3
