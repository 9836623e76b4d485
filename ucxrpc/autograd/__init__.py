"""Distributed autograd: ``import ucxrpc.autograd as dist_autograd``.

As ``torch.distributed.autograd``::

    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", model_part, (x,)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)

RPCs made inside the block record the tensors requiring grad they carry,
both ways; ``backward`` runs the pass across every worker the forward pass
touched; gradients accumulate in the context, never in ``.grad``.  Unlike
torch's, it works with CUDA tensors too.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ..errors import DistAutogradError
from ._context import CURRENT, DistAutogradContext
from ._engine import backward, get_gradients
from ._engine import release as _release
from ._recording import _debug_info
from ._recording import table as _table

__all__ = ["DistAutogradContext", "DistAutogradError", "backward", "context", "get_gradients"]


class context:  # noqa: N801  (torch's name)
    """``with context() as context_id:`` -- a new context for this thread.

    Its id holds this worker's id in the high 16 bits.  Leaving the block
    releases the context here at once and sends the release to every worker
    it touched (as torch, without waiting for them; graceful shutdown does).
    Contexts do not nest on a thread.
    """

    def __init__(self) -> None:
        self._id: int | None = None
        self._token: Any = None

    def __enter__(self) -> int:
        if CURRENT.get() is not None:
            raise DistAutogradError("Already have an autograd context id for this thread.")
        ctx = _table().new()
        self._id = ctx.id
        self._token = CURRENT.set(ctx.id)
        return ctx.id

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        CURRENT.reset(self._token)
        if self._id is not None:
            _release(self._id)


def _current_context() -> DistAutogradContext:
    """This thread's context (torch's private helper of the same name)."""
    context_id = CURRENT.get()
    if context_id is None:
        raise DistAutogradError("Current thread doesn't have a valid autograd context. Please "
                                "wrap your code using: `with torch.distributed.autograd."
                                "context() as context_id` to generate a valid context id.")
    return _table().get(context_id)


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return _table().get(context_id)


def _is_valid_context(context_id: int) -> bool:
    return _table().find(context_id) is not None


def _get_debug_info() -> dict[str, int]:
    return _debug_info(_table())

