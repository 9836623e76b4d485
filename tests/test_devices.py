"""Device maps: torch's validation rules and messages, without a GPU."""

from __future__ import annotations

import pytest
import torch

from ucxrpc import UcxRpcBackendOptions
from ucxrpc.devices import (check_devices, default_devices, reverse_maps, target_devices,
                            to_device, to_device_map, validate)

D = torch.device


def test_options_normalize_and_merge_like_torch():
    o = UcxRpcBackendOptions(device_maps={"w1": {0: 1, "cpu": "cpu"}}, devices=[0, "cuda:1"])
    assert o.device_maps == {"w1": {D("cuda:0"): D("cuda:1"), D("cpu"): D("cpu")}}
    assert o.devices == [D("cuda:0"), D("cuda:1")]
    o.set_device_map("w1", {"cuda:2": 2})  # adds to the map
    assert o.device_maps["w1"][D("cuda:2")] == D("cuda:2")
    o.set_device_map("w1", {0: 1})  # the same pair again is fine
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping, trying to map cuda:0 to "
                                         "cuda:3 and cuda:1"):
        o.set_device_map("w1", {0: 3})
    with pytest.raises(ValueError, match="trying to map cuda:3 and cuda:0 to cuda:1"):
        o.set_device_map("w1", {3: 1})  # a second source onto cuda:1
    with pytest.raises(ValueError, match="1-to-1 mapping, trying to map cuda:1 and cuda:0 to cuda:0"):
        UcxRpcBackendOptions(device_maps={"w": {0: 0, 1: 0}})
    with pytest.raises(ValueError, match="expect a list of CUDA devices, but got device type cpu"):
        o.set_devices(["cpu"])
    with pytest.raises(RuntimeError):
        to_device("gpu7")


def _job(**over):
    job = {"names": ["a", "b"], "counts": {"a": 2, "b": 2},
           "maps": {"a": {"b": to_device_map({0: 1})}, "b": {}},
           "devices": {"a": [], "b": []}}
    job.update(over)
    return job


def _validate(job):
    validate(job["names"], job["counts"], job["maps"], job["devices"])


@pytest.mark.parametrize("over, message", [
    ({"devices": {"a": [D("cuda:0"), D("cuda:0")], "b": []}}, "Node a has duplicated devices"),
    ({"devices": {"a": [D("cuda:5")], "b": []}}, "Node a has devices with invalid indices"),
    ({"maps": {"a": {"c": to_device_map({0: 0})}, "b": {}}},
     "Node a has invalid target node names in its device maps"),
    ({"maps": {"a": {"b": {D("cuda:0"): D("cuda:1"), D("cuda:1"): D("cuda:1")}}, "b": {}}},
     "Node a has duplicated target devices in its device map for b"),
    ({"devices": {"a": [D("cuda:1")], "b": []}},
     "Node a has unexpected source devices in its device map for b"),
    ({"maps": {"a": {"b": to_device_map({4: 1})}, "b": {}}},
     "Node a has source devices with invalid indices in its device map for b"),
    ({"devices": {"a": [], "b": [D("cuda:0")]}},
     "Node a has unexpected target devices in its device map for b"),
    ({"counts": {"a": 2, "b": 1}}, "Node a has target devices with invalid indices in its device "
                                   "map for b"),
    ({"counts": {"a": 0, "b": 0}}, "Node a has source devices with invalid indices"),  # no GPU
])
def test_job_wide_rules(over, message):
    with pytest.raises(ValueError, match=message):
        _validate(_job(**over))


def test_valid_jobs_pass():
    _validate(_job())
    _validate(_job(devices={"a": [D("cuda:0")], "b": [D("cuda:1")]}))
    # CPU entries need no GPU at all
    _validate(_job(counts={"a": 0, "b": 0}, maps={"a": {"b": to_device_map({"cpu": "cpu"})},
                                                 "b": {}}))


def test_reverse_maps_and_default_devices():
    maps = {"a": {"b": to_device_map({0: 1, "cpu": "cpu"})},
            "b": {"a": to_device_map({1: 0})}, "c": {"b": to_device_map({1: 2})}}
    rev = reverse_maps("b", maps)
    assert rev == {"a": {D("cuda:1"): D("cuda:0"), D("cpu"): D("cpu")},
                   "c": {D("cuda:2"): D("cuda:1")}}
    assert default_devices(maps["b"], rev) == [D("cuda:1"), D("cuda:2")]
    assert check_devices([0]) == [D("cuda:0")]


def test_target_devices_follow_the_map():
    m = to_device_map({0: 1, 1: "cpu"})
    assert target_devices([D("cpu"), D("cuda:0"), D("cuda:1")], m, "w1") == [-1, 1, -1]
    assert target_devices([D("cpu")], None, "w1") == [-1]  # host memory needs no map
    with pytest.raises(RuntimeError, match=r"a tensor on cuda:2 cannot go to w1: no device map "
                                           r"entry covers cuda:2; configure it with "
                                           r"set_device_map\('w1', \{'cuda:2': \.\.\.\}\)"):
        target_devices([D("cuda:2")], m, "w1")
    with pytest.raises(RuntimeError, match="reverse of w0's device map"):
        target_devices([D("cuda:0")], None, "w0", replying=True)
