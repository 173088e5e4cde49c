"""Per-layer expert access for the model: the ``ExpertProvider`` protocol and one provider per policy.

The model only knows routed ids; for each MoE layer it asks its provider for the layer's page
table ``[E, PAGES_PER_EXPERT]`` (cache pages or loading-buffer pages: the kernel cannot tell them
apart). ``PagedExperts`` (fixed, elastic) loads misses into the two loading buffers; with
``prefetch`` on, after routing layer ``m`` it applies layer ``m+1``'s router to the same hidden
state (the Fate-style predictor) and starts loading the predicted misses into the other buffer.
``ResidentExperts`` (static) has every expert cached. ``CpuComputedExperts`` (cpu) computes misses
on the host: the one provider whose ``computes_on_host`` capability is set.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from rimuru.experts.cache import ExpertCache
from rimuru.experts.loader import ExpertLoader
from rimuru.experts.moe_cpu import moe_cpu
from rimuru.experts.router import experts_touched, route
from rimuru.memory import PAGES_PER_EXPERT


class ExpertProvider(Protocol):
    num_experts: int
    experts_touched: int  # (layer, expert) pairs computed, summed over steps
    computes_on_host: bool  # True: the model must call ``split`` and add the host-computed part

    def layer_table(self, moe_layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Page table [E, PAGES_PER_EXPERT] for this layer's routed tokens (may start the next layer's prefetch)."""

    def split(self, moe_layer: int, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weights for the device kernel, host-computed output [T, d] or None). Called only when
        ``computes_on_host``."""

    def layer_done(self, moe_layer: int) -> None: ...


def _device_only_split(topk_weights: torch.Tensor) -> tuple[torch.Tensor, None]:
    return topk_weights, None


class PagedExperts:
    computes_on_host = False

    def __init__(self, cache: ExpertCache, loader: ExpertLoader, gate_weights: list[torch.Tensor], top_k: int,
                 norm_topk_prob: bool, prefetch: bool) -> None:
        self.cache = cache
        self.loader = loader
        self.gates = gate_weights
        self.top_k = top_k
        self.norm = norm_topk_prob
        self.prefetch = prefetch
        self.num_experts = cache.num_experts
        self.experts_touched = 0  # (layer, expert) pairs computed, summed over steps: HBM bytes for the floor

    def layer_table(self, moe_layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        nxt = moe_layer + 1
        predict = self.prefetch and nxt < len(self.gates) and not self.cache.page_table[nxt, :, 0].min() >= 0
        used = torch.bincount(topk_ids.reshape(-1).long(), minlength=self.num_experts) > 0  # [E]
        if predict:  # the next layer's router on this hidden state: Fate's predictor
            _, ids = route(hidden, self.gates[nxt], self.top_k, self.norm)
            used = torch.stack([used, torch.bincount(ids.reshape(-1).long(), minlength=self.num_experts) > 0])
        used = used.cpu().numpy()  # one device sync per layer: the host must know the misses
        touched = np.flatnonzero(used[0] if predict else used)
        self.experts_touched += len(touched)
        table = self.loader.layer_table(moe_layer, touched, self.cache.page_table[moe_layer])
        if predict:
            self.loader.prefetch(nxt, np.flatnonzero(used[1]), self.cache.page_table[nxt])
        return table

    def split(self, moe_layer, hidden, topk_weights, topk_ids):
        return _device_only_split(topk_weights)

    def layer_done(self, moe_layer: int) -> None:
        self.loader.layer_done(moe_layer)


class ResidentExperts:
    """Every expert resident (static policy): one device page table, no loading."""

    computes_on_host = False

    def __init__(self, page_table: np.ndarray, device: torch.device, num_experts: int) -> None:
        self.tables = torch.from_numpy(page_table).to(device)
        self.num_experts = num_experts
        self._touched = torch.zeros((), dtype=torch.int64, device=device)  # counted on device: no sync per layer

    @property
    def experts_touched(self) -> int:
        return int(self._touched)

    def layer_table(self, moe_layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        self._touched += (torch.bincount(topk_ids.reshape(-1).long(), minlength=self.num_experts) > 0).sum()
        return self.tables[moe_layer]

    def split(self, moe_layer, hidden, topk_weights, topk_ids):
        return _device_only_split(topk_weights)

    def layer_done(self, moe_layer: int) -> None:
        pass


class CpuComputedExperts:
    """Cached experts run on the device; the rest run on the CPU from the host copies
    (KTransformers; llama.cpp ``--n-cpu-moe``). Nothing is loaded over PCIe but activations."""

    computes_on_host = True

    def __init__(self, cache: ExpertCache, host_weights: torch.Tensor, device: torch.device) -> None:
        self.cache = cache
        self.host = host_weights  # [L, E, 3, f, d]
        self.device = device
        self.num_experts = cache.num_experts
        self.experts_touched = 0
        self.experts_on_cpu = 0

    def layer_table(self, moe_layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        row = self.cache.page_table[moe_layer].copy()
        resident = np.flatnonzero(row[:, 0] >= 0)
        if len(resident):
            row[row[:, 0] < 0] = row[resident[0]]  # misses get zero weight (see split); any finite page works
        else:
            row[:] = 0
        self.experts_touched += int(experts_touched(topk_ids, self.num_experts).numel())
        return torch.from_numpy(row).to(self.device)

    def split(self, moe_layer: int, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zero the device-side weight of non-resident picks and compute them on the CPU."""
        resident = torch.from_numpy(self.cache.page_table[moe_layer, :, 0] >= 0).to(topk_ids.device)
        on_device = resident[topk_ids.long()]  # [T, k]
        if bool(on_device.all()):
            return topk_weights, None
        num_experts, f, d = self.host.shape[1], self.host.shape[3], self.host.shape[4]
        slots = PAGES_PER_EXPERT
        view = self.host[moe_layer].reshape(num_experts * slots, f, d)  # identity page table over the host copy
        table = torch.arange(num_experts * slots, dtype=torch.int32).reshape(num_experts, slots)
        miss = ~on_device.cpu()
        out = moe_cpu(hidden.float().cpu(), topk_weights.cpu(), topk_ids.cpu(), view, table, keep=miss)  # [T, d]
        self.experts_on_cpu += int(torch.unique(topk_ids.cpu()[miss]).numel())
        device_weights = torch.where(on_device, topk_weights, torch.zeros_like(topk_weights))
        return device_weights, out.to(hidden.device, hidden.dtype)

    def layer_done(self, moe_layer: int) -> None:
        pass
