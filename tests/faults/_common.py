"""What the fault tests share: worker set-up, callees, failure records, bounds.

Each fault test runs real processes; this module is imported by those
children (spawned by :mod:`tests.workers` or started inside a network
namespace), so it imports only the standard library at module level.

A *failure record* is what a worker saw when a call failed, as plain data
that pickles back to the test: the exception's type, its classes, message,
and the seconds from the moment of the fault to the error.  Timestamps are
``time.monotonic()``, which on Linux is one clock for every process on the
machine, so a fault caused in one process is timed in another.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

#: Short, so the partition tests are fast: seconds a peer's host may leave
#: TCP keepalive unanswered before it is declared unreachable.
PEER_TIMEOUT = 2.0
#: Far above every bound below: a call that fails before this failed because
#: its peer was detected as gone, not because the call ran out of time.
RPC_TIMEOUT = 60.0
#: A killed peer's calls fail within this (the issue's promise, kept on a
#: loaded 2-core machine too): its kernel closes its lifeline at once.
FAIL_BOUND_S = 1.0
#: A partition is seen by TCP keepalive: PEER_TIMEOUT, plus the first
#: probe's idle time, plus margin for a loaded machine.
PARTITION_BOUND_S = PEER_TIMEOUT + 10.0
#: A survivor's graceful shutdown: nothing to wait for but live workers.
SHUTDOWN_BOUND_S = 10.0

WORLD = 3
VICTIM = "worker2"      # run_with_victim makes the last rank the victim
THIRD = "worker1"       # a worker the fault should not affect


def report(path: Path, run: Callable[[], dict[str, Any]]) -> int:
    """A worker's ``main``: SIGUSR1 dumps every thread's stack to its log;
    what ``run()`` returns, or the exception it raised as text (reported to
    the test, not lost in a log), goes to ``path`` as JSON, written at once
    (a reader never sees half of it).  Returns the exit status."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        out = run()
    except BaseException as exc:
        out = {"error": "".join(traceback.format_exception(exc))}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)
    return 0


def init(rank: int, world_size: int, init_method: str, **options: Any) -> None:
    """``init_rpc`` as ``worker{rank}`` with the fault tests' options."""
    import ucxrpc as rpc

    opts = {"peer_timeout": PEER_TIMEOUT, "rpc_timeout": RPC_TIMEOUT, **options}
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method, **opts))


def victim_main(rank: int, world_size: int, init_method: str) -> None:
    """The victim: joins, then serves until the test kills or stops it."""
    import ucxrpc as rpc

    init(rank, world_size, init_method)
    time.sleep(120)  # killed long before this ends
    rpc.shutdown()


_go = threading.Event()


def go() -> None:
    """Called by RPC: let this worker's :func:`wait_for_go` return."""
    _go.set()


def wait_for_go(timeout: float = 60.0) -> None:
    """Wait until a peer called :func:`go` (the test's steps are over), so
    the time a shutdown takes is its own and not spent waiting for them."""
    if not _go.wait(timeout):
        raise TimeoutError(f"nobody called go() within {timeout} s")


def check_third(nbytes: int) -> None:
    """The pipe to the worker the fault should not affect still carries small
    calls and a tensor of ``nbytes``."""
    import torch

    import ucxrpc as rpc

    assert rpc.rpc_sync(THIRD, add, args=(2, 3)) == 5
    t = torch.arange(nbytes // 4, dtype=torch.float32)
    assert torch.equal(rpc.rpc_sync(THIRD, echo, args=(t,)), t)


def finish(rank: int, out: dict[str, Any], go_file: str | None = None) -> dict[str, Any]:
    """A survivor's last step: worker0, its checks done, releases the third
    worker (by RPC, or by creating ``go_file`` where worker0 may have lost
    its pipes); both then shut down, timed."""
    import ucxrpc as rpc

    if go_file is not None:
        if rank == 0:
            open(go_file, "w").close()
        else:
            deadline = time.monotonic() + 60.0
            while not os.path.exists(go_file):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker0 did not create {go_file} within 60 s")
                time.sleep(0.05)
    elif rank == 0:
        rpc.rpc_sync(THIRD, go)
    else:
        wait_for_go()
    out["shutdown_s"] = timed_shutdown()
    return out


def timed_shutdown() -> float:
    """Graceful ``rpc.shutdown()``; returns how long it took."""
    import ucxrpc as rpc

    t0 = time.monotonic()
    rpc.shutdown()
    return time.monotonic() - t0


# -- callees ------------------------------------------------------------------

def add(a: Any, b: Any) -> Any:
    return a + b


def echo(x: Any) -> Any:
    return x


def pid() -> int:
    return os.getpid()


def kill_self(stamp_path: str) -> None:
    """Write the time to ``stamp_path``, then SIGKILL this process."""
    with open(stamp_path, "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never returns: no answer may leave for the caller


def kill_self_after(seconds: float, stamp_path: str) -> None:
    """Sleep, then :func:`kill_self` (a call that dies while its caller waits)."""
    time.sleep(seconds)
    kill_self(stamp_path)


def read_stamp(stamp_path: str) -> float:
    """The time :func:`kill_self` wrote."""
    with open(stamp_path) as f:
        return float(f.read())


def stop_self() -> None:
    """SIGSTOP this process from inside a call: it never answers.

    Sent to this thread, not the process: a process-directed SIGSTOP may be
    taken by another thread, and until the stop reaches this one it could
    still send its answer (into shared memory, no system call needed).
    """
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    time.sleep(60)  # never returns, even if continued


def debug_info() -> dict[str, Any]:
    import ucxrpc as rpc

    return rpc._get_debug_info()


# -- failure records ------------------------------------------------------------

def failure(since: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call ``fn``; describe the exception it raises, timed from ``since``.

    A call that returns is recorded too (``"type": None``), so the test
    reports what came back instead of a traceback from here.
    """
    try:
        value = fn(*args, **kwargs)
    except Exception as exc:  # the point: record whatever the user would see
        return {"type": type(exc).__name__,
                "classes": [c.__name__ for c in type(exc).__mro__],
                "message": str(exc).split("\n", 1)[0],
                "elapsed": time.monotonic() - since}
    return {"type": None, "value": repr(value)[:200], "elapsed": time.monotonic() - since}


def check_failure(rec: dict[str, Any], peer: str, what: str,
                  bound: float = FAIL_BOUND_S) -> None:
    """Assert ``rec`` is an RPC error (a RuntimeError) naming ``peer``, in time,
    and not the call's own timeout; print it for the reliability notes."""
    print(f"  {what}: {rec.get('type')} after {rec['elapsed']:.2f} s: {rec.get('message', rec)}")
    assert rec["type"] is not None, f"{what}: expected an error, the call returned {rec}"
    assert "RuntimeError" in rec["classes"], f"{what}: not a RuntimeError: {rec}"
    assert re.search(rf"\b{re.escape(peer)}\b", rec["message"]), \
        f"{what}: the error does not name {peer}: {rec}"
    assert "timed out" not in rec["message"] and "RpcTimeoutError" not in rec["classes"], \
        f"{what}: failed by its own timeout ({RPC_TIMEOUT} s), not by detecting {peer}: {rec}"
    assert rec["elapsed"] < bound, f"{what}: took {rec['elapsed']:.1f} s (bound {bound} s): {rec}"


def check_shutdown(seconds: float, who: str) -> None:
    print(f"  {who} shutdown: {seconds:.2f} s")
    assert seconds < SHUTDOWN_BOUND_S, f"{who}: graceful shutdown took {seconds:.1f} s"
