"""Per-layer expert access for the model: page tables over cache + loading buffers.

Bridges the model (which only knows routed ids) and the cache/loader. With ``prefetch`` on,
after routing layer ``m`` it applies layer ``m+1``'s router to the same hidden state (the
Fate-style predictor) and starts loading the predicted misses into the other buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from rimuru.experts.cache import ExpertCache
from rimuru.experts.loader import ExpertLoader
from rimuru.experts.router import experts_touched, route


class PagedExperts:
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

    def layer_done(self, moe_layer: int) -> None:
        self.loader.layer_done(moe_layer)


class ResidentExperts:
    """Every expert resident (static policy): one device page table, no loading."""

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

    def layer_done(self, moe_layer: int) -> None:
        pass


class CpuComputedExperts:
    """Cached experts run on the device; the rest run on the CPU from the host copies
    (KTransformers; llama.cpp ``--n-cpu-moe``). Nothing is loaded over PCIe but activations."""

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
        x = hidden.float().cpu()  # [T, d]
        ids, weights = topk_ids.cpu(), topk_weights.float().cpu()
        miss = ~on_device.cpu()
        out = torch.zeros_like(x)  # [T, d]
        for e in torch.unique(ids[miss]).tolist():
            tok, slot = torch.where((ids == e) & miss)
            w1, w3, w2t = (self.host[moe_layer, e, p].float() for p in range(3))  # [f, d] each
            h = torch.nn.functional.silu(x[tok] @ w1.T) * (x[tok] @ w3.T)  # [n, f]
            out.index_add_(0, tok, (h @ w2t) * weights[tok, slot, None])
            self.experts_on_cpu += 1
        device_weights = torch.where(on_device, topk_weights, torch.zeros_like(topk_weights))
        return device_weights, out.to(hidden.device, hidden.dtype)

    def layer_done(self, moe_layer: int) -> None:
        pass
