"""A vocabulary-parallel LM head (``vocab_parallel_head``): each rank projects its block of the vocabulary; the greedy
token is every rank's first maximum reduced, the logits are gathered where the whole row is needed."""

import pytest
import torch

from rimuru.distributed import Shard
from rimuru.distributed.comm import SINGLE, TorchDistributed
from rimuru.distributed.sharding import check_shardable
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.models.spec import ModelSpec

PROMPTS = [[9707, 11, 1879, 0], [3838, 374, 279, 6722, 315, 9625, 30], [40], [785, 3974, 13876, 38835, 34208, 916]]
BASE = dict(device="cpu", dtype=torch.float32, activation_reserve="1MiB", gpu_memory_budget="400MiB", policy="static")


def _two_ranks(parts: list[torch.Tensor]) -> list[TorchDistributed]:
    """Two ranks' communicators whose all-gather returns what each rank contributes to the same call (simulated:
    the ranks' calls are run one after the other, rank 1's contribution recorded first)."""
    comms = [TorchDistributed(Shard(r, 2), torch.device("cpu")) for r in (0, 1)]
    sent: list[torch.Tensor | None] = [None, None]

    def gather_for(rank: int):
        def all_gather(t: torch.Tensor) -> torch.Tensor:
            sent[rank] = t
            return torch.stack([s if s is not None else t for s in sent])
        return all_gather
    for r, c in enumerate(comms):
        c._all_gather = gather_for(r)
    return comms, sent


def test_greedy_tokens_are_the_argmax_of_the_whole_row_ties_to_the_lowest_id():
    gen = torch.Generator().manual_seed(0)
    S, V = 6, 40
    logits = torch.randn(S, V, generator=gen)
    logits[1, 3] = logits[1, 25] = 9.0  # a tie across the blocks: the lower id (rank 0's)
    logits[2, 22] = logits[2, 31] = 9.0  # a tie inside rank 1's block: its first
    logits[3, :] = 0.5  # every id ties: id 0
    blocks = [logits[:, : V // 2], logits[:, V // 2:]]
    comms, _ = _two_ranks(blocks)
    comms[1].greedy_tokens(blocks[1])  # rank 1's contribution
    got = comms[0].greedy_tokens(blocks[0])
    assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(logits, dim=-1))
    assert got[1].item() == 3 and got[2].item() == 22 and got[3].item() == 0
    assert torch.equal(comms[1].greedy_tokens(blocks[1]), got)  # every rank gets the same tokens
    assert torch.equal(SINGLE.greedy_tokens(logits), torch.argmax(logits, dim=-1))


def test_gather_vocab_puts_the_blocks_in_rank_order():
    logits = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)
    blocks = [logits[:, :4], logits[:, 4:]]
    comms, _ = _two_ranks(blocks)
    comms[1].gather_vocab(blocks[1])
    assert torch.equal(comms[0].gather_vocab(blocks[0]), logits)
    assert SINGLE.gather_vocab(logits) is logits


def test_clear_errors():
    spec = ModelSpec.from_pretrained("tiny-qwen3-moe")
    check_shardable(spec, Shard(0, 2), vocab_parallel=True)  # an even vocabulary splits
    odd = ModelSpec.from_pretrained("tiny-qwen3-moe")
    object.__setattr__(odd, "vocab_size", spec.vocab_size + 1)
    with pytest.raises(ValueError, match="vocabulary of"):
        check_shardable(odd, Shard(0, 2), vocab_parallel=True)
    hybrid = ModelSpec.from_pretrained("tiny-qwen3.5-moe")
    with pytest.raises(ValueError, match="not supported for hybrid"):
        check_shardable(hybrid, Shard(0, 2), vocab_parallel=True)


@pytest.mark.parametrize("auto", [False, True])
def test_auto_setting_follows_the_default_where_the_head_can_split(auto, monkeypatch):
    """``vocab_parallel_head=None`` (auto) gives ``VOCAB_PARALLEL_AUTO`` for a plain MoE model at TP > 1 and a
    replicated head where it cannot split (one rank, a hybrid, an odd vocabulary) instead of an error; True and
    False are kept as given."""
    from rimuru.distributed import sharding
    from rimuru.engine.config import EngineConfig

    monkeypatch.setattr(sharding, "VOCAB_PARALLEL_AUTO", auto)
    spec = ModelSpec.from_pretrained("tiny-qwen3-moe")
    odd = ModelSpec.from_pretrained("tiny-qwen3-moe")
    object.__setattr__(odd, "vocab_size", spec.vocab_size + 1)
    hybrid = ModelSpec.from_pretrained("tiny-qwen3.5-moe")
    assert sharding.vocab_parallel(None, spec, 2) is auto
    assert not sharding.vocab_parallel(None, spec, 1)
    assert not sharding.vocab_parallel(None, hybrid, 2) and not sharding.vocab_parallel(None, odd, 2)
    assert sharding.vocab_parallel(True, spec, 2) and not sharding.vocab_parallel(False, spec, 2)
    assert not sharding.vocab_parallel(True, spec, 1)
    check_shardable(hybrid, Shard(0, 2), vocab_parallel=None)  # auto asks for nothing
    with pytest.raises(ValueError, match="vocab_parallel_head must be"):
        EngineConfig(vocab_parallel_head="yes")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-moe"
    write_synthetic_checkpoint("tiny-qwen3-moe", out, seed=0, dtype=torch.float32, tokenizer=False)
    return out


def _generate(llm: LLM, max_tokens: int = 8) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    llm.check_integrity()
    return [o.output_token_ids for o in outs]


def test_greedy_identical_to_one_process_sync_async_and_switched_off(model_dir):
    """Prefills (eager: the logits gathered, then the sampler's argmax) and async-scheduled decode graphs (eager
    replays on the CPU: the distributed greedy choice) give one process's tokens; switched off at run time, too."""
    one = LLM(model_dir, **BASE)
    one._install_eager_replay_graphs()
    expected = _generate(one)
    with pytest.raises(ValueError, match="needs tensor parallelism"):
        one.model.use_vocab_parallel(True)
    llm = LLM(model_dir, **BASE, tensor_parallel_size=2, vocab_parallel_head=True)
    try:
        assert llm.model.vocab_parallel
        assert _generate(llm) == expected  # synchronous: every step's logits gathered
        llm._install_eager_replay_graphs()
        kinds = []
        message = llm.executor.sender.message
        llm.executor.sender.message = lambda out, kind="step": kinds.append(kind) or message(out, kind)
        assert _generate(llm) == expected
        assert kinds.count("launch") >= 5  # the decode steps ran launched: greedy_tokens on every rank
        llm.tp_group.use_vocab_parallel(llm, False)  # every rank, graphs recaptured
        assert not llm.model.vocab_parallel
        assert _generate(llm) == expected
    finally:
        llm.close()
    assert not any(p.is_alive() for p in llm.tp_group.procs)
