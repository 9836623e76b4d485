"""Distributed autograd across real worker processes, checked against the same
model computed in one process."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.workers import run_workers, worker_group
from ucxrpc.functions import async_execution

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

TOL = dict(rtol=1e-9, atol=1e-12)  # float64 throughout: the same ops, the same results


def _init(rank, world_size, init_method):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))


def seeded(seed, *shape, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


def local_grads(fn, *leaves):
    """Gradients of ``fn(*copies)`` with respect to fresh copies of ``leaves``."""
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    fn(*copies).backward()
    return [c.grad for c in copies]


def close(a, b):
    return a is not None and b is not None and torch.allclose(a, b, **TOL)


# -- functions the callees run ---------------------------------------------------

_PARAMS: dict[str, torch.Tensor] = {}


def param(name, seed, *shape):
    """A parameter of this worker, made once, the same on every run.

    Calls served at once may make it at once: setdefault keeps the first,
    so every caller (and every optimizer) gets the same tensor."""
    p = _PARAMS.get(name)
    return p if p is not None else _PARAMS.setdefault(name, seeded(seed, *shape))


def add(a, b):
    return a + b


def linear_here(x):
    return x @ param("w1", 11, 3, 3) + param("b1", 12, 3)


def param_grads(context_id, names):
    import ucxrpc.autograd as dist_autograd

    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(_PARAMS[n]) for n in names]


def exp_of(x):
    return x.exp()


def call_back(x):
    """worker1 -> worker0 and on: the callee's own call is recorded too."""
    import ucxrpc as rpc

    return rpc.rpc_sync("worker0", torch.mul, (x, 3.0)).sin()


def sum_sq(x):
    return (x * x).sum()


def own_loss():
    return (param("w1", 11, 3, 3) ** 2).sum()


def backward_own_loss():
    import ucxrpc as rpc

    rpc.RRef(own_loss()).backward()  # an owner RRef: local autograd


def own_grad(name):
    g = _PARAMS[name].grad
    return None if g is None else g.clone()


@async_execution
def async_double(x):
    fut = torch.futures.Future()
    fut.set_result(x * 2.0)
    return fut


def num_contexts():
    import ucxrpc.autograd as dist_autograd

    return dist_autograd._get_debug_info()["num_autograd_contexts"]


def _wait_contexts_zero(rpc, workers, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        counts = [rpc.rpc_sync(w, num_contexts) for w in workers]
        if not any(counts):
            return counts
        time.sleep(0.05)
    return counts


# -- 2 workers kept up: one case per test -------------------------------------------

_WORLD: dict[str, int] = {}


def _workers_up(rank, world_size, init_method):
    """A group's rank: up as ``worker{rank}`` until the module's last test."""
    import ucxrpc as rpc

    _WORLD["size"] = world_size
    _init(rank, world_size, init_method)
    yield
    rpc.shutdown()


def _no_context_left():
    """After each case: every context it made is gone, on every worker."""
    import ucxrpc as rpc

    workers = [f"worker{r}" for r in range(_WORLD["size"])]
    assert _wait_contexts_zero(rpc, workers) == [0] * len(workers)


pair = worker_group(_workers_up, 2, check=_no_context_left)
trio = worker_group(_workers_up, 3, check=_no_context_left)


def _design_doc_example():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # torch's design-doc example; t2 does not require grad
    t1, t2, t4 = seeded(1, 3, 3), seeded(2, 3, 3, grad=False), seeded(4, 3, 3)
    with dist_autograd.context() as ctx:
        t3 = rpc.rpc_sync("worker1", add, (t1, t2))
        loss = (t3 * t4).sum()
        dist_autograd.backward(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)
        assert set(map(id, grads)) == {id(t1), id(t4)}
        ref = local_grads(lambda a, b: ((a + t2) * b).sum(), t1, t4)
        assert close(grads[t1], ref[0]) and close(grads[t4], ref[1])
        assert t1.grad is None and t4.grad is None  # never .grad
    assert ctx >> 48 == 0


def test_torchs_design_doc_example(pair):
    pair.run(_design_doc_example)


def _callee_parameters():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # the callee's own parameters, an input that does not require grad
    x = seeded(5, 4, 3, grad=False)
    with dist_autograd.context() as ctx:
        out = rpc.rpc_sync("worker1", linear_here, (x,))
        dist_autograd.backward(ctx, [out.tanh().sum()])
        remote = rpc.rpc_sync("worker1", param_grads, (ctx, ["w1", "b1"]))
        assert dist_autograd.get_gradients(ctx) == {}
    ref = local_grads(lambda w, b: (x @ w + b).tanh().sum(), seeded(11, 3, 3), seeded(12, 3))
    assert close(remote[0], ref[0]) and close(remote[1], ref[1])


def test_the_callees_own_parameters_get_gradients(pair):
    pair.run(_callee_parameters)


def _output_used_twice():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    x = seeded(6, 5)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", exp_of, (x,))
        dist_autograd.backward(ctx, [(y * y).sum() + y.mean()])
        g = dist_autograd.get_gradients(ctx)[x]
    assert close(g, local_grads(lambda a: (a.exp() ** 2).sum() + a.exp().mean(), x)[0])


def test_an_output_used_twice(pair):
    pair.run(_output_used_twice)


def _intermediate_sent_twice():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # an intermediate sent twice: its local graph is shared by two sends
    x, w = seeded(6, 5), seeded(7, 5)
    with dist_autograd.context() as ctx:
        h = (w * x).exp()
        y1 = rpc.rpc_sync("worker1", torch.sin, (h,))
        y2 = rpc.rpc_async("worker1", torch.cos, (h,)).wait()
        dist_autograd.backward(ctx, [(y1 * y2).sum()])
        gw, gx = (dist_autograd.get_gradients(ctx)[t] for t in (w, x))
    ref = local_grads(lambda a, b: ((a * b).exp().sin() * (a * b).exp().cos()).sum(), w, x)
    assert close(gw, ref[0]) and close(gx, ref[1])


def test_an_intermediate_sent_twice(pair):
    pair.run(_intermediate_sent_twice)


def _retain_graph():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # retain_graph: a second backward accumulates
    x, w = seeded(6, 5), seeded(7, 5)
    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync("worker1", exp_of, (x * w,)).sum()
        dist_autograd.backward(ctx, [loss], retain_graph=True)
        dist_autograd.backward(ctx, [loss], retain_graph=True)
        g = dist_autograd.get_gradients(ctx)[w]
    assert close(g, 2 * local_grads(lambda a: (x * a).exp().sum(), w)[0])


def test_retain_graph_a_second_backward_accumulates(pair):
    pair.run(_retain_graph)


def _chain_back_and_self_call():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # a chain back to the caller (worker0 -> worker1 -> worker0), and a self call
    x, w = seeded(6, 5), seeded(7, 5)
    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync("worker1", call_back, (x * w,)).sum() + \
            rpc.rpc_sync("worker0", torch.mul, (w, w)).sum()
        dist_autograd.backward(ctx, [loss])
        g = dist_autograd.get_gradients(ctx)[w]
    assert close(g, local_grads(lambda a: (x * a * 3.0).sin().sum() + (a * a).sum(), w)[0])


def test_a_chain_back_to_the_caller_and_a_call_to_oneself(pair):
    pair.run(_chain_back_and_self_call)


def _async_callee():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # @async_execution callee
    w = seeded(7, 5)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", async_double, (w,))
        dist_autograd.backward(ctx, [y.sum()])
        assert close(dist_autograd.get_gradients(ctx)[w], torch.full_like(w, 2.0))


def test_an_async_execution_callee(pair):
    pair.run(_async_callee)


def _remote_to_here():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # remote() and to_here(), in a context of its own (as torch's FAST
    # mode, a pass waits for every send of its context)
    w = seeded(7, 5)
    with dist_autograd.context() as ctx:
        r = rpc.remote("worker1", call_back, (w,))
        dist_autograd.backward(ctx, [r.to_here().sum()])
        g = dist_autograd.get_gradients(ctx)[w]
        assert close(g, local_grads(lambda a: (a * 3.0).sin().sum(), w)[0])


def test_remote_and_to_here_in_a_context(pair):
    pair.run(_remote_to_here)


def _rref_backward_in_a_context():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # RRef.backward in a context of its own (the root here does not reach
    # the one of a pass before it)
    w = seeded(7, 5)
    with dist_autograd.context() as ctx:
        loss_rref = rpc.remote("worker1", sum_sq, (w,))
        loss_rref.backward(ctx)
        assert close(dist_autograd.get_gradients(ctx)[w], 2 * w.detach())


def test_rref_backward_in_a_context(pair):
    pair.run(_rref_backward_in_a_context)


def _rref_backward_without_a_context():
    import ucxrpc as rpc

    # Local autograd (no context id) is the owner's alone, as in torch;
    # on the owner it accumulates into .grad there.
    with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id'"):
        rpc.remote("worker1", own_loss).backward()
    rpc.rpc_sync("worker1", backward_own_loss)
    assert close(rpc.rpc_sync("worker1", own_grad, ("w1",)), 2 * seeded(11, 3, 3).detach())


def test_rref_backward_without_a_context_is_the_owners_local_autograd(pair):
    pair.run(_rref_backward_without_a_context)


def _misuse():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # misuse: torch's messages
    w = seeded(7, 5)
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 424242"):
        dist_autograd.get_gradients(424242)
    with dist_autograd.context() as ctx:
        with pytest.raises(RuntimeError, match="Already have an autograd context id"):
            with dist_autograd.context():
                pass
        y = rpc.rpc_sync("worker1", exp_of, (w,))
        with pytest.raises(RuntimeError, match="all roots need to be scalar"):
            dist_autograd.backward(ctx, [y])
        # torch's checks, in its order and words
        for bad in ((ctx, None), (None, [y.sum()]), (ctx, [y.sum(), 1.0]),
                    (ctx, [y.sum()], "yes")):
            with pytest.raises(TypeError, match="(?s)incompatible function arguments.*"
                                                "(context_id|roots|retain_graph)"):
                dist_autograd.backward(*bad)
        with pytest.raises(RuntimeError, match="No tensors provided for gradient"):
            dist_autograd.backward(ctx, [])
        with pytest.raises(RuntimeError, match="requires_grad not set on root"):
            dist_autograd.backward(ctx, [torch.rand(3, 3)])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            dist_autograd.backward(ctx, [torch.rand(1, requires_grad=True)])
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        dist_autograd.backward(ctx, [y.sum()])


def test_misuse_fails_with_torchs_messages(pair):
    pair.run(_misuse)


# -- 3 workers: a chain A -> B -> C -> A -------------------------------------------

def hop1(x):
    import ucxrpc as rpc

    return rpc.rpc_sync("worker2", hop2, (x * param("p1", 21, 4),)) + x


def hop2(y):
    import ucxrpc as rpc

    return rpc.rpc_sync("worker0", hop3, (y.sin() * param("p2", 22, 4),))


def hop3(z):
    return z * param("p0", 20, 4)


def scale_by_p1(x):
    return x * param("p1", 21, 4)


def fetch_exp(rref):
    """worker2 fetches an activation that lives on worker1 (pipeline style)."""
    return rref.to_here().exp()


def _chain():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    x, p0 = seeded(1, 4), param("p0", 20, 4)
    with dist_autograd.context() as ctx:
        out = rpc.rpc_sync("worker1", hop1, (x,))
        dist_autograd.backward(ctx, [(out * out).sum()])
        g = dist_autograd.get_gradients(ctx)
        gx, gp0 = g[x], g[p0]
        gp1 = rpc.rpc_sync("worker1", param_grads, (ctx, ["p1"]))[0]
        gp2 = rpc.rpc_sync("worker2", param_grads, (ctx, ["p2"]))[0]
        assert [rpc.rpc_sync(f"worker{r}", num_contexts) for r in range(3)] == [1, 1, 1]

    def model(a, q0, q1, q2):
        o = (a * q1).sin() * q2 * q0 + a
        return (o * o).sum()
    ref = local_grads(model, x, p0, seeded(21, 4), seeded(22, 4))
    for got, want in zip((gx, gp0, gp1, gp2), ref):
        assert close(got, want)
    # worker0 never called worker2, yet the release reached it
    assert _wait_contexts_zero(rpc, ["worker0", "worker1", "worker2"]) == [0, 0, 0]


def test_nested_chain_three_workers(trio):
    trio.run(_chain)


def _activation_fetched_through_a_proxy():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    # an RRef to an activation on worker1, fetched by worker2 through a proxy
    x = seeded(1, 4)
    with dist_autograd.context() as ctx:
        hidden = rpc.remote("worker1", scale_by_p1, (x,))
        out = rpc.rpc_sync("worker2", fetch_exp, (hidden,))
        dist_autograd.backward(ctx, [out.sum()])
        gx = dist_autograd.get_gradients(ctx)[x]
        gp1 = rpc.rpc_sync("worker1", param_grads, (ctx, ["p1"]))[0]
    ref = local_grads(lambda a, q1: (a * q1).exp().sum(), x, seeded(21, 4))
    assert close(gx, ref[0]) and close(gp1, ref[1])


def test_an_activation_on_one_worker_fetched_by_another_through_an_rref(trio):
    trio.run(_activation_fetched_through_a_proxy)


# -- errors during backward ----------------------------------------------------------

class Boom(torch.autograd.Function):
    """Doubles; its backward raises while ``fail`` is set (on that worker)."""

    fail = True

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if Boom.fail:
            raise ValueError("boom in backward")
        return grad * 2


def boom(x):
    return Boom.apply(x)


def set_boom(fail):
    Boom.fail = fail


def _errors():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    rpc.rpc_sync("worker1", set_boom, (True,))  # whatever ran on this group before
    w = seeded(1, 3)
    with dist_autograd.context() as ctx:
        a = rpc.rpc_sync("worker1", boom, (w,))
        b = rpc.rpc_sync("worker2", exp_of, (w,))
        loss = (a * b).sum()
        for _ in range(2):
            # torch's first line, then the worker's name and the error's type
            with pytest.raises(RuntimeError, match=r"(?s)Error on Node 1: boom in backward\n"
                               r"\(ValueError on worker worker1, .*boom in backward") as info:
                dist_autograd.backward(ctx, [loss], retain_graph=True)
            assert isinstance(info.value, rpc.RpcError)
        # as torch's: the context stays everywhere, and once the error is
        # gone backward runs again in it, the graph retained
        assert [rpc.rpc_sync(f"worker{r}", num_contexts) for r in (1, 2)] == [1, 1]
        assert num_contexts() == 1
        rpc.rpc_sync("worker1", set_boom, (False,))
        dist_autograd.backward(ctx, [loss], retain_graph=True)
        before = dist_autograd.get_gradients(ctx)[w].clone()
        dist_autograd.backward(ctx, [loss])
        step = dist_autograd.get_gradients(ctx)[w] - before
        assert close(step, local_grads(lambda x: (x * 2 * x.exp()).sum(), w)[0])
    assert num_contexts() == 0
    assert _wait_contexts_zero(rpc, ["worker1", "worker2"]) == [0, 0]
    # the agents keep serving, and a new context works
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [rpc.rpc_sync("worker2", exp_of, (w,)).sum()])
        assert close(dist_autograd.get_gradients(ctx)[w], w.detach().exp())


def test_error_during_backward_names_the_worker(trio):
    trio.run(_errors)


class Slow(torch.autograd.Function):
    """exp; its backward takes a while, so its gradients reach the caller
    after another worker's failure did."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.4)
        (y,) = ctx.saved_tensors
        return grad * y


def slow_exp(x):
    return Slow.apply(x)


def num_passes():
    import ucxrpc.autograd as dist_autograd

    return dist_autograd._get_debug_info()["num_current_backward_passes"]


def _error_while_another_part_runs():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    rpc.rpc_sync("worker1", set_boom, (True,))
    w = seeded(2, 3)
    with dist_autograd.context() as ctx:
        loss = (rpc.rpc_sync("worker1", boom, (w,)) * rpc.rpc_sync("worker2", slow_exp, (w,))).sum()
        with pytest.raises(RuntimeError, match="boom in backward"):
            dist_autograd.backward(ctx, [loss], retain_graph=True)
        # reported once worker2's part ended too (as torch waits for the
        # context's outstanding RPCs): nothing of the pass runs anywhere ...
        assert [rpc.rpc_sync(f"worker{r}", num_passes) for r in (1, 2)] == [0, 0]
        # ... and worker2's gradients, come here after the failure, were
        # dropped by the failed pass, not taken for the start of a new one
        time.sleep(0.6)
        assert num_passes() == 0
        rpc.rpc_sync("worker1", set_boom, (False,))
        dist_autograd.backward(ctx, [loss])
        assert close(dist_autograd.get_gradients(ctx)[w],
                     local_grads(lambda x: (x * 2 * x.exp()).sum(), w)[0])


def test_a_failed_pass_ends_after_the_parts_still_running_elsewhere(trio):
    trio.run(_error_while_another_part_runs)


# -- concurrent contexts from two trainers -------------------------------------------

_DONE = threading.Semaphore(0)


def ps_forward(x):
    return (param("ps", 30, 8) * x).sum()


def ps_grad(context_id):
    return param_grads(context_id, ["ps"])[0]


def ps_param_rref():
    import ucxrpc as rpc

    return rpc.RRef(param("ps", 30, 8))


def trainer_done():
    _DONE.release()


def ps_value():
    return _PARAMS["ps"].detach().clone()


def _trainers(rank, world_size, init_method):
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.optim import DistributedOptimizer

    _init(rank, world_size, init_method)
    steps, lr = 8, 0.1
    if rank == 0:
        p0 = param("ps", 30, 8).detach().clone()
        for _ in range(2):
            assert _DONE.acquire(timeout=60)
        # loss = (w * x).sum(): the gradient is x whatever w is, so the
        # result does not depend on how the trainers' steps interleave
        xs = [seeded(100 * r + i, 8, grad=False) for r in (1, 2) for i in range(steps)]
        assert close(_PARAMS["ps"].detach(), p0 - lr * sum(xs))
    else:
        w = rpc.rpc_sync("worker0", ps_param_rref)
        opt = DistributedOptimizer(torch.optim.SGD, [w], lr=lr)
        for i in range(steps):
            x = seeded(100 * rank + i, 8, grad=False)
            with dist_autograd.context() as ctx:
                loss = rpc.rpc_sync("worker0", ps_forward, (x,))
                dist_autograd.backward(ctx, [loss])
                # the other trainer's context is running too: each sees only its own
                assert close(rpc.rpc_sync("worker0", ps_grad, (ctx,)), x)
                opt.step(ctx)
        rpc.rpc_sync("worker0", trainer_done)
    rpc.shutdown()


def test_concurrent_contexts_from_two_trainers():
    run_workers(_trainers, 3, timeout=100)


def _accumulate_grad_hooks():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    t = torch.ones(3, requires_grad=True)
    t.grad = torch.full((3,), 7.0)  # a local gradient, which dist autograd leaves alone
    calls = []
    # t's AccumulateGrad node (kept alive here, so its hooks stay on it)
    node = (t * 1).grad_fn.next_functions[0][0]
    node.register_hook(lambda grad_inputs, grad_outputs: calls.append(1))
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", torch.mul, (t, 2.0))
        dist_autograd.backward(ctx, [(y + t).sum()])
        grads = dist_autograd.get_gradients(ctx)
        out = (grads[t].tolist(), t.grad.tolist(), len(calls))
    assert node is not None
    return out


def test_accumulate_grad_hooks_run_and_grad_is_left_alone(pair):
    # As torch's distributed engine: a leaf's AccumulateGrad hooks run (DDP's
    # reducer all-reduces there), once per pass, when every gradient for
    # it is in (here two: the roots', and the one back from worker1), while
    # the gradient goes to the context and .grad keeps its local value.
    assert pair.run(_accumulate_grad_hooks) == ([3.0] * 3, [7.0] * 3, 1)


# -- sparse gradients ---------------------------------------------------------------

def embed_sum(weight, idx, offsets):
    """A sparse embedding on the callee: its gradient for ``weight`` is sparse."""
    return torch.nn.functional.embedding_bag(weight, idx, offsets, sparse=True).sum()


def _sparse():
    import ucxrpc as rpc
    from ucxrpc import autograd as dist_autograd

    weight = seeded(7, 10, 3)
    idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    with dist_autograd.context() as ctx:
        # the weight travels as a leaf; its sparse gradient comes back
        loss = rpc.rpc_sync("worker1", embed_sum, (weight, idx, offsets))
        dist_autograd.backward(ctx, [loss])
        got = dist_autograd.get_gradients(ctx)[weight]
    want = local_grads(lambda w: embed_sum(w, idx, offsets), weight)[0]
    return (got.layout is torch.sparse_coo,
            torch.allclose(got.to_dense(), want.to_dense(), **TOL))


def test_sparse_gradients_cross_workers(pair):
    # Sparse tensors once travelled by torch's own pickling, which drops
    # requires_grad: the callee's sparse embedding was cut off from the graph.
    assert pair.run(_sparse) == (True, True)


# -- which gradients are kept, which copied ---------------------------------------

class _Twice(torch.autograd.Function):
    """``a + b`` whose backward hands one and the same tensor to both."""

    grad_ptr = 0

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, grad):
        _Twice.grad_ptr = grad.data_ptr()
        return grad, grad


class _Once(torch.autograd.Function):
    grad_ptr = 0

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        _Once.grad_ptr = grad.data_ptr()
        return grad


def _kept_or_copied():
    import ucxrpc.autograd as dist_autograd

    a, b = seeded(1, 4), seeded(2, 4)
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [(_Twice.apply(a, b) * 3).sum()])
        grads = dist_autograd.get_gradients(ctx)
        kept = [grads[a].data_ptr() == _Twice.grad_ptr, grads[b].data_ptr() == _Twice.grad_ptr]
        grads[a].add_(1.0)  # an optimizer's in-place update of one of them
        apart = grads[b].tolist() == [3.0] * 4
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [(_Once.apply(a) * 3).sum()])
        once = dist_autograd.get_gradients(ctx)[a].data_ptr() == _Once.grad_ptr
    return (sorted(kept), apart, once)


def test_two_leaves_given_one_gradient_get_copies_and_one_used_once_is_kept(pair):
    # As torch's distributed engine (its test_no_grad_copy): a gradient
    # tensor handed to two leaves is copied for both, so neither aliases the
    # tensor the function made nor the other; a tensor only one leaf got is
    # kept as it is.  (Each leaf's AccumulateGrad still runs, with its hooks:
    # which tensor went to which leaves is seen by a pre-hook, _pass.py.)
    assert pair.run(_kept_or_copied) == ([False, False], True, True)


_SYMBOLIC = "torch.fx.experimental.symbolic_shapes"


def _first_pass_imports(rank, world_size, init_method):
    import sys

    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    _init(rank, world_size, init_method)
    before = _SYMBOLIC in sys.modules
    if rank == 0:
        x = seeded(1, 4)
        with dist_autograd.context() as ctx:
            loss = rpc.rpc_sync("worker1", exp_of, (x,)).sum()
            dist_autograd.backward(ctx, [loss])
            grad = dist_autograd.get_gradients(ctx)[x]
        assert close(grad, local_grads(lambda a: a.exp().sum(), x)[0])
    rpc.shutdown()  # waits for worker1's part of the pass too
    return before, _SYMBOLIC in sys.modules


def test_first_backward_does_not_import_symbolic_shapes():
    # torch.autograd.backward checks gradient shapes with torch's symbolic
    # shapes module, whose first import (sympy with it) made a process's
    # first distributed backward cost 0.8-2 s on a CPU and ~6 s on a GPU
    # machine; the local passes call the engine directly (_torch_engine.py).
    assert run_workers(_first_pass_imports, 2, timeout=90) == [(False, False), (False, False)]
