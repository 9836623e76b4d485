"""Make torch's shipped RPC tests see ucxrpc where they import torch's RPC.

:func:`install` puts stand-ins into ``sys.modules`` (and on their parent
packages, since ``import a.b.c as x`` reads the attribute ``a.b.c`` when the
parent already has it):

==========================================  ==========================================
torch module                                what the tests get
==========================================  ==========================================
``torch.distributed.rpc``                   ucxrpc's public API, plus the torch-only
                                            names listed in :data:`TORCH_ONLY_RPC`
``torch.distributed.rpc.api``               ``ucxrpc.api`` (its public calls) plus
                                            torch internals as :class:`TorchInternal`
``torch.distributed.rpc.functions``         ``ucxrpc.functions``
``torch.distributed.rpc.internal``          torch's ``RPCExecMode`` enum; the rest stand-ins
``torch.distributed.rpc.constants``         torch's constant names, ucxrpc's values
``torch.distributed.rpc.backend_registry``  ``BackendType`` = ``ucxrpc.BackendType``
``torch.distributed.autograd``              ``ucxrpc.autograd``
``torch.distributed.optim``                 torch's, with ``DistributedOptimizer`` =
                                            ``ucxrpc.optim.DistributedOptimizer``
``torch.distributed.nn`` (and ``.api``,     torch's, with ``RemoteModule`` =
``.api.remote_module``)                     ``ucxrpc.nn.RemoteModule``
==========================================  ==========================================

Torch's test files stay untouched.  A torch internal that ucxrpc does not have
is a :class:`TorchInternal`: importing it works (the test modules import
many at module level), using it raises :class:`TorchInternalUsed` naming it,
so a test that reaches one fails with a reason that says so.  Tests that use
internals are listed in ``excluded.py`` and are not part of the public set.

The JIT and faulty-agent suites are not imported at all: ``rpc_utils``
imports them, and they compile TorchScript against torch's C++ RPC at module
level, so their modules are replaced by empty placeholders
(:data:`PLACEHOLDER_SUITES`); every one of their tests is out of scope
(``excluded.py`` lists them by suite).

``install`` must run before any torch test module is imported, in the parent
and in every spawned child.  ``tests/compat/suites.py`` calls it at import,
and the children of ``MultiProcessTestCase`` unpickle their test class from
that module, so they import it (and install the shim) first.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["PLACEHOLDER_SUITES", "TORCH_ONLY_RPC", "TorchInternal", "TorchInternalUsed",
           "install", "installed"]

_installed = False


class TorchInternalUsed(NotImplementedError):
    """A test reached a torch internal that ucxrpc has no counterpart for."""


class TorchInternal:
    """Stand-in for a torch internal name: importable, unusable.

    Calling it, reading an attribute of it, or instantiating it raises
    :class:`TorchInternalUsed` naming the torch name.
    """

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def _refuse(self) -> TorchInternalUsed:
        return TorchInternalUsed(
            f"{self._qualname} is a torch internal with no ucxrpc counterpart "
            f"(tests/compat shim)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._refuse()

    def __enter__(self) -> Any:
        raise self._refuse()

    def __exit__(self, *exc: object) -> None:
        return None

    def __repr__(self) -> str:
        return f"<torch internal {self._qualname} (not in ucxrpc)>"


class _ForwardingModule(types.ModuleType):
    """A module whose own attributes win, and whose other names come from ``target``."""

    def __init__(self, name: str, target: types.ModuleType | None, doc: str) -> None:
        super().__init__(name, doc)
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str) -> Any:
        target = object.__getattribute__(self, "_target")
        if target is None or name.startswith("__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return getattr(target, name)

    def __dir__(self) -> list[str]:
        target = object.__getattribute__(self, "_target")
        return sorted(set(super().__dir__()) | set(dir(target) if target else ()))


class _TorchRpcBackendOptions:
    """``torch.distributed.rpc.RpcBackendOptions``: only a base to subclass.

    rpc_test.py subclasses it at module level (``FooBackendOptions``, used by
    ``test_register_rpc_backend_and_set_and_start_rpc_backend``, a
    backend-registry test that is excluded).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


# Torch names under torch.distributed.rpc that are not in ucxrpc, and what the
# shim gives for them.  Everything not listed and not in ucxrpc.__all__ is an
# AttributeError, as a missing name would be for a user.
def _torch_only_rpc() -> dict[str, Any]:
    import ucxrpc

    internal = {name: TorchInternal(f"torch.distributed.rpc.{name}") for name in (
        "TensorPipeRpcBackendOptions", "TensorPipeAgent", "_rref_context_get_debug_info",
        "_get_current_rpc_agent", "_set_rpc_timeout", "_server_process_global_profile",
        "_init_rpc_backend", "_delete_all_user_and_unforked_owner_rrefs",
        "_set_and_start_rpc_agent", "_enable_server_process_global_profiler",
        "_disable_server_process_global_profiler", "enable_gil_profiling",
        "_enable_jit_rref_pickle", "_disable_jit_rref_pickle")}
    return {
        **internal,
        # Public in torch, trivially true here: torch's own modules ask it
        # (torch.nn.parallel.distributed at import).
        "is_available": lambda: True,
        "RpcBackendOptions": _TorchRpcBackendOptions,
        # Underscore names ucxrpc does have, under the same name.
        "_get_debug_info": ucxrpc._get_debug_info,
    }


#: Filled by :func:`install`: name -> object for torch-only names of
#: ``torch.distributed.rpc``.
TORCH_ONLY_RPC: dict[str, Any] = {}

#: Torch test modules replaced by placeholders holding empty suites: the JIT
#: and faulty-agent suites (out of scope; see the module docstring).
PLACEHOLDER_SUITES: dict[str, tuple[str, ...]] = {
    "torch.testing._internal.distributed.rpc.jit.rpc_test": ("JitRpcTest",),
    "torch.testing._internal.distributed.rpc.jit.dist_autograd_test": ("JitDistAutogradTest",),
    "torch.testing._internal.distributed.rpc.jit.rpc_test_faulty": ("JitFaultyAgentRpcTest",),
    "torch.testing._internal.distributed.rpc.faulty_agent_rpc_test": ("FaultyAgentRpcTest",),
}


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _installed


def install() -> None:
    """Put ucxrpc in place of torch's RPC modules for torch's tests.  Idempotent.

    Imports torch's own RPC, autograd, optim and nn packages first, so that
    torch code which holds references to them (DDP, the JIT) keeps torch's,
    and only code imported afterwards (the test modules) sees ucxrpc.
    """
    global _installed
    if _installed:
        return
    # torch's real packages, imported before the swap (see the docstring).
    import torch.distributed as dist
    import torch.distributed.autograd
    import torch.distributed.nn
    import torch.distributed.nn.api.remote_module
    import torch.distributed.optim
    import torch.distributed.rpc  # noqa: F401

    import ucxrpc
    import ucxrpc.api
    import ucxrpc.autograd
    import ucxrpc.functions
    import ucxrpc.nn
    import ucxrpc.nn.remote_module
    import ucxrpc.optim
    import ucxrpc.options

    TORCH_ONLY_RPC.update(_torch_only_rpc())
    rpc = _rpc_module(ucxrpc)
    modules: dict[str, types.ModuleType] = {"torch.distributed.rpc": rpc}
    for sub in ("api", "functions", "internal", "constants", "backend_registry"):
        modules[f"torch.distributed.rpc.{sub}"] = getattr(rpc, sub)
    modules["torch.distributed.autograd"] = ucxrpc.autograd
    modules.update(_optim_and_nn(ucxrpc))
    for name, module in modules.items():
        _put(name, module)
    for name, suites in PLACEHOLDER_SUITES.items():
        _put(name, _placeholder(name, suites))
    _installed = True
    del dist


def _put(name: str, module: types.ModuleType) -> None:
    sys.modules[name] = module
    parent_name, _, attr = name.rpartition(".")
    parent = sys.modules.get(parent_name) or importlib.import_module(parent_name)
    setattr(parent, attr, module)


def _rpc_module(ucxrpc: Any) -> types.ModuleType:
    import torch.distributed.rpc.internal as torch_internal

    import ucxrpc.api
    import ucxrpc.options

    rpc = _ForwardingModule("torch.distributed.rpc", None,
                            "ucxrpc standing in for torch.distributed.rpc (tests/compat)")
    for name in ucxrpc.__all__:
        setattr(rpc, name, getattr(ucxrpc, name))
    for name, obj in TORCH_ONLY_RPC.items():
        setattr(rpc, name, obj)

    api = _ForwardingModule("torch.distributed.rpc.api", ucxrpc.api,
                            "ucxrpc.api standing in for torch.distributed.rpc.api")
    for name in ("_thread_local_var", "_use_rpc_pickler", "_wait_all", "_all_gather",
                 "_wait_all_workers", "_default_pickler",
                 "_delete_all_user_and_unforked_owner_rrefs", "_get_current_rpc_agent",
                 "_set_rpc_timeout", "_init_rpc_states"):
        setattr(api, name, TorchInternal(f"torch.distributed.rpc.api.{name}"))
    # dist_utils.dist_init writes this before each test; harmless here.
    api._ignore_rref_leak = True

    internal = types.ModuleType("torch.distributed.rpc.internal",
                                "torch internals, plus torch's RPCExecMode enum")
    for name in ("_build_rpc_profiling_key", "_internal_rpc_pickler", "PythonUDF",
                 "_run_function", "_handle_exception", "serialize", "deserialize"):
        setattr(internal, name, TorchInternal(f"torch.distributed.rpc.internal.{name}"))
    # A plain enum the tests' own helpers dispatch on (sync / async / remote),
    # not RPC machinery: torch's, as is.
    internal.RPCExecMode = torch_internal.RPCExecMode

    constants = types.ModuleType("torch.distributed.rpc.constants",
                                 "torch's constant names with ucxrpc's values")
    constants.DEFAULT_RPC_TIMEOUT_SEC = ucxrpc.options.DEFAULT_RPC_TIMEOUT
    constants.DEFAULT_INIT_METHOD = ucxrpc.options.DEFAULT_INIT_METHOD
    constants.DEFAULT_NUM_WORKER_THREADS = ucxrpc.options.DEFAULT_NUM_WORKER_THREADS
    constants.DEFAULT_SHUTDOWN_TIMEOUT = 0.0
    constants.UNSET_RPC_TIMEOUT = -1.0

    registry = types.ModuleType("torch.distributed.rpc.backend_registry",
                                "torch's backend registry: only BackendType, ucxrpc's")
    registry.BackendType = ucxrpc.BackendType
    for name in ("register_backend", "construct_rpc_backend_options", "init_backend",
                 "backend_registered"):
        setattr(registry, name, TorchInternal(f"torch.distributed.rpc.backend_registry.{name}"))

    rpc.api = api
    rpc.functions = ucxrpc.functions
    rpc.internal = internal
    rpc.constants = constants
    rpc.backend_registry = registry
    rpc.__path__ = []  # a package, so that 'import torch.distributed.rpc.x' looks in sys.modules
    return rpc


def _optim_and_nn(ucxrpc: Any) -> dict[str, types.ModuleType]:
    import torch.distributed.nn as torch_nn
    import torch.distributed.nn.api as torch_nn_api
    import torch.distributed.optim as torch_optim

    import ucxrpc.nn.remote_module

    optim = _ForwardingModule("torch.distributed.optim", torch_optim,
                              "torch.distributed.optim with ucxrpc's DistributedOptimizer")
    optim.DistributedOptimizer = ucxrpc.optim.DistributedOptimizer
    optim.__path__ = list(torch_optim.__path__)

    remote_module = _ForwardingModule(
        "torch.distributed.nn.api.remote_module", ucxrpc.nn.remote_module,
        "ucxrpc.nn.remote_module standing in for torch.distributed.nn.api.remote_module")
    remote_module.RemoteModule = ucxrpc.nn.RemoteModule
    for name in ("_RemoteModule", "_REMOTE_MODULE_PICKLED_ATTRIBUTES",
                 "_NON_SCRIPTABLE_REMOTE_MODULE_MODULE", "_remote_module_receiver",
                 "_remote_module_reducer", "_recursive_script_module_receiver",
                 "_recursive_script_module_reducer"):
        setattr(remote_module, name,
                TorchInternal(f"torch.distributed.nn.api.remote_module.{name}"))
    api = _ForwardingModule("torch.distributed.nn.api", torch_nn_api,
                            "torch.distributed.nn.api with ucxrpc's remote_module")
    api.remote_module = remote_module
    api.__path__ = []
    nn = _ForwardingModule("torch.distributed.nn", torch_nn,
                           "torch.distributed.nn with ucxrpc's RemoteModule")
    nn.RemoteModule = ucxrpc.nn.RemoteModule
    nn.api = api
    nn.__path__ = list(torch_nn.__path__)
    return {"torch.distributed.optim": optim, "torch.distributed.nn": nn,
            "torch.distributed.nn.api": api,
            "torch.distributed.nn.api.remote_module": remote_module}


def _placeholder(name: str, suites: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(name, "placeholder: this torch suite is out of scope for ucxrpc "
                                    "(tests/compat/shim.py)")
    for suite in suites:
        setattr(module, suite, type(suite, (), {"__module__": name}))
    return module
