"""Memory policies: where a policy decides how the budget is split and how the expert cache moves.

One ``MemoryPolicy`` subclass per policy (static, fixed, elastic, cpu). Each one

* computes a ``MemoryPlan`` from the model, the engine options and the budget (``plan``: a pure
  function of its inputs; nothing is allocated),
* builds its expert side over the pool (``build``: loading buffers, the expert cache filled to the
  plan's initial size, the ``ExpertProvider`` the model asks for page tables), and
* exposes the hooks ``LLM.step`` calls in a fixed order (see docs/architecture.md, "A step"):
  ``begin_step`` (publish finished expert loads) -> ``releasable_l2_pages`` (asked by the scheduler
  while it schedules) -> ``after_schedule`` (resize the cache from R_b and F_b) -> the forward pass ->
  ``after_forward`` (free the pages of experts shrunk this step, now that no kernel reads them).

The policy object is the only caller of ``ExpertCache.expand``/``shrink``/``reclaim``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from rimuru.engine.state_manager import state_l2_pages
from rimuru.experts.adjuster import AdjusterConfig, compaction_due, decide
from rimuru.experts.cache import ExpertCache
from rimuru.experts.hotset import Hotset
from rimuru.experts.loader import ExpertLoader, buffer_need, shrink_release
from rimuru.experts.provider import CpuComputedExperts, ExpertProvider, PagedExperts, ResidentExperts
from rimuru.memory import EXPERT, KV, PAGES_PER_EXPERT, PagePool, PoolLayout
from rimuru.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from rimuru.engine.config import EngineConfig
    from rimuru.engine.scheduler import SchedulerOutput
    from rimuru.models.loader import LoadedCheckpoint
    from rimuru.models.spec import ModelSpec


class MemoryBudgetError(ValueError):
    """The budget cannot hold what the chosen policy needs."""


@dataclass(frozen=True)
class MemoryPlan:
    """How one engine splits its device budget. Bytes unless named otherwise; pages are expert (L2) pages."""

    policy: str
    budget: int  # everything the engine puts on the device
    dense: int  # always-resident weights (attention, norms, routers, shared experts, embeddings)
    activations: int  # working memory outside the pool
    pool: int  # the page pool's bytes: budget - dense - activations, rounded down to whole huge pages
    pool_l2_pages: int  # expert-sized pages the pool holds
    buffer_experts: int  # experts per loading buffer (two buffers); 0 when nothing is loaded per layer
    total_experts: int  # routed experts of the model (MoE layers x experts)
    initial_cache_experts: int  # cached before the first request
    min_cache_experts: int  # the smallest the cache can ever get: KV capacity is sized against it
    kv_capacity_tokens: int  # tokens of KV (all layers) that fit beside the minimum cache
    max_model_len: int  # the engine's context limit: model limit, KV capacity, the user's cap
    step_kv_l2_pages: int = 0  # L2 pages of KV one step's full token budget writes (all attention layers)

    @property
    def buffer_pages(self) -> int:
        return 2 * PAGES_PER_EXPERT * self.buffer_experts

    @property
    def free_l2_pages(self) -> int:
        """Expert pages free once the loading buffers are taken: shared by the cache and KV."""
        return self.pool_l2_pages - self.buffer_pages

    def report(self) -> dict[str, int]:
        """The engine's ``memory_report``: what run records and tables read."""
        return {"budget": self.budget, "dense": self.dense, "activations": self.activations,
                "pool": self.pool, "buffer_pages": self.buffer_pages,
                "initial_cache_experts": self.initial_cache_experts, "total_experts": self.total_experts,
                "max_model_len": self.max_model_len}

    def as_dict(self) -> dict:
        return asdict(self)


def activation_estimate(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Working memory outside the pool: per-token hidden/attention/MoE temporaries and sampled logits."""
    elem = torch.empty((), dtype=dtype).element_size()
    t = config.max_num_batched_tokens
    per_token = (24 * spec.hidden_size + 6 * spec.top_k * spec.moe_intermediate_size
                 + 4 * spec.num_heads * spec.head_dim) * elem
    logits = 2 * config.max_num_seqs * spec.vocab_size * 4
    slack = 512 * 2**20 if device.type == "cuda" else 0  # CUDA context, cuBLAS workspaces, Triton
    return t * per_token + logits + slack


class MemoryPolicy:
    """The base: a fixed expert cache beside KV, experts missing from it loaded per layer into two buffers."""

    name: ClassVar[str]
    stands_for: ClassVar[str]
    adjusts: ClassVar[bool] = False  # the workload-aware adjuster resizes the expert cache
    compacts_kv: ClassVar[bool] = False  # L2 pages that KV compaction frees grow the cache (kv_compaction_due)
    all_experts_resident: ClassVar[bool] = False
    loads_experts: ClassVar[bool] = True  # misses are copied into two per-layer loading buffers
    cache_cls: type[ExpertCache] = ExpertCache  # tensor parallelism's rank 0 sets one that logs its calls

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.cache: ExpertCache | None = None  # set by build()
        self.loader: ExpertLoader | None = None  # set by build()
        self.plan_: MemoryPlan | None = None
        # the loading buffers follow what the cache can miss (EngineConfig.loading_buffers; the plan reserves
        # one layer's experts per buffer, what an empty cache needs, so KV capacity never counts on the rest)
        self.sized_buffers = config.loading_buffers == "sized" and self.loads_experts

    # ------------------------------------------------------------------ plan (pure)
    @classmethod
    def buffer_experts(cls, spec: ModelSpec) -> int:
        """Experts per loading buffer: one MoE layer's experts, or none."""
        return spec.num_experts if cls.loads_experts else 0

    @classmethod
    def loading_buffer_bytes(cls, spec: ModelSpec, dtype: torch.dtype, tp: int = 1) -> int:
        """Bytes of the two loading buffers (what a scaled budget keeps at the model's own size)."""
        return 2 * cls.buffer_experts(spec) * spec.expert_bytes(dtype, tp)

    def initial_cache(self, total: int, free_l2: int) -> int:
        c = self.config
        if c.initial_cache_experts is not None:
            return min(total, c.initial_cache_experts)
        return min(total, int(free_l2 * (1 - c.kv_reserve)) // PAGES_PER_EXPERT)

    def min_cache(self, initial: int, total: int) -> int:
        """The smallest cache this engine can ever hold: what KV capacity (and max_model_len) is sized from."""
        return initial

    def _needs(self, total: int, buffer_experts: int) -> tuple[int, str]:
        """L2 pages the pool must hold at least (one KV block included), and what they are for."""
        what = "two loading buffers" if buffer_experts else "no expert pages"
        return 2 * PAGES_PER_EXPERT * buffer_experts + 1, what

    def plan(self, spec: ModelSpec, layout: PoolLayout, dense_bytes: int | None = None,
             device: torch.device | None = None) -> MemoryPlan:
        """Split the budget; raises ``MemoryBudgetError`` when the policy does not fit.

        ``dense_bytes``: the loaded dense weights' size (default: ``spec.dense_bytes`` in the engine dtype).
        """
        c = self.config
        device = device if device is not None else c.torch_device
        dtype = c.torch_dtype
        dense = spec.dense_bytes(dtype) if dense_bytes is None else dense_bytes
        act = (parse_bytes(c.activation_reserve) if c.activation_reserve is not None
               else activation_estimate(spec, c, dtype, device))
        pool = c.budget_bytes - dense - act
        total = spec.num_moe_layers * spec.num_experts
        buffer_experts = self.buffer_experts(spec)
        page = layout.page_bytes(EXPERT)
        needed_l2, what = self._needs(total, buffer_experts)
        if pool < needed_l2 * page:
            raise MemoryBudgetError(
                f"budget {format_bytes(c.budget_bytes)} is too small for policy {self.name!r}: dense weights "
                f"{format_bytes(dense)} + activations {format_bytes(act)} + {what} and one KV block "
                f"({format_bytes(needed_l2 * page)}) do not fit")
        huge = layout.huge_page_bytes
        pool_l2 = pool // huge * (huge // page)
        pool = pool // huge * huge
        free_l2 = pool_l2 - 2 * PAGES_PER_EXPERT * buffer_experts
        initial = self.initial_cache(total, free_l2)
        if PAGES_PER_EXPERT * initial >= free_l2:
            raise MemoryBudgetError(f"{initial} cached experts leave no page for KV in a pool of {free_l2} L2 pages")
        min_cache = self.min_cache(initial, total)
        kv_per_l2 = page // layout.page_bytes(KV)
        attn_layers = len(spec.full_attention_layers)  # hybrids: GDN layers hold states, not KV
        state_l2 = state_l2_pages(spec, layout)  # one request's SSM and conv states (0 without GDN layers)
        kv_tokens = (free_l2 - PAGES_PER_EXPERT * min_cache - state_l2) * kv_per_l2 // attn_layers * c.block_tokens
        limit = min(spec.max_position_embeddings, kv_tokens)
        max_len = min(limit, c.max_model_len) if c.max_model_len else limit
        if max_len < 2:
            raise MemoryBudgetError(f"KV capacity of {kv_tokens} tokens is below one request's minimum")
        step_kv_l2 = -(-(-(-c.max_num_batched_tokens // c.block_tokens) * attn_layers) // kv_per_l2)
        return MemoryPlan(self.name, c.budget_bytes, dense, act, pool, pool_l2, buffer_experts, total, initial,
                          min_cache, kv_tokens, max_len, step_kv_l2)

    # ------------------------------------------------------------------ build
    def build(self, plan: MemoryPlan, ckpt: LoadedCheckpoint | None, pool: PagePool, hotset: Hotset,
              device: torch.device, spec: ModelSpec | None = None,
              ) -> tuple[ExpertLoader, ExpertCache, ExpertProvider | None]:
        """Loading buffers, the cache filled to ``plan.initial_cache_experts``, and the provider.

        ``ckpt`` None (a modeled engine, ``spec`` given): the loader books loads without copying and there is
        no provider (the modeled executor stands in for the model and its provider)."""
        alloc = pool.allocator
        spec = spec if spec is not None else ckpt.spec  # expert parallelism: the rank's share of the experts
        virtual = (spec.num_moe_layers, spec.num_experts, PAGES_PER_EXPERT * pool.layout.page_bytes(EXPERT))
        loader = ExpertLoader(ckpt.experts.weights if ckpt is not None else None, pool.view(EXPERT).tensor, alloc,
                              plan.buffer_experts, virtual_shape=virtual)
        if alloc.free_l2_pages(EXPERT) != plan.free_l2_pages:
            raise RuntimeError(f"the pool has {alloc.free_l2_pages(EXPERT)} free expert pages, "
                               f"the plan {plan.free_l2_pages}")
        layers, experts = spec.num_moe_layers, spec.num_experts
        cache = self.cache_cls(alloc, hotset.global_order(), layers, experts, loader.copy_expert)
        cache.expand(plan.initial_cache_experts)
        cache.poll(wait=True)
        self.cache, self.loader, self.plan_ = cache, loader, plan
        if self.sized_buffers:
            self._fill_freed_buffer_pages()
        loader.bytes_loaded = loader.experts_loaded = 0  # count serving-time I/O only
        return loader, cache, self._provider(ckpt, cache, loader, device) if ckpt is not None else None

    def _provider(self, ckpt: LoadedCheckpoint, cache: ExpertCache, loader: ExpertLoader,
                  device: torch.device) -> ExpertProvider:
        spec = ckpt.spec
        gates = [ckpt.dense[f"model.layers.{layer}.mlp.gate.weight"] for layer in spec.moe_layers]
        return PagedExperts(cache, loader, gates, spec.top_k, spec.norm_topk_prob,
                            prefetch=self.config.prefetch == "predict",
                            prefetch_before_graphs=self.config.prefetch_before_graphs)

    # ------------------------------------------------------------------ sized loading buffers
    def buffer_need(self) -> tuple[int, int]:
        """Slots each loading buffer needs for the cache's page table now (``rimuru.experts.loader.buffer_need``)."""
        return buffer_need(self.cache.resident_per_layer(), self.cache.num_experts)

    def _fit_buffers(self) -> int:
        """Resize the loading buffers to what the cache can miss now; pages taken from the pool (< 0: returned)."""
        return self.loader.fit(self.buffer_need()) if self.sized_buffers else 0

    def _fill_freed_buffer_pages(self) -> None:
        """At start: the cache grows into the pages the loading buffers do not need (the KV share the plan made
        stays free); a larger cache needs smaller buffers, so this repeats until nothing more is freed. With
        ``initial_cache_experts`` given the cache keeps that size and the pages stay free."""
        freed = -self._fit_buffers()
        if self.config.initial_cache_experts is not None:
            return
        while freed >= PAGES_PER_EXPERT:
            started = self.cache.expand(freed // PAGES_PER_EXPERT)
            if not started:
                break
            self.cache.poll(wait=True)
            freed += -PAGES_PER_EXPERT * started - self._fit_buffers()

    def check(self) -> None:
        """The loading buffers' invariants: their pages are allocated, held by nothing else (cache pages), and,
        sized, cover what the cache can miss."""
        if self.loader is None:
            return
        mine = np.concatenate([b.ravel() for b in self.loader.buffers]) if self.loader.buffer_pages else np.zeros(0)
        assert len(np.unique(mine)) == len(mine), "a page is in a loading buffer twice"
        assert np.isin(mine, self.cache.allocator.allocated_ids(EXPERT)).all(), "a buffer page is not allocated"
        cached = self.cache.page_table[self.cache.page_table >= 0]
        assert not np.isin(mine, cached).any(), "a buffer page is also a cache page"
        if self.sized_buffers:
            need, have = self.buffer_need(), self.loader.capacities
            assert all(h >= n for h, n in zip(have, need, strict=True)), f"buffers {have} below the need {need}"

    # ------------------------------------------------------------------ step hooks
    def begin_step(self) -> None:
        """Before scheduling: publish expert loads that finished into the page table (sized buffers: return the
        slots the larger cache no longer needs to the pool)."""
        self.cache.poll()
        self._fit_buffers()

    def releasable_l2_pages(self) -> int:
        """L2 pages this policy can hand to KV after the current step (the scheduler defers instead of
        preempting when they cover a shortfall)."""
        return 0

    def after_schedule(self, out: SchedulerOutput, free_l2_pages: int) -> int:
        """After scheduling, before the forward pass: resize the cache; returns experts added (< 0: removed)."""
        return 0

    def kv_compaction_due(self, reclaimable_l2_pages: int) -> bool:
        """Before a synchronous step: whether to pack the KV pages, which would free ``reclaimable_l2_pages``."""
        return False

    def after_forward(self) -> None:
        """After the forward pass: free the pages of experts shrunk this step (sized buffers: grow by what the
        smaller cache can miss more, out of those pages)."""
        self.cache.reclaim()
        self._fit_buffers()


class FixedPolicy(MemoryPolicy):
    name = "fixed"
    stands_for = "fixed-ratio expert cache + separate KV region (Fate, MoE-Infinity, SGLang paged experts)"


class StaticPolicy(MemoryPolicy):
    name = "static"
    stands_for = "every expert resident, KV gets the rest (vLLM, SGLang default serving)"
    all_experts_resident = True
    loads_experts = False

    def initial_cache(self, total: int, free_l2: int) -> int:
        return total

    def _needs(self, total: int, buffer_experts: int) -> tuple[int, str]:
        return PAGES_PER_EXPERT * total + 1, "every expert"

    def _provider(self, ckpt, cache, loader, device) -> ExpertProvider:
        return ResidentExperts(cache.page_table, device, ckpt.experts.num_experts)


class CpuPolicy(MemoryPolicy):
    name = "cpu"
    stands_for = ("fixed expert cache on the device, other experts computed on the CPU "
                  "(KTransformers, llama.cpp --n-cpu-moe)")
    loads_experts = False

    def _provider(self, ckpt, cache, loader, device) -> ExpertProvider:
        return CpuComputedExperts(cache, ckpt.experts.weights, device)


class ElasticPolicy(MemoryPolicy):
    name = "elastic"
    stands_for = "Rimuru: experts and KV share the pool; the adjuster moves pages with the load"
    adjusts = True
    compacts_kv = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.adjuster = AdjusterConfig(pages_per_expert=PAGES_PER_EXPERT,
                                       expert_offload_limit=config.expert_offload_limit)

    def min_cache(self, initial: int, total: int) -> int:
        eol = self.config.expert_offload_limit
        return max(0, total - eol) if eol is not None else 0

    def releasable_l2_pages(self) -> int:
        floor = self.plan_.min_cache_experts
        pages = self.cache.releasable_l2_pages(floor)
        if self.sized_buffers:  # net of what the buffers take back once the cache is down to the floor
            cache = self.cache
            need = buffer_need(cache.resident_per_layer(prefix=floor), cache.num_experts)
            pages -= PAGES_PER_EXPERT * sum(max(0, n - c) for n, c in zip(need, self.loader.capacities, strict=True))
        return max(0, pages)

    def build(self, plan: MemoryPlan, ckpt: LoadedCheckpoint | None, pool: PagePool, hotset: Hotset,
              device: torch.device, spec: ModelSpec | None = None,
              ) -> tuple[ExpertLoader, ExpertCache, ExpertProvider | None]:
        # the cache expands only past one step's worth of free KV pages (at most the KV share the plan started with),
        # so that a request arriving at low load starts its first chunk at once instead of a step later behind a
        # shrink (KV compaction would otherwise hand the partly used pages' free slots, that headroom, to the cache);
        # the constant threshold is the floor
        if self.config.expand_headroom:  # off: the engine before 03fa546 (the modeled fidelity of older runs)
            kv_share = plan.free_l2_pages - PAGES_PER_EXPERT * plan.initial_cache_experts
            headroom = min(plan.step_kv_l2_pages, kv_share)
            self.adjuster = replace(self.adjuster, expand_free_above=max(self.adjuster.expand_free_above, headroom))
        return super().build(plan, ckpt, pool, hotset, device, spec)

    def kv_compaction_due(self, reclaimable_l2_pages: int) -> bool:
        cache = self.cache
        return compaction_due(self.adjuster, reclaimable_l2_pages, cache.num_cached, cache.total)

    def after_schedule(self, out: SchedulerOutput, free_l2_pages: int) -> int:
        cache = self.cache
        change = decide(self.adjuster, out.kv_short_l2, free_l2_pages, cache.num_cached, cache.total)
        if change > 0:
            return cache.expand(change)
        if change < 0:
            return -cache.shrink(self._net_shrink(-change))
        return 0

    def _net_shrink(self, experts: int) -> int:
        """Experts to shrink so that ``experts`` experts' pages reach KV: more than that with sized buffers when the
        smaller cache makes them grow (``shrink_release``; the buffers grow by at most 2 E experts in all)."""
        if not self.sized_buffers:
            return experts
        cache = self.cache
        room = max(0, cache.num_cached - self.plan_.min_cache_experts)
        tail = cache.shrink_tail(min(room, experts + sum(cache.num_experts - c for c in self.loader.capacities)))
        release = shrink_release(cache.resident_per_layer(), tail, self.loader.capacities, cache.num_experts)
        enough = np.flatnonzero(release >= PAGES_PER_EXPERT * experts)
        return int(enough[0]) + 1 if len(enough) else len(tail)


POLICIES: dict[str, type[MemoryPolicy]] = {p.name: p for p in (ElasticPolicy, FixedPolicy, StaticPolicy, CpuPolicy)}


def scaled_budget(policy: str, full: ModelSpec, budget: int, *, layers: int, dense_bytes: int,
                  layer_dense_bytes: float, dtype: torch.dtype, device: torch.device, tp: int = 1) -> int:
    """The budget (per rank) for the first ``layers`` layers of ``full`` (real per-layer shapes) that gives the
    workload what ``budget`` gives it on the full model: the elastic part of the pool (cache + KV: the budget
    minus dense weights, activations and the policy's loading buffers) scaled by ``layers / full.num_layers``.
    The loading buffers and the activation reserve hold one layer's worth in both models and keep their size.

    ``dense_bytes``: the small model's dense weights (on this rank); ``layer_dense_bytes``: one decoder
    layer's, which the full model has ``full.num_layers - layers`` more of. Used by the scaled GPU runs
    (workflow/scripts/e2e_gpu.py, e2e_tp_gpu.py, decode_floor_gpu.py) and by the modeled fidelity check
    that rebuilds their pools (rimuru.engine.modeled.reference.e2e_scaled_budget).
    """
    from rimuru.engine.config import EngineConfig

    dense_full = dense_bytes + (full.num_layers - layers) * layer_dense_bytes
    act = activation_estimate(full, EngineConfig(policy=policy, device=device.type, dtype=dtype), dtype, device)
    buffers = policy_class(policy).loading_buffer_bytes(full, dtype, tp)  # the policy's plan, not a re-derivation
    elastic_full = budget - dense_full - act - buffers
    return int(dense_bytes + act + buffers + elastic_full * layers / full.num_layers)


def mini_model_budget(model_dir: str | Path, real_config: str, card_gib: float, fraction: float, policy: str,
                      real_activation_gib: float, activation_bytes: int) -> dict:
    """Device budget for a scaled model that keeps the real card's memory ratios.

    The real pool is ``fraction * card - dense weights - activations`` (bf16). Everything in it is
    scaled by ``s = scaled expert bytes / real expert bytes`` (the KV bytes per token scale by the
    same factor for the bundled mini configs: checked here), except the two loading buffers, which
    hold one layer's experts each in both models and are added at their own size. The scaled model
    keeps its own dense weights and a fixed activation reserve outside the pool. The CPU pipeline's runs of
    the bundled mini models (workflow/scripts/common.py ``system_budget``) size their engines with it.
    """
    from rimuru.models.spec import ModelSpec

    real, mini = ModelSpec.from_pretrained(real_config), ModelSpec.from_pretrained(model_dir)
    dtype = torch.float32
    s = mini.total_expert_bytes(dtype) / real.total_expert_bytes(torch.bfloat16)
    s_kv = mini.kv_bytes_per_token(dtype) / real.kv_bytes_per_token(torch.bfloat16)
    memory_policy = policy_class(policy)
    real_buffers = memory_policy.loading_buffer_bytes(real, torch.bfloat16)
    mini_buffers = memory_policy.loading_buffer_bytes(mini, dtype)
    real_budget = fraction * card_gib * 2**30
    real_pool = real_budget - real.dense_bytes(torch.bfloat16) - real_activation_gib * 2**30
    pool = (real_pool - real_buffers) * s + mini_buffers
    budget = int(mini.dense_bytes(dtype) + activation_bytes + pool)
    return {"budget": budget, "scale": s, "kv_scale": s_kv, "real_budget_gib": real_budget / 2**30,
            "real_pool_gib": real_pool / 2**30, "real_experts_gib": real.total_expert_bytes(torch.bfloat16) / 2**30,
            "real_kv_tokens_if_static": (real_pool - real.total_expert_bytes(torch.bfloat16))
            / real.kv_bytes_per_token(torch.bfloat16)}


def make_policy(config: EngineConfig) -> MemoryPolicy:
    return policy_class(config.policy)(config)


def policy_class(name: str) -> type[MemoryPolicy]:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


def plan_memory(spec: ModelSpec, config: EngineConfig, dense_bytes: int | None = None,
                device: torch.device | None = None) -> MemoryPlan:
    """The plan an engine with these options would make for this model (nothing is allocated)."""
    layout = PoolLayout.from_spec(spec, block_tokens=config.block_tokens, weight_dtype=config.torch_dtype)
    return make_policy(config).plan(spec, layout, dense_bytes, device)


__all__ = ["POLICIES", "CpuPolicy", "ElasticPolicy", "FixedPolicy", "MemoryBudgetError", "MemoryPlan",
           "MemoryPolicy", "StaticPolicy", "activation_estimate", "make_policy", "mini_model_budget", "plan_memory",
           "policy_class", "scaled_budget"]
