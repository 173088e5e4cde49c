"""Paged attention: Triton kernels (interpreted on CPU) vs the torch reference vs SDPA on unpaged tensors."""

import pytest
import torch
import torch.nn.functional as F

from rimuru.kernels import variants
from rimuru.kernels.attention_reference import (
    decode_attention_reference,
    gather_kv,
    prefill_attention_reference,
    write_kv_reference,
)
from rimuru.kernels.paged_attention import (
    FULL_GRID_PER_SM,
    MIN_TOKENS_PER_SPLIT,
    decode_attention,
    paged_attention,
    prefill_attention,
    split_count,
    write_kv,
)
from rimuru.kernels.sync import counters
from rimuru.memory import KV, PagePool, PoolLayout
from tests.markers import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class PagedBatch:
    """Requests with random K/V scattered over random pages of a pool poisoned with NaN elsewhere."""

    def __init__(self, q_lens, seq_lens, block=4, kv_heads=2, group=2, head_dim=16, dtype=torch.float32,
                 seed=0, spare_pages=7, device=DEVICE, kv=None):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens = list(q_lens), list(seq_lens)
        self.block, self.kv_heads, self.group, self.head_dim = block, kv_heads, group, head_dim
        self.heads = kv_heads * group
        self.scale = head_dim**-0.5
        blocks = [-(-n // block) for n in seq_lens]
        num_pages = sum(blocks) + spare_pages
        if kv is None:
            kv = torch.full((num_pages, 2, block, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
            pages = torch.randperm(num_pages, generator=gen)[: sum(blocks)]
        else:  # pages handed out by a real pool's allocator, shuffled
            pages = kv.pop("pages")
            pages = pages[torch.randperm(len(pages), generator=gen)]
            kv = kv["view"]
            kv.fill_(float("nan"))
        self.kv = kv
        self.block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        self.keys, self.values = [], []
        used = 0
        for r, n in enumerate(seq_lens):
            self.block_tables[r, : blocks[r]] = pages[used: used + blocks[r]]
            used += blocks[r]
            k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
            self.keys.append(k.to(device))
            self.values.append(v.to(device))
            for t in range(n):  # written token by token: independent of write_kv
                page = self.block_tables[r, t // block]
                kv[page, 0, t % block] = k[t].to(device)
                kv[page, 1, t % block] = v[t].to(device)
        self.block_tables = self.block_tables.to(device)
        self.cu_query_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                          device=device)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.q = torch.randn(sum(q_lens), self.heads, head_dim, generator=gen).to(dtype).to(device)

    def poisoned_out(self) -> torch.Tensor:
        return torch.full_like(self.q, float("nan"))

    def sdpa(self) -> torch.Tensor:
        """SDPA per request on unpaged K/V (fp32): the independent oracle."""
        outs = []
        for r, (ql, n) in enumerate(zip(self.q_lens, self.seq_lens)):
            start = int(self.cu_query_lens[r])
            q = self.q[start: start + ql].float().transpose(0, 1)[None]  # [1, H, Q, D]
            k = self.keys[r].float().repeat_interleave(self.group, dim=1).transpose(0, 1)[None]  # [1, H, L, D]
            v = self.values[r].float().repeat_interleave(self.group, dim=1).transpose(0, 1)[None]
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - ql, n, device=q.device)[:, None]
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)[0].transpose(0, 1))
        return torch.cat(outs)


# Several requests: fresh prefills, chunks over a cached prefix, single-token decodes mixed in.
MIXED = dict(q_lens=[5, 1, 17, 3, 8], seq_lens=[5, 9, 40, 20, 8])


def test_reference_matches_sdpa_on_unpaged_kv():
    batch = PagedBatch(**MIXED)
    out = prefill_attention_reference(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens,
                                      batch.seq_lens_t, batch.scale, out=batch.poisoned_out())
    assert rel_err(out, batch.sdpa()) <= 1e-5


def test_gather_kv_returns_tokens_in_sequence_order_across_scattered_pages():
    batch = PagedBatch(**MIXED)
    k, v = gather_kv(batch.kv, batch.block_tables[2], 40)
    assert torch.equal(k, batch.keys[2]) and torch.equal(v, batch.values[2])


@needs_triton
@pytest.mark.parametrize("group,head_dim", [(2, 16), (3, 24), (1, 32)])
@pytest.mark.parametrize("block_m", [16, 128])
def test_triton_prefill_matches_reference_and_sdpa_with_cached_prefix(group, head_dim, block_m):
    batch = PagedBatch(**MIXED, group=group, head_dim=head_dim)
    out = prefill_attention(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t,
                            batch.scale, max_query_len=17, out=batch.poisoned_out(), block_m=block_m, block_n=16)
    ref = prefill_attention_reference(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t,
                                      batch.scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(out, batch.sdpa()) <= 1e-5


@needs_triton
def test_triton_prefill_tile_wider_than_a_page_and_longer_than_the_sequence():
    batch = PagedBatch(q_lens=[3, 6], seq_lens=[3, 30], block=8)
    out = prefill_attention(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t,
                            batch.scale, out=batch.poisoned_out(), block_n=64)
    assert rel_err(out, batch.sdpa()) <= 1e-5


@pytest.fixture(params=["all", "baseline"])
def kernel_variant(request):
    """Both decode variants: ``all`` (the ``merge`` lever) merges the splits inside the decode kernel, ``baseline``
    in a second one."""
    with variants.use(request.param):
        yield request.param


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_triton_decode_matches_reference_for_any_split_count(num_splits, kernel_variant):
    seq_lens = [1, 7, 33, 64, 50]  # splits past a short request's end are skipped
    batch = PagedBatch(q_lens=[1] * len(seq_lens), seq_lens=seq_lens, group=4)
    out = decode_attention(batch.q, batch.kv, batch.block_tables, batch.seq_lens_t, batch.scale,
                           max_seq_len=64, out=batch.poisoned_out(), num_splits=num_splits, block_n=16)
    ref = decode_attention_reference(batch.q, batch.kv, batch.block_tables, batch.seq_lens_t, batch.scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(out, batch.sdpa()) <= 1e-5


@needs_triton
def test_triton_decode_splits_each_request_by_its_own_length_and_merges_many_splits(kernel_variant):
    """Each request cuts its own KV into the grid's splits (a short one uses few, a long one many), and the merge
    (kernel, or in-kernel) folds more splits than it reads at once (REDUCE_SPLITS, MERGE_SPLITS) online; the
    in-kernel merge leaves its completion counters at zero for the next launch."""
    seq_lens = [300, 5, 0, 129]
    batch = PagedBatch(q_lens=[1] * len(seq_lens), seq_lens=[max(s, 1) for s in seq_lens], group=2, seed=5)
    batch.seq_lens_t[2] = 0  # a padding row
    out = decode_attention(batch.q, batch.kv, batch.block_tables, batch.seq_lens_t, batch.scale, max_seq_len=320,
                           out=batch.poisoned_out(), num_splits=20, block_n=16, min_tokens_per_split=16)
    ref = decode_attention_reference(batch.q, batch.kv, batch.block_tables, batch.seq_lens_t, batch.scale)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    keep = [0, 1, 3]
    assert rel_err(out[keep], ref[keep]) <= 1e-5
    assert not counters(batch.q.device, 1).any()
    again = decode_attention(batch.q, batch.kv, batch.block_tables, batch.seq_lens_t, batch.scale, max_seq_len=320,
                             out=batch.poisoned_out(), num_splits=20, block_n=16, min_tokens_per_split=16)
    assert torch.equal(again, out)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_writes_zeros_for_an_empty_padding_row(num_splits, kernel_variant):
    """A captured decode batch pads to its bucket with seq_len-0 rows: they must come out finite (zero)."""
    seq_lens = [7, 33]
    batch = PagedBatch(q_lens=[1] * 3, seq_lens=seq_lens + [1], group=4, seed=3)
    batch.seq_lens_t[2] = 0  # the padding row
    out = decode_attention(batch.q, batch.kv, batch.block_tables, batch.seq_lens_t, batch.scale,
                           max_seq_len=64, out=batch.poisoned_out(), num_splits=num_splits, block_n=16)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    ref = decode_attention_reference(batch.q[:2], batch.kv, batch.block_tables[:2], batch.seq_lens_t[:2], batch.scale)
    assert rel_err(out[:2], ref) <= 1e-5


@needs_triton
def test_decode_without_max_seq_len_uses_block_table_capacity():
    batch = PagedBatch(q_lens=[1, 1], seq_lens=[10, 3], group=2)
    out = decode_attention(batch.q, batch.kv, batch.block_tables, batch.seq_lens_t, batch.scale, num_splits=2,
                           block_n=16, out=batch.poisoned_out())
    assert rel_err(out, batch.sdpa()) <= 1e-5


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "reference"])
def test_write_kv_scatters_tokens_to_slots_and_skips_negative_slots(impl):
    gen = torch.Generator().manual_seed(1)
    block, kv_heads, head_dim, num_pages = 4, 2, 16, 6
    kv = torch.full((num_pages, 2, block, kv_heads, head_dim), float("nan"), device=DEVICE)
    slots = torch.tensor([13, 0, 22, -1, 7], dtype=torch.int64, device=DEVICE)
    k = torch.randn(5, kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(5, kv_heads, head_dim, generator=gen).to(DEVICE)
    write_kv(k, v, kv, slots, impl=impl)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(kv[slot // block, 0, slot % block], k[t])
        assert torch.equal(kv[slot // block, 1, slot % block], v[t])
    written = torch.zeros(num_pages, block, dtype=torch.bool)
    for slot in (13, 0, 22, 7):
        written[slot // block, slot % block] = True
    assert kv.transpose(1, 2)[~written.to(DEVICE)].isnan().all()  # nothing else touched


@needs_triton
def test_write_kv_casts_to_the_cache_dtype():
    kv = torch.zeros(2, 2, 4, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(1, 1, 16, device=DEVICE)
    write_kv(k, -k, kv, torch.tensor([5], device=DEVICE), impl="triton")
    write_kv_reference(k, -k, kv[:, :, :, :, :], torch.tensor([6], device=DEVICE))
    assert torch.equal(kv[1, 0, 1], k[0].bfloat16()) and torch.equal(kv[1, 0, 2], k[0].bfloat16())
    assert torch.equal(kv[1, 1, 1], -k[0].bfloat16())


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "reference"])
def test_dispatcher_routes_decode_and_mixed_batches(impl):
    mixed = PagedBatch(**MIXED)
    out = paged_attention(mixed.q, mixed.kv, mixed.block_tables, mixed.cu_query_lens, mixed.seq_lens_t,
                          mixed.scale, impl=impl, out=mixed.poisoned_out())
    assert rel_err(out, mixed.sdpa()) <= 1e-5
    decode = PagedBatch(q_lens=[1, 1, 1], seq_lens=[30, 2, 17])
    out = paged_attention(decode.q, decode.kv, decode.block_tables, decode.cu_query_lens, decode.seq_lens_t,
                          decode.scale, impl=impl, max_query_len=1, max_seq_len=30)
    assert rel_err(out, decode.sdpa()) <= 1e-5


def test_dispatcher_rejects_unknown_impl():
    batch = PagedBatch(q_lens=[1], seq_lens=[3])
    with pytest.raises(ValueError, match="unknown attention impl"):
        paged_attention(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t,
                        batch.scale, impl="flash")


@needs_triton
def test_kernels_read_kv_pages_handed_out_by_the_page_pool():
    block, kv_heads, head_dim = 4, 2, 16
    layout = PoolLayout.build(hidden_size=32, expert_intermediate=16, weight_dtype=torch.float32,
                              kv=(block, kv_heads, head_dim), kv_dtype=torch.float32)
    pool = PagePool(layout, 8 * layout.huge_page_bytes, device=DEVICE)
    ids = torch.as_tensor(pool.allocator.allocate(KV, 12).astype("int64"))
    pool.allocator.check_integrity()
    view = pool.view(KV)
    assert tuple(view.tensor.shape[1:]) == (2, block, kv_heads, head_dim)
    batch = PagedBatch(q_lens=[4, 1], seq_lens=[20, 27], kv={"view": view.tensor, "pages": ids})
    for impl in ("triton", "reference"):
        out = paged_attention(batch.q, view, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t,
                              batch.scale, impl=impl, out=batch.poisoned_out())
        assert rel_err(out, batch.sdpa()) <= 1e-5


@needs_triton
def test_bf16_kernels_stay_within_1e2_of_the_fp32_reference():
    """bf16 pages and queries (the serving dtype); under the interpreter the dots are upcast to fp32."""
    mixed = PagedBatch(**MIXED, group=4, dtype=torch.bfloat16)
    ref = prefill_attention_reference(mixed.q.float(), mixed.kv.float(), mixed.block_tables, mixed.cu_query_lens,
                                      mixed.seq_lens_t, mixed.scale)
    out = prefill_attention(mixed.q, mixed.kv, mixed.block_tables, mixed.cu_query_lens, mixed.seq_lens_t,
                            mixed.scale, out=mixed.poisoned_out(), block_n=16)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 1e-2
    dec = PagedBatch([1] * 4, [3, 40, 17, 64], group=4, dtype=torch.bfloat16)
    ref = decode_attention_reference(dec.q.float(), dec.kv.float(), dec.block_tables, dec.seq_lens_t, dec.scale)
    out = decode_attention(dec.q, dec.kv, dec.block_tables, dec.seq_lens_t, dec.scale, num_splits=4, block_n=16,
                           out=dec.poisoned_out())
    assert rel_err(out, ref) <= 1e-2


@needs_triton
def test_fp32_queries_over_a_bf16_cache_return_fp32():
    dec = PagedBatch([1] * 2, [9, 20], dtype=torch.bfloat16)
    q32 = dec.q.float()
    out = paged_attention(q32, dec.kv, dec.block_tables, dec.cu_query_lens, dec.seq_lens_t, dec.scale, impl="triton",
                          max_query_len=1)
    assert out.dtype == torch.float32
    ref = decode_attention_reference(q32, dec.kv.float(), dec.block_tables, dec.seq_lens_t, dec.scale)
    assert rel_err(out, ref) <= 1e-2


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_bf16_prefill_and_decode_match_fp32_reference():
    q_lens = [300, 1, 64, 1, 129]
    seq_lens = [300, 700, 1000, 65, 129 + 512]
    batch = PagedBatch(q_lens, seq_lens, block=16, kv_heads=4, group=8, head_dim=128, dtype=torch.bfloat16)
    ref = prefill_attention_reference(batch.q.float(), batch.kv.float(), batch.block_tables, batch.cu_query_lens,
                                      batch.seq_lens_t, batch.scale)
    out = paged_attention(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t, batch.scale,
                          max_query_len=300)
    assert rel_err(out, ref) <= 1e-2
    dec = PagedBatch([1] * 6, [1, 100, 2000, 513, 16, 1500], block=16, kv_heads=4, group=8, head_dim=128,
                     dtype=torch.bfloat16)
    ref = decode_attention_reference(dec.q.float(), dec.kv.float(), dec.block_tables, dec.seq_lens_t, dec.scale)
    for splits in (None, 1, 5):
        out = decode_attention(dec.q, dec.kv, dec.block_tables, dec.seq_lens_t, dec.scale, max_seq_len=2000,
                               num_splits=splits, out=dec.poisoned_out())
        assert rel_err(out, ref) <= 1e-2


@pytest.mark.gpu
def test_gpu_fp32_kernels_use_ieee_dots():
    batch = PagedBatch(**MIXED, block=16, kv_heads=4, group=8, head_dim=128)
    out = paged_attention(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t, batch.scale)
    assert rel_err(out, batch.sdpa()) <= 1e-4


def test_split_count_targets_four_programs_per_sm_and_nosplit_full_keeps_a_full_grid_whole():
    sms = 132  # the H200's
    # TP=2's rank at 256 running: 2 KV heads x 256 = 512 programs, just under 4 x 132 = 528 -> 2 splits by default
    assert split_count(256, 2, 4096, sms) == 2
    assert split_count(256, 2, 4096, sms, full_grid=True) == 1
    # TP=1 at 256 (1,024 programs) is one split either way; small grids split as before with the lever on
    assert split_count(256, 4, 4096, sms) == split_count(256, 4, 4096, sms, full_grid=True) == 1
    for req, heads in ((64, 4), (64, 2), (1, 4), (98, 4)):
        assert req * heads < FULL_GRID_PER_SM * sms
        assert split_count(req, heads, 4096, sms, full_grid=True) == split_count(req, heads, 4096, sms) > 1
    # the threshold is the first grid of FULL_GRID_PER_SM programs per SM
    edge = FULL_GRID_PER_SM * sms
    assert split_count(edge, 1, 4096, sms, full_grid=True) == 1
    assert split_count(edge - 1, 1, 4096, sms, full_grid=True) == 2
    # a short KV never splits below MIN_TOKENS_PER_SPLIT tokens a split
    assert split_count(1, 1, MIN_TOKENS_PER_SPLIT, sms) == 1
