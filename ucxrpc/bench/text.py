"""The benchmark's text around the table: what runs (header), which UCX
transports each pipe used (footer)."""

from __future__ import annotations

from typing import Any, Sequence

from .launch import RunOutcome
from .plan import Series, format_size
from .workload import WorkloadConfig

__all__ = ["header", "transport_lines"]

_DESCRIPTIONS = {
    "ucxrpc": "ucxrpc (UCX agent), {threads} worker threads; transports: {tls}",
    "torch": "torch.distributed.rpc, TensorPipe agent, {threads} worker threads",
    "ucxx": "UCX through ucxx's core API, tag send/recv into reused buffers, caller polls;\n"
            "              latency = 8-byte ping-pong, one-way = send + 8-byte ack; "
            "transports: {tls}",
}


def _where(info: dict[str, Any], device: str) -> str:
    simulated = info.get("simulated_hosts")
    if simulated and info.get("peer_host"):
        return (f"  hosts:       rank 0 {info['hostname']} ({device}) <-> rank 1 "
                f"{info['peer_host']} ({info.get('peer_device', '?')}): two simulated hosts "
                f"on {simulated.get('machine', '?')},\n"
                "               network namespaces joined by a veth pair (--hosts netns), "
                f"store {info.get('master', '?')}")
    if info.get("peer_host"):
        return (f"  hosts:       rank 0 {info['hostname']} ({device}) <-> rank 1 "
                f"{info['peer_host']} ({info.get('peer_device', '?')}), store "
                f"{info.get('master', '?')}")
    maps = "" if device == "cpu" else f", device maps {device} -> {device} both ways"
    return f"  hosts:       two processes on {info['hostname']}, tensors on {device}{maps}"


def header(series: Sequence[Series], cfg: WorkloadConfig, info: dict[str, Any],
           device: str, load: int = 0) -> str:
    """What is about to run, how it is measured, and where (``load``: busy
    processes running beside the workers)."""
    names = list(dict.fromkeys(s.label for s in series))
    lines = [f"ucxrpc bench: {names[0]} vs {', '.join(names[1:]) or 'nothing'}"]
    for s in series:
        text = _DESCRIPTIONS[s.impl].format(threads=cfg.num_worker_threads,
                                            tls=s.choice or "UCX default")
        if s.impl == "torch" and any(x.transports for x in series):
            text += " (--transports does not apply)"
        lines.append(f"  {s.label:<12}{text}")
    sizes = ", ".join(format_size(n) for n in cfg.sizes)
    lines += [
        f"  latency:     {cfg.latency_warmup} warm-up + {cfg.latency_iters} timed no-op calls; "
        "p50/p99",
        f"  throughput:  {cfg.async_outstanding:,} outstanding rpc_async + wait_all; "
        f"median of {cfg.async_repeats} rounds",
        f"  sizes:       {sizes}",
        "  per size:    one-way rpc_sync(consume, t), round-trip rpc_sync(echo, t) (the "
        "latency-vs-size figure),",
        "               bidirectional (both ranks send t at once); "
        f"{cfg.warmup_iters} warm-up calls, then >= {cfg.min_iters} timed",
        f"               (about {cfg.target_s:g} s); GB/s = bytes/s/1e9 over the median call; "
        "min/max in the JSON and plot",
        f"  dict echo:   {cfg.dict_tensors} x {format_size(cfg.dict_tensor_bytes)} "
        "tensors, rpc_sync(echo) p50",
        _where(info, device),
        f"  load:        {load} busy process{'es' if load != 1 else ''} (a Python loop each) "
        "beside the workers, for every implementation" if load else
        "  load:        none (nothing else started; the runs report what other processes used)",
        f"  software:    {info['cpus_usable']} CPUs, torch {info['torch']}, "
        f"ucxx {info['ucxx']}, libucx {info['libucx']}",
    ]
    return "\n".join(lines)


def _last_result(runs: Sequence[RunOutcome] | None) -> dict[str, Any] | None:
    results = [o.result for o in runs or () if o.result is not None]
    return results[-1] if results else None


def transport_lines(series: Sequence[Series],
                    outcomes: dict[str, list[RunOutcome]]) -> list[str]:
    """Per UCX series, the transport and device of every lane UCX chose."""
    lines = []
    for s in series:
        result = _last_result(outcomes.get(s.key))
        if result is None or s.impl == "torch":
            continue
        if s.impl == "ucxx":
            tls = ", ".join(result.get("transports") or ()) or "unknown"
            lines.append(f"{s.label} endpoint lanes: {tls} (UCX {result.get('ucx_version')})")
            continue
        pipes = result.get("pipe_info")
        if pipes is None:
            lines.append(f"{s.label} pipes: (ucxrpc.get_pipe_info is not available)")
        for pipe in pipes or ():
            tls = ", ".join(pipe.get("transports") or ()) or "unknown"
            lanes = ", ".join(f"{lane.get('transport')}/{lane.get('device')}"
                              for lane in pipe.get("lanes") or ())
            by_address = pipe.get("by_address") or {}
            read = [way for way in ("in", "out") if by_address.get(way)]
            lines.append(f"{s.label} pipe worker0 -> {pipe.get('peer', '?')}: {tls}"
                         + (f" (lanes: {lanes})" if lanes else "")
                         + (f"; large host buffers read by address: {', '.join(read)}"
                            if read else ""))
    return lines
