"""Expert parallelism under tensor parallelism (``enable_expert_parallel``): the placement, the fused MoE's null
expert under TRITON_INTERPRET, and the engine on the CPU (gloo, 2 processes, tiny fp32 models) — greedy outputs
identical to one process, every rank's pool consistent, bad combinations refused with a clear error."""

import numpy as np
import pytest
import torch

from rimuru.distributed import Shard
from rimuru.distributed.expert_parallel import Placement, check_expert_parallel, place_experts, rank_blocks
from rimuru.engine.config import EngineConfig
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.moe_reference import moe_reference
from rimuru.kernels import variants
from rimuru.kernels.fused_moe import fused_moe_experts
from rimuru.memory import EXPERT
from tests.markers import needs_triton

PROMPTS = [[9707, 11, 1879, 0], [3838, 374, 279, 6722, 315, 9625, 30], [40], [785, 3974, 13876, 38835, 34208, 916],
           [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
BASE = dict(device="cpu", dtype=torch.float32, activation_reserve="1MiB", gpu_memory_budget="400MiB",
            policy="static")


# ---------------------------------------------------------------------------------------------- placement
def test_contiguous_and_balanced_placements():
    c = place_experts(8, 2)
    assert c.local == ((0, 1, 2, 3), (4, 5, 6, 7)) and c.per_rank == 4 and c.null_expert == 4
    assert c.map(1).tolist() == [4, 4, 4, 4, 0, 1, 2, 3]
    hot = np.array([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.6])  # by hotness: 1 3 5 7 6 4 2 0
    b = place_experts(8, 2, hot)
    # snake over falling hotness: rank 0 gets the 1st, 4th, 5th, 8th hottest (1, 7, 6, 0); rank 1 the others
    assert b.local == ((0, 1, 6, 7), (2, 3, 4, 5))
    assert hot[list(b.local[0])].sum() == pytest.approx(hot[list(b.local[1])].sum())
    for p in (c, b):  # every expert on exactly one rank, its map the inverse of the placement
        assert sorted(e for ids in p.local for e in ids) == list(range(8))
        for r in range(2):
            m = p.map(r)
            assert [int(np.flatnonzero(m == j)[0]) for j in range(4)] == list(p.local[r])
            assert (m[p.owner != r] == p.null_expert).all()
    with pytest.raises(ValueError, match="divide evenly"):
        place_experts(6, 4)
    with pytest.raises(ValueError, match="shape"):
        place_experts(8, 2, np.ones(7))


def test_rank_blocks_counts_each_ranks_row_blocks():
    p = np.array([1.0, 1.0, 0.0, 0.0])  # every token routes to experts 0 and 1
    s = rank_blocks(p, place_experts(4, 2), tokens=20, block_m=16, samples=3)
    assert s.tolist() == [[4, 0, 4]] * 3  # 20 rows each: 2 blocks of 16 rows per expert, both on rank 0
    s = rank_blocks(p, Placement(4, ((0, 2), (1, 3))), tokens=20, block_m=16, samples=2)
    assert s.tolist() == [[2, 2, 4]] * 2


def test_expert_parallel_store_keeps_its_experts_whole():
    shard = Shard(1, 2, (1, 3))
    store = HostExpertStore.empty(1, 4, 8, 4, torch.float32, pin=False, shard=shard)
    assert tuple(store.weights.shape) == (1, 2, 3, 8, 4)  # 2 experts, full intermediate width
    for e in range(4):
        store.set_expert(0, e, torch.full((8, 4), e + 0.5), torch.full((8, 4), e + 1.5), torch.full((4, 8), e + 2.5))
    assert store.weights[0, :, 0, 0, 0].tolist() == [1.5, 3.5]  # global experts 1 and 3, in local order
    assert store.holds(3) and not store.holds(2)


# ---------------------------------------------------------------------------------------------- the kernel
@needs_triton
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 8, 2), (70, 8, 2), (40, 16, 8)])  # one token; the direct schedule;
# moe_align (140 pairs > 128); 320 pairs > 256: with `fast`, the one-launch parallel alignment (align_par), the
# path of a 64- or 256-request decode step, its null expert one more bin
@pytest.mark.parametrize("lever", ["baseline", "fast"])
def test_null_expert_rows_are_zero_and_the_ranks_sum_to_the_whole(T, E, k, lever):
    """Each rank's fused MoE over its own experts (local ids, the others the null expert) writes zeros in the null
    pairs' rows; the two ranks' partial sums add up to the MoE over all experts."""
    gen = torch.Generator().manual_seed(T)
    f, d = 32, 64
    view = torch.randn(3 * E, f, d, generator=gen) / d**0.5
    table = torch.arange(3 * E, dtype=torch.int32).reshape(E, 3)
    ids = torch.rand(T, E, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(T, k, generator=gen) + 0.1
    x = torch.randn(T, d, generator=gen)
    whole = moe_reference(x, w, ids, view, table)
    placement = place_experts(E, 2, np.arange(E, dtype=float))
    total = torch.zeros(T, d)
    with variants.use(lever):
        for r in range(2):
            local = torch.from_numpy(placement.map(r))[ids.long()]
            rank_table = table[list(placement.local[r])].contiguous()
            out = torch.full((T * k, d), float("nan"))
            rows = fused_moe_experts(x, w, local, view, rank_table, out=out, null_expert=placement.null_expert,
                                     tile_experts=E).view(T, k, d)
            null = local == placement.null_expert
            assert (rows[null] == 0).all() and torch.isfinite(rows).all()
            total += rows.sum(1)
    assert ((total - whole).norm() / whole.norm()).item() <= 1e-5


@needs_triton
def test_top_k_launch_writes_local_ids():
    """The GPU's routing launch applies the map itself: the same weights, ids through the map (padding rows too)."""
    from rimuru.kernels.norm_rope import topk_softmax

    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    valid = torch.tensor([True, True, False, True, True])
    m = torch.from_numpy(place_experts(8, 2, np.arange(8.0)).map(1))
    w0, ids0 = topk_softmax(logits, 2, True, valid)
    w1, ids1 = topk_softmax(logits, 2, True, valid, m)
    assert torch.equal(w0, w1) and torch.equal(ids1, m[ids0.long()])
    assert (ids1 == 4).any() and (ids1 < 4).any()  # both kinds of ids in this batch


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-qwen2-moe"])
def model_dir(request, tmp_path_factory):
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / request.param
    write_synthetic_checkpoint(request.param, out, seed=0, dtype=torch.float32, tokenizer=False)
    return out


def generate(llm: LLM, prompts=PROMPTS, max_tokens=8) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    llm.check_integrity()  # every rank's allocator and cache, and every rank's state equal to rank 0's
    return [o.output_token_ids for o in outs]


@pytest.mark.parametrize("graphed", [False, True])
def test_expert_parallel_greedy_identical_to_one_process(model_dir, graphed):
    """Static at TP=2 with whole experts per rank: greedy identical to one process, eager and through the
    (eagerly replayed) decode graphs with async scheduling; each rank's pool pages hold full-width experts, half of
    them."""
    if graphed and model_dir.name != "tiny-qwen3-moe":
        pytest.skip("one model is enough for the graphed path")
    single = LLM(model_dir, **BASE)
    if graphed:
        single._install_eager_replay_graphs()
    expected = generate(single)
    llm = LLM(model_dir, **BASE, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert llm.memory_report["expert_parallel"] is True
        assert llm.pool.layout.page_bytes(EXPERT) == single.pool.layout.page_bytes(EXPERT)  # full width
        assert llm.cache.num_experts * 2 == single.cache.num_experts  # half of the experts
        assert llm.expert_placement.local[0] + llm.expert_placement.local[1] != ()
        if graphed:
            llm._install_eager_replay_graphs()
        assert generate(llm) == expected
        if graphed:
            assert llm._inflight is None
    finally:
        llm.close()
    assert not any(p.is_alive() for p in llm.tp_group.procs)


@needs_triton
def test_expert_parallel_triton_moe_greedy_identical(model_dir):
    """The same with the Triton fused MoE (interpreted) on every rank: the null expert's rows in the engine."""
    if model_dir.name != "tiny-qwen3-moe":
        pytest.skip("one model is enough for the interpreted kernel")
    expected = generate(LLM(model_dir, **BASE, moe_impl="triton"), PROMPTS[:3], 4)
    llm = LLM(model_dir, **BASE, moe_impl="triton", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert generate(llm, PROMPTS[:3], 4) == expected
    finally:
        llm.close()


def test_bad_combinations_are_clear_errors(model_dir, capsys):
    with pytest.raises(ValueError, match="tensor_parallel_size >= 2"):
        EngineConfig(policy="static", enable_expert_parallel=True)
    for policy in ("fixed", "elastic", "cpu"):
        with pytest.raises(ValueError, match="serves policy static only"):
            EngineConfig(policy=policy, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="modeled"):
        EngineConfig(policy="static", tensor_parallel_size=2, enable_expert_parallel=True, executor="modeled")
    with pytest.raises(ValueError, match="record_routing"):
        EngineConfig(policy="static", tensor_parallel_size=2, enable_expert_parallel=True, record_routing=True)
    from rimuru.models.spec import ModelSpec

    with pytest.raises(ValueError, match="qwen2_moe, qwen3_moe models, not qwen3_5_moe"):
        check_expert_parallel(ModelSpec.from_pretrained("tiny-qwen3.5-moe"), 2)
    with pytest.raises(ValueError, match="8 routed experts do not divide over tensor_parallel_size=3"):
        check_expert_parallel(ModelSpec.from_pretrained(model_dir), 3)
    # from the command line: the same message, before any process starts
    from rimuru.cli import main

    assert main(["serve", str(model_dir), "--policy", "elastic", "-tp", "2", "--enable-expert-parallel"]) == 2
    assert "--enable-expert-parallel: enable_expert_parallel serves policy static only" in capsys.readouterr().err
