"""This worker's part of one distributed backward pass of a context.

torch's distributed engine (FAST mode) gives each worker one graph task per
context and pass: its roots are the backward's roots (on the worker that
called ``backward``) and *every* send of the context on the worker, each
waited for; a node runs once all gradients for it arrived, a recv's
gradient goes to its sender once, and the task ends, and the callbacks
queued in it run, when all of it ran.  :class:`WorkerPass` is that task,
built over torch's local engine, which takes all roots' gradients at once
and so cannot be fed a send's gradients as they arrive.  Each *entry* (the
roots, or one send) runs as a local part of its own when its gradients
come, and the pass keeps what makes the parts one pass:

* **Dependencies per entry.** Which entries reach which leaves and nodes is
  worked out once, when the pass begins (:func:`_walk`).  A recv's
  gradients go to its sender once every entry that reaches it has run
  (torch: RecvRpcBackward runs once all its inputs arrived), so each send
  on the peer gets its full gradient, once.
* **Gradients held for the pass.** Every leaf of the pass (of all entries)
  has its ``.grad`` lent to each part, holding what the pass accumulated
  so far, and taken back after.  A leaf's AccumulateGrad node and its
  hooks run as torch's engine runs them; a hook that writes another leaf's
  ``.grad`` (DDP's reducer, all-reducing a bucket once its last parameter is
  ready, whichever part that was) writes the pass's copy.  The context gets
  the gradients when the pass ends, with torch's distributed rule for
  keeping or copying each (:meth:`WorkerPass._commit`); ``.grad`` itself is
  left as the user had it.
* **The end.** The pass ends when every entry ran and every propagation it
  started was answered.  A failure (here, or in a peer's answer) stops it:
  no part runs or sends from then on, and it ends with the first failure
  once every propagation still in flight was answered.  torch's engine too
  waits for a context's outstanding RPCs before it reports an error; and a
  peer's part still running sends its gradients here later, which must
  find this pass and be dropped, not begin a new pass that nothing ends.
  The first message that began the pass on a worker is answered at its end
  (:attr:`WorkerPass.done`); later ones at once, as torch's.
* **A pass that cannot end fails.**  The pass waits for every send of its
  context (torch's FAST mode, which assumes every send is part of it).
  Where the worker that called ``backward`` has run its roots, nothing of
  its part runs or waits in line, every propagation it started was
  answered (so every part they began has ended: each waits for its own
  before it answers) and a send of its own is still awaited, no gradient
  can ever come for that send: a result the loss does not use.  torch's
  agent waits for ever there; the pass fails at once naming the sends
  (:meth:`WorkerPass._stuck`).  A worker other than the caller waiting so
  is not told from one whose gradients are still on their way: its pass
  waits (the caller's ``backward`` until the RPC timeout of the message
  that began it).

* **Final callbacks at the end.** A callback a part queues with
  ``queue_callback`` (FSDP's, DDP-like reducers' in Python) runs when the
  pass ends here, every part run, with the pass's gradients lent, before
  the context gets them: torch's graph task runs its final callbacks once
  all of it ran (``_torch_engine`` defers them).

What torch's single task does that separate local parts cannot: a node that
two entries reach runs once per entry, each time with its share of the
gradient (the sum is the same; a hook on such a node, a leaf's included,
sees the shares).  The missing hook is a way to add roots with their
gradients to a running graph task (``Engine::execute`` takes them all at
once; ``DistEngine::executeSendFunctionAsync`` feeds the task in C++ only).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .._states import StateEnum
from .. import _torch_futures
from ..errors import DistAutogradError
from ._context import DistAutogradContext, Recv
from ._torch_engine import run_backward

__all__ = ["ROOTS", "WorkerPass", "owned"]

_Future = torch.futures.Future

#: The entry of the roots, on the worker that called ``backward``; sends
#: are entries under their send ids.
ROOTS = -1

#: Starts a propagation: ``(recv, gradients) -> future`` of a Failure or None.
Propagate = Callable[[Recv, list[torch.Tensor | None]], _Future]


class Phase(StateEnum):
    """Where a pass is.  RUNNING -> COMMITTING -> ENDED, or RUNNING ->
    STOPPING (a part failed; waiting for its propagations in flight) ->
    ENDED; then FINISHED once :attr:`WorkerPass.done` completed."""

    RUNNING = "running"
    COMMITTING = "committing"
    STOPPING = "stopping"
    ENDED = "ended"
    FINISHED = "finished"


@dataclass
class _Entry:
    """Where one entry's gradients flow on this worker."""

    outputs: list[torch.Tensor]
    nodes: set[Any] = field(default_factory=set)
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # id -> leaf
    accumulators: dict[int, Any] = field(default_factory=dict)     # id(leaf) -> AccumulateGrad


#: Nodes whose backward runs a backward of its own over leaves the graph
#: does not show (the parameters a reentrant checkpoint recomputes with):
#: the pass cannot lend them its gradients, which would go to ``.grad``
#: instead of the context.  torch's distributed engine refuses them too
#: (its check is per graph task; ours, when the pass begins, is the same
#: whichever thread runs the part).
_HIDING = {
    "torch.utils.checkpoint.CheckpointFunction": (
        "When use_reentrant=True, torch.utils.checkpoint is incompatible with a distributed "
        "backward pass (the parameters it recomputes with are hidden from the pass, whose "
        "gradients would go to .grad, not the context; torch's agent refuses it too): "
        "use use_reentrant=False"),
}


def _function_of(node: Any) -> str | None:
    """The full name of the autograd Function whose backward ``node`` is,
    where it is a Python one."""
    cls = getattr(node, "_forward_cls", None)
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"


def _walk(outputs: Sequence[torch.Tensor]) -> _Entry:
    """The nodes and leaves requiring grad that ``outputs`` depend on."""
    entry = _Entry(list(outputs))
    stack: list[Any] = []
    for t in outputs:
        if t.grad_fn is None:
            entry.leaves[id(t)] = t
        else:
            stack.append(t.grad_fn)
    seen = entry.nodes
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        hiding = _HIDING.get(_function_of(node) or "")
        if hiding is not None:
            raise RuntimeError(hiding)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            entry.leaves[id(variable)] = variable
            entry.accumulators[id(variable)] = node
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return entry


class _LeafLocks:
    """One lock per leaf a part lends ``.grad`` of, so that two parts sharing
    a leaf (a parameter server's, in two trainers' contexts) take turns while
    parts over other leaves run at once.  A part takes its locks in one
    global order (by id), so parts cannot deadlock each other; a lock goes
    when its leaf does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}

    def of(self, leaves: Sequence[torch.Tensor]) -> list[threading.Lock]:
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


def _span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A span named as torch's distributed engine names its nodes, where a
    profiler is on (none costs ~40 ns to ask)."""
    if torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def _storage_of(grad: torch.Tensor) -> int:
    """The address a gradient's memory is known by (a sparse one's values')."""
    if grad.layout is torch.sparse_coo:
        return grad._values().untyped_storage().data_ptr()
    return grad.untyped_storage().data_ptr()


def owned(grad: torch.Tensor, storages: set[int], shared: bool = False) -> torch.Tensor:
    """``grad``, or a copy where keeping it would share memory.

    As torch's ``AccumulateGrad::accumulateGrad``: a gradient an optimizer may
    update in place must be dense, contiguous and not alias another leaf's;
    ``shared`` (the tensor was handed to more than one leaf, so torch's
    engine held more references to it than one leaf's) copies it too.
    """
    if grad.layout is torch.sparse_coo:
        # A sparse gradient has no storage of its own: its values' and
        # indices' count, as in torch's AccumulateGrad for sparse ones.
        values = grad._values()
        ptr = values.untyped_storage().data_ptr()
        if (not shared and values.is_contiguous() and grad._indices().is_contiguous()
                and ptr not in storages):
            if ptr:
                storages.add(ptr)
            return grad
        return grad.clone()
    ptr = grad.untyped_storage().data_ptr()
    if not shared and grad.is_contiguous() and ptr not in storages:
        if ptr:
            storages.add(ptr)
        return grad
    return grad.clone(memory_format=torch.contiguous_format)


class WorkerPass:
    """This worker's part of one backward pass of context ``ctx`` (see the
    module's docstring).  Thread-safe: parts run on whichever threads their
    gradients arrive on.

    Args:
        ctx: the context.
        roots: the backward's roots on the worker that called it, else None.
        retain_graph: keep the graph for another pass (the caller's flag,
            carried to every worker); a part keeps what a later part of
            this pass still needs whatever it says.
        propagate: starts sending a recv's gradients to its sender.
        failure: ``exception -> value`` the pass ends with when a part fails
            here (the engine's Failure, naming this worker).
        on_end: called with the pass as it ends, before :attr:`done`
            completes (its owner forgets it there, so that a next pass of
            the context may begin as soon as anyone sees this one done).
        pass_id: the distributed pass this is a part of (its owner's key).
    """

    def __init__(self, ctx: DistAutogradContext, roots: list[torch.Tensor] | None,
                 retain_graph: bool, propagate: Propagate,
                 failure: Callable[[BaseException], Any],
                 on_end: Callable[[WorkerPass], None] | None = None,
                 pass_id: Any = None) -> None:
        self._ctx = ctx
        self.pass_id = pass_id
        self._on_end = on_end
        # With roots, the thread that called backward owns the pass and runs
        # every entry (serve()), as torch's local engine runs a graph task's
        # CPU work on its owner thread: what a profiler on that thread
        # records includes the whole of this worker's part.
        self._owner = threading.get_ident() if roots is not None else None
        self._queue: deque[tuple[int, Sequence[torch.Tensor | None]]] = deque()
        self._retain = retain_graph
        self._propagate = propagate
        self._failure_of = failure
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        #: Completes with None, or the first failure, once the pass ended.
        self.done: _Future = _Future()
        self._phase = Phase.RUNNING
        self._failure: Any = None  # the first failure
        self._entries: dict[int, _Entry] = {}
        # A graph the pass cannot run fails the pass at its first part (an
        # error naming this worker, as any part's), not the message.
        self._refused: RuntimeError | None = None
        try:
            if roots is not None:
                self._entries[ROOTS] = _walk(roots)
            for send_id, send in list(ctx.sends.items()):
                if send.capture.tensors:  # a send without tensors requiring grad gets nothing back
                    self._entries[send_id] = _walk(send.capture.tensors)
        except RuntimeError as exc:
            self._refused = exc
            keys = [ROOTS] if roots is not None else []
            keys += [k for k, send in ctx.sends.items() if send.capture.tensors]
            self._entries = {k: _Entry([]) for k in keys}
        self._left = set(self._entries)
        leaves: dict[int, torch.Tensor] = {}
        for entry in self._entries.values():
            leaves.update(entry.leaves)
        self._leaves = list(leaves.values())
        # Per recv message: the entries that reach any of its tensors.
        self._recvs: dict[int, Recv] = {}
        self._recv_waits: dict[int, set[int]] = {}
        for key, entry in self._entries.items():
            for leaf in entry.leaves.values():
                slot = ctx.recv_slot(leaf)
                if slot is not None:
                    self._recvs[id(slot[0])] = slot[0]
                    self._recv_waits.setdefault(id(slot[0]), set()).add(key)
        self._grads: dict[int, torch.Tensor] = {}      # id(leaf) -> the pass's gradient
        self._delivered: dict[int, set[int]] = {}      # storage -> ids of leaves given it
        self._sent: set[int] = set()                   # ids of recv leaves whose gradients went
        self._running: set[int] = set()
        self._calls = 0                                # propagations not yet answered
        self._serving = False                          # the owner thread took an entry
        # Final callbacks the parts queued (torch runs a graph task's at its
        # end: here, the pass's); _defer is one object, the parts' sink.
        self._deferred: list[Callable[[], None]] = []
        self._defer = self._deferred.append

    def expects(self, key: int) -> bool:
        """Whether entry ``key`` (a send id, or :data:`ROOTS`) is part of this
        pass and has not run yet."""
        with self._lock:
            return key in self._left

    # ------------------------------------------------------------- the parts

    def run(self, key: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Run entry ``key`` with the gradients of its outputs (None: none
        flows there), here or, where the pass has an owner thread, there;
        a failure ends the pass with it.  Never raises."""
        if self._owner is not None and threading.get_ident() != self._owner:
            with self._lock:
                self._queue.append((key, grads))
                self._wake.notify()
            return
        self._run_now(key, grads)

    def serve(self) -> Any:
        """On the owner thread: run the entries that arrive for it until the
        pass ends; the pass's result (None, or the failure)."""
        while True:
            with self._lock:
                while not self._queue and self._phase is not Phase.FINISHED:
                    self._wake.wait()
                if self._phase is Phase.FINISHED:
                    return self._failure
                key, grads = self._queue.popleft()
                # Taken from the queue, not yet running: the pass is not idle
                # (_check must not find it stuck between the two).
                self._serving = True
            try:
                self._run_now(key, grads)
            finally:
                with self._lock:
                    self._serving = False
            self._check()

    def _run_now(self, key: int, grads: Sequence[torch.Tensor | None]) -> None:
        started = False
        try:
            with self._lock:
                if self._phase is not Phase.RUNNING:
                    return  # stopped by a failure: a late part is dropped
                if key not in self._left or key in self._running:
                    raise DistAutogradError(
                        f"send {key} of autograd context {self._ctx.id} is not awaited by the "
                        "backward pass running on this worker: it was made after the pass "
                        "began, or its gradients came twice")
                self._running.add(key)
                started = True
                later = [self._entries[k] for k in self._left if k != key]
            if self._refused is not None:
                raise self._refused
            entry = self._entries[key]
            pairs = {id(t): (t, g) for t, g in zip(entry.outputs, grads)
                     if g is not None and t.requires_grad}
            if pairs:
                keep = self._retain or any(entry.nodes & other.nodes for other in later)
                # A send's part under torch's name for its node, for profilers.
                with _span("SendRpcBackward") if key != ROOTS else contextlib.nullcontext():
                    self._part([t for t, _ in pairs.values()],
                               [g for _, g in pairs.values()], entry, keep)
            ready = self._reached(key)
        except Exception as exc:
            if started:
                with self._lock:
                    self._running.discard(key)
            self._stop(self._failure_of(exc))
            return
        for recv in ready:
            self._send(recv)
        self._check()

    def _part(self, outs: list[torch.Tensor], gouts: list[torch.Tensor], entry: _Entry,
              keep: bool) -> None:
        """One local part through torch's engine, every leaf of the pass
        holding the pass's gradient in ``.grad`` meanwhile; the callbacks
        it queues wait for the pass's end (:meth:`_run_callbacks`)."""
        hooks = [node.register_prehook(functools.partial(self._arrived, leaf_id))
                 for leaf_id, node in entry.accumulators.items()]
        try:
            with self._lending():
                run_backward(outs, gouts, keep, self._defer)
        finally:
            for handle in hooks:
                handle.remove()

    @contextlib.contextmanager
    def _lending(self) -> Iterator[None]:
        """Every leaf of the pass holds the pass's gradient in ``.grad``
        meanwhile; what it holds after is the pass's, and ``.grad`` goes
        back to what the user had."""
        leaves = self._leaves
        locks = _leaf_locks.of(leaves)
        for lock in locks:
            lock.acquire()
        try:
            saved = [leaf.grad for leaf in leaves]
            try:
                for leaf in leaves:
                    leaf.grad = self._grads.get(id(leaf))
                yield
            finally:
                for leaf, grad in zip(leaves, saved):
                    now = leaf.grad
                    # (A recv leaf whose gradients went meanwhile is done with.)
                    if now is not None and id(leaf) not in self._sent:
                        self._grads[id(leaf)] = now
                    leaf.grad = grad
        finally:
            for lock in reversed(locks):
                lock.release()

    def _run_callbacks(self) -> None:
        """The callbacks the parts queued, in order, as torch's graph task
        runs its final callbacks once all of it ran: with the pass's
        gradients lent, so that what they write (DDP's finalize) is kept."""
        if not self._deferred:
            return
        with self._lending():
            while self._deferred:
                self._deferred.pop(0)()

    def _arrived(self, leaf_id: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """A gradient reached a leaf's AccumulateGrad (before it runs): which
        leaves each gradient tensor went to decides what the context keeps."""
        grad = grads[0] if grads else None
        if grad is not None:
            self._delivered.setdefault(_storage_of(grad), set()).add(leaf_id)

    def _reached(self, key: int) -> list[Recv]:
        """Entry ``key`` ran: the recvs whose every reaching entry has run
        now, counted as propagations in flight in the same step (the pass
        must not be seen to end between the two)."""
        ready: list[Recv] = []
        with self._lock:
            self._running.discard(key)
            self._left.discard(key)
            if self._phase is not Phase.RUNNING:
                return ready  # stopped meanwhile: nothing more goes out
            for recv_id, waits in self._recv_waits.items():
                if key in waits:
                    waits.discard(key)
                    if not waits:
                        ready.append(self._recvs[recv_id])
            for recv in ready:
                del self._recv_waits[id(recv)]
                self._sent.update(id(t) for t in recv.tensors)
            self._calls += len(ready)
        return ready

    def _send(self, recv: Recv) -> None:
        """Send ``recv``'s gradients (every entry reaching it ran) to its
        sender, once, as torch's RecvRpcBackward: None for a tensor no
        gradient reached."""
        grads = [self._grads.pop(id(t), None) for t in recv.tensors]
        with _span("RecvRpcBackward"):  # torch's name for the node that sends them
            sent = self._propagate(recv, grads)
        sent.add_done_callback(self._answered)

    def _answered(self, fut: _Future) -> None:
        exc = _torch_futures.failure(fut)
        # The call itself failed, or it answered (None, or the Failure).
        result = self._failure_of(exc) if exc is not None else fut.value()
        with self._lock:
            self._calls -= 1
        if result is not None:
            self._stop(result)
        else:
            self._check()

    # ------------------------------------------------------------- the end

    def _stop(self, failure: Any) -> None:
        """A part failed: keep the first failure, run and send nothing more,
        and end once the propagations in flight are answered."""
        with self._lock:
            if self._phase is Phase.RUNNING:
                self._phase = Phase.STOPPING
                self._failure = failure
                self._grads.clear()
                self._queue.clear()
        self._check()

    def _check(self) -> None:
        """End the pass if nothing of it is left to wait for, or if what it
        waits for can never come."""
        stuck: list[int] = []
        with self._lock:
            if self._calls or self._running:
                return
            if self._phase is Phase.STOPPING:
                failure = self._failure
            elif self._phase is Phase.RUNNING and not self._left:
                self._phase = Phase.COMMITTING
                failure = None
            elif (self._phase is Phase.RUNNING and self._owner is not None
                  and not self._queue and not self._serving and ROOTS not in self._left):
                stuck = sorted(self._left)
            else:
                return
        if stuck:
            self._stop(self._failure_of(self._stuck(stuck)))  # ends it: nothing in flight
            return
        if failure is None:
            try:
                self._run_callbacks()
                self._commit()
            except Exception as exc:
                failure = self._failure_of(exc)
        self._end(failure)

    def _stuck(self, keys: list[int]) -> DistAutogradError:
        """The error of a pass waiting for sends ``keys`` that no part of it
        reaches (see the module's docstring)."""
        sends = "; ".join(
            f"send {k} to worker id {self._ctx.sends[k].dest} (tensors of shapes "
            f"{', '.join(str(list(t.shape)) for t in self._ctx.sends[k].capture.tensors)})"
            for k in keys)
        return DistAutogradError(
            f"the backward pass of autograd context {self._ctx.id} cannot finish: it waits "
            f"for the gradients of {sends}, which no part of the pass reaches (a result "
            "the loss does not use?). Every send of a context carrying tensors that "
            "require grad must lead to the loss (torch's agent waits for ever here)")

    def _commit(self) -> None:
        """The pass's gradients into the context, as torch's engine
        accumulates them there: a gradient tensor one leaf alone was given is
        kept (no copy), one given to several leaves, or not dense and
        contiguous, or aliasing another, is copied."""
        storages: set[int] = set()
        for leaf in self._leaves:
            grad = self._grads.pop(id(leaf), None)
            if grad is None or self._ctx.recv_slot(leaf) is not None:
                continue
            shared = len(self._delivered.get(_storage_of(grad), ())) > 1
            self._ctx.accumulate(leaf, owned(grad, storages, shared))

    def _end(self, result: Any) -> None:
        """End the pass with ``result``: its owner (if any) forgets it, then
        :attr:`done` completes, then the owner thread stops serving."""
        with self._lock:
            if self._phase in (Phase.ENDED, Phase.FINISHED):
                return
            self._phase = Phase.ENDED
            self._failure = result
            self._grads.clear()
            self._queue.clear()
        if self._on_end is not None:
            self._on_end(self)
        self.done.set_result(result)
        with self._lock:
            self._phase = Phase.FINISHED
            self._wake.notify_all()
