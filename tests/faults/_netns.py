"""Two network namespaces joined by a veth pair: two hosts on one machine.

Needs root and iproute2's ``ip``; :func:`netns_pair` raises
:class:`Unavailable` (the test skips with its reason) when either is
missing or the kernel refuses.  Names carry this process's id, so
concurrent sessions do not collide; addresses are private to the pair
(each namespace has only its loopback and its end of the veth).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ADDRESSES = ("10.214.0.1", "10.214.0.2")
PREFIX_LEN = 30


class Unavailable(Exception):
    """Network namespaces cannot be made here; the message says why."""


@dataclass(frozen=True)
class Side:
    netns: str
    veth: str
    address: str


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raises CalledProcessError with its stderr on failure."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return proc


def set_link(side: Side, state: str) -> None:
    """``ip link set VETH up|down`` inside the side's namespace."""
    ip("-n", side.netns, "link", "set", side.veth, state)


@contextmanager
def netns_pair() -> Iterator[tuple[Side, Side]]:
    """Make namespaces A and B with a veth link between them; delete both after.

    Raises:
        Unavailable: not root, no ``ip``, or ``ip netns add`` or the veth
            set-up refused.
    """
    if os.geteuid() != 0:
        raise Unavailable("needs root to create network namespaces")
    if shutil.which("ip") is None:
        raise Unavailable("needs iproute2's `ip` command")
    tag = f"ucxf{os.getpid()}"
    a = Side(f"{tag}a", f"vf{os.getpid()}a", ADDRESSES[0])
    b = Side(f"{tag}b", f"vf{os.getpid()}b", ADDRESSES[1])
    made: list[str] = []
    try:
        for side in (a, b):
            proc = ip("netns", "add", side.netns, check=False)
            if proc.returncode != 0:
                raise Unavailable(f"`ip netns add` failed: {proc.stderr.strip()}")
            made.append(side.netns)
        try:
            ip("link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
            for side in (a, b):
                ip("link", "set", side.veth, "netns", side.netns)
                ip("-n", side.netns, "addr", "add", f"{side.address}/{PREFIX_LEN}",
                   "dev", side.veth)
                ip("-n", side.netns, "link", "set", "lo", "up")
                set_link(side, "up")
        except subprocess.CalledProcessError as exc:
            raise Unavailable(f"cannot set up the veth link: `{' '.join(exc.cmd)}`: "
                              f"{exc.stderr.strip()}") from exc
        yield a, b
    finally:
        # Deleting a namespace deletes the veth end inside it, and so the pair.
        for name in made:
            ip("netns", "del", name, check=False)
