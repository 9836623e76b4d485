"""UCX itself: the only code that touches ucxx or libucp.

* :mod:`.environment`: the ``UCX_*`` settings ucxrpc runs UCX with (decided
  before ucxx loads, UCX reading them once) and what UCX really read.
* :mod:`.binding`: the one module that imports ucxx: context, worker,
  endpoints, requests; ucxx's types and exceptions stop there.
* :mod:`.ucp`: libucp's per-frame calls through ctypes, for the hot path.
* :mod:`.sockets`: UCX's TCP connections as the kernel sees them; the cut
  of the ones a discarded endpoint leaves stuck behind an outage.
* :mod:`.baseline`: raw UCX through ucxx's core API, the benchmark's ceiling.

The names most callers want, re-exported.
"""

from __future__ import annotations

from .binding import (DEVICE_PATHS, Endpoint, Probe, Request, UcxxRequest, Worker, cuda_memory,
                      device_path, local_resources, ucx_version)
from .environment import (INTRA_EAGER_MAX, MAX_SHM_SEG_SIZE, effective_settings, effective_tls,
                          environment_problem, keepalive_schedule, ucx_environment, ucx_tls)

__all__ = ["DEVICE_PATHS", "INTRA_EAGER_MAX", "MAX_SHM_SEG_SIZE", "Endpoint", "Probe", "Request",
           "UcxxRequest", "Worker", "cuda_memory", "device_path", "effective_settings",
           "effective_tls", "environment_problem", "keepalive_schedule", "local_resources",
           "ucx_environment", "ucx_tls", "ucx_version"]
