"""What an RRef's owner runs: creating a value, serving it, keeping count
of forks, and backward from it; and the per-agent registry they share."""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from .. import _torch_futures, api, devices
from ..agent import RpcAgent, not_a_future
from ..errors import RpcError, RRefError
from ..functions import _plain, async_execution
from .janitor import Janitor
from .registry import ForkId, Handle, Registry, RRefId


__all__ = ["registry"]


def registry(agent: RpcAgent | None = None) -> Registry:
    """The RRef registry of ``agent`` (the current one by default), made and
    plugged into the agent on first use."""
    if agent is None:
        agent = api._agent
        if agent is None:  # torch's words for an RRef made before init_rpc
            raise RpcError("Current RPC agent is not set! Did you initialize the RPC "
                           "framework (e.g. by calling `rpc.init_rpc`)?")
    return agent.extension("rref", _new_registry)


def _new_registry(agent: RpcAgent) -> Registry:
    reg = Registry(agent)
    janitor = Janitor(reg, lambda owner, items: agent.call(
        agent.members.workers[owner], _owner_del_forks, (items,), {}, None))
    janitor.start()
    agent.hooks.before_shutdown.append(janitor.flush)
    agent.hooks.on_close.append(janitor.stop)
    agent.hooks.on_peer_failure.append(reg.drop_forks_of)
    agent.hooks.debug_sources.append(reg.debug_info)
    return reg


def run_into(target: torch.futures.Future, func: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any], streams: list[Any]) -> None:
    """Run ``func`` on ``streams`` (one per CUDA device of this worker, none
    without) and set ``target``, which records where the value's work ends."""
    with devices.on_streams(streams):
        try:
            result = func(*args, **kwargs)
        except Exception as exc:
            _torch_futures.fail(target, exc)
            return
        if getattr(func, "_wrapped_async_rpc_function", None) is not None:
            if not isinstance(result, torch._C.Future):
                target.set_exception(not_a_future(func, result))
                return
            result.add_done_callback(lambda f: _torch_futures.forward(f, target))
            return
        target.set_result(result)


def _owner_create(rref_id: RRefId, fork_id: ForkId, holder: int, func: Any,
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    reg = registry()
    e = reg.entry(rref_id)
    reg.add_fork(rref_id, fork_id, holder)
    # With the caller's context variables: a distributed autograd context
    # keeps recording the function's own calls.  On this call's streams,
    # where its received arguments are recorded (see devices.callee_streams).
    ctx = contextvars.copy_context()
    reg.agent.submit(ctx.run, run_into, e.value, func, args, kwargs,
                     devices.current_streams(reg.agent.devices))


@async_execution
def _owner_create_now(rref_id: RRefId, fork_id: ForkId, holder: int, func: Any,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.futures.Future:
    """:func:`_owner_create` for a profiled ``remote()``: the function runs
    here and now, and the answer waits for its value, so that the caller's
    profile holds the function's events (torch's owner answers a
    ``remote()`` only then, profiled or not)."""
    reg = registry()
    reg.add_fork(rref_id, fork_id, holder)
    return _run_now(reg, rref_id, func, args, kwargs, devices.current_streams(reg.agent.devices))


@async_execution
def _owner_run_now(rref_id: RRefId, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   streams: list[Any]) -> torch.futures.Future:
    """The same for a profiled ``remote()`` of a worker to itself, on the
    caller's ``streams``."""
    return _run_now(registry(), rref_id, func, args, kwargs, streams)


def _run_now(reg: Registry, rref_id: RRefId, func: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any], streams: list[Any]) -> torch.futures.Future:
    """Run ``func`` into the value of ``rref_id``; the future completes
    (with None: a failure is the value's, for its users to meet) once the
    value is set."""
    value = reg.entry(rref_id).value
    run_into(value, func, args, kwargs, streams)
    done: torch.futures.Future = torch.futures.Future()
    value.add_done_callback(lambda _: done.set_result(None))
    return done


@async_execution
def _owner_type(rref_id: RRefId) -> torch.futures.Future:
    """The type of the value (once it exists), for proxies to check names."""
    return registry().entry(rref_id).value.then(lambda f: type(f.wait()))


@async_execution
def _owner_fetch(rref_id: RRefId) -> torch.futures.Future:
    return registry().entry(rref_id).value


@_plain
def _owner_add_fork(rref_id: RRefId, fork_id: ForkId, holder: int) -> None:
    registry().add_fork(rref_id, fork_id, holder)


@_plain
def _owner_backward(rref: Handle, context_id: int, retain_graph: bool) -> None:
    reg = registry()
    value = reg.agent.wait(reg.entry(rref._rref_id).value)
    if not isinstance(value, torch.Tensor):
        raise RRefError(f"RRef should contain a tensor for .backward(); {rref} holds a "
                        f"{type(value).__name__}")
    if context_id == -1:
        torch.autograd.backward(value, retain_graph=retain_graph)
        return
    dist_backward = reg.agent.hooks.dist_backward
    if dist_backward is None:  # no autograd context ever existed here
        raise RuntimeError(f"Could not find autograd context with id: {context_id}")
    dist_backward(context_id, [value], retain_graph)


@_plain
def _owner_del_forks(items: list[tuple[RRefId, ForkId]]) -> None:
    registry().del_forks(items)
