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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

__all__ = ["run_backward"]

_engine_run_backward: Callable[..., Any] | None = getattr(
    torch.autograd.graph, "_engine_run_backward", None)


def run_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 inputs: Sequence[torch.Tensor], retain_graph: bool) -> None:
    """``torch.autograd.backward(outputs, grads, retain_graph=retain_graph,
    inputs=inputs)``: gradients accumulate into each input's ``.grad``
    through its AccumulateGrad node (and its hooks), as there.

    Raises:
        RuntimeError: a gradient whose shape is not its output's (torch's
            words), or whatever the engine raises.
    """
    if _engine_run_backward is None:
        torch.autograd.backward(list(outputs), list(grads), retain_graph=retain_graph,
                                inputs=list(inputs))
        return
    for i, (out, grad) in enumerate(zip(outputs, grads)):
        if out.shape != grad.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of "
                               f"{tuple(grad.shape)} and output[{i}] has a shape of "
                               f"{tuple(out.shape)}.")
    _engine_run_backward(tuple(outputs), tuple(grads), retain_graph, False, tuple(inputs),
                         allow_unreachable=True, accumulate_grad=True)
