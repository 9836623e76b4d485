"""``ucxrpc info`` and ``ucxrpc bench``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def _info(_: argparse.Namespace) -> int:
    import torch

    from .transport import ucx

    os.environ.update(ucx.ucx_environment(None))
    res = ucx.local_resources()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    cuda_tls = sorted({t for t, _ in res["resources"] if t.startswith("cuda")})
    print(f"ucxrpc        {__import__('ucxrpc').__version__}")
    print(f"UCX           {ucx.ucx_version()}")
    print(f"torch         {torch.__version__}")
    print("transports    " + ", ".join(f"{t}/{d}" for t, d in res["resources"]))
    print(f"GPUs          {', '.join(gpus) if gpus else 'none'}")
    usable = res["cuda_support"] and bool(gpus) and bool(cuda_tls)
    why = ("UCX built with CUDA, GPU present, transports " + ", ".join(cuda_tls)) if usable else \
        ("UCX built without CUDA" if not res["cuda_support"] else
         "no GPU visible" if not gpus else "no CUDA transport loaded")
    print(f"CUDA support  {'usable' if usable else 'not usable'} ({why})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ucxrpc`` command."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ucxrpc", description="torch RPC on UCX")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="UCX version, transports, GPUs, CUDA support")
    sub.add_parser("bench", help="measure ucxrpc vs torch RPC vs raw UCX (see `ucxrpc bench -h`)",
                   add_help=False)
    if args and args[0] == "bench":
        from .bench import main as bench_main

        return bench_main(args[1:])
    ns = parser.parse_args(args)
    return _info(ns)


if __name__ == "__main__":
    raise SystemExit(main())
