"""The distributed backward pass (torch's FAST mode) and context release.

Backward starts on the worker that calls :func:`backward`: a local pass from
the roots computes the gradients of every leaf the roots depend on.  Leaves
that are tensors this worker received get their gradients sent back to their
sender (:func:`_propagate`), which runs a local pass from the tensors it sent,
and so on.  A worker answers a propagation only once its own pass and every
propagation it started have finished, so when the initiator's propagations
are all answered the whole distributed graph is done.

A local pass runs torch's engine as a local ``backward`` would, through
each leaf's AccumulateGrad node, whose hooks run as in torch's distributed
engine (DDP's reducer all-reduces its gradients there); the leaves' ``.grad``
is borrowed for the pass and put back, so gradients land in the context
only (:func:`_run_pass`).  One consequence: a local ``backward`` over the
same leaves on another thread during a distributed pass would see ``.grad``
borrowed; torch's engine never touches ``.grad`` at all.

Each send runs its own local pass as soon as its gradients arrive.  Passes
started by a propagation keep their graph (``retain_graph``) until the context
is released: two sends may share part of a worker's graph, and nothing says
which of them comes last.

Failures travel as values (:class:`Failure`), not exceptions, so the
initiator can name the worker where it happened however deep in the chain.
"""

from __future__ import annotations

import functools
import logging
import threading
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .. import api
from ..agent import RpcAgent
from ..errors import DistAutogradError, RpcError
from ..functions import _plain, async_execution
from ._context import ContextTable, DistAutogradContext, Recv
from ._recording import table
from ._torch_engine import run_backward

logger = logging.getLogger(__name__)

_Future = torch.futures.Future


@dataclass(frozen=True)
class Failure:
    """Where and how a backward pass failed: the worker (its name and id),
    the error's type and message, and its traceback where it was raised."""

    worker: str
    node: int
    kind: str
    error: str
    traceback: str = ""

    def describe(self, context_id: int) -> str:
        # torch's first line ("Error on Node N: message"), which its tests
        # and users match on; then ours, naming the worker and the error's type.
        text = (f"Error on Node {self.node}: {self.error}\n({self.kind} on worker {self.worker}, "
                f"in the distributed backward pass of autograd context {context_id})")
        return f"{text}\n{self.traceback}" if self.traceback else text


def _failure(agent: RpcAgent, node: int, exc: BaseException, trace: bool) -> Failure:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) if trace else ""
    return Failure(agent.members.name_of(node), node, type(exc).__name__, str(exc), tb)


def _here(agent: RpcAgent, exc: BaseException) -> Failure:
    return _failure(agent, agent.info.id, exc, trace=True)


# -- the local pass -------------------------------------------------------------

def _leaves(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves requiring grad that ``outputs`` depend on, each once."""
    found: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack: list[Any] = []
    for t in outputs:
        if t.grad_fn is None:
            found[id(t)] = t
        else:
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            found[id(variable)] = variable
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return list(found.values())


def _local_pass(agent: RpcAgent, ctx: DistAutogradContext, outputs: Sequence[torch.Tensor],
                grad_outputs: Sequence[torch.Tensor | None],
                retain_graph: bool) -> list[tuple[int, _Future]]:
    """Back-propagate through this worker's graph; returns the propagations
    it started, as (peer, future) pairs."""
    pairs = {id(t): (t, g) for t, g in zip(outputs, grad_outputs)
             if g is not None and t.requires_grad}
    if not pairs:
        return []
    outs = [t for t, _ in pairs.values()]
    gouts = [g for _, g in pairs.values()]
    leaves = _leaves(outs)
    grads = _run_pass(outs, gouts, leaves, retain_graph)
    outgoing: dict[int, tuple[Recv, list[torch.Tensor | None]]] = {}
    storages: set[int] = set()
    for leaf, grad in zip(leaves, grads):
        if grad is None:
            continue
        slot = ctx.recv_slot(leaf)
        if slot is None:
            ctx.accumulate(leaf, _owned(grad, storages))
            continue
        recv, position = slot
        entry = outgoing.get(id(recv))
        if entry is None:
            entry = outgoing[id(recv)] = (recv, [None] * len(recv.tensors))
        entry[1][position] = grad
    return [(recv.source, _send_grads(agent, ctx.id, recv, gs)) for recv, gs in outgoing.values()]


class _LeafLocks:
    """One lock per leaf a pass borrows (see :func:`_run_pass`), so that two
    passes sharing a leaf (a parameter server's, in two trainers' contexts)
    take turns while passes over other leaves run at once.  A pass takes its
    locks in one global order (by id), so passes cannot deadlock each other;
    a lock goes when its leaf does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}

    def of(self, leaves: list[torch.Tensor]) -> list[threading.Lock]:
        found: dict[int, threading.Lock] = {}
        with self._lock:
            for leaf in leaves:
                key = id(leaf)
                lock = self._locks.get(key)
                if lock is None:
                    lock = self._locks[key] = threading.Lock()
                    weakref.finalize(leaf, self._locks.pop, key, None)
                found[key] = lock
        return [found[key] for key in sorted(found)]


_leaf_locks = _LeafLocks()


def _run_pass(outs: list[torch.Tensor], gouts: list[torch.Tensor],
              leaves: list[torch.Tensor], retain_graph: bool) -> list[torch.Tensor | None]:
    """The gradients of ``leaves``, computed as torch's engine computes them
    for a local ``backward``: through each leaf's AccumulateGrad node, so that
    the node's hooks run (DDP's reducer all-reduces its gradients there, and
    torch's distributed engine runs them too) and its rules for keeping or
    copying a gradient apply.  The leaves' own ``.grad`` is set aside for the
    pass and put back after it: the gradients go to the context, never into
    ``.grad``; a pass holds its leaves' locks meanwhile."""
    if not leaves:
        return []
    locks = _leaf_locks.of(leaves)
    for lock in locks:
        lock.acquire()
    try:
        saved = [leaf.grad for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        try:
            run_backward(outs, gouts, leaves, retain_graph)
            return [leaf.grad for leaf in leaves]
        finally:
            for leaf, grad in zip(leaves, saved):
                leaf.grad = grad
    finally:
        for lock in reversed(locks):
            lock.release()


def _owned(grad: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """``grad``, or a copy where keeping it would share memory.

    As torch's AccumulateGrad: a gradient an optimizer may update in place
    must be dense and not alias another leaf's (the gradients of ``a + b``
    are one tensor).  Most are neither, and are kept without a copy.
    """
    if grad.layout is torch.sparse_coo:
        # A sparse gradient has no storage of its own: its values' and
        # indices' count, as in torch's AccumulateGrad for sparse ones.
        values = grad._values()
        ptr = values.untyped_storage().data_ptr()
        if values.is_contiguous() and grad._indices().is_contiguous() and ptr not in storages:
            if ptr:
                storages.add(ptr)
            return grad
        return grad.clone()
    ptr = grad.untyped_storage().data_ptr()
    if grad.is_contiguous() and ptr not in storages:
        if ptr:
            storages.add(ptr)
        return grad
    return grad.clone(memory_format=torch.contiguous_format)


def _send_grads(agent: RpcAgent, context_id: int, recv: Recv,
                grads: list[torch.Tensor | None]) -> _Future:
    try:
        return agent.call(agent.members.workers[recv.source], _propagate,
                          (context_id, recv.send_id, grads), {}, agent.default_timeout)
    except Exception as exc:  # a broken pipe, a closed agent: fail this branch only
        fut: _Future = _Future()
        fut.set_exception(exc)
        return fut


def _gather(agent: RpcAgent, calls: list[tuple[int, _Future]]) -> _Future:
    """A future of the first Failure among ``calls``, or None once all succeeded."""
    out: _Future = _Future()
    if not calls:
        out.set_result(None)
        return out
    lock = threading.Lock()
    state: dict[str, Any] = {"left": len(calls), "failure": None}

    def done(peer: int, f: _Future) -> None:
        try:
            result = f.value()
        except Exception as exc:
            result = _failure(agent, peer, exc, trace=False)
        with lock:
            if isinstance(result, Failure) and state["failure"] is None:
                state["failure"] = result
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            out.set_result(state["failure"])

    for peer, f in calls:
        f.add_done_callback(functools.partial(done, peer))
    return out


@_plain
@async_execution
def _propagate(context_id: int, send_id: int, grads: list[torch.Tensor | None]) -> _Future:
    """Run on the worker that made send ``send_id``: gradients for what it sent."""
    agent = api._current()
    tbl = table(agent)
    try:
        ctx = tbl.get(context_id)
        send = ctx.sends.get(send_id)
        if send is None:
            raise DistAutogradError(f"autograd context {context_id} has no send {send_id}")
        sent = send.capture.tensors
        if len(grads) != len(sent):
            raise DistAutogradError(f"{len(grads)} gradients for send {send_id} of context "
                                    f"{context_id}, which sent {len(sent)} tensors")
        calls = _local_pass(agent, ctx, sent, grads, retain_graph=True)
    except Exception as exc:
        out: _Future = _Future()
        out.set_result(_here(agent, exc))
        return out
    return _gather(agent, calls)


# -- backward -------------------------------------------------------------------

_SIGNATURE = "(context_id: int, roots: List[Tensor], retain_graph: bool = False) -> None"


def _check_arguments(context_id: Any, roots: Any, retain_graph: Any) -> list[Any]:
    """torch's binding's type checks: a TypeError naming what is wrong."""
    wrong = []
    if not isinstance(context_id, int):
        wrong.append(f"context_id is a {type(context_id).__name__}, not an int")
    if isinstance(roots, (str, bytes)) or not isinstance(roots, Sequence):
        wrong.append(f"roots is a {type(roots).__name__}, not a list of tensors")
    else:
        wrong += [f"roots[{i}] is a {type(r).__name__}, not a Tensor"
                  for i, r in enumerate(roots) if not isinstance(r, torch.Tensor)]
    if not isinstance(retain_graph, bool):
        wrong.append(f"retain_graph is a {type(retain_graph).__name__}, not a bool")
    if wrong:
        raise TypeError(f"backward(): incompatible function arguments. The following argument "
                        f"types are supported:\n    1. {_SIGNATURE}\n\nInvoked with: "
                        f"{context_id!r}, {roots!r}, {retain_graph!r}: {'; '.join(wrong)}")
    return list(roots)


def _check_roots(ctx: DistAutogradContext, roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch's checks of the roots, in its order and words.  A tensor an RPC
    brought here is a leaf in ucxrpc where torch gives it a recv function:
    a valid root, as there."""
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for i, root in enumerate(roots):
        if not root.requires_grad:
            raise RuntimeError(f"requires_grad not set on root {i}")
        if root.numel() != 1:
            raise RuntimeError(f"Found root {i} of shape {tuple(root.shape)}, which is not a "
                               f"scalar, all roots need to be scalar")
        if root.grad_fn is None and ctx.recv_slot(root) is None:
            raise RuntimeError(f"root {i} (a leaf) does not have a valid gradient function.")
    return roots


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass of ``context_id`` from ``roots`` across every
    worker the forward pass touched; returns when all of it is done.

    Gradients accumulate in the context on each worker (see
    :func:`get_gradients`), never in ``.grad``.  On failure anywhere a
    DistAutogradError names the worker where it failed, once every part of
    the pass has stopped; the context stays on every worker (as torch's),
    so a later backward in it can run (with ``retain_graph``, the graph is
    still there) until its ``with`` block ends.

    Raises:
        TypeError: arguments of the wrong types (torch's "incompatible
            function arguments").
        RuntimeError: no roots, or a root that does not require grad, is not
            a scalar, or is a leaf; an unknown context.
        DistAutogradError: the pass failed on some worker.
    """
    roots = _check_arguments(context_id, roots, retain_graph)
    agent = api._current()
    tbl = table(agent)
    ctx = tbl.get(context_id)
    roots = _check_roots(ctx, roots)
    tbl.backward_passes += 1
    try:
        try:
            calls = _local_pass(agent, ctx, roots, [torch.ones_like(r) for r in roots],
                                retain_graph)
        except Exception as exc:
            failure: Failure | None = _here(agent, exc)
        else:
            failure = agent.wait(_gather(agent, calls))
    finally:
        tbl.backward_passes -= 1
    if failure is not None:
        raise DistAutogradError(failure.describe(context_id))


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's gradients in ``context_id``: leaf tensor -> gradient."""
    return table().get(context_id).gradients()


# -- release --------------------------------------------------------------------

def release_peers(agent: RpcAgent, tbl: ContextTable, ctx: DistAutogradContext,
                  exclude: int | None) -> _Future:
    """Release ``ctx`` on the workers it touched (they pass it on)."""
    calls = []
    for peer in sorted(ctx.peers(tbl.me)):
        if peer == exclude or peer not in agent.members.workers:
            continue
        try:
            calls.append((peer, agent.call(agent.members.workers[peer], _release,
                                           (ctx.id, tbl.me), {}, agent.default_timeout)))
        except RpcError as exc:  # a dead peer has nothing left to release
            logger.debug("%s: cannot release context %d on %s: %s", agent.info.name,
                         ctx.id, agent.members.name_of(peer), exc)
    return _gather(agent, calls)


@_plain
@async_execution
def _release(context_id: int, requester: int) -> _Future:
    agent = api._current()
    tbl = table(agent)
    ctx = tbl.pop(context_id)
    if ctx is None:
        done: _Future = _Future()
        done.set_result(None)
        return done
    return release_peers(agent, tbl, ctx, exclude=requester)


def release(context_id: int) -> None:
    """Drop ``context_id`` here and, without waiting, on every worker it touched.

    Not waited for, as in torch: a training loop's next step overlaps the
    round trip (graceful shutdown still waits for it).  A no-op once RPC is
    shut down: the contexts went with the agent.
    """
    if not api.is_initialized():
        return
    agent = api._current()
    tbl = table(agent)
    ctx = tbl.pop(context_id)
    if ctx is None or not ctx.peers(tbl.me):
        return
    done = release_peers(agent, tbl, ctx, exclude=None)
    done.add_done_callback(lambda f: _log_lingering(agent, context_id, f.value()))


def _log_lingering(agent: RpcAgent, context_id: int, failure: Failure | None) -> None:
    if failure is not None:
        logger.warning("%s: autograd context %d may linger on %s: %s", agent.info.name,
                       context_id, failure.worker, f"{failure.kind}: {failure.error}")
