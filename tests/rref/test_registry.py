"""The owner's RRef registry, without processes: the order in which a pool
runs requests must not lose a value's waiters."""

import gc
import types
import weakref

import torch

from ucxrpc.rref.registry import Registry


def _registry():
    # Registry reads only the worker's id and devices from its agent.
    return Registry(types.SimpleNamespace(info=types.SimpleNamespace(id=1), devices=[]))


class _Handle:  # stands for the owner's local RRef object (weakly referenced)
    pass


def test_a_request_overtaking_the_creation_keeps_its_waiters():
    """A proxy call sent right after remote() may run before _owner_create:
    its RRef argument makes the entry and dies before the caller's fork is
    added.  The entry must survive, so the creation sets the future the proxy
    waits on (it used to be freed, and the call hung)."""
    reg = _registry()
    rid = (0, 7)
    e = reg.entry(rid)
    h = _Handle()
    e.handle = weakref.ref(h, reg.freer(rid))
    waiter = e.value.then(lambda f: f.wait() + 1)
    del h
    gc.collect()
    assert reg.owned.get(rid) is e, "the entry of a value still being made was freed"

    reg.add_fork(rid, (0, 8), 0)  # _owner_create, late
    reg.entry(rid).value.set_result(41)
    assert waiter.wait() == 42


def test_a_made_value_without_holders_is_freed():
    reg = _registry()
    rid = (0, 1)
    reg.add_fork(rid, (0, 2), 0)
    reg.entry(rid).value.set_result(torch.ones(1))
    reg.del_forks([(rid, (0, 2))])
    assert rid not in reg.owned


def test_a_value_whose_holders_left_while_it_was_made_is_freed_once_made():
    reg = _registry()
    rid = (0, 3)
    reg.add_fork(rid, (0, 4), 0)
    reg.del_forks([(rid, (0, 4))])
    assert rid in reg.owned  # waiters may still come for it
    reg.entry(rid).value.set_result(1)
    assert rid not in reg.owned
