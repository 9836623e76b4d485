"""Two simulated hosts for the benchmark tools that start ranks of their
own (``switches.py``, ``alternate.py``): network namespaces joined by a
veth pair, as ``ucxrpc bench --hosts netns`` makes them (root)."""

from __future__ import annotations

import os
from typing import Sequence


def run_ranks(tag: str, argv: Sequence[str], timeout_s: float = 600.0) -> None:
    """Run ``argv`` as rank 0 on one host and rank 1 on the other (``RANK``,
    ``MASTER_ADDR`` and the rest as the bench's ranks get them), wait for
    both, and delete the hosts.

    Raises:
        RuntimeError: a rank failed.
    """
    from ucxrpc.bench import simhosts
    from ucxrpc.bench.netns import Hosts

    with Hosts(tag=tag) as hosts:
        doc = {"kind": "netns", "machine": os.uname().nodename, "command": os.path.basename(
            argv[1]) if len(argv) > 1 else "", "link": "veth", "hosts": []}
        procs = []
        for host in hosts.hosts:
            env = simhosts.rank_env(hosts, host, doc)
            env.pop(simhosts.ENV, None)  # not a bench rank
            procs.append(hosts.popen(host, list(argv), env=env))
        for p in procs:
            p.wait(timeout=timeout_s)
        codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"a rank failed (exit codes {codes}): {' '.join(argv)}")
