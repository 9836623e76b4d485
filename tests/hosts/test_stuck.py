"""A connection stuck behind an outage is cut, and never resumes after it
(ucxrpc/transport/ucx/sockets.py: what a discarded endpoint's connections
get, as UCX 1.21 would otherwise parse their resumed bytes into an
endpoint it let go).

A client on host 0 holds two connections to a server on host 1 in epoll
sets nested as UCX's are (:mod:`tests.hosts._stuck`).  Both hosts drop
what arrives; the client sends 64 KiB on one connection, which TCP then
retransmits unacknowledged.  The look at the epoll sets finds both
connections and names only that one stuck; the cut ends it in the kernel
(no heal needed); after the heal the server got none of its bytes, and
the idle connection still carries data.
"""

from __future__ import annotations

import errno

import pytest

from tests.hosts._harness import Job, two_hosts, write

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def test_a_stuck_connection_is_cut_and_never_resumes(tmp_path):
    with two_hosts() as hosts:
        job = Job(hosts, tmp_path)
        host0, host1 = hosts.hosts
        try:
            job.start_worker_module("tests.hosts._stuck", "server", host1, "server",
                                    host1.address)
            job.wait_for("listening")
            job.start_worker_module("tests.hosts._stuck", "client", host0, "client",
                                    host1.address)
            job.wait_for("ready")
            hosts.drop(host0, True)
            hosts.drop(host1, True)
            write(tmp_path / "dropping", "")
            cut = job.json("cut.json")
            hosts.drop(host0, False)
            hosts.drop(host1, False)
            write(tmp_path / "healed", "")
            job.wait_for("got-hello")
            write(tmp_path / "stop", "")
            client = job.json("client.json")
            server = job.json("server.json")
        finally:
            job.stop()
    assert cut["listed"], cut  # both connections, found through the nested epoll sets
    assert cut["found"] == [True] and cut["cut"] == [True], cut  # the stuck one alone
    assert cut["silent_s"][0] >= 0.5, cut
    assert (cut["stuck_timeout_ms"], cut["idle_timeout_ms"]) == (1, 0), cut
    # The kernel ended it at its next retransmission, inside the outage.
    assert cut["stuck_closed"] and cut["stuck_error"] == errno.ETIMEDOUT, cut
    # After the heal: nothing of it reached the server; the idle one works.
    assert server == {"stuck": 0, "idle": 5}, server
    assert not client["idle_closed"], client
