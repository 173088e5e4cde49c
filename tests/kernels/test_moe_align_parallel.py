"""The one-launch parallel alignment (``align_par`` lever, issue 13 wave 8): the same schedule as the torch
version, bit for bit (it keeps pair order within an expert), whatever the grid's split of pairs and rows."""

import pytest
import torch

from rimuru.kernels import moe_align as ma
from rimuru.kernels import variants
from tests.markers import needs_triton


def _ids(T: int, E: int, k: int, skew: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(T * 31 + E)
    if skew:  # a few hot experts: long runs of one expert (rows past one block, many empty experts)
        probs = torch.full((E,), 0.1).index_fill_(0, torch.arange(0, E, 7), 20.0)
        return torch.stack([torch.multinomial(probs, k, generator=gen) for _ in range(T)]).to(torch.int32)
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)


def test_parallel_align_is_decided_by_pair_count_and_lever():
    assert not ma.parallel_align(ma.FUSED_SCATTER_MAX_PAIRS, True)
    assert ma.parallel_align(ma.FUSED_SCATTER_MAX_PAIRS + 1, True)
    assert ma.parallel_align(ma.PARALLEL_MAX_PAIRS, True)
    assert not ma.parallel_align(ma.PARALLEL_MAX_PAIRS + 1, True)
    assert not ma.parallel_align(512, False)


@needs_triton
@pytest.mark.parametrize("T,E,k,bm,skew", [(40, 64, 8, 16, False), (64, 128, 8, 16, True), (33, 16, 8, 64, True),
                                           (37, 128, 8, 8, False)])
def test_parallel_alignment_equals_the_torch_schedule(T, E, k, bm, skew, monkeypatch):
    ids = _ids(T, E, k, skew)
    assert ma.parallel_align(T * k, True)
    # small programs so that the interpreter's grid has several of each kind (pairs, rows, counting chunks)
    monkeypatch.setattr(ma, "PARALLEL_PAIRS", 16)
    monkeypatch.setattr(ma, "PARALLEL_CHUNK", 64)
    monkeypatch.setattr(ma, "PARALLEL_ROWS", 64)
    ref = ma.moe_align_torch(ids, E, bm)
    with variants.use("fast,align_par"):
        got = ma.moe_align(ids, E, bm)
    assert torch.equal(got.sorted_token_ids, ref.sorted_token_ids)
    assert torch.equal(got.expert_ids, ref.expert_ids)
    assert torch.equal(got.num_tokens_post_padded, ref.num_tokens_post_padded)
    with variants.use("fast"):  # the two-launch path agrees up to order within an expert
        old = ma.moe_align(ids, E, bm)
    assert torch.equal(old.expert_ids, ref.expert_ids)
    used = int(ref.num_tokens_post_padded)
    for b in range(used // bm):
        blk = slice(b * bm, (b + 1) * bm)
        assert sorted(old.sorted_token_ids[blk].tolist()) == sorted(got.sorted_token_ids[blk].tolist())
