"""``ucxrpc.nn``: modules that live on another worker."""

from __future__ import annotations

from .remote_module import RemoteModule

__all__ = ["RemoteModule"]
