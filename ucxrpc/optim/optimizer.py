"""DistributedOptimizer: one local optimizer per parameter owner.

``step(context_id)`` asks every owner at once to load that context's
gradients into its parameters and step its optimizer.  An owner steps one
optimizer at a time (whoever asks: several trainers may share parameters), and
puts back whatever ``.grad`` held before, so the context's gradients never
leak into ``.grad`` beyond the step.  On CUDA, a step reads the gradients
after the streams that accumulated them, and is finished on the GPU when
``step`` returns.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from .. import api, devices
from .. import autograd as dist_autograd
from ..functions import _plain
from ..rref import RRef

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """The optimizer on one owner, over the parameters it owns."""

    # One step at a time on this worker, as torch: optimizers are not
    # thread-safe and several trainers may own a share of the same parameters.
    _step_lock = threading.Lock()

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params: list[RRef[Any]],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.params = [p.local_value() for p in params]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        # The gradients' accumulations (on other streams) come first.
        grads = dist_autograd.get_gradients(context_id)
        with self._step_lock:
            saved = [p.grad for p in self.params]
            try:
                for p in self.params:
                    p.grad = grads.get(p)
                self.optimizer.step()
            finally:
                for p, g in zip(self.params, saved):
                    p.grad = g
            # Done means done: the reply carries no CUDA tensor, so nothing
            # else waits for the update, and the next forward pass is served
            # on another stream.  No-op for parameters on the CPU.
            devices.settle(self.params)


@_plain
def _create(optimizer_class: type[torch.optim.Optimizer], params: list[RRef[Any]],
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> RRef[_LocalOptimizer]:
    return RRef(_LocalOptimizer(optimizer_class, params, args, kwargs))


@_plain
def _step(optimizer: RRef[_LocalOptimizer], context_id: int) -> None:
    optimizer.local_value().step(context_id)


class DistributedOptimizer:
    """``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)``.

    ``params_rref`` lists RRefs of parameters, on any workers;
    ``optimizer_class(local_params, *args, **kwargs)`` is built on each owner
    (any ``torch.optim`` optimizer works).  Creation errors (a bad argument
    for the optimizer, say) raise here with their own type.
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params_rref: list[RRef[Any]],
                 *args: Any, **kwargs: Any) -> None:
        by_owner: dict[Any, list[RRef[Any]]] = defaultdict(list)
        for p in params_rref:
            if not isinstance(p, RRef):
                raise TypeError(f"DistributedOptimizer takes RRefs of parameters, got a "
                                f"{type(p).__name__}")
            by_owner[p.owner()].append(p)
        agent = api._current()
        futs = {owner: api.rpc_async(owner, _create, (optimizer_class, params, args, kwargs))
                for owner, params in by_owner.items()}
        self.remote_optimizers: list[RRef[_LocalOptimizer]] = [agent.wait(f) for f in futs.values()]

    def step(self, context_id: int) -> None:
        """Update every owner's parameters from the gradients in ``context_id``,
        all owners at once; returns when all have stepped.

        Raises the first owner's error, which names the owner (an unreachable
        owner, a context it does not have); the other owners still step.
        """
        agent = api._current()
        futs = [api.rpc_async(opt.owner(), _step, (opt, context_id))
                for opt in self.remote_optimizers]
        errors = []
        for fut in futs:
            try:
                agent.wait(fut)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
