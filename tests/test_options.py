"""UcxRpcBackendOptions (ucxrpc/options.py): validated on creation,
keyword-only, torch's device-map rule."""

from __future__ import annotations

import pytest

from ucxrpc.options import UcxRpcBackendOptions


def test_options_validation():
    with pytest.raises(ValueError, match="num_worker_threads"):
        UcxRpcBackendOptions(num_worker_threads=0)
    with pytest.raises(ValueError, match="rpc_timeout"):
        UcxRpcBackendOptions(rpc_timeout=-1)
    with pytest.raises(TypeError):
        UcxRpcBackendOptions(16)  # keyword-only
    opts = UcxRpcBackendOptions(transports="tcp, sm")
    assert opts.transports == ["tcp", "sm"]
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping"):
        opts.set_device_map("w1", {0: 1, 1: 1})
