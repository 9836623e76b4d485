#!/usr/bin/env python
"""What one call carrying a tensor costs: a plain loop, for a per-call budget.

Rank 0 calls ``rpc_sync(sink, (x,))`` for ``--seconds`` with ``x`` a tensor
of ``--size`` bytes on ``--device`` (``cuda``: cuda:0 in both processes, one
GPU shared, device maps both ways, as ``ucxrpc bench --device cuda``); the
callee's ``sink`` returns ``x.numel()``.  It prints one JSON line: the call
time's p10 / p50 / p90 in µs, the calls made, and each rank's CPU time per
call.  ``--impl torch`` runs the same loop on torch's TensorPipe agent.

While the timed loop runs, ``--pid-dir`` holds ``rank0.pid`` and
``rank1.pid`` and a file ``go`` (written after the warm-up), so a sampler
can watch both ranks: benchmarks/gpu_check.sh's ``percall`` step runs
``py-spy record`` on each and turns the stacks into a per-frame table
(benchmarks/stacks.py).  ``--hold`` keeps the loop running until the file
``stop`` appears there (or ``--seconds`` ran out), so the sampler decides
how long it samples.

    python benchmarks/percall.py --device cuda --size 16M
    python benchmarks/percall.py --impl torch --device cuda --size 1M
    python benchmarks/percall.py --device cpu --size 4K --seconds 1   # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ucxrpc._launch import free_port, start  # noqa: E402  (after the path)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``4K``, ``16M``, ``1G`` or bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[:-1] if unit else text) * _UNITS[unit])


def sink(x):
    return x.numel()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(rank: int, port: int, impl: str, device: str, size: int, seconds: float,
          pid_dir: str | None, hold: bool) -> dict | None:
    import torch

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    maps = None
    if device == "cuda":
        torch.cuda.set_device(0)
        maps = {("worker1" if rank == 0 else "worker0"): {0: 0}}
    if impl == "torch":
        import torch.distributed.rpc as rpc
        opts = rpc.TensorPipeRpcBackendOptions(device_maps=maps or {})
    else:
        import ucxrpc as rpc
        opts = rpc.UcxRpcBackendOptions(device_maps=maps)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    out = None
    if rank == 0:
        x = torch.ones(max(size // 4, 1), device=device)
        for _ in range(50):
            rpc.rpc_sync("worker1", sink, (x,))
        peer_cpu0 = rpc.rpc_sync("worker1", _cpu_s)
        if pid_dir:
            open(os.path.join(pid_dir, "go"), "w").close()
        stop = os.path.join(pid_dir, "stop") if (pid_dir and hold) else None
        times = []
        cpu0, clock = _cpu_s(), time.perf_counter
        end = clock() + seconds
        while clock() < end and not (stop and len(times) % 64 == 0 and os.path.exists(stop)):
            t = clock()
            rpc.rpc_sync("worker1", sink, (x,))
            times.append(clock() - t)
        cpu = _cpu_s() - cpu0
        peer_cpu = rpc.rpc_sync("worker1", _cpu_s) - peer_cpu0
        times.sort()
        n = len(times)

        def pct(p: float) -> float:
            return round(times[min(n - 1, int(p / 100 * n))] * 1e6, 1)

        out = {"impl": impl, "device": device, "size": size, "calls": n,
               "p10_us": pct(10), "p50_us": pct(50), "p90_us": pct(90),
               "cpu_us_per_call": {"caller": round(cpu / n * 1e6, 1),
                                   "callee": round(peer_cpu / n * 1e6, 1)},
               "device_path": os.environ.get("UCXRPC_DEVICE_PATH", "ucp") if impl == "ucxrpc"
               else None}
    rpc.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("ucxrpc", "torch"), default="ucxrpc")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", default="16M", help="bytes of the tensor (4K, 1M, 16M, ...)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed loop (default 3 s)")
    parser.add_argument("--pid-dir", default=None,
                        help="write rank0.pid, rank1.pid and go here (for a sampler)")
    parser.add_argument("--hold", action="store_true",
                        help="also stop early when --pid-dir/stop appears")
    parser.add_argument("--timeout", type=float, default=300.0, help="whole run (default 300 s)")
    args = parser.parse_args(argv)
    if args.pid_dir:
        os.makedirs(args.pid_dir, exist_ok=True)
    size = parse_size(args.size)
    port = free_port()
    rank_args = [(r, port, args.impl, args.device, size, args.seconds, args.pid_dir, args.hold)
                 for r in range(2)]
    with start(_rank, rank_args) as ranks:
        outcomes = ranks.collect(timeout=args.timeout, failure_grace=10.0)
    failed = [o for o in outcomes if o.error]
    for o in failed:
        print(o.error, file=sys.stderr)
    if failed or outcomes[0].value is None:
        return 1
    print(json.dumps(outcomes[0].value), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
