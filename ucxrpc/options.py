"""Backend options, torch's ``TensorPipeRpcBackendOptions`` for UCX."""

from __future__ import annotations

import numbers
import operator
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .devices import DeviceMap, check_devices, merge_device_map, to_device_map
from .transport.loop.strategy import Mode, mode_of

DEFAULT_RPC_TIMEOUT = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16


def _seconds(name: str, value: Any) -> float:
    """``value`` as torch's options read it back: a float.

    Raises:
        TypeError: not a real number (a ``timedelta``, a string), in the
            words torch's own (pybind11) constructor starts with.
    """
    if not isinstance(value, numbers.Real):
        raise TypeError(f"incompatible constructor arguments: {name} must be a number of "
                        f"seconds (int or float), got {type(value).__name__} {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    """``value`` as an int; anything with ``__index__`` passes, as in torch.

    Raises:
        TypeError: not an integer (``2.5``, ``"4"``).
    """
    try:
        return int(operator.index(value))
    except TypeError:
        raise TypeError(f"incompatible constructor arguments: {name} must be an int, got "
                        f"{type(value).__name__} {value!r}") from None


class RpcBackendOptions:
    """torch's base of every backend's options: ``rpc_timeout`` (seconds,
    read back as a float) and ``init_method``.

    ucxrpc's one backend takes :class:`UcxRpcBackendOptions`, which derives
    from this class (so does ``TensorPipeRpcBackendOptions``).  It is here
    for programs that test ``isinstance(options, RpcBackendOptions)`` or
    subclass it; ``init_rpc`` refuses an instance that is not a
    UcxRpcBackendOptions, as torch's TensorPipe backend refuses another
    backend's options.  Positional arguments, as torch's.

    Raises:
        TypeError: ``rpc_timeout`` is not a number.
    """

    rpc_timeout: float
    init_method: str

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
                 init_method: str = DEFAULT_INIT_METHOD) -> None:
        self.rpc_timeout = _seconds("rpc_timeout", rpc_timeout)
        self.init_method = init_method


@dataclass(kw_only=True)
class UcxRpcBackendOptions(RpcBackendOptions):
    """Options for :func:`ucxrpc.init_rpc`; keyword-only, validated on creation.

    Numbers are read back with the types torch gives them: counts as
    ``int``, seconds as ``float`` (``rpc_timeout=7`` reads back ``7.0``).

    Attributes:
        num_worker_threads: threads running incoming calls (runnable at once;
            threads blocked in nested RPCs do not count).
        rpc_timeout: default timeout in seconds for RPCs; 0 means none.
        init_method: c10d rendezvous URL: ``env://``, ``tcp://host:port`` or
            ``file:///path``.
        device_maps: ``{worker name: {local device: remote device}}`` for
            tensors sent to that worker (replies come back through the
            reverse); devices as ``torch.device``, strings or CUDA indices.
            Read back normalized to ``torch.device``.
        devices: local CUDA devices this worker uses (default: those its
            maps and the maps targeting it name).
        transports: UCX transports allowed (``["tcp"]``, ``["sm", "cma"]``,
            ...); ``None`` lets UCX choose (``UCX_TLS`` is honoured).
        max_buffers / max_frame_bytes / max_message_bytes: bounds every
            incoming frame is checked against before anything is allocated.
        peer_timeout: seconds a peer's *host* may leave TCP keepalive
            unanswered (a machine that vanished, a network partition) before
            calls waiting on that peer fail, naming it.  A peer's death on a
            reachable host is known at once (its kernel closes its
            lifeline), and a peer that is alive but silent (its GIL held,
            stopped, overloaded) is never declared dead: its kernel answers
            keepalive for it, and its calls fail only by their own timeout.
        progress: how the progress thread waits for messages: ``"adaptive"``
            (polls while it has a core to itself, sleeps in epoll as soon as
            another thread or process wants that core), ``"polling"`` (polls
            while a message is expected: lowest latency on an idle host,
            worst on a busy one) or ``"blocking"`` (always sleeps in epoll:
            no CPU while waiting, a wake-up per message).  Default:
            ``UCXRPC_PROGRESS``, else ``"adaptive"``.
    """

    num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    init_method: str = DEFAULT_INIT_METHOD
    device_maps: dict[str, Any] | None = None
    devices: list[Any] | None = None
    transports: list[str] | None = None
    max_buffers: int = 65535
    max_frame_bytes: int = 1 << 30
    max_message_bytes: int = 1 << 40
    peer_timeout: float = 10.0
    progress: str | None = None
    _maps: dict[str, DeviceMap] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        """Check every field and normalize it.

        Raises:
            TypeError: a number of the wrong type (a ``timedelta`` timeout,
                a fractional thread count).
            ValueError: a value out of range, an unknown progress mode.
        """
        self.num_worker_threads = _count("num_worker_threads", self.num_worker_threads)
        self.rpc_timeout = _seconds("rpc_timeout", self.rpc_timeout)
        self.peer_timeout = _seconds("peer_timeout", self.peer_timeout)
        self.max_buffers = _count("max_buffers", self.max_buffers)
        self.max_frame_bytes = _count("max_frame_bytes", self.max_frame_bytes)
        self.max_message_bytes = _count("max_message_bytes", self.max_message_bytes)
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be a positive int, got "
                             f"{self.num_worker_threads!r}")
        if self.rpc_timeout < 0:
            raise ValueError(f"rpc_timeout must be >= 0 seconds, got {self.rpc_timeout}")
        if self.peer_timeout <= 0:
            raise ValueError(f"peer_timeout must be > 0 seconds, got {self.peer_timeout}")
        if self.progress is None:
            self.progress = os.environ.get("UCXRPC_PROGRESS", Mode.ADAPTIVE.value)
        self.progress = mode_of(self.progress).value  # or ValueError naming the modes
        if not 1 <= self.max_buffers <= 65535:
            raise ValueError(f"max_buffers must be in [1, 65535], got {self.max_buffers}")
        if isinstance(self.transports, str):
            self.transports = [t.strip() for t in self.transports.split(",") if t.strip()]
        maps, self.device_maps = self.device_maps, {}
        for to, m in (maps or {}).items():
            self.set_device_map(to, m)
        if self.devices is not None:
            self.set_devices(self.devices)

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Map local devices to ``to``'s devices for tensors sent there; adds
        to what an earlier call set (a source may not change its target).

        Raises:
            ValueError: not one-to-one, as torch words it.
        """
        self._maps[to] = merge_device_map(self._maps.get(to), to, to_device_map(device_map))
        self.device_maps = {k: dict(v) for k, v in self._maps.items()}

    def set_devices(self, devices: list[Any]) -> None:
        """The local CUDA devices this worker uses.

        Raises:
            ValueError: a device that is not CUDA.
        """
        self.devices = check_devices(devices)

    def maps(self) -> dict[str, DeviceMap]:
        """The device maps, normalized (copies)."""
        return {k: dict(v) for k, v in self._maps.items()}

    def device_list(self) -> list[torch.device]:
        return list(self.devices or [])
