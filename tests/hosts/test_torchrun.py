"""``torchrun --nnodes 2`` across the two simulated hosts, running an example
unchanged.

``examples/rnn_remote_embedding.py`` documents ``torchrun --nproc-per-node
2 examples/rnn_remote_embedding.py``; here it runs as two nodes of one
process each, one node per host, meeting through torchrun's c10d
rendezvous hosted on host 0 (``--rdzv-endpoint`` its address), as on two
machines.  Which node gets rank 0 (the trainer) is the rendezvous's choice.
The example's options are its own: nothing restricts UCX's transports, so
it works only if UCX finds the path between the hosts by itself (tcp: the
hosts share no memory).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.hosts._harness import Job, two_hosts, worker_env

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

EXAMPLE = "examples/rnn_remote_embedding.py"
RDZV_PORT = 29400  # any port is free on a brand-new host
RUN_S = 100.0
LOSS = re.compile(r"^step\s+(\d+) loss ([0-9.]+)$", re.MULTILINE)


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun_two_nodes_runs_an_example_unchanged(tmp_path):
    with two_hosts() as hosts:
        a, _ = hosts.hosts
        job = Job(hosts, tmp_path)
        argv = [*_torchrun(), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{a.address}:{RDZV_PORT}", "--rdzv-id", "two-hosts", EXAMPLE]
        try:
            for index, host in enumerate(hosts.hosts):
                job.start(f"node{index}", host, argv, env=worker_env())
            codes = [job.wait_exit(f"node{index}", RUN_S) for index in (0, 1)]
        finally:
            job.stop()
    assert codes == [0, 0], job.logs()
    logs = [(tmp_path / f"node{index}.log").read_text(errors="replace") for index in (0, 1)]
    curves = [[float(loss) for _, loss in LOSS.findall(log)] for log in logs]
    trainer = [curve for curve in curves if curve]
    assert len(trainer) == 1, job.logs()  # the trainer on one host, the table on the other
    (curve,) = trainer
    assert len(curve) >= 10, job.logs()
    # It learns, as in tests/autograd/test_examples.py: the last three steps
    # against the first.
    assert sum(curve[-3:]) / 3 < 0.1 * curve[0], curve
