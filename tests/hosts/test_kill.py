"""A worker on the other host SIGKILLed, mid-call and idle.

worker0 (with the store) runs on host 0; worker1 and worker2 on host 1.
The test SIGKILLs worker1 while worker0's call runs on it, then, once
worker0 checked that worker2 still serves it both ways, worker2 while idle.
Each of worker0's calls fails with a BrokenError naming the dead worker,
within the suite's bound (``tests/faults/_common.py``), timed from the
kill; later calls fail at once; worker0 then shuts down cleanly.  The kill
is the Popen's: it takes the victim's whole PID namespace down, as a host
losing a process would.
"""

from __future__ import annotations

import pytest

from tests.faults import _common as c
from tests.hosts._harness import STORE_PORT, Job, two_hosts, write

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def test_peer_on_the_other_host_killed_mid_call_and_idle(tmp_path):
    with two_hosts() as hosts:
        a, b = hosts.hosts
        init_method = f"tcp://{a.address}:{STORE_PORT}"
        job = Job(hosts, tmp_path)
        try:
            for rank, host in enumerate((a, b, b)):
                job.start_worker(f"worker{rank}", host, "kill", rank, init_method)
            job.wait_for("busy1")  # worker0's call runs on worker1
            write(tmp_path / "killed1", repr(job.kill("worker1")))
            job.wait_for("idle")
            write(tmp_path / "killed2", repr(job.kill("worker2")))
            out = job.json("worker0.json")
            assert job.wait_exit("worker0") == 0, job.logs()
        finally:
            job.stop()
    assert out["pipes"] and all(p["transports"] == ["tcp"] for p in out["pipes"]), out["pipes"]
    print("\n  worker0 on host 0, its peers on host 1 SIGKILLed:")
    for key, peer, what, bound in (
            ("pending", "worker1", "call pending on worker1 when it was killed", c.FAIL_BOUND_S),
            ("later1", "worker1", "later call to worker1", c.FAIL_BOUND_S),
            ("after_third1", "worker1", "call to worker1 after worker2's checks", c.FAIL_BOUND_S),
            ("idle", "worker2", "first call to worker2 after it was killed idle",
             c.FAIL_BOUND_S),
            ("later2", "worker2", "later call to worker2", c.FAIL_BOUND_S)):
        c.check_failure(out[key], peer, what, bound=bound)
        assert "BrokenError" in out[key]["classes"], out[key]
    assert out["third_ok"], "worker2 stopped serving worker0 after worker1 died"
    c.check_shutdown(out["shutdown_s"], "worker0 (both peers dead)")
