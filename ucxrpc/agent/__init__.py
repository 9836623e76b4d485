"""The RPC agent: request/response matching, timeouts, user functions.

One agent per process (:mod:`.core`), in parts: who a worker is
(:mod:`.info`), who the job's workers are, what names resolve to, which
peers are gone and the device maps per peer (:mod:`.members`), the agent's
life (:mod:`.state`), the calls it waits for and their deadlines
(:mod:`.calls`), the requests it runs and answers (:mod:`.serving`),
errors across the wire (:mod:`.remote_errors`), and what the layers above
plug in (:mod:`.hooks`).
"""

from __future__ import annotations

from .core import RpcAgent
from .hooks import Hooks
from .info import WorkerInfo, check_name
from .remote_errors import describe_exception, not_a_future, rebuild_exception, timeout_error
from .state import AgentState

__all__ = ["AgentState", "Hooks", "RpcAgent", "WorkerInfo", "check_name", "describe_exception",
           "not_a_future", "rebuild_exception", "timeout_error"]
