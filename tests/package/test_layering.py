"""Keep the layering of ucxrpc/ honest (see docs/architecture.md, "Layers").

* Only modules under ``ucxrpc/transport/`` import ``ucxx``.
* Imports point down the stack: a module imports only modules of the same or
  a lower rank (table below). Every import counts: relative or absolute, at
  top level, inside functions, under ``if TYPE_CHECKING``.
* ``import ucxrpc`` starts no thread, does not import ``ucxx``, and leaves
  the environment alone.

Modules not written yet are simply absent. A module that exists but is not in
the table fails the test: give it a rank here when adding it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "ucxrpc"

# Module (or package) -> rank. A module may import modules of its own rank or
# lower. The entry for a package covers everything below it.
RANKS: dict[str, int] = {
    # Leaves: importable from everywhere, import nothing of ucxrpc (errors aside).
    "ucxrpc.errors": 0,
    "ucxrpc._kernels": 0,  # CuPy kernels and their CPU fallback
    "ucxrpc._cuda": 0,  # torch's current CUDA streams and device at C level
    "ucxrpc._torch_profiler": 0,  # torch's legacy profiler's private hooks, for RPC profiling
    "ucxrpc._torch_futures": 0,  # torch.futures.wait_all / collect_all that fail fast
    "ucxrpc._launch": 0,  # starts/stops rank processes for tests, bench, examples: stdlib only
    "ucxrpc._states": 0,  # the base of the state and reason enums (identity hash)
    "ucxrpc._core": 0,  # the native core (csrc/, C): frames, libucp calls, the call table; imports nothing of ucxrpc
    # The transport, bottom up (docs/architecture.md, "Layers").
    "ucxrpc.transport.wire": 1,  # frames, tags, auth, batches, gathers: pure codecs
    "ucxrpc.transport.loop": 1,  # who turns the progress loop, and whether it may poll
    "ucxrpc.transport.cuda": 2,  # CUDA context for UCX, bounce buffers, staging and packing
    "ucxrpc.transport.ucx": 3,  # the only code touching ucxx or libucp
    "ucxrpc.transport.hostmem": 4,  # receive buffers, reading/writing a peer's memory
    "ucxrpc.transport.watch": 4,  # lifelines and the shared-memory canary
    "ucxrpc.transport": 5,  # what knows a Pipe: engine, pipe, send, receive, handshake, ...
    "ucxrpc.serialization": 6,  # pickling with tensors out of band, bundles, the envelope
    "ucxrpc.devices": 6,
    "ucxrpc.options": 6,
    "ucxrpc.timeouts": 6,  # torch's timeout conventions, turned into seconds or None once
    "ucxrpc.constants": 6,  # torch's constant names (torch.distributed.rpc.constants), ucxrpc's values
    "ucxrpc.tensorpipe": 6,  # TensorPipeRpcBackendOptions: TensorPipe's option names as UcxRpcBackendOptions
    "ucxrpc.agent": 7,  # the agent, its thread pool, rendezvous and membership
    "ucxrpc.api": 8,
    "ucxrpc._all_gather": 8,  # torch's rpc.api._all_gather; api imports it and binds its calls
    "ucxrpc.functions": 8,
    "ucxrpc.profiling": 8,  # RPC under torch's profiler: the caller's spans, the callee's events
    "ucxrpc.rref": 9,
    "ucxrpc.autograd": 10,
    "ucxrpc.optim": 11,
    "ucxrpc.nn": 11,
    "ucxrpc.cli": 12,
    "ucxrpc.torch_rpc": 12,  # install() and the launcher: ucxrpc in place of torch's RPC modules
    "ucxrpc.bench": 12,
    "ucxrpc.__main__": 12,
    # The package itself re-exports the public API, so it sits on top, and
    # nothing below the top may import names from it.
    "ucxrpc": 12,
}

UCX_PACKAGE = "ucxx"
UCX_ALLOWED_UNDER = "ucxrpc.transport.ucx"


@dataclass(frozen=True)
class Module:
    name: str
    path: str  # as given, for messages
    is_package: bool


def _module_of(path: str) -> Module:
    parts = list(Path(path).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return Module(".".join(parts), path, is_package)


def rank_of(name: str) -> int | None:
    """Return the rank of module ``name``, or None when the table has no entry for it."""
    if name == "ucxrpc":
        return RANKS["ucxrpc"]
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        rank = RANKS.get(".".join(parts[:end]))
        if rank is not None:
            return rank
    return None


def _resolve_relative(module: Module, level: int, target: str | None) -> str:
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if level - 1 > len(package) - 1:
        raise ValueError(f"relative import beyond the top package in {module.path}")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(module: Module, tree: ast.AST, known: set[str]) -> Iterator[tuple[int, str]]:
    """Yield (line, imported module name) for every import in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, node.level, node.module)
            else:
                base = node.module or ""
            for alias in node.names:
                # `from pkg import sub` depends on pkg.sub when that is a module.
                candidate = f"{base}.{alias.name}"
                yield node.lineno, candidate if candidate in known else base
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value


def _is_dynamic_import(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__") and bool(node.args)


def layering_violations(sources: Mapping[str, str]) -> list[str]:
    """Check modules given as {path relative to the repo root: source}; return the violations."""
    modules = {path: _module_of(path) for path in sources}
    known = {m.name for m in modules.values()}
    for name in list(known):  # packages without __init__.py are still packages
        parts = name.split(".")
        known.update(".".join(parts[:end]) for end in range(1, len(parts)))

    problems = []
    for path, source in sorted(sources.items()):
        module = modules[path]
        own_rank = rank_of(module.name)
        if own_rank is None:
            problems.append(f"{path}: module {module.name} has no rank; add it to RANKS in {__file__}")
            continue
        tree = ast.parse(source, filename=path)
        for line, imported in _imports(module, tree, known):
            where = f"{path}:{line}: {module.name} (rank {own_rank})"
            top = imported.split(".")[0]
            if top == UCX_PACKAGE and not _under(module.name, UCX_ALLOWED_UNDER):
                problems.append(f"{where} imports {imported}; only {UCX_ALLOWED_UNDER} may import ucxx")
            if top != "ucxrpc" or imported == module.name:
                continue
            dep_rank = rank_of(imported)
            if dep_rank is None:
                problems.append(f"{where} imports {imported}, which has no rank (or does not exist)")
            elif dep_rank > own_rank:
                problems.append(f"{where} imports {imported} (rank {dep_rank}), which is above it")
    return problems


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _package_sources() -> dict[str, str]:
    return {
        path.relative_to(REPO_ROOT).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


# ---- the real check -----------------------------------------------------------


def test_ucxrpc_imports_point_down_the_stack() -> None:
    problems = layering_violations(_package_sources())
    assert not problems, "layering violations:\n" + "\n".join(problems)


@pytest.mark.processes
@pytest.mark.skipif(
    not (PACKAGE_DIR / "__init__.py").exists(), reason="ucxrpc/__init__.py does not exist yet"
)
def test_importing_ucxrpc_starts_nothing() -> None:
    code = (
        "import os, sys, threading\n"
        "before = dict(os.environ)\n"
        "import ucxrpc\n"
        "assert 'ucxx' not in sys.modules, 'import ucxrpc imported ucxx'\n"
        "assert 'cupy' not in sys.modules, 'import ucxrpc imported cupy'\n"
        "assert threading.active_count() == 1, f'import ucxrpc started threads: {threading.enumerate()}'\n"
        "changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}\n"
        "assert not changed, f'import ucxrpc changed the environment: {sorted(changed)}'\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_wheel_ships_every_package() -> None:
    # pyproject.toml lists packages by hand (see the comment there); a package
    # missing from the list would be missing from the wheel, though every
    # test run from the source tree would still pass.
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools_config = config["tool"]["setuptools"]
    listed = set(setuptools_config["packages"])
    on_disk = {
        ".".join(path.relative_to(REPO_ROOT).parts)
        for path in [PACKAGE_DIR, *PACKAGE_DIR.rglob("*")]
        if path.is_dir() and path.name != "__pycache__" and any(path.glob("*.py"))
    }
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    # The CUDA kernels' sources are data inside the package (_kernels.py
    # reads them from there, installed or not).
    assert "kernels/*.cu" in setuptools_config["package-data"]["ucxrpc"]
    assert (PACKAGE_DIR / "kernels" / "multi_copy.cu").is_file()


# ---- the checker checks itself ------------------------------------------------


def test_checker_accepts_a_well_layered_tree() -> None:
    sources = {
        "ucxrpc/__init__.py": "from .api import init_rpc\nfrom . import rref\n",
        "ucxrpc/errors.py": "",
        "ucxrpc/transport/__init__.py": "from .pipe import Pipe\n",
        "ucxrpc/transport/pipe.py": "from ..errors import BrokenError\nfrom .wire import auth\n",
        "ucxrpc/transport/ucx/binding.py": "import ucxx\nfrom ...errors import BrokenError\n",
        "ucxrpc/transport/wire/auth.py": "from ucxrpc.errors import AuthenticationError\n",
        "ucxrpc/serialization/envelope.py": "from ..errors import FrameError\n",
        "ucxrpc/agent.py": "from .transport import Pipe\nfrom .serialization import envelope\n"
                           "import ucxrpc.errors\n",
        "ucxrpc/api.py": "from .agent import Agent\n",
        "ucxrpc/rref.py": "def f():\n    from .api import rpc_sync\n",
        "ucxrpc/autograd/__init__.py": "from .context import Context\n",
        "ucxrpc/autograd/context.py": "from ..rref import RRef\nfrom . import __name__ as _n\n",
        "ucxrpc/cli.py": "import ucxrpc\nfrom ucxrpc import init_rpc\n",
    }
    assert layering_violations(sources) == []


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        ("ucxrpc/transport/pipe.py", "from ..agent import Agent\n", "imports ucxrpc.agent (rank 7)"),
        ("ucxrpc/transport/pipe.py", "import ucxrpc.api\n", "imports ucxrpc.api (rank 8)"),
        ("ucxrpc/transport/wire/frame.py", "from ..pipe import Pipe\n",
         "imports ucxrpc.transport.pipe (rank 5)"),
        ("ucxrpc/transport/pipe.py", "import ucxx\n", "only ucxrpc.transport.ucx may import ucxx"),
        ("ucxrpc/agent.py", "def f():\n    from .rref import RRef\n", "ucxrpc/agent.py:2"),
        ("ucxrpc/agent.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .api import X\n",
         "imports ucxrpc.api"),
        ("ucxrpc/agent.py", "import ucxx\n", "only ucxrpc.transport.ucx may import ucxx"),
        ("ucxrpc/agent.py", "from ucxx._lib_async import Endpoint\n", "may import ucxx"),
        ("ucxrpc/agent.py", "import importlib\nm = importlib.import_module('ucxx')\n", "may import ucxx"),
        ("ucxrpc/serialization/envelope.py", "from ucxrpc import rpc_sync\n", "imports ucxrpc (rank 12)"),
        ("ucxrpc/serialization/envelope.py", "from .. import rpc_sync\n", "imports ucxrpc (rank 12)"),
        ("ucxrpc/errors.py", "from .nowhere import x\n", "has no rank"),
        ("ucxrpc/mystery.py", "", "has no rank; add it to RANKS"),
    ],
)
def test_checker_catches_bad_imports(path: str, source: str, expected: str) -> None:
    sources = {
        "ucxrpc/__init__.py": "",
        "ucxrpc/agent.py": "",
        "ucxrpc/api.py": "",
        "ucxrpc/rref.py": "",
        "ucxrpc/transport/__init__.py": "",
        path: source,
    }
    problems = layering_violations(sources)
    assert len(problems) == 1, problems
    assert expected in problems[0]
