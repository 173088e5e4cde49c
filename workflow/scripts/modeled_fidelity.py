"""Fidelity of the modeled executor: replay the committed H200 e2e runs of the CUDA-graphed engine in
modeled mode and compare.

Each (run, policy, workload) of the ``--reference`` folders' e2e.csv (results/reference/e2e/graphs and later
runs: ABBA repeats) is re-run once — a modeled run is deterministic, and one that another folder measured with the
same set-up takes that replay (``Replays``) — with the same model shape (layers as
run), scaled budget (checked: the same initial cache), policy, KV reserve, hotset (the folder's hotset.json),
request lengths (checked: the same output tokens), arrivals (``--arrivals``: ``inproc``,
rimuru.workloads.arrivals as e2e_gpu.py draws them for rimuru.bench.inproc's loop, or ``legacy``, the numpy
draws of its earlier loop), decode-graph batch cap (``--graph-cap COMMIT=N``: the cap the measured commit
had) and the discarded warm-up pass of the trace's first ``--warmup-requests`` requests, with the cost
parameters of ``--cost-params``. Measured values are the median over the repeats, with their min and max.
Writes fidelity.csv (run, split, metric, measured, min, max, repeats, modeled, rel_error; ``split`` is
``fit`` for the runs of ``--fit``, whose per-step timelines the calibration fitted the step times on beside
the decode-floor segments, ``validate`` for the others), the modeled per-step timelines and a figure:
per-step time of the decode-floor segments (measured vs modeled: fit data) and every run's metrics.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from common import save_figure
from e2e_gpu import parse_engine, run_engine
from modeled_tp_check import tp_rows

from rimuru.engine.llm import LLM
from rimuru.engine.modeled.calibration import floor_features, load_floor, predict_steps, timeline_features
from rimuru.engine.modeled.cost import CostModel, CostParams
from rimuru.engine.modeled.hardware import load_gpu
from rimuru.engine.modeled.reference import (
    ENGINE_FEATURES,
    command_arg,
    e2e_scaled_budget,
    engine_features,
    hotset_prompts,
    parse_run_model,
    spec_with_layers,
    trace_skip,
)
from rimuru.engine.modeled.replay import TraceRequest, arrivals, replay, run_batch
from rimuru.experts.hotset import Hotset
from rimuru.models.spec import ModelSpec
from rimuru.units import parse_bytes
from rimuru.workloads.arrivals import ArrivalSpec, arrival_times

METRICS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "forward_steps", "peak_concurrency",
           "expert_gb_loaded", "cuda_graph_steps")
GOALS = {"output_throughput": 0.08, "mean_ttft_ms": 0.08, "forward_steps": 0.02, "peak_concurrency": 0.02}


def draw_arrivals(kind: str, n: int, rate: float | None, seed: int) -> np.ndarray:
    if kind == "legacy":
        return arrivals(n, rate, seed)
    spec = ArrivalSpec(kind="poisson", rate=rate) if rate else ArrivalSpec()
    return np.asarray(arrival_times(spec, n, seed), dtype=float)


# ENGINE_FEATURES' per-commit options: nargs and help (the option is the feature's name, --with-dashes)
FEATURE_OPTIONS = {
    "graph_cap": ("+", "COMMIT=N: offloading decode-graph cap of a commit"),
    "async_scheduling": ("+", "COMMIT=0|1: whether the measured commit's async scheduling overlapped a graphed step's "
                              "host work with the step before (the modeled engine's async_scheduling)"),
    "next_step_prefetch": ("+", "COMMIT=0|1: whether the measured commit's eager steps prefetch the next step's "
                                "first-layer misses (a98ef5f and later; the modeled engine's "
                                "modeled_next_step_prefetch)"),
    "kv_compaction": ("*", "COMMIT=0|1: whether the measured commit's elastic engine packed its KV pages "
                           "(5432607 and later; the modeled engine's kv_compaction)"),
    "short_lookahead": ("*", "COMMIT=0|1: whether the measured commit's scheduler counted the waiting queue's "
                             "next-step demand in R_b (9a2935b and later; the modeled engine's short_lookahead)"),
    "expand_headroom": ("*", "COMMIT=0|1: whether the measured commit's elastic engine kept one step's KV free before "
                             "expanding (03fa546 and later; the modeled engine's expand_headroom)"),
    "prefetch_before_graphs": ("*", "COMMIT=0|1: whether the measured commit's end-of-step prefetch also ran before a "
                                    "graphed step (the engine before 4e86d95; the modeled engine's "
                                    "prefetch_before_graphs)"),
    "running_lookahead": ("*", "COMMIT=0|1: whether the measured commit's R_b look-ahead counted the running "
                               "requests' next-step demand first (2d9b9ab and later; the modeled engine's "
                               "running_lookahead)"),
    "decode_kernels": ("*", "COMMIT=WAVE: the wave of the decode kernels the measured commit launched (4: before "
                            "02c534e, 5: wave5 before f7b685e, 7: fast): its graph replays take the terms fitted on "
                            "that wave's decode floors (calibration decode_kernels; the base terms where none is "
                            "fitted, said in the row's kernel_terms)"),
    "engine_terms": ("*", "COMMIT=WAVE: the wave of the engine whose eager-step host and copy terms the measured "
                          "commit replays with (calibration engine_terms, fitted on that engine's serving steps; 0: "
                          "the base terms, as where none is fitted, said in the row's engine_term_source)"),
}


def feature_option(feature: str) -> str:
    """The per-commit option of an engine feature: ``kv_compaction`` -> ``--kv-compaction``."""
    return "--" + feature.replace("_", "-")


def graph_caps(items: list[str], option: str = "--graph-cap") -> dict[str, int]:
    """KEY=N words of ``option`` (COMMIT=N, or FEATURE=N for --engine-default)."""
    caps = {}
    for item in items:
        commit, _, cap = item.partition("=")
        if not cap.isdigit():
            raise SystemExit(f"{option} takes KEY=N words, got {item!r}")
        caps[commit] = int(cap)
    return caps


def folder_run(ref: Path) -> str:
    """The run name of a folder that holds one run (its e2e.csv has no run column): the folder's name, prefixed
    by its parent's unless that is e2e/ (e2e/static_c56c229 -> static_c56c229, e2e/async_70e4f36/burst_400 ->
    async_70e4f36_burst_400)."""
    return ref.name if ref.parent.name == "e2e" else f"{ref.parent.name}_{ref.name}"


def fit_run_key(key: str) -> str:
    """The fidelity row name (RUN/POLICY) of a calibration's fit run ``FOLDER:POLICY`` (a folder under
    results/reference holding one run; a ``#...`` suffix, a run's workload and repeat, left off)."""
    folder, _, policy = key.partition("#")[0].rpartition(":")
    return f"{folder_run(Path('results/reference') / folder)}/{policy}"


def read_runs(path: Path) -> pd.DataFrame:
    """An e2e.csv, its ``commit`` column as text (a short hash such as ``99659e4`` would otherwise read as a number)."""
    return pd.read_csv(path, dtype={"commit": str})


# the columns that name a run's engine beside its policy (e2e_gpu.run_engine's options), where a folder has them
ENGINE_COLUMNS = ("loading_buffers", "gc_idle_collect", "split")


def buffer_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """An e2e.csv or timeline frame with its ``policy`` as e2e_gpu.py's ``--runs`` names the run's engine
    (``e2e_gpu.run_engine``: ``POLICY[+sized][+gcauto][+splitNN]``) where the frame has ``loading_buffers`` /
    ``gc_idle_collect`` / ``split`` columns (runs of several engines share a folder, e.g. buffers_6500491); unchanged
    without them (every run before them: whole-layer buffers, no idle collection, the command's kv_reserve)."""
    if not set(ENGINE_COLUMNS) & set(frame.columns):
        return frame
    buffers = frame["loading_buffers"] if "loading_buffers" in frame else pd.Series("layer", index=frame.index)
    gc_idle = (frame["gc_idle_collect"].astype(str).str.lower().isin(["true", "1"]) if "gc_idle_collect" in frame
               else pd.Series(True, index=frame.index))
    split = frame["split"].astype(float) if "split" in frame else pd.Series(np.nan, index=frame.index)
    engines = pd.DataFrame({"policy": frame["policy"].astype(str).to_numpy(), "buffers": buffers.astype(str).to_numpy(),
                            "gc_idle": gc_idle.to_numpy(), "split": split.to_numpy()})
    # one label per distinct engine (a timeline has one per step: tens of thousands of rows, a few engines)
    group = engines.groupby(list(engines.columns), sort=False, dropna=False)
    labels = np.array([run_engine(p, b, bool(g), None if np.isnan(f) else float(f))
                       for p, b, g, f in group.size().index], dtype=object)
    for label in set(labels):
        parse_engine(label)  # a clear error for an engine e2e_gpu.py does not name (e.g. loading_buffers 'foo')
    return frame.assign(policy=labels[group.ngroup().to_numpy()].tolist())


def engine_policy(label: str) -> tuple[str, str]:
    """A run's engine label (``buffer_labels``) -> (the engine's policy, its loading_buffers). ``+gcauto`` (Python's
    automatic collection instead of the idle collection) replays the same: the modeled engine's step time has no
    collector term; ``+splitNN`` sets the engine's kv_reserve (``run_kv_reserve``)."""
    run = parse_engine(label)
    return run.policy, run.buffers


def run_kv_reserve(label: str, command: str) -> float:
    """The kv_reserve a measured run's engine had: its split's complement (``+splitNN``, wave 19), else its command's
    ``--kv-reserve`` (e2e_gpu.py's default 0.1)."""
    return parse_engine(label).kv_reserve(float(command_arg(command, "--kv-reserve", 0.1)))


def fit_names(keys: list[str], root: str = "results/reference") -> set[str]:
    """RUN/POLICY as fidelity.csv names the runs of ``--fit-timelines`` keys DIR/RUN:POLICY: RUN, or the folder's
    name where its e2e.csv has no run column (one run per folder, e.g. e2e/static_c56c229)."""
    out = set()
    for key in keys:
        path, policy = key.rsplit(":", 1)
        folder, run = path.rsplit("/", 1)
        runs = pd.read_csv(Path(root) / folder / "e2e.csv", nrows=1)
        out.add(f"{run if 'run' in runs else folder_run(Path(folder))}/{policy}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reference", nargs="+", default=["results/reference/e2e/graphs"],
                    help="folders with an e2e.csv and the hotset.json their runs were served with")
    ap.add_argument("--lengths", required=True, help="CSV prompt_len,output_len (modeled_trace.py)")
    ap.add_argument("--cost-params", required=True)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--arrivals", choices=("inproc", "legacy"), default="inproc",
                    help="how the measuring script drew Poisson arrivals (see the module docstring)")
    for feature in ENGINE_FEATURES:  # one per-commit option each: COMMIT=N words
        nargs, text = FEATURE_OPTIONS[feature]
        ap.add_argument(feature_option(feature), dest=feature, nargs=nargs, default=[], help=text)
    ap.add_argument("--fit", nargs="*", default=[],
                    help="DIR/RUN:POLICY (the calibration's --fit-timelines, DIR under results/reference) of runs "
                         "whose per-step timelines the calibration fitted on: their rows are `fit`")
    ap.add_argument("--engine-default", nargs="*", default=[],
                    help="graph_cap=N async_scheduling=0|1 next_step_prefetch=0|1 kv_compaction=0|1 "
                         "short_lookahead=0|1 expand_headroom=0|1 prefetch_before_graphs=0|1 running_lookahead=0|1 "
                         "decode_kernels=WAVE: "
                         "the engine of every measured "
                         "commit the per-commit options above do not list (without it such a commit is an error)")
    ap.add_argument("--decode-floor", nargs="+", required=True,
                    help="decode-floor segments, newest first, as the calibration read them: figure")
    ap.add_argument("--tp-runs", nargs="*", default=[],
                    help="SPLIT=E2E_RUNS_CSV: tensor-parallel runs (e2e_tp_gpu.py) replayed with their trace and "
                         "hotset (--tp-trace, --tp-hotset); split fit for the runs the calibration's TP fit used")
    ap.add_argument("--tp-trace", default="results/reference/e2e_tp2/trace_sharegpt_400.jsonl.gz")
    ap.add_argument("--tp-hotset", default="results/reference/e2e_tp2/hotset.json")
    ap.add_argument("--routing-ablation", nargs="*", default=[],
                    help="FOLDER=HOTSET: replay FOLDER's runs once more with the routing model drawing from HOTSET's "
                         "probabilities (the cache still filled in the served hotset's order: "
                         "modeled_routing_profile); rows split `ablation`, named RUN routing:<HOTSET's folder>")
    ap.add_argument("--decode-gamma", nargs="*", default=[],
                    help="FOLDER=PROFILE: FOLDER's runs were served with PROFILE (a hotset under results/reference "
                         "whose decode tempering the calibration fitted: fitted.decode_gamma) and replay with its "
                         "decode_gamma; other folders with gamma 1 (the profile as measured)")
    ap.add_argument("--tp-decode-gamma", default="",
                    help="PROFILE (fitted.decode_gamma) whose decode_gamma the TP runs (served with --tp-hotset) "
                         "replay with")
    ap.add_argument("--chunk-law", nargs="*", default=[],
                    help="FOLDER=NAME: FOLDER's runs replay with the prefill chunk law NAME the calibration fitted "
                         "for their model build (fitted.chunk_law; its fit runs' rows are `fit`) and its prefill "
                         "tempering where it has one (prefill_gamma); other folders with the calibration's "
                         "routing_chunk_* and no prefill tempering")
    ap.add_argument("--routing-prior", nargs="*", default=[],
                    help="FOLDER=NAME: FOLDER's runs replay with the profile shrinkage NAME the calibration fitted for "
                         "their model build (fitted.routing_prior_build); other folders with the calibration's "
                         "routing_prior_tokens / routing_reference_curve")
    ap.add_argument("--decode-request", nargs="*", default=[],
                    help="FOLDER=NAME: FOLDER's runs replay each request's decode tokens with the per-request "
                         "tempering NAME the calibration fitted for their model build (fitted.decode_request: "
                         "routing.DecodeRequestLaw; its fit runs' rows are `fit`); other folders with every request "
                         "alike")
    ap.add_argument("--async-admission", action="store_true",
                    help="one-GPU replays admit the arrivals during a pipelined (async-scheduled) step after the next "
                         "step, as the engine measured (replay's async_admission: wave 12's rule 6); default: into it")
    ap.add_argument("--seed-spread", type=int, default=0,
                    help="replay every one-GPU Poisson run this many more times with the next engine seeds (the "
                         "routing draws; arrivals stay the run's) and write fidelity_seeds.csv beside --out-csv: each "
                         "draw and, per run and metric, their median, min and max (rows of record: the run's own seed)")
    ap.add_argument("--out-csv", required=True)
    ap.add_argument("--out-timelines", required=True, help="folder for the modeled timelines")
    ap.add_argument("--figure", required=True)
    args = ap.parse_args()
    frames = []
    for ref in map(Path, args.reference):
        frame = buffer_labels(read_runs(ref / "e2e.csv"))
        if "run" not in frame:  # one run per folder (e.g. e2e/static_c56c229): the folder names it
            frame.insert(0, "run", folder_run(ref))
        frames.append(frame.assign(hotset=str(ref / "hotset.json"), routing_profile=""))
    for item in args.routing_ablation:
        folder, _, profile = item.partition("=")
        matches = [f for f, ref in zip(frames, args.reference) if Path(ref) == Path(folder)]
        if not profile or len(matches) != 1:
            raise SystemExit(f"--routing-ablation takes FOLDER=HOTSET with FOLDER one of --reference, got {item!r}")
        frames.append(matches[0].assign(run=matches[0]["run"] + f" routing:{Path(profile).parent.name}",
                                        routing_profile=profile))
    e2e = pd.concat(frames, ignore_index=True)
    lengths = pd.read_csv(args.lengths)
    valued = ("graph_cap", "decode_kernels", "engine_terms")  # features with a value, not a switch
    maps = {feature: {c: n if feature in valued else bool(n)
                      for c, n in graph_caps(getattr(args, feature), feature_option(feature)).items()}
            for feature in ENGINE_FEATURES}
    fit = fit_names(args.fit)
    calibration = CostParams.load(args.cost_params)
    fitted_gamma = calibration.fitted.get("decode_gamma", {})

    def kernels_option(wave: int) -> tuple[int | None, str]:
        """The engine's modeled_decode_kernels for a commit of decode-kernel wave ``wave``, and which terms those are
        (``CostParams.decode_kernel_terms``): a wave without fitted terms replays with the base terms."""
        terms = calibration.decode_kernel_terms(wave)
        return (None if terms in ("base", "missing") else wave), terms

    def engine_terms_option(wave: int, tp: int = 1, hybrid: bool = False) -> tuple[int | None, str]:
        """The engine's modeled_engine_terms for a commit of engine wave ``wave``, and which terms a run of it at
        tensor-parallel size ``tp`` (of a hybrid model or not) replays with (``CostParams.engine_term_source``): a
        wave without fitted terms replays with the base terms, as a configuration outside its fit data does."""
        source = calibration.engine_term_source(wave, tp, hybrid)
        return (None if source in ("base", "missing") else wave), source

    def gamma_of(profile: str) -> float:
        if not profile:
            return 1.0
        if profile not in fitted_gamma:
            raise SystemExit(f"{args.cost_params} has no decode_gamma fitted for {profile} "
                             f"(fitted: {', '.join(fitted_gamma) or 'none'})")
        return float(fitted_gamma[profile]["decode_gamma"])

    gamma_folder = {}
    for item in args.decode_gamma:
        folder, _, profile = item.partition("=")
        if Path(folder) not in [Path(r) for r in args.reference]:
            raise SystemExit(f"--decode-gamma takes FOLDER=PROFILE with FOLDER one of --reference, got {item!r}")
        gamma_folder[str(Path(folder) / "hotset.json")] = (profile, gamma_of(profile))
    for profile, _ in set(gamma_folder.values()):  # the runs an applied decode tempering was fitted on (one-GPU
        for name in fitted_gamma[profile]["runs"]:  # e2e folders: DIR:POLICY#WORKLOAD/REPEAT) are fit runs (wave 12)
            if (Path("results/reference") / name.partition("#")[0].rpartition(":")[0] / "e2e.csv").exists():
                fit.add(fit_run_key(name))
    fitted_laws = calibration.fitted.get("chunk_law", {})
    for law in fitted_laws.values():  # the runs a named chunk law was fitted on (calibration --chunk-law-fit)
        fit |= {fit_run_key(key) for key in law["runs"]}
    for folder in calibration.fitted.get("engine_terms_fit", {}).get("input", []):  # an engine's own terms' fit runs
        ref = Path("results/reference") / folder
        fit |= {f"{folder_run(ref)}/{label}" for label in buffer_labels(read_runs(ref / "e2e.csv"))["policy"]}
    def per_folder(items: list[str], option: str, fitted: dict, what: str) -> dict[str, tuple[str, dict]]:
        """FOLDER=NAME items of ``option``: each folder's hotset path -> (NAME, the calibration's entry NAME of
        ``fitted``), FOLDER one of --reference."""
        references, out = [Path(r) for r in args.reference], {}
        for item in items:
            folder, _, name = item.partition("=")
            if Path(folder) not in references or name not in fitted:
                raise SystemExit(f"{option} takes FOLDER=NAME with FOLDER one of --reference and NAME {what} of "
                                 f"{args.cost_params} (fitted: {', '.join(fitted) or 'none'}), got {item!r}")
            out[str(Path(folder) / "hotset.json")] = (name, fitted[name])
        return out

    law_folder = {hotset: (name, (float(law["routing_chunk_scale"]), float(law["routing_chunk_exponent"]),
                                  float(law.get("routing_chunk_cross", 1.0))), float(law.get("prefill_gamma", 1.0)))
                  for hotset, (name, law) in per_folder(args.chunk_law, "--chunk-law", fitted_laws,
                                                        "a chunk law").items()}
    prior_folder = {hotset: (name, (float(b["routing_prior_tokens"]), tuple(b["routing_reference_curve"])))
                    for hotset, (name, b) in per_folder(args.routing_prior, "--routing-prior",
                                                        calibration.fitted.get("routing_prior_build", {}),
                                                        "a routing prior").items()}
    request_folder = {}
    for hotset, (name, law) in per_folder(args.decode_request, "--decode-request",
                                          calibration.fitted.get("decode_request", {}),
                                          "a decode request law").items():
        request_folder[hotset] = (name, (float(law["exponent"]), float(law["ref"]), float(law["spread"]),
                                         float(law["center"])))
        fit |= {fit_run_key(key) for key in law["fit_runs"]}  # its fit runs are fit rows
    default = graph_caps(args.engine_default, "--engine-default") if args.engine_default else None
    rows, seed_rows = [], []
    replays = Replays(args.async_admission)
    timelines = Path(args.out_timelines)
    timelines.mkdir(parents=True, exist_ok=True)
    for (run, label, workload), group in e2e.groupby(["run", "policy", "workload"], sort=False):
        row = group.iloc[0]
        policy, buffers = engine_policy(label)
        key = f"{run}/{label}/{workload}"
        if group["commit"].nunique() != 1 or group["command"].nunique() != 1:
            raise SystemExit(f"{key}: repeats from different commits or commands")
        commit = str(row["commit"])
        try:
            engine = engine_features(commit, maps, default)
        except ValueError as exc:
            raise SystemExit(f"{key}: {exc} ({', '.join(feature_option(f) for f in ENGINE_FEATURES)} or "
                             f"--engine-default {' '.join(f + '=N' for f in ENGINE_FEATURES)})") from None
        for feature, value in engine.items():
            maps[feature][commit] = value if feature in valued else bool(value)
        feat = {feature: maps[feature][commit] for feature in ENGINE_FEATURES}
        name, layers = parse_run_model(row["model"])
        full, small = ModelSpec.from_pretrained(name), spec_with_layers(name, layers)
        budget = e2e_scaled_budget(full, small, parse_bytes(f"{row['budget_gib']}GiB"), policy)
        engine_wave, engine_source = engine_terms_option(feat["engine_terms"], 1, small.is_hybrid)
        command = row["command"]
        kv_reserve = run_kv_reserve(label, command)
        seed = int(command_arg(command, "--seed", 0))

        engine_options = dict(
            executor="modeled", gpu_memory_budget=budget, policy=policy, kv_reserve=kv_reserve,
            loading_buffers=buffers, hotset=row["hotset"], hardware=args.hardware, cost_params=args.cost_params,
            offload_graph_max_batch=feat["graph_cap"], async_scheduling=feat["async_scheduling"],
            modeled_next_step_prefetch=feat["next_step_prefetch"], kv_compaction=feat["kv_compaction"],
            short_lookahead=feat["short_lookahead"], expand_headroom=feat["expand_headroom"],
            prefetch_before_graphs=feat["prefetch_before_graphs"], running_lookahead=feat["running_lookahead"],
            modeled_decode_kernels=kernels_option(feat["decode_kernels"])[0],
            modeled_engine_terms=engine_wave,
            modeled_routing_profile=row["routing_profile"] or None,
            modeled_decode_gamma=gamma_folder.get(str(Path(row["hotset"])), ("", 1.0))[1],
            modeled_chunk_law=law_folder.get(str(Path(row["hotset"])), ("", None))[1],
            modeled_prefill_gamma=law_folder.get(str(Path(row["hotset"])), ("", None, 1.0))[2],
            modeled_routing_prior=prior_folder.get(str(Path(row["hotset"])), ("", None))[1],
            modeled_decode_request=request_folder.get(str(Path(row["hotset"])), ("", None))[1])
        n = int(row["num_requests"])
        # the hotset routed the first prompts of the script's whole trace (--num-requests), a Poisson run may serve
        # fewer of them (--poisson-requests): every served prompt is among the profiled ones when cal >= n
        cal = hotset_prompts(command, int(command_arg(command, "--num-requests", n)))
        max_out = int(command_arg(command, "--max-output", 0))  # e2e_gpu.py's output cap (0: none)
        # the run's trace: the lengths file from the request its trace started at (device_engine.sh E2E_TRACE_SKIP)
        run_lengths = lengths.iloc[trace_skip(command):].reset_index(drop=True)
        outputs = run_lengths["output_len"].clip(upper=max_out) if max_out else run_lengths["output_len"]
        if int(outputs[:n].sum()) != round(row["output_throughput"] * row["duration_s"]):
            raise SystemExit(f"{key}: the lengths file is not the run's trace (output tokens differ)")
        rate = None if np.isinf(row["request_rate"]) else float(row["request_rate"])
        trace = [TraceRequest(int(p), int(o), float(a)) for p, o, a in
                 zip(run_lengths["prompt_len"][:n], outputs[:n], draw_arrivals(args.arrivals, n, rate, seed))]
        warm = int(command_arg(command, "--warmup-requests", 0))
        before = list(zip(run_lengths["prompt_len"][:warm].astype(int), outputs[:warm].astype(int)))
        probe = step_probe_ms(Path(row["hotset"]).parent, label, workload)  # the run's step probe, if it had one
        replayed = replays.run((name, layers), small, seed, engine_options, before, trace, probe)
        initial = replayed.initial_cache_experts
        if initial != row["initial_cache_experts"]:
            raise SystemExit(f"{key}: modeled pool holds {initial} initial experts, the measured one "
                             f"{row['initial_cache_experts']}: budgets differ")
        metrics = replayed.metrics
        if workload == "poisson" and not row["routing_profile"]:  # the replay's own draw-to-draw spread
            for k in range(args.seed_spread + 1):
                draw = metrics if k == 0 else replays.run((name, layers), small, seed + k, engine_options, before,
                                                          trace, probe).metrics
                for m in SEED_METRICS:
                    med = float(group[m].astype(float).median())
                    seed_rows.append({"run": key, "engine_seed": seed + k, "metric": m, "measured": med,
                                      "measured_min": float(group[m].min()), "measured_max": float(group[m].max()),
                                      "modeled": float(draw[m]), "rel_error": float(draw[m]) / med - 1})
        for m in METRICS:
            measured = group[m].astype(float)
            med, modeled = float(measured.median()), float(metrics[m])
            split = "ablation" if row["routing_profile"] else "fit" if f"{run}/{label}" in fit else "validate"
            rows.append({"run": key, "split": split, "metric": m, "measured": med,
                         "measured_min": float(measured.min()),
                         "measured_max": float(measured.max()), "repeats": len(measured), "modeled": modeled,
                         "rel_error": (modeled - med) / med if med else float("nan"),
                         "goal": GOALS.get(m, float("nan")), "graph_cap": feat["graph_cap"],
                         "loading_buffers": buffers,
                         "kv_compaction": feat["kv_compaction"], "short_lookahead": feat["short_lookahead"],
                         "expand_headroom": feat["expand_headroom"],
                         "prefetch_before_graphs": feat["prefetch_before_graphs"],
                         "running_lookahead": feat["running_lookahead"], "decode_kernels": feat["decode_kernels"],
                         "kernel_terms": kernels_option(feat["decode_kernels"])[1],
                         "engine_terms": feat["engine_terms"],
                         "engine_term_source": engine_source,
                         "async_overlap": feat["async_scheduling"],
                         "async_admission": bool(args.async_admission and feat["async_scheduling"]),
                         "commit": commit, "hotset_prompts": cal,
                         "hotset_tokens": replayed.hotset_tokens, "hotset_in_sample": min(cal, n) / n,
                         "decode_gamma": replayed.decode_gamma,
                         "decode_gamma_profile": gamma_folder.get(str(Path(row["hotset"])), ("", 1.0))[0],
                         "chunk_law": law_folder.get(str(Path(row["hotset"])), ("", None))[0],
                         "prefill_gamma": replayed.prefill_gamma,
                         "routing_prior": prior_folder.get(str(Path(row["hotset"])), ("", None))[0],
                         "decode_request": request_folder.get(str(Path(row["hotset"])), ("", None))[0],
                         "step_probe_ms": probe})
        safe = re.sub(r"[^a-z0-9_]+", "_", key)
        replayed.timeline.to_csv(timelines / f"{safe}.csv", index=False)
        print(f"{key} (cap {feat['graph_cap']}, {len(group)} measured): " + ", ".join(
            f"{m} {float(group[m].median()):.4g} -> {float(metrics[m]):.4g}" for m in METRICS), flush=True)
    def tp_engine(commit: str) -> dict[str, int]:
        try:
            return engine_features(commit, maps, default)
        except ValueError as exc:
            raise SystemExit(f"TP run at {commit}: {exc}") from None

    for item in args.tp_runs:
        split, _, path = item.partition("=")
        if split not in ("fit", "validate") or not path:
            raise SystemExit(f"--tp-runs takes fit=PATH or validate=PATH, got {item!r}")
        for r in tp_rows(path, args.tp_trace, args.tp_hotset, args.cost_params, args.hardware, split,
                         engine=tp_engine, timelines=timelines, decode_gamma=gamma_of(args.tp_decode_gamma),
                         kernels=kernels_option, h2d=True, engine_terms=engine_terms_option):
            rows.append(r | {"goal": GOALS.get(r["metric"], float("nan")), "async_overlap": bool(r["async_scheduling"]),
                             "decode_gamma_profile": args.tp_decode_gamma})
    frame = pd.DataFrame(rows)
    Path(args.out_csv).parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out_csv, index=False)
    seed_spread(pd.DataFrame(seed_rows)).to_csv(Path(args.out_csv).with_name("fidelity_seeds.csv"), index=False)
    tp_paths = [p.partition("=")[2] for p in args.tp_runs]
    validate_tp = [p.partition("=")[2] for p in args.tp_runs if p.partition("=")[0] == "validate"]
    tp_band(validate_tp, frame).to_csv(Path(args.out_csv).with_name("fidelity_tp_band.csv"), index=False)
    setup_band(e2e[e2e["routing_profile"] == ""], frame).to_csv(
        Path(args.out_csv).with_name("fidelity_setup_band.csv"), index=False)
    kinds = step_kinds(args.reference, tp_paths, timelines)
    kinds.to_csv(Path(args.out_csv).with_name("fidelity_kinds.csv"), index=False)
    positions = decode_positions(args.reference, timelines, args.cost_params)
    positions.to_csv(Path(args.out_csv).with_name("fidelity_decode_position.csv"), index=False)
    pairs = policy_pairs(tp_paths, timelines)
    pairs.to_csv(Path(args.out_csv).with_name("fidelity_policy_pairs.csv"), index=False)
    serving = serving_steps(args.reference, fit, args.cost_params, args.hardware, maps["async_scheduling"],
                            kernels=lambda commit: kernels_option(maps["decode_kernels"][commit])[0],
                            engine_terms=lambda commit: engine_terms_option(maps["engine_terms"][commit])[0])
    serving.to_csv(Path(args.out_csv).with_name("fidelity_steps.csv"), index=False)
    figure(frame, floor_steps(args.decode_floor, args.cost_params, args.hardware), serving, args.figure)


TP_BAND_METRICS = ("output_throughput", "mean_ttft_ms")
POOL_POLICIES_WITHIN = 0.02  # tp_band pools a set-up's policies where their replays differ by at most this


def replay_with_warmup(llm: LLM, before: list[tuple[int, int]], trace: list[TraceRequest],
                       probe_ms: float = 0.0, async_admission: bool = False) -> dict:
    """The run's discarded pass (``before``: prompt and output lengths, all at once, before its clock started), then
    the timed ``trace`` (with ``probe_ms`` after every step: ``replay``'s ``between_steps_ms``; ``async_admission``:
    ``replay``'s, arrivals during a pipelined step join after the next one): ``replay``'s metrics plus the timed
    pass's decode-graph steps."""
    if before:
        run_batch(llm, before, "warmup-")
    graph_before = llm.executor.graph_steps
    metrics = replay(llm, trace, between_steps_ms=probe_ms, async_admission=async_admission)
    metrics["cuda_graph_steps"] = llm.executor.graph_steps - graph_before
    return metrics


SEED_METRICS = ("output_throughput", "mean_ttft_ms", "forward_steps")


@dataclass(frozen=True)
class Replayed:
    """What fidelity.csv and the timelines take from one replay (``replay_with_warmup``) and its engine."""

    metrics: dict
    initial_cache_experts: int
    hotset_tokens: int
    decode_gamma: float
    prefill_gamma: float
    timeline: pd.DataFrame  # the timed pass's steps (the engine's timeline)


def profile_key(path: str | None) -> tuple | str | None:
    """A hotset file as a replay uses it: its routing probabilities and token counts. Not its ``model`` (the name of
    the profiling run's checkpoint folder, a temporary name that differs from call to call), which no part of the
    modeled engine reads: folders whose hotsets differ only there replay the same. None and a path with no file (the
    engine's uniform profile) stay as they are."""
    if path is None or not Path(path).exists():
        return path
    h = Hotset.load(path)
    decode = None if h.decode_probability is None else h.decode_probability.tobytes()
    return h.probability.shape, h.probability.tobytes(), int(h.num_tokens), decode, int(h.decode_tokens)


class Replays:
    """Replays by what determines them: the model (name and layers), the engine seed, the engine's options with each
    hotset file read (``profile_key``), the discarded pass, the timed trace and the step probe. A modeled replay is
    deterministic, so a run that several folders measured with the same set-up (repeats of one engine in other
    calls, ``+gcauto`` beside the idle collection, a routing ablation whose profile is a folder's own hotset) and its
    seed-spread draws are replayed once and their results reused."""

    def __init__(self, async_admission: bool = False) -> None:
        self.async_admission = async_admission  # every replay's (replay_with_warmup)
        self._done: dict[tuple, Replayed] = {}
        self._profiles: dict[str | None, tuple | str | None] = {}

    def _profile(self, path: str | None) -> tuple | str | None:
        if path not in self._profiles:
            self._profiles[path] = profile_key(path)
        return self._profiles[path]

    def run(self, model: tuple[str, int | None], spec: ModelSpec, seed: int, options: dict,
            before: list[tuple[int, int]], trace: list[TraceRequest], probe_ms: float) -> Replayed:
        """``replay_with_warmup`` of ``LLM(spec, seed=seed, **options)`` (``model``: the name and layers ``spec`` was
        built from), or the result of the same replay done before."""
        files = {k: self._profile(options[k]) for k in ("hotset", "modeled_routing_profile")}
        key = (model, seed, tuple(sorted((options | files).items())), tuple(before), tuple(trace), probe_ms)
        if key not in self._done:
            llm = LLM(spec, seed=seed, **options)
            metrics = replay_with_warmup(llm, before, trace, probe_ms, self.async_admission)
            self._done[key] = Replayed(metrics, llm.memory_report["initial_cache_experts"],
                                       int(llm.hotset.num_tokens), llm.config.modeled_decode_gamma,
                                       llm.config.modeled_prefill_gamma, llm.timeline.frame())
        return self._done[key]


def step_probe_ms(folder: Path, policy: str, workload: str) -> float:
    """The median ``host_probe_ms`` of a measured run's steps (rows of the folder's timelines whose label, as
    ``buffer_labels`` gives it, is ``policy`` and whose workload is ``workload``): e2e_gpu.py --step-probe ran the probe
    on the engine thread after every step call, outside the step; the replay adds it after each of its steps (wave
    18). 0 for a run without the probe. Only timeline files with the probe's column are read, and only the columns
    used."""
    probes = []
    for path in sorted(folder.glob("timelines*.csv.gz")):
        columns = pd.read_csv(path, nrows=0).columns
        if "host_probe_ms" not in columns:
            continue
        used = [c for c in ("policy", "workload", *ENGINE_COLUMNS, "host_probe_ms") if c in columns]
        t = buffer_labels(pd.read_csv(path, usecols=used))
        probes.append(t.loc[(t["policy"] == policy) & (t["workload"] == workload), "host_probe_ms"].dropna())
    probe = pd.concat(probes) if probes else pd.Series(dtype=float)
    return float(probe.median()) if len(probe) else 0.0


def seed_spread(draws: pd.DataFrame) -> pd.DataFrame:
    """``draws`` (one row per run, engine seed and metric: the replay of that seed) with, per run and metric, the
    draws' median, min and max error against the measured median (``draws_*``) and the number of draws: how far the
    replay's own routing draws move a metric (wave 10). A miss smaller than that spread is not resolved by one draw."""
    if draws.empty:
        return draws
    stats = draws.groupby(["run", "metric"])["rel_error"].agg(draws="count", draws_median="median",
                                                             draws_min="min", draws_max="max").reset_index()
    return draws.merge(stats, on=["run", "metric"])


def tp_band(runs_paths: list[str], fidelity: pd.DataFrame) -> pd.DataFrame:
    """The TP validation held to a stated band (wave 9): the measured runs of one set-up (model label, per-GPU
    budget, requests, workload, TP degree, the trace's first request) pooled over every validation folder, call and
    policy — the measured order of the policies reversed from call to call while each rank's pinned H2D probe stayed
    flat, and the model predicts both policies within ~1% — as median, min and max; beside it each folder's replay
    (``fidelity``'s rows at the profile's rate) with its error against the pooled median and whether it lies within
    the measured range. Where the replays of one set-up's policies differ by more than ``POOL_POLICIES_WITHIN`` on a
    metric (the hybrid's bursts, wave 13: elastic 1.5x fixed, measured and modeled) the premise fails, and each policy
    has its own band (``policies`` says which)."""
    runs = []
    for path in runs_paths:
        r = pd.read_csv(path, dtype={"commit": str})
        skip = r["command"].map(lambda c: trace_skip(str(c))) if "command" in r else 0
        runs.append(r.assign(folder=Path(path).parent.name, trace_skip=skip)[r["request_rate"] == float("inf")])
    if not runs:
        return pd.DataFrame()
    runs = pd.concat(runs, ignore_index=True)
    keys = ["model", "budget_gib", "num_requests", "workload", "tensor_parallel_size", "trace_skip"]
    out = []
    for setup, g in runs.groupby(keys):
        for m in TP_BAND_METRICS:
            replays = {(folder, policy): fidelity[(fidelity["run"] == f"tp{int(setup[4])}_{folder}/{policy}/burst")
                                                  & (fidelity["metric"] == m)]
                       for (folder, policy), _ in g.groupby(["folder", "policy"])}
            by_policy = pd.Series({k: float(r["modeled"].iloc[0]) for k, r in replays.items() if not r.empty})
            by_policy = by_policy.groupby(level=1).median() if len(by_policy) else by_policy
            pooled = len(by_policy) < 2 or by_policy.max() / by_policy.min() - 1 <= POOL_POLICIES_WITHIN
            for (folder, policy), row in replays.items():
                if row.empty:
                    continue
                band = g if pooled else g[g["policy"] == policy]
                v = band[m].astype(float)
                modeled = float(row["modeled"].iloc[0])
                out.append({**dict(zip(keys, setup)), "metric": m, "policies": "pooled" if pooled else policy,
                            "runs": len(v), "folders": band["folder"].nunique(), **pooled_spread(v),
                            "run": f"{folder}/{policy}", "commit": str(row["commit"].iloc[0]), "modeled": modeled,
                            **against_band(v, modeled, m)})
    return pd.DataFrame(out)


def pooled_spread(v: pd.Series) -> dict:
    """A band's measured values (one set-up's runs pooled): median, min, max and the min's and max's offsets from the
    median (``tp_band``, ``setup_band``)."""
    med = float(v.median())
    return {"pooled_median": med, "pooled_min": float(v.min()), "pooled_max": float(v.max()),
            "spread_low": float(v.min()) / med - 1, "spread_high": float(v.max()) / med - 1}


def against_band(v: pd.Series, modeled: float, metric: str) -> dict:
    """A replay's ``modeled`` value of ``metric`` against a band's measured values ``v``: its error against their
    median, whether it lies within their range, and the metric's goal."""
    return {"rel_error_vs_pooled": modeled / float(v.median()) - 1,
            "within_measured_range": bool(v.min() <= modeled <= v.max()), "goal": GOALS.get(metric, float("nan"))}


SETUP_BAND_METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "forward_steps")
SETUP_KEYS = ("model", "budget_gib", "workload", "request_rate", "num_requests", "trace_skip", "hotset_prompts",
              "policy")


def setup_band(e2e: pd.DataFrame, fidelity: pd.DataFrame) -> pd.DataFrame:
    """One-GPU validation runs against their set-up's band (wave 16): every measured pass of one set-up (model label
    with its layers and output cap, budget, workload, rate, requests, the trace's first request, hotset prompts,
    policy) pooled over the folders that measured it — the same work measured in several calls, on several machines
    — as median, min and max; beside it each folder's replay (``fidelity``'s validation row) with its error against
    the pooled median and whether it lies within the measured range. Where the host's speed moves a run's steps by
    more than the goal between passes (wave 16: host-bound steps at two speeds 1.3-1.5x apart), a run's own median is
    one draw of that spread; the band says where the model sits in it. Set-ups measured by one folder are listed
    too (``folders`` 1)."""
    if e2e.empty:
        return pd.DataFrame()
    runs = e2e.assign(
        trace_skip=e2e["command"].map(lambda c: trace_skip(str(c))),
        hotset_prompts=[hotset_prompts(str(c), int(command_arg(str(c), "--num-requests", n)))
                        for c, n in zip(e2e["command"], e2e["num_requests"])])
    validate = fidelity[fidelity["split"] == "validate"]
    out = []
    for setup, g in runs.groupby(list(SETUP_KEYS), dropna=False):
        for m in SETUP_BAND_METRICS:
            if m not in g:
                continue
            v = g[m].astype(float)
            for run, r in g.groupby("run"):
                row = validate[(validate["run"] == f"{run}/{setup[-1]}/{setup[2]}") & (validate["metric"] == m)]
                if row.empty:
                    continue
                modeled = float(row["modeled"].iloc[0])
                out.append({**dict(zip(SETUP_KEYS, setup)), "metric": m, "runs": len(v), "folders": g["run"].nunique(),
                            **pooled_spread(v), "run": run, "run_median": float(r[m].astype(float).median()),
                            "modeled": modeled, "rel_error_vs_run": float(row["rel_error"].iloc[0]),
                            **against_band(v, modeled, m)})
    return pd.DataFrame(out)


def step_kind(frame: pd.DataFrame) -> np.ndarray:
    """``first`` (a run's first step: the burst's first prefill), ``prefill`` (prompt tokens, with or without
    decode tokens beside them) or ``decode``."""
    kind = np.where(frame["prefill_tokens"].to_numpy() > 0, "prefill", "decode").astype(object)
    kind[:1] = "first"
    return kind


def step_kinds(references: list[str], tp_runs: list[str], timelines: Path) -> pd.DataFrame:
    """Measured against replayed steps, summed per step kind (``step_kind``): steps, tokens, (layer, expert) pairs
    touched, experts loaded and step time of every measured repeat (``source`` ``measured``, ``repeat``) and of the
    replay (``modeled``; the timelines ``main`` wrote to ``timelines``), for every run with a per-step timeline
    (e2e ``timelines*.csv.gz``; TP runs' ``timeline.csv(.gz)`` beside their e2e_runs.csv). Where a replay's error
    comes from: which kind of step diverges, and whether in routing (touched, loaded) or in time per work."""
    out = []
    for run, measured, _ in measured_timelines(references, tp_runs):
        for (policy, workload), m in measured.groupby(["policy", "workload"]):
            safe = re.sub(r"[^a-z0-9_]+", "_", f"{run}/{policy}/{workload}")
            modeled = timelines / f"{safe}.csv"
            if not modeled.exists():
                continue
            sources = [("measured", r, g) for r, g in m.groupby("repeat")] + [("modeled", -1, pd.read_csv(modeled))]
            for source, repeat, g in sources:
                g = g.reset_index(drop=True)
                agg = g.assign(kind=step_kind(g)).groupby("kind").agg(
                    steps=("step", "size"), tokens=("tokens", "sum"), touched=("experts_touched", "sum"),
                    loaded=("experts_loaded", "sum"), step_ms=("step_ms", "sum")).reset_index()
                out.append(agg.assign(run=f"{run}/{policy}/{workload}", source=source, repeat=repeat))
    cols = ["run", "source", "repeat", "kind", "steps", "tokens", "touched", "loaded", "step_ms"]
    return pd.concat(out, ignore_index=True)[cols] if out else pd.DataFrame(columns=cols)


def measured_timelines(references: list[str], tp_runs: list[str]) -> list[tuple[str, pd.DataFrame, Path]]:
    """(run as fidelity.csv names it, every measured step of its timeline file, the folder's hotset) per timeline file
    of the e2e folders (``timelines*.csv.gz``) and of the TP runs' folders (``timeline.csv(.gz)``)."""
    out = []
    for ref in map(Path, references):
        runs = read_runs(ref / "e2e.csv")
        for path in sorted(ref.glob("timelines*.csv.gz")):
            trace_run = path.name.removeprefix("timelines").removeprefix("_").removesuffix(".csv.gz")
            out.append((trace_run if "run" in runs else folder_run(ref), buffer_labels(pd.read_csv(path)),
                        ref / "hotset.json"))
    for runs_path in map(Path, tp_runs):
        found = [p for p in (runs_path.parent / "timeline.csv.gz", runs_path.parent / "timeline.csv") if p.exists()]
        if found:
            frame = pd.read_csv(found[0])
            if "workload" not in frame:
                frame = frame.assign(workload="burst")  # a TP folder's timeline: bursts only
            out.append((f"tp2_{runs_path.parent.name}", frame, runs_path.parent / "hotset.json"))
    return out


def decode_positions(references: list[str], timelines: Path, cost_params: str,
                     buckets=(0, 2, 8, 32, 64, 128, 256, 100_000)) -> pd.DataFrame:
    """The fixed policy's Poisson runs (a static cache: one decode token's expected misses are one number): over the
    stretches of one running request after its own prefill, the recorded experts read in place per step against
    the routing model's expectation (the served hotset's routing, the calibration's shrinkage), by the request's
    decode position (steps since its prefill), for the measured repeats and the replay."""
    from rimuru.engine.modeled.routing import RoutingModel
    from rimuru.experts.hotset import Hotset

    params = CostParams.load(cost_params)
    out = []
    for run, frame, hotset_path in measured_timelines(references, []):
        for (policy, workload), m in frame.groupby(["policy", "workload"]):
            modeled = timelines / f"{re.sub(r'[^a-z0-9_]+', '_', f'{run}/{policy}/{workload}')}.csv"
            if policy != "fixed" or workload != "poisson" or not modeled.exists():
                continue
            hotset = Hotset.load(hotset_path)
            routing = RoutingModel.from_hotset(hotset, int(round(hotset.probability.sum(axis=1).mean())),
                                               chunk_scale=params.routing_chunk_scale,
                                               chunk_exponent=params.routing_chunk_exponent,
                                               prior_tokens=params.routing_prior_tokens,
                                               reference_curve=params.routing_reference_curve)
            rank = hotset.global_rank()
            one_token = routing.touch_probability(0.0, 1.0)
            sources = [("measured", r, g) for r, g in m.groupby("repeat")] + [("modeled", -1, pd.read_csv(modeled))]
            for source, repeat, g in sources:
                g = g.reset_index(drop=True)
                prefill, running = g["prefill_tokens"].to_numpy() > 0, g["running"].to_numpy()
                position = np.full(len(g), -1)
                for i in range(len(g)):  # steps since the one running request's prefill; -1 elsewhere
                    if prefill[i]:
                        position[i] = 0 if running[i] == 1 else -1
                    elif running[i] == 1 and i and position[i - 1] >= 0:
                        position[i] = position[i - 1] + 1
                sel = (position > 0) & ~prefill
                expected = np.array([one_token[rank >= c].sum() for c in g["cached_experts"][sel]])
                d = pd.DataFrame({"bucket": pd.cut(position[sel], list(buckets)).astype(str),
                                  "recorded": g["experts_loaded"].to_numpy(float)[sel], "expected": expected})
                agg = d.groupby("bucket", sort=False).agg(steps=("recorded", "size"), recorded=("recorded", "mean"),
                                                          expected=("expected", "mean")).reset_index()
                out.append(agg.assign(run=f"{run}/{policy}/{workload}", source=source, repeat=repeat,
                                      ratio=agg["recorded"] / agg["expected"]))
    cols = ["run", "source", "repeat", "bucket", "steps", "recorded", "expected", "ratio"]
    return pd.concat(out, ignore_index=True)[cols] if out else pd.DataFrame(columns=cols)


LATENESS = ("rank0_send_to_launch_ms", "rank1_received_late_ms", "rank1_launched_late_ms")


def policy_pairs(tp_runs: list[str], timelines: Path) -> pd.DataFrame:
    """TP runs whose timeline holds both policies (they serve the same requests in the same steps): per step kind
    (prefill: with prompt tokens; decode), over the steps where both did the same tokens, the median of fixed's step
    time minus elastic's and the mean of their loads' difference, measured (repeat r against repeat r) and replayed;
    where the measured timeline has each step's host lateness (``LATENESS``), the median of fixed's minus elastic's."""
    out = []
    for run, frame, _ in measured_timelines([], tp_runs):
        names = [timelines / f"{run}_{p}_burst.csv" for p in ("elastic", "fixed")]
        if set(frame["policy"]) < {"elastic", "fixed"} or not all(n.exists() for n in names):
            continue
        by = {(p, r): g for (p, r), g in frame.groupby(["policy", "repeat"])}
        pairs = [("measured", r, by[("elastic", r)], by[("fixed", r)]) for r in sorted(frame["repeat"].unique())
                 if ("elastic", r) in by and ("fixed", r) in by]
        pairs.append(("modeled", -1, *(pd.read_csv(n) for n in names)))
        for source, repeat, e, f in pairs:
            e, f = e.reset_index(drop=True), f.reset_index(drop=True)
            n = min(len(e), len(f))
            e, f = e.iloc[:n], f.iloc[:n]
            same = (e["tokens"].to_numpy() == f["tokens"].to_numpy())
            for kind, sel in (("prefill", same & (e["prefill_tokens"].to_numpy() > 0)),
                              ("decode", same & (e["prefill_tokens"].to_numpy() == 0))):
                diff = (f["step_ms"] - e["step_ms"]).to_numpy()[sel]
                loads = (f["experts_loaded"] - e["experts_loaded"]).to_numpy()[sel]
                # a timeline with each step's host lateness (e2e_tp_gpu.py since 6500491): the same difference of
                # rank 0's send-to-launch and rank 1's lateness, i.e. how much of fixed's extra step time is host
                late = {f"fixed_minus_elastic_{c}_median": float(np.median((f[c] - e[c]).to_numpy()[sel]))
                        for c in LATENESS if c in e and c in f and sel.any()}
                out.append({"run": run, "source": source, "repeat": repeat, "kind": kind, "steps": int(sel.sum()),
                            "elastic_median_ms": float(np.median(e["step_ms"].to_numpy()[sel])),
                            "fixed_median_ms": float(np.median(f["step_ms"].to_numpy()[sel])),
                            "fixed_minus_elastic_median_ms": float(np.median(diff)),
                            "fixed_minus_elastic_loads_mean": float(loads.mean())} | late)
    return pd.DataFrame(out)


def serving_steps(references: list[str], fit: list[str], cost_params: str, hardware: str,
                  overlap: dict[str, bool], kernels=None, engine_terms=None) -> pd.DataFrame:
    """The cost model fed each measured serving step's recorded work (calibration.timeline_features) against the
    step's measured time, as medians and sums per (run, step kind, resize: the adjuster shrank or expanded the cache
    in the step or not, running-request bucket): the step-time model alone, without the routing model or the
    replay. ``split`` as in fidelity.csv (``fit``: the fitted timeline). ``kernels``: a measured commit -> the
    engine's modeled_decode_kernels (the replay's; None: the base terms); ``engine_terms`` likewise its
    modeled_engine_terms."""
    base, gpu = CostParams.load(cost_params), load_gpu(hardware)
    out = []
    buckets = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    for ref in map(Path, references):
        runs = buffer_labels(read_runs(ref / "e2e.csv"))
        for path in sorted(ref.glob("timelines*.csv.gz")):
            trace_run = path.name.removeprefix("timelines").removeprefix("_").removesuffix(".csv.gz")
            run = trace_run if "run" in runs else folder_run(ref)  # as fidelity.csv names it
            for policy, t in buffer_labels(pd.read_csv(path)).groupby("policy"):
                rows = runs[runs["policy"] == policy]
                if "run" in runs:
                    rows = rows[rows["run"] == trace_run]
                if rows.empty:
                    continue
                name, layers = parse_run_model(rows["model"].iloc[0])
                commit = str(rows["commit"].iloc[0])
                spec = spec_with_layers(name, layers)
                params = base.with_decode_kernels(kernels(commit) if kernels is not None else None).with_engine_terms(
                    engine_terms(commit) if engine_terms is not None else None, 1, spec.is_hybrid)
                cost = CostModel(spec, gpu, params)
                t = t.reset_index(drop=True)
                x = timeline_features(t, cost, engine_policy(policy)[0],
                                      async_overlap=overlap.get(str(rows["commit"].iloc[0]), False))
                key = f"{run}/{policy}"
                resize = np.where(t["adjust"] < 0, "shrink", np.where(t["adjust"] > 0, "expand", "none"))
                frame = pd.DataFrame({"run": key, "split": "fit" if key in fit else "validate", "kind": x["kind"],
                                      "resize": resize, "running": pd.cut(t["running"], buckets).astype(str),
                                      "measured_ms": x["measured"],
                                      "modeled_ms": predict_steps(x, cost, params, sync=x["sync"])})
                out.append(frame.groupby(["run", "split", "kind", "resize", "running"], as_index=False).agg(
                    steps=("measured_ms", "size"), measured_ms=("measured_ms", "median"),
                    modeled_ms=("modeled_ms", "median"), measured_ms_sum=("measured_ms", "sum"),
                    modeled_ms_sum=("modeled_ms", "sum")))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def floor_steps(paths: list[str], cost_params: str, hardware: str) -> pd.DataFrame:
    """Each decode-floor segment's measured median step time beside the fitted cost model's."""
    floor = load_floor(paths)
    params, gpu = CostParams.load(cost_params), load_gpu(hardware)
    out = []
    for layers, f in floor.groupby("layers"):
        f = f.reset_index(drop=True)
        cost = CostModel(spec_with_layers(f["model"].iloc[0], int(layers)), gpu, params)
        x = floor_features(f, cost)
        out.append(f.assign(modeled_ms=predict_steps(x, cost, params, sync=x["sync"])))
    return pd.concat(out)


def figure(frame: pd.DataFrame, steps: pd.DataFrame, serving: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(frame["run"]))
    metrics = ["output_throughput", "mean_ttft_ms", "mean_tpot_ms", "forward_steps", "peak_concurrency",
               "cuda_graph_steps"]
    colors = plt.cm.tab10(np.linspace(0, 1, 10))
    fig, (left, ax) = plt.subplots(1, 2, figsize=(17, 5.5), gridspec_kw={"width_ratios": [1, 1.6]})
    for (layers, mode), d in steps.groupby(["layers", "mode"]):
        left.scatter(d["step_ms"], d["modeled_ms"], s=14, marker="o" if mode == "graph" else "x",
                     label=f"decode floor {layers} layers, {mode}")
    for split, d in serving.groupby("split") if len(serving) else []:
        d = d[d["steps"] >= 5]
        left.scatter(d["measured_ms"], d["modeled_ms"], s=18, marker="s" if split == "fit" else "^",
                     facecolors="none", edgecolors="k" if split == "fit" else "m",
                     label=f"serving steps ({split}): median per run, kind, running bucket")
    lo = min(steps[["step_ms", "modeled_ms"]].min().min(), serving[["measured_ms", "modeled_ms"]].min().min())
    hi = max(steps[["step_ms", "modeled_ms"]].max().max(), serving[["measured_ms", "modeled_ms"]].max().max())
    lim = [lo * 0.8, hi * 1.2]
    left.plot(lim, lim, "k-", lw=0.8)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("measured median step (ms)")
    left.set_ylabel("modeled step (ms)")
    left.set_title("step time: the cost model fed each step's recorded work")
    left.legend(fontsize=7)
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        d = frame[frame["run"] == run].set_index("metric").reindex(metrics)  # TP rows have no graph count
        lo = 100 * (d["measured_min"] - d["measured"]) / d["measured"]
        hi = 100 * (d["measured_max"] - d["measured"]) / d["measured"]
        x = np.arange(len(metrics)) + i * width
        split = d["split"].iloc[0]
        ax.bar(x, 100 * d["rel_error"], width, color=colors[i % 10], label=f"{run} ({split})",
               hatch="//" if split == "fit" else None)
        ax.errorbar(x, np.zeros(len(x)), yerr=[-lo, hi], fmt="none", ecolor="k", capsize=2, lw=0.8)
    ax.axhline(0, color="k", lw=0.8)
    for y in (-8, 8):
        ax.axhline(y, color="gray", ls=":", lw=0.8)
    ax.set_xticks(np.arange(len(metrics)) + 0.4 - width / 2, metrics, rotation=20)
    ax.set_ylabel("modeled vs measured median (%)")
    ax.set_title("MODELED vs measured (H200, CUDA-graphed engine); whiskers: measured repeats' min-max")
    ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
