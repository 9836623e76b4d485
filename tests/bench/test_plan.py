"""Sizes, sweep defaults, transport choices and series: no processes."""

from __future__ import annotations

import pytest

from ucxrpc.bench import plan

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def test_default_sweep_is_4k_to_256m_on_cpu_and_to_1g_on_cuda():
    cpu = plan.default_sizes("cpu")
    assert cpu[0] == 4 * KiB and cpu[-1] == 256 * MiB and len(cpu) == 9
    assert all(b == 4 * a for a, b in zip(cpu, cpu[1:]))
    cuda = plan.default_sizes("cuda")
    assert cuda[:-1] == cpu and cuda[-1] == GiB


@pytest.mark.parametrize("text, sizes", [
    ("4K..1M", (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB)),
    ("4K..1M:2", tuple(4 * KiB << i for i in range(9))),
    ("1M..3M", (MiB,)),                                     # stops at or below the top
    ("64K,4K..16K,3M", (4 * KiB, 16 * KiB, 64 * KiB, 3 * MiB)),
    ("1G..1G", (GiB,)),
])
def test_size_ranges(text, sizes):
    assert plan.parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["1M..4K", "4K..1M:1", "4K..", "..1M", "4K..1M:x"])
def test_bad_size_ranges(text):
    with pytest.raises(ValueError):
        plan.parse_sizes(text)


def test_transport_choices():
    assert plan.parse_transports(None) == (None,)
    assert plan.parse_transports([]) == (None,)
    # the old single comma list stays one choice using both transports
    assert plan.parse_transports(["tcp,sm"]) == (("tcp", "sm"),)
    assert plan.parse_transports(["tcp;sm;all"]) == (("tcp",), ("sm",), ("all",))
    assert plan.parse_transports(["tcp", "sm, cma", "tcp"]) == (("tcp",), ("sm", "cma"))
    for bad in (["tcp;"], [" , "], [";"]):
        with pytest.raises(ValueError, match="empty transport choice"):
            plan.parse_transports(bad)


def test_series_one_per_transport_choice_except_torch():
    series = plan.build_series(["ucxrpc", "torch", "ucxx"], [("tcp",), ("sm",)])
    assert [s.key for s in series] == ["ucxrpc[tcp]", "ucxrpc[sm]", "torch", "ucxx[tcp]",
                                       "ucxx[sm]"]
    assert series[0].transports == ("tcp",) and series[2].transports is None
    assert series[3].label == "raw ucxx [tcp]"


def test_single_choice_keeps_plain_keys():
    for choices in ([None], [("tcp", "sm")]):
        series = plan.build_series(["ucxrpc", "ucxx", "ucxrpc"], choices)
        assert [s.key for s in series] == ["ucxrpc", "ucxx"]
        assert series[0].transports == choices[0]
    assert plan.build_series(["ucxrpc"], [("tcp", "sm")])[0].choice == "tcp,sm"


def test_ratio_pairs_match_transport_choices():
    keys = ["ucxrpc[tcp]", "ucxrpc[sm]", "torch", "ucxx[tcp]", "ucxx[sm]"]
    assert plan.ratio_pairs(keys, "ucxrpc") == (
        ("ucxrpc[tcp]", "torch"), ("ucxrpc[tcp]", "ucxx[tcp]"),
        ("ucxrpc[sm]", "torch"), ("ucxrpc[sm]", "ucxx[sm]"))
    # torch runs on no UCX transport: it is compared with every series
    assert plan.ratio_pairs(["torch", "ucxx[tcp]", "ucxx[sm]"], "torch") == (
        ("torch", "ucxx[tcp]"), ("torch", "ucxx[sm]"))
    assert plan.ratio_pairs(["ucxrpc", "torch", "ucxx"], "ucxrpc") == (
        ("ucxrpc", "torch"), ("ucxrpc", "ucxx"))


def test_split_key():
    assert plan.split_key("ucxx[tcp,sm]") == ("ucxx", "tcp,sm")
    assert plan.split_key("torch") == ("torch", None)
