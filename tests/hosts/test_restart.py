"""A peer that restarts is a new incarnation (dynamic group, two hosts).

worker1 is SIGKILLed in the middle of a 64 MiB call from worker0; its call
fails naming it; then a new process joins under the same name and rank, on
the same host (its kernel having said the old one is gone), and worker0's
calls reach it: the new process, every value right, nothing of the old
incarnation delivered to it (tests/hosts/_restart.py).
"""

from __future__ import annotations

import pytest

from tests.faults import _common as c
from tests.hosts._harness import STORE_PORT, Job, two_hosts

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def test_a_restarted_peer_takes_its_place_and_gets_nothing_of_the_old_one(tmp_path):
    with two_hosts() as hosts:
        job = Job(hosts, tmp_path)
        host0, host1 = hosts.hosts
        init = f"tcp://{host0.address}:{STORE_PORT}"
        try:
            job.start_worker_module("tests.hosts._restart", "first", host0, "first", init)
            job.wait_for("joined-first")
            job.start_worker_module("tests.hosts._restart", "peer", host1, "peer", init)
            job.wait_for("inflight")
            killed = job.kill("peer")
            job.wait_for("failed")
            job.start_worker_module("tests.hosts._restart", "again", host1, "again", init)
            again = job.json("again.json")
            first = job.json("first.json")
            for name in ("first", "again"):
                assert job.wait_exit(name) == 0, job.logs()
        finally:
            job.stop()
    # The worker timed its failure from 0: the monotonic clock, one for the
    # whole machine, so the time from the kill is the difference.
    c.check_failure({**first["cut"], "elapsed": first["cut"]["elapsed"] - killed}, "worker1",
                    "worker0's 64 MiB call to the killed worker1")
    assert first["cut"]["type"] == "BrokenError", first["cut"]
    assert first["first_incarnation"] != first["again_incarnation"] == again["incarnation"]
    assert first["calls"] == [True] * 5, first["calls"]
    (pipe,) = first["pipes"]
    assert pipe["peer"] == "worker1" and pipe["state"] == "open" and pipe["transports"] == ["tcp"]
    print(f"  the new worker1 ({first['again_incarnation']}) got every call right; its counters: "
          f"{again['debug']}")
    assert again["debug"]["frame_errors"] == 0 and again["debug"]["watched_requests"] == 0
    c.check_shutdown(again["shutdown_s"], "the new worker1")
    c.check_shutdown(first["shutdown_s"], "worker0")
