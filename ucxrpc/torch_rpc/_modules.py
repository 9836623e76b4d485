"""The modules :func:`ucxrpc.torch_rpc.install` puts in place of torch's.

Each is built from ucxrpc and named as torch names it.  Where torch's module
holds more than RPC (``torch.distributed.optim``, ``torch.distributed.nn``),
the stand-in forwards every other name to torch's own.  A torch name with no
ucxrpc counterpart is an AttributeError that says so, as a missing name
would be, worded so that the reader learns why.
"""

from __future__ import annotations

import functools
import importlib.machinery
import types
from typing import Any, Callable, TypeVar

import ucxrpc
import ucxrpc.api
import ucxrpc.autograd
import ucxrpc.constants
import ucxrpc.functions
import ucxrpc.nn
import ucxrpc.nn.remote_module
import ucxrpc.optim

__all__ = ["ForwardingModule", "build"]

RPC = "torch.distributed.rpc"

F = TypeVar("F", bound=Callable[..., Any])


class ForwardingModule(types.ModuleType):
    """A module whose own attributes win and whose other names come from
    ``target`` (None: no other names).  A name neither has is an
    AttributeError; where ``target`` is ucxrpc's, it says that ucxrpc has
    no counterpart of that torch name."""

    def __init__(self, name: str, target: types.ModuleType | None, doc: str, *,
                 ours: bool = True) -> None:
        super().__init__(name, doc)
        # A spec, so that importlib.util.find_spec(name) answers instead of
        # raising on a module in sys.modules whose __spec__ is None.
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_ours", ours)

    def __getattr__(self, name: str) -> Any:
        target = object.__getattribute__(self, "_target")
        if target is not None and not name.startswith("__"):
            try:
                return getattr(target, name)
            except AttributeError:
                pass
        why = ""
        if object.__getattribute__(self, "_ours") and not name.startswith("__"):
            why = (": ucxrpc stands in for torch's module here (ucxrpc.torch_rpc) and has "
                   "no counterpart of this torch name")
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}{why}")

    def __dir__(self) -> list[str]:
        target = object.__getattribute__(self, "_target")
        return sorted(set(super().__dir__()) | set(dir(target) if target else ()))


def _fill(module: types.ModuleType, **names: Any) -> types.ModuleType:
    for name, value in names.items():
        setattr(module, name, value)
    return module


def _as_package(module: types.ModuleType, path: list[str] | None = None) -> types.ModuleType:
    # A package, so that 'import torch.distributed.rpc.api' finds its
    # submodule in sys.modules; an empty path, so that a submodule we do not
    # provide is not loaded from torch's files into our package.
    module.__path__ = list(path or [])
    if module.__spec__ is not None:
        module.__spec__.submodule_search_locations = module.__path__
    return module


def construct_rpc_backend_options(backend: Any,
                                  rpc_timeout: float = ucxrpc.constants.DEFAULT_RPC_TIMEOUT_SEC,
                                  init_method: str = ucxrpc.constants.DEFAULT_INIT_METHOD,
                                  **kwargs: Any) -> ucxrpc.TensorPipeRpcBackendOptions:
    """torch's ``backend_registry.construct_rpc_backend_options``: the
    backend's options (ucxrpc's one backend takes TensorPipe's names).

    Raises:
        TypeError: ``backend`` is not a BackendType; an unknown keyword.
    """
    if not isinstance(backend, ucxrpc.BackendType):
        raise TypeError(f"backend must be a member of BackendType, got {backend!r}")
    return ucxrpc.TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method,
                                              **kwargs)


def backend_registered(backend_name: str) -> bool:
    """torch's ``backend_registry.backend_registered``: whether
    ``BackendType`` has a member of that name (``UCX``, ``TENSORPIPE``)."""
    return backend_name in ucxrpc.BackendType.__members__


def is_available() -> bool:
    """``torch.distributed.autograd.is_available``: always True here."""
    return True


def _require_initialized(func: F) -> F:
    """torch's ``rpc.api._require_initialized``, a decorator libraries apply
    at import (PyG's distributed package): the call raises torch's
    "RPC has not been initialized" RuntimeError before ``init_rpc``."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not ucxrpc.is_initialized():
            raise ucxrpc.RpcError("RPC has not been initialized. Call "
                                  "torch.distributed.rpc.init_rpc first.")
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _rpc_modules() -> dict[str, types.ModuleType]:
    api = _fill(ForwardingModule(f"{RPC}.api", ucxrpc.api,
                                 "ucxrpc.api standing in for torch.distributed.rpc.api"),
                _require_initialized=_require_initialized)
    options = _fill(ForwardingModule(f"{RPC}.options", None, "TensorPipe's options, ucxrpc's"),
                    TensorPipeRpcBackendOptions=ucxrpc.TensorPipeRpcBackendOptions,
                    __all__=["TensorPipeRpcBackendOptions"])
    registry = _fill(
        ForwardingModule(f"{RPC}.backend_registry", None,
                         "torch's backend registry, as far as ucxrpc's one backend has one"),
        BackendType=ucxrpc.BackendType, backend_registered=backend_registered,
        construct_rpc_backend_options=construct_rpc_backend_options,
        __all__=["BackendType", "backend_registered", "construct_rpc_backend_options"])
    torch_names = dict(api=api, backend_registry=registry, constants=ucxrpc.constants,
                       functions=ucxrpc.functions, options=options,
                       is_available=ucxrpc.is_available,
                       **{f.__name__: f for f in ucxrpc._TORCH_PRIVATE})
    ours = {name: getattr(ucxrpc, name) for name in ucxrpc.__all__}
    public = set(ours) | {name for name in torch_names if not name.startswith("_")}
    rpc = _as_package(_fill(
        ForwardingModule(RPC, ucxrpc, "ucxrpc standing in for torch.distributed.rpc "
                                      "(ucxrpc.torch_rpc)"),
        **{**ours, **torch_names}, __all__=sorted(public)))
    return {RPC: rpc, f"{RPC}.api": api, f"{RPC}.functions": ucxrpc.functions,
            f"{RPC}.constants": ucxrpc.constants, f"{RPC}.options": options,
            f"{RPC}.backend_registry": registry}


def _autograd_optim_nn() -> dict[str, types.ModuleType]:
    import torch.distributed.nn as torch_nn
    import torch.distributed.nn.api as torch_nn_api
    import torch.distributed.optim as torch_optim

    autograd = _as_package(_fill(
        ForwardingModule("torch.distributed.autograd", ucxrpc.autograd,
                         "ucxrpc.autograd standing in for torch.distributed.autograd"),
        is_available=is_available))
    optim = _as_package(_fill(
        ForwardingModule("torch.distributed.optim", torch_optim,
                         "torch.distributed.optim with ucxrpc's DistributedOptimizer",
                         ours=False),
        DistributedOptimizer=ucxrpc.optim.DistributedOptimizer), torch_optim.__path__)
    remote_module = _fill(
        ForwardingModule("torch.distributed.nn.api.remote_module", ucxrpc.nn.remote_module,
                         "ucxrpc.nn.remote_module standing in for "
                         "torch.distributed.nn.api.remote_module"),
        RemoteModule=ucxrpc.nn.RemoteModule)
    api = _as_package(_fill(
        ForwardingModule("torch.distributed.nn.api", torch_nn_api,
                         "torch.distributed.nn.api with ucxrpc's remote_module", ours=False),
        remote_module=remote_module))
    nn = _as_package(_fill(
        ForwardingModule("torch.distributed.nn", torch_nn,
                         "torch.distributed.nn with ucxrpc's RemoteModule", ours=False),
        RemoteModule=ucxrpc.nn.RemoteModule, api=api), torch_nn.__path__)
    return {"torch.distributed.autograd": autograd, "torch.distributed.optim": optim,
            "torch.distributed.nn": nn, "torch.distributed.nn.api": api,
            "torch.distributed.nn.api.remote_module": remote_module}


def build() -> dict[str, types.ModuleType]:
    """The stand-ins, by the torch module name each takes the place of.

    torch's own packages must be imported before (see ``install``): the
    optim and nn stand-ins forward to them.
    """
    return {**_rpc_modules(), **_autograd_optim_nn()}
