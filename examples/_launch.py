"""Start an example's workers: under torchrun (RANK and WORLD_SIZE set) each
process runs one rank; run directly, the example spawns all its ranks here."""

from __future__ import annotations

import os
from typing import Callable

import torch.multiprocessing as mp

from ucxrpc.rendezvous import free_port


def _run(rank: int, world_size: int, main: Callable[[int, int], None]) -> None:
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    main(rank, world_size)


def launch(main: Callable[[int, int], None], world_size: int) -> None:
    """Call ``main(rank, world_size)`` in every rank; init_method is env://."""
    if "RANK" in os.environ:
        main(int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", world_size)))
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(_run, args=(world_size, main), nprocs=world_size, join=True)
