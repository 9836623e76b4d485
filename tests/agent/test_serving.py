"""What a request leaves in the worker pool's queue (agent/serving.py).

Requests queued behind a busy pool outlive the garbage collector's young
collections; every tracked object among them is walked by the full
collections they set off.  A small request leaves none but the queue's own
tuple, and keeps its bytes exact."""

from __future__ import annotations

import gc
from typing import Any

from ucxrpc.agent.serving import COPY_BODY_MAX, Server


class _Pool:
    def __init__(self) -> None:
        self.tasks: list[tuple[Any, tuple[Any, ...]]] = []

    def submit(self, fn: Any, *args: Any) -> None:
        self.tasks.append((fn, args))


def test_a_small_request_queues_nothing_the_collector_tracks() -> None:
    pool = _Pool()
    server = Server(agent=None, pool=pool)  # type: ignore[arg-type]
    frame = memoryview(bytearray(b"\x80" * 64 + bytes(range(200))))
    server.accept(2, 11, frame[64:], [])
    server.accept(2, 12, frame[64:], [], True)
    (fn, args), (fn2, args2) = pool.tasks
    assert fn is fn2  # bound once
    peer, msg_id, body, buffers, plain = args
    assert (peer, msg_id, body, tuple(buffers), plain) == (2, 11, bytes(range(200)), (), False)
    assert args2[1:] == (12, bytes(range(200)), (), True)  # (its body marked plain)
    assert not any(gc.is_tracked(a) for a in args)
    assert server.unanswered == 2


def test_a_large_request_body_is_not_copied() -> None:
    pool = _Pool()
    server = Server(agent=None, pool=pool)  # type: ignore[arg-type]
    frame = memoryview(bytearray(COPY_BODY_MAX + 1))
    server.accept(1, 3, frame, [])
    body = pool.tasks[0][1][2]
    assert isinstance(body, memoryview) and body.obj is frame.obj
