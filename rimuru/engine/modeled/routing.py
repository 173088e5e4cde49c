"""Routing model of the modeled executor: which experts a step's tokens touch, per MoE layer.

Fitted to a hotset profile (the measured per-layer probabilities ``pi[l, e]`` that a token selects
expert ``e`` of layer ``l``; each row sums to top-k). Tokens route independently, so expert ``e`` of
layer ``l`` is touched by a step of ``T`` tokens with probability ``1 - (1 - pi[l, e]) ** T`` — the
exact marginal of per-token top-k sampling with those inclusion probabilities; the joint law within
one token (exactly k distinct experts) is not kept, and neither is any cross-layer correlation (the
hotset profiles here carry none). The tokens of one prefill chunk are not independent (a prompt's tokens
share experts): a chunk of ``q`` tokens counts as ``min(q, chunk_scale * q ** chunk_exponent)``
independent tokens (``effective_tokens``; fitted to measured per-step touched experts by
``rimuru.engine.modeled.calibration.fit_chunk_routing``; 1 and 1 = independent). Decode tokens of different
requests count one each. Seeded: the same seed and the same sequence of calls give the same sets.
"""

from __future__ import annotations

import numpy as np

from rimuru.experts.hotset import Hotset


class RoutingModel:
    def __init__(self, probability: np.ndarray, top_k: int, seed: int = 0, chunk_scale: float = 1.0,
                 chunk_exponent: float = 1.0) -> None:
        if chunk_scale <= 0 or not 0 < chunk_exponent <= 1:
            raise ValueError(f"chunk_scale must be > 0 and chunk_exponent in (0, 1], got {chunk_scale}, "
                             f"{chunk_exponent}")
        self.chunk_scale, self.chunk_exponent = float(chunk_scale), float(chunk_exponent)
        p = np.asarray(probability, dtype=np.float64)
        if p.ndim != 2:
            raise ValueError(f"routing probabilities must be [layers, experts], got shape {p.shape}")
        rows = p.sum(axis=1, keepdims=True)
        if (rows <= 0).any():
            raise ValueError("every layer needs a positive routing probability")
        # a profile measured on few tokens may not sum to exactly k: renormalise each layer to k picks
        self.pi = np.clip(p / rows * top_k, 0.0, 1.0)
        self.top_k = top_k
        self._log_miss = np.log1p(-np.minimum(self.pi, 1 - 1e-12))  # log(1 - pi)
        self.rng = np.random.default_rng(seed)
        self._touch: dict[int, np.ndarray] = {}  # tokens -> touch probabilities (batch sizes repeat)

    @classmethod
    def from_hotset(cls, hotset: Hotset, top_k: int, seed: int = 0, chunk_scale: float = 1.0,
                    chunk_exponent: float = 1.0) -> RoutingModel:
        return cls(hotset.probability, top_k, seed, chunk_scale, chunk_exponent)

    def effective_tokens(self, q_lens) -> float:
        """Independent tokens equivalent to a step's chunks (``q_lens``: tokens per scheduled request)."""
        q = np.asarray(q_lens, dtype=np.float64)
        if (self.chunk_exponent == 1.0 and self.chunk_scale >= 1.0) or not len(q) or q.max() <= 1:
            return float(q.sum())  # independent tokens, or decode tokens only
        return float(np.where(q > 1, np.minimum(q, self.chunk_scale * q ** self.chunk_exponent), q).sum())

    @property
    def shape(self) -> tuple[int, int]:
        return self.pi.shape

    def touch_probability(self, tokens: float) -> np.ndarray:
        """[L, E] P(expert touched by ``tokens`` independent tokens; fractional: effective tokens)."""
        tokens = round(float(tokens), 2)
        p = self._touch.get(tokens)
        if p is None:
            if len(self._touch) > 4096:
                self._touch.clear()
            p = self._touch[tokens] = -np.expm1(self._log_miss * tokens)
        return p

    def expected_touched(self, tokens: float, mask: np.ndarray | None = None) -> np.ndarray:
        """[L] expected number of touched experts (within ``mask`` [L, E] if given)."""
        p = self.touch_probability(tokens)
        return (p if mask is None else p * mask).sum(axis=1)

    def sample_touched(self, tokens: float) -> np.ndarray:
        """[L, E] bool: the experts this step's ``tokens`` (effective) tokens route to (a fresh draw per call)."""
        if tokens <= 0:
            return np.zeros(self.pi.shape, dtype=bool)
        return self.rng.random(self.pi.shape) < self.touch_probability(tokens)

    def share(self, mask: np.ndarray) -> np.ndarray:
        """[L] fraction of all token->expert assignments that go to the experts in ``mask`` [L, E]."""
        return (self.pi * mask).sum(axis=1) / self.top_k


def tiled_hotset(measured: Hotset, num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> Hotset:
    """A full model's routing profile from a measured one of fewer layers or experts.

    Each layer takes the sorted probability curve of one measured layer (cycled), resampled by rank
    quantile to ``num_experts`` and rescaled to ``top_k`` picks per token, and assigns it to the experts
    in a seeded random order (so the hot experts differ between layers, as in a real model)."""
    rng = np.random.default_rng(seed)
    curves = -np.sort(-measured.probability, axis=1)
    src = np.linspace(0, 1, curves.shape[1])
    dst = np.linspace(0, 1, num_experts)
    prob = np.empty((num_layers, num_experts))
    for layer in range(num_layers):
        curve = np.interp(dst, src, curves[layer % len(curves)])
        curve = curve / curve.sum() * top_k
        prob[layer, rng.permutation(num_experts)] = curve
    return Hotset(prob, measured.num_tokens, f"tiled from {measured.model or 'a measured profile'}")
