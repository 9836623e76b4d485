"""Libraries built on torch's RPC, unmodified, on ucxrpc: the programs in
examples/libraries/ run under ``python -m ucxrpc.torch_rpc``.

* TorchRL's ``RPCCollector``: two collector processes feed the trainer
  2,000 CartPole frames in 10 batches, the weights pushed back after each.
* FairScale's ``DistributedPipeline``: two stages of RemoteModules in two
  micro-batches, ``RRef.backward`` and ``DistributedOptimizer``; each step's
  loss is the loss of the same model trained in one process.

Each needs its library (the module docstrings say how to install it) and
is skipped without it: CI does not install them.  Each program runs in its
own session, bounded in time, its process group killed afterwards
(``test_as_torch._run``).
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

from tests.rpc.test_as_torch import _run

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "libraries"


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module}: see its example's docstring")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@_needs("torchrl")
def test_torchrls_rpc_collector_runs_on_ucxrpc() -> None:
    result = _run(["-m", "ucxrpc.torch_rpc", str(EXAMPLES / "torchrl_rpc_collector.py"),
                   str(_free_port())])
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rpc: ucxrpc; frames 2000 batches 10" in result.stdout, result.stdout


@_needs("fairscale")
def test_fairscales_pipeline_trains_as_the_model_in_one_process() -> None:
    result = _run(["-m", "ucxrpc.torch_rpc", str(EXAMPLES / "fairscale_pipeline.py"),
                   str(_free_port()), "2"])
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" losses ") for line in result.stdout.splitlines()
                 if " losses " in line)
    assert set(lines) == {"ucxrpc", "local"}, result.stdout
    assert lines["ucxrpc"] == lines["local"], result.stdout
