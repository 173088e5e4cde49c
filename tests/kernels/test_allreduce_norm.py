"""The fused all-reduce + residual add + RMSNorm of 2 tensor-parallel ranks (rimuru/kernels/allreduce_norm.py), on
one device: the peer is a second set of receive buffers and flags, and the two ranks' launches run one after the
other (rank 1's push and flag are pre-set for rank 0's launch, exactly what rank 1's launch writes), so no launch
waits for a program that is not running. Interpreted on the CPU; the same test runs on one GPU."""

import pytest
import torch

from rimuru.kernels.allreduce_norm import (
    combine_partial,
    empty_value_fill,
    lamport_add_rms_norm,
    one_shot_add_rms_norm,
)
from rimuru.kernels.norm_rope import add_rms_norm
from tests.markers import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(gen, T, k, d, dtype, extra):
    a = torch.randn(T, k, d, generator=gen).to(dtype) if k > 1 else torch.randn(T, d, generator=gen).to(dtype)
    e = torch.randn(T, d, generator=gen).to(dtype) if extra else None
    return a.to(DEVICE), None if e is None else e.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,extra", [(1, False), (4, False), (4, True)])
def test_combine_partial_is_the_torch_sum(dtype, k, extra):
    gen = torch.Generator().manual_seed(k + 10 * extra)
    a, e = _inputs(gen, 5, k, 96, dtype, extra)
    want = combine_partial(a, e, triton_kernel=False)
    got = combine_partial(a, e, triton_kernel=True)
    assert got.shape == (5, 96) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the interpreter truncates where CUDA rounds
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= tol


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,extra,parity", [(1, False, 0), (4, True, 1)])
def test_two_ranks_one_launch_each_equal_all_reduce_then_add_norm(dtype, k, extra, parity):
    gen = torch.Generator().manual_seed(3 * k + extra)
    T, d, rows = 6, 96, 8
    h = torch.randn(T, d, generator=gen).to(dtype).to(DEVICE)  # the residual: replicated, the same on both ranks
    w = (torch.rand(d, generator=gen) + 0.5).to(dtype).to(DEVICE)
    parts = [_inputs(gen, T, k, d, dtype, extra) for _ in range(2)]  # each rank's partial sums
    recv = [torch.full((2, rows * d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    flags = [torch.zeros(rows, dtype=torch.int32, device=DEVICE) for _ in range(2)]

    partial = [combine_partial(a, e, triton_kernel=False) for a, e in parts]
    total = (partial[0].float() + partial[1].float()).to(dtype)  # an all-reduce's result
    h_want, x_want = add_rms_norm(h, total, w, 1e-6, triton_kernel=False)

    # rank 1's push and signal, as its launch writes them (its rounding: the interpreter's bf16 casts truncate),
    # so that rank 0's launch finds them
    pushed = [combine_partial(a, e, triton_kernel=True) for a, e in parts]
    recv[0][parity, : T * d] = pushed[1].reshape(-1)
    flags[0][:T] = 1
    outs = []
    for rank in (0, 1):
        peer = 1 - rank
        a, e = parts[rank]
        outs.append(one_shot_add_rms_norm(h, a, w, 1e-6, e, recv[peer][parity], recv[rank][parity], flags[peer],
                                          flags[rank]))
        if rank == 0:  # rank 0 pushed its partial into rank 1's buffer and raised rank 1's flags for its rows
            assert torch.equal(flags[1][:T], torch.ones(T, dtype=torch.int32, device=DEVICE))
            assert torch.equal(flags[0], torch.zeros(rows, dtype=torch.int32, device=DEVICE))  # consumed
    assert torch.equal(flags[1], torch.zeros(rows, dtype=torch.int32, device=DEVICE))  # rank 1 consumed rank 0's
    # rank 1's launch raised rank 0's flags again: the signal the hand-written pre-set stood in for
    assert flags[0].tolist() == [1] * T + [0] * (rows - T)
    for rank in (0, 1):  # each receive buffer holds the peer's partial, in this call's half only
        assert torch.equal(recv[rank][parity, : T * d].view(T, d), pushed[1 - rank])
        assert recv[rank][1 - parity].isnan().all()
    (h0, x0), (h1, x1) = outs
    assert torch.equal(h0, h1) and torch.equal(x0, x1)  # the replicas stay bit-identical
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for got, want in ((h0, h_want), (x0, x_want)):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= tol


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,extra,parity", [(1, False, 1), (4, True, 0)])
def test_flag_free_variant_two_ranks(dtype, k, extra, parity):
    """The flag-free exchange: a row has arrived when none of its elements is the empty value (-0.0); a partial that
    is -0.0 (row 0 here) is pushed as +0.0, so no reader waits forever; each reader empties its half after use."""
    gen = torch.Generator().manual_seed(5 * k + extra)
    T, d, rows = 5, 96, 8
    h = torch.randn(T, d, generator=gen).to(dtype).to(DEVICE)
    w = (torch.rand(d, generator=gen) + 0.5).to(dtype).to(DEVICE)
    parts = [_inputs(gen, T, k, d, dtype, extra) for _ in range(2)]
    for a, e in parts:  # row 0's partial is exactly -0.0 on both ranks
        a[0] = -0.0
        if e is not None:
            e[0] = -0.0
    recv = [empty_value_fill(torch.empty(2, rows * d, dtype=dtype, device=DEVICE)) for _ in range(2)]
    pushed = [combine_partial(a, e, triton_kernel=True) for a, e in parts]
    if k == 1 and not extra:  # (a sum in fp32 from +0.0 turns -0.0 into +0.0 by itself)
        assert torch.signbit(pushed[0][0]).all() and (pushed[0][0] == 0).all()  # the empty value's bits
    sent = [torch.where(x == 0, torch.zeros_like(x), x) for x in pushed]  # as a launch pushes it: -0.0 -> +0.0
    recv[0][parity, : T * d] = sent[1].reshape(-1)  # rank 1's push, so that rank 0's launch finds it
    outs = []
    for rank in (0, 1):
        a, e = parts[rank]
        outs.append(lamport_add_rms_norm(h, a, w, 1e-6, e, recv[1 - rank][parity], recv[rank][parity]))
    (h0, x0), (h1, x1) = outs
    assert torch.equal(h0, h1) and torch.equal(x0, x1)
    scratch = torch.empty(rows * d, dtype=dtype, device=DEVICE)  # the flag variant: the peer's row and flag pre-set
    a0, e0 = parts[0]
    flag_h, flag_x = one_shot_add_rms_norm(h, a0, w, 1e-6, e0, scratch, sent[1].reshape(-1).contiguous(),
                                           torch.zeros(rows, dtype=torch.int32, device=DEVICE),
                                           torch.ones(rows, dtype=torch.int32, device=DEVICE))
    assert torch.equal(h0, flag_h) and torch.equal(x0, flag_x)  # the same bits as the flag variant
    assert torch.signbit(recv[1][parity]).all() and (recv[1][parity] == 0).all()  # rank 1 emptied its half
    got = recv[0][parity, : T * d].view(T, d)  # rank 1's real push landed in rank 0's half (emptied before)
    assert torch.equal(got, sent[1]) and not torch.signbit(got[0]).any()
    assert torch.signbit(recv[0][1 - parity]).all()  # the other half untouched


def test_flag_free_variant_in_the_decode_chain_only_with_pdl_wide(monkeypatch):
    """On a (pretended) Hopper GPU, inside a graph's capture: the flag-free sub-layer end takes the decode chain's
    launch arguments (waits for the kernel before it, lets the next one launch) with ``pdl_wide`` only, at any row
    count; without it, or eagerly, none (the kernel launched as before)."""
    from types import SimpleNamespace

    import rimuru.kernels.allreduce_norm as arn
    import rimuru.kernels.pdl as pdl
    from rimuru.kernels import variants

    monkeypatch.setattr(pdl, "_interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    seen = []
    monkeypatch.setattr(arn, "launch_residual_norm", lambda *args, pdl=None: seen.append(pdl))
    full = {"PDL_WAIT": True, "LAUNCH_DEPENDENTS": True, "launch_pdl": True}

    def launch(rows: int) -> None:  # a device object only: nothing is launched
        h = SimpleNamespace(device=torch.device("cuda", 0), shape=(rows, 2048))
        arn.lamport_add_rms_norm(h, None, None, 1e-6, None, None, None)

    with variants.for_graphs():
        with variants.use("fast"):
            launch(4)
            launch(pdl.PDL_MAX_ROWS + 1)
        with variants.use("fast,pdl_wide"):
            launch(4)
            launch(256)
    with variants.use("fast,pdl_wide"):
        launch(256)  # eager
    assert seen == [None, None, full, full, {}]
