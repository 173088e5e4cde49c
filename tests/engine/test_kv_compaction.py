"""KV compaction (rimuru.memory.compaction): packing the survivors' scattered KV pages frees whole L2 pages for the
expert cache, keeps every request's KV contents, and leaves greedy outputs unchanged."""

import numpy as np
import pytest
import torch

from rimuru.engine.kv_manager import KVCacheManager
from rimuru.engine.sampling_params import SamplingParams
from rimuru.memory import EXPERT, KV, PagePool
from tests.engine.tiny import engine
from tests.memory.layouts import QWEN3_30B_A3B


def test_compaction_moves_pages_with_their_data_and_frees_whole_l2_pages():
    pool = PagePool(QWEN3_30B_A3B, 8 * QWEN3_30B_A3B.huge_page_bytes)  # 8 L2 pages of 96 KV pages
    alloc, view = pool.allocator, pool.view(KV)
    kv = KVCacheManager(alloc, num_layers=4, block_tokens=16)
    per = kv.pages_per_l2
    ids = [f"r{i}" for i in range(30)]
    for blocks in range(1, 6):  # decode-like growth: a block for every request per round, so each spans parents
        kv.allocate_many([(rid, 16 * blocks) for rid in ids])
    rng = np.random.default_rng(0)
    for rid in rng.permutation(ids)[:20]:  # two thirds finish in random order: the survivors stay scattered
        kv.free(str(rid))
    survivors = [r for r in ids if kv.num_blocks(r)]
    for rid in survivors:  # a page's contents name it: (request, layer, block)
        pages = kv.pages(rid)
        for layer in range(4):
            for b in range(pages.shape[1]):
                view.tensor[pages[layer, b]] = hash((rid, layer, b)) % 1000
    before = {rid: kv.pages(rid).copy() for rid in survivors}
    reclaimable = kv.reclaimable_l2_pages()
    assert reclaimable >= 3, "the set-up must scatter the survivors"
    free_l2 = alloc.free_l2_pages(EXPERT)
    src, dst = kv.compact()
    view.move(src, dst)
    alloc.check_integrity()
    assert alloc.free_l2_pages(EXPERT) == free_l2 + reclaimable  # whole L2 pages, as many as promised
    assert kv.reclaimable_l2_pages() == 0
    assert kv.l2_pages_for(kv.num_allocated_pages) == alloc.stats()[EXPERT]["split"]  # packed: no spare parent
    moved = 0
    for rid in survivors:
        pages = kv.pages(rid)
        moved += int((pages != before[rid]).sum())
        for layer in range(4):
            for b in range(pages.shape[1]):
                assert (view.tensor[pages[layer, b]] == hash((rid, layer, b)) % 1000).all(), (rid, layer, b)
    assert moved == len(src) > 0
    assert set(alloc.allocated_ids(KV).tolist()) == {int(p) for rid in survivors for p in kv.pages(rid).ravel()}
    assert per * alloc.stats()[EXPERT]["split"] >= kv.num_allocated_pages


@pytest.fixture(scope="module")
def drain(tmp_path_factory):
    """(checkpoint, options, prompts, params, the tokens and cache sizes of an elastic run without compaction)"""
    from rimuru.bench import pressure
    from rimuru.models.checkpoint import write_synthetic_checkpoint
    from rimuru.models.loader import load_checkpoint

    path = write_synthetic_checkpoint("tiny-qwen3-moe", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0,
                                      dtype=torch.float32)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    budget = pressure.tight_budget(path, experts=6, kv_pages=30, device="cpu", dtype=torch.float32,
                                   activation_reserve="1MiB")  # the cache can never hold all 16 experts
    options = dict(policy="elastic", gpu_memory_budget=budget, kv_reserve=0.6, block_tokens=4,
                   max_num_batched_tokens=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 1000, int(n)).tolist() for n in rng.integers(4, 30, 12)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in rng.integers(2, 24, 12)]
    plain = engine(ckpt, kv_compaction=False, **options)
    tokens = [o.output_token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert plain.kv_pages_moved == 0
    return ckpt, options, prompts, params, tokens, plain.timeline.frame()["cached_experts"].sum()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_elastic_engine_compacts_kv_and_greedy_output_is_unchanged(drain, async_scheduling):
    """A drain under elastic: requests of mixed lengths finish in arbitrary order; with compaction the freed L2 pages
    go back to the cache (it holds more experts over the run), pages move, and the tokens are those of the run
    without compaction. With async scheduling (decode graphs replayed eagerly on the CPU) compaction runs only
    with no step in flight."""
    ckpt, options, prompts, params, tokens, cached = drain
    llm = engine(ckpt, kv_compaction=True, async_scheduling=async_scheduling, **options)
    if async_scheduling:
        llm._install_eager_replay_graphs()
        compact = llm.kv.compact

        def compact_idle(*args, **kwargs):
            assert llm._inflight is None, "compaction with a step in flight"
            return compact(*args, **kwargs)

        llm.kv.compact = compact_idle
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.add_request(f"r{i:02d}", prompt, p)
    done, pipelined = {}, 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
        pipelined += llm._inflight is not None
    llm.check_integrity()
    assert llm.allocator.num_allocated(KV) == 0
    assert llm.kv_pages_moved > 0
    assert llm.timeline.frame()["kv_pages_moved"].sum() == llm.kv_pages_moved  # recorded on the steps they preceded
    assert [done[k] for k in sorted(done)] == tokens
    assert llm.timeline.frame()["cached_experts"].sum() > cached
    assert (pipelined > 0) == async_scheduling


def test_a_compaction_due_makes_the_step_synchronous():
    from rimuru.engine.llm import may_pipeline

    ready = dict(enabled=True, graphs_ready=True, evictions_pending=False, decode_fits=True)
    assert may_pipeline(**ready, compaction_due=False)
    assert not may_pipeline(**ready, compaction_due=True)


def test_compaction_is_due_for_a_whole_expert_and_a_cache_with_room():
    from rimuru.experts.adjuster import AdjusterConfig, compaction_due

    config = AdjusterConfig()
    assert compaction_due(config, 3, 100, 128)
    assert not compaction_due(config, 2, 100, 128)  # less than one expert's pages
    assert not compaction_due(config, 9, 128, 128)  # every expert cached already


def _gpu_drain(device: str, dtype: torch.dtype, compaction: bool):
    """The drain of ``test_elastic_engine_compacts_kv_and_greedy_output_is_unchanged`` on ``device`` with the decode
    graphs captured by warm-up (CUDA) and async scheduling on: (pages moved, tokens, compiles, graphed steps)."""
    from rimuru.bench import pressure
    from rimuru.engine.llm import LLM
    from rimuru.models.synthetic_memory import synthetic_checkpoint_in_memory

    ckpt = synthetic_checkpoint_in_memory("tiny-qwen3-moe", seed=0, dtype=dtype, device=device, routing_skew=0.7,
                                          progress=False)
    base = dict(device=device, dtype=dtype, activation_reserve="64MiB")
    budget = pressure.tight_budget(ckpt, experts=6, kv_pages=40, **base)
    llm = LLM(ckpt, gpu_memory_budget=budget, policy="elastic", kv_reserve=0.6, max_num_seqs=24, block_tokens=4,
              max_num_batched_tokens=256, kv_compaction=compaction, **base)  # 4-token blocks: 8 KV pages per L2
    llm.warmup()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 150000, int(n)).tolist() for n in rng.integers(3, 120, 24)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in rng.integers(2, 60, 24)]
    tokens = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.check_integrity()
    assert llm.allocator.num_allocated(KV) == 0
    frame = llm.timeline.frame()
    return llm.kv_pages_moved, tokens, int(frame["compiles"].sum()), int(frame["cuda_graph"].sum())


@pytest.mark.gpu
def test_gpu_compaction_keeps_the_greedy_tokens_with_graphs_and_async_scheduling():
    """On the device the pages' data moves with the tables (a device copy queued before the step) while graphed
    steps run pipelined: the tokens equal the run without compaction's, and nothing compiles after warm-up."""
    moved, tokens, compiles, graphed = _gpu_drain("cuda", torch.bfloat16, True)
    plain_moved, plain_tokens, _, _ = _gpu_drain("cuda", torch.bfloat16, False)
    assert moved > 0 and plain_moved == 0
    assert tokens == plain_tokens
    assert graphed > 0 and compiles == 0


@pytest.mark.parametrize("layers,step_pages,threshold", [(4, 6, 9), (48, 64, 64)])
def test_elastic_keeps_one_steps_kv_free_before_expanding(layers, step_pages, threshold):
    """The cache expands only past one full token budget's KV (2048 tokens: 128 blocks per layer, 96 KV pages per L2
    page), never below the constant threshold: at 48 layers that headroom is what KV compaction would otherwise give
    to the cache, and an arriving request would wait a step behind a shrink."""
    from rimuru.engine.llm import LLM
    from rimuru.engine.modeled.reference import spec_with_layers

    llm = LLM(spec_with_layers("qwen3-30b-a3b", layers), executor="modeled", gpu_memory_budget="32GiB",
              policy="elastic", modeled_step_ms=1.0)
    assert llm.plan.step_kv_l2_pages == step_pages
    assert llm.policy.adjuster.expand_free_above == threshold
    fixed = LLM(spec_with_layers("qwen3-30b-a3b", layers), executor="modeled", gpu_memory_budget="32GiB",
                policy="fixed", modeled_step_ms=1.0)
    assert fixed.plan.step_kv_l2_pages == step_pages  # the plan's, whatever the policy
