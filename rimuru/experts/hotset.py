"""Hotset profile: per MoE layer, experts ordered by empirical routing probability.

The cache policy is prefix-based over one global order that interleaves layers by probability
(docs/architecture.md §3). Profiles are JSON so they can be inspected and committed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Hotset:
    probability: np.ndarray  # [moe_layers, experts]: P(expert selected for a token)
    num_tokens: int = 0
    model: str = ""
    # the same for the profile's decode tokens only (requests computing one token in a step), where the profiler
    # recorded them apart (LLM.routing_hotset, since wave 14); None: not recorded (older profiles, tiled ones)
    decode_probability: np.ndarray | None = None
    decode_tokens: int = 0

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int) -> Hotset:
        return cls(np.full((num_layers, num_experts), 1.0 / num_experts))

    @classmethod
    def from_counts(cls, counts: np.ndarray, num_tokens: int, model: str = "", decode_counts: np.ndarray | None = None,
                    decode_tokens: int = 0) -> Hotset:
        """From router selections [layers, experts] over ``num_tokens`` tokens; ``decode_counts`` over
        ``decode_tokens``: the decode tokens' share of them (kept where there was at least one)."""
        decode = None if decode_counts is None or decode_tokens < 1 else decode_counts / decode_tokens
        return cls(counts / max(1, num_tokens), num_tokens, model, decode, decode_tokens if decode is not None else 0)

    def global_order(self) -> np.ndarray:
        """[layers*experts, 2] (layer, expert), most probable first; ties interleave layers by rank."""
        layers, experts = self.probability.shape
        rank = np.argsort(np.argsort(-self.probability, axis=1, kind="stable"), axis=1, kind="stable")
        layer_idx, expert_idx = np.meshgrid(np.arange(layers), np.arange(experts), indexing="ij")
        keys = np.lexsort((layer_idx.ravel(), rank.ravel(), -self.probability.ravel()))
        return np.stack([layer_idx.ravel()[keys], expert_idx.ravel()[keys]], axis=1)

    def global_rank(self) -> np.ndarray:
        """[layers, experts]: each pair's place in :meth:`global_order` (0: cached first)."""
        return order_rank(self.global_order(), *self.probability.shape)

    def top_share(self, k: int) -> float:
        """Mean over layers of the routing share taken by each layer's k most used experts."""
        p = np.sort(self.probability, axis=1)[:, ::-1]
        return float((p[:, :k].sum(axis=1) / p.sum(axis=1)).mean())

    def save(self, path: str | Path) -> None:
        order = np.argsort(-self.probability, axis=1, kind="stable")
        layers = [{"order": o.tolist(), "probability": self.probability[i, o].round(6).tolist()}
                  for i, o in enumerate(order)]
        data = {"model": self.model, "num_tokens": self.num_tokens, "layers": layers}
        if self.decode_probability is not None:  # in each layer's order
            for i, o in enumerate(order):
                layers[i]["decode_probability"] = self.decode_probability[i, o].round(6).tolist()
            data["decode_tokens"] = self.decode_tokens
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> Hotset:
        data = json.loads(Path(path).read_text())
        layers = data["layers"]
        prob = np.zeros((len(layers), len(layers[0]["order"])))
        split = "decode_probability" in layers[0]
        decode = np.zeros_like(prob) if split else None
        for i, layer in enumerate(layers):
            prob[i, layer["order"]] = layer["probability"]
            if split:
                decode[i, layer["order"]] = layer["decode_probability"]
        return cls(prob, data.get("num_tokens", 0), data.get("model", ""), decode,
                   int(data.get("decode_tokens", 0)) if split else 0)


def order_rank(order: np.ndarray, layers: int, experts: int) -> np.ndarray:
    """[layers, experts]: each (layer, expert) pair's place in ``order`` ([layers*experts, 2], a cache's fill order
    such as :meth:`Hotset.global_order`): a cache holding its first ``n`` pairs holds exactly those with rank < n."""
    rank = np.empty(layers * experts, dtype=np.int64)
    rank[order[:, 0] * experts + order[:, 1]] = np.arange(layers * experts)
    return rank.reshape(layers, experts)
