"""Pack/unpack of many tensors: the CPU path here, the CUDA kernel with a GPU."""

from __future__ import annotations

import sys

import pytest
import torch

from ucxrpc import _kernels

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _tensors(device):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, dtype in enumerate(DTYPES * 3):
        shape = [(), (1,), (7,), (3, 5), (2, 3, 4)][i % 5]
        x = torch.randint(0, 2 if dtype is torch.bool else 120, shape, generator=g).to(dtype)
        out.append(x.to(device))
    out.append(torch.randn(4, 6)[:, ::2].to(device))  # not contiguous
    out.append(torch.empty(0, device=device))
    return out


def _roundtrip(device):
    tensors = _tensors(device)
    buf, specs = _kernels.pack(tensors)
    assert buf.dtype is torch.uint8 and buf.device == tensors[0].device
    assert all(s.offset % _kernels.ALIGN == 0 for s in specs)
    got = _kernels.unpack(buf.clone(), specs)
    for a, b in zip(tensors, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return buf, specs


def test_pack_unpack_every_dtype_on_the_cpu():
    buf, specs = _roundtrip("cpu")
    # back to back, aligned
    assert specs[1].offset == _kernels.ALIGN and buf.numel() == specs[-1].offset
    assert "cupy" not in sys.modules  # the CPU path never imports it


def test_unpack_refuses_a_short_buffer():
    buf, specs = _kernels.pack([torch.ones(100)])
    with pytest.raises(ValueError, match="too small"):
        _kernels.unpack(buf[:100], specs)


@pytest.mark.gpu
def test_pack_unpack_on_the_gpu_matches_the_cpu():
    buf, specs = _roundtrip("cuda")
    cpu_buf, cpu_specs = _roundtrip("cpu")
    assert specs == cpu_specs
    # the same bytes, padding aside
    for s in specs:
        assert torch.equal(buf[s.offset:s.offset + s.nbytes].cpu(),
                           cpu_buf[s.offset:s.offset + s.nbytes])
    # large ranges span several blocks, at unaligned addresses too
    big = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
    parts = [big[1:300_001], big[5:77], big[64:200_064]]
    got = _kernels.unpack(*_kernels.pack(parts))
    assert all(torch.equal(a, b) for a, b in zip(parts, got))
