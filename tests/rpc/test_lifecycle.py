"""Shutdown and re-initialisation, as torch's RPC does them.

* ``shutdown()`` (timeout 0, the default) waits for every live worker,
  however long the job runs: a passive worker that calls it right after
  ``init_rpc``, as most RPC programs' servers do, waits through a job longer
  than its ``rpc_timeout``.
* An explicit ``timeout`` is honoured: the worker leaves, and calls to it
  then fail at once, naming it.
* ``init_rpc`` again after ``shutdown()`` in the same processes, with the
  same names, ranks and store address, works, round after round, on a
  store rank 0 hosts and on one that outlives each job (a file).
"""

from __future__ import annotations

import time

import pytest

from tests.faults import _common as c
from tests.workers import free_port, run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

RPC_TIMEOUT = 1.0
JOB_S = 3.0  # 3 x RPC_TIMEOUT


def _work(seconds):
    """Calls to worker1 for ``seconds``; how many returned right."""
    import ucxrpc as rpc

    done, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        assert rpc.rpc_sync("worker1", c.add, args=(done, 1)) == done + 1
        done += 1
        time.sleep(0.01)
    return done


def _passive_server(rank, world_size, init_method):
    c.init(rank, world_size, init_method, rpc_timeout=RPC_TIMEOUT)
    out = {}
    if rank == 0:
        out["calls"] = _work(JOB_S)
    out["shutdown_s"] = c.timed_shutdown()
    return out


def test_shutdown_waits_for_a_job_longer_than_the_rpc_timeout():
    res = run_workers(_passive_server, 2, timeout=60)
    print(f"\n  worker0 made {res[0]['calls']} calls over {JOB_S} s (rpc_timeout={RPC_TIMEOUT} s); "
          f"worker1's shutdown() waited {res[1]['shutdown_s']:.2f} s")
    assert res[0]["calls"] > 10
    assert res[1]["shutdown_s"] >= JOB_S - 0.5  # it waited for worker0, as torch does


def _leaves_early(rank, world_size, init_method):
    import ucxrpc as rpc

    c.init(rank, world_size, init_method, rpc_timeout=30)
    out = {}
    if rank == 0:
        out["calls"] = _work(0.5)
        t0 = time.monotonic()
        deadline = t0 + 20
        while True:  # until worker1's shutdown(timeout=1) gave up waiting for us
            rec = c.failure(t0, rpc.rpc_sync, "worker1", c.add, args=(1, 1))
            if rec["type"] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out["after"] = rec
        # rpc_async to the peer known gone: a failed future, as torch's agent
        # gives, not an exception at the call
        fut = rpc.rpc_async("worker1", c.add, args=(1, 1))
        try:
            fut.wait()
            out["async"] = "answered"
        except Exception as exc:
            out["async"] = f"{type(exc).__name__}: {exc}"
        out["shutdown_s"] = c.timed_shutdown()  # worker1 is gone: not waited for
    else:
        t0 = time.monotonic()
        rpc.shutdown(timeout=1.0)
        out["shutdown_s"] = time.monotonic() - t0
    return out


def test_an_explicit_shutdown_timeout_is_honoured():
    res = run_workers(_leaves_early, 2, timeout=60)
    r0, r1 = res
    print(f"\n  worker1 shutdown(timeout=1): {r1['shutdown_s']:.2f} s; then worker0's call: "
          f"{r0['after']}")
    assert 1.0 <= r1["shutdown_s"] < 1.0 + 6.0 + 2.0, r1  # the barrier's bound, + its last step
    after = r0["after"]
    assert after["type"] == "BrokenError" and "worker1" in after["message"], after
    assert "it shut down" in after["message"], after
    assert r0["async"].startswith("BrokenError: worker worker1") and "it shut down" in r0["async"]
    c.check_shutdown(r0["shutdown_s"], "worker0")


ROUNDS = 3


def _rounds(rank, world_size, init_method):
    import torch

    import ucxrpc as rpc

    peer = f"worker{1 - rank}"
    out = []
    for n in range(ROUNDS):
        t0 = time.monotonic()
        c.init(rank, world_size, init_method, rpc_timeout=20)
        t = torch.full((1 << 16,), float(n))
        assert rpc.rpc_sync(peer, c.add, args=(t, rank)).eq(n + rank).all()
        assert rpc.get_worker_info(peer).id == 1 - rank
        rpc.shutdown()
        out.append(round(time.monotonic() - t0, 2))
    return out


@pytest.mark.parametrize("store", ["tcp", "file", "agent"])
def test_init_again_after_shutdown_in_the_same_processes(store, tmp_path):
    # A TCPStore that rank 0 hosts ends with each job, and so does a file
    # once every worker has closed it; torchrun's agent store (here this
    # process's) outlives every job, with whatever keys they left.
    init_method, env, agent_store = None, None, None
    if store == "file":
        init_method = f"file://{tmp_path}/store"
    elif store == "agent":
        import torch.distributed as dist

        port = free_port()
        agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        init_method = "env://"
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    res = run_workers(_rounds, 2, timeout=90, init_method=init_method, env=env)
    del agent_store
    print(f"\n  {ROUNDS} rounds of init_rpc, a call each way, shutdown, on a {store} store: "
          f"{res[0]} s (worker0)")
    assert all(len(r) == ROUNDS for r in res)
