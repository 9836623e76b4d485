"""ucxrpc's reply objects in CUDA-aware futures, checked on the CPU.

On a worker with CUDA devices every call's future is a
``torch.futures.Future(devices=...)`` (:func:`ucxrpc.devices.future`).
Completing one makes torch find the value's tensors by pickling it with
``torch._jit_internal._extract_tensors``; a value that refuses that pickle
fails the call with "Cannot extract tensors from value".  A CPU-only worker
never extracts, so these tests call the extractor themselves: on the objects
directly, and (end to end) through futures that extract on completion as a
CUDA-aware one does.  The stream side of those futures needs a GPU: see
tests/rpc/test_gpu_streams.py.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch._jit_internal import _extract_tensors

from tests.workers import worker_group
from ucxrpc.autograd._recording import _Reply
from ucxrpc.serialization.pickler import GradCapture, Serializer

pytestmark = pytest.mark.timeout(120)


def _same(got, want):
    return len(got) == len(want) and all(a is b for a, b in zip(got, want))


def test_an_autograd_reply_gives_up_its_tensors():
    # A _Reply as the caller gets it: loaded, its capture listing the
    # received tensors that require grad (which the value holds too).
    a = torch.randn(3, requires_grad=True)
    plain = torch.ones(2)
    serializer = Serializer()
    pickled = serializer.dumps(_Reply(7, 8, GradCapture(), {"a": a, "plain": plain}))
    reply = serializer.loads(pickled.payload, [b.clone() for b in pickled.buffers])
    assert len(reply.capture.tensors) == 1
    got = _extract_tensors(reply)
    value = reply.value
    assert {id(t) for t in got} == {id(value["a"]), id(value["plain"])}
    assert _same(_extract_tensors(reply.capture), reply.capture.tensors)
    # Anywhere but there, a capture still refuses to leave a message.
    with pytest.raises(TypeError, match="GradCapture"):
        pickle.dumps(reply)
    with pytest.raises(TypeError, match="GradCapture"):
        pickle.dumps(reply.capture, protocol=pickle.HIGHEST_PROTOCOL)


def test_only_torchs_extractor_is_let_through():
    # The pure-Python pickler, whose frames sit between the object and its
    # caller, still refuses.
    with pytest.raises(TypeError, match="GradCapture"):
        pickle._dumps(GradCapture())
    # The extractor gets the capture's tensors (none here) instead of an error.
    assert _extract_tensors([GradCapture()]) == []


def test_cpu_tensors_make_no_cuda_call(monkeypatch):
    from ucxrpc import devices
    from ucxrpc.autograd._context import DistAutogradContext

    def refuse(*args, **kwargs):
        raise AssertionError("a CUDA call on the CPU path")

    for name in ("current_stream", "current_device", "Event", "Stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    ctx = DistAutogradContext(1)
    leaf = torch.ones(3, requires_grad=True)
    ctx.accumulate(leaf, torch.ones(3))
    ctx.accumulate(leaf, torch.ones(3))
    assert torch.equal(ctx.gradients()[leaf], torch.full((3,), 2.0))
    with devices.on_streams(devices.current_streams([])):
        devices.settle([torch.ones(2)])
    assert type(devices.future([])) is torch.futures.Future


class _Extracting(torch.futures.Future):
    """A future that, when completed, extracts its value's tensors as a
    CUDA-aware future does (torch's ``Future::markCompleted``), and fails
    the same way when it cannot."""

    def set_result(self, result):
        try:
            _extract_tensors(result)
        except Exception as exc:
            self.set_exception(RuntimeError(
                f"Cannot extract tensors from value: {type(exc).__name__}: {exc}"))
            return
        super().set_result(result)


def _extracting(devs):
    return _Extracting()


def _extracting_workers(rank, world_size, init_method):
    """A group's rank: every call's future extracts, as on a CUDA worker."""
    import ucxrpc as rpc
    from ucxrpc import devices

    devices.future = _extracting
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    yield
    rpc.shutdown()


pair = worker_group(_extracting_workers, 2)


def _rrefs_hold_no_tensor():
    import ucxrpc as rpc
    from ucxrpc.nn import RemoteModule

    # A reply of RRefs (the RemoteModule's parameters) completes its future.
    rm = RemoteModule("worker1/cpu", torch.nn.Linear, args=(3, 2))
    params = rm.remote_parameters()
    assert len(params) == 2 and all(isinstance(p, rpc.RRef) for p in params)
    t = torch.arange(4.0)
    owned = rpc.RRef(t)
    made = rpc.remote("worker1", torch.add, (t, 1))
    # As torch's own RRefs: an RRef holds no tensor of the value it is in.
    assert _same(_extract_tensors([*params, owned, made, t]), [t])
    assert torch.equal(made.to_here(), t + 1)
    # A user pickling one to send it somewhere is still refused.
    with pytest.raises(RuntimeError, match="only be pickled inside an RPC"):
        pickle.dumps(params[0])
    with pytest.raises(RuntimeError, match="only be pickled inside an RPC"):
        pickle.dumps(owned, protocol=pickle.HIGHEST_PROTOCOL)


@pytest.mark.processes
def test_a_reply_of_rrefs_completes_and_an_rref_holds_no_tensor(pair):
    pair.run(_rrefs_hold_no_tensor)


def _remote_module_holds_no_tensor():
    from ucxrpc.nn import RemoteModule

    # Nor does a RemoteModule (its module lives on the owner).
    rm = RemoteModule("worker1/cpu", torch.nn.Linear, args=(3, 2))
    t = torch.arange(4.0)
    assert _same(_extract_tensors({"model": rm, "t": t}), [t])
    with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule in python pickler"):
        pickle.dumps(rm)


@pytest.mark.processes
def test_a_remote_module_holds_no_tensor_and_is_not_pickled(pair):
    pair.run(_remote_module_holds_no_tensor)


def _replies_in_a_context():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # Every RPC made inside a context answers with a _Reply.
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", torch.mul, (x, 3.0))
        fut = rpc.rpc_async("worker1", torch.mul, (x, 2.0))
        z = fut.wait()
        dist_autograd.backward(ctx, [(y * y).sum() + z.sum()])
        g = dist_autograd.get_gradients(ctx)[x]
    assert torch.allclose(g, 18 * x.detach() + 2)


@pytest.mark.processes
def test_autograd_replies_complete_extracting_futures(pair):
    pair.run(_replies_in_a_context)


def _owner_values():
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.nn import RemoteModule
    from ucxrpc.optim import DistributedOptimizer

    # Owner values (the module, its optimizer) are extracted when set too.
    rm = RemoteModule("worker1/cpu", torch.nn.Linear, args=(3, 2))
    params = rm.remote_parameters()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.5)
    before = params[0].to_here()
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [rm(torch.ones(1, 3)).sum()])
        opt.step(ctx)
    assert torch.allclose(params[0].to_here(), before - 0.5)


@pytest.mark.processes
def test_owner_values_are_extracted_when_set(pair):
    pair.run(_owner_values)
