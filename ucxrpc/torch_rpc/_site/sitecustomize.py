"""Put ucxrpc in place of torch's RPC in a new Python process, when asked.

Python runs ``sitecustomize`` at start-up from the first directory on its
path that has one; ``ucxrpc.torch_rpc`` puts this file's directory first on
``PYTHONPATH`` for the processes a program starts (``child_environment``).
Where ``UCXRPC_TORCH_RPC`` is set, this module arms a one-shot import hook:
right after the process has imported torch, it runs
``ucxrpc.torch_rpc.install()``, before any other module can reach torch's
RPC.  A process that never imports torch pays nothing (only the standard
library is imported here), and an interpreter that cannot import ucxrpc
(another environment's Python) keeps torch's RPC, with a warning.

Then it runs the ``sitecustomize`` it hides, if the path has another.
Other ``sitecustomize`` files chain the same way (coverage's, a site's, a
test harness's), so two may run each other: this one runs once per process
whoever runs it (a marker in ``sys.modules``), and never runs the one that
is already running it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from types import ModuleType
from typing import Any, Sequence

# ucxrpc.torch_rpc.ENV_VAR (not imported: that would import torch now).
ENV_VAR = "UCXRPC_TORCH_RPC"

_HERE = os.path.dirname(os.path.abspath(__file__))
# The directory holding the ucxrpc package this file belongs to.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
# Set in sys.modules by the first run in a process: a sitecustomize that
# runs the one it hides runs this file again (as a module object of its
# own, so a module global cannot tell), and this one would run it again.
_GUARD = "_ucxrpc_sitecustomize_ran"
_MISSING = object()


class InstallAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at the first import of ``torch``, takes
    itself off ``sys.meta_path`` and returns torch's own spec, its loader
    made to call :func:`install_ucxrpc` once torch's module has run."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")  # by the finders after this one
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_torch = loader.exec_module
        previous = vars(loader).get("exec_module", _MISSING)

        def exec_module(module: ModuleType) -> None:
            try:
                run_torch(module)
            finally:
                # The loader as found, unless someone patched it after us.
                if vars(loader).get("exec_module") is exec_module:
                    if previous is _MISSING:
                        del loader.exec_module
                    else:
                        loader.exec_module = previous
            install_ucxrpc()

        loader.exec_module = exec_module
        return spec


def install_ucxrpc() -> None:
    """``ucxrpc.torch_rpc.install()``; with a warning instead where this
    interpreter cannot import ucxrpc, even from this file's own tree."""
    if importlib.util.find_spec("ucxrpc") is None and _ROOT not in sys.path:
        # A child whose path lost the entry its parent found ucxrpc by (a
        # checkout on the parent's working directory): last, so that it
        # shadows nothing.
        sys.path.append(_ROOT)
    try:
        from ucxrpc.torch_rpc import install
    except ImportError as exc:
        warnings.warn(f"{ENV_VAR} is set but {sys.executable} cannot import ucxrpc ({exc}): "
                      "torch.distributed.rpc stays torch's in this process", RuntimeWarning,
                      stacklevel=2)
        return
    install()


def run_hidden_sitecustomize() -> None:
    """Run the ``sitecustomize`` that this one hides on ``sys.path``, if
    any, as Python would have run it."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    running = sys.modules.get("sitecustomize")
    if running is not None and _origin(running) == spec.origin:
        return  # Python ran that one first and it ran this one: done already
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # 'import sitecustomize' now finds that one
    spec.loader.exec_module(module)


def _origin(module: ModuleType) -> str | None:
    spec = getattr(module, "__spec__", None)
    return getattr(spec, "origin", None) or getattr(module, "__file__", None)


if _GUARD not in sys.modules:
    sys.modules[_GUARD] = ModuleType(_GUARD)
    if os.environ.get(ENV_VAR, "") not in ("", "0"):
        sys.meta_path.insert(0, InstallAfterTorch())
    run_hidden_sitecustomize()
