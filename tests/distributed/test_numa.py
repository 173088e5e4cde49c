"""rimuru.distributed.numa: the cpulist parser, sysfs reading on fixtures, and the affinity plan (pure)."""

import os

import pytest
import torch

from rimuru.distributed import numa
from rimuru.distributed.h2d_probe import h2d_gbps, numa_pages

GPU0, GPU1 = "00000000:1B:00.0", "00000000:9C:00.0"


def write_sysfs(root, nodes: dict[int, str], gpus: dict[str, str]):
    for node, cpus in nodes.items():
        d = root / "sys/devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for bus, node in gpus.items():
        d = root / "sys/bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
    return root


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("") == frozenset()
    for bad in ("a-b", "3-1", "1-2-3"):
        with pytest.raises(ValueError, match="not a cpulist"):
            numa.parse_cpulist(bad)


def test_normalize_bus_id():
    assert numa.normalize_bus_id(GPU0) == "0000:1b:00.0"
    assert numa.normalize_bus_id("0000:9c:00.0") == "0000:9c:00.0"
    with pytest.raises(ValueError, match="not a PCI bus id"):
        numa.normalize_bus_id("1b:00")


def test_two_sockets_bind_each_gpu_to_its_node(tmp_path):
    root = write_sysfs(tmp_path, {0: "0-15,32-47", 1: "16-31,48-63"}, {"0000:1b:00.0": "0", "0000:9c:00.0": "1"})
    topo = numa.read_topology([GPU0, GPU1], root)
    assert topo.gpu_node == {"0000:1b:00.0": 0, "0000:9c:00.0": 1}
    allowed = frozenset(range(64))
    p0 = numa.plan_affinity("auto", GPU0, topo, allowed)
    p1 = numa.plan_affinity("auto", GPU1, topo, allowed)
    assert p0.node == 0 and p0.cpus == set(range(16)) | set(range(32, 48))
    assert p1.node == 1 and p1.cpus == set(range(16, 32)) | set(range(48, 64))
    # a container's cpuset: only the allowed CPUs of the node
    assert numa.plan_affinity("auto", GPU1, topo, frozenset({1, 2, 20})).cpus == {20}
    # none of the node's CPUs allowed: left as is, with the reason
    none = numa.plan_affinity("auto", GPU1, topo, frozenset({1, 2}))
    assert none.cpus is None and "none of node 1" in none.reason
    assert numa.plan_affinity("off", GPU0, topo, allowed).cpus is None


def test_no_numa_information_leaves_affinity(tmp_path):
    # one node (a VM that hides the sockets, like the nvidia-h200-x2 machine), numa_node -1, or no sysfs at all
    one = numa.read_topology([GPU0], write_sysfs(tmp_path / "a", {0: "0-31"}, {"0000:1b:00.0": "-1"}))
    assert one.gpu_node == {"0000:1b:00.0": None}
    plan = numa.plan_affinity("auto", GPU0, one, frozenset(range(32)))
    assert plan.cpus is None and "1 NUMA node" in plan.reason
    two = numa.read_topology([GPU0], write_sysfs(tmp_path / "b", {0: "0-3", 1: "4-7"}, {"0000:1b:00.0": "-1"}))
    assert "no NUMA node for GPU" in numa.plan_affinity("auto", GPU0, two, frozenset(range(8))).reason
    empty = numa.read_topology([GPU0], tmp_path / "nothing")
    assert empty.node_cpus == {} and numa.plan_affinity("auto", GPU0, empty, frozenset({0})).cpus is None
    assert numa.plan_affinity("auto", None, two, frozenset(range(8))).reason == "no GPU"


def test_bad_setting_is_a_clear_error():
    with pytest.raises(ValueError, match="numa_affinity must be one of auto, off"):
        numa.plan_affinity("on", GPU0, numa.Topology({}, {}), frozenset())


def test_apply_affinity_binds_this_process():
    before = os.sched_getaffinity(0)
    one = min(before)
    try:
        numa.apply_affinity(numa.AffinityPlan(frozenset({one}), 0, "test"))
        assert os.sched_getaffinity(0) == {one}
        numa.apply_affinity(numa.AffinityPlan(None, None, "off"))
        assert os.sched_getaffinity(0) == {one}
    finally:
        os.sched_setaffinity(0, before)


def test_numa_pages_reads_the_mapping_of_the_tensor(tmp_path):
    t = torch.zeros(1 << 20, dtype=torch.uint8)
    addr = t.data_ptr()
    maps = tmp_path / "numa_maps"
    maps.write_text(f"{addr - 8192:x} default anon=3 dirty=3 N0=1 N1=2 kernelpagesize_kB=4\n"
                    f"{addr + (1 << 30):x} default anon=1 N1=1\n")
    assert numa_pages(t, maps) == {0: 1, 1: 2}
    assert numa_pages(t, tmp_path / "missing") == {}
    if os.path.exists("/proc/self/numa_maps"):  # this process's real numa_maps
        assert sum(numa_pages(torch.ones(1 << 22)).values()) > 0


def test_h2d_probe_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        h2d_gbps(torch.zeros(16, dtype=torch.uint8), torch.device("cpu"), 4, 16)
