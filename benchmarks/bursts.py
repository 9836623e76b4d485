"""Bursts of ``rpc_async`` no-ops, their rate and CPU: five bursts of
10,000 calls and a ``wait_all`` in one pair of processes, printed as the
median's calls/s and CPU µs per call (both processes), then every burst's
rate in thousands.  On the project's VM a burst's rate is bimodal (Run AU:
27-62k calls/s in one invocation), so compare trees by many invocations
in turn, or count calls (``calls_per_rpc.py PORT N async``).

    python benchmarks/bursts.py PORT
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


def run(rank, port):
    import ucxrpc as rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        for _ in range(2):  # warm-up
            torch.futures.wait_all([rpc.rpc_async("w1", noop) for _ in range(2000)])
        rates, cpus = [], []
        for _ in range(5):
            mine, theirs = cpu(), rpc.rpc_sync("w1", cpu)
            start = time.perf_counter()
            torch.futures.wait_all([rpc.rpc_async("w1", noop) for _ in range(10000)])
            took = time.perf_counter() - start
            used = cpu() - mine + rpc.rpc_sync("w1", cpu) - theirs
            rates.append(10000 / took)
            cpus.append(used / 10000 * 1e6)
        rates.sort()
        cpus.sort()
        print(f"rpc_async {rates[2]:.0f}/s  cpu {cpus[2]:.1f} us/call",
              [round(r / 1000) for r in rates], flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]),), nprocs=2)
