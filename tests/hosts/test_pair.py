"""One worker on each simulated host, kept up for the module: RPC, RRefs,
distributed autograd and RemoteModule across the link, over UCX's tcp.

The two workers start once (importing torch costs each about 2 s of CPU);
worker0 runs every scenario of :data:`tests.hosts._worker.SCENARIOS` in
turn and writes each one's result, so each test here checks its own
scenario and one failing does not hide the others.
"""

from __future__ import annotations

import pytest

from tests.faults import _common as c
from tests.hosts._harness import STORE_PORT, Job, two_hosts

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

#: Sizes worker0 and worker1 sent each other (tests.hosts._worker.SIZES).
MAX_BYTES = 64 << 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """worker0 on host 0 (with the store), worker1 on host 1, running the scenarios."""
    ctl = tmp_path_factory.mktemp("pair")
    with two_hosts() as hosts:
        job = Job(hosts, ctl)
        init_method = f"tcp://{hosts.hosts[0].address}:{STORE_PORT}"
        try:
            for rank, host in enumerate(hosts.hosts):
                job.start_worker(f"worker{rank}", host, "pair", rank, init_method)
            yield job
        finally:
            job.stop()


def test_rpc_both_ways_with_tensors_and_errors_over_tcp(pair):
    out = pair.json("scenario-rpc.json")
    who0, who1 = out["who0"], out["who1"]
    # Two hosts: their own names, network and IPC namespaces.
    assert who0["hostname"] != who1["hostname"]
    assert who0["netns"] != who1["netns"] and who0["ipc"] != who1["ipc"]
    for side, who in (("pipes0", who0), ("pipes1", who1)):
        (pipe,) = out[side]
        assert pipe["transports"] == ["tcp"], pipe
        assert pipe["lanes"] and all(lane == {"transport": "tcp", "device": who["veth"]}
                                     for lane in pipe["lanes"]), pipe
        assert pipe["by_address"] == {"in": False, "out": False}, pipe
    for direction in ("from0", "from1"):
        calls = out[direction]
        assert (calls["rpc_sync"], calls["rpc_async"], calls["remote"]) == (5, 9, 13)
        assert max(calls["sizes"]) == MAX_BYTES  # each echoed and answered, content checked
        errors = calls["errors"]
        assert {k: v["type"] for k, v in errors.items()} == {
            "ValueError": "ValueError", "KeyError": "KeyError", "async TypeError": "TypeError"}
        assert "raised on worker" in errors["ValueError"]["message"], errors


def test_rrefs_across_hosts_and_counts_back_to_zero(pair):
    out = pair.json("scenario-rref.json")
    assert out["owner"] == "worker1"
    assert (out["proxy_sync"], out["proxy_async"], out["proxy_remote"], out["to_here"]) == \
        (11, 13, 16, 16)
    assert out["ours_used_there"] == {"owner": "worker0", "added": 105, "value": 105}
    assert out["ours_after"] == 105
    assert out["theirs_on_owner"] == {"owner": "worker1", "added": 17, "value": 17}
    assert out["made_for_us"] == {"owner": "worker0", "is_owner": True, "value": 42}
    empty = {"num_owner_rrefs": 0, "num_forks": 0, "num_pending_users": 0}
    assert out["after"] == {"worker0": empty, "worker1": empty}, out


def test_distributed_autograd_and_optimizer_match_local_training(pair):
    out = pair.json("scenario-autograd.json")
    assert out["losses"] == pytest.approx(out["want_losses"], rel=1e-9)
    assert out["grad_diff"] < 1e-12, out
    assert out["param_diff"] < 1e-12, out
    assert out["no_local_grad"] and out["n_params"] == 6
    assert out["losses"][-1] < out["losses"][0]


def test_remote_module_forward_backward_step(pair):
    out = pair.json("scenario-remote_module.json")
    assert out["on"] == "worker1"
    assert out["forward_diff"] < 1e-12 and out["forward_async_diff"] < 1e-12, out
    assert out["losses"] == pytest.approx(out["want_losses"], rel=1e-9)
    assert out["param_diff"] < 1e-12, out


def test_both_shut_down_cleanly(pair):
    for rank in (0, 1):
        out = pair.json(f"worker{rank}.json")
        c.check_shutdown(out["shutdown_s"], f"worker{rank}")
        assert pair.wait_exit(f"worker{rank}", c.SHUTDOWN_BOUND_S) == 0, pair.logs()
