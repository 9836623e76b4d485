"""torch's autograd engine, called the way ``torch.autograd.backward`` calls it.

The one place ucxrpc's distributed engine reaches below torch's public
autograd API.  ``torch.autograd.backward`` checks each gradient's shape
with ``torch.fx.experimental.symbolic_shapes`` (``_make_grads``), and the
first such check in a process imports it, with sympy: 0.3 s here (488
modules) and ~6 s on a GPU machine's first distributed backward
(benchmarks/runs/AH.md), a cost torch's own C++
distributed engine never pays.  The gradients a distributed pass hands its
local part are ours (they came over the wire for tensors this worker
sent), so a plain shape check does, and the engine runs straight away.

Where this torch has no ``_engine_run_backward`` (a version that renamed
it), the public ``torch.autograd.backward`` runs instead: correct, only
slower the first time.

A callback queued with ``Variable._execution_engine.queue_callback`` runs
when the graph task that queued it ends: for a distributed pass, that is
when the whole pass ends on this worker (torch's one graph task per
context), not when the local part ends.  :func:`run_backward` takes a
``defer`` sink for them: ucxrpc's handle to torch's engine (the Python
object is a handle, the engine one per process) queues every callback
through a wrapper that, when the task ends, hands it to the sink of the part
that task ran (known by its graph task id, which a marker root of the part
records), or runs it, as torch would, when no part of ours queued it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch
from torch.autograd.variable import Variable

__all__ = ["gradients_at", "hooks_set_aside", "run_backward"]

_engine_run_backward: Callable[..., Any] | None = getattr(
    torch.autograd.graph, "_engine_run_backward", None)

Sink = Callable[[Callable[[], None]], None]

# Graph task id -> the sink of the part running it (set by the part's
# marker, dropped when the part's backward returned).
_sinks: dict[int, Sink] = {}
_sinks_lock = threading.Lock()
_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
_EngineBase: Any = type(Variable._execution_engine)


class _Engine(_EngineBase):
    """torch's engine, its final callbacks going to a distributed pass's
    sink where a part of one queued them (see the module's docstring)."""

    def queue_callback(self, callback: Callable[[], None]) -> None:
        task = _task_id() if _task_id is not None else -1

        def run_or_defer() -> None:
            with _sinks_lock:
                sink = _sinks.get(task)
            if sink is None:
                callback()
            else:
                sink(callback)

        super().queue_callback(run_or_defer)


class _Marker(torch.autograd.Function):
    """A root of a part that records the part's graph task id when it runs."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, sink: Sink) -> torch.Tensor:
        ctx.sink = sink
        return token.view_as(token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        assert _task_id is not None
        with _sinks_lock:
            _sinks[_task_id()] = ctx.sink
        return None, None


def _install() -> bool:
    """Put ucxrpc's handle to the engine in torch's place, once; whether the
    final callbacks can be deferred (this torch tells a graph task's id).
    Done as ucxrpc is imported: code that keeps the handle it found (as
    ``engine = Variable._execution_engine``) keeps ours."""
    if _task_id is None:
        return False
    if not isinstance(Variable._execution_engine, _Engine):
        Variable._execution_engine = _Engine()
    return True


_install()


def _outputs_with_marker(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         defer: Sink | None) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                      torch.Tensor | None]:
    """``outputs`` and ``grads`` with, where ``defer`` is given, a marker root
    that records the graph task's id (the final callbacks go to ``defer``);
    and the marker's token, whose gradient edge a capturing run must ask
    for, or the marker would not run."""
    outputs, grads = list(outputs), list(grads)
    token = None
    if defer is not None and isinstance(Variable._execution_engine, _Engine):
        token = torch.empty(0, requires_grad=True)
        with torch.enable_grad():
            marker = _Marker.apply(token, defer)
        outputs.append(marker)
        grads.append(torch.empty(0))
    return outputs, grads, token


def _check_shapes(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    for i, (out, grad) in enumerate(zip(outputs, grads)):
        if out.shape != grad.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of "
                               f"{tuple(grad.shape)} and output[{i}] has a shape of "
                               f"{tuple(out.shape)}.")


def _forget(defer: Sink | None) -> None:
    if defer is not None:
        with _sinks_lock:
            for key in [k for k, v in _sinks.items() if v is defer]:
                del _sinks[key]


def run_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 retain_graph: bool, defer: Sink | None = None) -> None:
    """``torch.autograd.backward(outputs, grads, retain_graph=retain_graph)``:
    gradients accumulate into the ``.grad`` of every leaf the outputs reach,
    through its AccumulateGrad node (and its hooks), as there.
    ``defer``: where the final callbacks queued during it go instead of
    running at its end.

    Raises:
        RuntimeError: a gradient whose shape is not its output's (torch's
            words), or whatever the engine raises.
    """
    outputs, grads, _ = _outputs_with_marker(outputs, grads, defer)
    try:
        if _engine_run_backward is None:
            torch.autograd.backward(outputs, grads, retain_graph=retain_graph)
            return
        _check_shapes(outputs, grads)
        _engine_run_backward(tuple(outputs), tuple(grads), retain_graph, False, (),
                             allow_unreachable=True, accumulate_grad=True)
    finally:
        _forget(defer)


def gradients_at(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], retain_graph: bool,
                 leaves: Sequence[torch.Tensor],
                 defer: Sink | None = None) -> list[torch.Tensor | None]:
    """The gradients flowing into ``leaves`` (every leaf requiring grad that
    the outputs reach), as ``torch.autograd.grad(outputs, leaves)``: every
    node between runs, with its hooks, and the leaves' AccumulateGrad nodes
    do not (the caller runs each once, when all of its gradient is in:
    :func:`run_backward` from the leaf).  None for a leaf no gradient
    reached.

    torch runs a captured node's tensor hooks (a leaf's ``register_hook``
    ones) on what it captures; here they must run once, when the node does,
    so each leaf's hooks are set aside meanwhile (the caller holds the
    leaves' locks: nothing else runs them in between).
    """
    outputs, grads, token = _outputs_with_marker(outputs, grads, defer)
    inputs = list(leaves)
    if token is not None:
        inputs.append(token)
    try:
        with hooks_set_aside(leaves, "_backward_hooks"):
            found = _capture(outputs, grads, retain_graph, inputs)
    finally:
        _forget(defer)
    return list(found[:len(leaves)])


def _capture(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], retain_graph: bool,
             inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor | None]:
    if _engine_run_backward is None:
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=retain_graph,
                                   allow_unused=True)
    _check_shapes(outputs, grads)
    return _engine_run_backward(tuple(outputs), tuple(grads), retain_graph, False,
                                tuple(inputs), allow_unreachable=True, accumulate_grad=False)


@contextlib.contextmanager
def hooks_set_aside(leaves: Sequence[torch.Tensor], kind: str) -> Iterator[None]:
    """The Python hooks of kind ``kind`` on each of ``leaves`` (the
    ``_backward_hooks`` that ``register_hook`` adds, the
    ``_post_accumulate_grad_hooks``) do not run meanwhile.  torch calls
    each through the leaf's own dict, so emptying the dict and filling it
    again after sets them aside; the caller holds the leaves' locks."""
    hidden: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    try:
        for leaf in leaves:
            hooks = getattr(leaf, kind, None)
            if hooks:
                hidden.append((hooks, dict(hooks)))
                hooks.clear()
        yield
    finally:
        for hooks, saved in hidden:
            hooks.update(saved)
