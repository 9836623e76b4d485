"""Timeouts, turned from torch's conventions into one value at the API.

torch's RPC calls take ``-1`` (``UNSET_RPC_TIMEOUT``) for "the default" and
``0`` for "no limit" (another negative value is refused here); its ``shutdown`` takes ``0`` for "no limit" and a
negative value for "the RPC timeout"; its options take ``rpc_timeout=0``
for "none".  Below the API every timeout is :data:`Seconds`: a positive
number of seconds, or None for no limit, so no layer below tests for ``0``
or ``-1`` or invents a large number that stands for "forever".
"""

from __future__ import annotations

from typing import Optional

__all__ = ["Seconds", "UNSET", "for_call", "for_wait", "of_option"]

#: A timeout below the API: seconds (> 0), or None for no limit.
Seconds = Optional[float]

#: torch's ``UNSET_RPC_TIMEOUT``: use the default.
UNSET = -1.0


def of_option(rpc_timeout: float) -> Seconds:
    """The options' ``rpc_timeout`` (0: none)."""
    return float(rpc_timeout) if rpc_timeout > 0 else None


def for_call(timeout: float | None, default: Seconds) -> Seconds:
    """A call's ``timeout``: :data:`UNSET` (or None) for ``default``, 0 for
    no limit, else seconds (``rpc_sync``, ``rpc_async``, ``remote``,
    ``to_here``, proxies).

    Raises:
        ValueError: any other negative value, naming it.  torch takes only
            its sentinel -1 for "the default"; with any other negative
            value torch 2.13's agent fails the call at once ("RPC ran for
            more than set timeout (-5000 ms)"): a mistake, best reported
            where it is made.
    """
    if timeout is None or timeout == UNSET:
        return default
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (0: no limit), or {UNSET} (torch's "
                         f"UNSET_RPC_TIMEOUT) for the default RPC timeout; got {timeout!r}")
    return float(timeout) if timeout > 0 else None


def for_wait(timeout: float | None, default: Seconds) -> Seconds:
    """``shutdown``'s ``timeout``: 0 (or None) for no limit, negative for
    ``default``, else seconds."""
    if timeout is None or timeout == 0:
        return None
    return default if timeout < 0 else float(timeout)
