"""The communicator the model calls between its sharded halves: an all-reduce, and nothing at world size 1.

``SingleProcess`` is what every single-device engine uses: ``all_reduce`` returns its argument, so a
model built with it runs exactly the single-device code. ``TorchDistributed`` wraps a
``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs). With ``timing`` on it records CUDA
events around each all-reduce so a run can report the all-reduce time per step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from rimuru.kernels.graph_timing import capture, replay_ms

RELEASE_TIMEOUT_S = 30.0  # the peer release's bound (the process's last resort acts LAST_RESORT_S after a death)


@dataclass(frozen=True)
class Shard:
    """Which slice of the weights a process holds: rank ``rank`` of ``world`` tensor-parallel ranks."""

    rank: int = 0
    world: int = 1
    experts: tuple[int, ...] | None = None  # expert parallelism: the global ids of the routed experts this rank
    # holds whole, in local order (rimuru.distributed.expert_parallel); None: every expert's intermediate slice

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.world} is not a rank")

    @property
    def slices_experts(self) -> bool:
        """Routed experts split along the intermediate dim (plain tensor parallelism on several ranks)."""
        return self.world > 1 and self.experts is None

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

    def reduce_add_rms_norm(self, h: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float,
                            extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A sub-layer's end: this rank's partial (``addend`` ``[T, d]`` or ``[T, k, d]`` summed, ``+ extra``)
        summed over ranks, added to the residual ``h``, and the next RMSNorm: ``(h_new, normed)``
        (``rimuru.kernels.norm_rope.add_rms_norm`` after the all-reduce)."""

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over ranks (agreeing on one memory decision)."""

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """``[S, V / world]`` logits of each rank's vocabulary block -> ``[S, V]`` (a vocabulary-parallel LM head)."""

    def greedy_tokens(self, local: torch.Tensor) -> torch.Tensor:
        """The greedy choice over the whole vocabulary from each rank's ``[S, V / world]`` logits: ``[S]`` int64 token
        ids, the first maximum (``torch.argmax`` of the gathered logits) — without gathering them."""

    @property
    def selection_report(self) -> dict:
        """Which all-reduce backend runs (rimuru/distributed/allreduce.py); empty on one rank."""


class SingleProcess:
    shard = ONE_RANK
    world_size = 1
    selection_report: dict = {}

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reduce_add_rms_norm(self, h, addend, weight, eps, extra=None):
        from rimuru.kernels.norm_rope import add_rms_norm

        return add_rms_norm(h, addend, weight, eps, extra=extra)

    def min_int(self, value: int) -> int:
        return value

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def greedy_tokens(self, local: torch.Tensor) -> torch.Tensor:
        return torch.argmax(local, dim=-1)


SINGLE = SingleProcess()


class TorchDistributed:
    """The all-reduce of a tensor-parallel rank over the default ``torch.distributed`` group (initialised by the
    caller), through a named backend (rimuru/distributed/allreduce.py): the process group's own all-reduce (NCCL,
    gloo) until :meth:`select_all_reduce` picks one at engine start (``symm_mem`` on GPUs with peer access)."""

    def __init__(self, shard: Shard, device: torch.device) -> None:
        from rimuru.distributed.allreduce import AllReduceBackend, ProcessGroupAllReduce

        self.shard = shard
        self.device = device
        self.world_size = shard.world
        self.timing = False
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.calls = 0
        group = ProcessGroupAllReduce("nccl" if device.type == "cuda" else "gloo")
        self.backend: AllReduceBackend = group  # the one in use; written by select_all_reduce / use_all_reduce
        self.backends: dict[str, AllReduceBackend] = {group.name: group}  # built so far (all ranks alike)
        self.selection_report: dict = {"all_reduce": group.name}
        self.dead_ranks: list[int] = []  # written by rank 0's monitor thread: every later collective raises at once
        self._release_kit = None  # the peer release's pinned sources and side streams (CUDA, peer-memory backends)
        self._release_lock = threading.Lock()

    # ------------------------------------------------------------------ backends
    def _context(self, dtype: torch.dtype):
        import torch.distributed as dist

        from rimuru.distributed.allreduce import AllReduceContext

        return AllReduceContext(self.device, self.shard.rank, self.world_size, dtype, dist.group.WORLD.group_name)

    def agree(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (a collective)."""
        return self.min_int(int(ok)) == 1

    def select_all_reduce(self, requested: str, dtype: torch.dtype) -> dict:
        """Choose the all-reduce backend on every rank at once (engine start; a collective); returns the report."""
        from rimuru.distributed.allreduce import select_all_reduce

        sel = select_all_reduce(requested, self._context(dtype), self.agree)
        self.backend = self.backends[sel.backend.name] = sel.backend
        self._prepare_release()
        self.selection_report = {**sel.report(),
                                 "peer_release": None if self._release_kit is None else self._release_kit.way}
        return self.selection_report

    def use_all_reduce(self, name: str, dtype: torch.dtype) -> None:
        """Switch every later all-reduce to backend ``name`` (built now if it was not: a collective, every rank
        calls it at once). Decode graphs captured before keep the backend they captured: recapture them
        (rimuru.distributed.allreduce_ab.use_all_reduce does both on every rank)."""
        from rimuru.distributed.allreduce import AllReduceUnavailable, all_reduce_candidates, build_backend

        if name not in self.backends:
            all_reduce_candidates(name, self.device.type)  # a clear error for a name that cannot run here
            backend, reason = build_backend(name, self._context(dtype), self.agree)
            if backend is None:
                raise AllReduceUnavailable(f"all_reduce={name!r}: {reason}")
            self.backends[name] = backend
            self._prepare_release()
        self.backend = self.backends[name]

    def mark_dead(self, dead: list[int]) -> None:
        """Every later collective of this rank raises ``TensorParallelError`` at once (rank 0's monitor thread, the
        moment it sees a rank die)."""
        self.dead_ranks = sorted(set(self.dead_ranks) | set(dead))

    def _release_fills(self, dead: list[int]) -> list:
        return [f for backend in list(self.backends.values()) for f in backend.release_fills(dead)]

    def _prepare_release(self) -> None:
        """The peer release's sources and side streams (rimuru/distributed/release.py), made now for every fill any
        dead peer could need: nothing is allocated at failure time. Rank 0 only: its monitor thread is the one that
        sees a rank die and releases (rimuru/distributed/group.py); the workers never release, so they build no kit."""
        if self.device.type != "cuda" or self.shard.rank != 0:
            return
        from rimuru.distributed.release import ReleaseKit

        peers = [r for r in range(self.world_size) if r != self.shard.rank]
        fills = self._release_fills(peers)
        self._release_kit = ReleaseKit(self.device, fills) if fills else None

    def release_peers(self, dead: list[int], timeout_s: float = RELEASE_TIMEOUT_S, progress=None):
        """A rank died (rank 0's monitor thread): make every later collective of this rank raise instead of calling
        into a group whose peer is gone (an eager step after NCCL's abort would otherwise wait in the next collective
        until the store's timeout), then write what the dead ranks would have written into every backend's
        peer-memory buffers (``release_fills``) through the copy engines until the device drains or ``timeout_s``
        (:func:`rimuru.distributed.release.release`: it never blocks on the device). Returns the
        :class:`~rimuru.distributed.release.ReleaseReport` (None: nothing to release); ``progress`` gets the report
        so far while it runs long."""
        self.mark_dead(dead)
        fills = self._release_fills(dead)
        if not fills or self._release_kit is None:
            return None
        with self._release_lock:
            return self._release_kit.run(fills, timeout_s, progress)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()

    # ------------------------------------------------------------------ the call
    def _check_alive(self) -> None:
        if self.dead_ranks:
            from rimuru.distributed.errors import TensorParallelError

            raise TensorParallelError(f"tensor-parallel rank(s) {self.dead_ranks} died: no collective can complete")

    def _timed(self, call, on_cuda: bool):
        """``call()``, between two CUDA events when timing is on (the per-step all-reduce time): its result and the
        events (None when untimed)."""
        if not (self.timing and on_cuda):
            return call(), None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = call()
        end.record()
        return out, (start, end)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self._check_alive()
        t, events = self._timed(lambda: self.backend.all_reduce(t), t.is_cuda)
        if events is not None:
            self._events.append(events)
        return t

    def reduce_add_rms_norm(self, h, addend, weight, eps, extra=None):
        """The backend's fused launch where it has one (``symm_mem_fused``; timed as an all-reduce, the add + norm
        included), else the partial combined in one launch, all-reduced, then ``add_rms_norm``."""
        from rimuru.kernels.allreduce_norm import combine_partial
        from rimuru.kernels.norm_rope import add_rms_norm

        self._check_alive()
        fused, events = self._timed(lambda: self.backend.add_rms_norm(h, addend, weight, eps, extra), h.is_cuda)
        if fused is None:
            return add_rms_norm(h, self.all_reduce(combine_partial(addend, extra)), weight, eps)
        if events is not None:
            self._events.append(events)
        self.calls += 1
        return fused

    def min_int(self, value: int) -> int:
        import torch.distributed as dist

        self._check_alive()
        backend_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=backend_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[world, *t.shape]``: every rank's ``t`` in rank order (the process group: NCCL or gloo)."""
        import torch.distributed as dist

        self._check_alive()
        t = t.contiguous()
        if t.is_cuda:
            out = torch.empty((self.world_size, *t.shape), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, t)
            return out
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        return torch.stack(parts)

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        parts = self._all_gather(local)  # [world, S, V / world]
        return parts.permute(1, 0, 2).reshape(local.shape[0], -1)

    def greedy_tokens(self, local: torch.Tensor) -> torch.Tensor:
        """Each rank's first maximum and its global id (fp32: exact below 2^24), gathered ``[world, S, 2]``; the
        rank with the largest value wins, the lowest rank on a tie (its ids are the lower ones): ``torch.argmax``
        of the gathered logits, from ``S * 2`` values per rank instead of ``S * V / world``."""
        idx = torch.argmax(local, dim=-1)
        best = local.gather(1, idx[:, None]).float()
        ids = (idx + self.shard.rank * local.shape[1]).to(torch.float32)[:, None]
        parts = self._all_gather(torch.cat([best, ids], dim=1))  # [world, S, 2]
        winner = torch.argmax(parts[..., 0], dim=0)  # [S]: the first (lowest) rank with the maximum
        return parts[..., 1].gather(0, winner[None])[0].to(torch.int64)

    def pop_all_reduce_ms(self) -> float:
        """Milliseconds spent in all-reduces recorded since the last call (synchronises the device)."""
        if not self._events:
            return 0.0
        self._events[-1][1].synchronize()
        total = sum(s.elapsed_time(e) for s, e in self._events)
        self._events.clear()
        return total


def time_all_reduces(comm: TorchDistributed, rows: int, cols: int, dtype: torch.dtype, calls: int, iters: int,
                     backend: str | None = None, sublayer: bool = False) -> float:
    """Milliseconds for ``calls`` all-reduces of a ``[rows, cols]`` tensor — what one decode step of a model with
    ``calls`` all-reduces spends in them when no rank waits for another. Every rank calls this at once.
    ``sublayer``: ``calls`` whole sub-layer ends instead (``reduce_add_rms_norm``: the all-reduce with the residual
    add and the next RMSNorm, one launch where the backend fuses them, the composed launches elsewhere) — how the
    model calls the backend, and the only way to time a fused backend's own exchange (its plain ``all_reduce`` is
    ``symm_mem``'s).

    On a GPU the ``calls`` all-reduces are captured in one CUDA graph (as in a graphed decode step) and the graph
    is replayed ``iters`` times back to back after a synchronising all-reduce, so a rank's late start is paid
    once, not per replay; the result is the total over the replays / ``iters``. On the CPU (gloo) the calls run
    eagerly. ``backend``: an all-reduce backend's name (None: the one in use); the one in use is restored after."""
    in_use = comm.backend
    if backend:
        comm.use_all_reduce(backend, dtype)  # built now on every rank if it was not (they all run this at once)
    try:
        return _time_all_reduces(comm, rows, cols, dtype, calls, iters, sublayer)
    finally:
        comm.backend = in_use


def _time_all_reduces(comm: TorchDistributed, rows: int, cols: int, dtype: torch.dtype, calls: int,
                      iters: int, sublayer: bool) -> float:
    device = comm.device
    t = torch.ones(rows, cols, dtype=dtype, device=device)
    if sublayer:  # the residual, this rank's partial and the norm's weight: the same tensors every call
        h, w = torch.ones_like(t), torch.ones(cols, dtype=dtype, device=device)

        def call() -> None:
            comm.reduce_add_rms_norm(h, t, w, 1e-6)
    else:
        def call() -> None:
            comm.all_reduce(t)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters * calls):
            call()
        return (time.perf_counter() - start) * 1e3 / iters
    for _ in range(calls):  # eager once: the communicator is set up outside the capture
        call()
    torch.cuda.synchronize(device)
    graph, _ = capture(lambda: [call() for _ in range(calls)], device)
    # every rank here: the timed replays start together
    return replay_ms(graph, iters, device, before=lambda: comm.all_reduce(torch.ones(1, device=device)))
