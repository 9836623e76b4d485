"""Tensor wire forms shared by both sides, and the receiving side.

Split from :mod:`ucxrpc.serialization` (which pickles): the dtype tables that
are part of the wire format, and the rebuild functions a pickle stream
names, with :class:`_Loader`, which checks every tensor against the buffers
the message actually carried before viewing them.
"""

from __future__ import annotations

import ctypes
import io
import logging
import math
import pickle
import threading
from collections.abc import Sequence
from typing import Any, cast

import torch

from ..devices import extracting_tensors
from ..errors import SerializationError

logger = logging.getLogger(__name__)

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_UINT8 = torch.uint8

# Empty tensors to ``set_`` received storages onto, per (dtype, device).
_PROTOS: dict[tuple[torch.dtype, int], torch.Tensor] = {}


# torch's RPC rule (tensorpipe_utils.cpp): re-copy a view when its storage is
# at least this large and at least COMPACT_RATIO times the bytes it uses.
COMPACT_MIN_BYTES = 8 * 1024
COMPACT_RATIO = 2


def compacted(storage_bytes: int, view_bytes: int) -> bool:
    """torch's rule: whether a view travels as a compact copy of itself
    (else with its whole storage, shared with whatever else uses it)."""
    return storage_bytes >= COMPACT_MIN_BYTES and storage_bytes >= COMPACT_RATIO * view_bytes


def _device_name(t: torch.Tensor) -> str:
    # str(t.device) is several times slower and this runs once per buffer.
    return f"cuda:{t.get_device()}" if t.is_cuda else "cpu"

# ---------------------------------------------------------------------------
# dtype names: tensors carry their dtype as a short string.  The same string
# object is reused for every tensor of a dtype, so pickle's memo sends it once
# per message; a torch.dtype object would cost a global lookup on load.


_DTYPE_TO_NAME: dict[torch.dtype, str] = {}
_NAME_TO_DTYPE: dict[str, torch.dtype] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_TO_NAME.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        _DTYPE_TO_NAME[dtype] = name
    return name


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = _NAME_TO_DTYPE.get(name)
    if dtype is None:
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise SerializationError(f"unknown tensor dtype {name!r} in message")
        _NAME_TO_DTYPE[name] = dtype
    return dtype


# dtype numbers for _rebuild_vector.  The table is part of the wire format:
# append only (a name this torch lacks keeps its slot).  A code is the number
# shifted left by two, or'ed with the flags below.
_CODED_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
                 "int8", "uint8", "bool", "complex64", "complex128", "complex32",
                 "uint16", "uint32", "uint64")
_REQUIRES_GRAD, _PARAMETER = 1, 2  # flags of _rebuild_tensor and of codes

# dtype -> (code without flags, itemsize); code -> (dtype, itemsize, flags)
_DTYPE_CODES: dict[torch.dtype, tuple[int, int]] = {
    dt: (number << 2, dt.itemsize) for number, dt in
    enumerate(getattr(torch, name, None) for name in _CODED_DTYPES) if isinstance(dt, torch.dtype)}
_CODE_SPECS: dict[int, tuple[torch.dtype, int, int]] = {
    code | flags: (dt, itemsize, flags) for dt, (code, itemsize) in _DTYPE_CODES.items()
    for flags in range(4)}
_COMPLEX_CODES = frozenset(code for dt, (code, _) in _DTYPE_CODES.items() if dt.is_complex)


# ---------------------------------------------------------------------------
# Receiving side.



def _settle_copy(copy: torch.Tensor) -> None:
    """Wait for a realigned CUDA buffer's copy.  It was queued on this
    thread's current stream, while the message's reader (a served call on
    its pool streams, a future's waiter) waits only for the streams the
    transport settled.  Rare (a buffer at an odd offset), so a wait is
    cheap where it happens."""
    torch.cuda.current_stream(copy.device).synchronize()

class _LoadState(threading.local):
    loader: _Loader | None = None  # the _Loader of the loads running here


_LOCAL = _LoadState()

_NOT_IN_LOADS = "a ucxrpc tensor can only be unpickled by Serializer.loads"


def _rebuild_vector(index: int, code: int, numel: int) -> torch.Tensor:
    """Pickle's rebuild call for a 1-D tensor that is all of its buffer.

    The hot path of every load, so it is written out here rather than as a
    _Loader method (one Python call less per tensor): mostly one view op.
    """
    loader = _LOCAL.loader
    if loader is None:
        raise SerializationError(_NOT_IN_LOADS)
    number = loader.ntensors
    loader.ntensors = number + 1
    if index == loader.used:  # a new buffer (each earlier one has its entry)
        loader.used = index + 1
        buffers = loader.buffers
        buf = buffers[index] if index < loader.nregular else None
        # The checks of _Loader.entry, in their cheapest form.
        if not (isinstance(buf, _Tensor) and buf.dtype is _UINT8 and buf.stride() == (1,)):
            buf, bits, nbytes = loader.entry(index, number)  # or raises
        else:
            bits, nbytes = buf.data_ptr(), buf.numel()
            loader.entries[index] = (buf, bits, nbytes)
    elif 0 <= index < loader.used:
        buf, bits, nbytes = loader.entries[index]
    else:
        raise loader.out_of_order(number, index)
    spec = _CODE_SPECS.get(code)
    if spec is None:
        raise SerializationError(f"unknown tensor dtype code {code!r} in message")
    dtype, itemsize, flags = spec
    if numel * itemsize == nbytes and not bits % itemsize:
        try:
            # view(dtype) is a non-differentiable view: a leaf with no _base.
            t = buf.view(dtype)
        except RuntimeError:  # its storage starts misaligned (buffer over odd memory)
            t = loader.place(number, index, dtype, 0, (numel,), (1,))
    else:  # a buffer of another size, or misaligned: checked, maybe copied
        t = loader.place(number, index, dtype, 0, (numel,), (1,))
    return _finish(t, flags, None, number) if flags else t


def _rebuild_bundled(slot: int, flags: int = 0) -> torch.Tensor:
    """Pickle's rebuild call for a tensor that travelled in a bundle
    (:mod:`ucxrpc.serialization.bundle`): already cut out before the stream was read."""
    loader = _LOCAL.loader
    if loader is None:
        raise SerializationError(_NOT_IN_LOADS)
    number = loader.ntensors
    loader.ntensors = number + 1
    bundled = loader.bundled
    if not (type(slot) is int and 0 <= slot < len(bundled)):
        raise SerializationError(f"tensor {number} names bundle slot {slot!r} of {len(bundled)}")
    t = bundled[slot]
    return _finish(t, flags, None, number) if flags else t


def _bundled_slot(slot: int) -> torch.Tensor:
    """Pickle's rebuild call for a bundled tensor with no flags.

    :class:`BundleUnpickler` resolves this name to its message's slot table
    instead, so the call costs a dict look-up in C, not a Python frame and
    the loader's bookkeeping (0.14 µs a tensor, 14 µs a message of 100);
    this function serves any other unpickler.
    """
    return _rebuild_bundled(slot)


def _rebuild_inband(code: int, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    """Pickle's rebuild call for a small host tensor whose bytes travelled
    in the pickle stream (see ``serialization.INBAND_MAX_BYTES``): a tensor
    of its own, as torch's agent would make.  Like bundled tensors without
    flags, not counted in ``_Loader.ntensors``."""
    spec = _CODE_SPECS.get(code) if type(code) is int else None
    if spec is None or spec[2]:
        raise SerializationError(f"unknown tensor dtype code {code!r} in an in-band tensor")
    dtype, itemsize, _ = spec
    try:
        # Checked before anything is allocated: the shape is only a claim
        # (torch.empty refuses negative and non-integer sizes).
        if type(shape) is not tuple or type(data) is not bytes:
            raise TypeError(f"{type(shape).__name__} shape, {type(data).__name__} data")
        if math.prod(shape) * itemsize != len(data):
            raise ValueError(f"{len(data)} bytes for {dtype} of shape {shape}")
        t = torch.empty(shape, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise SerializationError(f"malformed in-band tensor: {exc}") from None
    if data:
        ctypes.memmove(t.data_ptr(), data, len(data))
    return t


#: What a run (:class:`ucxrpc.serialization.bundle.Run`) was: the kinds of _bundled_run.
RUN_LIST, RUN_TUPLE, RUN_DICT = 0, 1, 2


def _bundled_run(start: int, n: int, kind: int, keys: tuple[Any, ...] | None = None) -> Any:
    """Pickle's rebuild call for a list, tuple or dict (``keys``) of the
    ``n`` bundled tensors from slot ``start`` on."""
    loader = _LOCAL.loader
    if loader is None:
        raise SerializationError(_NOT_IN_LOADS)
    bundled = loader.bundled
    if not (type(start) is int and type(n) is int and 0 <= start and 0 < n
            and start + n <= len(bundled)):
        raise SerializationError(f"a run of {n!r} tensors from bundle slot {start!r} is not "
                                 f"within the {len(bundled)} slots")
    run = bundled[start:start + n]  # a list of its own (see _bundle.unpack)
    if kind == RUN_LIST:
        return run
    if kind == RUN_TUPLE:
        return tuple(run)
    if kind == RUN_DICT and type(keys) is tuple and len(keys) == n:
        return dict(zip(keys, run))
    raise SerializationError(f"a run of {n} tensors of kind {kind!r} with "
                             f"{type(keys).__name__} keys")


def _as_is(obj: Any) -> Any:
    """Pickle's rebuild call for a run that did not bundle: it travelled as
    itself, one call deeper."""
    return obj


class _Slots(dict[int, torch.Tensor]):
    """Bundled tensors by slot; a slot the table lacks is refused by name
    (a list would take -1 as its last slot)."""

    __slots__ = ()

    def __missing__(self, slot: object) -> torch.Tensor:
        raise SerializationError(f"a tensor names bundle slot {slot!r} of {len(self)}")


class BundleUnpickler(pickle.Unpickler):
    """Reads a bundled message's pickle stream (see :func:`_bundled_slot`).

    Bundled tensors with no flags are not counted in ``_Loader.ntensors``,
    so the tensor numbers in errors count the other tensors only.
    """

    def __init__(self, stream: memoryview, loader: _Loader,
                 bundled: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(stream), buffers=loader)
        self._bundled = bundled

    def find_class(self, module: str, name: str) -> Any:
        # Called once per distinct global in a message (pickle memoizes
        # them), so the table is made here: a message whose bundled tensors
        # all travel in runs needs none.
        if name == "_bundled_slot" and module == __name__:
            return _Slots(enumerate(self._bundled)).__getitem__
        return super().find_class(module, name)


def _rebuild_tensor(index: int, offset: int, dtype: str, shape: tuple[int, ...],
                    stride: tuple[int, ...], flags: int, cls: type | None = None) -> torch.Tensor:
    """Pickle's rebuild call for any other out-of-band tensor (no copy if aligned)."""
    loader = _LOCAL.loader
    if loader is None:
        raise SerializationError(_NOT_IN_LOADS)
    number = loader.ntensors
    loader.ntensors = number + 1
    if index == loader.used:
        loader.used = index + 1
        loader.entry(index, number)
    elif not 0 <= index < loader.used:
        raise loader.out_of_order(number, index)
    t = loader.place(number, index, _dtype_from_name(dtype), offset, shape, stride)
    return _finish(t, flags, cls, number) if flags or cls is not None else t


def _rebuild_sparse_coo(indices: torch.Tensor, values: torch.Tensor, size: tuple[int, ...],
                        coalesced: bool, flags: int) -> torch.Tensor:
    """Pickle's rebuild call for a sparse COO tensor, whose indices and
    values travelled as tensors of their own (out of band); its autograd
    flag is applied as a dense tensor's is."""
    loader = _LOCAL.loader
    if loader is None:
        raise SerializationError(_NOT_IN_LOADS)
    try:
        # Checked, as torch's own unpickling checks sparse tensors: a peer's
        # indices out of range would otherwise be read past the values.
        t = torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced,
                                    check_invariants=True)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise SerializationError(f"a sparse tensor of size {tuple(size)} is malformed: "
                                 f"{exc}") from exc
    return _finish(t, flags, None, loader.ntensors) if flags else t


def _extent(offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """One past the last storage element a view touches; 0 if it has none."""
    if len(shape) != len(stride):
        raise SerializationError(f"tensor shape {shape} and stride {stride} differ in length")
    end = offset + 1
    for size, step in zip(shape, stride):
        if size == 0:
            return 0
        if size < 0 or step < 0:
            raise SerializationError(f"tensor has negative shape {shape} or stride {stride}")
        end += (size - 1) * step
    return end


def _finish(t: torch.Tensor, flags: int, cls: type | None, number: int) -> torch.Tensor:
    """Apply the autograd flags and the tensor type to a rebuilt tensor."""
    requires_grad = bool(flags & _REQUIRES_GRAD)
    if flags & _PARAMETER:
        t = _Parameter(t, requires_grad=requires_grad)
    elif cls is not None:
        if not (isinstance(cls, type) and issubclass(cls, _Tensor)):
            raise SerializationError(f"tensor {number} has type {cls!r}, not a Tensor subclass")
        t = t.as_subclass(cls)
    if requires_grad:
        t.requires_grad_()
        capture = _LOCAL.loader.capture if _LOCAL.loader is not None else None
        if capture is not None:
            capture.append(t)
    return t


class GradCapture:
    """Lists the tensors requiring grad that a message carries after it.

    Put one in a message ahead of the objects of interest: after ``dumps``
    its ``tensors`` are those pickled after it (each once), and the copy
    ``loads`` rebuilds lists their counterparts in the same order.  This is
    how distributed autograd pairs what one worker sent with what the other
    received, whatever objects the tensors sat in.
    """

    __slots__ = ("tensors",)

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __reduce__(self) -> Any:
        # A Serializer never gets here (it pickles captures itself).  A
        # CUDA-aware future finding the tensors of an autograd reply does.
        if extracting_tensors():
            return (list, (self.tensors,))
        raise TypeError("a GradCapture can only be pickled by a ucxrpc Serializer")


def _rebuild_capture() -> GradCapture:
    loader = _LOCAL.loader
    if loader is None:
        raise SerializationError(_NOT_IN_LOADS)
    capture = GradCapture()
    loader.capture = capture.tensors
    return capture


# (buffer, its address, its length in bytes)
_Entry = tuple[torch.Tensor, int, int]


class _Loader:
    """Per-``loads`` state: hands buffers to tensors and to pickle.

    Also the iterator pickle draws its out-of-band buffers from.
    """

    __slots__ = ("buffers", "used", "ntensors", "entries", "capture", "bundled", "nregular")

    def __init__(self, buffers: Sequence[torch.Tensor],
                 bundled: list[torch.Tensor] | None = None, nbundles: int = 0) -> None:
        self.buffers = buffers
        self.bundled = bundled or []  # tensors by bundle slot (see _bundle)
        self.nregular = len(buffers) - nbundles  # the bundles are the last buffers
        self.used = 0  # buffers introduced so far, in stream order
        self.ntensors = 0
        self.entries: dict[int, _Entry] = {}
        self.capture: list[torch.Tensor] | None = None  # see GradCapture

    def __iter__(self) -> _Loader:
        return self

    def __next__(self) -> Any:
        """The next out-of-band pickle buffer (a numpy array's bytes)."""
        index = self.used
        buf = (self.entries.get(index) or self.entry(index, None))[0]
        self.used += 1
        if buf.is_cuda:
            raise SerializationError(f"buffer {index} holds pickled bytes but is on {_device_name(buf)}")
        return buf.numpy()

    def out_of_order(self, number: int, index: int) -> SerializationError:
        return SerializationError(f"tensor {number} refers to buffer {index} out of order "
                                 f"(next new buffer is {self.used}); corrupt message")

    def place(self, number: int, index: int, dtype: torch.dtype, offset: int,
               shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        """A ``dtype`` view of buffer ``index`` (already checked) at ``offset``."""
        buf, bits, nbytes = self.entries[index]
        itemsize = dtype.itemsize
        end = _extent(offset, shape, stride)
        if end and (offset < 0 or end * itemsize > nbytes):
            raise SerializationError(
                f"tensor {number} needs bytes [{offset * itemsize}, {end * itemsize}) "
                f"but buffer {index} has {nbytes} bytes")
        base = cast(int, buf.storage_offset())
        # Elements must be aligned both in memory and within the storage.
        if (bits | base) % itemsize:
            buf, base = self._realign(index, buf, itemsize), 0
        device = buf.get_device()
        proto = _PROTOS.get((dtype, device))
        if proto is None:
            proto = _PROTOS[(dtype, device)] = torch.empty(0, dtype=dtype, device=buf.device)
        return proto.new().set_(buf.untyped_storage(), base // itemsize + offset, shape, stride)

    def entry(self, index: int, number: int | None) -> _Entry:
        """Check buffer ``index`` and cache what views of it need (first use).

        ``number``: the tensor that needs it, or None for a pickle buffer.
        """
        buffers = self.buffers
        if index >= self.nregular:
            who = f"pickle buffer {index}" if number is None else f"tensor {number}"
            raise SerializationError(f"{who} needs buffer {index} but the message has only "
                                     f"{self.nregular} buffers{self._besides()}")
        buf = buffers[index]
        # stride() == (1,) is the cheaper test; the rest are 0- or 1-byte buffers.
        if not (isinstance(buf, _Tensor) and buf.dtype is _UINT8
                and (buf.stride() == (1,) or buf.dim() == 1 and buf.is_contiguous())):
            raise SerializationError(f"buffer {index} is not a 1-D contiguous uint8 tensor")
        if buf.stride() != (1,):  # one byte or none: views of it get stride 1
            buf = buf.as_strided(buf.shape, (1,))
        entry = self.entries[index] = (buf, buf.data_ptr(), buf.numel())
        return entry

    def _realign(self, index: int, buf: torch.Tensor, itemsize: int) -> torch.Tensor:
        """Copy a buffer whose address does not suit ``itemsize``-byte elements.

        The copy is a fresh (aligned) allocation and replaces the buffer for
        the rest of this message, so later views share it.
        """
        logger.debug("buffer %d is misaligned for %d-byte elements; copying %d bytes",
                     index, itemsize, buf.numel())
        copy = torch.empty_like(buf).copy_(buf)
        if copy.is_cuda:
            _settle_copy(copy)
        self.entries[index] = (copy, copy.data_ptr(), copy.numel())
        return copy

    def finish(self) -> None:
        """Check that the pickle used every buffer the message carried."""
        if self.used != self.nregular:
            raise SerializationError(f"message has {self.nregular} buffers{self._besides()} "
                                     f"but its pickle uses {self.used}")

    def _besides(self) -> str:
        return " besides its bundles" if self.nregular < len(self.buffers) else ""
