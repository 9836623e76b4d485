"""``ucxrpc bench`` across two hosts, one rank on each.

Launched by torchrun (or anything that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``), each host's ``ucxrpc bench`` becomes
that rank's coordinator: for every run it spawns one fresh child for its own
rank, exactly as a local run spawns two.

The coordinators talk through a c10d ``TCPStore`` at
``MASTER_ADDR:MASTER_PORT``: rank 0 hosts it, or, when torchrun's agent
already does (``TORCHELASTIC_USE_AGENT_STORE=True``), both are clients — the
same rule as torch's ``env://`` rendezvous. Keys, under one prefix:

``plan``           rank 0's runs, configuration, host and device (rank 1's
                   own options are ignored, so the two cannot disagree)
``hello/1``        rank 1's host and GPU index
``run<i>/init``    the RPC rendezvous of run ``i``: ``tcp://MASTER_ADDR:<port
                   free on rank 0>``, hosted by rank 0's child
``run<i>/raw/*``   the raw baseline's UCX worker addresses
``run<i>/error1``  rank 1's child failed (rank 0 stops waiting)
``run<i>/cpu1``    CPU seconds rank 1 used for run ``i`` (its coordinator
                   and child); with ``same_machine`` rank 0 does not count
                   them as other processes' (``--hosts netns``)
``run<i>/end``     rank 0's run is over: ``ok`` or ``failed``
``done``, ``bye``  the end, and rank 1's acknowledgement (rank 0 keeps the
                   store up until then)
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

from .._launch import free_port
from .launch import (ChildSpec, CpuMeter, ProgressFn, RunOutcome, StoreAddress, collect,
                     start_children, stop_children)
from .workload import WorkloadConfig

__all__ = ["HostEnv", "HostSession", "host_env", "local_device"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BYE_WAIT_S = 15.0
_CPU_WAIT_S = 5.0    # same machine: how long rank 0 waits for rank 1's CPU seconds


@dataclass(frozen=True)
class HostEnv:
    rank: int
    master_addr: str
    master_port: int
    local_rank: int
    agent_store: bool
    prefix: str


def host_env(environ: Mapping[str, str] = os.environ) -> HostEnv | None:
    """The launcher's settings, or ``None`` when not launched (no ``RANK`` and
    no ``WORLD_SIZE``).

    Raises:
        ValueError: some are set and some not, ``WORLD_SIZE`` is not 2, or a
            value is malformed; the message says which and what to do.
    """
    present = [k for k in _ENV if environ.get(k)]
    if not {"RANK", "WORLD_SIZE"} & set(present):
        return None
    missing = [k for k in _ENV if k not in present]
    if missing:
        raise ValueError(f"launched with {', '.join(present)} but without {', '.join(missing)}; "
                         "set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun does), "
                         "or pass --local to run both ranks on this host")
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        port = int(environ["MASTER_PORT"])
        local_rank = int(environ.get("LOCAL_RANK") or 0)
    except ValueError as exc:
        raise ValueError(f"malformed launcher variable: {exc}") from None
    if world != 2:
        raise ValueError(f"ucxrpc bench measures between exactly 2 ranks, but WORLD_SIZE={world}; "
                         "launch one process on each of two hosts (torchrun --nnodes 2 "
                         "--nproc-per-node 1)")
    if rank not in (0, 1):
        raise ValueError(f"RANK must be 0 or 1 with WORLD_SIZE=2, not {rank}")
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT must be a TCP port, not {port}")
    prefix = "ucxrpc-bench/{}/{}".format(environ.get("TORCHELASTIC_RUN_ID", "-"),
                                         environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return HostEnv(rank, environ["MASTER_ADDR"], port, local_rank,
                   environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True), prefix)


def _cuda_index(local_rank: int) -> int | None:
    """This rank's GPU: ``LOCAL_RANK`` modulo the GPUs visible, or ``None``."""
    import torch

    if not torch.cuda.is_available():
        return None
    return local_rank % torch.cuda.device_count()


def local_device(kind: str, local_rank: int) -> str:
    """``"cpu"``, or this rank's ``"cuda:N"``.

    Raises:
        RuntimeError: ``kind`` is ``"cuda"`` and no GPU is visible.
    """
    if kind == "cpu":
        return "cpu"
    index = _cuda_index(local_rank)
    if index is None:
        raise RuntimeError(f"--device cuda on {socket.gethostname()}, which has no usable CUDA "
                           "GPU (torch.cuda.is_available() is False)")
    return f"cuda:{index}"


def _device(rank0_device: str, hello: Mapping[str, Any], who: str) -> str:
    if rank0_device == "cpu":
        return "cpu"
    if hello.get("cuda") is None:
        raise RuntimeError(f"--device cuda, but {who} ({hello.get('host', '?')}) has no usable "
                           "CUDA GPU")
    return f"cuda:{hello['cuda']}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class HostSession:
    """One rank's coordinator; :meth:`close` is idempotent and always releases
    the store.

    ``same_machine``: both ranks share this machine's CPUs (two simulated
    hosts), so rank 0 tells rank 1's CPU time apart from other processes'.
    """

    def __init__(self, env: HostEnv, timeout_s: float, same_machine: bool = False) -> None:
        import torch.distributed as dist

        self.env = env
        self.same_machine = same_machine
        self._address = StoreAddress(env.master_addr, env.master_port, env.prefix)
        self._tcp = dist.TCPStore(env.master_addr, env.master_port, is_master=(
            env.rank == 0 and not env.agent_store), wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s))
        self.store = dist.PrefixStore(env.prefix, self._tcp)
        self.peer: dict[str, Any] = {}
        self._closed = False

    # --- small helpers over the store ------------------------------------

    def _get(self, key: str, deadline: float) -> str:
        remaining = max(0.1, deadline - time.monotonic())
        self.store.wait([key], timedelta(seconds=remaining))
        return bytes(self.store.get(key)).decode()

    def _where(self) -> str:
        return f"{self.env.master_addr}:{self.env.master_port}"

    def _peek(self, key: str) -> str | None:
        return bytes(self.store.get(key)).decode() if self.store.check([key]) else None

    # --- rank 0 --------------------------------------------------------------

    def publish(self, plan: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Rank 0: hand the plan to rank 1 and wait for its hello.

        ``plan["device"]`` is rank 0's device (``"cpu"``, ``"cuda:0"``).

        Raises:
            RuntimeError: the plan wants CUDA and rank 1 has no GPU.
        """
        self.store.set("plan", json.dumps(plan))
        try:
            hello = json.loads(self._get("hello/1", deadline))
        except RuntimeError as exc:   # c10d's store errors are RuntimeErrors
            raise RuntimeError(f"rank 1 did not join through {self._where()} in time "
                               f"(start ucxrpc bench there with RANK=1): {exc}") from exc
        self.peer = {"host": hello["host"], "device": _device(plan["device"], hello, "rank 1")}
        return self.peer

    def run(self, index: int, key: str, impl: str, cfg: WorkloadConfig, device: str,
            deadline: float, on_progress: ProgressFn | None = None) -> RunOutcome:
        """Rank 0: one run with this host's child against rank 1's."""
        import multiprocessing

        bind = "::" if ":" in self.env.master_addr else ""
        init = f"tcp://{_url_host(self.env.master_addr)}:{free_port(bind)}"
        self.store.set(f"run{index}/init", init)
        outcome = RunOutcome(key)

        def peer_failed() -> str | None:
            text = self._peek(f"run{index}/error1")
            return None if text is None else \
                f"on rank 1 ({self.peer.get('host', '?')}): {text}"

        results = multiprocessing.get_context("spawn").Queue()
        procs: list[Any] = []
        meter, start = CpuMeter(), time.monotonic()
        try:
            start_children(procs, [self._spec(impl, 0, init, cfg, device, index, deadline)],
                           [f"{key}-worker0"], results, [(None, None)])
            collect(outcome, procs, results, deadline, on_progress, peer_failed=peer_failed)
        finally:
            stop_children(procs, [results])
            self.store.set(f"run{index}/end", "ok" if outcome.error is None else "failed")
            outcome.wall_s = time.monotonic() - start
            outcome.cpu_others = meter.others(self._peer_cpu(index))
        return outcome

    def _peer_cpu(self, index: int) -> float:
        """Rank 1's CPU seconds for run ``index`` when it shares this machine
        (bounded wait; 0 when it did not say)."""
        if not self.same_machine:
            return 0.0
        try:
            return float(self._get(f"run{index}/cpu1", time.monotonic() + _CPU_WAIT_S))
        except (RuntimeError, ValueError):
            return 0.0

    # --- rank 1 --------------------------------------------------------------

    def join(self, deadline: float) -> dict[str, Any]:
        """Rank 1: say hello (host, CUDA device); return rank 0's plan, with
        ``plan["local_device"]`` set to this rank's device.

        Raises:
            RuntimeError: the plan wants CUDA and this host has no GPU.
        """
        mine = {"host": socket.gethostname(), "cuda": _cuda_index(self.env.local_rank)}
        self.store.set("hello/1", json.dumps(mine))
        try:
            plan: dict[str, Any] = json.loads(self._get("plan", deadline))
        except RuntimeError as exc:
            raise RuntimeError(f"rank 0 published no plan through {self._where()} in "
                               f"time: {exc}") from exc
        self.peer = {"host": plan.get("host"), "device": plan["device"]}
        plan["local_device"] = _device(plan["device"], mine, "this host")
        return plan

    def serve(self, index: int, key: str, impl: str, cfg: WorkloadConfig, device: str,
              deadline: float) -> RunOutcome:
        """Rank 1: this host's side of run ``index``."""
        import multiprocessing

        init = self._get(f"run{index}/init", deadline)
        outcome = RunOutcome(key)

        def peer_failed() -> str | None:
            return "rank 0's side of the run failed" \
                if self._peek(f"run{index}/end") == "failed" else None

        results = multiprocessing.get_context("spawn").Queue()
        procs: list[Any] = []
        start, cpu = time.monotonic(), CpuMeter.own()
        try:
            start_children(procs, [self._spec(impl, 1, init, cfg, device, index, deadline)],
                           [f"{key}-worker1"], results, [(None, None)])
            collect(outcome, procs, results, deadline, want_result=False,
                    peer_failed=peer_failed)
        finally:
            stop_children(procs, [results])
            if outcome.error is not None:
                self.store.set(f"run{index}/error1", outcome.error)
            self.store.set(f"run{index}/cpu1", repr(CpuMeter.own() - cpu))
            outcome.wall_s = time.monotonic() - start
        return outcome

    def _spec(self, impl: str, rank: int, init: str, cfg: WorkloadConfig, device: str,
              index: int, deadline: float) -> ChildSpec:
        peer_device = self.peer.get("device", device)
        wall = time.time() + (deadline - time.monotonic())
        return ChildSpec(impl, rank, init, cfg, device, peer_device, os.getpid(), wall,
                         self._address, f"run{index}")

    # --- both ------------------------------------------------------------------

    def close(self, deadline: float) -> None:
        """Rank 0 announces the end and waits (bounded) for rank 1's goodbye;
        rank 1 waits for the end and says goodbye. Never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.env.rank == 0:
                self.store.set("done", "1")
                self._get("bye", min(deadline, time.monotonic() + _BYE_WAIT_S))
            else:
                self._get("done", deadline)
                self.store.set("bye", "1")
        except Exception:   # the other side is gone: nothing left to coordinate
            pass
        finally:
            del self.store, self._tcp
