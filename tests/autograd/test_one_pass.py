"""A distributed backward is one pass per worker (autograd/_pass.py), as in
torch's distributed engine: each send gets its gradient once, a hook that
writes another leaf's gradient during the pass (DDP's reducer) is kept in the
context, every parameter under DDP is all-reduced whichever local part
reached it, and the pass waits for every send of its context."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers, worker_group

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]


def _init(rank, world_size, init_method):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))


# -- a recv two entries reach: its sender's send runs once ---------------------------

_SEEN: list[int] = []


def doubled(x):
    """worker1: y = 2x, with a hook counting the gradients y's part sees."""
    y = x * 2.0
    y.register_hook(lambda g: _SEEN.append(1))
    return y


def seen():
    return len(_SEEN)


def _workers_up(rank, world_size, init_method):
    """A group's rank: up as ``worker{rank}`` until the module's last test."""
    import ucxrpc as rpc

    _init(rank, world_size, init_method)
    yield
    rpc.shutdown()


pair = worker_group(_workers_up, 2)


def _recv_reached_twice():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    before = rpc.rpc_sync("worker1", seen)
    x = torch.arange(4.0, requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", doubled, (x,))
        # y is reached by the roots and by the send of y * 3 to worker1
        z = rpc.rpc_sync("worker1", torch.mul, (y * 3.0, y))
        dist_autograd.backward(ctx, [y.sum() + z.sum()])
        grad = dist_autograd.get_gradients(ctx)[x]
    # d/dx (2x + 3 (2x)^2) = 2 + 24 x
    return grad.tolist(), rpc.rpc_sync("worker1", seen) - before


def test_a_recv_reached_by_two_parts_sends_its_gradient_once(pair):
    grad, hooks = pair.run(_recv_reached_twice)
    assert grad == [2.0 + 24.0 * i for i in range(4)]
    assert hooks == 1  # worker1's send of y ran once, with the summed gradient


# -- a parameter several micro-batches use: its node runs once -----------------------

_CLAMP = 2.5
_SHARED: dict = {}


def shared_parameter():
    """worker1: a parameter with a tensor hook that changes its gradient (not
    linearly: clamp), an AccumulateGrad hook (as DDP's reducer) and a
    post-accumulate-grad hook, each logging what it sees."""
    w = torch.nn.Parameter(torch.ones(3))
    log = {"tensor": [], "node": [], "post": 0}

    def clamp(g):
        log["tensor"].append(g.tolist())
        return g.clamp(max=_CLAMP)

    def post(p):
        log["post"] += 1

    w.register_hook(clamp)
    node = w.view_as(w).grad_fn.next_functions[0][0]
    node.register_hook(lambda grad_inputs, grad_outputs: log["node"].append(1))
    w.register_post_accumulate_grad_hook(post)
    _SHARED.update(w=w, node=node, log=log)


def through_shared(x):
    return x * _SHARED["w"]


def shared_seen(ctx_id):
    import ucxrpc.autograd as dist_autograd

    grad = dist_autograd.get_gradients(ctx_id)[_SHARED["w"]]
    log = _SHARED["log"]
    return grad.tolist(), log["tensor"], len(log["node"]), log["post"], _SHARED["w"].grad


def _micro_batches_share_a_parameter():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    rpc.rpc_sync("worker1", shared_parameter)
    with dist_autograd.context() as ctx:
        # Four micro-batches through worker1's parameter: four sends there,
        # each its own entry of the pass, whose gradients come one by one.
        ys = [rpc.rpc_sync("worker1", through_shared, (torch.ones(3),)) for _ in range(4)]
        dist_autograd.backward(ctx, [torch.stack(ys).sum()])
        return rpc.rpc_sync("worker1", shared_seen, (ctx,))


def test_a_parameter_several_sends_reach_accumulates_once_with_the_whole_gradient(pair):
    # torch's one graph task runs the parameter's AccumulateGrad once, when
    # all four micro-batches' gradients are in: its tensor hook sees the
    # sum (4) once and clamps it (2.5; per micro-batch it would leave each
    # 1 alone, 4 in all), its node hook runs once, and, the gradient going
    # to the context rather than .grad, no post-accumulate-grad hook runs
    # (torch's agent, same program: the same four figures).
    grad, tensor_hook, node_hook, post_hook, dot_grad = pair.run(_micro_batches_share_a_parameter)
    assert tensor_hook == [[4.0] * 3]
    assert grad == [_CLAMP] * 3
    assert node_hook == 1
    assert post_hook == 0
    assert dot_grad is None


def _a_sparse_leaf_sent_twice():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    w = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,), requires_grad=True)
    with dist_autograd.context() as ctx:
        # w itself is each send's output: two entries share a sparse leaf.
        a = rpc.rpc_sync("worker1", torch.mul, (w, 2.0))
        b = rpc.rpc_sync("worker1", torch.mul, (w, 3.0))
        dist_autograd.backward(ctx, [torch.sparse.sum(a + b)])
        grad = dist_autograd.get_gradients(ctx)[w]
        return grad.layout == torch.sparse_coo, grad.to_dense().tolist()


def test_a_sparse_leaf_two_sends_carried_gets_their_sum_once(pair):
    assert pair.run(_a_sparse_leaf_sent_twice) == (True, [5.0, 0.0, 5.0])


def _a_tensor_sent_and_used_locally():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    w = torch.ones(3, requires_grad=True)
    seen = []
    with dist_autograd.context() as ctx:
        h = w * 2.0
        h.retain_grad()
        h.register_hook(lambda g: seen.append(g.tolist()))
        # h's node is interior, and both the roots' part and the part of
        # h's send to worker1 reach it.
        r = rpc.rpc_sync("worker1", torch.mul, (h, 3.0))
        dist_autograd.backward(ctx, [r.sum() + h.sum()])
        return dist_autograd.get_gradients(ctx)[w].tolist(), h.grad.tolist(), sorted(seen)


def test_an_interior_node_two_entries_reach_runs_once_per_entry_with_the_sums_right(pair):
    # The one difference left from torch's graph task (README): h's node runs
    # once per entry, its hook seeing each share (1, then 3) where torch's
    # sees 4 once; the sums, the context's gradient and retain_grad's .grad,
    # are torch's.
    grad, retained, seen = pair.run(_a_tensor_sent_and_used_locally)
    assert grad == [8.0] * 3
    assert retained == [4.0] * 3
    assert seen == [[1.0] * 3, [3.0] * 3]


# -- a part that failed: the pass's later messages find it ended ----------------------

_FAILS_LEFT = [0]


class _FailOnce(torch.autograd.Function):
    """y = 2x whose backward fails while ``_FAILS_LEFT`` says so."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        if _FAILS_LEFT[0] > 0:
            _FAILS_LEFT[0] -= 1
            raise ValueError("the first part here fails")
        return g * 2.0


def fail_once(x):
    return _FailOnce.apply(x)


def arm(n):
    _FAILS_LEFT[0] = n


def passes_running():
    import ucxrpc.autograd as dist_autograd
    return dist_autograd._get_debug_info()["num_current_backward_passes"]


def _late_messages_of_a_failed_pass():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.errors import DistAutogradError

    # Each backward sends eight gradients to worker1, its part there fails at
    # the first it runs, and the other seven reach a part that ended (its
    # pass failed) or, sooner, one that is stopping.  A late one must not
    # begin a new part there, which would wait for the entry the failed
    # part took until the timeout (5 s here, for the control's sake).
    old = rpc.get_rpc_timeout()
    rpc._set_rpc_timeout(5.0)
    errors = []
    try:
        for _ in range(5):
            rpc.rpc_sync("worker1", arm, (1,))
            xs = [torch.full((2,), float(i), requires_grad=True) for i in range(8)]
            with dist_autograd.context() as ctx:
                ys = [rpc.rpc_sync("worker1", fail_once, (x,)) for x in xs]
                try:
                    dist_autograd.backward(ctx, [torch.stack(ys).sum()])
                except DistAutogradError as e:
                    errors.append(str(e).splitlines()[0])
                errors.append(rpc.rpc_sync("worker1", passes_running))
        # The context still trains afterwards.
        rpc.rpc_sync("worker1", arm, (0,))
        x = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [rpc.rpc_sync("worker1", fail_once, (x,)).sum()])
            grad = dist_autograd.get_gradients(ctx)[x].tolist()
    finally:
        rpc._set_rpc_timeout(old)
    return errors, grad


def test_a_failed_parts_late_messages_are_answered_not_begun_anew(pair):
    errors, grad = pair.run(_late_messages_of_a_failed_pass)
    assert errors == ["Error on Node 1: the first part here fails", 0] * 5
    assert grad == [2.0, 2.0]


# -- a hook writing another leaf's gradient during the pass ---------------------------

def _hook_writes_other_leaf():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    a = torch.ones(3, requires_grad=True)   # reached by the roots' part
    b = torch.ones(3, requires_grad=True)   # reached by the part of the send of b * 2
    engine = torch.autograd.Variable._execution_engine
    order: list[str] = []

    def finalize() -> None:  # as DDP's reducer: once its last parameter is ready
        order.append("callback")
        a.grad.mul_(10.0)
        b.grad.mul_(10.0)

    a_node = (a * 1).grad_fn.next_functions[0][0]
    b_node = (b * 1).grad_fn.next_functions[0][0]
    def b_ready(grad_inputs, grad_outputs):
        order.append("b")
        engine.queue_callback(finalize)

    a_node.register_hook(lambda grad_inputs, grad_outputs: order.append("a") and None)
    b_node.register_hook(b_ready)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", torch.mul, (b, 2.0))
        dist_autograd.backward(ctx, [(a * y).sum()])
        grads = dist_autograd.get_gradients(ctx)
        out = (grads[a].tolist(), grads[b].tolist(), order, a.grad, b.grad)
    assert a_node is not None and b_node is not None
    return out


def test_a_callback_queued_in_the_pass_writes_the_pass_gradients(pair):
    # b's AccumulateGrad runs in a later local part than a's (b's gradient
    # comes back from worker1); the callback it queues scales both leaves'
    # gradients, as DDP's finalize writes every parameter of a bucket, and
    # the context keeps what it wrote for both, while .grad stays untouched.
    a_grad, b_grad, order, a_local, b_local = pair.run(_hook_writes_other_leaf)
    assert a_grad == [20.0] * 3 and b_grad == [20.0] * 3
    assert order == ["a", "b", "callback"]
    assert a_local is None and b_local is None


def _callback_queued_in_the_first_part():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    a = torch.ones(3, requires_grad=True)   # the roots' part: runs first
    b = torch.ones(3, requires_grad=True)   # the part of the send of b * 2: later
    engine = torch.autograd.Variable._execution_engine
    order: list[str] = []

    def finalize() -> None:
        order.append(f"callback sees b.grad {b.grad is not None and b.grad.tolist()}")
        b.grad.mul_(10.0)

    def a_ready(grad_inputs, grad_outputs):
        order.append("a")
        engine.queue_callback(finalize)

    # (AccumulateGrad nodes live while referenced: kept, as their hooks)
    a_node = (a * 1).grad_fn.next_functions[0][0]
    b_node = (b * 1).grad_fn.next_functions[0][0]
    a_node.register_hook(a_ready)
    b_node.register_hook(lambda grad_inputs, grad_outputs: order.append("b") and None)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", torch.mul, (b, 2.0))
        dist_autograd.backward(ctx, [(a * y).sum()])
        b_grad = dist_autograd.get_gradients(ctx)[b].tolist()
    # Outside a pass the engine's callbacks run at the end of their backward.
    outside: list[str] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 1
    y.grad_fn.register_hook(
        lambda gi, go: engine.queue_callback(lambda: outside.append("ran")) and None)
    y.sum().backward()
    assert a_node is not None and b_node is not None
    return order, b_grad, outside


def test_a_callback_queued_in_an_early_part_runs_when_the_pass_ends(pair):
    # torch's graph task runs its final callbacks once all of it ran: the
    # callback queued in a's part (the first) runs after b's part (the
    # last), sees b's gradient and writes it for the context.
    order, b_grad, outside = pair.run(_callback_queued_in_the_first_part)
    assert order == ["a", "b", "callback sees b.grad [2.0, 2.0, 2.0]"]
    assert b_grad == [20.0] * 3
    assert outside == ["ran"]


# -- a send the roots do not use: the pass cannot end, and says so -------------------

def _unused_send():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.errors import DistAutogradError

    t1, t2 = torch.rand(3, requires_grad=True), torch.rand(3, requires_grad=True)
    with dist_autograd.context() as ctx:
        rpc.rpc_sync("worker1", torch.add, (t1, t2))  # its result is never used
        try:
            dist_autograd.backward(ctx, [(t1 * t2).sum()])
            error = None
        except DistAutogradError as e:
            error = str(e)
    with dist_autograd.context() as ctx:  # every send used: the pass ends
        y = rpc.rpc_sync("worker1", torch.mul, (t1, 2.0))
        dist_autograd.backward(ctx, [y.sum()])
        grad = dist_autograd.get_gradients(ctx)[t1].tolist()
    return error, grad, rpc.rpc_sync("worker1", passes_running)


def test_a_send_no_part_reaches_fails_the_backward_naming_it(pair):
    # torch's FAST mode waits for every send of the context; here no part
    # can ever reach the send of (t1, t2) (its result is unused): torch's
    # agent waits for ever, ucxrpc's fails at once, naming what it awaited.
    error, grad, running = pair.run(_unused_send)
    assert error is not None and error.startswith("Error on Node 0: the backward pass of "
                                                  "autograd context"), error
    assert "cannot finish: it waits for the gradients of send" in error
    assert "to worker id 1 (tensors of shapes [3], [3])" in error
    assert grad == [2.0] * 3
    assert running == 0


def ignore(t):
    """worker0, called back from worker1: takes a tensor, gives back nothing
    that carries gradients."""
    return None


def calls_back(x):
    """worker1: y = 2x; sends y to worker0 and drops what comes back, so no
    gradient ever comes for that send; returns 3y."""
    import ucxrpc as rpc

    y = x * 2.0
    rpc.rpc_sync("worker0", ignore, (y,))
    return y * 3.0


_OWN = torch.ones(3, requires_grad=True)


def sends_its_own(x):
    """worker1: sends 2 * a parameter of its own to worker0, dropping what
    comes back; returns 3x (so x's gradients go back as ever)."""
    import ucxrpc as rpc

    rpc.rpc_sync("worker0", ignore, (_OWN * 2.0,))
    return x * 3.0


def _failed_backward(fn, x):
    """In a context of its own, backward through ``worker1``'s ``fn(x)``:
    the error it failed with (None if it did not), and how many passes
    still run on worker1 after it."""
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.errors import DistAutogradError

    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", fn, (x,))
        try:
            dist_autograd.backward(ctx, [y.sum()])
            error = None
        except DistAutogradError as e:
            error = str(e)
        return error, rpc.rpc_sync("worker1", passes_running)


def _unused_send_on_a_callee():
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    x = torch.rand(3, requires_grad=True)
    error, running = _failed_backward(calls_back, x)  # its part was ended
    alone, left = _failed_backward(sends_its_own, x)  # only worker1 waits
    running += left
    with dist_autograd.context() as ctx:  # every send used: the pass ends
        y = rpc.rpc_sync("worker1", torch.mul, (x, 2.0))
        dist_autograd.backward(ctx, [y.sum()])
        grad = dist_autograd.get_gradients(ctx)[x].tolist()
    return error, alone, running, grad


def test_a_send_no_part_reaches_on_another_worker_fails_the_backward_naming_it(pair):
    # worker1's part waits for the gradients of its send to worker0, which
    # nothing uses, so its recv of x never sends x's gradients, for which
    # worker0 waits in turn.  Before termination detection only a caller
    # with every propagation answered was found waiting so: here worker0's
    # propagation to worker1 is never answered, and the pass ended by the
    # RPC timeout (60 s).
    error, alone, running, grad = pair.run(_unused_send_on_a_callee)
    assert error is not None and error.startswith("Error on Node 0: the backward pass of "
                                                  "autograd context"), error
    assert "cannot finish: it waits for the gradients of send" in error
    assert "to worker id 1 (tensors of shapes [3]); worker1 (worker id 1) waits for" in error
    assert "to worker id 0 (tensors of shapes [3]), which no part" in error
    # Where worker1 alone waits (its own parameter's send), the caller's
    # part ran everything, and learns it from worker1's answer.
    assert alone is not None and ("cannot finish: worker1 (worker id 1) waits for the "
                                  "gradients of send" in alone), alone
    assert "to worker id 0 (tensors of shapes [3]), which no part" in alone
    assert "it waits" not in alone
    assert running == 0
    assert grad == [2.0] * 3


# -- DDP around a model that calls another worker --------------------------------------

def _ddp_outside(rank, world_size, init_method, pg_file):
    import torch.distributed as dist

    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    _init(rank, world_size, init_method)
    out = None
    if rank < 2:  # two trainers under DDP; worker2 holds the middle layer
        dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank,
                                world_size=2)

        class Hybrid(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = torch.nn.Linear(2, 3, bias=False)   # before the remote part
                self.fc2 = torch.nn.Linear(3, 1, bias=False)   # after it
                with torch.no_grad():
                    self.fc1.weight.copy_(torch.arange(6.0).view(3, 2) / 6.0)
                    self.fc2.weight.fill_(0.5)

            def forward(self, x):
                h = rpc.rpc_sync("worker2", torch.tanh, (self.fc1(x),))
                return self.fc2(h)

        model = torch.nn.parallel.DistributedDataParallel(Hybrid())
        x = torch.full((4, 2), float(rank + 1))  # the trainers' gradients differ
        with dist_autograd.context() as ctx:
            loss = model(x).sum()
            dist_autograd.backward(ctx, [loss])
            grads = dist_autograd.get_gradients(ctx)
            fc1, fc2 = (grads[model.module.fc1.weight], grads[model.module.fc2.weight])
        # Each trainer's own gradients, computed locally, then averaged.
        local = Hybrid()
        lx = local.fc2(torch.tanh(local.fc1(x))).sum()
        lx.backward()
        mine = torch.cat([local.fc1.weight.grad.flatten(), local.fc2.weight.grad.flatten()])
        both = [torch.zeros_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        out = (torch.cat([fc1.flatten(), fc2.flatten()]), (both[0] + both[1]) / 2)
        dist.destroy_process_group()
    rpc.shutdown()
    return out


def test_ddp_around_a_model_calling_another_worker_all_reduces_every_parameter(tmp_path):
    # fc2's gradient comes in the trainer's first local part (from the loss),
    # fc1's in a later one (back from worker2): DDP's reducer all-reduces
    # their bucket when fc1 is ready, and both must come out averaged.
    results = run_workers(_ddp_outside, 3, args=(str(tmp_path / "pg"),), timeout=140)
    for got, averaged in results[:2]:
        assert torch.allclose(got, averaged), (got, averaged)
    assert torch.allclose(results[0][0], results[1][0])
