"""The CPU attention backend (batched SDPA over gathered pages) against the per-request torch reference."""

import pytest
import torch

from rimuru.kernels.attention_cpu import length_buckets, paged_attention_cpu
from rimuru.kernels.attention_reference import prefill_attention_reference
from rimuru.kernels.paged_attention import paged_attention
from tests.kernels.test_paged_attention import PagedBatch, rel_err

CASES = {
    "prefill": dict(q_lens=[5, 13, 1, 9], seq_lens=[5, 13, 1, 9]),  # fresh prompts, one of a single token
    "chunked_prefill": dict(q_lens=[4, 7], seq_lens=[21, 7]),  # a chunk over a cached prefix
    "decode": dict(q_lens=[1, 1, 1, 1, 1], seq_lens=[1, 9, 40, 17, 4]),
    "mixed": dict(q_lens=[5, 1, 17, 3, 8, 1], seq_lens=[5, 9, 40, 20, 8, 33]),
    # fresh prompts over several length buckets, a chunk over a cached prefix, decodes and an empty request
    "buckets": dict(q_lens=[37, 2, 1, 29, 11, 0, 64, 6, 3, 1, 20, 45],
                    seq_lens=[37, 2, 50, 29, 11, 7, 64, 6, 3, 12, 26, 45]),
}


def reference(batch: PagedBatch) -> torch.Tensor:
    return prefill_attention_reference(batch.q.float(), batch.kv.float(), batch.block_tables, batch.cu_query_lens,
                                       batch.seq_lens_t, batch.scale)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("group,head_dim,block", [(2, 16, 4), (1, 32, 8), (4, 8, 16)])
def test_cpu_backend_matches_reference_fp32(case, group, head_dim, block):
    # the pool outside each request's tokens is NaN: a read past a sequence's end shows as NaN
    batch = PagedBatch(**CASES[case], group=group, head_dim=head_dim, block=block, device="cpu")
    out = paged_attention_cpu(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t,
                              batch.scale, out=batch.poisoned_out())
    assert not out.isnan().any()
    assert rel_err(out, reference(batch)) <= 1e-5
    assert rel_err(out, batch.sdpa()) <= 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_backend_without_host_maxima_matches_with_them(case):
    batch = PagedBatch(**CASES[case], device="cpu")
    args = (batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t, batch.scale)
    hinted = paged_attention_cpu(*args, max_query_len=max(batch.q_lens), max_seq_len=max(batch.seq_lens))
    assert torch.equal(paged_attention_cpu(*args), hinted)


def test_cpu_backend_bf16_stays_within_2e2_of_fp32_reference():
    batch = PagedBatch(**CASES["mixed"], dtype=torch.bfloat16, device="cpu")
    out = paged_attention_cpu(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t,
                              batch.scale)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, reference(batch)) <= 2e-2


def test_requests_with_no_query_tokens_are_skipped():
    batch = PagedBatch(q_lens=[3, 0, 2], seq_lens=[3, 6, 9], device="cpu")
    out = paged_attention_cpu(batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t,
                              batch.scale)
    assert rel_err(out, reference(batch)) <= 1e-5


def test_dispatcher_picks_the_cpu_backend_on_cpu_and_keeps_the_reference_selectable():
    batch = PagedBatch(**CASES["mixed"], device="cpu")
    args = (batch.q, batch.kv, batch.block_tables, batch.cu_query_lens, batch.seq_lens_t, batch.scale)
    assert torch.equal(paged_attention(*args, impl="auto"), paged_attention_cpu(*args))
    assert torch.equal(paged_attention(*args, impl="cpu"), paged_attention_cpu(*args))
    assert torch.equal(paged_attention(*args, impl="reference"), prefill_attention_reference(*args))
    with pytest.raises(ValueError, match="choose one of"):
        paged_attention(*args, impl="flash")


def test_length_buckets_group_longest_first_and_bound_the_padding():
    lengths = [37, 2, 29, 11, 64, 6, 3, 20, 45, 64]
    buckets = length_buckets(lengths, ratio=0.7)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))  # every index once
    firsts = [lengths[b[0]] for b in buckets]
    assert firsts == sorted(firsts, reverse=True)
    for b in buckets:
        assert all(0.7 * lengths[b[0]] <= lengths[i] <= lengths[b[0]] for i in b)
    assert [[lengths[i] for i in b] for b in buckets] == [[64, 64, 45], [37, 29], [20], [11], [6], [3], [2]]
    assert length_buckets([]) == []
