"""The all-reduce behind the tensor-parallel forward: named backends, one chosen at engine start.

``ALL_REDUCE_BACKENDS`` maps a name to a factory; every backend is an :class:`AllReduceBackend`:

* ``nccl`` / ``gloo`` — ``torch.distributed.all_reduce`` over the engine's process group (NCCL on GPUs, gloo on
  CPUs). NCCL's small all-reduce costs ~21 µs per call on 2× H200 over NVLink (results/reference/e2e_tp2/
  graphed_48L): latency, not bytes, at a decode step's 256 KiB.
* ``symm_mem`` — a one-shot all-reduce over NVLink peer memory, PyTorch's symmetric memory
  (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``): one kernel copies this rank's partial sum into its
  symmetric buffer, meets the other ranks at a barrier of signal pads, reads every rank's buffer over NVLink and
  writes the sum in place. The buffer and the signal pads are allocated and exchanged once (``rendezvous``), so the
  call is capturable in CUDA graphs. Peer memory only: NVLink multicast stays off
  (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, never the ``multimem`` operations).
* ``symm_mem_two_shot`` — the same buffer, PyTorch's two-shot kernel (reduce-scatter then all-gather over peer
  memory; a copy into the buffer first).
* ``symm_mem_fused`` — 2 ranks: the model's all-reduce *and* the residual add + RMSNorm after it in one Triton
  launch over peer memory (rimuru/kernels/allreduce_norm.py: each rank pushes its partial rows into the peer's
  receive buffer, a per-row flag handshake, then sum, add, norm), and the MoE's sum over its expert rows folded into
  the same launch: one kernel per sub-layer where the others take four (sum, cast, all-reduce, add + norm). Its
  plain ``all_reduce`` (anything else that sums) is ``symm_mem``'s.
* ``symm_mem_lamport`` — ``symm_mem_fused`` without the flags: the receive buffer holds an empty value (-0.0) where
  no row is pending, and a reader polls the pushed row itself (no fence, no atomic per call; the partial is never
  sent as -0.0). ``auto``'s first choice since wave 7: 3.9 vs 5.1 µs a sub-layer end at 64 rows, 0.11 ms off the
  48-layer step (results/reference/e2e_tp2/lamport_48L/).

Every backend answers ``add_rms_norm`` (the fused sub-layer end): ``None`` where it does not fuse it, and the
communicator then composes :func:`rimuru.kernels.allreduce_norm.combine_partial`, ``all_reduce`` and
``add_rms_norm`` (three launches).

A symmetric-memory backend sends what it should not take to the process group (NCCL): tensors over its buffer
(``max_bytes``, prefill's large sums), other dtypes, non-contiguous or misaligned tensors. The decision is a pure
function of the tensor's size, dtype and layout (:func:`symm_mem_takes`), so every rank takes the same path.

``auto`` (the default) is ``symm_mem_lamport``, ``symm_mem_fused``, then ``nccl`` on GPUs (``nccl`` wherever the
fused backends cannot run: not 2 ranks, no peer access, another dtype) and ``gloo`` on CPUs; ``symm_mem_or_nccl``
tries ``symm_mem`` then ``nccl``. History: ``auto`` took ``symm_mem`` first until wave 5, then ``nccl`` (a killed
rank of a graphed ``symm_mem`` engine was not reported within 75 s, results/reference/e2e_tp2/async_48L/); in wave 6
the fused backend (results/reference/e2e_tp2/fused_48L/, 2x H200, 48-layer decode, async: 9.37 vs 10.27 ms NCCL at
64 running, a killed rank reported in 5.2 s, as NCCL and ``symm_mem``); since wave 7 the flag-free one
(results/reference/e2e_tp2/lamport_48L/: 9.26 vs 9.37 ms with the fused one, both with a vocabulary-parallel head,
fp32 greedy identical to TP=1, a killed rank reported in 5.15 s). Every rank checks a candidate locally, then
the ranks agree (a MIN all-reduce over the group) before the collective set-up and again after it; the first
candidate every rank could build is used by all (:func:`select_all_reduce`). A single name asked for explicitly
gets no fallback: it works on every rank or the engine does not start, with the reason.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rimuru.distributed.release import ONE, ZERO, Fill

AUTO = "auto"
SYMM_MEM_OR_NCCL = "symm_mem_or_nccl"
SYMM_MEM_MAX_BYTES = 2 << 20  # 2 MiB: every decode bucket up to 512 rows of a 2048-wide bf16 model; prefill -> NCCL
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)  # what PyTorch's symmetric-memory kernels reduce
SYMM_MEM_ALIGN = 16  # bytes: the kernels' widest vector; the buffer view and the input must agree on alignment
MULTICAST_OFF = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
# ALL_REDUCE_BACKENDS' names, auto and the one fallback order
FUSED_MAX_ROWS = 4096  # rows (tokens) one fused call takes: one int32 flag per row and peer
ALL_REDUCE_CHOICES = (AUTO, "nccl", "gloo", "symm_mem", "symm_mem_two_shot", "symm_mem_fused", "symm_mem_lamport",
                      SYMM_MEM_OR_NCCL)


class AllReduceUnavailable(RuntimeError):
    """A backend cannot run here (missing support, no peer access, a failed set-up); the message says why."""


@dataclass(frozen=True)
class AllReduceContext:
    """What a backend is built for: this rank's device, its rank and the world, the model dtype, the group name."""

    device: torch.device
    rank: int
    world: int
    dtype: torch.dtype
    group_name: str


class AllReduceBackend(Protocol):
    name: str

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns the sum (in ``t`` itself)."""

    def add_rms_norm(self, h: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float,
                     extra: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``add_rms_norm(h, all_reduce(partial), weight, eps)`` with ``partial`` = ``addend`` (``[T, d]`` or
        ``[T, k, d]`` summed) + ``extra``, fused; None: not fused here (the communicator composes it)."""

    def release_fills(self, dead: list[int]) -> list[Fill]:
        """A peer died: what this rank's device memory must hold so that its kernels waiting for the dead ranks
        finish (with garbage) and the device drains — written by rank 0's monitor through the copy engines
        (:mod:`rimuru.distributed.release`); empty where nothing spins on the GPU (the process group's abort
        releases NCCL's kernels)."""

    def close(self) -> None: ...


class ProcessGroupAllReduce:
    """``torch.distributed.all_reduce`` over the default group: NCCL on GPUs, gloo on CPUs."""

    def __init__(self, name: str) -> None:
        self.name = name

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t)
        return t

    def add_rms_norm(self, h, addend, weight, eps, extra):
        return None

    def release_fills(self, dead: list[int]) -> list[Fill]:
        return []  # the group's abort unblocks NCCL's kernels (rimuru/distributed/group.py)

    def close(self) -> None:
        pass


def symm_mem_takes(nbytes: int, offset_bytes: int, dtype: torch.dtype, contiguous: bool,
                   buffer_dtype: torch.dtype, max_bytes: int) -> bool:
    """Whether a symmetric-memory backend reduces this tensor itself (else the process group does): the buffer's
    dtype, contiguous, 16-byte aligned size and offset, at most ``max_bytes``. A pure function of the tensor's
    shape, dtype and layout: every rank decides the same."""
    return (dtype == buffer_dtype and contiguous and 0 < nbytes <= max_bytes and nbytes % SYMM_MEM_ALIGN == 0
            and offset_bytes % SYMM_MEM_ALIGN == 0)


def all_reduce_candidates(requested: str, device_type: str) -> tuple[str, ...]:
    """The backends to try, in order, for ``requested`` on this kind of device; a clear error for a choice that
    cannot run there."""
    if requested not in ALL_REDUCE_CHOICES:
        raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCE_CHOICES)}, got {requested!r}")
    if device_type != "cuda":
        if requested not in (AUTO, "gloo", SYMM_MEM_OR_NCCL):
            raise ValueError(f"all_reduce={requested!r} needs GPUs; on {device_type} the all-reduce is gloo")
        return ("gloo",)
    if requested == AUTO:
        return ("symm_mem_lamport", "symm_mem_fused", "nccl")
    if requested == SYMM_MEM_OR_NCCL:
        return ("symm_mem", "nccl")
    if requested == "gloo":
        raise ValueError("all_reduce='gloo' is the CPU backend; on GPUs use auto, nccl, symm_mem, symm_mem_two_shot "
                         "or symm_mem_fused")
    return (requested,)


_SYMM_GROUP: list = []  # the process group this process's symmetric memory was set up with (at most one)


def _rendezvous(buffer: torch.Tensor, group_name: str):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    if not _SYMM_GROUP:
        _SYMM_GROUP.append(dist.group.WORLD)

    try:
        return symm_mem.rendezvous(buffer, group_name)
    except RuntimeError as exc:  # releases that still need the group registered first (deprecated since)
        if "group info" not in str(exc) and "group_info" not in str(exc):
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        return symm_mem.rendezvous(buffer, group_name)


class SymmMemAllReduce:
    """One-shot (or two-shot) all-reduce over NVLink peer memory; what it should not take goes to ``fallback``."""

    def __init__(self, ctx: AllReduceContext, fallback: AllReduceBackend, two_shot: bool = False,
                 max_bytes: int = SYMM_MEM_MAX_BYTES) -> None:
        reason = symm_mem_unavailable(ctx)
        if reason:
            raise AllReduceUnavailable(reason)
        import torch.distributed._symmetric_memory as symm_mem

        self.name = "symm_mem_two_shot" if two_shot else "symm_mem"
        self.fallback, self.two_shot = fallback, two_shot
        self.ctx, self.dtype, self.max_bytes, self.group_name = ctx, ctx.dtype, max_bytes, ctx.group_name
        with contextlib.suppress(AttributeError, RuntimeError):  # the peer-memory backend (a no-op if it is already)
            symm_mem.set_backend("CUDA")
        self.buffer = symm_mem.empty(max_bytes // ctx.dtype.itemsize, dtype=ctx.dtype, device=ctx.device)
        self.handle = _rendezvous(self.buffer, ctx.group_name)
        ops = torch.ops.symm_mem
        self._one_shot = ops.one_shot_all_reduce_copy_out if not two_shot else None
        self._two_shot = ops.two_shot_all_reduce_out if two_shot else None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        size = t.element_size()
        if not symm_mem_takes(t.numel() * size, t.storage_offset() * size, t.dtype, t.is_contiguous(), self.dtype,
                              self.max_bytes):
            return self.fallback.all_reduce(t)
        buf = self.buffer[: t.numel()].view(t.shape)
        if self._one_shot is not None:  # copy in, barrier, every rank's buffer summed into t: one kernel
            return self._one_shot(buf, t, "sum", self.group_name, t)
        buf.copy_(t)
        return self._two_shot(buf, "sum", self.group_name, t)

    def add_rms_norm(self, h, addend, weight, eps, extra):
        return None

    def release_fills(self, dead: list[int]) -> list[Fill]:
        """PyTorch's barrier (``sync_remote_blocks``): block ``b`` of rank ``r`` raises flag ``[b, r]`` in every
        rank's signal pad (a compare-and-swap 0 -> 1 that waits while it is 1), then waits for flag ``[b, peer]`` in
        its own pad to be 1 and lowers it. So for a dead rank ``d``: column ``d`` of this rank's pad raised (every
        wait for it passes) and column ``me`` of ``d``'s pad lowered (every put into it passes); this rank's own
        column (raised and lowered by one thread within one barrier) is never touched. The sums are garbage; the
        engine is ending with the error."""
        me = self.ctx.rank
        mine = self._pad(me)
        fills = []
        for r in dead:
            fills += [Fill(mine[:, r], ONE), Fill(self._pad(r)[:, me], ZERO)]
        return fills

    def _pad(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s signal pad as ``[blocks, world]`` int32 flags: flag ``[b, r]`` is rank ``r``'s arrival at
        block ``b``'s barrier (PyTorch's ``sync_remote_blocks``)."""
        pad = self.handle.get_signal_pad(rank).view(torch.int32)
        world = self.ctx.world
        return pad[: pad.numel() // world * world].view(-1, world)

    def close(self) -> None:
        self.handle = None


class SymmMemFusedAllReduce(SymmMemAllReduce):
    """2 ranks: the sub-layer's all-reduce fused with the residual add + RMSNorm after it (one Triton launch over
    peer memory, rimuru/kernels/allreduce_norm.py); plain all-reduces are ``symm_mem``'s one-shot. Its own
    symmetric buffers: a receive buffer of two halves of ``max_bytes`` (consecutive calls alternate, the host
    counts: every forward makes an even number of calls, so captured graphs replay the same sequence) and one int32
    flag per row."""

    def __init__(self, ctx: AllReduceContext, fallback: AllReduceBackend, max_bytes: int = SYMM_MEM_MAX_BYTES) -> None:
        if (why := _not_two_ranks(ctx)) is not None:
            raise AllReduceUnavailable(why)
        super().__init__(ctx, fallback, max_bytes=max_bytes)
        import torch.distributed._symmetric_memory as symm_mem

        self.name = "symm_mem_fused"
        self.half = max_bytes // ctx.dtype.itemsize  # elements per half of the receive buffer
        self.recv = symm_mem.empty(2 * self.half, dtype=ctx.dtype, device=ctx.device)
        self.recv_handle = _rendezvous(self.recv, ctx.group_name)
        self.flags = symm_mem.empty(FUSED_MAX_ROWS, dtype=torch.int32, device=ctx.device)
        self.flags.zero_()  # before the collective that ends the set-up (build_backend's agreement): no peer
        torch.cuda.synchronize(ctx.device)  # raises a flag here before it is zero
        self.flags_handle = _rendezvous(self.flags, ctx.group_name)
        peer = 1 - ctx.rank
        self.peer_recv = self.recv_handle.get_buffer(peer, (2 * self.half,), ctx.dtype)
        self.peer_flags = self.flags_handle.get_buffer(peer, (FUSED_MAX_ROWS,), torch.int32)
        self.parity = 0  # the half the next fused call uses (host-side; captured into graphs)

    def add_rms_norm(self, h, addend, weight, eps, extra):
        T, d = h.shape
        if not (fused_takes(T, d, self.dtype, self.max_bytes) and h.dtype == addend.dtype == weight.dtype == self.dtype
                and (extra is None or extra.dtype == self.dtype) and h.is_cuda):
            return None
        lo = self.parity * self.half
        self.parity ^= 1
        n = T * d
        return self._exchange(h, addend, weight, eps, extra, self.peer_recv[lo:lo + n], self.recv[lo:lo + n])

    def _exchange(self, h, addend, weight, eps, extra, peer_recv, my_recv):
        """The fused launch on this call's halves of the receive buffers (the flag handshake)."""
        from rimuru.kernels.allreduce_norm import one_shot_add_rms_norm

        return one_shot_add_rms_norm(h, addend, weight, eps, extra, peer_recv, my_recv, self.peer_flags, self.flags)

    def release_fills(self, dead: list[int]) -> list[Fill]:
        """Also this backend's row flags: this rank's raised (its waits pass), the dead peer's lowered (its pushes
        pass)."""
        return super().release_fills(dead) + [Fill(self.flags, ONE), Fill(self.peer_flags, ZERO)]

    def close(self) -> None:
        super().close()
        self.recv_handle = self.flags_handle = None


class SymmMemLamportAllReduce(SymmMemFusedAllReduce):
    """``symm_mem_fused`` with the flag-free exchange (rimuru/kernels/allreduce_norm.py,
    ``lamport_add_rms_norm``): the receive buffer starts empty (-0.0) and each reader empties its half again."""

    def __init__(self, ctx: AllReduceContext, fallback: AllReduceBackend, max_bytes: int = SYMM_MEM_MAX_BYTES) -> None:
        super().__init__(ctx, fallback, max_bytes=max_bytes)
        from rimuru.kernels.allreduce_norm import empty_value_fill

        self.name = "symm_mem_lamport"
        empty_value_fill(self.recv)  # before the set-up's closing agreement: no peer pushes before it is empty
        torch.cuda.synchronize(ctx.device)

    def _exchange(self, h, addend, weight, eps, extra, peer_recv, my_recv):
        """The flag-free launch (the pushed rows are the signal)."""
        from rimuru.kernels.allreduce_norm import lamport_add_rms_norm

        return lamport_add_rms_norm(h, addend, weight, eps, extra, peer_recv, my_recv)

    def release_fills(self, dead: list[int]) -> list[Fill]:
        """Also this rank's receive buffer, zero bytes (+0.0, not the empty value -0.0): every pending poll
        passes."""
        return super().release_fills(dead) + [Fill(self.recv, ZERO)]


def fused_takes(rows: int, cols: int, dtype: torch.dtype, max_bytes: int) -> bool:
    """Whether ``symm_mem_fused`` fuses a ``[rows, cols]`` sub-layer end (else the communicator composes it): at
    most ``FUSED_MAX_ROWS`` rows and ``max_bytes``. A pure function of the shape: every rank, every call of a
    forward decides the same (the halves' alternation relies on it)."""
    return 0 < rows <= FUSED_MAX_ROWS and rows * cols * dtype.itemsize <= max_bytes


def symm_mem_unavailable(ctx: AllReduceContext) -> str | None:
    """Why the symmetric-memory all-reduce cannot run on this rank (None: it can): checked locally, before any
    collective set-up."""
    if ctx.device.type != "cuda":
        return f"symmetric memory needs CUDA devices, not {ctx.device.type}"
    if ctx.dtype not in SYMM_MEM_DTYPES:
        return f"PyTorch's symmetric-memory all-reduce sums bf16 and fp32, not {ctx.dtype}"
    if os.environ.setdefault(MULTICAST_OFF, "1") != "1":
        return f"{MULTICAST_OFF}={os.environ[MULTICAST_OFF]!r}: NVLink multicast must stay off on these machines"
    if _SYMM_GROUP:
        import torch.distributed as dist

        if _SYMM_GROUP[0] is not dist.group.WORLD:
            # PyTorch numbers its rendezvous exchanges per process (and older releases keep one store per group
            # name): a later engine's fresh workers would wait for keys this process never writes
            return ("symmetric memory was set up for an earlier process group of this process; one engine with "
                    "tensor parallelism per process can use it")
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        ops = torch.ops.symm_mem
        ops.one_shot_all_reduce_copy_out, ops.two_shot_all_reduce_out  # noqa: B018 - resolved once, here
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"this PyTorch has no symmetric-memory all-reduce ({type(exc).__name__}: {exc})"
    index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
    first = index - ctx.rank  # the group's GPUs are consecutive (rimuru.distributed.group.rank_device)
    for peer in range(first, first + ctx.world):
        if peer != index and not torch.cuda.can_device_access_peer(index, peer):
            return f"GPU {index} cannot access GPU {peer}'s memory (no peer access)"
    return None


def _not_two_ranks(ctx: AllReduceContext) -> str | None:
    return None if ctx.world == 2 else f"symm_mem_fused is written for 2 ranks, not {ctx.world}"


def fused_unavailable(ctx: AllReduceContext) -> str | None:
    """Why ``symm_mem_fused`` cannot run on this rank (None: it can): ``symm_mem``'s reasons, and 2 ranks."""
    return _not_two_ranks(ctx) or symm_mem_unavailable(ctx)


@dataclass(frozen=True)
class BackendEntry:
    """A registry entry: a local check (why this rank cannot run the backend, or None), then the build (which may be
    a collective: every rank builds at once, after the ranks agreed that every rank passed its check)."""

    unavailable: Callable[[AllReduceContext], str | None]
    build: Callable[[AllReduceContext, AllReduceBackend], AllReduceBackend]


def _always(ctx: AllReduceContext) -> str | None:
    return None


def _the_group(ctx: AllReduceContext, group: AllReduceBackend) -> AllReduceBackend:
    return group


ALL_REDUCE_BACKENDS: dict[str, BackendEntry] = {
    "nccl": BackendEntry(_always, _the_group),
    "gloo": BackendEntry(_always, _the_group),
    "symm_mem": BackendEntry(symm_mem_unavailable, lambda ctx, group: SymmMemAllReduce(ctx, group)),
    "symm_mem_two_shot": BackendEntry(symm_mem_unavailable,
                                      lambda ctx, group: SymmMemAllReduce(ctx, group, two_shot=True)),
    "symm_mem_fused": BackendEntry(fused_unavailable, lambda ctx, group: SymmMemFusedAllReduce(ctx, group)),
    "symm_mem_lamport": BackendEntry(fused_unavailable, lambda ctx, group: SymmMemLamportAllReduce(ctx, group)),
}


@dataclass
class Selection:
    """The backend every rank uses, and why earlier candidates were passed over (this rank's reasons)."""

    backend: AllReduceBackend
    requested: str
    skipped: dict[str, str]

    def report(self) -> dict:
        return {"all_reduce": self.backend.name, "all_reduce_requested": self.requested,
                "all_reduce_skipped": dict(self.skipped)}


def process_group_backend(ctx: AllReduceContext) -> ProcessGroupAllReduce:
    return ProcessGroupAllReduce("nccl" if ctx.device.type == "cuda" else "gloo")


def build_backend(name: str, ctx: AllReduceContext, agree: Callable[[bool], bool],
                  registry: dict[str, BackendEntry] | None = None) -> tuple[AllReduceBackend | None, str | None]:
    """Build backend ``name`` on every rank or on none: (backend, None), or (None, this rank's reason). Two
    agreements: after the local checks (so that no rank enters a collective set-up alone) and after the build."""
    entry = (ALL_REDUCE_BACKENDS if registry is None else registry)[name]
    try:
        reason = entry.unavailable(ctx)
    except Exception as exc:  # noqa: BLE001 - a check that fails is a reason
        reason = f"{type(exc).__name__}: {exc}"
    if not agree(reason is None):
        return None, reason or "unavailable on another rank"
    backend = None
    try:
        backend = entry.build(ctx, process_group_backend(ctx))
    except Exception as exc:  # noqa: BLE001 - a set-up that fails: the next candidate
        reason = str(exc) if isinstance(exc, AllReduceUnavailable) else f"{type(exc).__name__}: {exc}"
    if agree(backend is not None):
        return backend, None
    if backend is not None:
        backend.close()
    return None, reason or "set-up failed on another rank"


def select_all_reduce(requested: str, ctx: AllReduceContext, agree: Callable[[bool], bool],
                      registry: dict[str, BackendEntry] | None = None) -> Selection:
    """The first of ``all_reduce_candidates(requested, …)`` that every rank can build (:func:`build_backend`).
    ``agree(ok)`` is True when ``ok`` holds on every rank (a collective: every rank calls it the same number of
    times, in the same order). An explicit choice (one candidate) that fails raises ``AllReduceUnavailable`` with
    this rank's reason; ``auto`` ends at the process group, which always builds."""
    skipped: dict[str, str] = {}
    for name in all_reduce_candidates(requested, ctx.device.type):
        backend, reason = build_backend(name, ctx, agree, registry)
        if backend is not None:
            return Selection(backend, requested, skipped)
        skipped[name] = reason or "unavailable"
    raise AllReduceUnavailable(f"all_reduce={requested!r} cannot run on every rank: "
                               + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
