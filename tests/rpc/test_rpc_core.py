"""rpc_sync / rpc_async / lifecycle over real UCX pipes between processes.

The scenarios of a plain two-worker job run one per test on one group of
workers kept up for the module (tests/workers.py, worker_group); after each
one the agent must still be serving.  Jobs that need their own start (other
options, three workers, init and shutdown themselves) run on their own."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from tests.workers import run_workers, worker_group
from ucxrpc.functions import async_execution

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def _opts(init_method: str, **kw: object):
    import ucxrpc as rpc

    return rpc.UcxRpcBackendOptions(init_method=init_method, **kw)


def _init(rank: int, world_size: int, init_method: str, **kw: object) -> None:
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=_opts(init_method, **kw))


# ---------------------------------------------------------------- callees

def add(a, b, *, scale=1):
    return (a + b) * scale


def echo(x):
    return x


def raise_value_error(msg):
    raise ValueError(msg)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def return_unpicklable():
    return threading.Lock()


def whoami():
    import ucxrpc as rpc

    return rpc.get_worker_info().name


class CustomError(Exception):
    pass


def raise_custom():
    raise CustomError("custom failure")


def _async_add(a, b):
    fut = torch.futures.Future()

    def complete():
        time.sleep(0.05)
        fut.set_result(a + b)

    threading.Thread(target=complete).start()
    return fut


@async_execution
def async_add_entry(a, b):
    return _async_add(a, b)


class AsyncHolder:
    @staticmethod
    @async_execution
    def add(a, b):
        return _async_add(a, b)


def nested_to(dst, value):
    import ucxrpc as rpc

    return rpc.rpc_sync(dst, add, args=(value, 1))


def call_back_caller(caller, value):
    import ucxrpc as rpc

    return rpc.rpc_sync(caller, add, args=(value, 100))


# ------------------------------------------- scenarios on two workers kept up

def _pair(rank: int, world_size: int, init_method: str):
    """The group's ranks: worker0 (which runs the scenarios) and worker1."""
    import ucxrpc as rpc

    _init(rank, world_size, init_method)
    yield
    rpc.shutdown()


def _still_serving() -> None:
    """After each scenario: the agent still serves, and calls worker1."""
    import ucxrpc as rpc

    assert rpc._get_debug_info()["state"] == "serving"  # agent/state.py
    assert rpc.rpc_sync("worker1", add, args=(1, 1)) == 2


pair = worker_group(_pair, 2, check=_still_serving)


def _worker_infos() -> None:
    import ucxrpc as rpc

    me = rpc.get_worker_info()
    w1 = rpc.get_worker_info("worker1")
    assert (me.name, me.id) == ("worker0", 0)
    assert (w1.name, w1.id) == ("worker1", 1)
    assert w1 == rpc.get_worker_info("worker1") and hash(w1) == hash(rpc.get_worker_info("worker1"))
    assert repr(w1) == "WorkerInfo(id=1, name=worker1)"


def test_worker_infos_name_every_worker(pair):
    pair.run(_worker_infos)


def _destinations() -> None:
    import ucxrpc as rpc

    w1 = rpc.get_worker_info("worker1")
    # destinations: name, rank, WorkerInfo; builtins and user functions; kwargs
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)),
                       torch.full((2,), 2.0))
    assert rpc.rpc_sync(1, add, args=(2, 3), kwargs={"scale": 10}) == 50
    assert rpc.rpc_sync(w1, whoami) == "worker1"
    assert rpc.rpc_sync("worker0", whoami) == "worker0"  # a call to oneself


def test_a_destination_is_a_name_a_rank_or_a_worker_info(pair):
    pair.run(_destinations)


def _async_future() -> None:
    import ucxrpc as rpc

    fut = rpc.rpc_async("worker1", add, args=(torch.ones(3), torch.ones(3)))
    assert isinstance(fut, torch.futures.Future)
    chained = fut.then(lambda f: f.value().sum().item())
    assert chained.wait() == 6.0


def test_rpc_async_gives_a_torch_future_that_chains(pair):
    pair.run(_async_future)


def _async_execution() -> None:
    import ucxrpc as rpc

    # async_execution, plain and as a staticmethod
    assert rpc.rpc_sync("worker1", async_add_entry, args=(1, 2)) == 3
    assert rpc.rpc_sync("worker1", AsyncHolder.add, args=(3, 4)) == 7


def test_async_execution_plain_and_as_a_staticmethod(pair):
    pair.run(_async_execution)


def _large_tensor() -> None:
    import ucxrpc as rpc

    # a large tensor both ways, received whole
    big = torch.arange(8 << 20, dtype=torch.int32)
    back = rpc.rpc_sync("worker1", echo, args=(big,))
    assert torch.equal(back, big) and back.data_ptr() != big.data_ptr()


def test_a_large_tensor_goes_both_ways_whole(pair):
    pair.run(_large_tensor)


def _concurrent_large() -> None:
    import ucxrpc as rpc

    # many concurrent large messages on one pipe
    tensors = [torch.full((1 << 20,), float(i)) for i in range(8)]
    futs = [rpc.rpc_async("worker1", echo, args=(t,)) for t in tensors]
    for t, f in zip(tensors, futs):
        assert torch.equal(f.wait(), t)


def test_many_concurrent_large_messages_on_one_pipe(pair):
    pair.run(_concurrent_large)


def _sizes_in_flight() -> None:
    import ucxrpc as rpc

    # frames of very different sizes in flight together arrive in order
    # (a large frame completes after a small one sent behind it)
    many = {f"t{i}": torch.full((1024,), float(i)) for i in range(100)}
    for _ in range(50):
        futs = [rpc.rpc_async("worker1", echo, args=(many,)),
                rpc.rpc_async("worker1", add, args=(1, 2)),
                rpc.rpc_async("worker1", echo, args=(many,))]
        assert futs[1].wait() == 3
        assert torch.equal(futs[2].wait()["t99"], many["t99"])
        futs[0].wait()


def test_frames_of_very_different_sizes_in_flight_together(pair):
    pair.run(_sizes_in_flight)


def _timeout_and_pipe_info() -> list:
    import ucxrpc as rpc

    assert rpc.get_rpc_timeout() == 60.0
    info = rpc.get_pipe_info("worker1")
    assert info and info[0]["peer"] == "worker1" and info[0]["transports"], info
    return info[0]["transports"]


def test_default_timeout_and_the_pipes_transports(pair):
    assert pair.run(_timeout_and_pipe_info)


def _tensor_fidelity() -> None:
    import ucxrpc as rpc

    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    cases = {
        "transposed": base.t(),
        "zero": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "bool": torch.tensor([True, False, True]),
        "half": torch.randn(5).half(),
        "bf16": torch.randn(5).bfloat16(),
        "complex": torch.randn(4, dtype=torch.complex64),
        "int8": torch.tensor([-1, 2, 3], dtype=torch.int8),
        "slice_big_storage": torch.arange(10000, dtype=torch.float32)[10:20],
    }
    back = rpc.rpc_sync("worker1", echo, args=(cases,))
    for k, v in cases.items():
        got = back[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got, v), k
    assert back["transposed"].stride() == base.t().stride()


def test_tensor_fidelity(pair):
    pair.run(_tensor_fidelity)


def _shared_storage() -> None:
    import ucxrpc as rpc

    # a storage shared by two views travels once and stays shared
    a = torch.arange(16.0)
    x, y = rpc.rpc_sync("worker1", echo, args=((a, a[4:]),))
    assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    x[5] = -1.0
    assert y[1].item() == -1.0


def test_a_storage_shared_by_two_views_stays_shared(pair):
    pair.run(_shared_storage)


def _remote_exceptions() -> None:
    import ucxrpc as rpc

    # remote exception: same type and message, remote traceback available
    with pytest.raises(ValueError, match="bad input 42") as ei:
        rpc.rpc_sync("worker1", raise_value_error, args=("bad input 42",))
    assert "On WorkerInfo(id=1, name=worker1)" in str(ei.value)
    assert "raise_value_error" in ei.value.remote_traceback
    with pytest.raises(CustomError, match="custom failure"):
        rpc.rpc_async("worker1", raise_custom).wait()


def test_a_remote_exception_keeps_its_type_message_and_traceback(pair):
    pair.run(_remote_exceptions)


def _fail_with(x: torch.Tensor) -> None:
    raise ValueError(f"no thanks ({x.numel()} elements)")


def _failed_calls_free_their_arguments() -> None:
    import gc
    import weakref

    import ucxrpc as rpc

    def failed(call) -> weakref.ref:
        x = torch.ones(1000)
        with pytest.raises(ValueError, match="no thanks"):
            call(x)
        return weakref.ref(x)

    calls = [lambda x: rpc.rpc_sync("worker1", _fail_with, (x,)),
             lambda x: rpc.rpc_async("worker1", _fail_with, (x,)).wait(),
             lambda x: rpc.remote("worker1", _fail_with, (x,)).to_here()]
    for call in calls:
        refs = [failed(call) for _ in range(3)]
        gc.collect()
        # A torch future re-raises the exception object it holds, growing its
        # traceback by the waiting frames each time: a cycle through the
        # future that the collector cannot see.  Each wait raises a copy.
        assert [r() for r in refs] == [None, None, None]


def test_a_failed_call_keeps_nothing_of_its_caller_alive(pair):
    pair.run(_failed_calls_free_their_arguments)


def _unknown_destinations() -> None:
    import ucxrpc as rpc

    # unknown destination at call time, from every entry point
    for call in (rpc.rpc_sync, rpc.rpc_async):
        with pytest.raises(RuntimeError, match="could not find destination name nope"):
            call("nope", add, args=(1, 2))
    with pytest.raises(RuntimeError, match="destination id 17"):
        rpc.rpc_sync(17, add, args=(1, 2))


def test_an_unknown_destination_fails_at_call_time(pair):
    pair.run(_unknown_destinations)


def _unpicklable() -> None:
    import ucxrpc as rpc

    # unpicklable argument: the local pickling error, at call time
    with pytest.raises((TypeError, AttributeError)):
        rpc.rpc_sync("worker1", echo, args=(threading.Lock(),))
    # unpicklable result: RuntimeError naming the pickling failure
    with pytest.raises(RuntimeError, match="cannot pickle the result of return_unpicklable"):
        rpc.rpc_sync("worker1", return_unpicklable)


def test_an_unpicklable_argument_or_result_fails_naming_it(pair):
    pair.run(_unpicklable)


def _timeouts() -> None:
    import ucxrpc as rpc

    # timeouts: per call, via rpc_async().wait(), and 0 = never
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="RPC ran for more than set timeout \\(500 ms\\)"):
        rpc.rpc_sync("worker1", sleep_then, args=(3, 1), timeout=0.5)
    assert time.monotonic() - t0 < 2.5
    with pytest.raises(TimeoutError):
        rpc.rpc_async("worker1", sleep_then, args=(3, 1), timeout=0.2).wait()
    assert rpc.rpc_sync("worker1", sleep_then, args=(0.3, 7), timeout=0) == 7


def test_timeouts_per_call_on_wait_and_never(pair):
    pair.run(_timeouts)


def _no_deadline_left_behind() -> None:
    import ucxrpc as rpc

    # Answered calls leave no deadline behind, even queued behind a
    # slow call (else ~1M entries at 20k calls/s with the 60 s default).
    slow = rpc.rpc_async("worker1", sleep_then, args=(2, 0))
    torch.futures.wait_all([rpc.rpc_async("worker1", add, args=(i, 1)) for i in range(3000)])
    assert _armed_within(1, 10.0) <= 1  # the slow call's own
    slow.wait()
    assert _armed_within(0, 10.0) == 0


def _armed_within(most: int, seconds: float) -> int:
    """Deadlines the agent holds, once at most ``most`` or ``seconds`` passed
    (the timer drops answered ones on its next turn)."""
    import ucxrpc as rpc

    end = time.monotonic() + seconds
    while (armed := rpc._get_debug_info()["armed_deadlines"]) > most and time.monotonic() < end:
        time.sleep(0.05)
    return armed


def test_answered_calls_leave_no_deadline_behind(pair):
    pair.run(_no_deadline_left_behind)


# ------------------------------------------------------ jobs of their own

def _nested(rank: int, world_size: int, init_method: str) -> None:
    import ucxrpc as rpc

    _init(rank, world_size, init_method, num_worker_threads=4)
    if rank == 0:
        # A -> B -> C
        assert rpc.rpc_sync("worker1", nested_to, args=("worker2", 5)) == 6
        # B calls back A from inside its handler, many at once: more blocked
        # handlers than threads must not deadlock.
        futs = [rpc.rpc_async("worker1", call_back_caller, args=("worker0", i)) for i in range(24)]
        assert [f.wait() for f in futs] == [i + 100 for i in range(24)]
    rpc.shutdown()


def test_nested_calls_do_not_deadlock():
    run_workers(_nested, 3, timeout=90)


def _lifecycle(rank: int, world_size: int, init_method: str) -> None:
    import ucxrpc as rpc

    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.rpc_sync("worker1", add, args=(1, 2))
    with pytest.raises(ValueError, match="Worker name must match"):
        rpc.init_rpc("bad name!", rank=rank, world_size=world_size)
    _init(rank, world_size, init_method)
    with pytest.raises(RuntimeError, match="RPC is already initialized"):
        _init(rank, world_size, init_method)
    other = 1 - rank
    assert rpc.rpc_sync(other, add, args=(rank, 10)) == rank + 10
    rpc.shutdown()
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.rpc_async(other, add, args=(1, 2))
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.get_worker_info()


def test_lifecycle_errors():
    run_workers(_lifecycle, 2, timeout=90)


def _env_init(rank: int, world_size: int, init_method: str, port: int) -> str:
    import ucxrpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size)
    name = rpc.rpc_sync(f"trainer{1 - rank}", whoami)
    rpc.shutdown()
    # init again after shutdown in the same process, through a file store
    rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=_opts(init_method))
    assert rpc.rpc_sync(f"trainer{1 - rank}", add, args=(1, 2)) == 3
    rpc.shutdown()
    return name


def test_env_and_file_init(tmp_path):
    from tests.workers import free_port

    res = run_workers(_env_init, 2, args=(free_port(),), timeout=90,
                      init_method=f"file://{tmp_path}/store")
    assert res == ["trainer1", "trainer0"]


def _tcp_only(rank: int, world_size: int, init_method: str) -> list:
    import ucxrpc as rpc

    _init(rank, world_size, init_method, transports=["tcp"])
    t = torch.randn(1 << 20)
    assert torch.equal(rpc.rpc_sync(1 - rank, echo, args=(t,)), t)
    info = rpc.get_pipe_info()
    rpc.shutdown()
    return info[0]["transports"]


def test_transports_option_narrows_what_ucx_uses():
    res = run_workers(_tcp_only, 2, timeout=90, env={"UCX_NET_DEVICES": "lo"})
    assert res == [["tcp"], ["tcp"]]


def _graceful(rank: int, world_size: int, init_method: str) -> object:
    import ucxrpc as rpc

    _init(rank, world_size, init_method)
    if rank == 1:
        # rank 0 is already shutting down; graceful shutdown must still serve
        # this call and let its reply arrive before tearing down.
        fut = rpc.rpc_async("worker0", sleep_then, args=(1.0, "served"))
        rpc.shutdown()
        return fut.wait()
    rpc.shutdown()
    return None


def test_graceful_shutdown_waits_for_in_flight_work():
    assert run_workers(_graceful, 2, timeout=90) == [None, "served"]


def _env_rank(rank: int, world_size: int, init_method: str, port: int) -> int:
    import ucxrpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    rpc.init_rpc(f"w{rank}", world_size=world_size)  # rank from RANK, as torchrun sets
    me = rpc.get_worker_info().id
    rpc.shutdown()
    return me


def test_rank_comes_from_torchrun_environment():
    from tests.workers import free_port

    assert run_workers(_env_rank, 2, args=(free_port(),), timeout=90) == [0, 1]


def _hammer(rank: int, world_size: int, init_method: str) -> list:
    import ucxrpc as rpc

    _init(rank, world_size, init_method)
    errors: list = []

    def caller(tid: int) -> None:
        try:
            for i in range(100):
                to = (rank + 1 + i % (world_size - 1)) % world_size
                t = torch.full((1 + (i * 7919) % 300000,), float(tid))
                assert torch.equal(rpc.rpc_sync(to, echo, args=(t,)), t)
        except Exception as exc:  # surfaced below with the others
            errors.append(repr(exc))

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rpc.shutdown()
    return errors


def test_many_threads_call_every_peer_at_once():
    # Sends go to UCX straight from the calling threads while the progress
    # thread polls; mixed sizes cover inline, eager and rendezvous paths.
    assert run_workers(_hammer, 3, timeout=100) == [[], [], []]
