"""Switching the decode kernel levers at run time on a tensor-parallel engine (``LLM.use_kernels``: every rank
switches and recaptures its decode graphs, as for the all-reduce backend): gloo, two ranks, fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.kernels import variants

PROMPTS = [[9707, 11, 1879, 0], [3838, 374, 279, 6722, 315, 9625, 30], [40], [785, 3974, 13876, 38835, 34208, 916]]
BASE = dict(device="cpu", dtype=torch.float32, activation_reserve="1MiB", gpu_memory_budget="400MiB", policy="static")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-moe"
    write_synthetic_checkpoint("tiny-qwen3-moe", out, seed=0, dtype=torch.float32, tokenizer=False)
    return out


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.check_integrity()
    return [o.output_token_ids for o in outs]


def test_kernel_levers_switched_on_every_rank_greedy_unchanged(model_dir, monkeypatch):
    """TP=2 with graphs (eager replays on the CPU), switched to ``fast,pdl_wide,merge`` and back: rank 0 launches the
    new levers, every worker is told in lockstep and recaptures (the engine keeps serving: a worker that failed its
    switch would end the engine), and the greedy tokens stay those of one process. A bad lever is a clear error
    before any rank switches, and the engine serves on with the levers it had."""
    import rimuru.distributed.group as group

    before = variants.current()
    one = LLM(model_dir, **BASE)
    expected = _generate(one)
    llm = LLM(model_dir, **BASE, tensor_parallel_size=2)
    try:
        llm._install_eager_replay_graphs()
        assert _generate(llm) == expected
        sent = []
        send = llm.tp_group.send
        monkeypatch.setattr(llm.tp_group, "send",
                            lambda message: (message[0] == "kernels" and sent.append(message)) or send(message))
        llm.use_kernels("fast,pdl_wide,merge")
        assert variants.current() == ("align_par,direct_moe,gemv,merge,moe_gemv,nosplit_full,pdl,pdl_chain,pdl_wide,"
                                      "qkv_fused")
        assert sent == [("kernels", "fast,pdl_wide,merge")]  # the workers' message, answered "switched"
        assert _generate(llm) == expected
        with pytest.raises(ValueError, match="unknown kernel lever"):
            llm.use_kernels("fast,pdl_wider")
        assert len(sent) == 1 and "pdl_wide" in variants.current()
        assert _generate(llm) == expected
        llm.use_kernels("fast")
        assert variants.current() == "fast" and _generate(llm) == expected
        one.use_kernels("fast,merge")  # one process: the levers and its graphs (none here)
        assert variants.current() == "align_par,direct_moe,gemv,merge,moe_gemv,nosplit_full,pdl,pdl_chain,qkv_fused"
        assert group.SWITCHES["kernels"] is group.switch_kernels
    finally:
        variants.select(before)
        llm.close()
    assert not any(p.is_alive() for p in llm.tp_group.procs)
