"""The native core's ``Expect`` (csrc/expect.c): what a drive asks the
transport, as rules.  Each rule's meaning, first match winning, terms read
at each call (not once), the one Python test (``when``) called only where
its term holds, bad rules named, reference counts balanced.  The
transport's and the agent's own rules are tests/agent/test_core.py's and
the loop's tests' to hold."""

from __future__ import annotations

import gc
import sys
import time
from collections import deque
from types import SimpleNamespace

import pytest

from ucxrpc import _core


def test_any_is_true_where_one_of_its_terms_is_read_each_call():
    box = SimpleNamespace(frames=[])
    watch: list = []
    ask = _core.Expect((("any", (watch, (box, "frames")), "in flight"), ("then", "quiet")))
    assert ask() == "quiet"
    watch.append(1)
    assert ask(False) == "in flight"
    watch.clear()
    box.frames = [1]  # a new object under the name: read again, not kept
    assert ask() == "in flight"


def test_overdue_is_the_calls_argument():
    ask = _core.Expect((("overdue", "quiet"), ("then", "awaited")))
    assert ask(True) == "quiet" and ask(False) == "awaited" and ask() == "awaited"


def test_when_asks_its_test_only_where_its_term_holds():
    asked = []
    grants = SimpleNamespace(split_until=0.0)

    def due() -> bool:
        asked.append(1)
        return True

    ask = _core.Expect((("when", (grants, "split_until"), due, "copying"),))
    assert ask() is None and asked == []  # no rule matched: None
    grants.split_until = time.monotonic() + 1
    assert ask() == "copying" and asked == [1]


def test_above_and_within_read_numbers_and_the_clock():
    pool = SimpleNamespace(running=0)
    agent = SimpleNamespace(requested_at=-10.0)
    ask = _core.Expect((("above", (pool, "running"), "computing"),
                        ("within", (agent, "requested_at"), 0.5, "awaited"),
                        ("then", "nothing due")))
    assert ask() == "nothing due"
    agent.requested_at = time.monotonic()
    assert ask() == "awaited"
    pool.running = 2
    assert ask() == "computing"


def test_the_first_rule_that_matches_wins():
    ask = _core.Expect((("any", ([1],), "first"), ("any", ([1],), "second")))
    assert ask() == "first"


def test_an_error_in_a_term_or_test_is_raised():
    def boom() -> bool:
        raise LookupError("the test failed")

    with pytest.raises(AttributeError):
        _core.Expect((("any", ((object(), "missing"),), 1),))()
    with pytest.raises(LookupError):
        _core.Expect((("when", [1], boom, 1),))()


@pytest.mark.parametrize("rules, error, message", [
    ((("nonesuch", 1),), ValueError, "unknown op"),
    ((("any", (), 1, 2),), ValueError, "wrong length"),
    (("any",), TypeError, "must be a tuple"),
    ((("when", [1], 5, 1),), TypeError, "not callable"),
    ((("within", [1], "soon", 1),), TypeError, "must be real number"),
])
def test_bad_rules_are_named(rules, error, message):
    with pytest.raises(error, match=message):
        _core.Expect(rules)


def test_bad_calls_are_named():
    ask = _core.Expect(())
    with pytest.raises(TypeError, match="one argument"):
        ask(True, False)
    with pytest.raises(TypeError, match="one argument"):
        ask(overdue=True)


def test_reference_counts_stay_balanced():
    box = SimpleNamespace(frames=deque())
    why, fn = object(), (lambda: True)
    watched = [box, why, fn, box.frames]
    for _ in range(3):
        ask = _core.Expect((("any", ((box, "frames"),), why), ("when", [1], fn, why)))
        assert ask() is why
    del ask
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(500):
        ask = _core.Expect((("any", ((box, "frames"),), why), ("when", [1], fn, why),
                            ("above", (box, "nonesuch"), why)))
        assert ask() is why and ask(True) is why
        del ask
        with pytest.raises(ValueError):
            _core.Expect((("any", ((box, "frames"),), why), ("nonesuch", why)))
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before
    assert "Expect((" in repr(_core.Expect((("then", 1),)))
