"""What an owner runs for ``rref.rpc_sync().method(...)`` and friends."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import torch

from .. import devices
from ..functions import async_execution
from .owner import registry

if TYPE_CHECKING:
    from .handle import RRef

__all__: list[str] = []


@async_execution
def _proxy_call(rref: RRef[Any], name: str, args: tuple[Any, ...],
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
                out.set_result(ctx.run(getattr(f.wait(), name), *args, **kwargs))
        except Exception as exc:  # set_exception keeps its type; then() would not
            out.set_exception(exc)

    value.add_done_callback(run)
    return out


def _invoke_method(rref: RRef[Any], name: str, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    return getattr(rref.local_value(), name)(*args, **kwargs)
