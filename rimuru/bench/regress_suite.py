"""The regression benchmarks' measurements (compared by ``rimuru.bench.regress``).

Groups, each a function returning ``Metric``s named ``<group>/...``:

* ``pipeline``: the case study (every system, 200-request burst, memory executor) and the EOL sweep's
  end points, exactly as the smoke pipeline runs them (``snakemake --configfile config/smoke.yaml``
  on the rules' own outputs, in a scratch copy of the workflow): forward steps, peak concurrency,
  preemptions, compared exactly (the case study runs on a virtual clock; the EOL runs add every
  request before the first step, so neither depends on the machine's speed).
* ``greedy``: greedy token ids (a digest) and step counts of each memory policy on the tiny
  synthetic models, the elastic one under a budget tight enough to shrink the cache and preempt.
* ``kernels``: the Triton fused MoE and paged attention kernels (interpreter on CPU) and the CPU
  backend's MoE and attention against their torch references at small shapes, on pools whose unused
  pages are NaN: max error normalised by the reference's max, bound 1e-5 (a kernel reading one page
  off gives NaN or O(1)).
* ``speed``: time ratios measured in the same run, interleaved, medians (never absolute times):
  the allocator's decode step (allocate + free one KV page for each of 256 requests on a pool
  holding other requests' KV) over the same step on a plain numpy free list, best of 21 interleaved
  samples each; and the CPU backend (``moe_cpu``, ``paged_attention(impl="cpu")``) over the torch
  reference on the same inputs. Fails only beyond a 2x slowdown of a ratio: on the shared 2-core machine
  under the load of eight sessions the best-of ratios moved by about 10% between runs (medians by 2x).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rimuru.bench.regress import Metric, Tolerance

ROOT = Path(__file__).resolve().parents[2]
EXACT = Tolerance("exact")
KERNEL_BOUND = Tolerance("at_most", 1e-5)
SLOWDOWN = Tolerance("slowdown", 2.0)


# ------------------------------------------------------------------------------------------- pipeline
def _merged_config(profile: str) -> dict:
    """config/default.yaml with a profile merged over it, key by key (snakemake's --configfile rule)."""
    import yaml

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    base = yaml.safe_load((ROOT / "config/default.yaml").read_text())
    return merge(base, yaml.safe_load((ROOT / profile).read_text()) or {})


def pipeline_targets(config: dict) -> dict[str, str]:
    """Metric prefix -> the pipeline output it reads (the smoke profile's case and EOL runs)."""
    targets = {f"case/{s}": f"results/case/runs/{s}.json" for s in config["case"]["systems"]}
    for x in [*map(str, config["eol"]["extra"]), "none"]:
        targets[f"eol/eol_{x}"] = f"results/eol/runs/eol_{x}.json"
    return targets


def counts(run: dict) -> dict[str, int]:
    """forward steps, peak concurrency, preemptions of a run_case summary or a run_bench result."""
    src = run.get("engine", run)
    return {k: int(src[k]) for k in ("forward_steps", "peak_concurrency", "preemptions")}


def measure_pipeline(workdir: Path | None = None, profile: str = "config/smoke.yaml") -> list[Metric]:
    config = _merged_config(profile)
    targets = pipeline_targets(config)
    scratch = workdir or Path(tempfile.mkdtemp(prefix="rimuru-regress-"))
    try:
        scratch.mkdir(parents=True, exist_ok=True)
        for name in ("Snakefile", "workflow", "config", "baselines", "workloads"):
            src, dst = ROOT / name, scratch / name
            if dst.exists():
                shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
            (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
        snakemake = Path(sys.executable).with_name("snakemake")
        cmd = [str(snakemake), *targets.values(), "--cores", str(min(2, os.cpu_count() or 1)), "--configfile",
               profile]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            logs = sorted((scratch / "results/logs").rglob("*.log")) if (scratch / "results/logs").exists() else []
            tail = "\n".join(f"--- {p.relative_to(scratch)}\n{p.read_text()[-1500:]}" for p in logs[-3:])
            raise RuntimeError(f"pipeline runs failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}\n{tail}")
        metrics = []
        for prefix, out in targets.items():
            for key, value in counts(json.loads((scratch / out).read_text())).items():
                metrics.append(Metric(f"pipeline/{prefix}/{key}", value, EXACT, f"smoke {out}"))
        return metrics
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------- greedy
GREEDY_MODELS = ("tiny-qwen3-moe", "tiny-qwen2-moe")
PROMPTS = [[9707, 11, 1879, 0], [3838, 374, 279, 6722, 315, 9625, 30], [40], [785, 3974, 13876, 38835, 34208, 916],
           [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [1986, 374, 264, 1273], [22, 22], [100, 200, 300]]
MAX_TOKENS = 12


def token_digest(outputs: Sequence[Sequence[int]]) -> str:
    """A short, order-sensitive digest of token id lists (what the exact check compares)."""
    h = hashlib.sha256(json.dumps([list(map(int, o)) for o in outputs]).encode()).hexdigest()
    return f"{h[:12]} ({sum(map(len, outputs))} tok)"


def _policy_runs(model_dir: Path) -> dict[str, dict]:
    """Each memory policy's engine options; elastic and fixed on a budget that holds 16 experts and a
    few KV blocks, so that elastic shrinks its cache and the scheduler preempts."""
    import torch

    from rimuru.engine.llm import LLM

    probe = LLM(model_dir, device="cpu", dtype=torch.float32, gpu_memory_budget="400MiB", policy="fixed",
                initial_cache_experts=0, activation_reserve="1MiB")
    r = probe.memory_report
    page = probe.pool.layout.page_bytes("expert")
    tight = r["dense"] + r["activations"] + r["buffer_pages"] * page + (3 * 16 + 4) * page
    return {
        "static": dict(gpu_memory_budget="400MiB", policy="static"),
        "fixed": dict(gpu_memory_budget="400MiB", policy="fixed", initial_cache_experts=4),
        "cpu": dict(gpu_memory_budget="400MiB", policy="cpu", initial_cache_experts=4),
        "fixed_tight": dict(gpu_memory_budget=tight, policy="fixed", initial_cache_experts=16),
        "elastic_tight": dict(gpu_memory_budget=tight, policy="elastic", initial_cache_experts=16,
                              expert_offload_limit=2, max_num_batched_tokens=64),
    }


def measure_greedy(models: Sequence[str] = GREEDY_MODELS) -> list[Metric]:
    import torch

    from rimuru.engine.llm import LLM
    from rimuru.engine.sampling_params import SamplingParams
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    metrics = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a thread pool only spin-waits on a shared machine
    with tempfile.TemporaryDirectory(prefix="rimuru-regress-") as tmp:
        for model in models:  # prompts are token ids: no tokenizer to load
            model_dir = write_synthetic_checkpoint(model, Path(tmp) / model, seed=0, dtype=torch.float32,
                                                   tokenizer=False)
            for policy, options in _policy_runs(model_dir).items():
                llm = LLM(model_dir, device="cpu", dtype=torch.float32, activation_reserve="1MiB", **options)
                outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
                llm.check_integrity()
                stats = llm.stats()
                name = f"greedy/{model}/{policy}"
                metrics.append(Metric(f"{name}/tokens", token_digest([o.output_token_ids for o in outs]), EXACT,
                                      "sha256 of the greedy token ids"))
                metrics += [Metric(f"{name}/{k}", int(getattr(stats, k)), EXACT)
                            for k in ("forward_steps", "peak_concurrency", "preemptions")]
    torch.set_num_threads(threads)
    return metrics


# -------------------------------------------------------------------------------------------- kernels
def _max_rel(a, b) -> float:
    """max |a - b| / max |b| (NaN when a holds NaN: the poison of a page it should not have read)."""
    import torch

    err = (a.float() - b.float()).abs().max() / b.float().abs().max()
    return float("nan") if torch.isnan(a).any() else float(err)


def _moe_pool(E: int, f: int, d: int, gen, cache_pages: int = 64):
    """Expert pages scattered over a pool (cache region, then a buffer region); unused pages NaN."""
    import torch

    view = torch.full((cache_pages + 3 * E, f, d), float("nan"))
    cache_ids = torch.randperm(cache_pages, generator=gen)
    buffer_ids = cache_pages + torch.randperm(3 * E, generator=gen)
    in_cache = torch.rand(E, generator=gen) < 0.5
    table = torch.empty(E, 3, dtype=torch.int32)
    ci = bi = 0
    for e in range(E):
        ids = cache_ids[ci:ci + 3] if in_cache[e] else buffer_ids[bi:bi + 3]
        ci, bi = (ci + 3, bi) if in_cache[e] else (ci, bi + 3)
        table[e] = ids.to(torch.int32)
        for p in range(3):
            view[table[e, p]] = torch.randn(f, d, generator=gen) / d**0.5
    return view, table


def _moe_inputs(T: int, seed: int, E: int = 8, f: int = 32, d: int = 64, k: int = 2):
    import torch

    gen = torch.Generator().manual_seed(seed)
    view, table = _moe_pool(E, f, d, gen)
    ids = torch.rand(T, E, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(T, k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    x = torch.randn(T, d, generator=gen)
    return x, w, ids, view, table


def _moe_impl(impl: str) -> Callable:
    """The routed-experts implementation under test: the Triton kernel or the CPU backend."""
    if impl == "triton":
        from rimuru.kernels.fused_moe import fused_moe

        return fused_moe
    from rimuru.experts.moe_cpu import moe_cpu

    return moe_cpu


def _moe_case(T: int, seed: int, impl: str = "triton") -> float:
    from rimuru.experts.moe_reference import moe_reference

    args = _moe_inputs(T, seed)
    return _max_rel(_moe_impl(impl)(*args), moe_reference(*args))


class _PagedKV:
    """Requests' K/V scattered token by token over random pages of a NaN-poisoned pool."""

    def __init__(self, q_lens, seq_lens, seed: int, block=4, kv_heads=2, group=2, head_dim=16, spare=7):
        import torch

        gen = torch.Generator().manual_seed(seed)
        blocks = [-(-n // block) for n in seq_lens]
        self.kv = torch.full((sum(blocks) + spare, 2, block, kv_heads, head_dim), float("nan"))
        pages = torch.randperm(len(self.kv), generator=gen)[: sum(blocks)]
        self.block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        used = 0
        for r, n in enumerate(seq_lens):
            self.block_tables[r, : blocks[r]] = pages[used: used + blocks[r]]
            used += blocks[r]
            k, v = torch.randn(2, n, kv_heads, head_dim, generator=gen)
            for t in range(n):
                page = self.block_tables[r, t // block]
                self.kv[page, 0, t % block], self.kv[page, 1, t % block] = k[t], v[t]
        self.cu_query_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen)
        self.scale = head_dim**-0.5
        self.max_query_len, self.max_seq_len = max(q_lens), max(seq_lens)


def _attention_case(kind: str, seed: int, impl: str = "triton") -> float:
    from rimuru.kernels.attention_reference import decode_attention_reference, prefill_attention_reference
    from rimuru.kernels.paged_attention import paged_attention

    if kind == "prefill":  # fresh prefills, chunks over a cached prefix and decodes in one batch
        b = _PagedKV([5, 1, 17, 3, 8], [5, 9, 40, 20, 8], seed)
        ref = prefill_attention_reference(b.q, b.kv, b.block_tables, b.cu_query_lens, b.seq_lens, b.scale)
    else:
        b = _PagedKV([1] * 5, [1, 7, 33, 64, 50], seed, group=4)
        ref = decode_attention_reference(b.q, b.kv, b.block_tables, b.seq_lens, b.scale)
    got = paged_attention(b.q, b.kv, b.block_tables, b.cu_query_lens, b.seq_lens, b.scale, impl=impl,
                          max_query_len=b.max_query_len, max_seq_len=b.max_seq_len)
    return _max_rel(got, ref)


def measure_kernels() -> list[Metric]:
    """Triton kernels (interpreted) and the CPU backend, each against the torch reference."""
    metrics = []
    for impl, name in (("triton", "fused_moe"), ("cpu", "moe_cpu")):
        note = f"{impl}: max abs(out - reference) / max abs(reference)"
        metrics += [Metric(f"kernels/{name}/T{T}/max_rel_err", _moe_case(T, seed, impl), KERNEL_BOUND, note)
                    for T, seed in ((1, 1), (7, 7), (33, 33))]
    for impl, name in (("triton", "paged_attention"), ("cpu", "attention_cpu")):
        note = f"{impl}: max abs(out - reference) / max abs(reference)"
        metrics += [Metric(f"kernels/{name}/{kind}/max_rel_err", _attention_case(kind, seed, impl), KERNEL_BOUND,
                           note) for kind, seed in (("prefill", 0), ("decode", 1))]
    return metrics


# ---------------------------------------------------------------------------------------------- speed
class NumpyFreeList:
    """The plain baseline: one numpy stack of free page ids; allocate pops, free pushes."""

    def __init__(self, num_pages: int) -> None:
        import numpy as np

        self.stack = np.arange(num_pages, dtype=np.int64)[::-1].copy()
        self.top = num_pages

    def allocate(self, n: int):
        self.top -= n
        return self.stack[self.top: self.top + n].copy()

    def free(self, ids) -> None:
        self.stack[self.top: self.top + len(ids)] = ids
        self.top += len(ids)


def interleaved_ratio(a: Callable[[], None], b: Callable[[], None], *, rounds: int = 21, sample_s: float = 0.004,
                      clock: Callable[[], float] = time.perf_counter) -> tuple[float, dict]:
    """best time of one call of a / best time of one call of b (timeit's convention: interference from
    other load only adds time, so the best of many samples is the stable estimate; medians are reported).

    Each sample times a batch of calls sized to last about ``sample_s`` (calibrated on an unmeasured
    warm-up), and the two alternate in order (a b, b a, ...) so that load on the machine hits both alike."""
    def batch(fn, n: int) -> float:
        t0 = clock()
        for _ in range(n):
            fn()
        return (clock() - t0) / n

    inner = {}
    for fn in (a, b):
        per_call = max(batch(fn, 3), 1e-9)
        inner[fn] = max(1, int(sample_s / per_call))
    ta, tb = [], []
    for r in range(rounds):
        order = ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta))
        for fn, out in order:
            out.append(batch(fn, inner[fn]))
    ma, mb = statistics.median(ta), statistics.median(tb)
    spread = {"a_best_us": min(ta) * 1e6, "b_best_us": min(tb) * 1e6, "a_median_us": ma * 1e6,
              "b_median_us": mb * 1e6, "median_ratio": ma / mb}
    return min(ta) / min(tb), spread


def measure_speed() -> list[Metric]:
    import numpy as np

    from rimuru.memory import KV, MultiLevelAllocator, PoolLayout

    layout = PoolLayout.build(hidden_size=2048, expert_intermediate=768, kv=(16, 4, 128))  # Qwen3-30B-A3B
    alloc = MultiLevelAllocator(layout, 2_000)
    rng = np.random.default_rng(0)
    held = alloc.allocate(KV, 256 * 40)  # other requests' KV, a third of it freed again: steady state
    alloc.free(KV, rng.choice(held, size=len(held) // 3, replace=False))
    alloc.allocate("expert", 2_000 // 4)
    plain = NumpyFreeList(alloc.num_pages(KV))
    n = 256  # a decode step: one new page for each of 256 running requests

    def allocator_step() -> None:
        alloc.free(KV, alloc.allocate(KV, n))

    def freelist_step() -> None:
        plain.free(plain.allocate(n))

    ratio, spread = interleaved_ratio(allocator_step, freelist_step)
    alloc.check_integrity()
    note = (f"best of 21: allocator {spread['a_best_us']:.0f} us, free list {spread['b_best_us']:.2f} us "
            f"(median ratio {spread['median_ratio']:.0f})")
    metrics = [Metric("speed/allocator_decode_256_vs_numpy_freelist", round(ratio, 3), SLOWDOWN, note)]
    return metrics + _cpu_backend_ratios()


def _cpu_backend_ratios() -> list[Metric]:
    """The CPU backend (grouped-matmul MoE, batched-SDPA attention) over the torch reference on the same
    inputs, one thread: a step of 32 tokens over 16 experts, and a decode batch of 8 requests (calls of
    about a millisecond, so that the best of many samples is one that no other process interrupted)."""
    import torch

    from rimuru.experts.moe_cpu import moe_cpu
    from rimuru.experts.moe_reference import moe_reference
    from rimuru.kernels.paged_attention import paged_attention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        moe_args = _moe_inputs(32, 3, E=16, f=64, d=128, k=4)
        moe_ratio, moe = interleaved_ratio(lambda: moe_cpu(*moe_args), lambda: moe_reference(*moe_args))
        b = _PagedKV([1] * 8, [37 + 13 * i for i in range(8)], 4, block=16, kv_heads=2, group=4, head_dim=32)

        def attention(impl: str) -> Callable[[], None]:
            return lambda: paged_attention(b.q, b.kv, b.block_tables, b.cu_query_lens, b.seq_lens, b.scale,
                                           impl=impl, max_query_len=1, max_seq_len=b.max_seq_len)

        att_ratio, att = interleaved_ratio(attention("cpu"), attention("reference"))
    finally:
        torch.set_num_threads(threads)

    def note(info: dict) -> str:
        return (f"best of 21: cpu backend {info['a_best_us']:.0f} us, reference {info['b_best_us']:.0f} us "
                f"(median ratio {info['median_ratio']:.2f})")

    return [Metric("speed/moe_cpu_vs_reference_T32_E16", round(moe_ratio, 3), SLOWDOWN, note(moe)),
            Metric("speed/attention_cpu_vs_reference_decode8", round(att_ratio, 3), SLOWDOWN, note(att))]


# ----------------------------------------------------------------------------------------------- all
GROUPS: dict[str, Callable[..., list[Metric]]] = {
    "kernels": measure_kernels,
    "speed": measure_speed,
    "greedy": measure_greedy,
    "pipeline": measure_pipeline,
}


def measure(groups: Sequence[str] | None = None, workdir: Path | None = None) -> tuple[list[Metric], dict[str, float]]:
    """Every metric of the chosen groups (default: all), and the seconds each group took."""
    metrics, took = [], {}
    for name in groups or GROUPS:
        t0 = time.perf_counter()
        fn = GROUPS[name]
        metrics += fn(workdir=workdir) if name == "pipeline" else fn()
        took[name] = time.perf_counter() - t0
    return metrics, took
