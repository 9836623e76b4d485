"""Make torch's shipped RPC tests see ucxrpc where they import torch's RPC.

:func:`install` runs the supported :func:`ucxrpc.torch_rpc.install`, which
puts ucxrpc in place of ``torch.distributed.rpc`` (and ``.api``,
``.functions``, ``.constants``, ``.options``, ``.backend_registry``),
``torch.distributed.autograd``, ``DistributedOptimizer`` and
``RemoteModule`` (its docstring has the table), then adds what only torch's
test modules need:

==========================================  ==========================================
where                                       what the tests get besides
==========================================  ==========================================
``torch.distributed.rpc``, ``.api``,        torch internals as :class:`TorchInternal`
``.backend_registry``,                      stand-ins, where ucxrpc has no name of
``torch.distributed.nn.api.remote_module``  its own (:data:`TORCH_INTERNALS`)
``torch.distributed.rpc.api``               ``_ignore_rref_leak``, which the tests'
                                            ``dist_init`` writes
``torch.distributed.rpc.internal``          torch's ``RPCExecMode`` enum; the rest
                                            stand-ins
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

import ucxrpc.torch_rpc

__all__ = ["PLACEHOLDER_SUITES", "TORCH_INTERNALS", "TORCH_ONLY_RPC", "TorchInternal",
           "TorchInternalUsed", "install", "installed"]

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


#: Torch module -> the internals its test modules import from it.  Each
#: becomes a :class:`TorchInternal` unless the supported stand-in already
#: has the name (ucxrpc grew a counterpart).
TORCH_INTERNALS: dict[str, tuple[str, ...]] = {
    "torch.distributed.rpc": (
        "TensorPipeAgent", "_rref_context_get_debug_info", "_get_current_rpc_agent",
        "_set_rpc_timeout", "_server_process_global_profile", "_init_rpc_backend",
        "_delete_all_user_and_unforked_owner_rrefs", "_set_and_start_rpc_agent",
        "_enable_server_process_global_profiler", "_disable_server_process_global_profiler",
        "enable_gil_profiling", "_enable_jit_rref_pickle", "_disable_jit_rref_pickle"),
    "torch.distributed.rpc.api": (
        "_thread_local_var", "_use_rpc_pickler", "_wait_all", "_all_gather",
        "_wait_all_workers", "_default_pickler", "_delete_all_user_and_unforked_owner_rrefs",
        "_get_current_rpc_agent", "_set_rpc_timeout", "_init_rpc_states"),
    "torch.distributed.rpc.internal": (
        "_build_rpc_profiling_key", "_internal_rpc_pickler", "PythonUDF", "_run_function",
        "_handle_exception", "serialize", "deserialize"),
    "torch.distributed.rpc.backend_registry": ("register_backend", "init_backend"),
    "torch.distributed.nn.api.remote_module": (
        "_RemoteModule", "_REMOTE_MODULE_PICKLED_ATTRIBUTES",
        "_NON_SCRIPTABLE_REMOTE_MODULE_MODULE", "_remote_module_receiver",
        "_remote_module_reducer", "_recursive_script_module_receiver",
        "_recursive_script_module_reducer"),
}

#: Filled by :func:`install`: name -> the stand-in given for it, for the
#: torch internals of ``torch.distributed.rpc``.
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

    The supported install first (:func:`ucxrpc.torch_rpc.install`, which
    imports torch's own packages before the swap, so that torch code holding
    references to them, DDP and the JIT, keeps torch's), then the tests'
    stand-ins and placeholders.
    """
    global _installed
    if _installed:
        return
    ucxrpc.torch_rpc.install()
    import torch.distributed.rpc.internal as torch_internal  # torch's: before the swap below

    internal = types.ModuleType("torch.distributed.rpc.internal",
                                "torch internals, plus torch's RPCExecMode enum and "
                                "profiling-key format")
    # A plain enum the tests' own helpers dispatch on (sync / async / remote),
    # not RPC machinery: torch's, as is.
    internal.RPCExecMode = torch_internal.RPCExecMode  # type: ignore[attr-defined]
    # A string format the profiler tests build the names they expect with
    # (ucxrpc.profiling.rpc_key makes the same): torch's, as is.
    internal._build_rpc_profiling_key = (  # type: ignore[attr-defined]
        torch_internal._build_rpc_profiling_key)
    _put(internal.__name__, internal)
    rpc = sys.modules["torch.distributed.rpc"]
    for module_name, names in TORCH_INTERNALS.items():
        module = sys.modules[module_name]
        for name in names:
            if not hasattr(module, name):
                setattr(module, name, TorchInternal(f"{module_name}.{name}"))
    TORCH_ONLY_RPC.update({name: getattr(rpc, name)
                           for name in TORCH_INTERNALS["torch.distributed.rpc"]})
    # dist_utils.dist_init writes this before each test; harmless here.
    sys.modules["torch.distributed.rpc.api"]._ignore_rref_leak = True  # type: ignore[attr-defined]
    for name, suites in PLACEHOLDER_SUITES.items():
        _put(name, _placeholder(name, suites))
    _installed = True


def _put(name: str, module: types.ModuleType) -> None:
    sys.modules[name] = module
    parent_name, _, attr = name.rpartition(".")
    parent = sys.modules.get(parent_name) or importlib.import_module(parent_name)
    setattr(parent, attr, module)


def _placeholder(name: str, suites: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(name, "placeholder: this torch suite is out of scope for ucxrpc "
                                    "(tests/compat/shim.py)")
    for suite in suites:
        setattr(module, suite, type(suite, (), {"__module__": name}))
    return module
