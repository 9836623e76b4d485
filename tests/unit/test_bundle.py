"""Small host tensors bundled one buffer per dtype (ucxrpc/_bundle.py),
through Serializer.dumps/loads in process; the transport is played by
``_wire``, which copies each buffer into fresh memory (at an odd address
when asked).  The same messages over real pipes: tests/rpc/test_bundle_rpc.py.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from ucxrpc import _bundle
from ucxrpc._tensor_codec import _bundled_slot, _rebuild_bundled
from ucxrpc.errors import SerializationError
from ucxrpc.serialization import GradCapture, Pickled, Serializer

ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
] + [d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64"))
     if isinstance(d, torch.dtype)]

SER = Serializer()


def _wire(pickled: Pickled, misalign: int = 0) -> list[torch.Tensor]:
    out = []
    for buf in pickled.buffers:
        big = torch.empty(buf.numel() + misalign, dtype=torch.uint8)
        fresh = big[misalign:]
        fresh.copy_(buf)
        out.append(fresh)
    return out


def _roundtrip(obj, misalign: int = 0):
    p = SER.dumps(obj)
    return SER.loads(p.payload, _wire(p, misalign)), p


def _sample(dtype: torch.dtype, shape=(5, 3)) -> torch.Tensor:
    """A tensor of its own storage (a reshape of a temporary would be a view
    sharing its base's storage, which keeps the per-storage path)."""
    if dtype is torch.bool:
        t = torch.arange(15) % 3 == 0
    elif dtype.is_complex:
        t = torch.complex(torch.arange(15.0), -torch.arange(15.0)).to(dtype)
    else:
        t = torch.arange(15, dtype=torch.int64).to(dtype)
    return t.reshape(shape).clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                   getattr(torch, "uint64", None)):
        a, b = a.to(torch.int64), b.to(torch.int64)
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


@pytest.mark.parametrize("misalign", [0, 1], ids=["aligned", "odd-address"])
def test_every_dtype_and_shape_travels_in_one_buffer_per_dtype(misalign):
    msg = {}
    for dtype in ALL_DTYPES:
        name = str(dtype).removeprefix("torch.")
        msg[name] = _sample(dtype)                               # 2-D
        msg[name + "-vec"] = _sample(dtype).reshape(-1).clone()  # 1-D
        msg[name + "-scalar"] = _sample(dtype).reshape(-1)[4].clone()  # 0-D
    back, p = _roundtrip(msg, misalign)
    assert len(p.buffers) == len(ALL_DTYPES), [b.numel() for b in p.buffers]
    for k, v in msg.items():
        assert _same(back[k], v), k
        assert back[k].is_leaf and not back[k].requires_grad and back[k]._base is None, k
    # Each received tensor has its own bytes within the bundle.
    back["float32"].fill_(-1)
    assert _same(back["float32-vec"], msg["float32-vec"])


def test_views_zero_size_and_large_tensors_mixed():
    big = torch.arange(100_000.0)               # 400 KB: its own buffer, zero-copy
    base = torch.arange(10_000.0)               # 40 KB storage
    msg = {
        "big": big,
        "slice": base[100:200],                 # compacted by torch's rule: bundled
        "empty": torch.empty(0),                # no bytes at all
        "empty2d": torch.empty(0, 4, dtype=torch.int64),
        "small": torch.ones(3),
        "transposed": torch.arange(6.0).view(2, 3).t(),  # not contiguous: its own buffer
        "text": "not a tensor",
    }
    back, p = _roundtrip(msg)
    assert p.buffers[0].numel() == big.nbytes  # regular buffers first, bundles last
    bundle_bytes = p.buffers[-1].numel()
    assert bundle_bytes == (100 + 3) * 4, [b.numel() for b in p.buffers]
    for k, v in msg.items():
        if isinstance(v, torch.Tensor):
            assert _same(back[k], v), k
        else:
            assert back[k] == v
    assert back["transposed"].stride() == msg["transposed"].stride()


def test_lazy_negation_conjugation_and_zero_tensors_arrive_as_their_values():
    # A bundle's cat writes what each tensor reads as, so a compacted view
    # with a lazy bit, or a zero tensor, is bundled like any other; a whole
    # view of a live base keeps the per-storage path, which resolves them.
    base = torch.arange(4096.0)                       # 16 KiB: small views compact
    cplx = torch.complex(torch.arange(4096.0), torch.ones(4096))
    msg = {
        "neg-slice": base[10:16]._neg_view(),         # bundled
        "conj-slice": cplx[5:9].conj(),               # bundled
        "zero": torch._efficientzerotensor(5),        # bundled: no memory, all zeros
        "neg-whole": torch.arange(3.0).clone()._neg_view(),   # per-storage path
        "conj-whole": cplx[:3].clone().conj(),                # per-storage path
    }
    expected = {"neg-slice": -base[10:16], "conj-slice": cplx[5:9].conj_physical(),
                "zero": torch.zeros(5), "neg-whole": -torch.arange(3.0),
                "conj-whole": cplx[:3].conj_physical()}
    assert all(msg[k].is_neg() for k in ("neg-slice", "neg-whole"))
    assert all(msg[k].is_conj() for k in ("conj-slice", "conj-whole"))
    assert msg["zero"]._is_zerotensor()
    back, p = _roundtrip(msg)
    bundles = p.buffers[-2:]  # float32 and complex64, after the two per-storage buffers
    assert len(p.buffers) == 4
    assert [b.numel() for b in bundles] == [(6 + 5) * 4, 4 * 8]
    for k, want in expected.items():
        got = back[k]
        assert not (got.is_neg() or got.is_conj() or got._is_zerotensor()), k
        assert _same(got, want), (k, got, want)


def test_a_storage_shared_within_a_message_still_arrives_shared():
    a = torch.arange(10.0)                      # small: not compacted
    back, _ = _roundtrip([a, a[2:], a.view(2, 5)])
    back[0][3] = 100.0
    assert back[1][1] == 100.0 and back[2][0, 3] == 100.0


def test_a_view_of_a_live_base_keeps_the_per_storage_path():
    base = torch.arange(12.0)
    back, p = _roundtrip({"view": base.view(3, 4)})  # its base shares the storage
    assert not p.payload.startswith(_bundle.MARK) and len(p.buffers) == 1
    assert torch.equal(back["view"], base.view(3, 4))


def test_the_same_tensor_twice_arrives_as_one():
    t = torch.ones(4)
    back, p = _roundtrip([t, t])
    assert back[0] is back[1]


def test_bytes_are_taken_at_dumps():
    t = torch.zeros(4)
    p = SER.dumps({"t": t})
    t.fill_(7)
    assert torch.equal(SER.loads(p.payload, _wire(p))["t"], torch.zeros(4))


def test_autograd_flags_parameters_and_capture_order():
    leaf = torch.ones(3, requires_grad=True)
    param = torch.nn.Parameter(torch.full((2,), 2.0))
    plain = torch.zeros(2)
    big = torch.ones(20_000, requires_grad=True)   # not bundled, but captured in order
    cap = GradCapture()
    p = SER.dumps([cap, leaf, plain, big, param])
    assert cap.tensors == [leaf, big, param]
    back = SER.loads(p.payload, _wire(p))
    rcap, rleaf, rplain, rbig, rparam = back
    assert rleaf.requires_grad and rleaf.is_leaf and not rplain.requires_grad
    assert type(rparam) is torch.nn.Parameter and rparam.requires_grad
    assert [t.shape for t in rcap.tensors] == [(3,), (20_000,), (2,)]
    assert rcap.tensors[0] is rleaf and rcap.tensors[2] is rparam


def test_a_bundle_is_capped_and_the_rest_go_as_their_own_buffers():
    n = _bundle.MAX_TOTAL_BYTES // (64 << 10) + 3
    msg = [torch.full((16 << 10,), float(i)) for i in range(n)]  # 64 KiB each
    back, p = _roundtrip(msg)
    assert len(p.buffers) == 4  # three over the cap, then the bundle
    assert p.buffers[-1].numel() == _bundle.MAX_TOTAL_BYTES
    assert all(torch.equal(a, b) for a, b in zip(back, msg))


def test_an_echo_bundles_again():
    msg = {f"t{i}": torch.full((1024,), float(i)) for i in range(100)}
    back, p = _roundtrip(msg)
    assert len(p.buffers) == 1
    again = SER.dumps(back)  # slices of one received bundle, as an echo sends
    assert len(again.buffers) == 1 and again.buffers[0].numel() == 100 * 4096
    out = SER.loads(again.payload, _wire(again))
    assert all(torch.equal(out[k], msg[k]) for k in msg)


def test_off_each_tensor_is_its_own_buffer():
    msg = [torch.ones(2), torch.zeros(3, dtype=torch.int64)]
    p = Serializer(bundle=False).dumps(msg)
    assert len(p.buffers) == 2 and not p.payload.startswith(_bundle.MARK)
    assert all(torch.equal(a, b) for a, b in zip(SER.loads(p.payload, _wire(p)), msg))


# ------------------------------------------------------------- bad input

def _bundled_payload(table, stream=b"", ) -> bytes:
    raw = pickle.dumps(table, protocol=5)
    return _bundle.MARK + len(raw).to_bytes(4, "little") + raw + stream


_F32 = 0  # float32 is first in the wire table of dtype codes


@pytest.mark.parametrize("payload, buffers, message", [
    (b"B\x01", [], "too short"),
    (b"B" + (1 << 30).to_bytes(4, "little"), [], "does not fit"),
    (b"B" + (3).to_bytes(4, "little") + b"xyz", [], "corrupt bundle table"),
    (_bundled_payload(([_F32], b"\x00", [2], {})), [], "names 1 groups but the message has 0"),
    (_bundled_payload(([999], b"\x00", [2], {})), [torch.zeros(8, dtype=torch.uint8)],
     "unknown tensor dtype code 999"),
    (_bundled_payload(([_F32], b"\x00", [3], {})), [torch.zeros(8, dtype=torch.uint8)],
     "holds 8 bytes, its table 12"),
    (_bundled_payload(([_F32], b"\x01", [2], {})), [torch.zeros(8, dtype=torch.uint8)],
     "names group 1 of 1"),
    (_bundled_payload(([_F32], b"\x00", [-2], {})), [torch.zeros(8, dtype=torch.uint8)],
     "has -2 elements"),
    (_bundled_payload(([_F32], b"\x00", [2], {0: (3,)})), [torch.zeros(8, dtype=torch.uint8)],
     "cannot have shape"),
    (_bundled_payload(([_F32], b"\x00", [2], {1: (2,)})), [torch.zeros(8, dtype=torch.uint8)],
     "gives a shape to slot 1 of 1"),
    (_bundled_payload(([_F32], b"\x00", [2], {"0": (2,)})), [torch.zeros(8, dtype=torch.uint8)],
     "gives a shape to slot '0' of 1"),
    (_bundled_payload(([_F32], b"\x00", [2], {})), [torch.zeros(8)],
     "is not a 1-D host uint8 tensor"),
], ids=["short", "table-size", "garbage", "no-buffer", "dtype", "size", "group", "numel",
        "shape", "shape-slot", "shape-key", "buffer-kind"])
def test_a_forged_table_is_refused_by_name(payload, buffers, message):
    with pytest.raises(SerializationError, match=message):
        SER.loads(payload, buffers)


class _ForgedSlot:
    def __init__(self, rebuild, slot):
        self.rebuild, self.slot = rebuild, slot

    def __reduce__(self):
        return (self.rebuild, (self.slot,))


@pytest.mark.parametrize("rebuild", [_bundled_slot, _rebuild_bundled])
@pytest.mark.parametrize("slot", [1, -1, "0"])
def test_a_stream_naming_a_slot_the_table_lacks_is_refused(rebuild, slot):
    # _bundled_slot is resolved to a look-up in the message's slot table,
    # _rebuild_bundled (a slot with flags) checks the slot itself.
    stream = pickle.dumps(_ForgedSlot(rebuild, slot), protocol=5)
    payload = _bundled_payload(([_F32], b"\x00", [2], {}), stream)
    with pytest.raises(SerializationError, match="bundle slot"):
        SER.loads(payload, [torch.zeros(8, dtype=torch.uint8)])


def test_a_bundled_tensor_is_refused_outside_serializer_loads():
    # Any other unpickler reaches _bundled_slot itself, which names the
    # only reader that has the message's bundles.
    p = SER.dumps({"t": torch.ones(3)})
    stream = bytes(_bundle.unpack(p.payload, p.buffers)[0])
    with pytest.raises(SerializationError, match="only be unpickled by Serializer.loads"):
        pickle.loads(stream)


def test_a_bundle_buffer_is_not_a_regular_one():
    # A stream that claims the bundle buffer as its own vector is refused.
    from ucxrpc._tensor_codec import _rebuild_vector

    class Vec:
        def __reduce__(self):
            return (_rebuild_vector, (0, _F32, 2))

    payload = _bundled_payload(([_F32], b"\x00", [2], {}), pickle.dumps(Vec(), protocol=5))
    with pytest.raises(SerializationError, match="besides its bundles"):
        SER.loads(payload, [torch.zeros(8, dtype=torch.uint8)])


def test_groups_past_torchs_serial_copy_bound_are_gathered_right():
    # Runs of small tensors and tensors alone past 32768 elements, one dtype.
    sizes = [100, 40_000, 7, 30_000, 5_000, 65_536, 1, 20_000, 20_000]
    msg = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    back, p = _roundtrip(msg)
    assert len(p.buffers) == 1 and p.buffers[0].numel() == sum(sizes)
    assert all(torch.equal(a, b) for a, b in zip(back, msg))
