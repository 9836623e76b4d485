"""The UCX settings ucxrpc applies before UCX loads (transport/ucx.py):
what it sets, and that a user's own settings win."""

from __future__ import annotations

from ucxrpc.transport.ucx import ucx_environment


def test_defaults_keep_shared_memory_with_error_handling_and_eager_intra_host():
    env = ucx_environment(None, 10.0, environ={})
    assert env["UCX_MM_ERROR_HANDLING"] == "y"
    assert env["UCX_RNDV_THRESH"] == "intra:512K,inter:auto"
    assert "UCX_TLS" not in env  # UCX chooses


def test_the_users_settings_win_except_an_explicit_transports_list():
    mine = {"UCX_RNDV_THRESH": "auto", "UCX_TLS": "tcp", "UCX_MM_ERROR_HANDLING": "n"}
    env = ucx_environment(None, 10.0, environ=mine)
    assert not set(env) & set(mine)
    assert ucx_environment(["shm", "tcp"], 10.0, environ=mine)["UCX_TLS"] == "sm,tcp"
