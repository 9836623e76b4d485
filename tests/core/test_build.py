"""The native core's build (setup.py): a machine without a C compiler gets
an install error that says what to install, not a compiler's trace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "csrc", src / "csrc")
    (src / "ucxrpc").mkdir()
    shutil.copy(REPO / "ucxrpc" / "__init__.py", src / "ucxrpc" / "__init__.py")
    return src


@pytest.mark.processes
def test_a_missing_compiler_fails_the_build_naming_the_packages(tmp_path):
    src = _copy(tmp_path)
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"))
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=src,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "building ucxrpc._core failed" in out.stderr
    assert "apt-get install gcc python3-dev" in out.stderr


@pytest.mark.processes
def test_the_core_builds_warning_free_with_the_system_compiler(tmp_path):
    """-Wall -Wextra (setup.py's flags) and nothing to say: a warning is
    the first sign of a wrong width or a sign mix on the wire."""
    src = _copy(tmp_path)
    out = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=src,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "warning:" not in out.stderr, out.stderr
    assert list((src / "ucxrpc").glob("_core.*.so"))
