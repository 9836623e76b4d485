"""A worker's identity, as torch's ``WorkerInfo``."""

from __future__ import annotations

from typing import Any

__all__ = ["WorkerInfo"]


class WorkerInfo:
    """A worker's name and id; hashable, picklable, equal by both."""

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int) -> None:  # noqa: A002  (torch's field name)
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
