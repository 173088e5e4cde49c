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

from collections.abc import Callable
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
    host_pages: torch.Tensor | None  # [J, f, d] pinned host pages that negative table ids point at (zero-copy)

    def layer_table(self, moe_layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Page table [E, PAGES_PER_EXPERT] for this layer's routed tokens (may start the next layer's prefetch)."""

    def split(self, moe_layer: int, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weights for the device kernel, host-computed output [T, d] or None). Called only when
        ``computes_on_host``."""

    def layer_done(self, moe_layer: int) -> None: ...

    def expect_next_step(self, in_place: bool) -> None:
        """Before an eager forward: whether the step after it is expected to read its misses in place (a decode
        graph, ``rimuru.engine.cuda_graphs.next_step_replays``), which no loading-buffer copy serves."""


def _device_only_split(topk_weights: torch.Tensor) -> tuple[torch.Tensor, None]:
    return topk_weights, None


def touched_mask(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] bool: experts at least one token routes to. No host sync (unlike ``bincount`` on CUDA), so it
    can run inside a captured graph. An id ``E`` (expert parallelism's null expert: another rank's) is not counted."""
    mask = torch.zeros(num_experts + 1, dtype=torch.bool, device=topk_ids.device)
    return mask.index_fill_(0, topk_ids.reshape(-1).long(), True)[:num_experts]


def prefetch_next_step(touched: int, num_experts: int, next_in_place: bool = False) -> bool:
    """Whether a step's first MoE layer routing predicts the next step's: when it touched at least 3/4 of the
    layer's experts (a large decode batch), the next step's tokens, one per request, touch nearly the same set, so
    its misses are copied at the end of this step, while the host finishes this step and schedules the next
    (the PCIe link is otherwise idle there). Below that, a wrong guess would delay the next step's own loads.

    Never when the next step is expected to replay a decode graph (``next_in_place``): a graph reads its misses
    in place over PCIe and never the loading buffer, so the copy (a large prefill's first layer: 50-60 experts,
    ~10 ms on the H200) would only compete with the graph's own reads for the link; those steps were the flagged
    steps after a prefill in the Poisson runs at d9f9d41 (docs/e2e.md)."""
    return not next_in_place and 4 * touched >= 3 * num_experts


class PagedExperts:
    computes_on_host = False
    host_pages = None  # misses are loaded into buffer pages, never read in place

    def __init__(self, cache: ExpertCache, loader: ExpertLoader, gate_weights: list[torch.Tensor], top_k: int,
                 norm_topk_prob: bool, prefetch: bool, prefetch_before_graphs: bool = False) -> None:
        self.cache = cache
        self.loader = loader
        self.gates = gate_weights
        self.top_k = top_k
        self.norm = norm_topk_prob
        self.prefetch = prefetch
        self.num_experts = cache.num_experts
        self.experts_touched = 0  # (layer, expert) pairs computed, summed over steps: HBM bytes for the floor
        self._first_touched: np.ndarray | None = None  # this step's first-layer experts: the next step's guess
        self._next_in_place = False  # the step after this one replays a decode graph (expect_next_step)
        self._before_graphs = prefetch_before_graphs  # prefetch even then (the engine before; EngineConfig)

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
        if moe_layer == 0:
            self._first_touched = touched
        table = self.loader.layer_table(moe_layer, touched, self.cache.page_table[moe_layer])
        if predict:
            self.loader.prefetch(nxt, np.flatnonzero(used[1]), self.cache.page_table[nxt])
        return table

    def split(self, moe_layer, hidden, topk_weights, topk_ids):
        return _device_only_split(topk_weights)

    def layer_done(self, moe_layer: int) -> None:
        self.loader.layer_done(moe_layer)
        first = self._first_touched
        if (moe_layer == len(self.gates) - 1 and self.prefetch and first is not None
                and prefetch_next_step(len(first), self.num_experts, self._next_in_place)):
            # the last layer's compute is queued (its buffer's event recorded): the next step's first layer
            # gets this step's misses of that layer in its buffer, behind this step's loads on the copy stream
            self.loader.prefetch_next_step(first, self.cache.page_table[0])
            self._first_touched = None

    def expect_next_step(self, in_place: bool) -> None:
        self._next_in_place = in_place and not self._before_graphs


class ResidentExperts:
    """Every expert resident (static policy): one device page table, no loading."""

    computes_on_host = False
    host_pages = None

    def __init__(self, page_table: np.ndarray, device: torch.device, num_experts: int) -> None:
        self.tables = torch.from_numpy(page_table).to(device)
        self.num_experts = num_experts
        self._touched = torch.zeros((), dtype=torch.int64, device=device)  # counted on device: no sync per layer
        self._touched_read = 0
        self._counted = False  # an eager layer added to the device count since it was last read

    @property
    def experts_touched(self) -> int:
        """Read from the device only when an eager step counted since the last read: reading is a device sync,
        which, with async scheduling, would wait for the decode step just launched (graphed steps count in
        DeviceTableExperts, never here)."""
        if self._counted:
            self._touched_read = int(self._touched)
            self._counted = False
        return self._touched_read

    def layer_table(self, moe_layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        self._touched += touched_mask(topk_ids, self.num_experts).sum()
        self._counted = True
        return self.tables[moe_layer]

    def split(self, moe_layer, hidden, topk_weights, topk_ids):
        return _device_only_split(topk_weights)

    def layer_done(self, moe_layer: int) -> None:
        pass

    def expect_next_step(self, in_place: bool) -> None:
        pass


class CpuComputedExperts:
    """Cached experts run on the device; the rest run on the CPU from the host copies
    (KTransformers; llama.cpp ``--n-cpu-moe``). Nothing is loaded over PCIe but activations."""

    computes_on_host = True
    host_pages = None

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

    def expect_next_step(self, in_place: bool) -> None:
        pass


def host_pages(host_weights: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """The host store ``[L, E, 3, f, d]`` as pages ``[J, f, d]`` over its own memory (no copy, also for a
    store whose layers share storage, as a benchmark's expanded one does) and each (layer, expert, proj)'s
    page index ``[L, E, 3]``."""
    layers, experts, _, f, d = host_weights.shape
    page = f * d
    s0, s1, s2, s3, s4 = host_weights.stride()
    if s3 != d or s4 != 1 or any(s % page for s in (s0, s1, s2)):
        raise ValueError("host expert pages must be contiguous [f, d] blocks")
    index = (np.arange(layers)[:, None, None] * (s0 // page) + np.arange(experts)[None, :, None] * (s1 // page)
             + np.arange(3)[None, None, :] * (s2 // page))
    pages = torch.as_strided(host_weights, (int(index.max()) + 1, f, d), (page, d, 1), host_weights.storage_offset())
    return pages, index


class DeviceTableExperts:
    """The decode CUDA graphs' provider: page tables live on the device, a miss reads host memory in place.

    ``tables`` [L, E, 3] int32 holds the cache's pages; an expert that is not resident gets
    ``-(1 + j)``, page ``j`` of the pinned host store ``host_pages`` [L*E*3, f, d], which the fused MoE
    kernel reads over PCIe (zero-copy). So a decode step needs no host decision per layer and runs as
    one graph replay whatever the cache holds. :meth:`refresh` (outside the graph, before a replay)
    re-uploads the tables from the cache's host page table when it changed. Experts touched and
    missed are counted on the device and read after the step (:meth:`settle`).
    """

    computes_on_host = False

    def __init__(self, page_table: Callable[[], np.ndarray], version: Callable[[], int],
                 host_weights: torch.Tensor | None, device: torch.device) -> None:
        self._page_table, self._version = page_table, version
        table = page_table()
        layers, experts = table.shape[:2]
        self.num_experts = experts
        self.host_pages, self._host_index = None, None
        if host_weights is not None:
            self.host_pages, index = host_pages(host_weights)
            self._host_index = (-1 - index).astype(np.int32)
        pin = device.type == "cuda"
        self._staging = torch.empty(layers, experts, 3, dtype=torch.int32, pin_memory=pin)
        self.tables = torch.empty(layers, experts, 3, dtype=torch.int32, device=device)
        self._counts = torch.zeros(2, dtype=torch.int64, device=device)  # touched, missed (this step)
        self._counts_host = torch.zeros(2, dtype=torch.int64, pin_memory=pin)
        self._seen_version: int | None = None
        self._staged: torch.cuda.Event | None = None  # the last table upload out of ``_staging``
        self._step_ids: list[tuple[int, torch.Tensor]] = []
        self.experts_touched = 0
        self.experts_missed = 0  # read in place over PCIe
        self.refresh()

    def refresh(self) -> bool:
        """Upload the page table if the cache changed since the last upload; True when it did."""
        if self._version() == self._seen_version:
            return False
        table = self._page_table()
        if self.host_pages is None and (table[..., 0] < 0).any():
            raise RuntimeError("an expert is not resident and there is no host store to read it from")
        merged = table if self._host_index is None else np.where(table >= 0, table, self._host_index)
        if self._staged is not None:  # async scheduling: the last upload may still be queued behind a step
            self._staged.synchronize()
        self._staging.copy_(torch.from_numpy(merged))
        self.tables.copy_(self._staging, non_blocking=True)
        if self._staging.is_pinned():
            self._staged = torch.cuda.Event()
            self._staged.record()
        self._seen_version = self._version()
        return True

    def begin_step(self) -> None:
        self._step_ids: list[tuple[int, torch.Tensor]] = []

    def layer_table(self, moe_layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        self._step_ids.append((moe_layer, topk_ids))  # counted once per step in finish_step(), not per layer
        return self.tables[moe_layer]

    def finish_step(self) -> None:
        """Count the step's touched and missed (layer, expert) pairs in a few launches (inside the graph)."""
        if not self._step_ids:
            self._counts.zero_()
            return
        layers = [m for m, _ in self._step_ids]
        ids = torch.stack([t.reshape(-1) for _, t in self._step_ids]).long()  # [M, T*k]: one copy, one cast
        used = torch.zeros(len(layers), self.num_experts + 1, dtype=torch.bool, device=ids.device)
        used = used.scatter_(1, ids, True)[:, :self.num_experts]  # id E: expert parallelism's null expert
        first, last = layers[0], layers[-1]
        rows = self.tables[first: last + 1] if layers == list(range(first, last + 1)) else self.tables[layers]
        absent = rows[:, :, 0] < 0
        torch.stack([used.sum(), (used & absent).sum()], out=self._counts)
        self._step_ids = []

    def split(self, moe_layer, hidden, topk_weights, topk_ids):
        return _device_only_split(topk_weights)

    def layer_done(self, moe_layer: int) -> None:
        pass

    def expect_next_step(self, in_place: bool) -> None:
        pass

    def new_counts_buffer(self) -> torch.Tensor:
        """A host buffer for one step's counters (async scheduling keeps one per step in flight)."""
        host = self._counts_host
        return torch.zeros(host.shape, dtype=host.dtype, pin_memory=host.is_pinned())

    def end_step(self, into: torch.Tensor | None = None) -> None:
        """Queue the counters' copy to the host (``into``, default this provider's buffer; read by
        :meth:`settle` once the step has synchronised)."""
        (self._counts_host if into is None else into).copy_(self._counts, non_blocking=True)

    def settle(self, counts: torch.Tensor | None = None) -> tuple[int, int]:
        """After the step's sync: (experts touched, experts read in place) this step, added to the totals
        (``counts``: the buffer given to :meth:`end_step`)."""
        touched, missed = (int(v) for v in (self._counts_host if counts is None else counts).tolist())
        self.experts_touched += touched
        self.experts_missed += missed
        return touched, missed
