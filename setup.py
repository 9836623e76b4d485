"""The native core's build (ucxrpc._core, C with the CPython API).

Everything else about the package is declared in pyproject.toml; an
extension module still needs a setup.py with setuptools.  The core is
required: there is no pure-Python twin to fall back to (docs/architecture.md,
"The native core"), so a machine without a C compiler or without Python's
headers fails here, saying what to install.
"""

import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = ["csrc/module.c", "csrc/frame.c", "csrc/siphash.c", "csrc/ucp.c", "csrc/timer.c",
           "csrc/calls.c", "csrc/loop.c", "csrc/reply.c", "csrc/send.c",
           "csrc/receive.c", "csrc/expect.c", "csrc/plain.c", "csrc/pool.c"]
HEADERS = ["csrc/core.h", "csrc/siphash.h", "csrc/ucp_abi.h"]

HINT = ("ucxrpc builds its native core (ucxrpc._core) with the system C compiler and "
        "Python's headers. Install them and retry, on Debian or Ubuntu: "
        "apt-get install gcc python3-dev (for a Python that is not the system's, its own "
        "headers); on Fedora or RHEL: dnf install gcc python3-devel.")


class BuildCore(build_ext):
    """build_ext that fails with what to install instead of a compiler's trace."""

    def run(self) -> None:
        include = Path(sysconfig.get_paths()["include"]) / "Python.h"
        if not include.exists():
            raise SystemExit(f"error: Python.h not found at {include}.\n{HINT}")
        try:
            super().run()
        except Exception as exc:  # CompileError, or the compiler not found at all
            raise SystemExit(f"error: building ucxrpc._core failed: {exc}\n{HINT}") from exc


setup(
    ext_modules=[Extension(
        "ucxrpc._core",
        sources=SOURCES,
        depends=HEADERS,
        include_dirs=["csrc"],
        # C11; -O2 as Python's own build; warnings are errors worth seeing.
        extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
        libraries=["dl"],  # dlopen: libucp is the copy ucxx loaded, found at run time
    )],
    cmdclass={"build_ext": BuildCore},
)
