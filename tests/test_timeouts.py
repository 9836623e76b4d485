"""torch's timeout conventions, turned once into seconds or None (timeouts.py)."""

from __future__ import annotations

import pytest

from ucxrpc import timeouts
from ucxrpc.errors import BrokenError, PeerLeftError


@pytest.mark.parametrize("given, default, want", [
    (-1, 60.0, 60.0), (None, 60.0, 60.0), (-1, None, None),  # torch's UNSET: the default
    (0, 60.0, None), (0.0, None, None),                       # 0: no limit
    (2.5, 60.0, 2.5), (2, None, 2.0)])
def test_a_calls_timeout(given, default, want) -> None:
    assert timeouts.for_call(given, default) == want


@pytest.mark.parametrize("given", [-5, -0.5, -1.5, -1e-9, float("-inf")])
def test_a_negative_timeout_other_than_torchs_unset_is_refused(given) -> None:
    # torch's agent fails such a call at once ("RPC ran for more than set
    # timeout (-5000 ms)"); here it is a mistake named where it is made.
    with pytest.raises(ValueError, match=rf"timeout must be >= 0 .*got {given!r}"):
        timeouts.for_call(given, 60.0)


@pytest.mark.parametrize("given, default, want", [
    (0, 60.0, None), (None, 60.0, None),  # shutdown's default: as long as the job runs
    (-1, 60.0, 60.0), (-1, None, None), (3, 60.0, 3.0)])
def test_shutdowns_timeout(given, default, want) -> None:
    assert timeouts.for_wait(given, default) == want


def test_the_options_timeout() -> None:
    assert timeouts.of_option(0) is None and timeouts.of_option(60) == 60.0


def test_a_peer_that_left_is_a_broken_one() -> None:
    # Callers that catch a dead peer's BrokenError catch a departed one's too.
    assert issubclass(PeerLeftError, BrokenError)
