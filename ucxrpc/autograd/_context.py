"""Distributed autograd contexts and the per-worker table that holds them.

A context is one forward and backward pass of a distributed model.  It lives
on every worker the pass touched, under the same id, and records there:

* sends: tensors requiring grad that this worker sent (arguments or return
  values), by a send id unique on this worker.  The gradients for them come
  back from the receiver during backward.
* recvs: tensors requiring grad that this worker received, each with the
  sender and its send id.  The receiver makes them fresh leaves; during
  backward their gradients go back to the sender instead of into the context.
* gradients of this worker's other leaves, accumulated over backward passes.
* the workers it exchanged messages with, to release the context there too.

Pure bookkeeping: nothing here sends a message (CUDA gradients are marked
with events, so that readers on other streams wait for them).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ..devices import ReadyEvents
from ..errors import DistAutogradError
from ..serialization.pickler import GradCapture

# The context of the running thread: the ``with context()`` block, or the
# context of the request a handler serves.  A ContextVar rather than a
# thread-local so that work handed to the pool with copy_context() (remote())
# keeps recording into it.
CURRENT: ContextVar[int | None] = ContextVar("ucxrpc_autograd_context", default=None)

# Context id layout, as torch: the creating worker's id above the counter.
_COUNTER_BITS = 48
_MAX_WORKER_ID = (1 << 16) - 1

# Released ids remembered so that a message arriving late for one does not
# bring the context back (it would never be released again).
_TOMBSTONES = 4096


def unknown_context(context_id: int, why: str | None = None) -> DistAutogradError:
    """torch's error for an unknown context, with why it is gone where known."""
    return DistAutogradError(f"Could not find autograd context with id: {context_id}"
                             + ("" if why is None else f" ({why})"))


@dataclass(slots=True)
class Send:
    dest: int
    capture: GradCapture  # filled by the serializer as the message is pickled


@dataclass(slots=True)
class Recv:
    source: int
    send_id: int
    tensors: list[torch.Tensor]


#: Ended passes a context remembers: a context sees one pass per step, a
#: few with retain_graph; a message late by more passes than this is not.
_ENDED_PASSES = 64


class DistAutogradContext:
    """One context on one worker.  Thread-safe."""

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self._lock = threading.Lock()
        self.sends: dict[int, Send] = {}
        self._recv_of: dict[int, tuple[Recv, int]] = {}  # id(tensor) -> (recv, position)
        self._grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(leaf) -> (leaf, grad)
        self._ready = ReadyEvents()  # where the CUDA gradients' accumulations end
        self.known: set[int] = set()
        self.backward_passes = 0
        #: This worker's part of the backward pass running now, if one is
        #: (a WorkerPass; the engine's to set, under its lock).
        self.running_pass: Any = None
        #: The ids of the passes whose part here ended (the engine's): a
        #: late message of one of them must not begin a part anew.
        self.ended_passes: deque[Any] = deque(maxlen=_ENDED_PASSES)

    def _context_id(self) -> int:  # torch's name
        return self.id

    def add_send(self, send_id: int, dest: int, capture: GradCapture) -> None:
        with self._lock:
            self.sends[send_id] = Send(dest, capture)
            self.known.add(dest)

    def add_recv(self, source: int, send_id: int, tensors: list[torch.Tensor]) -> None:
        recv = Recv(source, send_id, tensors)
        with self._lock:
            self.known.add(source)
            for i, t in enumerate(tensors):
                self._recv_of[id(t)] = (recv, i)

    def touch(self, worker: int) -> None:
        with self._lock:
            self.known.add(worker)

    def recv_slot(self, t: torch.Tensor) -> tuple[Recv, int] | None:
        """Where ``t`` came from, if it is a tensor this worker received."""
        slot = self._recv_of.get(id(t))
        # The id of a dead tensor may be reused: the recv keeps its tensors
        # alive, so identity settles it.
        if slot is not None and slot[0].tensors[slot[1]] is t:
            return slot
        return None

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` to ``leaf``'s gradient; the first one is kept as it is
        (the caller hands over a tensor nothing else uses).

        A CUDA gradient is queued on the caller's current stream, which
        differs from one propagation to the next (each is a served call on
        a pool stream): so the sum waits for the earlier accumulations, and
        an event marks where this one ends (see :meth:`gradients`).
        """
        with self._lock:
            old = self._grads.get(id(leaf))
            if old is not None and grad.is_cuda:
                self._ready.block(grad.device)  # the sum reads the earlier gradient
            self._grads[id(leaf)] = (leaf, grad if old is None else old[1] + grad)
            if grad.is_cuda:
                self._ready.record(grad.device)

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """Leaf -> gradient.  Work queued afterwards on the current streams
        (an optimizer's step, reading them here) follows the accumulations,
        whatever streams those ran on, as torch's ``getGradients``."""
        with self._lock:
            self._ready.block()
            return {leaf: grad for leaf, grad in self._grads.values()}

    def peers(self, me: int) -> set[int]:
        with self._lock:
            return self.known - {me}

    def __repr__(self) -> str:
        return (f"DistAutogradContext(id={self.id}, sends={len(self.sends)}, "
                f"recvs={len(self._recv_of)}, known={sorted(self.known)})")


class ContextTable:
    """This worker's contexts by id."""

    def __init__(self, worker_id: int) -> None:
        if not 0 <= worker_id <= _MAX_WORKER_ID:
            raise DistAutogradError(f"worker id {worker_id} does not fit in a context id's "
                                    f"16 worker bits")
        self.me = worker_id
        self._contexts: dict[int, DistAutogradContext] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._send_ids = itertools.count(1)
        self._released: deque[int] = deque(maxlen=_TOMBSTONES)
        self._released_set: set[int] = set()
        #: Contexts dropped because their creator failed or became
        #: unreachable, and why (the latest _TOMBSTONES): a pass that comes
        #: back for one after an outage is told so.
        self._dropped: dict[int, str] = {}
        self.backward_passes = 0  # running now, on this worker

    def new(self) -> DistAutogradContext:
        n = next(self._counter)
        if n >= 1 << _COUNTER_BITS:
            raise DistAutogradError("this worker has used up its autograd context ids")
        ctx = DistAutogradContext((self.me << _COUNTER_BITS) | n)
        with self._lock:
            self._contexts[ctx.id] = ctx
        return ctx

    def get(self, context_id: int) -> DistAutogradContext:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise unknown_context(context_id, self._dropped.get(context_id))
        return ctx

    def find(self, context_id: int) -> DistAutogradContext | None:
        return self._contexts.get(context_id)

    def join(self, context_id: int) -> DistAutogradContext | None:
        """The context a message from another worker belongs to, made on
        first contact; None if it was released here already."""
        ctx = self._contexts.get(context_id)
        if ctx is not None:
            return ctx
        with self._lock:
            if context_id in self._released_set:
                return None
            return self._contexts.setdefault(context_id, DistAutogradContext(context_id))

    def pop(self, context_id: int) -> DistAutogradContext | None:
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
            if ctx is not None:
                if len(self._released) == self._released.maxlen:
                    self._released_set.discard(self._released[0])
                self._released.append(context_id)
                self._released_set.add(context_id)
        return ctx

    def drop_created_by(self, worker: int, err: BaseException | None = None) -> None:
        """Forget the contexts a worker that died, became unreachable or
        left created (``err``: how its calls fail): the release it would
        have sent never comes, or no longer means anything.  A later use of
        one is told why."""
        with self._lock:
            ids = [i for i in self._contexts if i >> _COUNTER_BITS == worker]
            why = (f"dropped on worker {self.me} when {err} (a distributed autograd context "
                   "does not outlive a failure, or an outage, between the workers it spans)")
            for i in ids:
                self._dropped[i] = why
            while len(self._dropped) > _TOMBSTONES:
                del self._dropped[next(iter(self._dropped))]
        for i in ids:
            self.pop(i)

    def next_send_id(self) -> int:
        return next(self._send_ids)

    def __len__(self) -> int:
        return len(self._contexts)
