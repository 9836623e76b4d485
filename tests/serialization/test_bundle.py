"""Small host tensors bundled one buffer per dtype (ucxrpc/serialization/bundle.py),
through Serializer.dumps/loads in process; the transport is played by
``_wire``, which copies each buffer into fresh memory (at an odd address
when asked).  The same messages over real pipes: tests/rpc/test_bundle_rpc.py.
"""

from __future__ import annotations

import pickle
from unittest import mock

import pytest
import torch

from tests.serialization._helpers import ALL_DTYPES
from tests.serialization._helpers import copied as _wire
from tests.serialization._helpers import same as _same
from tests.serialization._helpers import sample as _sample
from ucxrpc.serialization import bundle as _bundle, tensors as _tensor_codec
from ucxrpc.serialization.tensors import (RUN_DICT, RUN_LIST, _bundled_run, _bundled_slot,
                                          _rebuild_bundled)
from ucxrpc.errors import SerializationError
from ucxrpc.serialization.pickler import GradCapture, Pickled, Serializer
from ucxrpc.transport.wire.gather import Gather

# The bundle itself: no tensor goes in the pickle stream (test_tensors.py),
# and a message's first small tensor bundles too (see test_first_alone).
SER = Serializer(inband_tensors=0, first_alone=False)


def _roundtrip(obj, misalign: int = 0):
    p = SER.dumps(obj)
    return SER.loads(p.payload, _wire(p, misalign)), p


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


def test_bytes_of_a_bundle_joined_at_dumps_are_taken_then():
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



def test_a_large_bundle_of_one_dtype_is_sent_from_its_tensors():
    msg = {f"t{i}": torch.full((1024,), float(i)) for i in range(100)}
    p = SER.dumps(msg)
    (g,) = p.buffers
    assert isinstance(g, Gather) and g.numel() == g.nbytes == 100 * 4096
    assert g.iov.tolist() == [x for t in msg.values() for x in (t.data_ptr(), 4096)]
    assert torch.equal(g.joined(), torch.cat(list(msg.values())).view(torch.uint8))
    assert [s.device for s in p.specs] == ["cpu"]
    # Joined by loads itself where dumps' output is read in process.
    back = SER.loads(p.payload, p.buffers)
    assert all(torch.equal(back[k], msg[k]) for k in msg)



def test_tensors_received_in_one_bundle_and_sent_on_in_order_go_as_its_range():
    # An echo: the received tensors are views of one buffer, back to back.
    msg = {f"t{i}": torch.full((1024,), float(i)) for i in range(100)}
    p = SER.dumps(msg)
    (received,) = _wire(p)
    back = SER.loads(p.payload, [received])
    for name, keys in (("all", list(back)), ("a run within", list(back)[10:60])):
        again = SER.dumps({k: back[k] for k in keys})
        (sent,) = again.buffers
        assert isinstance(sent, torch.Tensor) and sent.dtype is torch.uint8, name
        start = keys[0][1:]
        assert sent.data_ptr() == received.data_ptr() + int(start) * 4096, name
        assert sent.numel() == len(keys) * 4096, name
        out = SER.loads(again.payload, [sent.clone()])
        assert all(torch.equal(out[k], msg[k]) for k in keys), name


def test_tensors_out_of_their_order_are_gathered_from_where_they_are():
    msg = {f"t{i}": torch.full((1024,), float(i)) for i in range(100)}
    p = SER.dumps(msg)
    back = SER.loads(p.payload, _wire(p))
    flipped = {k: back[k] for k in reversed(list(back))}
    again = SER.dumps(flipped)
    (sent,) = again.buffers
    assert isinstance(sent, Gather)
    out = SER.loads(again.payload, [sent.joined()])
    assert all(torch.equal(out[k], msg[k]) for k in msg)


def test_back_to_back_memory_past_the_first_storage_is_not_one_range():
    from ucxrpc.serialization import bundle
    block = torch.zeros(2 * 65536)
    halves = list(block.split(65536))
    got = bundle._span(halves[0], [t.data_ptr() for t in halves], [262144, 262144], 524288)
    assert got is not None and got.numel() == 524288 and got.data_ptr() == block.data_ptr()
    # Memory right after a storage's end belongs to some other allocation:
    # a tensor over both is no range of the first.
    small = torch.zeros(4)
    assert bundle._span(small, [small.data_ptr(), small.data_ptr() + 16], [16, 16], 32) is None


def test_a_gathered_tensor_that_requires_grad_arrives_with_its_flag():
    msg = [torch.full((1024,), float(i)) for i in range(99)] + [torch.ones(1024, requires_grad=True)]
    p = SER.dumps(msg)  # not a run (one requires grad): each bundled alone
    (g,) = p.buffers
    assert isinstance(g, Gather) and not g.joined().requires_grad
    back = SER.loads(p.payload, p.buffers)
    assert [t.requires_grad for t in back] == [False] * 99 + [True]
    assert all(t.is_leaf and torch.equal(a, t.detach()) for a, t in zip(msg, back))

@pytest.mark.parametrize("case", ["small", "two-dtypes", "negated", "zero", "serial-bound"])
def test_a_bundle_is_joined_where_its_bytes_must_be_copied_anyway_or_are_not_its_values(case):
    msg = [torch.full((1024,), float(i)) for i in range(100)]
    base = torch.arange(4096.0)  # its views compact: they bundle
    if case == "small":
        msg = msg[:16]                                   # 64 KiB: inline in the frame
    elif case == "two-dtypes":
        msg = msg + [torch.ones(3, dtype=torch.int64)]
    elif case == "negated":
        msg = msg + [base[10:16]._neg_view()]
    elif case == "zero":
        msg = msg + [torch._efficientzerotensor(5)]
    else:
        # A member past torch's serial copy bound, all of one dtype.
        msg = [t.to(torch.uint8) for t in msg] + [torch.ones(40_000, dtype=torch.uint8)]
    back, p = _roundtrip(msg)
    assert not any(isinstance(b, Gather) for b in p.buffers)
    assert all(_same(a, b) for a, b in zip(back, msg))

def test_views_of_storages_of_one_size_bundle_only_where_each_would_be_compacted():
    bases = [torch.arange(4096.0) for _ in range(2)]  # 16 KiB each, kept alive
    small = [bases[i % 2][i * 64:(i + 1) * 64] for i in range(_RUN)]  # compact copies
    back, p = _roundtrip(small)
    assert _runs_in(p) == 1
    assert all(torch.equal(a, b) for a, b in zip(back, small))
    # One view over half its storage travels with the storage, so the run
    # cannot bundle: it travels as itself and its views arrive shared.
    mixed = [bases[0][:2100]] + [bases[1][i * 64:(i + 1) * 64] for i in range(_RUN)]
    back, p = _roundtrip(mixed)
    assert _runs_in(p) == 0
    assert all(torch.equal(a, b) for a, b in zip(back, mixed))
    assert back[0].untyped_storage().nbytes() == bases[0].untyped_storage().nbytes()


def test_off_each_tensor_is_its_own_buffer():
    msg = [torch.ones(2), torch.zeros(3, dtype=torch.int64)]
    p = Serializer(bundle=False).dumps(msg)
    assert len(p.buffers) == 2 and not p.payload.startswith(_bundle.MARK)
    assert all(torch.equal(a, b) for a, b in zip(SER.loads(p.payload, _wire(p)), msg))


# ------------------------------------------------------------- runs

_RUN = _bundle.RUN_MIN


def _runs_in(p: Pickled) -> int:
    """How many runs ``p`` carries: its _bundled_run calls, counted on load."""
    calls = []
    real = _tensor_codec._bundled_run

    def counted(*args):
        calls.append(args)
        return real(*args)

    with mock.patch.object(_tensor_codec, "_bundled_run", counted):
        SER.loads(p.payload, _wire(p))
    return len(calls)


def _noop():
    pass


@pytest.mark.parametrize("kind", [dict, list, tuple])
def test_a_container_of_small_tensors_travels_as_one_run(kind):
    # Every dtype, 0-D to 2-D, and RUN_MIN more of growing length.
    tensors = ([_sample(dtype) for dtype in ALL_DTYPES]
               + [torch.arange(float(i + 1)) for i in range(_RUN)])
    msg = ({f"k{i}": t for i, t in enumerate(tensors)} if kind is dict else kind(tensors))
    # In an rpc request's envelope, and alone (a reply).
    for obj in ((_noop, (msg,), {}), msg):
        back, p = _roundtrip(obj)
        assert _runs_in(p) == 1
        got = back[1][0] if isinstance(obj, tuple) and obj[0] is _noop else back
        assert type(got) is kind and len(got) == len(msg)
        pairs = zip(got.items(), msg.items()) if kind is dict else zip(got, msg)
        for a, b in pairs:
            if kind is dict:
                assert a[0] == b[0]
                a, b = a[1], b[1]
            assert _same(a, b)


def test_too_few_tensors_or_anything_else_in_the_container_is_no_run():
    few = [torch.ones(2) for _ in range(_RUN - 1)]
    mixed = [torch.ones(2) for _ in range(_RUN)] + ["text"]
    for msg in (few, mixed, {"a": mixed}):
        back, p = _roundtrip(msg)
        assert _runs_in(p) == 0 and p.payload.startswith(_bundle.MARK)
    assert back["a"][-1] == "text" and all(torch.equal(t, torch.ones(2)) for t in back["a"][:-1])


class _Holder:
    def __init__(self, ref):
        self.ref = ref


def test_identity_within_the_message_is_kept_with_runs():
    d = {f"k{i}": torch.full((4,), float(i)) for i in range(_RUN)}
    t = d["k0"]
    # The same run twice is one run, which arrives shared.
    back, p = _roundtrip((d, d))
    assert back[0] is back[1] and _runs_in(p) == 1
    # So does a container holding a run, met twice (untouched: not copied).
    inner = (1, "x")
    back, p = _roundtrip([inner, (inner, d)])
    assert back[0] is back[1][0] and _runs_in(p) == 1
    # A run's tensor also outside it, or twice in it: no run, arrives shared.
    for msg in ((d, t), [t] * _RUN, (d, [t, *d.values()])):
        back, p = _roundtrip(msg)
        assert _runs_in(p) == 0
    back, _ = _roundtrip((d, t))
    assert back[1] is back[0]["k0"]
    back, _ = _roundtrip([t] * _RUN)
    assert all(x is back[0] for x in back)
    # A container also reachable through an object's state: no run, shared.
    back, p = _roundtrip((d, _Holder(d)))
    assert _runs_in(p) == 0 and back[1].ref is back[0]


def test_a_run_whose_tensors_do_not_all_bundle_travels_as_itself():
    noted = torch.ones(2)
    noted.note = "kept"  # state: the scan leaves such a message alone
    live = torch.arange(40.0)
    cases = {
        "requires-grad": torch.ones(2, requires_grad=True),
        "large": torch.ones(20_000),                     # 80 KB: its own buffer
        "view": live[5:10],                # of a live base too small to compact
        "strided": torch.arange(40.0).view(8, 5).clone().t(),  # not contiguous
        "attribute": noted,
    }
    for name, odd in cases.items():
        msg = [torch.full((3,), float(i)) for i in range(_RUN)] + [odd]
        back, p = _roundtrip(msg)
        assert _runs_in(p) == 0, name
        for a, b in zip(back, msg):
            assert torch.equal(a, b) and a.requires_grad == b.requires_grad, name
            assert a.stride() == b.stride(), name
        if name == "attribute":
            assert back[-1].note == "kept"


def _dense(t):
    return t.to_dense() if t.is_sparse else t.view(torch.uint8) if t.element_size() == 1 else t


def test_a_run_with_a_tensor_of_another_kind_travels_as_itself():
    # The run's checks are one pass each over the run; a tensor failing any
    # of them leaves the container to pickle as itself.
    shared = torch.arange(3.0)
    odd_ones = {
        "empty": [torch.ones(0)],
        "no dtype code": [torch.ones(4).to(torch.float8_e4m3fn)],
        "sparse": [torch.eye(3).to_sparse()],
        "nested": [torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])],
        "meta": [torch.ones(2, device="meta")],
        "one storage, two tensors": [shared, shared.view(3)],
    }
    for name, odd in odd_ones.items():
        msg = [torch.full((3,), float(i)) for i in range(_RUN)] + odd
        back, p = _roundtrip(msg)
        assert _runs_in(p) == 0, name
        for a, b in zip(back, msg):
            assert (a.dtype, a.layout, a.device, a.is_nested) == (
                b.dtype, b.layout, b.device, b.is_nested), name
            if name not in ("meta", "nested"):
                assert torch.equal(_dense(a), _dense(b)), name
    back, _ = _roundtrip([torch.full((3,), float(i)) for i in range(_RUN)]
                         + odd_ones["one storage, two tensors"])
    assert back[-1].data_ptr() == back[-2].data_ptr()  # arrived sharing, as sent


def _own_storage(t):
    return t.untyped_storage().nbytes() == t.nbytes


def test_a_view_that_would_travel_on_with_its_whole_bundle_arrives_apart():
    # torch's receiver gives each tensor a storage of its own.  A view of a
    # bundle under torch's compaction size would go on with all of it,
    # shared with its neighbours: such tensors arrive as copies, and an echo
    # of them is a run again, arriving apart.
    small = [torch.full((4,), float(i)) for i in range(_RUN)]
    for misalign in (0, 1):
        back, p = _roundtrip(small, misalign)
        assert _runs_in(p) == 1 and all(map(_own_storage, back))
        again, p = _roundtrip(back)
        assert _runs_in(p) == 1 and all(map(_own_storage, again))
        assert all(torch.equal(a, b) for a, b in zip(again, small))
        assert len({t.data_ptr() for t in again}) == len(small)
    # In a large bundle every view but one over half of it travels as a
    # compact copy: they stay views, that one comes apart.
    large = [torch.full((1024,), float(i)) for i in range(_RUN)]
    big = torch.arange(12_000.0)  # 48 KB of a 113.5 KB bundle: under half
    mixed = [torch.arange(16_000.0), *small]  # 64 KB of 64.3 KB: over half
    back, p = _roundtrip(large)
    assert _runs_in(p) == 1 and not any(map(_own_storage, back))
    back, p = _roundtrip([big, *large])
    assert _runs_in(p) == 1 and not any(map(_own_storage, back))
    back, p = _roundtrip(mixed)
    assert _runs_in(p) == 1 and _own_storage(back[0]) and not any(map(_own_storage, back[1:]))
    assert all(torch.equal(a, b) for a, b in zip(back, mixed))


def test_a_run_past_the_bundle_cap_travels_as_itself():
    n = _bundle.MAX_TOTAL_BYTES // (64 << 10) + 3
    msg = [torch.full((16 << 10,), float(i)) for i in range(n)]
    p = SER.dumps(msg)
    assert _runs_in(p) == 0
    assert all(torch.equal(a, b) for a, b in zip(SER.loads(p.payload, _wire(p)), msg))


def test_runs_in_nested_containers_and_shared_empty_ones():
    empty: list = []
    d1 = {f"a{i}": torch.ones(i + 1) for i in range(_RUN)}
    d2 = [torch.zeros(2, 2) for _ in range(_RUN)]
    back, p = _roundtrip([d1, (d2, empty), empty])
    assert _runs_in(p) == 2
    assert back[1][1] is back[2] == []
    assert all(torch.equal(back[0][k], v) for k, v in d1.items())
    assert all(torch.equal(a, b) for a, b in zip(back[1][0], d2))


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
    (_bundled_payload(([_F32], b"\x00", [2.0], {})), [torch.zeros(8, dtype=torch.uint8)],
     "has 2.0 elements"),
    (_bundled_payload(([_F32], b"\x00", [2], {0: (3,)})), [torch.zeros(8, dtype=torch.uint8)],
     "cannot have shape"),
    (_bundled_payload(([_F32], b"\x00", [2], {1: (2,)})), [torch.zeros(8, dtype=torch.uint8)],
     "gives a shape to slot 1 of 1"),
    (_bundled_payload(([_F32], b"\x00", [2], {"0": (2,)})), [torch.zeros(8, dtype=torch.uint8)],
     "gives a shape to slot '0' of 1"),
    (_bundled_payload(([_F32], b"\x00", [2], {})), [torch.zeros(8)],
     "is not a 1-D host uint8 tensor"),
], ids=["short", "table-size", "garbage", "no-buffer", "dtype", "size", "group", "numel",
        "numel-type", "shape", "shape-slot", "shape-key", "buffer-kind"])
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


class _ForgedRun:
    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (_bundled_run, self.args)


@pytest.mark.parametrize("args, message", [
    ((0, 2, RUN_LIST), "run of 2 tensors from bundle slot 0 is not within the 1 slots"),
    ((-1, 1, RUN_LIST), "from bundle slot -1"),
    ((0, 0, RUN_LIST), "run of 0 tensors"),
    ((0, 1, 7), "of kind 7"),
    ((0, 1, RUN_DICT, ("a", "b")), "of kind 2 with tuple keys"),
    ((0, 1, RUN_DICT), "with NoneType keys"),
], ids=["past-end", "negative", "empty", "kind", "keys", "no-keys"])
def test_a_forged_run_is_refused_by_name(args, message):
    payload = _bundled_payload(([_F32], b"\x00", [2], {}),
                               pickle.dumps(_ForgedRun(*args), protocol=5))
    with pytest.raises(SerializationError, match=message):
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
    from ucxrpc.serialization.tensors import _rebuild_vector

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


# --- first_alone: a message's first small tensor goes as its own buffer ------

ALONE = Serializer(inband_tensors=0)  # first_alone is the default


def test_a_lone_small_tensor_travels_as_its_own_buffer_zero_copy():
    t = torch.arange(4096.0)  # 16 KiB: small enough to bundle
    p = ALONE.dumps((_sample_fn, (t,), {}))
    assert p.payload[:1] != _bundle.MARK  # no table: nothing bundled
    assert len(p.buffers) == 1 and p.buffers[0].data_ptr() == t.data_ptr()
    back = ALONE.loads(p.payload, _wire(p))
    assert torch.equal(back[1][0], t)


def test_after_the_first_small_tensor_the_rest_bundle():
    first, second, third = torch.arange(10.0), torch.ones(3, dtype=torch.int64), torch.zeros(2)
    p = ALONE.dumps([first, second, third])
    assert p.payload[:1] == _bundle.MARK
    # The first's own bytes first (regular buffers before bundles), then one
    # bundle per dtype in order of first use.
    assert [b.numel() for b in p.buffers] == [40, 24, 8]
    assert p.buffers[0].data_ptr() == first.data_ptr()
    back = ALONE.loads(p.payload, _wire(p, misalign=1))
    assert all(torch.equal(a, b) and a.dtype == b.dtype
               for a, b in zip(back, [first, second, third]))


def test_the_first_alone_keeps_flags_views_and_per_message_state():
    base = torch.arange(10_000.0)
    view = base[100:200]  # compacted by torch's rule: a copy of its 400 bytes
    leaf = torch.ones(3, requires_grad=True)
    for first in (view, leaf, torch.nn.Parameter(torch.full((2,), 2.0))):
        cap = GradCapture()
        p = ALONE.dumps([cap, first, torch.ones(2)])
        back = ALONE.loads(p.payload, _wire(p))
        assert torch.equal(back[1].detach(), first.detach())
        assert type(back[1]) is type(first) and back[1].requires_grad == first.requires_grad
        assert p.buffers[0].numel() == first.nbytes  # its own buffer, then the bundle
    # Each message starts afresh: the next message's first goes alone again.
    for _ in range(2):
        p = ALONE.dumps(torch.ones(5))
        assert len(p.buffers) == 1 and p.payload[:1] != _bundle.MARK


def test_runs_bundle_whatever_came_first():
    d = {f"t{i}": torch.full((4,), float(i)) for i in range(_bundle.RUN_MIN)}
    p = ALONE.dumps(d)
    assert [b.numel() for b in p.buffers] == [_bundle.RUN_MIN * 16]  # one bundle, none alone
    back = ALONE.loads(p.payload, _wire(p))
    assert all(torch.equal(back[k], v) for k, v in d.items())


def test_first_alone_off_bundles_a_lone_tensor():
    p = SER.dumps(torch.arange(10.0))
    assert p.payload[:1] == _bundle.MARK and [b.numel() for b in p.buffers] == [40]


def _sample_fn(x):
    return x
