"""Pickle protocol 5 with tensors travelling out of band.

A message becomes a :class:`Pickled`: a pickle stream (``payload``) that holds
only metadata, plus a list of raw byte buffers (``buffers``), each a 1-D
contiguous ``torch.uint8`` tensor on the CPU or a CUDA device.  The transport
sends ``[payload, *buffers]``; the receiver reads the sizes and devices first
(:attr:`Pickled.specs`), allocates the buffers itself, receives straight into
them and calls :meth:`Serializer.loads`, which rebuilds every tensor as a view
of those buffers -- no copy on either side for contiguous data.

What goes out of band:

* every strided CPU or CUDA tensor (``nn.Parameter`` and plain subclasses
  included): its storage bytes.  A storage shared by several tensors in one
  message travels once and arrives shared again.  As in torch's RPC, a view
  that uses less than half of a storage of at least 8 KiB travels as a compact
  copy of just the view instead.
* any protocol-5 ``PickleBuffer`` of at least 64 KiB, which is how large
  contiguous numpy arrays pickle themselves.

Sparse, quantized, nested and other exotic tensors fall back to torch's own
pickling (correct, not zero-copy).

Small host tensors are the exception to zero-copy: copied into one buffer
per dtype (a *bundle*, :mod:`ucxrpc.serialization.bundle`), they cost the transport one
buffer instead of one each; a dict, list or tuple of them pickles as one
call (a *run*).  The first few very small ones of a message (at most
:data:`INBAND_MAX_TENSORS`, :data:`INBAND_MAX_BYTES` together) travel
inside the pickle stream itself, as ``_rebuild_inband(code, shape, bytes)``:
a message carrying a scalar or a short vector then needs no buffer and no
bundle at all.  The first small tensor past those goes out of band as
itself, zero-copy (a bundle of one would cost a table, a copy and a split);
only the ones after it bundle.

Wire forms: a plain 1-D tensor that is all of its storage (the common case)
travels as ``_rebuild_vector(buffer, code, numel)``, ``code`` packing a dtype
number from a fixed table with the autograd flags; every other tensor as
``_rebuild_tensor(buffer, offset, dtype name, shape, stride, flags[, type])``.

The rebuild functions, the dtype table and the receiving side live in
:mod:`ucxrpc.serialization.tensors`.

Buffer numbering: buffers are numbered in the order the pickle stream first
refers to them.  Tensors name their buffer index explicitly (so shared storages
can be referenced again); pickle's own out-of-band buffers (``NEXT_BUFFER``)
carry no index, and take the next unused number.  Because a tensor's rebuild
call never has another buffer nested inside its arguments, the load side sees
the buffers introduced in exactly the same order, which :class:`_Loader`
checks.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import operator
import pickle
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import bundle as _bundle
from .tensors import (_COMPLEX_CODES, _DTYPE_CODES, _LOCAL, _PARAMETER, _REQUIRES_GRAD, RUN_DICT,
                      RUN_LIST, RUN_TUPLE, BundleUnpickler, GradCapture, _as_is, _bundled_run,
                      _bundled_slot, _Loader, _device_name, _dtype_name, _rebuild_bundled,
                      _rebuild_capture, _rebuild_inband, _rebuild_sparse_coo, _rebuild_tensor,
                      _rebuild_vector, compacted)
from .._core import plain_pickle as _plain_pickle
from ..errors import SerializationError
from ..transport.wire.gather import Buffer, Gather


__all__ = ["BufferSpec", "GradCapture", "Pickled", "Serializer", "dumps", "loads",
           "unpickling_error"]

logger = logging.getLogger(__name__)

PROTOCOL = 5
#: None pickled (what pickle writes for it at PROTOCOL, without a frame).
_NONE = pickle.dumps(None, protocol=PROTOCOL)

#: Small host tensors that travel inside the pickle stream: at most this
#: many per message, of at most this many bytes together.  A message's
#: bundle costs the two sides ~20 µs in process (the table, the gather, the
#: frame's buffer, the split) and about twice that between two processes;
#: a tensor in the stream costs a few copies of its bytes and a fresh tensor
#: on arrival (~3 µs).  Measured in a pair loop (echo, blocks in turn within
#: one process pair, p50): one tensor of 0-d, 1, 4 and 8 KiB 42%, 33%, 25%
#: and 20% faster in band, 16 KiB a draw, 32 and 64 KiB 50% and 110% slower;
#: two 4 KiB tensors 20% faster, four a draw, eight 44% slower; eight
#: scalars 36% faster.
INBAND_MAX_TENSORS = 8
INBAND_MAX_BYTES = 8192
_string_at = ctypes.string_at

# PickleBuffers (large numpy arrays) below this size stay inside the pickle:
# one more transport buffer costs more than copying a few KiB.
_OOB_MIN_BYTES = 64 * 1024


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided
_SPARSE_COO = torch.sparse_coo
_UINT8 = torch.uint8
_storage_uses = _bundle.storage_uses
_Run = _bundle.Run
#: A run's dtype codes by dtype, and _NO_CODE where a dtype has none (no
#: code is: codes are multiples of 4).
_CODE_OF = {dtype: code for dtype, (code, _) in _DTYPE_CODES.items()}
_NO_CODE = 0xFF
_NO_CODES = itertools.repeat(_NO_CODE)
_STRIDED_ONLY = {_STRIDED}
# A run's checks are passes over its tensors in C (map), each attribute read
# once per tensor: a Python loop over them cost ~1 µs per tensor, a quarter of
# it the loop itself (100 tensors: 91 µs against 69).
_dtype = operator.attrgetter("dtype")
_requires_grad = operator.attrgetter("requires_grad")
_layout = operator.attrgetter("layout")
_is_nested = operator.attrgetter("is_nested")
_is_cpu = operator.attrgetter("is_cpu")
_nbytes = operator.attrgetter("nbytes")
_cdata = operator.attrgetter("_cdata")
_is_contiguous = torch.Tensor.is_contiguous
_dim = torch.Tensor.dim
_untyped_storage = torch.Tensor.untyped_storage
_storage_nbytes = torch.UntypedStorage.nbytes


def _bundles(t: torch.Tensor, storage: torch.UntypedStorage, storage_bytes: int,
             nbytes: int) -> bool:
    """Whether ``t`` (a small host tensor of ``nbytes`` over ``storage``) may
    travel as a copy in a bundle: contiguous, and either all of its storage
    and the only tensor using it, or a view that torch's rule sends as a
    compact copy anyway.  Either way nothing else in the message shares its
    bytes; a tensor that might must keep the per-storage path, which makes
    it arrive shared."""
    return _owns_bytes(storage, storage_bytes, nbytes) and t.is_contiguous()


def _owns_bytes(storage: torch.UntypedStorage, storage_bytes: int, nbytes: int) -> bool:
    """:func:`_bundles`' rule on the storage side."""
    return (_storage_uses(storage._cdata) == 2 if storage_bytes == nbytes
            else compacted(storage_bytes, nbytes))


def _all_bundle(tensors: Sequence[torch.Tensor], storages: list[torch.UntypedStorage],
                storage_bytes: list[int], sizes: list[int]) -> bool:
    """:func:`_bundles` for every tensor of a run, one pass per check."""
    # Each all of its storage (the common case): 2 uses, the tensor and the
    # storage object read here, as in _owns_bytes.
    if storage_bytes == sizes:
        owned = all(map((2).__eq__, map(_storage_uses, map(_cdata, storages))))
    elif (storage_bytes.count(first := storage_bytes[0]) == len(storage_bytes)
          and compacted(first, max(sizes))):
        # Views of storages of one size (mostly one storage: a received
        # bundle sent on), all compact copies: compacted() only grows true
        # as the view shrinks.  A call per tensor cost ~0.25 us.
        owned = True
    else:
        owned = all(map(_owns_bytes, storages, storage_bytes, sizes))
    return owned and all(map(_is_contiguous, tensors))


Reducer = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """Size and device of one out-of-band buffer, known before its bytes.

    Attributes:
        nbytes: length of the buffer in bytes.
        device: ``"cpu"`` or ``"cuda:N"``.
    """

    nbytes: int
    device: str


class Pickled(NamedTuple):
    """One serialized message: a pickle stream and its out-of-band buffers.

    The buffers view the sender's memory (zero-copy): the tensors and arrays
    they came from must not be modified until the transport has sent them.
    CUDA buffers may still have work pending on the current stream (the
    producer's kernels, or the compaction copy made by ``dumps``).

    Attributes:
        payload: the pickle stream (protocol 5).
        buffers: 1-D contiguous ``torch.uint8`` tensors (CPU or CUDA), or a
            bundle's :class:`~ucxrpc.transport.wire.gather.Gather` of host
            tensors (the transport sends its parts as one buffer), in the
            order ``loads`` expects them back.
        cuda: whether any buffer is CUDA memory (device maps apply).
    """

    payload: bytes
    buffers: list[Buffer]
    cuda: bool = False  # whether any buffer is CUDA memory

    # (A NamedTuple, built by _new_pickled: every message is pickled into
    # one, and a dataclass's __init__ was a Python call each; issue 52.)

    @property
    def specs(self) -> list[BufferSpec]:
        """What the receiver must allocate: one spec per buffer, in order."""
        return [BufferSpec(b.numel(), "cpu" if isinstance(b, Gather) else _device_name(b))
                for b in self.buffers]


#: Builds a :class:`Pickled` without its Python ``__new__``.
_new_pickled = tuple.__new__


# ---------------------------------------------------------------------------
# Sending side.


@functools.cache
def _plain_subclass(cls: type) -> bool:
    """Whether tensors of ``cls`` can travel as raw storage plus their type.

    True for subclasses that keep torch's default pickling and dispatch (so a
    real storage backs them); wrapper subclasses and those with their own
    ``__reduce_ex__`` (Parameter subclasses, DTensor, ...) use their own.
    """
    return (cls.__reduce_ex__ is _Tensor.__reduce_ex__
            and getattr(cls, "__torch_dispatch__", None) is _Tensor.__torch_dispatch__)


# Empty tensors to make new ones from: ``proto.new()`` is the cheapest way to
# get a tensor of a given dtype and device to ``set_`` onto a storage (it
# skips parsing dtype/device arguments), and this runs once per tensor.
# Keyed by device index (-1 for the CPU); the receiving side adds the dtype.
_BYTE_PROTOS: dict[int, torch.Tensor] = {}


def _bytes_of(view: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor viewing ``view``'s bytes (no copy)."""
    if view.readonly:
        # torch warns that writing would be undefined; nothing here writes.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def _bytes_over(storage: torch.UntypedStorage, device: int) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage`` (on device index ``device``)."""
    proto = _BYTE_PROTOS.get(device)
    if proto is None:
        proto = _BYTE_PROTOS[device] = torch.empty(0, dtype=_UINT8, device=storage.device)
    return proto.new().set_(storage)


# Below this guard, view and set_ skip autograd's view and version tracking
# (0.15-0.2 us each, a third), which no transport buffer needs.  Entering it
# costs about 0.6 us, so it pays from _UNTRACKED_MIN buffers.  Only our own
# calls run inside it, never pickling (user code).
_UNTRACKED: Callable[[], Any] = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView",
                                        contextlib.nullcontext)
_UNTRACKED_MIN = 4


def _as_bytes(buffers: list[Any]) -> list[Buffer]:
    """The uint8 tensors for what a dump put in ``buffers``, all made at once
    (a list of Buffer, as the bundles added after them may be Gathers).

    Each is a tensor (a 1-D stride-1 one, or already bytes: a numpy array's)
    whose bytes are ``view(uint8)``, half the cost of ``set_``, or a (storage,
    device index) pair.  Made after the dump so that one guard covers them.
    """
    if len(buffers) < _UNTRACKED_MIN:
        return [_bytes_over(*b) if type(b) is tuple else b.view(_UINT8) for b in buffers]
    with _UNTRACKED():
        return [_bytes_over(*b) if type(b) is tuple else b.view(_UINT8) for b in buffers]


def _materialize(t: torch.Tensor) -> torch.Tensor:
    """Resolve lazy conj/neg bits and zero tensors into real memory."""
    t = t.detach()
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t.resolve_conj().resolve_neg()


def _set_tensor_state(tensor: torch.Tensor, state: Any) -> torch.Tensor:
    """Restore Python attributes of a received tensor (as torch's pickling)."""
    if getattr(type(tensor), "__setstate__", _Tensor.__setstate__) is not _Tensor.__setstate__:
        tensor.__setstate__(state)
    else:
        torch._utils._set_obj_state(tensor, state)
    return tensor


class _MessagePickler(pickle.Pickler):
    """Pickler for one thread; reused across messages (state reset per dump)."""

    def __init__(self, serializer: Serializer) -> None:
        self._chunks: list[bytes] = []
        # The pickler is its own file, and pickle reads ``write`` once, in
        # __init__ below: the chunk list's own append (C), so a dump's
        # write is no Python call (issue 52).  The list is therefore kept,
        # emptied after each dump, never replaced.
        self.write = self._chunks.append  # type: ignore[method-assign,assignment]
        self._dispatch = serializer._dispatch
        self._hook = serializer._hook
        self._bundling = serializer.bundle
        self._pack: _bundle.Packer | None = None
        # What a message may carry in the stream, and what this one still may.
        self._inband = serializer.inband
        self._inband_left, self._inband_room = self._inband
        # Whether the next tensor that could bundle goes as itself instead
        # (Serializer's first_alone; once per message).
        self._first_alone = self._lone = serializer.first_alone
        if self._hook is not None or self._dispatch:
            # pickle reads this attribute once, here: without extensions the
            # per-object call goes straight to the tensor code.
            self.reducer_override = self._reduce_extended  # type: ignore[method-assign]
        super().__init__(self, protocol=PROTOCOL, buffer_callback=self._buffer_callback)
        self.buffers: list[Any] = []  # see _as_bytes
        self._storage_index: dict[tuple[int, int, int], int] = {}
        self._capture: list[torch.Tensor] | None = None  # see GradCapture
        self.cuda = False
        self.busy = False

    def write(self, data: bytes) -> Any:
        # The pickler is its own file: it writes once per dump except for very
        # large streams, so keeping the chunks avoids a BytesIO copy.  (Bound
        # over by the list's append in __init__; here for pickle's protocol.)
        self._chunks.append(data)

    def run(self, obj: object) -> tuple[bytes, list[Buffer], bool]:
        """Pickle ``obj``; returns the payload, the buffers and whether any is
        CUDA memory, then resets."""
        try:
            self.dump(obj)
            chunks, cuda = self._chunks, self.cuda
            payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            buffers: list[Buffer] = _as_bytes(self.buffers) if self.buffers else []
            if self._pack is not None:
                payload, bundles = self._pack.finish(payload)
                buffers = buffers + bundles if buffers else bundles
        finally:
            self.clear_memo()  # do not keep the message's objects alive
            self._chunks.clear()  # (the same list: write is its append)
            self._pack = None
            self._inband_left, self._inband_room = self._inband
            self._lone = self._first_alone
            self.buffers = []
            self._storage_index = {}
            self._capture = None
            self.cuda = False
        return payload, buffers, cuda

    def _reduce_extended(self, obj: Any) -> Any:
        """reducer_override with the serializer's hook and dispatch table first."""
        if self._hook is not None:
            rv = self._hook(obj)
            if rv is not NotImplemented:
                return rv
        reducer = self._dispatch.get(type(obj))
        if reducer is not None:
            return reducer(obj)
        return _MessagePickler.reducer_override(self, obj)

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is not _Tensor and cls is not _Parameter:
            if isinstance(obj, _Tensor):
                return self._reduce_tensor(obj)
            if cls is _Run:
                return self._reduce_run(obj.obj)
            if cls is GradCapture:
                self._capture = obj.tensors
                return (_rebuild_capture, ())
            return NotImplemented
        # Fast path, inline: a plain tensor that is all of its storage (most
        # tensors an RPC carries).  Its buffer is its own bytes: no offset, no
        # compaction to weigh.  Each attribute read costs ~0.05 us, a quarter
        # of this path, so each is done once and only where it can matter.
        t = obj
        dtype = t.dtype
        spec = _DTYPE_CODES.get(dtype)  # None for quantized and rare dtypes
        if spec is None or t.layout is not _STRIDED or t.is_nested or t.__dict__:
            return self._reduce_tensor(t)
        code, itemsize = spec
        nbytes = t.nbytes
        cpu = t.is_cpu
        storage = None  # read once, whichever path reads it first
        if cpu and 0 < nbytes <= _bundle.MAX_TENSOR_BYTES and self._bundling:
            # The bundle's cat writes values, so lazy negation and
            # conjugation and zero tensors need no check here; an empty
            # tensor has nothing to bundle.
            storage = t.untyped_storage()
            storage_bytes = storage.nbytes()
            if _bundles(t, storage, storage_bytes, nbytes):
                if (nbytes <= self._inband_room and self._inband_left and cls is _Tensor
                        and not t.requires_grad and not t.is_neg()
                        and not (code in _COMPLEX_CODES and t.is_conj())):
                    ptr = t.data_ptr()  # null for a ZeroTensor: the bundle makes its zeros
                    if ptr:
                        self._inband_room -= nbytes
                        self._inband_left -= 1
                        return (_rebuild_inband, (code, tuple(t.shape), _string_at(ptr, nbytes)))
                pack = self._pack
                if pack is None and self._lone:
                    self._lone = False  # it goes as itself, below
                    slot = -1
                else:
                    if pack is None:
                        pack = self._pack = _bundle.Packer()
                    slot = pack.add(t, nbytes, code)
                if slot >= 0:
                    flags = self._grad_flag(t) if t.requires_grad else 0
                    if cls is _Parameter:
                        flags |= _PARAMETER
                    if flags:
                        return (_rebuild_bundled, (slot, flags))
                    return (_bundled_slot, (slot,))
        if cpu:
            device = -1
        elif t.is_cuda:
            device = t.get_device()
            self.cuda = True
        else:
            return self._reduce_tensor(t)
        if t.is_neg() or code in _COMPLEX_CODES and t.is_conj():
            return self._reduce_tensor(t)
        ptr = t.data_ptr()  # null for a ZeroTensor (it has no bytes) and empty ones
        if not ptr:
            return self._reduce_tensor(t)
        if storage is None:
            storage = t.untyped_storage()
            storage_bytes = storage.nbytes()
        whole = storage_bytes == nbytes
        if not whole:
            return self._reduce_tensor(t)
        # A stride-1 vector as large as its storage starts at offset 0.
        vector = t.stride() == (1,)
        if not vector and t.storage_offset():
            return self._reduce_tensor(t)
        key = (ptr, nbytes, device)  # as _buffer_index's, the offset being 0
        index = self._storage_index.get(key)
        if index is None:
            index = self._storage_index[key] = len(self.buffers)
            # Its bytes, made by _as_bytes after the dump.
            self.buffers.append(t if vector else (storage, device))
        flags = self._grad_flag(t) if t.requires_grad else 0
        if cls is _Parameter:
            flags |= _PARAMETER
        if vector:
            return (_rebuild_vector, (index, code | flags, nbytes // itemsize))
        return (_rebuild_tensor, (index, 0, _dtype_name(dtype), tuple(t.shape), t.stride(), flags))

    def _reduce_run(self, obj: Any) -> Any:
        """A :class:`_bundle.Run`: its tensors bundled in consecutive slots
        when every one of them bundles alone (see reducer_override), else
        the container as itself."""
        cls = type(obj)
        # with_runs checked the type and the __dict__ of each.
        values = list(obj.values()) if cls is dict else obj
        codes = bytes(map(_CODE_OF.get, map(_dtype, values), _NO_CODES))
        if (_NO_CODE in codes or any(map(_requires_grad, values))
                or _STRIDED_ONLY != set(map(_layout, values)) or any(map(_is_nested, values))
                or not all(map(_is_cpu, values))):
            return (_as_is, (obj,))
        sizes = list(map(_nbytes, values))
        pack = self._pack
        room = _bundle.MAX_TOTAL_BYTES - (pack.nbytes if pack is not None else 0)
        if min(sizes) <= 0 or max(sizes) > _bundle.MAX_TENSOR_BYTES or sum(sizes) > room:
            return (_as_is, (obj,))
        storages = list(map(_untyped_storage, values))
        if not _all_bundle(values, storages, list(map(_storage_nbytes, storages)), sizes):
            return (_as_is, (obj,))
        dims = list(map(_dim, values))
        shapes = ({k: tuple(values[k].shape) for k, d in enumerate(dims) if d != 1}
                  if dims.count(1) != len(dims) else {})
        if pack is None:
            pack = self._pack = _bundle.Packer()
        start = pack.extend(values, sizes, codes, shapes)
        if cls is dict:
            return (_bundled_run, (start, len(sizes), RUN_DICT, tuple(obj)))
        return (_bundled_run, (start, len(sizes), RUN_LIST if cls is list else RUN_TUPLE))

    def _grad_flag(self, t: torch.Tensor) -> int:
        if self._capture is not None:
            self._capture.append(t)
        return _REQUIRES_GRAD

    def _buffer_callback(self, buffer: pickle.PickleBuffer) -> bool:
        # Returning False sends the buffer out of band; it takes the next
        # buffer number, matching _Loader.__next__.
        view = buffer.raw()
        if view.nbytes < _OOB_MIN_BYTES:
            return True
        self.buffers.append(_bytes_of(view))
        return False

    def _reduce_tensor(self, t: torch.Tensor) -> Any:
        """General path: any tensor (views, subclasses, lazy bits, ...)."""
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter and not _plain_subclass(cls):
            return NotImplemented
        if t.layout is _SPARSE_COO and cls is _Tensor and (t.is_cpu or t.is_cuda):
            # Its indices and values go out of band like any tensor's data;
            # torch's own pickling would drop requires_grad, and with it the
            # tensor's place in distributed autograd (sparse embeddings).
            flags = self._grad_flag(t) if t.requires_grad else 0
            d = t.detach()
            return (_rebuild_sparse_coo, (d._indices(), d._values(), tuple(t.shape),
                                          t.is_coalesced(), flags))
        if (t.layout is not _STRIDED or t.is_quantized or t.is_nested
                or not (t.is_cpu or t.is_cuda)):
            return NotImplemented  # torch's own pickling: in band, but correct
        data = _materialize(t) if t.is_neg() or t.is_conj() or t._is_zerotensor() else t
        index = self._buffer_index(data)
        if index < 0:  # compacted: a fresh copy of just the view
            data = data.detach().clone()
            index = self._add_buffer(data.untyped_storage(), data.get_device())
        flags = self._grad_flag(t) if t.requires_grad else 0
        if cls is _Parameter:
            flags |= _PARAMETER
        args: tuple[Any, ...] = (index, data.storage_offset(), _dtype_name(data.dtype),
                                 tuple(data.shape), data.stride(), flags)
        if cls is not _Tensor and cls is not _Parameter:
            args += (cls,)
        elif not t.__dict__:
            return (_rebuild_tensor, args)
        state = torch._utils._get_obj_state(t)
        if not state:
            return (_rebuild_tensor, args)
        # state_setter (not BUILD, which would call Tensor.__setstate__) runs
        # after the tensor exists, so buffers inside the state keep stream order.
        return (_rebuild_tensor, args, state, None, None, _set_tensor_state)

    def _buffer_index(self, t: torch.Tensor) -> int:
        """Index of the buffer holding ``t``'s whole storage, or -1 to compact."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if compacted(nbytes, t.nbytes):
            return -1
        # The device is part of the key so that empty storages (all at
        # address 0) on different devices stay apart.
        device = t.get_device()
        key = (storage.data_ptr(), nbytes, device)
        index = self._storage_index.get(key)
        if index is None:
            index = self._storage_index[key] = self._add_buffer(storage, device)
        return index

    def _add_buffer(self, storage: torch.UntypedStorage, device: int) -> int:
        """Add a buffer for all of ``storage`` (made by _as_bytes); its index."""
        if device >= 0:
            self.cuda = True
        self.buffers.append((storage, device))
        return len(self.buffers) - 1


# ---------------------------------------------------------------------------
# Public interface.


class Serializer:
    """Turns objects into :class:`Pickled` messages and back.

    Thread-safe: each thread reuses its own pickler.

    Extension: later layers intercept their own types either by passing
    ``dispatch={SomeType: reducer}`` (``reducer(obj)`` returns a ``__reduce__``
    tuple; matched on the exact type, checked before tensors) or by
    subclassing and overriding :meth:`reducer_override`, which then sees every
    object pickle does not handle natively.  Rebuild functions named in those
    tuples must be importable module-level callables.

    Args:
        max_buffers: most out-of-band buffers one message may have (the wire
            format allows 65535).
        dispatch: extra reducers by exact type.
        bundle: gather small host tensors into one buffer per dtype
            (:mod:`ucxrpc.serialization.bundle`), the first few of them inside the pickle
            stream; off, each travels as its own buffer.
        inband_tensors, inband_bytes: how many small host tensors, and how
            many bytes of them, a message carries inside the pickle stream
            (:data:`INBAND_MAX_TENSORS`, :data:`INBAND_MAX_BYTES`).
        first_alone: a message's first small host tensor past those goes
            as its own buffer, not in a bundle: a bundle of one tensor
            costs both sides a table, a copy and a split for nothing, and
            most messages carry one tensor.  The ones after it bundle.
    """

    def __init__(self, *, max_buffers: int = 65535,
                 dispatch: Mapping[type, Reducer] | None = None, bundle: bool = True,
                 inband_tensors: int = INBAND_MAX_TENSORS,
                 inband_bytes: int = INBAND_MAX_BYTES, first_alone: bool = True) -> None:
        self.max_buffers = max_buffers
        self.bundle = bundle
        self.first_alone = first_alone
        self.inband = (inband_tensors, inband_bytes)
        self._dispatch: dict[type, Reducer] = dict(dispatch or {})
        overridden = type(self).reducer_override is not Serializer.reducer_override
        self._hook: Reducer | None = self.reducer_override if overridden else None
        self._local = threading.local()
        #: ``dumps_plain(obj)``: ``obj``'s pickle where it is plain (no
        #: tensor, nothing this serializer's hooks or tensor code would
        #: see: csrc/plain.c says what is), bytes that pickle's own
        #: ``loads`` unpickles, and that :meth:`loads` would too; else None,
        #: and :meth:`dumps` is the way.  One C call where :meth:`dumps`
        #: makes seven Python calls (issue 52).  Never plain with a hook or
        #: a dispatch table: they must see every object.
        self.dumps_plain: Callable[[Any], bytes | None] = (
            _plain_pickle if self._hook is None and not self._dispatch else _never_plain)

    def reducer_override(self, obj: Any) -> Any:
        """Hook for subclasses: a reduce tuple for ``obj``, or ``NotImplemented``.

        Called for every object that is not an int, float, str, bytes, None,
        bool, tuple, list or dict -- tensors included -- before the built-in
        handling.  The base class is never called (the hook is skipped when not
        overridden, to keep the hot path short).
        """
        return NotImplemented

    def dumps(self, obj: object) -> Pickled:
        """Serialize ``obj``; tensor and large array bytes go out of band.

        Never blocks: no timeout.  CUDA work (compaction copies) is only
        enqueued on the current stream.

        Raises:
            TypeError, AttributeError, pickle.PicklingError, ...: whatever
                pickle raised for an unpicklable object, unchanged.
            SerializationError: the message needs more than ``max_buffers``
                buffers.
        """
        if obj is None:
            # Every reply of a function that returns nothing: pickle writes
            # None before any hook or dispatch table could see it, so these
            # are its bytes whatever they are (a call's ~1 µs of pickler
            # set-up and reset; issue 52).
            return _new_pickled(Pickled, (_NONE, [], False))
        # A hook or a dispatch table must see every object, and a run's
        # tensors are never handed to them.
        if self.bundle and self._hook is None and not self._dispatch:
            obj = _bundle.with_runs(obj)
        pickler = self._acquire_pickler()
        try:
            payload, buffers, cuda = pickler.run(obj)
        finally:
            pickler.busy = False
        if len(buffers) > self.max_buffers:
            raise SerializationError(f"message needs {len(buffers)} buffers; the limit is "
                                     f"{self.max_buffers}")
        return _new_pickled(Pickled, (payload, buffers, cuda))

    def loads(self, payload: bytes | memoryview, buffers: Sequence[torch.Tensor]) -> object:
        """Rebuild an object from ``payload`` and the received ``buffers``.

        Tensors come back as views of ``buffers`` (same devices), except where
        a buffer's address does not suit a tensor's dtype: then that buffer is
        copied once.  Received tensors are leaves.  Never blocks: no timeout.

        Raises:
            SerializationError: too many, too few or too small buffers, a
                corrupt payload, or any error raised while unpickling (chained).
        """
        if not buffers and payload == _NONE:  # dumps' None, unpickled without a loader
            return None
        if len(buffers) > self.max_buffers:
            raise SerializationError(f"message has {len(buffers)} buffers; the limit is "
                                     f"{self.max_buffers}")
        unpickler = None
        if payload[:1] == _bundle.MARK:
            stream, bundled, nbundles = _bundle.unpack(payload, buffers)
            loader = _Loader(buffers, bundled, nbundles)
            unpickler = BundleUnpickler(stream, loader, bundled)
        else:
            loader = _Loader(buffers)
        outer = _LOCAL.loader  # loads may nest via __setstate__
        _LOCAL.loader = loader
        try:
            if unpickler is None:
                obj = pickle.loads(payload, buffers=loader)
            else:
                obj = unpickler.load()
        except SerializationError:
            raise
        except Exception as exc:
            raise unpickling_error(exc) from exc
        finally:
            _LOCAL.loader = outer
        if buffers:  # (without any, none is left unused: a call fewer a no-op)
            loader.finish()
        return obj

    def _acquire_pickler(self) -> _MessagePickler:
        # Building a Pickler costs about as much as pickling a small message,
        # so each thread keeps one; a nested dumps (from inside a reducer)
        # gets a fresh one.
        pickler = getattr(self._local, "pickler", None)
        if pickler is None:
            pickler = self._local.pickler = _MessagePickler(self)
        elif pickler.busy:
            pickler = _MessagePickler(self)
        pickler.busy = True
        return pickler


def _never_plain(obj: object) -> None:
    """A serializer's ``dumps_plain`` where it has hooks: nothing is plain."""
    return None


def unpickling_error(exc: Exception) -> SerializationError:
    """The error for a message whose unpickling raised ``exc`` (not chained:
    raise it ``from exc``): :meth:`Serializer.loads`' words, and the agent's
    for a plain message, which it unpickles with pickle's ``loads``."""
    if isinstance(exc, SerializationError):
        return exc
    return SerializationError(f"cannot unpickle message: {type(exc).__name__}: {exc}")


_default = Serializer()


def dumps(obj: object) -> Pickled:
    """:meth:`Serializer.dumps` with the default serializer."""
    return _default.dumps(obj)


def loads(payload: bytes | memoryview, buffers: Sequence[torch.Tensor]) -> object:
    """:meth:`Serializer.loads` with the default serializer."""
    return _default.loads(payload, buffers)
