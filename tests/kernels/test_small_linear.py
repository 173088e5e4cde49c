"""The few-row projection kernel (decode at batch 1-16) against F.linear, interpreted on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from rimuru.kernels import variants
from rimuru.kernels.pdl import PDL_MAX_ROWS, chain, pdl_launch
from rimuru.kernels.small_linear import (
    GEMV_MAX_K,
    GEMV_MAX_ROWS,
    GEMV_MIN_PROGRAMS,
    GEMV_NARROW_ROWS,
    GEMV_TILE,
    SMALL_M_MAX_ROWS,
    gemv,
    gemv_blocks,
    linear,
    small_m,
    small_m_linear,
)
from tests.markers import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _linear_inputs(M: int, N: int, K: int, bias: bool):
    """Seeded x [M, K], w [N, K] (scaled by 1/sqrt(K)) and an optional bias [N] on DEVICE."""
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEVICE)
    b = torch.randn(N, generator=gen).to(DEVICE) if bias else None
    return x, w, b


@needs_triton
@pytest.mark.parametrize("M,N,K,bias", [(1, 40, 512, False), (5, 16, 300, True), (16, 33, 256, True)])
def test_small_m_linear_matches_f_linear(M, N, K, bias):
    x, w, b = _linear_inputs(M, N, K, bias)
    got = small_m_linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_triton
def test_small_m_linear_rows_do_not_depend_on_the_batch():
    """A padded graph batch and the eager batch give each request the same values (rows are independent)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 256, generator=gen).to(DEVICE)
    w = torch.randn(24, 256, generator=gen).to(DEVICE)
    assert torch.equal(small_m_linear(x[:3], w), small_m_linear(x, w)[:3])


def test_small_m_takes_only_a_few_rows_when_enabled():
    assert small_m(1, True) and small_m(SMALL_M_MAX_ROWS, True)
    assert not small_m(SMALL_M_MAX_ROWS + 1, True) and not small_m(0, True) and not small_m(4, False)
    with pytest.raises(ValueError, match="small_m_linear wants"):
        small_m_linear(torch.zeros(SMALL_M_MAX_ROWS + 1, 8), torch.zeros(4, 8))


# ------------------------------------------------------------------------------------- gemv (the ``gemv`` lever)
@needs_triton
@pytest.mark.parametrize("M,N,K,bias", [(1, 40, 512, False), (3, 33, 300, True), (4, 128, 2048, False),
                                        (2, 700, 64, True)])
def test_gemv_matches_f_linear(M, N, K, bias):
    x, w, b = _linear_inputs(M, N, K, bias)
    got = gemv(x, w, b)
    assert got.shape == (M, N) and got.dtype == x.dtype
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_triton
def test_gemv_bf16_sums_in_fp32_and_rounds_once():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(48, 256, generator=gen) / 16).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(48, generator=gen).to(torch.bfloat16).to(DEVICE)
    want = (x.float() @ w.float().T + b.float()).to(torch.bfloat16)
    got = gemv(x, w, b)
    assert got.dtype == torch.bfloat16
    # fp32 sums in another order than the reference's: at most one bf16 step apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


@needs_triton
def test_gemv_rows_do_not_depend_on_the_batch():
    """A padded graph batch (4 rows) and the eager batch (1-3 rows) give each request the same bits."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 320, generator=gen).to(DEVICE)
    w = torch.randn(24, 320, generator=gen).to(DEVICE)
    full = gemv(x, w)
    for rows in (1, 2, 3):
        assert torch.equal(gemv(x[:rows], w), full[:rows])


def test_gemv_blocks_fill_the_machine_within_one_tile():
    for n, k in ((5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (40, 300)):
        block_n, block_k = gemv_blocks(n, k)
        assert block_k >= k and block_k & (block_k - 1) == 0
        assert block_n * block_k <= max(GEMV_TILE, block_k)
        assert block_n == 1 or -(-n // block_n) >= GEMV_MIN_PROGRAMS
    assert gemv_blocks(5120, 2048) == (4, 2048)  # qkv at Qwen3-30B-A3B: 1,280 programs of 16 KB
    assert gemv_blocks(128, 2048) == (1, 2048)  # the router: one expert's row per program


def test_gemv_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="gemv wants"):
        gemv(torch.zeros(GEMV_MAX_ROWS + 1, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="gemv wants"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="gemv wants"):
        gemv(torch.zeros(1, GEMV_MAX_K + 1), torch.zeros(4, GEMV_MAX_K + 1))
    with pytest.raises(ValueError, match="gemv wants"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 8), torch.zeros(5))


@needs_triton
def test_linear_takes_gemv_for_a_few_rows_only_when_on():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(20, 64, generator=gen).to(DEVICE)
    few, many = torch.randn(GEMV_MAX_ROWS, 64, generator=gen).to(DEVICE), torch.randn(6, 64, generator=gen).to(DEVICE)
    assert torch.equal(linear(few, w, None, False, True), gemv(few, w))
    assert torch.equal(linear(few, w, None, False, False), F.linear(few, w))
    assert torch.equal(linear(many, w, None, False, True), F.linear(many, w))
    with variants.use("fast,gemv_le2"):  # the row limit lever: at most GEMV_NARROW_ROWS rows through the gemv
        narrow = few[:GEMV_NARROW_ROWS]
        assert torch.equal(linear(narrow, w, None, False, True), gemv(narrow, w))
        assert torch.equal(linear(few, w, None, False, True), F.linear(few, w))


def test_pdl_is_off_under_the_interpreter_and_off_the_gpu():
    assert not pdl_launch(True, torch.device("cpu"))
    assert not pdl_launch(False, torch.device("cuda", 0))
    with variants.use("fast,gemv,pdl,pdl_chain"):
        assert chain(torch.device("cpu"), 1) == {} and chain(torch.device("cpu"), 1, primary=True) == {}


def test_programmatic_launches_only_while_a_graph_is_built(monkeypatch):
    """On a (pretended) Hopper GPU: the launch arguments ``chain`` gives are empty for an eager launch and those of
    the levers inside ``variants.for_graphs()`` (a graph's capture); ``pdl_eager`` puts them on eager launches too;
    the gemv takes the same rule (its ``pdl`` argument comes from ``variants.on``)."""
    import rimuru.kernels.pdl as pdl

    monkeypatch.setattr(pdl, "_interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    dev = torch.device("cuda", 0)  # a device object only: nothing is launched
    full = {"PDL_WAIT": True, "LAUNCH_DEPENDENTS": True, "launch_pdl": True}
    with variants.use("fast"):
        assert chain(dev, 1) == {} and chain(dev, 1, primary=True) == {}
        assert not pdl_launch(variants.on("pdl"), dev)
        with variants.for_graphs():
            assert chain(dev, 1) == full and chain(dev, 1, primary=True) == full
            assert chain(dev, PDL_MAX_ROWS + 1) == {}
            assert pdl_launch(variants.on("pdl"), dev)
        assert chain(dev, 1) == {}
    with variants.use("fast,pdl_eager"):
        assert chain(dev, 1) == full
    with variants.use("wave5,gemv,pdl"), variants.for_graphs():
        assert chain(dev, 1) == {} and chain(dev, 1, primary=True) == {"LAUNCH_DEPENDENTS": True}
    with variants.use("fast,pdl_wide"):  # pdl_wide: the chain at every row count, still in a graph's capture only
        assert chain(dev, PDL_MAX_ROWS + 1) == {}
        with variants.for_graphs():
            assert chain(dev, PDL_MAX_ROWS + 1) == full and chain(dev, 256, primary=True) == full
    with variants.use("wave5,pdl_wide"), variants.for_graphs():  # it widens pdl_chain; alone it launches nothing
        assert chain(dev, 1) == {} and chain(dev, 256) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pdl_launch_arguments_follow_the_levers():
    """Off: nothing; ``pdl``: only a kernel before a projection signals; ``pdl_chain``: every chain kernel waits,
    signals and is launched as a dependent (on a GPU of compute capability >= 9.0, in a graph's capture); nothing
    above PDL_MAX_ROWS."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    with variants.use("fast,pdl_chain,pdl"):
        assert chain(dev, 1) == {} and chain(dev, 1, primary=True) == {}  # eager: none
    with variants.for_graphs(), variants.use("wave5,gemv"):
        assert chain(dev, 1) == {} and chain(dev, 1, primary=True) == {}
    with variants.for_graphs(), variants.use("wave5,gemv,pdl"):
        assert chain(dev, 1) == {} and chain(dev, 1, primary=True) == {"LAUNCH_DEPENDENTS": True}
    with variants.for_graphs(), variants.use("wave5,gemv,pdl,pdl_chain"):
        full = {"PDL_WAIT": True, "LAUNCH_DEPENDENTS": True, "launch_pdl": True}
        assert chain(dev, 1) == full and chain(dev, PDL_MAX_ROWS, primary=True) == full
        assert chain(dev, PDL_MAX_ROWS + 1) == {} and chain(dev, PDL_MAX_ROWS + 1, primary=True) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["wave5,gemv", "wave5,gemv,pdl", "wave5,gemv,pdl,pdl_chain"])
def test_gemv_in_a_cuda_graph_reads_the_norm_it_follows(spec):
    """The decode chain add_rms_norm -> projection captured in a graph, the projection launched as a programmatic
    dependent (``pdl``; with ``pdl_chain`` the norm too): replayed on new inputs it reads the norm's output of that
    replay (its ``gdc_wait``), at the Qwen3-30B-A3B shapes (qkv [5120, 2048], o [2048, 4096], router [128, 2048]),
    against F.linear."""
    from rimuru.kernels.norm_rope import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(11)
    d = 2048
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k**0.5
               for n, k in ((5120, d), (2048, 4096), (128, d))]
    norm = torch.rand(d, generator=gen, device="cuda", dtype=torch.bfloat16) + 0.5
    with variants.use(spec):
        for rows in (1, 4):
            h = torch.randn(rows, d, generator=gen, device="cuda", dtype=torch.bfloat16)
            a = torch.randn(rows, d, generator=gen, device="cuda", dtype=torch.bfloat16)
            wide = torch.randn(rows, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)

            def step(h=h, a=a, wide=wide):
                _, x = add_rms_norm(h, a, norm, 1e-6)
                return [linear(x, weights[0], None, False, True), linear(wide, weights[1], None, False, True),
                        linear(x, weights[2], None, False, True)], x

            with variants.for_graphs():  # the levers act on a graph's launches (and its compiling pass)
                step()  # compile outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs, x = step()
            for _ in range(3):  # new inputs each replay: a stale read of the norm's output would show
                h.copy_(torch.randn(rows, d, generator=gen, device="cuda", dtype=torch.bfloat16))
                a.copy_(torch.randn(rows, d, generator=gen, device="cuda", dtype=torch.bfloat16))
                wide.copy_(torch.randn(rows, 4096, generator=gen, device="cuda", dtype=torch.bfloat16))
                graph.replay()
                torch.cuda.synchronize()
                _, x_eager = add_rms_norm(h, a, norm, 1e-6)
                assert torch.equal(x, x_eager)
                for out, w, inp in zip(outs, weights, (x_eager, wide, x_eager)):
                    torch.testing.assert_close(out.float(), F.linear(inp, w).float(), rtol=2 ** -7, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_router_logits_through_gemv_route_like_cublas():
    """``route`` with the ``gemv`` lever (the router's logits by the few-row kernel) picks the experts cuBLAS's logits
    pick, in fp32 (no near-ties), at Qwen3-30B-A3B's router shape, with and without a padding mask."""
    from rimuru.experts.router import route
    from rimuru.kernels import variants

    gen = torch.Generator(device="cuda").manual_seed(4)
    hidden = torch.randn(4, 2048, generator=gen, device="cuda")
    gate = torch.randn(128, 2048, generator=gen, device="cuda") / 45
    for valid in (None, torch.tensor([[True], [True], [False], [True]], device="cuda")):
        with variants.use("wave5"):
            w0, ids0 = route(hidden, gate, 8, True, valid)
        with variants.use("wave5,gemv"):
            w1, ids1 = route(hidden, gate, 8, True, valid)
        assert torch.equal(ids0, ids1)
        torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("M,N,K,bias", [(17, 40, 256, True), (64, 33, 512, False), (100, 32, 300, True)])
def test_wide_linear_matches_f_linear_and_linear_dispatches_to_it(M, N, K, bias, monkeypatch):
    """``wide_gemm``: 17-128 rows in one tile (64 rows with 256-wide K steps, 100 rows with 128-wide and a ragged K);
    ``linear`` takes it only with the lever's flag, within its rows."""
    from rimuru.kernels import small_linear
    from rimuru.kernels.small_linear import WIDE_MAX_ROWS, wide_linear, wide_m, wide_tile

    x, w, b = _linear_inputs(M, N, K, bias)
    torch.testing.assert_close(wide_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert wide_tile(M)[0] >= M and wide_tile(M)[1] == (256 if M <= 64 else 128)
    assert not wide_m(SMALL_M_MAX_ROWS, True) and wide_m(SMALL_M_MAX_ROWS + 1, True)
    assert not wide_m(WIDE_MAX_ROWS + 1, True) and not wide_m(64, False)
    calls = []
    monkeypatch.setattr(small_linear, "wide_linear", lambda *a: calls.append(a) or F.linear(*a))
    linear(x, w, b, False, False, wide_on=False)
    assert not calls
    linear(x, w, b, False, False, wide_on=True)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="wide_linear wants"):
        wide_linear(torch.zeros(WIDE_MAX_ROWS + 1, K, device=DEVICE), w)
