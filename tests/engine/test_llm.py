"""The engine end to end on a tiny synthetic model, against transformers' own generate."""

import pytest
import torch

from rimuru.engine.llm import LLM, MemoryBudgetError
from rimuru.engine.sampling_params import SamplingParams

PROMPTS = [[9707, 11, 1879, 0], [3838, 374, 279, 6722, 315, 9625, 30], [40], [785, 3974, 13876, 38835, 34208, 916],
           [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [1986, 374, 264, 1273], [22, 22], [100, 200, 300]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-moe"
    write_synthetic_checkpoint("tiny-qwen3-moe", out, seed=0, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                               attention_mask=torch.ones_like(ids), pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


def run(model_dir, **options):
    llm = LLM(model_dir, device="cpu", dtype=torch.float32, activation_reserve="1MiB", **options)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    llm.check_integrity()
    assert not llm.has_unfinished_requests()
    return llm, [o.output_token_ids for o in outs]


def test_greedy_matches_transformers_with_every_expert_cached(model_dir, reference):
    llm, outs = run(model_dir, gpu_memory_budget="400MiB", policy="static")
    assert outs == reference


def test_greedy_matches_transformers_with_a_quarter_of_experts_cached(model_dir, reference):
    llm, outs = run(model_dir, gpu_memory_budget="400MiB", policy="fixed", initial_cache_experts=4)
    assert outs == reference
    assert llm.loader.experts_loaded > 0


def test_greedy_matches_with_uncached_experts_computed_on_cpu(model_dir, reference):
    llm, outs = run(model_dir, gpu_memory_budget="400MiB", policy="cpu", initial_cache_experts=4)
    assert outs == reference
    assert llm.provider.experts_on_cpu > 0 and llm.loader.experts_loaded == 0


def test_greedy_matches_under_pressure_with_shrink_and_preemption(model_dir, reference):
    # the offload limit stops the shrinking at 14 cached experts, so the scheduler must preempt too
    llm, outs = run(model_dir, gpu_memory_budget=_tight_budget(model_dir), policy="elastic",
                    initial_cache_experts=16, expert_offload_limit=2, max_num_batched_tokens=64)
    assert outs == reference
    shrinks = sum(1 for r in llm.timeline.records if r.adjust < 0)
    assert shrinks > 0, "the adjuster never shrank"
    assert llm.stats().preemptions > 0, "the scheduler never preempted"


def test_elastic_reaches_higher_peak_concurrency_than_fixed(model_dir):
    budget = _tight_budget(model_dir)
    fixed, _ = run(model_dir, gpu_memory_budget=budget, policy="fixed", initial_cache_experts=16)
    elastic, _ = run(model_dir, gpu_memory_budget=budget, policy="elastic", initial_cache_experts=16)
    assert elastic.stats().peak_concurrency > fixed.stats().peak_concurrency


def test_budget_too_small_is_a_clear_error(model_dir):
    with pytest.raises(MemoryBudgetError, match="too small"):
        LLM(model_dir, device="cpu", dtype=torch.float32, gpu_memory_budget="1MiB")


def _tight_budget(model_dir) -> int:
    """Dense weights + activations + buffers + 16 cached experts + a few KV blocks."""
    probe = LLM(model_dir, device="cpu", dtype=torch.float32, gpu_memory_budget="400MiB", policy="fixed",
                initial_cache_experts=0, activation_reserve="1MiB")
    r = probe.memory_report
    page = probe.pool.layout.page_bytes("expert")
    return r["dense"] + r["activations"] + r["buffer_pages"] * page + (3 * 16 + 4) * page


def test_in_memory_synthetic_checkpoint_equals_the_written_one(model_dir):
    from rimuru.models.loader import load_checkpoint
    from rimuru.models.synthetic_memory import synthetic_checkpoint_in_memory

    disk = load_checkpoint(model_dir, dtype=torch.float32)
    mem = synthetic_checkpoint_in_memory("tiny-qwen3-moe", seed=0, dtype=torch.float32, progress=False)
    assert torch.equal(disk.experts.weights, mem.experts.weights)
    assert disk.dense.keys() == mem.dense.keys()
    assert all(torch.equal(disk.dense[k], mem.dense[k]) for k in disk.dense)
