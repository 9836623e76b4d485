"""Start an example's workers: under torchrun (RANK and WORLD_SIZE set) each
process runs one rank; run directly, the example spawns all its ranks here,
through ucxrpc's launcher (the one its tests and benchmark use)."""

from __future__ import annotations

import os
import sys
from typing import Callable

from ucxrpc._launch import free_port, start

#: After one rank fails, how long the others get to fail on their own (their
#: errors often say more) before they are stopped.
FAILURE_GRACE_S = 5.0


def _run(rank: int, main: Callable[[int, int], None]) -> None:
    os.environ["RANK"] = str(rank)
    main(rank, int(os.environ["WORLD_SIZE"]))


def launch(main: Callable[[int, int], None], world_size: int) -> None:
    """Call ``main(rank, world_size)`` in every rank; init_method is env://.

    Run directly, waits for every rank without a time limit, as a training
    job does; when a rank fails, the others are stopped and this process
    exits with status 1 after printing each failed rank's error.
    """
    if "RANK" in os.environ:
        main(int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", world_size)))
        return
    env = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
           "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port()),
           "WORLD_SIZE": str(world_size)}
    with start(_run, [(rank, main) for rank in range(world_size)], env=env,
               names=[f"rank{rank}" for rank in range(world_size)]) as ranks:
        outcomes = ranks.collect(None, failure_grace=FAILURE_GRACE_S)
    for out in outcomes:
        if out.error is not None:
            print(f"rank {out.rank} failed:\n{out.error}", file=sys.stderr)
        elif not out.ok:
            print(f"rank {out.rank} was stopped after another rank failed", file=sys.stderr)
    if not all(out.ok for out in outcomes):
        sys.exit(1)
