"""``ucxrpc info`` and ``ucxrpc bench``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


_LIBS_OF_UCX_CUDA = {  # what libuct_cuda.so needs besides the CUDA runtime it brings
    "libcuda.so.1": "no NVIDIA driver library (libcuda.so.1)",
    "libnvidia-ml.so.1": "no NVML (libnvidia-ml.so.1; in a container, NVIDIA_DRIVER_CAPABILITIES "
                         "must include utility)",
}


def _line(label: str, ok: bool, detail: str) -> str:
    return f"{label:<14}" + (f"ready ({detail})" if ok else f"not ready: {detail}")


def _torch_cuda() -> tuple[bool, str, list[str]]:
    """Whether torch can use CUDA here, why (not), and the GPUs' names."""
    import torch

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is built without CUDA", []
    if not torch.cuda.is_available():
        try:
            torch.cuda.init()
            why = "no GPU visible"
        except Exception as exc:  # torch says why: no driver, a driver too old, ...
            why = str(exc).strip().splitlines()[0]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}): {why}{seen}", []
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return True, (f"torch {torch.__version__} with CUDA {torch.version.cuda} sees "
                  f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"), gpus


def _cupy() -> tuple[bool, str]:
    """Whether CuPy packs CUDA tensors here (it imports, sees cuda:0 and
    compiles the kernel there), and why not."""
    from . import _kernels

    problem = _kernels.cuda_problem(0)
    if problem is not None:
        return False, f"{problem}; small CUDA tensors go one by one"
    import cupy

    v = cupy.cuda.runtime.runtimeGetVersion()
    return True, (f"CuPy {cupy.__version__}, CUDA runtime {v // 1000}.{v % 1000 // 10}, "
                  "pack kernel compiled on cuda:0")


def _ucx_cuda(name: str, loaded: set[str], cuda_ok: bool) -> tuple[bool, str]:
    """Whether UCX loaded CUDA transport ``name`` for this process, and why not."""
    import ctypes

    if name in loaded:
        if name == "cuda_ipc" and "cuda_copy" not in loaded:
            return False, "loaded without cuda_copy: UCX cannot detect device memory"
        if name == "cuda_ipc" and cuda_ok:
            import torch

            from .transport.cuda import bounce

            memory_way, why = bounce.way(torch.cuda.current_device())
            if memory_way is not bounce.Way.AS_IS:
                return memory_way is bounce.Way.BOUNCED, why
        return True, {"cuda_copy": "UCX detects and copies device memory",
                      "cuda_ipc": "processes on one GPU read each other's memory"}.get(name, name)
    if not cuda_ok:
        return False, "no usable GPU (see CUDA)"
    for lib, why in _LIBS_OF_UCX_CUDA.items():
        try:
            ctypes.CDLL(lib)
        except OSError:
            return False, f"UCX did not load it: {why}"
    tls = os.environ.get("UCX_TLS", "all")
    if tls != "all" and name not in tls:
        return False, f"UCX_TLS={tls} leaves it out"
    return False, "UCX did not load it (see `ucx_info -d` with UCX_LOG_LEVEL=debug)"


def _info(_: argparse.Namespace) -> int:
    import torch

    from .transport.cuda import context as cudactx
    from .transport import ucx
    from .transport.ucx import ucp

    cuda_ok, cuda_why, gpus = _torch_cuda()  # CUDA first: UCX sees its context
    # The settings a worker here starts UCX with (its rendezvous switch
    # depends on whether a GPU is usable).
    os.environ.update(ucx.ucx_environment(
        None, device_memory=cudactx.uses_device_memory(None)))
    res = ucx.local_resources()
    settings = ucx.effective_settings()
    loaded = {t for t, _ in res["resources"]}
    cuda_tls = sorted(t for t in loaded if t.startswith("cuda"))
    print(f"ucxrpc        {__import__('ucxrpc').__version__}")
    print(f"UCX           {ucx.ucx_version()} ({ucp.loaded_library('libucp.so') or 'not loaded'})")
    print(f"torch         {torch.__version__}")
    print("transports    " + ", ".join(f"{t}/{d}" for t, d in res["resources"]))
    print(f"GPUs          {', '.join(gpus) if gpus else 'none'}")
    print(_line("CUDA", cuda_ok, cuda_why))
    print(_line("CuPy", *_cupy()))
    for name in ("cuda_copy", "cuda_ipc"):
        print(_line(name, *_ucx_cuda(name, loaded, cuda_ok)))
    problem = ucx.environment_problem()
    print(_line("UCX settings", problem is None, problem or "no UCX_* setting known to break pipes"))
    cache = settings.get("UCX_MEMTYPE_CACHE", "?")
    print(_line("memtype cache", cache == "n",
                f"UCX_MEMTYPE_CACHE={cache}, as UCX read it" if cache == "n" else
                f"UCX_MEMTYPE_CACHE={cache} as UCX read it; unset it or set it to n"))
    print(f"{'fragments':<14}{settings.get('UCX_RNDV_FRAG_MEM_TYPES', '?')} "
          "(UCX_RNDV_FRAG_MEM_TYPES: rendezvous pipelines stage through these)")
    usable = cuda_ok and ucx.cuda_memory(res["cuda_support"], res["resources"])
    why = ("GPU present, transports " + ", ".join(cuda_tls)) if usable else \
        ("no usable GPU" if not cuda_ok else "UCX has no cuda_copy: CUDA tensors are staged")
    print(f"CUDA support  {'usable' if usable else 'not usable'} ({why})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ucxrpc`` command."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ucxrpc", description="torch RPC on UCX")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="UCX version, transports, GPUs, and whether CUDA, CuPy, "
                   "UCX's CUDA transports and its memory-type setting are ready, and why not")
    sub.add_parser("bench", help="measure ucxrpc vs torch RPC vs raw UCX (see `ucxrpc bench -h`)",
                   add_help=False)
    if args and args[0] == "bench":
        from .bench import main as bench_main

        return bench_main(args[1:])
    ns = parser.parse_args(args)
    return _info(ns)


if __name__ == "__main__":
    raise SystemExit(main())
