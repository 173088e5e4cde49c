"""Completion counters for kernels whose last program to finish does a final step (a split merge, a top-k).

A kernel that cuts one result over several programs can finish it in the same launch instead of a second one:
each program stores its part, then counts itself done on a per-result counter (:func:`last_to_arrive`); the one
that sees every other part done reads them all, writes the result and resets the counter to zero
(:func:`reset`). Counters live in one persistent zeroed int32 buffer per device (:func:`counters`), shared by
every such launch: launches on one stream run one after another, and each leaves its counters at zero, so the
buffer needs no clearing, inside a CUDA graph or out of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_COUNTERS = 1 << 16  # results in flight in one launch: 64 Ki covers 512 requests x 128 KV heads

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters on ``device``. Allocated outside any CUDA-graph capture: a buffer
    first created inside one would only be zeroed when the graph replays."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{n} completion counters must exist before a CUDA graph capture (run the kernel "
                               "eagerly at that size first)")
        buf = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@triton.jit
def last_to_arrive(counter_ptr, parts):
    """Count this program's part of a result done; True for the program that completes all ``parts``. Every
    thread's stores come before the count (barrier, then a release); the last program's later loads come after
    every other part's count (acquire), and should bypass L1 (``cache_modifier=".cg"``)."""
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    return done == parts - 1


@triton.jit
def reset(counter_ptr):
    """The last program, done with the result: the counter is zero for the next launch."""
    tl.atomic_xchg(counter_ptr, 0)
