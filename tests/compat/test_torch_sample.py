"""A fast sample of torch's own RPC tests, run against ucxrpc.

The full public set (``python -m tests.compat.run``) takes half an hour or
more; CI runs these few, one per area, all of which pass.  They run in one
child process (``python -m tests.compat.run``): the import shim swaps torch's
RPC modules in ``sys.modules``, which must not happen inside this pytest
process.  That child runs in its own process group, killed as a whole
afterwards, so the ranks and the forkserver it started cannot outlive it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# One or two per area of torch's suites; each passes on ucxrpc.
SAMPLE = (
    "RpcTest.test_nested_rpc",
    # A proxy call right after remote(): it hung when the owner ran the call
    # before the creation and freed the value's entry in between.
    "RpcTest.test_rref_proxy_tensor",
    "RpcTest.test_async_class_rref_proxy",
    "RpcTest.test_async_function_nested",
    "RpcTest.test_py_raise_in_user_func_escaped_str",
    "DistAutogradTest.test_backward_simple",
    "DistOptimizerTest.test_dist_optim",
    "RemoteModuleTest.test_remote_parameters",
)

# torch's own fixture waits this long for a test's ranks; the child as a
# whole gets _CHILD_TIMEOUT_S; pytest-timeout bounds the rest.
_TEST_TIMEOUT_S = 30
_CHILD_TIMEOUT_S = 75

_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sample_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Run SAMPLE in one child process; key -> that test's result."""
    if importlib.util.find_spec("expecttest") is None:
        pytest.fail("torch's test modules import expecttest: install it "
                    "(pip install expecttest; it belongs in the 'test' extra)", pytrace=False)
    out = tmp_path_factory.mktemp("compat")
    cmd = [sys.executable, "-m", "tests.compat.run", "--timeout", str(_TEST_TIMEOUT_S),
           "--report", str(out / "REPORT.md"), "--json", str(out / "results.json")]
    for key in SAMPLE:
        cmd += ["-t", key]
    proc = subprocess.Popen(cmd, cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log = "(the runner timed out)"
    finally:
        _kill_group(proc)
    path = out / "results.json"
    if not path.exists():
        pytest.fail(f"the compat runner wrote no results; its output:\n{log[-4000:]}",
                    pytrace=False)
    results = json.loads(path.read_text())["results"]
    return {r["key"]: r for r in results}


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the runner's whole process group (its forkserver and ranks too) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.mark.timeout(_CHILD_TIMEOUT_S + 30)
@pytest.mark.parametrize("key", SAMPLE)
def test_torch_rpc_test_passes_on_ucxrpc(key: str,
                                         sample_results: dict[str, dict[str, Any]]) -> None:
    result = sample_results.get(key)
    assert result is not None, f"{key} did not run (runner timed out, or torch renamed it)"
    assert result["outcome"] == "passed", f"{key}: {result['reason']}\n{result['details']}"
