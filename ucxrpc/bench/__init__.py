"""``ucxrpc bench``: ucxrpc against torch's TensorPipe agent and raw UCX.

Each implementation runs the same workload in its own pair of spawned
processes on this host (see :mod:`ucxrpc.bench.workload`); the results are
tabulated by :mod:`ucxrpc.bench.report`. Entry point: :func:`main`, called
by the ``ucxrpc bench`` command and ``benchmarks/bench_rpc.py``.

Importing this package imports neither torch nor ucxx nor the rest of
ucxrpc; the children do that.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from typing import Any, Iterator, Sequence

from . import report
from .workload import (IMPLEMENTATIONS, RunOutcome, WorkloadConfig,
                       describe_config, quick_config, run_implementation)

__all__ = ["main", "build_parser"]

# Share of all CPUs other processes may take during a run before the figures
# come with a warning.
_BUSY_WARN = 0.05

_DESCRIPTIONS = {
    "ucxrpc": "ucxrpc (UCX agent), {threads} worker threads; transports: {tls}",
    "torch": "torch.distributed.rpc, TensorPipe agent, {threads} worker threads",
    "ucxx": "UCX through ucxx's core API, tag send/recv into reused buffers, caller polls;\n"
            "            latency = 8-byte ping-pong, one-way = send + 8-byte ack; transports: {tls}",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ucxrpc bench",
        description="Measure RPC latency, throughput and bandwidth between two local "
                    "processes; compare ucxrpc with torch's TensorPipe agent and raw UCX.")
    parser.add_argument("--impl", choices=("ucxrpc", "torch"), default="ucxrpc",
                        help="implementation under test; ratio columns are it ÷ the others "
                             "(default: ucxrpc)")
    parser.add_argument("--compare", choices=("torch", "ucxx"), action="append", default=[],
                        help="also run torch's TensorPipe agent or the raw ucxx baseline "
                             "(repeatable)")
    parser.add_argument("--sizes", type=report.parse_sizes, default=None,
                        help="bandwidth sizes, comma-separated, K/M/G suffixes are binary "
                             "(default: 4K,16K,64K,256K,1M,4M,16M,64M,256M)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed no-op rpc_sync calls for latency (default: 2000)")
    parser.add_argument("--transports", default=None,
                        help="comma-separated UCX transports for ucxrpc and raw ucxx, "
                             "e.g. 'sm' or 'tcp' (default: UCX chooses)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the results, config and machine info as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: sizes 4K,64K,1M, few iterations")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every implementation N times, interleaved, and show the "
                             "median of the runs per figure (default: 1)")
    parser.add_argument("--stat", choices=("median", "best"), default="median",
                        help="with --repeat: per figure, the median of the runs or the best "
                             "(lowest time, highest rate) (default: median)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="overall deadline in seconds (default: 600 per repeat, "
                             "--quick: 180)")
    return parser


def _config(args: argparse.Namespace) -> WorkloadConfig:
    overrides: dict[str, Any] = {}
    if args.sizes is not None:
        overrides["sizes"] = args.sizes
    if args.repeat < 1:
        raise ValueError("--repeat must be at least 1")
    if args.iters is not None:
        if args.iters < 1:
            raise ValueError("--iters must be at least 1")
        overrides["latency_iters"] = args.iters
    if args.transports:
        overrides["transports"] = tuple(t.strip() for t in args.transports.split(",") if t.strip())
    return quick_config(**overrides) if args.quick else WorkloadConfig(**overrides)


def _header(impls: Sequence[str], cfg: WorkloadConfig, info: dict[str, Any]) -> str:
    tls = ",".join(cfg.transports) if cfg.transports else "UCX default"
    sizes = [report.format_size(n) for n in cfg.sizes]
    names = [report.IMPL_LABELS[i] for i in impls]
    lines = [f"ucxrpc bench: {names[0]} vs {', '.join(names[1:]) or 'nothing'}"]
    for impl in impls:
        text = _DESCRIPTIONS[impl].format(threads=cfg.num_worker_threads, tls=tls)
        if impl == "torch" and cfg.transports:
            text += " (--transports does not apply)"
        lines.append(f"  {report.IMPL_LABELS[impl]:<10}{text}")
    lines.append(f"  latency:    {cfg.latency_warmup} warm-up + {cfg.latency_iters} timed calls; "
                 f"p50/p99")
    lines.append(f"  throughput: {cfg.async_outstanding:,} outstanding rpc_async + wait_all; "
                 f"median of {cfg.async_repeats} rounds")
    lines.append(f"  bandwidth:  {', '.join(sizes)}; per size {cfg.warmup_iters} warm-up calls, "
                 f"then >= {cfg.min_iters} timed (about {cfg.target_s:g} s); "
                 "GB/s = bytes/s/1e9, median")
    lines.append(f"  dict echo:  {cfg.dict_tensors} x {report.format_size(cfg.dict_tensor_bytes)} "
                 "tensors, rpc_sync(echo) p50")
    lines.append(f"  host {info['hostname']}, {info['cpus_usable']} CPUs, torch {info['torch']}, "
                 f"ucxx {info['ucxx']}, libucx {info['libucx']}")
    return "\n".join(lines)


def _transport_lines(outcomes: dict[str, list[RunOutcome]]) -> list[str]:
    lines = []
    ucxrpc = _last_result(outcomes.get("ucxrpc"))
    if ucxrpc is not None:
        pipes = ucxrpc.get("pipe_info")
        if pipes is None:
            lines.append("ucxrpc pipes: (ucxrpc.get_pipe_info is not available)")
        for pipe in pipes or ():
            tls = ", ".join(pipe.get("transports") or ()) or "unknown"
            lanes = ", ".join(f"{lane.get('transport')}/{lane.get('device')}"
                              for lane in pipe.get("lanes") or ())
            lines.append(f"ucxrpc pipe worker0 -> {pipe.get('peer', '?')}: {tls}"
                         + (f" (lanes: {lanes})" if lanes else ""))
    raw = _last_result(outcomes.get("ucxx"))
    if raw is not None:
        tls = ", ".join(raw.get("transports") or ()) or "unknown"
        lines.append(f"raw ucxx endpoint lanes: {tls} (UCX {raw.get('ucx_version')})")
    return lines


def _last_result(runs: list[RunOutcome] | None) -> dict[str, Any] | None:
    results = [o.result for o in runs or () if o.result is not None]
    return results[-1] if results else None


def _run_all(impls: Sequence[str], cfg: WorkloadConfig, repeat: int,
             deadline: float) -> dict[str, list[RunOutcome]]:
    """Run each implementation ``repeat`` times, interleaved (a, b, a, b, ...).

    Interleaving spreads slow drifts of the machine over every implementation
    instead of loading them onto whichever ran last.
    """
    outcomes: dict[str, list[RunOutcome]] = {impl: [] for impl in impls}
    for round_ in range(repeat):
        for impl in impls:
            tag = impl if repeat == 1 else f"{impl} {round_ + 1}/{repeat}"
            print(f"[{tag}] running ...", file=sys.stderr, flush=True)
            outcome = run_implementation(impl, cfg, deadline)
            state = "failed" if outcome.error else "done"
            others = "" if outcome.cpu_others is None else \
                f" (other processes: {outcome.cpu_others:.0%} of the CPUs)"
            print(f"[{tag}] {state} in {outcome.wall_s:.1f} s{others}", file=sys.stderr,
                  flush=True)
            if outcome.cpu_others is not None and outcome.cpu_others > _BUSY_WARN:
                outcome.warnings.append(
                    f"other processes used {outcome.cpu_others:.0%} of the CPUs during this "
                    "run; its figures are distorted (a benchmark wants the machine to itself)")
            for warning in outcome.warnings:
                print(f"[{tag}] warning: {warning}", file=sys.stderr, flush=True)
            outcomes[impl].append(outcome)
    return outcomes


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit meanwhile, so ``finally`` kills the children."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a header, the table and the pipes' transports.

    Args:
        argv: command-line arguments without the program name (default:
            ``sys.argv[1:]``).

    Returns:
        0 when every implementation ran (or ``--help``); 1 when a run failed
        (the others are still reported); 2 on bad arguments (argparse's
        message on stderr) or when ucxrpc is asked for but not usable.
    """
    parser = build_parser()
    try:   # argparse exits on --help and on bad arguments; a caller wants a code
        args = parser.parse_args(argv)
        try:
            cfg = _config(args)
        except ValueError as exc:
            parser.error(str(exc))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    impls = tuple(dict.fromkeys([args.impl] + list(args.compare)))
    assert all(i in IMPLEMENTATIONS for i in impls)
    info = report.machine_info()
    info["bench_args"] = list(sys.argv[1:] if argv is None else argv)
    print(_header(impls, cfg, info), flush=True)
    timeout = args.timeout if args.timeout is not None else \
        (180.0 if args.quick else 600.0 * args.repeat)
    with _sigterm_as_exit():
        outcomes = _run_all(impls, cfg, args.repeat, time.monotonic() + timeout)

    results: dict[str, Any] = {i: [o.result for o in runs if o.result is not None]
                               for i, runs in outcomes.items()}
    errors = {i: "\n".join(o.error for o in runs if o.error)
              for i, runs in outcomes.items() if any(o.error for o in runs)}
    table = report.build_table(results, primary=args.impl, impls=impls, stat=args.stat)
    print()
    if args.repeat > 1:
        print(f"{args.stat} of {args.repeat} runs per implementation (failed runs left out)")
    print(report.render_table(table))
    for line in _transport_lines(outcomes):
        print(line)
    for impl, error in errors.items():
        print(f"\n{impl} FAILED: {error}", file=sys.stderr)
    if args.json:
        raw = _last_result(outcomes.get("ucxx"))
        if raw is not None:
            info["ucx"] = raw.get("ucx_version")
        config = describe_config(cfg)
        config.update(repeat=args.repeat, stat=args.stat)
        doc = report.build_json(table, results, info, config, errors)
        doc["runs"] = {i: [{"wall_s": o.wall_s, "warnings": o.warnings,
                            "cpu_others": o.cpu_others, "ok": o.error is None} for o in runs]
                       for i, runs in outcomes.items()}
        report.dump_json(args.json, doc)
        print(f"JSON written to {args.json}")
    return 1 if errors else 0
