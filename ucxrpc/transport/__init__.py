"""UCX transport: the only layer that imports ucxx (inside :mod:`.ucx`)."""

from __future__ import annotations

from .engine import MAX_WORKER_ID, SPIN_S, Transport
from .pipe import Peer
from .wire.frame import Limits

__all__ = ["Transport", "Limits", "MAX_WORKER_ID", "Peer", "SPIN_S"]
