"""Dynamic membership (``init_rpc(world_size=None)``): workers join and leave
a running group, one at a time, as in torch; a leaving worker's RRef forks
and autograd contexts are dropped on the others; a worker can come back."""

from __future__ import annotations

import pytest
import torch

from tests.workers import free_port, run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]


def _coord(port, rank):
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))


def _join(rank, port, name=None):
    import ucxrpc as rpc

    opts = rpc.UcxRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20)
    rpc.init_rpc(name or f"worker{rank}", rank=rank, world_size=None, rpc_backend_options=opts)


def whoami():
    import ucxrpc as rpc

    return rpc.get_worker_info().name


def known(name):
    import ucxrpc as rpc

    try:
        return rpc.get_worker_info(name).id
    except RuntimeError as exc:
        return str(exc)


def counts():
    import ucxrpc as rpc

    info = rpc._get_debug_info()
    return {k: info.get(k, 0) for k in ("num_forks", "num_autograd_contexts")}


def double(x):
    return x * 2


def _group(rank, world_size, _init_method, rpc_port, coord_port):
    import ucxrpc as rpc
    from ucxrpc import autograd

    coord = _coord(coord_port, rank)
    out = {}
    if rank == 0:
        _join(0, rpc_port)
        coord.set("w0-up", "1")
        coord.wait(["w2-up"])
        # both newcomers were announced to the workers already present
        out["knows"] = [known("worker1"), known("worker2")]
        out["w2"] = rpc.rpc_sync("worker2", whoami)
        coord.wait(["w1-left"])
        out["after_leave"] = (known("worker1"), counts())
        with pytest.raises(RuntimeError, match="worker1"):
            rpc.rpc_sync("worker1", whoami)
        coord.set("checked", "1")
        coord.wait(["w1-back"])
        out["back"] = rpc.rpc_sync("worker1", whoami)
        coord.set("w0-saw-back", "1")
        coord.wait(["w1-done", "w2-done"])
        rpc.shutdown()  # the store's host leaves last
    elif rank == 1:
        coord.wait(["w0-up"])
        _join(1, rpc_port)
        coord.set("w1-up", "1")
        coord.wait(["w2-up"])
        out["peers"] = [rpc.rpc_sync("worker0", whoami), rpc.rpc_sync("worker2", whoami)]
        # leave while holding a fork of worker0's RRef and inside a context
        held = rpc.remote("worker0", torch.ones, args=(3,))
        held.to_here()
        ctx = autograd.context()
        ctx.__enter__()
        rpc.rpc_sync("worker0", double, (torch.ones(2, requires_grad=True),))
        out["before"] = rpc.rpc_sync("worker0", counts)
        rpc.shutdown()
        coord.set("w1-left", "1")
        coord.wait(["checked"])
        _join(1, rpc_port)  # the same name and rank, a new address
        out["rejoined"] = rpc.rpc_sync("worker0", double, (torch.ones(2),)).tolist()
        coord.set("w1-back", "1")
        coord.wait(["w0-saw-back", "w2-saw-back"])
        rpc.shutdown()
        coord.set("w1-done", "1")
        del held
    else:
        coord.wait(["w1-up"])
        _join(2, rpc_port)
        out["peers"] = [rpc.rpc_sync("worker0", whoami), rpc.rpc_sync("worker1", whoami)]
        coord.set("w2-up", "1")
        coord.wait(["w1-back"])
        out["w1_back"] = rpc.rpc_sync("worker1", whoami)
        coord.set("w2-saw-back", "1")
        rpc.shutdown()
        coord.set("w2-done", "1")
    return out


def test_workers_join_leave_and_rejoin():
    res = run_workers(_group, 3, args=(free_port(), free_port()), timeout=120)
    w0, w1, w2 = res
    assert w0["knows"] == [1, 2] and w0["w2"] == "worker2"
    assert w1["peers"] == ["worker0", "worker2"] and w2["peers"] == ["worker0", "worker1"]
    assert w1["before"]["num_forks"] >= 1 and w1["before"]["num_autograd_contexts"] == 1
    left_name, left_counts = w0["after_leave"]
    assert "worker1" in left_name  # unknown now: torch's message names it
    assert left_counts == {"num_forks": 0, "num_autograd_contexts": 0}, left_counts
    assert w1["rejoined"] == [2.0, 2.0] and w0["back"] == "worker1" and w2["w1_back"] == "worker1"


def _clash(rank, world_size, _init_method, rpc_port, coord_port):
    import ucxrpc as rpc

    coord = _coord(coord_port, rank)
    if rank < 2:
        if rank == 1:
            coord.wait(["w0"])
        _join(rank, rpc_port)
        coord.set(f"w{rank}", "1")
        coord.wait(["done"])
        if rank == 0:
            coord.wait(["w1-done"])
        rpc.shutdown()
        coord.set(f"w{rank}-done", "1")
        return None
    coord.wait(["w0", "w1"])
    errors = []
    for name, r in (("worker0", 2), ("other", 1), ("other", 0)):
        with pytest.raises(RuntimeError) as info:
            _join(r, rpc_port, name=name)
        errors.append(str(info.value))
        assert not rpc.is_initialized()
    coord.set("done", "1")
    return errors


def test_taken_names_and_ranks_are_refused():
    res = run_workers(_clash, 3, args=(free_port(), free_port()), timeout=90)
    name_err, rank_err, host_err = res[2]
    assert "worker name 'worker0' is already in the group, as rank 0" in name_err
    assert "rank 1 is already in the group, as 'worker1'" in rank_err
    assert "rank 0 hosts the group's store" in host_err and "in use" in host_err


def _mixed(rank, world_size, init_method, coord_port):
    import ucxrpc as rpc

    coord = _coord(coord_port, rank)
    opts = rpc.UcxRpcBackendOptions(init_method=init_method, rpc_timeout=20)
    if rank == 0:
        rpc.init_rpc("worker0", rank=0, world_size=None, rpc_backend_options=opts)
        coord.set("w0-up", "1")
        coord.wait(["w1-tried"])  # the dynamic group stays up while worker1 tries
        rpc.shutdown()
        return None
    coord.wait(["w0-up"])
    with pytest.raises(RuntimeError, match="static and dynamic membership do not mix"):
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=opts)
    coord.set("w1-tried", "1")
    return "refused"


def test_static_and_dynamic_workers_do_not_mix():
    assert run_workers(_mixed, 2, args=(free_port(),), timeout=60)[1] == "refused"
