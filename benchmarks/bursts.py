"""Bursts of ``rpc_async`` no-ops, their rate and CPU: five bursts of
10,000 calls and a ``wait_all`` in one pair of processes, printed as the
median's calls/s and CPU µs per call (both processes), then every burst's
rate in thousands, and each burst's issuing and waiting in ms.  On the
project's VM a burst's rate was bimodal (Run AU: 27-62k calls/s in one
invocation; its slow mode, a progress thread starved of the GIL while the
burst was issued, in benchmarks/runs/BC.md, where the wait after issuing
is what grew), so compare trees by many invocations in turn, or count
calls (``calls_per_rpc.py PORT N async``).

    python benchmarks/bursts.py PORT [BURSTS [WARMUP]]

``BURSTS`` bursts (default 5) after two warm-up bursts of ``WARMUP`` calls
(default 2,000; Run BC's rounds: ``6 10000``).
"""
import os
import resource
import sys
import time

import torch
import torch.multiprocessing as mp


def noop():
    return None


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(rank, port, bursts, warmup):
    import ucxrpc as rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        for _ in range(2):  # warm-up
            torch.futures.wait_all([rpc.rpc_async("w1", noop) for _ in range(warmup)])
        rates, cpus, phases = [], [], []
        for _ in range(bursts):
            mine, theirs = cpu(), rpc.rpc_sync("w1", cpu)
            start = time.perf_counter()
            futures = [rpc.rpc_async("w1", noop) for _ in range(10000)]
            issued = time.perf_counter()
            torch.futures.wait_all(futures)
            took = time.perf_counter() - start
            used = cpu() - mine + rpc.rpc_sync("w1", cpu) - theirs
            rates.append(10000 / took)
            cpus.append(used / 10000 * 1e6)
            phases.append(f"{(issued - start) * 1e3:.0f}+{(start + took - issued) * 1e3:.0f}")
        print("bursts (issuing + waiting, ms):", " ".join(phases))
        rates.sort()
        cpus.sort()
        print(f"rpc_async {rates[len(rates) // 2]:.0f}/s  cpu {cpus[len(cpus) // 2]:.1f} us/call",
              [round(r / 1000) for r in rates], flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5,
                        int(sys.argv[3]) if len(sys.argv) > 3 else 2000), nprocs=2)
