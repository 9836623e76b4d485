"""Per-size statistics, step counts and the configuration: no processes."""

from __future__ import annotations

import json

import pytest

from ucxrpc.bench import workload


def test_size_stats_min_median_max():
    stats = workload.size_stats([0.004, 0.001, 0.002], size=1_000_000, factor=2)
    assert stats["iters"] == 3
    assert (stats["min_s"], stats["median_s"], stats["max_s"]) == (0.001, 0.002, 0.004)
    assert stats["gbps"] == pytest.approx(2e6 / 0.002 / 1e9)
    assert stats["gbps_min"] == pytest.approx(2e6 / 0.004 / 1e9)   # from the slowest call
    assert stats["gbps_max"] == pytest.approx(2e6 / 0.001 / 1e9)
    assert stats["gbps_min"] <= stats["gbps"] <= stats["gbps_max"]


def test_size_stats_even_count_median_and_empty():
    stats = workload.size_stats([1.0, 3.0, 2.0, 4.0], size=10, factor=1)
    assert stats["median_s"] == 2.5
    with pytest.raises(ValueError):
        workload.size_stats([], size=10, factor=1)


def test_step_counts_match_the_sections():
    cfg = workload.quick_config()
    sized = len(workload.SECTIONS) * len(cfg.sizes)
    assert workload.count_steps("ucxrpc", cfg) == workload.count_steps("torch", cfg) == 3 + sized
    assert workload.count_steps("ucxx", cfg) == 1 + sized
    assert set(workload.SECTIONS) == {"one_way", "round_trip", "bidirectional"}


def test_config_is_json_ready():
    cfg = workload.quick_config(transports=("tcp",), device="cuda")
    doc = json.loads(json.dumps(workload.describe_config(cfg)))
    assert doc["transports"] == ["tcp"] and doc["device"] == "cuda"
    assert doc["sizes"] == list(cfg.sizes)
    assert workload.WorkloadConfig().sizes[-1] == 256 << 20


def test_the_raw_baseline_sends_memory_allocated_as_the_calls_tensors_are():
    """Raw ucxx sends what torch's allocator made, as ucxrpc and torch's
    agent send the workload's tensors: a numpy array of 4 MiB or more gets
    huge pages, which the kernel's copy reads faster, a head start the
    baseline had over every large host tensor (benchmarks/runs/AY.md).
    What it receives into stays a numpy array (huge pages, as ucxrpc's
    pooled receive buffers are)."""
    import torch

    from ucxrpc.bench import raw

    sent = raw._buffer(4 << 20, 1, "cpu", sent=True)
    assert isinstance(sent.base, torch.Tensor) and sent.nbytes == 4 << 20
    assert int(sent[0]) == int(sent[-1]) == 1  # every page touched before timing
    received = raw._buffer(4 << 20, 0, "cpu")
    assert not isinstance(received.base, torch.Tensor) and int(received[-1]) == 0
