"""Turn benchmark measurements into a comparison table, text and JSON.

Pure functions over plain data, so they can be tested without processes.
Every implementation (``ucxrpc``, ``torch``, raw ``ucxx``) reports its
measurements in one schema, produced by :func:`ucxrpc.bench.workload.run_workload`
and :func:`ucxrpc.transport.baseline.baseline_peer`::

    {
      "latency":    {"p50_us": float, "p99_us": float, "mean_us": float, "n": int},
      "async":      {"calls_per_s": float, "runs": [float, ...], "stat": "median",
                     "outstanding": int},                      # optional
      "one_way":    [{"bytes": int, "gbps": float, "iters": int, ...}, ...],
      "round_trip": [{"bytes": int, "gbps": float, "iters": int, ...}, ...],
      "dict_echo":  {"p50_us": float, "n": int, ...},           # optional
    }

A missing section (raw ucxx has no ``async`` or ``dict_echo``) or a missing
implementation (it failed, or was not asked for) shows as an empty cell.

Ratio columns compare the *primary* implementation (the one under test,
normally ``ucxrpc``) with each other one as ``primary ÷ other``: for rows
where lower is better (latency) a ratio < 1 means the primary wins; for rows
where higher is better (bandwidth, throughput) a ratio > 1 means it wins.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import socket
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = [
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

#: Column labels for the implementation keys used throughout the harness.
IMPL_LABELS = {"ucxrpc": "ucxrpc", "torch": "torch", "ucxx": "raw ucxx"}
#: Short names used in ratio column headers ("ucxrpc/raw").
_RATIO_NAMES = {"ucxrpc": "ucxrpc", "torch": "torch", "ucxx": "raw"}

EMPTY = "—"

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse ``"4K"``, ``"16KiB"``, ``"1M"``, ``"2g"`` or ``"4096"`` into bytes.

    Suffixes are binary (K = 1024). Raises ``ValueError`` on anything else,
    including sizes < 1.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 4K, 16M, 1G)")
    value = int(match.group(1)) * _SUFFIXES[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"size must be at least 1 byte: {text!r}")
    return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parse a comma-separated list of sizes; duplicates dropped, sorted."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("empty size list")
    return tuple(sorted({parse_size(p) for p in parts}))


def format_size(n: int) -> str:
    """``4096 -> "4 KiB"``, ``16777216 -> "16 MiB"``, ``1000 -> "1000 B"``."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


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
    values: Mapping[str, float | None]   # impl -> value
    ratios: Mapping[str, float | None]   # other impl -> primary / other


@dataclass(frozen=True)
class Table:
    primary: str
    impls: tuple[str, ...]            # value columns, primary first
    ratio_against: tuple[str, ...]    # one ratio column per entry
    rows: tuple[Row, ...]

    def ratio_header(self, other: str) -> str:
        return f"{_RATIO_NAMES.get(self.primary, self.primary)}/{_RATIO_NAMES.get(other, other)}"


def _get(d: Mapping[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(d, Mapping) or key not in d:
            return None
        d = d[key]
    return d


def flatten(measurements: Mapping[str, Any] | None) -> dict[str, float]:
    """Map one implementation's measurements to ``{metric key: value}``.

    Keys: ``latency_p50_us``, ``latency_p99_us``, ``async_calls_per_s``,
    ``one_way_gbps/<bytes>``, ``round_trip_gbps/<bytes>``,
    ``dict_echo_p50_us``. Absent or ``None`` values are left out.
    """
    out: dict[str, float] = {}
    for key, path in (("latency_p50_us", ("latency", "p50_us")),
                      ("latency_p99_us", ("latency", "p99_us")),
                      ("async_calls_per_s", ("async", "calls_per_s")),
                      ("dict_echo_p50_us", ("dict_echo", "p50_us"))):
        value = _get(measurements, *path)
        if value is not None:
            out[key] = float(value)
    for section in ("one_way", "round_trip"):
        for entry in _get(measurements, section) or ():
            if entry.get("gbps") is not None:
                out[f"{section}_gbps/{int(entry['bytes'])}"] = float(entry["gbps"])
    return out


def _metrics_for(flat: Sequence[Mapping[str, float]]) -> list[Metric]:
    """Rows in display order: latency, throughput, bandwidths by size, dict."""
    keys = set().union(*flat) if flat else set()
    rows = [Metric("latency_p50_us", "no-op rpc_sync latency p50", "µs", False),
            Metric("latency_p99_us", "no-op rpc_sync latency p99", "µs", False),
            Metric("async_calls_per_s", "rpc_async throughput", "calls/s", True)]
    for section, label in (("one_way", "one-way bandwidth"), ("round_trip", "round-trip bandwidth")):
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
    """Whether a smaller value of metric ``key`` is better (times: ``*_us``)."""
    return key.endswith("_us")


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
        results: implementation key -> measurements (schema in the module
            docstring), or a list of them from repeated runs, combined per
            metric by ``stat`` (see :func:`combine_runs`); an implementation
            may be missing or ``None``.
        primary: the implementation under test; ratio columns are
            ``primary ÷ other`` for every other implementation in ``impls``.
        impls: value columns in display order (primary is moved first).

    Rows appear only for metrics at least one implementation reported.
    """
    order = (primary,) + tuple(i for i in dict.fromkeys(impls) if i != primary)
    flat = {}
    for impl in order:
        result = results.get(impl)
        runs = result if isinstance(result, Sequence) else [result]
        flat[impl] = combine_runs(runs, stat)
    others = order[1:]
    rows = []
    for metric in _metrics_for(list(flat.values())):
        values = {impl: flat[impl].get(metric.key) for impl in order}
        ratios = {o: ratio(values[primary], values[o]) for o in others}
        rows.append(Row(metric, values, ratios))
    return Table(primary=primary, impls=order, ratio_against=others, rows=tuple(rows))


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
    header = (["metric", "unit", "better"] + [IMPL_LABELS.get(i, i) for i in table.impls]
              + [table.ratio_header(o) for o in table.ratio_against])
    body = [[r.metric.label, r.metric.unit, r.metric.better]
            + [format_value(r.values.get(i)) for i in table.impls]
            + [format_ratio(r.ratios.get(o)) for o in table.ratio_against]
            for r in table.rows]
    widths = [max(len(line[c]) for line in [header] + body) for c in range(len(header))]

    def fmt(cells: list[str]) -> str:
        left = [cells[c].ljust(widths[c]) for c in range(3)]
        right = [cells[c].rjust(widths[c]) for c in range(3, len(cells))]
        return "  ".join(left + right).rstrip()

    lines = [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(b) for b in body]
    if table.ratio_against:
        p = _RATIO_NAMES.get(table.primary, table.primary)
        lines.append(f"ratios are {p} ÷ other: < 1 is better where 'better' says lower "
                     "(latency); > 1 is better where it says higher (bandwidth, throughput).")
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
                   "ratios": {table.ratio_header(o): v for o, v in r.ratios.items()}}
                  for r in table.rows],
        "results": dict(results),
        "errors": dict(errors or {}),
    }


def dump_json(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> None:
    """Write ``doc`` as indented JSON (non-JSON values via ``str``)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str, ensure_ascii=False)
        f.write("\n")
