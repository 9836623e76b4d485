"""An RRef owner SIGKILLed while others use its RRefs.

The victim (worker2) owns RRefs that worker0 created with ``remote()`` and
shared with worker1.  Once it is killed, ``to_here()`` and proxy calls on
both users fail naming worker2; RRefs owned by worker1 keep working; the
users' bookkeeping (deletions still owed to the dead owner) does not hold
up their shutdown.
"""

from __future__ import annotations

import time

import pytest

from tests.faults import _common as c
from tests.workers import run_with_victim

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


class Counter:
    def __init__(self, start):
        self.value = start

    def add(self, n):
        self.value += n
        return self.value


_held: dict = {}


def hold(key, rref):
    """On worker1: keep a user RRef someone sent."""
    _held[key] = rref
    return rref.owner_name()


def use_held(killed):
    """On worker1: what using the held RRefs of the dead owner gives, timed
    from this first use (worker1 had no reason to talk to the owner before)
    and from the kill."""
    dead = _held["dead"]
    start = time.monotonic()
    out = {"to_here": c.failure(start, dead.to_here),
           "proxy": c.failure(start, lambda: dead.rpc_sync().add(1)),
           "alive": _held["alive"].to_here().value}
    out["since_kill"] = start - killed + out["to_here"]["elapsed"]
    return out


def use_alive():
    return _held["alive"].to_here().value


def drop_held():
    """On worker1: drop every held RRef (their deletions go to the owners)."""
    _held.clear()
    import gc

    gc.collect()


def _survivor(rank, world_size, init_method, full_world, stamp_path):
    import ucxrpc as rpc

    c.init(rank, full_world, init_method)
    out = {}
    if rank == 0:
        dead = rpc.remote(c.VICTIM, Counter, args=(1,))
        dead_value = rpc.remote(c.VICTIM, c.add, args=(20, 22))
        alive = rpc.remote(c.THIRD, Counter, args=(10,))
        assert dead.to_here().value == 1 and dead_value.to_here() == 42
        assert rpc.rpc_sync(c.THIRD, hold, args=("dead", dead)) == c.VICTIM
        assert rpc.rpc_sync(c.THIRD, hold, args=("alive", alive)) == c.THIRD
        out["forks_on_third"] = rpc.rpc_sync(c.THIRD, c.debug_info)["num_forks"]
        rpc.rpc_async(c.VICTIM, c.kill_self, args=(stamp_path,))
        while True:  # the victim is gone once the stamp is written
            try:
                killed = c.read_stamp(stamp_path)
                break
            except (OSError, ValueError):
                time.sleep(0.01)
        out["to_here"] = c.failure(killed, dead.to_here)
        out["proxy"] = c.failure(killed, lambda: dead.rpc_sync().add(1))
        out["value"] = c.failure(killed, dead_value.to_here)
        out["new_remote"] = c.failure(killed, lambda: rpc.remote(c.VICTIM, Counter,
                                                                 args=(0,)).to_here())
        # worker1 learns of the death only when it uses the RRef itself.
        out["third"] = rpc.rpc_sync(c.THIRD, use_held, args=(killed,))
        # RRefs owned by the unaffected worker keep working, here and there.
        assert alive.to_here().value == 10
        assert alive.rpc_sync().add(5) == 15
        assert rpc.rpc_sync(c.THIRD, use_alive) == 15
        # Dropped user RRefs owe deletions to their owners, the dead one too.
        del dead, dead_value, alive
        rpc.rpc_sync(c.THIRD, drop_held)
    return c.finish(rank, out)


def test_rref_owner_killed_while_shared(tmp_path):
    stamp = str(tmp_path / "killed-at")
    res = run_with_victim(c.victim_main, _survivor, c.WORLD, args=(c.WORLD, stamp), timeout=80)
    r0 = res[0]
    print("\n  SIGKILL of the owner of RRefs used by worker0 and worker1:")
    c.check_failure(r0["to_here"], c.VICTIM, "worker0 to_here()")
    c.check_failure(r0["proxy"], c.VICTIM, "worker0 rref.rpc_sync().add()")
    c.check_failure(r0["value"], c.VICTIM, "worker0 to_here() of a second RRef")
    c.check_failure(r0["new_remote"], c.VICTIM, "worker0 remote() to the dead owner")
    c.check_failure(r0["third"]["to_here"], c.VICTIM, "worker1 to_here()")
    c.check_failure(r0["third"]["proxy"], c.VICTIM, "worker1 rref.rpc_sync().add()")
    print(f"  worker1 to_here() failed {r0['third']['since_kill']:.2f} s after the kill")
    for rank, r in enumerate(res):
        c.check_shutdown(r["shutdown_s"], f"worker{rank}")
