"""A callee's failures as torch reports them: on the caller, and on the
callee's stderr."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


class TwoArgError(Exception):
    """Cannot be rebuilt from a message alone."""

    def __init__(self, flag, msg):
        self.flag = flag
        super().__init__(msg)


def raise_two_arg():
    raise TwoArgError(True, "two-arg failure")


def raise_only_here():
    """Raise an exception whose class the caller does not have."""
    cls = type("OnlyOnCallee", (Exception,), {"__module__": __name__})
    setattr(sys.modules[__name__], "OnlyOnCallee", cls)
    raise cls("only-here failure")


def raise_type_error():
    raise TypeError("a user TypeError")


def missing_on_callee():
    return 1


def drop_missing_on_callee():
    del sys.modules[__name__].missing_on_callee


def _errors(rank, world_size, init_method):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    if rank == 0:
        # an exception that cannot be rebuilt here: its message and type still arrive
        with pytest.raises(RuntimeError, match=r"(?s)Original exception on remote side was "
                                               r"On WorkerInfo\(id=1, name=worker1\).*"
                                               r"TwoArgError: two-arg failure") as info:
            rpc.rpc_sync("worker1", raise_two_arg)
        assert "Failed to create original exception type" in str(info.value)
        with pytest.raises(RuntimeError, match=r"(?s)Failed to load the original exception "
                                               r"type.*Original exception on remote side was"
                                               r".*OnlyOnCallee: only-here failure"):
            rpc.rpc_async("worker1", raise_only_here).wait()
        # a function the callee does not have: torch's hint
        rpc.rpc_sync("worker1", drop_missing_on_callee)
        with pytest.raises(RuntimeError, match=r"(?s)missing_on_callee.*Default RPC pickler "
                                               r"does not serialize function code"):
            rpc.rpc_sync("worker1", missing_on_callee)
        # a builtin op whose arguments match no schema: torch's RuntimeError,
        # naming the mismatch; a user function's TypeError stays one
        with pytest.raises(RuntimeError, match=r"(?s)failed to match any schema.*"
                                               r"missing value for argument 'self'") as info:
            rpc.rpc_sync("worker1", torch.add, args=())
        assert not isinstance(info.value, TypeError)
        with pytest.raises(TypeError, match="a user TypeError"):
            rpc.rpc_sync("worker1", raise_type_error)
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)),
                           torch.full((2,), 2.0))
        # the callee prints a failing function's error on its stderr (here
        # the callee is this process)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            with pytest.raises(ValueError, match="printed failure"):
                rpc.rpc_sync("worker0", raise_value_error, args=("printed failure",))
        assert "On WorkerInfo(id=0, name=worker0)" in err.getvalue(), err.getvalue()
        assert "ValueError('printed failure')" in err.getvalue(), err.getvalue()
    rpc.shutdown()


def raise_value_error(msg):
    raise ValueError(msg)


def test_remote_failures_as_torch_reports_them():
    run_workers(_errors, 2, timeout=100)
