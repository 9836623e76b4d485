"""The direct libucp frame path (ucxrpc/transport/ucx/ucp.py), on a real UCX
worker in a child process, through an endpoint to itself.

* A small host array sent directly arrives intact through probe and
  receive, with its tag; a send UCX finishes at once is the shared DONE.
* A large one (rendezvous) is left in flight: its request completes only
  once the receiver took it and the worker progressed, and is freed then.
* A buffer too short for the probed message fails that receive with an
  error that names the truncation; the next message still arrives.
* Buffers that are not writable host arrays (bytes, a read-only view) go
  through ucxx and arrive the same.
* Host byte tensors (a message's data buffers) are sent and received
  directly too, into a receive posted before or after the message came; a
  too-short one fails with the truncation named.  Empty and non-byte
  tensors go through ucxx and arrive the same.
* After the endpoint is closed, sending raises BrokenError instead of
  handing UCX a stale handle.
* The native spin (the progress loop's idle turns) returns on a frame it
  looks for (leaving it to be taken), on a wake-up, on a late yield or
  when its budget is spent, and not on a message of another tag.
* ``take`` takes every frame of a turn in one call, in order: the small
  ones received at once into byte arrays of their own, a larger one left
  for the caller to judge and receive; an allocator that fails raises and
  leaves nothing behind in UCX.
* The installed UCX gives the worker the multi-threaded mode ucxrpc needs
  (``ucp_worker_query``; the Worker refuses to start otherwise, shown with
  the query made to say single-threaded).
* A receive posted for a message that never comes is cancelled
  (``ucp_request_cancel``): it ends, failed, once.
"""

from __future__ import annotations

import pytest

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]

TAG = 0x5 << 60
MASK = (1 << 64) - 1


def _scenario(rank, world_size, init_method, name):
    import time

    import numpy as np

    from ucxrpc.errors import BrokenError
    from ucxrpc.transport.ucx import ucp
    from ucxrpc.transport.ucx.binding import Endpoint, Worker

    worker = Worker(None)
    errors: list[BaseException] = []
    ep = Endpoint(worker, worker.address, errors.append)

    def until(cond, limit_s=20.0):
        end = time.monotonic() + limit_s
        while not cond():
            if time.monotonic() > end:
                raise TimeoutError(name)
            worker.progress()

    def take(tag, into_len=None):
        found = []
        until(lambda: found.append(worker.probe(tag, MASK)) or found[-1] is not None)
        probe = found[-1]
        buf = np.zeros(probe.length if into_len is None else into_len, dtype=np.uint8)
        req = worker.recv_probed(buf, probe)
        until(lambda: req.done)
        return probe, buf, req

    out: dict = {}
    if name == "small":
        data = np.arange(200, dtype=np.uint8)
        sent = ep.tag_send(data, TAG | 7)
        until(lambda: sent.done)
        probe, buf, req = take(TAG | 7)
        out = {"same": bool((buf == data).all()), "tag": probe.sender_tag == TAG | 7,
               "length": probe.length, "error": req.error(), "send_error": sent.error(),
               "direct": type(sent).__name__, "is_done": sent is ucp.DONE,
               "thread_mode": ucp.ucp().thread_mode(worker._handle)}
    elif name == "large":
        data = np.random.default_rng(1).integers(0, 255, 4 << 20, dtype=np.uint8)
        sent = ep.tag_send(data, TAG | 8)
        out["in_flight"] = isinstance(sent, ucp.UcpRequest) and not sent.done
        probe, buf, req = take(TAG | 8)
        until(lambda: sent.done)
        out.update(same=bool((buf == data).all()), send_error=sent.error(),
                   recv_error=req.error(), released=sent.keep is None)
    elif name == "truncated":
        first = np.full(300, 3, dtype=np.uint8)
        second = np.full(50, 4, dtype=np.uint8)
        for i, arr in enumerate((first, second)):
            sent = ep.tag_send(arr, TAG | i)
            until(lambda: sent.done)
        _, _, req = take(TAG | 0, into_len=10)
        err = req.error()
        out["error"] = f"{type(err).__name__}: {err}"
        _, buf, req = take(TAG | 1)
        out["next"] = bool((buf == 4).all()) and req.error() is None
    elif name == "via_ucxx":
        ro = np.arange(64, dtype=np.uint8)
        ro.flags.writeable = False
        got = []
        for i, payload in enumerate((b"x" * 100, ro)):
            sent = ep.tag_send(payload, TAG | (10 + i))
            until(lambda: sent.done)
            _, buf, req = take(TAG | (10 + i))
            got.append((type(sent).__name__, bytes(buf) == bytes(payload), req.error()))
        out["got"] = got
    elif name == "tensors":
        import torch

        def trip(data, into, post_first, tag):
            """Send ``data``, receive it into ``into`` with a receive posted
            before the send or after it; (send kind, receive kind, error)."""
            if post_first:
                req = worker.tag_recv(into, tag)
            sent = ep.tag_send(data, tag)
            if not post_first:
                until(lambda: sent.done)
                req = worker.tag_recv(into, tag)
            until(lambda: req.done and sent.done)
            return type(sent).__name__, type(req).__name__, req.error()

        data = torch.from_numpy(np.random.default_rng(2).integers(0, 255, 1 << 20, dtype=np.uint8))
        for post_first in (True, False):
            into = torch.zeros(1 << 20, dtype=torch.uint8)
            kinds = trip(data, into, post_first, TAG | (20 + post_first))
            out[f"posted_first={post_first}"] = (*kinds, bool(torch.equal(into, data)))
        short = torch.zeros(100, dtype=torch.uint8)
        _, _, err = trip(data[:300], short, True, TAG | 22)
        out["short"] = f"{type(err).__name__}: {err}"
        others = {"empty": (torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)),
                  "float": (torch.arange(16, dtype=torch.float32), torch.zeros(16))}
        for i, (label, (src, into)) in enumerate(others.items()):
            sent_kind, recv_kind, err = trip(src, into, True, TAG | (30 + i))
            out[label] = (sent_kind, recv_kind, err, bool(torch.equal(into, src.contiguous())))
    elif name == "spin":
        import os

        spin = worker.spinner(TAG, (1 << 64) - (1 << 60), 1000)  # kind 5 only
        wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Nothing waits: the budget runs out, the CPU given up meanwhile.
        start = time.monotonic()
        out["idle"] = (*spin(wake, 0.05, 10.0)[:2], time.monotonic() - start)
        # A wake-up ends it at once, and is consumed.
        os.eventfd_write(wake, 1)
        out["woken"] = spin(wake, 5.0, 10.0)[0]
        out["consumed"] = spin(wake, 0.01, 10.0)[0]
        # A yield that comes back later than late_s is reported with its length.
        out["late"] = spin(wake, 5.0, 0.0)
        # A frame that arrives is found and taken, received as a turn's
        # take receives a small one; a large one comes as its handle.
        sent = ep.tag_send(np.arange(100, dtype=np.uint8), TAG | 40)
        why, _, _, taken = spin(wake, 5.0, 10.0)
        (tag, length, req, buf), = taken
        until(lambda: req.done)
        out["frame"] = (why, tag == TAG | 40, length, req.error() is None and sent.error() is None,
                        bytes(buf[:100]) == bytes(range(100)))
        data = (np.arange(2000) % 251).astype(np.uint8)
        big = ep.tag_send(data, TAG | 41)
        why, _, _, taken = spin(wake, 5.0, 10.0)
        (tag, length, req, handle), = taken
        into = np.zeros(2000, dtype=np.uint8)
        got = worker.recv_taken(into, handle)
        until(lambda: got.done and big.done)
        out["large"] = (why, length, req, bool((into == data).all()))
        out["none_taken"] = spin(wake, 0.01, 10.0)[3]
        # A message of another kind is not one it looks for.
        other = ep.tag_send(np.arange(10, dtype=np.uint8), (0x6 << 60) | 1)
        out["other"] = spin(wake, 0.05, 10.0)[0]
        take((0x6 << 60) | 1)
        out["other_sent"] = other.error() is None
        os.close(wake)
    elif name == "take":
        kinds = (1 << 64) - (1 << 60)  # kind 5, any low bits
        out["none"] = worker.taker(TAG, kinds, 1000)()
        small = np.arange(200, dtype=np.uint8)
        big = np.random.default_rng(2).integers(0, 255, 5000, dtype=np.uint8)
        for i, arr in enumerate((small, big, small[:10])):
            sent = ep.tag_send(arr, TAG | (50 + i))
            until(lambda: sent.done)
        taken = []
        until(lambda: taken.extend(worker.taker(TAG, kinds, 1000)() or ()) or len(taken) >= 3)
        (t1, n1, r1, b1), (t2, n2, r2, h2), (t3, n3, r3, b3) = taken
        until(lambda: r1.done and r3.done)
        # In the order sent; the small ones received into byte arrays of
        # their own, the large one left to the caller to receive.
        out["order"] = [t1 - TAG, t2 - TAG, t3 - TAG]
        out["small"] = (n1, r1.error(), bool((b1 == small).all()), b1.dtype.name, n3,
                        bool((b3 == small[:10]).all()))
        buf = np.zeros(n2, dtype=np.uint8)
        r2b = worker.recv_taken(buf, h2)
        until(lambda: r2b.done)
        out["large"] = (r2, n2, r2b.error(), bool((buf == big).all()))
        out["after"] = worker.taker(TAG, kinds, 1000)()

        # An allocator that fails: the error comes out, and the message is
        # not left behind in UCX (received into nothing).
        def broken(n):
            raise MemoryError(f"no {n} bytes")

        sent = ep.tag_send(small, TAG | 60)
        until(lambda: sent.done)
        found = []

        def fails():
            try:
                found.append(worker.taker(TAG, kinds, 1000)())
            except MemoryError as exc:
                found.append(str(exc))
            return found[-1] is not None

        worker._ucp.take, real = (lambda h, t, m, s, a: real(h, t, m, s, broken)), worker._ucp.take
        until(fails)
        worker._ucp.take = real
        out["broken"] = found[-1]
        for _ in range(100):
            worker.progress()
        out["left_behind"] = worker.taker(TAG, kinds, 1000)()
    else:  # "closed"
        ep.close()
        try:
            ep.tag_send(np.zeros(8, dtype=np.uint8), TAG)
            out["raised"] = None
        except BrokenError as exc:
            out["raised"] = str(exc)
    out["endpoint_errors"] = [str(e) for e in errors]
    return out


def _run(name):
    return run_workers(_scenario, 1, args=(name,), timeout=45)[0]


def _cancel_and_refuse(rank, world_size, init_method):
    """A receive nobody sends to, cancelled on a real worker (how an ended
    pipe lets go of its receives: receive.py, Receiver.abandon); then a
    worker whose UCX says it is not multi-threaded, refused."""
    import time

    import numpy as np

    from ucxrpc.transport.ucx import ucp
    from ucxrpc.transport.ucx.binding import Worker

    worker = Worker(None)
    req = worker.tag_recv(np.zeros(64, dtype=np.uint8), TAG | 99)
    for _ in range(50):
        worker.progress()
    out: dict = {"pending": req.done, "cancelled": worker.cancel(req)}
    end = time.monotonic() + 20
    while not req.done and time.monotonic() < end:
        worker.progress()
    err = req.error()
    out.update(done=req.done, error=None if err is None else f"{type(err).__name__}: {err}",
               again=worker.cancel(req))
    real = ucp.Ucp.thread_mode
    ucp.Ucp.thread_mode = lambda self, handle: 0  # UCS_THREAD_MODE_SINGLE
    try:
        Worker(None)
        out["refused"] = None
    except RuntimeError as exc:
        out["refused"] = str(exc)
    finally:
        ucp.Ucp.thread_mode = real
    return out


def test_a_posted_receive_is_cancelled_and_a_single_threaded_worker_refused():
    res = run_workers(_cancel_and_refuse, 1, timeout=45)[0]
    assert res["pending"] is False and res["cancelled"] == 1, res
    # It ends, failed (its owner frees it as any other), and only once.
    assert res["done"] is True and res["error"] and "cancel" in res["error"].lower(), res
    assert res["again"] == 0, res
    assert res["refused"] and "thread mode 'single'" in res["refused"], res
    assert "--enable-mt" in res["refused"], res


def test_take_receives_small_frames_at_once_and_leaves_large_ones_to_the_caller():
    res = _run("take")
    assert res["none"] is None and res["after"] is None, res
    assert res["order"] == [50, 51, 52], res
    assert res["small"] == (200, None, True, "uint8", 10, True), res
    assert res["large"] == (None, 5000, None, True), res
    assert res["broken"] == "no 200 bytes" and res["left_behind"] is None, res


def test_a_small_frame_arrives_intact_with_its_tag():
    res = _run("small")
    assert res["same"] and res["tag"] and res["length"] == 200, res
    assert res["error"] is None and res["send_error"] is None, res
    # a 200-byte eager send over the loopback completes when made
    assert res["is_done"] and res["direct"] == "UcpRequest", res
    assert res["endpoint_errors"] == [], res


def test_a_large_send_stays_in_flight_until_received_and_is_then_released():
    res = _run("large")
    assert res["in_flight"] and res["same"], res
    assert res["send_error"] is None and res["recv_error"] is None, res
    assert res["released"], res


def test_a_too_short_buffer_fails_that_receive_and_the_next_still_arrives():
    res = _run("truncated")
    assert res["error"].startswith("BrokenError: UCX request failed:"), res
    assert "truncated" in res["error"].lower(), res
    assert res["next"], res


def test_buffers_that_are_not_writable_host_arrays_go_through_ucxx():
    res = _run("via_ucxx")
    assert [(kind, same, err) for kind, same, err in res["got"]] == [
        ("UcxxRequest", True, None), ("UcxxRequest", True, None)], res


def test_the_native_spin_returns_on_a_frame_a_wake_up_a_late_yield_or_its_budget():
    """ucp_spin (csrc/ucp.c): the loop's idle turns without Python.  Why it
    returned is its first value: 0 a frame matching its tag waited (taken,
    as ucp_take takes them: its last value), 1 a yield came back late (with
    its length), 2 the budget ran out (having yielded meanwhile), 3 the
    loop was woken (the wake-up consumed)."""
    res = _run("spin")
    why, quick, took = res["idle"]
    assert why == 2 and quick > 0 and took >= 0.05, res
    assert res["woken"] == 3 and res["consumed"] == 2, res
    why, _, late, _ = res["late"]
    assert why == 1 and late > 0.0, res
    assert res["frame"] == (0, True, 100, True, True), res
    assert res["large"] == (0, 2000, None, True), res
    assert res["none_taken"] is None, res
    assert res["other"] == 2 and res["other_sent"], res


def test_sending_after_close_raises_broken_error():
    res = _run("closed")
    assert res["raised"] == "UCX endpoint already closed", res


def test_host_byte_tensors_go_directly_and_other_tensors_through_ucxx():
    res = _run("tensors")
    direct = ("UcpRequest",)
    for post_first in (True, False):
        sent, received, err, same = res[f"posted_first={post_first}"]
        assert sent in direct and received in direct, res
        assert err is None and same, res
    assert res["short"].startswith("BrokenError: UCX request failed:"), res
    assert "truncated" in res["short"].lower(), res
    # an empty tensor has no address for the direct path; the others are
    # not what the transport sends, and ucxx takes any of them
    for label in ("empty", "float"):
        assert res[label] == ("UcxxRequest", "UcxxRequest", None, True), (label, res)
    assert res["endpoint_errors"] == [], res


def test_the_installed_ucx_makes_the_worker_multi_threaded():
    assert _run("small")["thread_mode"] == 2  # UCS_THREAD_MODE_MULTI
