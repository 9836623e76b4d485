"""``ucxrpc bench`` arguments and launch environment, checked before anything starts."""

from __future__ import annotations

import json
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


# -- --hosts netns -----------------------------------------------------------------

def test_hosts_netns_parses_and_only_netns():
    assert build_parser().parse_args([]).hosts is None   # as before: this host, or torchrun
    assert build_parser().parse_args(["--hosts", "netns"]).hosts == "netns"


def test_hosts_takes_no_other_value(capsys):
    assert main(["--hosts", "docker"]) == 2
    assert "invalid choice: 'docker'" in capsys.readouterr().err


def test_help_documents_hosts_netns(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--hosts {netns}" in text and "simulated hosts" in text
    assert "Needs root" in text
    # The "across two hosts" epilog names it too.
    epilog = text[text.index("across two hosts:"):]
    assert "--hosts netns" in epilog and "needs root" in epilog


def test_hosts_netns_without_root_says_what_it_needs(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["--hosts", "netns", "--quick", "--no-json", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "--hosts netns" in err and "need root" in err
    assert "iproute2" in err and "util-linux" in err


def test_hosts_netns_ignores_the_launcher_variables(monkeypatch, capsys):
    # Like --local: both ranks run on this machine, whatever RANK/WORLD_SIZE say.
    for key, value in {**LAUNCH, "WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["--hosts", "netns", "--quick", "--no-json", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "need root" in err and "WORLD_SIZE" not in err


def test_a_rank_started_by_hosts_netns_is_a_launched_rank(monkeypatch, capsys):
    # The ranks get the user's argv, --hosts netns and --local included, and
    # the invoker's variable: they run as launched ranks, never making hosts.
    from ucxrpc.bench import simhosts

    for key, value in {**LAUNCH, "WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(simhosts.ENV, json.dumps({"kind": "netns", "machine": "m"}))
    assert main(["--hosts", "netns", "--local", "--quick", "--no-json", "--no-plot"]) == 2
    assert "WORLD_SIZE=3" in capsys.readouterr().err


def test_a_malformed_simulated_hosts_variable_is_a_usage_error(monkeypatch, capsys):
    from ucxrpc.bench import simhosts

    assert simhosts.simulated_hosts({}) is None
    assert simhosts.simulated_hosts({simhosts.ENV: '{"kind": "netns"}'}) == {"kind": "netns"}
    monkeypatch.setenv(simhosts.ENV, "not json")
    assert main(["--quick", "--no-json", "--no-plot"]) == 2
    assert f"{simhosts.ENV} is set but malformed" in capsys.readouterr().err


def test_each_rank_is_launched_as_across_two_hosts():
    from ucxrpc.bench import simhosts
    from ucxrpc.bench.netns import Hosts

    hosts = Hosts()   # names and addresses only: nothing is made before __enter__
    a, b = hosts.hosts
    mine = {"RANK": "7", "WORLD_SIZE": "9", "LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "x",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "UCX_NET_DEVICES": "eth0",
            "UCX_TLS": "tcp", "PYTHONPATH": "/elsewhere", "HOME": "/root"}
    doc = {"kind": "netns", "machine": "m"}
    envs = [simhosts.rank_env(hosts, h, doc, mine) for h in (a, b)]
    for rank, (host, env) in enumerate(zip((a, b), envs)):
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", "0")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (a.address, "29500")
        assert env["UCX_NET_DEVICES"] == env["TP_SOCKET_IFNAME"] == host.veth
        assert not any(k.startswith("TORCHELASTIC_") for k in env)
        assert env["UCX_TLS"] == "tcp" and env["HOME"] == "/root"   # the user's, kept
        assert env["PYTHONPATH"].endswith(os.pathsep + "/elsewhere")
        assert json.loads(env[simhosts.ENV]) == doc
        launched = host_env(env)
        assert launched is not None and launched.rank == rank and not launched.agent_store
    hosts.close()
