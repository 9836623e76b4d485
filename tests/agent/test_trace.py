"""The per-message DEBUG trace (docs/style.md): with the ``ucxrpc.agent``
loggers at DEBUG, one call can be followed through both workers by its id;
at INFO nothing is logged per message."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fails() -> None:
    raise ValueError("no")


def _traced(rank, world_size, init_method):
    import ucxrpc as rpc

    records = _Records()
    agent_log = logging.getLogger("ucxrpc.agent")
    agent_log.addHandler(records)
    agent_log.setLevel(logging.INFO)
    if rank == 1:
        # Before init_rpc: w0's calls can be served while w1's init_rpc is
        # still returning, and _lines must find the handler then.
        _HANDLER.append(records)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    if rank == 0:
        rpc.rpc_sync("w1", torch.add, (torch.ones(2), 1))  # at INFO: no trace
        quiet = list(records.lines)
        rpc.rpc_sync("w1", agent_log.setLevel, (logging.DEBUG,))
        agent_log.setLevel(logging.DEBUG)
        rpc.rpc_sync("w1", torch.add, (torch.ones(2), 1))
        try:
            rpc.rpc_sync("w1", fails)
        except ValueError:
            pass
        agent_log.setLevel(logging.INFO)
        rpc.rpc_sync("w1", agent_log.setLevel, (logging.INFO,))
        traced = [line for line in records.lines if line not in quiet]
        theirs = rpc.rpc_sync("w1", _lines)
        out = (quiet, traced, theirs)
    else:
        out = None
    rpc.shutdown()
    return out


_HANDLER: list[_Records] = []


def _lines() -> list[str]:
    return list(_HANDLER[0].lines)


def test_one_call_is_followed_through_both_workers_by_its_id():
    quiet, mine, theirs = run_workers(_traced, 2, timeout=90)[0]
    per_message = re.compile(r"call \d+|response \d+|error \d+|request \d+")
    assert not [line for line in quiet if per_message.search(line)]
    sent = [int(m.group(1)) for line in mine
            if (m := re.match(r"w0: call (\d+) to w1: \S*add ", line))]
    assert len(sent) == 1, mine
    call = sent[0]
    assert f"w0: response {call} from w1" in " ".join(mine)
    assert any(line.startswith(f"w1: request {call} from w0") for line in theirs), theirs
    assert any(line.startswith(f"w1: serving call {call} from w0: _VariableFunctionsClass.add")
               for line in theirs)
    assert any(line.startswith(f"w1: replied to call {call} from w0") for line in theirs)
    failed = [int(m.group(1)) for line in mine
              if (m := re.match(r"w0: call (\d+) to w1: fails", line))]
    assert failed and f"w0: error {failed[0]} from w1" in " ".join(mine)
    assert any(line.startswith(f"w1: answering call {failed[0]} from w0 with ValueError: no")
               for line in theirs)
