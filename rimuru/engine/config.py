"""Engine configuration (frozen). The memory policies it names live in ``rimuru.engine.memory_policy``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rimuru.units import parse_bytes

EXECUTORS = ("torch", "modeled")
# dtype by name (vLLM's spellings); "auto" / None: the device's default (EngineConfig.torch_dtype)
DTYPE_NAMES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
               "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
               "float": torch.float32}
EXPERT_PARALLEL_POLICIES = ("static",)  # the policies enable_expert_parallel can serve correctly



def _int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: not isinstance(v, bool) and isinstance(v, int) and v >= low


def _positive_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0


def _one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is c or (type(v) is type(c) and v == c) for c in choices)


def _chunk_law(v: Any) -> bool:
    return len(v) in (2, 3) and v[0] > 0 and 0 < v[1] <= 1 and (len(v) == 2 or 0 < v[2] <= 1)


def _decode_request(v: Any) -> bool:
    return len(v) == 4 and all(math.isfinite(x) for x in v) and v[1] > 0 and v[2] >= 0


def _routing_prior(v: Any) -> bool:
    return len(v) == 2 and v[0] >= 0 and len(v[1]) > 0 and abs(sum(v[1]) - 1) <= 1e-6


@dataclass(frozen=True)
class FieldRule:
    """One field's rule: ``valid(value)``, and what a valid value is, for the error (``"{name} must be {what}"``)."""

    name: str
    valid: Callable[[Any], bool]
    what: str

    def check(self, value: Any) -> None:
        try:
            ok = self.valid(value)
        except (TypeError, ValueError):  # a value of the wrong shape (a number where a pair belongs, ...)
            ok = False
        if not ok:
            raise ValueError(f"{self.name} must be {self.what}, got {value!r}")


@dataclass(frozen=True)
class ModeledOption(FieldRule):
    """An option of the modeled executor only: ``unset`` is its value with any other executor."""

    unset: Any = None

    def check(self, value: Any, executor: str = "modeled") -> None:  # type: ignore[override]
        if value is self.unset or (self.unset is not None and value == self.unset):
            return
        if executor != "modeled":
            raise ValueError(f"{self.name} is an option of the modeled executor (executor='modeled'); "
                             f"executor is {executor!r}")
        super().check(value)


FIELD_RULES = (
    FieldRule("executor", _one_of(*EXECUTORS), f"one of {', '.join(EXECUTORS)}"),
    FieldRule("dtype", _one_of(None, torch.bfloat16, torch.float16, torch.float32),
              f"torch.bfloat16, torch.float16, torch.float32 or one of {', '.join(DTYPE_NAMES)}"),
    FieldRule("gc_young_threshold", _int_at_least(1), "an integer >= 1"),
    FieldRule("loading_buffers", _one_of("layer", "sized"), "'layer' or 'sized'"),
    FieldRule("prefetch", _one_of("predict", "none"), "'predict' or 'none'"),
    FieldRule("tensor_parallel_size", _int_at_least(1), "a positive integer"),
    FieldRule("vocab_parallel_head", _one_of(None, True, False), "True, False or None (auto)"),
    FieldRule("enable_expert_parallel", _one_of(True, False), "True or False"),
    FieldRule("tp_timeout_s", _positive_number, "a positive number of seconds"),
    FieldRule("offload_graph_max_batch", lambda v: v is None or _int_at_least(0)(v),
              "a non-negative integer or None"),
    FieldRule("kv_reserve", lambda v: not isinstance(v, bool) and 0 <= v < 1, "in [0, 1)"),
)

MODELED_OPTIONS = (
    ModeledOption("modeled_step_ms", _positive_number, "a positive step time in ms"),
    ModeledOption("modeled_routing_profile", lambda v: True, "a routing profile"),
    ModeledOption("modeled_chunk_law", _chunk_law,
                  "a prefill chunk law (scale > 0, exponent in (0, 1][, cross-prompt exponent in (0, 1]])"),
    ModeledOption("modeled_decode_kernels", _int_at_least(0), "the wave (a non-negative integer) of the decode "
                  "kernels modeled"),
    ModeledOption("modeled_engine_terms", _int_at_least(0), "the wave (a non-negative integer) of the engine whose "
                  "host and copy terms are modeled"),
    ModeledOption("modeled_routing_prior", _routing_prior, "(prior tokens >= 0, a reference curve summing to 1)"),
    ModeledOption("modeled_h2d_gbps", _positive_number, "a positive host-to-device rate in GB/s"),
    ModeledOption("modeled_decode_request", _decode_request,
                  "a per-request decode tempering (exponent, reference prompt tokens > 0, spread >= 0, center)"),
    ModeledOption("modeled_decode_gamma", _positive_number, "a positive exponent of the decode routing", unset=1.0),
    ModeledOption("modeled_prefill_gamma", _positive_number, "a positive exponent of the prefill routing", unset=1.0),
    ModeledOption("modeled_host_slowdown", _positive_number, "a positive factor on the host terms", unset=1.0),
)


@dataclass(frozen=True)
class EngineConfig:
    gpu_memory_budget: int | str = "2GiB"  # everything the engine puts on the device
    policy: str = "elastic"
    device: str | None = None  # default: cuda if available else cpu
    dtype: torch.dtype | str | None = None  # a torch.dtype or its name (DTYPE_NAMES; "auto" = None); default: bf16 on
    # cuda; on cpu bf16 where native (AVX512-BF16/AMX), else fp32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: model limit, capped by what KV can hold
    block_tokens: int = 16
    initial_cache_experts: int | None = None  # default: fill the pool but kv_reserve
    kv_reserve: float = 0.25  # fraction of the pool kept for KV when sizing the default cache
    expert_offload_limit: int | None = None  # EOL (elastic only)
    prefetch: str = "predict"  # "predict" (next layer's router on this hidden) | "none"
    activation_reserve: int | str | None = None  # default: estimated from max_num_batched_tokens
    hotset: str | None = None  # profile JSON; default: <model_dir>/hotset.json if present
    moe_impl: str = "auto"  # auto (triton on cuda, cpu elsewhere) | triton | cpu | reference (the oracle)
    attention_impl: str = "auto"
    seed: int = 0
    tokenizer: str = "checkpoint"  # checkpoint: its tokenizer.json | qwen-folded: that, else Qwen ids % vocab
    record_routing: bool = False  # count router selections (for `rimuru profile`)
    # ---- which executor runs the forward pass
    executor: str = "torch"  # torch: the model runs | modeled: a cost model and a routing model stand in for it
    hardware: str = "h200"  # modeled: GPU profile (config/hardware/<name>.yaml or a path)
    host: str = "host-xeon-amx"  # modeled, cpu policy: host CPU profile of the CPU-computed experts
    cost_params: str | None = None  # modeled: fitted CostParams JSON (default: uncalibrated defaults)
    modeled_step_ms: float | None = None  # modeled: a constant step time instead of the cost model
    modeled_routing_profile: str | None = None  # modeled: a hotset JSON whose probabilities the routing model draws
    # from instead of the served hotset's (whose order still fills the cache): a better routing measurement of the
    # same model (e.g. more calibration prompts) for a run served with a hotset of few prompts
    modeled_decode_gamma: float = 1.0  # modeled: decode tokens route by the profile tempered to this power (per layer,
    # rescaled to top-k; rimuru.engine.modeled.routing.temper): the calibration's correction for the profile a run
    # was served with (fitted on that profile's fit runs' decode steps); 1: the profile as measured
    modeled_prefill_gamma: float = 1.0  # modeled: prefill chunks' effective tokens route by the profile tempered to
    # this power (routing.temper; RoutingModel.prefill_gamma): the prefill tempering the calibration fitted with the
    # chunk law of the model build a run served (fitted.chunk_law[NAME].prefill_gamma, wave 12); 1: the profile
    modeled_host_slowdown: float = 1.0  # modeled: the host is this many times slower than the calibration's fit data
    # (CostParams.with_host_slowdown: every host term scaled); 1: the calibration's host
    modeled_chunk_law: tuple[float, ...] | None = None  # modeled: a prefill chunk law (scale, exponent[, cross])
    # instead of the calibration's routing_chunk_*: one the calibration fitted for the model build a run served
    # (fitted.chunk_law; cross: RoutingModel.chunk_cross, 1 if not given)
    modeled_decode_kernels: int | None = None  # modeled: the wave of the decode kernels the modeled engine launches
    # (4: wave 4's, 5: wave5, 7: fast): its decode-graph replays take the terms the calibration fitted on decode floors
    # measured with those kernels (CostParams.decode_kernels); None: the calibration's base terms
    modeled_engine_terms: int | None = None  # modeled: the wave of the engine modeled: its eager steps take the host
    # and copy terms the calibration fitted on that engine's serving steps (CostParams.engine_terms); None or 0: the
    # calibration's base terms
    modeled_h2d_gbps: float | None = None  # modeled: the pinned host-to-device rate (GB/s) of expert copies and
    # in-place reads instead of the hardware profile's: a rate measured for one run (e.g. a TP rank's probe, whose rate
    # varied between engine processes); None: the profile's
    modeled_routing_prior: tuple[float, tuple[float, ...]] | None = None  # modeled: (routing_prior_tokens,
    # routing_reference_curve) instead of the calibration's: a profile shrinkage fitted for the model build a run
    # served (fitted.routing_prior_build), e.g. the 48-layer repeated-layer model, whose deep layers are flatter
    modeled_decode_request: tuple[float, float, float, float] | None = None  # modeled: each request's decode tokens
    # route by the decode profile tempered by decode_gamma * exp(center + exponent * log(prompt tokens / ref) +
    # spread * z), z a standard normal drawn from the request's id (routing.DecodeRequestLaw: (exponent, ref, spread,
    # center)), fitted per model build (fitted.decode_request); None: every request's decode tokens alike
    modeled_next_step_prefetch: bool = True  # modeled: an eager step copies its first layer's misses for the next
    # step when that layer touched >= 3/4 of its experts, as PagedExperts does since a98ef5f (False: an older engine)
    loading_buffers: str = "layer"  # layer: two loading buffers of one MoE layer's experts each, for the engine's
    # life | sized: each buffer holds what its layers can miss (E minus the fewest resident experts of a layer it
    # serves, rimuru.experts.loader.buffer_need), resized as the cache changes; the rest of their pages serve the
    # cache and KV (fixed: its cache grows into them at start; elastic: its adjuster expands into them)
    prefetch_before_graphs: bool = False  # an eager step's end-of-step prefetch also runs when the next step is
    # expected to replay a decode graph, which reads misses in place and never the buffer (the engine before this
    # switch: every measured run up to d9f9d41/2268456; the modeled fidelity of those runs)
    tensor_parallel_size: int = 1  # ranks (one process and one device each; modeled: one process) the layers are
    # sharded over; the budget is per rank
    tp_timeout_s: float = 300.0  # a rank silent this long in a collective ends the engine
    all_reduce: str = "auto"  # tensor parallelism's all-reduce (rimuru/distributed/allreduce.py): auto
    # (symm_mem_lamport, symm_mem_fused, then nccl on GPUs; gloo on CPUs) | nccl | symm_mem (a one-shot over NVLink
    # peer memory) | symm_mem_two_shot | symm_mem_fused (2 ranks: all-reduce + residual add + RMSNorm in one launch)
    # | symm_mem_lamport (the same, flag-free) | symm_mem_or_nccl | gloo
    vocab_parallel_head: bool | None = None  # tensor parallelism: each rank projects its block of the vocabulary
    # (the LM head read once over all ranks instead of on each); greedy tokens from every rank's first maximum, the
    # logits gathered where the whole row is needed (sampling, logprobs). Plain MoE models; no effect on one rank.
    # None (auto): rimuru.distributed.sharding.vocab_parallel decides (on for plain MoE models whose vocabulary
    # divides by the ranks, VOCAB_PARALLEL_AUTO; replicated for hybrids); True: on (an error where it cannot be);
    # False: off (the head replicated, as before wave 8)
    enable_expert_parallel: bool = False  # tensor parallelism: whole routed experts per rank (E / ranks each, full
    # intermediate width) instead of every expert's intermediate slice; attention, shared experts and dense MLPs
    # stay split (rimuru.distributed.expert_parallel, docs/tensor_parallel.md "Expert parallelism"). static only
    enforce_eager: bool = False  # no CUDA graphs: every step runs the eager forward
    offload_graph_max_batch: int | None = None  # offloading policies replay decode graphs up to this batch
    # (None: rimuru.engine.cuda_graphs.OFFLOAD_GRAPH_MAX_BATCH); the modeled engine models the same choice
    kv_compaction: bool = True  # elastic: pack scattered KV pages so that partly used L2 pages return to the expert
    # cache (rimuru.memory.compaction; one device, plain MoE models)
    expand_headroom: bool = True  # elastic expands its cache only past one step's worth of free KV pages (03fa546);
    # False: the engine before (the modeled fidelity of older runs)
    short_lookahead: bool = True  # the scheduler's R_b counts what the waiting queue lacks for the next step's token
    # budget (rimuru.engine.scheduler, 9a2935b); False: the engine before (the modeled fidelity of older runs)
    running_lookahead: bool = True  # that look-ahead also counts what the running requests take first in the next step
    # (a decode token each, the rest of a chunked prompt; SchedulerConfig); False: the engine up to 2268456
    gc_freeze: bool = True  # LLM.warmup() freezes the live heap out of Python's cyclic GC (LLM.close() unfreezes)
    gc_idle_collect: bool = True  # from LLM.warmup() to LLM.close(): Python's generation-0 threshold raised to
    # gc_young_threshold (a backstop), and a collection when a step call leaves the engine idle, after the step is
    # timed and recorded (rimuru.engine.gc_policy); False: Python's automatic collection, the engine before wave 9
    gc_young_threshold: int = 20_000  # generation-0 threshold while serving with gc_idle_collect (CPython: 700)
    timeline_columns: bool = True  # the step timeline keeps its rows in columns (no GC-tracked object per step,
    # rimuru.engine.timeline); False: one StepRecord object per step (the engine before wave 8; docs/engine.md)
    async_scheduling: bool = True  # graphed greedy decode of `static`: step n+1 is scheduled and launched while
    # step n runs on the device, its tokens fed on the device (docs/engine.md, "Async scheduling")

    def __post_init__(self) -> None:
        """Every option checked once, at construction: each field against its rule (``FIELD_RULES``), the modeled
        executor's options (``MODELED_OPTIONS``), then the rules that tie fields together. A bad value is a
        ``ValueError`` naming the field and the value, never a failure deep inside the engine."""
        from rimuru.distributed.allreduce import all_reduce_candidates
        from rimuru.engine.memory_policy import policy_class
        from rimuru.models.tokenizer import TOKENIZER_CHOICES

        policy_class(self.policy)  # the policy registry's own error
        if isinstance(self.dtype, str) and self.dtype in DTYPE_NAMES:  # a name: its torch.dtype, once
            object.__setattr__(self, "dtype", DTYPE_NAMES[self.dtype])
        if self.tokenizer not in TOKENIZER_CHOICES:
            raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZER_CHOICES)}, got {self.tokenizer!r}")
        for rule in FIELD_RULES:
            rule.check(getattr(self, rule.name))
        for option in MODELED_OPTIONS:
            option.check(getattr(self, option.name), self.executor)
        self._check_combinations()
        all_reduce_candidates(self.all_reduce, "cuda" if self.modeled else self.torch_device.type)  # modeled: a GPU

    def _check_combinations(self) -> None:
        """The rules between fields: what tensor parallelism and expert parallelism can run with."""
        if self.loading_buffers == "sized" and self.tensor_parallel_size > 1:
            raise ValueError("loading_buffers='sized' runs on one device (tensor parallelism's ranks would have to "
                             "replay every resize): use loading_buffers='layer' with tensor_parallel_size > 1")
        if not self.enable_expert_parallel:
            return
        if self.tensor_parallel_size < 2:
            raise ValueError("enable_expert_parallel places whole experts on tensor-parallel ranks: it needs "
                             "tensor_parallel_size >= 2")
        if self.policy not in EXPERT_PARALLEL_POLICIES:
            raise ValueError(f"enable_expert_parallel serves policy {', '.join(EXPERT_PARALLEL_POLICIES)} only "
                             f"(every expert resident on its rank), not {self.policy!r}: the offloading "
                             "policies' one memory decision would cache different experts on each rank")
        if self.record_routing:
            raise ValueError("record_routing counts global expert ids; it does not run with "
                             "enable_expert_parallel (each rank routes to its local ids)")
        if self.executor != "torch":
            raise ValueError("enable_expert_parallel needs the torch executor (the modeled executor does not "
                             "model expert parallelism)")

    @property
    def modeled(self) -> bool:
        return self.executor == "modeled"

    @property
    def budget_bytes(self) -> int:
        return parse_bytes(self.gpu_memory_budget)

    @property
    def torch_device(self) -> torch.device:
        if self.modeled:  # nothing is allocated: the pool is bookkeeping over a meta tensor
            return torch.device("meta")
        if self.device:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        if self.modeled:
            return torch.bfloat16  # the modeled hardware's weights
        if self.torch_device.type == "cuda":
            return torch.bfloat16
        from rimuru.engine.cpu import default_cpu_dtype

        return default_cpu_dtype()
