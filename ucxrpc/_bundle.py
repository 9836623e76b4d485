"""Small host tensors of a message travel packed: one buffer per dtype.

Every out-of-band buffer costs the transport a descriptor, a copy or a tag
message and a tensor object on each side, a few microseconds of Python each:
a dict of 100 tensors of 4 KiB spent more time on that than on its bytes.
So :func:`ucxrpc.serialization.Serializer.dumps` gathers the small CPU
tensors of a message into a :class:`Packer`: one ``torch.cat`` per dtype
after the dump, and each such tensor pickles as ``_bundled_slot(slot)``
(``_rebuild_bundled(slot, flags)`` when it requires grad or is a Parameter).
The receiver cuts every buffer with one ``split`` (:func:`unpack`), before
the pickle stream is read, so each rebuild call is a dict look-up.

Bundled: a non-empty contiguous CPU tensor of at most
:data:`MAX_TENSOR_BYTES` that is either all of its storage and the only
tensor using it (a storage shared by several tensors keeps the per-storage
path, which makes it arrive shared) or a view that torch's rule sends as a
compact copy, while the message's bundle stays under :data:`MAX_TOTAL_BYTES`
(the bytes the transport would have copied into the frame anyway).  The
bytes are copied at ``dumps``: a bundled tensor changed after ``dumps``
travels as it was then, and a lazily negated, conjugated or zero tensor as
a plain tensor of its values.  Received, a bundled tensor is a view of its
bundle buffer, as an inlined one was a view of the frame.

Wire form: the payload starts with :data:`MARK` (a pickle stream starts with
``0x80``), a u32 table length, the table (a pickle of plain lists: per
group its dtype code, per slot its group and element count, and the shape
of each slot that is not 1-D), then the pickle stream.  The group buffers
are the message's last buffers, in group order.  Everything in the table is
checked against the buffers before any tensor is made.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch

from ._tensor_codec import _CODE_SPECS
from .errors import SerializationError

__all__ = ["MARK", "MAX_TENSOR_BYTES", "MAX_TOTAL_BYTES", "Packer", "storage_uses", "unpack"]

#: Largest tensor bundled (the transport's default inline threshold).
MAX_TENSOR_BYTES = 64 << 10
#: Most bytes one message bundles (the transport's default inline total):
#: past it, tensors go zero-copy as their own buffers.
MAX_TOTAL_BYTES = 4 << 20
MARK = b"B"
_LEN = struct.Struct("<I")
#: Elements below which torch copies on the calling thread (ATen's
#: GRAIN_SIZE, the serial bound of cat and copy_).
_SERIAL_MAX = 32768
_MAX_TABLE = 64 << 20
_UINT8 = torch.uint8

#: ``storage_uses(storage._cdata)``: how many references hold a storage;
#: 2 when one tensor alone uses it (the caller's ``storage`` object is the
#: second).  A torch without the call answers 0, and nothing is bundled.
storage_uses: Callable[[Any], int] = getattr(torch._C, "_storage_Use_Count",
                                             lambda cdata: 0)
# See serialization._UNTRACKED: split and view below it make plain tensors,
# not autograd views of the bundle (a received tensor is a leaf).
_UNTRACKED: Callable[[], Any] = torch._C._AutoDispatchBelowADInplaceOrView


class Packer:
    """The small tensors of one message, in slot order (sending side).

    ``add`` records what the pickler already read of each tensor and no
    more (it runs once per tensor: 0.1 µs there is 10 µs a message of 100);
    the dtype groups and the table are worked out once, at ``finish``.
    """

    __slots__ = ("tensors", "codes", "sizes", "shapes", "nbytes")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []       # by slot
        self.codes = bytearray()                    # dtype code (flagless) of each slot
        self.sizes: list[int] = []                  # bytes of each slot
        self.shapes: dict[int, tuple[int, ...]] = {}  # shape of each slot not 1-D
        self.nbytes = 0

    def add(self, t: torch.Tensor, nbytes: int, code: int) -> int:
        """The slot of ``t`` (contiguous, of dtype ``code``, ``nbytes``
        long), or -1 when the bundle is full."""
        total = self.nbytes + nbytes
        if total > MAX_TOTAL_BYTES:
            return -1
        self.nbytes = total
        slot = len(self.tensors)
        self.tensors.append(t)
        self.codes.append(code)
        self.sizes.append(nbytes)
        if t.dim() != 1:
            self.shapes[slot] = tuple(t.shape)
        return slot

    def finish(self, stream: bytes) -> tuple[bytes, list[torch.Tensor]]:
        """The payload (table, then ``stream``) and the group buffers."""
        codes, tensors = self.codes, self.tensors
        first = codes[0]
        if codes.count(first) == len(codes):  # one dtype: the common case
            order = [first]
            slot_group = bytes(len(codes))
            groups = [tensors]
            itemsize = _CODE_SPECS[first][1]
            numels = [n // itemsize for n in self.sizes]
        else:
            order = list(dict.fromkeys(codes))  # groups in order of first use
            slot_group = bytes(order.index(c) for c in codes)
            groups = [[] for _ in order]
            for g, t in zip(slot_group, tensors):
                groups[g].append(t)
            itemsizes = [_CODE_SPECS[c][1] for c in order]
            numels = [n // itemsizes[g] for g, n in zip(slot_group, self.sizes)]
        large = max(numels) >= _SERIAL_MAX  # a member alone over the serial copy bound
        with _UNTRACKED():
            if self.shapes:
                groups = [[m.view(-1) for m in members] for members in groups]
            buffers = [_gather(members, large) for members in groups]
        table = pickle.dumps((order, slot_group, numels, self.shapes), protocol=5)
        return MARK + _LEN.pack(len(table)) + table + stream, buffers


def _gather(members: list[torch.Tensor], large: bool) -> torch.Tensor:
    """One buffer holding ``members`` (1-D, one dtype) back to back, copied
    on this thread.  torch's CPU copy kernels hand a copy of more than
    :data:`_SERIAL_MAX` elements to its intra-op thread pool, whose wake-up
    cost 130 µs per 64 KiB message here (two processes on two cores) against
    5 µs for the copy itself.  ``torch.cat`` copies input by input, so only
    a member over that bound (``large``) needs copying some other way."""
    if not large:
        return torch.cat(members).view(_UINT8)
    out = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype)
    at = 0
    for run in _runs(members):
        n = sum(t.numel() for t in run)
        if len(run) == 1 and n >= _SERIAL_MAX:
            out[at:at + n].view(_UINT8).numpy()[:] = run[0].view(_UINT8).numpy()
        else:
            torch.cat(run, out=out[at:at + n])
        at += n
    return out.view(_UINT8)


def _runs(members: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of members under :data:`_SERIAL_MAX` elements; a
    member at or over it comes alone."""
    run: list[torch.Tensor] = []
    for t in members:
        if t.numel() >= _SERIAL_MAX:
            if run:
                yield run
                run = []
            yield [t]
        else:
            run.append(t)
    if run:
        yield run


def unpack(payload: bytes | memoryview,
           buffers: Sequence[torch.Tensor]) -> tuple[memoryview, list[torch.Tensor], int]:
    """Read a bundled payload: the pickle stream, the bundled tensors by
    slot, and how many of ``buffers`` (the last ones) were bundles.

    Raises:
        SerializationError: a table that does not match the buffers.
    """
    view = memoryview(payload).cast("B")
    if view.nbytes < 1 + _LEN.size:
        raise SerializationError("bundled message too short for its table")
    (size,) = _LEN.unpack_from(view, 1)
    start = 1 + _LEN.size
    if size > _MAX_TABLE or start + size > view.nbytes:
        raise SerializationError(f"bundle table of {size} bytes does not fit the payload")
    try:
        codes, slot_group, numels, shapes = pickle.loads(view[start:start + size])
        ngroups = len(codes)
        if not (isinstance(slot_group, bytes) and len(slot_group) == len(numels)
                and isinstance(shapes, dict)):
            raise TypeError("malformed table")
    except SerializationError:
        raise
    except Exception as exc:
        raise SerializationError(f"corrupt bundle table: {type(exc).__name__}: {exc}") from exc
    if not 0 < ngroups <= len(buffers):
        raise SerializationError(f"bundle table names {ngroups} groups but the message has "
                                 f"{len(buffers)} buffers")
    first = len(buffers) - ngroups
    sizes: list[list[int]] = [[] for _ in range(ngroups)]
    for g, n in zip(slot_group, numels):
        if g >= ngroups or not isinstance(n, int) or n < 0:
            raise SerializationError(f"bundle slot names group {g} of {ngroups} or has "
                                     f"{n!r} elements")
        sizes[g].append(n)
    parts: list[Sequence[torch.Tensor]] = []
    with _UNTRACKED():
        for g, code in enumerate(codes):
            spec = _CODE_SPECS.get(code) if isinstance(code, int) else None
            if spec is None or spec[2]:
                raise SerializationError(f"unknown tensor dtype code {code!r} in bundle {g}")
            dtype, itemsize = spec[0], spec[1]
            buf = buffers[first + g]
            if not (isinstance(buf, torch.Tensor) and buf.dtype is _UINT8 and buf.dim() == 1
                    and not buf.is_cuda):
                raise SerializationError(f"bundle {g} (buffer {first + g}) is not a 1-D host "
                                         "uint8 tensor")
            expected = sum(sizes[g]) * itemsize
            if expected != buf.numel():
                raise SerializationError(f"bundle {g} holds {buf.numel()} bytes, its table "
                                         f"{expected}")
            if buf.data_ptr() % itemsize or buf.stride() != (1,):
                buf = buf.clone()  # misaligned in its frame: realigned once
            # split_with_sizes itself: Tensor.split's Python wrapper cost
            # another 0.3 µs per tensor.
            parts.append(buf.view(dtype).split_with_sizes(sizes[g]))
        if ngroups == 1:
            out = list(parts[0])
        else:
            taken = [iter(p) for p in parts]
            out = [next(taken[g]) for g in slot_group]
        for k, shape in shapes.items():
            if not (type(k) is int and 0 <= k < len(out)):
                raise SerializationError(f"bundle table gives a shape to slot {k!r} of "
                                         f"{len(out)}")
            t = out[k]
            try:
                out[k] = t.view(shape)
            except Exception as exc:
                raise SerializationError(f"bundle slot {k} of {t.numel()} elements cannot "
                                         f"have shape {shape!r}") from exc
    return view[start + size:], out, ngroups
