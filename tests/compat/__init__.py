"""torch's own RPC tests, run against ucxrpc (README.md).

How their ranks may start, here where both the runner and the fixture
read it without importing torch: ``forkserver`` (the default) forks each
rank from a server that imported :data:`FORKSERVER_PRELOAD` once;
``spawn`` is upstream's way.
"""

START_METHODS = ("forkserver", "spawn")

#: What the forkserver imports once, before it forks any rank.
FORKSERVER_PRELOAD = ["tests.compat.suites"]
