"""The Triton fused MoE vs the einsum reference, under TRITON_INTERPRET=1 on CPU (tiny shapes)."""

import zlib

import pytest
import torch

from rimuru.experts.moe_reference import moe_reference
from rimuru.kernels import variants
from rimuru.kernels.fused_moe import MoeConfigs, MoeKernelConfig, fused_moe, fused_moe_experts
from rimuru.kernels.moe_align import moe_align, moe_align_torch
from tests.markers import needs_triton


def _pool(E, f, d, placement, gen, cache_pages=64, buffer_experts=None):
    """Expert view = cache region then a loading-buffer region; unused pages are NaN poison."""
    buffer_experts = buffer_experts or E
    view = torch.full((cache_pages + 3 * buffer_experts, f, d), float("nan"))
    cache_ids = torch.randperm(cache_pages, generator=gen)
    buffer_ids = cache_pages + torch.randperm(3 * buffer_experts, generator=gen)
    in_cache = {"cache": torch.ones(E, dtype=torch.bool), "buffer": torch.zeros(E, dtype=torch.bool),
                "mixed": torch.rand(E, generator=gen) < 0.5}[placement]
    table = torch.empty(E, 3, dtype=torch.int32)
    ci = bi = 0
    for e in range(E):
        if in_cache[e]:
            table[e] = cache_ids[ci:ci + 3].to(torch.int32)
            ci += 3
        else:
            table[e] = buffer_ids[bi:bi + 3].to(torch.int32)
            bi += 3
    for e in range(E):
        for p in range(3):
            view[table[e, p]] = torch.randn(f, d, generator=gen) / d**0.5
    return view, table


def _routing(T, E, k, gen, skip_expert=None):
    scores = torch.rand(T, E, generator=gen)
    if skip_expert is not None:
        scores[:, skip_expert] = -1.0  # never routed: its page-table row must not matter
    ids = scores.topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(T, k, generator=gen) + 0.1
    return w / w.sum(-1, keepdim=True), ids


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(params=["wave5", "baseline", "fast"])
def kernel_variant(request):
    """``wave5`` schedules small batches from the top-k ids inside the kernel, ``baseline`` through moe_align;
    ``fast`` also computes one token's experts as matrix-vector products (moe_gemv_kernel)."""
    with variants.use(request.param):
        yield request.param


@needs_triton
@pytest.mark.parametrize("placement", ["cache", "buffer", "mixed"])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_paged_kernel_matches_reference_for_any_page_placement(placement, T, kernel_variant):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{placement}{T}".encode()))
    E, f, d, k = 8, 32, 64, 2
    view, table = _pool(E, f, d, placement, gen)
    table[3] = 10**6 if T == 1 else table[3]  # a garbage row for an expert nobody routes to (T=1)
    w, ids = _routing(T, E, k, gen, skip_expert=3)
    x = torch.randn(T, d, generator=gen)
    ref = moe_reference(x, w, ids, view, table)
    out = torch.full((T * k, d), float("nan"))
    inter = torch.full((T * k, f), float("nan"))
    rows = fused_moe_experts(x, w, ids, view, table, out=out, intermediate=inter)
    got = rows.view(T, k, d).sum(1)
    assert torch.isfinite(got).all()
    assert _rel(got, ref) <= 1e-5


@needs_triton
def test_contiguous_variant_equals_paged_variant_on_the_same_weights():
    gen = torch.Generator().manual_seed(11)
    E, f, d, k, T = 8, 32, 64, 2, 12
    view, table = _pool(E, f, d, "mixed", gen)
    contiguous = view[table.long()].contiguous()  # [E, 3, f, d]
    w, ids = _routing(T, E, k, gen)
    x = torch.randn(T, d, generator=gen)
    torch.testing.assert_close(fused_moe(x, w, ids, contiguous, None), fused_moe(x, w, ids, view, table))


@needs_triton
def test_uneven_hidden_and_intermediate_sizes_use_masked_tiles():
    gen = torch.Generator().manual_seed(5)
    E, f, d, k, T = 4, 48, 80, 2, 9  # neither a multiple of the 32-wide K tiles
    view, table = _pool(E, f, d, "mixed", gen)
    w, ids = _routing(T, E, k, gen)
    x = torch.randn(T, d, generator=gen)
    assert _rel(fused_moe(x, w, ids, view, table), moe_reference(x, w, ids, view, table)) <= 1e-5


@needs_triton
def test_multi_block_experts_and_grouped_program_order(kernel_variant):
    gen = torch.Generator().manual_seed(6)
    E, f, d, k, T = 4, 32, 64, 2, 40  # ~20 rows per expert: two 16-row blocks each
    view, table = _pool(E, f, d, "cache", gen)
    w, ids = _routing(T, E, k, gen)
    x = torch.randn(T, d, generator=gen)
    cfg = MoeConfigs(MoeKernelConfig(16, 16, 32, group_m=4, num_stages=1), MoeKernelConfig(16, 32, 32, group_m=4,
                                                                                          num_stages=1))
    assert _rel(fused_moe(x, w, ids, view, table, configs=cfg), moe_reference(x, w, ids, view, table)) <= 1e-5


@needs_triton
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 8, 2), (16, 8, 8), (64, 4, 2)])
def test_direct_schedule_equals_the_aligned_schedule_bit_for_bit(T, E, k):
    """Small batches skip moe_align: each program finds its expert's pairs among the top-k ids itself. The blocks
    are the aligned ones (same rows, same tiles), so the outputs are identical; covers an expert with more pairs
    than a block holds (T=16 at k=8 of 8 experts: 16 rows each; T=64: ~32 rows, two blocks) and a token routed
    twice to the same expert (ids drawn with replacement, as warm-up draws them)."""
    from rimuru.kernels.fused_moe import DIRECT_MAX_PAIRS, SMALL_CONFIGS, direct_schedule

    gen = torch.Generator().manual_seed(100 + T)
    f, d = 32, 64
    view, table = _pool(E, f, d, "mixed", gen)
    ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    w = torch.rand(T, k, generator=gen)
    x = torch.randn(T, d, generator=gen)
    assert direct_schedule(T * k, SMALL_CONFIGS.gate_up.block_m, True) == (T * k <= DIRECT_MAX_PAIRS)
    with variants.use("direct_moe"):
        fast = fused_moe_experts(x, w, ids, view, table)
    with variants.use("baseline"):
        base = fused_moe_experts(x, w, ids, view, table)
    assert torch.equal(fast, base)
    ref = moe_reference(x, w, ids, view, table)
    assert _rel(fast.view(T, k, d).sum(1), ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("T,spec", [(1, "wave5"), (1, "fast"), (4, "fast"), (64, "fast"), (1024, "fast")])
def test_bf16_kernel_on_gpu_at_qwen3_shapes_within_1e2_of_fp32_reference(T, spec):
    with variants.use(spec):
        _bf16_at_qwen3_shapes(T)


def _bf16_at_qwen3_shapes(T):
    gen = torch.Generator(device="cuda").manual_seed(T)
    E, f, d, k = 128, 768, 2048, 8
    P = 3 * E * 2
    view = (torch.randn(P, f, d, device="cuda", generator=gen) / d**0.5).to(torch.bfloat16)
    table = torch.randperm(P, device="cuda", generator=gen)[: 3 * E].reshape(E, 3).to(torch.int32)
    x = torch.randn(T, d, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    ids = ids.to(torch.int32)
    got = fused_moe(x, w, ids, view, table)
    ref = moe_reference(x.float(), w, ids, view.float(), table)
    assert _rel(got, ref) <= 1e-2


# (37, 16, 4, 8) and (1, 128, 8, 16): one launch; the others have more pairs than FUSED_SCATTER_MAX_PAIRS: two
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("T,E,k,bm", [(37, 16, 4, 8), (1, 128, 8, 16), (300, 256, 8, 64), (40, 64, 8, 16)])
def test_alignment_puts_every_pair_once_in_single_expert_blocks(impl, T, E, k, bm):
    gen = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    a = (moe_align if impl == "triton" else moe_align_torch)(ids, E, bm)
    ref = moe_align_torch(ids, E, bm)
    assert torch.equal(a.expert_ids, ref.expert_ids)
    assert torch.equal(a.num_tokens_post_padded, ref.num_tokens_post_padded)
    n = T * k
    used = int(a.num_tokens_post_padded)
    assert used % bm == 0 and used <= a.sorted_token_ids.numel()
    s = a.sorted_token_ids[:used]
    real = s[s < n]
    assert sorted(real.tolist()) == list(range(n))
    assert (a.sorted_token_ids[used:] == n).all()
    flat = ids.reshape(-1)
    for b in range(used // bm):
        block = s[b * bm:(b + 1) * bm]
        block = block[block < n]
        assert len(block) > 0 and (flat[block.long()] == a.expert_ids[b]).all()
    assert (a.expert_ids[used // bm:] == -1).all()


@needs_triton
@pytest.mark.parametrize("T", [1, 5])
def test_negative_page_ids_read_host_pages_zero_copy(T, kernel_variant):
    """A page-table entry -(1 + j) reads page j of the host store: the decode graph's miss path."""
    gen = torch.Generator().manual_seed(17 + T)
    E, f, d, k = 8, 32, 64, 2
    view, table = _pool(E, f, d, "cache", gen)
    host = torch.randn(3 * E, f, d, generator=gen) / d**0.5  # [L*E*3, f, d] with L = 1
    missing = torch.tensor([1, 4, 6])
    for e in missing.tolist():  # these experts live only on the host: the table points there
        table[e] = -(1 + torch.arange(3 * e, 3 * e + 3, dtype=torch.int32))
    w, ids = _routing(T, E, k, gen)
    ids[0, 0] = 4 if ids[0, 1] != 4 else 1  # at least one miss
    ref_in = torch.randn(T, d, generator=gen)
    got = fused_moe(ref_in, w, ids, view, table, host_pages=host)
    ref = moe_reference(ref_in, w, ids, view, table, host_pages=host)
    assert torch.isfinite(got).all()
    assert _rel(got, ref) < 1e-4
    if kernel_variant == "fast":  # the one-token gemv on host pages (the moe_gemv_host lever) reads them too
        with variants.use("fast,moe_gemv_host"):
            assert _rel(fused_moe(ref_in, w, ids, view, table, host_pages=host), ref) < 1e-4
    with_host_copy = view.clone()
    # the same weights copied into pool pages give the same answer
    free = torch.arange(view.shape[0] - 3 * len(missing), view.shape[0]).reshape(-1, 3)
    table2 = table.clone()
    for row, e in zip(free, missing.tolist()):
        with_host_copy[row] = host[3 * e:3 * e + 3]
        table2[e] = row.to(torch.int32)
    assert _rel(fused_moe(ref_in, w, ids, with_host_copy, table2), ref) < 1e-4


@pytest.mark.parametrize("shape", [(8, 2, 32, 64), (128, 8, 768, 2048), (256, 8, 512, 2048), (60, 4, 1408, 2048)])
def test_warmup_token_counts_cover_every_variant_a_step_can_launch(shape):
    """Every (tile choice, fused-scatter or not) a batch of 1..8192 tokens picks is compiled by warm-up. The
    H200 no-compile test caught the tiny model's warm-up compiling only the fused-scatter alignment (one count,
    2 pairs): its first 211-token prefill compiled the two-launch alignment (2 compiles)."""
    from rimuru.kernels.fused_moe import kernel_variant, warmup_token_counts

    experts, k, f, d = shape
    warmed = {kernel_variant(m, k, experts, f, d) for m in warmup_token_counts(experts, k, f, d)}
    assert {kernel_variant(m, k, experts, f, d) for m in range(1, 8193)} == warmed
    assert any(v[2] for v in warmed) and not all(v[2] for v in warmed)  # direct schedules and aligned ones


@needs_triton
@pytest.mark.parametrize("f,d", [(32, 64), (48, 80)])
def test_one_token_gemv_path_matches_the_reference_contiguous_and_paged(f, d):
    """``moe_gemv``: one token's k experts as matrix-vector products (masked K when not a power of two), on pool
    pages and on contiguous [E, 3, f, d] weights; more tokens keep the tiled kernel (bit-equal to ``fast``)."""
    from rimuru.kernels.fused_moe import moe_gemv

    gen = torch.Generator().manual_seed(f + d)
    E, k = 8, 4
    view, table = _pool(E, f, d, "mixed", gen)
    w, ids = _routing(1, E, k, gen)
    x = torch.randn(1, d, generator=gen)
    ref = moe_reference(x, w, ids, view, table)
    with variants.use("wave5,moe_gemv"):
        assert moe_gemv(1, f, d, variants.on("moe_gemv")) and not moe_gemv(2, f, d, True)
        assert not moe_gemv(1, f, d, True, host_pages=True)  # in-place host reads keep the tiled kernel
        assert _rel(fused_moe(x, w, ids, view, table), ref) <= 1e-5
        assert _rel(fused_moe(x, w, ids, view[table.long()].contiguous(), None), ref) <= 1e-5
        w2, ids2 = _routing(3, E, k, gen)
        x2 = torch.randn(3, d, generator=gen)
        tiled = fused_moe_experts(x2, w2, ids2, view, table)
    with variants.use("wave5"):
        assert torch.equal(tiled, fused_moe_experts(x2, w2, ids2, view, table))


@needs_triton
def test_one_token_gemv_kernel_reads_host_pages():
    """The gemv kernel's own host-page path (``HOST_PAGES``; ``fused_moe`` no longer dispatches it there, see
    ``moe_gemv``): table entries ``-(1 + j)`` read page ``j`` of the host store, as the tiled kernel does."""
    from rimuru.kernels.fused_moe import _launch_gemv

    gen = torch.Generator().manual_seed(23)
    E, f, d, k = 8, 32, 64, 4
    view, table = _pool(E, f, d, "cache", gen)
    host = torch.randn(3 * E, f, d, generator=gen) / d**0.5
    for e in (1, 4):
        table[e] = -(1 + torch.arange(3 * e, 3 * e + 3, dtype=torch.int32))
    w, ids = _routing(1, E, k, gen)
    ids[0, 0] = 4 if 4 not in ids[0, 1:].tolist() else ids[0, 0]
    x = torch.randn(1, d, generator=gen)
    ref = moe_reference(x, w, ids, view, table, host_pages=host)
    flat, w_flat = ids.reshape(-1).contiguous(), w.reshape(-1).float().contiguous()
    h, y = torch.empty(k, f), torch.empty(k, d)
    common = dict(F=f, D=d, top_k=k, paged=True, host=host)
    _launch_gemv(x, view, h, table, w_flat, flat, N=f, K=d, gate_up=True, **common)
    _launch_gemv(h, view, y, table, w_flat, flat, N=d, K=f, gate_up=False, **common)
    assert 4 in ids[0].tolist() and _rel(y.sum(0, keepdim=True), ref) <= 1e-5  # y: one row per routed expert


def test_one_token_gemv_blocks_at_qwen3_shapes():
    from rimuru.kernels.fused_moe import MOE_GEMV_TILE, moe_gemv_blocks

    assert moe_gemv_blocks(768, 2048, gate_up=True) == (2, 2048, 4)  # 2 x 2 x 2048 weights, 3,072 programs
    assert moe_gemv_blocks(2048, 768, gate_up=False) == (16, 1024, 8)  # 32-byte rows of W2^T, 1,024 programs
    for n, kk, gu in ((32, 64, True), (64, 32, False), (5, 3, False)):
        bn, bk, _ = moe_gemv_blocks(n, kk, gu)
        assert bk >= kk and bn <= triton_next_pow2(n) and bn * bk <= max(MOE_GEMV_TILE, 16 * bk)


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def test_slice_tiles_lever_gives_a_tp_slice_the_full_widths_tiles():
    """``slice_tiles``: Qwen3-30B-A3B's experts at TP=2 (intermediate 384, no tuned table) take the tiles tuned for
    the full width (768) by token count, and warm-up covers that table's choices; off, the rows-per-expert rule (64-row
    blocks at 256 tokens); a tuned shape is the same either way."""
    from rimuru.kernels import variants
    from rimuru.kernels.fused_moe import TUNED, pick_configs, slice_table, warmup_token_counts

    full = TUNED[(128, 768, 2048)]
    assert slice_table(128, 384, 2048) is full and slice_table(128, 256, 2048) is None
    with variants.use("fast"):
        off = {t: pick_configs(t, 8, 128, 384, 2048) for t in (64, 128, 256)}
        tp1 = pick_configs(256, 8, 128, 768, 2048)
        warm_off = warmup_token_counts(128, 8, 384, 2048)
    assert off[256].gate_up.block_m == 64
    with variants.use("fast,slice_tiles"):
        on = {t: pick_configs(t, 8, 128, 384, 2048) for t in (64, 128, 256)}
        assert pick_configs(256, 8, 128, 768, 2048) == tp1
        warm_on = warmup_token_counts(128, 8, 384, 2048)
        assert {pick_configs(t, 8, 128, 384, 2048) for t in warm_on} == {pick_configs(t, 8, 128, 384, 2048)
                                                                       for t in range(1, 8193)}
    for t in (64, 128, 256):
        assert (on[t].gate_up.block_m, on[t].gate_up.block_n, on[t].down.block_k) == \
            (full[t][0][0], full[t][0][1], full[t][1][2])
    assert on[256].gate_up.block_m == 32 and on[256] != off[256] and warm_on != warm_off
