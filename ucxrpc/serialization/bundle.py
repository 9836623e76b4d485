"""Small host tensors of a message travel packed: one buffer per dtype.

Every out-of-band buffer costs the transport a descriptor, a copy or a tag
message and a tensor object on each side, a few microseconds of Python each:
a dict of 100 tensors of 4 KiB spent more time on that than on its bytes.
So :func:`ucxrpc.serialization.Serializer.dumps` gathers the small CPU
tensors of a message into a :class:`Packer`: one buffer per dtype after
the dump, and each such tensor pickles as ``_bundled_slot(slot)``
(``_rebuild_bundled(slot, flags)`` when it requires grad or is a Parameter).
The receiver cuts every buffer with one ``split`` (:func:`unpack`), before
the pickle stream is read, so each rebuild call is a dict look-up.  (A
message's first few very small tensors skip the bundle and travel inside the
pickle stream: ``serialization.INBAND_MAX_TENSORS``.)

Bundled: a non-empty contiguous CPU tensor of at most
:data:`MAX_TENSOR_BYTES` that is either all of its storage and the only
tensor using it (a storage shared by several tensors keeps the per-storage
path, which makes it arrive shared) or a view that torch's rule sends as a
compact copy, while the message's bundle stays under :data:`MAX_TOTAL_BYTES`
(the bytes the transport would have copied into the frame anyway).  A
buffer is one ``torch.cat`` of its tensors, made at ``dumps``, except the
one buffer of a bundle of one dtype over :data:`MAX_TENSOR_BYTES` (the
transport's default inline threshold): that goes as a
:class:`~ucxrpc.transport.wire.gather.Gather` of its tensors, which UCX copies
from where they are, once, when the message is sent (:func:`_unjoined`),
or, where they lie back to back in one storage (tensors received in one
bundle and sent on as they came), as that range of the storage.
So a bundled tensor changed after ``dumps`` may travel as it was then or
as it is at the send, as a large tensor (sent zero-copy) does; and a
lazily negated, conjugated or zero tensor travels as a plain tensor of its
values.  Received, a bundled tensor is a view of its
bundle buffer, as an inlined one was a view of the frame, unless that view
would travel on with the whole bundle (torch's compaction rule): then it
is a copy of its own, as torch's receiver gives every tensor its storage.

A message's dicts, lists and tuples of :data:`RUN_MIN` or more plain
tensors travel as *runs* (:func:`with_runs`): their tensors take
consecutive slots and each container pickles as one
``_bundled_run(first slot, count, kind[, keys])``, so pickle does not
visit their tensors one by one.  Only where the whole message can be seen
(small containers, plain values, tensors without state) and nothing in it
refers to a run or its tensors from elsewhere, so that what arrives shared
stays shared.

Wire form: the payload starts with :data:`MARK` (a pickle stream starts with
``0x80``), a u32 table length, the table (a pickle of plain lists: per
group its dtype code, per slot its group and element count, and the shape
of each slot that is not 1-D), then the pickle stream.  The group buffers
are the message's last buffers, in group order.  Everything in the table is
checked against the buffers before any tensor is made.
"""

from __future__ import annotations

import operator
import pickle
import struct
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable

import torch

from .tensors import _CODE_SPECS, _COMPLEX_CODES, compacted
from ..errors import SerializationError
from ..transport.wire.gather import Buffer, Gather

__all__ = ["MARK", "MAX_TENSOR_BYTES", "MAX_TOTAL_BYTES", "RUN_MIN", "Packer", "Run",
           "storage_uses", "unpack", "with_runs"]

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
_is_neg = torch.Tensor.is_neg
_is_conj = torch.Tensor.is_conj
_data_ptr = torch.Tensor.data_ptr
#: An empty host uint8 tensor to make byte views from (``_span``).
_BYTES = torch.empty(0, dtype=torch.uint8)
_INT_ONLY = frozenset({int})

#: ``storage_uses(storage._cdata)``: how many references hold a storage;
#: 2 when one tensor alone uses it (the caller's ``storage`` object is the
#: second).  A torch without the call answers 0, and nothing is bundled.
storage_uses: Callable[[Any], int] = getattr(torch._C, "_storage_Use_Count",
                                             lambda cdata: 0)
# See serialization._UNTRACKED: split and view below it make plain tensors,
# not autograd views of the bundle (a received tensor is a leaf).
_UNTRACKED: Callable[[], Any] = torch._C._AutoDispatchBelowADInplaceOrView


#: Fewest tensors a container needs to travel as a :class:`Run`: the scan
#: and the run's own work cost about what 12 tensors save (in process, a
#: list of 8 pickled 4.7 µs slower as a run, one of 32 6.8 µs faster).
RUN_MIN = 16
#: Most values :func:`with_runs` looks at outside runs, and how deep: a
#: message it cannot see whole keeps the ordinary path.
_SCAN_VALUES = 64
_SCAN_DEPTH = 4
# Objects that pickle by value with no identity of their own, and objects
# pickled by name: neither can hold a tensor of the message.
_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes})
_BY_NAME = (types.FunctionType, types.BuiltinFunctionType, type)
_Tensor = torch.Tensor


class Run:
    """A dict, list or tuple of small host tensors, as :func:`with_runs`
    found it: it pickles as one ``_bundled_run`` naming consecutive slots
    (or as itself, when its tensors turn out not to bundle), so pickle does
    not visit its values one by one."""

    __slots__ = ("obj",)

    def __init__(self, obj: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> None:
        self.obj = obj


class _Unseen(Exception):
    """with_runs cannot see the whole message, or runs would change what
    arrives shared (a tensor in two places, a copied container met twice)."""


def with_runs(obj: object) -> object:
    """``obj`` with each dict, list or tuple of :data:`RUN_MIN` or more plain
    tensors (and nothing else) replaced by a :class:`Run`, or ``obj`` itself.

    Pickle handles dicts, lists and tuples in C, out of reach of
    ``reducer_override``; only a copy of the containers on the way to a run
    can hand them over.  That is exact only where nothing else in the
    message refers to a container replaced or copied, or to a run's tensor
    (pickle's memo would have made it arrive shared).  So the message must
    be seen whole: small containers, values pickled by value or by name,
    tensors without state; anything else (an object with state, deep or
    large nesting, a container met twice) leaves ``obj`` as it is.
    """
    cls = type(obj)
    if (cls is not tuple and cls is not list and cls is not dict) or not _holds_run(obj, 0):
        return obj  # the common case, in about a microsecond
    scan = _Scan()
    try:
        out = scan.visit(obj, 0)
    except _Unseen:
        return obj
    if not scan.run_tensors.isdisjoint(scan.tensors):
        return obj
    return out


def _holds_run(x: Any, depth: int) -> bool:
    """Whether ``x`` may hold a run: a container of at least RUN_MIN values
    whose first is a tensor, in a small container that holds it."""
    values = x.values() if type(x) is dict else x
    if len(values) >= RUN_MIN:
        for v in values:
            return type(v) is _Tensor
    if depth < _SCAN_DEPTH:
        for v in values:
            cls = type(v)
            # (An empty container holds nothing: most calls' args or kwargs.)
            if (cls is tuple or cls is list or cls is dict) and v and _holds_run(v, depth + 1):
                return True
    return False


_ONLY_TENSORS = {_Tensor}
_IN_PROGRESS = object()
_state = operator.attrgetter("__dict__")


class _Scan:
    """One message's walk for :func:`with_runs`."""

    __slots__ = ("budget", "containers", "tensors", "run_tensors")

    def __init__(self) -> None:
        self.budget = _SCAN_VALUES
        self.containers: dict[int, Any] = {}  # id -> what it pickles as
        self.tensors: set[int] = set()      # tensors outside runs
        self.run_tensors: set[int] = set()

    def visit(self, x: Any, depth: int) -> Any:
        cls = type(x)
        if cls in _LEAVES:
            return x
        if cls is tuple or cls is list or cls is dict:
            # An empty one is never copied: met twice, it stays shared.
            return self._container(x, cls, depth) if x else x
        if isinstance(x, _Tensor):
            if x.__dict__:  # its state may refer to anything
                raise _Unseen
            self.tensors.add(id(x))
            return x
        if isinstance(x, _BY_NAME):
            return x
        raise _Unseen

    def _container(self, x: Any, cls: type, depth: int) -> Any:
        key = id(x)
        seen = self.containers.get(key)
        if seen is not None:
            # Met again: a run or an untouched container stays shared (pickle's
            # memo); a copy would not be (nor, while in progress, a cycle).
            if seen is x or type(seen) is Run:
                return seen
            raise _Unseen
        self.containers[key] = _IN_PROGRESS
        self.containers[key] = out = self._new(x, cls, depth)
        return out

    def _new(self, x: Any, cls: type, depth: int) -> Any:
        """What ``x`` (a container met for the first time) pickles as."""
        if cls is dict:
            if not _LEAVES.issuperset(map(type, x)):
                raise _Unseen
            values = x.values()
        else:
            values = x
        n = len(values)
        # In C, a pass over the values each: this runs for every run.
        if n >= RUN_MIN and set(map(type, values)) == _ONLY_TENSORS:
            ids = set(map(id, values))
            if any(map(_state, values)) or len(ids) != n or not ids.isdisjoint(self.run_tensors):
                raise _Unseen
            self.run_tensors |= ids
            return Run(x)
        self.budget -= n
        if self.budget < 0 or depth >= _SCAN_DEPTH:
            raise _Unseen
        visit = self.visit
        new = [visit(v, depth + 1) for v in values]
        for a, b in zip(new, values):
            if a is not b:
                break
        else:
            return x  # nothing in it changed
        if cls is tuple:
            return tuple(new)
        if cls is list:
            return new
        return dict(zip(x, new))


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

    def extend(self, tensors: Iterable[torch.Tensor], sizes: list[int], codes: bytes | bytearray,
               shapes: dict[int, tuple[int, ...]]) -> int:
        """Slots for a run of ``tensors`` (as :meth:`add` takes them; shapes
        of those not 1-D by their place in the run), which the caller has
        checked fits; the first slot."""
        start = len(self.tensors)
        self.tensors += tensors
        self.codes += codes
        self.sizes += sizes
        self.nbytes += sum(sizes)
        for k, shape in shapes.items():
            self.shapes[start + k] = shape
        return start

    def finish(self, stream: bytes) -> tuple[bytes, list[Buffer]]:
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
            buffers: list[Buffer]
            if len(order) == 1:
                sent = _unjoined(groups[0], self.sizes, self.nbytes, order[0], large)
                buffers = [sent if sent is not None else _gather(groups[0], large)]
            else:
                buffers = [_gather(members, large) for members in groups]
        table = pickle.dumps((order, slot_group, numels, self.shapes), protocol=5)
        return MARK + _LEN.pack(len(table)) + table + stream, buffers


def _unjoined(members: list[torch.Tensor], sizes: list[int], nbytes: int, code: int,
              large: bool) -> Buffer | None:
    """``members`` (1-D, of dtype ``code``, ``sizes`` bytes each, ``nbytes``
    in all) as a :class:`~ucxrpc.transport.wire.gather.Gather`, sent from where they
    are (or, back to back in one storage, as that range of it: :func:`_span`),
    or None where they are to be joined now: a bundle the transport would copy into
    its frame anyway (:data:`MAX_TENSOR_BYTES`, its default inline
    threshold, or less), or one whose bytes are not its values (lazily
    negated or conjugated, or a zero tensor without bytes).  Only for
    bundles of one dtype, the common case: with several, the table's
    bundles and their buffers stay in one simple order."""
    if large or nbytes <= MAX_TENSOR_BYTES or any(map(_is_neg, members)) or (
            code in _COMPLEX_CODES and any(map(_is_conj, members))):
        return None
    addresses = list(map(_data_ptr, members))
    if 0 in addresses:
        return None
    whole = _span(members[0], addresses, sizes, nbytes)
    if whole is not None:
        return whole
    return Gather(members, addresses, sizes, nbytes)


def _span(first: torch.Tensor, addresses: list[int], sizes: list[int],
          nbytes: int) -> torch.Tensor | None:
    """The bytes of members at ``addresses`` (``sizes`` bytes each) as one
    uint8 tensor over ``first``'s storage where they lie back to back in
    it, else None.  Tensors received in one bundle and sent on as they came
    (an echo; a stage passing its inputs on) are views of one buffer in
    order: sent as that buffer's range, UCX copies one block where an I/O
    vector of a hundred parts cost it about twice as long (Run AB's 80 µs
    against 23-36 for 400 KiB), and no vector is built."""
    if addresses[1:] != list(map(operator.add, addresses[:-1], sizes[:-1])):
        return None
    storage = first.untyped_storage()
    offset = addresses[0] - storage.data_ptr()
    if offset < 0 or offset + nbytes > storage.nbytes():
        return None  # back to back in memory, but not all in this storage
    return _BYTES.new().set_(storage, offset, (nbytes,), (1,))


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
    sizes: list[list[int]]
    if (ngroups == 1 and type(numels) is list and slot_group.count(0) == len(numels)
            and _INT_ONLY.issuperset(map(type, numels)) and min(numels, default=0) >= 0):
        sizes = [numels]  # one group (the common case), checked in C: ~0.1 us a slot less
    else:
        sizes = [[] for _ in range(ngroups)]
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
            if type(buf) is Gather:  # dumps' own output, not received: see _unjoined
                buf = buf.joined()
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
            parts.append(_split(buf.view(dtype), sizes[g], itemsize))
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


def _split(whole: torch.Tensor, numels: list[int], itemsize: int) -> Sequence[torch.Tensor]:
    """The tensors of one bundle (``whole``, as their dtype): views of
    it, except where a view would travel on with the whole bundle (torch's
    rule, :func:`.tensors.compacted`: a bundle under 8 KiB, or a
    tensor over half of it).  Those get storages of their own, as torch's
    receiver gives every tensor: sent on (a reply echoing them), they stay
    a run and do not arrive sharing one storage."""
    # split_with_sizes itself: Tensor.split's Python wrapper cost another
    # 0.3 µs per tensor.
    pieces = whole.split_with_sizes(numels)
    if len(numels) < 2:
        return pieces  # all of the buffer: it travels as itself
    storage_bytes = whole.untyped_storage().nbytes()
    if compacted(storage_bytes, max(numels) * itemsize):
        return pieces  # every view would travel as a compact copy: the common case
    if not compacted(storage_bytes, 0):  # none would: one copy each, in one call
        # (torch's stub types it as returning None; it returns the copies)
        copies: list[torch.Tensor] = torch.split_with_sizes_copy(  # type: ignore[func-returns-value,assignment]
            whole, numels)
        return copies
    return [p if compacted(storage_bytes, n * itemsize) else p.clone()
            for p, n in zip(pieces, numels)]
