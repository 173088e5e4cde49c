"""Per-request SSM and conv state pages of hybrid models, and the cache manager that pairs them with KV.

A request of a hybrid model (Qwen3.5: Gated DeltaNet + attention) holds, for each GDN layer, one
SSM page (its ``[HV, K, V]`` recurrent state, an L2 page beside expert pages) and one conv run
(``W - 1`` consecutive conv rows inside an L3 parent, beside KV pages); its attention layers hold
KV pages as any model's do. States are allocated when the request is admitted (its first KV
allocation), and freed with its KV on finish, abort and preemption.

:class:`HybridCacheManager` is what the scheduler talks to for such models: the KVCacheManager's
interface, with states folded in. ``can_allocate`` is exact for KV and states together (both come
out of free huge pages when the carved pages run out); ``pages_needed`` — what the scheduler sums
into the adjuster's R_b — counts a request's states, converted to KV-page equivalents, until it holds them,
so the adjuster releases expert pages for states as it does for KV.
"""

from __future__ import annotations

import numpy as np

from rimuru.engine.kv_manager import KVCacheManager
from rimuru.memory import CONV, EXPERT, KV, SSM, MultiLevelAllocator, PoolLayout
from rimuru.models.spec import ModelSpec


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def state_bytes(layers: int, layout: PoolLayout) -> int:
    """Bytes one request's states take: an SSM page and a conv run per GDN layer, conv runs packed into pages of
    their parent class (SSM pages, or expert pages where conv rows do not divide an SSM page)."""
    conv = layout[CONV]
    parent_bytes = layout[conv.parent].page_bytes
    conv_per_parent = (parent_bytes // conv.page_bytes) // conv.run
    return layers * layout[SSM].page_bytes + _ceil(layers, conv_per_parent) * parent_bytes


def state_l2_pages(spec: ModelSpec, layout: PoolLayout) -> int:
    """Expert-sized (L2) pages one request's states take: an SSM page and a conv run per GDN layer."""
    layers = len(spec.linear_attention_layers)
    if not layers:
        return 0
    return _ceil(state_bytes(layers, layout), layout[EXPERT].page_bytes)


class StateManager:
    """SSM pages and conv runs per request, one of each per GDN layer. The only writer of its arrays."""

    def __init__(self, allocator: MultiLevelAllocator, num_layers: int) -> None:
        layout = allocator.layout
        if SSM not in layout or CONV not in layout:
            raise ValueError("a hybrid model needs SSM and conv page classes in the pool layout")
        self.allocator = allocator
        self.num_layers = num_layers
        ssm, conv = layout[SSM], layout[CONV]
        self.ssm_per_huge = layout.huge_page_bytes // ssm.page_bytes
        self.conv_parent = conv.parent  # SSM, or EXPERT where conv rows do not divide an SSM page
        self.conv_per_ssm = (layout[conv.parent].page_bytes // conv.page_bytes) // conv.run  # runs per parent page
        self.conv_rows = conv.run
        self._ssm: dict[str, np.ndarray] = {}  # request id -> [num_layers] SSM page ids
        self._conv: dict[str, np.ndarray] = {}  # request id -> [num_layers] first conv row ids

    def holds(self, request_id: str) -> bool:
        return request_id in self._ssm

    def conv_parents_needed(self, free_conv: int) -> int:
        """Parent pages (of class ``conv_parent``) one more request's conv runs split, given carved free runs."""
        return _ceil(max(0, self.num_layers - free_conv), self.conv_per_ssm)

    def huge_pages_needed(self, free_ssm: int, free_conv: int) -> int:
        """Huge pages one more request's SSM pages take, with its conv runs' parents when those are SSM pages
        (expert-page parents are counted with the KV's: ``conv_parents_needed``)."""
        ssm = self.num_layers + (self.conv_parents_needed(free_conv) if self.conv_parent == SSM else 0)
        return _ceil(max(0, ssm - free_ssm), self.ssm_per_huge)

    @property
    def bytes_per_request(self) -> int:
        return state_bytes(self.num_layers, self.allocator.layout)

    def allocate(self, request_id: str) -> None:
        if self.holds(request_id):
            raise ValueError(f"request {request_id!r} already holds states")
        ssm = self.allocator.allocate(SSM, self.num_layers)
        try:
            conv = self.allocator.allocate(CONV, self.num_layers)
        except Exception:
            self.allocator.free(SSM, ssm)
            raise
        self._ssm[request_id], self._conv[request_id] = ssm, conv

    def free(self, request_id: str) -> None:
        ssm = self._ssm.pop(request_id, None)
        conv = self._conv.pop(request_id, None)
        if ssm is not None:
            self.allocator.free(SSM, ssm)
            self.allocator.free(CONV, conv)

    def ssm_pages(self, request_id: str) -> np.ndarray:
        return self._ssm[request_id]

    def conv_pages(self, request_id: str) -> np.ndarray:
        return self._conv[request_id]

    @property
    def requests(self) -> frozenset[str]:
        return frozenset(self._ssm)

    @property
    def num_ssm_pages(self) -> int:
        return len(self._ssm) * self.num_layers

    @property
    def num_conv_runs(self) -> int:
        return len(self._conv) * self.num_layers


class HybridCacheManager:
    """KV pages (full-attention layers) plus SSM and conv states (GDN layers), behind KVCacheManager's interface."""

    def __init__(self, allocator: MultiLevelAllocator, num_kv_layers: int, block_tokens: int,
                 num_gdn_layers: int) -> None:
        self.allocator = allocator
        self.kv = KVCacheManager(allocator, num_kv_layers, block_tokens)
        self.states = StateManager(allocator, num_gdn_layers)
        layout = allocator.layout
        self.kv_per_expert = layout[EXPERT].page_bytes // layout[KV].page_bytes
        self.expert_per_huge = layout.huge_page_bytes // layout[EXPERT].page_bytes
        # one request's states in KV-page equivalents (the scheduler's unit for R_b)
        self.state_kv_pages = _ceil(self.states.bytes_per_request, layout[EXPERT].page_bytes) * self.kv_per_expert

    # ---- the KVCacheManager interface the scheduler and executor use
    @property
    def num_layers(self) -> int:
        return self.kv.num_layers

    @property
    def block_tokens(self) -> int:
        return self.kv.block_tokens

    @property
    def pages_per_l2(self) -> int:
        return self.kv.pages_per_l2

    def num_blocks(self, request_id: str) -> int:
        return self.kv.num_blocks(request_id)

    def pages(self, request_id: str) -> np.ndarray:
        return self.kv.pages(request_id)

    def free_pages(self) -> int:
        return self.kv.free_pages()

    def l2_pages_for(self, kv_pages: int) -> int:
        return self.kv.l2_pages_for(kv_pages)

    @property
    def num_allocated_pages(self) -> int:
        return self.kv.num_allocated_pages

    def pages_needed(self, request_id: str, total_tokens: int) -> int:
        """KV pages to allocate, plus the request's states as KV-page equivalents until it holds them."""
        states = 0 if self.states.holds(request_id) else self.state_kv_pages
        return self.kv.pages_needed(request_id, total_tokens) + states

    def can_allocate(self, request_id: str, total_tokens: int) -> bool:
        kv_need = self.kv.pages_needed(request_id, total_tokens)
        if self.states.holds(request_id):
            return self.allocator.can_allocate(KV, kv_need)
        st = self.allocator.stats()
        experts = _ceil(max(0, kv_need - st[KV]["carved_free"]), self.kv_per_expert)
        if self.states.conv_parent == EXPERT:  # conv rows split expert pages, as KV pages do
            experts += self.states.conv_parents_needed(st[CONV]["carved_free"])
        huge = _ceil(max(0, experts - st[EXPERT]["carved_free"]), self.expert_per_huge)
        huge += self.states.huge_pages_needed(st[SSM]["carved_free"], st[CONV]["carved_free"])
        return huge <= st["huge"]["free"]

    def allocate(self, request_id: str, total_tokens: int) -> None:
        fresh = not self.states.holds(request_id)
        if fresh:
            self.states.allocate(request_id)
        try:
            self.kv.allocate(request_id, total_tokens)
        except Exception:
            if fresh:
                self.states.free(request_id)
            raise

    def allocate_many(self, requests: list[tuple[str, int]]) -> None:
        """The scheduler's batched growth (KVCacheManager.allocate_many): states for requests that hold none
        yet, then every request's KV in one call; on failure the states taken here are given back."""
        fresh = [rid for rid, _ in requests if not self.states.holds(rid)]
        taken = []
        try:
            for rid in fresh:
                self.states.allocate(rid)
                taken.append(rid)
            self.kv.allocate_many(requests)
        except Exception:
            for rid in taken:
                self.states.free(rid)
            raise

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)
        self.states.free(request_id)

    def check(self, live: set[str] | frozenset[str]) -> None:
        """States are held by exactly the live (running) requests."""
        held = self.states.requests
        assert held <= set(live), f"states held by requests that are not running: {sorted(held - set(live))[:8]}"
        assert self.allocator.num_allocated(SSM) == self.states.num_ssm_pages, "SSM pages leaked or lost"
        assert self.allocator.num_allocated(CONV) == self.states.num_conv_runs, "conv runs leaked or lost"
