"""Host-to-device copy rate of this process's host memory: an independent probe of what a rank's expert loads get.

:func:`h2d_gbps` copies ``chunk_bytes`` pieces of a host tensor (the rank's pinned expert store, or any buffer) to the
device on a side stream, back to back, and times each round with CUDA events; the result is the median round's
GB/s (1e9 bytes/s) and every round's rate. :func:`numa_pages` reads ``/proc/self/numa_maps`` to say on which NUMA
node(s) a host buffer's pages sit (the mapping holding its first byte).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class H2DRate:
    """``gbps``: the median round's rate (GPU-timed); ``rates``: every round's; ``issue_us``: the median round's host
    time to enqueue one copy (wall clock around the enqueue loop / copies: a load's host side, not its transfer)."""
    gbps: float
    rates: list[float]
    issue_us: float


def h2d_gbps(host: torch.Tensor, device: torch.device, chunk_bytes: int, total_bytes: int, rounds: int = 5,
             streams: int = 1) -> H2DRate:
    """The rate of copying ``total_bytes`` of ``host`` (flattened, from its start, wrapping) to ``device`` in
    ``chunk_bytes`` copies, spread round-robin over ``streams`` side streams. One discarded round first (warm-up)."""
    if device.type != "cuda":
        raise ValueError(f"h2d_gbps needs a CUDA device, got {device}")
    flat = host.reshape(-1).view(torch.uint8)
    if chunk_bytes <= 0 or total_bytes < chunk_bytes or flat.numel() < chunk_bytes:
        raise ValueError(f"chunk {chunk_bytes} B, total {total_bytes} B, host {flat.numel()} B: need "
                         f"0 < chunk <= total and chunk <= host")
    n = total_bytes // chunk_bytes
    per = flat.numel() // chunk_bytes
    slots = min(n, per)
    dst = torch.empty(slots * chunk_bytes, dtype=torch.uint8, device=device)
    side = [torch.cuda.Stream(device) for _ in range(streams)]
    rates: list[float] = []
    issue: list[float] = []
    for r in range(rounds + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cur = torch.cuda.current_stream(device)
        start.record(cur)
        for s in side:
            s.wait_stream(cur)
        t0 = time.perf_counter()
        for i in range(n):
            j = i % per
            k = i % slots
            with torch.cuda.stream(side[i % streams]):
                dst[k * chunk_bytes:(k + 1) * chunk_bytes].copy_(flat[j * chunk_bytes:(j + 1) * chunk_bytes],
                                                                non_blocking=True)
        t1 = time.perf_counter()
        for s in side:
            cur.wait_stream(s)
        end.record(cur)
        end.synchronize()
        if r:
            rates.append(n * chunk_bytes / (start.elapsed_time(end) * 1e-3) / 1e9)
            issue.append((t1 - t0) / n * 1e6)
    return H2DRate(statistics.median(rates), rates, statistics.median(issue))


def numa_pages(tensor: torch.Tensor, maps: str | Path = "/proc/self/numa_maps") -> dict[int, int]:
    """{node: pages} of the mapping that holds ``tensor``'s first byte, from ``numa_maps`` ({} if not found)."""
    addr = tensor.data_ptr()
    best: tuple[int, str] | None = None
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        head, _, rest = line.partition(" ")
        try:
            start = int(head, 16)
        except ValueError:
            continue
        if start <= addr and (best is None or start > best[0]):
            best = (start, rest)
    if best is None:
        return {}
    nodes: dict[int, int] = {}
    for field in best[1].split():
        key, eq, value = field.partition("=")
        if eq and key.startswith("N") and key[1:].isdigit() and value.isdigit():
            nodes[int(key[1:])] = int(value)
    return nodes
