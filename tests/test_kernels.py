"""Pack/unpack of many tensors: the CPU path here, the CUDA kernel with a GPU;
where the kernel's source is found; what happens where CuPy is missing or broken."""

from __future__ import annotations

import fnmatch
import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.at_once import run_at_once
from ucxrpc import _kernels

REPO = Path(__file__).resolve().parents[1]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _tensors(device):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, dtype in enumerate(DTYPES * 3):
        shape = [(), (1,), (7,), (3, 5), (2, 3, 4)][i % 5]
        x = torch.randint(0, 2 if dtype is torch.bool else 120, shape, generator=g).to(dtype)
        out.append(x.to(device))
    out.append(torch.randn(4, 6, generator=g)[:, ::2].to(device))  # not contiguous
    out.append(torch.empty(0, device=device))
    return out


def _roundtrip(device):
    tensors = _tensors(device)
    buf, specs = _kernels.pack(tensors)
    assert buf.dtype is torch.uint8 and buf.device == tensors[0].device
    assert all(s.offset % _kernels.ALIGN == 0 for s in specs)
    got = _kernels.unpack(buf.clone(), specs)
    for a, b in zip(tensors, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return buf, specs


def test_pack_unpack_every_dtype_on_the_cpu():
    buf, specs = _roundtrip("cpu")
    # back to back, aligned
    assert specs[1].offset == _kernels.ALIGN and buf.numel() == specs[-1].offset
    assert "cupy" not in sys.modules  # the CPU path never imports it


def test_unpack_refuses_a_short_buffer():
    buf, specs = _kernels.pack([torch.ones(100)])
    with pytest.raises(ValueError, match="too small"):
        _kernels.unpack(buf[:100], specs)


@pytest.mark.gpu
@pytest.mark.processes  # CuPy's first compile runs `ldconfig -p` (found on an H200)
def test_pack_unpack_on_the_gpu_matches_the_cpu():
    buf, specs = _roundtrip("cuda")
    cpu_buf, cpu_specs = _roundtrip("cpu")
    assert specs == cpu_specs
    # the same bytes, padding aside
    for s in specs:
        assert torch.equal(buf[s.offset:s.offset + s.nbytes].cpu(),
                           cpu_buf[s.offset:s.offset + s.nbytes])
    # large ranges span several blocks, at unaligned addresses too
    big = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
    parts = [big[1:300_001], big[5:77], big[64:200_064]]
    got = _kernels.unpack(*_kernels.pack(parts))
    assert all(torch.equal(a, b) for a, b in zip(parts, got))


# ---- the kernel's source, found without an install ---------------------------

# A stand-in for CuPy that records the source _kernel compiles.
_RECORDING_CUPY = """
import contextlib
compiled = []
class RawModule:
    def __init__(self, code):
        compiled.append(code)
    def get_function(self, name):
        return name
class cuda:
    Device = staticmethod(lambda index: contextlib.nullcontext())
"""


def _start_isolated(code: str, stubs: dict[str, str], where: Path) -> subprocess.Popen[str]:
    """Start ``code`` in ``python -S`` with this checkout first on PYTHONPATH,
    then stub packages (``name -> __init__.py text``, written under
    ``where``), then what this process imports from: no site initialisation,
    so no ``.pth`` file runs and no editable-install finder exists;
    ``ucxrpc`` is the checkout's own."""
    for name, text in stubs.items():
        (where / "stubs" / name).mkdir(parents=True)
        (where / "stubs" / name / "__init__.py").write_text(text)
    here = [p for p in sys.path if p and os.path.isdir(p) and Path(p).resolve() != REPO]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(where / "stubs"), *here])
    return subprocess.Popen([sys.executable, "-S", "-c", textwrap.dedent(code)], env=env,
                            cwd=where, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """The isolated programs of the tests below (each above its test), all
    started at once and waited for under one deadline (what still runs after
    it is killed): each imports torch and ucxrpc, seconds of CPU, and one
    after another they left a core idle.  Each test checks its own
    program's exit."""
    runs = {"plain_checkout": (_PLAIN_CHECKOUT, {"cupy": _RECORDING_CUPY}),
            "broken_cupy": (_WITH_A_BROKEN_CUPY, {"cupy": _BROKEN_CUPY}),
            "without_cupy": (_WITHOUT_CUPY, {})}
    return run_at_once({name: functools.partial(_start_isolated, code, stubs,
                                                tmp_path_factory.mktemp(name))
                        for name, (code, stubs) in runs.items()}, 60)


# (the test's docstring says what this checks)
_PLAIN_CHECKOUT = """
    import sys, cupy, ucxrpc
    from ucxrpc import _kernels
    assert not [f for f in sys.meta_path if "editable" in repr(f).lower()], sys.meta_path
    assert _kernels._kernel(0) == "multi_copy"
    (source,) = cupy.compiled
    assert "multi_copy" in source and "__global__" in source, source[:200]
    print("loaded", len(source), "bytes from", ucxrpc.__file__)
"""


@pytest.mark.processes
def test_the_kernel_source_loads_from_a_plain_checkout(isolated):
    """_kernel reads multi_copy.cu with ucxrpc found only on PYTHONPATH (no
    wheel, no editable install), as pytest and benchmarks/ run it."""
    proc = isolated["plain_checkout"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"from {REPO / 'ucxrpc' / '__init__.py'}" in proc.stdout


def test_the_wheel_ships_every_kernel_source():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["ucxrpc"]
    sources = [p.relative_to(REPO / "ucxrpc").as_posix()
               for p in (REPO / "ucxrpc" / "kernels").iterdir() if p.suffix in (".cu", ".cuh")]
    assert "kernels/multi_copy.cu" in sources
    assert all(any(fnmatch.fnmatch(s, pat) for pat in patterns) for s in sources), patterns


# ---- CuPy missing or broken: no packing on the sender, a plain cut on arrival -

_BROKEN_CUPY = """
raise ImportError("libcudart.so.13: cannot open shared object file (a broken CuPy)")
"""

_WITH_A_BROKEN_CUPY = """
    import logging, sys, torch
    logging.basicConfig(format="%(levelname)s %(name)s %(message)s")
    from ucxrpc import _kernels
    from ucxrpc.transport.cuda import staging
    cuda0 = torch.device("cuda", 0)
    assert not staging._can_pack(cuda0), "a broken CuPy would fail the RPC"
    assert not staging._can_pack(cuda0)
    reason = _kernels.cuda_problem(0)
    assert "does not import" in reason and "libcudart.so.13" in reason, reason
    # the host-as-device debug path still packs, with memmove: no CuPy
    bufs = [torch.arange(40, dtype=torch.uint8) for _ in range(staging.PACK_MIN_COUNT)]
    out = staging.plan(bufs, None, staged=False, host_as_device=True)
    assert out.packed == staging.PACK_MIN_COUNT, out.packed
"""

# None in sys.modules hides any CuPy this machine has from find_spec and import.
_WITHOUT_CUPY = """
    import sys
    sys.modules["cupy"] = None
    from ucxrpc import _kernels
    print(_kernels.cuda_problem(0))
"""


@pytest.mark.processes
def test_a_broken_cupy_turns_cuda_packing_off_with_one_warning(isolated):
    proc = isolated["broken_cupy"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, proc.stderr
    assert "CuPy is installed but does not import" in warnings[0]
    assert "sent one by one" in warnings[0]


@pytest.mark.processes
def test_without_cupy_the_reason_says_it_is_not_installed(isolated):
    proc = isolated["without_cupy"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("CuPy is not installed"), proc.stdout


def test_a_pack_is_cut_apart_without_the_kernel(monkeypatch):
    """What a receiver without a working CuPy does with a peer's pack: the
    same bytes, one copy per tensor (run on host tensors standing in)."""
    calls = []
    monkeypatch.setattr(_kernels, "kernel_usable", lambda device: False)
    monkeypatch.setattr(_kernels, "multi_copy", lambda *a: calls.append(a))
    tensors = _tensors("cpu")
    buf, specs = _kernels.pack(tensors)
    got = _kernels.unpack(buf.clone(), specs)
    assert calls == []
    for a, b in zip(tensors, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
