#!/usr/bin/env python
"""Where a no-op ``rpc_sync``'s wall time goes, stage by stage, on both sides.

Two processes on this host; rank 0 calls ``rpc_sync(noop)`` ``--calls``
times after a warm-up.  Both stamp ``time.perf_counter_ns()`` (the same
CLOCK_MONOTONIC in every process of a host) at the seams of one call:

    caller  rpc_sync entered            (the loop, around the call)
    caller  call pickled                Serializer.dumps_plain returned (a
                                        plain call), else RpcAgent.dumps_for
    caller  request frame sent          Endpoint.send_frame entered (libucp's
                                        send, which the C send calls)
    callee  frame taken off UCX         Receiver.taken entered (a turn's take or
                                        a driver's spin took frames; the
                                        native core's Inlet.taken)
    callee  message to the agent        RpcAgent._on_message entered (from the
                                        Inlet, which decodes and checks it)
    callee  request claimed             WorkerPool.submit entered (by the pool
                                        thread driving, usually)
    callee  its drive over              RpcAgent._drive returned
    callee  request served              Server._serve entered (a pool thread)
    callee  user function               noop entered
    callee  reply made                  Server._reply entered
    callee  reply frame sent            Endpoint.send_frame entered
    caller  frame taken, handled, to the agent (as the callee's)
    caller  reply unpickled             the agent's plain loads returned (a
                                        waited call's value then goes to its slot)
    caller  its drive over              Transport.drive returned on the main
                                        thread (a user's thread drives inline)
    caller  rpc_sync returned

and prints, per stage (the time from one seam to the next), p10 / p50 /
p90 in µs over the calls whose every seam was seen in order.  Each seam is a
wrapper of a method (about 0.5-1 µs each on the project's VM, so the total
is ~10 µs over an unwrapped call's): compare stages with one another and
runs of one tree with another, not the total with ``ucxrpc bench``'s
no-op.  "wire + detect" is UCX's latency plus the waiting side's detection
(its native spin, which takes the frame, or a loop turn): the stage a faster
poll could shorten.  The profile before an optimisation, as docs/style.md
asks; ``calls_per_rpc.py`` counts the calls, this times them.

With ``--payload`` the call echoes a payload instead (``dict``: the
bench's dict echo, 100 tensors of 4 KiB; or one tensor's size, ``1M``):
where its frames carry buffers that the receiver's Python takes in (one
sent apart through UCX, 64-256 KiB on a quiet host, or one of 8 MiB or
more), the table has that path's seams instead (the receiver's frame
decoded, its buffers in and the message delivered, the request and reply
pickled and unpickled on both sides); a payload that travels inside the
pickle stream (8 KiB or less), inside its frame, or by address below 8
MiB is taken in by the native core and has the no-op's seams (the dict's
400 KiB bundle among them since Run BF).  Where a message with buffers
spends its time, as Run BD read it.

    python benchmarks/stages.py                  # 3,000 calls, a table
    python benchmarks/stages.py --calls 500 --json stages.json
    python benchmarks/stages.py --payload dict --calls 1000
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ucxrpc._launch import free_port, start  # noqa: E402  (after the path)

_ns = time.perf_counter_ns
#: seam name -> stamps (ns), in this process.
_STAMPS: dict[str, list[int]] = {k: [] for k in (
    "pickled", "take", "message", "claim", "drove", "serve", "user", "reply", "send",
    "complete", "decoded", "deliver")}

#: (label, from seam, to seam, side of each seam): the table's rows, in
#: the order a call passes them.  Sides: "c" caller, "e" callee.
STAGES = (
    ("caller: rpc_sync -> call pickled", ("c", "start"), ("c", "pickled")),
    ("caller: pickled -> request frame sent", ("c", "pickled"), ("c", "send")),
    ("wire + callee detects the frame", ("c", "send"), ("e", "take")),
    ("callee: take -> agent's _on_message", ("e", "take"), ("e", "message")),
    ("callee: _on_message -> request claimed", ("e", "message"), ("e", "claim")),
    ("callee: claimed -> its drive over", ("e", "claim"), ("e", "drove")),
    ("callee: drive over -> _serve (pool)", ("e", "drove"), ("e", "serve")),
    ("callee: _serve -> user function", ("e", "serve"), ("e", "user")),
    ("callee: user function -> _reply", ("e", "user"), ("e", "reply")),
    ("callee: _reply -> reply frame sent", ("e", "reply"), ("e", "send")),
    ("wire + caller detects the reply", ("e", "send"), ("c", "take")),
    ("caller: take -> agent's _on_message", ("c", "take"), ("c", "message")),
    ("caller: _on_message -> reply unpickled", ("c", "message"), ("c", "complete")),
    ("caller: unpickled -> its drive over", ("c", "complete"), ("c", "drove")),
    ("caller: drive over -> rpc_sync returned", ("c", "drove"), ("c", "end")),
)

#: The stages of a call carrying a payload (``--payload``), echoed back:
#: its frames have buffers, so they pass the receiver's Python path (the
#: frame decoded, its buffers received, the message delivered), and the
#: callee pickles its reply.  Up to the callee's take, a no-op's.
PAYLOAD_STAGES = STAGES[:3] + (
    ("callee: take -> frame decoded", ("e", "take"), ("e", "decoded")),
    ("callee: decoded -> buffers in, delivered", ("e", "decoded"), ("e", "deliver")),
    ("callee: delivered -> agent's _on_message", ("e", "deliver"), ("e", "message")),
    ("callee: _on_message -> _serve (pool)", ("e", "message"), ("e", "serve")),
    ("callee: _serve -> request unpickled", ("e", "serve"), ("e", "complete")),
    ("callee: unpickled -> user function", ("e", "complete"), ("e", "user")),
    ("callee: user function -> _reply", ("e", "user"), ("e", "reply")),
    ("callee: _reply -> reply pickled", ("e", "reply"), ("e", "pickled")),
    ("callee: pickled -> reply frame sent", ("e", "pickled"), ("e", "send")),
    ("wire + caller detects the reply", ("e", "send"), ("c", "take")),
    ("caller: take -> frame decoded", ("c", "take"), ("c", "decoded")),
    ("caller: decoded -> buffers in, delivered", ("c", "decoded"), ("c", "deliver")),
    ("caller: delivered -> agent's _on_message", ("c", "deliver"), ("c", "message")),
    ("caller: _on_message -> reply unpickled", ("c", "message"), ("c", "complete")),
    ("caller: unpickled -> rpc_sync returned", ("c", "complete"), ("c", "end")),
)


def noop() -> None:
    _STAMPS["user"].append(_ns())


def echo(x: Any) -> Any:
    _STAMPS["user"].append(_ns())
    return x


def _payload(spec: str) -> Any:
    """``--payload``: ``dict`` (the bench's dict echo, 100 tensors of 4 KiB)
    or a tensor's size in bytes (``1M``, ``400K``, ``4096``)."""
    import torch

    if spec == "dict":
        return {f"t{i}": torch.randn(1024) for i in range(100)}
    units = {"K": 1 << 10, "M": 1 << 20}
    nbytes = int(spec[:-1]) * units[spec[-1]] if spec[-1] in units else int(spec)
    return torch.randn(nbytes // 4)


def _clear() -> None:
    for stamps in _STAMPS.values():
        stamps.clear()


def _stamps() -> dict[str, list[int]]:
    return _STAMPS


def _stamp_entry(owner: Any, name: str, seam: str, *, on_return: bool = False) -> None:
    """Stamp ``seam`` as ``owner.name`` (a class's method, or a module's
    function looked up at each call) is entered, or as it returns."""
    inner = getattr(owner, name)
    stamps = _STAMPS[seam]

    def stamped(*args: Any, **kwargs: Any) -> Any:
        if not on_return:
            stamps.append(_ns())
            return inner(*args, **kwargs)
        try:
            return inner(*args, **kwargs)
        finally:
            stamps.append(_ns())

    setattr(owner, name, stamped)


def _install() -> None:
    """Wrap the seams, in this process, before the agent starts."""
    from ucxrpc.agent import core, pool, serving
    from ucxrpc.transport import receive
    from ucxrpc.transport.ucx import binding

    _stamp_entry(core.RpcAgent, "_on_message", "message")
    _stamp_entry(serving.Server, "_serve", "serve")
    _stamp_entry(serving.Server, "_reply", "reply")
    # A frame without buffers is made and sent in one C call (the
    # Outlet, csrc/send.c): the seam is its endpoint's send_frame, which
    # each endpoint binds to libucp's send as it opens.
    opened = binding.Endpoint.__init__

    def open_stamped(self: Any, *args: Any, **kwargs: Any) -> None:
        opened(self, *args, **kwargs)
        _stamp_entry(self, "send_frame", "send")
        _stamp_entry(self, "tag_send", "send")  # a frame with buffers, then its data

    binding.Endpoint.__init__ = open_stamped  # type: ignore[method-assign]
    # A waited call's reply (rpc_sync's) goes straight to its slot once
    # unpickled; a plain one's unpickling is pickle's loads, bound in the
    # agent's module (any other's is the serializer's loads).
    _stamp_entry(core, "_loads_plain", "complete", on_return=True)
    # A message with buffers: its frame decoded and checked, then (its
    # buffers received or read) delivered; its unpickling the serializer's.
    _stamp_entry(receive.Receiver, "_message_decoded", "decoded")
    _stamp_entry(receive.Receiver, "_deliver", "deliver")
    from ucxrpc.serialization import pickler as _pickler
    _stamp_entry(_pickler.Serializer, "loads", "complete", on_return=True)
    # Frames taken off UCX, by a turn's take or a driver's native spin,
    # all reach the receiver through its taken, the native core's
    # Inlet.taken bound on each receiver as it is made (before the loop
    # binds it in turn).
    made = receive.Receiver.__init__

    def made_stamped(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        _stamp_entry(self, "taken", "take")

    receive.Receiver.__init__ = made_stamped  # type: ignore[method-assign]
    # (dumps_for pickles the callee's replies too: only the caller's
    # stamps are matched, as the stages above say.)  A plain call is
    # pickled by the serializer's dumps_plain (C, bound on each serializer
    # as it is made), any other by dumps_for.
    _stamp_entry(core.RpcAgent, "dumps_for", "pickled", on_return=True)
    from ucxrpc.serialization import pickler
    serializer_made = pickler.Serializer.__init__

    def serializer_stamped(self: Any, *args: Any, **kwargs: Any) -> None:
        serializer_made(self, *args, **kwargs)
        # Stamped only where it pickled: a call it declines (not plain)
        # goes on to dumps_for, whose return is the seam then.
        plain, stamps = self.dumps_plain, _STAMPS["pickled"]

        def plain_stamped(obj: Any) -> Any:
            out = plain(obj)
            if out is not None:
                stamps.append(_ns())
            return out

        self.dumps_plain = plain_stamped

    pickler.Serializer.__init__ = serializer_stamped  # type: ignore[method-assign]
    _stamp_entry(pool.WorkerPool, "submit", "claim")
    # A drive's end: the loop handed on, the thread back to its caller
    # (wrapped on the class before init_rpc binds it anywhere): the pool
    # thread's idle drive returning on the callee; on the caller, whose
    # RpcAgent.wait drives inline, the wait's next step.
    _stamp_entry(core.RpcAgent, "_drive", "drove", on_return=True)
    # The caller's wait drives inline (the transport's drive, bound on it
    # as it is made): its return on the main thread.
    from ucxrpc.transport import engine
    transport_made = engine.Transport.__init__

    def transport_stamped(self: Any, *args: Any, **kwargs: Any) -> None:
        transport_made(self, *args, **kwargs)
        drive, stamps, main = self.drive, _STAMPS["drove"], threading.main_thread()

        def drive_stamped(done: Any) -> Any:
            try:
                return drive(done)
            finally:
                if threading.current_thread() is main:
                    stamps.append(_ns())

        self.drive = drive_stamped

    engine.Transport.__init__ = transport_stamped  # type: ignore[method-assign]


def _rank(rank: int, port: int, calls: int, warmup: int, payload: str | None = None
          ) -> dict | None:
    import ucxrpc as rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    _install()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out = None
    if rank == 0:
        fn, args = (noop, ()) if payload is None else (echo, (_payload(payload),))
        for _ in range(warmup):
            rpc.rpc_sync("worker1", fn, args)
        rpc.rpc_sync("worker1", _clear)
        _clear()
        begun, ended = [], []
        for _ in range(calls):
            begun.append(_ns())
            rpc.rpc_sync("worker1", fn, args)
            ended.append(_ns())
        caller = {k: list(v) for k, v in _STAMPS.items()}
        caller.update(start=begun, end=ended)
        out = {"caller": caller, "callee": rpc.rpc_sync("worker1", _stamps)}
    rpc.shutdown()
    return out


def stage_times(caller: dict[str, list[int]], callee: dict[str, list[int]],
                stages: tuple[tuple[str, tuple[str, str], tuple[str, str]], ...] = STAGES
                ) -> list[list[int]]:
    """Per stage, the ns each call spent in it, for the calls whose every
    seam was found in order: each seam is the first stamp of its kind at
    or after the previous seam (within the call's own start and end)."""
    sides = {"c": caller, "e": callee}
    seams = [stages[0][1]] + [stage[2] for stage in stages]
    per_stage: list[list[int]] = [[] for _ in stages]
    for t0, t_end in zip(caller["start"], caller["end"]):
        at = [t0]
        for side, seam in seams[1:-1]:
            stamps = sides[side][seam]
            i = bisect.bisect_left(stamps, at[-1])
            if i == len(stamps) or stamps[i] > t_end:
                break
            at.append(stamps[i])
        else:
            at.append(t_end)
            for i in range(len(stages)):
                per_stage[i].append(at[i + 1] - at[i])
    return per_stage


def _pct(values: list[int], p: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] / 1000, 1)


def table(per_stage: list[list[int]],
          stages: tuple[tuple[str, tuple[str, str], tuple[str, str]], ...] = STAGES) -> dict:
    rows = [{"stage": label, "p10_us": _pct(v, 10), "p50_us": _pct(v, 50), "p90_us": _pct(v, 90)}
            for (label, _, _), v in zip(stages, per_stage) if v]
    totals = [sum(call) for call in zip(*per_stage)]
    return {"calls": len(totals), "stages": rows,
            "total": {"p10_us": _pct(totals, 10), "p50_us": _pct(totals, 50),
                      "p90_us": _pct(totals, 90)} if totals else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="timed calls (default 3,000)")
    parser.add_argument("--warmup", type=int, default=500, help="calls before (default 500)")
    parser.add_argument("--json", default=None, help="also write the table here")
    parser.add_argument("--timeout", type=float, default=300.0, help="whole run (default 300 s)")
    parser.add_argument("--payload", default=None,
                        help="echo this instead of a no-op: 'dict' (the bench's dict echo, "
                             "100 tensors of 4 KiB) or one tensor's bytes ('1M', '400K')")
    args = parser.parse_args(argv)
    port = free_port()
    stages = STAGES if args.payload is None else PAYLOAD_STAGES
    with start(_rank, [(r, port, args.calls, args.warmup, args.payload)
                       for r in range(2)]) as ranks:
        outcomes = ranks.collect(timeout=args.timeout, failure_grace=10.0)
    failed = [o for o in outcomes if o.error]
    for o in failed:
        print(o.error, file=sys.stderr)
    value: Any = outcomes[0].value
    if failed or value is None:
        return 1
    per_stage = stage_times(value["caller"], value["callee"], stages)
    if stages is PAYLOAD_STAGES and len(per_stage[0]) < args.calls // 2:
        # A payload small enough to travel inside the pickle stream has no
        # buffers: its frames take the no-op's seams.
        stages = STAGES
        per_stage = stage_times(value["caller"], value["callee"], stages)
    result = table(per_stage, stages)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['calls']} of {args.calls} calls with every seam seen; µs")
    print(f"{'stage':44s} {'p10':>7s} {'p50':>7s} {'p90':>7s}")
    for row in result["stages"]:
        print(f"{row['stage']:44s} {row['p10_us']:7.1f} {row['p50_us']:7.1f} {row['p90_us']:7.1f}")
    if result["total"]:
        t = result["total"]
        print(f"{'total (wrapped)':44s} {t['p10_us']:7.1f} {t['p50_us']:7.1f} {t['p90_us']:7.1f}")
    return 0 if result["calls"] else 1


if __name__ == "__main__":
    sys.exit(main())
