"""Errors across the wire: a callee's exception described, and rebuilt on
the caller with its own type where that can be done (as torch does), else
as a :class:`~ucxrpc.errors.RemoteError` naming the type and the worker."""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from ..errors import RemoteError, RpcError, RpcTimeoutError
from .info import WorkerInfo

__all__ = ["describe_exception", "not_a_future", "rebuild_exception", "timeout_error"]


def timeout_error(timeout: float) -> RpcTimeoutError:
    """torch's message for a call that ran past its timeout."""
    return RpcTimeoutError(f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) "
                           "and will now be marked with an error")


def not_a_future(func: Any, result: Any) -> RpcError:
    """An ``@async_execution`` function returned something else, in torch's
    words (a RuntimeError, which torch's tests match on)."""
    return RpcError("Functions decorated with @rpc.async_function must return a "
                    f"torch.futures.Future object, but got {type(result)} "
                    f"(from {getattr(func, '__qualname__', func)})")


def describe_exception(exc: BaseException, where: WorkerInfo) -> bytes:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    desc: dict[str, Any] = {"type": type(exc), "name": type(exc).__qualname__,
                            "tb": tb, "worker": repr(where), "worker_name": where.name}
    try:
        return pickle.dumps(desc, protocol=5)
    except Exception:  # the exception's class cannot be pickled by reference
        desc["type"] = None
        return pickle.dumps(desc, protocol=5)


def rebuild_exception(body: memoryview) -> BaseException:
    """The remote exception with its own type where it can be rebuilt."""
    try:
        desc = pickle.loads(body)
    except Exception as exc:  # the type does not exist here, etc.
        return RemoteError(f"a remote call failed and its error could not be decoded: {exc}")
    msg = f"On {desc['worker']}:\n{desc['tb']}"
    cls = desc.get("type")
    rebuilt: BaseException | None = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            rebuilt = cls(msg)
        except Exception:
            rebuilt = None
    if rebuilt is None:
        rebuilt = RemoteError(msg, worker=desc["worker_name"], remote_type=desc["name"],
                              remote_traceback=desc["tb"])
    setattr(rebuilt, "remote_traceback", desc["tb"])
    return rebuilt
