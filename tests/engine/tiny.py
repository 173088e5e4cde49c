"""The tiny synthetic models the engine tests serve (fp32, CPU), and transformers' greedy outputs on them."""

from __future__ import annotations

from pathlib import Path

import torch

from rimuru.bench import pressure
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.memory import CONV, KV, SSM

PROMPTS = [[9707, 11, 1879, 0], [3838, 374, 279, 6722, 315, 9625, 30], [40], [785, 3974, 13876, 38835, 34208, 916],
           [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [1986, 374, 264, 1273], [22, 22], [100, 200, 300]]
MAX_TOKENS = 12
MODELS = ("tiny-qwen3-moe", "tiny-qwen3.5-moe", "tiny-qwen3-next")  # a plain MoE and two hybrids (Gated DeltaNet +
# gated attention; Qwen3-Next stores its GDN input projections fused per key-head group)


_WRITTEN: dict[str, Path] = {}  # name -> its checkpoint, written once per session (read only by the tests)
_GREEDY: dict[tuple[str, str], list[list[int]]] = {}  # (checkpoint, device) -> transformers' greedy outputs


def write_tiny(tmp_path_factory, name: str) -> Path:
    """The synthetic checkpoint ``name`` (seed 0, fp32): written once per session, shared by every module."""
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    if name not in _WRITTEN:
        out = tmp_path_factory.mktemp("ckpt") / name
        write_synthetic_checkpoint(name, out, seed=0, dtype=torch.float32)
        _WRITTEN[name] = out
    return _WRITTEN[name]


def transformers_greedy(model_dir: Path, device: str = "cpu") -> list[list[int]]:
    """transformers' own greedy continuation of each of ``PROMPTS`` (``MAX_TOKENS`` tokens) on ``device``; run
    once per checkpoint and device in a session (a fresh copy each call)."""
    key = (str(model_dir), device)
    if key not in _GREEDY:
        _GREEDY[key] = _transformers_greedy(model_dir, device)
    return [list(o) for o in _GREEDY[key]]


def _transformers_greedy(model_dir: Path, device: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().to(device)
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                               attention_mask=torch.ones_like(ids), pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


def engine(source, **options) -> LLM:
    return LLM(source, device="cpu", dtype=torch.float32, activation_reserve="1MiB", **options)


def tight_budget(source) -> int:
    """Dense weights + activations + loading buffers + 16 cached experts + 4 pages (KV blocks and states)."""
    return pressure.tight_budget(source, experts=16, kv_pages=4, device="cpu", dtype=torch.float32,
                                 activation_reserve="1MiB")


def assert_all_state_pages_returned(llm: LLM) -> None:
    for cls in (SSM, CONV, KV) if llm.spec.is_hybrid else (KV,):
        assert llm.allocator.num_allocated(cls) == 0, f"{cls} pages still allocated"


def serve_prompts(source, **options) -> tuple[LLM, list[list[int]]]:
    """``PROMPTS`` served greedily to the end; the allocator checked and every KV and state page back."""
    llm = engine(source, **options)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    llm.check_integrity()
    assert not llm.has_unfinished_requests()
    assert_all_state_pages_returned(llm)
    return llm, [o.output_token_ids for o in outs]
