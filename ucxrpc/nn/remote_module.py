"""``RemoteModule``: an ``nn.Module`` instantiated and run on another worker.

As torch's ``torch.distributed.nn.RemoteModule``: forward runs on the owner;
the caller keeps an RRef to the module and RRefs to its parameters (for
``DistributedOptimizer``).  Methods that would need the module's state here
(``parameters()``, ``to()``, ``state_dict()``, ...) raise instead.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from .. import api, devices
from ..agent import WorkerInfo
from ..rref import RRef, remote

_UNSUPPORTED = (
    "register_buffer", "register_parameter", "add_module", "register_module", "apply", "cuda",
    "ipu", "xpu", "cpu", "type", "float", "double", "half", "bfloat16", "to",
    "register_backward_hook", "register_full_backward_hook", "register_forward_pre_hook",
    "register_forward_hook", "state_dict", "load_state_dict", "parameters",
    "named_parameters", "buffers", "named_buffers", "children", "named_children", "modules",
    "named_modules", "requires_grad_", "zero_grad", "share_memory", "extra_repr",
)

_DEVICE_RE = re.compile(r"^(?P<worker>[^/]+)(/(?P<device>.+))?$")


def parse_remote_device(remote_device: str) -> tuple[str | int, torch.device]:
    """``"worker1/cuda:0"`` or ``"rank:1/cpu"`` -> (worker name or rank, device).

    Raises:
        ValueError: a malformed string, or an unknown device.
    """
    m = _DEVICE_RE.match(remote_device) if isinstance(remote_device, str) else None
    if m is None:
        raise ValueError(f"remote_device must look like 'worker/device' or 'rank:N/device', "
                         f"got {remote_device!r}")
    worker, device = m.group("worker"), m.group("device") or "cpu"
    target: str | int = worker
    if worker.startswith("rank:"):
        try:
            target = int(worker[len("rank:"):])
        except ValueError:
            raise ValueError(f"bad rank in remote_device {remote_device!r}") from None
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"bad device in remote_device {remote_device!r}: {exc}") from None
    return target, dev


def _instantiate(module_cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 device: str) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        # torch's words (and type), which its users match on.
        raise ValueError("Expect `module_cls(*args, **kwargs)` returns an instance of <class "
                         f"nn.Module>, but it returns an instance of {type(module)}.")
    return module.to(device)


def _check_created(module_rref: RRef[nn.Module]) -> None:
    module_rref.local_value()  # waits for construction; raises its error


def _forward(module_rref: RRef[nn.Module], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    return module_rref.local_value()(*args, **kwargs)


def _parameter_rrefs(module_rref: RRef[nn.Module], recurse: bool) -> list[RRef[Any]]:
    return [RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: RRef[nn.Module], mode: bool) -> None:
    module_rref.local_value().train(mode)


# What a RemoteModule carries over RPC, as torch's
# ``_REMOTE_MODULE_PICKLED_ATTRIBUTES``: attributes set after construction
# stay behind.
_PICKLED_ATTRIBUTES = ("on", "device", "training", "module_rref")


def _rebuild(state: dict[str, Any]) -> RemoteModule:
    module = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(module)
    module.__dict__.update(state)
    return module


class RemoteModule(nn.Module):
    """Instantiate ``module_cls(*args, **kwargs)`` on ``remote_device``.

    Blocks until the module exists on its owner (construction errors raise
    here, with their own type; a ``module_cls`` that builds no ``nn.Module``
    raises ValueError).

    A RemoteModule can be sent over RPC, as an argument or a result: the
    receiver gets one sharing the same remote module (``on``, ``device``,
    ``training`` and ``module_rref`` travel; attributes added later do not).
    Pickled outside RPC (``torch.save``, ``pickle.dumps``) it raises
    RuntimeError.
    """

    def __init__(self, remote_device: str, module_cls: type[nn.Module],
                 args: tuple[Any, ...] | None = None,
                 kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        target, device = parse_remote_device(remote_device)
        agent = api._current()
        self.on: WorkerInfo = agent.members.resolve(target)
        self.device = str(device)
        self.module_rref: RRef[nn.Module] = remote(
            self.on, _instantiate, (module_cls, tuple(args or ()), dict(kwargs or {}),
                                    self.device))
        api.rpc_sync(self.on, _check_created, (self.module_rref,))

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: RRef[nn.Module],
                              _module_interface_cls: Any = None) -> RemoteModule:
        """A RemoteModule for the existing module ``module_rref`` names.

        Several RemoteModules can so share one module (for instance a
        receiver's, built from a ``module_rref`` sent to it).  Calls go to
        ``module_rref``'s owner; ``remote_device`` gives the module's device
        there, in the constructor's format.  Creates nothing, sends nothing.

        Raises:
            ValueError: ``remote_device`` is malformed.
            NotImplementedError: ``_module_interface_cls`` is given (ucxrpc
                has no scripted RemoteModule).
        """
        if _module_interface_cls is not None:
            raise NotImplementedError("ucxrpc's RemoteModule cannot be scripted: "
                                      "_module_interface_cls is not supported")
        _, device = parse_remote_device(remote_device)
        return _rebuild({"on": module_rref.owner(), "device": str(device), "training": True,
                         "module_rref": module_rref})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward on its owner and return the result here."""
        return api.rpc_sync(self.on, _forward, (self.module_rref, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        return api.rpc_async(self.on, _forward, (self.module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef[Any]]:
        """RRefs to the module's parameters (for ``DistributedOptimizer``)."""
        return api.rpc_sync(self.on, _parameter_rrefs, (self.module_rref, recurse))

    def get_module_rref(self) -> RRef[nn.Module]:
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        api.rpc_sync(self.on, _set_training, (self.module_rref, mode))
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        return self.train(False)

    def __reduce__(self) -> tuple[Any, ...]:
        if devices.extracting_tensors():
            # A CUDA-aware future looking into a value that holds this: its
            # module and parameters live on the owner, none here.
            return (tuple, ())
        if not api.is_initialized() or api._current().pickling_destination() is None:
            raise RuntimeError("Cannot pickle RemoteModule in python pickler. RemoteModule "
                               "can only be pickled when using RPC (as an argument or a "
                               "return value)")
        return (_rebuild, ({k: self.__dict__[k] for k in _PICKLED_ATTRIBUTES},))


def _refuse(name: str) -> Any:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        hint = (" Please use ``remote_parameters`` instead." if name == "parameters" else "")
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule.{hint}")
    method.__name__ = name
    return method


for _name in _UNSUPPORTED:
    setattr(RemoteModule, _name, _refuse(_name))
