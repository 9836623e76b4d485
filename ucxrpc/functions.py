"""``@async_execution``: the function returns a Future; the reply waits for it."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["async_execution"]


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future``.

    The callee's thread is released as soon as ``fn`` returns; the response is
    sent when the future completes (its exception, if any, is re-raised on
    the caller).  Stacks under ``@staticmethod`` / ``@classmethod``.

    With CUDA tensors in the result, as in torch: the reply is sent from
    the future's callback, on the streams current where the future is
    completed.  Complete it on the streams that made its tensors (or after
    synchronizing them), or return a future that knows its devices
    (``torch.futures.Future(devices=...)``, which an ``rpc_async`` returns).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _plain(fn: F) -> F:
    """Mark one of ucxrpc's own RPC functions (RRef bookkeeping, autograd
    messages) as carrying no autograd history: distributed autograd sends it
    as it is, even inside a context."""
    fn._ucxrpc_plain = True  # type: ignore[attr-defined]
    return fn
