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
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def plain(fn: F) -> F:
    """Mark one of ucxrpc's own RPC functions (RRef bookkeeping, autograd
    messages) as carrying no autograd history: distributed autograd sends it
    as it is, even inside a context."""
    fn._ucxrpc_plain = True  # type: ignore[attr-defined]
    return fn
