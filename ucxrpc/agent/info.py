"""A worker's identity, as torch's ``WorkerInfo``."""

from __future__ import annotations

import re
from typing import Any

from ..errors import WorkerNameError

__all__ = ["WorkerInfo", "check_name"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]+$")
MAX_NAME_LEN = 128


def check_name(name: str) -> None:
    """torch's rule for worker names, in torch's words: letters, digits,
    ``_``, ``:`` and ``-``, not empty, shorter than 128 characters.

    Raises:
        WorkerNameError: (a RuntimeError and a ValueError) saying which part.
    """
    if not isinstance(name, str):
        raise WorkerNameError(f"Worker name must be a string, got {type(name).__name__}")
    if not name:
        raise WorkerNameError("Worker name must be non-empty")
    if len(name) >= MAX_NAME_LEN:
        raise WorkerNameError(f"Worker name must be shorter than {MAX_NAME_LEN} characters, "
                              f"got {len(name)}")
    if not _NAME_RE.match(name):
        raise WorkerNameError(f"Worker name must match ^[A-Za-z0-9-_:]*$, got {name!r}")


class WorkerInfo:
    """A worker's name and id; hashable, picklable, equal by both."""

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int) -> None:  # noqa: A002  (torch's field name)
        check_name(name)
        self.name = name
        self.id = id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and (self.id, self.name) == (other.id, other.name)

    def __hash__(self) -> int:
        return hash((self.id, self.name))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerInfo, (self.name, self.id))
