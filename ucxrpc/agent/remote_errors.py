"""Errors across the wire: a callee's exception described, and rebuilt on
the caller with its own type where that can be done (as torch does), else
as a :class:`~ucxrpc.errors.RemoteError` naming the type and the worker."""

from __future__ import annotations

import pickle
import sys
import traceback
from typing import Any

import torch

from ..errors import RemoteError, RpcError, RpcTimeoutError, SerializationError
from .info import WorkerInfo

__all__ = ["describe_exception", "not_a_future", "rebuild_exception", "timeout_error",
           "undecodable_request", "user_failure"]


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


def user_failure(func: Any, args: Any, kwargs: Any, exc: Exception,
                 where: WorkerInfo) -> Exception:
    """What a callee answers when the function it was asked to run raised.

    As torch's agent, the failure is also printed on this worker's stderr
    (torch's ``_run_function`` prints it; its tests read it there).  A torch
    builtin op whose arguments match none of its schemas fails as it does
    in torch: a RuntimeError "Overloaded torch operator invoked from Python
    failed to match any schema", listing each schema's mismatch, where
    Python's binding raised a TypeError.
    """
    print(f"On {where}:\n{exc!r}\n"
          + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
          file=sys.stderr)
    if isinstance(exc, TypeError):
        op = torch.jit._builtins._find_builtin(func)
        if op is not None:
            try:
                torch._C._jit_resolve_packet(op, *(args or ()), **(kwargs or {}))
            except RuntimeError as schema_error:
                schema_error.__cause__ = exc
                return schema_error
    return exc


def undecodable_request(exc: Exception, me: str, peer: str) -> SerializationError:
    """A request ``me`` cannot unpickle; a function or class missing here
    (an AttributeError while unpickling) gets torch's hint."""
    hint = ""
    if isinstance(exc.__cause__, AttributeError) or isinstance(exc, AttributeError):
        hint = (" Default RPC pickler does not serialize function code. Ensure that UDFs are "
                "defined on both caller and callee modules.")
    err = SerializationError(f"{me} cannot decode a request from {peer}: {exc}{hint}")
    err.__cause__ = exc
    return err


def describe_exception(exc: BaseException, where: WorkerInfo) -> bytes:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    # The type travels pickled on its own: a caller that cannot load it
    # still gets the rest (which worker, the traceback).
    try:
        cls: bytes | None = pickle.dumps(type(exc), protocol=5)
    except Exception:  # the exception's class cannot be pickled by reference
        cls = None
    desc: dict[str, Any] = {"type": cls, "name": type(exc).__qualname__,
                            "tb": tb, "worker": repr(where), "worker_name": where.name}
    return pickle.dumps(desc, protocol=5)


def rebuild_exception(body: memoryview) -> BaseException:
    """The remote exception with its own type where it can be rebuilt, else
    a RemoteError whose message holds the original one (as torch's, it says
    "Original exception on remote side was ...")."""
    try:
        desc = pickle.loads(body)
    except Exception as exc:  # a corrupt body
        return RemoteError(f"a remote call failed and its error could not be decoded: {exc}")
    msg = f"On {desc['worker']}:\n{desc['tb']}"
    rebuilt: BaseException | None = None
    why = ""
    try:
        cls = None if desc["type"] is None else pickle.loads(desc["type"])
    except Exception as exc:  # the type does not exist here
        cls, why = None, f"Failed to load the original exception type: {exc!r}."
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            rebuilt = cls(msg)
        except Exception as exc:
            why = f"Failed to create original exception type. Error msg was {exc!r}."
    elif desc["type"] is None:
        why = "The original exception type could not be pickled."
    if rebuilt is None:
        rebuilt = RemoteError(f"{why} Original exception on remote side was {msg}",
                              worker=desc["worker_name"], remote_type=desc["name"],
                              remote_traceback=desc["tb"])
    setattr(rebuilt, "remote_traceback", desc["tb"])
    return rebuilt
