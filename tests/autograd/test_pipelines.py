"""Pipelines train as the same model trained in one process.

tests/autograd/pipelines.py, a program that runs unchanged on either agent,
drives the matrix (2, 3 and 4 workers; 1, 2, 4 and 8 micro-batches passed
stage to stage as RRefs; no checkpointing, torch's reentrant and its
non-reentrant checkpoint; the loss on the driver or on the last stage) and
compares each step's loss and every parameter with local math.  Here its
cells run in the suite's worker processes with ``torch.distributed.rpc``
swapped for ucxrpc (as the launcher swaps it), and FairScale's as the
program under ``python -m ucxrpc.torch_rpc``, in a session of its own,
bounded in time and killed after (``test_as_torch._run``).  What torch's agent gives
for the same matrix is in README.md (the same cells on both agents).
"""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest

from tests.rpc.test_as_torch import _run
from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

PROGRAM = Path(__file__).with_name("pipelines.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cells(*flags: str) -> list[dict]:
    result = _run(["-m", "ucxrpc.torch_rpc", str(PROGRAM), str(_free_port()), *flags],
                  timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.rstrip().endswith("done"), result.stdout[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _matrix(rank: int, world_size: int, init_method: str) -> list[dict] | None:
    """A worker of the matrix: ``torch.distributed.rpc`` is ucxrpc, as under
    ``python -m ucxrpc.torch_rpc``; rank 0 drives every cell.  (Forked from
    the suite's server, which imported torch: the program itself pays ~8 s
    more to start four interpreters.)"""
    import ucxrpc.torch_rpc

    ucxrpc.torch_rpc.install()
    import torch.distributed.rpc as rpc

    from tests.autograd import pipelines

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init_method,
                                                                     rpc_timeout=60))
    out = list(pipelines.cells()) if rank == 0 else None
    rpc.shutdown()
    return out


def test_every_pipeline_of_the_matrix_trains_as_local_math_on_ucxrpc() -> None:
    cells = run_workers(_matrix, 4, timeout=200)[0]
    assert len(cells) == 3 * 4 * 3 * 2
    for cell in cells:
        if "checkpoint=reentrant" in cell["cell"]:
            # torch's reentrant checkpoint hides its parameters from the
            # pass: refused with torch's reason on both agents, at once.
            assert cell.get("refused"), cell
            assert "use use_reentrant=False" in cell["error"], cell
        else:
            assert cell["equal"], cell


@pytest.mark.skipif(importlib.util.find_spec("fairscale") is None,
                    reason="needs fairscale (in the test extra): pip install fairscale==0.4.13")
def test_fairscales_pipelines_train_as_local_math_where_torch_can() -> None:
    cells = _cells("--fairscale")
    assert len(cells) == 3 * 4 * 3 * 2
    for cell in cells:
        assert "error" not in cell, cell
        if "checkpoint=always" not in cell["cell"]:
            assert cell["equal"], cell  # never, and except_last (its default)
        else:
            # With every micro-batch checkpointed no parameter moves, on
            # torch's agent alike (the same losses): FairScale's to mend.
            assert cell["losses"][0] == cell["losses"][-1], cell
