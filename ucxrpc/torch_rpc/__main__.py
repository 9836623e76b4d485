"""``python -m ucxrpc.torch_rpc program.py args...`` (or ``-m module args...``).

Runs the program as ``python program.py args...`` (``python -m module
args...``) would, on ucxrpc: :func:`ucxrpc.torch_rpc.install` with
``children=True`` first, so that the program, the libraries it imports and
every Python process it starts get ucxrpc where they import
``torch.distributed.rpc``.  The program's exit status is the command's.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

from . import install

USAGE = """\
usage: python -m ucxrpc.torch_rpc program.py [args ...]
       python -m ucxrpc.torch_rpc -m module [args ...]

Run a program that imports torch.distributed.rpc (directly or through a
library: TorchRL, FairScale, PyG) on ucxrpc, unchanged, in its own process
and in every Python process it starts."""


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (default: ``sys.argv[1:]``), install, run the program.

    Raises:
        SystemExit: 2 with the usage on a bad command line; the program's
            own exit.
        Exception: whatever the program raises.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return
    if not args or (args[0] == "-m" and len(args) < 2) or (
            args[0].startswith("-") and args[0] != "-m"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    install(children=True)
    if args[0] == "-m":
        # As 'python -m': the working directory stays first on sys.path.
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    path = args[0]
    sys.argv = [path, *args[1:]]
    # As 'python program.py': the program's directory first on sys.path,
    # in place of the working directory that 'python -m' put there.
    here = os.path.dirname(os.path.abspath(path))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.getcwd():
        sys.path[0] = here
    else:
        sys.path.insert(0, here)
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
