"""The public RPC calls, with torch.distributed.rpc's signatures and semantics."""

from __future__ import annotations

import enum
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Literal, overload

import torch

from . import _all_gather as _gather_protocol, _torch_futures, profiling, timeouts
from ._all_gather import _all_gather, _gatherings
from .agent import membership as _membership, rendezvous
from ._torch_profiler import profiler_enabled
from .agent import RpcAgent, WorkerInfo, check_name
from .agent.calls import CallFuture
from .errors import BrokenError, RpcError
from .functions import _plain
from .options import RpcBackendOptions, UcxRpcBackendOptions

if TYPE_CHECKING:
    from .agent.calls import SyncReply

logger = logging.getLogger(__name__)

_agent: RpcAgent | None = None
_lifecycle = threading.Lock()

_NOT_INITIALIZED = ("RPC has not been initialized. Call "
                    "torch.distributed.rpc.init_rpc first.")


class BackendType(enum.Enum):
    """The only backend ucxrpc has; accepted for torch compatibility.

    ``TENSORPIPE``, torch's default backend, is the same member under
    torch's name (an alias: ``BackendType.TENSORPIPE is BackendType.UCX``),
    so a program that names torch's backend runs on ucxrpc's.
    """

    UCX = "UCX"
    TENSORPIPE = "UCX"


def _current() -> RpcAgent:
    agent = _agent
    if agent is None:
        raise RpcError(_NOT_INITIALIZED)
    return agent


def init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: UcxRpcBackendOptions | None = None) -> None:
    """Join the job as ``name``: rendezvous, exchange addresses, barrier.

    Blocks until every worker joined or ``rpc_timeout`` passed.

    Raises:
        ValueError: bad name or options.
        RpcError: already initialized, duplicate names, rendezvous failure.
    """
    global _agent
    check_name(name)
    if backend not in (None, BackendType.UCX, "UCX", "ucx"):
        raise TypeError(f"Argument backend must be a member of BackendType: ucxrpc only has "
                        f"the UCX backend, got {backend!r}")
    opts = rpc_backend_options or UcxRpcBackendOptions()
    if not isinstance(opts, UcxRpcBackendOptions):
        # torch's words first, for the backend's own check where the
        # options are torch's base class, else for the argument's type.
        said = ("`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`"
                if isinstance(opts, RpcBackendOptions) else
                "Argument rpc_backend_options must be an instance of RpcBackendOptions")
        raise TypeError(f"{said}: ucxrpc takes UcxRpcBackendOptions (TensorPipeRpcBackendOptions "
                        f"is one), got {type(opts).__name__}")
    dynamic = not world_size
    default = timeouts.of_option(opts.rpc_timeout)
    if dynamic and rank < 0 and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    with _lifecycle:
        if _agent is not None:
            raise RpcError("RPC is already initialized")
        # torch.futures.wait_all / collect_all fail fast on our futures too.
        _torch_futures.install()
        if dynamic:
            store = rendezvous.open_dynamic_store(opts.init_method, rank, default)
            # First: the keys a worker of the other kind would wait for (the
            # job secret, ...) are not where it looks.
            rendezvous.claim_mode(store, "dynamic")
            agent = RpcAgent(name, rank, None, opts, store)
        else:
            store, rank, world_size = rendezvous.open_store(opts.init_method, rank,
                                                            int(world_size or 0), default)
            rendezvous.claim_mode(store, "static")
            agent = RpcAgent(name, rank, world_size, opts, store)
        # Before peers may call us: their profiled calls' events name our rank.
        profiling.install(agent)
        # Published before joining: peers may call us as soon as our
        # transport runs, and their functions may use the API.
        _agent = agent
        try:
            if dynamic:
                _membership.join(agent, default, _welcome, _farewell)
            else:
                agent.join(default)
        except BaseException:
            _agent = None
            agent.shutdown(graceful=False, timeout=None)
            raise


@_plain
def _welcome(record: str) -> None:
    """Run on every present worker when one joins a dynamic group."""
    _current().members.add(rendezvous.Member.from_json(record.encode()))


@_plain
def _farewell(rank: int) -> None:
    """Run on every present worker when one leaves a dynamic group."""
    _current().members.remove(rank)


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the job.

    ``graceful`` waits for this worker's outstanding calls, then for every
    live worker to reach shutdown, however long the job runs (a worker that
    dies meanwhile is not waited for: the kernel tells us), then tears down.
    ``timeout`` in seconds bounds each of those waits, as in torch: 0 (the
    default) for no limit, a negative value for the RPC timeout.  Resources
    are always released; a second call raises "RPC has not been
    initialized", as torch's does.
    """
    global _agent
    with _lifecycle:
        agent = _current()
        try:
            agent.shutdown(graceful, timeouts.for_wait(timeout, agent.default_timeout))
        finally:
            _agent = None


def rpc_async(to: Any, func: Callable[..., Any], args: tuple[Any, ...] | None = None,
              kwargs: dict[str, Any] | None = None, timeout: float = -1.0) -> torch.futures.Future:
    """Call ``func(*args, **kwargs)`` on ``to``; returns a Future at once.

    ``to`` is a name, rank or WorkerInfo.  ``timeout`` in seconds: -1 uses
    the default (``rpc_timeout``), 0 waits forever.

    Raises:
        RpcError: RPC is not initialized, or the agent shut down; an
            unknown ``to`` (a RuntimeError, as torch's).
        TypeError: ``to`` is not a name, rank or WorkerInfo.
        ValueError: ``timeout`` is negative but not -1.
        Exception: pickling the call failed, with the pickler's own type.
        FrameError: the message breaks a limit (``max_message_bytes``...).

    The future fails instead with :class:`RpcTimeoutError` (a RuntimeError
    saying the RPC timed out) on expiry, :class:`BrokenError` naming the
    peer when it is dead or dies or :class:`PeerLeftError` when it left or
    leaves its group, and the remote exception with its own type when
    ``func`` raises.
    """
    agent = _agent  # (_current, inline: a call fewer a call)
    if agent is None:
        raise RpcError(_NOT_INITIALIZED)
    try:
        return _call(agent, to, func, args, kwargs, timeout)
    except BrokenError as exc:
        # A peer known dead fails the future, as torch's agent does, not
        # the call: a program handles a dead peer where it waits.
        fut = CallFuture(agent.devices)
        _torch_futures.fail(fut, exc)
        return fut


@overload
def _call(agent: RpcAgent, to: Any, func: Callable[..., Any], args: tuple[Any, ...] | None,
          kwargs: dict[str, Any] | None, timeout: float,
          waited: Literal[False] = False) -> torch.futures.Future: ...


@overload
def _call(agent: RpcAgent, to: Any, func: Callable[..., Any], args: tuple[Any, ...] | None,
          kwargs: dict[str, Any] | None, timeout: float,
          waited: bool) -> torch.futures.Future | SyncReply: ...


def _call(agent: RpcAgent, to: Any, func: Callable[..., Any], args: tuple[Any, ...] | None,
          kwargs: dict[str, Any] | None, timeout: float, waited: bool = False
          ) -> torch.futures.Future | SyncReply:
    if profiler_enabled():  # the one check a call pays for torch's profiler
        return profiling.call(agent, agent.members.resolve(to), func, tuple(args or ()),
                              dict(kwargs or {}), timeouts.for_call(timeout, agent.default_timeout),
                              waited)
    # (for_call's commonest answer, inline: a call fewer a call)
    return agent.call(agent.members.resolve(to), func, tuple(args or ()), dict(kwargs or {}),
                      agent.default_timeout if timeout == timeouts.UNSET
                      else timeouts.for_call(timeout, agent.default_timeout), waited=waited)


def rpc_sync(to: Any, func: Callable[..., Any], args: tuple[Any, ...] | None = None,
             kwargs: dict[str, Any] | None = None, timeout: float = -1.0) -> Any:
    """Like :func:`rpc_async`, then wait: returns the result, or raises
    what :func:`rpc_async` raises or its future fails with (the remote
    exception with its own type, the remote traceback in its message).
    ``timeout`` as :func:`rpc_async`'s."""
    agent = _agent  # (_current, inline: a call fewer a call)
    if agent is None:
        raise RpcError(_NOT_INITIALIZED)
    return agent.wait(_call(agent, to, func, args, kwargs, timeout, waited=True))


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """This worker's WorkerInfo, or the named worker's.

    Raises:
        RpcError: RPC is not initialized, or no worker has that name.
    """
    agent = _current()
    if worker_name is None:
        return agent.info
    return agent.members.resolve(worker_name)


def get_rpc_timeout() -> float:
    """The default RPC timeout in seconds, as given (0: none).

    Raises:
        RpcError: RPC is not initialized.
    """
    return _current().options.rpc_timeout


def get_pipe_info(to: Any = None) -> list[dict[str, Any]]:
    """Per open pipe: the peer, the UCX transports and lanes its endpoint
    uses (as UCX reports them), how CUDA tensors travel on it
    (``cuda_path``), its state and message counts; for ``to`` only if given.

    Raises:
        RpcError: RPC is not initialized, or ``to`` is unknown.
    """
    agent = _current()
    peer = None if to is None else agent.members.resolve(to).id
    return agent.transport.pipe_info(peer)


def _get_debug_info() -> dict[str, Any]:
    """Agent counters (calls sent/served, timeouts, failures, frames refused)."""
    return _current().debug_info()


def is_initialized() -> bool:
    """Whether ``init_rpc`` ran in this process and ``shutdown`` did not yet."""
    return _agent is not None


def is_available() -> bool:
    """Whether RPC is available: always True (torch's says whether its build
    has RPC).  A plain function, so that TorchScript compiles code calling
    ``torch.distributed.rpc.is_available()`` where ucxrpc stands in."""
    return True


# -- torch's private names that libraries reach for ------------------------------
#
# Not torch's documented API, but called by torch's own sharding code, PyG's
# distributed package and programs that guard their shutdown:
# ``rpc._is_current_rpc_agent_set()``, ``rpc._get_current_rpc_agent()
# .get_worker_infos()``, ``rpc._set_rpc_timeout``, ``rpc.api._all_gather``
# (ucxrpc/_all_gather.py holds its protocol; it is imported here, where
# torch has it, and given the three functions of ours it calls, at the end
# of this module).

#: The tests look into an agent's all-gathers as ``api._gatherings``
#: (tests/rpc/test_all_gather.py): imported for them, and named here so the
#: import counts as used.
_FOR_TESTS = (_gatherings,)


def _is_current_rpc_agent_set() -> bool:
    """torch's name for :func:`is_initialized`."""
    return _agent is not None


def _get_current_rpc_agent() -> RpcAgent:
    """This process's agent, with torch's ``RpcAgent`` methods
    (``get_worker_info``, ``get_worker_infos``, ``get_debug_info``).

    Raises:
        RpcError: RPC is not initialized.
    """
    return _current()


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """The default timeout of the calls made from now on, in seconds (0:
    none), as torch's: :func:`get_rpc_timeout` reads it back."""
    agent = _current()
    seconds = float(rpc_timeout)
    if seconds < 0:
        raise ValueError(f"rpc_timeout must be >= 0 seconds (0: none), got {rpc_timeout!r}")
    agent.options.rpc_timeout = seconds
    agent.default_timeout = timeouts.of_option(seconds)


def _wait_all_workers(timeout: float = 0) -> None:
    """Return once every worker called it: torch's ``rpc.api._wait_all_workers``
    (an :func:`_all_gather` of None; ``timeout`` as its, 0: no limit)."""
    _all_gather(None, timeout=timeout)


def _barrier(worker_names: Any) -> None:
    """Return once every worker of ``worker_names`` called it: torch's
    ``rpc.api._barrier``, which, as torch's, logs a failure instead of
    raising it."""
    try:
        _all_gather(None, set(worker_names))
    except RuntimeError as exc:
        logger.error("barrier of %s failed: %s", sorted(worker_names), exc)


_gather_protocol.bind(_current, rpc_sync, rpc_async)
