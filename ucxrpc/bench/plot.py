"""The benchmark's PNG: bandwidth vs size and latency vs size, one line per series.

Left panel: one-way (solid) and bidirectional (dashed) bandwidth in GB/s
over message size (log x). Right panel: the round-trip time of a message of
that size (``rpc_sync(echo, t)``; raw ucxx: ping-pong), in µs, log-log.
Lines are medians; the shaded band spans the fastest to the slowest call.
With several runs per series (``--repeat``) the line is the median of the
runs' medians and the band the extremes over all runs.

Input is the JSON document ``ucxrpc bench`` writes, so a saved run can be
plotted again. matplotlib is imported only here, only when plotting, and
drawn through its Agg canvas without pyplot: no window, no global backend
switch in the calling process.
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Iterable, Mapping

from .plan import format_size, series_label

__all__ = ["curves", "plot_path_for", "render_plot"]

_STYLES = {"one_way": ("-", "o", "one-way"), "bidirectional": ("--", "s", "bidirectional")}
_DPI = 120


def plot_path_for(json_path: str | os.PathLike[str]) -> str:
    """Where the plot goes next to a JSON file: the same name, ``.png``."""
    root, _ = os.path.splitext(os.fspath(json_path))
    return root + ".png"


def _runs(result: Any) -> list[Mapping[str, Any]]:
    runs = result if isinstance(result, list) else [result]
    return [r for r in runs if isinstance(r, Mapping)]


def curves(result: Any, section: str, value: str) -> list[tuple[int, float, float, float]]:
    """``(bytes, median, low, high)`` per size of one series' ``section``.

    Args:
        result: one run's measurements or a list of runs (``None`` entries,
            failed runs, are skipped).
        section: ``"one_way"``, ``"round_trip"``, ``"bidirectional"``.
        value: ``"gbps"`` (bands from ``gbps_min``/``gbps_max``) or ``"us"``
            (the time per call in µs, from ``median_s``/``min_s``/``max_s``).
            Results without the band fields get a band of zero width.
    """
    points: dict[int, list[tuple[float, float, float]]] = {}
    for run in _runs(result):
        for entry in run.get(section) or ():
            if value == "gbps":
                mid = entry.get("gbps")
                low, high = entry.get("gbps_min", mid), entry.get("gbps_max", mid)
            else:
                mid = None if entry.get("median_s") is None else entry["median_s"] * 1e6
                low = entry.get("min_s", entry.get("median_s"))
                high = entry.get("max_s", entry.get("median_s"))
                low, high = (None if x is None else x * 1e6 for x in (low, high))
            if mid is not None:
                points.setdefault(int(entry["bytes"]), []).append(
                    (mid, mid if low is None else low, mid if high is None else high))
    return [(size, statistics.median(p[0] for p in pts), min(p[1] for p in pts),
             max(p[2] for p in pts)) for size, pts in sorted(points.items())]


def _short_size(n: int) -> str:
    return format_size(n).replace(" KiB", "K").replace(" MiB", "M").replace(" GiB", "G")


def _draw(ax: Any, xs: list[int], mid: list[float], low: list[float], high: list[float],
          color: Any, style: str, marker: str, label: str) -> None:
    ax.plot(xs, mid, linestyle=style, marker=marker, markersize=4, color=color, label=label)
    if any(lo != hi for lo, hi in zip(low, high)):
        ax.fill_between(xs, low, high, color=color, alpha=0.1, linewidth=0)


def _axes_sizes(ax: Any, sizes: Iterable[int]) -> None:
    ticks = sorted(set(sizes))
    ax.set_xscale("log", base=2)
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([_short_size(n) for n in ticks], rotation=45, fontsize=8)
        ax.minorticks_off()
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def _title(doc: Mapping[str, Any]) -> str:
    machine = doc.get("machine") or {}
    config = doc.get("config") or {}
    parts = ["ucxrpc bench", str(machine.get("hostname", "?"))]
    if machine.get("peer_host"):
        parts[-1] += f" ↔ {machine['peer_host']}"
    if machine.get("simulated_hosts"):
        parts[-1] += " (simulated hosts, netns)"
    parts.append(str(config.get("device", "cpu")))
    if config.get("load"):
        parts.append(f"load {config['load']}")
    if machine.get("timestamp"):
        parts.append(str(machine["timestamp"]))
    return " · ".join(parts)


def render_plot(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    """Draw ``doc`` (the benchmark's JSON document) into a PNG at ``path``.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results: Mapping[str, Any] = doc.get("results") or {}
    order = list(doc.get("implementations") or results)
    labels = {k: (v or {}).get("label") for k, v in (doc.get("series") or {}).items()}
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    bw, lat = fig.subplots(1, 2)
    colors = [f"C{i}" for i in range(10)]
    sizes: set[int] = set()
    for index, key in enumerate(k for k in order if k in results):
        color, name = colors[index % len(colors)], labels.get(key) or series_label(key)
        for section, (style, marker, mode) in _STYLES.items():
            points = curves(results[key], section, "gbps")
            if points:
                xs, mid, low, high = (list(col) for col in zip(*points))
                _draw(bw, xs, mid, low, high, color, style, marker, f"{name} {mode}")
                sizes.update(xs)
        points = curves(results[key], "round_trip", "us")
        if points:
            xs, mid, low, high = (list(col) for col in zip(*points))
            _draw(lat, xs, mid, low, high, color, "-", "o", name)
            sizes.update(xs)
    for ax in (bw, lat):
        _axes_sizes(ax, sizes)
    bw.set_ylabel("bandwidth (GB/s = 1e9 bytes/s)")
    bw.set_title("bandwidth vs size (median; band: min–max)")
    bw.set_ylim(bottom=0)
    lat.set_yscale("log")
    lat.set_ylabel("round-trip time (µs)")
    lat.set_title("latency vs size: echo of a tensor of that size")
    for ax in (bw, lat):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "no measurements", ha="center", va="center",
                    transform=ax.transAxes)
    fig.suptitle(_title(doc), fontsize=10)
    fig.savefig(os.fspath(path), dpi=_DPI, format="png")
    return os.fspath(path)
