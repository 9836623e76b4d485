"""``ucxrpc bench --hosts netns``: the benchmark across two simulated hosts.

The invoking process (on the machine, root) makes a
:class:`~ucxrpc.bench.netns.Hosts` pair and starts one ``ucxrpc bench`` on
each host, launched as the cross-host mode (:mod:`ucxrpc.bench.hosts`)
expects: ``RANK=0`` on host 0 and ``RANK=1`` on host 1, ``WORLD_SIZE=2``,
``MASTER_ADDR`` host 0's address on the veth, ``MASTER_PORT``
:data:`MASTER_PORT` (the namespaces are new: nothing holds it), and
``UCX_NET_DEVICES`` (with TensorPipe's ``TP_SOCKET_IFNAME`` and Gloo's
``GLOO_SOCKET_IFNAME``) the host's veth.  Each rank is isolated as
:meth:`~ucxrpc.bench.netns.Hosts.command` describes (its own hostname, PID,
IPC and mount namespaces, a private ``/dev/shm``), so neither UCX nor
TensorPipe finds shared memory between the two: ucxrpc, torch's agent and
raw ucxx all go over TCP on the veth, found by themselves (no ``UCX_TLS`` is
set).

Both ranks get the user's arguments (rank 0's apply to both, as across real
hosts) and :data:`ENV`, which tells them to run as launched ranks whatever
``--hosts`` and ``--local`` say, and tells rank 0 what to record: the JSON's
``config.hosts`` is ``"netns"`` and ``machine.simulated_hosts`` names the
machine and the two hosts.  Rank 0 writes to the invoker's stdout and
stderr (header, progress bar, table, the files written), as a local run
does; rank 1's output goes to a temporary file, shown when something failed.
The ranks run in a session of their own, so a Ctrl-C reaches only the
invoker, which then ends them.

The invoker waits for both and always ends them and deletes the namespaces
(on an error, Ctrl-C or SIGTERM too): SIGKILL of a rank's Popen takes its
whole PID namespace down, its runs' children with it.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from .netns import Host, Hosts, Unavailable

__all__ = ["ENV", "MASTER_PORT", "rank_env", "run", "simulated_hosts"]

#: Set by the invoker for both ranks: JSON naming the machine and the hosts.
ENV = "UCXRPC_BENCH_SIMULATED_HOSTS"
#: rank 0's store, on host 0's veth address.
MASTER_PORT = 29500

_TAG = "ucxb"
_GRACE_S = 60.0      # beyond --timeout: both ranks' start-up (torch) and the goodbye
_END_S = 20.0        # one rank has ended: how long the other gets to end too
_POLL_S = 0.1
_LOG_LINES = 40      # of rank 1's output, shown when something failed
# Launcher variables the ranks must not inherit from the invoker's environment.
_DROPPED_PREFIXES = ("TORCHELASTIC_",)
_DROPPED = ("LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE")


def simulated_hosts(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """What the invoker set in :data:`ENV`: ``None`` outside a simulated-host rank.

    Raises:
        ValueError: :data:`ENV` is set but is not such a document.
    """
    text = environ.get(ENV)
    if not text:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("kind") != "netns":
        raise ValueError(f"{ENV} is set but malformed ({text[:80]!r}); it is set by "
                         "`ucxrpc bench --hosts netns` for the ranks it starts")
    return doc


def _document(hosts: Hosts, command: str) -> dict[str, Any]:
    return {"kind": "netns", "machine": socket.gethostname(), "command": command,
            "link": "veth",
            "hosts": [{"name": h.netns, "address": h.address, "device": h.veth}
                      for h in hosts.hosts]}


def rank_env(hosts: Hosts, host: Host, document: Mapping[str, Any],
             environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment of the rank on ``host`` (its rank is the host's index)."""
    env = {k: v for k, v in environ.items()
           if k not in _DROPPED and not k.startswith(_DROPPED_PREFIXES)}
    # The ranks import the ucxrpc the invoker runs, wherever they start.
    package_root = str(Path(__file__).resolve().parents[2])
    env.update({
        "RANK": str(host.index), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
        "MASTER_ADDR": hosts.hosts[0].address, "MASTER_PORT": str(MASTER_PORT),
        "UCX_NET_DEVICES": host.veth, "TP_SOCKET_IFNAME": host.veth,
        "GLOO_SOCKET_IFNAME": host.veth,
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root, environ.get("PYTHONPATH")])),
        ENV: json.dumps(document),
    })
    return env


def _tail(log: IO[bytes]) -> str:
    log.flush()
    log.seek(0)
    lines = log.read().decode(errors="replace").splitlines()
    return "\n".join(lines[-_LOG_LINES:])


def _wait(procs: Sequence[subprocess.Popen[Any]],
          timeout_s: float) -> tuple[int | None, int | None, str | None]:
    """Wait for both ranks; their exit codes (``None``: still running, to be
    killed) and why the wait gave up, if it did."""
    rank0, rank1 = procs
    deadline = time.monotonic() + timeout_s + _GRACE_S
    while rank0.poll() is None:
        if rank1.poll() not in (None, 0):
            # Rank 1 failed: rank 0 sees it (or ends its run) and stops soon;
            # waiting for a rank 1 that left would take it the whole --timeout.
            try:
                rank0.wait(_END_S)
            except subprocess.TimeoutExpired:
                return None, rank1.returncode, (f"rank 1 failed (exit code {rank1.returncode}) "
                                                f"and rank 0 did not end within {_END_S:g} s")
            break
        if time.monotonic() > deadline:
            return None, rank1.poll(), (f"rank 0 did not end within --timeout + {_GRACE_S:g} s "
                                        f"({timeout_s + _GRACE_S:g} s)")
        time.sleep(_POLL_S)
    try:   # rank 0 waited for rank 1's goodbye: rank 1 ends at once
        rank1.wait(_END_S)
    except subprocess.TimeoutExpired:
        pass
    return rank0.returncode, rank1.poll(), None


def run(argv: Sequence[str], timeout_s: float, *, command: str | None = None,
        err: IO[str] | None = None) -> int:
    """Run ``ucxrpc bench argv`` as two ranks on two simulated hosts.

    Args:
        argv: the user's arguments (``--hosts netns`` among them: the ranks
            ignore it, seeing :data:`ENV`).
        timeout_s: the run's ``--timeout``; the ranks keep to it themselves,
            the invoker gives up (and kills them) a minute after it.
        command: what the user ran, for the JSON (default: ``sys.argv``).
        err: where the invoker's own messages go (default: ``sys.stderr``).

    Returns:
        rank 0's exit code (0, 1 or 2, as :func:`ucxrpc.bench.main`), at
        least 1 when rank 1 failed or the ranks had to be killed; 2 when
        simulated hosts cannot be made here; 130 on Ctrl-C.
    """
    err = sys.stderr if err is None else err
    command = shlex.join(sys.argv) if command is None else command
    bench = [sys.executable, "-m", "ucxrpc.bench", *argv]
    with tempfile.TemporaryFile() as log:
        try:
            with Hosts(tag=_TAG) as hosts:
                document = _document(hosts, command)
                procs = []
                for host in hosts.hosts:
                    output: dict[str, Any] = {} if host.index == 0 else \
                        {"stdout": log, "stderr": subprocess.STDOUT}
                    procs.append(hosts.popen(host, bench, env=rank_env(hosts, host, document),
                                             cwd=os.getcwd(), stdin=subprocess.DEVNULL,
                                             start_new_session=True, **output))
                code0, code1, gave_up = _wait(procs, timeout_s)
        except Unavailable as exc:
            print(f"ucxrpc bench: error: --hosts netns: {exc}; two simulated hosts need root, "
                  "iproute2 (`ip`) and util-linux (`unshare`, `mount`)", file=err)
            return 2
        except KeyboardInterrupt:
            print("ucxrpc bench: interrupted; both ranks ended, the simulated hosts deleted",
                  file=err)
            return 130
        # Leaving the block killed what still ran and deleted the namespaces.
        if gave_up is not None:
            print(f"ucxrpc bench: error: --hosts netns: {gave_up}; both ranks killed",
                  file=err)
        rank1_failed = code1 not in (0, None)
        lingered = gave_up is None and code1 is None
        if lingered:
            print(f"ucxrpc bench: warning: rank 1 did not end within {_END_S:g} s of rank 0; "
                  "killed", file=err)
        failed = gave_up is not None or code0 != 0 or rank1_failed
        if (failed or lingered) and (text := _tail(log)):
            state = "killed" if code1 is None else f"exit code {code1}"
            print(f"\nrank 1 ({state}), last lines:\n{text}", file=err)
        if code0 is None or code0 < 0:
            return 1
        return max(code0, 1) if failed else 0
