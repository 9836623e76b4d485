#!/usr/bin/env python
"""Benchmark ucxrpc against torch's TensorPipe RPC agent and raw UCX (ucxx).

A thin wrapper around :func:`ucxrpc.bench.main` (the same code as the
``ucxrpc bench`` command) that works from a source checkout without
installing ucxrpc. See benchmarks/README.md.

    python benchmarks/bench_rpc.py --compare torch --compare ucxx
    python benchmarks/bench_rpc.py --impl torch --compare ucxx --quick
"""

from __future__ import annotations

import os
import sys

# The repository root, so `ucxrpc` imports from this checkout; spawned
# benchmark children inherit sys.path from this process.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucxrpc.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
