"""``DistributedOptimizer``, as ``torch.distributed.optim``."""

from __future__ import annotations

from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
