"""Timing a run of launches as one CUDA graph: the kernels alone, without the host's launch cost.

Used by the GPU measurement scripts and :func:`rimuru.distributed.comm.bench_all_reduce`. ``capture`` records
``fn()`` on a side stream (the caller has run it eagerly once, so that compiles, handles and workspaces are made
outside the capture) and returns the graph with ``fn``'s result (tensors the replays write). ``replay_ms`` replays it
once, waits (``before``, by default a device synchronize; a collective for graphs that communicate, so that every
rank starts the timed replays together), then times ``iters`` replays with CUDA events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any], device: torch.device) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn()`` captured into a new graph on a side stream; returns ``(graph, fn's result)``."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        result = fn()
    current.wait_stream(stream)
    return graph, result


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int, device: torch.device,
              before: Callable[[], None] | None = None) -> float:
    """Milliseconds per replay of ``graph`` over ``iters`` timed replays, after one untimed replay and ``before()``."""
    graph.replay()
    if before is None:
        torch.cuda.synchronize(device)
    else:
        before()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
