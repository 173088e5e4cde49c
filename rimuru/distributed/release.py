"""Releasing this rank's kernels that wait for a dead peer, through the copy engines.

A peer-memory all-reduce kernel (PyTorch's symmetric-memory barrier, Rimuru's flag and flag-free exchanges) spins on
the GPU until its peer writes a flag or a row; a killed peer never does, the kernel never ends, and every later call
that waits for the device (NCCL's abort, a free, the process's exit path) waits for ever. Rank 0's monitor therefore
writes what the dead peer would have written (:meth:`SymmMemAllReduce.release_fills
<rimuru.distributed.allreduce.SymmMemAllReduce.release_fills>`) until the device drains.

Until wave 9 those writes were ``fill_`` / ``zero_`` *kernels* on a side stream followed by a blocking
``synchronize``. On 2x H200 (results/reference/e2e_tp2/levers_48L/) the side stream's fill once never completed, the
release thread stayed inside ``synchronize`` and NCCL's abort waited on a device that never drained. A kernel needs a
free slot on an SM, and a kernel waiting for the dead rank may hold the slots (with programmatic dependent launches the
next kernel's programs are resident too). So the writes are now host-to-device copies from small pinned buffers of the
right bytes (``cudaMemcpy2DAsync``, cuda-python's runtime binding): the copy engines run them and no SM is needed. A
column of a signal pad (one flag per block, ``world`` flags apart) is one strided 2-D copy, never a kernel.

Two more things the wave-9 stall could be, which copies alone do not remove, and what this module does about them:

* A stream shares one of the driver's hardware work queues with other streams once there are more streams than
  connections (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default); work behind a stuck kernel in the same queue waits for
  it (a false dependency). The writes therefore go round-robin over several side streams made at set-up, and the loop
  never blocks on one: it issues a new round on a stream only once that stream's last round completed, and it polls.
* The wait itself: ``synchronize`` is a blocking driver call with no timeout. Here every wait is an event query, so
  :func:`release` returns by its deadline whatever the device does; the process's last resort
  (rimuru/distributed/group.py) then ends it loudly if the engine thread is still stuck.

What was written, on which stream, and whether the device drained is returned (:class:`ReleaseReport`) and printed on
stderr by the caller: the evidence for which of the hypotheses held on the GPU. Not yet run on GPUs.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

ZERO = 0  # zero bytes: a cleared flag, +0.0 in a receive buffer (the flag-free exchange's "row here")
ONE = 1  # an int32 one: a raised flag
VALUES = (ZERO, ONE)
POLL_S = 0.001  # between rounds: the copies are a few KiB plus one receive buffer (4 MiB), ~0.1 ms at PCIe rates
RELEASE_STREAMS = 4  # side streams the writes rotate over (see the module docstring: shared hardware queues)


@dataclass(frozen=True)
class Fill:
    """One region to overwrite: ``target`` (a view of device memory, this rank's or a peer's mapped into this
    process) gets ``value`` in every element (``ONE``: int32 targets only)."""

    target: torch.Tensor
    value: int


@dataclass(frozen=True)
class Copy2D:
    """A fill as one 2-D copy: ``height`` rows of ``width`` bytes at ``dst``, ``dpitch`` bytes apart; the source is
    ``width * height`` bytes of ``value`` laid out densely (source pitch ``width``)."""

    dst: int
    dpitch: int
    width: int
    height: int
    value: int

    @property
    def nbytes(self) -> int:
        return self.width * self.height


def copy_plan(fill: Fill) -> Copy2D:
    """The 2-D copy that writes ``fill``: a contiguous view is one row; a 1-D strided view (a signal pad's column) is
    one element a row, ``stride`` elements apart; a 2-D view with contiguous rows is its rows. Anything else (or a
    value the pinned sources do not hold) is a ``ValueError``: a release must never write past its target."""
    t, value = fill.target, fill.value
    if value not in VALUES:
        raise ValueError(f"a release writes 0 or 1, got {value!r}")
    if value == ONE and t.dtype != torch.int32:
        raise ValueError(f"a raised flag is an int32 one; the target is {t.dtype}")
    size = t.element_size()
    if t.numel() == 0:
        raise ValueError("a release fill needs a non-empty target")
    if t.is_contiguous():
        return Copy2D(t.data_ptr(), t.numel() * size, t.numel() * size, 1, value)
    if t.dim() == 1:
        return Copy2D(t.data_ptr(), t.stride(0) * size, size, t.numel(), value)
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.size(1):
        return Copy2D(t.data_ptr(), t.stride(0) * size, t.size(1) * size, t.size(0), value)
    raise ValueError(f"a release fill needs rows of contiguous bytes; got shape {tuple(t.shape)} "
                     f"stride {t.stride()}")


class Sources:
    """The bytes the copies read: a buffer of zeros of ``zero_bytes`` and one of int32 ones of ``one_bytes``, pinned
    on CUDA (a copy engine reads page-locked memory only). Made when the backends are built, never at failure time:
    a host allocation then is one more driver call that could wait."""

    def __init__(self, zero_bytes: int, one_bytes: int, pin: bool) -> None:
        self.zeros = torch.zeros(max(1, (zero_bytes + 3) // 4), dtype=torch.int32, pin_memory=pin)
        self.ones = torch.ones(max(1, (one_bytes + 3) // 4), dtype=torch.int32, pin_memory=pin)

    @classmethod
    def for_fills(cls, fills: Sequence[Fill], pin: bool) -> Sources:
        """Sources large enough for every fill of ``fills``."""
        copies = [copy_plan(f) for f in fills]
        return cls(max((c.nbytes for c in copies if c.value == ZERO), default=0),
                   max((c.nbytes for c in copies if c.value == ONE), default=0), pin)

    def address(self, copy: Copy2D) -> int:
        src = self.ones if copy.value == ONE else self.zeros
        if copy.nbytes > src.numel() * 4:
            raise ValueError(f"a release copy of {copy.nbytes} bytes exceeds its {src.numel() * 4}-byte source")
        return src.data_ptr()


class Copies2D(Protocol):
    """Issues ``height`` rows of ``width`` bytes from ``src`` (pitch ``spitch``) to ``dst`` (pitch ``dpitch``) on
    ``stream`` (a raw stream handle), asynchronously."""

    def __call__(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None: ...


class CudaRuntimeCopies:
    """:class:`Copies2D` on the copy engines: ``cudaMemcpy2DAsync`` host to device (cuda-python's runtime binding,
    ``cuda-bindings``). A failed call raises ``RuntimeError`` naming the CUDA error."""

    def __init__(self, runtime=None) -> None:
        if runtime is None:
            from cuda.bindings import runtime
        self.rt = runtime
        self.kind = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice

    def __call__(self, dst, dpitch, src, spitch, width, height, stream) -> None:
        err, *_ = self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, self.kind,
                                            self.rt.cudaStream_t(stream))  # the raw handle, as the binding's type
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpy2DAsync: {err!r}")


def host_copies(dst, dpitch, src, spitch, width, height, stream) -> None:
    """:class:`Copies2D` between host addresses, row by row (``ctypes.memmove``): what the copy engine does, for the
    CPU tests (the targets are CPU tensors there)."""
    for row in range(height):
        ctypes.memmove(dst + row * dpitch, src + row * spitch, width)


class ReleaseDevice(Protocol):
    """What :func:`release` needs from the device: write a fill on a stream, mark a stream's position, ask whether a
    mark passed, and whether the work that waits for the dead rank has drained."""

    def write(self, fill: Fill, stream) -> str:
        """Issue ``fill`` on ``stream``; returns how ("copy_engine", or "kernel" where the copy could not be
        issued)."""

    def mark(self, stream): ...

    def passed(self, mark) -> bool: ...

    def drained(self) -> bool: ...


class CudaReleaseDevice:
    """:class:`ReleaseDevice` on a CUDA device: fills become copy-engine copies (:func:`copy_plan`, ``copies``), marks
    are events, "drained" is an event recorded on the stream the engine's steps run on when the release began. Without
    ``copies`` (no ``cuda-bindings``), or for a fill whose copy cannot be issued (a binding or CUDA error), the write
    is the ``fill_`` kernel of wave 9, and the reason is kept (``fallback``)."""

    def __init__(self, device: torch.device, sources: Sources, copies: Copies2D | None) -> None:
        self.device, self.sources, self.copies = device, sources, copies
        self.fallback: str | None = None if copies is not None else "cuda-bindings is not installed"
        self.probe = torch.cuda.Event()
        self.probe.record(torch.cuda.current_stream(device))

    def write(self, fill: Fill, stream) -> str:
        if self.copies is not None:
            c = copy_plan(fill)
            try:
                self.copies(c.dst, c.dpitch, self.sources.address(c), c.width, c.width, c.height, stream.cuda_stream)
                return "copy_engine"
            except Exception as exc:  # noqa: BLE001 - this fill by kernel (where SMs are free); the others still copy
                self.fallback = f"{type(exc).__name__}: {exc}"
        with torch.cuda.stream(stream):
            fill.target.fill_(fill.value)
        return "kernel"

    def mark(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def passed(self, mark) -> bool:
        return mark.query()

    def drained(self) -> bool:
        return self.probe.query()


@dataclass
class ReleaseReport:
    """What :func:`release` did: whether the device drained and after how long, the rounds issued and completed on
    each side stream, how the writes went (copy engine / kernel) and why a kernel was used."""

    drained: bool = False
    seconds: float = 0.0
    issued: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    ways: dict[str, int] = field(default_factory=dict)
    fallback: str | None = None

    def line(self) -> str:
        return (f"peer release: drained={self.drained} after {self.seconds:.3f} s; rounds issued {self.issued}, "
                f"completed {self.completed} per side stream; writes {self.ways}"
                + (f"; kernel fallback: {self.fallback}" if self.fallback else ""))


PROGRESS_S = (1.0, 5.0, 15.0)  # a release still running then reports so far (the process may end before it does)


def release(fills: Sequence[Fill], device: ReleaseDevice, streams: Sequence, timeout_s: float,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
            progress: Callable[[ReleaseReport], None] | None = None) -> ReleaseReport:
    """Write ``fills`` round after round, rotating over ``streams``, until ``device.drained()`` or ``timeout_s``.

    A stream gets its next round only once its last one completed (``passed``): a stream whose queue sits behind a
    stuck kernel holds one round, never a growing backlog, while the others keep writing. Nothing here blocks on the
    device, so the call returns by ``timeout_s`` (plus one round's issue) whatever the device does. ``progress``
    gets the report so far at each of ``PROGRESS_S`` the release is still running (a process that ends with the
    error meanwhile keeps the evidence)."""
    report = ReleaseReport(issued=[0] * len(streams), completed=[0] * len(streams))
    start = clock()
    pending: list = [None] * len(streams)
    ticks = list(PROGRESS_S)
    while not device.drained():
        elapsed = clock() - start
        if elapsed >= timeout_s:
            break
        if progress is not None and ticks and elapsed >= ticks[0]:
            ticks = [t for t in ticks if t > elapsed]
            report.seconds = elapsed
            progress(report)
        for i, stream in enumerate(streams):
            if pending[i] is not None:
                if not device.passed(pending[i]):
                    continue
                report.completed[i] += 1
            for fill in fills:
                way = device.write(fill, stream)
                report.ways[way] = report.ways.get(way, 0) + 1
            pending[i] = device.mark(stream)
            report.issued[i] += 1
        sleep(POLL_S)
    else:
        report.drained = True
    report.seconds = clock() - start
    for i, mark in enumerate(pending):  # the last round of each stream, if it ran
        if mark is not None and device.passed(mark):
            report.completed[i] += 1
    report.fallback = device.fallback
    return report


class ReleaseKit:
    """What rank 0 needs to release its device when a peer dies, made at set-up (when the backends are built): the
    pinned sources for ``fills`` (every fill any dead rank could need), ``RELEASE_STREAMS`` side streams and the
    copy-engine binding (None without ``cuda-bindings``: the writes are then the kernels of wave 9)."""

    def __init__(self, device: torch.device, fills: Sequence[Fill], streams: int = RELEASE_STREAMS) -> None:
        self.device = device
        self.sources = Sources.for_fills(fills, pin=True)
        with torch.cuda.device(device):
            self.streams = [torch.cuda.Stream(device) for _ in range(streams)]
        self.copies: Copies2D | None = None
        self.fallback: str | None = None
        try:
            self.copies = CudaRuntimeCopies()
            self._first_copy()
        except Exception as exc:  # noqa: BLE001 - no binding, or it cannot copy here: the kernels of wave 9
            self.copies, self.fallback = None, f"{type(exc).__name__}: {exc}"

    def _first_copy(self) -> None:
        """One 4-byte copy now, at set-up, on the first side stream: whatever the binding initialises on its first
        call (its runtime, the context) happens here, not while a kernel spins for a dead rank. (A first launch of a
        kernel under CUDA's lazy module loading can need a context synchronisation, which a spinning kernel never
        allows: one more reason the release launches no kernel.)"""
        scratch = torch.zeros(1, dtype=torch.int32, device=self.device)
        fill = Fill(scratch, ONE)
        c = copy_plan(fill)
        self.copies(c.dst, c.dpitch, self.sources.address(c), c.width, c.width, c.height,
                    self.streams[0].cuda_stream)
        self.streams[0].synchronize()
        if int(scratch.item()) != 1:
            raise RuntimeError("the set-up copy did not land")

    @property
    def way(self) -> str:
        """How this kit writes: ``copy_engine``, or ``kernels (why)``."""
        return "copy_engine" if self.copies is not None else f"kernels ({self.fallback})"

    def run(self, fills: Sequence[Fill], timeout_s: float,
            progress: Callable[[ReleaseReport], None] | None = None) -> ReleaseReport:
        with torch.cuda.device(self.device):
            device = CudaReleaseDevice(self.device, self.sources, self.copies)
            if self.copies is None:
                device.fallback = self.fallback or device.fallback
            return release(fills, device, self.streams, timeout_s, progress=progress)
