"""torch's legacy autograd profiler as RPC profiling needs it: the one user
of its private hooks.

torch 2.13 profiles RPC only under the legacy profiler
(``torch.autograd.profiler_legacy.profile``): its agent records no RPC
under Kineto (``torch.profiler.profile``, and ``torch.autograd.profiler.profile``,
which is Kineto too).  What ucxrpc needs from it, all checked against the
pinned torch by ``tests/test_torch_profiler.py``:

* ``torch.autograd._profiler_enabled`` and ``torch._C._autograd._profiler_type``:
  whether a profiler is on in this thread, and which (torch's ``rpc.api``
  asks the same two questions).
* ``torch.autograd._enable_profiler_legacy`` / ``_disable_profiler_legacy`` and
  ``ProfilerConfig``: a callee profiles the function it runs with its
  caller's settings (torch's agent does it in C++, ``RpcWithProfilingReq``).
* ``profiler_legacy.profile._start_trace`` and ``profiler_legacy._parse_legacy_records``,
  wrapped once by :func:`install`: a profile's start tells which settings its
  callees get, and the events RPC brought back join the profile's own before
  it builds its tree.  torch's agent adds them in C++
  (``profiler::addEventList``), which Python cannot reach, and a
  ``ProfilerConfig`` cannot be read back in Python.
* ``torch._C._distributed_rpc._set_profiler_node_id``: every event records
  this worker's rank as its ``node_id``, as under torch's agent.
* ``torch.jit._builtins._find_builtin``: a builtin's qualified name
  (``aten::add``), which torch's profiling key uses.

Events cross the wire as :class:`Event` (plain data): a callee's
``FunctionEvent`` objects are read into them, and a caller's profile makes
``FunctionEvent`` objects of them again.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Callable, NamedTuple

import torch
from torch.autograd import profiler_legacy
from torch.autograd.profiler_util import MEMORY_EVENT_NAME, FunctionEvent

__all__ = ["CalleeProfile", "Event", "Session", "Settings", "builtin_name", "current_session",
           "install", "legacy_profiler_on", "now_us", "profiler_enabled"]

logger = logging.getLogger(__name__)

#: Whether a profiler (of any kind) is on in this thread: the one check an
#: RPC pays while none is (a C call, about 40 ns).
profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled

_profiler_type = torch._C._autograd._profiler_type
_LEGACY = torch._C._profiler.ActiveProfilerType.LEGACY

# torch's own functions, kept before install() wraps them: a callee parses
# its records with torch's parser, which must not take the thread's session.
_torch_parse = profiler_legacy._parse_legacy_records
_torch_start_trace = profiler_legacy.profile._start_trace


def legacy_profiler_on() -> bool:
    """Whether this thread's profiler is the legacy one, the only one torch
    profiles RPC under."""
    return bool(_profiler_type() == _LEGACY)


def now_us() -> float:
    """The legacy profiler's clock: wall time (``CLOCK_REALTIME``) in
    microseconds, so one host's processes agree on it (and hosts do as far
    as their clocks do, as in torch)."""
    return time.time_ns() / 1000.0


def builtin_name(func: Any) -> str | None:
    """``aten::add`` for ``torch.add``: the name torch's profiling key gives a
    builtin; None for any other function."""
    name = torch.jit._builtins._find_builtin(func)
    return None if name is None else str(name)


class Settings(NamedTuple):
    """What a legacy profile records, as its callees are told."""

    use_cuda: bool = False
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False


class Event(NamedTuple):
    """One profiled event as plain data.

    Times are :func:`now_us` wall-clock microseconds; ``thread`` None means
    the thread of the session that holds the event (a span the session
    recorded itself, before that thread's torch id is known).  ``handle``
    is torch's record handle (``FunctionEvent.id``).
    """

    name: str
    trace_name: str | None
    node_id: int
    thread: int | None
    start_us: float
    end_us: float
    is_async: bool = False
    is_remote: bool = False
    input_shapes: Any = None
    stack: tuple[str, ...] = ()
    scope: int = 0
    use_device: str | None = None
    cpu_memory_usage: int = 0
    device_memory_usage: int = 0
    sequence_nr: int = -1
    fwd_thread: int | None = None
    flops: int | None = None
    kernels: tuple[tuple[str, int, float], ...] = ()
    handle: int = 0

    def remote(self, prefix: str) -> Event:
        """This event as the caller of the call that ran it records it:
        named after the call (``prefix`` is ``<key>#remote_op: ``) and
        remote.  A top-level ``[memory]`` event stays as it is: torch's
        parser makes those anew, unnamed and unattributed."""
        if self.name == MEMORY_EVENT_NAME:
            return self
        return self._replace(name=prefix + self.name, is_remote=True,
                             trace_name=None if self.trace_name is None
                             else prefix + self.trace_name)


class Session:
    """The RPC side of one legacy profiling session (one thread): the spans
    of the calls made in it and the events their callees sent back, which
    join the session's own events when it ends.  Thread-safe: replies add
    to it from whichever thread completes them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def add(self, events: Iterable[Event]) -> None:
        with self._lock:
            self._events.extend(events)

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)


_local = threading.local()


def current_session() -> Session | None:
    """The session of the legacy profile on this thread, if one started
    after :func:`install` (or this thread is a profiled callee's)."""
    return getattr(_local, "session", None)


# ----------------------------------------------------------------- install

_install_lock = threading.Lock()


def install(node_id: int) -> None:
    """Make this process's legacy profiles RPC-aware (idempotent): each
    records ``node_id`` as its events' node, a profile's start opens its
    :class:`Session`, and its end merges the session's events.

    Done at ``init_rpc``, never at import: until then torch is untouched.
    A torch without these hooks keeps working, its profiles without the
    callees' events (logged once).
    """
    setter = getattr(getattr(torch._C, "_distributed_rpc", None), "_set_profiler_node_id", None)
    if setter is not None and node_id >= 0:  # torch refuses a negative id
        setter(node_id)
    with _install_lock:
        if getattr(profiler_legacy._parse_legacy_records, "_ucxrpc", False):
            return
        if not (callable(_torch_parse) and callable(_torch_start_trace)):
            logger.warning("torch's legacy profiler has no _parse_legacy_records or "
                           "profile._start_trace: RPC profiles will lack the callees' events")
            return
        profiler_legacy.profile._start_trace = _start_trace  # type: ignore[method-assign]
        profiler_legacy._parse_legacy_records = _parse_legacy_records


def _start_trace(self: Any) -> None:
    """``profile._start_trace``, which then opens the thread's session."""
    _torch_start_trace(self)
    _local.session = Session(Settings(
        use_cuda=bool(getattr(self, "use_cuda", False)),
        record_shapes=bool(getattr(self, "record_shapes", False)),
        profile_memory=bool(getattr(self, "profile_memory", False)),
        with_stack=bool(getattr(self, "with_stack", False)),
        with_flops=bool(getattr(self, "with_flops", False)),
        with_modules=bool(getattr(self, "with_modules", False))))


def _parse_legacy_records(thread_records: Any) -> list[FunctionEvent]:
    """torch's parser, plus the events of the thread's session (which ends
    here: a thread runs one legacy profile at a time)."""
    functions: list[FunctionEvent] = _torch_parse(thread_records)
    session = _local.__dict__.pop("session", None)
    extra = session.events() if session is not None else []
    if extra:
        base_us, thread = _start_of(thread_records)
        functions.extend(_function_event(e, base_us, thread) for e in extra)
        # torch's own order: by start, the outer of two nested events first.
        functions.sort(key=lambda evt: [evt.time_range.start, -evt.time_range.end])
    return functions


_parse_legacy_records._ucxrpc = True  # type: ignore[attr-defined]


# ------------------------------------------------------------------ callee

class CalleeProfile:
    """The profile a callee runs a profiled caller's function under, with
    the caller's settings, on the thread that runs it.

    :meth:`start` and :meth:`stop` on that thread around the function's
    synchronous part; :meth:`events` (any thread, later for an
    ``@async_execution`` function) gives what the caller gets, the events of
    the callee's own calls included: those land in :attr:`session`, which
    the function's calls find as this thread's while it runs.
    """

    def __init__(self, settings: Settings) -> None:
        self.session = Session(settings)
        self._outer: Session | None = None
        self._records: Any = None
        self._on = False

    def start(self) -> None:
        """Turn the legacy profiler on in this thread.  Where this thread
        profiles already, nothing is recorded (logged at DEBUG)."""
        try:
            torch.autograd._enable_profiler_legacy(_config(self.session.settings))
        except RuntimeError as exc:
            logger.debug("not profiling an RPC's function: %s", exc)
            return
        self._on = True
        self._outer = current_session()
        _local.session = self.session

    def stop(self) -> None:
        """Turn it off again, keeping what it recorded."""
        if not self._on:
            return
        self._on = False
        _local.session = self._outer
        self._records = torch.autograd._disable_profiler_legacy()

    def events(self) -> list[Event]:
        """Everything recorded, in wall-clock time, for the caller."""
        if self._records is None:
            return []
        base_us, thread = _start_of(self._records)
        out = [_event(fe, base_us) for fe in _torch_parse(self._records)]
        out.extend(e if e.thread is not None else e._replace(thread=thread)
                   for e in self.session.events())
        return out


def _config(settings: Settings) -> Any:
    state = torch.autograd.ProfilerState.CPU
    if settings.use_cuda:
        if torch.cuda.is_available():
            state = torch.autograd.ProfilerState.CUDA
        else:  # as torch's agent: the caller's CUDA profiling, on CPU here
            logger.warning("Profiler was requested to be enabled with CUDA on this node, but "
                           "CUDA is not available. Falling back to CPU profiling only.")
    return torch.autograd.ProfilerConfig(
        state, settings.record_shapes, settings.profile_memory, settings.with_stack,
        settings.with_flops, settings.with_modules, torch._C._profiler._ExperimentalConfig())


# ---------------------------------------------------------- conversions

def _start_of(thread_records: Any) -> tuple[float, int]:
    """Wall time and torch thread id of a session's ``__start_profile``
    (torch's parser has checked it is there)."""
    for record in itertools.chain.from_iterable(thread_records):
        if record.name() == "__start_profile":
            return float(record.start_us()), int(record.thread_id())
    raise RuntimeError("legacy profiler records without a __start_profile event")


def _event(fe: FunctionEvent, base_us: float) -> Event:
    return Event(
        name=fe.name, trace_name=fe.trace_name, node_id=fe.node_id, thread=fe.thread,
        start_us=base_us + fe.time_range.start, end_us=base_us + fe.time_range.end,
        is_async=fe.is_async, is_remote=fe.is_remote, input_shapes=fe.input_shapes,
        stack=tuple(fe.stack or ()), scope=fe.scope, use_device=fe.use_device,
        cpu_memory_usage=fe.cpu_memory_usage, device_memory_usage=fe.device_memory_usage,
        sequence_nr=fe.sequence_nr, fwd_thread=fe.fwd_thread, flops=fe.flops,
        kernels=tuple((k.name, k.device, k.duration) for k in fe.kernels), handle=fe.id)


def _function_event(e: Event, base_us: float, thread: int) -> FunctionEvent:
    # A top-level [memory] event has no time, as torch's parser makes them.
    memory = e.name == MEMORY_EVENT_NAME
    fe = FunctionEvent(
        id=e.handle, name=e.name, trace_name=e.trace_name,
        thread=thread if e.thread is None else e.thread,
        start_us=0 if memory else e.start_us - base_us, end_us=0 if memory else e.end_us - base_us,
        fwd_thread=e.fwd_thread, input_shapes=e.input_shapes, stack=list(e.stack),
        scope=e.scope, use_device=e.use_device, cpu_memory_usage=e.cpu_memory_usage,
        device_memory_usage=e.device_memory_usage, is_async=e.is_async,
        is_remote=e.is_remote, sequence_nr=e.sequence_nr, node_id=e.node_id,
        device_type=torch.autograd.DeviceType.CPU, is_legacy=True, flops=e.flops)
    for name, device, duration in e.kernels:
        fe.append_kernel(name, device, duration)
    return fe
