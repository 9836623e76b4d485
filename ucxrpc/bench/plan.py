"""What a benchmark run covers: message sizes, UCX transport choices, series.

Pure functions over plain values (no torch, no ucxx), so the command line can
be checked and tested without starting anything.

A *series* is one line of the plot and one value column of the table: an
implementation (``ucxrpc``, ``torch``, raw ``ucxx``) with one UCX transport
choice. torch's TensorPipe agent does not run on UCX, so it is one series
whatever ``--transports`` says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "DEFAULT_MAX_SIZE",
    "IMPL_LABELS",
    "RATIO_NAMES",
    "Series",
    "build_series",
    "default_sizes",
    "format_size",
    "parse_size",
    "parse_sizes",
    "parse_transports",
    "ratio_pairs",
    "series_label",
    "series_short",
    "split_key",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MIN_SIZE = 4 * KiB
#: Largest default size per device kind: a 1 GiB host tensor per buffer
#: (send, receive, echo, both sides) is more memory than small hosts have,
#: and the CPU curve is flat well before 256 MiB.
DEFAULT_MAX_SIZE = {"cpu": 256 * MiB, "cuda": 1 * GiB}
DEFAULT_STEP = 4

#: Column labels for the implementation keys used throughout the harness.
IMPL_LABELS = {"ucxrpc": "ucxrpc", "torch": "torch", "ucxx": "raw ucxx"}
#: Short names used in ratio column headers ("ucxrpc/raw").
RATIO_NAMES = {"ucxrpc": "ucxrpc", "torch": "torch", "ucxx": "raw"}
#: Implementations that run on UCX and so take a transport choice.
UCX_IMPLS = ("ucxrpc", "ucxx")

_SUFFIXES = {"": 1, "K": KiB, "M": MiB, "G": GiB}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_RANGE_RE = re.compile(r"^\s*([^.:]+)\.\.([^.:]+)(?::\s*(\d+)\s*)?$")
_KEY_RE = re.compile(r"^([a-z]+)(?:\[(.+)\])?$")

def parse_size(text: str) -> int:
    """Parse ``"4K"``, ``"16KiB"``, ``"1M"``, ``"2g"`` or ``"4096"`` into bytes.

    Suffixes are binary (K = 1024). Raises ``ValueError`` on anything else,
    including sizes < 1.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 4K, 16M, 1G)")
    value = int(match.group(1)) * _SUFFIXES[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"size must be at least 1 byte: {text!r}")
    return value


def _size_range(lo: int, hi: int, step: int) -> list[int]:
    if step < 2:
        raise ValueError(f"a size range needs a step factor of at least 2, not {step}")
    if hi < lo:
        raise ValueError(f"size range runs backwards: {format_size(lo)}..{format_size(hi)}")
    out = [lo]
    while out[-1] * step <= hi:
        out.append(out[-1] * step)
    return out


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parse ``"4K,1M"`` or ranges ``"4K..256M"`` (x4 steps) / ``"4K..1G:2"``.

    Items are comma-separated and may mix sizes and ranges; a range runs from
    its low end in steps of the given factor (default 4) up to at most its
    high end. Duplicates are dropped; the result is sorted.
    """
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("empty size list")
    sizes: set[int] = set()
    for part in parts:
        ranged = _RANGE_RE.match(part)
        if ranged is None:
            sizes.add(parse_size(part))
            continue
        step = int(ranged.group(3)) if ranged.group(3) else DEFAULT_STEP
        sizes.update(_size_range(parse_size(ranged.group(1)), parse_size(ranged.group(2)), step))
    return tuple(sorted(sizes))


def default_sizes(device: str = "cpu") -> tuple[int, ...]:
    """4 KiB up to 256 MiB (CPU) or 1 GiB (CUDA) in powers of 4."""
    return tuple(_size_range(MIN_SIZE, DEFAULT_MAX_SIZE[device], DEFAULT_STEP))


def format_size(n: int) -> str:
    """``4096 -> "4 KiB"``, ``16777216 -> "16 MiB"``, ``1000 -> "1000 B"``."""
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def parse_transports(values: Sequence[str] | None) -> tuple[tuple[str, ...] | None, ...]:
    """``--transports`` values -> transport choices, in order, duplicates dropped.

    Each value holds one choice or several separated by ``;``; a choice is a
    comma-separated list of UCX transport names used together (``"tcp,sm"``
    is one choice allowing both; ``"all"`` is UCX's own name for every
    transport). No value at all gives ``(None,)``: UCX's own choice, with
    ``UCX_TLS`` from the environment honoured. Raises ``ValueError`` on an
    empty choice.
    """
    if not values:
        return (None,)
    choices: dict[tuple[str, ...], None] = {}
    for value in values:
        for choice in value.split(";"):
            names = tuple(dict.fromkeys(n.strip() for n in choice.split(",") if n.strip()))
            if not names:
                raise ValueError(f"empty transport choice in --transports {value!r}")
            choices[names] = None
    return tuple(choices)


@dataclass(frozen=True)
class Series:
    """One implementation under one transport choice; ``key`` names it in
    results and JSON (``"ucxrpc"``, or ``"ucxrpc[tcp]"`` in a matrix)."""

    impl: str
    transports: tuple[str, ...] | None
    key: str

    @property
    def choice(self) -> str | None:
        return ",".join(self.transports) if self.transports else None

    @property
    def label(self) -> str:
        """Human name: ``"raw ucxx"``, ``"ucxrpc [tcp]"``."""
        return series_label(self.key)


def split_key(key: str) -> tuple[str, str | None]:
    """``"ucxx[tcp,sm]" -> ("ucxx", "tcp,sm")``; ``"torch" -> ("torch", None)``."""
    match = _KEY_RE.match(key)
    return (match.group(1), match.group(2)) if match else (key, None)


def series_label(key: str) -> str:
    impl, choice = split_key(key)
    name = IMPL_LABELS.get(impl, impl)
    return f"{name} [{choice}]" if choice else name


def series_short(key: str) -> str:
    """Ratio-header name: ``"raw[tcp]"``."""
    impl, choice = split_key(key)
    name = RATIO_NAMES.get(impl, impl)
    return f"{name}[{choice}]" if choice else name


def build_series(impls: Sequence[str],
                 choices: Sequence[tuple[str, ...] | None]) -> tuple[Series, ...]:
    """Series in display order: per implementation, one per transport choice.

    Keys carry the choice only when there are several, so a plain run keeps
    the keys ``ucxrpc``/``torch``/``ucxx``.
    """
    matrix = len(choices) > 1
    out = []
    for impl in dict.fromkeys(impls):
        for choice in (choices if impl in UCX_IMPLS else (None,)):
            key = f"{impl}[{','.join(choice or ('default',))}]" if matrix and impl in UCX_IMPLS \
                else impl
            out.append(Series(impl, choice, key))
    return tuple(out)


def ratio_pairs(keys: Sequence[str], primary: str) -> tuple[tuple[str, str], ...]:
    """Ratio columns ``(numerator, denominator)``: each series of the primary
    implementation over each series of another implementation that ran on
    the same transport choice (or has none: torch)."""
    pairs = []
    for num in keys:
        impl, choice = split_key(num)
        if impl != primary:
            continue
        for den in keys:
            other, other_choice = split_key(den)
            if other == primary:
                continue
            if choice is None or other_choice is None or choice == other_choice:
                pairs.append((num, den))
    return tuple(pairs)
