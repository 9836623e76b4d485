"""Where the JSON and the plot go, and what happens when one cannot be written."""

from __future__ import annotations

import json
import sys

import pytest

from ucxrpc.bench import _write_files, build_parser

# The first plot of a process builds matplotlib's font cache, which runs
# fontconfig's `fc-list` where it is installed (a fresh machine with
# fontconfig: CI's once failed here for it).  Whichever of these tests
# draws first starts it.
pytestmark = pytest.mark.processes

DOC = {"machine": {"hostname": "h"}, "config": {"device": "cpu"}, "implementations": ["ucxrpc"],
       "results": {"ucxrpc": [{"one_way": [{"bytes": 4096, "gbps": 1.0, "median_s": 1e-5}],
                               "round_trip": [{"bytes": 4096, "gbps": 1.0, "median_s": 2e-5}]}]}}


def _write(argv: list[str]) -> int:
    return _write_files(build_parser().parse_args(argv), DOC)


def test_default_json_and_plot_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _write([]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ucxrpc-bench.json", "ucxrpc-bench.png"]
    assert json.loads((tmp_path / "ucxrpc-bench.json").read_text())["machine"] == {"hostname": "h"}


def test_plot_follows_the_json_path(tmp_path):
    assert _write(["--json", str(tmp_path / "run.json")]) == 0
    assert (tmp_path / "run.png").read_bytes().startswith(b"\x89PNG")


def test_no_json_no_plot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _write(["--no-json"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["ucxrpc-bench.png"]
    (tmp_path / "ucxrpc-bench.png").unlink()
    assert _write(["--no-plot", "--json", "x.json"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_without_matplotlib_the_run_still_succeeds_unless_a_plot_was_asked_for(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert _write([]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert _write(["--plot", "p.png"]) == 1
    assert not (tmp_path / "p.png").exists()


def test_unwritable_paths_fail(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "dir"
    assert _write(["--json", str(missing / "r.json"), "--plot", str(missing / "r.png")]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "r.json" in err and "r.png" in err


def test_replot_draws_a_saved_result_without_running(tmp_path, capsys):
    from ucxrpc.bench import main

    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(DOC))
    assert main(["--replot", str(saved)]) == 0
    assert (tmp_path / "saved.png").read_bytes().startswith(b"\x89PNG")
    assert main(["--replot", str(tmp_path / "missing.json")]) == 1
    assert "cannot plot" in capsys.readouterr().err
