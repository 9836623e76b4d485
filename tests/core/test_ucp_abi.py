"""The part of libucp's ABI the native core declares for itself
(csrc/ucp_abi.h) against UCX's own headers, which the libucx wheel ships:
every offset, size and constant the core relies on, compiled beside ucp.h
with the system compiler."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ucxrpc import _core

PROGRAM = r"""
#include <stddef.h>
#include <stdio.h>
#include <ucp/api/ucp.h>
#define OFF(f) printf("\"%s\": %zu,", #f, offsetof(ucp_request_param_t, f))
int main(void) {
    printf("{");
    printf("\"sizeof(ucp_request_param_t)\": %zu,", sizeof(ucp_request_param_t));
    OFF(op_attr_mask); OFF(flags); OFF(request); OFF(cb); OFF(datatype); OFF(user_data);
    OFF(reply_buffer); OFF(memory_type); OFF(recv_info); OFF(memh);
    printf("\"sizeof(ucp_tag_recv_info_t)\": %zu,", sizeof(ucp_tag_recv_info_t));
    printf("\"sender_tag\": %zu,", offsetof(ucp_tag_recv_info_t, sender_tag));
    printf("\"length\": %zu,", offsetof(ucp_tag_recv_info_t, length));
    printf("\"sizeof(ucp_dt_iov_t)\": %zu,", sizeof(ucp_dt_iov_t));
    printf("\"UCP_OP_ATTR_FIELD_DATATYPE\": %d,", (int)UCP_OP_ATTR_FIELD_DATATYPE);
    printf("\"UCP_OP_ATTR_FIELD_MEMORY_TYPE\": %d,", (int)UCP_OP_ATTR_FIELD_MEMORY_TYPE);
    printf("\"UCS_MEMORY_TYPE_HOST\": %d,", (int)UCS_MEMORY_TYPE_HOST);
    printf("\"UCS_MEMORY_TYPE_CUDA\": %d,", (int)UCS_MEMORY_TYPE_CUDA);
    printf("\"UCP_DATATYPE_IOV\": %d,", (int)ucp_dt_make_iov());
    printf("\"UCS_ERR_LAST\": %d", (int)UCS_ERR_LAST);
    printf("}\n");
    return 0;
}
"""


def _ucx_include() -> Path | None:
    try:
        import libucx  # type: ignore[import-untyped]
    except ImportError:
        return None
    include = Path(libucx.__file__).parent / "include"
    return include if (include / "ucp" / "api" / "ucp.h").exists() else None


@pytest.mark.processes
def test_the_declared_abi_is_ucps(tmp_path):
    include = _ucx_include()
    if include is None:
        pytest.skip("needs UCX's headers (the libucx wheel, which ucxx installs)")
    (tmp_path / "abi.c").write_text(PROGRAM)
    subprocess.run(["gcc", "-std=c11", f"-I{include}", "abi.c", "-o", "abi"], cwd=tmp_path,
                   check=True, capture_output=True, timeout=120)
    theirs = json.loads(subprocess.run([str(tmp_path / "abi")], capture_output=True, text=True,
                                       check=True, timeout=30).stdout)
    assert _core.ucp_abi() == theirs
