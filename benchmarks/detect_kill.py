"""How long a call waiting on a SIGKILLed peer takes to fail.

Each trial: this process (worker0) and a fresh victim process (worker1) join
a job; worker0 opens the pipe with one call, leaves a call pending on the
victim (a 60 s sleep), SIGKILLs the victim and times the pending call's
failure.  Then worker0 shuts down (the dead victim is not waited for) and
initialises again for the next trial, in the same process.  Optionally one
busy process (a Python loop) takes a core throughout.

    python benchmarks/detect_kill.py --trials 20 --pipe shm --pipe tcp --load 0 --load 1

Prints p50 and max per pipe and load, and the first error message.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucxrpc._launch import free_port  # noqa: E402
from ucxrpc.bench.launch import busy_load  # noqa: E402

#: ``transports=`` per pipe kind (None: UCX's choice, shared memory here).
PIPES = {"shm": None, "tcp": ["tcp"]}


def _victim(init_method: str, transports: list[str] | None) -> None:
    import ucxrpc as rpc

    rpc.init_rpc("worker1", rank=1, world_size=2,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method,
                                                              transports=transports))
    time.sleep(600)  # killed long before


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _trial(ctx, transports: list[str] | None) -> tuple[float, str, list[str]]:
    import ucxrpc as rpc

    init_method = f"tcp://127.0.0.1:{free_port()}"
    victim = ctx.Process(target=_victim, args=(init_method, transports), daemon=True)
    victim.start()
    try:
        rpc.init_rpc("worker0", rank=0, world_size=2,
                     rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method,
                                                                  transports=transports))
        rpc.rpc_sync("worker1", os.getpid)
        lanes = rpc.get_pipe_info("worker1")[0]["transports"]
        pending = rpc.rpc_async("worker1", _sleep, args=(60.0,))
        time.sleep(0.05)  # the request is on the victim's side
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            pending.wait()
            raise SystemExit("the pending call returned: nothing was measured")
        except RuntimeError as exc:
            elapsed, message = time.monotonic() - killed, str(exc).split("\n")[0]
        rpc.shutdown()
        return elapsed, message, lanes
    finally:
        victim.kill()
        victim.join()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--pipe", action="append", choices=sorted(PIPES))
    ap.add_argument("--load", action="append", type=int, help="busy processes beside the job")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    print(f"{'pipe':12} {'load':>4} {'trials':>6} {'p50 ms':>8} {'max ms':>8}  first error")
    for pipe in args.pipe or ["shm"]:
        for load in args.load or [0]:
            with busy_load(load):
                times, first, lanes = [], "", []
                for _ in range(args.trials):
                    elapsed, message, lanes = _trial(ctx, PIPES[pipe])
                    times.append(elapsed)
                    first = first or message
            print(f"{pipe + str(lanes):12} {load:>4} {len(times):>6} "
                  f"{1e3 * statistics.median(times):>8.2f} {1e3 * max(times):>8.2f}  {first}",
                  flush=True)


if __name__ == "__main__":
    main()
