"""What the layers above the agent (RRefs, distributed autograd, dynamic
membership) plug into it, typed, in one place.

The agent must not import those layers; they register here instead, once
per agent (their state is made by :meth:`RpcAgent.extension`).  The agent
calls each hook at one point of its life, named by the field, and a hook
that raises is logged, never allowed to stop the agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from .info import WorkerInfo

__all__ = ["Hooks", "WrapCall", "Finish"]

#: Hands the caller the future to return for a call's reply future.
Finish = Callable[["torch.futures.Future"], "torch.futures.Future"]
#: Rewrites an outgoing call: ``(to, func, args, kwargs)`` → None to send it
#: as it is, or ``(func, args, kwargs, finish)``.
WrapCall = Callable[["WorkerInfo", Any, tuple[Any, ...], dict[str, Any]],
                    "tuple[Any, tuple[Any, ...], dict[str, Any], Finish] | None"]


@dataclass
class Hooks:
    #: ``(timeout)`` at a graceful shutdown, before in-flight work is drained
    #: (RRefs flush their deletions).
    before_shutdown: list[Callable[[float | None], None]] = field(default_factory=list)
    #: ``(peer id, error)`` when a peer failed, became unreachable, or left
    #: (RRef forks and autograd contexts it held are dropped; ``error`` is
    #: what its calls fail with, so what is asked for later can say why).
    on_peer_failure: list[Callable[[int, BaseException], None]] = field(default_factory=list)
    #: ``()`` once the agent closed, however it shut down: threads of the
    #: layers above that wait for work without a timeout stop (an idle
    #: worker's threads wake for nothing, issue 50).
    on_close: list[Callable[[], None]] = field(default_factory=list)
    #: Each adds its counters to ``_get_debug_info()``.
    debug_sources: list[Callable[[], dict[str, Any]]] = field(default_factory=list)
    #: Distributed autograd wraps calls made inside a context.
    wrap_call: WrapCall | None = None
    #: Dynamic membership: tells the group this worker leaves (set at join).
    leave_group: Callable[[float | None], None] | None = None
    #: Distributed autograd's backward ``(context_id, roots, retain_graph)``,
    #: for ``RRef.backward`` run on the owner; None until an autograd context
    #: existed on this agent (then no context can be found either).
    dist_backward: Callable[[int, list[Any], bool], None] | None = None
