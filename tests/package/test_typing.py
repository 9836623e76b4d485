"""docs/style.md: ucxrpc/ stays mypy clean (config in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_mypy_clean():
    pytest.importorskip("mypy", reason="mypy comes with the test extra")
    proc = subprocess.run([sys.executable, "-m", "mypy", "ucxrpc"], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
