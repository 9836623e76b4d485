"""UCX's failures as ucxrpc's errors: the one mapping, for both bindings.

A request fails the same way to everything above, whether ucxx made it
(:mod:`.binding`, whose exceptions carry UCX's status as text) or libucp did
through ctypes (:mod:`.ucp`, a status code, named by ``ucs_status_string``):
a :class:`~ucxrpc.errors.BrokenError` saying what failed and, where known,
UCX's status, chained to ucxx's exception where there is one.  No ucxx
type reaches a caller: this is where they stop (docs/architecture.md, the
error boundary).
"""

from __future__ import annotations

from ...errors import BrokenError, ConnectError

__all__ = ["endpoint_closed", "endpoint_failed", "open_failed", "request_failed"]


def request_failed(detail: str, status: int | None = None,
                   cause: BaseException | None = None) -> BrokenError:
    """A send or receive UCX could not complete: ``detail`` (UCX's words),
    its ``status`` code where known, ucxx's exception as the cause."""
    err = BrokenError(f"UCX request failed: {detail}"
                      + (f" (status {status})" if status is not None else ""))
    err.__cause__ = cause
    return err


def endpoint_failed(status: object) -> BrokenError:
    """UCX reported an endpoint's failure (its error callback): the peer or
    the network failed."""
    return BrokenError(f"UCX endpoint failed: {status}")


def endpoint_closed() -> BrokenError:
    """A send on an endpoint this side closed already."""
    return BrokenError("UCX endpoint already closed")


def open_failed(cause: BaseException) -> ConnectError:
    """An endpoint could not be made from the peer's address."""
    err = ConnectError(f"cannot open a UCX endpoint: {cause}")
    err.__cause__ = cause
    return err
