"""`rimuru.LLM`: the engine's public face — offline `generate` and the streaming step API.

``__init__`` is wiring: the memory policy plans the budget (``MemoryPlan``), the pool is carved from
it, the policy builds its expert side (loading buffers, cache, provider), then the scheduler, model
and executor. ``step`` is schedule -> execute -> postprocess with the policy's hooks around them
(docs/architecture.md, "A step").
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import logging
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from rimuru.distributed.comm import SINGLE, Shard, TorchDistributed
from rimuru.distributed.errors import FatalEngineError, TensorParallelError
from rimuru.distributed.expert_parallel import Placement, engine_placement
from rimuru.distributed.group import (
    START_TIMEOUT_S,
    TensorParallelExecutor,
    TensorParallelGroup,
    init_process_group,
    rank_device,
    switch_kernels,
)
from rimuru.distributed.replica import (
    BatchSender,
    RecordingExpertCache,
    RecordingHybridCacheManager,
    RecordingKVCacheManager,
    state_digest,
)
from rimuru.distributed.sharding import check_shardable, vocab_parallel
from rimuru.engine.clock import VirtualClock, WallClock
from rimuru.engine.config import EngineConfig
from rimuru.engine.cuda_graphs import DecodeGraphs, decode_graphs_allowed, graph_max_batch
from rimuru.engine.executor import LaunchedDecode, TorchExecutor
from rimuru.engine.gc_policy import YoungThreshold, idle_collection
from rimuru.engine.hybrid_executor import build_hybrid
from rimuru.engine.kv_manager import KVCacheManager
from rimuru.engine.memory_policy import MemoryBudgetError, activation_estimate, make_policy
from rimuru.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from rimuru.engine.request import Request, Status
from rimuru.engine.sampler import sample
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from rimuru.engine.state_manager import HybridCacheManager
from rimuru.engine.timeline import StepRecord, Timeline
from rimuru.experts.hotset import Hotset
from rimuru.experts.provider import DeviceTableExperts
from rimuru.kernels.compiles import compile_count
from rimuru.kernels.compiles import install as install_compile_counter
from rimuru.memory import EXPERT, KV, PAGES_PER_EXPERT, PagePool, PoolLayout
from rimuru.models.loader import LoadedCheckpoint, load_checkpoint
from rimuru.models.qwen_moe import QwenMoeModel
from rimuru.models.spec import ModelSpec
from rimuru.models.synthetic_memory import SyntheticCheckpoint
from rimuru.models.tokenizer import engine_tokenizer

log = logging.getLogger("rimuru.engine")

__all__ = ["LLM", "MemoryBudgetError", "StepObserver", "activation_estimate", "may_pipeline"]


class StepObserver(Protocol):
    """What :meth:`LLM.observe_steps` tells: a step call starts, and it ends (returned or raised)."""

    def step_started(self) -> None: ...

    def step_ended(self) -> None: ...


def may_pipeline(*, enabled: bool, graphs_ready: bool, evictions_pending: bool, decode_fits: bool,
                 compaction_due: bool = False) -> bool:
    """Whether the next step is launched before the step in flight (if any) is read (async scheduling,
    docs/engine.md): the option on, decode graphs captured with replay on (with tensor parallelism on every rank),
    no expert eviction pending (experts the step in flight shrank are freed at its commit, with nothing else in
    flight), and the scheduler's next batch a greedy pure decode that the graphs cover and whose
    KV fits without preemption (``Scheduler.pipelinable``). Every policy: the graphs read a miss in place from
    pinned host memory, so no page moves around a pipelined forward; expansion copies wait for the compute
    stream (``ExpertLoader.copy_expert``) and enter the page table only after their event. A KV compaction due
    (``rimuru.experts.adjuster.compaction_due``) also waits for a step with nothing in flight: it moves pages that
    step reads and writes."""
    return enabled and graphs_ready and not evictions_pending and decode_fits and not compaction_due


class LLM:
    def __init__(self, model: str | Path | LoadedCheckpoint | ModelSpec | SyntheticCheckpoint, *, _tp_rank: int = 0,
                 _tp_port: int | None = None, **options) -> None:
        """``model``: a checkpoint directory, a checkpoint already in memory (``LoadedCheckpoint``, one device
        only) or a synthetic-checkpoint recipe (``SyntheticCheckpoint``).

        ``tensor_parallel_size=N`` splits the model over N processes and devices (docs/tensor_parallel.md);
        ``_tp_*`` are set by rimuru/distributed/group.py for ranks > 0. With ``executor="modeled"`` no weights
        are loaded and no process is started: ``model`` may also be a bundled config name (``qwen3-30b-a3b``),
        a config.json path or a ``ModelSpec`` (``rimuru.engine.modeled``)."""
        self.tp_group: TensorParallelGroup | None = None
        self._froze_heap = False  # warmup() froze the heap out of the cyclic GC; close() unfreezes it
        self._gc_held = False  # warmup() raised the GC's young threshold (gc_idle_collect); close() restores it
        try:
            self._build(model, _tp_rank, _tp_port, options)
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.close()
            raise

    def _build(self, model, tp_rank: int, tp_port: int | None, options: dict) -> None:
        self.config = config = EngineConfig(**options)
        tp = config.tensor_parallel_size
        shard = Shard(tp_rank, tp) if not config.modeled else Shard()  # modeled: one process stands for N ranks
        device, dtype = rank_device(config.torch_device, shard.rank), config.torch_dtype
        self.device = device
        self.comm = SINGLE
        if shard.world > 1:
            if isinstance(model, LoadedCheckpoint | ModelSpec):
                raise ValueError("tensor_parallel_size > 1 needs a checkpoint directory or a SyntheticCheckpoint "
                                 "(each rank loads its own shard)")
            if not isinstance(model, SyntheticCheckpoint) and not (Path(model) / "config.json").exists():
                raise FileNotFoundError(f"{model} is not a checkpoint directory (no config.json)")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if shard.rank == 0:
                source = model if isinstance(model, SyntheticCheckpoint) else str(model)
                # a size the model cannot be split into fails here, before any worker process is started
                check_shardable(ModelSpec.from_pretrained(model.config if isinstance(model, SyntheticCheckpoint)
                                                          else source), shard, config.vocab_parallel_head)
                self.tp_group = TensorParallelGroup(shard.world, source, options, device, config.tp_timeout_s)
            else:
                init_process_group("nccl" if device.type == "cuda" else "gloo", tp_port, shard.rank, shard.world,
                                   config.tp_timeout_s)
            self.comm = TorchDistributed(shard, device)
            self._collective(lambda: self.comm.select_all_reduce(config.all_reduce, dtype))  # every rank at once
            if self.tp_group is not None:
                self.tp_group.comm = self.comm  # a dead rank: the monitor releases kernels waiting for it
        if config.modeled and config.record_routing:
            raise ValueError("record_routing needs the real forward pass (executor='torch')")
        placement = None
        if config.enable_expert_parallel:  # whole experts per rank: this rank's share, before its weights load
            placement = self._expert_placement(model, config, shard.world)
            shard = Shard(shard.rank, shard.world, placement.local[shard.rank])
        ckpt: LoadedCheckpoint | None = None
        if isinstance(model, SyntheticCheckpoint):
            ckpt, self.model_dir, self.model_name = model.load(device, dtype, shard), Path("."), model.name
            spec = ckpt.spec
        elif isinstance(model, ModelSpec):
            if not config.modeled:
                raise ValueError("a ModelSpec has no weights: pass a checkpoint, or executor='modeled'")
            spec, self.model_dir = model, Path(".")
            self.model_name = Path(model.source).parent.name or "spec"
        elif isinstance(model, LoadedCheckpoint):
            ckpt, self.model_dir, spec = model, Path("."), model.spec
            self.model_name = Path(model.spec.source).parent.name or "in-memory"
        elif config.modeled:  # the config only: a checkpoint dir, a config.json or a bundled name
            spec = ModelSpec.from_pretrained(model)
            path = Path(model)
            self.model_dir = path if path.is_dir() else path.parent if path.is_file() else Path(".")
            self.model_name = path.name if path.is_dir() else str(model)
        else:
            self.model_dir = Path(model)
            if not (self.model_dir / "config.json").exists():
                raise FileNotFoundError(f"{self.model_dir} is not a checkpoint directory (no config.json)")
            self.model_name = self.model_dir.name
            ckpt = load_checkpoint(self.model_dir, device=device, dtype=dtype, shard=shard)
            spec = ckpt.spec
        self.spec = spec
        self.tokenizer = engine_tokenizer(config.tokenizer, None if self.model_dir == Path(".") else self.model_dir,
                                          spec.vocab_size)
        self.eos_token_ids = frozenset(spec.eos_token_ids)

        # ---- memory: the policy splits the budget, the pool holds what is left after dense weights and activations
        self.policy = policy = make_policy(config)
        layout = PoolLayout.from_spec(spec, block_tokens=config.block_tokens, weight_dtype=dtype, tp=tp,
                                      expert_tp=1 if placement is not None else None)
        # what this rank's pool holds of the routed experts: all of them (sliced), or its own (expert parallelism)
        rank_spec = spec if placement is None else dataclasses.replace(spec, num_experts=placement.per_rank)
        if ckpt is not None:
            dense_bytes = sum(t.numel() * t.element_size() for t in ckpt.dense.values())
            if shard.world > 1:  # one memory decision: every rank plans with the largest shard, so the pools match
                dense_bytes = -self._collective(lambda: self.comm.min_int(-dense_bytes))
                policy.cache_cls = RecordingExpertCache
        else:  # modeled: one rank's shard (replicated embeddings, LM head, norms, router); activations as on its GPU
            dense_bytes = spec.dense_bytes(dtype, tp)
        plan_device = torch.device("cuda") if config.modeled else device
        self.plan = plan = policy.plan(rank_spec, layout, dense_bytes, plan_device)
        self.pool = PagePool(layout, plan.pool, device)
        self.allocator = self.pool.allocator

        # ---- experts: hotset order, then the policy's loading buffers, cache and provider
        hotset_path = Path(config.hotset) if config.hotset else self.model_dir / "hotset.json"
        self.hotset = (Hotset.load(hotset_path) if hotset_path.exists() and placement is None
                       else Hotset.uniform(spec.num_moe_layers, rank_spec.num_experts))  # static under EP: order moot
        self.loader, self.cache, self.provider = policy.build(plan, ckpt, self.pool, self.hotset, device,
                                                              spec=rank_spec)

        # ---- scheduler, model and executor
        self.max_model_len = plan.max_model_len
        if spec.is_hybrid:  # GDN layers hold SSM and conv states per request, attention layers KV
            hybrid_cls = RecordingHybridCacheManager if shard.world > 1 else HybridCacheManager
            self.kv = hybrid_cls(self.allocator, len(spec.full_attention_layers), config.block_tokens,
                                 len(spec.linear_attention_layers))
        else:
            kv_cls = RecordingKVCacheManager if shard.world > 1 else KVCacheManager
            self.kv = kv_cls(self.allocator, len(spec.full_attention_layers), config.block_tokens)
        sched_config = SchedulerConfig(self.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
                                       short_lookahead=config.short_lookahead,
                                       running_lookahead=config.running_lookahead)
        self.scheduler = Scheduler(sched_config, self.kv, policy.releasable_l2_pages)
        # KV compaction: where freed L2 pages can grow the cache (elastic), on one device (tensor parallelism would
        # replay the moves on every rank) and without GDN states (their manager keeps its own tables)
        self._compacts = config.kv_compaction and policy.compacts_kv and tp == 1 and not spec.is_hybrid
        self.kv_pages_moved = 0
        if config.modeled:
            from rimuru.engine.modeled import build_modeled_executor

            self.model = self._local_executor = None
            self.clock = VirtualClock()
            self.executor = build_modeled_executor(self, config)
            self.provider = self.executor  # counts experts_touched as the torch providers do
        else:
            self.clock = WallClock()
            if spec.is_hybrid:  # no decode graphs for the hybrid model yet
                self.model, self.executor = build_hybrid(spec, ckpt.dense, config, self.pool, self.kv, self.provider,
                                                         device, self.comm)
            else:
                self.model = QwenMoeModel(spec, ckpt.dense, device, config.attention_impl, config.moe_impl,
                                          self.comm, None if placement is None
                                          else torch.from_numpy(placement.map(shard.rank)))
                if vocab_parallel(config.vocab_parallel_head, spec, tp):
                    self.model.use_vocab_parallel(True)
                self.executor = TorchExecutor(self.model, self.kv, self.pool.view(KV),
                                              self.pool.view(EXPERT).tensor, self.provider, device,
                                              self._decode_graphs(ckpt.experts.weights))
            self._local_executor: TorchExecutor | None = self.executor  # this process's forward; owns the graphs
            if config.record_routing:
                self.model.record_routing()
        install_compile_counter()
        self.timeline = Timeline(columnar=config.timeline_columns)
        self._generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self._generators: dict[str, torch.Generator | None] = {}
        self._start = self.clock.now()
        self._generated = 0
        self._failed = 0
        self._inflight: tuple[LaunchedDecode, int, int] | None = None  # async scheduling: (step, number, adjust)
        self._step_observers: list[StepObserver] = []  # observe_steps(): told when each step call starts and ends
        self._async = config.async_scheduling  # use_async_scheduling() switches it for a block of steps
        self._prompt_scores: dict[str, dict[int, TokenLogprob]] = {}  # prompt_logprobs until the first token
        self.memory_report = {**plan.report(), "tensor_parallel_size": tp, **self.comm.selection_report,
                              "expert_parallel": placement is not None}
        self.expert_placement = placement  # read-only: which global experts each rank holds whole (or None)
        if self.tp_group is not None:  # rank 0 decides; from now on every allocator change is replayed
            oplog: list = []
            self.kv.oplog = self.cache.oplog = oplog
            sender = BatchSender(oplog, self._generators.__contains__)
            self.executor = TensorParallelExecutor(self.executor, self.tp_group, sender, device)
            self.tp_group.gather("ready", START_TIMEOUT_S)

    @staticmethod
    def _expert_placement(model, config: EngineConfig, world: int) -> Placement:
        """Expert parallelism's placement (rimuru.distributed.expert_parallel.engine_placement): the same on every
        rank, from the model's config and the hotset file (``EngineConfig.hotset``, else the checkpoint's own)."""
        if isinstance(model, LoadedCheckpoint | ModelSpec):
            raise ValueError("enable_expert_parallel needs a checkpoint directory or a SyntheticCheckpoint")
        synthetic = isinstance(model, SyntheticCheckpoint)
        spec = ModelSpec.from_pretrained(model.config if synthetic else str(model))
        path = Path(config.hotset) if config.hotset else None if synthetic else Path(model) / "hotset.json"
        hotness = Hotset.load(path).probability if path is not None and path.exists() else None
        return engine_placement(spec, world, hotness)

    def _collective(self, fn):
        """Run a start-up collective; on rank 0 a failure becomes the error naming the failed rank."""
        if self.tp_group is None:
            return fn()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            raise self.tp_group.fail(exc) from exc

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op on one device). The decode graphs are destroyed first: with
        tensor parallelism they hold captured collectives of the group being closed, and an NCCL communicator
        torn down while a graph still holds its collectives can hang (PyTorch issue 115388). A heap that
        ``warmup`` froze is unfrozen, so that the engine can be collected."""
        if self._froze_heap:
            gc.unfreeze()
            self._froze_heap = False
        if self._gc_held:
            YoungThreshold.release()
            self._gc_held = False
        if self.tp_group is not None:
            inflight, self._inflight = self._inflight, None
            if inflight is not None and self.tp_group.error is None:  # the graphs below may still be running it
                with contextlib.suppress(TensorParallelError):
                    inflight[0].wait()
            if self._local_executor is not None and self.tp_group.error is None:
                # destroys the CUDA graphs themselves; not after a failure: a graph may still be running (a kernel
                # waiting for a dead rank) and destroying it would block (2x H200, wave 5)
                self._local_executor.drop_graphs()
            self.tp_group.close()

    def _install_eager_replay_graphs(self) -> DecodeGraphs:
        """Give a one-device engine without decode graphs (on the CPU, say) graphs that run their captured forward
        eagerly over the same persistent buffers (``DecodeGraphs(replay_eagerly=True)``), so that the graphed
        and async-scheduling paths run where CUDA graphs do not exist: CPU tests and the host-time profile
        (workflow/scripts/profile_host_step.py). With tensor parallelism every rank installs its own."""
        if self.spec.is_hybrid or self.model is None:
            raise RuntimeError("eager-replay decode graphs need a torch engine of a plain MoE model")
        if self.tp_group is not None:
            self.tp_group.send(("eager_graphs",))
        resident = self.policy.all_experts_resident
        experts = DeviceTableExperts(lambda: self.cache.page_table, lambda: self.cache.version,
                                     None if resident else self.loader.host, self.device)
        max_batch = graph_max_batch(self.config.max_num_seqs, resident, self.config.offload_graph_max_batch)
        graphs = DecodeGraphs(self.model, self.kv, self.pool.view(KV), self.pool.view(EXPERT).tensor, experts,
                              self.device, max_batch, self.max_model_len, replay_eagerly=True)
        graphs.capture()
        local = TorchExecutor(self.model, self.kv, self.pool.view(KV), self.pool.view(EXPERT).tensor, self.provider,
                              self.device, graphs)
        self._local_executor = local
        if self.tp_group is None:
            self.executor = local
        else:
            self.executor.local = local
            self.tp_group.gather("eager_graphs")
        return graphs

    def _decode_graphs(self, host_weights: torch.Tensor) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, or None: ``enforce_eager``, no CUDA, the ``cpu`` policy (it computes
        misses on the host), routing recording (a host-side count per layer), or an offloading policy whose
        host experts are not pinned (the graphs read misses in place from pinned memory)."""
        config, policy = self.config, self.policy
        if self.device.type != "cuda" or not decode_graphs_allowed(config, policy.name):
            return None  # tensor parallelism: every rank captures the same buckets, NCCL all-reduces inside
        resident = policy.all_experts_resident
        if not resident and not host_weights.is_pinned():
            return None
        experts = DeviceTableExperts(lambda: self.cache.page_table, lambda: self.cache.version,
                                     None if resident else host_weights, self.device)
        max_batch = graph_max_batch(config.max_num_seqs, resident, config.offload_graph_max_batch)
        return DecodeGraphs(self.model, self.kv, self.pool.view(KV), self.pool.view(EXPERT).tensor, experts,
                            self.device, max_batch, self.max_model_len)

    # ------------------------------------------------------------------ streaming API
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Atomic: everything is validated first, so a ValueError/TypeError leaves no trace."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        ids = list(prompt_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise ValueError("prompt token ids must be integers")
        if any(not 0 <= t < self.spec.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        request = Request(request_id, [int(t) for t in ids], params,
                          self.clock.now() if arrival_time is None else arrival_time)
        generator = (torch.Generator().manual_seed(params.seed) if params.seed is not None
                     else None if params.greedy else self._generator)
        self.scheduler.add(request)  # validates (duplicate id, empty or too long prompt) before it changes anything
        self._generators[request_id] = generator

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """Drop the engine's own per-request state (sampling generator, pending prompt scores) of a request that
        has finished, failed or been aborted."""
        self._generators.pop(request_id, None)
        self._prompt_scores.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @contextlib.contextmanager
    def observe_steps(self, observer: StepObserver):
        """For the block's duration, ``observer.step_started()`` and ``step_ended()`` bracket every :meth:`step` call
        (instrumentation, e.g. ``rimuru.bench.gcstats.GcRecorder``; nothing the engine does changes)."""
        self._step_observers.append(observer)
        try:
            yield observer
        finally:
            self._step_observers.remove(observer)

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule -> execute -> postprocess, with the memory policy's hooks around them.

        A forward pass that raises fails only the requests in this step (their pages are freed); a request
        whose sampling raises fails alone. Either way the engine keeps serving.

        Async scheduling (``async_scheduling``, one device with decode graphs, any memory policy): while a greedy
        decode batch runs graphed, step n+1 is scheduled and launched before step n's tokens are read, its input
        tokens taken on the device; this call then returns step n's outputs (so a pipelined call returns the previous
        launch's tokens, and the timeline records step n with this call's wall time). Any other step first
        finishes the one in flight (docs/engine.md, "Async scheduling").

        With ``EngineConfig.gc_idle_collect`` (after warm-up), a call whose step leaves nothing running or waiting then
        collects Python's cyclic garbage (``rimuru.engine.gc_policy.idle_collection``): after the step was timed,
        recorded and its observers told it ended, before this call returns."""
        if not self._step_observers:
            outputs = self._run_step()
        else:
            for observer in self._step_observers:
                observer.step_started()
            try:
                outputs = self._run_step()
            finally:
                for observer in reversed(self._step_observers):
                    observer.step_ended()
        if self._gc_held:  # the step is timed, recorded and observed: collect now if it left the engine idle
            generation = idle_collection(idle=not self.scheduler.has_unfinished() and self._inflight is None,
                                         counts=gc.get_count(), full_every=gc.get_threshold()[2])
            if generation is not None:
                gc.collect(generation)
        return outputs

    def _run_step(self) -> list[RequestOutput]:
        """:meth:`step`'s work."""
        t0 = self.clock.now()
        compiles_before = compile_count()
        outputs: list[RequestOutput] = []
        pipelinable = self._pipelinable()
        if self._inflight is not None and not pipelinable:
            inflight, self._inflight = self._inflight, None
            outputs = self._commit(inflight, t0, compiles_before)
            self.policy.after_forward()  # nothing in flight now: free the pages of experts that step shrank
            t0, compiles_before = self.clock.now(), compile_count()
            pipelinable = self._pipelinable()  # the commit finished requests and freed pages: ask again
        if pipelinable:
            return outputs + self._step_async(t0, compiles_before)
        return outputs + self._step_sync(t0, compiles_before)

    def _pipelinable(self) -> bool:
        """Whether the next step is launched without waiting for the one before (:func:`may_pipeline`)."""
        executor = self._local_executor
        graphs_ready = executor is not None and executor.launches_decode
        return may_pipeline(
            enabled=self._async, graphs_ready=graphs_ready, evictions_pending=self.cache.num_evicting > 0,
            decode_fits=graphs_ready and self.scheduler.pipelinable(executor.graphs.bmax),
            compaction_due=self._compaction_due())

    def _compaction_due(self) -> bool:
        return self._compacts and self.policy.kv_compaction_due(self.kv.reclaimable_l2_pages())

    def _compact_kv(self) -> int:
        """Pack the KV pages when due (nothing in flight: called by a synchronous step before it schedules); the
        copies are queued on the compute stream ahead of the step's forward and of any expansion into the freed
        pages (``ExpertLoader.copy_expert`` waits for that stream)."""
        if not self._compaction_due():
            return 0
        src, dst = self.kv.compact()
        self.pool.view(KV).move(src, dst)
        self.kv_pages_moved += len(src)
        return len(src)

    def _step_async(self, t0: float, compiles_before: int) -> list[RequestOutput]:
        """Schedule and launch a graphed decode step, then read the tokens of the step launched before it."""
        self.policy.begin_step()
        out = self.scheduler.schedule()
        change = self.policy.after_schedule(out, self.allocator.free_l2_pages(EXPERT))
        previous, self._inflight = self._inflight, None
        try:
            if not self.graphs.can_run(out):
                raise RuntimeError("async scheduling scheduled a step the decode graphs cannot run")
            launched = self.executor.launch_decode(out, None if previous is None else previous[0])  # TP: every rank
        except FatalEngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, not the engine
            log.exception("forward pass failed; failing the %d requests of this step", len(out.chunks))
            outputs = [] if previous is None else self._commit(previous, t0, compiles_before)
            self.policy.after_forward()  # nothing in flight: this step's shrink, if any, is freed now
            return outputs + [self._fail(c.request, exc) for c in out.chunks if not c.request.is_finished]
        # no after_forward() here: experts this step shrank stay mapped until its commit, in the next call (a
        # pending eviction makes that call's step synchronous: may_pipeline)
        self.scheduler.advance(out)
        self._inflight = (launched, self.scheduler.forward_steps, change)
        return [] if previous is None else self._commit(previous, t0, compiles_before)

    def _commit(self, inflight: tuple[LaunchedDecode, int, int], t0: float,
                compiles_before: int) -> list[RequestOutput]:
        """Wait for a launched step, append its tokens (the scheduler finishes requests), build the outputs and
        record the step (timed from ``t0``, the start of the call that reads it)."""
        launched, number, change = inflight
        out = launched.out
        tokens = launched.wait()
        before = self._io_counters()
        self.graphs.experts.settle(launched.counts)
        got, _ = self.scheduler.commit(out, tokens, self.clock.now(), self.eos_token_ids)
        self._generated += len(got)
        outputs = []
        for req in got:
            finished = req.status is Status.FINISHED
            outputs.append(self._output(req, [req.output_token_ids[-1]], finished))
            if finished:
                self._forget(req.request_id)
        self._record(out, t0, change, before, len(out.chunks), compile_count() - compiles_before, True, number)
        return outputs

    def _step_sync(self, t0: float, compiles_before: int) -> list[RequestOutput]:
        """Schedule, execute, postprocess: the step whose tokens are read before it returns."""
        replays_before = self.graphs.replays if self.graphs is not None else 0
        self.policy.begin_step()
        moved = self._compact_kv()
        before = self._io_counters()
        out = self.scheduler.schedule()  # asks policy.releasable_l2_pages() when KV runs short
        change = 0
        outputs: list[RequestOutput] = []
        decode_tokens = sum(1 for c in out.chunks if c.num_tokens == 1 and c.samples)  # before update() appends
        try:
            change = self.policy.after_schedule(out, self.allocator.free_l2_pages(EXPERT))
            if not out.is_empty:
                outputs = self._execute_and_postprocess(out)
        finally:
            self.policy.after_forward()  # shrunk experts go back to the pool even when the step failed
        if not out.is_empty:
            graphed = self.graphs is not None and self.graphs.replays > replays_before
            self._record(out, t0, change, before, decode_tokens, compile_count() - compiles_before, graphed,
                         moved=moved)
        return outputs

    def _execute_and_postprocess(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Execute, then sample, advance the requests (the scheduler finishes them and frees their KV), and
        build the outputs."""
        try:
            logits = self.executor.execute(out)
        except FatalEngineError:  # e.g. a dead tensor-parallel rank: the engine cannot take another step
            raise
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, not the engine
            log.exception("forward pass failed; failing the %d requests of this step", len(out.chunks))
            self.loader.abandon_step()
            return [self._fail(c.request, exc) for c in out.chunks]
        samplers = [c for c in out.chunks if c.samples]
        failed = self._score_prompts(out, logits[len(samplers):])
        logits = logits[:len(samplers)]
        tokens = self._sample(logits, samplers)  # row i is samplers[i]; its argmax().tolist() synchronises
        if not samplers and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing sampled: wait for the forward so the step is timed whole
        if self.graphs is not None:
            self.graphs.settle()  # the replay's device counters, now that the step has synchronised
        failed += [self._fail(c.request, t) for c, t in zip(samplers, tokens) if isinstance(t, Exception)]
        if failed:
            out = dataclasses.replace(out, chunks=tuple(c for c in out.chunks if not c.request.is_finished))
        rows = {c.request.request_id: i for i, c in enumerate(samplers) if not c.request.is_finished}
        sampled = {rid: tokens[i] for rid, i in rows.items()}
        now = self.clock.now()
        finished = {r.request_id for r in self.scheduler.update(out, sampled, now, self.eos_token_ids)}
        self._generated += len(sampled)
        outputs = failed
        for chunk in samplers:
            req = chunk.request
            rid = req.request_id
            if rid not in rows:
                continue
            output = self._output(req, [sampled[rid]], rid in finished)
            if req.params.logprobs is not None:
                output.logprobs = _logprobs(logits[rows[rid]:rows[rid] + 1], [sampled[rid]], req.params.logprobs)
            if req.params.prompt_logprobs is not None and len(req.output_token_ids) == 1:
                scores = self._prompt_scores.pop(rid, {})
                output.prompt_logprobs = [None] + [scores.get(p) for p in range(len(req.prompt_token_ids) - 1)]
            outputs.append(output)
            if rid in finished:
                self._forget(rid)
        return outputs

    def _score_prompts(self, out: SchedulerOutput, rows: torch.Tensor) -> list[RequestOutput]:
        """Keep the prompt-token log-probabilities of the chunks that asked for them (the rows after the
        samples); a request whose scoring fails is failed alone."""
        failed, i = [], 0
        for chunk in out.chunks:
            scored = chunk.prompt_scored
            if not scored:
                continue
            req = chunk.request
            try:
                if len(rows) < i + len(scored):
                    raise RuntimeError("this executor returns no prompt logits: prompt_logprobs are unavailable")
                nxt = [req.prompt_token_ids[p + 1] for p in scored]
                entries = _logprobs(rows[i:i + len(scored)], nxt, req.params.prompt_logprobs)
                self._prompt_scores.setdefault(req.request_id, {}).update(zip(scored, entries))
            except Exception as exc:  # noqa: BLE001
                log.exception("prompt scoring failed for request %s", req.request_id)
                failed.append(self._fail(req, exc))
            i += len(scored)
        return failed

    def _sample(self, logits: torch.Tensor, samplers: list) -> list[int | Exception]:
        """One token per sampling chunk; a row whose sampling raises gets the exception instead."""
        params = [c.request.params for c in samplers]
        generators = [self._generators[c.request.request_id] for c in samplers]
        try:
            return sample(logits, params, generators)
        except Exception:  # noqa: BLE001 - find the request(s) at fault, row by row
            tokens: list[int | Exception] = []
            for i in range(len(samplers)):
                try:
                    tokens.append(sample(logits[i:i + 1], params[i:i + 1], generators[i:i + 1])[0])
                except Exception as exc:  # noqa: BLE001
                    log.exception("sampling failed for request %s", samplers[i].request.request_id)
                    tokens.append(exc)
            return tokens

    def _fail(self, req: Request, exc: BaseException) -> RequestOutput:
        """Finish ``req`` with an error and free its pages."""
        self.scheduler.abort(req.request_id, reason="error")
        self._forget(req.request_id)
        self._failed += 1
        output = self._output(req, [], True)
        output.error = f"{type(exc).__name__}: {exc}"
        return output

    def _io_counters(self) -> tuple[int, int, int, int]:
        """(expert bytes over PCIe, experts loaded or read in place, experts touched, next-step prefetches) so far;
        graphed decode steps read misses in place from pinned host memory instead of loading them."""
        carried = self.loader.experts_carried
        if self.graphs is None:
            return self.loader.bytes_loaded, self.loader.experts_loaded, self.provider.experts_touched, carried
        graphed = self.graphs.experts
        in_place = graphed.experts_missed
        return (self.loader.bytes_loaded + in_place * self.loader.expert_bytes, self.loader.experts_loaded + in_place,
                self.provider.experts_touched + graphed.experts_touched, carried)

    def _output(self, req: Request, new: list[int], finished: bool) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt_token_ids, req.output_token_ids, new, finished,
                             req.finish_reason if finished else None, None, req.arrival_time, req.first_token_time,
                             req.token_times, num_output_tokens=len(req.output_token_ids))

    def _record(self, out, t0: float, change: int, loaded_before: tuple[int, int, int, int], decode: int,
                compiles: int = 0, graphed: bool = False, number: int | None = None, moved: int = 0) -> None:
        now = self.clock.now()
        loaded = self._io_counters()
        kv_pages = self.kv.num_allocated_pages
        self.timeline.add(StepRecord(
            step=self.scheduler.forward_steps if number is None else number, time_s=now - self._start,
            step_ms=(now - t0) * 1e3,
            tokens=out.num_tokens, prefill_tokens=out.num_tokens - decode, decode_tokens=decode,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), kv_pages=kv_pages,
            kv_l2_pages=self.kv.l2_pages_for(kv_pages), cached_experts=self.cache.num_cached,
            free_l2_pages=self.allocator.free_l2_pages(EXPERT),
            context_tokens=sum(c.start + c.num_tokens for c in out.chunks),
            experts_touched=loaded[2] - loaded_before[2], expert_bytes_loaded=loaded[0] - loaded_before[0],
            experts_loaded=loaded[1] - loaded_before[1], r_b=out.kv_short_l2, adjust=change,
            preempted=len(out.preempted), compiles=compiles, cuda_graph=int(graphed), kv_pages_moved=moved,
            experts_carried=loaded[3] - loaded_before[3]))

    def timeline_seconds(self) -> float:
        """Now on the timeline's axis (``StepRecord.time_s``: seconds of ``clock`` since the engine was built)."""
        return self.clock.now() - self._start

    def stats(self) -> EngineStats:
        kv_pages = self.kv.num_allocated_pages
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), kv_pages=kv_pages,
            cached_experts=self.cache.num_cached, free_l2_pages=self.allocator.free_l2_pages(EXPERT),
            peak_concurrency=self.scheduler.peak_concurrency, forward_steps=self.scheduler.forward_steps,
            preemptions=self.scheduler.num_preemptions, generated_tokens=self._generated,
            expert_bytes_loaded=self._io_counters()[0], failed_requests=self._failed)

    # ------------------------------------------------------------------ offline API
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts as strings (needs a tokenizer) or token-id lists; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            tokens = self._encode(prompt)
            rid = f"gen-{id(self)}-{i}-{time.perf_counter_ns()}"
            self.add_request(rid, tokens, p)
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.has_unfinished_requests():
                for o in self.step():
                    if o.finished:
                        done[o.request_id] = o
                        bar.update(1)
        results = [done[r] for r in ids]
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        return results

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]

    def profile_hotset(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> Hotset:
        """Run calibration prompts to completion and return the hotset their routing gives (the one profiler:
        `rimuru profile`, the pipeline and the GPU run call this). Needs ``record_routing=True``."""
        if self.model.routing_counts is None:
            raise RuntimeError("create the engine with record_routing=True to profile routing")
        self.generate(prompts, params, use_tqdm=False)
        return self.routing_hotset()

    def routing_hotset(self) -> Hotset:
        """The hotset measured from the routing recorded so far (``record_routing=True``)."""
        counts = self.model.routing_counts if self.model is not None else None
        if counts is None:
            raise RuntimeError("create the engine with record_routing=True to profile routing")
        decode = self.model.decode_routing_counts
        k = self.spec.top_k
        return Hotset.from_counts(counts.numpy().astype(np.float64), int(counts[0].sum()) // k, self.model_name,
                                  decode.numpy().astype(np.float64), int(decode[0].sum()) // k)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode CUDA graphs (None: every step eager). The executor owns them; this is a read."""
        return None if self._local_executor is None else self._local_executor.graphs

    @contextlib.contextmanager
    def use_async_scheduling(self, enabled: bool):
        """``with llm.use_async_scheduling(False):`` the block's steps each wait for their own tokens (the step in
        flight, if any, finishes first); the previous setting returns after the block. For A/B runs."""
        previous, self._async = self._async, enabled
        try:
            yield
        finally:
            self._async = previous

    def use_graphs(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """``with llm.use_graphs(False):`` runs the block's steps eagerly, on the very path ``enforce_eager``
        takes (``True``: decode steps replay the graphs again); the previous setting returns after the block.
        Nothing changes on an engine without graphs."""
        if self._local_executor is None:
            return contextlib.nullcontext()
        return self._local_executor.use_graphs(enabled)

    def use_kernels(self, spec: str) -> None:
        """Launch the decode kernel levers ``spec`` (``rimuru.kernels.variants``: ``fast``, a list of levers) from now
        on and recapture the decode graphs with them, on every rank (``TensorParallelGroup.use_kernels``). The levers
        are per process: another engine in this process launches them too, and keeps the graphs it captured before
        until it is switched as well. For A/B runs."""
        if self.tp_group is not None:
            self.tp_group.use_kernels(self, spec)
            return
        from rimuru.kernels import variants

        variants.parse(spec)  # a clear error before anything changes
        switch_kernels(self, spec)

    @contextlib.contextmanager
    def collective_timing(self):
        """With tensor parallelism, within the block rank 0 times each all-reduce (CUDA events:
        ``comm.pop_all_reduce_ms``) and records each worker's lateness per step (``executor.pop_lateness``); both
        start empty. A no-op on one rank."""
        if self.tp_group is None:
            yield
            return
        self.comm.pop_all_reduce_ms()
        self.executor.pop_lateness()
        self.comm.timing = self.executor.timing = True
        try:
            yield
        finally:
            self.comm.timing = self.executor.timing = False

    def fall_back_to_eager(self) -> None:
        """Serve every later step eagerly (after a failed graph capture, say): the executor drops its decode
        graphs, as ``enforce_eager`` would have from the start."""
        if self._local_executor is not None:
            self._local_executor.drop_graphs()

    def warmup_or_eager(self, max_seq_len: int | None = None) -> dict:
        """:meth:`warmup`; when it raises (a failed graph capture, say) the error is logged with its traceback
        and the engine serves every step eagerly (:meth:`fall_back_to_eager`), so one failure does not cost a
        whole measured run. Returns warmup's dict, or ``{"compiles": None, "graphs": 0, "failed": error}``.
        A dead tensor-parallel rank still raises."""
        try:
            return self.warmup(max_seq_len)
        except FatalEngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the result and the log, then served eagerly
            log.exception("warm-up failed; serving eagerly")
            self.fall_back_to_eager()
            return {"compiles": None, "graphs": 0, "failed": f"{type(exc).__name__}: {exc}"}

    def warmup(self, max_seq_len: int | None = None) -> dict[str, int]:
        """Compile every kernel variant a run can launch and capture the decode CUDA graphs, so that no request
        pays a JIT compile: decode with and without KV splits, each prefill tile height, each fused-MoE tile
        config (eager loads and, for graphs, in-place host reads), then one graph per batch bucket. Reads pool
        pages as dummy inputs and discards the results; writes no KV. Returns what it did (compiles, graphs).
        ``max_seq_len`` is accepted for compatibility; every split count shares two kernel variants now."""
        if self.device.type != "cuda" or self.model is None:
            self._freeze_heap()
            return {"compiles": 0, "graphs": 0}
        from rimuru.kernels.fused_moe import fused_moe, warmup_token_counts
        from rimuru.kernels.paged_attention import MIN_TOKENS_PER_SPLIT, decode_attention, prefill_attention, write_kv

        if self.tp_group is not None:
            self.tp_group.send(("warmup", max_seq_len))
        before = compile_count()
        spec, dev, dtype = self.spec, self.device, self.config.torch_dtype
        attn = self.model.attention_config  # this rank's heads (tensor parallelism shards them)
        heads = attn.num_heads
        block = self.config.block_tokens
        kv = self.pool.view(KV)
        scale = spec.head_dim**-0.5
        for splits in (1, 2):  # SPLIT=False / True: the only two decode variants
            seq = splits * MIN_TOKENS_PER_SPLIT
            q = torch.randn(1, heads, spec.head_dim, device=dev, dtype=dtype)
            table = torch.zeros(1, -(-seq // block), dtype=torch.int32, device=dev)
            decode_attention(q, kv, table, torch.tensor([seq], dtype=torch.int32, device=dev), scale,
                             max_seq_len=seq, num_splits=splits)
        # the KV write, every slot skipped (negative): nothing is written. Decode-graph capture compiles it too, but
        # hybrid models have no graphs, and their first step compiled it (H200, main 3966996)
        kv_rows = torch.randn(2, attn.num_kv_heads, spec.head_dim, device=dev, dtype=dtype)
        write_kv(kv_rows, kv_rows, kv, torch.full((2,), -1, dtype=torch.int32, device=dev),  # int32: the upload's
                 impl=self.config.attention_impl)
        group = heads // attn.num_kv_heads
        for q_len in sorted({max(1, -(-rows // group)) for rows in (16, 32, 64, 128)} | {2}):  # each tile height
            q = torch.randn(q_len, heads, spec.head_dim, device=dev, dtype=dtype)
            table = torch.zeros(1, -(-q_len // block), dtype=torch.int32, device=dev)
            cu = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
            prefill_attention(q, kv, table, cu, torch.tensor([q_len], dtype=torch.int32, device=dev), scale,
                              max_query_len=q_len)
        experts, k = spec.num_experts, spec.top_k
        ep = self.expert_placement
        local = experts if ep is None else ep.per_rank  # expert parallelism: its experts whole, plus the null id
        table = torch.zeros(local, PAGES_PER_EXPERT, dtype=torch.int32, device=dev)
        f = spec.moe_intermediate_size // (1 if ep is not None else self.comm.world_size)
        for m in warmup_token_counts(experts, k, f, spec.hidden_size):
            ids = torch.randint(0, local + (ep is not None), (m, k), device=dev, dtype=torch.int32)
            weights = torch.full((m, k), 1.0 / k, device=dev)
            fused_moe(torch.randn(m, spec.hidden_size, device=dev, dtype=dtype), weights, ids,
                      self.pool.view(EXPERT).tensor, table,
                      **({} if ep is None else {"null_expert": local, "tile_experts": experts}))
        # routing with and without a padding mask (graphs pass one, eager steps do not), and the fused residual
        # add + RMSNorm for each addend shape (a sub-layer's output, a token's k expert rows) and a shared expert
        from rimuru.kernels.norm_rope import add_rms_norm, warmup_routing

        warmup_routing(experts, spec.hidden_size, k, spec.norm_topk_prob, dtype, dev, self.model.expert_map)
        self.model.warmup_projections()  # the few-row projection kernel (``gemv`` lever) at each row-block height
        self.model.warmup_eager(kv)  # the first norm and the q/k norm + RoPE + KV write, as eager steps launch them
        h = torch.randn(2, spec.hidden_size, device=dev, dtype=dtype)
        norm = torch.ones(spec.hidden_size, device=dev, dtype=dtype)
        for addend in (h, torch.randn(2, k, spec.hidden_size, device=dev, dtype=dtype)):
            for extra in (None, h):
                add_rms_norm(h, addend, norm, spec.rms_norm_eps, extra=extra)
        if spec.is_hybrid:  # GDN decode, fla's chunked prefill (autotuned once), the conv update
            self._local_executor.warmup_states()  # this rank's executor (rank 0 of a TP group wraps it)
        if self.graphs is not None and not self.graphs.graphs:
            self.graphs.capture()
        torch.cuda.synchronize(dev)
        if self.tp_group is not None:
            self.tp_group.gather("warm")
        self._freeze_heap()
        return {"compiles": compile_count() - before, "graphs": len(self.graphs.graphs) if self.graphs else 0}

    def _freeze_heap(self) -> None:
        """After warm-up the live heap (model, engine, graphs, queued requests) leaves Python's cyclic collector
        (``gc.freeze``, as vLLM's engine does after start-up), so that a collection inside a serving step does not walk
        it (a host pause in a 2 ms graphed step is a stall). Unfrozen first, so that an engine discarded before this one
        is collected; :meth:`close` unfreezes. ``EngineConfig.gc_freeze`` switches it (process-wide, as ``gc`` is).
        With ``EngineConfig.gc_idle_collect`` the engine also holds the collector's young threshold raised until
        :meth:`close` and collects when a step call leaves it idle (:meth:`step`, rimuru.engine.gc_policy). Only this
        process: tensor-parallel workers keep Python's automatic collection."""
        if self.config.gc_idle_collect and not self._gc_held:  # rimuru.engine.gc_policy: collect at idle instead
            YoungThreshold.hold(self.config.gc_young_threshold)
            self._gc_held = True
        if not self.config.gc_freeze:
            return
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self._froze_heap = True
        _unfreeze_at_exit()

    def check_integrity(self) -> None:
        """Allocator and cache invariants; with tensor parallelism on every rank, and every rank's allocator
        state equal to rank 0's."""
        self.allocator.check_integrity()
        self.cache.check()
        self.policy.check()  # the loading buffers' pages
        if isinstance(self.kv, HybridCacheManager):
            self.kv.check({r.request_id for r in self.scheduler.running})
        if self.tp_group is not None:
            self.tp_group.send(("check", self.executor.sender.drain_ops()))
            mine = state_digest(self)
            for rank, (digest,) in enumerate(self.tp_group.gather("checked"), start=1):
                if digest != mine:
                    raise self.tp_group.fail(TensorParallelError(
                        f"tensor-parallel rank {rank}'s pool state differs from rank 0's"))


def _logprobs(rows: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Each row's log-softmax: the given token's log-probability and the top ``k`` (raw logits, like vLLM)."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    chosen = lp[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()
    if k:
        values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, c, top) for t, c, top in zip(token_ids, chosen, tops)]


def _unfreeze_at_exit() -> None:
    """Once per process: unfreeze before the interpreter's final collection, so that frozen objects are finalized
    (extension types report instances still alive at exit as leaks)."""
    global _UNFREEZE_REGISTERED
    if not _UNFREEZE_REGISTERED:
        atexit.register(gc.unfreeze)
        _UNFREEZE_REGISTERED = True


_UNFREEZE_REGISTERED = False
