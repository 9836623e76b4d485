#!/usr/bin/env python
"""CUDA tensors between two processes on one GPU: ucxrpc against torch's
TensorPipe agent (both with a device map cuda:0 -> cuda:0), a host-staged
ucxrpc transfer, and the GPU's own device-to-device copy as the ceiling.

    python benchmarks/bench_cuda.py                 # 1 MiB .. 1 GiB
    python benchmarks/bench_cuda.py --sizes 1M,256M --repeat 5

Rows: one-way GB/s per size (rpc_sync of a function that only touches the
tensor's device, so the time is the transfer plus one round trip), then 1,000
tensors of 4 KiB sent one by one against packed with ucxrpc's kernel
(ucxrpc._kernels) and unpacked on arrival.  Needs a GPU, torch and CuPy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text):
    return int(text[:-1]) * _SUFFIX[text[-1].upper()] if text[-1].upper() in _SUFFIX else int(text)


def device_of(t):
    return str(t.device) if not isinstance(t, list) else str(t[0].device)


def unpack_here(buf, specs):
    from ucxrpc import _kernels

    return len(_kernels.unpack(buf, specs))


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


def _child(impl, rank, port, sizes, repeat, out):
    import torch
    warnings.filterwarnings("ignore")
    rpc, Options = _modules(impl)
    opts = Options(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8)
    opts.set_device_map(f"worker{1 - rank}", {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank != 0:
            return
        res = {}
        for n in sizes:
            t = torch.ones(n, dtype=torch.uint8, device="cuda")
            res[("direct", n)] = n / _timed(lambda: rpc.rpc_sync("worker1", device_of, (t,)),
                                            repeat) / 1e9
            if impl == "ucxrpc":
                def staged():
                    host = t.cpu()  # the host bounce a missing CUDA path would cost
                    rpc.rpc_sync("worker1", device_of, (host,))
                res[("staged", n)] = n / _timed(staged, repeat) / 1e9
        small = [torch.full((1024,), float(i), device="cuda") for i in range(1000)]
        res[("small_each", 0)] = _timed(lambda: rpc.rpc_sync("worker1", device_of, (small,)),
                                        repeat) * 1e3
        if impl == "ucxrpc":
            from ucxrpc import _kernels

            def packed():
                buf, specs = _kernels.pack(small)
                rpc.rpc_sync("worker1", unpack_here, (buf, specs))
            res[("small_packed", 0)] = _timed(packed, repeat) * 1e3
        out.put(res)
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


def _run(impl, sizes, repeat):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_child, args=(impl, r, port, sizes, repeat, out), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=600)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,4M,16M,64M,256M,1G")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench_cuda needs a CUDA GPU")
    sizes = [_size(s) for s in args.sizes.split(",")]
    print(f"GPU: {torch.cuda.get_device_name(0)}; one-way GB/s, median of {args.repeat}")
    d2d = _d2d(sizes, args.repeat)
    ucx = _run("ucxrpc", sizes, args.repeat)
    tp = _run("torch", sizes, args.repeat)
    print(f"{'size':>6} {'d2d copy':>9} {'ucxrpc':>8} {'staged':>8} {'torch':>8} "
          f"{'ucxrpc/d2d':>11} {'ucxrpc/torch':>13}")
    for n in sizes:
        u, t = ucx[("direct", n)], tp[("direct", n)]
        print(f"{n >> 20:>5}M {d2d[n]:>9.1f} {u:>8.1f} {ucx[('staged', n)]:>8.1f} {t:>8.1f} "
              f"{u / d2d[n]:>11.2f} {u / t:>13.2f}")
    print(f"1,000 x 4 KiB CUDA tensors, ms per call: ucxrpc one by one "
          f"{ucx[('small_each', 0)]:.2f}, ucxrpc packed {ucx[('small_packed', 0)]:.2f}, "
          f"torch one by one {tp[('small_each', 0)]:.2f}")


if __name__ == "__main__":
    main()
