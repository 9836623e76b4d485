"""The base of ucxrpc's state and reason enums.

A plain ``enum.Enum`` member hashes in Python (``Enum.__hash__`` returns
``hash(self._name_)``): a function call each time one is a dict key or a set
member, and the progress loop's reasons (``why in POLLS``) and owner moves
(``_MOVES[owner]``) did so about 18 times per no-op call on each side
(counted with ``sys.setprofile``; none before the owner table).  Members are
singletons compared by identity, so identity's hash (C) is as correct.
"""

from __future__ import annotations

import enum

__all__ = ["StateEnum"]


class StateEnum(enum.Enum):
    """An Enum whose members hash by identity, in C."""

    __hash__ = object.__hash__
