"""The UCX settings ucxrpc applies before UCX loads (transport/ucx.py):
what it sets, that a user's own settings win, how ``transports=`` becomes
``UCX_TLS``, when device memory may be handed to UCX, and (in a child
process) that UCX really reads the settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucxrpc.transport.ucx import cuda_memory, ucx_environment, ucx_tls

REPO = Path(__file__).resolve().parents[2]


def test_defaults_keep_shared_memory_with_error_handling_and_eager_intra_host():
    env = ucx_environment(None, 10.0, environ={})
    assert env["UCX_MM_ERROR_HANDLING"] == "y"
    assert env["UCX_RNDV_THRESH"] == "intra:2M,inter:auto"
    assert "UCX_TLS" not in env  # UCX chooses


def test_a_process_that_may_send_device_memory_lets_ucx_pick_the_rendezvous_switch():
    # One threshold serves every memory type: 2 MiB eagerly would copy CUDA
    # messages to the peer 8 KiB at a time (benchmarks/RESULTS.md, Run R).
    env = ucx_environment(None, 10.0, environ={}, device_memory=True)
    assert env["UCX_RNDV_THRESH"] == "auto"
    assert "UCX_RNDV_THRESH" not in ucx_environment(
        None, 10.0, environ={"UCX_RNDV_THRESH": "intra:2M"}, device_memory=True)


def test_the_users_settings_win_except_an_explicit_transports_list():
    mine = {"UCX_RNDV_THRESH": "auto", "UCX_TLS": "tcp", "UCX_MM_ERROR_HANDLING": "n",
            "UCX_MEMTYPE_CACHE": "y", "UCX_RNDV_FRAG_MEM_TYPES": "cuda",
            "UCX_WARN_UNUSED_ENV_VARS": "y"}
    env = ucx_environment(None, 10.0, environ=mine)
    assert not set(env) & set(mine)
    assert ucx_environment(["shm", "tcp"], 10.0, environ=mine)["UCX_TLS"] == "sm,tcp"
    # the deprecated singular is the user's choice too: the plural would override it
    assert "UCX_RNDV_FRAG_MEM_TYPES" not in ucx_environment(
        None, 10.0, environ={"UCX_RNDV_FRAG_MEM_TYPE": "host"})


def test_gpu_settings_ucxx_cannot_apply_and_fragments_of_either_memory():
    env = ucx_environment(None, 10.0, environ={})
    assert env["UCX_MEMTYPE_CACHE"] == "n"
    assert env["UCX_RNDV_FRAG_MEM_TYPES"] == "host,cuda"


def test_unused_variable_warnings_stay_on_unless_transports_are_narrowed():
    assert "UCX_WARN_UNUSED_ENV_VARS" not in ucx_environment(None, 10.0, environ={})
    assert "UCX_WARN_UNUSED_ENV_VARS" not in ucx_environment(["all"], 10.0, environ={})
    assert ucx_environment(["sm"], 10.0, environ={})["UCX_WARN_UNUSED_ENV_VARS"] == "n"
    assert ucx_environment(None, 10.0, environ={"UCX_TLS": "tcp"})[
        "UCX_WARN_UNUSED_ENV_VARS"] == "n"


@pytest.mark.parametrize("transports, tls", [
    (["sm", "cuda_ipc"], "sm,cuda_ipc,cuda_copy"),
    (["tcp", "gdr_copy"], "tcp,gdr_copy,cuda_copy"),
    (["shm", "cuda"], "sm,cuda_copy,cuda_ipc"),
    (["cuda_ipc", "cuda_copy", "sm"], "cuda_ipc,cuda_copy,sm"),
    (["sm", "cuda_copy"], "sm,cuda_copy"),
    (["sm", "sm", "tcp"], "sm,tcp"),
    (["^tcp"], "^tcp"),
    (["all"], "all"),
])
def test_transports_naming_cuda_ipc_or_gdr_copy_bring_cuda_copy(transports, tls):
    assert ucx_tls(transports) == tls
    assert ucx_environment(transports, 10.0, environ={})["UCX_TLS"] == tls


def test_device_memory_goes_to_ucx_only_with_cuda_copy_loaded():
    host = [("tcp", "lo"), ("sysv", "memory")]
    assert cuda_memory(True, host + [("cuda_copy", "cuda"), ("cuda_ipc", "cuda")])
    assert cuda_memory(True, host + [("cuda_copy", "cuda")])
    assert not cuda_memory(True, host + [("cuda_ipc", "cuda")])
    assert not cuda_memory(True, host + [("gdr_copy", "cuda")])
    assert not cuda_memory(True, host)
    # ucxx's cuda_support is a test of UCX_TLS: true on a machine without a GPU
    assert not cuda_memory(False, host + [("cuda_copy", "cuda")])


_CHILD = """
import json, sys
from ucxrpc.transport.ucx import Worker, effective_settings
Worker(None)
s = effective_settings()
json.dump({k: s.get(k) for k in sys.argv[1:]}, sys.stdout)
"""


@pytest.mark.timeout(90)
def test_ucx_reads_the_settings_in_a_process_that_starts_without_them():
    """What libucs really has, printed by UCX itself, in a process whose
    environment had no UCX_* variable: the pytest process may have imported
    ucxx already, which puts UCX_MEMTYPE_CACHE=n in os.environ for its
    children and would hide that ucxx's own setting comes too late."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["PYTHONPATH"] = str(REPO)
    names = ["UCX_MEMTYPE_CACHE", "UCX_RNDV_FRAG_MEM_TYPES", "UCX_WARN_UNUSED_ENV_VARS"]
    proc = subprocess.run([sys.executable, "-c", _CHILD, *names], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout)
    assert got == {"UCX_MEMTYPE_CACHE": "n", "UCX_RNDV_FRAG_MEM_TYPES": "host,cuda",
                   "UCX_WARN_UNUSED_ENV_VARS": "y"}, got
    # every variable set was read, so UCX's check of them stays quiet
    assert "unused environment variable" not in proc.stderr, proc.stderr
