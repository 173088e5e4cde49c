"""Cost model of one forward step: attention, dense layers, MoE, expert loads over PCIe overlapped as
the dual-buffer loader schedules them, host time, tensor-parallel all-reduce, CPU-computed experts.

Peak numbers come from a hardware profile (config/hardware/*.yaml); efficiencies and host times from
``CostParams`` (fitted to H200 measurements by ``rimuru.engine.modeled.calibration``). Each device term
is a roofline: ``max(bytes / (peak bandwidth x efficiency), FLOPs / (peak FLOPs x efficiency))``.

Per step, layer by layer, two timelines (``layer_pipeline``): the compute stream and the copy stream.
Expansions the adjuster started this step are queued on the copy stream first. In MoE layer ``l`` the
host learns the routed experts (one sync with paged experts), queues the misses that were not
prefetched (demand loads) and then the predicted misses of layer ``l + 1`` (prefetch into the other
buffer); layer ``l``'s experts wait for every copy queued before (one CUDA event on one stream), so a
late prefetch or an expansion stalls the layer, and prefetches overlap the layer's compute.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from rimuru.engine.modeled.hardware import GpuProfile, HostProfile
from rimuru.models.spec import LINEAR_ATTENTION, ModelSpec

# the terms of a decode-graph replay that follow its kernels (CostParams.decode_kernels): the fixed device time per
# layer, the in-place reads' PCIe efficiency and the replay's host time
DECODE_KERNEL_TERMS = ("graph_layer_us", "inplace_eff", "host_graph_step_ms")
# the terms of an eager step's host work and expert copies that follow the engine's code (CostParams.engine_terms):
# per step, per scheduled request, per computed token, per MoE layer with a routing sync and the share of it after the
# sync, and the copies' rate (the copy path is the engine's too: which stream, how the copies are queued)
ENGINE_TERMS = ("host_step_ms", "host_seq_us", "token_us", "host_layer_sync_ms", "host_layer_post_share", "pcie_eff")
# the terms that are host time (the engine thread's Python, dispatch and launches): CostParams.with_host_slowdown scales
# them; device, copy and CPU-expert terms stay (wave 16: one H200 host ran these at two speeds 1.3-1.5x apart)
HOST_TERMS = ("host_step_ms", "host_seq_us", "token_us", "host_layer_sync_ms", "host_layer_async_ms",
              "host_graph_step_ms", "resident_token_us", "resident_seq_us", "loop_step_us", "loop_seq_us",
              "loop_eager_us", "tp_step_ms", "tp_layer_ms", "tp_step_async_ms", "tp_layer_async_ms",
              "tp_graph_async_ms", "gdn_eager_layer_ms", "host_admit_us", "host_finish_us")


def _wave_terms(table: dict, wave: int, allowed: tuple[str, ...], field_name: str, name: str, kind: str,
                fitted_note: str = "") -> dict:
    """The terms ``table`` (``CostParams.decode_kernels`` or ``engine_terms``: {wave: {term: value}}) holds for
    ``wave``; an error names the fitted waves where there are none, and any term outside ``allowed``."""
    terms = table.get(str(int(wave)))
    if terms is None:
        raise ValueError(f"no {name} terms fitted for wave {wave} (fitted: {', '.join(sorted(table)) or 'none'}"
                         f"{fitted_note})")
    unknown = set(terms) - set(allowed)
    if unknown:
        raise ValueError(f"{field_name}[{wave}] has terms {sorted(unknown)} that are not {kind} terms "
                         f"({', '.join(allowed)})")
    return terms


@dataclass(frozen=True)
class CostParams:
    """Efficiencies (fractions of a profile's peaks) and host times; defaults are uncalibrated guesses."""

    hbm_eff: float = 0.7  # streaming reads (weights, KV) of peak HBM bandwidth
    mma_eff: float = 0.5  # GEMMs (dense layers, MoE at large M) of peak bf16 FLOPs
    attn_eff: float = 0.3  # prefill attention of peak bf16 FLOPs
    pcie_eff: float = 1.0  # expert copies of the profile's pinned H2D bandwidth
    gpu_layer_us: float = 40.0  # device time per layer that no roofline term covers (small kernels)
    host_step_ms: float = 3.0  # schedule, prepare inputs, sample, update: once per step
    host_seq_us: float = 10.0  # per scheduled request
    host_admit_us: float = 0.0  # (wave 18) per request admitted in the step (its first chunk: start 0; a preempted
    # request recomputed is admitted again): the scheduler's admission (its KV pages) and its first inputs, before
    # the launches. 0: not modeled (the calibrations through wave 17)
    host_finish_us: float = 0.0  # (wave 18) per request the step finishes: its last output and its finish (KV pages
    # freed), after the device work. Both measured on eager prefill steps that admit and finish 1-256 prompts
    # (results/reference/engine/prefill_requests_a7111e4; calibration.admission_terms)
    token_us: float = 0.0  # eager step, per computed token: work no roofline or per-request term covers (input
    # preparation and routing bookkeeping that grow with a prefill chunk, the MoE's per-token gather/scatter)
    host_layer_sync_ms: float = 2.0  # per layer with a routing sync (paged experts): host and device serial
    host_layer_async_ms: float = 1.0  # per layer without one (resident experts): overlaps the device
    prefetch_recall: float = 0.8  # fraction of a layer's misses the predictor loads ahead (layers >= 1)
    prefetch_waste: float = 0.05  # predicted experts loaded but not routed to, per miss
    host_graph_step_ms: float = 0.5  # a step that replays a decode CUDA graph: its host time (no per-layer term)
    inplace_eff: float = 0.8  # graphed offloading steps read missed experts in place: of pinned H2D bandwidth
    cpu_dram_eff: float = 0.6  # CPU-computed experts: of the host's DRAM bandwidth
    cpu_flops_eff: float = 0.3  # of the host's peak bf16 FLOPs
    cpu_layer_us: float = 60.0  # activations to the host and back, one sync per layer
    resident_token_us: float | None = None  # token_us of an eager step without a routing sync (every expert resident:
    # static), whose MoE bookkeeping stays on the device; None: token_us (no such serving step was fitted)
    resident_seq_us: float | None = None  # host_seq_us of a step (eager or graphed) with every expert resident (no
    # routing sync; the resident provider's host path); None: host_seq_us
    loop_step_us: float = 0.0  # the serving loop's host time between two steps, outside LLM.step (rimuru.bench.inproc:
    loop_seq_us: float = 0.0  # each step's outputs handled, arrivals admitted): per step + per output + after an
    loop_eager_us: float = 0.0  # eager step; replay adds it after every step
    tp_step_ms: float = 0.0  # tensor parallelism, per step: rank 0 sends the step message before it launches, and the
    # peers launch later (a collective waits for the latest rank); on the host path, before the device work
    tp_layer_ms: float = 0.0  # tensor parallelism, per MoE layer with a routing sync (eager paged steps): every rank
    # syncs on its routing and the layer's all-reduce waits for the slowest
    tp_step_async_ms: float | None = None  # tp_step_ms of an engine with async scheduling (its rank 0 schedules and
    # launches a graphed step while the step before runs; the term sits in the host time that max(host, device)
    # overlaps, CostModel.graphed_step); None: tp_step_ms (calibration.fit_tp_async)
    tp_layer_async_ms: float | None = None  # tp_layer_ms of an engine with async scheduling; None: tp_layer_ms
    tp_graph_async_ms: float = 0.0  # tensor parallelism, per decode-graph replay of an engine with async scheduling,
    # on top of the per-step term: rank 0 sends each replay to its peers (the TP Poisson runs' send-to-launch is
    # 0.72-0.87 ms a replay, a one-GPU replay's host 0.52); host time, which max(host, device) overlaps
    # (calibration.fit_tp_graph, fitted on a TP Poisson run's graph replays)
    gdn_prefill_layer_ms: float = 0.0  # a hybrid's Gated DeltaNet layer in a step that is not pure decode (it runs
    # fla's chunked prefill for every sequence of the step, and the conv over the chunk): per layer, launches and the
    # chunk pipeline's fixed work, beyond the state/FLOPs roofline (calibration.fit_gdn_prefill)
    gdn_eager_layer_ms: float = 0.0  # a hybrid's Gated DeltaNet layer in an eager step, decode or chunked: host time of
    # its launches beyond an attention layer's (four input projections, the conv, the recurrent kernel, a gated norm),
    # added to the layer's host term (serial with the device under a routing sync, overlapped without one)
    # (calibration.fit_gdn_eager, fitted on hybrid decode floors)
    eager_host_overlap: bool = False  # (wave 16) an eager step with a routing sync: a layer's host launches run while
    # the previous layer's experts (and the copies they wait for) run on the device; the host waits only at the next
    # routing sync (layer_pipeline_overlap). False: a layer's host and device time serial, then its experts, then the
    # next layer's host time (layer_pipeline; the model through wave 15)
    host_layer_post_share: float = 0.0  # (wave 17) with eager_host_overlap: the share of host_layer_sync_ms the host
    # spends after the layer's routing sync (the misses' bookkeeping, the copies' and the experts' launches): the
    # layer's copies and experts start only after it, so it is serial with the device; the rest is the launches
    # before the sync, which overlap the previous layer's experts. 0: all of it before the sync (wave 16's pipeline).
    # Measured: a 48-layer eager paged prefill step runs ~2.0 ms a layer once its device work nears the host's
    # (results/reference/engine/prefill_floor48L_093469c)
    routing_chunk_scale: float = 1.0  # a prefill chunk of q tokens routes like min(q, scale * q ** exponent)
    routing_chunk_exponent: float = 1.0  # independent tokens (RoutingModel.effective_tokens); 1, 1: independent
    routing_prior_tokens: float = 0.0  # a hotset layer worth n tokens is shrunk toward uniform, weight prior/(n+prior)
    # (routing.shrink_to_uniform; calibration.fit_routing_prior); 0: the profile as measured
    routing_reference_curve: tuple = ()  # sorted popularity curve of profiles of many prompts (sums to 1): a layer's
    # unseen experts against it give n (routing.effective_profile_tokens); empty: n = the hotset's num_tokens
    graph_layer_us: float | None = None  # device time per layer of a decode-graph replay that no roofline covers;
    # None: gpu_layer_us (one term for eager and graphed steps, as fitted on the base calibration's decode floors)
    decode_kernels: dict = field(default_factory=dict)  # {wave: {term: value}}: the graph-replay terms (DECODE_KERNEL_
    # TERMS) fitted on decode floors measured with another wave's decode kernels (rimuru.kernels.variants: "4" the
    # wave-4 kernels, "5" wave5, "7" fast), for the runs of commits that launched those (with_decode_kernels)
    decode_kernels_base: int | None = None  # the kernels' wave of the base calibration's decode floors (its terms)
    engine_terms: dict = field(default_factory=dict)  # {wave: {term: value}}: the eager-step host and copy terms
    # (ENGINE_TERMS) fitted on the serving steps of the engine of that wave (calibration.fit_engine_terms), for the
    # runs of commits that ran that engine (with_engine_terms); the base terms serve every other commit
    engine_terms_scope: dict = field(default_factory=dict)  # {wave: {"tp": [sizes], "hybrid": bool}}: what that
    # wave's fit data served (tensor-parallel sizes, a hybrid model or not). A run outside it keeps the base terms:
    # the TP and hybrid terms (tp_*, gdn_*) were fitted on top of the base host terms and are not refitted on these
    fitted: dict = field(default_factory=dict, compare=False)  # how and on what the numbers were fitted

    def eager_token_us(self, sync: bool) -> float:
        """Per computed token of an eager step with (``sync``: paged experts) or without a routing sync."""
        return self.token_us if sync or self.resident_token_us is None else self.resident_token_us

    def seq_us(self, sync: bool) -> float:
        """Per scheduled request of a step with (paged experts) or without a routing sync (every expert resident)."""
        return self.host_seq_us if sync or self.resident_seq_us is None else self.resident_seq_us

    def loop_ms(self, outputs: int, graphed: bool) -> float:
        """The serving loop's time after a step that returned ``outputs`` request outputs."""
        return (self.loop_step_us + self.loop_seq_us * outputs + (0.0 if graphed else self.loop_eager_us)) * 1e-3

    def graph_layer_ms(self) -> float:
        """Device time per layer of a decode-graph replay that no roofline covers."""
        return (self.gpu_layer_us if self.graph_layer_us is None else self.graph_layer_us) * 1e-3

    def decode_kernel_terms(self, wave: int | None) -> str:
        """Which terms an engine of decode-kernel wave ``wave`` replays with: ``base`` (the base calibration's: ``wave``
        is None or its floors' wave), ``wave N`` (fitted on that wave's floors) or ``missing`` (neither: the
        replay can only stand in the base terms, and says so)."""
        if wave is None or wave == self.decode_kernels_base:
            return "base"
        return f"wave {int(wave)}" if str(int(wave)) in self.decode_kernels else "missing"

    def with_decode_kernels(self, wave: int | None) -> CostParams:
        """The parameters of an engine that launched wave ``wave``'s decode kernels: the base calibration's where
        ``wave`` is None or ``decode_kernels_base``, else the graph-replay terms fitted on that wave's decode floors
        (``decode_kernels``); an error names the fitted waves otherwise."""
        if wave is None or wave == self.decode_kernels_base:
            return self
        terms = _wave_terms(self.decode_kernels, wave, DECODE_KERNEL_TERMS, "decode_kernels", "decode-kernel",
                            "graph-replay", f"; base: {self.decode_kernels_base}")
        return self.replace(**{k: float(v) for k, v in terms.items()})

    def engine_term_source(self, wave: int | None, tp: int = 1, hybrid: bool = False) -> str:
        """Which eager-step host and copy terms a run of engine wave ``wave`` (at tensor-parallel size ``tp``, of a
        hybrid model or not) replays with: ``base`` (``wave`` is None or 0: the base calibration's), ``wave N``
        (fitted on that engine's serving steps), ``base: outside wave N`` (a configuration its fit data did not serve,
        ``engine_terms_scope``) or ``missing`` (none fitted for it: the base terms stand in, and the replay says so)."""
        if not wave:
            return "base"
        if str(int(wave)) not in self.engine_terms:
            return "missing"
        return f"wave {int(wave)}" if self.in_engine_scope(wave, tp, hybrid) else f"base: outside wave {int(wave)}"

    def in_engine_scope(self, wave: int, tp: int, hybrid: bool) -> bool:
        """Whether wave ``wave``'s fit data served this configuration (no scope recorded: every configuration)."""
        scope = self.engine_terms_scope.get(str(int(wave)))
        return scope is None or (int(tp) in scope["tp"] and bool(hybrid) == bool(scope["hybrid"]))

    def with_engine_terms(self, wave: int | None, tp: int = 1, hybrid: bool = False) -> CostParams:
        """The parameters of the engine of wave ``wave`` at tensor-parallel size ``tp``, of a hybrid model or not: the
        base calibration's where ``wave`` is None or 0 or the configuration lies outside the wave's fit data
        (``engine_terms_scope``), else the eager-step host and copy terms fitted on that engine's serving steps
        (``engine_terms``); an error names the fitted waves otherwise."""
        if not wave:
            return self
        terms = _wave_terms(self.engine_terms, wave, ENGINE_TERMS, "engine_terms", "engine", "engine")
        if not self.in_engine_scope(wave, tp, hybrid):
            return self
        return self.replace(**{k: float(v) for k, v in terms.items()})

    def with_host_slowdown(self, factor: float) -> CostParams:
        """The parameters of a host ``factor`` times slower (``HOST_TERMS`` multiplied; 1: these). The calibration's
        host terms are one host's at the time of its fit data; wave 16 measured the H200 machine's engine thread at
        two speeds 1.3-1.5x apart within one call (docs/modeled.md), and the paper's cards sit in other hosts."""
        if not factor > 0:
            raise ValueError(f"host slowdown must be > 0, got {factor}")
        if factor == 1:
            return self
        return self.replace(**{k: getattr(self, k) * factor for k in HOST_TERMS if getattr(self, k) is not None})

    def tp_terms(self, async_scheduling: bool) -> tuple[float, float]:
        """(per-step, per-MoE-layer) host terms of a tensor-parallel step: those fitted on an engine with async
        scheduling where ``async_scheduling`` and they were fitted, else the synchronous engine's."""
        if async_scheduling and self.tp_step_async_ms is not None:
            return float(self.tp_step_async_ms), float(self.tp_layer_async_ms or 0.0)
        return self.tp_step_ms, self.tp_layer_ms

    def tp_graph_ms(self, async_scheduling: bool) -> float:
        """The per-replay host term of a tensor-parallel decode graph (``tp_graph_async_ms``: engines with async
        scheduling; 0 for the synchronous engine, which has none fitted)."""
        return float(self.tp_graph_async_ms) if async_scheduling else 0.0

    def replace(self, **changes) -> CostParams:
        return CostParams(**(asdict(self) | changes))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostParams:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown cost parameters {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class StepWork:
    """What one step computes, as the modeled executor sees it (per MoE layer arrays are [num_moe_layers])."""

    q_lens: np.ndarray  # [R] tokens computed per scheduled request
    starts: np.ndarray  # [R] first position computed
    samples: int  # rows that reach the lm_head
    touched: np.ndarray  # [M] experts computed on the device per MoE layer
    demand: np.ndarray  # [M] experts loaded after the layer's routing sync
    prefetched: np.ndarray  # [M] experts loaded for the layer during the previous layer
    cpu_experts: np.ndarray | None = None  # [M] experts computed on the host (cpu policy)
    cpu_share: np.ndarray | None = None  # [M] fraction of token->expert assignments computed on the host
    expansion_experts: int = 0  # cache expansions queued on the copy stream at step start
    sync_per_layer: bool = True  # paged experts: the host waits for routing in every MoE layer
    graphed: bool = False  # the step replays a decode CUDA graph: no host work per layer, misses read in place
    in_place: np.ndarray | None = None  # [M] graphed: experts read in place from pinned host memory over PCIe
    carried_experts: int = 0  # copies the step before queued at its end (next-step prefetch of the first layer):
    # on the copy stream while this step's host work runs, ahead of this step's copies
    overlapped: bool = False  # graphed and launched while the step before it ran (async scheduling): its host
    # work hides behind the device, the step takes max(host, device) instead of host + device
    admitted: int = 0  # requests whose first chunk the step computes (CostParams.host_admit_us)
    finished: int = 0  # requests the step finishes (CostParams.host_finish_us)

    @property
    def tokens(self) -> int:
        return int(self.q_lens.sum())


@dataclass(frozen=True)
class StepTime:
    total_ms: float
    host_ms: float
    attention_ms: float
    dense_ms: float
    moe_ms: float
    load_stall_ms: float
    allreduce_ms: float
    cpu_ms: float
    loads_ms: float  # copy-stream busy time (expert bytes / PCIe)


def layer_pipeline(pre_ms: np.ndarray, moe_ms: np.ndarray, demand_ms: np.ndarray, prefetch_ms: np.ndarray,
                   expansion_ms: float) -> tuple[float, float]:
    """Compute and copy streams over the MoE layers; returns (compute end, stall waiting for copies).

    ``pre_ms[l]``: everything of layer ``l`` before its experts run (attention, dense, host); ``moe_ms[l]``:
    its experts; ``demand_ms[l]`` copies queued after layer ``l``'s routing; ``prefetch_ms[l]`` copies for
    layer ``l`` queued after layer ``l - 1``'s demand copies.
    """
    g, c, stall = 0.0, float(expansion_ms), 0.0
    pre, moe, demand = np.asarray(pre_ms, float).tolist(), np.asarray(moe_ms, float).tolist(), \
        np.asarray(demand_ms, float).tolist()
    prefetch = np.asarray(prefetch_ms, float).tolist() + [0.0]
    for layer in range(len(pre)):
        g += pre[layer]
        c = max(c, g) + demand[layer]  # misses of this layer, issued once the host knows them
        ready = c  # one event after everything queued so far on the copy stream
        c += prefetch[layer + 1]  # the predictor's loads for the next layer into the other buffer
        if ready > g:
            stall += ready - g
            g = ready
        g += moe[layer]
    return g, stall


def layer_pipeline_overlap(host_ms: np.ndarray, device_ms: np.ndarray, moe_ms: np.ndarray, demand_ms: np.ndarray,
                           prefetch_ms: np.ndarray, expansion_ms: float,
                           host_experts_ms: np.ndarray | None = None, post_sync_ms: float = 0.0) -> tuple[float, float]:
    """Host, compute and copy streams over the MoE layers of an eager step with a routing sync per layer
    (``CostParams.eager_host_overlap``); returns (end, stall waiting for copies).

    Layer ``l``: the host launches its work before the experts (``host_ms[l]``) from when it left the previous
    layer's routing sync; the device runs that work (``device_ms[l]``) after the previous layer's experts, and it ends
    no earlier than its last launch. The host then waits for the routing (the sync), queues the layer's demand copies
    (and the next layer's prefetch), launches the experts, which wait for the copies on the device, and goes on to
    the next layer without waiting: the next layer's launches overlap these experts and their copies.
    ``host_experts_ms[l]``: experts the host computes itself (the ``cpu`` policy's), after the sync, beside the
    device's: the host launches the next layer only after them. ``post_sync_ms``: host time after each routing sync
    before the layer's copies and experts are launched (``CostParams.host_layer_post_share``; ``host_ms`` is then the
    launches before the sync only): the copies and the experts start after it.
    """
    host, gpu, copy, stall = 0.0, 0.0, float(expansion_ms), 0.0
    prefetch = np.asarray(prefetch_ms, float).tolist() + [0.0]
    on_host = np.zeros(len(moe_ms)) if host_experts_ms is None else np.asarray(host_experts_ms, float)
    for layer, (h, d, moe, demand, cpu) in enumerate(zip(np.asarray(host_ms, float).tolist(),
                                                          np.asarray(device_ms, float).tolist(),
                                                          np.asarray(moe_ms, float).tolist(),
                                                          np.asarray(demand_ms, float).tolist(), on_host.tolist())):
        host += h
        launched = max(gpu + d, host) + post_sync_ms  # the routing sync, then the copies' and experts' launches
        host = launched + cpu  # then the host's own experts
        copy = max(copy, launched) + demand
        ready = copy
        copy += prefetch[layer + 1]
        stall += max(0.0, ready - launched)
        gpu = max(launched, ready) + moe
    return max(host, gpu), stall


class CostModel:
    """Shapes resolved once for one model, tensor-parallel degree and hardware."""

    def __init__(self, spec: ModelSpec, gpu: GpuProfile, params: CostParams, *, tp: int = 1,
                 host: HostProfile | None = None, dtype_bytes: int = 2, num_layers: int | None = None,
                 async_scheduling: bool = False) -> None:
        """``async_scheduling``: the engine's async scheduling is on (its TP host terms: ``CostParams.tp_terms``)."""
        self.spec, self.gpu, self.params, self.tp, self.host = spec, gpu, params, tp, host
        e = dtype_bytes
        d = spec.hidden_size
        layers = spec.num_layers
        self.num_moe_layers = spec.num_moe_layers
        tables = spec.vocab_size * d * e * (1 if spec.tie_word_embeddings else 2)
        # every rank holds and computes the whole LM head (rimuru.distributed.sharding replicates it)
        self.lm_head_bytes = spec.vocab_size * d * e
        self.lm_head_flops_per_row = 2 * spec.vocab_size * d
        # dense weights of the decoder layers (attention or GDN, router, shared expert, norms) of one rank's shard
        self.layer_dense_bytes = (spec.dense_params(tp) * e - tables - d * e) / layers
        self.layer_dense_flops_per_token = 2 * self.layer_dense_bytes / e
        self.full_layers = len(spec.full_attention_layers)
        self.linear_layers = len(spec.linear_attention_layers)
        self.heads = max(1, spec.num_heads // tp)
        self.kv_bytes_per_token_layer = 2 * spec.heads_per_rank(tp)[1] * spec.head_dim * e
        self.attn_flops_factor = 4 * self.heads * spec.head_dim  # QK^T and PV, per (query, key) pair
        vh, kd, vd = spec.ssm_state_shape(tp) if spec.is_hybrid else (0, 0, 0)
        self.state_bytes = vh * kd * vd * 4  # fp32 recurrent state, read and written once per step
        self.state_flops_per_token = 6 * vh * kd * vd  # delta-rule update and read-out per token
        self.expert_bytes = spec.expert_bytes(tp=tp) * e // 2
        self.expert_flops_per_assignment = 2 * 3 * spec.expert_page_shape(tp)[0] * d
        self.top_k = spec.top_k
        self.hidden = d
        self.dtype_bytes = e
        self.moe_layer_ids = set(spec.moe_layers)
        self.layer_kinds = spec.layer_types
        self._linear_mask = np.array([k == LINEAR_ATTENTION for k in spec.layer_types])
        # host terms of a tensor-parallel step (those of an engine with async scheduling where it has it)
        self.tp_step_ms, self.tp_layer_ms = params.tp_terms(async_scheduling) if tp > 1 else (0.0, 0.0)
        self.tp_graph_ms = params.tp_graph_ms(async_scheduling) if tp > 1 else 0.0

    def linear_layer_mask(self) -> np.ndarray:
        """[M] which MoE layers are Gated DeltaNet layers (the vectorised step model's layer order: every layer MoE)."""
        if not self.linear_layers:
            return np.zeros(self.num_moe_layers, bool)
        if len(self.moe_layer_ids) != len(self.layer_kinds):
            raise NotImplementedError("the vectorised step model (calibration.predict_steps) needs every layer MoE")
        return self._linear_mask

    # ------------------------------------------------------------------ terms (ms)
    def _roof(self, nbytes: float, flops: float, flops_eff: float) -> float:
        p, g = self.params, self.gpu
        return max(nbytes / (g.hbm_bytes_per_s * p.hbm_eff), flops / (g.bf16_flops * flops_eff)) * 1e3

    def attention_ms(self, q_lens: np.ndarray, starts: np.ndarray) -> float:
        """One full-attention layer: causal FLOPs over the chunk's keys, KV bytes read (and written)."""
        q, s = np.asarray(q_lens), np.asarray(starts)
        # (query, key) pairs: each request's q * start + q (q + 1) / 2, whole numbers summed exactly as integers
        pairs = float(int(np.dot(q, s)) + int(np.dot(q, q + 1)) // 2)
        tokens = int(q.sum())
        kv_bytes = float(int(s.sum()) + 2 * tokens) * self.kv_bytes_per_token_layer  # each sequence, then the writes
        return self._roof(kv_bytes, self.attn_flops_factor * pairs, self.params.attn_eff)

    def linear_attention_ms(self, q_lens: np.ndarray) -> float:
        """One GDN layer: each request's recurrent state read and written, delta-rule FLOPs per token; in a step
        with a prefill chunk (any request computing more than one token: the engine's ``is_pure_decode`` is false)
        the chunked path's fixed time too (``CostParams.gdn_prefill_layer_ms``)."""
        tokens = float(q_lens.sum())
        roof = self._roof(2 * self.state_bytes * len(q_lens), self.state_flops_per_token * tokens, self.params.mma_eff)
        chunked = len(q_lens) and q_lens.max() > 1
        return roof + (self.params.gdn_prefill_layer_ms if chunked else 0.0)

    def dense_ms(self, tokens: int) -> float:
        """One decoder layer's dense weights (projections, router, shared expert)."""
        return self._roof(self.layer_dense_bytes, self.layer_dense_flops_per_token * tokens, self.params.mma_eff)

    def moe_ms(self, touched: np.ndarray, assignments: np.ndarray | float) -> np.ndarray:
        """[M] experts' weights read once each, FLOPs per token->expert assignment (``assignments``: [M], or one
        count for every layer)."""
        p, g = self.params, self.gpu
        read = touched * self.expert_bytes / (g.hbm_bytes_per_s * p.hbm_eff)
        compute = assignments * self.expert_flops_per_assignment / (g.bf16_flops * p.mma_eff)
        return np.maximum(read, compute) * 1e3

    def load_ms(self, experts: np.ndarray | float) -> np.ndarray | float:
        return experts * self.expert_bytes / (self.gpu.pcie_h2d_bytes_per_s * self.params.pcie_eff) * 1e3

    def allreduce_ms(self, tokens: int) -> float:
        """Ring all-reduce of one [tokens, d] bf16 activation over ``tp`` ranks (two per layer)."""
        if self.tp == 1:
            return 0.0
        n, g = self.tp, self.gpu
        nbytes = tokens * self.hidden * self.dtype_bytes
        bandwidth = 2 * (n - 1) / n * nbytes / g.allreduce_bus_bytes_per_s
        return (bandwidth + 2 * (n - 1) * g.allreduce_latency_us * 1e-6) * 1e3

    def cpu_ms(self, experts: np.ndarray, assignments: np.ndarray) -> np.ndarray:
        """[M] experts computed on the host: weights from DRAM, FLOPs on its cores (AMX or not)."""
        if self.host is None:
            raise ValueError("CPU-computed experts need a host profile (engine option host=...)")
        p, h = self.params, self.host
        read = experts * self.expert_bytes * self.tp / (h.dram_bytes_per_s * p.cpu_dram_eff)
        compute = assignments * self.expert_flops_per_assignment * self.tp / (h.bf16_flops * p.cpu_flops_eff)
        return np.where(experts > 0, np.maximum(read, compute) * 1e3 + p.cpu_layer_us * 1e-3, 0.0)

    # ------------------------------------------------------------------ one step
    def in_place_ms(self, experts: np.ndarray) -> np.ndarray:
        """[M] missed experts read in place by the graphed MoE kernel from pinned host memory over PCIe."""
        return experts * self.expert_bytes / (self.gpu.pcie_h2d_bytes_per_s * self.params.inplace_eff) * 1e3

    def graphed_step(self, w: StepWork) -> StepTime:
        """One replay of a decode CUDA graph: the host's step work, then every layer back to back on the device
        (no per-layer host time or sync); a layer's experts read the resident ones from HBM and the missed ones
        in place over PCIe, one after the other. Host then device; with ``w.overlapped`` (async scheduling: the
        host scheduled and launched this step while the one before ran) the longer of the two."""
        p = self.params
        tokens = w.tokens
        attn_full = self.attention_ms(w.q_lens, w.starts)
        attn_lin = self.linear_attention_ms(w.q_lens) if self.linear_layers else 0.0
        fixed = p.graph_layer_ms()
        dense = self.dense_ms(tokens) + 2 * self.allreduce_ms(tokens)  # NCCL all-reduces inside the graph
        in_place = np.zeros(self.num_moe_layers) if w.in_place is None else np.asarray(w.in_place, float)
        moe = self.moe_ms(np.asarray(w.touched, float) - in_place, float(tokens * self.top_k))  # same in each layer
        reads = self.in_place_ms(in_place)
        moe_sum, reads_sum = moe.sum(), reads.sum()
        n_layers = len(self.layer_kinds)
        attention = attn_full * self.full_layers + attn_lin * self.linear_layers
        head = self._roof(self.lm_head_bytes, self.lm_head_flops_per_row * w.samples, p.mma_eff)
        host = (p.host_graph_step_ms + p.seq_us(w.sync_per_layer) * 1e-3 * len(w.q_lens) + self.tp_step_ms
                + self.tp_graph_ms + p.host_finish_us * 1e-3 * w.finished)
        # copies the eager step before queued at its end (its next-step prefetch) hold the PCIe link the in-place
        # reads need: their time, less the host work before the replay, adds to the device's (the measured
        # Poisson runs at d9f9d41: 9-10 ms over the two graphed steps after a large prefill)
        carried = max(0.0, float(self.load_ms(w.carried_experts)) - (0.0 if w.overlapped else host))
        device = attention + (dense + fixed) * n_layers + float(moe_sum + reads_sum) + head + carried
        return StepTime(total_ms=max(host, device) if w.overlapped else host + device, host_ms=host,
                        attention_ms=attention,
                        dense_ms=(dense + fixed) * n_layers + head, moe_ms=float(moe_sum + reads_sum),
                        load_stall_ms=carried, allreduce_ms=0.0, cpu_ms=0.0,
                        loads_ms=float(reads_sum) + carried)

    def step(self, w: StepWork) -> StepTime:
        if w.graphed:
            return self.graphed_step(w)
        p = self.params
        tokens = w.tokens
        attn_full = self.attention_ms(w.q_lens, w.starts) if len(w.q_lens) else 0.0
        attn_lin = self.linear_attention_ms(w.q_lens) if self.linear_layers else 0.0
        dense = self.dense_ms(tokens)
        ar = 2 * self.allreduce_ms(tokens)
        host_layer = p.host_layer_sync_ms + self.tp_layer_ms if w.sync_per_layer else p.host_layer_async_ms
        host_linear = host_layer + p.gdn_eager_layer_ms  # a GDN layer's launches (0 unless fitted)
        assignments = tokens * self.top_k * (1 - (w.cpu_share if w.cpu_share is not None else 0.0))
        moe = self.moe_ms(w.touched, assignments * np.ones(self.num_moe_layers))
        cpu = np.zeros(self.num_moe_layers)
        if w.cpu_experts is not None and w.cpu_experts.any():
            cpu = self.cpu_ms(w.cpu_experts, tokens * self.top_k * w.cpu_share)
        moe_total = np.maximum(moe, cpu)  # host and device experts of a layer run side by side
        layer_gpu_fixed = p.gpu_layer_us * 1e-3
        demand, prefetch = self.load_ms(w.demand), self.load_ms(w.prefetched)
        expansion = float(self.load_ms(w.expansion_experts))
        if w.overlapped:
            raise ValueError("only a decode-graph replay overlaps the step before it (async scheduling)")
        scheduling = (p.host_step_ms + p.seq_us(w.sync_per_layer) * 1e-3 * len(w.q_lens)
                      + p.host_admit_us * 1e-3 * w.admitted)
        host = (scheduling + p.eager_token_us(w.sync_per_layer) * 1e-3 * tokens + self.tp_step_ms
                + p.host_finish_us * 1e-3 * w.finished)
        carried = float(self.load_ms(w.carried_experts))  # queued before this step's host work, which hides it
        # up to the first launch: scheduling and per-request preparation (the per-token term is bookkeeping that
        # grows with a chunk during its layers, e.g. the MoE's gather/scatter: it does not precede the device)
        lead = scheduling + self.tp_step_ms
        if w.sync_per_layer and p.eager_host_overlap:  # host launches overlap the previous layer's experts
            device_pre, device_tail = self._prefix(attn_full, attn_lin, dense + layer_gpu_fixed + ar, 0.0, 0.0,
                                                   moe_total, True)
            post = p.host_layer_post_share * p.host_layer_sync_ms  # after each MoE layer's routing sync
            host_pre, host_tail = self._prefix(0.0, 0.0, 0.0, host_layer, host_linear, moe_total, True)
            host_pre = host_pre - post  # each MoE layer's own host term holds it (a dense layer's has no sync)
            gpu_end, stall = layer_pipeline_overlap(host_pre, device_pre, moe, demand, prefetch,
                                                    max(0.0, carried - lead) + expansion, host_experts_ms=cpu,
                                                    post_sync_ms=post)
            tail = device_tail + host_tail
        else:
            pre, tail = self._prefix(attn_full, attn_lin, dense + layer_gpu_fixed + ar, host_layer, host_linear,
                                     moe_total, w.sync_per_layer)
            gpu_end, stall = layer_pipeline(pre, moe_total, demand, prefetch, max(0.0, carried - lead) + expansion)
        gpu_end += tail
        head = self._roof(self.lm_head_bytes, self.lm_head_flops_per_row * w.samples, p.mma_eff)
        total = host + gpu_end + head
        n_layers = len(self.layer_kinds)
        return StepTime(
            total_ms=total, host_ms=host + host_layer * self.num_moe_layers + p.gdn_eager_layer_ms * self.linear_layers,
            attention_ms=attn_full * self.full_layers + attn_lin * self.linear_layers,
            dense_ms=(dense + layer_gpu_fixed) * n_layers + head,
            moe_ms=float(moe.sum()), load_stall_ms=stall, allreduce_ms=ar * n_layers, cpu_ms=float(cpu.sum()),
            loads_ms=float(np.sum(demand) + np.sum(prefetch) + expansion + carried))

    def _prefix(self, attn_full: float, attn_lin: float, other: float, host_layer: float, host_linear: float,
                moe_total: np.ndarray, sync: bool) -> tuple[np.ndarray, float]:
        """[M] time of each MoE layer before its experts run, and time after the last MoE layer. ``host_layer``: a
        layer's host term, ``host_linear`` a GDN layer's."""
        kinds = self.layer_kinds
        if len(self.moe_layer_ids) == len(kinds):  # every layer is MoE: vectorised
            device = np.where(self._linear_mask, attn_lin, attn_full) + other
            host = np.where(self._linear_mask, host_linear, host_layer)
            if sync:
                return device + host, 0.0
            return np.maximum(device + moe_total, host) - moe_total, 0.0
        pre = np.zeros(self.num_moe_layers)
        carry, tail, m = 0.0, 0.0, 0  # dense-MLP layers add to the next MoE layer (or to the end)
        for i, kind in enumerate(kinds):
            device = (attn_lin if kind == LINEAR_ATTENTION else attn_full) + other
            host_layer_i = host_linear if kind == LINEAR_ATTENTION else host_layer
            if i not in self.moe_layer_ids:
                extra = device + host_layer_i if sync else max(device, host_layer_i)
                if m < self.num_moe_layers:
                    carry += extra
                else:
                    tail += extra
                continue
            # with a routing sync host and device alternate; without, the host's launches overlap the device
            pre[m] = carry + (device + host_layer_i if sync else max(device + moe_total[m], host_layer_i)
                              - moe_total[m])
            carry, m = 0.0, m + 1
        return pre, tail
