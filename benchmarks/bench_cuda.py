#!/usr/bin/env python
"""CUDA tensors between two processes on one GPU: ucxrpc against torch's
TensorPipe agent (both with a device map cuda:0 -> cuda:0), ucxrpc with its
CUDA transports left out (so it stages through pinned host memory, as on a
pipe without a CUDA path), and the GPU's own device-to-device copy as the
ceiling.

    python benchmarks/bench_cuda.py                 # 1 MiB .. 1 GiB
    python benchmarks/bench_cuda.py --sizes 1M,256M --repeat 5

Rows: one-way GB/s per size (rpc_sync of a function that only touches the
tensor's device, so the time is the transfer plus one round trip), then one
call carrying 1,000 CUDA tensors of 4 KiB: packed (ucxrpc's default above
its count threshold: one kernel launch per side) against one by one (packing
switched off) and torch.  Needs a GPU, torch and CuPy.

A run whose child raises or dies stops at once with the child's traceback
(the other runs still go); the exit status is 1 if any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucxrpc._launch import free_port  # noqa: E402  (after the path)
from ucxrpc.bench.plan import parse_sizes  # noqa: E402


class ChildFailed(RuntimeError):
    """A benchmark child raised, died or ran out of time."""


def device_of(t):
    return str(t.device) if not isinstance(t, list) else str(t[0].device)


def _modules(impl):
    if impl == "torch":
        import torch.distributed.rpc as rpc
        return rpc, rpc.TensorPipeRpcBackendOptions
    import ucxrpc as rpc
    return rpc, rpc.UcxRpcBackendOptions


def _timed(fn, repeat):
    import torch
    fn()  # warm-up (first touch, IPC handles)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# variant -> UcxRpcBackendOptions extras: UCX without its CUDA transports
# takes the staged path; packing off sends small tensors one by one.
_VARIANTS = {"direct": {}, "staged": {"transports": ["sm", "tcp"]}, "unpacked": {}}


def _child(impl, variant, rank, port, sizes, repeat, out):
    try:
        _measure(impl, variant, rank, port, sizes, repeat, out)
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        raise


def _measure(impl, variant, rank, port, sizes, repeat, out):
    import torch
    warnings.filterwarnings("ignore")
    rpc, Options = _modules(impl)
    extra = _VARIANTS[variant] if impl == "ucxrpc" else {}
    opts = Options(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8, **extra)
    opts.set_device_map(f"worker{1 - rank}", {0: 0})
    if variant == "unpacked":
        from ucxrpc.transport.cuda import staging
        staging.PACK_MIN_COUNT = 1 << 30
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank != 0:
            return
        res = {}
        if variant != "unpacked":
            for n in sizes:
                t = torch.ones(n, dtype=torch.uint8, device="cuda")
                res[n] = n / _timed(lambda: rpc.rpc_sync("worker1", device_of, (t,)),
                                    repeat) / 1e9
                del t
        small = [torch.full((1024,), float(i), device="cuda") for i in range(1000)]
        res["small"] = _timed(lambda: rpc.rpc_sync("worker1", device_of, (small,)), repeat) * 1e3
        if impl == "ucxrpc":
            pipe = rpc.get_pipe_info("worker1")[0]
            res["pipe"] = f"{pipe['cuda_path']} over {','.join(pipe['transports'])}"
            res["stats"] = {k: v for k, v in rpc._get_debug_info().items()
                            if k in ("staged_bytes", "bounced_bytes", "packed_buffers")}
        out.put(("ok", rank, res))
    finally:
        rpc.shutdown()


def _d2d(sizes, repeat):
    import torch
    res = {}
    for n in sizes:
        a = torch.ones(n, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeat + 1):
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        res[n] = n / statistics.median(times[1:]) / 1e9
    return res


def _run(impl, variant, sizes, repeat, timeout):
    """Rank 0's results; raises :class:`ChildFailed` as soon as a child
    reports an exception or exits abnormally, or at ``timeout`` seconds."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(impl, variant, r, port, sizes, repeat, out),
                         daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                kind, rank, value = out.get(timeout=1.0)
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if p.exitcode not in (None, 0):
                        raise ChildFailed(f"{impl}/{variant}: rank {rank} exited with code "
                                          f"{p.exitcode} (a signal if negative)") from None
                if time.monotonic() > deadline:
                    raise ChildFailed(f"{impl}/{variant}: no result in {timeout:.0f} s") from None
                continue
            if kind == "error":
                raise ChildFailed(f"{impl}/{variant}: rank {rank} raised:\n{value}")
            return value
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)


def _runs(specs, repeat, timeout):
    """Every run in ``specs`` (name -> (impl, variant, sizes)); a failed one
    is reported on stderr and missing from the result."""
    results, failed = {}, []
    for name, (impl, variant, sizes) in specs.items():
        try:
            results[name] = _run(impl, variant, sizes, repeat, timeout)
        except ChildFailed as exc:
            print(f"FAILED {exc}", file=sys.stderr, flush=True)
            failed.append(name)
    return results, failed


def _fmt(value, spec):
    return format(value, spec) if value is not None else "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,4M,16M,64M,256M,1G")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds each run (a pair of processes) may take (default: 600)")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench_cuda needs a CUDA GPU")
    sizes = list(parse_sizes(args.sizes))
    print(f"GPU: {torch.cuda.get_device_name(0)}; one-way GB/s, median of {args.repeat}")
    d2d = _d2d(sizes, args.repeat)
    res, failed = _runs({"ucx": ("ucxrpc", "direct", sizes),
                         "staged": ("ucxrpc", "staged", sizes),
                         "unpacked": ("ucxrpc", "unpacked", []),
                         "torch": ("torch", "direct", sizes)}, args.repeat, args.timeout)
    ucx, staged, unpacked, tp = (res.get(k, {}) for k in ("ucx", "staged", "unpacked", "torch"))
    print(f"ucxrpc pipe: {ucx.get('pipe')} {ucx.get('stats')}; staged run: "
          f"{staged.get('pipe')} {staged.get('stats')}")
    if ucx and "cuda_ipc" not in ucx["pipe"]:
        print("WARNING: the ucxrpc pipe has no cuda_ipc lane: UCX stages device memory itself")
    print(f"{'size':>6} {'d2d copy':>9} {'ucxrpc':>8} {'staged':>8} {'torch':>8} "
          f"{'ucxrpc/d2d':>11} {'ucxrpc/torch':>13}")
    for n in sizes:
        u, t, st = ucx.get(n), tp.get(n), staged.get(n)
        print(f"{n >> 20:>5}M {d2d[n]:>9.1f} {_fmt(u, '>8.1f')} {_fmt(st, '>8.1f')} "
              f"{_fmt(t, '>8.1f')} {_fmt(u and u / d2d[n], '>11.2f')} "
              f"{_fmt(u and t and u / t, '>13.2f')}")
    print(f"1,000 x 4 KiB CUDA tensors in one call, ms: ucxrpc packed "
          f"{_fmt(ucx.get('small'), '.2f')}, ucxrpc one by one "
          f"{_fmt(unpacked.get('small'), '.2f')} ({unpacked.get('stats')}), "
          f"torch {_fmt(tp.get('small'), '.2f')}")
    if failed:
        sys.exit(f"bench_cuda: {len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
