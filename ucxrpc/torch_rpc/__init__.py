"""Run a program that imports ``torch.distributed.rpc`` itself on ucxrpc, unchanged.

Libraries built on torch's RPC (TorchRL's collectors, FairScale's
pipeline, PyG's distributed sampler) import torch's module, not ours, so
changing one import in the program does not reach them.  Two ways to put
ucxrpc in their place:

* ``python -m ucxrpc.torch_rpc program.py args...`` (or ``-m module
  args...``): the launcher (``__main__.py``).  It calls
  ``install(children=True)`` and runs the program as ``python program.py``
  would, so the program and every Python process it starts run on ucxrpc.
* :func:`install` at the top of the program, before anything imports the
  libraries: this process (and, with ``children=True``, the processes it
  starts afterwards).

What a program gets after :func:`install`:

==========================================  ==========================================
torch module                                in its place
==========================================  ==========================================
``torch.distributed.rpc``                   ucxrpc's public API, with torch's names:
                                            ``BackendType.TENSORPIPE``,
                                            ``TensorPipeRpcBackendOptions``,
                                            ``RpcBackendOptions``, ``is_available``
``torch.distributed.rpc.api``               ``ucxrpc.api`` (``_all_gather``, ``_barrier``,
                                            ``_wait_all_workers``), and
                                            ``_require_initialized``
``torch._C._distributed_rpc.                ucxrpc's, for code that asks torch's C
_is_current_rpc_agent_set``                 module (PyG)
``torch.distributed.rpc.functions``         ``ucxrpc.functions`` (``async_execution``)
``torch.distributed.rpc.constants``         ``ucxrpc.constants``
``torch.distributed.rpc.options``           ``TensorPipeRpcBackendOptions``, ucxrpc's
``torch.distributed.rpc.backend_registry``  ``BackendType``, ``backend_registered``,
                                            ``construct_rpc_backend_options``
``torch.distributed.autograd``              ``ucxrpc.autograd``, and ``is_available``
``torch.distributed.optim``                 torch's, with ucxrpc's ``DistributedOptimizer``
``torch.distributed.nn`` (``.api``,         torch's, with ucxrpc's ``RemoteModule``
``.api.remote_module``)
==========================================  ==========================================

A torch name ucxrpc has no counterpart of (torch internals, its backend
registry's ``register_backend``) is an AttributeError saying so.  torch's
own modules imported before the swap keep the references they took to
torch's RPC (``install`` imports torch's packages first, so that this
holds for all of them: DDP's ``RRef``, TorchScript's); code imported
afterwards sees ucxrpc's.

Child processes: ``children=True`` sets :data:`ENV_VAR` and puts a
directory holding a ``sitecustomize.py`` first on ``PYTHONPATH``
(:func:`child_environment`), so every Python process started from then on
(``spawn``, ``forkserver``, ``multiprocessing.Process``,
``torch.multiprocessing.spawn``, ``subprocess`` running Python) runs
:func:`install` as soon as it imports torch, and a process that never
imports torch pays nothing.  That ``sitecustomize`` then runs the one it
hides, if any.  Forked children inherit the swap itself.  A child started
with its own ``env=`` lacking those two variables, or with ``python -I``
or ``-E``, is not reached.

Importing this module changes nothing: no modules swapped, no environment
written, until :func:`install` is called.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import types
from pathlib import Path
from typing import Mapping

__all__ = ["ENV_VAR", "child_environment", "install", "installed", "site_dir"]

#: Set (to ``1``) in a process's environment, it makes the ``sitecustomize``
#: of :func:`site_dir` install ucxrpc in that process when it imports torch.
ENV_VAR = "UCXRPC_TORCH_RPC"

_installed = False
_lock = threading.Lock()

#: torch's packages that hold RPC, imported before the swap (see install()).
_TORCH_PACKAGES = ("torch.distributed.rpc", "torch.distributed.autograd",
                   "torch.distributed.optim", "torch.distributed.nn",
                   "torch.distributed.nn.api.remote_module")


def site_dir() -> str:
    """The directory whose ``sitecustomize.py`` installs ucxrpc in a new
    Python process when :data:`ENV_VAR` is set (see :func:`child_environment`)."""
    return str(Path(__file__).resolve().parent / "_site")


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that make Python processes started with ``environ``
    (default: this process's) install ucxrpc when they import torch:
    :data:`ENV_VAR` and ``PYTHONPATH`` with :func:`site_dir` first.  For a
    program that starts children with an ``env=`` of its own."""
    environ = os.environ if environ is None else environ
    entries = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    here = site_dir()
    return {ENV_VAR: "1",
            "PYTHONPATH": os.pathsep.join([here, *(p for p in entries if p != here)])}


def installed() -> bool:
    """Whether :func:`install` ran in this process (or in the one it was
    forked from)."""
    return _installed


def install(*, children: bool = False) -> None:
    """Put ucxrpc in place of torch's RPC modules in this process (see the
    module's docstring for what each becomes).  Idempotent; thread-safe.

    torch's own packages are imported first, so torch code that took
    references to them at import keeps torch's; only code that imports
    them afterwards sees ucxrpc.  Call it before importing the libraries
    that use torch's RPC: a module that already holds torch's module keeps
    it.

    Args:
        children: also set this process's environment so that every Python
            process it starts from now on installs ucxrpc too (see
            :func:`child_environment`).

    Raises:
        ImportError: torch's RPC packages cannot be imported (a torch built
            without distributed).
    """
    global _installed
    with _lock:
        if children:
            os.environ.update(child_environment())
        if _installed:
            return
        for name in _TORCH_PACKAGES:
            importlib.import_module(name)
        from ._modules import build

        for name, module in build().items():
            _put(name, module)
        # PyG asks torch's C module itself whether RPC is up ("from
        # torch._C._distributed_rpc import _is_current_rpc_agent_set", at
        # each call): there too, the answer is now ucxrpc's.  torch's own
        # modules took their reference at import, before this.
        from .. import api

        setattr(importlib.import_module("torch._C._distributed_rpc"),
                "_is_current_rpc_agent_set", api._is_current_rpc_agent_set)
        _installed = True


def _put(name: str, module: types.ModuleType) -> None:
    # In sys.modules for 'import torch.distributed.rpc', and on the parent
    # package, which 'import torch.distributed.rpc as rpc' reads when the
    # parent already has the attribute.
    sys.modules[name] = module
    parent, _, attr = name.rpartition(".")
    setattr(sys.modules.get(parent) or importlib.import_module(parent), attr, module)
