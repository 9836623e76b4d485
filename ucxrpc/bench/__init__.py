"""``ucxrpc bench``: ucxrpc against torch's TensorPipe agent and raw UCX.

Each series (an implementation, under one UCX transport choice) runs the
same workload (:mod:`ucxrpc.bench.workload`, :mod:`ucxrpc.bench.raw`) in
fresh processes: two on this host, or one on each of two hosts when launched
by torchrun (:mod:`ucxrpc.bench.hosts`) or, with ``--hosts netns``, on two
simulated hosts of this machine (:mod:`ucxrpc.bench.simhosts`). The results
become a table and a JSON document (:mod:`ucxrpc.bench.report`) and a PNG plot
(:mod:`ucxrpc.bench.plot`). Entry point: :func:`main`, called by the
``ucxrpc bench`` command, ``python -m ucxrpc.bench`` and
``benchmarks/bench_rpc.py``.

Importing this package starts nothing and imports neither ucxx nor
matplotlib: the children load UCX (after setting ``UCX_*``), and the plot
loads matplotlib only when it draws.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator

from . import report, simhosts
from .hosts import HostSession, host_env, local_device
from .launch import RunOutcome, busy_load
from .plan import (DEFAULT_MAX_SIZE, build_series, default_sizes, format_size, parse_sizes,
                   parse_transports)
from .progress import Progress
from .runner import plan_document, plan_runs, run_all, serve_rank1
from .text import header, transport_lines
from .workload import WorkloadConfig, count_steps, describe_config, quick_config

__all__ = ["main", "build_parser"]

DEFAULT_JSON = "ucxrpc-bench.json"

_EPILOG = f"""\
sizes: comma-separated sizes (K/M/G are binary) and ranges LO..HI (steps of x4)
  or LO..HI:F (steps of xF); default 4K..{format_size(DEFAULT_MAX_SIZE['cpu'])} on CPU,
  4K..{format_size(DEFAULT_MAX_SIZE['cuda'])} with --device cuda.

transports: each --transports value is one UCX transport choice or several
  separated by ';'; a choice is a comma list used together. Several choices
  make a matrix: ucxrpc and raw ucxx run once per choice, e.g.
    --transports 'tcp;sm;all'       (tcp vs shared memory vs everything)
    --transports tcp --transports sm,cma
    --device cuda --transports 'sm,cuda;tcp,cuda_copy;all'

across two hosts: run the same command on both under torchrun (or anything
  that sets RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT), e.g. on host N:
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank N \\
        --master-addr HOST0 --master-port 29500 -m ucxrpc.bench --compare torch
  rank 0's options apply to both; rank 0 prints and writes the results.
  --hosts netns does this between two simulated hosts on this machine (network
  namespaces joined by a veth pair, nothing else shared; needs root), e.g.
    ucxrpc bench --hosts netns --quick
"""


def _sizes_arg(text: str) -> tuple[int, ...]:
    try:
        return parse_sizes(text)
    except ValueError as exc:   # argparse shows only this type's message
        raise argparse.ArgumentTypeError(str(exc)) from None


#: What runs beside the implementation under test when ``--compare`` is not
#: given: torch's agent (what a user of torch's RPC comes to compare with)
#: and raw ucxx (the ceiling; about 10 s on a 2-core host).
DEFAULT_COMPARE = ("torch", "ucxx")


def compared(compare: list[str] | None) -> list[str]:
    """The implementations ``--compare`` asks for besides the one under test."""
    if compare is None:
        return list(DEFAULT_COMPARE)
    return [c for c in compare if c != "none"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ucxrpc bench", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure RPC latency, throughput and bandwidth (one-way, round-trip, "
                    "bidirectional) between two processes on this host or on two hosts; "
                    "compare ucxrpc with torch's TensorPipe agent and raw UCX. Prints a "
                    "table and writes JSON and a PNG plot.")
    add = parser.add_argument
    add("--impl", choices=("ucxrpc", "torch"), default="ucxrpc",
        help="implementation under test; ratio columns are it ÷ the others (default: ucxrpc)")
    add("--compare", choices=("torch", "ucxx", "none"), action="append", default=None,
        help="also run torch's TensorPipe agent or the raw ucxx baseline (repeatable); "
             "default: both, the ratio columns being what the bench is for; 'none': "
             "the implementation under test alone")
    add("--sizes", type=_sizes_arg, default=None,
        help="message sizes for the bandwidth and latency-vs-size tests (see below)")
    add("--device", choices=("cpu", "cuda"), default="cpu",
        help="where tensors live; cuda: cuda:0 on both ranks (one GPU shared by the two "
             "local processes) with device maps both ways (default: cpu)")
    add("--transports", action="append", default=None, metavar="CHOICES",
        help="UCX transports for ucxrpc and raw ucxx, e.g. 'tcp', 'sm', 'tcp;sm;all' "
             "(repeatable; default: UCX chooses, UCX_TLS honoured)")
    add("--iters", type=int, default=None,
        help="timed no-op rpc_sync calls for latency (default: 2000, --quick: 200)")
    add("--time-per-size", type=float, default=None, metavar="SECONDS",
        help="timed work per size and test, at least 3 calls (default: 0.3, --quick: 0.05)")
    add("--json", metavar="PATH", default=None,
        help=f"write results, config and machine info as JSON here (default: {DEFAULT_JSON})")
    add("--no-json", action="store_true", help="write no JSON file")
    add("--plot", metavar="PATH", default=None,
        help="write the PNG plot here (default: the JSON path with .png, "
             "ucxrpc-bench.png with --no-json)")
    add("--no-plot", action="store_true", help="draw no plot")
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress bar on stderr (default: when stderr is a terminal)")
    add("--quick", action="store_true",
        help="smoke test: sizes 4K,64K,1M, few iterations (seconds per series)")
    add("--repeat", type=int, default=1, metavar="N",
        help="run every series N times, interleaved; the table shows the median of the runs "
             "(default: 1)")
    add("--stat", choices=("median", "best"), default="median",
        help="with --repeat: per figure, the median of the runs or the best (lowest time, "
             "highest rate) (default: median)")
    add("--timeout", type=float, default=None,
        help="overall deadline in seconds (default: 600 per repeat, --quick: 180)")
    add("--load", type=int, default=0, metavar="N",
        help="run N CPU-bound busy processes beside the workers for the whole run, for "
             "every implementation alike: a busy host, as a training node is (default: 0)")
    add("--local", action="store_true",
        help="run both ranks on this host even when RANK/WORLD_SIZE are set")
    add("--hosts", choices=("netns",), default=None,
        help="netns: run the two ranks on two simulated hosts of this machine, network "
             "namespaces joined by a veth pair that share nothing else (no shared memory: "
             "every implementation goes over TCP on the veth), launched as across two hosts; "
             "RANK/WORLD_SIZE are ignored. Needs root, iproute2 and util-linux (default: "
             "both ranks on this host, or one per host under torchrun)")
    add("--replot", metavar="JSON", default=None,
        help="run nothing: draw the plot of a saved JSON result (to --plot, default: "
             "next to it)")
    return parser


def _config(args: argparse.Namespace) -> WorkloadConfig:
    overrides: dict[str, Any] = {"device": args.device}
    if args.sizes is not None:
        overrides["sizes"] = args.sizes
    elif not args.quick:   # --quick has its own few sizes
        overrides["sizes"] = default_sizes(args.device)
    if args.repeat < 1:
        raise ValueError("--repeat must be at least 1")
    if args.load < 0:
        raise ValueError("--load must be 0 or more")
    if args.iters is not None:
        if args.iters < 1:
            raise ValueError("--iters must be at least 1")
        overrides["latency_iters"] = args.iters
    if args.time_per_size is not None:
        if args.time_per_size <= 0:
            raise ValueError("--time-per-size must be positive")
        overrides["target_s"] = args.time_per_size
    return quick_config(**overrides) if args.quick else WorkloadConfig(**overrides)


def _check_cuda() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return ("--device cuda: no usable CUDA GPU here (torch.cuda.is_available() is False; "
                f"torch {torch.__version__})")
    return None


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


def _fail(message: str) -> int:
    print(f"ucxrpc bench: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a header, the table and the pipes' transports,
    and write the JSON and the plot.

    Args:
        argv: command-line arguments without the program name (default:
            ``sys.argv[1:]``).

    Returns:
        0 when every run finished (or ``--help``); 1 when a run failed (the
        others are still reported) or an explicitly asked-for file could not
        be written; 2 on bad arguments, a bad launch environment, or
        ``--device cuda`` without a GPU.
    """
    parser = build_parser()
    try:   # argparse exits on --help and on bad arguments; a caller wants a code
        args = parser.parse_args(argv)
        try:
            cfg = _config(args)
            choices = parse_transports(args.transports)
            # A rank that --hosts netns started is a launched rank, whatever
            # its (the user's) --hosts and --local say.
            simulated = simhosts.simulated_hosts()
            launched = simulated is not None or (args.hosts is None and not args.local)
            env = host_env() if launched else None
        except ValueError as exc:
            parser.error(str(exc))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.replot:
        return _replot(args.replot, args.plot)
    timeout = args.timeout if args.timeout is not None else \
        (180.0 if args.quick else 600.0 * args.repeat)
    deadline = time.monotonic() + timeout
    if env is None and args.device == "cuda" and (problem := _check_cuda()):
        return _fail(problem)
    if args.hosts == "netns" and simulated is None:
        with _sigterm_as_exit():
            return simhosts.run(list(sys.argv[1:] if argv is None else argv), timeout)
    # On simulated hosts rank 0 runs the load: both ranks share this machine's CPUs.
    load = 0 if simulated is not None and env is not None and env.rank == 1 else args.load
    with _sigterm_as_exit(), busy_load(load):
        if env is None:
            return _bench(args, cfg, choices, argv, deadline, None)
        try:
            session = HostSession(env, timeout, same_machine=simulated is not None)
        except Exception as exc:   # the store is unreachable: nothing to run
            role = "host" if env.rank == 0 and not env.agent_store else "reach"
            return _fail(f"cannot {role} the store at {env.master_addr}:{env.master_port}: {exc}")
        try:
            if env.rank == 1:
                return serve_rank1(session, deadline)
            return _bench(args, cfg, choices, argv, deadline, session, simulated)
        except RuntimeError as exc:
            return _fail(str(exc))
        finally:
            session.close(deadline)


def _bench(args: argparse.Namespace, cfg: WorkloadConfig, choices: Any, argv: list[str] | None,
           deadline: float, session: HostSession | None,
           simulated: dict[str, Any] | None = None) -> int:
    """Rank 0 (or the only process): run everything, report, write files.

    ``simulated``: what ``--hosts netns`` told rank 0 (:mod:`.simhosts`).
    """
    impls = tuple(dict.fromkeys([args.impl] + compared(args.compare)))
    series = build_series(impls, choices)
    runs = plan_runs(series, args.repeat)
    info = report.machine_info()
    info["bench_args"] = list(sys.argv[1:] if argv is None else argv)
    execute: Callable[..., RunOutcome] | None = None
    device = "cuda:0" if cfg.device == "cuda" else "cpu"
    if session is not None:
        device = local_device(cfg.device, session.env.local_rank)
        peer = session.publish(plan_document(runs, cfg, device, socket.gethostname(),
                                             deadline - time.monotonic()), deadline)
        info.update(peer_host=peer["host"], peer_device=peer["device"],
                    master=f"{session.env.master_addr}:{session.env.master_port}")
        if simulated is not None:   # the user ran the invoker: record its command
            info["command"] = simulated.get("command", info["command"])
            info["simulated_hosts"] = {k: simulated.get(k) for k in ("kind", "machine", "link",
                                                                     "hosts")}

        def run_remote(index: int, run: Any, run_cfg: WorkloadConfig, until: float,
                       on_progress: Any) -> RunOutcome:
            return session.run(index, run.series.key, run.series.impl, run_cfg, device,
                               until, on_progress)
        execute = run_remote

    print(header(series, cfg, info, device, args.load), flush=True)
    progress = Progress(sum(count_steps(r.series.impl, cfg) for r in runs),
                        enabled=args.progress)
    try:
        outcomes = run_all(runs, cfg, deadline, progress, execute)
    finally:
        progress.close()
    return _report(args, cfg, series, outcomes, info, device)


def _report(args: argparse.Namespace, cfg: WorkloadConfig, series: Any,
            outcomes: dict[str, list[RunOutcome]], info: dict[str, Any], device: str) -> int:
    keys = [s.key for s in series]
    results: dict[str, Any] = {k: [o.result for o in outcomes.get(k, ()) if o.result is not None]
                               for k in keys}
    errors = {k: "\n".join(o.error for o in runs if o.error)
              for k, runs in outcomes.items() if any(o.error for o in runs)}
    table = report.build_table(results, primary=args.impl, impls=keys, stat=args.stat)
    print()
    if args.repeat > 1:
        print(f"{args.stat} of {args.repeat} runs per series (failed runs left out)")
    print(report.render_table(table))
    for line in transport_lines(series, outcomes):
        print(line)
    for key, error in errors.items():
        print(f"\n{key} FAILED: {error}", file=sys.stderr)
    status = 1 if errors else 0
    if args.no_json and args.no_plot:
        return status
    raw = next((o.result for s in series if s.impl == "ucxx"
                for o in outcomes.get(s.key, ()) if o.result is not None), None)
    if raw is not None:
        info["ucx"] = raw.get("ucx_version")
    config = describe_config(cfg)
    # Where the two ranks ran: one host, two hosts, two simulated hosts (--hosts netns).
    hosts = "netns" if info.get("simulated_hosts") else "two" if info.get("peer_host") \
        else "local"
    config.update(repeat=args.repeat, stat=args.stat, device=device, load=args.load, hosts=hosts,
                  transport_choices=[list(c) if c else None for c in
                                     dict.fromkeys(s.transports for s in series
                                                   if s.impl != "torch")])
    doc = report.build_json(table, results, info, config, errors)
    doc["series"] = {s.key: {"impl": s.impl, "transports": list(s.transports or ()) or None,
                             "label": s.label} for s in series}
    doc["runs"] = {k: [{"wall_s": o.wall_s, "warnings": o.warnings, "cpu_others": o.cpu_others,
                        "ok": o.error is None} for o in runs] for k, runs in outcomes.items()}
    return max(status, _write_files(args, doc))


def _replot(json_path: str, plot_path: str | None) -> int:
    import json

    from .plot import plot_path_for, render_plot

    try:
        with open(json_path, encoding="utf-8") as f:
            doc = json.load(f)
        path = render_plot(doc, plot_path or plot_path_for(json_path))
    except (OSError, ValueError, ImportError) as exc:
        print(f"ucxrpc bench: cannot plot {json_path}: {exc}", file=sys.stderr)
        return 1
    print(f"plot written to {path}")
    return 0


def _write_files(args: argparse.Namespace, doc: dict[str, Any]) -> int:
    """Write the JSON and the plot; 1 if one that was asked for by name failed."""
    from .plot import plot_path_for, render_plot

    status = 0
    json_path = None if args.no_json else (args.json or DEFAULT_JSON)
    if json_path is not None:
        try:
            report.dump_json(json_path, doc)
            print(f"JSON written to {json_path}")
        except OSError as exc:
            print(f"ucxrpc bench: cannot write {json_path}: {exc}", file=sys.stderr)
            status = 1
    if args.no_plot:
        return status
    plot_path = args.plot or plot_path_for(json_path or DEFAULT_JSON)
    try:
        render_plot(doc, plot_path)
        print(f"plot written to {plot_path}")
    except ImportError as exc:
        print(f"ucxrpc bench: no plot: matplotlib is not installed ({exc}); "
              "pip install 'ucxrpc[bench]'", file=sys.stderr)
        status = max(status, 1 if args.plot else 0)
    except (OSError, ValueError) as exc:
        print(f"ucxrpc bench: cannot write the plot {plot_path}: {exc}", file=sys.stderr)
        status = 1
    return status
