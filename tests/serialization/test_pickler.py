"""Round trips through ucxrpc.serialization, in process.

``_wire`` plays the transport: it copies every buffer into a fresh uint8
tensor (optionally a slice of a bigger allocation) so nothing received
aliases what was sent.

These tests pin the per-buffer wire form, which carries large, CUDA and
shared-storage tensors: ``dumps`` here bundles nothing.  Bundling of small
host tensors (on by default) has its own tests in ``test_bundle.py``; the
in-band form and what the receiving side refuses (tensors.py), in
``test_tensors.py``.
"""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch

from tests.serialization._helpers import assert_same as _assert_same
from tests.serialization._helpers import copied_at as _wire
from ucxrpc.serialization import pickler as serialization
from ucxrpc.errors import SerializationError
from ucxrpc.serialization.pickler import BufferSpec, Pickled, Serializer, loads

dumps = Serializer(bundle=False).dumps

ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
]


def _roundtrip(obj: object, offset: int | None = None) -> object:
    pickled = dumps(obj)
    return loads(pickled.payload, _wire(pickled, offset))


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic NaN-free values of any dtype."""
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# --------------------------------------------------------------------------
# Interface


def test_all_names_exist():
    assert sorted(serialization.__all__) == ["BufferSpec", "GradCapture", "Pickled", "Serializer",
                                             "dumps", "loads", "unpickling_error"]
    for name in serialization.__all__:
        assert hasattr(serialization, name)


def test_payload_is_protocol_5_pickle_without_tensor_bytes():
    t = torch.full((4096,), 7, dtype=torch.uint8)
    pickled = dumps({"t": t})
    assert isinstance(pickled.payload, bytes)
    assert pickled.payload[:2] == b"\x80\x05"
    assert b"\x07" * 64 not in pickled.payload  # the data is out of band
    assert len(pickled.payload) < 200
    assert pickled.specs == [BufferSpec(4096, "cpu")]


def test_buffers_are_zero_copy_uint8_views_of_the_storage():
    t = torch.randn(64, 64)
    pickled = dumps(t)
    (buf,) = pickled.buffers
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert buf.numel() == t.nbytes
    assert buf.data_ptr() == t.data_ptr()


def test_specs_list_every_buffer_in_order():
    a, b = torch.zeros(3, dtype=torch.int16), torch.zeros(5, dtype=torch.float64)
    pickled = dumps([a, b])
    assert pickled.specs == [BufferSpec(6, "cpu"), BufferSpec(40, "cpu")]


def _noop() -> None:
    return None


class _Hooked(Serializer):
    def reducer_override(self, obj):
        return NotImplemented


@pytest.mark.parametrize("serializer", [Serializer(), Serializer(bundle=False), _Hooked()],
                         ids=["default", "no-bundles", "hooked"])
def test_none_travels_as_pickle_writes_it_whatever_the_serializer(serializer):
    """A reply of None (every function that returns nothing) skips the
    pickler and the loader: its bytes must be pickle's own, and a None
    payload that came with buffers is refused as any payload would be."""
    pickled = serializer.dumps(None)
    assert pickled == Pickled(pickle.dumps(None, protocol=5), [], False)
    assert serializer.loads(memoryview(pickled.payload), []) is None
    assert serializer.loads(pickled.payload, []) is None
    with pytest.raises(SerializationError, match="message has 1 buffers but its pickle uses 0"):
        serializer.loads(pickled.payload, [torch.zeros(4, dtype=torch.uint8)])
    # Not the same object each time: a sender may keep what it was given.
    assert serializer.dumps(None) is not pickled


def test_noop_message_has_no_buffers():
    pickled = dumps((_noop, (), {}))
    assert pickled.buffers == []
    assert loads(pickled.payload, []) == (_noop, (), {})


# --------------------------------------------------------------------------
# Tensors


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_roundtrips(dtype):
    t = _sample(dtype, (5, 7))
    _assert_same(_roundtrip(t), t)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_roundtrips_from_misaligned_buffer(dtype):
    t = _sample(dtype, (3, 5))
    _assert_same(_roundtrip(t, offset=1), t)


@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (3, 0), (2, 0, 4)], ids=str)
def test_zero_dim_and_zero_size(shape):
    t = _sample(torch.float32, shape)
    got = _roundtrip(t)
    _assert_same(got, t)


def test_zero_size_view_with_offset():
    base = torch.arange(10.0)
    view = base[5:5]
    got_base, got_view = _roundtrip([base, view])
    _assert_same(got_view, view)
    assert got_view.storage_offset() == 5
    assert _shares_storage(got_base, got_view)


def test_non_contiguous_layouts_keep_strides():
    base = torch.arange(60.0).reshape(3, 4, 5)
    cases = [base.transpose(0, 2), base[:, ::2, 1:], base.permute(1, 2, 0),
             torch.arange(3.0).reshape(3, 1).expand(3, 4)]
    got = _roundtrip(cases)
    for g, want in zip(got, cases):
        _assert_same(g, want)
        assert g.storage_offset() == want.storage_offset()
        assert g.is_contiguous() == want.is_contiguous()


def test_views_sent_together_stay_views():
    a = torch.arange(12.0).reshape(3, 4)
    pickled = dumps({"a": a, "tail": a[1:], "t": a.T, "flat": a.view(-1)})
    assert len(pickled.buffers) == 1
    got = loads(pickled.payload, _wire(pickled))
    for key in ("tail", "t", "flat"):
        assert _shares_storage(got["a"], got[key])
    assert got["t"].stride() == (1, 4)
    got["a"][1, 0] = -1.0
    assert got["tail"][0, 0].item() == -1.0
    assert got["t"][0, 1].item() == -1.0


def test_views_of_different_dtypes_share_one_buffer():
    a = torch.arange(8, dtype=torch.int32)
    b = a.view(torch.uint8)
    pickled = dumps([a, b])
    assert len(pickled.buffers) == 1
    got_a, got_b = loads(pickled.payload, _wire(pickled))
    _assert_same(got_b, b)
    got_b[0] = 99
    assert got_a[0].item() == 99


def test_same_tensor_twice_arrives_as_one_object():
    t = torch.randn(4)
    pickled = dumps([t, t])
    assert len(pickled.buffers) == 1
    got = loads(pickled.payload, _wire(pickled))
    assert got[0] is got[1]


def test_separate_storages_travel_separately():
    a, b = torch.zeros(4), torch.ones(4)
    pickled = dumps([a, b])
    assert len(pickled.buffers) == 2
    got_a, got_b = loads(pickled.payload, _wire(pickled))
    assert not _shares_storage(got_a, got_b)


def test_views_share_storage_after_realignment_copy():
    a = torch.arange(16, dtype=torch.float64)
    got_a, got_tail = _roundtrip([a, a[3:]], offset=3)
    _assert_same(got_tail, a[3:])
    assert _shares_storage(got_a, got_tail)


# Compaction: storage >= 8 KiB and >= 2x the bytes the view uses.


def test_compaction_when_storage_large_and_view_small():
    base = torch.arange(2048, dtype=torch.float32)  # exactly 8 KiB
    view = base[100:1124]  # 4 KiB: exactly half
    pickled = dumps(view)
    assert pickled.specs == [BufferSpec(4096, "cpu")]
    got = loads(pickled.payload, _wire(pickled))
    _assert_same(got, view)
    assert got.storage_offset() == 0


def test_no_compaction_just_below_size_threshold():
    base = torch.arange(2047, dtype=torch.float32)  # 8 KiB - 4 bytes
    view = base[100:101]
    pickled = dumps(view)
    assert pickled.specs == [BufferSpec(2047 * 4, "cpu")]
    got = loads(pickled.payload, _wire(pickled))
    _assert_same(got, view)
    assert got.storage_offset() == 100


def test_no_compaction_when_view_uses_more_than_half():
    base = torch.arange(2048, dtype=torch.float32)
    view = base[:1025]  # 4100 bytes > 8192 / 2
    pickled = dumps(view)
    assert pickled.specs == [BufferSpec(8192, "cpu")]
    _assert_same(loads(pickled.payload, _wire(pickled)), view)


def test_compacted_non_dense_view_arrives_contiguous():
    base = torch.arange(8192, dtype=torch.float32).reshape(64, 128)
    view = base[::4, ::2]  # 2 KiB of a 32 KiB storage
    pickled = dumps(view)
    assert pickled.specs == [BufferSpec(view.nbytes, "cpu")]
    got = loads(pickled.payload, _wire(pickled))
    assert torch.equal(got, view)
    assert got.is_contiguous()


def test_compacted_views_no_longer_share_but_whole_tensor_does():
    base = torch.arange(4096, dtype=torch.float32)  # 16 KiB
    small = base[:10]
    pickled = dumps([base, base[1:], small])
    assert [s.nbytes for s in pickled.specs] == [16384, 40]
    got_base, got_tail, got_small = loads(pickled.payload, _wire(pickled))
    assert _shares_storage(got_base, got_tail)
    assert not _shares_storage(got_base, got_small)
    assert torch.equal(got_small, small)


# Fast path: a plain tensor that is all of its storage travels without offset
# (1-D stride-1 ones as _rebuild_vector); everything else takes the general
# path.  Both must agree on buffers, sharing and layout.


def _forms(pickled: Pickled) -> set[str]:
    """Which rebuild functions a payload calls."""
    return {name for name in ("_rebuild_vector", "_rebuild_tensor") if name.encode() in pickled.payload}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_whole_vector_of_every_dtype_takes_the_fast_path(dtype):
    t = _sample(dtype, (37,))
    pickled = dumps(t)
    assert _forms(pickled) == {"_rebuild_vector"}
    (buf,) = pickled.buffers
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert buf.data_ptr() == t.data_ptr() and buf.numel() == t.nbytes
    bufs = _wire(pickled)
    got = loads(pickled.payload, bufs)
    _assert_same(got, t)
    assert got.data_ptr() == bufs[0].data_ptr()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_whole_vector_from_misaligned_buffer(dtype):
    t = _sample(dtype, (9,))
    got = _roundtrip(t, offset=1)
    _assert_same(got, t)
    assert got.data_ptr() % t.itemsize == 0


def test_vector_buffer_has_no_autograd_link_to_its_tensor():
    t = torch.randn(8, requires_grad=True)
    (buf,) = dumps(t).buffers
    assert not buf.requires_grad and buf.grad_fn is None
    assert buf.data_ptr() == t.data_ptr()


def test_view_smaller_than_its_storage_below_threshold_sends_the_storage():
    base = torch.arange(100.0)  # 400 bytes: far below the compaction threshold
    view = base[:60]  # offset 0, stride 1, but not all of its storage
    pickled = dumps(view)
    assert _forms(pickled) == {"_rebuild_tensor"}
    assert pickled.specs == [BufferSpec(400, "cpu")]
    got = loads(pickled.payload, _wire(pickled))
    _assert_same(got, view)
    assert got.untyped_storage().nbytes() == 400


@pytest.mark.parametrize("make", [
    lambda: torch.tensor(2.5),  # 0-dim
    lambda: torch.arange(12.0).reshape(3, 4),
    lambda: torch.arange(12.0).reshape(3, 4).T,  # all of its storage, not contiguous
    lambda: torch.arange(3.0)[:1].expand(3),  # stride 0, storage as large as its bytes
    lambda: torch.arange(3.0)[2:].expand(3),  # the same at offset 2
    lambda: torch.empty_strided((1,), (5,)).fill_(7.0),  # one element, odd stride
    lambda: torch.arange(3.0).reshape(1, 3).T,  # size-1 dim with a non-default stride
], ids=["0-dim", "2-d", "transposed", "expanded", "expanded-offset", "odd-stride-1",
        "size-1-stride"])
def test_whole_storage_non_vectors_keep_exact_layout(make):
    t = make()
    pickled = dumps(t)
    assert _forms(pickled) == {"_rebuild_tensor"}
    assert [s.nbytes for s in pickled.specs] == [t.untyped_storage().nbytes()]
    bufs = _wire(pickled)
    got = loads(pickled.payload, bufs)
    _assert_same(got, t)
    assert got.storage_offset() == t.storage_offset()
    assert got.untyped_storage().data_ptr() == bufs[0].data_ptr()


@pytest.mark.parametrize("nvectors", [0, 1, 8])
def test_buffers_of_every_kind_are_zero_copy_bytes(nvectors):
    # Buffers are made after the dump, under a guard from a few on: both ways.
    vectors = [torch.full((5,), float(i)) for i in range(nvectors)]
    matrix = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    arr = np.arange(1 << 14, dtype=np.float64)
    obj = [*vectors, matrix, arr]
    pickled = dumps(obj)
    assert len(pickled.buffers) == nvectors + 2
    for buf in pickled.buffers:
        assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    sources = [t.data_ptr() for t in vectors] + [matrix.data_ptr(), arr.ctypes.data]
    assert [b.data_ptr() for b in pickled.buffers] == sources
    got = loads(pickled.payload, _wire(pickled))
    for g, want in zip(got[:-1], obj[:-1]):
        _assert_same(g, want)
    assert np.array_equal(got[-1], arr)


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 2, 0)], ids=["vector-first", "vector-last"])
def test_vector_and_views_of_it_share_one_buffer_in_either_order(order):
    a = torch.arange(10.0)
    parts = [a, a[2:], a.view(2, 5)]  # fast path, general path, whole-storage 2-D
    obj = [parts[i] for i in order]
    pickled = dumps(obj)
    assert len(pickled.buffers) == 1
    got = loads(pickled.payload, _wire(pickled))
    for g, want in zip(got, obj):
        _assert_same(g, want)
        assert g.storage_offset() == want.storage_offset()
    whole, tail, matrix = (got[order.index(i)] for i in range(3))
    whole[3] = -1.0
    assert tail[1].item() == -1.0 and matrix[0, 3].item() == -1.0


def test_vector_buffer_larger_than_needed_is_used_in_place():
    t = torch.arange(6, dtype=torch.int32)
    pickled = dumps(t)
    big = torch.zeros(64, dtype=torch.uint8)
    big[:24] = pickled.buffers[0]
    got = loads(pickled.payload, [big])
    _assert_same(got, t)
    assert got.data_ptr() == big.data_ptr()


@pytest.mark.parametrize("storage_start, offset", [(4, 4), (4, 8)],
                         ids=["aligned-address", "aligned-offset"])
def test_vector_from_buffer_whose_storage_starts_misaligned(storage_start, offset):
    # A storage that starts 4 bytes off an 8-byte boundary, and a buffer in it
    # whose address or whose offset in the storage does not suit float64:
    # either way the buffer is copied before float64 views it.
    t = torch.arange(5, dtype=torch.float64)
    pickled = dumps(t)
    raw = torch.zeros(64, dtype=torch.uint8)
    start = next(s for s in range(8) if (raw.data_ptr() + s) % 8 == storage_start)
    storage = torch.frombuffer(memoryview(raw.numpy())[start:], dtype=torch.uint8)
    buf = storage[offset:offset + 40]
    assert (buf.data_ptr() % 8 == 0) != (buf.storage_offset() % 8 == 0)
    buf.copy_(pickled.buffers[0])
    got = loads(pickled.payload, [buf])
    _assert_same(got, t)
    assert got.data_ptr() % 8 == 0 and got.data_ptr() != buf.data_ptr()


def test_neg_view_of_a_whole_real_tensor_is_materialized():
    neg = torch._neg_view(torch.arange(4.0))
    assert neg.is_neg() and neg.untyped_storage().nbytes() == neg.nbytes
    got = _roundtrip(neg)
    assert not got.is_neg()
    assert torch.equal(got, -torch.arange(4.0))


def test_received_vector_is_a_plain_leaf_even_when_loaded_without_grad():
    t = torch.randn(5)
    pickled = dumps(t)
    with torch.no_grad():
        got = loads(pickled.payload, _wire(pickled))
    assert got.is_leaf and got._base is None and not got._is_view()
    w = torch.ones(5, requires_grad=True)
    got.mul_(w)  # in-place with grad: forbidden on views made under no_grad
    got.sum().backward()
    assert torch.equal(w.grad, t)


def test_dispatch_for_tensor_wins_over_the_fast_path():
    ser = Serializer(dispatch={torch.Tensor: lambda t: (torch.tensor, (t.tolist(),))})
    pickled = ser.dumps([torch.arange(3.0)])
    assert pickled.buffers == []
    assert torch.equal(ser.loads(pickled.payload, [])[0], torch.arange(3.0))


# Received tensors are views of the received buffers.


def test_received_tensor_is_a_view_of_its_buffer():
    t = torch.randn(8, 8)
    pickled = dumps(t)
    bufs = _wire(pickled)
    got = loads(pickled.payload, bufs)
    assert got.data_ptr() == bufs[0].data_ptr()
    bufs[0].zero_()
    assert torch.count_nonzero(got).item() == 0


def test_buffer_slice_at_aligned_offset_is_used_in_place():
    t = torch.randn(5, 3, dtype=torch.float64)
    pickled = dumps(t[1:])
    bufs = _wire(pickled, offset=64)
    assert bufs[0].storage_offset() == 64
    got = loads(pickled.payload, bufs)
    _assert_same(got, t[1:])
    assert got.data_ptr() == bufs[0].data_ptr() + 3 * 8


def test_buffer_slice_at_odd_offset_is_copied_for_wide_dtypes():
    t = torch.randn(5, 3, dtype=torch.float32)
    pickled = dumps(t)
    bufs = _wire(pickled, offset=1)
    got = loads(pickled.payload, bufs)
    _assert_same(got, t)
    assert got.data_ptr() % 4 == 0
    assert got.data_ptr() != bufs[0].data_ptr()


def test_byte_tensor_uses_odd_offset_buffer_in_place():
    t = torch.arange(100, dtype=torch.uint8)
    pickled = dumps(t)
    bufs = _wire(pickled, offset=1)
    got = loads(pickled.payload, bufs)
    _assert_same(got, t)
    assert got.data_ptr() == bufs[0].data_ptr()


# Autograd flags, parameters and subclasses.


def test_requires_grad_and_parameters_are_restored_as_leaves():
    x = torch.randn(3, requires_grad=True)
    y = x * 2  # not a leaf on this side
    p = torch.nn.Parameter(torch.randn(2, 2))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    plain = torch.randn(2)
    got_x, got_y, got_p, got_frozen, got_plain = _roundtrip([x, y, p, frozen, plain])
    assert got_x.requires_grad and got_x.is_leaf and type(got_x) is torch.Tensor
    assert got_y.requires_grad and got_y.is_leaf and got_y.grad_fn is None
    assert torch.equal(got_y, y.detach())
    assert type(got_p) is torch.nn.Parameter and got_p.requires_grad
    assert torch.equal(got_p, p.detach())
    assert type(got_frozen) is torch.nn.Parameter and not got_frozen.requires_grad
    assert not got_plain.requires_grad
    got_p.sum().backward()
    assert torch.equal(got_p.grad, torch.ones(2, 2))


class _TaggedTensor(torch.Tensor):
    pass


def test_plain_subclass_and_attributes_roundtrip_out_of_band():
    sub = torch.arange(6.0).as_subclass(_TaggedTensor)
    sub.tag = "hello"
    plain = torch.arange(3.0)
    plain.note = np.arange(3)
    pickled = dumps([sub, plain])
    assert len(pickled.buffers) == 2
    got_sub, got_plain = loads(pickled.payload, _wire(pickled))
    assert type(got_sub) is _TaggedTensor and got_sub.tag == "hello"
    assert torch.equal(got_sub.as_subclass(torch.Tensor), torch.arange(6.0))
    assert np.array_equal(got_plain.note, np.arange(3))


def test_buffers_inside_tensor_state_keep_their_order():
    t = torch.arange(4.0)
    t.payload = np.arange(20000, dtype=np.float64)  # out of band itself
    after = torch.arange(5, dtype=torch.int64)
    pickled = dumps([t, after])
    assert [s.nbytes for s in pickled.specs] == [16, 160000, 40]
    got_t, got_after = loads(pickled.payload, _wire(pickled))
    assert np.array_equal(got_t.payload, t.payload)
    _assert_same(got_after, after)


# Lazy bits and exotic layouts.


def test_conj_and_neg_views_are_materialized():
    c = torch.randn(4, dtype=torch.complex64)
    conj = c.conj()
    neg = conj.imag
    assert conj.is_conj() and neg.is_neg()
    got_conj, got_neg = _roundtrip([conj, neg])
    assert not got_conj.is_conj() and not got_neg.is_neg()
    assert torch.equal(got_conj, conj.resolve_conj())
    assert torch.equal(got_neg, neg.resolve_neg())


def test_zero_tensor_is_materialized():
    z = torch._efficientzerotensor(3)
    pickled = dumps(z)
    (buf,) = pickled.buffers
    assert not buf._is_zerotensor() and buf.data_ptr() != 0  # real bytes to send
    got = loads(pickled.payload, _wire(pickled))
    assert torch.equal(got, torch.zeros(3))


def test_sparse_tensor_falls_back_but_its_parts_go_out_of_band():
    dense = torch.zeros(6, 6)
    dense[1, 2], dense[4, 0] = 3.0, -1.0
    sparse = dense.to_sparse()
    pickled = dumps(sparse)
    assert len(pickled.buffers) == 2  # indices and values
    got = loads(pickled.payload, _wire(pickled))
    assert got.is_sparse
    assert torch.equal(got.to_dense(), dense)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantized_tensor_falls_back_to_torch_pickling():
    q = torch.quantize_per_tensor(torch.randn(8), scale=0.1, zero_point=3, dtype=torch.quint8)
    got = _roundtrip(q)
    assert got.is_quantized
    assert torch.equal(got.int_repr(), q.int_repr())
    assert got.q_scale() == q.q_scale()


# --------------------------------------------------------------------------
# numpy and containers


def test_large_numpy_array_goes_out_of_band_zero_copy():
    arr = np.arange(1 << 14, dtype=np.float64)  # 128 KiB
    pickled = dumps({"arr": arr})
    assert pickled.specs == [BufferSpec(arr.nbytes, "cpu")]
    assert pickled.buffers[0].data_ptr() == arr.ctypes.data
    assert len(pickled.payload) < 300
    bufs = _wire(pickled)
    got = loads(pickled.payload, bufs)["arr"]
    assert got.dtype == arr.dtype and np.array_equal(got, arr)
    assert got.ctypes.data == bufs[0].data_ptr()


def test_small_numpy_array_stays_in_band():
    arr = np.arange(100, dtype=np.int32)
    pickled = dumps(arr)
    assert pickled.buffers == []
    assert np.array_equal(loads(pickled.payload, []), arr)


def test_numpy_layouts_and_readonly():
    fortran = np.asfortranarray(np.arange(40000, dtype=np.float32).reshape(200, 200))
    strided = np.arange(40000, dtype=np.float64)[::2]  # not contiguous: in band
    readonly = np.frombuffer(bytes(range(256)) * 512, dtype=np.uint8)
    pickled = dumps([fortran, strided, readonly])
    assert [s.nbytes for s in pickled.specs] == [fortran.nbytes, readonly.nbytes]
    got_f, got_s, got_r = loads(pickled.payload, _wire(pickled))
    assert np.array_equal(got_f, fortran) and got_f.flags.f_contiguous
    assert np.array_equal(got_s, strided)
    assert np.array_equal(got_r, readonly) and not got_r.flags.writeable


def test_nested_containers_mixing_everything():
    base = torch.randn(4, 4)
    obj = {
        "list": [base, (base[0], {"deep": base.T})],
        "tuple": (1, "two", 3.0, None, b"bytes"),
        "np": np.ones(20000),
        "small_np": np.zeros(3),
        "meta": (torch.Size([2, 3]), torch.float16, torch.device("cpu")),
        "int8": _sample(torch.int8, (9,)),
    }
    pickled = dumps(obj)
    assert len(pickled.buffers) == 3
    got = loads(pickled.payload, _wire(pickled, offset=16))
    _assert_same(got["list"][0], base)
    _assert_same(got["list"][1][0], base[0])
    _assert_same(got["list"][1][1]["deep"], base.T)
    assert _shares_storage(got["list"][0], got["list"][1][1]["deep"])
    assert got["tuple"] == obj["tuple"]
    assert np.array_equal(got["np"], obj["np"])
    assert np.array_equal(got["small_np"], obj["small_np"])
    assert got["meta"] == obj["meta"]
    _assert_same(got["int8"], obj["int8"])


def test_large_in_band_payload_written_in_pieces():
    blob = bytes(range(256)) * 1024  # 256 KiB: pickle writes it separately
    obj = {"head": torch.arange(3), "blob": blob, "tail": [torch.ones(2), "end"]}
    pickled = dumps(obj)
    assert len(pickled.payload) > len(blob)
    got = loads(pickled.payload, _wire(pickled))
    assert got["blob"] == blob and got["tail"][1] == "end"
    assert torch.equal(got["head"], obj["head"]) and torch.equal(got["tail"][0], torch.ones(2))


# --------------------------------------------------------------------------
# Errors on dumps: the original pickling exception


@pytest.mark.parametrize("make", [lambda: (lambda: 0), threading.Lock], ids=["lambda", "lock"])
def test_unpicklable_raises_the_original_exception_type(make):
    bad = make()
    with pytest.raises(Exception) as plain:
        pickle.dumps(bad, protocol=5)
    with pytest.raises(Exception) as ours:
        dumps({"x": [torch.ones(2), bad]})
    assert type(ours.value) is type(plain.value)
    assert not isinstance(ours.value, SerializationError)
    # the serializer is still usable afterwards
    assert torch.equal(_roundtrip(torch.ones(2)), torch.ones(2))


def test_too_many_buffers_on_dumps():
    ser = Serializer(max_buffers=2, bundle=False)
    ser.dumps([torch.ones(1), torch.ones(1)])
    with pytest.raises(SerializationError, match="3 buffers; the limit is 2"):
        ser.dumps([torch.ones(1), torch.ones(1), torch.ones(1)])


# --------------------------------------------------------------------------
# Extension hooks


class _Handle:
    def __init__(self, name: str):
        self.name = name


def _rebuild_handle(name: str) -> _Handle:
    return _Handle("rebuilt:" + name)


def test_dispatch_mapping_intercepts_exact_type():
    ser = Serializer(dispatch={_Handle: lambda h: (_rebuild_handle, (h.name,))})
    pickled = ser.dumps([_Handle("a"), torch.ones(2)])
    got_handle, got_tensor = ser.loads(pickled.payload, _wire(pickled))
    assert got_handle.name == "rebuilt:a"
    assert torch.equal(got_tensor, torch.ones(2))
    # the default serializer pickles it normally
    assert _roundtrip(_Handle("a")).name == "a"


def test_subclass_reducer_override_sees_objects_and_tensors_still_work():
    seen = []

    class Intercepting(Serializer):
        def reducer_override(self, obj):
            seen.append(type(obj))
            if isinstance(obj, _Handle):
                return (_rebuild_handle, (obj.name,))
            return NotImplemented

    ser = Intercepting()
    # 40 KB: over INBAND_MAX_BYTES, so it takes the bundle's buffer.
    pickled = ser.dumps({"h": _Handle("b"), "t": torch.arange(5000)})
    assert len(pickled.buffers) == 1
    got = ser.loads(pickled.payload, _wire(pickled))
    assert got["h"].name == "rebuilt:b"
    assert torch.equal(got["t"], torch.arange(5000))
    assert _Handle in seen and torch.Tensor in seen


def _rebuild_inner(payload: bytes, raw: list[bytes]) -> object:
    bufs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw]
    return loads(payload, bufs)


class _Envelope:
    """Pickles by running a whole dumps of its content (a nested dumps)."""

    def __init__(self, content: object):
        self.content = content

    def __reduce__(self):
        inner = dumps(self.content)
        return (_rebuild_inner, (inner.payload, [b.numpy().tobytes() for b in inner.buffers]))


def test_nested_dumps_and_loads_do_not_disturb_the_outer_message():
    outer_t = torch.arange(6.0)
    inner_t = torch.arange(3, dtype=torch.int16)
    pickled = dumps([outer_t, _Envelope({"t": inner_t, "v": inner_t[1:]}), outer_t[2:]])
    assert len(pickled.buffers) == 1
    got_outer, got_inner, got_tail = loads(pickled.payload, _wire(pickled))
    _assert_same(got_outer, outer_t)
    _assert_same(got_tail, outer_t[2:])
    assert _shares_storage(got_outer, got_tail)
    _assert_same(got_inner["t"], inner_t)
    assert _shares_storage(got_inner["t"], got_inner["v"])


def test_module_level_and_instance_agree():
    t = torch.randn(3)
    a, b = dumps(t), Serializer().dumps(t)
    assert a.payload == b.payload
    assert torch.equal(Serializer().loads(a.payload, _wire(a)), t)


def test_threads_serialize_independently():
    errors = []

    def work(seed: int) -> None:
        try:
            for i in range(200):
                t = torch.full((16,), float(seed * 1000 + i))
                got = _roundtrip({"t": t, "v": t[2:]})
                assert torch.equal(got["t"], t) and _shares_storage(got["t"], got["v"])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors


# --------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
def test_cuda_tensors_roundtrip_on_device():
    base = torch.randn(8, 8, device="cuda")
    cpu = torch.arange(4)
    pickled = dumps({"a": base, "t": base.T, "row": base[1], "cpu": cpu})
    assert pickled.specs == [BufferSpec(256, "cuda:0"), BufferSpec(32, "cpu")]
    assert pickled.buffers[0].data_ptr() == base.data_ptr()
    got = loads(pickled.payload, _wire(pickled))
    _assert_same(got["a"], base)
    _assert_same(got["t"], base.T)
    assert _shares_storage(got["a"], got["row"])
    _assert_same(got["cpu"], cpu)


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_grad_capture_pairs_sent_and_received_tensors():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(4, 4).t().requires_grad_()  # the general (strided) path
    p = torch.nn.Parameter(torch.randn(2))
    before = torch.randn(2, requires_grad=True)
    capture = serialization.GradCapture()
    msg = (before, capture, [b, a, torch.ones(2)], {"again": a, "obj": _Holder(p)})
    pickled = dumps(msg)
    # Only what follows the capture, each tensor once, in stream order.
    assert [id(t) for t in capture.tensors] == [id(b), id(a), id(p)]
    got = loads(pickled.payload, _wire(pickled))
    received = got[1].tensors
    assert [id(t) for t in received] == [id(got[2][0]), id(got[2][1]), id(got[3]["obj"].t)]
    assert got[3]["again"] is got[2][1]
    assert all(t.requires_grad and t.is_leaf for t in received)
    assert isinstance(received[2], torch.nn.Parameter)
    for sent, back in zip(capture.tensors, received):
        assert torch.equal(sent.detach(), back.detach())
    # Without a capture nothing is recorded, and a capture cannot leave a message.
    assert _roundtrip([a])[0].requires_grad
    with pytest.raises(TypeError, match="GradCapture"):
        pickle.dumps(serialization.GradCapture())


# ---- sparse COO ------------------------------------------------------------

def _sparse(requires_grad: bool = False, coalesce: bool = False) -> torch.Tensor:
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    t = torch.sparse_coo_tensor(i, torch.tensor([3.0, 4.0, 5.0]), (2, 3))
    t = t.coalesce() if coalesce else t
    return t.requires_grad_() if requires_grad else t


def test_sparse_tensors_keep_requires_grad_and_their_place_in_a_capture():
    # torch's own pickling of a sparse tensor drops requires_grad: a sparse
    # embedding's output lost its place in distributed autograd.
    s = Serializer()
    sent = serialization.GradCapture()
    dense = torch.ones(2, requires_grad=True)
    pickled = s.dumps((sent, _sparse(requires_grad=True), dense, _sparse(coalesce=True)))
    got = s.loads(pickled.payload, pickled.buffers)
    assert got[1].layout is torch.sparse_coo and got[1].requires_grad
    assert torch.equal(got[1].detach().to_dense(), _sparse().to_dense())
    assert got[3].is_coalesced() and not got[3].requires_grad
    assert len(sent.tensors) == len(got[0].tensors) == 2
    assert got[0].tensors[0] is got[1] and got[0].tensors[1] is got[2]


def test_a_malformed_sparse_tensor_is_refused_by_name():
    s = Serializer()
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (2,),
                                  check_invariants=False)
    pickled = s.dumps(bad)
    with pytest.raises(SerializationError, match="sparse tensor of size"):
        s.loads(pickled.payload, pickled.buffers)


# --------------------------------------------------------------------------
# A misaligned CUDA buffer's copy is done before anyone reads it (the CUDA
# path review of 2026-11-29, finding 11): the copy is queued on the loading
# thread's current stream, and the message's reader runs on streams that
# wait only for what the transport settled.


def _read_on_a_side_stream(got: torch.Tensor) -> float:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        total = got.double().sum()
    side.synchronize()
    return total.item()


@pytest.mark.gpu
def test_a_misaligned_cuda_buffer_is_copied_before_it_is_read(monkeypatch):
    from ucxrpc.serialization import tensors

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")
    t = torch.arange(1 << 22, dtype=torch.float32, device="cuda")  # 16 MiB
    want = float(t.double().sum().item())
    pickled = dumps(t)

    def loaded_behind_a_spin() -> float:
        wire = _wire(pickled, offset=1)  # misaligned: loads copies it
        # The copy's block would otherwise be the last run's copy, freed with
        # the right values still in it: an unwaited read would see them and
        # the control could not race (as on an H200, 2026-11-29).  Every free
        # block of the copy's size is made garbage first (0xFF: NaN).
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        poison = torch.full((wire[0].numel(),), 0xFF, dtype=torch.uint8, device="cuda")
        del poison
        torch.cuda.synchronize()         # the buffers as the transport hands them up
        torch.cuda._sleep(200_000_000)   # the current stream busy for ~100 ms
        got = loads(pickled.payload, wire)
        return _read_on_a_side_stream(got)

    assert loaded_behind_a_spin() == want  # also launches every kernel once
    # The control: the copy without its wait races the side stream's read.
    monkeypatch.setattr(tensors, "_settle_copy", lambda copy: None)
    raced = loaded_behind_a_spin()
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert raced != want, "the control did not race: this check cannot fail here"
    assert loaded_behind_a_spin() == want
