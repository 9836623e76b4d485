"""The ucxx binding (ucxrpc/transport/ucx/binding.py), without processes:
when device memory may be handed to UCX, and the refusal of a worker UCX
did not make multi-threaded.  Its pipes between processes are
tested through the transport (tests/transport/ucx/test_ucp.py, tests/rpc/)."""

from __future__ import annotations

import pytest

from ucxrpc.transport.ucx.binding import check_thread_mode, cuda_memory


def test_device_memory_goes_to_ucx_only_with_cuda_copy_loaded():
    host = [("tcp", "lo"), ("sysv", "memory")]
    assert cuda_memory(True, host + [("cuda_copy", "cuda"), ("cuda_ipc", "cuda")])
    assert cuda_memory(True, host + [("cuda_copy", "cuda")])
    assert not cuda_memory(True, host + [("cuda_ipc", "cuda")])
    assert not cuda_memory(True, host + [("gdr_copy", "cuda")])
    assert not cuda_memory(True, host)
    # ucxx's cuda_support is a test of UCX_TLS: true on a machine without a GPU
    assert not cuda_memory(False, host + [("cuda_copy", "cuda")])


@pytest.mark.parametrize("mode, name", [(0, "single"), (1, "serialized"), (-1, "unknown (-1)")])
def test_a_worker_that_is_not_multi_threaded_is_refused_naming_the_library(mode, name):
    with pytest.raises(RuntimeError) as err:
        check_thread_mode(mode)
    text = str(err.value)
    assert f"thread mode {name!r}" in text and "libucp" in text and "--enable-mt" in text
    check_thread_mode(2)  # multi: nothing to say
