"""rendezvous.barrier against a c10d HashStore, ranks as threads."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from ucxrpc.agent import rendezvous
from ucxrpc.errors import RpcTimeoutError


class CountingStore:
    """A HashStore that counts the ``check`` calls made on it."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.checks = 0

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        return self.store.check(keys)


def test_a_long_wait_polls_the_store_less_and_less():
    store = CountingStore()
    late = threading.Timer(1.0, rendezvous.arrive, (store, "k", 1))
    late.start()
    try:
        rendezvous.barrier(store, "k", 0, 2, timeout=30)
    finally:
        late.cancel()
    # Every 10 ms, as before, would be ~100 rounds of two checks in the
    # second; polling at a tenth of the time waited is ~35 (fewer on a slow
    # machine, never more).
    assert store.checks < 120


def test_a_rank_found_gone_is_not_waited_for():
    store = CountingStore()
    gone: set[int] = set()
    threading.Timer(0.3, gone.add, (1,)).start()
    rendezvous.barrier(store, "k", 0, 2, timeout=30, gone=lambda: set(gone))
    assert not store.store.check(["ucxrpc/k/1"])


def test_a_missing_rank_times_the_barrier_out_naming_it():
    with pytest.raises(RpcTimeoutError, match=r"waiting for ranks \[1, 2\]"):
        rendezvous.barrier(CountingStore(), "k", 0, 3, timeout=0.3)


def test_ranks_arriving_together_all_pass():
    store = CountingStore()
    threads = [threading.Thread(target=rendezvous.barrier, args=(store, "k", r, 3, 30))
               for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert all(store.store.check([f"ucxrpc/k/{r}"]) for r in range(3))
