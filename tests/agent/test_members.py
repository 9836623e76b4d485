"""One agent's view of the job's workers (agent/members.py), without processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ucxrpc.agent.info import WorkerInfo
from ucxrpc.agent.members import Members
from ucxrpc.errors import AuthenticationError, BrokenError, ClosedError, PeerLeftError, RpcError
from ucxrpc.agent.rendezvous import Member
from ucxrpc.transport import Peer

D = torch.device


class Recorder:
    """Stands in for the transport (peers added) and the agent (peers gone)."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []
        self.gone: list[tuple[int, BaseException]] = []

    def add_peer(self, peer: Peer) -> None:
        self.peers.append(peer)

    def on_gone(self, peer: int, err: BaseException) -> None:
        self.gone.append((peer, err))


def _member(rank: int, name: str, maps: dict | None = None) -> Member:
    return Member(rank, name, f"addr{rank}".encode(), "host", 100 + rank,
                  device_maps=maps or {}, lifeline=f"life{rank}", cma=f"offer{rank}")


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def members(rec: Recorder) -> Members:
    m = Members(WorkerInfo("w0", 0), add_peer=rec.add_peer, on_gone=rec.on_gone,
                my_maps=lambda: {"w1": {D("cuda:0"): D("cuda:1")}})
    for rank in range(3):
        m.add(_member(rank, f"w{rank}", {"w0": {"cuda:2": "cuda:3"}} if rank == 1 else None))
    return m


# -- the table and resolution ----------------------------------------------------

def test_peers_go_to_the_transport_and_this_worker_does_not(members: Members,
                                                            rec: Recorder) -> None:
    assert rec.peers == [Peer(1, "w1", b"addr1", False, 1 << 30, "life1", 101, "offer1"),
                         Peer(2, "w2", b"addr2", False, 1 << 30, "life2", 102, "offer2")]
    assert sorted(members.workers) == [0, 1, 2]


@pytest.mark.parametrize("to", ["w1", 1, WorkerInfo("w1", 1)])
def test_a_worker_resolves_by_name_id_or_info(members: Members, to) -> None:
    assert members.resolve(to) == WorkerInfo("w1", 1)


@pytest.mark.parametrize("to, message", [
    ("nobody", "Unknown destination worker nobody: could not find destination name nobody"),
    (7, "Unknown destination worker 7: could not find destination id 7"),
    (WorkerInfo("w1", 2), "Unknown destination worker WorkerInfo(id=2, name=w1): could not "
                          "find destination id 2")])
def test_an_unknown_worker_is_torchs_error_naming_it(members: Members, to, message) -> None:
    with pytest.raises(RpcError) as info:
        members.resolve(to)
    assert str(info.value) == message


def test_a_float_is_a_value_error_and_anything_else_a_type_error(members: Members) -> None:
    with pytest.raises(ValueError, match="a rank is an int, got 1.0"):
        members.resolve(1.0)
    with pytest.raises(TypeError, match="got bool"):
        members.resolve(True)
    with pytest.raises(TypeError, match="got NoneType"):
        members.resolve(None)


def test_name_of_an_unknown_worker_is_its_id(members: Members) -> None:
    assert members.name_of(2) == "w2" and members.name_of(9) == "id 9"


def test_device_maps_are_set_per_peer_from_both_sides(members: Members) -> None:
    assert members.device_maps == {1: {D("cuda:0"): D("cuda:1")}}
    # w1 maps its cuda:2 to our cuda:3: our replies go back the other way.
    assert members.reverse_device_maps == {1: {D("cuda:3"): D("cuda:2")}}


# -- leaving ----------------------------------------------------------------------

def test_a_worker_that_left_is_gone_with_its_name_and_maps(members: Members,
                                                          rec: Recorder) -> None:
    members.remove(1)
    [(peer, err)] = rec.gone
    assert peer == 1 and type(err) is PeerLeftError
    assert str(err) == "worker w1 (id 1) left the group"
    assert 1 not in members.workers and members.is_broken(1) and members.broken() == {1}
    assert members.device_maps == {} and members.reverse_device_maps == {}
    with pytest.raises(RpcError, match="could not find destination name w1"):
        members.resolve("w1")
    assert members.failures == 0  # leaving is not failing


def test_removing_this_worker_or_a_stranger_does_nothing(members: Members,
                                                         rec: Recorder) -> None:
    members.remove(0)
    members.remove(9)
    assert rec.gone == [] and sorted(members.workers) == [0, 1, 2]


def test_a_name_taken_again_stays_with_its_new_rank(members: Members) -> None:
    members.add(_member(5, "w1"))  # w1 rejoined as rank 5 before rank 1's farewell
    members.remove(1)
    assert members.resolve("w1") == WorkerInfo("w1", 5)


def test_on_gone_sees_the_worker_still_in_the_table(rec: Recorder) -> None:
    seen = []
    m = Members(WorkerInfo("w0", 0), add_peer=rec.add_peer,
                on_gone=lambda peer, err: seen.append(m.name_of(peer)))
    m.add(_member(1, "w1"))
    m.remove(1)
    assert seen == ["w1"]


# -- failures ---------------------------------------------------------------------

@pytest.mark.parametrize("cause, kind, message", [
    (AuthenticationError("bad secret"), AuthenticationError,
     "pipe to worker w2 (id 2) refused: bad secret"),
    (PeerLeftError("bye"), PeerLeftError, "worker w2 (id 2) left the group"),
    (ClosedError("shut down"), ClosedError, "worker w2 (id 2) is gone: shut down"),
    (OSError("reset"), BrokenError, "worker w2 (id 2) failed: reset")])
def test_a_failed_peers_error_says_how_and_names_it(members: Members, rec: Recorder, cause,
                                                    kind, message) -> None:
    members.fail(2, cause)
    [(peer, err)] = rec.gone
    assert peer == 2 and type(err) is kind and str(err) == message and err.__cause__ is cause
    again = members.peer_error(2)
    assert type(again) is kind and str(again) == message
    assert members.failures == 1


def test_the_first_failure_is_the_one_kept(members: Members, rec: Recorder) -> None:
    members.fail(2, OSError("first"))
    members.fail(2, OSError("second"))
    assert len(rec.gone) == 1 and members.failures == 1
    assert str(members.peer_error(2)).endswith("failed: first")


def test_a_failure_of_a_stranger_or_a_leaver_is_ignored(members: Members,
                                                        rec: Recorder) -> None:
    members.remove(1)
    members.fail(1, OSError("late"))
    members.fail(9, OSError("who"))
    assert [p for p, _ in rec.gone] == [1] and members.failures == 0


def test_joining_again_forgets_the_failure(members: Members) -> None:
    members.fail(2, OSError("reset"))
    members.add(_member(2, "w2"))
    assert not members.is_broken(2) and members.broken() == set()


# -- where CUDA buffers land ------------------------------------------------------

def _pickled(*devs: str) -> SimpleNamespace:
    # Not real CUDA tensors (no GPU needed): buffers as the transport reads them.
    bufs = [SimpleNamespace(device=D(d), is_cuda=d != "cpu",
                            get_device=lambda d=d: -1 if d == "cpu" else D(d).index)
            for d in devs]
    return SimpleNamespace(cuda=any(d.startswith("cuda") for d in devs), buffers=bufs)


def test_host_only_messages_have_no_targets(members: Members) -> None:
    assert members.cuda_targets(1, _pickled("cpu")) is None


def test_cuda_buffers_follow_the_map_and_replies_its_reverse(members: Members) -> None:
    assert members.device_targets(1, [-1, 0]) == [-1, 1]
    assert members.device_targets(1, [3], replying=True) == [2]


def test_a_cuda_buffer_without_a_map_is_refused_naming_the_peer(members: Members) -> None:
    with pytest.raises(RpcError, match=r"a tensor on cuda:0 cannot go to w2: .*set_device_map"):
        members.device_targets(2, [0])
    with pytest.raises(RpcError, match="the reverse of w2's device map"):
        members.device_targets(2, [0], replying=True)


def test_a_refusal_is_not_remembered_and_a_mapped_device_still_goes(members: Members) -> None:
    for _ in range(2):  # asked again, refused again: nothing was learnt from it
        with pytest.raises(RpcError, match="cuda:5 cannot go to w1"):
            members.device_targets(1, [0, 5])
    assert members.device_targets(1, [0, -1, 0]) == [1, -1, 1]


def test_targets_are_decided_once_per_peer_and_device(members: Members,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ucxrpc import devices

    asked: list[list[torch.device]] = []
    decide = devices.target_devices

    def counting(sources, *args, **kwargs):
        asked.append(list(sources))
        return decide(sources, *args, **kwargs)

    monkeypatch.setattr(devices, "target_devices", counting)
    for _ in range(100):
        assert members.device_targets(1, [0, -1, 0]) == [1, -1, 1]
        assert members.device_targets(1, [3, 3], replying=True) == [2, 2]
    assert asked == [[D("cuda:0")], [D("cuda:3")]]  # once each: the rest were lookups


def test_a_peer_joining_again_with_a_new_map_is_decided_anew(members: Members) -> None:
    assert members.device_targets(1, [3], replying=True) == [2]
    members.add(_member(1, "w1", {"w0": {"cuda:2": "cuda:5"}}))  # its map to us changed
    assert members.device_targets(1, [5], replying=True) == [2]
    with pytest.raises(RpcError, match="cuda:3 cannot go to w1"):
        members.device_targets(1, [3], replying=True)


def test_a_map_replaced_by_the_job_wide_check_is_decided_anew(members: Members) -> None:
    assert members.device_targets(1, [0]) == [1]
    members.device_maps = {1: {D("cuda:0"): D("cuda:4")}}  # as RpcAgent.check_device_maps sets it
    assert members.device_targets(1, [0]) == [4]


def test_an_unreachable_peer_is_restored_and_a_dead_one_is_not(members: Members,
                                                               rec: Recorder) -> None:
    from ucxrpc.errors import UnreachableError
    members.fail(2, UnreachableError("silent host"))
    err = members.peer_error(2)
    assert type(err) is UnreachableError and "worker w2 (id 2) is unreachable" in str(err)
    members.fail(2, UnreachableError("again"))  # the first cause is kept
    assert "silent host" in str(members.peer_error(2)) and members.failures == 1
    members.restore(2)
    assert not members.is_broken(2)
    # Found gone after being unreachable: failed again, with that.
    members.fail(2, UnreachableError("silent host"))
    members.fail(2, BrokenError("its process is gone"))
    assert type(members.peer_error(2)) is BrokenError and members.failures == 3
    assert [type(e) for _, e in rec.gone][-2:] == [UnreachableError, BrokenError]
    members.restore(2)  # a dead peer stays failed
    assert members.is_broken(2)
