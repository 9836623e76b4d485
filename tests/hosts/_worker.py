"""One worker of the two-host tier, run on a simulated host.

``python -m tests.hosts._worker CTL MODE RANK INIT_METHOD``
(:mod:`tests.hosts._harness` starts it inside the host's namespaces, with
``UCX_NET_DEVICES`` naming the host's veth).  It joins as ``worker<RANK>``
over TCP only (``transports=["tcp"]``); worker0 hosts the store.  It talks
to the test through files in the directory ``CTL`` and ends by writing
``worker<RANK>.json`` (what it saw, as plain data, or ``{"error": ...}``).
Modes:

``pair``   worker0 runs every scenario of :data:`SCENARIOS` against
           worker1, in turn, each writing ``scenario-<name>.json`` whether it
           passed or not (one failing does not hide the others); then it
           releases worker1 and both shut down.
``kill``   worker0 survives, worker1 and worker2 are SIGKILLed by the test:
           worker1 while worker0's call to it runs (the test waits for
           ``busy1``, kills, writes ``killed1`` with the time), worker2 idle
           (worker0 writes ``idle``; the test kills it and writes ``killed2``).
           worker0 records each failure, timed from the kill, and checks
           that worker2 still served it after worker1 died.

Every wait has a deadline, so a worker the test forgets still ends; SIGUSR1
dumps every thread's stack to the log.  The checks of a scenario run here,
where the tensors are; what the test asserts comes back in the JSON.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tests.faults import _common as c

#: No step of a worker takes longer than this.
STEP_TIMEOUT_S = 60.0
MODES = ("pair", "kill")
#: rpc_timeout in mode "pair": far below the test's wait for a scenario.
PAIR_RPC_TIMEOUT_S = 20.0
PEER = "worker1"
#: Tensor sizes sent both ways, in bytes (float32): empty to 64 MiB.
SIZES = (0, 4, 4 << 10, 1 << 20, 16 << 20, 64 << 20)


def write(path: Path, text: str) -> None:
    """Write ``path`` at once (a reader never sees it half written)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_file(path: Path, timeout: float = STEP_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)
    return path.read_text()


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# -- callees (both workers import this module) ------------------------------------

def echo(x: Any) -> Any:
    return x


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` of float32 that only ``seed`` decides."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(nbytes // 4, generator=g)


def check_and_return(t: torch.Tensor, seed: int) -> torch.Tensor:
    """The callee checks what came, then sends back a fresh tensor of the same size."""
    if not torch.equal(t, pattern(t.numel() * 4, seed)):
        raise AssertionError(f"{t.numel() * 4} bytes arrived altered")
    return pattern(t.numel() * 4, seed + 1)


def fail_with(kind: str, message: str) -> None:
    raise {"ValueError": ValueError, "KeyError": KeyError, "TypeError": TypeError}[kind](message)


def pipes() -> list[dict[str, Any]]:
    import ucxrpc as rpc

    return rpc.get_pipe_info()


def whoami() -> dict[str, Any]:
    import socket

    return {"hostname": socket.gethostname(), "pid": os.getpid(),
            "netns": os.readlink("/proc/self/ns/net"), "ipc": os.readlink("/proc/self/ns/ipc"),
            "veth": os.environ.get("UCX_NET_DEVICES")}


def calls_to(peer: str) -> dict[str, Any]:
    """rpc_sync, rpc_async, remote and tensors of every size to ``peer``;
    run on either worker, so the other one's calls cross the link too."""
    import ucxrpc as rpc

    out: dict[str, Any] = {"rpc_sync": rpc.rpc_sync(peer, c.add, args=(2, 3)),
                           "rpc_async": rpc.rpc_async(peer, c.add, args=(4, 5)).wait(),
                           "remote": rpc.remote(peer, c.add, args=(6, 7)).to_here()}
    for i, nbytes in enumerate(SIZES):
        seed = 10 * i
        sent = pattern(nbytes, seed)
        assert torch.equal(rpc.rpc_sync(peer, echo, args=(sent,)), sent), f"echo of {nbytes} B"
        back = rpc.rpc_async(peer, check_and_return, args=(sent, seed)).wait()
        assert torch.equal(back, pattern(nbytes, seed + 1)), f"reply of {nbytes} B"
    out["sizes"] = list(SIZES)
    errors = {}
    for kind in ("ValueError", "KeyError"):
        try:
            rpc.rpc_sync(peer, fail_with, args=(kind, f"raised on {peer}"))
        except Exception as exc:  # the point: what the caller sees
            errors[kind] = {"type": type(exc).__name__, "message": str(exc)}
    try:
        rpc.rpc_async(peer, fail_with, args=("TypeError", "async")).wait()
    except Exception as exc:
        errors["async TypeError"] = {"type": type(exc).__name__, "message": str(exc)}
    out["errors"] = errors
    return out


class Counter:
    def __init__(self, value: int) -> None:
        self.value = value

    def add(self, n: int) -> int:
        self.value += n
        return self.value


def use_rref(rref: Any, n: int) -> dict[str, Any]:
    """Use an RRef received from the other worker: its proxy and to_here()."""
    return {"owner": rref.owner_name(), "added": rref.rpc_sync().add(n),
            "value": rref.to_here().value}


def make_rref(value: int) -> Any:
    """A remote() on the other worker, returned to the caller."""
    import ucxrpc as rpc

    caller = "worker0" if rpc.get_worker_info().name == "worker1" else "worker1"
    return rpc.remote(caller, Counter, args=(value,))


def debug_counts() -> dict[str, int]:
    import ucxrpc as rpc

    gc.collect()
    info = rpc._get_debug_info()
    return {k: info.get(k, 0) for k in ("num_owner_rrefs", "num_forks", "num_pending_users")}


class Stage(nn.Module):
    """A layer whose initial weights depend only on ``seed`` (float64)."""

    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(d_in, d_out, dtype=torch.float64)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(d_out, d_in, generator=g, dtype=torch.float64) * 0.3)
            self.fc.bias.copy_(torch.randn(d_out, generator=g, dtype=torch.float64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


_stages: dict[str, Stage] = {}


def stage(name: str, *args: int) -> Stage:
    """This worker's stage ``name``, made on first use."""
    if name not in _stages:
        _stages[name] = Stage(*args)
    return _stages[name]


def stage_params(name: str) -> list[Any]:
    import ucxrpc as rpc

    return [rpc.RRef(p) for p in _stages[name].parameters()]


def stage_grads(name: str, context_id: int) -> list[torch.Tensor]:
    import ucxrpc.autograd as dist_autograd

    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in _stages[name].parameters()]


def first_then_back(x: torch.Tensor) -> torch.Tensor:
    """On worker1: stage s1, then worker0's stage s2 (a call back across the link)."""
    import ucxrpc as rpc

    h = stage("s1", 4, 8, 1)(x)
    return rpc.rpc_sync("worker0", second, args=(h,))


def second(h: torch.Tensor) -> torch.Tensor:
    return stage("s2", 8, 6, 2)(h)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(16, 4, generator=g, dtype=torch.float64),
            torch.randn(16, 1, generator=g, dtype=torch.float64))


# -- worker0's scenarios in mode "pair" ---------------------------------------

def scenario_rpc() -> dict[str, Any]:
    """Calls and tensors both ways, remote errors, the transport."""
    import ucxrpc as rpc

    out = {"from0": calls_to(PEER),
           "from1": rpc.rpc_sync(PEER, calls_to, args=("worker0",)),
           "pipes0": pipes(), "pipes1": rpc.rpc_sync(PEER, pipes),
           "who0": whoami(), "who1": rpc.rpc_sync(PEER, whoami)}
    return out


def scenario_rref() -> dict[str, Any]:
    """remote(), to_here(), proxies, RRefs passed both ways and used there."""
    import ucxrpc as rpc

    out: dict[str, Any] = {}
    theirs = rpc.remote(PEER, Counter, args=(10,))
    out["owner"] = theirs.owner_name()
    out["proxy_sync"] = theirs.rpc_sync().add(1)
    out["proxy_async"] = theirs.rpc_async().add(2).wait()
    out["proxy_remote"] = theirs.remote().add(3).to_here()
    out["to_here"] = theirs.to_here().value
    # Ours, passed to worker1 (a fork there) and used from there, through us.
    ours = rpc.RRef(Counter(100))
    out["ours_used_there"] = rpc.rpc_sync(PEER, use_rref, args=(ours, 5))
    out["ours_after"] = ours.local_value().value
    # Theirs passed back to its owner, and one worker1 made on us.
    out["theirs_on_owner"] = rpc.rpc_sync(PEER, use_rref, args=(theirs, 1))
    mine = rpc.rpc_sync(PEER, make_rref, args=(42,))
    out["made_for_us"] = {"owner": mine.owner_name(), "is_owner": mine.is_owner(),
                          "value": mine.to_here().value}
    out["during"] = {"worker0": debug_counts(), "worker1": rpc.rpc_sync(PEER, debug_counts)}
    del theirs, ours, mine
    gc.collect()
    counts = {}

    def empty() -> bool:
        counts.update(worker0=debug_counts(), worker1=rpc.rpc_sync(PEER, debug_counts))
        return all(not any(v.values()) for v in counts.values())

    wait_until(empty, timeout=15.0)
    out["after"] = counts
    return out


def _reference(steps: int) -> tuple[list[float], list[list[torch.Tensor]], list[torch.Tensor]]:
    """The same model trained in this process: losses, each step's
    gradients (s1, s2, head) and the final parameters."""
    x, y = _data()
    stages = [Stage(4, 8, 1), Stage(8, 6, 2), Stage(6, 1, 3)]
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        out = x
        for s in stages:
            out = s(out)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        grads.append([p.grad.clone() for p in params])
        opt.step()
        losses.append(loss.item())
    return losses, grads, [p.detach() for p in params]


def scenario_autograd() -> dict[str, Any]:
    """A model split across the hosts (s1 on worker1, s2 and the head here,
    worker1 calling s2 back), trained by DistributedOptimizer; losses,
    gradients and parameters against the same training done locally."""
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.optim import DistributedOptimizer

    steps = 3
    x, y = _data()
    rpc.rpc_sync(PEER, stage, args=("s1", 4, 8, 1))
    stage("s2", 8, 6, 2)
    head = Stage(6, 1, 3)
    params = (rpc.rpc_sync(PEER, stage_params, args=("s1",)) + stage_params("s2")
              + [rpc.RRef(p) for p in head.parameters()])
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05, momentum=0.9)
    losses, grads = [], []
    for _ in range(steps):
        with dist_autograd.context() as ctx:
            loss = ((head(rpc.rpc_sync(PEER, first_then_back, args=(x,))) - y) ** 2).mean()
            dist_autograd.backward(ctx, [loss])
            local = dist_autograd.get_gradients(ctx)
            grads.append(rpc.rpc_sync(PEER, stage_grads, args=("s1", ctx))
                         + stage_grads("s2", ctx) + [local[p] for p in head.parameters()])
            opt.step(ctx)
            losses.append(loss.item())
    want_losses, want_grads, want_params = _reference(steps)
    got_params = [p.to_here() for p in params]
    grad_diff = max((g - w).abs().max().item()
                    for step_g, step_w in zip(grads, want_grads) for g, w in zip(step_g, step_w))
    param_diff = max((g - w).abs().max().item() for g, w in zip(got_params, want_params))
    return {"losses": losses, "want_losses": want_losses, "grad_diff": grad_diff,
            "param_diff": param_diff, "no_local_grad": all(p.grad is None for p in head.parameters()),
            "n_params": len(got_params)}


class Net(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(d_in, d_out, dtype=torch.float64)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * scale


def scenario_remote_module() -> dict[str, Any]:
    """A RemoteModule on worker1: forward, backward, an optimizer step, each
    against the same module here."""
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.nn import RemoteModule
    from ucxrpc.optim import DistributedOptimizer

    x, y = _data()
    y = y.expand(16, 3)
    rm = RemoteModule(f"{PEER}/cpu", Net, args=(4,), kwargs={"d_out": 3})
    local = Net(4, 3)
    ref_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    opt = DistributedOptimizer(torch.optim.SGD, rm.remote_parameters(), lr=0.1)
    out: dict[str, Any] = {"on": rm.on.name, "forward_diff": (rm(x, scale=2.0) - local(x, 2.0))
                           .abs().max().item(), "losses": [], "want_losses": []}
    for _ in range(2):
        with dist_autograd.context() as ctx:
            loss = ((rm(x) - y) ** 2).mean()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        ref_opt.zero_grad()
        want = ((local(x) - y) ** 2).mean()
        want.backward()
        ref_opt.step()
        out["losses"].append(loss.item())
        out["want_losses"].append(want.item())
    got = [p.to_here() for p in rm.remote_parameters()]
    out["param_diff"] = max((g - w).abs().max().item()
                            for g, w in zip(got, local.parameters()))
    out["forward_async_diff"] = (rm.forward_async(x).wait() - local(x)).abs().max().item()
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "rpc": scenario_rpc, "rref": scenario_rref, "autograd": scenario_autograd,
    "remote_module": scenario_remote_module,
}


def run_pair(ctl: Path, rank: int, init_method: str) -> dict[str, Any]:
    import ucxrpc as rpc

    # Every call here takes well under a second: a call that hangs fails its
    # scenario in PAIR_RPC_TIMEOUT_S, and the next scenarios still run.
    c.init(rank, 2, init_method, transports=["tcp"], rpc_timeout=PAIR_RPC_TIMEOUT_S)
    if rank == 1:
        c.wait_for_go(timeout=240.0)  # worker0's scenarios
        return {"shutdown_s": c.timed_shutdown()}
    for name, scenario in SCENARIOS.items():
        try:
            out = scenario()
        except BaseException as exc:  # reported to its test, the next scenarios still run
            out = {"error": "".join(traceback.format_exception(exc))}
        write(ctl / f"scenario-{name}.json", json.dumps(out))
    rpc.rpc_sync(PEER, c.go)
    return {"shutdown_s": c.timed_shutdown()}


# -- mode "kill" ---------------------------------------------------------------

def block(busy_path: str) -> None:
    """On a victim: say it runs, then never return (the test kills us)."""
    write(Path(busy_path), "1")
    time.sleep(STEP_TIMEOUT_S)


def _failure_since_kill(ctl: Path, victim: str, fn: Callable[[], Any]) -> dict[str, Any]:
    """:func:`c.failure` of ``fn``, timed from the test's kill of ``victim``
    (the time it wrote to ``killed<n>``, read once the call ended)."""
    rec = c.failure(0.0, fn)
    ended = rec.pop("elapsed")
    killed = float(wait_file(ctl / f"killed{victim[-1]}"))
    rec["elapsed"] = ended - killed
    return rec


def run_kill(ctl: Path, rank: int, init_method: str) -> dict[str, Any]:
    import ucxrpc as rpc

    c.init(rank, 3, init_method, transports=["tcp"])
    if rank != 0:
        time.sleep(STEP_TIMEOUT_S * 2)  # served until killed
        raise RuntimeError("not killed in time")
    out: dict[str, Any] = {}
    for peer in ("worker1", "worker2"):
        assert rpc.rpc_sync(peer, c.add, args=(1, 1)) == 2
    out["pipes"] = pipes()
    # worker1 killed while our call runs on it.
    fut = rpc.rpc_async("worker1", block, args=(str(ctl / "busy1"),))
    out["pending"] = _failure_since_kill(ctl, "worker1", fut.wait)
    out["pending"]["classes_ok"] = "BrokenError" in out["pending"]["classes"]
    out["later1"] = c.failure(time.monotonic(), rpc.rpc_sync, "worker1", c.add, args=(1, 2))
    # worker2, on the same host as the one that died, still serves us both ways.
    t = torch.arange(4 << 20, dtype=torch.float32)
    out["third_ok"] = (rpc.rpc_sync("worker2", c.add, args=(2, 3)) == 5
                       and torch.equal(rpc.rpc_sync("worker2", echo, args=(t,)), t)
                       and rpc.rpc_sync("worker2", calls_to_self_add) == 7)
    out["after_third1"] = c.failure(time.monotonic(), rpc.rpc_sync, "worker1", c.add, args=(1, 2))
    # worker2 killed while idle: our next call fails, naming it.
    write(ctl / "idle", "1")
    killed2 = float(wait_file(ctl / "killed2"))
    out["idle"] = c.failure(killed2, rpc.rpc_sync, "worker2", c.add, args=(1, 2))
    out["later2"] = c.failure(time.monotonic(), rpc.rpc_sync, "worker2", c.add, args=(1, 2))
    out["shutdown_s"] = c.timed_shutdown()
    return out


def calls_to_self_add() -> int:
    """On worker2: a call back to worker0."""
    import ucxrpc as rpc

    return rpc.rpc_sync("worker0", c.add, args=(3, 4))


def main(argv: list[str]) -> int:
    ctl, mode, rank, init_method = Path(argv[1]), argv[2], int(argv[3]), argv[4]
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, got {mode!r}")
    run = run_pair if mode == "pair" else run_kill
    return c.report(ctl / f"worker{rank}.json", lambda: run(ctl, rank, init_method))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
