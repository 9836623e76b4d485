"""torch's RPC test suites made concrete for ucxrpc, as upstream does it.

The equivalent of torch's ``test/distributed/rpc/test_tensorpipe_agent.py``:
:func:`rpc_utils.generate_tests` mixes :class:`UcxRpcAgentTestFixture` into
every agent-agnostic suite (``GENERIC_TESTS``) and into the suites upstream
runs only on its TensorPipe agent (``TENSORPIPE_TESTS``: they hold the sparse
tensor and dynamic-membership tests).  The classes are named ``Ucx<Suite>``
and live in this module.

Importing this module installs the import shim first (:mod:`tests.compat.shim`)
and so changes ``sys.modules``: it is meant for the compat runner and its
children only.  ``MultiProcessTestCase`` starts each rank with the *spawn*
method and sends it the test class by reference, so every child imports this
module, and so installs the shim, before torch's test modules.

Left out: the JIT and faulty-agent suites (placeholders, see the shim) and
the CUDA suites (``GENERIC_CUDA_TESTS``, ``TENSORPIPE_CUDA_TESTS``); see
``excluded.py``.
"""

from __future__ import annotations

from tests.compat import shim

shim.install()

from torch.testing._internal.distributed import rpc_utils  # noqa: E402

from tests.compat.fixture import UcxRpcAgentTestFixture  # noqa: E402

PREFIX = "Ucx"

#: torch's suites run here, in upstream's order.
SUITES = [suite for suite in rpc_utils.GENERIC_TESTS + rpc_utils.TENSORPIPE_TESTS
          if suite.__module__ not in shim.PLACEHOLDER_SUITES]

#: Generated class name -> class (``UcxRpcTest``, ``UcxDistAutogradTest``, ...).
CLASSES = rpc_utils.generate_tests(PREFIX, UcxRpcAgentTestFixture, SUITES, __name__)
globals().update(CLASSES)
