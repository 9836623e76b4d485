"""The agent's life, as a state machine.

NEW → JOINING (publishing its record, learning the others', starting the
transport) → SERVING → DRAINING (a graceful shutdown: the layers above
flush, in-flight work finishes, the workers meet at the shutdown barrier)
→ CLOSED.  Any state may go straight to CLOSED (a shutdown that is not
graceful, a failed join).  Calls are taken until CLOSED: while DRAINING,
the work being finished may itself make calls (an RRef's deletions keep
flowing while a worker waits at the barrier), as in torch.
"""

from __future__ import annotations

from .._states import StateEnum

__all__ = ["MOVES", "AgentState"]


class AgentState(StateEnum):
    NEW = "new"
    JOINING = "joining"
    SERVING = "serving"
    DRAINING = "draining"
    CLOSED = "closed"


#: The moves an agent makes (:meth:`RpcAgent._move` checks each): the one
#: table of its life.  CLOSED ends it from anywhere (a shutdown that is not
#: graceful, a failed join).
MOVES: dict[AgentState, frozenset[AgentState]] = {
    AgentState.NEW: frozenset({AgentState.JOINING, AgentState.CLOSED}),
    AgentState.JOINING: frozenset({AgentState.SERVING, AgentState.CLOSED}),
    AgentState.SERVING: frozenset({AgentState.DRAINING, AgentState.CLOSED}),
    AgentState.DRAINING: frozenset({AgentState.CLOSED}),
    AgentState.CLOSED: frozenset(),
}
