"""Outages between two hosts: a blip costs nothing, a long partition fails
calls fast and heals by itself, and nothing is lost or delivered twice.

worker0 on host 0, worker1 on host 1 (:mod:`tests.hosts._outage`), each
calling the other every 50 ms with a 1 MiB tensor whose echo it checks.
Every packet arriving at host 0 is dropped (``iptables``, silently, as a
failed switch drops them), then the link is back:

* a **blip** shorter than ``peer_timeout`` (1 s of 2 s): no call fails;
* a **long partition** (several times ``peer_timeout``), found while a
  256 MiB call is in flight: the calls across it fail as unreachable,
  naming the peer, within the bound a partition is given; once both sides
  know, nothing is left posted for the transfer that was cut and the
  survivor idles (over 10 s its threads wake at most 8 times a second),
  and what the cut transfer's requests held is freed; once the link is
  back, both reach each other again within :data:`RECOVER_BOUND_S`, and
  every call made after that succeeds.  An RRef and a distributed autograd
  context made before the partition either go on or fail naming the
  outage; new ones work.

On a GPU (``gpu``) the same with a 1 GiB tensor on ``cuda:0`` of both
(device maps, ``tcp,cuda_copy``): the cut finds worker0 receiving into
device memory, and once both know, ``torch.cuda.memory_allocated()`` is
back where it was before the transfer on both; after the heal a device
tensor goes both ways again.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from tests.faults import _common as c
from tests.hosts._harness import STORE_PORT, Job, two_hosts, write
from tests.hosts._outage import PAYLOAD, PEER_TIMEOUT, tell

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

BLIP_S = 1.0
#: After the heal, both sides reach each other again within this: a new
#: round of lifeline connections goes out every 0.5 s, then one handshake.
RECOVER_BOUND_S = 3.0
#: The survivor while its peer is unreachable and nobody calls, over as
#: long as issue 50 asks.  What the design decides is how often its threads
#: wake: the progress thread's idle waits end every 0.5 s (UCX's timers),
#: and a LOST lifeline's round of connections goes out every 0.5 s; nothing
#: else is timed (the call timer, the RRef janitor and the worker's own
#: main thread wait until told).  That is 4 wake-ups a second, and a few
#: more where the two threads meet at the GIL: 5.0-5.3 measured, 6.0 once
#: in 16 runs; before 2026-11-30, 11-12, of which 6 for nothing.
QUIET_S = 10.0
QUIET_WAKES_PER_S = 8.0
#: What those wake-ups cost is the host's: on the project's 2-vCPU VM a
#: thread woken after 0.5 s asleep pays 0.3 ms of CPU for a C program that
#: does nothing, and a lifeline round that costs 0.09 ms run back to back
#: costs 2.5-6 ms (caches and TLB gone cold meanwhile): 0.6-1.8% of a core
#: for the same 50 wake-ups, by the hour (2026-11-30).  So the CPU bound is
#: there for a thread that spins (most of a core); one that polls wakes
#: often, which the bound above catches (a 10 ms poll: 100 a second).
QUIET_CPU = 0.05  # of one core
#: A failed call lasts at most this: found unreachable by keepalive.
FAIL_BOUND_S = PEER_TIMEOUT + 10.0


def _usage(pid: int) -> tuple[float, int]:
    """Of every thread of ``pid`` so far: CPU seconds, to the nanosecond
    (``/proc/PID/stat`` counts 10 ms ticks: 1% of 3 s is 3 of them), and
    how many times they went to sleep, so woke (voluntary context switches)."""
    ns = wakes = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ns += int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{task}/status") as f:
                wakes += next(int(line.split()[1]) for line in f
                              if line.startswith("voluntary_ctxt_switches:"))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return ns / 1e9, wakes


def _failed(calls: list[dict[str, Any]], lo: float, hi: float) -> list[dict[str, Any]]:
    return [r for r in calls if lo <= r["start"] <= hi and not r["ok"]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_blip_costs_nothing_and_a_long_partition_fails_fast_and_heals(tmp_path, device):
    with two_hosts() as hosts:
        job = Job(hosts, tmp_path)
        host0 = hosts.hosts[0]
        init = f"tcp://{host0.address}:{STORE_PORT}"
        try:
            for rank, host in enumerate(hosts.hosts):
                job.start_worker_module("tests.hosts._outage", f"worker{rank}", host, rank, init,
                                        device)
            job.wait_for("ready0")
            job.wait_for("ready1")
            time.sleep(1.0)
            blip = time.monotonic()
            hosts.drop(host0, True)
            time.sleep(BLIP_S)
            hosts.drop(host0, False)
            blip_end = time.monotonic()
            time.sleep(1.3)  # the blip's window below reaches 1 s past its end
            write(tmp_path / "big", "1")
            job.wait_for("big-started")
            time.sleep(0.05)
            cut = time.monotonic()
            hosts.drop(host0, True)
            job.wait_for("lost0", timeout=FAIL_BOUND_S + 10)
            job.wait_for("lost1", timeout=FAIL_BOUND_S + 10)
            write(tmp_path / "quiet", "1")
            quiet = [json.loads(job.wait_for(f"paused{r}")) for r in (0, 1)]
            pid0 = hosts.worker_pid(job.procs["worker0"])
            assert pid0 is not None
            cpu0, wakes0 = _usage(pid0)
            time.sleep(QUIET_S)
            cpu1, wakes1 = _usage(pid0)
            idle_cpu = (cpu1 - cpu0) / QUIET_S
            idle_wakes = (wakes1 - wakes0) / QUIET_S
            for r in (0, 1):
                tell(tmp_path / f"resume{r}")
            time.sleep(0.5)  # calls fail fast meanwhile
            hosts.drop(host0, False)
            heal = time.monotonic()
            time.sleep(RECOVER_BOUND_S + 0.7)  # ~14 calls each past the bound
            write(tmp_path / "done", "1")
            out = [job.json(f"worker{r}.json") for r in (0, 1)]
            for r in (0, 1):
                assert job.wait_exit(f"worker{r}") == 0, job.logs()
        finally:
            job.stop()
    print(f"\n  partition of {heal - cut:.1f} s (peer_timeout {PEER_TIMEOUT:g} s), "
          f"blip of {blip_end - blip:.1f} s; worker0 while cut off and idle: "
          f"{idle_wakes:.1f} wake-ups/s, {100 * idle_cpu:.2f}% of a core")
    for rank, res in enumerate(out):
        peer = f"worker{1 - rank}"
        calls = res["calls"]
        assert all(r["ok"] or "error" in r for r in calls)
        assert not [r for r in calls if r.get("error") == "wrong value"], "a wrong value came back"
        # The blip: nothing fails, the longest call lasts about the blip.
        assert not _failed(calls, blip - 0.2, blip_end + 1.0), _failed(calls, blip - 0.2,
                                                                       blip_end + 1.0)
        longest = max(r["end"] - r["start"] for r in calls if blip - 0.2 <= r["start"] <= blip_end)
        # The long partition: calls fail as unreachable, naming the peer, in time.
        failed = _failed(calls, cut - 0.2, heal + RECOVER_BOUND_S)
        assert failed, f"worker{rank}: no call failed across the partition"
        for r in failed:
            assert r["type"] == "UnreachableError", r
            assert peer in r["error"], r
            assert r["end"] - r["start"] < FAIL_BOUND_S, r
        first = min(r["end"] for r in failed)
        # Healed: reachable again soon after, every later call succeeds.
        after = [r for r in calls if r["start"] >= heal + RECOVER_BOUND_S]
        assert after and all(r["ok"] for r in after), [r for r in after if not r["ok"]][:3]
        back = min(r["end"] for r in calls if r["start"] >= heal and r["ok"])
        print(f"  worker{rank}: blip, longest call {longest:.2f} s; partition found after "
              f"{first - cut:.2f} s ({len(failed)} calls failed, e.g. {failed[-1]['error']!r}); "
              f"calls work again {back - heal:.2f} s after the heal, settled "
              f"{res['after_heal'].get('settled_s')} s later; {res['debug']}")
        assert back - heal < RECOVER_BOUND_S
        # Once both knew: nothing left posted (the 256 MiB call was cut).
        assert quiet[rank]["watched_requests"] == 0, quiet[rank]
        assert quiet[rank]["poll_decision"] != "data in flight", quiet[rank]
        assert quiet[rank]["broken_peers"] == [1 - rank], quiet[rank]
        # What the cut transfer's requests held is freed: UCX ended them
        # once their endpoint was discarded (transport/engine.py,
        # _let_go_of_endpoint).  A flushing close left 15 of the 256 MiB
        # message's 16 MiB receives held on worker0 past the heal, and the
        # sends on worker1 (Run AO).  At most one 1 MiB call the peer was
        # sending as the link went stays held: a receive UCX matched to the
        # first fragments of an eager message cannot be cancelled, and UCX
        # fails it with no endpoint's close; it ended when the old
        # connection resumed after the heal and brought the rest, but that
        # connection is now cut (ucx/sockets.py: its resumed bytes
        # corrupted UCX's memory), so it stays held for the process's life
        # (3 of 28 runs held one, 2026-11-29; 1 of 24 kept it, Run AW).
        assert quiet[rank]["retired_bytes"] <= PAYLOAD.nbytes, quiet[rank]
        # After the heal nothing else of the outage is held (settled_s: how
        # long that took; _outage.AFTER_HEAL_S says how long it may).
        after = res["after_heal"]
        assert after["retired_requests"] <= 1 and after["retired_bytes"] <= PAYLOAD.nbytes, after
        if device == "cuda":
            assert quiet[rank]["cuda_leaked"] == 0, quiet[rank]
            assert res["device_echo"] == {"value": True}, res["device_echo"]
        c.check_shutdown(res["shutdown_s"], f"worker{rank}")
    assert idle_wakes <= QUIET_WAKES_PER_S, f"worker0 woke {idle_wakes:.1f} times a second idle"
    assert idle_cpu < QUIET_CPU, f"worker0 used {100 * idle_cpu:.1f}% of a core while idle"
    w0, w1 = out
    print(f"  the 256 MiB call cut by the partition: {w1['big']}")
    assert w1["big"].get("value") is True or w1["big"]["type"] == "UnreachableError", w1["big"]
    if device == "cuda":  # else the memory checks above checked nothing
        assert w1["big"].get("type") == "UnreachableError", w1["big"]
    # State that spanned the outage goes on, or fails naming it; new state works.
    for what in ("rref", "backward"):
        res = w0[what]
        print(f"  {what} made before the partition, used after: {res}")
        assert res.get("value") in (41, True) or "outage" in res["error"], res
    assert w0["rref_new"] == {"value": 42} and w0["backward_new"] == {"value": True}, w0
