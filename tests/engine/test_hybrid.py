"""The engine on a tiny fp32 Qwen3.5-MoE hybrid (Gated DeltaNet + gated attention) against transformers' generate,
with SSM and conv states in pool pages."""

import pytest
import torch

from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.state_manager import HybridCacheManager
from rimuru.memory import CONV, KV, SSM
from tests.engine.test_llm import MAX_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3.5-moe"
    write_synthetic_checkpoint("tiny-qwen3.5-moe", out, seed=0, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def ckpt(model_dir):
    """Loaded once: every engine of this module serves the same in-memory checkpoint."""
    from rimuru.models.loader import load_checkpoint

    return load_checkpoint(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tight(ckpt) -> int:
    """Dense weights + activations + loading buffers + 16 cached experts + 4 pages (KV and states)."""
    probe = engine(ckpt, gpu_memory_budget="400MiB", policy="fixed", initial_cache_experts=0)
    r = probe.memory_report
    page = probe.pool.layout.page_bytes("expert")
    return r["dense"] + r["activations"] + r["buffer_pages"] * page + (3 * 16 + 4) * page


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                               attention_mask=torch.ones_like(ids), pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


def engine(ckpt, **options) -> LLM:
    return LLM(ckpt, device="cpu", dtype=torch.float32, activation_reserve="1MiB", **options)


def run(ckpt, **options):
    llm = engine(ckpt, **options)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    llm.check_integrity()
    assert not llm.has_unfinished_requests()
    assert_all_state_pages_returned(llm)
    return llm, [o.output_token_ids for o in outs]


def assert_all_state_pages_returned(llm: LLM) -> None:
    for cls in (SSM, CONV, KV):
        assert llm.allocator.num_allocated(cls) == 0, f"{cls} pages still allocated"


def test_the_engine_serves_the_hybrid_with_states_in_the_pool(ckpt):
    llm = engine(ckpt, gpu_memory_budget="400MiB", policy="static")
    assert isinstance(llm.kv, HybridCacheManager)
    assert llm.kv.num_layers == 1 and llm.kv.states.num_layers == 1  # one attention and one GDN layer
    llm.add_request("a", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()
    assert llm.allocator.num_allocated(SSM) == 1 and llm.allocator.num_allocated(CONV) == 1
    assert llm.kv.states.conv_rows == 3  # linear_conv_kernel_dim - 1 consecutive rows
    llm.check_integrity()


def test_greedy_matches_transformers_static(ckpt, reference):
    _, outs = run(ckpt, gpu_memory_budget="400MiB", policy="static")
    assert outs == reference


def test_greedy_matches_transformers_fixed_cache(ckpt, reference):
    llm, outs = run(ckpt, gpu_memory_budget="400MiB", policy="fixed", initial_cache_experts=4)
    assert outs == reference
    assert llm.loader.experts_loaded > 0


def test_greedy_matches_transformers_cpu_experts(ckpt, reference):
    llm, outs = run(ckpt, gpu_memory_budget="400MiB", policy="cpu", initial_cache_experts=4)
    assert outs == reference
    assert llm.provider.experts_on_cpu > 0


def test_greedy_matches_transformers_elastic_under_pressure(ckpt, tight, reference):
    llm, outs = run(ckpt, gpu_memory_budget=tight, policy="elastic", initial_cache_experts=16,
                    expert_offload_limit=2, max_num_batched_tokens=64)
    assert outs == reference
    assert sum(1 for r in llm.timeline.records if r.adjust < 0) > 0, "the adjuster never shrank"
    assert llm.stats().preemptions > 0, "the scheduler never preempted"


def test_chunked_prefill_carries_states_across_chunks(ckpt, reference):
    # 5-token chunks: the 14-token prompt runs as 5 + 5 + 4, the 7-token one as 5 + 2 (fewer tokens than the
    # conv's W-1 = 3 rows, so its new conv rows mix the previous chunk's rows and its own tokens)
    llm, outs = run(ckpt, gpu_memory_budget="400MiB", policy="static", max_num_batched_tokens=5)
    assert outs == reference
    assert any(r.prefill_tokens and r.tokens == 5 for r in llm.timeline.records)


def test_abort_and_preemption_return_every_state_page(ckpt, tight):
    llm = engine(ckpt, gpu_memory_budget=tight, policy="fixed", initial_cache_experts=16,
                 max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i, p in enumerate(PROMPTS * 2):
        llm.add_request(f"r{i}", p, params)
    preempted = 0
    for _ in range(80):
        llm.step()
        llm.check_integrity()  # states held by exactly the running requests, nothing leaked
        preempted = llm.stats().preemptions
        if preempted:
            break
    assert preempted > 0, "the budget never forced a preemption"
    assert llm.allocator.num_allocated(SSM) > 0
    for i in range(len(PROMPTS) * 2):
        llm.abort_request(f"r{i}")
    llm.check_integrity()
    assert_all_state_pages_returned(llm)
    stats = llm.allocator.stats()
    assert stats[SSM]["carved_free"] == stats[SSM]["split"] == 0, "SSM pages did not merge back into huge pages"
