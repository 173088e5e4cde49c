"""Which CPUs a tensor-parallel rank's process runs on: the NUMA node of its GPU (host-memory placement).

A rank's pinned host expert store is allocated (and its pages first touched) by the rank's own process, so its
pages land on the NUMA node of the CPU that process happens to run on. Every expert load then crosses from that
node to the GPU; a store on the socket far from its GPU pays the inter-socket link on every copy. Binding the
process to its GPU's node *before* it allocates keeps the store local.

The decision is a pure function of what sysfs says (:func:`plan_affinity`); :func:`read_topology` reads sysfs (a
root directory, so tests use fixtures) and :func:`apply_affinity` is the one side effect
(``os.sched_setaffinity``). Where sysfs has no NUMA information (one node, ``numa_node`` -1, a CPU device, no
sysfs at all), the plan is "leave as is" with the reason, never an error.

The engine does not bind its ranks yet: the one two-GPU machine measured (a VM) exposes a single NUMA node, so a
binding had nothing to show there (docs/tensor_parallel.md). ``workflow/scripts/tp_h2d_diag.py`` uses the plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

NUMA_SETTINGS = ("auto", "off")


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format; empty -> empty)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"not a cpulist: {text!r}") from None
        if last < first:
            raise ValueError(f"not a cpulist: {text!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def normalize_bus_id(bus_id: str) -> str:
    """A PCI address as sysfs names it: ``"00000000:1B:00.0"`` (nvidia-smi / CUDA) -> ``"0000:1b:00.0"``."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or rest.count(":") != 1:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{int(domain, 16):04x}:{rest}"


@dataclass(frozen=True)
class Topology:
    """What sysfs says: each NUMA node's CPUs, and each GPU's (by normalized PCI bus id) node (None: not known)."""
    node_cpus: dict[int, frozenset[int]]
    gpu_node: dict[str, int | None]


def read_topology(bus_ids, root: str | os.PathLike = "/") -> Topology:
    """Read ``/sys/devices/system/node/node*/cpulist`` and ``/sys/bus/pci/devices/<bus>/numa_node`` under ``root``.
    Missing files give an empty node map / a None node (no error: the plan then says why it leaves things)."""
    root = Path(root)
    nodes: dict[int, frozenset[int]] = {}
    node_dir = root / "sys/devices/system/node"
    if node_dir.is_dir():
        for entry in sorted(node_dir.glob("node[0-9]*")):
            try:
                cpus = parse_cpulist((entry / "cpulist").read_text())
            except (OSError, ValueError):
                continue
            if cpus:
                nodes[int(entry.name[4:])] = cpus
    gpus: dict[str, int | None] = {}
    for bus in bus_ids:
        key = normalize_bus_id(bus)
        try:
            node = int((root / "sys/bus/pci/devices" / key / "numa_node").read_text().strip())
        except (OSError, ValueError):
            node = None
        gpus[key] = node if node is not None and node >= 0 else None
    return Topology(nodes, gpus)


@dataclass(frozen=True)
class AffinityPlan:
    """``cpus`` None: leave the process's affinity as it is; ``reason`` says why (or which node was chosen)."""
    cpus: frozenset[int] | None
    node: int | None
    reason: str


def plan_affinity(setting: str, bus_id: str | None, topology: Topology, allowed: frozenset[int]) -> AffinityPlan:
    """The CPUs a rank driving the GPU at ``bus_id`` should run on: its GPU's NUMA node's CPUs that the process is
    allowed (``allowed``: its current affinity, e.g. a container's cpuset). Pure; ``setting`` is ``auto`` or ``off``."""
    if setting not in NUMA_SETTINGS:
        raise ValueError(f"numa_affinity must be one of {', '.join(NUMA_SETTINGS)}, got {setting!r}")
    if setting == "off":
        return AffinityPlan(None, None, "off")
    if bus_id is None:
        return AffinityPlan(None, None, "no GPU")
    if len(topology.node_cpus) < 2:
        return AffinityPlan(None, None, f"{len(topology.node_cpus)} NUMA node(s) in sysfs")
    node = topology.gpu_node.get(normalize_bus_id(bus_id))
    if node is None:
        return AffinityPlan(None, None, f"no NUMA node for GPU {bus_id} in sysfs")
    cpus = topology.node_cpus.get(node, frozenset()) & allowed
    if not cpus:
        return AffinityPlan(None, node, f"none of node {node}'s CPUs is allowed to this process")
    return AffinityPlan(cpus, node, f"node {node} ({len(cpus)} CPUs)")


def gpu_bus_id(index: int) -> str | None:
    """The PCI bus id of CUDA device ``index`` (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def apply_affinity(plan: AffinityPlan) -> None:
    """Bind this process (every thread created afterwards inherits it) to ``plan.cpus``; nothing if None."""
    if plan.cpus is not None:
        os.sched_setaffinity(0, plan.cpus)

