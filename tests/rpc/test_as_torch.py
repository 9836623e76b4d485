"""A program that imports torch's RPC itself, run on ucxrpc unchanged
(``python -m ucxrpc.torch_rpc``, :mod:`ucxrpc.torch_rpc`).

* The launcher runs ``_torch_program.py`` (nothing of ucxrpc in it): its
  main process and the children it starts with ``torch.multiprocessing.spawn``,
  a forkserver, ``multiprocessing.Process`` and ``subprocess`` each see
  ucxrpc where they import ``torch.distributed.rpc`` and its autograd, and
  each pair completes an RPC and a distributed backward between its two
  workers; TorchScript compiles a call to ``torch.distributed.rpc.is_available()``.
* ``-m module``, the program's arguments, ``sys.path[0]`` and exit status
  are those ``python`` would give it.
* The ``sitecustomize`` children get runs the one it hides, swaps nothing
  where ``UCXRPC_TORCH_RPC`` is unset or ucxrpc cannot be imported (with a
  warning), and imports nothing (not even torch) in a process that does
  not import torch.
* In this process, :func:`install` swaps torch's modules in place and
  leaves torch's own references to its RPC alone (in a child: it rewrites
  ``sys.modules``).

Every program runs in its own session, bounded in time; its whole process
group is killed afterwards, and every process it reported must be gone.  A
test's programs are independent of one another and start at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ucxrpc.torch_rpc import ENV_VAR, site_dir

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).with_name("_torch_program.py")
RUN_S = 120.0  # below the test's timeout, so that this error is the one reported


def _start(args: list[str], *, cwd: Path = ROOT,
           env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``python args...`` in a session of its own; :func:`_finish` ends it."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _finish(*procs: subprocess.Popen[str],
            timeout: float = RUN_S) -> list[subprocess.CompletedProcess[str]]:
    """Wait for programs started together, under one deadline; kill each one's
    session after.  (Each program imports torch: seconds of CPU.  Run one
    after another they leave a core idle; a test's programs are independent.)"""
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                outputs.append(("", f"(still running after {timeout} s: killed)"))
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            for proc, (out, err) in zip(procs, outputs)]


def _run(args: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None,
         timeout: float = RUN_S) -> subprocess.CompletedProcess[str]:
    """Run ``python args...`` in a session of its own; kill the session after."""
    return _finish(_start(args, cwd=cwd, env=env), timeout=timeout)[0]


def _reports(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {r["who"]: r for r in lines}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def _assert_gone(pids: list[int]) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end and any(map(_alive, pids)):
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} outlived the program"


def test_a_program_and_every_child_it_starts_run_on_ucxrpc() -> None:
    result = _run(["-m", "ucxrpc.torch_rpc", str(PROGRAM)])
    reports = _reports(result)
    _assert_gone([r["pid"] for r in reports.values()])
    assert result.returncode == 0, result.stderr[-4000:]
    expected = {"main", "subprocess"} | {f"{group}/rank{rank}" for group in
                                         ("spawn", "forkserver", "process") for rank in (0, 1)}
    assert set(reports) == expected, result.stderr[-4000:]
    for who, report in reports.items():
        assert report["rpc"] == "ucxrpc.api", who
        assert report["autograd"].startswith("ucxrpc.autograd"), who
    assert reports["main"]["scripted"] == [2.0]  # TorchScript called rpc.is_available()
    for group in ("spawn", "forkserver", "process"):
        rank0 = reports[f"{group}/rank0"]
        assert rank0["callee"]["pid"] == reports[f"{group}/rank1"]["pid"]
        assert rank0["callee"]["rpc"] == "ucxrpc.api"
        assert rank0["grad"] == [2.0, 2.0, 2.0]
    assert len({r["pid"] for r in reports.values()}) == len(reports)  # all separate processes


def test_the_launcher_runs_a_module_or_a_file_as_python_would(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(
        "import json, sys, torch.distributed.rpc as rpc\n"
        "print(json.dumps({'who': __name__, 'argv': sys.argv, 'path0': sys.path[0],\n"
        "                  'rpc': rpc.init_rpc.__module__}))\n"
        "sys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    as_file, as_module, usage = _finish(
        _start(["-m", "ucxrpc.torch_rpc", str(tmp_path / "prog.py"), "a", "-b"], env=env),
        _start(["-m", "ucxrpc.torch_rpc", "-m", "prog", "c"], env=env),
        _start(["-m", "ucxrpc.torch_rpc"]))
    for result, argv1, path0 in ((as_file, ["a", "-b"], str(tmp_path)),
                                 (as_module, ["c"], str(ROOT))):
        assert result.returncode == 3, result.stderr[-4000:]
        report = _reports(result)["__main__"]
        assert report["argv"] == [str(tmp_path / "prog.py"), *argv1]
        assert report["path0"] == path0  # the program's directory; for -m, the working one
        assert report["rpc"] == "ucxrpc.api"
    assert usage.returncode == 2 and "usage: python -m ucxrpc.torch_rpc" in usage.stderr


def test_the_childrens_sitecustomize_chains_and_stays_out_of_the_way(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['HIDDEN_RAN'] = '1'\n")
    show = ("import json, os, sys\n"
            "mods = set(sys.modules)\n"
            "print(json.dumps({'who': 'child', 'hidden': os.environ.get('HIDDEN_RAN'),\n"
            "                  'torch': 'torch' in mods, 'ucxrpc': 'ucxrpc' in mods}))\n")
    with_rpc = show + ("import torch.distributed.rpc as rpc\n"
                       "print(json.dumps({'who': 'rpc', 'rpc': rpc.init_rpc.__module__}))\n")
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([site_dir(), str(tmp_path)])}
    base.pop(ENV_VAR, None)
    # An interpreter that cannot import ucxrpc (here: a broken one first on
    # its path) keeps torch's RPC and says why.
    broken = tmp_path / "elsewhere" / "ucxrpc"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('not this one')\n")
    on, off, elsewhere = _finish(
        _start(["-c", with_rpc], cwd=tmp_path, env={**base, ENV_VAR: "1"}),
        _start(["-c", with_rpc], cwd=tmp_path, env=base),
        _start(["-c", with_rpc], cwd=tmp_path, env={
            **base, ENV_VAR: "1",
            "PYTHONPATH": os.pathsep.join([base["PYTHONPATH"], str(broken.parent)])}))
    for result, module in ((on, "ucxrpc.api"), (off, "torch.distributed.rpc"),
                           (elsewhere, "torch.distributed.rpc")):
        assert result.returncode == 0, result.stderr[-4000:]
        reports = _reports(result)
        # The hidden sitecustomize ran; nothing was imported before torch was.
        assert reports["child"] == {"who": "child", "hidden": "1", "torch": False,
                                    "ucxrpc": False}
        assert reports["rpc"]["rpc"] == module
    assert "cannot import ucxrpc (not this one)" in elsewhere.stderr
    assert "torch.distributed.rpc stays torch's" in elsewhere.stderr


#: A sitecustomize that, like ucxrpc's (and coverage's, a site's), runs the
#: one it hides on the path; it counts its runs.
_CHAINING_SITECUSTOMIZE = """\
import importlib.machinery, importlib.util, os, sys
os.environ['OTHER_RAN'] = str(int(os.environ.get('OTHER_RAN', '0')) + 1)
here = os.path.dirname(os.path.abspath(__file__))
others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
spec = importlib.machinery.PathFinder.find_spec('sitecustomize', others)
if spec is not None:
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
"""


def test_the_childrens_sitecustomize_lives_beside_one_that_chains_too(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(_CHAINING_SITECUSTOMIZE)
    prog = ("import json, os, sys\n"
            "import torch, torch.distributed.rpc as rpc\n"
            "print(json.dumps({'who': 'child', 'other': os.environ.get('OTHER_RAN'),\n"
            "                  'rpc': rpc.init_rpc.__module__,\n"
            "                  'loader': type(torch.__spec__.loader).__name__,\n"
            "                  'patched': 'exec_module' in vars(torch.__spec__.loader)}))\n")
    base = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "OTHER_RAN")}
    # ucxrpc's first (as its children get it), then the other first (as a
    # harness may put its own): each runs once, ucxrpc is installed once,
    # and torch's loader is left as it was.
    orders = ([site_dir(), str(other)], [str(other), site_dir()])
    results = _finish(*(_start(["-c", prog], cwd=tmp_path, env={
        **base, ENV_VAR: "1", "PYTHONPATH": os.pathsep.join(order)}) for order in orders))
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
        assert "RecursionError" not in result.stderr, result.stderr[-4000:]
        assert _reports(result)["child"] == {"who": "child", "other": "1", "rpc": "ucxrpc.api",
                                             "loader": "SourceFileLoader", "patched": False}


def _install_here(init_method: str | None = None) -> dict[str, object]:
    import torch.nn.parallel.distributed as ddp

    import ucxrpc
    import ucxrpc.torch_rpc

    torch_rref = ddp.RRef
    ucxrpc.torch_rpc.install()
    ucxrpc.torch_rpc.install()  # idempotent
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    import torch.distributed.rpc.constants as constants
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer, ZeroRedundancyOptimizer
    from torch.distributed.rpc.backend_registry import construct_rpc_backend_options
    from torch.distributed.rpc.functions import async_execution

    try:
        rpc.register_backend  # noqa: B018
        missing = ""
    except AttributeError as exc:
        missing = str(exc)
    options = construct_rpc_backend_options(rpc.BackendType.TENSORPIPE, rpc_timeout=5)
    try:  # a decorator PyG applies at import; the call needs init_rpc
        rpc.api._require_initialized(len)([])
        uninitialized = ""
    except RuntimeError as exc:
        uninitialized = str(exc)
    pyg: list[object] = []
    if init_method is not None:  # what PyG's init_rpc asks, of torch's C module too
        from torch._C._distributed_rpc import _is_current_rpc_agent_set

        pyg.append(_is_current_rpc_agent_set())
        rpc.init_rpc("worker0", rank=0, world_size=1,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                         init_method=init_method, _transports=["ibv", "uv"]))
        try:
            pyg += [_is_current_rpc_agent_set(), rpc.api._all_gather(("trainer", 1, 0)),
                    [w.name for w in rpc._get_current_rpc_agent().get_worker_infos()]]
        finally:
            rpc.shutdown()
        pyg.append(_is_current_rpc_agent_set())
    return {
        "pyg": pyg,
        "rpc": rpc.rpc_sync is ucxrpc.rpc_sync and rpc.RRef is ucxrpc.RRef,
        "names": (rpc.BackendType.TENSORPIPE is ucxrpc.BackendType.UCX
                  and rpc.TensorPipeRpcBackendOptions is ucxrpc.TensorPipeRpcBackendOptions
                  and async_execution is ucxrpc.functions.async_execution
                  and constants.UNSET_RPC_TIMEOUT == -1.0 and rpc.is_available()
                  and dist_autograd.is_available()),
        "options": (type(options).__name__, options.rpc_timeout),
        "autograd": dist_autograd.backward is ucxrpc.autograd.backward,
        "optim": (DistributedOptimizer is ucxrpc.optim.DistributedOptimizer
                  and ZeroRedundancyOptimizer.__module__.startswith("torch.")),
        "nn": RemoteModule is ucxrpc.nn.RemoteModule,
        "torch_keeps_its_own": ddp.RRef is torch_rref and torch_rref is not ucxrpc.RRef,
        "missing": missing,
        "uninitialized": uninitialized,
    }


def test_install_puts_ucxrpc_in_place_of_torchs_modules() -> None:
    from tests.workers import run_workers

    def check(got: dict[str, object]) -> None:
        assert got["options"] == ("TensorPipeRpcBackendOptions", 5.0)
        assert all(got[k] for k in ("rpc", "names", "autograd", "optim", "nn",
                                    "torch_keeps_its_own")), got
        assert "register_backend" in got["missing"] and "no counterpart" in got["missing"]
        assert "RPC has not been initialized" in got["uninitialized"]
        assert got["pyg"] == [False, True, {"worker0": ("trainer", 1, 0)}, ["worker0"], False]

    check(run_workers(_install_one, 1, timeout=60)[0])


def _install_one(rank: int, world_size: int, init_method: str) -> dict[str, object]:
    return _install_here(init_method)
