"""The host buffer pool (ucxrpc/transport/hostmem/pool.py, its lists the
native core's csrc/pool.c): buffers placed where asked in their page, large
ones advised onto huge pages, the allocator's memory where no mapping can
be made, a buffer back on its list once the last tensor over it dies (on
any thread), idle memory bounded."""

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


def test_a_buffer_goes_back_to_its_list_when_the_last_tensor_over_it_dies():
    pool = HostPool()
    t = pool.alloc(1 << 20, 128)
    view = t[10:20].view(-1)
    t[:] = 3
    del t
    assert pool.stats()["cached_bytes"] == 0  # the view still holds it
    assert view.tolist() == [3] * 10
    del view
    assert pool.stats() == {"cached_bytes": (1 << 20) + PAGE, "hits": 0, "misses": 1}
    again = pool.alloc((1 << 20) - 7, 128)  # the same class: taken off the list
    assert pool.stats() == {"cached_bytes": 0, "hits": 1, "misses": 1}
    assert again.numel() == (1 << 20) - 7 and again.data_ptr() % PAGE == 128


def test_a_buffer_dropped_on_another_thread_goes_back_and_idle_memory_is_bounded():
    import threading

    pool = HostPool(max_cached_bytes=3 << 20)
    held = [pool.alloc(2 << 20), pool.alloc(2 << 20)]
    dropper = threading.Thread(target=held.clear)
    dropper.start()
    dropper.join()
    # One kept (2 MiB), the other let go: two would be over 3 MiB idle.
    assert pool.stats()["cached_bytes"] == 2 << 20
    pool.clear()
    assert pool.stats()["cached_bytes"] == 0


def test_small_buffers_without_a_phase_come_from_the_allocator():
    pool = HostPool()
    assert pool.alloc(100).numel() == 100 and pool.alloc(0).numel() == 0
    assert pool.stats() == {"cached_bytes": 0, "hits": 0, "misses": 0}
    phased = pool.alloc(100, 5)  # a phase asked for: pooled at any size
    assert phased.data_ptr() % PAGE == 5 and pool.stats()["misses"] == 1
