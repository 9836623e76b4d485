"""The distributed backward pass (torch's FAST mode) and context release.

Backward starts on the worker that calls :func:`backward`, and each worker
the forward pass touched takes part once per pass: its part is a
:class:`~._pass.WorkerPass` (torch's graph task for the context on that
worker), whose entries are the roots, where there are some, and every send
of the context there.  A recv's gradients go back to its sender
(:func:`_propagate`) once every entry of the pass that reaches it has run;
the message that begins a worker's part is answered when that part has
ended, every entry run and every propagation it started answered, and
later messages at once, as torch's.  So when the initiator's part ends, the
whole distributed graph has run.  Every message carries its pass's id (the
initiator's worker id and a count): a part that failed ends at once, and
the pass's messages still on their way to it are answered, not taken for
the first messages of a new pass (which would wait, until ``rpc_timeout``,
for entries the ended part already took).  How the parts keep torch's gradient and
hook semantics over torch's local engine, and where they cannot, is in
``_pass.py``.

Failures travel as values (:class:`Failure`), not exceptions, so the
initiator can name the worker where it happened however deep in the chain.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .._states import StateEnum
from .. import _torch_futures, api
from ..agent import RpcAgent
from ..errors import DistAutogradError, RpcError
from ..functions import _plain, async_execution
from ._context import ContextTable, DistAutogradContext, Recv
from ._pass import ROOTS, WorkerPass
from ._recording import BACKWARD, table

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


# -- the pass on this worker ------------------------------------------------------

def _send_grads(agent: RpcAgent, context_id: int, pass_id: PassId, retain_graph: bool,
                recv: Recv, grads: list[torch.Tensor | None]) -> _Future:
    """Start sending ``recv``'s gradients to its sender: a future of its
    answer (None, or a Failure), or of the error that kept it from going."""
    try:
        return agent.call(agent.members.workers[recv.source], _propagate,
                          (context_id, pass_id, recv.send_id, grads, retain_graph), {},
                          agent.default_timeout)
    except Exception as exc:  # a broken pipe, a closed agent: fail this branch only
        fut: _Future = _Future()
        _torch_futures.fail(fut, exc)
        return fut


#: A pass's id: the worker that called ``backward`` and its count there.
PassId = tuple[int, int]


class Begun(StateEnum):
    """What a pass's message found on its worker (:func:`_begin`)."""

    NEW = "new"          # it begins this worker's part: answered at the part's end
    RUNNING = "running"  # the part runs: answered once its entry ran
    ENDED = "ended"      # the part ended (a failure): answered at once


def _begin(agent: RpcAgent, ctx: DistAutogradContext, roots: list[torch.Tensor] | None,
           retain_graph: bool, pass_id: PassId) -> tuple[WorkerPass | None, Begun]:
    """This worker's part of pass ``pass_id`` of ``ctx``: the one running,
    or None where it ended, or begun now.  ``roots``: this worker calls
    ``backward``."""
    tbl = table(agent)
    with _passes_lock:
        running = ctx.running_pass
        if running is not None:
            if roots is None and running.pass_id == pass_id:
                return running, Begun.RUNNING
            raise DistAutogradError(f"a backward pass of autograd context {ctx.id} is "
                                    "already running on this worker")
        if pass_id in ctx.ended_passes:
            return None, Begun.ENDED
        p = WorkerPass(ctx, roots, retain_graph,
                       functools.partial(_send_grads, agent, ctx.id, pass_id, retain_graph),
                       functools.partial(_here, agent), functools.partial(_ended, tbl, ctx),
                       pass_id, (agent.info.id, agent.info.name))
        ctx.running_pass = p
        tbl.backward_passes += 1
    return p, Begun.NEW


def _ended(tbl: ContextTable, ctx: DistAutogradContext, p: WorkerPass) -> None:
    with _passes_lock:
        if ctx.running_pass is p:
            ctx.running_pass = None
            ctx.ended_passes.append(p.pass_id)
            tbl.backward_passes -= 1


#: Counts the passes this worker begins (the second half of their ids).
_pass_counter = itertools.count()


# Guards the running pass of every context: one begins at a time.
_passes_lock = threading.Lock()


def _gather(agent: RpcAgent, calls: list[tuple[int, _Future]]) -> _Future:
    """A future of the first Failure among ``calls``, or None once all succeeded."""
    out: _Future = _Future()
    if not calls:
        out.set_result(None)
        return out
    lock = threading.Lock()
    state: dict[str, Any] = {"left": len(calls), "failure": None}

    def done(peer: int, f: _Future) -> None:
        exc = _torch_futures.failure(f)
        result = _failure(agent, peer, exc, trace=False) if exc is not None else f.value()
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
def _propagate(context_id: int, pass_id: PassId, send_id: int,
               grads: list[torch.Tensor | None], retain_graph: bool) -> _Future:
    """Run on the worker that made send ``send_id``: gradients for what it
    sent.  The message that engages this worker's part of the pass (the
    one that begins it, or the first after it was left waiting) is answered
    when that part ends, or with what waits once it is left waiting
    (``_pass.Waits``); others once their entry ran (their failures end the
    pass and reach the initiator through the engaging one), as torch's;
    one that comes after the part ended (it failed) is dropped and
    answered."""
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
        p, begun = _begin(agent, ctx, None, retain_graph, (pass_id[0], pass_id[1]))
    except Exception as exc:
        out: _Future = _Future()
        out.set_result(_here(agent, exc))
        return out
    if p is not None:
        engaging = p.deliver(send_id, grads)
        if engaging is not None:
            return engaging
    answered: _Future = _Future()
    answered.set_result(None)
    return answered


# -- backward -------------------------------------------------------------------

def _backward_span() -> Any:
    """torch's span around a distributed backward, where a profiler is on."""
    if torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function("torch::distributed::autograd::backward")
    return contextlib.nullcontext()


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
    still there) until its ``with`` block ends.  As torch's FAST mode, the
    pass waits for every send of the context that carried tensors requiring
    grad; a send of this worker's that no part can reach (its result
    unused) fails it at once, naming the send (torch's waits for ever).

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
    with _backward_span():
        p, _ = _begin(agent, ctx, roots, retain_graph, (agent.info.id, next(_pass_counter)))
        assert p is not None  # a new pass id is never an ended one
        p.run(ROOTS, [torch.ones_like(r) for r in roots])
        with agent.blocking():  # the pool may replace a thread of its own waiting here
            failure = p.serve()
    if failure is not None:
        for peer in p.stuck_workers:  # their parts wait for ever: end them
            _abandon_on(agent, peer, context_id, p.pass_id, failure)
        raise DistAutogradError(failure.describe(context_id))


def _abandon_on(agent: RpcAgent, peer: int, context_id: int, pass_id: PassId,
                failure: Failure) -> None:
    """End ``peer``'s part of the pass, found waiting for gradients that
    never come; not waited for (a peer gone meanwhile has no part left)."""
    to = agent.members.workers.get(peer)
    if to is None:  # gone from the group: no part left there
        return
    try:
        agent.call(to, _abandon, (context_id, pass_id, failure), {}, agent.default_timeout)
    except RpcError as exc:
        logger.debug("%s: cannot end the waiting part of context %d on %s: %s",
                     agent.info.name, context_id, agent.members.name_of(peer), exc)


@_plain
def _abandon(context_id: int, pass_id: PassId, failure: Failure) -> None:
    """The caller found this worker's part of ``pass_id`` waiting for ever:
    it ends with the pass's failure, so that the context may run another."""
    ctx = table(api._current()).find(context_id)
    running = ctx.running_pass if ctx is not None else None
    if running is not None and running.pass_id == tuple(pass_id):
        running.abandon(failure)


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


BACKWARD.append(backward)  # for RRef.backward on an owner (_recording._dist_backward)
