"""How the sender plans device buffers (staged, packed) and how the receiver
lands staged chunks: the decisions, on host tensors standing in for device
ones (``host_as_device``), as the debug switch does."""

from __future__ import annotations

import torch

from ucxrpc.transport.cuda import staging
from ucxrpc.transport.wire.frame import PACK, PACKED, STAGED, BufferDesc


def _bytes(*sizes):
    return [torch.arange(n, dtype=torch.int64).to(torch.uint8) for n in sizes]


def test_host_only_messages_keep_the_plain_path():
    assert staging.plan(_bytes(10, 1 << 20), None, staged=True, host_as_device=False) is None


def test_a_pack_needs_enough_small_buffers():
    few = _bytes(*([100] * (staging.PACK_MIN_COUNT - 1)))
    out = staging.plan(few, None, staged=False, host_as_device=True)
    assert out is not None and out.packed == 0 and len(out.buffers) == len(few)
    big = staging.PACK_MAX_BYTES + 1
    bufs = _bytes(*([100] * staging.PACK_MIN_COUNT), big)
    out = staging.plan(bufs, None, staged=False, host_as_device=True)
    assert out.packed == staging.PACK_MIN_COUNT and len(out.buffers) == len(bufs) + 1
    pack = len(bufs)
    assert out.ways[pack] == (PACK, 0, 0) and out.ways[-2] == (0, 0, 0)  # too big to pack
    offsets = [w[2] for w in out.ways[:staging.PACK_MIN_COUNT]]
    assert all(w[:2] == (PACKED, pack) for w in out.ways[:staging.PACK_MIN_COUNT])
    for i, off in enumerate(offsets):  # each member's bytes sit at its offset
        assert torch.equal(out.buffers[pack][off:off + 100], bufs[i])


def test_packs_group_by_destination_device():
    bufs = _bytes(*([64] * (2 * staging.PACK_MIN_COUNT)))
    targets = [-1, 0] * staging.PACK_MIN_COUNT
    out = staging.plan(bufs, targets, staged=True, host_as_device=True, chunk=1 << 20)
    assert len(out.buffers) == len(bufs) + 2
    assert [v[2] for v in out.views[len(bufs):]] == [-1, 0]
    assert out.ways[len(bufs)] == (PACK | STAGED, 1024, 0)
    assert {out.ways[i][1] for i in range(0, len(bufs), 2)} == {len(bufs)}
    assert {out.ways[i][1] for i in range(1, len(bufs), 2)} == {len(bufs) + 1}


def test_staged_parts_are_the_buffer_in_order():
    buf = torch.randint(0, 255, ((3 << 20) + 5,), dtype=torch.uint8)
    out = staging.plan([buf], None, staged=True, host_as_device=True, chunk=1 << 20)
    assert out.ways == [(STAGED, 1024, 0)] and out.staged_bytes == buf.numel()
    parts = list(out.parts(0))
    assert [p.numel() for p in parts] == [1 << 20] * 3 + [5]
    assert torch.equal(torch.cat(parts), buf)
    assert [p.numel() for p in staging.plan([torch.empty(0, dtype=torch.uint8)], None,
                                            staged=True, host_as_device=True).parts(0)] == [0]


def test_landings_copy_into_place():
    desc = BufferDesc((2 << 20) + 1, 0, -1, STAGED, 1024)
    target = torch.zeros(desc.nbytes, dtype=torch.uint8)
    in_place = staging.landings(target, desc, host_as_device=False)
    assert [(ld.into.numel(), ld.then) for ld in in_place] == [(1 << 20, None)] * 2 + [(1, None)]
    assert in_place[1].into.data_ptr() == target.data_ptr() + (1 << 20)
    copied = staging.landings(target, desc, host_as_device=True)
    for k, ld in enumerate(copied):
        ld.into.fill_(k + 1)
        ld.then()
    assert target[0] == 1 and target[(1 << 20)] == 2 and target[-1] == 3


def test_finish_cuts_members_out_of_their_pack():
    bufs = _bytes(*([33] * staging.PACK_MIN_COUNT))
    out = staging.plan(bufs, None, staged=False, host_as_device=True)
    n = len(bufs)
    descs = [BufferDesc(b.numel(), w[2], -1, w[0], w[1]) for b, w in zip(out.buffers, out.ways)]
    received = [None] * n + [out.buffers[n].clone()]
    made: list[tuple[int, int]] = []

    def alloc(nbytes: int, device: int) -> torch.Tensor:  # the transport's, as receives are
        made.append((nbytes, device))
        return torch.empty(nbytes, dtype=torch.uint8)

    got = staging.finish(received, descs, n, alloc)
    assert len(got) == n and all(torch.equal(a, b) for a, b in zip(got, bufs))
    assert len({t.data_ptr() for t in got}) == n  # tensors of their own, not views of the pack
    # Made by the allocator given (on a GPU: the receive stream), not on
    # whatever stream is current.
    assert made == [(b.numel(), -1) for b in bufs]


def test_finish_cuts_a_pack_apart_without_the_kernel_too(monkeypatch):
    """A receiver whose CuPy is missing or broken still takes a peer's pack:
    one copy per member instead of one launch (host tensors standing in)."""
    from ucxrpc import _kernels

    bufs = _bytes(*[17 + i for i in range(staging.PACK_MIN_COUNT)])
    out = staging.plan(bufs, None, staged=False, host_as_device=True)
    n = len(bufs)
    descs = [BufferDesc(b.numel(), w[2], -1, w[0], w[1]) for b, w in zip(out.buffers, out.ways)]
    monkeypatch.setattr(_kernels, "kernel_usable", lambda device: False)
    monkeypatch.setattr(_kernels, "multi_copy", None)  # not called: it would raise
    got = staging.finish([None] * n + [out.buffers[n].clone()], descs, n,
                         lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(got, bufs))


def test_receives_counts_the_messages_a_buffer_arrives_in():
    """What a rejected message's drain must consume: nothing for inline and
    packed buffers, every chunk of a staged one."""
    from ucxrpc.transport.wire.frame import NOT_INLINE

    assert staging.receives(BufferDesc(10, 64, -1)) == 0                   # inline
    assert staging.receives(BufferDesc(10, 0, -1, PACKED, 0)) == 0          # in a pack
    assert staging.receives(BufferDesc(10, NOT_INLINE, -1)) == 1            # separate
    assert staging.receives(BufferDesc(9 << 20 | 1, NOT_INLINE, 0, STAGED, 4096)) == 3
    assert staging.receives(BufferDesc(0, NOT_INLINE, 0, STAGED, 4096)) == 1
    assert staging.receives(BufferDesc(1 << 20, NOT_INLINE, 0, PACK, 0)) == 1
