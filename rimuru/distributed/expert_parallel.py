"""Expert parallelism for the routed experts under tensor parallelism (``enable_expert_parallel``, off by default).

With the switch on, a tensor-parallel engine keeps its attention, shared experts and dense MLPs split as before
(rimuru/distributed/sharding.py) but places **whole routed experts** on ranks: rank ``r`` holds the full
intermediate width of ``E / world`` experts (its *local* experts) and none of the others. Every rank routes every
token (the router is replicated); a rank computes only the (token, expert) pairs whose expert is local and leaves
the others' rows zero, so its MoE output is a partial sum, and the all-reduce that follows the MoE (the same one as
under plain tensor parallelism) adds the ranks' halves. Each rank then runs TP=1's kernel shape (full width, TP=1's
tuned tiles) on its share of the experts; the step waits for the rank with more work (routing imbalance).

Local numbering: rank ``r`` sees its experts as ``0 .. E/world - 1`` (``Placement.local[r]`` lists their global
ids, in order), so its host store, pool pages and page tables have the same shape on every rank — ``E/world``
experts of full-width pages — and the allocator state that the operation log keeps equal is the same on every
rank. ``Placement.maps[r]`` turns a global id into the local one, or ``E/world`` (the *null expert*) for an expert
held elsewhere; the fused MoE skips null pairs and writes their rows as zeros.

Which experts go where is a pure function of the model's expert count, the world size and, optionally, a hotness
per expert (:func:`place_experts`); one placement serves every layer (the host store of a repeated-layer synthetic
model is one copy viewed per layer).

:func:`rank_blocks` samples what one MoE layer costs each rank (row blocks of the fused kernel) for a routing
distribution: the estimate in docs/tensor_parallel.md ("Expert parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Placement:
    """Which global experts each rank holds whole: ``local[r]`` [E / world] int, ascending within a rank."""

    num_experts: int
    local: tuple[tuple[int, ...], ...]

    @property
    def world(self) -> int:
        return len(self.local)

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.world

    @property
    def null_expert(self) -> int:
        """The local id of "held by another rank": one past the rank's last local expert."""
        return self.per_rank

    @cached_property
    def owner(self) -> np.ndarray:
        """[E] rank holding each global expert."""
        owner = np.full(self.num_experts, -1, dtype=np.int64)
        for r, ids in enumerate(self.local):
            owner[list(ids)] = r
        return owner

    def map(self, rank: int) -> np.ndarray:
        """[E] int32: global id -> rank ``rank``'s local id, or :attr:`null_expert` where another rank holds it."""
        m = np.full(self.num_experts, self.null_expert, dtype=np.int32)
        m[list(self.local[rank])] = np.arange(self.per_rank, dtype=np.int32)
        return m


def place_experts(num_experts: int, world: int, hotness: np.ndarray | None = None) -> Placement:
    """Split ``num_experts`` experts over ``world`` ranks, ``num_experts / world`` each (a clear error otherwise).

    ``hotness`` None: contiguous blocks (rank ``r`` holds ``[r E/w, (r+1) E/w)``, vLLM's default). Else [E] (or
    [layers, E], averaged) per-token routing probabilities: experts in falling hotness are dealt to ranks in snake
    order (0, 1, ..., w-1, w-1, ..., 0, ...), which gives every rank the same number of experts and nearly the same
    expected load."""
    if world < 1 or num_experts % world:
        raise ValueError(f"expert parallelism needs the {num_experts} routed experts to divide evenly over "
                         f"{world} ranks")
    per = num_experts // world
    if hotness is None:
        return Placement(num_experts, tuple(tuple(range(r * per, (r + 1) * per)) for r in range(world)))
    h = np.asarray(hotness, dtype=np.float64)
    if h.ndim == 2:
        h = h.mean(axis=0)
    if h.shape != (num_experts,):
        raise ValueError(f"hotness has shape {h.shape}, want ({num_experts},)")
    order = np.argsort(-h, kind="stable")
    snake = np.concatenate([np.arange(world), np.arange(world)[::-1]])
    ranks = snake[np.arange(num_experts) % (2 * world)]
    return Placement(num_experts, tuple(tuple(sorted(int(e) for e in order[ranks == r])) for r in range(world)))


def rank_blocks(probability: np.ndarray, placement: Placement, tokens: int, block_m: int, samples: int = 2000,
                seed: int = 0) -> np.ndarray:
    """[samples, world + 1] sampled fused-MoE row blocks of one layer: per rank under ``placement`` (the experts it
    holds, ``ceil(rows / block_m)`` blocks each), and in the last column every expert's (one rank holding all, i.e.
    TP=1, or each tensor-parallel slice). Each expert's rows in a batch of ``tokens`` are drawn as Binomial(tokens,
    p_e), independently (``probability`` [E]: per-token probabilities summing to top-k, as in a hotset file) —
    the true top-k draw's slight negative correlation between experts is ignored."""
    p = np.clip(np.asarray(probability, dtype=np.float64), 0.0, 1.0)
    rng = np.random.default_rng(seed)
    rows = rng.binomial(tokens, p[None, :], size=(samples, p.size))
    blocks = -(-rows // block_m)
    per_rank = np.stack([blocks[:, list(ids)].sum(axis=1) for ids in placement.local], axis=1)
    return np.concatenate([per_rank, blocks.sum(axis=1, keepdims=True)], axis=1)


EXPERT_PARALLEL_MODELS = ("qwen2_moe", "qwen3_moe")


def check_expert_parallel(spec, world: int) -> None:
    """Clear errors for a model that expert parallelism cannot place over ``world`` ranks."""
    if spec.model_type not in EXPERT_PARALLEL_MODELS or spec.is_hybrid:
        raise ValueError(f"enable_expert_parallel runs {', '.join(EXPERT_PARALLEL_MODELS)} models, not "
                         f"{spec.model_type}")
    if spec.num_experts % world:
        raise ValueError(f"enable_expert_parallel: {spec.model_type}'s {spec.num_experts} routed experts do not divide "
                         f"over tensor_parallel_size={world} ranks")


def engine_placement(spec, world: int, hotness: np.ndarray | None) -> Placement:
    """The engine's placement: balanced by the hotset's routing probabilities (averaged over its layers) where there
    is a hotset of this model's experts, else contiguous. Every rank computes it from the same file."""
    check_expert_parallel(spec, world)
    if hotness is not None and np.asarray(hotness).shape[-1] != spec.num_experts:
        raise ValueError(f"the hotset has {np.asarray(hotness).shape[-1]} experts per layer, the model "
                         f"{spec.num_experts}")
    return place_experts(spec.num_experts, world, hotness)
