"""The host buffer pool (ucxrpc/transport/hostmem/pool.py): buffers placed
where asked in their page, large ones advised onto huge pages, the
allocator's memory where no mapping can be made."""

from __future__ import annotations

import os

import pytest

from ucxrpc.transport.hostmem.pool import HUGE, PAGE, HostPool


def test_pool_buffers_start_where_asked_in_their_page():
    pool = HostPool()
    for phase in (0, 16, 64, 4000):
        t = pool.alloc(3 << 20, phase)
        assert t.data_ptr() % PAGE == phase and t.numel() == 3 << 20
        t[-1] = 1  # all of it is ours
    del t
    again = pool.alloc(3 << 20, 64)
    assert again.data_ptr() % PAGE == 64 and pool.stats()["hits"] >= 1


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (proc(5))."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="this kernel has no transparent huge pages")
def test_large_pool_buffers_are_advised_onto_huge_pages_from_a_huge_page_boundary():
    # A peer reads them by address a huge page at a time (pool.HUGE).
    pool = HostPool()
    plain, phased = pool.alloc(HUGE), pool.alloc(5 << 20, 100)
    assert plain.data_ptr() % HUGE == 0 and phased.data_ptr() % HUGE == 100
    assert "hg" in _vm_flags(plain.data_ptr()) and "hg" in _vm_flags(phased.data_ptr())
    plain[-1] = phased[-1] = 7  # all of it is ours
    assert plain[-1] == phased[-1] == 7


def test_a_pool_buffer_comes_from_the_allocator_where_no_mapping_can_be_made(monkeypatch):
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    t = HostPool().alloc(HUGE + 1, 100)
    assert t.numel() == HUGE + 1 and t.data_ptr() % PAGE == 100
    t[-1] = 7
    assert t[-1] == 7
