"""Two simulated hosts on one machine: network namespaces joined by a veth pair.

The tests' two-host tier (``tests/hosts/``), the partition tests
(``tests/faults/test_partition.py``) and ``ucxrpc bench --hosts netns``
(:mod:`ucxrpc.bench.simhosts`) run ucxrpc between two hosts that share
nothing but a link, on one Linux machine:

* each :class:`Host` is a network namespace with its loopback up and one end
  of a veth pair, addressed in a private ``/30``;
* with ``isolate=True`` (the default) a worker started on a host also gets
  UTS, IPC, PID and mount namespaces of its own (``unshare``), a private
  tmpfs on ``/dev/shm``, the host's name as hostname and an ``/etc/hosts``
  that names both hosts (names resolve from it alone: a host has no DNS).
  So UCX's shared-memory transports (System V segments live in the IPC
  namespace, POSIX ones in ``/dev/shm``, and UCX tells machines apart by
  hostname) and ucxrpc's reads by address
  (:mod:`ucxrpc.transport.hostmem.cma` checks the PID namespace) cannot
  join two workers on different hosts: UCX must pick ``tcp`` over the veth,
  as between two machines.  The filesystem is still shared, so paths, the
  virtualenv and control files work on both hosts.

Names (``<tag><pid>a``, ``<tag><pid>b``, then ``<tag><pid>a1``... for a
process's later pairs) carry this process's id, so concurrent sessions
never collide; the veth ends are made inside their namespaces, never in the
caller's, and are named like their host.  A pair's addresses are
``10.X.Y.Z/30`` with ``X.Y.Z`` from ``(pid + 32768 * n) mod 2**22`` for the
process's ``n``-th pair: one-to-one for the pids of Linux's default
``pid_max`` (32768) and a process's first 128 pairs.  A collision beyond
that would be harmless anyway: an address is only ever seen inside its
pair's two namespaces, which hold nothing else but loopback.

Needs root, iproute2's ``ip`` and util-linux's ``unshare`` and ``mount``
(and ``iptables-legacy`` for :meth:`Hosts.drop`); :class:`Unavailable`
says which is missing, or what the kernel refused.  Standard library only.

Threads: a :class:`Hosts` is used by the thread that made it; its workers
die with that thread (``PR_SET_PDEATHSIG``), so start them from a thread
that outlives them.
"""

from __future__ import annotations

import enum
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .._launch import die_with_parent

__all__ = ["ISOLATION", "Host", "Hosts", "Unavailable"]

#: The namespaces ``unshare`` gives a worker started with ``isolate=True``;
#: ``--fork`` makes the worker PID 1 of its PID namespace, ``--kill-child``
#: SIGKILLs it when ``unshare`` dies, and the kernel then kills everything
#: left in that namespace: a SIGKILL of the Popen takes the whole worker down.
ISOLATION = ("unshare", "--uts", "--ipc", "--pid", "--mount", "--fork", "--kill-child",
             "--mount-proc")

# Run by `sh -c` in the worker's namespaces: $0 is the host's name, $1 the
# hosts file, $2 the name service switch, the rest the worker's argv.  The
# mount namespace is private (unshare's default propagation), so no mount
# reaches the caller's.  Names resolve from the hosts file alone: a host
# has no DNS, and c10d's store looks up each client's address by name
# (a lookup that fails prints a warning in every worker's output).
_SETUP = ('mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm'
          ' && mount --bind "$1" /etc/hosts'
          ' && { [ ! -e /etc/nsswitch.conf ] || mount --bind "$2" /etc/nsswitch.conf; }'
          ' && hostname "$0" && shift 2 && exec "$@"')

_PREFIX_LEN = 30
_IP_TIMEOUT_S = 10.0
_MAX_NAME = 15  # IFNAMSIZ - 1: the veth ends are named like their hosts
_TAG = re.compile(r"[a-z]{1,4}")
_PAIRS = itertools.count()  # this process's pairs, for their names and addresses


class Unavailable(Exception):
    """Simulated hosts cannot be made here; the message says why (not root,
    no ``ip``, no ``unshare``, no ``iptables-legacy``, the kernel refused)."""


@dataclass(frozen=True)
class Host:
    """One simulated host.

    Attributes:
        index: 0 or 1.
        netns: the network namespace's name (``ip netns``).
        veth: its end of the veth pair, the interface name inside the
            namespace (what ``UCX_NET_DEVICES`` names).
        address: its IPv4 address on the veth.
    """

    index: int
    netns: str
    veth: str
    address: str


class _State(enum.Enum):
    NEW = "new"        # names chosen, nothing made
    OPEN = "open"      # both namespaces and the link made (or being made)
    CLOSED = "closed"  # everything made deleted; for good


def _addresses(pid: int, pair: int) -> tuple[str, str]:
    net = ipaddress.IPv4Address("10.0.0.0") + (((pid + 32768 * pair) % 2**22) << 2)
    return str(net + 1), str(net + 2)


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=_IP_TIMEOUT_S,
                          check=False)


class Hosts:
    """Two simulated hosts joined by a link; a context manager.

    ``with Hosts() as hosts:`` makes both namespaces and the link (raising
    :class:`Unavailable` where it cannot, with nothing left behind);
    leaving the block, or :meth:`close`, kills the workers started by
    :meth:`popen` that still run and deletes exactly the namespaces this
    object made (a namespace takes its veth end with it).  ``close`` is
    idempotent and always releases; nothing may be started afterwards.

    Args:
        tag: 1 to 4 lowercase letters starting every name (default ``ucxh``).

    Raises:
        ValueError: a malformed ``tag``.
    """

    hosts: tuple[Host, Host]

    def __init__(self, tag: str = "ucxh") -> None:
        if not _TAG.fullmatch(tag):
            raise ValueError(f"tag must be 1 to 4 lowercase letters, not {tag!r}")
        pid, pair = os.getpid(), next(_PAIRS)
        names = [f"{tag}{pid}{side}{pair or ''}" for side in "ab"]
        if max(map(len, names)) > _MAX_NAME:
            raise ValueError(f"{names[0]!r} is too long for an interface name: too many pairs "
                             "in one process, or a longer tag")
        addresses = _addresses(pid, pair)
        self.hosts = (Host(0, names[0], names[0], addresses[0]),
                      Host(1, names[1], names[1], addresses[1]))
        self._state = _State.NEW
        self._made: list[str] = []                 # namespaces made, to delete
        self._procs: list[subprocess.Popen[Any]] = []
        self._dropping: set[int] = set()           # hosts with drop(on=True) in force
        self._dir: str | None = None               # the hosts file's directory

    # -- life ------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        self._open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _open(self) -> None:
        if self._state is not _State.NEW:
            raise RuntimeError(f"these hosts are {self._state.value}: make a new Hosts")
        if os.geteuid() != 0:
            raise Unavailable("simulated hosts need root (network namespaces, mounts)")
        for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"),
                              ("mount", "util-linux"), ("hostname", "hostname")):
            if shutil.which(tool) is None:
                raise Unavailable(f"simulated hosts need `{tool}` ({package}), not on PATH")
        self._state = _State.OPEN
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        a, b = self.hosts
        for host in self.hosts:
            self._ip("netns", "add", host.netns, what="make a network namespace")
            self._made.append(host.netns)
        # Made inside the namespaces: the caller's namespace never holds the
        # ends, so their names cannot clash with its interfaces.
        self._ip("link", "add", a.veth, "netns", a.netns, "type", "veth", "peer", "name",
                 b.veth, "netns", b.netns, what="make the veth pair")
        for host in self.hosts:
            self._ip("-n", host.netns, "addr", "add", f"{host.address}/{_PREFIX_LEN}", "dev",
                     host.veth, what="address the veth")
            self._ip("-n", host.netns, "link", "set", "lo", "up", what="bring loopback up")
            self.set_link(host, True)
        self._await_carrier()
        self._dir = tempfile.mkdtemp(prefix=f"{a.netns}-")
        with open(os.path.join(self._dir, "hosts"), "w") as f:
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                    + "".join(f"{h.address}\t{h.netns}\n" for h in self.hosts))
        os.chmod(os.path.join(self._dir, "hosts"), 0o644)
        try:
            with open("/etc/nsswitch.conf") as f:
                switch = [line for line in f if not line.startswith("hosts:")]
        except OSError:
            switch = []
        with open(os.path.join(self._dir, "nsswitch.conf"), "w") as f:
            f.writelines([*switch, "hosts: files\n"])
        os.chmod(os.path.join(self._dir, "nsswitch.conf"), 0o644)
        # What a container may refuse (a PID namespace, mounting proc or
        # tmpfs) is found here, once, rather than in every worker.
        probe = _run(self.command(a, ["true"]))
        if probe.returncode != 0:
            raise Unavailable(f"cannot isolate a worker: `{' '.join(ISOLATION)} ...` exited "
                              f"with {probe.returncode}: {probe.stderr.strip()}")

    def _await_carrier(self) -> None:
        # The link carries packets once each end sees its peer up (carrier,
        # LOWER_UP); a worker started before that would find its first
        # connection failing.  It takes milliseconds.
        deadline = time.monotonic() + _IP_TIMEOUT_S
        for host in self.hosts:
            while True:
                shown = _run(["ip", "-n", host.netns, "-br", "link", "show", "dev", host.veth])
                if "LOWER_UP" in shown.stdout:
                    break
                if time.monotonic() > deadline:
                    raise Unavailable(f"the veth link did not come up within {_IP_TIMEOUT_S:g} s: "
                                      f"{shown.stdout.strip() or shown.stderr.strip()}")
                time.sleep(0.01)

    def close(self) -> None:
        """Kill this object's workers still running, delete its namespaces
        and hosts file.  Idempotent; never raises for what is already gone."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=_IP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        for name in self._made:
            _run(["ip", "netns", "del", name])
        self._made.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- workers ---------------------------------------------------------------

    def command(self, host: Host, argv: Sequence[str], *, isolate: bool = True) -> list[str]:
        """The command line that runs ``argv`` on ``host``.

        ``isolate=True``: inside the host's network namespace and namespaces
        of its own (:data:`ISOLATION`), with a private ``/dev/shm``, the
        host's name as hostname and the pair's ``/etc/hosts``; ``argv`` runs
        as PID 1 of its PID namespace (it reaps no orphans, and signals
        without a handler are ignored there; see :meth:`worker_pid`).
        ``isolate=False``: only inside the network namespace.

        Raises:
            RuntimeError: the hosts are not open.
        """
        self._check_open()
        self._check_host(host)
        enter = ["ip", "netns", "exec", host.netns]
        if not isolate:
            return [*enter, *argv]
        assert self._dir is not None
        return [*enter, *ISOLATION, "sh", "-c", _SETUP, host.netns,
                os.path.join(self._dir, "hosts"), os.path.join(self._dir, "nsswitch.conf"),
                *argv]

    def popen(self, host: Host, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              isolate: bool = True, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host`` (:meth:`command`); returns its Popen.

        The child dies with the calling thread (``PR_SET_PDEATHSIG``, set
        before any ``preexec_fn`` of ``kwargs``), and with ``isolate=True``
        a SIGKILL of the Popen takes the whole worker down.  Other signals
        reach ``unshare``, not the worker: it holds SIGTERM and SIGINT back
        and dies of the rest (so the worker too); signal the worker by
        :meth:`worker_pid`.  :meth:`close` kills it if it still runs.

        Args:
            env: the environment (default ``os.environ``), with
                ``UCX_NET_DEVICES`` set to the host's veth unless it names
                that variable itself.
            kwargs: passed to ``subprocess.Popen`` (``cwd``, ``stdout``...).

        Raises:
            RuntimeError: the hosts are not open.
            OSError: as ``subprocess.Popen``.
        """
        environ = dict(os.environ if env is None else env)
        environ.setdefault("UCX_NET_DEVICES", host.veth)
        theirs: Callable[[], object] | None = kwargs.pop("preexec_fn", None)

        def preexec() -> None:
            die_with_parent()
            if theirs is not None:
                theirs()

        proc = subprocess.Popen(self.command(host, argv, isolate=isolate), env=environ,
                                preexec_fn=preexec, **kwargs)
        self._procs.append(proc)
        return proc

    @staticmethod
    def worker_pid(proc: subprocess.Popen[Any], *, isolate: bool = True) -> int | None:
        """The pid, as this process sees it, of the program a :meth:`popen`
        started (``unshare``'s child with ``isolate=True``: the one to send a
        signal such as SIGUSR1 to), or ``None`` while it is not started yet
        or once it has ended."""
        if not isolate:
            return proc.pid if proc.poll() is None else None
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = f.read().split()
        except OSError:  # gone, or a kernel without the children file
            children = _children_by_scan(proc.pid)
        return int(children[0]) if children else None

    # -- the link --------------------------------------------------------------

    def set_link(self, host: Host, up: bool) -> None:
        """``ip link set VETH up|down`` inside ``host``'s namespace.

        Raises:
            RuntimeError: the hosts are not open.
            Unavailable: ``ip`` refused (its message).
        """
        self._check_open()
        self._check_host(host)
        self._ip("-n", host.netns, "link", "set", host.veth, "up" if up else "down",
                 what="set the link")

    def drop(self, host: Host, on: bool) -> None:
        """Silently drop every packet arriving at ``host`` (a failed switch:
        nothing answers, nothing is refused), or stop doing so.

        ``on=True`` inserts ``-I INPUT -i VETH -j DROP`` in the host's
        namespace with ``iptables-legacy``, once; ``on=False`` deletes
        exactly that rule.  Either is a no-op when already in force.

        Raises:
            RuntimeError: the hosts are not open.
            Unavailable: no ``iptables-legacy``, or it refused.
        """
        self._check_open()
        self._check_host(host)
        if on == (host.index in self._dropping):
            return
        if shutil.which("iptables-legacy") is None:
            raise Unavailable("dropping packets needs `iptables-legacy` (Debian's iptables "
                              "package); the nft backend is not used")
        # -w: the xtables lock is one file for every namespace on the machine.
        self._ip("netns", "exec", host.netns, "iptables-legacy", "-w", "10",
                 "-I" if on else "-D", "INPUT", "-i", host.veth, "-j", "DROP",
                 what="drop packets" if on else "stop dropping packets")
        if on:
            self._dropping.add(host.index)
        else:
            self._dropping.discard(host.index)

    # -- helpers ---------------------------------------------------------------

    def _ip(self, *args: str, what: str) -> None:
        proc = _run(["ip", *args])
        if proc.returncode != 0:
            raise Unavailable(f"cannot {what}: `ip {' '.join(args)}` exited with "
                              f"{proc.returncode}: {proc.stderr.strip()}")

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise RuntimeError(f"these hosts are {self._state.value}, not open (use `with`)")

    def _check_host(self, host: Host) -> None:
        if host not in self.hosts:
            raise ValueError(f"{host} is not one of these hosts")


def _children_by_scan(pid: int) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(entry)
    return found

