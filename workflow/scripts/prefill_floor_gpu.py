"""Where an eager prefill step's time goes as its chunk grows (wave 17): host phases and device time, per step.

The modeled executor's ``token_us`` (per computed token of an eager step with a routing sync) is fitted on one-GPU
serving timelines, where it sits beside copy-bound mixed steps; the TP=2 bursts' mixed steps leave no room for it
(docs/modeled.md, Gaps). This script measures, at one GPU, what a prefill step of ``q`` tokens spends where, for
each ``--runs`` engine (``POLICY:BUDGET``, the budget of the full model scaled to ``--layers`` as e2e_gpu.py does:
e.g. ``static:80GiB`` resident experts and no routing sync, ``fixed:400GiB`` paged experts all cached — a routing
sync per layer and no copies —, ``fixed:32GiB`` paged with misses loaded):

* per measured step (``--requests`` new prompts of ``q / requests`` random tokens, ``max_tokens=1``, prefilled in one
  step; ``q`` from ``--tokens``, in ABBA order over ``--repeats`` rounds, the first ``--discard`` rounds dropped):
  the step's wall time (the engine's timeline), and host time in ``scheduler.schedule``, ``executor.prepare`` (the
  inputs and their upload), the ``model.forward`` call (launches, and the routing syncs' waits), the paged provider's
  ``layer_table`` calls (each layer's sync, its misses' copy launches) and the sampling call (which waits for the
  device), plus the device span of the forward (CUDA events from before ``prepare`` to after ``forward`` returns);
* per round after the discarded ones, one more step of each size under ``torch.profiler`` (CUDA activity only):
  the summed kernel time (device busy) and host-to-device copy time of the step (``profiled`` = 1; its host times
  carry the profiler's overhead and are not used for them).

The slopes against ``q`` per engine say where per-token time is: host phases before the launches (``prepare``),
host inside the forward (``forward_call`` minus the waits), or device (kernel time beyond the rooflines).
Writes ``prefill_floor.csv`` (one row per step, with provenance). ``--device cpu`` dry-runs it (fp32, no events,
no profiler).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rimuru.bench.host_probe import StepSpeedProbe  # noqa: E402
from rimuru.engine.llm import LLM  # noqa: E402
from rimuru.engine.modeled.reference import e2e_scaled_budget  # noqa: E402
from rimuru.engine.sampling_params import SamplingParams  # noqa: E402
from rimuru.engine.timeline import StepRecord  # noqa: E402
from rimuru.experts.provider import PagedExperts  # noqa: E402
from rimuru.models.spec import ModelSpec  # noqa: E402
from rimuru.models.synthetic_memory import SyntheticCheckpoint  # noqa: E402
from rimuru.provenance import provenance  # noqa: E402
from rimuru.units import parse_bytes  # noqa: E402

PHASES = ("schedule", "prepare", "forward_call", "layer_table", "sample")


class PhaseTimer:
    """Host time per phase of the current step (wrapped callables on one engine's own objects), and the device span
    of its forward (CUDA events: before ``prepare``, after ``forward`` returns)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.ms = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self.events: list[torch.cuda.Event] = []

    def reset(self) -> None:
        self.ms = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self.events = []

    def wrap(self, name: str, fn, event_before: bool = False, event_after: bool = False):
        def timed(*a, **k):
            if event_before and self.cuda:
                self.events.append(_event())
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.ms[name] += (time.perf_counter() - t) * 1e3
                self.calls[name] += 1
                if event_after and self.cuda:
                    self.events.append(_event())
        return timed

    def device_span_ms(self) -> float:
        if len(self.events) < 2:
            return float("nan")
        self.events[-1].synchronize()
        return float(self.events[0].elapsed_time(self.events[-1]))


def _event() -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def instrument(llm: LLM, timer: PhaseTimer):
    """Wrap this engine's scheduler, executor, model forward, paged provider and sampling (instance attributes: the
    library's classes are untouched); returns the function that removes the wrappers (each holds its engine's bound
    method: left in place, they keep the engine and its device pool alive after the caller drops it)."""
    ex = llm._local_executor
    wrapped = [(llm.scheduler, "schedule", "schedule", {}), (ex, "prepare", "prepare", {"event_before": True}),
               (llm.model, "forward", "forward_call", {"event_after": True}), (llm, "_sample", "sample", {})]
    if isinstance(llm.provider, PagedExperts):
        wrapped.append((llm.provider, "layer_table", "layer_table", {}))
    for obj, attr, phase, kw in wrapped:
        setattr(obj, attr, timer.wrap(phase, getattr(obj, attr), **kw))

    def restore() -> None:
        for obj, attr, _, _ in wrapped:
            delattr(obj, attr)
    return restore


def profiled_device_ms(fn, *args) -> tuple[object, float, float, float]:
    """``fn(*args)``'s result, and the kernel ms, host-to-device copy ms and other copies' ms the device spent on it
    (torch.profiler, CUDA activity)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn(*args)
        torch.cuda.synchronize()
    kernels = h2d = other = 0.0
    for ev in prof.events():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "device_time", 0)
        if ev.device_type != torch.autograd.DeviceType.CUDA or t <= 0:
            continue
        name = ev.name.lower()
        if "memcpy" in name and "htod" in name:
            h2d += t
        elif "memcpy" in name or "memset" in name:
            other += t
        else:
            kernels += t
    return result, kernels * 1e-3, h2d * 1e-3, other * 1e-3


def one_step(llm: LLM, q: int, requests: int, rng: np.random.Generator, tag: str) -> StepRecord:
    """Prefill ``requests`` prompts totalling ``q`` tokens in one step; the step's timeline record."""
    lens = [q // requests + (1 if i < q % requests else 0) for i in range(requests)]
    for i, n in enumerate(lens):
        llm.add_request(f"{tag}-{i}", rng.integers(0, llm.spec.vocab_size, n).tolist(),
                        SamplingParams(max_tokens=1, ignore_eos=True))
    first = len(llm.timeline)
    llm.step()
    record = llm.timeline.records[first]
    while llm.has_unfinished_requests():  # max_tokens=1: nothing left unless the step did not hold every prompt
        llm.step()
    return record


def measure(llm: LLM, label: dict, tokens: list[int], requests: int, repeats: int, discard: int,
            rng: np.random.Generator, cuda: bool, probe: StepSpeedProbe | None) -> list[dict]:
    timer = PhaseTimer(cuda)
    restore = instrument(llm, timer)
    try:
        return _measure(llm, timer, label, tokens, requests, repeats, discard, rng, cuda, probe)
    finally:
        restore()


def _row(label: dict, q: int, requests: int, r: int, order: int, discarded: bool, record: StepRecord,
         timer: PhaseTimer, **device) -> dict:
    """One step's CSV row: its timeline record's work and time, the host phases and the device span ``timer`` saw,
    and ``device`` (the probe, or a profiled step's kernel and copy times; NaN where not measured)."""
    return {**label, "tokens": q, "requests": requests, "round": r, "order": order, "profiled": int(order < 0),
            "discarded": int(discarded), "step_ms": record.step_ms, "prefill_tokens": record.prefill_tokens,
            "experts_touched": record.experts_touched, "experts_loaded": record.experts_loaded,
            "cached_experts": record.cached_experts, "compiles": record.compiles,
            **{f"{p}_ms": timer.ms[p] for p in PHASES}, **{f"{p}_calls": timer.calls[p] for p in PHASES},
            "device_span_ms": timer.device_span_ms(),
            **{k: device.get(k, float("nan")) for k in ("host_probe_ms", "kernel_ms", "h2d_ms", "other_copy_ms")}}


def _measure(llm: LLM, timer: PhaseTimer, label: dict, tokens: list[int], requests: int, repeats: int, discard: int,
             rng: np.random.Generator, cuda: bool, probe: StepSpeedProbe | None) -> list[dict]:
    rows = []
    for r in range(repeats):
        order = tokens if r % 2 == 0 else tokens[::-1]
        for k, q in enumerate(order):
            timer.reset()
            probed = len(probe.rows) if probe else 0
            record = one_step(llm, q, requests, rng, f"r{r}-{q}")
            speed = probe.rows[probed][1] if probe and len(probe.rows) > probed else float("nan")
            rows.append(_row(label, q, requests, r, k, r < discard, record, timer, host_probe_ms=speed))
            print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in rows[-1].items()
                              if k2 in ("policy", "budget", "tokens", "round", "step_ms", "prepare_ms",
                                        "forward_call_ms", "layer_table_ms", "sample_ms", "device_span_ms",
                                        "experts_loaded", "compiles")}), flush=True)
        if cuda and r >= discard:  # one profiled step of each size per kept round (order -1)
            for q in order:
                timer.reset()
                record, kernels, h2d, other = profiled_device_ms(one_step, llm, q, requests, rng, f"p{r}-{q}")
                rows.append(_row(label, q, requests, r, -1, False, record, timer, kernel_ms=kernels, h2d_ms=h2d,
                                 other_copy_ms=other))
    return rows


def parse_runs(text: str) -> list[tuple[str, str]]:
    runs = []
    for item in text.split(","):
        policy, _, budget = item.strip().partition(":")
        if not policy or not budget:
            raise ValueError(f"--runs takes POLICY:BUDGET,... (e.g. static:80GiB,fixed:32GiB), got {item!r}")
        parse_bytes(budget)
        runs.append((policy, budget))
    return runs


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per engine and chunk size: medians of the kept unprofiled steps, and of the profiled ones' device times."""
    kept = frame[(frame["discarded"] == 0) & (frame["profiled"] == 0)]
    cols = ["step_ms", "prepare_ms", "forward_call_ms", "layer_table_ms", "sample_ms", "device_span_ms",
            "experts_loaded"]
    out = kept.groupby(["policy", "budget", "tokens"], as_index=False)[cols].median()
    prof = frame[frame["profiled"] == 1].groupby(["policy", "budget", "tokens"], as_index=False)[
        ["kernel_ms", "h2d_ms"]].median()
    return out.merge(prof, on=["policy", "budget", "tokens"], how="left")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skew", type=float, default=0.7)
    ap.add_argument("--runs", default="static:80GiB,fixed:400GiB,fixed:32GiB",
                    help="POLICY:BUDGET,... engines to measure (budget of the full model, scaled to --layers)")
    ap.add_argument("--tokens", default="256,512,1024,2048,4096", help="prefill tokens per measured step")
    ap.add_argument("--requests", type=int, default=8, help="prompts per measured step (the tokens split among them)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--discard", type=int, default=2, help="first rounds dropped (kernels compiling, caches warming)")
    ap.add_argument("--hotset", default=None)
    ap.add_argument("--fast-synth", action="store_true")
    ap.add_argument("--gpu-synth", action="store_true", help="draw the synthetic weights on the device")
    ap.add_argument("--step-probe", type=int, default=0, metavar="ITERATIONS",
                    help="after every step call, time a fixed host workload of this size on the engine's thread "
                         "(e2e_gpu.py --step-probe): column host_probe_ms; 0: off")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (fp32; no CUDA events, no profiler)")
    args = ap.parse_args()
    try:
        runs = parse_runs(args.runs)
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if min(tokens) < args.requests or args.requests < 1:
        ap.error(f"every --tokens value must be at least --requests ({args.requests}) and --requests at least 1")
    if not 0 <= args.discard < args.repeats:
        ap.error("--discard must be at least 0 and below --repeats")
    if args.step_probe < 0:
        ap.error(f"--step-probe must be >= 0 (0: off), got {args.step_probe}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = SyntheticCheckpoint(args.model, args.seed, args.skew, args.layers, repeat_first_layer=args.fast_synth,
                               generate_on_device=args.gpu_synth).load(device, dtype)
    print(f"synthesized {args.layers} layers in {time.perf_counter() - t0:.0f} s", flush=True)
    full = ModelSpec.from_pretrained(args.model)
    rng = np.random.default_rng(args.seed)
    rows: list[dict] = []
    for policy, budget_text in runs:
        budget = e2e_scaled_budget(full, ckpt.spec, parse_bytes(budget_text), policy, dtype)
        llm = LLM(ckpt, gpu_memory_budget=budget, policy=policy, device=args.device, dtype=dtype, seed=args.seed,
                  max_num_seqs=max(16, args.requests), max_num_batched_tokens=max(tokens), kv_reserve=0.1,
                  enforce_eager=True, **({"hotset": args.hotset} if args.hotset else {}))
        t1 = time.perf_counter()
        info = llm.warmup_or_eager()
        print(f"{policy}:{budget_text}: warm-up {time.perf_counter() - t1:.1f} s, {info}, "
              f"cached experts {llm.stats().cached_experts}", flush=True)
        label = {"model": args.model, "layers": args.layers, "policy": policy, "budget": budget_text}
        probe = StepSpeedProbe(llm.timeline.__len__, args.step_probe) if args.step_probe > 0 else None
        with llm.observe_steps(probe) if probe else contextlib.nullcontext():
            rows += measure(llm, label, tokens, args.requests, args.repeats, args.discard, rng, cuda, probe)
        pd.DataFrame(rows).assign(**provenance()).to_csv(out / "prefill_floor.csv", index=False)
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    frame = pd.DataFrame(rows)
    print(summarize(frame).to_string(index=False, float_format=lambda v: f"{v:.2f}"), flush=True)


if __name__ == "__main__":
    main()
