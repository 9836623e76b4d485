#!/usr/bin/env python
"""What this machine charges for a wake-up: the floor under any RPC's no-op.

A no-op call hands work from thread to thread and process to process; each
hand-off to a thread asleep on another core costs that core's wake-up.  On a
VM with idle vCPUs that wake-up goes through the hypervisor, and on the
16-vCPU GPU machine a host no-op took 258-370 µs for ucxrpc and 669 µs for
torch, against 66 and ~190 µs on a busy 2-core VM
(benchmarks/runs/AH.md).  This prints, as one JSON
object, round trips (p50 / p90 µs) of:

* ``threads_event``: two threads of one process, each waking the other
  (``threading.Event``: a futex wake and, under it, the GIL changing hands);
* ``processes_pipe``: two processes, each blocked in ``read`` on a pipe;
* ``processes_spin``: the same two processes reading non-blocking pipes in
  a loop: no sleep, no wake-up, what the hand-off costs without them.

The gap between the last two is the machine's wake-up; a no-op RPC pays it
for every hand-off that finds its thread asleep.  benchmarks/gpu_check.sh's
``floor`` step runs this beside ``ucxrpc bench`` with and without UCX's CUDA
transports.

    python benchmarks/floor.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time


def _pct(times: list[float], p: float) -> float:
    times = sorted(times)
    return round(times[min(len(times) - 1, int(p / 100 * len(times)))] * 1e6, 1)


def _summary(times: list[float]) -> dict[str, float]:
    return {"p50_us": _pct(times, 50), "p90_us": _pct(times, 90), "n": len(times)}


def threads_event(rounds: int) -> dict[str, float]:
    ping, pong = threading.Event(), threading.Event()

    def echo() -> None:
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        ping.set()
        pong.wait()
        pong.clear()
        times.append(time.perf_counter() - t)
    th.join(10)
    return _summary(times)


def _pipes(rounds: int, spin: bool) -> dict[str, float]:
    there_r, there_w = os.pipe()
    back_r, back_w = os.pipe()
    if spin:
        os.set_blocking(there_r, False)
        os.set_blocking(back_r, False)

    def read(fd: int) -> None:
        while True:
            try:
                if os.read(fd, 1):
                    return
            except BlockingIOError:
                continue

    pid = os.fork()
    if pid == 0:  # the echo: only os calls, then _exit
        try:
            for _ in range(rounds):
                read(there_r)
                os.write(back_w, b"x")
        finally:
            os._exit(0)
    times = []
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            os.write(there_w, b"x")
            read(back_r)
            times.append(time.perf_counter() - t)
    finally:
        os.waitpid(pid, 0)
        for fd in (there_r, there_w, back_r, back_w):
            os.close(fd)
    return _summary(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args(argv)
    out = {"cpus": os.cpu_count(),
           "threads_event": threads_event(args.rounds),
           "processes_pipe": _pipes(args.rounds, spin=False),
           "processes_spin": _pipes(args.rounds, spin=True)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
