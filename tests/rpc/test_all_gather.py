"""torch's private names that libraries call, between real workers.

torch's sharding code, PyG's distributed package and programs guarding
their shutdown call ``rpc._is_current_rpc_agent_set()``,
``rpc._get_current_rpc_agent().get_worker_infos()``, ``rpc._set_rpc_timeout``
and ``rpc.api._all_gather`` / ``_wait_all_workers`` / ``_barrier`` (PyG's init_rpc gathers
every worker's role and rank with it).  Rank 0 drives each scenario; the
other workers join an all-gather through an ``rpc_async`` of
:func:`gather_here`, which runs it on their pool threads.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.workers import worker_group

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def _workers_up(rank, world_size, init_method):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    yield
    rpc.shutdown()


def _no_gathering_left():
    """After each scenario: no worker holds an all-gather that succeeded."""
    import ucxrpc as rpc

    for w in ("worker0", "worker1", "worker2"):
        assert rpc.rpc_sync(w, open_gatherings) == []


trio = worker_group(_workers_up, 3, check=_no_gathering_left)


def open_gatherings():
    from ucxrpc import api

    agent = api._current()
    states = api._gatherings(agent)
    return sorted(seq for seq, g in states.open.items() if not g.ended)


def gather_here(obj, worker_names=None, timeout=-1.0):
    """On a worker: its part of an all-gather; what it gave, or its error."""
    from ucxrpc import api

    try:
        return api._all_gather(obj, worker_names, timeout)
    except RuntimeError as exc:
        return exc


def _others(obj_of, worker_names=None, timeout=-1.0, who=("worker1", "worker2")):
    import ucxrpc as rpc

    return [rpc.rpc_async(w, gather_here, (obj_of(w), worker_names, timeout)) for w in who]


def _every_worker_gets_every_object():
    from ucxrpc import api

    for step in range(3):  # each call a sequence of its own
        futs = _others(lambda w: (w, step, torch.full((2,), float(step))))
        mine = api._all_gather(("worker0", step, torch.full((2,), float(step))))
        theirs = [f.wait() for f in futs]
        assert sorted(mine) == ["worker0", "worker1", "worker2"]
        for got in theirs:
            assert sorted(got) == sorted(mine)
            for name, (who, s, t) in got.items():
                assert (who, s) == (name, step) and torch.equal(t, mine[name][2])


def test_all_gather_gives_every_worker_every_object(trio):
    trio.run(_every_worker_gets_every_object)


def _a_subset_gathers_alone():
    from ucxrpc import api

    futs = _others(lambda w: w.upper(), worker_names=["worker1", "worker2"])
    assert [f.wait() for f in futs] == [{"worker1": "WORKER1", "worker2": "WORKER2"}] * 2
    with pytest.raises(ValueError, match=r"worker0, which is not one of its workers "
                                         r"\['worker1', 'worker2'\]"):
        api._all_gather(1, worker_names=["worker1", "worker2"])


def test_a_subset_of_workers_gathers_without_the_others(trio):
    trio.run(_a_subset_gathers_alone)


def _a_missing_worker_times_out():
    import ucxrpc as rpc
    from ucxrpc import api

    # worker2 does not come: the leader names it, worker1 names its leader
    (late,) = _others(lambda w: w, timeout=0.3, who=("worker1",))
    with pytest.raises(RuntimeError, match=r"timed out in _all_gather after 0\.30 seconds: "
                                           r"no object from worker2"):
        api._all_gather("worker0", timeout=0.3)
    err = late.wait()
    # (its object reached the leader in time, or, on a slow host, after it gave up)
    assert isinstance(err, RuntimeError) and ("waiting for the objects from its leader worker0"
                                              in str(err) or "came too late" in str(err)), err
    # worker2 comes too late: refused at once, not kept
    err = rpc.rpc_sync("worker2", gather_here, ("worker2", None, 5.0))
    assert isinstance(err, RuntimeError) and "came too late" in str(err)
    # and the next one works
    futs = _others(lambda w: w)
    assert api._all_gather("worker0") == {w: w for w in ("worker0", "worker1", "worker2")}
    assert [f.wait() for f in futs] == [{w: w for w in ("worker0", "worker1", "worker2")}] * 2


def test_an_all_gather_missing_a_worker_times_out_naming_it(trio):
    trio.run(_a_missing_worker_times_out)


def wait_all_here():
    from ucxrpc import api

    api._wait_all_workers()
    return True


def _wait_all_workers():
    import ucxrpc as rpc
    from ucxrpc import api

    futs = [rpc.rpc_async(w, wait_all_here) for w in ("worker1", "worker2")]
    time.sleep(0.2)
    assert not any(f.done() for f in futs)  # they wait for worker0
    api._wait_all_workers()
    assert [f.wait() for f in futs] == [True, True]


def test_wait_all_workers_returns_once_every_worker_called_it(trio):
    trio.run(_wait_all_workers)


def barrier_here(names):
    from ucxrpc import api

    api._barrier(names)
    return True


def _barrier_of_two():
    import ucxrpc as rpc

    first = rpc.rpc_async("worker1", barrier_here, (["worker1", "worker2"],))
    time.sleep(0.2)
    assert not first.done()  # waits for worker2, not for worker0
    assert rpc.rpc_sync("worker2", barrier_here, (["worker2", "worker1"],))
    assert first.wait()


def test_a_barrier_waits_for_the_workers_it_names(trio):
    trio.run(_barrier_of_two)


def nap(seconds):
    time.sleep(seconds)


def _the_agent_and_its_timeout():
    import ucxrpc as rpc

    assert rpc._is_current_rpc_agent_set()
    agent = rpc._get_current_rpc_agent()
    assert [(w.name, w.id) for w in agent.get_worker_infos()] == [
        ("worker0", 0), ("worker1", 1), ("worker2", 2)]
    assert agent.get_worker_info() == rpc.get_worker_info()
    assert agent.get_worker_info("worker2").id == agent.get_worker_info(2).id == 2
    with pytest.raises(RuntimeError, match="worker9"):
        agent.get_worker_info("worker9")
    info = agent.get_debug_info()
    assert info and all(isinstance(v, str) for v in info.values())
    before = rpc.get_rpc_timeout()
    rpc._set_rpc_timeout(0.2)
    try:
        assert rpc.get_rpc_timeout() == 0.2
        with pytest.raises(rpc.RpcTimeoutError):
            rpc.rpc_sync("worker1", nap, (1.0,))
        rpc.rpc_sync("worker1", nap, (1.0,), timeout=5)  # a call's own timeout still wins
    finally:
        rpc._set_rpc_timeout(before)
    assert rpc.get_rpc_timeout() == before
    with pytest.raises(ValueError, match="rpc_timeout"):
        rpc._set_rpc_timeout(-2)


def test_the_agent_answers_torchs_methods_and_takes_a_new_default_timeout(trio):
    trio.run(_the_agent_and_its_timeout)

