"""The communicator the model calls between its sharded halves: an all-reduce, and nothing at world size 1.

``SingleProcess`` is what every single-device engine uses: ``all_reduce`` returns its argument, so a
model built with it runs exactly the single-device code. ``TorchDistributed`` wraps a
``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs). With ``timing`` on it records CUDA
events around each all-reduce so a run can report the all-reduce time per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Shard:
    """Which slice of the weights a process holds: rank ``rank`` of ``world`` tensor-parallel ranks."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.world} is not a rank")

    def rows(self, n: int, what: str) -> slice:
        """This rank's contiguous block of ``n`` rows split evenly."""
        if n % self.world:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size={self.world}")
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)


ONE_RANK = Shard()


class Communicator(Protocol):
    shard: Shard

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``t``."""

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over ranks (agreeing on one memory decision)."""


class SingleProcess:
    shard = ONE_RANK
    world_size = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def min_int(self, value: int) -> int:
        return value


SINGLE = SingleProcess()


class TorchDistributed:
    """All-reduce over the default ``torch.distributed`` group (initialised by the caller)."""

    def __init__(self, shard: Shard, device: torch.device) -> None:
        self.shard = shard
        self.device = device
        self.world_size = shard.world
        self.timing = False
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.calls = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.calls += 1
        if self.timing and t.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(t)
            end.record()
            self._events.append((start, end))
        else:
            dist.all_reduce(t)
        return t

    def min_int(self, value: int) -> int:
        import torch.distributed as dist

        backend_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=backend_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def pop_all_reduce_ms(self) -> float:
        """Milliseconds spent in all-reduces recorded since the last call (synchronises the device)."""
        if not self._events:
            return 0.0
        self._events[-1][1].synchronize()
        total = sum(s.elapsed_time(e) for s, e in self._events)
        self._events.clear()
        return total


def time_all_reduces(comm: TorchDistributed, rows: int, cols: int, dtype: torch.dtype, calls: int, iters: int) -> float:
    """Milliseconds for ``calls`` all-reduces of a ``[rows, cols]`` tensor — what one decode step of a model with
    ``calls`` all-reduces spends in them when no rank waits for another. Every rank calls this at once.

    On a GPU the ``calls`` all-reduces are captured in one CUDA graph (as in a graphed decode step) and the graph
    is replayed ``iters`` times back to back after a synchronising all-reduce, so a rank's late start is paid
    once, not per replay; the result is the total over the replays / ``iters``. On the CPU (gloo) the calls run
    eagerly."""
    device = comm.device
    t = torch.ones(rows, cols, dtype=dtype, device=device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters * calls):
            comm.all_reduce(t)
        return (time.perf_counter() - start) * 1e3 / iters
    for _ in range(calls):  # eager once: the communicator is set up outside the capture
        comm.all_reduce(t)
    torch.cuda.synchronize(device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            comm.all_reduce(t)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph.replay()
    comm.all_reduce(torch.ones(1, device=device))  # every rank here: the timed replays start together
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
