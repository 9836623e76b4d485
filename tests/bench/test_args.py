"""``ucxrpc bench`` arguments and launch environment, checked before anything starts."""

from __future__ import annotations

import os
import time

import pytest

from ucxrpc.bench import build_parser, main, compared
from ucxrpc.bench.hosts import host_env

LAUNCH = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_not_launched():
    assert host_env({}) is None
    assert host_env({"MASTER_ADDR": "x", "MASTER_PORT": "1"}) is None


def test_launched_by_torchrun():
    env = host_env({**LAUNCH, "RANK": "1", "LOCAL_RANK": "0",
                    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "abc"})
    assert env is not None
    assert (env.rank, env.master_addr, env.master_port) == (1, "10.0.0.1", 29500)
    assert env.agent_store and env.prefix == "ucxrpc-bench/abc/0"
    assert not host_env(LAUNCH).agent_store


@pytest.mark.parametrize("change, message", [
    ({"WORLD_SIZE": "4"}, "exactly 2 ranks"),
    ({"WORLD_SIZE": "1"}, "exactly 2 ranks"),
    ({"RANK": "2"}, "RANK must be 0 or 1"),
    ({"MASTER_ADDR": ""}, "without MASTER_ADDR"),
    ({"MASTER_PORT": "http"}, "malformed"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
])
def test_bad_launch_environment(change, message):
    with pytest.raises(ValueError, match=message):
        host_env({**LAUNCH, **change})


def test_bad_launch_environment_is_a_usage_error(monkeypatch, capsys):
    for key, value in {**LAUNCH, "WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--quick"]) == 2
    assert "WORLD_SIZE=3" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--transports", "tcp;"], "empty transport choice"),
    (["--sizes", "1M..4K"], "backwards"),
    (["--repeat", "0"], "--repeat"),
    (["--time-per-size", "0"], "--time-per-size"),
    (["--device", "tpu"], "invalid choice"),
    (["--load", "-1"], "--load must be 0 or more"),
])
def test_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cuda_without_a_gpu_fails_clearly(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: this checks the message without one")
    assert main(["--device", "cuda", "--quick", "--no-json", "--no-plot", "--local"]) == 2
    assert "no usable CUDA GPU" in capsys.readouterr().err


def test_help_documents_defaults_and_multi_host(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for needle in ("4K..256 MiB", "1 GiB with --device cuda", "ucxrpc-bench.json",
                   "'tcp;sm;all'", "torchrun --nnodes 2", "--progress"):
        assert needle in text, needle
    args = build_parser().parse_args(["--transports", "tcp", "--transports", "sm"])
    assert args.transports == ["tcp", "sm"]


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_rank0_without_rank1_gives_up_at_the_deadline(monkeypatch, capsys):
    from tests.workers import free_port

    for key, value in {**LAUNCH, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert main(["--quick", "--timeout", "2", "--no-json", "--no-plot"]) == 2
    assert "rank 1 did not join" in capsys.readouterr().err


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.processes
def test_busy_load_runs_busy_processes_and_ends_them():
    from ucxrpc.bench.launch import busy_load

    with busy_load(2) as pids:
        assert len(pids) == 2
        deadline = time.monotonic() + 30
        while min(_cpu_seconds(p) for p in pids) < 0.2:  # they spin
            assert time.monotonic() < deadline, "the busy processes used no CPU"
            time.sleep(0.05)
    for pid in pids:  # killed and reaped: gone from /proc
        assert not os.path.exists(f"/proc/{pid}")
    with busy_load(0) as pids:
        assert pids == []


def test_the_bench_compares_with_torch_and_raw_ucxx_unless_told_otherwise():
    # The main job's figures are ratios to torch's agent (and raw UCX):
    # without --compare both run beside ucxrpc.
    assert compared(build_parser().parse_args([]).compare) == ["torch", "ucxx"]
    assert compared(build_parser().parse_args(["--compare", "torch"]).compare) == ["torch"]
    assert compared(build_parser().parse_args(["--compare", "none"]).compare) == []
