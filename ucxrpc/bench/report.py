"""Turn benchmark measurements into a comparison table, text and JSON.

Pure functions over plain data, so they can be tested without processes.
Every implementation (``ucxrpc``, ``torch``, raw ``ucxx``) reports its
measurements in one schema, produced by :func:`ucxrpc.bench.workload.run_workload`
and :func:`ucxrpc.bench.raw.raw_peer`::

    {
      "latency":    {"p50_us": float, "p99_us": float, "mean_us": float, "n": int},
      "async":      {"calls_per_s": float, "runs": [float, ...], "stat": "median",
                     "outstanding": int},                      # optional
      "one_way":       [SIZED, ...],     # rpc_sync(consume, t) / send + 8-byte ack
      "round_trip":    [SIZED, ...],     # rpc_sync(echo, t) / ping-pong
      "bidirectional": [SIZED, ...],     # both sides send at once (optional)
      "dict_echo":  {"p50_us": float, "n": int, ...},           # optional
    }
    SIZED = {"bytes": int, "iters": int, "gbps": float, "gbps_min": float,
             "gbps_max": float, "min_s": float, "median_s": float, "max_s": float}

(see :func:`ucxrpc.bench.workload.size_stats`). Results are keyed by
*series*: an implementation, or in a transport matrix an implementation
under one transport choice (``"ucxrpc[tcp]"``, see :mod:`ucxrpc.bench.plan`).
A missing section (raw ucxx has no ``async`` or ``dict_echo``) or a missing
series (it failed, or was not asked for) shows as an empty cell.

Ratio columns compare the *primary* implementation (the one under test,
normally ``ucxrpc``) with each other series as ``primary ÷ other`` (in a
matrix, against the series on the same transport choice, and torch): for
rows where lower is better (latency) a ratio < 1 means the primary wins; for
rows where higher is better (bandwidth, throughput) a ratio > 1 means it
wins.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import sys
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .plan import (IMPL_LABELS, format_size, parse_size, parse_sizes, ratio_pairs, series_label,
                   series_short, split_key)

__all__ = [
    "CPU_PREFIX",
    "IMPL_LABELS",
    "Metric",
    "Row",
    "Table",
    "build_table",
    "build_json",
    "dump_json",
    "flatten",
    "format_size",
    "format_ratio",
    "format_value",
    "machine_info",
    "combine_runs",
    "lower_is_better",
    "parse_size",
    "parse_sizes",
    "ratio",
    "render_table",
]

EMPTY = "—"
#: Prefix of the flattened keys holding a figure's CPU µs per call.
CPU_PREFIX = "cpu_us/"

#: Per-size sections in display order, with their row labels.
_SIZED = {"one_way": "one-way bandwidth", "round_trip": "round-trip bandwidth",
          "bidirectional": "bidirectional bandwidth"}


@dataclass(frozen=True)
class Metric:
    """One table row's meaning: its key in :func:`flatten` output and units."""

    key: str
    label: str
    unit: str
    higher_is_better: bool

    @property
    def better(self) -> str:
        return "higher" if self.higher_is_better else "lower"


@dataclass(frozen=True)
class Row:
    metric: Metric
    values: Mapping[str, float | None]                # series -> value
    ratios: Mapping[tuple[str, str], float | None]    # (numerator, denominator) -> ratio
    cpu: Mapping[str, float | None] = dataclasses.field(default_factory=dict)  # µs per call


@dataclass(frozen=True)
class Table:
    primary: str                              # the implementation under test
    impls: tuple[str, ...]                    # value columns (series), primary's first
    ratio_pairs: tuple[tuple[str, str], ...]  # one ratio column per pair
    rows: tuple[Row, ...]

    def ratio_header(self, pair: tuple[str, str]) -> str:
        return f"{series_short(pair[0])}/{series_short(pair[1])}"


def _get(d: Mapping[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(d, Mapping) or key not in d:
            return None
        d = d[key]
    return d


def flatten(measurements: Mapping[str, Any] | None) -> dict[str, float]:
    """Map one implementation's measurements to ``{metric key: value}``.

    Keys: ``latency_p50_us``, ``latency_p99_us``, ``async_calls_per_s``,
    ``<section>_gbps/<bytes>`` for each per-size section (``one_way``,
    ``round_trip``, ``bidirectional``), ``dict_echo_p50_us``; and
    ``cpu_us/<key>``, the CPU µs per call behind a figure, where measured
    (the latency's goes with its p50).  Absent or ``None`` values are left
    out.
    """
    out: dict[str, float] = {}
    # (key, section, field, whether the section's CPU per call goes with it)
    for key, part, field, with_cpu in (("latency_p50_us", "latency", "p50_us", True),
                                       ("latency_p99_us", "latency", "p99_us", False),
                                       ("async_calls_per_s", "async", "calls_per_s", True),
                                       ("dict_echo_p50_us", "dict_echo", "p50_us", True)):
        value = _get(measurements, part, field)
        if value is not None:
            out[key] = float(value)
            cpu = _get(measurements, part, "cpu_us") if with_cpu else None
            if cpu is not None:
                out[CPU_PREFIX + key] = float(cpu)
    for section in _SIZED:
        for entry in _get(measurements, section) or ():
            if entry.get("gbps") is not None:
                key = f"{section}_gbps/{int(entry['bytes'])}"
                out[key] = float(entry["gbps"])
                if entry.get("cpu_us") is not None:
                    out[CPU_PREFIX + key] = float(entry["cpu_us"])
    return out


def _metrics_for(flat: Sequence[Mapping[str, float]]) -> list[Metric]:
    """Rows in display order: latency, throughput, bandwidths by size, dict."""
    keys = set().union(*flat) if flat else set()
    rows = [Metric("latency_p50_us", "no-op rpc_sync latency p50", "µs", False),
            Metric("latency_p99_us", "no-op rpc_sync latency p99", "µs", False),
            Metric("async_calls_per_s", "rpc_async throughput", "calls/s", True)]
    for section, label in _SIZED.items():
        sizes = sorted(int(k.split("/", 1)[1]) for k in keys if k.startswith(section + "_gbps/"))
        rows += [Metric(f"{section}_gbps/{n}", f"{label} {format_size(n)}", "GB/s", True)
                 for n in sizes]
    rows.append(Metric("dict_echo_p50_us", "dict 100×4 KiB echo p50", "µs", False))
    return [m for m in rows if m.key in keys]


def ratio(primary: float | None, other: float | None) -> float | None:
    """``primary / other``, or ``None`` when either is missing or other is 0."""
    if primary is None or other is None or other == 0:
        return None
    return primary / other


def lower_is_better(key: str) -> bool:
    """Whether a smaller value of metric ``key`` is better (times: ``*_us``,
    and CPU per call)."""
    return key.endswith("_us") or key.startswith(CPU_PREFIX)


def combine_runs(runs: Sequence[Mapping[str, Any] | None], stat: str = "median") -> dict[str, float]:
    """Flatten several runs of one implementation into one value per metric.

    Args:
        runs: measurements per run; ``None`` (a failed run) and metrics a run
            lacks are skipped.
        stat: ``"median"`` (the mean of the middle two for an even count) or
            ``"best"`` (the lowest time, the highest rate: on a shared machine
            interference only ever slows a run down).
    """
    if stat not in ("median", "best"):
        raise ValueError(f"stat must be 'median' or 'best', not {stat!r}")
    values: dict[str, list[float]] = {}
    for run in runs:
        for key, value in flatten(run).items():
            values.setdefault(key, []).append(value)
    out = {}
    for key, vals in values.items():
        vals.sort()
        if stat == "best":
            out[key] = vals[0] if lower_is_better(key) else vals[-1]
        else:
            mid = len(vals) // 2
            out[key] = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
    return out


def build_table(results: Mapping[str, Any], primary: str, impls: Sequence[str],
                stat: str = "median") -> Table:
    """Build the comparison table.

    Args:
        results: series key -> measurements (schema in the module
            docstring), or a list of them from repeated runs, combined per
            metric by ``stat`` (see :func:`combine_runs`); a series may be
            missing or ``None``.
        primary: the implementation under test; ratio columns are its series
            over the others' (:func:`ucxrpc.bench.plan.ratio_pairs`).
        impls: value columns (series keys) in display order; the primary's
            series are moved first.

    Rows appear only for metrics at least one series reported.
    """
    keys = tuple(dict.fromkeys(impls))
    order = tuple(k for k in keys if split_key(k)[0] == primary) + \
        tuple(k for k in keys if split_key(k)[0] != primary)
    flat = {}
    for key in order:
        result = results.get(key)
        runs = result if isinstance(result, Sequence) else [result]
        flat[key] = combine_runs(runs, stat)
    pairs = ratio_pairs(order, primary)
    rows = []
    for metric in _metrics_for(list(flat.values())):
        values = {key: flat[key].get(metric.key) for key in order}
        ratios = {pair: ratio(values[pair[0]], values[pair[1]]) for pair in pairs}
        cpu = {key: flat[key].get(CPU_PREFIX + metric.key) for key in order}
        rows.append(Row(metric, values, ratios, cpu))
    return Table(primary=primary, impls=order, ratio_pairs=pairs, rows=tuple(rows))


def format_value(value: float | None) -> str:
    """Three significant figures or so, thousands separated; ``—`` if missing."""
    if value is None:
        return EMPTY
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def format_ratio(value: float | None) -> str:
    """Two decimals from 1 up, three significant figures below 1."""
    if value is None:
        return EMPTY
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def render_table(table: Table) -> str:
    """Render as aligned plain text: label left-aligned, numbers right-aligned.

    Ends with a legend line saying how to read the ratio columns.
    """
    cpu_cols = [i for i in table.impls if any(r.cpu.get(i) is not None for r in table.rows)]
    header = (["metric", "unit", "better"] + [series_label(i) for i in table.impls]
              + [table.ratio_header(pair) for pair in table.ratio_pairs]
              + [f"CPU µs/call {series_short(i)}" for i in cpu_cols])
    body = [[r.metric.label, r.metric.unit, r.metric.better]
            + [format_value(r.values.get(i)) for i in table.impls]
            + [format_ratio(r.ratios.get(pair)) for pair in table.ratio_pairs]
            + [format_value(r.cpu.get(i)) for i in cpu_cols]
            for r in table.rows]
    widths = [max(len(line[c]) for line in [header] + body) for c in range(len(header))]

    def fmt(cells: list[str]) -> str:
        left = [cells[c].ljust(widths[c]) for c in range(3)]
        right = [cells[c].rjust(widths[c]) for c in range(3, len(cells))]
        return "  ".join(left + right).rstrip()

    lines = [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(b) for b in body]
    if table.ratio_pairs:
        p = series_short(table.primary)
        lines.append(f"ratios are {p} ÷ other: < 1 is better where 'better' says lower "
                     "(latency); > 1 is better where it says higher (bandwidth, throughput).")
    if cpu_cols:
        lines.append("CPU µs/call: user + system time of both processes over a figure's "
                     "timed calls, per call (lower is better).")
    if not table.rows:
        lines.append("(no measurements)")
    return "\n".join(lines)


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and how the benchmark ran: host, CPUs, load, versions, command, time.

    Versions come from installed package metadata, so nothing heavy (torch,
    ucxx) is imported here. ``argv`` defaults to ``sys.argv``.
    """
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "ucxx": _dist_version("ucxx-cu13", "ucxx-cu12", "ucxx"),
        "libucx": _dist_version("libucx-cu13", "libucx-cu12", "libucx"),
        "command": shlex.join(sys.argv if argv is None else list(argv)),
        "loadavg": _loadavg(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def build_json(table: Table, results: Mapping[str, Any], info: Mapping[str, Any],
               config: Mapping[str, Any] | None = None,
               errors: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything needed to reproduce and compare a run, as JSON-ready data."""
    return {
        "machine": dict(info),
        "config": dict(config or {}),
        "primary": table.primary,
        "implementations": list(table.impls),
        "table": [{"metric": r.metric.key, "label": r.metric.label, "unit": r.metric.unit,
                   "better": r.metric.better, "values": dict(r.values),
                   "ratios": {table.ratio_header(pair): v for pair, v in r.ratios.items()},
                   "cpu_us_per_call": dict(r.cpu)}
                  for r in table.rows],
        "results": dict(results),
        "errors": dict(errors or {}),
    }


def dump_json(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> None:
    """Write ``doc`` as indented JSON (non-JSON values via ``str``)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str, ensure_ascii=False)
        f.write("\n")
