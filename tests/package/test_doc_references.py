"""The map stays true: what the docs name in backticks exists.

docs/architecture.md, README.md and every docstring of the package name
modules, files, classes, functions, methods, attributes and constants in
backticks (and docstrings in Sphinx roles: ``:mod:`.frame```).  A rename that
leaves one of them behind breaks this test, not the next reader.

What counts as a reference, and how it resolves:

* a path (``ucxrpc/transport/engine.py``, ``tests/hosts/``, ``docs/x.md``):
  it exists in the repository;
* a dotted name (``Transport._break``, ``staging.finish``,
  ``ucxrpc.transport.wire``): its first part is a module (by its full or
  short name), a class or a known outside module, and every later part is
  an attribute of what came before, or at least an attribute some class or
  module of the package has (``pipe.out.state``: a variable's attributes);
* a bare name that looks like code (``snake_case``, ``CamelCase``,
  ``CONSTANT``): something of the package has that name (a module, a
  module-level name, a class attribute, an attribute set on ``self``, a
  parameter), or a known outside one;
* a Sphinx role in a docstring (``:class:`.pipe.Pipe```, ``:meth:`drive```):
  resolved as a dotted name, a leading ``.`` relative to the docstring's
  package.

Everything else in backticks (commands, settings, expressions, thread
names, environment variables) is prose and not checked.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import pytest

import ucxrpc

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ucxrpc"
#: Settings and environment variables: named in backticks, not code.
SETTING = re.compile(r"^(UCX|UCXRPC|PYTORCH|TORCHELASTIC|CUDA|NCCL|GLOO|TP|OMP|MASTER|LOCAL|"
                     r"RAPIDS|TCP|SO|IPPROTO|EPOLL|PR|CLOCK|MSG)_\w+$|^(RANK|WORLD_SIZE|"
                     r"PYTHONPATH|PATH|HOME|LICENSE)$")
#: Names from the libraries the examples run (FairScale, TorchRL) and from
#: torch's own tests and autograd engine.
OUTSIDE_NAMES = {"DistributedPipeline", "RPCCollector", "queue_callback", "gdr_copy", "retain_grad"}
_FILE = re.compile(r"[\w.-]+\.(py|md|json|txt|sh|typed|toml|yml|yaml|cu|cuh|png|cfg|ini)")
DOCS = [REPO / "docs" / "architecture.md", REPO / "README.md"]

#: Outside modules a reference may start with (resolved by importing them).
OUTSIDE = ("torch", "numpy", "np", "os", "socket", "select", "threading", "ctypes", "time",
           "contextvars", "multiprocessing", "subprocess", "signal", "errno", "weakref",
           "functools", "collections", "itertools", "pickle", "struct", "hmac", "hashlib",
           "queue", "sys", "gc", "json", "logging", "asyncio", "typing", "dataclasses",
           "importlib", "runpy", "atexit", "faulthandler", "tempfile", "cupy", "ucxx")
#: Names from outside that docs cite bare: UCX's and CUDA's C API, Linux's.
OUTSIDE_CALL = re.compile(r"^(ucp|uct|ucs|ucm|cu|cuda|cudaStream|nccl|process_vm|pidfd|epoll|"
                          r"eventfd|prctl|pthread|mmap|madvise|getnameinfo|setns|unshare)\w*$")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_PATH = re.compile(r"(ucxrpc|tests|docs|benchmarks|examples|docker|\.ci)/[\w./-]*")
_DOTTED = re.compile(r"\.?[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?")
_ROLE = re.compile(r":(mod|class|func|meth|data|attr|exc|obj):`~?([^`]+)`")
_DOUBLE = re.compile(r"``([^`]+)``")


@lru_cache(maxsize=None)
def _modules() -> dict[str, object]:
    """Every module of the package, imported, by full name."""
    out: dict[str, object] = {"ucxrpc": ucxrpc}
    for info in pkgutil.walk_packages([str(PACKAGE)], "ucxrpc."):
        if info.name.endswith("__main__") or ".torch_rpc._site" in info.name:
            continue
        out[info.name] = importlib.import_module(info.name)
    return out


class _Index:
    """What the package defines, by simple name."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.classes: dict[str, list[type]] = defaultdict(list)
        self.class_attrs: dict[str, set[str]] = defaultdict(set)  # by class simple name
        self.short_modules: dict[str, list[str]] = defaultdict(list)
        for name, module in _modules().items():
            parts = name.split(".")
            for i in range(len(parts)):
                self.short_modules[".".join(parts[i:])].append(name)
                self.names.add(parts[i])
            self.names.update(vars(module))
            path = getattr(module, "__file__", None)
            if path and path.endswith(".py"):  # not the native core's shared object
                self._scan(Path(path).read_text(encoding="utf-8"))
            for obj in vars(module).values():
                if isinstance(obj, type) and obj.__module__ == name:
                    self.classes[obj.__name__].append(obj)
                    for klass in obj.__mro__:
                        self.class_attrs[obj.__name__].update(vars(klass))
                        self.class_attrs[obj.__name__].update(getattr(klass, "__slots__", ()))
                        self.class_attrs[obj.__name__].update(
                            getattr(klass, "__dataclass_fields__", {}))
        for attrs in self.class_attrs.values():
            self.names.update(attrs)
        # The native core's C functions (csrc/: docs name `check_ways`).
        for path in (REPO / "csrc").glob("*.[ch]"):
            self.names.update(re.findall(r"^[A-Za-z_][\w \*]*?\b(\w+)\(", path.read_text(),
                                         re.MULTILINE))
        # What the tests define (helpers the docs name: worker_group, RANKS).
        for path in (REPO / "tests").rglob("*.py"):
            if path != Path(__file__).resolve():  # its own examples of stale names
                self._scan(path.read_text(encoding="utf-8"))
        self.files = {p.name for p in REPO.rglob("*") if ".venv" not in p.parts
                      and ".git" not in p.parts}

    def _scan(self, source: str) -> None:
        """Names the source sets or takes: attributes set on ``self`` (by
        class), parameters, locals."""
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id in ("self", "cls")
                            and isinstance(sub.ctx, ast.Store)):
                        self.class_attrs[node.name].add(sub.attr)
                        self.names.add(sub.attr)
            elif isinstance(node, ast.arg):
                self.names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                self.names.add(node.attr)
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and _IDENT.fullmatch(node.value)):
                self.names.add(node.value)  # a key of _get_debug_info(), a setting's name


@lru_cache(maxsize=None)
def _index() -> _Index:
    return _Index()


def _outside(first: str, rest: list[str]) -> bool:
    """Whether ``first.rest...`` is something of an outside module."""
    if first not in OUTSIDE:
        return False
    try:
        obj = importlib.import_module({"np": "numpy"}.get(first, first))
    except ImportError:
        return True  # optional (CuPy): not checkable here
    for part in rest:
        if not hasattr(obj, part):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")  # type: ignore[attr-defined]
                continue
            except (ImportError, AttributeError):
                return False
        obj = getattr(obj, part)
    return True


def _resolve(ref: str, base: str = "ucxrpc") -> str | None:
    """None if ``ref`` resolves, else why not.  ``base``: the package a
    leading ``.`` is relative to."""
    idx = _index()
    ref = ref.removesuffix("()")
    relative = ref.startswith(".")
    if relative:
        pkg = base.split(".")
        dots = len(ref) - len(ref.lstrip("."))
        anchor = ".".join(pkg[:len(pkg) - dots + 1])
        ref = f"{anchor}.{ref.lstrip('.')}" if ref.lstrip(".") else anchor
    parts = ref.split(".")
    # The longest leading run that names a module (full or short name).
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        found = idx.short_modules.get(head) or ([head] if head in _modules() else [])
        if found:
            return _walk([_modules()[m] for m in found], parts[i:], ref, strict=relative)
    first, rest = parts[0], parts[1:]
    if _outside(first, rest) or OUTSIDE_CALL.match(first):
        return None
    if first in idx.classes:
        objs: list[object] = list(idx.classes[first])
        if rest and not any(rest[0] in idx.class_attrs[first] or hasattr(o, rest[0])
                            for o in objs):
            return f"{first} has no {rest[0]!r}"
        return None if len(rest) <= 1 else _loose(rest[1:], ref)
    if first in idx.names or hasattr(builtins, first):
        return _loose(rest, ref)
    return f"nothing of the package is named {first!r}"


def _walk(objs: list[object], rest: list[str], ref: str, strict: bool = False) -> str | None:
    """Attributes ``rest`` from one of ``objs`` (modules with the same short
    name); ``strict`` (a relative reference, which names one module): no
    falling back on the package's names."""
    for obj in objs:
        cur: object = obj
        for k, part in enumerate(rest):
            if hasattr(cur, part):
                cur = getattr(cur, part)
                continue
            attrs = _index().class_attrs.get(getattr(cur, "__name__", ""), set())
            if part in attrs:  # set on self, or a slot
                return _loose(rest[k + 1:], ref)
            break
        else:
            return None
    if strict:
        return f"{ref}: no such attribute"
    # A module's short name that is also a variable's (``agent.call``,
    # ``pipe.direct``): its attributes are the package's names at least.
    return _loose(rest, ref)


def _loose(rest: list[str], ref: str) -> str | None:
    """Attributes of something whose type the text does not say (a variable):
    each must at least be a name the package has."""
    for part in rest:
        if part not in _index().names and not hasattr(builtins, part):
            return f"{ref}: nothing of the package is named {part!r}"
    return None


def _looks_like_code(span: str) -> bool:
    if not _DOTTED.fullmatch(span) or SETTING.match(span) or span in OUTSIDE_NAMES:
        return False
    if "." in span.strip(".") or span.endswith("()"):
        return True
    name = span
    # A bare word: code if it has an underscore or inner capital, or is a constant.
    return "_" in name.strip("_") or (name[:1].isupper() and any(c.islower() for c in name[1:])
                                      and any(c.isupper() for c in name[1:])) \
        or (name.isupper() and len(name) > 2) or name.startswith("_")


def _doc_refs() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks are examples
        for span in re.findall(r"`([^`\n]+)`", text):
            out.append((str(doc.relative_to(REPO)), span.strip()))
    return out


def _docstring_refs() -> list[tuple[str, str, str]]:
    """(where, reference, package a leading dot is relative to)."""
    out = []
    for name, module in _modules().items():
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):  # the native core's docs are its own
            continue
        base = name if Path(path).name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc:
                continue
            where = f"{name}:{getattr(node, 'name', '<module>')}"
            for _, ref in _ROLE.findall(doc):
                out.append((where, ref.strip(), base))
            for span in _DOUBLE.findall(doc):
                span = span.strip()
                if _PATH.fullmatch(span) or span.startswith("ucxrpc."):
                    out.append((where, span, base))
    return out


def _check_path(span: str) -> str | None:
    path = span.split("#")[0].split(":")[0]
    return None if (REPO / path).exists() else f"{path} does not exist"


def _check(span: str, base: str = "ucxrpc") -> str | None:
    if _PATH.fullmatch(span):
        return _check_path(span)
    if _FILE.fullmatch(span):
        # A file named alone: one of the repository's, or torch's own tests'.
        return None if span in _index().files or _torch_file(span) else f"no file {span}"
    if span.startswith(".") and base == "ucxrpc":
        return None  # prose about someone else's module (torch's rpc.backend_registry)
    if _looks_like_code(span):
        return _resolve(span, base)
    return None


@lru_cache(maxsize=None)
def _torch_file(name: str) -> bool:
    import torch
    return any(Path(torch.__file__).parent.rglob(name))


def test_what_the_architecture_doc_and_readme_name_exists():
    wrong = sorted({f"{where}: `{span}`: {why}" for where, span in _doc_refs()
                    if (why := _check(span)) is not None})
    assert not wrong, "stale references:\n" + "\n".join(wrong)


def test_what_docstrings_name_exists():
    wrong = sorted({f"{where}: `{ref}`: {why}" for where, ref, base in _docstring_refs()
                    if (why := (_check_path(ref) if _PATH.fullmatch(ref)
                                else _resolve(ref, base))) is not None})
    assert not wrong, "stale references:\n" + "\n".join(wrong)


@pytest.mark.parametrize("span, ok", [
    ("ucxrpc/transport/engine.py", True), ("ucxrpc/transport/nowhere.py", False),
    ("Transport._break", True), ("Transport._no_such", False),
    ("staging.finish", True), ("wire.gather.Gather", True),
    ("UnreachableError", True), ("NoSuchClassAnywhere", False),
    ("RETRY_S", True), ("torch.cuda.ExternalStream", True),
    ("pipe.out.state", True), ("pipe.out.no_such_field_anywhere", False),
])
def test_the_resolver_tells_right_from_stale(span, ok):
    assert (_check(span) is None) is ok, _check(span)
