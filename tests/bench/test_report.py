"""The benchmark report: table, ratios, text and JSON, on synthetic numbers."""

from __future__ import annotations

import json

import pytest

from ucxrpc.bench import report

KiB, MiB = 1 << 10, 1 << 20


def _measurements(p50: float, p99: float, gbps: float, calls: float | None = 10_000.0,
                  dict_us: float | None = 2_000.0, sizes: tuple[int, ...] = (4 * KiB, MiB)):
    doc = {
        "latency": {"p50_us": p50, "p99_us": p99, "mean_us": p50, "n": 100},
        "one_way": [{"bytes": n, "gbps": gbps, "iters": 3} for n in sizes],
        "round_trip": [{"bytes": n, "gbps": 2 * gbps, "iters": 3} for n in sizes],
    }
    if calls is not None:
        doc["async"] = {"calls_per_s": calls, "runs": [calls], "stat": "median",
                        "outstanding": 10_000}
    if dict_us is not None:
        doc["dict_echo"] = {"p50_us": dict_us, "n": 20}
    return doc


RESULTS = {
    "ucxrpc": _measurements(p50=50.0, p99=100.0, gbps=8.0, calls=40_000.0, dict_us=500.0),
    "torch": _measurements(p50=200.0, p99=400.0, gbps=2.0, calls=10_000.0, dict_us=2_000.0),
    "ucxx": _measurements(p50=5.0, p99=10.0, gbps=16.0, calls=None, dict_us=None),
}


TORCH, RAW = ("ucxrpc", "torch"), ("ucxrpc", "ucxx")


def _row(table: report.Table, key: str) -> report.Row:
    (row,) = [r for r in table.rows if r.metric.key == key]
    return row


def test_ratios_are_primary_over_other_for_every_metric():
    table = report.build_table(RESULTS, primary="ucxrpc", impls=["ucxrpc", "torch", "ucxx"])
    assert table.impls == ("ucxrpc", "torch", "ucxx")
    assert table.ratio_pairs == (TORCH, RAW)

    latency = _row(table, "latency_p50_us")
    assert latency.metric.better == "lower"
    assert latency.ratios[TORCH] == pytest.approx(0.25)    # < 1: ucxrpc is faster
    assert latency.ratios[RAW] == pytest.approx(10.0)

    bandwidth = _row(table, f"one_way_gbps/{MiB}")
    assert bandwidth.metric.better == "higher"
    assert bandwidth.ratios[TORCH] == pytest.approx(4.0)   # > 1: ucxrpc moves more
    assert bandwidth.ratios[RAW] == pytest.approx(0.5)

    throughput = _row(table, "async_calls_per_s")
    assert throughput.metric.better == "higher"
    assert throughput.ratios[TORCH] == pytest.approx(4.0)
    assert throughput.ratios[RAW] is None                  # raw has no such figure
    assert throughput.values["ucxx"] is None


def test_ratio_columns_are_labelled_primary_over_other():
    table = report.build_table(RESULTS, primary="ucxrpc", impls=["ucxrpc", "torch", "ucxx"])
    text = report.render_table(table)
    header = text.splitlines()[0].split()
    assert header[-2:] == ["ucxrpc/torch", "ucxrpc/raw"]
    assert "raw" in header and "ucxx" in header   # the "raw ucxx" value column
    assert "< 1 is better" in text and "> 1 is better" in text


def test_rows_in_order_with_sizes_ascending():
    table = report.build_table(RESULTS, primary="ucxrpc", impls=["ucxrpc", "torch"])
    keys = [r.metric.key for r in table.rows]
    assert keys == ["latency_p50_us", "latency_p99_us", "async_calls_per_s",
                    f"one_way_gbps/{4 * KiB}", f"one_way_gbps/{MiB}",
                    f"round_trip_gbps/{4 * KiB}", f"round_trip_gbps/{MiB}",
                    "dict_echo_p50_us"]
    labels = [r.metric.label for r in table.rows]
    assert "one-way bandwidth 4 KiB" in labels and "round-trip bandwidth 1 MiB" in labels


def test_missing_implementation_gives_empty_cells_not_errors():
    results = {"ucxrpc": None, "torch": RESULTS["torch"]}     # ucxrpc failed; ucxx absent
    table = report.build_table(results, primary="ucxrpc", impls=["ucxrpc", "torch", "ucxx"])
    assert table.rows, "rows come from whoever did report"
    for row in table.rows:
        assert row.values["ucxrpc"] is None and row.values["ucxx"] is None
        assert all(v is None for v in row.ratios.values())
    text = report.render_table(table)
    assert report.EMPTY in text
    assert "200" in text                                      # torch's latency still shown


def test_sizes_only_one_implementation_measured_still_appear():
    results = {"torch": _measurements(200.0, 400.0, 2.0, sizes=(4 * KiB,)),
               "ucxx": _measurements(5.0, 10.0, 16.0, sizes=(4 * KiB, 256 * MiB))}
    table = report.build_table(results, primary="torch", impls=["torch", "ucxx"])
    row = _row(table, f"one_way_gbps/{256 * MiB}")
    assert row.values == {"torch": None, "ucxx": 16.0}
    assert row.ratios == {("torch", "ucxx"): None}
    assert "one-way bandwidth 256 MiB" in report.render_table(table)


def test_no_results_at_all():
    table = report.build_table({}, primary="ucxrpc", impls=["ucxrpc", "torch"])
    assert table.rows == ()
    assert "no measurements" in report.render_table(table)


def test_primary_is_moved_first_and_duplicates_dropped():
    table = report.build_table(RESULTS, primary="torch", impls=["ucxx", "torch", "ucxx"])
    assert table.impls == ("torch", "ucxx")
    assert table.ratio_header(("torch", "ucxx")) == "torch/raw"
    assert _row(table, "latency_p50_us").ratios == {("torch", "ucxx"): pytest.approx(40.0)}


def test_ratio_edge_cases():
    assert report.ratio(1.0, 2.0) == 0.5
    assert report.ratio(None, 2.0) is None
    assert report.ratio(1.0, None) is None
    assert report.ratio(1.0, 0.0) is None


def test_render_is_aligned():
    table = report.build_table(RESULTS, primary="ucxrpc", impls=["ucxrpc", "torch", "ucxx"])
    lines = report.render_table(table).splitlines()
    header, rule, body = lines[0], lines[1], lines[2:2 + len(table.rows)]
    # every numeric column ends where its header ends (right-aligned)
    ends = [i + 1 for i, (a, b) in enumerate(zip(rule, rule[1:] + " ")) if a == "-" and b == " "]
    for line in [header] + body:
        for end in ends[3:]:
            assert line[end - 1] != " ", (line, end)
            assert end == len(line) or line[end] == " "


@pytest.mark.parametrize("value, text", [(None, "—"), (12_345.6, "12,346"), (333.4, "333"),
                                         (55.55, "55.5"), (5.555, "5.55"), (0.0123, "0.012")])
def test_format_value(value, text):
    assert report.format_value(value) == text


@pytest.mark.parametrize("value, text", [(None, "—"), (0.0146, "0.0146"), (0.5, "0.5"),
                                         (1.0, "1.00"), (42.74, "42.74"), (1234.0, "1,234")])
def test_format_ratio(value, text):
    assert report.format_ratio(value) == text


@pytest.mark.parametrize("text, size", [("4096", 4096), ("4K", 4 * KiB), ("16kib", 16 * KiB),
                                        ("1M", MiB), ("256MiB", 256 * MiB), ("1G", 1 << 30),
                                        (" 64 K ", 64 * KiB), ("8B", 8)])
def test_parse_size(text, size):
    assert report.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "K", "4T", "-1", "0", "4.5K", "1MM"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        report.parse_size(text)


def test_parse_sizes_sorted_unique_and_format_size():
    assert report.parse_sizes("1M,4K,4096,") == (4 * KiB, MiB)
    with pytest.raises(ValueError):
        report.parse_sizes(" , ")
    assert [report.format_size(n) for n in (8, 4 * KiB, 3 * MiB, 1 << 30, 1000)] == \
        ["8 B", "4 KiB", "3 MiB", "1 GiB", "1000 B"]


def test_json_document_round_trips(tmp_path):
    table = report.build_table(RESULTS, primary="ucxrpc", impls=["ucxrpc", "torch", "ucxx"])
    info = report.machine_info(["ucxrpc", "bench", "--quick"])
    for key in ("hostname", "cpu_count", "torch", "ucxx", "command", "timestamp"):
        assert key in info
    assert info["command"] == "ucxrpc bench --quick"
    doc = report.build_json(table, RESULTS, info, {"sizes": [4096]}, {"torch": "boom"})
    path = tmp_path / "bench.json"
    report.dump_json(path, doc)
    loaded = json.loads(path.read_text(encoding="utf-8"))
    assert loaded["machine"]["hostname"] == info["hostname"]
    assert loaded["errors"] == {"torch": "boom"}
    first = loaded["table"][0]
    assert first["metric"] == "latency_p50_us" and first["better"] == "lower"
    assert first["ratios"] == {"ucxrpc/torch": pytest.approx(0.25), "ucxrpc/raw": pytest.approx(10.0)}
    assert loaded["results"]["torch"]["latency"]["p50_us"] == 200.0


def test_repeated_runs_show_the_median_per_metric():
    runs = [_measurements(p50=p50, p99=400.0, gbps=gbps)
            for p50, gbps in ((100.0, 1.0), (300.0, 5.0), (200.0, 2.0))]
    runs.append(None)                                          # a failed run is left out
    table = report.build_table({"torch": runs, "ucxx": [RESULTS["ucxx"]]},
                               primary="torch", impls=["torch", "ucxx"])
    assert _row(table, "latency_p50_us").values["torch"] == 200.0
    assert _row(table, f"one_way_gbps/{MiB}").values["torch"] == 2.0
    assert _row(table, f"one_way_gbps/{MiB}").ratios[("torch", "ucxx")] == \
        pytest.approx(2.0 / 16.0)


def test_combine_runs_median_even_count_and_missing_metrics():
    a = _measurements(p50=100.0, p99=1.0, gbps=1.0, calls=None)
    b = _measurements(p50=200.0, p99=1.0, gbps=3.0, calls=50.0)
    flat = report.combine_runs([a, b])
    assert flat["latency_p50_us"] == 150.0
    assert flat[f"one_way_gbps/{MiB}"] == 2.0
    assert flat["async_calls_per_s"] == 50.0                  # only one run had it
    assert report.combine_runs([]) == {}
    table = report.build_table({"ucxrpc": [], "torch": [b]}, primary="ucxrpc",
                               impls=["ucxrpc", "torch"])
    assert all(r.values["ucxrpc"] is None for r in table.rows)


def test_best_of_runs_takes_lowest_time_and_highest_rate():
    slow = _measurements(p50=300.0, p99=900.0, gbps=1.0, calls=5_000.0, dict_us=4_000.0)
    fast = _measurements(p50=100.0, p99=200.0, gbps=4.0, calls=9_000.0, dict_us=2_000.0)
    flat = report.combine_runs([slow, None, fast], stat="best")
    assert flat["latency_p50_us"] == 100.0 and flat["latency_p99_us"] == 200.0
    assert flat["dict_echo_p50_us"] == 2_000.0
    assert flat[f"round_trip_gbps/{MiB}"] == 8.0 and flat["async_calls_per_s"] == 9_000.0
    table = report.build_table({"torch": [slow, fast]}, primary="torch", impls=["torch"],
                               stat="best")
    assert _row(table, "latency_p50_us").values["torch"] == 100.0
    with pytest.raises(ValueError):
        report.combine_runs([slow], stat="mean")


def test_direction_of_every_metric_agrees_with_the_key_rule():
    table = report.build_table(RESULTS, primary="ucxrpc", impls=["ucxrpc", "torch", "ucxx"])
    for row in table.rows:
        assert report.lower_is_better(row.metric.key) == (not row.metric.higher_is_better)


def test_bidirectional_rows_follow_round_trip():
    doc = _measurements(p50=50.0, p99=100.0, gbps=1.0)
    doc["bidirectional"] = [{"bytes": MiB, "gbps": 3.0, "iters": 3}]
    table = report.build_table({"ucxrpc": doc}, primary="ucxrpc", impls=["ucxrpc"])
    keys = [r.metric.key for r in table.rows]
    assert keys.index(f"bidirectional_gbps/{MiB}") == keys.index(f"round_trip_gbps/{MiB}") + 1
    row = _row(table, f"bidirectional_gbps/{MiB}")
    assert row.values == {"ucxrpc": 3.0} and row.metric.better == "higher"
    assert "bidirectional bandwidth 1 MiB" in report.render_table(table)


def test_transport_matrix_compares_like_with_like():
    results = {"ucxrpc[tcp]": _measurements(100.0, 200.0, 1.0),
               "ucxrpc[sm]": _measurements(50.0, 100.0, 8.0),
               "torch": _measurements(200.0, 400.0, 2.0),
               "ucxx[tcp]": _measurements(10.0, 20.0, 2.0),
               "ucxx[sm]": _measurements(5.0, 10.0, 16.0)}
    table = report.build_table(results, primary="ucxrpc",
                               impls=["torch", "ucxx[tcp]", "ucxx[sm]", "ucxrpc[tcp]",
                                      "ucxrpc[sm]"])
    assert table.impls[:2] == ("ucxrpc[tcp]", "ucxrpc[sm]")
    assert table.ratio_pairs == (("ucxrpc[tcp]", "torch"), ("ucxrpc[tcp]", "ucxx[tcp]"),
                                 ("ucxrpc[sm]", "torch"), ("ucxrpc[sm]", "ucxx[sm]"))
    row = _row(table, f"one_way_gbps/{MiB}")
    assert row.ratios[("ucxrpc[sm]", "ucxx[sm]")] == pytest.approx(0.5)
    header = report.render_table(table).splitlines()[0]
    assert "ucxrpc [tcp]" in header and "raw ucxx [sm]" in header
    assert "ucxrpc[tcp]/raw[tcp]" in header and "ucxrpc[sm]/torch" in header
    doc = report.build_json(table, results, {}, {})
    assert set(doc["table"][0]["ratios"]) == {"ucxrpc[tcp]/torch", "ucxrpc[tcp]/raw[tcp]",
                                              "ucxrpc[sm]/torch", "ucxrpc[sm]/raw[sm]"}


def _with_cpu(doc: dict, us: float) -> dict:
    doc = json.loads(json.dumps(doc))
    doc["latency"]["cpu_us"] = us
    doc["dict_echo"]["cpu_us"] = 10 * us
    for entry in doc["one_way"]:
        entry["cpu_us"] = 2 * us
    return doc


def test_cpu_per_call_goes_with_each_figure_and_its_own_columns():
    results = {"ucxrpc": _with_cpu(RESULTS["ucxrpc"], 30.0),
               "torch": _with_cpu(RESULTS["torch"], 120.0), "ucxx": RESULTS["ucxx"]}
    flat = report.flatten(results["ucxrpc"])
    assert flat[report.CPU_PREFIX + "latency_p50_us"] == 30.0
    assert report.CPU_PREFIX + "latency_p99_us" not in flat   # one figure per timed run
    assert flat[report.CPU_PREFIX + f"one_way_gbps/{MiB}"] == 60.0
    assert report.lower_is_better(report.CPU_PREFIX + f"one_way_gbps/{MiB}")

    table = report.build_table(results, primary="ucxrpc", impls=["ucxrpc", "torch", "ucxx"])
    assert _row(table, "dict_echo_p50_us").cpu == {"ucxrpc": 300.0, "torch": 1200.0,
                                                   "ucxx": None}
    assert _row(table, f"round_trip_gbps/{MiB}").cpu["ucxrpc"] is None  # not measured
    text = report.render_table(table)
    header = text.splitlines()[0]
    assert header.endswith("CPU µs/call ucxrpc  CPU µs/call torch")  # raw measured none
    assert "user + system time of both processes" in text
    latency_line = next(line for line in text.splitlines() if "latency p50" in line)
    assert latency_line.split()[-2:] == ["30.0", "120"]
    doc = report.build_json(table, results, {})
    row = next(r for r in doc["table"] if r["metric"] == "latency_p50_us")
    assert row["cpu_us_per_call"]["torch"] == 120.0
    # Repeated runs: the best CPU figure is the lowest.
    best = report.combine_runs([results["ucxrpc"], _with_cpu(RESULTS["ucxrpc"], 20.0)], "best")
    assert best[report.CPU_PREFIX + "latency_p50_us"] == 20.0
