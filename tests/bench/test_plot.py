"""The PNG plot, drawn from a synthetic result document."""

from __future__ import annotations

import pytest

from ucxrpc.bench import plot

# The first plot of a process builds matplotlib's font cache, which runs
# fontconfig's `fc-list` where it is installed (a fresh machine with
# fontconfig: CI's once failed here for it).  Whichever of these tests
# draws first starts it.
pytestmark = pytest.mark.processes

KiB, MiB = 1 << 10, 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sized(size: int, seconds: float, factor: int) -> dict:
    return {"bytes": size, "iters": 5, "gbps": factor * size / seconds / 1e9,
            "gbps_min": factor * size / (2 * seconds) / 1e9,
            "gbps_max": factor * size / (seconds / 2) / 1e9,
            "min_s": seconds / 2, "median_s": seconds, "max_s": 2 * seconds}


def _result(scale: float) -> dict:
    sizes = (4 * KiB, 64 * KiB, MiB)
    return {"latency": {"p50_us": 50.0 * scale, "p99_us": 90.0 * scale},
            "one_way": [_sized(n, scale * (1e-5 + n / 5e9), 1) for n in sizes],
            "round_trip": [_sized(n, scale * (2e-5 + n / 5e9), 2) for n in sizes],
            "bidirectional": [_sized(n, scale * (3e-5 + n / 5e9), 2) for n in sizes]}


def _doc() -> dict:
    return {"machine": {"hostname": "testhost", "timestamp": "2026-01-01T00:00:00+00:00"},
            "config": {"device": "cpu"},
            "implementations": ["ucxrpc[tcp]", "torch", "ucxx[tcp]"],
            "series": {"ucxrpc[tcp]": {"label": "ucxrpc [tcp]"}, "torch": {"label": "torch"},
                       "ucxx[tcp]": {"label": "raw ucxx [tcp]"}},
            "results": {"ucxrpc[tcp]": [_result(1.0), _result(1.2)], "torch": [_result(3.0)],
                        "ucxx[tcp]": [None, _result(0.5)]}}


def test_plot_is_a_png(tmp_path):
    path = tmp_path / "bench.png"
    assert plot.render_plot(_doc(), path) == str(path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plot_of_nothing_still_draws(tmp_path):
    path = tmp_path / "empty.png"
    plot.render_plot({"results": {}}, path)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_plot_leaves_the_global_backend_alone(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    plot.render_plot(_doc(), tmp_path / "x.png")
    assert matplotlib.get_backend() == before


def test_curves_combine_runs():
    runs = [_result(1.0), None, _result(3.0)]
    points = plot.curves(runs, "one_way", "gbps")
    assert [p[0] for p in points] == [4 * KiB, 64 * KiB, MiB]
    size, mid, low, high = points[-1]
    one, three = _result(1.0)["one_way"][-1], _result(3.0)["one_way"][-1]
    assert mid == pytest.approx((one["gbps"] + three["gbps"]) / 2)
    assert low == three["gbps_min"] and high == one["gbps_max"]
    size, mid, low, high = plot.curves(runs, "round_trip", "us")[0]
    assert low < mid < high


def test_curves_of_results_without_bands():
    old = {"one_way": [{"bytes": 4096, "gbps": 1.5, "median_s": 1e-5}]}   # older JSON
    assert plot.curves(old, "one_way", "gbps") == [(4096, 1.5, 1.5, 1.5)]
    assert plot.curves(old, "round_trip", "us") == []


def test_plot_path_next_to_the_json():
    assert plot.plot_path_for("out/run.json") == "out/run.png"
    assert plot.plot_path_for("bench") == "bench.png"


@pytest.mark.processes
def test_importing_the_bench_loads_neither_ucxx_nor_matplotlib():
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, ucxrpc.bench, ucxrpc.bench.plot, ucxrpc.bench.launch\n"
            "print(sorted(m for m in ('ucxx', 'matplotlib') if m in sys.modules))\n")
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
