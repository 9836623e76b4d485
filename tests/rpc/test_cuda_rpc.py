"""CUDA tensors over RPC along device maps (two processes sharing one GPU).

Marked ``gpu``: skipped without one.  Run on a GPU machine with
``UCXRPC_REQUIRE_GPU=1 python -m pytest -m gpu -rs``, where a skip fails
(benchmarks/gpu_check.sh does).
"""

from __future__ import annotations

import pytest
import torch

from tests.rpc._gpu import BOTH, SPIN
from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.gpu, pytest.mark.timeout(180)]

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64"]


def _init(rank, world_size, init_method, maps, **extra):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method,
                                                              device_maps=maps.get(rank),
                                                              **extra))


def describe(t):
    return str(t.device), t.dtype, t.sum().item() if t.dtype != torch.bool else int(t.sum())


def plus_one(t):
    return t + 1


def sample(dtype_name, n=1 << 16):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2 if dtype is torch.bool else 100, (n,), generator=g)
    return x.to(dtype)


def _cuda_both_ways(rank, world_size, init_method):
    import ucxrpc as rpc

    _init(rank, world_size, init_method, {0: {"worker1": {0: 0}}})
    if rank == 0:
        for name in DTYPES:
            t = sample(name).cuda()
            # the callee sees it on cuda:0 (the map), the reply comes back there
            assert rpc.rpc_sync("worker1", describe, (t,)) == describe(t), name
            if t.dtype is not torch.bool:
                back = rpc.rpc_sync("worker1", plus_one, (t,))
                assert back.device == torch.device("cuda:0")
                assert torch.equal(back, t + 1), name
        # stream discipline: the producer kernel is still running when the RPC goes
        big = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(100_000_000)  # about 50-100 ms of GPU time on the stream
        big.add_(3)
        assert rpc.rpc_sync("worker1", describe, (big,))[2] == 3 * (1 << 20)
    else:
        # worker1 has no map to worker0: CUDA tensors it sends are refused clearly
        with pytest.raises(RuntimeError, match="no device map entry covers cuda:0"):
            rpc.rpc_sync("worker0", describe, (torch.ones(4, device="cuda"),))
    rpc.shutdown()


def test_cuda_tensors_follow_the_device_map():
    run_workers(_cuda_both_ways, 2, timeout=150)


def where(t):
    return str(t.device)


def make_cuda(n):
    return torch.full((n,), 7.0, device="cuda")


def _to_cpu(rank, world_size, init_method):
    import ucxrpc as rpc

    # worker0's cuda:0 lands on worker1's CPU; worker1's replies come back on cuda:0
    _init(rank, world_size, init_method, {0: {"worker1": {0: "cpu"}}})
    if rank == 0:
        t = torch.arange(1000, dtype=torch.float32, device="cuda")
        assert rpc.rpc_sync("worker1", where, (t,)) == "cpu"
        assert torch.equal(rpc.rpc_sync("worker1", plus_one, (t,)).cpu(), t.cpu() + 1)
    rpc.shutdown()


def test_cuda_mapped_to_cpu():
    run_workers(_to_cpu, 2, timeout=150)


# Without UCX's CUDA transports, CUDA tensors must be staged through pinned
# host chunks; with them the pipe is GPU-direct.
STAGED = {"transports": ["sm", "tcp"]}


def path_stats():
    import ucxrpc as rpc

    info = rpc._get_debug_info()
    return {k: info[k] for k in ("staged_bytes", "packed_buffers")}


def _paths(rank, world_size, init_method, extra):
    import ucxrpc as rpc

    _init(rank, world_size, init_method, {0: {"worker1": {0: 0}}, 1: {"worker0": {0: 0}}},
          **extra)
    out = None
    if rank == 0:
        big = torch.randint(0, 255, ((9 << 20) + 1,), dtype=torch.uint8, device="cuda")
        back = rpc.rpc_sync("worker1", plus_one, (big,))
        assert back.device == torch.device("cuda:0") and torch.equal(back, big + 1)
        # a producer still running when the call goes, on the staged path too
        slow = torch.zeros(1 << 22, device="cuda")
        torch.cuda._sleep(100_000_000)
        slow.add_(2)
        assert rpc.rpc_sync("worker1", describe, (slow,))[2] == 2 * (1 << 22)
        # many small tensors of every dtype: packed, and cut apart on arrival
        many = [sample(name, n=17 + i).cuda() for i, name in enumerate(DTYPES * 10)]
        got = rpc.rpc_sync("worker1", echo, (many,))
        assert all(a.dtype == b.dtype and torch.equal(a, b) and b.is_cuda
                   for a, b in zip(many, got))
        assert len({t.data_ptr() for t in got}) == len(got)
        pipe = rpc.get_pipe_info("worker1")[0]
        out = {"path": pipe["cuda_path"], "transports": pipe["transports"],
               "device_path": rpc._get_debug_info()["device_path"],
               "mine": path_stats(), "theirs": rpc.rpc_sync("worker1", path_stats)}
    rpc.shutdown()
    return out


def echo(x):
    return x


# UCXRPC_DEVICE_PATH: device buffers through the direct libucp calls with
# their memory type (the default), or through ucxx's Array (kept to be
# measured against it: transport/ucx/binding.py, DEVICE_PATHS).
@pytest.mark.parametrize("extra, path, device_path", [({}, "gpu-direct", "ucp"),
                                                      ({}, "gpu-direct", "ucxx"),
                                                      (STAGED, "staged", "ucp")])
def test_gpu_direct_and_staged_paths(extra, path, device_path):
    res = run_workers(_paths, 2, args=(extra,), timeout=150,
                      env={"UCXRPC_DEVICE_PATH": device_path})[0]
    assert res["device_path"] == device_path, res
    assert res["path"] == path, res
    assert res["mine"]["packed_buffers"] >= 110 and res["theirs"]["packed_buffers"] >= 110, res
    if path == "staged":
        assert res["mine"]["staged_bytes"] >= 9 << 20, res
    else:
        assert res["mine"]["staged_bytes"] == 0, res
        # UCX's own lane, not only ucxrpc's label: without cuda_ipc, UCX
        # stages device memory through its own fragments
        assert "cuda_ipc" in res["transports"], res


def stream_facts(t):
    current = torch.cuda.current_stream()
    return current != torch.cuda.default_stream(), t.sum().item()


def slow_double(fut):
    """A ``then`` callback whose kernels are still queued when it returns."""
    x = fut.value()
    torch.cuda._sleep(SPIN)
    return x * 2


def _streams(rank, world_size, init_method):
    import ucxrpc as rpc

    _init(rank, world_size, init_method, {0: {"worker1": {0: 0}}})
    out = None
    if rank == 0:
        n = 1 << 20
        t = torch.ones(n, device="cuda")
        on_pool, total = rpc.rpc_sync("worker1", stream_facts, (t,))
        assert on_pool and total == n
        side = torch.cuda.Stream()
        # Every kernel below launched once first: with CUDA's lazy module
        # loading (the default), a kernel's first launch loads its module and
        # waits for the device, which would order the streams and keep the
        # control from racing (seen on an H100, 2026-11-26: the control's
        # first `x * 2` waited out the spin).  Its blocks hold 10s, not the
        # 4s the checks look for.
        warm = torch.futures.Future()
        warm.set_result(t * 5)
        warm.then(slow_double).wait().sum()
        torch.cuda.synchronize()
        # The control, before the checked chain (so that no block of 4s is
        # free for it to land in): on a plain future the callback's kernels
        # run on the current stream and nothing makes the side stream wait
        # for them, so the sum races the spin and comes out wrong.  If it
        # does not, this check could not fail either (CUDA_LAUNCH_BLOCKING
        # set, say).
        plain = torch.futures.Future()
        plain.set_result(t + 1)
        raced_chain = plain.then(slow_double)
        with torch.cuda.stream(side):
            raced = raced_chain.wait().sum()
        torch.cuda.synchronize()
        # The future knows its devices: its callback runs on streams that
        # wait for the value, the chained future records the callback's
        # work, and waiting for it on any stream waits for that work.
        chained = rpc.rpc_async("worker1", plus_one, (t,)).then(slow_double)
        with torch.cuda.stream(side):
            total = chained.wait().sum()
        # The sum ran on the side stream: .item() copies on the current one.
        torch.cuda.synchronize()
        out = {"raced": raced.item(), "total": total.item(), "n": n,
               "streams": (str(torch.cuda.current_stream()), str(side))}
    rpc.shutdown()
    return out


def test_callee_runs_on_pool_streams_and_futures_know_devices():
    res = run_workers(_streams, 2, timeout=150)[0]
    assert res["raced"] != 4 * res["n"], ("the control did not race: this check cannot "
                                          "fail here", res)
    assert res["total"] == 4 * res["n"], res


def fives(n):
    return torch.full((n,), 5.0, device="cuda")


def _fresh_thread(rank, world_size, init_method):
    import threading

    import ucxrpc as rpc

    _init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        got: list = []

        def call() -> None:  # a thread that never made a CUDA call of its own
            got.append(rpc.rpc_sync("worker1", plus_one, (t,)))
            got.append(rpc.rpc_async("worker1", plus_one, (t,)).wait())

        th = threading.Thread(target=call)
        th.start()
        th.join(60)
        out = [bool(torch.equal(g, t + 1)) for g in got]
    rpc.shutdown()
    return out


def test_a_thread_that_never_used_cuda_calls_with_device_tensors():
    # It waits for its reply by driving UCX itself (agent/core.py, _drive),
    # which needs a CUDA context on the thread: the transport lends it the
    # device's while it drives, where it has none (cudactx.Borrowed).
    assert run_workers(_fresh_thread, 2, timeout=150)[0] == [True, True]


def _current_context() -> int:
    """The CUDA context current on the calling thread (0: none), from the
    driver: torch's own answer would make one current to ask."""
    import ctypes

    ctx = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(ctx))
    return ctx.value or 0


def _context_device() -> int | None:
    """The device of the CUDA context current on the calling thread (None:
    none), from the driver."""
    import ctypes

    if not _current_context():
        return None
    dev = ctypes.c_int(-1)
    ctypes.CDLL("libcuda.so.1").cuCtxGetDevice(ctypes.byref(dev))
    return dev.value


def _host_arguments_cuda_reply(rank, world_size, init_method):
    import threading

    import ucxrpc as rpc
    from ucxrpc.transport.cuda.side import CudaSide

    _init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        seen: dict = {"drives": []}
        context = _current_context
        drive = CudaSide.drive

        def watched_drive(self, *args):
            # The transport's part ends here: what it lent must be taken
            # back before the reply is handed to torch's future.
            try:
                return drive(self, *args)
            finally:
                if threading.current_thread() is th:
                    seen["drives"].append(context())

        def call() -> None:
            # Host arguments only: nothing before the wait makes a CUDA call
            # on this thread (cuda_targets settles nothing), so the drive is
            # the first to need a context here.
            seen["before"] = context()
            got = rpc.rpc_sync("worker1", fives, (1 << 20,))
            # torch's CUDA future (as torch's agent's) makes the current
            # streams wait for the reply: CUDA's runtime binds the thread's
            # own device's primary context there, as any CUDA call would.
            # Its device must be the thread's, never the worker's.
            seen["after_device"] = _context_device()
            seen["ok"] = bool(torch.equal(got, torch.full((1 << 20,), 5.0, device="cuda")))
            seen["device"] = torch.cuda.current_device()

        CudaSide.drive = watched_drive
        th = threading.Thread(target=call)
        th.start()
        th.join(60)
        CudaSide.drive = drive
        out = seen
    rpc.shutdown()
    return out


def test_a_thread_with_host_arguments_gets_a_cuda_reply_and_is_left_as_found():
    # The first GPU run (an H200, 2026-11-29) found a context current after
    # the call: torch's future's wait had bound it, not the transport, whose
    # drive had popped what it pushed.  So the transport's part is checked
    # where it ends, and the rest by device.
    seen = run_workers(_host_arguments_cuda_reply, 2, timeout=150)[0]
    assert seen["before"] == 0 and seen["drives"], seen
    assert all(ctx == 0 for ctx in seen["drives"]), f"a drive left a context current: {seen}"
    assert seen["after_device"] in (None, 0) and seen["device"] == 0, seen
    assert seen["ok"], seen


def _init_on_a_fresh_thread(rank, world_size, init_method):
    import threading

    import ucxrpc as rpc

    seen: dict = {}
    context = _current_context

    def start() -> None:
        # This thread never used CUDA: the transport's start lends it the
        # device's context while UCX's worker opens (engine.py,
        # CudaSide.lent), and must take it back.
        seen["before"] = context()
        _init(rank, world_size, init_method, BOTH)
        seen["after"] = context()

    th = threading.Thread(target=start)
    th.start()
    th.join(60)
    # Device memory still moves (the progress thread has its own context).
    peer = f"worker{1 - rank}"
    seen["ok"] = bool(torch.equal(rpc.rpc_sync(peer, fives, (1 << 20,)),
                                  torch.full((1 << 20,), 5.0, device="cuda")))
    rpc.shutdown()
    return seen


def test_init_rpc_leaves_the_thread_that_called_it_as_it_found_it():
    # Issue 50 item 4, on init_rpc's own thread (the user's): before, the
    # transport made the device's context current there for good, so a
    # worker of devices=["cuda:1"] switched its user's torch device to 1.
    # On one GPU the switch cannot show; a context left current on a thread
    # that had none is the same fault.
    for seen in run_workers(_init_on_a_fresh_thread, 2, timeout=150):
        assert seen["before"] == 0, seen
        assert seen["after"] == 0, f"init_rpc left a CUDA context current on its thread: {seen}"
        assert seen["ok"], seen


def _receive_stream_and_pools(rank, world_size, init_method):
    import ucxrpc as rpc
    from ucxrpc.transport.cuda import side

    _init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        got = rpc.rpc_sync("worker1", fives, (1 << 20,))  # a device receive here
        assert torch.equal(got, torch.full((1 << 20,), 5.0, device="cuda"))
        ours = side._RECEIVE_ALLOCS[0][2].cuda_stream
        # Every stream torch's pools hand out (32 a priority, round-robin),
        # as user code draws them: twice around each.
        pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(64)}
        out = {"ours": ours, "pooled": len(pooled), "shared": ours in pooled,
               "current": ours == torch.cuda.current_stream().cuda_stream}
    rpc.shutdown()
    return out


def test_receives_are_allocated_on_a_stream_no_user_code_can_be_handed():
    # Finding 5 of the CUDA review: a stream drawn from torch's pool (as
    # torch.cuda.Stream() draws) is handed to user code too, whose kernels
    # on it would read a received tensor's block as freed.  Without this,
    # receives moved back to a pooled stream would fail nothing: the
    # freed-memory controls allocate on the current stream.
    got = run_workers(_receive_stream_and_pools, 2, timeout=150)[0]
    assert got["pooled"] >= 2 and not got["shared"] and not got["current"], got


def smallest(t):
    return t.min().item()


def _written_on_another_stream(rank, world_size, init_method, blocking):
    """x filled behind a spin on a stream other than the current one (the
    legacy default), then sent at once: the smallest value the callee saw,
    per round (7.0 when the send waited for the fill)."""
    import ctypes

    import ucxrpc as rpc

    _init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        if blocking:
            # A blocking stream (CU_STREAM_DEFAULT), as CuPy's streams are by
            # default: CUDA orders the legacy default stream after its work.
            # The driver makes it in the thread's current context: torch's
            # (init_rpc leaves the thread's as it found it: none yet).
            torch.cuda.init()
            torch.cuda.synchronize()
            lib, handle = ctypes.CDLL("libcuda.so.1"), ctypes.c_void_p()
            assert lib.cuStreamCreate(ctypes.byref(handle), 0) == 0
            other = torch.cuda.ExternalStream(handle.value)
        else:
            other = torch.cuda.Stream()  # non-blocking: no such order
        out = []
        for _ in range(3):
            x = torch.zeros(1 << 20, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.stream(other):
                torch.cuda._sleep(SPIN)
                x.fill_(7.0)
            out.append(rpc.rpc_sync("worker1", smallest, (x,)))
            torch.cuda.synchronize()
    rpc.shutdown()
    return out


def test_a_tensor_written_on_a_blocking_stream_is_sent_once_written():
    # The review's probe 7 (settle, _cuda.py): the current stream is the
    # legacy default, and the tensor was written on a blocking stream.
    # torch's agent recorded an event on the current stream, which the
    # legacy stream orders after the blocking stream's work; ucxrpc queries
    # and synchronizes that stream instead, with nothing queued on it.
    # Does that wait too?  Expect 7.0 each round.
    got = run_workers(_written_on_another_stream, 2, args=(True,), timeout=150)[0]
    assert got == [7.0, 7.0, 7.0], got


def test_control_a_tensor_written_on_a_non_blocking_stream_may_go_unwritten():
    # The control: a non-blocking stream has no order with the current one,
    # and nothing (here or in torch) waits for it: the race the test above
    # would show is observable.  Expect a 0.0 in some round.
    got = run_workers(_written_on_another_stream, 2, args=(False,), timeout=150)[0]
    assert 0.0 in got, f"the race did not show in {got}: the probe above proves nothing"


#: The ways a device tensor arrives (receive.py, cuda/staging.py): the UCX
#: options that make each, and the reply's shape (one tensor, or twelve of
#: 64 KiB, which travel as one pack: staging.PACK_MIN_COUNT).
FREED_WAYS = {
    "one buffer": ({}, None),
    "staged": (STAGED, None),
    "packed": ({}, 12),
    "packed, staged": (STAGED, 12),
}


def small_fives(count, n):
    return [torch.full((n,), 5.0, device="cuda") for _ in range(count)]


def _on_the_current_stream(nbytes, device):
    """The rule broken: a receive allocated on the thread's current stream,
    where a block the user just freed with work pending is handed out."""
    return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))


def _freed_rounds(count, rounds=3):
    """Free x (or xs) while ``x * 2`` is still queued behind a spin, then call
    for a reply of fives of the same size: (min and max of x * 2, min of
    the reply) per round; (6, 6, 5) unless the reply landed in x."""
    import ucxrpc as rpc

    n = 1 << 22 if count is None else 1 << 14
    results = []
    for _ in range(rounds):
        xs = [torch.full((n,), 3.0, device="cuda") for _ in range(count or 1)]
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN)
        ys = [x * 2 for x in xs]  # queued behind the spin: they still read xs
        del xs                    # their blocks go back to this stream's pool at once
        got = (rpc.rpc_sync("worker1", fives, (n,)) if count is None
               else rpc.rpc_sync("worker1", small_fives, (count, n)))
        got = [got] if count is None else got
        torch.cuda.synchronize()
        results.append((min(y.min().item() for y in ys), max(y.max().item() for y in ys),
                        min(g.min().item() for g in got)))
    return results


def _freed_with_work_pending(rank, world_size, init_method, way):
    import ucxrpc as rpc
    from ucxrpc.transport import engine

    extra, count = FREED_WAYS[way]
    _init(rank, world_size, init_method, BOTH, **extra)
    out = None
    if rank == 0:
        _freed_rounds(count, rounds=1)  # warm: the callee's kernels, both allocators
        # The control first, so that no block freed in the checked rounds is
        # left for it: receives allocated as the rule forbids.  If the reply
        # never lands in x here, the checked rounds could not fail either.
        kept = engine.cuda_alloc
        engine.cuda_alloc = _on_the_current_stream
        try:
            control = _freed_rounds(count)
        finally:
            engine.cuda_alloc = kept
        out = {"control": control, "checked": _freed_rounds(count),
               "paths": rpc.rpc_sync("worker1", path_stats)}  # the replies' sender
    rpc.shutdown()
    return out


@pytest.mark.parametrize("way", list(FREED_WAYS))
def test_a_receive_never_lands_in_memory_freed_with_work_pending(way):
    # torch's allocator gives a block freed on a stream to the next
    # allocation on that stream at once: the work queued on the stream is
    # ordered before whatever comes next on it.  UCX, and the staged and
    # packed copies, write on streams of their own, so a reply allocated on
    # the caller's stream could land in x while `x * 2` still reads it;
    # receives are allocated on a stream of the transport's own
    # (transport/cuda/side.py, _RECEIVE_ALLOCS), for every way a device
    # tensor arrives.
    res = run_workers(_freed_with_work_pending, 2, args=(way,), timeout=150)[0]
    staged, packed = FREED_WAYS[way][0] is STAGED, FREED_WAYS[way][1] is not None
    assert (res["paths"]["staged_bytes"] > 0) == staged, res  # the way it meant to test
    assert (res["paths"]["packed_buffers"] > 0) == packed, res
    assert res["control"] != [(6.0, 6.0, 5.0)] * 3, (
        "the control did not race: this check cannot fail here", res)
    assert res["checked"] == [(6.0, 6.0, 5.0)] * 3, res


# -- a peer killed in the middle of a device transfer -----------------------------

#: The victim's reply: large enough, over TCP, to be in flight when it dies.
KILLED_NBYTES = 512 << 20


def _victim(rank, world_size, init_method):
    import time

    _init(rank, world_size, init_method, {})
    time.sleep(120)  # killed long before this ends


def cuda_reply_then_die(nbytes, stamp):
    import threading

    from tests.faults import _common as c

    value = torch.full((nbytes // 4,), 7.0, device="cuda")
    torch.cuda.synchronize()
    threading.Timer(0.05, c.kill_self, args=(stamp,)).start()
    return value


def _survivor(rank, world_size, init_method, full_world, stamp):
    import gc
    import time

    import ucxrpc as rpc

    _init(rank, full_world, init_method, {0: {"worker1": {0: 0}}})
    assert torch.equal(rpc.rpc_sync("worker1", fives, (4,)), torch.full((4,), 5.0,
                                                                        device="cuda"))
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    try:
        rpc.rpc_sync("worker1", cuda_reply_then_die, (KILLED_NBYTES, stamp))
        outcome = "returned"  # the transfer was over before the kill: nothing to check
    except Exception as exc:  # the point: what the caller sees
        outcome = f"{type(exc).__name__}: {exc}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the loop lets go of the receive, then prunes it
        info = rpc._get_debug_info()
        gc.collect()
        # The decision is the loop's last: it moves at its next turn after
        # the receive is let go, so it is waited for too (a loop still
        # polling "data in flight" 10 s on would fail here).
        if not info["watched_requests"] and not info["retired_requests"] \
                and torch.cuda.memory_allocated() == base \
                and info["progress"]["poll_decision"] != "data in flight":
            break
        time.sleep(0.1)
    info = rpc._get_debug_info()
    out = {"outcome": outcome, "watched": info["watched_requests"],
           "retired": info["retired_requests"], "decision": info["progress"]["poll_decision"],
           "leaked": torch.cuda.memory_allocated() - base}
    rpc.shutdown()
    return out


def test_a_peer_killed_mid_device_transfer_leaves_nothing_posted_or_allocated(tmp_path):
    # Over TCP (cuda_copy staging the device memory through UCX's own
    # buffers) a 512 MiB reply is in flight for a while: the victim dies in
    # it, and the survivor's receive, posted into device memory, must be
    # let go, its memory freed, and the loop go quiet (transport/receive.py,
    # Receiver.abandon).
    from tests.workers import run_with_victim

    out = run_with_victim(_victim, _survivor, 2, args=(2, str(tmp_path / "stamp")),
                          timeout=150, env={"UCX_TLS": "tcp,cuda_copy"})[0]
    assert out["outcome"] != "returned", "the reply arrived before the kill: nothing was tested"
    assert "worker1" in out["outcome"] and "Error" in out["outcome"], out
    assert out["watched"] == 0 and out["retired"] == 0, out
    assert out["decision"] != "data in flight" and out["leaked"] == 0, out
