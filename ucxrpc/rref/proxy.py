"""What an owner runs for ``rref.rpc_sync().method(...)`` and friends."""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from .. import _torch_futures, devices
from ..functions import async_execution
from .owner import registry
from .registry import Handle


__all__: list[str] = []


@async_execution
def _proxy_call(rref: Handle, name: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> torch.futures.Future:
    reg = registry()
    value = reg.entry(rref._rref_id).value
    out = devices.future(reg.agent.devices)
    # The method may run later, on the thread that sets the value: with this
    # call's context variables (a distributed autograd context) all the same,
    # and on this call's streams, where its arguments are recorded; wait()
    # makes them follow the value's work.
    ctx = contextvars.copy_context()
    streams = devices.current_streams(reg.agent.devices)

    def run(f: torch.futures.Future) -> None:
        try:
            with devices.on_streams(streams):
                method = getattr(f.wait(), name)
                result = ctx.run(method, *args, **kwargs)
        except Exception as exc:  # set_exception keeps its type; then() would not
            _torch_futures.fail(out, exc)
            return
        if _is_async(method, result):  # the reply waits for the method's future
            result.add_done_callback(lambda r: _torch_futures.forward(r, out))
        else:
            out.set_result(result)

    value.add_done_callback(run)
    return out


@async_execution
def _invoke_method(rref: Handle, name: str, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> torch.futures.Future:
    """``rref.remote().name(...)`` on the owner: the new RRef's value is the
    method's result, or its future's value for an ``@async_execution``
    method (a future made here, for the others)."""
    method = getattr(rref.local_value(), name)
    result = method(*args, **kwargs)
    if _is_async(method, result):
        return result
    out = devices.future(registry().agent.devices)
    out.set_result(result)
    return out


def _is_async(method: Any, result: Any) -> bool:
    """Whether ``method`` is ``@async_execution`` (as a static or class
    method too) and kept its promise of a future."""
    return (getattr(method, "_wrapped_async_rpc_function", None) is not None
            and isinstance(result, torch._C.Future))
