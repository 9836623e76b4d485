"""Recording the forward pass: send/recv pairs on every RPC made in a context.

A call made inside a context (``rpc_sync``, ``rpc_async``, ``remote``, RRef
proxies and ``to_here``, RemoteModule: everything that goes through
``RpcAgent.call``) is rewritten by :func:`_wrap_call` into a call of
:func:`_run` (or :func:`_run_async`) on the callee, with the context id, the
sender's id and send id, and a :class:`GradCapture` ahead of the user's
function and arguments.  The capture pairs the tensors requiring grad that
left the sender with those the callee rebuilt, in order, whatever objects
they sat in.  The callee runs the function inside the context (so its own
calls are recorded too) and answers with a :class:`_Reply`, which records the
returned tensors the same way in the other direction.

Functions marked with :func:`ucxrpc.functions._plain` (the autograd and RRef
machinery's own messages) are sent as they are.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable

import torch

from .. import _torch_futures, api, devices
from ..agent import RpcAgent, WorkerInfo
from ..functions import async_execution
from ..serialization.pickler import GradCapture
from ._context import CURRENT, ContextTable, DistAutogradContext


def table(agent: RpcAgent | None = None) -> ContextTable:
    """This worker's contexts; the first use hooks autograd into the agent."""
    return (agent or api._current()).extension("autograd", _hook)


def _hook(agent: RpcAgent) -> ContextTable:
    tbl = ContextTable(agent.info.id)
    agent.hooks.wrap_call = functools.partial(_wrap_call, tbl, agent.devices)
    agent.hooks.debug_sources.append(functools.partial(_debug_info, tbl))
    agent.hooks.on_peer_failure.append(tbl.drop_created_by)
    agent.hooks.dist_backward = _dist_backward
    return tbl


#: The engine's ``backward`` (``_engine.py`` registers it when it loads: it
#: builds on this module, which so need not import it back).
BACKWARD: list[Callable[[int, list[Any], bool], None]] = []


def _dist_backward(context_id: int, roots: list[Any], retain_graph: bool) -> None:
    """Distributed backward, for ``RRef.backward`` run on the RRef's owner
    (the RRef layer sits below this package and reaches it through the
    agent's hooks)."""
    BACKWARD[0](context_id, roots, retain_graph)


def _debug_info(tbl: ContextTable) -> dict[str, int]:
    return {"num_autograd_contexts": len(tbl),
            "num_current_backward_passes": tbl.backward_passes}


# -- sender -------------------------------------------------------------------

def _wrap_call(tbl: ContextTable, devs: list[torch.device], to: WorkerInfo, func: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    context_id = CURRENT.get()
    if context_id is None or getattr(func, "_ucxrpc_plain", False):
        return None
    ctx = tbl.find(context_id)
    if ctx is None:  # released while a thread of the with block still runs
        return None
    capture = GradCapture()
    send_id = tbl.next_send_id()
    ctx.add_send(send_id, to.id, capture)
    is_async = getattr(func, "_wrapped_async_rpc_function", None) is not None
    runner = _run_async if is_async else _run
    # The capture goes before the function: a bound method's module
    # parameters are recorded too.
    wrapped_args = (context_id, tbl.me, send_id, capture, func, args, kwargs)
    return runner, wrapped_args, {}, functools.partial(_unwrap_reply, tbl, devs, to.id)


def _unwrap_reply(tbl: ContextTable, devs: list[torch.device], peer: int,
                  fut: torch.futures.Future) -> torch.futures.Future:
    # Not fut.then(): a callback's exception would come out as a RuntimeError,
    # and callers rely on the remote exception's own type.  Made as the
    # agent makes its own: a caller with CUDA devices gets a CUDA-aware future.
    out = devices.future(devs)

    def done(f: torch.futures.Future) -> None:
        try:
            reply = f.value()
            if reply.capture.tensors:
                ctx = tbl.find(reply.context_id)
                if ctx is not None:
                    ctx.add_recv(peer, reply.send_id, reply.capture.tensors)
        except Exception as exc:
            _torch_futures.fail(out, exc)
            return
        out.set_result(reply.value)

    fut.add_done_callback(done)
    return out


# -- callee -------------------------------------------------------------------

class _Reply:
    """A return value and the record of its tensors requiring grad."""

    __slots__ = ("context_id", "send_id", "capture", "value")

    def __init__(self, context_id: int, send_id: int, capture: GradCapture, value: Any) -> None:
        self.context_id = context_id
        self.send_id = send_id
        self.capture = capture
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        # The capture ahead of the value, so that it sees the value's tensors.
        return (_Reply, (self.context_id, self.send_id, self.capture, self.value))


@contextlib.contextmanager
def _inside(context_id: int, sender: int, send_id: int,
            capture: GradCapture) -> Iterator[tuple[ContextTable, DistAutogradContext | None]]:
    """Run the body in the sender's context (None if released here already),
    with the tensors it sent recorded."""
    tbl = table()
    ctx = tbl.join(context_id)
    if ctx is not None:
        if capture.tensors:
            ctx.add_recv(sender, send_id, capture.tensors)
        else:
            ctx.touch(sender)
    token = CURRENT.set(context_id if ctx is not None else None)
    try:
        yield tbl, ctx
    finally:
        CURRENT.reset(token)


def _reply(tbl: ContextTable, ctx: DistAutogradContext | None, context_id: int, dest: int,
           value: Any) -> _Reply:
    capture = GradCapture()
    send_id = tbl.next_send_id()
    if ctx is not None:
        ctx.add_send(send_id, dest, capture)
    return _Reply(context_id, send_id, capture, value)


def _run(context_id: int, sender: int, send_id: int, capture: GradCapture, func: Any,
         args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Reply:
    with _inside(context_id, sender, send_id, capture) as (tbl, ctx):
        value = func(*args, **kwargs)
    return _reply(tbl, ctx, context_id, sender, value)


@async_execution
def _run_async(context_id: int, sender: int, send_id: int, capture: GradCapture, func: Any,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.futures.Future:
    with _inside(context_id, sender, send_id, capture) as (tbl, ctx):
        inner = func(*args, **kwargs)
    # Knows this worker's devices: the reply goes out from a callback of
    # ``out``, which must run on streams that follow the value's work, not
    # on whichever thread's streams registered it (see RpcAgent._reply_future).
    out = devices.future(api._current().devices)
    if not isinstance(inner, torch._C.Future):
        out.set_exception(TypeError(
            f"@async_execution function {getattr(func, '__name__', func)} returned "
            f"{type(inner).__name__}, not a torch.futures.Future"))
        return out

    inner.add_done_callback(lambda f: _torch_futures.forward(
        f, out, lambda value: _reply(tbl, ctx, context_id, sender, value)))
    return out
