"""The shared-memory queue check's states (watch/canary.py): its table, and
``QueueCheck._move`` making what it allows and refusing the rest."""

from __future__ import annotations

import pytest

from ucxrpc.transport.watch.canary import _MOVES, CheckState, QueueCheck


def _check(state: CheckState) -> QueueCheck:
    check = QueueCheck(worker=None, transports=None, tag=0,  # type: ignore[arg-type]
                       on_stuck=lambda reason: None)
    check.state = state
    return check


def test_stuck_and_unavailable_are_final() -> None:
    assert set(_MOVES) == set(CheckState)
    assert not _MOVES[CheckState.STUCK] and not _MOVES[CheckState.UNAVAILABLE]
    assert _MOVES[CheckState.IDLE] == {CheckState.WAITING, CheckState.UNAVAILABLE}


@pytest.mark.parametrize("was", list(CheckState), ids=lambda s: s.name)
@pytest.mark.parametrize("to", list(CheckState), ids=lambda s: s.name)
def test_each_move_is_made_or_refused_as_the_table_says(was: CheckState, to: CheckState) -> None:
    check = _check(was)
    if to in _MOVES[was]:
        check._move(to)
        assert check.state is to
    else:
        with pytest.raises(RuntimeError, match=f"no move from {was.value} to {to.value}"):
            check._move(to)
        assert check.state is was
