"""The peer release (rimuru/distributed/release.py): what a dead peer's release writes, where, how (2-D copies, never a
kernel), and that its loop is bounded whatever the device does. CPU: the "device memory" is CPU tensors and the
copy engine is a host memmove of the same 2-D copies; the GPU test at the end runs the real copy engine."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rimuru.distributed.allreduce import (
    AllReduceContext,
    SymmMemAllReduce,
    SymmMemFusedAllReduce,
    SymmMemLamportAllReduce,
)
from rimuru.distributed.release import (
    ONE,
    ZERO,
    Copy2D,
    CudaRuntimeCopies,
    Fill,
    Sources,
    copy_plan,
    host_copies,
    release,
)

GUARD = 7  # words around every target: a release must never write past it


def test_copy_plan_contiguous_strided_column_and_rows():
    buf = torch.zeros(24, dtype=torch.int32)
    c = copy_plan(Fill(buf[4:10], ZERO))
    assert c == Copy2D(buf.data_ptr() + 16, 24, 24, 1, ZERO)
    pad = buf.view(-1, 3)  # [8 blocks, world 3]
    c = copy_plan(Fill(pad[:, 2], ONE))  # one rank's column: one int32 a row, 12 bytes apart
    assert (c.dst, c.dpitch, c.width, c.height) == (buf.data_ptr() + 8, 12, 4, 8)
    c = copy_plan(Fill(pad[:, 1:], ONE))  # rows of two flags
    assert (c.dst, c.dpitch, c.width, c.height) == (buf.data_ptr() + 4, 12, 8, 8)


def test_copy_plan_refuses_what_it_cannot_write_exactly():
    with pytest.raises(ValueError, match="0 or 1"):
        copy_plan(Fill(torch.zeros(4, dtype=torch.int32), 2))
    with pytest.raises(ValueError, match="int32"):
        copy_plan(Fill(torch.zeros(4), ONE))
    with pytest.raises(ValueError, match="contiguous bytes"):
        copy_plan(Fill(torch.zeros(4, 4, dtype=torch.int32)[:, ::2], ONE))
    with pytest.raises(ValueError, match="non-empty"):
        copy_plan(Fill(torch.zeros(0, dtype=torch.int32), ZERO))
    small = Sources(8, 8, pin=False)
    with pytest.raises(ValueError, match="exceeds"):
        small.address(copy_plan(Fill(torch.zeros(3, dtype=torch.int32), ONE)))


class HostDevice:
    """A ReleaseDevice on CPU memory: writes are ``host_copies`` of the 2-D copies the CUDA device issues; a stream's
    rounds complete unless the stream is ``stuck``; the device drains after ``drain_after`` polls (never: None)."""

    fallback = None

    def __init__(self, sources, stuck=(), drain_after=None):
        self.sources, self.stuck, self.drain_after = sources, set(stuck), drain_after
        self.polls, self.copies = 0, []

    def write(self, fill, stream):
        c = copy_plan(fill)
        self.copies.append((stream, c))
        host_copies(c.dst, c.dpitch, self.sources.address(c), c.width, c.width, c.height, stream)
        return "copy_engine"

    def mark(self, stream):
        return stream

    def passed(self, mark):
        return mark not in self.stuck

    def drained(self):
        self.polls += 1
        return self.drain_after is not None and self.polls > self.drain_after


class FakeHandle:
    """Symmetric memory's handle over CPU tensors: each rank's signal pad (uint32 words)."""

    def __init__(self, pads):
        self.pads = pads

    def get_signal_pad(self, rank):
        return self.pads[rank]


def _guarded(n, dtype, fill_value):
    """A tensor of ``n`` elements inside a larger one whose guard words hold a marker."""
    whole = torch.full((n + 2 * GUARD,), fill_value, dtype=dtype)
    return whole, whole[GUARD:GUARD + n]


def _backend(cls, world=2, rank=0, blocks=6, dtype=torch.float32):
    b = object.__new__(cls)
    b.ctx = AllReduceContext(torch.device("cpu"), rank, world, dtype, "0")
    wholes, pads = [], []
    for _ in range(world):
        whole, pad = _guarded(blocks * world, torch.int32, 5)  # 5: a flag value no release writes
        wholes.append(whole)
        pads.append(pad)
    b.handle = FakeHandle(pads)
    b._wholes = wholes
    if cls is not SymmMemAllReduce:
        b._flags_whole, b.flags = _guarded(16, torch.int32, 5)
        b._peer_flags_whole, b.peer_flags = _guarded(16, torch.int32, 5)
    if cls is SymmMemLamportAllReduce:
        b._recv_whole, b.recv = _guarded(32, dtype, -0.0)  # the empty value everywhere
    return b


@pytest.mark.parametrize("cls", [SymmMemAllReduce, SymmMemFusedAllReduce, SymmMemLamportAllReduce])
def test_release_writes_the_dead_ranks_flags_and_nothing_else(cls):
    """Rank 0 of 2, rank 1 dead: column 1 of rank 0's pad raised, column 0 of rank 1's pad lowered, both other columns
    and every guard word untouched; the fused backends' own flags raised / the peer's lowered; lamport's receive
    buffer +0.0 (sign bit clear), not the empty -0.0."""
    b = _backend(cls)
    fills = b.release_fills([1])
    sources = Sources.for_fills(fills, pin=False)
    dev = HostDevice(sources, drain_after=1)
    report = release(fills, dev, streams=[11], timeout_s=5.0)
    assert report.drained and report.ways == {"copy_engine": len(fills)}
    mine = b._pad(0)
    theirs = b._pad(1)
    assert mine[:, 1].eq(1).all() and mine[:, 0].eq(5).all()
    assert theirs[:, 0].eq(0).all() and theirs[:, 1].eq(5).all()
    for whole in b._wholes:
        assert whole[:GUARD].eq(5).all() and whole[-GUARD:].eq(5).all()
    if cls is not SymmMemAllReduce:
        assert b.flags.eq(1).all() and b.peer_flags.eq(0).all()
        for whole in (b._flags_whole, b._peer_flags_whole):
            assert whole[:GUARD].eq(5).all() and whole[-GUARD:].eq(5).all()
    if cls is SymmMemLamportAllReduce:
        assert b.recv.view(torch.int32).eq(0).all()  # +0.0 bit for bit
        edge = torch.cat([b._recv_whole[:GUARD], b._recv_whole[-GUARD:]])
        assert torch.signbit(edge).all()  # still the empty value outside the buffer
    # every write is one 2-D copy a fill: the pad columns are strided copies of 4-byte rows, never kernels
    widths = [(c.width, c.height, c.dpitch) for _, c in dev.copies]
    assert widths[:2] == [(4, 6, 8), (4, 6, 8)]


def test_release_of_rank_2_of_4_touches_only_its_columns():
    b = _backend(SymmMemAllReduce, world=4, rank=2, blocks=3)
    fills = b.release_fills([0, 3])
    release(fills, HostDevice(Sources.for_fills(fills, pin=False), drain_after=1), streams=[0], timeout_s=5.0)
    mine = b._pad(2)
    assert mine[:, 0].eq(1).all() and mine[:, 3].eq(1).all() and mine[:, 1].eq(5).all() and mine[:, 2].eq(5).all()
    for dead in (0, 3):
        pad = b._pad(dead)
        assert pad[:, 2].eq(0).all()
        assert all(pad[:, c].eq(5).all() for c in range(4) if c != 2)
    assert b._pad(1).eq(5).all()  # a live peer's pad: untouched


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_release_keeps_writing_on_free_streams_while_one_is_stuck_and_stops_at_drain():
    """A stream whose queue sits behind the stuck kernel holds one round, never a backlog; the others keep writing
    until the device drains."""
    b = _backend(SymmMemLamportAllReduce)
    fills = b.release_fills([1])
    dev = HostDevice(Sources.for_fills(fills, pin=False), stuck={"s0"}, drain_after=50)
    clock = Clock()
    report = release(fills, dev, streams=["s0", "s1", "s2"], timeout_s=30.0, clock=clock, sleep=clock.sleep)
    assert report.drained
    assert report.issued[0] == 1 and report.completed[0] == 0
    assert report.issued[1] == report.issued[2] == 50 and report.completed[1] == 50
    assert report.seconds == pytest.approx(50 * 0.001)


def test_release_returns_by_its_deadline_when_the_device_never_drains():
    b = _backend(SymmMemFusedAllReduce)
    fills = b.release_fills([1])
    dev = HostDevice(Sources.for_fills(fills, pin=False), stuck={"a", "b"})  # every queue stuck, never drains
    clock = Clock()
    report = release(fills, dev, streams=["a", "b"], timeout_s=2.0, clock=clock, sleep=clock.sleep)
    assert not report.drained and report.seconds == pytest.approx(2.0, abs=0.002)
    assert report.issued == [1, 1] and report.completed == [0, 0]
    assert len(dev.copies) == 2 * len(fills)  # one round a stream, no backlog
    assert "drained=False" in report.line()


def test_a_long_release_reports_its_progress():
    """At 1, 5 and 15 s a release still running hands out its report so far (the process may end with the error
    before the release does)."""
    b = _backend(SymmMemAllReduce)
    fills = b.release_fills([1])
    dev = HostDevice(Sources.for_fills(fills, pin=False), stuck={"b"})  # never drains
    clock, seen = Clock(), []
    report = release(fills, dev, streams=["a", "b"], timeout_s=20.0, clock=clock, sleep=clock.sleep,
                     progress=lambda r: seen.append((round(r.seconds, 2), r.drained, list(r.issued))))
    assert [s for s, _, _ in seen] == [1.0, 5.0, 15.0] and not any(d for _, d, _ in seen)
    assert seen[0][2][1] == 1 and seen[0][2][0] > 1  # the stuck stream holds its one round
    assert not report.drained


def test_cuda_runtime_copies_call_cudaMemcpy2DAsync_host_to_device():
    calls = []

    class Err:
        cudaSuccess = "ok"

    rt = types.SimpleNamespace(
        cudaMemcpyKind=types.SimpleNamespace(cudaMemcpyHostToDevice="h2d"), cudaError_t=Err,
        cudaStream_t=lambda handle: ("stream", handle), cudaMemcpy2DAsync=lambda *a: (calls.append(a), ("ok",))[1])
    copies = CudaRuntimeCopies(rt)
    copies(1000, 8, 2000, 4, 4, 6, 77)
    assert calls == [(1000, 8, 2000, 4, 4, 6, "h2d", ("stream", 77))]
    rt.cudaMemcpy2DAsync = lambda *a: ("cudaErrorInvalidValue",)
    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        copies(1000, 8, 2000, 4, 4, 6, 77)


def test_cuda_runtime_copies_import_cuda_bindings(monkeypatch):
    """Without a runtime given, the binding is cuda-python's ``cuda.bindings.runtime`` (an ImportError where it is
    not installed: the kit then falls back to kernels)."""
    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice="h2d")
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = rt
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", rt)
    assert CudaRuntimeCopies().rt is rt


def test_communicator_release_marks_dead_and_merges_every_backends_fills():
    from rimuru.distributed.comm import Shard, TorchDistributed

    comm = TorchDistributed(Shard(0, 2), torch.device("cpu"))
    assert comm.release_peers([1]) is None and comm.dead_ranks == [1]  # gloo: nothing spins, nothing to write
    lam, fused = _backend(SymmMemLamportAllReduce), _backend(SymmMemFusedAllReduce)
    comm.backends.update({"symm_mem_lamport": lam, "symm_mem_fused": fused})
    ran = []

    class Kit:
        def run(self, fills, timeout_s, progress=None):
            ran.append((len(fills), timeout_s))
            return "report"

    comm._release_kit = Kit()
    assert comm.release_peers([1], timeout_s=3.0) == "report"
    assert ran == [(len(lam.release_fills([1])) + len(fused.release_fills([1])), 3.0)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copy_engine_release_frees_spinners_that_hold_every_sm():
    """Spinners in every block slot of every SM; the flag raised through the copy engine (no SM needed): every
    program sees it, none times out (the time-out is seconds; the copy takes microseconds)."""
    from rimuru.distributed.release_probe import occupancy_probe

    cases = {c["case"]: c for c in occupancy_probe(torch.device("cuda", 0))}
    full = cases["full_copy_engine"]
    assert full["released"] == full["programs"] and full["timed_out"] == 0
    control = cases["one_per_sm_kernel"]
    assert control["released"] == control["programs"]


def test_probe_spinner_counts_released_and_timed_out_programs():
    """The GPU probes' spinner (rimuru/distributed/release_probe.py) under the interpreter: with the flag down every
    program gives up after its polls (timed out); with it raised every program is released at once."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    from rimuru.distributed.release_probe import spin_kernel

    for raised, expect in ((0, [0, 3]), (1, [3, 0])):
        flag = torch.full((1,), raised, dtype=torch.int32)
        counts = torch.zeros(2, dtype=torch.int32)
        spin_kernel[(3,)](flag, counts, 4, num_warps=1)
        assert counts.tolist() == expect
