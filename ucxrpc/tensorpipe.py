"""TensorPipe's option names, for programs written against torch's default backend.

torch's RPC has one built-in backend, TensorPipe, and programs name it:
``init_rpc(..., backend=BackendType.TENSORPIPE, rpc_backend_options=
TensorPipeRpcBackendOptions(..., _transports=["uv"]))`` (TorchRL's
collectors always do).  :class:`TensorPipeRpcBackendOptions` takes torch
2.13's signature and *is* a :class:`~ucxrpc.options.UcxRpcBackendOptions`,
so ``init_rpc`` takes it as it is and every option reads back as ucxrpc's.
TensorPipe's ``_transports`` and ``_channels`` become UCX transports
(``transports=``, which becomes ``UCX_TLS``), the nearest UCX choice each:

==================  =====================  ==========================================
TensorPipe name     UCX transports         why
==================  =====================  ==========================================
``uv``              ``tcp``                TCP sockets, both
``shm``             ``sm``                 shared memory within a host
``ibv``             ``ib`` (rc, ud, dc)    InfiniBand verbs
``cma``             ``cma``                cross-memory attach within a host
``mpt_uv``          ``tcp``                TensorPipe's multi-connection TCP
``basic``           (none needed)          tensors over the transport: UCX does so
``xth``             (none needed)          calls within a process never reach UCX
``cuda_ipc``,       ``cuda`` (cuda_copy,   UCX picks the device path itself, given
``cuda_gdr``,       cuda_ipc)              its CUDA transports (GPUDirect RDMA too,
``cuda_xth``,                              with ``ibv``)
``cuda_basic``
==================  =====================  ==========================================

With ``_transports`` unset, UCX chooses among all its transports, as
TensorPipe does among all of its own; ``_channels`` then narrows nothing
(UCX's choice includes every transport a channel maps to).  With
``_transports`` set and ``_channels`` unset, TensorPipe uses every channel
it has, so ucxrpc adds ``cma`` and UCX's CUDA transports; not ``mpt_uv``'s
``tcp``, which would widen the transports the program chose
(``_transports=["shm"]`` is shared memory only).  As TensorPipe passes
over a transport or channel the host cannot use, InfiniBand is left out
on a host without InfiniBand devices and CUDA where torch sees no GPU
(UCX would warn about them at every start).

A name TensorPipe does not have (``"tcp"``: UCX's own names go in
``UcxRpcBackendOptions(transports=...)``) maps to nothing: it is accepted
and ignored, with one warning naming every such name, where torch would
refuse it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch

from .options import (DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT,
                      UcxRpcBackendOptions)

__all__ = ["CHANNELS", "DEFAULT_CHANNELS", "TRANSPORTS", "TensorPipeRpcBackendOptions",
           "ucx_transports"]

#: TensorPipe transport -> the UCX transports (or ucxrpc aliases) it becomes.
TRANSPORTS: dict[str, tuple[str, ...]] = {
    "uv": ("tcp",),
    "shm": ("sm",),
    "ibv": ("ib",),
}

#: TensorPipe channel -> the UCX transports (or ucxrpc aliases) it becomes;
#: an empty tuple where UCX needs none for what the channel does.
CHANNELS: dict[str, tuple[str, ...]] = {
    "basic": (),
    "xth": (),
    "cma": ("cma",),
    "mpt_uv": ("tcp",),
    "cuda_basic": ("cuda",),
    "cuda_xth": ("cuda",),
    "cuda_ipc": ("cuda",),
    "cuda_gdr": ("cuda",),
}


#: The channels TensorPipe uses with ``_channels`` unset (all it has), as far
#: as they matter to UCX: not ``mpt_uv``, whose ``tcp`` would widen the
#: transports the program chose.
DEFAULT_CHANNELS = ("basic", "cma", "cuda_basic", "cuda_xth", "cuda_ipc", "cuda_gdr")


def _has_infiniband() -> bool:
    """Whether this host has InfiniBand (or RoCE) devices, as the kernel lists them."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _has_gpu() -> bool:
    """Whether torch sees a CUDA GPU here.  torch.cuda.device_count asks NVML
    before CUDA, so it does not initialise CUDA in a process that may fork
    its workers after making its options (torch.cuda.is_available would)."""
    return torch.version.cuda is not None and torch.cuda.device_count() > 0


#: UCX names that only a host with the hardware can use, and how to tell.
#: TensorPipe leaves a transport or channel that is not viable out without
#: a word; so does ucxrpc (UCX would warn at every start about a transport
#: it does not have).
_NEEDS: dict[str, Callable[[], bool]] = {"ib": _has_infiniband, "cuda": _has_gpu}


def ucx_transports(transports: Sequence[str] | None,
                   channels: Sequence[str] | None) -> tuple[list[str] | None, list[str]]:
    """TensorPipe's ``_transports`` and ``_channels`` as UCX transports.

    Returns:
        ``(transports, ignored)``: the value for ``UcxRpcBackendOptions(
        transports=...)`` (None: UCX chooses among all), and the names
        that map to nothing, as ``"transport 'x'"`` / ``"channel 'y'"``.

    Raises:
        TypeError: a list given as one string (torch refuses it too).
    """
    for what, names in (("_transports", transports), ("_channels", channels)):
        if isinstance(names, str):
            raise TypeError(f"{what} must be a list of names, got the string {names!r}")
    ignored = [f"transport {t!r}" for t in transports or () if t not in TRANSPORTS]
    ignored += [f"channel {c!r}" for c in channels or () if c not in CHANNELS]
    if transports is None:
        return None, ignored
    named = _usable(u for t in transports for u in TRANSPORTS.get(t, ()))
    if not named:
        # No transport named maps to one this host has: narrowing to the
        # channels alone would leave UCX no way to reach a peer.
        return None, ignored
    used = DEFAULT_CHANNELS if channels is None else channels
    return _usable([*named, *(u for c in used for u in CHANNELS.get(c, ()))]), ignored


def _usable(names: Iterable[str]) -> list[str]:
    """``names`` once each, in order, without those the host cannot use."""
    out = []
    for name in dict.fromkeys(names):
        needs = _NEEDS.get(name)
        if needs is None or needs():
            out.append(name)
    return out


class TensorPipeRpcBackendOptions(UcxRpcBackendOptions):
    """torch's ``TensorPipeRpcBackendOptions``, signature and all, as ucxrpc
    options: a :class:`UcxRpcBackendOptions` whose ``transports`` are
    TensorPipe's ``_transports`` and ``_channels`` mapped to UCX (see this
    module's docstring); every other option as in UcxRpcBackendOptions.

    ``set_device_map`` and ``set_devices`` are UcxRpcBackendOptions', which
    follow torch's rules.

    Raises:
        TypeError: a number of the wrong type (a ``timedelta`` timeout), or
            ``_transports`` / ``_channels`` given as one string.
        ValueError: a value out of range, a device map that is not
            one-to-one, a device that is not CUDA.

    Warns:
        UserWarning: once, naming the transports and channels that map to
            nothing (names TensorPipe does not have), which are ignored.
    """

    def __init__(self, *, num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
                 init_method: str = DEFAULT_INIT_METHOD,
                 device_maps: dict[str, Any] | None = None,
                 devices: list[Any] | None = None,
                 _transports: list[str] | None = None,
                 _channels: list[str] | None = None) -> None:
        transports, ignored = ucx_transports(_transports, _channels)
        if ignored:
            warnings.warn(
                f"TensorPipeRpcBackendOptions ignores {', '.join(ignored)}, which no UCX "
                f"transport stands for (TensorPipe's transports are {sorted(TRANSPORTS)}, its "
                f"channels {sorted(CHANNELS)}; UCX's own names go in UcxRpcBackendOptions("
                f"transports=...)). UCX transports used: {transports or 'all (UCX chooses)'}",
                UserWarning, stacklevel=2)
        super().__init__(num_worker_threads=num_worker_threads, rpc_timeout=rpc_timeout,
                         init_method=init_method, device_maps=device_maps, devices=devices,
                         transports=transports)
