"""The names a program written for torch's RPC passes to it, accepted by ucxrpc.

* ``BackendType.TENSORPIPE`` is ucxrpc's backend under torch's name.
* ``TensorPipeRpcBackendOptions`` takes torch 2.13's signature, is a
  ``UcxRpcBackendOptions`` (and an ``RpcBackendOptions``), and maps
  ``_transports`` / ``_channels`` to UCX transports; a name that maps to
  nothing is accepted with one warning.  Between real workers, ``uv`` runs
  on TCP and ``shm`` on shared memory, as UCX reports its lanes.
* Options read back with torch's types; a ``timedelta`` timeout is a
  TypeError in torch's words; ``rpc.constants`` has torch's names and values.
* ``is_available()`` is True and TorchScript compiles a call to it.
* Between real workers, a negative timeout other than torch's -1 is a
  ValueError naming it, for ``rpc_sync``, ``rpc_async``, ``remote`` and
  ``to_here`` (torch fails the call at once, saying it ran for more than
  -5000 ms); -1 is the default (tests/test_timeouts.py has the rule).
* torch's private ``_is_current_rpc_agent_set`` and ``_get_current_rpc_agent``
  answer before ``init_rpc`` as torch's do (tests/rpc/test_all_gather.py has
  them, and ``api._all_gather``, between workers).
"""

from __future__ import annotations

import datetime
import inspect
import warnings

import pytest
import torch

import ucxrpc
from ucxrpc import tensorpipe
from tests.workers import run_workers

pytestmark = pytest.mark.timeout(120)


def test_tensorpipe_is_ucxrpcs_backend_under_torchs_name() -> None:
    assert ucxrpc.BackendType.TENSORPIPE is ucxrpc.BackendType.UCX
    assert ucxrpc.BackendType["TENSORPIPE"] is ucxrpc.BackendType.UCX  # torch's fixture's way


def test_tensorpipe_options_take_torchs_signature() -> None:
    from torch.distributed.rpc.options import TensorPipeRpcBackendOptions as Torchs

    ours, theirs = (inspect.signature(c.__init__).parameters for c in
                    (ucxrpc.TensorPipeRpcBackendOptions, Torchs))
    assert [(p.name, p.kind, p.default) for p in ours.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.values()]
    options = ucxrpc.TensorPipeRpcBackendOptions()
    assert isinstance(options, ucxrpc.UcxRpcBackendOptions)
    assert isinstance(options, ucxrpc.RpcBackendOptions)


@pytest.fixture
def hardware(monkeypatch: pytest.MonkeyPatch):
    """Set what the host has: ``hardware(gpu=..., ib=...)``."""
    def set_(*, gpu: bool, ib: bool) -> None:
        monkeypatch.setitem(tensorpipe._NEEDS, "cuda", lambda: gpu)
        monkeypatch.setitem(tensorpipe._NEEDS, "ib", lambda: ib)
    return set_


@pytest.mark.parametrize("transports, channels, gpu, ib, want", [
    (None, None, True, True, None),                       # UCX chooses, as TensorPipe does
    (None, ["cma"], True, True, None),                    # channels alone narrow nothing
    (["uv"], None, False, False, ["tcp", "cma"]),         # TorchRL's, on a CPU host
    (["uv"], None, True, False, ["tcp", "cma", "cuda"]),  # ... with a GPU: CUDA channels
    (["shm"], None, False, False, ["sm", "cma"]),         # mpt_uv does not bring TCP in
    (["uv"], ["basic"], True, False, ["tcp"]),
    (["ibv", "uv"], ["mpt_uv", "basic"], False, True, ["ib", "tcp"]),  # PyG's
    (["ibv", "uv"], ["mpt_uv", "basic"], False, False, ["tcp"]),  # no InfiniBand here
    (["ibv"], ["cuda_ipc"], False, False, None),          # nothing left to reach peers by
    (["shm", "uv"], ["cma", "cuda_ipc", "cuda_gdr"], True, False, ["sm", "tcp", "cma", "cuda"]),
])
def test_tensorpipe_names_become_the_nearest_ucx_transports(
        hardware, transports, channels, gpu, ib, want) -> None:
    hardware(gpu=gpu, ib=ib)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TensorPipe's own names: no warning
        options = ucxrpc.TensorPipeRpcBackendOptions(_transports=transports, _channels=channels)
    assert options.transports == want


def test_a_name_that_maps_to_nothing_is_ignored_with_one_warning(hardware) -> None:
    hardware(gpu=False, ib=False)
    with pytest.warns(UserWarning) as record:
        options = ucxrpc.TensorPipeRpcBackendOptions(_transports=["uv", "tcp"],
                                                     _channels=["bogus", "basic"])
    assert len(record) == 1
    said = str(record[0].message)
    assert "transport 'tcp'" in said and "channel 'bogus'" in said
    assert "UcxRpcBackendOptions(transports=" in said  # where UCX's own names go
    assert options.transports == ["tcp"]
    with pytest.raises(TypeError, match="list of names"):
        ucxrpc.TensorPipeRpcBackendOptions(_transports="uv")  # type: ignore[arg-type]


def test_options_read_back_with_torchs_types() -> None:
    from torch.distributed.rpc import TensorPipeRpcBackendOptions as Torchs

    for ours in (ucxrpc.UcxRpcBackendOptions(rpc_timeout=7, num_worker_threads=3),
                 ucxrpc.TensorPipeRpcBackendOptions(rpc_timeout=7, num_worker_threads=3)):
        theirs = Torchs(rpc_timeout=7, num_worker_threads=3)
        for name in ("rpc_timeout", "num_worker_threads", "init_method"):
            assert getattr(ours, name) == getattr(theirs, name)
            assert type(getattr(ours, name)) is type(getattr(theirs, name)), name
    assert ucxrpc.RpcBackendOptions(7).rpc_timeout == 7.0
    assert isinstance(ucxrpc.UcxRpcBackendOptions(peer_timeout=3).peer_timeout, float)
    with pytest.raises(TypeError, match="incompatible constructor arguments.*rpc_timeout"):
        ucxrpc.TensorPipeRpcBackendOptions(rpc_timeout=datetime.timedelta())
    with pytest.raises(TypeError, match="num_worker_threads must be an int"):
        ucxrpc.UcxRpcBackendOptions(num_worker_threads=2.5)  # type: ignore[arg-type]


def test_device_names_follow_torchs_rules() -> None:
    options = ucxrpc.TensorPipeRpcBackendOptions(device_maps={"w1": {0: 1}})
    options.set_device_map("w1", {1: 2})
    assert options.device_maps == {"w1": {torch.device("cuda:0"): torch.device("cuda:1"),
                                          torch.device("cuda:1"): torch.device("cuda:2")}}
    with pytest.raises(ValueError, match="expect a list of CUDA devices"):
        options.set_devices(["cpu"])


def test_constants_have_torchs_names_and_values() -> None:
    import torch.distributed.rpc.constants as theirs

    names = [n for n in vars(theirs) if n.isupper() and not n.startswith("_")]
    assert sorted(names) == sorted(ucxrpc.constants.__all__)
    for name in names:
        assert getattr(ucxrpc.constants, name) == getattr(theirs, name), name


def _calls_is_available(x: torch.Tensor) -> torch.Tensor:
    if ucxrpc.is_available():
        return x + 1
    return x


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_is_available_is_true_and_scriptable() -> None:
    assert ucxrpc.is_available() is True
    assert inspect.isfunction(ucxrpc.is_available)
    assert torch.jit.script(_calls_is_available)(torch.ones(1)).item() == 2.0


def test_init_rpc_refuses_another_backends_options_in_torchs_words() -> None:
    class FooBackendOptions(ucxrpc.RpcBackendOptions):
        pass

    with pytest.raises(TypeError, match="`rpc_backend_options` must be a "
                                        "`TensorPipeRpcBackendOptions`"):
        ucxrpc.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=FooBackendOptions())


# -- on real workers --------------------------------------------------------


def _lanes(rank: int, world_size: int, init_method: str, transports: list[str]) -> dict:
    """Join with TensorPipe's names; rank 0 says what UCX uses and how
    negative timeouts fare."""
    import ucxrpc as rpc

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=30,
                                                  _transports=transports)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 backend=rpc.BackendType.TENSORPIPE, rpc_backend_options=options)
    out: dict = {}
    if rank == 0:
        out["sum"] = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1),
                                  timeout=-1).tolist()
        out["lanes"] = sorted({lane["transport"] for pipe in rpc.get_pipe_info()
                               for lane in pipe["lanes"]})
        out["timeout"] = rpc.get_rpc_timeout()
        out["refused"] = {}
        rref = rpc.remote("worker1", torch.add, args=(torch.ones(1), 1))
        for what, call in (
                ("rpc_sync", lambda: rpc.rpc_sync("worker1", torch.add, args=(1, 1),
                                                  timeout=-5)),
                ("rpc_async", lambda: rpc.rpc_async("worker1", torch.add, args=(1, 1),
                                                    timeout=-0.5)),
                ("remote", lambda: rpc.remote("worker1", torch.add, args=(1, 1),
                                              timeout=-5)),
                ("to_here", lambda: rref.to_here(timeout=-2))):
            try:
                call()
                out["refused"][what] = None
            except ValueError as exc:
                out["refused"][what] = str(exc)
        out["after"] = rref.to_here().tolist()  # the agent is fine afterwards
    rpc.shutdown()
    return out


@pytest.mark.processes
@pytest.mark.parametrize("transports, want", [(["uv"], {"tcp"}), (["shm"], None)])
def test_torchrls_options_run_on_the_ucx_transport_they_name(transports, want) -> None:
    out = run_workers(_lanes, 2, args=(transports,), timeout=90)[0]
    assert out["sum"] == [2.0, 2.0]
    assert out["timeout"] == 30.0 and isinstance(out["timeout"], float)
    if want is not None:
        assert set(out["lanes"]) == want
    else:  # shared memory: whatever UCX calls it here (sysv, posix), never TCP
        assert out["lanes"] and "tcp" not in out["lanes"]
    for what, said in out["refused"].items():
        assert said is not None, f"{what} took a negative timeout"
        assert "timeout must be >= 0" in said and "got -" in said, said
    assert out["after"] == [2.0]


def test_before_init_no_agent_is_set() -> None:
    assert ucxrpc._is_current_rpc_agent_set() is False
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        ucxrpc._get_current_rpc_agent()
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        ucxrpc.api._all_gather(1)
