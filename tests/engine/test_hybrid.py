"""The engine on a tiny fp32 Qwen3.5-MoE hybrid (Gated DeltaNet + gated attention) against transformers' generate,
with SSM and conv states in pool pages (greedy per policy: tests/engine/test_greedy.py)."""

import os
import tempfile

import pytest
import torch

from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.state_manager import HybridCacheManager
from rimuru.kernels.compiles import compiles_by_kernel
from rimuru.memory import CONV, SSM
from tests.engine.tiny import (
    MAX_TOKENS,
    PROMPTS,
    assert_all_state_pages_returned,
    engine,
    serve_prompts,
    tight_budget,
    transformers_greedy,
    write_tiny,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "tiny-qwen3.5-moe")


@pytest.fixture(scope="module")
def ckpt(model_dir):
    """Loaded once: every engine of this module serves the same in-memory checkpoint."""
    from rimuru.models.loader import load_checkpoint

    return load_checkpoint(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tight(ckpt) -> int:
    return tight_budget(ckpt)


@pytest.fixture(scope="module")
def reference(model_dir):
    return transformers_greedy(model_dir)


def test_the_engine_serves_the_hybrid_with_states_in_the_pool(ckpt):
    llm = engine(ckpt, gpu_memory_budget="400MiB", policy="static")
    assert isinstance(llm.kv, HybridCacheManager)
    assert llm.kv.num_layers == 1 and llm.kv.states.num_layers == 1  # one attention and one GDN layer
    llm.add_request("a", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()
    assert llm.allocator.num_allocated(SSM) == 1 and llm.allocator.num_allocated(CONV) == 1
    assert llm.kv.states.conv_rows == 3  # linear_conv_kernel_dim - 1 consecutive rows
    llm.check_integrity()


def test_chunked_prefill_carries_states_across_chunks(ckpt, reference):
    # 5-token chunks: the 14-token prompt runs as 5 + 5 + 4, the 7-token one as 5 + 2 (fewer tokens than the
    # conv's W-1 = 3 rows, so its new conv rows mix the previous chunk's rows and its own tokens)
    llm, outs = serve_prompts(ckpt, gpu_memory_budget="400MiB", policy="static", max_num_batched_tokens=5)
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


def test_state_warmup_gives_its_pages_back_and_changes_no_output(ckpt, reference):
    llm = engine(ckpt, gpu_memory_budget="400MiB", policy="static")
    llm.executor.warmup_states()  # LLM.warmup runs it on CUDA; here on the reference kernels
    llm.check_integrity()
    assert_all_state_pages_returned(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference


@pytest.fixture(scope="module")
def ieee_fp32_dots():
    """fp32 means fp32 on both sides: fla's chunked GDN kernels call ``tl.dot`` without a precision, which Triton runs
    in TF32 on the GPU; TF32 rounding, applied in a different chunking by transformers and by the engine, turned a
    near-tie into a different greedy token at 2026-11-30 (H200, main a31de00: one sequence of six diverged at its
    9th token). ``TRITON_F32_DEFAULT=ieee`` is read when a kernel compiles, so it is set before either side compiles
    fla's kernels (a fresh Triton cache dir keeps TF32 binaries of an earlier process out)."""
    saved = {k: os.environ.get(k) for k in ("TRITON_F32_DEFAULT", "TRITON_CACHE_DIR")}
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-ieee-")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def reference_cuda(model_dir, ieee_fp32_dots):
    """transformers on CUDA: where fla-core imports, transformers' Qwen3.5 takes its GDN kernels, which cannot run on
    CPU tensors. Its causal conv (torch) and recurrent decode (fla) stay independent of our Triton kernels."""
    return transformers_greedy(model_dir, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["static", "elastic"])
def test_gpu_greedy_matches_transformers(model_dir, reference_cuda, ieee_fp32_dots, policy):
    """The CUDA path (Triton GDN decode and conv, fla's chunked prefill, paged attention, fused MoE) on the fp32
    tiny hybrid against transformers' generate."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    llm = LLM(str(model_dir), device="cuda", dtype=torch.float32, gpu_memory_budget="2GiB", policy=policy)
    info = llm.warmup()
    warm = compiles_by_kernel()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    llm.check_integrity()
    assert_all_state_pages_returned(llm)
    assert [o.output_token_ids for o in outs] == reference_cuda
    late = {k: n - warm.get(k, 0) for k, n in compiles_by_kernel().items() if n != warm.get(k, 0)}
    steps = [(r.tokens, r.prefill_tokens, r.compiles) for r in llm.timeline.records if r.compiles]
    assert sum(r.compiles for r in llm.timeline.records) == 0, f"compiles after warm-up {info}: {late} in {steps}"


def test_routing_profile_records_the_decode_tokens_apart(ckpt, tmp_path):
    """record_routing counts the decode tokens (requests computing one token in a step) apart as well as in the whole
    profile: a profile with outputs minus the same prompts' profile with one output token each is exactly the decode
    part, its token count the outputs less the tokens the prefill sampled; the split survives a save and load."""
    import numpy as np

    from rimuru.experts.hotset import Hotset

    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[3]]
    outputs = [1, 5, 9]
    whole = engine(ckpt, gpu_memory_budget="400MiB", policy="static", record_routing=True).profile_hotset(
        prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in outputs])
    prefill = engine(ckpt, gpu_memory_budget="400MiB", policy="static", record_routing=True).profile_hotset(
        prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    k = ckpt.spec.top_k
    assert whole.decode_tokens == sum(o - 1 for o in outputs) and prefill.decode_tokens == 0
    assert prefill.decode_probability is None  # no decode token: nothing recorded apart
    assert whole.num_tokens == sum(map(len, prompts)) + whole.decode_tokens
    counts = whole.probability * whole.num_tokens
    decode = whole.decode_probability * whole.decode_tokens
    assert np.allclose(decode.sum(axis=1), whole.decode_tokens * k)
    assert np.allclose(counts - prefill.probability * prefill.num_tokens, decode)
    whole.save(tmp_path / "h.json")
    back = Hotset.load(tmp_path / "h.json")
    assert back.decode_tokens == whole.decode_tokens
    assert np.allclose(back.decode_probability, whole.decode_probability, atol=1e-6)
    prefill.save(tmp_path / "p.json")
    assert Hotset.load(tmp_path / "p.json").decode_probability is None
