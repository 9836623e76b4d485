"""The public surface: what each public module exports, the error tree, the
version and ``python -m ucxrpc``."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import ucxrpc
from ucxrpc import errors

REPO = Path(__file__).resolve().parents[2]
PUBLIC = ["ucxrpc", "ucxrpc.autograd", "ucxrpc.optim", "ucxrpc.nn", "ucxrpc.functions",
          "ucxrpc.errors", "ucxrpc.constants", "ucxrpc.tensorpipe", "ucxrpc.torch_rpc"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_name_exists(name: str) -> None:
    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ repeats a name"


@pytest.mark.parametrize("name", PUBLIC[1:])
def test_every_public_definition_is_exported(name: str) -> None:
    # A function or class a module defines without an underscore is public;
    # one left out of __all__ is either private by mistake or missing.
    module = importlib.import_module(name)
    defined = {n for n, obj in vars(module).items()
               if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
               and getattr(obj, "__module__", "").startswith(name)}
    assert defined <= set(module.__all__), f"{name}: not in __all__: {defined - set(module.__all__)}"


def test_every_error_class_is_exported_at_the_top() -> None:
    classes = {n for n, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, BaseException)
               and obj.__module__ == errors.__name__}
    assert classes == set(errors.__all__)
    assert classes <= set(ucxrpc.__all__), classes - set(ucxrpc.__all__)
    for n in classes:  # one tree, rooted where torch's users catch RPC failures
        assert issubclass(getattr(ucxrpc, n), RuntimeError), n


def test_the_version_has_one_source() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'attr = "ucxrpc.__version__"' in text
    try:
        installed = importlib.metadata.version("ucxrpc")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ucxrpc is not installed, only on the path")
    assert installed == ucxrpc.__version__


@pytest.mark.processes
def test_python_dash_m_ucxrpc_is_the_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "ucxrpc", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "info" in proc.stdout and "bench" in proc.stdout


@pytest.mark.parametrize("name, says", [("abc*", "Worker name must match"),
                                        (" ", "Worker name must match"),
                                        ("", "must be non-empty"),
                                        ("a" * 500, "shorter than 128")])
def test_worker_names_follow_torchs_rule_in_its_words(name: str, says: str) -> None:
    with pytest.raises(RuntimeError, match=says):
        ucxrpc.WorkerInfo(name, 0)
    with pytest.raises(ValueError, match=says):  # what it is, too
        ucxrpc.WorkerInfo(name, 0)
    assert ucxrpc.WorkerInfo("trainer:0-a_b", 3).name == "trainer:0-a_b"
