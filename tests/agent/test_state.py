"""The agent's life (agent/state.py): every move its table allows is made by
``RpcAgent._move``, every other one refused with both states named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ucxrpc.agent.core import RpcAgent
from ucxrpc.agent.state import MOVES, AgentState


def _agent(state: AgentState) -> SimpleNamespace:
    return SimpleNamespace(state=state, info=SimpleNamespace(name="w0"))


def test_the_table_holds_a_life_from_new_to_closed() -> None:
    assert set(MOVES) == set(AgentState)
    # The graceful path, and CLOSED from every state but itself.
    path = [AgentState.NEW, AgentState.JOINING, AgentState.SERVING, AgentState.DRAINING,
            AgentState.CLOSED]
    for was, to in zip(path, path[1:]):
        assert to in MOVES[was]
    assert all(AgentState.CLOSED in MOVES[s] for s in AgentState if s is not AgentState.CLOSED)
    assert not MOVES[AgentState.CLOSED]


@pytest.mark.parametrize("was", list(AgentState), ids=lambda s: s.name)
@pytest.mark.parametrize("to", list(AgentState), ids=lambda s: s.name)
def test_each_move_is_made_or_refused_as_the_table_says(was: AgentState, to: AgentState) -> None:
    agent = _agent(was)
    if to in MOVES[was]:
        RpcAgent._move(agent, to)  # type: ignore[arg-type]
        assert agent.state is to
    else:
        with pytest.raises(RuntimeError, match=f"w0: the agent cannot go from {was.value} "
                                               f"to {to.value}"):
            RpcAgent._move(agent, to)  # type: ignore[arg-type]
        assert agent.state is was
