"""Pipelines train as the same model trained in one process.

tests/autograd/pipelines.py, a program that runs unchanged on either agent,
drives the matrix (2, 3 and 4 workers; 1, 2, 4 and 8 micro-batches passed
stage to stage as RRefs; no checkpointing, torch's reentrant and its
non-reentrant checkpoint; the loss on the driver or on the last stage) and
compares each step's loss and every parameter with local math; with
FairScale installed, FairScale's ``DistributedPipeline`` over the same
matrix too.  Here both matrices' cells run in one start of the suite's
worker processes, ``torch.distributed.rpc`` swapped for ucxrpc (as the
launcher swaps it); FairScale under the launcher itself is
tests/rpc/test_libraries.py's.  What torch's agent gives for the same
matrix is in README.md (the same cells on both agents).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


def _matrix(rank: int, world_size: int, init_method: str,
            fairscale: bool) -> dict[str, list[dict]] | None:
    """A worker of the matrices: ``torch.distributed.rpc`` is ucxrpc, as
    under ``python -m ucxrpc.torch_rpc``; rank 0 drives every cell, our own
    pipeline's then FairScale's.  (Forked from the suite's server, which
    imported torch: the program itself pays ~8 s more to start four
    interpreters, and FairScale's matrix as a program of its own paid that
    again; FairScale under the launcher is test_libraries.py's.)"""
    import ucxrpc.torch_rpc

    ucxrpc.torch_rpc.install()
    import torch.distributed.rpc as rpc

    from tests.autograd import pipelines

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init_method,
                                                                     rpc_timeout=60))
    out = None
    if rank == 0:
        out = {"own": list(pipelines.cells()),
               "fairscale": list(pipelines.cells(fairscale=True)) if fairscale else []}
    rpc.shutdown()
    return out


@pytest.fixture(scope="module")
def matrices() -> dict[str, list[dict]]:
    """Both matrices' cells, from one start of four workers."""
    fairscale = importlib.util.find_spec("fairscale") is not None
    return run_workers(_matrix, 4, args=(fairscale,), timeout=270)[0]


def test_every_pipeline_of_the_matrix_trains_as_local_math_on_ucxrpc(matrices) -> None:
    cells = matrices["own"]
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
def test_fairscales_pipelines_train_as_local_math_where_torch_can(matrices) -> None:
    cells = matrices["fairscale"]
    assert len(cells) == 3 * 4 * 3 * 2
    for cell in cells:
        assert "error" not in cell, cell
        if "checkpoint=always" not in cell["cell"]:
            assert cell["equal"], cell  # never, and except_last (its default)
        else:
            # With every micro-batch checkpointed no parameter moves, on
            # torch's agent alike (the same losses): FairScale's to mend.
            assert cell["losses"][0] == cell["losses"][-1], cell
