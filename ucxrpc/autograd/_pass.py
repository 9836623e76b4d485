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
  context (torch's FAST mode, which assumes every send is part of it), and
  a send whose result the loss does not use never gets gradients.  torch's
  agent waits for ever there; here the caller's ``backward`` fails at once
  naming every worker that waits and for which sends
  (:meth:`WorkerPass._stuck`).  Telling that apart from gradients still on
  their way is termination detection, done as Dijkstra and Scholten's:
  a part is *engaged* by the message it is answering last (the one that
  began it, or the first that came while it was disengaged), and a part
  left with nothing running and every propagation of its own answered, but
  sends still awaited, answers that message with a :class:`Waits` report
  (who waits, for what) and is disengaged; the next message engages it
  again.  Any gradient still on its way is a part running or a propagation
  unanswered, so a chain of unanswered messages leads from it to the
  caller.  Where the caller has run its roots, nothing of its own runs or
  waits in line and every propagation it started was answered, nothing is
  on its way anywhere: what the latest reports (numbered per worker, the
  answers carrying them up) still say is awaited never comes.  The caller
  then fails the pass and ends the waiting parts (``_engine._abandon``).

* **Final callbacks at the end.** A callback a part queues with
  ``queue_callback`` (FSDP's, DDP-like reducers' in Python) runs when the
  pass ends here, every part run, with the pass's gradients lent, before
  the context gets them: torch's graph task runs its final callbacks once
  all of it ran (``_torch_engine`` defers them).

* **A leaf's node runs once.**  A leaf several entries reach (a parameter
  several micro-batches use) has its AccumulateGrad node run once, when the
  last of those entries ran, with the sum of what each sent it: such an
  entry's part runs only up to its leaves' nodes and hands over the
  gradients flowing into them (``_torch_engine.gradients_at``, the leaves'
  tensor hooks set aside meanwhile, or they would see each share), and
  :meth:`WorkerPass._gather` adds them up.  Its hooks then see what torch's
  graph task gives them: the whole gradient, once.

What torch's single task does that separate local parts cannot: an
*interior* node that two entries reach runs once per entry, each time with
its share of the gradient (the sums are the same, ``retain_grad``'s too; a
hook on such a node or its tensor sees the shares).  Cutting there as at a
leaf would not do: torch runs an interior node's tensor hooks (and
``retain_grad``) on the gradient it captures there, so they would see each
share and then the sum, and a hook that changes the gradient would be
applied twice.  The missing hook is a way to add roots with their
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
from ._torch_engine import gradients_at, hooks_set_aside, run_backward

__all__ = ["ROOTS", "WorkerPass", "owned"]

_Future = torch.futures.Future

#: The entry of the roots, on the worker that called ``backward``; sends
#: are entries under their send ids.
ROOTS = -1

#: Starts a propagation: ``(recv, gradients) -> future`` of a Failure, a
#: :class:`Waits` or None.
Propagate = Callable[[Recv, list[torch.Tensor | None]], _Future]


@dataclass(frozen=True)
class Waits:
    """A part's answer to the message engaging it while sends of the pass
    are still awaited somewhere below it (see the module's docstring): per
    worker id, its latest report ``(number, worker name, the sends it
    awaits, described)``; an empty tuple says that worker awaits nothing
    any more, superseding its earlier reports."""

    reports: dict[int, tuple[int, str, tuple[str, ...]]]


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
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # id -> leaf
    accumulators: dict[int, Any] = field(default_factory=dict)     # id(leaf) -> AccumulateGrad
    #: The nodes between the outputs and the leaves: where two entries
    #: share one, a later part runs it again (the module's docstring).
    inner: set[Any] = field(default_factory=set)


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
    seen: set[Any] = set()
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
    entry.inner = seen - set(entry.accumulators.values())
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
        me: this worker's id and name, for the reports of what it awaits.
    """

    def __init__(self, ctx: DistAutogradContext, roots: list[torch.Tensor] | None,
                 retain_graph: bool, propagate: Propagate,
                 failure: Callable[[BaseException], Any],
                 on_end: Callable[[WorkerPass], None] | None = None,
                 pass_id: Any = None, me: tuple[int, str] = (-1, "")) -> None:
        self._ctx = ctx
        self.pass_id = pass_id
        self._me = me
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
        # A leaf two or more entries reach gets its gradient from each; its
        # AccumulateGrad runs once, with the sum, when the last of them ran
        # (torch's graph task runs a node once all its inputs are in).
        reach: dict[int, set[int]] = {}
        self._accumulators: dict[int, Any] = {}   # id(leaf) -> AccumulateGrad, where seen
        for key, entry in self._entries.items():
            self._accumulators.update(entry.accumulators)
            for leaf_id, leaf in entry.leaves.items():
                if leaf.requires_grad:
                    reach.setdefault(leaf_id, set()).add(key)
        self._leaf_waits = {leaf_id: keys for leaf_id, keys in reach.items() if len(keys) > 1}
        self._shares: dict[int, torch.Tensor] = {}  # id(leaf) -> the sum come so far
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
        # Termination detection (the module's docstring): the future that
        # answers the message engaging this part (a part without roots),
        # messages on their way to a part from their engaging check, the
        # latest report of each worker below, and how many this one made.
        self._engager: _Future | None = None
        self._arriving = 0
        self._reports: dict[int, tuple[int, str, tuple[str, ...]]] = {}
        self._reported = 0
        #: Worker ids the caller found waiting for ever (their parts are
        #: to be ended when the pass fails so).
        self.stuck_workers: list[int] = []

    def expects(self, key: int) -> bool:
        """Whether entry ``key`` (a send id, or :data:`ROOTS`) is part of this
        pass and has not run yet."""
        with self._lock:
            return key in self._left

    # ------------------------------------------------------------- the parts

    def deliver(self, key: int, grads: Sequence[torch.Tensor | None]) -> _Future | None:
        """A peer's message with the gradients of entry ``key``: run it (as
        :meth:`run`).  Returns the future answering the message where it
        engages this part (a part without roots, disengaged: it answers at
        the part's end, or with a :class:`Waits` report when the part is
        left waiting), else None: answer it now."""
        engaging: _Future | None = None
        with self._lock:
            if self._owner is None:
                if self._phase is Phase.RUNNING and self._engager is None:
                    engaging = self._engager = _Future()
                # Until the entry is taken, the part is not idle: a check
                # meanwhile must not answer the engaging message.
                self._arriving += 1
        self.run(key, grads)
        return engaging

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
                if self._owner is None and self._arriving:
                    self._arriving -= 1
                # Taken in the same step as the arrival ends: the part is
                # never seen idle between the two.
                dropped = self._phase is not Phase.RUNNING
                if not dropped:
                    if key not in self._left or key in self._running:
                        raise DistAutogradError(
                            f"send {key} of autograd context {self._ctx.id} is not awaited by "
                            "the backward pass running on this worker: it was made after the "
                            "pass began, or its gradients came twice")
                    self._running.add(key)
                    started = True
                    later = [self._entries[k] for k in self._left if k != key]
            if dropped:  # stopped by a failure: a late part is dropped
                self._check()  # (its end may have waited for this arrival)
                return
            if self._refused is not None:
                raise self._refused
            entry = self._entries[key]
            pairs = {id(t): (t, g) for t, g in zip(entry.outputs, grads)
                     if g is not None and t.requires_grad}
            shares = not self._leaf_waits.keys().isdisjoint(entry.leaves)
            if pairs or shares:
                keep = self._retain or any(entry.inner & other.inner for other in later)
                # A send's part under torch's name for its node, for profilers.
                with _span("SendRpcBackward") if key != ROOTS else contextlib.nullcontext():
                    self._part(key, [t for t, _ in pairs.values()],
                               [g for _, g in pairs.values()], entry, keep, shares)
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

    def _part(self, key: int, outs: list[torch.Tensor], gouts: list[torch.Tensor],
              entry: _Entry, keep: bool, shares: bool) -> None:
        """One local part through torch's engine, every leaf of the pass
        holding the pass's gradient in ``.grad`` meanwhile; the callbacks
        it queues wait for the pass's end (:meth:`_run_callbacks`).

        Where the entry reaches a leaf another entry reaches too
        (``shares``), the part runs up to its leaves' AccumulateGrad nodes
        and takes the gradients flowing into them; each leaf's node then
        runs once its whole gradient is in (:meth:`_gather`)."""
        with self._lending():
            if not shares:
                self._accumulate(list(entry.accumulators),
                                 lambda: run_backward(outs, gouts, keep, self._defer))
                return
            leaves = [leaf for leaf in entry.leaves.values() if leaf.requires_grad]
            found: dict[int, torch.Tensor | None] = {}
            if outs:
                grads = gradients_at(outs, gouts, keep, leaves, self._defer)
                found = {id(leaf): grad for leaf, grad in zip(leaves, grads)}
            ready = self._gather(key, leaves, found)
            if ready:
                self._accumulate([id(leaf) for leaf, _ in ready], lambda: run_backward(
                    [leaf for leaf, _ in ready], [grad for _, grad in ready], False,
                    self._defer))

    def _accumulate(self, leaf_ids: list[int], run: Callable[[], None]) -> None:
        """``run``, noting which of the leaves ``leaf_ids`` each gradient
        tensor reaches (:meth:`_arrived`; a leaf that was itself sent, whose
        node the graph does not show, is not watched, as before)."""
        hooks = [self._accumulators[leaf_id].register_prehook(
                     functools.partial(self._arrived, leaf_id))
                 for leaf_id in leaf_ids if leaf_id in self._accumulators]
        try:
            run()
        finally:
            for handle in hooks:
                handle.remove()

    def _gather(self, key: int, leaves: list[torch.Tensor], found: dict[int, torch.Tensor | None]
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Entry ``key``'s gradients for its ``leaves`` (``found``; None
        where none flowed) added to what the other entries sharing a leaf
        gave; the leaves whose whole gradient is in now, with it."""
        ready: list[tuple[torch.Tensor, torch.Tensor]] = []
        with self._lock:
            for leaf in leaves:
                leaf_id = id(leaf)
                grad = found.get(leaf_id)
                waits = self._leaf_waits.get(leaf_id)
                if waits is None:  # this entry's alone
                    if grad is not None:
                        ready.append((leaf, grad))
                    continue
                if grad is not None:
                    held = self._shares.get(leaf_id)
                    self._shares[leaf_id] = grad if held is None else held + grad
                waits.discard(key)
                if not waits and leaf_id in self._shares:
                    ready.append((leaf, self._shares.pop(leaf_id)))
        return ready

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
                # The gradient goes to the context, not .grad: as under
                # torch's distributed engine, no post-accumulate-grad hook
                # runs (one stepping an optimizer would step with it).
                with hooks_set_aside(leaves, "_post_accumulate_grad_hooks"):
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
        # The call itself failed, or it answered (None, what waits below,
        # or the Failure).
        result = self._failure_of(exc) if exc is not None else fut.value()
        with self._lock:
            self._calls -= 1
            if isinstance(result, Waits):
                self._merge(result.reports)
                result = None
        if result is not None:
            self._stop(result)
        else:
            self._check()

    def _merge(self, reports: dict[int, tuple[int, str, tuple[str, ...]]]) -> None:
        """Keep each worker's latest report (under the lock)."""
        for worker, report in reports.items():
            mine = self._reports.get(worker)
            if mine is None or mine[0] < report[0]:
                self._reports[worker] = report

    def _report(self, awaited: Sequence[int]) -> Waits | None:
        """What this part answers its engaging message with (under the
        lock): its own report awaiting ``awaited`` (where it ever reported
        or awaits something) and the latest of those below; None where
        nobody reported anything."""
        if awaited or self._reported:
            self._reported += 1
            self._reports[self._me[0]] = (self._reported, self._me[1],
                                          tuple(self._describe(awaited)))
        return Waits(dict(self._reports)) if self._reports else None

    # ------------------------------------------------------------- the end

    def _stop(self, failure: Any) -> None:
        """A part failed: keep the first failure, run and send nothing more,
        and end once the propagations in flight are answered."""
        with self._lock:
            if self._phase is Phase.RUNNING:
                self._phase = Phase.STOPPING
                self._failure = failure
                self._grads.clear()
                self._shares.clear()
                self._queue.clear()
        self._check()

    def _check(self) -> None:
        """End the pass if nothing of it is left to wait for, or if what it
        waits for can never come; a part without roots left waiting answers
        its engaging message with what waits (the module's docstring)."""
        stuck: dict[int, tuple[str, tuple[str, ...]]] = {}
        answer: tuple[_Future, Waits | None] | None = None
        with self._lock:
            if self._calls or self._running or self._arriving:
                return
            waiting = {w: (name, sends) for w, (_, name, sends) in self._reports.items()
                       if sends and w != self._me[0]}
            if self._phase is Phase.STOPPING:
                failure = self._failure
            elif self._owner is None:
                if self._phase is not Phase.RUNNING:
                    return
                if self._left:  # idle, waiting: disengage
                    if self._engager is None:
                        return
                    answer = (self._engager, self._report(sorted(self._left)))
                    self._engager = None
                else:
                    self._phase = Phase.COMMITTING
                    failure = None
            elif (self._phase is Phase.RUNNING and not self._queue and not self._serving
                  and ROOTS not in self._left):
                if not self._left and not waiting:
                    self._phase = Phase.COMMITTING
                    failure = None
                else:
                    stuck = waiting
                    if self._left:
                        own = tuple(self._describe(sorted(self._left)))
                        stuck[self._me[0]] = (self._me[1], own)
                    self.stuck_workers = sorted(w for w in stuck if w != self._me[0])
            else:
                return
        if answer is not None:
            answer[0].set_result(answer[1])
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

    def _describe(self, keys: Sequence[int]) -> list[str]:
        return [f"send {k} to worker id {self._ctx.sends[k].dest} (tensors of shapes "
                f"{', '.join(str(list(t.shape)) for t in self._ctx.sends[k].capture.tensors)})"
                for k in keys]

    def _stuck(self, stuck: dict[int, tuple[str, tuple[str, ...]]]) -> DistAutogradError:
        """The error of a pass whose workers (this one's id included where
        it waits itself) wait for sends that no part of it reaches (see the
        module's docstring)."""
        waits = "; ".join(
            f"{'it' if w == self._me[0] else f'{name} (worker id {w})'} waits for the "
            f"gradients of {'; '.join(sends)}"
            for w, (name, sends) in sorted(stuck.items(), key=lambda kv: kv[0] != self._me[0]))
        return DistAutogradError(
            f"the backward pass of autograd context {self._ctx.id} cannot finish: {waits}, "
            "which no part of the pass reaches (a result the loss does not use?). Every "
            "send of a context carrying tensors that require grad must lead to the loss "
            "(torch's agent waits for ever here)")

    def abandon(self, failure: Any) -> None:
        """The caller found this part waiting for ever: end it with
        ``failure`` (nothing of it is in flight)."""
        self._stop(failure)

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
            engager, self._engager = self._engager, None
            answer = result if result is not None else self._report(())
        if self._on_end is not None:
            self._on_end(self)
        if engager is not None:
            engager.set_result(answer)
        self.done.set_result(result)
        with self._lock:
            self._phase = Phase.FINISHED
            self._wake.notify_all()
