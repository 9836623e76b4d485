"""The native core's ``plain_pickle`` (csrc/plain.c): a plain message
pickled in one call, byte for byte what the serializer writes for it, and
None for anything the serializer's hooks or tensor code would see."""

from __future__ import annotations

import operator
import os
import pickle
import sys

import pytest
import torch

from ucxrpc import _core
from ucxrpc.serialization.pickler import Serializer


def module_function(x: int) -> int:
    return x


class Plain:
    pass


class _Meta(type):
    pass


class WithMeta(metaclass=_Meta):
    pass


PLAIN = [
    None, True, 0, -(1 << 70), 2.5, "ü", b"\x00", (), [], {},
    (module_function, (1, 2.0, "x", b"y", False, None), {"k": [1, {"d": 3}]}),
    (os.path.join, ("a", "b"), {}),
    (len, ([1, 2],), {}),           # a builtin function of a module
    (torch.add, (1, 2), {}),        # a builtin whose __self__ is a class
    (Plain, int, operator.add),     # classes and builtins by name
    [[[[1]]]],                      # as deep as it looks
    list(range(64)),                # as many values as it looks at
    b"x" * 300_000,                 # large: one frame or several, alike
]

NOT_PLAIN = [
    torch.zeros(2),                 # a tensor: the tensor code sees it
    (module_function, (torch.ones(1),), {}),
    ([].append,),                   # a bound builtin pickles its list
    (WithMeta,),                    # a metaclass may reduce it its own way
    ((1).bit_length,),
    (Plain(),),                     # an instance: its reduce is its own
    [[[[[1]]]]],                    # deeper than it looks
    list(range(65)),                # more values than it looks at
    {1, 2},                         # a set: not among the containers
    1j,
    bytearray(b"x"),
]


@pytest.mark.parametrize("obj", PLAIN, ids=lambda o: type(o).__name__)
def test_a_plain_message_is_what_the_serializer_writes(obj):
    got = _core.plain_pickle(obj)
    assert got == Serializer().dumps(obj).payload
    assert got == pickle.dumps(obj, protocol=5)
    assert pickle.loads(got) == obj


@pytest.mark.parametrize("obj", NOT_PLAIN, ids=lambda o: type(o).__name__)
def test_what_the_serializer_would_see_is_not_plain(obj):
    assert _core.plain_pickle(obj) is None


def test_a_cycle_is_not_plain():
    a: list = [1]
    a.append(a)
    assert _core.plain_pickle(a) is None
    d: dict = {}
    d["self"] = d
    assert _core.plain_pickle((d,)) is None


def test_what_pickle_refuses_is_left_to_the_serializer_to_word():
    # A lambda is a Python function by type, so plain by the look; pickle
    # refuses it, and the long way raises that with the serializer's words.
    call = (lambda: 0, (), {})
    assert _core.plain_pickle(call) is None
    with pytest.raises((pickle.PicklingError, AttributeError), match="local object"):
        Serializer().dumps(call)


def test_a_serializer_with_hooks_makes_nothing_plain():
    class Hooked(Serializer):
        def reducer_override(self, obj):
            return NotImplemented

    assert Hooked().dumps_plain((module_function, (1,), {})) is None
    assert Serializer(dispatch={int: int}).dumps_plain(1) is None
    assert Serializer().dumps_plain is _core.plain_pickle


def test_references_are_kept_as_they_were():
    obj = (module_function, ("a string of its own",), {"k": 1})
    parts = [sys.getrefcount(x) for x in (obj, obj[1], obj[2], module_function)]
    for _ in range(1000):
        _core.plain_pickle(obj)
        _core.plain_pickle([[[[[1]]]]])
        _core.plain_pickle((lambda: 0,))
        _core.plain_pickle(None)
    assert [sys.getrefcount(x) for x in (obj, obj[1], obj[2], module_function)] == parts


def test_none_is_one_shared_pickle():
    assert _core.plain_pickle(None) is _core.plain_pickle(None)
    assert _core.plain_pickle(None) == pickle.dumps(None, protocol=5)
