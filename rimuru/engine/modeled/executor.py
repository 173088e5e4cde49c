"""ModeledExecutor: the executor that models the forward pass instead of running it.

Same interface as ``TorchExecutor`` (a SchedulerOutput in, one row of logits per sampling chunk out),
so the scheduler, allocator, adjuster, expert cache and loader bookkeeping of ``LLM.step`` run for
real around it. Per step it draws the routed experts of every MoE layer from a ``RoutingModel``,
finds the misses against the cache's page table, books their loads with the loader (demand loads
and the predictor's prefetches, as ``PagedExperts`` does) and advances the engine's virtual clock by
the ``CostModel``'s step time. A pure decode step replays a CUDA graph when the torch engine would
(``rimuru.engine.cuda_graphs.replays_graph`` with the engine's graph batch cap): its misses are read in
place from pinned host memory (booked with the loader as the torch engine counts them), not loaded. With
async scheduling (``pipelined``) a graphed step launched behind another takes max(host, device).
Outputs carry no text: every sampled token is id 0 and lengths follow the requests' ``max_tokens``
(``ignore_eos``, as ``vllm bench serve`` runs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields

import numpy as np
import torch

from rimuru.engine.clock import VirtualClock
from rimuru.engine.cuda_graphs import next_step_replays, replays_graph
from rimuru.engine.modeled.cost import CostModel, StepTime, StepWork
from rimuru.engine.modeled.routing import RoutingModel
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.experts.cache import ExpertCache
from rimuru.experts.loader import ExpertLoader
from rimuru.experts.provider import prefetch_next_step

_FIELDS = tuple(f.name for f in fields(StepTime))


def pipelined(async_scheduling: bool, graphed: bool, waiting: int, compacted: bool = False) -> bool:
    """Whether the engine launches this step without waiting for the one before (``rimuru.engine.llm.may_pipeline``):
    async scheduling on for the engine, a decode-graph step, nothing waiting (a
    graphed pure decode step admitted nobody, so the queue after scheduling is the queue the engine checked), and
    no KV compaction before it (``compacted``: a compaction due makes the engine take a synchronous step, which packs
    the pages first). A pipelined step after a pipelined step overlaps it: the host schedules and launches it while
    the device runs the one before."""
    return async_scheduling and graphed and waiting == 0 and not compacted


def step_admissions(out: SchedulerOutput, max_model_len: int = 0) -> tuple[int, int]:
    """(requests whose first chunk ``out`` computes: admitted, or recomputed after a preemption; requests its sampled
    tokens finish by length: the ``max_tokens``-th output or the ``max_model_len``-th token, 0: no length cap), the
    counts ``CostParams.host_admit_us`` and ``host_finish_us`` take. Modeled outputs are never a stop token
    (``ignore_eos``), so length is the only finish."""
    admitted = finished = 0
    for chunk in out.chunks:
        admitted += chunk.start == 0
        if chunk.samples:
            request = chunk.request
            known = request.num_tokens + 1  # the sampled token
            finished += (len(request.output_token_ids) + request.num_pending + 1 >= request.params.max_tokens
                         or (max_model_len > 0 and known >= max_model_len))
    return admitted, finished


@functools.cache
def zero_logits(rows: int) -> torch.Tensor:
    """[rows, 1] zeros: a modeled step's logits, one row per sampled request (every sampled token is id 0). One
    tensor per row count, shared by every step of every engine (allocating it each step was a measurable share of a
    replay's time): the engine only reads a step's logits (``LLM._execute_and_postprocess``, ``sample``)."""
    return torch.zeros(rows, 1)


class ModeledExecutor:
    def __init__(self, cost: CostModel | None, routing: RoutingModel, cache: ExpertCache, loader: ExpertLoader,
                 clock: VirtualClock, *, experts_mode: str, prefetch: bool, fixed_step_ms: float | None = None,
                 graph_max_batch: int | None = None, max_model_len: int = 0, async_scheduling: bool = False,
                 waiting: Callable[[], int] = lambda: 0, next_step_prefetch: bool = True,
                 kv_pages_moved: Callable[[], int] = lambda: 0, prefetch_before_graphs: bool = False) -> None:
        """``experts_mode``: ``paged`` (cache + loading buffers), ``resident`` (static) or ``cpu``;
        ``graph_max_batch``: decode steps of at most this many requests replay a CUDA graph (None: none do);
        ``async_scheduling``: the engine launches a graphed decode step while the one before runs (``pipelined``);
        ``waiting``: the scheduler's waiting requests (a step is pipelined only with none);
        ``kv_pages_moved``: the engine's count of KV pages compaction moved (a step after a compaction is synchronous);
        ``next_step_prefetch``: an eager paged step whose first MoE layer touched >= 3/4 of its experts copies that
        layer's misses into its buffer at the step's end for the next step (``PagedExperts.layer_done``, since
        ``a98ef5f``; False models an engine from before), but not when the next step is expected to replay a decode
        graph (``next_step_replays``) unless ``prefetch_before_graphs`` (the engine before that rule). Copies carried
        into a graphed step share the PCIe link with its in-place reads: their time adds to its device time."""
        if experts_mode not in ("paged", "resident", "cpu"):
            raise ValueError(f"experts_mode must be paged, resident or cpu, got {experts_mode!r}")
        if cost is None and fixed_step_ms is None:
            raise ValueError("a modeled executor needs a cost model or a fixed step time")
        self.cost = cost
        self.routing = routing
        self.cache = cache
        self.loader = loader
        self.clock = clock
        self.mode = experts_mode
        self.prefetch = prefetch and experts_mode == "paged"
        self.fixed_step_ms = fixed_step_ms
        self.graph_max_batch = graph_max_batch
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.waiting = waiting
        self.kv_pages_moved = kv_pages_moved
        self._moved_seen = kv_pages_moved()
        self._pipelined = False  # the step before was launched without waiting for its predecessor
        self.next_step_prefetch = next_step_prefetch and self.prefetch
        self.prefetch_before_graphs = prefetch_before_graphs
        self._carried: np.ndarray | None = None  # [E] first-layer experts copied at the end of an eager step
        self._carried_new = 0  # of them, copied at the end of the step just before (their copy time)
        self.overlapped_steps = 0  # graphed steps whose host work hid behind the step before (async scheduling)
        self.graph_steps = 0  # steps that replayed a decode graph, as TorchExecutor counts them
        self.experts_touched = 0  # (layer, expert) pairs computed, as the torch providers count them
        self.experts_on_cpu = 0
        self.last: StepTime | None = None
        self.totals: dict[str, float] = {}
        self._loads_seen = loader.experts_loaded
        self._table_version: int | None = None  # ExpertCache.version that _resident was taken at
        self._resident = self._absent = None  # [L, E] bool: experts in the cache's page table, and the others
        self._no_loads = np.zeros(routing.shape[0], dtype=np.int64)  # [M] a step's demand or prefetched loads
        self._no_loads.flags.writeable = False  # where it has none: one read-only array shared by those steps

    @property
    def last_pipelined(self) -> bool:
        """Whether the last step was launched without waiting for the one before (``pipelined``)."""
        return self._pipelined

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        chunks = out.chunks
        q = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        samples = sum(1 for c in chunks if c.samples)
        expansions = self.loader.experts_loaded - self._loads_seen  # started by the adjuster this step
        prefill, decode = self.routing.step_tokens(q)
        if decode and self.routing.decode_request is not None:  # each request's decode tokens by its own tempering
            decode = self.routing.decode_keys((c.request.request_id, len(c.request.prompt_token_ids))
                                              for c in chunks if c.num_tokens == 1)
        touched = self.routing.sample_touched(prefill, decode)  # [M, E]
        cpu_experts = cpu_share = None
        demand, prefetched, in_place = self._no_loads, self._no_loads, None
        graphed = self.graph_max_batch is not None and replays_graph(out, self.graph_max_batch, self.max_model_len)
        self.graph_steps += graphed
        moved = self.kv_pages_moved()
        compacted, self._moved_seen = moved != self._moved_seen, moved
        now_pipelined = pipelined(self.async_scheduling, graphed, self.waiting(), compacted)
        overlapped = now_pipelined and self._pipelined
        self._pipelined = now_pipelined
        self.overlapped_steps += overlapped
        carried = 0  # experts copied at the end of the previous step, on the copy stream as this step starts
        if self.mode == "resident":
            on_device = touched.sum(axis=1)
        else:
            resident, absent = self._page_table_masks()
            miss = touched & absent
            misses = miss.sum(axis=1)
            if self.mode == "cpu":
                on_device = (touched & resident).sum(axis=1)
                cpu_experts = misses
                cpu_share = self.routing.share(absent)
                self.experts_on_cpu += int(misses.sum())
            elif graphed:  # misses read in place over PCIe, counted as the torch engine counts them
                on_device = touched.sum(axis=1)
                in_place = misses
                self.loader.account_loads(int(misses.sum()))
            else:
                on_device = touched.sum(axis=1)
                if self._carried is not None:  # the previous step copied these into layer 0's buffer: hits
                    misses[0] -= int((miss[0] & self._carried).sum())
                demand, prefetched = self._split_loads(misses, resident, touched)
                self.loader.account_loads(int(demand.sum() + prefetched.sum()))
            carried = self._carried_new
            self._carried_new = 0
            if self.mode == "paged" and not graphed and self.next_step_prefetch:
                next_in_place = (self.graph_max_batch is not None and not self.prefetch_before_graphs
                                 and next_step_replays(out, self.graph_max_batch))
                self._carry_first_layer(touched[0], resident[0], next_in_place)
        self.experts_touched += int(on_device.sum())
        self._loads_seen = self.loader.experts_loaded
        if self.fixed_step_ms is not None:
            step_ms = self.fixed_step_ms
        else:
            admitted, finished = step_admissions(out, self.max_model_len)
            self.last = self.cost.step(StepWork(q, starts, samples, on_device, demand, prefetched, cpu_experts,
                                                cpu_share, expansions, sync_per_layer=self.mode != "resident",
                                                graphed=graphed, in_place=in_place, overlapped=overlapped,
                                                carried_experts=carried, admitted=admitted, finished=finished))
            step_ms = self.last.total_ms
            for k in _FIELDS:
                self.totals[k] = self.totals.get(k, 0.0) + float(getattr(self.last, k))
        self.clock.advance(step_ms / 1e3)
        return zero_logits(samples)

    def _page_table_masks(self) -> tuple[np.ndarray, np.ndarray]:
        """([L, E] experts in the cache's page table, the others), taken again only when the table has changed
        (``ExpertCache.version``): most steps neither publish nor reclaim an expert. Read-only arrays."""
        if self._table_version != self.cache.version:
            resident = self.cache.page_table[:, :, 0] >= 0
            absent = ~resident
            resident.flags.writeable = absent.flags.writeable = False
            self._resident, self._absent, self._table_version = resident, absent, self.cache.version
        return self._resident, self._absent

    def _carry_first_layer(self, first: np.ndarray, resident: np.ndarray, next_in_place: bool = False) -> None:
        """``PagedExperts.layer_done``: after a step whose first MoE layer touched ``first`` ([E] bool), its
        non-resident experts (up to a buffer's capacity, in expert order as ``ExpertLoader.prefetch`` takes them)
        are copied for the next step when ``prefetch_next_step`` says so."""
        if not prefetch_next_step(int(first.sum()), len(first), next_in_place):
            self._carried = None
            return
        ids = np.flatnonzero(first & ~resident)[: self.loader.capacity]
        self._carried = np.zeros(len(first), dtype=bool)
        self._carried[ids] = True
        self._carried_new = len(ids)
        self.loader.account_loads(len(ids), carried=True)

    def _split_loads(self, misses: np.ndarray, resident: np.ndarray, touched: np.ndarray):
        """Demand loads and predicted loads per layer (predictions for layer l are made in layer l - 1)."""
        if not self.prefetch or self.cost is None:
            return misses, np.zeros_like(misses)
        p = self.cost.params
        rng = self.routing.rng
        predicted = rng.binomial(misses, p.prefetch_recall)
        predicted[0] = 0  # nothing predicts the first MoE layer
        full = resident.all(axis=1)  # the predictor is off for a fully resident layer
        predicted[full] = 0
        spare = (~resident & ~touched).sum(axis=1)
        waste = np.minimum(rng.poisson(p.prefetch_waste * misses), spare)
        waste[0] = 0
        waste[full] = 0
        return misses - predicted, predicted + waste
