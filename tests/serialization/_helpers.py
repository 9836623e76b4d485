"""What the serialization tests share: the transport played in process
(each buffer copied into fresh memory, as a receiver allocates it), sample
tensors of every dtype, and comparisons that see dtype and layout."""

from __future__ import annotations

import torch

from ucxrpc.serialization.pickler import Pickled
from ucxrpc.transport.wire.gather import Gather

__all__ = ["ALL_DTYPES", "assert_same", "copied", "copied_at", "same", "sample"]

#: Every dtype a tensor may have on the wire (the unsigned wide ones where
#: this torch has them).
ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
] + [d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64"))
     if isinstance(d, torch.dtype)]


def copied(pickled: Pickled, misalign: int = 0) -> list[torch.Tensor]:
    """Copy host buffers as a transport would, each ``misalign`` bytes into
    an allocation of its own."""
    out = []
    for buf in pickled.buffers:
        buf = buf.joined() if isinstance(buf, Gather) else buf  # as the wire carries it
        big = torch.empty(buf.numel() + misalign, dtype=torch.uint8)
        fresh = big[misalign:]
        fresh.copy_(buf)
        out.append(fresh)
    return out


def copied_at(pickled: Pickled, offset: int | None = None) -> list[torch.Tensor]:
    """Copy buffers as a transport would; ``offset`` places each inside a bigger
    allocation at that byte offset."""
    out = []
    for buf in pickled.buffers:
        buf = buf.joined() if isinstance(buf, Gather) else buf  # as the wire carries it
        if offset is None:
            fresh = torch.empty(buf.numel(), dtype=torch.uint8, device=buf.device)
        else:
            big = torch.empty(buf.numel() + offset + 7, dtype=torch.uint8, device=buf.device)
            fresh = big[offset:offset + buf.numel()]
        fresh.copy_(buf)
        out.append(fresh)
    return out


def sample(dtype: torch.dtype, shape=(5, 3)) -> torch.Tensor:
    """A tensor of its own storage (a reshape of a temporary would be a view
    sharing its base's storage, which keeps the per-storage path)."""
    if dtype is torch.bool:
        t = torch.arange(15) % 3 == 0
    elif dtype.is_complex:
        t = torch.complex(torch.arange(15.0), -torch.arange(15.0)).to(dtype)
    else:
        t = torch.arange(15, dtype=torch.int64).to(dtype)
    return t.reshape(shape).clone()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                   getattr(torch, "uint64", None)):
        a, b = a.to(torch.int64), b.to(torch.int64)
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is type(want)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride()
    assert got.device == want.device
    assert torch.equal(got, want)
