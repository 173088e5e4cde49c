"""Fit the modeled executor's cost parameters to the committed H200 measurements.

Inputs (results/reference/): the fused-MoE kernel tables, the attention table, the decode-step segments
of the CUDA-graphed engine (decode_floor_gpu.py's detail CSVs: step times) and the per-step timelines of the
e2e runs marked ``fit`` (their expert loads give the predictor's waste). Output: a CostParams JSON whose
``fitted`` entry names every input file with the commit that last changed it and the commit recorded in its
rows, the fits' errors and the assumptions (rimuru/engine/modeled/calibration.py explains each fit).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pandas as pd
from modeled_fidelity import buffer_labels

from rimuru.engine.modeled.calibration import (
    PREFILL_FLOOR_COLUMNS,
    FitRun,
    PrefillStep,
    admission_terms,
    fit_attention,
    fit_chunk_law,
    fit_chunk_routing,
    fit_decode_floor,
    fit_decode_gamma,
    fit_decode_kernels,
    fit_decode_request_law,
    fit_engine_terms,
    fit_gdn_eager,
    fit_gdn_prefill,
    fit_loop,
    fit_moe_kernel,
    fit_prefill_routing,
    fit_routing_prior,
    fit_tp,
    fit_tp_async,
    fit_tp_graph,
    floor_check,
    load_floor,
    pcie_eff_from_h2d,
    prefetch_waste,
    prefill_chunks,
)
from rimuru.engine.modeled.cost import CostModel, CostParams
from rimuru.engine.modeled.hardware import load_gpu
from rimuru.engine.modeled.reference import command_arg, parse_run_model, spec_with_layers, trace_skip
from rimuru.engine.modeled.routing import RoutingModel
from rimuru.experts.hotset import Hotset
from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance


def git_commit(path: str | Path) -> str:
    """The commit that last changed ``path`` ('uncommitted' if none)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h", "--", str(path)], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out = ""
    return out or "uncommitted"


def data_entry(path: Path, frame: pd.DataFrame | None = None) -> dict:
    entry = {"path": str(path), "git_commit": git_commit(path)}
    if frame is not None and "commit" in frame:
        entry["measured_at_commits"] = sorted(set(map(str, frame["commit"].dropna())))
    return entry


def reference_csv(ref: Path, path: str, option: str, data: list) -> pd.DataFrame:
    """The CSV ``path`` under ``ref`` that ``option`` names, its provenance appended to ``data``; a usage error if it is
    not there."""
    if not (ref / path).exists():
        raise SystemExit(f"{option}: {ref / path} not found")
    frame = pd.read_csv(ref / path)
    data.append(data_entry(ref / path, frame))
    return frame


def read_tp_timelines(folder: Path, option: str, gpu, params, data: list, by_repeat: bool = False) -> list:
    """The TP serving runs of ``folder`` (e2e_tp_gpu.py's ``e2e_runs.csv`` and ``timeline.csv(.gz)``) as the TP fits
    take them: (timeline, cost model at the run's model and TP degree, policy), one per policy or, ``by_repeat``, per
    policy and repeat (each run's steps consecutive); both files appended to ``data`` (the inputs' provenance)."""
    t_path = next((p for p in (folder / "timeline.csv", folder / "timeline.csv.gz") if p.exists()), None)
    if t_path is None:
        raise SystemExit(f"{option} {folder}: no timeline.csv(.gz) there")
    runs, frame = pd.read_csv(folder / "e2e_runs.csv"), pd.read_csv(t_path)
    data += [data_entry(folder / "e2e_runs.csv", runs), data_entry(t_path)]
    keys = ["policy", "repeat"] if by_repeat and "repeat" in frame else ["policy"]
    timelines = []
    for key, t in frame.groupby(keys):
        policy = key[0] if isinstance(key, tuple) else key
        row = runs[runs["policy"] == policy].iloc[0]
        name, layers = parse_run_model(row["model"])
        cost = CostModel(spec_with_layers(name, layers), gpu, params, tp=int(row["tensor_parallel_size"]))
        timelines.append((t.reset_index(drop=True), cost, policy))
    return timelines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reference", default="results/reference")
    ap.add_argument("--decode-floor", nargs="+", default=["engine/decode_floor_detail.csv"],
                    help="decode-step segments (decode_floor_gpu.py), relative to --reference, newest first: per layer "
                         "count the first file that has it (the step-time fit)")
    ap.add_argument("--fit-runs", required=True,
                    help="RUN:POLICY:WORKLOAD,... rows of e2e/e2e.csv whose timelines give the predictor's waste")
    ap.add_argument("--routing-fit-runs", default="",
                    help="RUN:POLICY:WORKLOAD,... rows of e2e/e2e.csv (Poisson: one prefill chunk per step) whose "
                         "timelines give the prefill chunks' routing correlation (routing_chunk_*)")
    ap.add_argument("--routing-prior-fit", default="",
                    help="DIR,... folders under --reference (fit runs) with a hotset.json built from many calibration "
                         "prompts and an e2e.csv: sub-sampled, they give routing_prior_tokens and "
                         "routing_reference_curve (every hotset's shrinkage toward uniform); empty: no shrinkage")
    ap.add_argument("--fit-timelines", default="",
                    help="DIR/RUN:POLICY,... measured per-step timelines (DIR/timelines_RUN.csv.gz under --reference, "
                         "every repeat of POLICY) fitted jointly with the decode-floor segments: prefill, mixed and "
                         "decode steps of serving runs; the fidelity check counts these runs as fit, not validation")
    ap.add_argument("--async-floor", nargs="*", default=[],
                    help="decode-floor files (relative to --reference) of an engine whose async scheduling overlaps: "
                         "its graph (async) and graph-sync segments are checked against the fitted model, not fitted")
    ap.add_argument("--fit-loop", action="store_true",
                    help="apply the serving-loop fit (loop_*; always written to fitted.loop_fit) to the parameters")
    ap.add_argument("--tp-step", default="",
                    help="e2e_tp_gpu.py step_tp.csv (relative to --reference) with rank 0's send-to-launch and the "
                         "peer's lateness per TP segment: tp_step_ms")
    ap.add_argument("--tp-timelines", default="",
                    help="folder (relative to --reference) with e2e_runs.csv and timeline.csv of TP serving runs: "
                         "tp_layer_ms (their rows in fidelity.csv are `fit`)")
    ap.add_argument("--tp-async-timelines", default="",
                    help="folder (relative to --reference): e2e_runs.csv and timeline.csv of TP serving runs of an "
                         "async-scheduling engine: tp_step_async_ms, tp_layer_async_ms (calibration.fit_tp_async)")
    ap.add_argument("--tp-async-kernels", type=int, default=None,
                    help="the decode-kernel wave that engine launched (its graph replays' terms)")
    ap.add_argument("--tp-graph-timelines", default="",
                    help="folder (relative to --reference): e2e_runs.csv and timeline.csv of a TP Poisson run of the "
                         "same async engine: tp_graph_async_ms from its graph replays (calibration.fit_tp_graph)")
    ap.add_argument("--gdn-timelines", default="",
                    help="folder (relative to --reference): e2e_runs.csv and timeline.csv of hybrid serving runs: "
                         "gdn_prefill_layer_ms from their chunked steps (calibration.fit_gdn_prefill)")
    ap.add_argument("--gdn-floor", nargs="*", default=[],
                    help="hybrid decode floors (decode_floor_gpu.py detail CSVs, relative to --reference; one layer "
                         "count each): gdn_eager_layer_ms from their eager segments together "
                         "(calibration.fit_gdn_eager), before the --gdn-timelines fit")
    ap.add_argument("--gdn-floor-steps", type=int, default=12,
                    help="those floors' steps per segment, discarded and measured (their context growth)")
    ap.add_argument("--decode-gamma-fit", nargs="*", default=[],
                    help="PROFILE=RUN+RUN...: a hotset (relative to --reference) and the fit runs served with it whose "
                         "decode steps give its decode tempering (RoutingModel decode_gamma; fitted.decode_gamma); or "
                         "BUILD=RUN+RUN...: a --routing-prior-build name, one tempering fitted jointly on that build's "
                         "runs, each with its own folder's hotset.json; RUN "
                         "DIR/TRACE:POLICY (DIR/timelines_TRACE.csv.gz, e2e.csv) or DIR:POLICY (a TP folder's "
                         "timeline.csv and e2e_runs.csv)")
    ap.add_argument("--chunk-law-fit", nargs="*", default=[],
                    help="NAME=DIR:POLICY+DIR:POLICY...: a named prefill chunk law (fitted.chunk_law[NAME]) fitted on "
                         "the prefill steps of these e2e folders' timelines (DIR/timelines*.csv.gz under --reference, "
                         "every repeat of POLICY, served with DIR/hotset.json), their chunks recovered from --lengths")
    ap.add_argument("--prefill-gamma-fit", nargs="*", default=[],
                    help="NAME...: chunk laws of --chunk-law-fit fitted jointly with a prefill tempering "
                         "(fit_prefill_routing: touched pairs and recorded loads of the same steps; "
                         "fitted.chunk_law[NAME] prefill_gamma), the profiles shrunk by the routing_prior_build of the "
                         "same NAME where there is one")
    ap.add_argument("--prefill-cross-fit", nargs="*", default=[],
                    help="NAME...: of --prefill-gamma-fit, also fit the law's cross-prompt exponent "
                         "(fitted.chunk_law[NAME] routing_chunk_cross: RoutingModel.chunk_cross, wave 21)")
    ap.add_argument("--routing-prior-build", nargs="*", default=[],
                    help="NAME=DIR+DIR...: a named profile shrinkage (fitted.routing_prior_build[NAME]: prior tokens "
                         "and reference curve, fit_routing_prior) fitted on the hotsets of these fit-run folders of "
                         "one model build (relative to --reference), for the runs of that build")
    ap.add_argument("--decode-request-fit", nargs="*", default=[],
                    help="NAME=DIR:POLICY+...: a --routing-prior-build NAME's per-request decode tempering "
                         "(fitted.decode_request[NAME]: routing.DecodeRequestLaw, fit_decode_request_law) fitted on "
                         "the stretches of one request decoding alone in these e2e folders' timelines (every repeat of "
                         "POLICY, served with DIR/hotset.json shrunk by the build's prior; a profile without a decode "
                         "split with the build's decode tempering, --decode-gamma-fit NAME, as its replay takes it)")
    ap.add_argument("--decode-request-spread", nargs="*", default=[],
                    help="NAME...: of --decode-request-fit, also fit a request's own draw (the law's spread: the "
                         "stretches' loads variance); without: spread 0, the prompt-length law alone")
    ap.add_argument("--lengths", default="",
                    help="CSV prompt_len,output_len (modeled_trace.py): the trace the --chunk-law-fit runs served")
    ap.add_argument("--decode-kernels-fit", nargs="*", default=[],
                    help="decode-floor files (decode_floor_gpu.py detail CSVs, relative to --reference) whose graphed "
                         "segments of the paged policies give the graph-replay terms of each decode-kernel wave "
                         "(fit_decode_kernels; CostParams.decode_kernels)")
    ap.add_argument("--decode-kernels-waves", nargs="*", default=[],
                    help="VARIANT=WAVE: the wave of the decode kernels a floor row's `kernels` column names (e.g. "
                         "fast=7 wave5=5 baseline=4); rows of other variants are left out")
    ap.add_argument("--decode-kernels-base", type=int, default=None,
                    help="the decode kernels' wave of the --decode-floor files (the base calibration's terms serve "
                         "it; a wave fitted here equal to it is reported, not applied)")
    ap.add_argument("--eager-host-overlap", action="store_true",
                    help="fit the eager pipeline in which a layer's host launches overlap the previous layer's experts "
                         "and their copies (CostParams.eager_host_overlap, wave 16); default: host and device serial")
    ap.add_argument("--tie-token-us", action="store_true",
                    help="a paged eager step's per-token term is the static fit timeline's (token_us = "
                         "resident_token_us, calibration.fit_decode_floor tie_token; wave 17's prefill floor); "
                         "default: token_us free in the joint fit")
    ap.add_argument("--post-sync", action="store_true",
                    help="with --eager-host-overlap: fit host_layer_post_share, the share of a layer's host time after "
                         "its routing sync, before its copies and experts can start (wave 17); default: 0")
    ap.add_argument("--pcie-from-h2d", default=None, metavar="SUMMARY_CSV",
                    help="hold pcie_eff at a measured H2D rate of expert-sized copies instead of fitting it: "
                         "tp_h2d_diag.py's summary.csv (relative to --reference), its one-GPU-alone cases' median GB/s "
                         "over the profile's (calibration.pcie_eff_from_h2d; wave 17)")
    ap.add_argument("--prefill-requests", nargs="*", default=[], metavar="CSV",
                    help="prefill_floor_gpu.py --requests R files (relative to --reference) at two or more prompt "
                         "counts: host_admit_us and host_finish_us as measured inputs (calibration.admission_terms; "
                         "wave 18), in place before the step fit; default: neither term (0)")
    ap.add_argument("--prefill-floor", nargs="*", default=[], metavar="CSV",
                    help="prefill_floor_gpu.py files (relative to --reference): their paged policies' kept steps join "
                         "the joint step fit with token_us and host_admit_us free (calibration.fit_decode_floor "
                         "prefill; wave 18; tried and not kept); default: none")
    ap.add_argument("--engine-terms-fit", default="", metavar="WAVE=DIR+DIR",
                    help="one engine's eager-step host and copy terms (calibration.fit_engine_terms; "
                         "CostParams.engine_terms[WAVE]) fitted, last, on every pass of the paged policies in these "
                         "e2e folders (relative to --reference: timelines.csv.gz and e2e.csv), runs measured with that "
                         "engine; default: none (every run replays with the base terms)")
    ap.add_argument("--engine-terms-free", nargs="*", default=[],
                    help="the terms --engine-terms-fit fits (of ENGINE_TERMS; every other term as fitted before)")
    ap.add_argument("--engine-terms-kernels", type=int, default=None,
                    help="the decode-kernel wave that engine launched (its graph replays' terms)")
    ap.add_argument("--engine-terms-weights", choices=("kind", "step"), default="kind",
                    help="kind: each step kind of each pass weighs alike (default); step: every step alike")
    ap.add_argument("--engine-terms-async", type=int, choices=(0, 1), default=1,
                    help="whether that engine's async scheduling overlapped its graph replays (1)")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ref = Path(args.reference)
    gpu = load_gpu(args.hardware)
    data = []

    kernel_tables, kernel_specs = [], []
    for path in sorted((ref / "kernel").glob("kernel_*.csv")):
        frame = pd.read_csv(path)
        kernel_tables.append(frame)
        kernel_specs.append(ModelSpec.from_pretrained(path.stem.removeprefix("kernel_")))
        data.append(data_entry(path, frame))
    kernel = fit_moe_kernel(kernel_tables, kernel_specs, gpu)
    att_path = ref / "attention_h200.csv"
    att_frame = pd.read_csv(att_path)
    attention = fit_attention(att_frame, gpu, kernel["hbm_eff"])
    data.append(data_entry(att_path, att_frame))
    base = CostParams(hbm_eff=kernel["hbm_eff"], mma_eff=kernel["mma_eff"], attn_eff=attention["attn_eff"],
                      gpu_layer_us=kernel["moe_fixed_us"] + attention["attn_fixed_us"],
                      eager_host_overlap=args.eager_host_overlap)

    e2e_path = ref / "e2e" / "e2e.csv"
    e2e = pd.read_csv(e2e_path)
    data.append(data_entry(e2e_path, e2e))

    def fit_run(key: str, chunk: dict) -> FitRun:
        run, policy, workload = key.split(":")
        row = e2e[(e2e["run"] == run) & (e2e["policy"] == policy) & (e2e["workload"] == workload)]
        if len(row) != 1:
            raise SystemExit(f"fit run {key}: {len(row)} rows in {e2e_path}")
        name, layers = parse_run_model(row.iloc[0]["model"])
        spec = spec_with_layers(name, layers)
        timeline_path = ref / "e2e" / run / f"timeline_{policy}_{workload}.csv"
        hotset_path = ref / "e2e" / run / "hotset.json"
        hotset = Hotset.load(hotset_path)
        timeline = pd.read_csv(timeline_path)
        data.extend([data_entry(timeline_path), data_entry(hotset_path)])
        return FitRun(key, timeline, spec, policy, RoutingModel.from_hotset(hotset, spec.top_k, **chunk),
                      hotset.global_order())

    routing_fit = {}
    if args.routing_fit_runs:
        routing_fit = fit_chunk_routing([fit_run(k, {}) for k in args.routing_fit_runs.split(",")])
        base = base.replace(routing_chunk_scale=routing_fit["routing_chunk_scale"],
                            routing_chunk_exponent=routing_fit["routing_chunk_exponent"])
    prior_fit = {}
    if args.routing_prior_fit:
        profiles, seen, top_k = [], set(), set()
        for folder in args.routing_prior_fit.split(","):
            hotset_path, runs_path = ref / folder / "hotset.json", ref / folder / "e2e.csv"
            hotset, runs = Hotset.load(hotset_path), pd.read_csv(runs_path)
            top_k.add(spec_with_layers(*parse_run_model(runs["model"].iloc[0])).top_k)
            data.extend([data_entry(hotset_path), data_entry(runs_path)])
            key = hotset.probability.round(6).tobytes()
            if key not in seen:  # the same profile served several folders (e.g. graphs and static_c56c229)
                seen.add(key)
                profiles.append(hotset.probability)
        if len(top_k) != 1:
            raise SystemExit(f"--routing-prior-fit: the folders' models route to {sorted(top_k)} experts, not one k")
        prior_fit = fit_routing_prior(profiles, top_k.pop())
        prior_fit["folders"] = args.routing_prior_fit.split(",")
        base = base.replace(routing_prior_tokens=prior_fit["routing_prior_tokens"],
                            routing_reference_curve=tuple(prior_fit["routing_reference_curve"]))
    chunk = {"chunk_scale": base.routing_chunk_scale, "chunk_exponent": base.routing_chunk_exponent,
             "prior_tokens": base.routing_prior_tokens, "reference_curve": base.routing_reference_curve}
    runs = [fit_run(k, chunk) for k in args.fit_runs.split(",")]
    base = base.replace(prefetch_waste=prefetch_waste(runs))
    prior_builds = {}
    for item in args.routing_prior_build:
        name, _, folders = item.partition("=")
        if not folders:
            raise SystemExit(f"--routing-prior-build takes NAME=DIR+DIR..., got {item!r}")
        profiles, top_k = [], set()
        for folder in folders.split("+"):
            hotset_path, runs_path = ref / folder / "hotset.json", ref / folder / "e2e.csv"
            if not hotset_path.exists() or not runs_path.exists():
                raise SystemExit(f"--routing-prior-build {name}: no hotset.json or e2e.csv in {ref / folder}")
            profiles.append(Hotset.load(hotset_path).probability)
            top_k.add(spec_with_layers(*parse_run_model(pd.read_csv(runs_path)["model"].iloc[0])).top_k)
            data.extend([data_entry(hotset_path), data_entry(runs_path)])
        if len(top_k) != 1:
            raise SystemExit(f"--routing-prior-build {name}: the folders' models route to {sorted(top_k)} experts")
        prior_builds[name] = fit_routing_prior(profiles, top_k.pop()) | {"folders": folders.split("+")}
    def build_shrink(build: str) -> dict:
        """The routing model's shrinkage of a profile of ``build`` (a routing_prior_build name; '': the base one)."""
        return chunk if not build else chunk | {
            "prior_tokens": prior_builds[build]["routing_prior_tokens"],
            "reference_curve": tuple(prior_builds[build]["routing_reference_curve"])}

    decode_gamma = {}
    for item in args.decode_gamma_fit:
        profile, _, keys = item.partition("=")
        if not keys:
            raise SystemExit(f"--decode-gamma-fit takes PROFILE=RUN+RUN... or BUILD=RUN+RUN..., got {item!r}")
        # PROFILE: a hotset (relative to --reference) every run was served with. BUILD: a routing_prior_build name
        # (wave 11): one tempering for the model build, fitted jointly on its fit runs, each run with the hotset its
        # own folder holds (the one it was served with) shrunk by the build's prior
        by_build = profile in prior_builds and not (ref / profile).is_file()
        if by_build:
            build, hotset = profile, None
        else:
            hotset = Hotset.load(ref / profile)
            data.append(data_entry(ref / profile))
            # a profile of a model build with its own shrinkage (routing_prior_build) is shrunk as its build's runs
            build = next((name for name, fit in prior_builds.items()
                          if str(Path(profile).parent) in fit["folders"]), "")
        shrink = build_shrink(build)
        gamma_runs = []
        for key in keys.split("+"):
            path, policy = key.rsplit(":", 1)
            run_hotset = hotset
            if by_build:
                if not (ref / path / "hotset.json").is_file():
                    raise SystemExit(f"--decode-gamma-fit {profile}: {key} has no hotset.json in {ref / path}")
                run_hotset = Hotset.load(ref / path / "hotset.json")
                data.append(data_entry(ref / path / "hotset.json"))
            if (ref / path / "timelines.csv.gz").exists():  # a one-GPU e2e folder: timelines.csv.gz and e2e.csv
                t_path, runs_path = ref / path / "timelines.csv.gz", ref / path / "e2e.csv"
            elif (ref / path).is_dir():  # a TP folder: timeline.csv(.gz) and e2e_runs.csv
                t_path = next(p for p in (ref / path / "timeline.csv.gz", ref / path / "timeline.csv") if p.exists())
                runs_path = ref / path / "e2e_runs.csv"
            else:
                folder, trace = path.rsplit("/", 1)
                t_path, runs_path = ref / folder / f"timelines_{trace}.csv.gz", ref / folder / "e2e.csv"
            t_frame = pd.read_csv(t_path)
            t_frame = t_frame[t_frame["policy"] == policy]
            model = pd.read_csv(runs_path)["model"].iloc[0]
            spec = spec_with_layers(*parse_run_model(model))
            data.append(data_entry(t_path))
            by = [c for c in ("workload", "repeat") if c in t_frame]  # one run per workload and repeat
            for run_id, t in t_frame.groupby(by):
                gamma_runs.append(FitRun(f"{key}#{'/'.join(map(str, run_id))}", t.reset_index(drop=True), spec, policy,
                                         RoutingModel.from_hotset(run_hotset, spec.top_k, **shrink),
                                         run_hotset.global_order()))
        decode_gamma[profile] = fit_decode_gamma(gamma_runs, base.prefetch_waste) | {
            "routing_prior_build": build, "by": "build" if by_build else "profile"}
    chunk_laws = {}
    for item in args.chunk_law_fit:
        name, _, keys = item.partition("=")
        if not keys or not args.lengths:
            raise SystemExit(f"--chunk-law-fit takes NAME=DIR:POLICY+... and needs --lengths, got {item!r}")
        prompt_lens = pd.read_csv(args.lengths)["prompt_len"].to_numpy()
        rows, prefill_steps = [], []
        joint = name in args.prefill_gamma_fit  # the law and the prefill tempering, on touched pairs and loads
        for key in keys.split("+"):
            folder, _, policy = key.rpartition(":")
            runs_path, hotset_path = ref / folder / "e2e.csv", ref / folder / "hotset.json"
            paths = sorted((ref / folder).glob("timelines*.csv.gz"))
            if not paths or not runs_path.exists():
                raise SystemExit(f"--chunk-law-fit {key}: no timelines*.csv.gz or e2e.csv in {ref / folder}")
            runs = pd.read_csv(runs_path)
            spec = spec_with_layers(*parse_run_model(runs["model"].iloc[0]))
            # the run's trace: the lengths file from the request its trace started at (device_engine.sh E2E_TRACE_SKIP)
            lens = prompt_lens[trace_skip(runs["command"].iloc[0]):]
            prompts = int(lens[: int(runs["num_requests"].iloc[0])].sum())
            hotset = Hotset.load(hotset_path)
            # the joint fit shrinks the profile as the build's runs replay (its routing_prior_build, if any)
            shrink = build_shrink(name if joint and name in prior_builds else "")
            routing = RoutingModel.from_hotset(hotset, spec.top_k, prior_tokens=shrink["prior_tokens"],
                                               reference_curve=shrink["reference_curve"])
            rank = hotset.global_rank() if joint else None  # a pair's place in the cache's fill order
            data.extend([data_entry(runs_path), data_entry(hotset_path)] + [data_entry(p) for p in paths])
            for path in paths:
                frame = pd.read_csv(path)
                for _, t in frame[frame["policy"] == policy].groupby("repeat"):
                    if t["preempted"].any():
                        raise SystemExit(f"--chunk-law-fit {key}: a preempted request (chunks not recoverable)")
                    if int(t["prefill_tokens"].sum()) != prompts:
                        raise SystemExit(f"--chunk-law-fit {key}: {int(t['prefill_tokens'].sum())} prefill tokens, "
                                         f"the trace's first prompts {prompts}: --lengths is not the run's trace")
                    chunks = prefill_chunks(t["prefill_tokens"], lens)
                    rows += [(routing, int(d), c, float(m)) for d, c, m in
                             zip(t["decode_tokens"], chunks, t["experts_touched"]) if sum(c) > 1]
                    if joint:
                        # loads: expansions off; an eager step's misses times 1 + the predictor's waste, as replayed
                        prefill_steps += [
                            PrefillStep(routing, int(d), tuple(c), float(m), float(loaded - max(adjust, 0)),
                                        rank >= int(cached), 1.0 if graph == 1 else 1.0 + base.prefetch_waste)
                            for d, c, m, loaded, adjust, cached, graph in
                            zip(t["decode_tokens"], chunks, t["experts_touched"], t["experts_loaded"], t["adjust"],
                                t["cached_experts"], t["cuda_graph"]) if sum(c) > 1]
        if not rows:
            raise SystemExit(f"--chunk-law-fit {name}: no prefill steps")
        if name in args.prefill_cross_fit and not joint:
            raise SystemExit(f"--prefill-cross-fit {name}: only with --prefill-gamma-fit {name}")
        if joint:
            chunk_laws[name] = fit_prefill_routing(prefill_steps, cross=name in args.prefill_cross_fit) | {
                "runs": keys.split("+"), "routing_prior_build": name if name in prior_builds else "",
                "waste": base.prefetch_waste}
        else:
            chunk_laws[name] = fit_chunk_law(rows) | {"runs": keys.split("+")}
    decode_request = {}
    for item in args.decode_request_fit:
        name, _, keys = item.partition("=")
        if not keys or name not in prior_builds:
            raise SystemExit(f"--decode-request-fit takes NAME=DIR:POLICY+... with NAME a --routing-prior-build, "
                             f"got {item!r}")
        build_gamma = float(decode_gamma[name]["decode_gamma"]) if name in decode_gamma else 1.0
        shrink, request_runs = build_shrink(name), []
        for key in keys.split("+"):
            folder, _, policy = key.rpartition(":")
            paths = [ref / folder / f for f in ("timelines.csv.gz", "e2e.csv", "hotset.json")]
            if not all(p.exists() for p in paths):
                raise SystemExit(f"--decode-request-fit {key}: no timelines.csv.gz, e2e.csv or hotset.json in "
                                 f"{ref / folder}")
            spec = spec_with_layers(*parse_run_model(pd.read_csv(paths[1])["model"].iloc[0]))
            hotset = Hotset.load(paths[2])
            routing = RoutingModel.from_hotset(hotset, spec.top_k, prior_tokens=shrink["prior_tokens"],
                                               reference_curve=shrink["reference_curve"])
            gamma = build_gamma if hotset.decode_probability is None else 1.0
            data.extend(data_entry(p) for p in paths)
            frame = pd.read_csv(paths[0])
            for repeat, t in frame[frame["policy"] == policy].groupby("repeat"):
                request_runs.append((FitRun(f"{key}#{repeat}", t.sort_values("step").reset_index(drop=True), spec,
                                            policy, routing, hotset.global_order()), gamma))
        try:
            decode_request[name] = fit_decode_request_law(request_runs, spread=name in args.decode_request_spread) | {
                "fit_runs": keys.split("+")}
        except ValueError as exc:
            raise SystemExit(f"--decode-request-fit {name}: {exc}") from None
    floor = load_floor([ref / path for path in args.decode_floor])
    for path, rows in floor.groupby("source", sort=False):
        data.append(data_entry(Path(path), rows) | {"layers": sorted(map(int, rows["layers"].unique()))})
    frames = [f.reset_index(drop=True) for _, f in floor.groupby("layers")]
    floor_costs = [CostModel(spec_with_layers(f["model"].iloc[0], int(f["layers"].iloc[0])), gpu, base) for f in frames]
    timelines = []
    for key in filter(None, args.fit_timelines.split(",")):
        path, policy = key.rsplit(":", 1)
        folder, run = path.rsplit("/", 1)
        t_path = ref / folder / f"timelines_{run}.csv.gz"
        runs_path = ref / folder / "e2e.csv"
        t_all, t_runs = pd.read_csv(t_path), pd.read_csv(runs_path)
        t_frame = t_all[t_all["policy"] == policy].reset_index(drop=True)
        # a folder of one run (e.g. e2e/static_c56c229) has no run column: its rows are that run
        row = t_runs[((t_runs["run"] == run) if "run" in t_runs else True) & (t_runs["policy"] == policy)]
        if t_frame.empty or row.empty:
            raise SystemExit(f"--fit-timelines {key}: no {policy} steps in {t_path} or no row in {runs_path}")
        name, layers = parse_run_model(row.iloc[0]["model"])
        timelines.append((f"{run}/{policy}", t_frame, CostModel(spec_with_layers(name, layers), gpu, base), policy))
        data += [data_entry(t_path), data_entry(runs_path, row)]
    if args.post_sync and not args.eager_host_overlap:
        raise SystemExit("--post-sync needs --eager-host-overlap (it splits that pipeline's host time at the sync)")
    admission = {}
    if args.prefill_requests:
        frames_r = [reference_csv(ref, path, "--prefill-requests", data) for path in args.prefill_requests]
        try:
            admission = admission_terms(pd.concat(frames_r, ignore_index=True)) | {"files": args.prefill_requests}
        except ValueError as exc:
            raise SystemExit(f"--prefill-requests: {exc}") from None
        base = base.replace(host_admit_us=admission["host_admit_us"], host_finish_us=admission["host_finish_us"])
    hold, pcie_input = (), {}
    if args.pcie_from_h2d:
        h2d_frame = reference_csv(ref, args.pcie_from_h2d, "--pcie-from-h2d", data)
        pcie_input = pcie_eff_from_h2d(h2d_frame, gpu) | {"source": str(args.pcie_from_h2d)}
        base, hold = base.replace(pcie_eff=pcie_input["pcie_eff"]), ("pcie_eff",)
    prefill_floor = []
    for path in args.prefill_floor:
        frame = reference_csv(ref, path, "--prefill-floor", data)
        missing = sorted(set(PREFILL_FLOOR_COLUMNS) - set(frame.columns))
        if missing:
            raise SystemExit(f"--prefill-floor {path}: not a prefill_floor_gpu.py file "
                             f"(no column {', '.join(missing)})")
        prefill_floor.append(frame[frame["policy"] != "static"])  # a resident step's terms are the second stage's
    prefill = [(f.reset_index(drop=True), CostModel(spec_with_layers(f["model"].iloc[0], int(layers)), gpu, base))
               for layers, f in pd.concat(prefill_floor, ignore_index=True).groupby("layers")] if prefill_floor else []
    params, steps = fit_decode_floor(frames, floor_costs, base, timelines, tie_token=args.tie_token_us,
                                     post_sync=args.post_sync, hold=hold, prefill=prefill)
    if pcie_input:
        steps["pcie_input"] = pcie_input
    if admission:
        steps["admission_input"] = admission
    # the serving loop between steps: the fit runs' all-at-once timelines (a Poisson run's gaps include idle time)
    bursts = [t[t["workload"] == "burst"] for _, t, _, _ in timelines]
    loop = fit_loop([t for t in bursts if len(t)]) if any(len(t) for t in bursts) else {}
    if loop and args.fit_loop:
        params = params.replace(loop_step_us=loop["loop_step_us"], loop_seq_us=loop["loop_seq_us"],
                                loop_eager_us=loop["loop_eager_us"])
    tp = {}
    if args.tp_step and args.tp_timelines:
        step_tp = pd.read_csv(ref / args.tp_step)
        data.append(data_entry(ref / args.tp_step, step_tp))
        tp_timelines = read_tp_timelines(ref / args.tp_timelines, "--tp-timelines", gpu, params, data)
        params, tp = fit_tp(step_tp, tp_timelines, params)
    kernels_fit, kernel_terms = {}, {}
    if args.decode_kernels_fit:
        waves = {}
        for item in args.decode_kernels_waves:
            variant, _, wave = item.rpartition("=")
            if not variant or not wave.isdigit():
                raise SystemExit(f"--decode-kernels-waves takes VARIANT=WAVE words, got {item!r}")
            waves[variant] = int(wave)
        if not waves or args.decode_kernels_base is None:
            raise SystemExit("--decode-kernels-fit needs --decode-kernels-waves and --decode-kernels-base")
        frames_k = []
        for path in args.decode_kernels_fit:
            frame = pd.read_csv(ref / path)
            if "kernels" not in frame:
                raise SystemExit(f"--decode-kernels-fit {path}: no kernels column (a floor from before the kernel A/B)")
            command = str(frame["command"].iloc[0])
            seg = int(command_arg(command, "--steps", 12)) + int(command_arg(command, "--discard", 3))
            frames_k.append(frame.assign(source=path, segment_steps=seg))
            data.append(data_entry(ref / path, frame) | {"layers": sorted(map(int, frame["layers"].unique()))})
        floor_k = pd.concat(frames_k, ignore_index=True)
        for (layers, seg_steps), f in floor_k.groupby(["layers", "segment_steps"]):
            cost = CostModel(spec_with_layers(f["model"].iloc[0], int(layers)), gpu, params)
            terms, report = fit_decode_kernels(f.reset_index(drop=True), cost, params, waves,
                                               steps_per_segment=int(seg_steps))
            kernels_fit[f"{int(layers)}L"] = report | {"files": sorted(set(f["source"]))}
            for wave, t in terms.items():
                if wave in kernel_terms:
                    raise SystemExit(f"--decode-kernels-fit: wave {wave} fitted twice (several layer counts or "
                                     f"segment lengths); give one call's files")
                kernel_terms[wave] = t
        base_terms = kernel_terms.pop(str(args.decode_kernels_base), None)  # the base terms serve the base wave
        kernels_fit["base_wave"] = args.decode_kernels_base
        kernels_fit["base_wave_refit_not_applied"] = base_terms
        params = params.replace(decode_kernels=kernel_terms, decode_kernels_base=args.decode_kernels_base)
    tp_async = {}
    if args.tp_async_timelines:  # after the decode-kernel terms: that engine's graph replays take its wave's
        a_timelines = read_tp_timelines(ref / args.tp_async_timelines, "--tp-async-timelines", gpu, params, data,
                                        by_repeat=True)
        params, tp_async = fit_tp_async(a_timelines, params, args.tp_async_kernels)
        tp_async["input"] = args.tp_async_timelines
    tp_graph = {}
    if args.tp_graph_timelines:  # after the async engine's TP terms, which its replays also carry
        g_timelines = read_tp_timelines(ref / args.tp_graph_timelines, "--tp-graph-timelines", gpu, params, data,
                                        by_repeat=True)
        params, tp_graph = fit_tp_graph(g_timelines, params, args.tp_async_kernels)
        tp_graph["input"] = args.tp_graph_timelines
    gdn_eager = {}
    if args.gdn_floor:  # a hybrid's eager GDN host term, before the chunked-prefill term that the same steps carry
        floors = []
        for path in args.gdn_floor:
            frame = pd.read_csv(ref / path)
            data.append(data_entry(ref / path, frame))
            layers = frame["layers"].unique()
            if len(layers) != 1:
                raise SystemExit(f"--gdn-floor {path}: one layer count per file, got {sorted(layers)}")
            floors.append((frame, CostModel(spec_with_layers(frame["model"].iloc[0], int(layers[0])), gpu, params)))
        params, gdn_eager = fit_gdn_eager(floors, params, steps_per_segment=args.gdn_floor_steps)
        gdn_eager["input"] = args.gdn_floor
    gdn = {}
    if args.gdn_timelines:  # after the TP terms: a hybrid TP run's eager steps carry them
        h_timelines = read_tp_timelines(ref / args.gdn_timelines, "--gdn-timelines", gpu, params, data, by_repeat=True)
        params, gdn = fit_gdn_prefill(h_timelines, params)
        gdn["input"] = args.gdn_timelines
    engine_fit = {}
    if args.engine_terms_fit:  # last: the engine's terms sit on every other term of the calibration
        wave, _, folders = args.engine_terms_fit.partition("=")
        if not wave.isdigit() or int(wave) == 0 or not folders or not args.engine_terms_free:
            raise SystemExit(f"--engine-terms-fit takes WAVE=DIR+DIR (WAVE a positive integer) with "
                             f"--engine-terms-free TERM..., got {args.engine_terms_fit!r}")
        e_timelines = []
        for folder in folders.split("+"):
            t_path, runs_path = ref / folder / "timelines.csv.gz", ref / folder / "e2e.csv"
            if not t_path.exists() or not runs_path.exists():
                raise SystemExit(f"--engine-terms-fit {folder}: no timelines.csv.gz or e2e.csv in {ref / folder}")
            t_all, runs_e = pd.read_csv(t_path), pd.read_csv(runs_path, dtype={"commit": str})
            data += [data_entry(t_path), data_entry(runs_path, runs_e)]
            cost = CostModel(spec_with_layers(*parse_run_model(runs_e["model"].iloc[0])), gpu, params)
            t_all = t_all.assign(engine=buffer_labels(t_all)["policy"])  # e.g. fixed+split50 (e2e_gpu.py --runs)
            by = [c for c in ("policy", "split", "workload", "repeat") if c in t_all]
            for _, t in t_all[t_all["policy"] != "static"].groupby(by, dropna=False):
                name = f"{folder}/{t['engine'].iloc[0]}/{t['workload'].iloc[0]}/{t['repeat'].iloc[0]}"
                e_timelines.append((name, t.reset_index(drop=True), cost, str(t["policy"].iloc[0])))
        try:
            terms, engine_fit = fit_engine_terms(e_timelines, params, tuple(args.engine_terms_free),
                                                 args.engine_terms_kernels, bool(args.engine_terms_async),
                                                 weigh_kinds=args.engine_terms_weights == "kind")
        except ValueError as exc:
            raise SystemExit(f"--engine-terms-fit: {exc}") from None
        engine_fit |= {"wave": int(wave), "input": folders.split("+")}
        params = params.replace(engine_terms={str(int(wave)): terms},
                                engine_terms_scope={str(int(wave)): engine_fit["scope"]})
    checks = {}
    for path in args.async_floor:
        frame = pd.read_csv(ref / path)
        frame = frame[(frame["compiles"] == 0) & (frame["stalls"] == 0)].reset_index(drop=True)
        data.append(data_entry(ref / path, frame))
        for layers, f in frame.groupby("layers"):
            cost = CostModel(spec_with_layers(f["model"].iloc[0], int(layers)), gpu, params)
            checks[f"{path} {int(layers)}L"] = floor_check(f.reset_index(drop=True), cost, params, async_overlap=True)
    params = params.replace(fitted={"tp_fit": tp, "tp_fit_inputs": [args.tp_step, args.tp_timelines],
                                    "tp_async_fit": tp_async,
                                    "tp_graph_fit": tp_graph, "gdn_prefill_fit": gdn,
                                    "gdn_eager_fit": gdn_eager, "engine_terms_fit": engine_fit,
                                    "loop_fit": loop, "loop_applied": bool(loop and args.fit_loop),
                                    "async_floor_check": checks,
        "hardware": args.hardware, "kernel_fit": kernel, "attention_fit": attention, "step_fit": steps,
        "routing_fit": routing_fit, "routing_prior_fit": prior_fit, "decode_gamma": decode_gamma,
        "chunk_law": chunk_laws, "decode_kernels_fit": kernels_fit, "routing_prior_build": prior_builds,
        "decode_request": decode_request,
        "routing_fit_runs": list(filter(None, args.routing_fit_runs.split(","))),
        "fit_runs": args.fit_runs.split(","), "fit_timelines": list(filter(None, args.fit_timelines.split(","))),
        "data": data,
        "assumptions": [
            "step times: the decode-floor segments (pure decode steps of the CUDA-graphed engine, eager and graphed, "
            "4 and 48 layers) and, jointly, every step of the --fit-timelines runs (prefill, mixed, eager and graphed "
            "decode: token_us is identified there); the kernel/attention rooflines give the device terms' shape",
            "fit-timeline steps: prefill chunks per step estimated as prefill tokens / 256 (rounded up), their "
            "attention pairs as chunks from position 0 (the timeline records neither)",
            "segment context: prompts of 256 tokens plus 11 steps per earlier segment (decode_floor_gpu.py defaults)",
            "predictor waste: from the fit runs' recorded loads (the eager engine before CUDA graphs; the predictor "
            "is unchanged since)",
            "CPU-expert terms (cpu_*) are not fitted: no CPU-expert GPU run is committed; defaults stand",
        ],
        "written_by": provenance()})
    params.save(args.out)
    print(f"kernel: hbm_eff {kernel['hbm_eff']:.3f} mma_eff {kernel['mma_eff']:.3f} "
          f"fixed {kernel['moe_fixed_us']:.1f} us "
          f"(median error {kernel['median_rel_error']:.1%}); attention: attn_eff {attention['attn_eff']:.3f}")
    print("steps:", {k: round(v, 3) for k, v in steps["values"].items()}, "waste", round(params.prefetch_waste, 3))
    for profile, g in decode_gamma.items():
        print(f"decode gamma of {profile}: {g['decode_gamma']:.3f} ({g['decode_steps']} decode steps, recorded loads "
              f"{g['recorded_loads']:.0f}, expected {g['expected_loads_at_gamma_1']:.0f} at gamma 1)")
    for name, law in chunk_laws.items():
        if "prefill_gamma" in law:
            print(f"chunk law {name} with prefill tempering: scale {law['routing_chunk_scale']:.3f} exponent "
                  f"{law['routing_chunk_exponent']:.3f} prefill_gamma {law['prefill_gamma']:.3f} "
                  f"cross {law.get('routing_chunk_cross', 1.0):.3f} "
                  f"({law['steps']} steps; touched median error {law['touched_median_abs_rel_error']:.1%}, loads "
                  f"{law['loads_median_abs_rel_error']:.1%} "
                  f"(gamma 1: {law['gamma_1_loads_median_abs_rel_error']:.1%}); "
                  f"loads {law['recorded_loads']:.0f} recorded, {law['expected_loads']:.0f} expected, "
                  f"{law['expected_loads_at_gamma_1']:.0f} at gamma 1)")
            continue
        print(f"chunk law {name}: scale {law['routing_chunk_scale']:.3f} exponent {law['routing_chunk_exponent']:.3f} "
              f"({law['steps']} steps, median error {law['median_abs_rel_error']:.1%}, worst "
              f"{law['max_abs_rel_error']:.1%}; independent tokens {law['independent_median_abs_rel_error']:.1%})")
    for name, b in prior_builds.items():
        print(f"routing prior {name}: {b['routing_prior_tokens']:.2f} pseudo-tokens (RMS log error touched "
              f"{b['rms_log_error']:.3f}, outside the cache {b['rms_log_error_outside_cache']:.3f}; unshrunk "
              f"{b['rms_log_error_unshrunk']:.3f}) from {', '.join(b['folders'])}")
    for layers, r in kernels_fit.items():
        if not isinstance(r, dict) or "terms" not in r:
            continue
        print(f"decode kernels ({layers}, {r['segments']} graphed segments, median error "
              f"{r['median_abs_rel_error']:.1%}, base terms {r['base_median_abs_rel_error']:.1%}):",
              {w: {k: round(v, 3) for k, v in t.items()} for w, t in r["terms"].items()})
        for name, g in r["groups"].items():
            print(f"  {name}: measured {g['measured_ms']:.3f} ms, base terms {g['modeled_base_ms']:.3f}, fitted "
                  f"{g['modeled_ms']:.3f} ({g['rel_error']:+.1%})")
    if engine_fit:
        print(f"engine terms, wave {engine_fit['wave']} ({engine_fit['steps']} steps of {len(engine_fit['passes'])} "
              f"passes; at a bound: {', '.join(engine_fit['at_bound']) or 'none'}):",
              {k: round(v, 4) for k, v in engine_fit["terms"].items()})
        for name, g in engine_fit["groups"].items():
            print(f"  {name}: {g['steps']} steps, measured {g['measured_ms_sum'] / 1e3:.2f} s, base terms "
                  f"{g['base_rel_error']:+.1%}, fitted {g['rel_error']:+.1%}")
    print("serving loop:", {k: round(v, 3) for k, v in loop.items()}, "applied" if args.fit_loop else "not applied")
    if tp:
        print(f"TP: tp_step_ms {tp['tp_step_ms']:.3f} ({tp['tp_step_segments']} segments), tp_layer_ms "
              f"{tp['tp_layer_ms']:.3f}:", ", ".join(f"{k} {r['measured_ms_sum']:.0f}->{r['modeled_ms_sum']:.0f} ms"
                                                    for k, r in tp["groups"].items()))
    for name, rows in checks.items():
        print(f"  not fitted, {name}:", ", ".join(f"{k} {r['measured_ms']:.2f}->{r['modeled_ms']:.2f} ms "
                                                   f"({r['rel_error']:+.1%})" for k, r in rows.items()))
    for name, r in steps["timeline_groups"].items():
        print(f"  {name}: {r['steps']} steps, measured {r['measured_ms_sum'] / 1e3:.2f} s, modeled "
              f"{r['modeled_ms_sum'] / 1e3:.2f} s, median step error {r['median_rel_error']:+.1%}")
    for name, r in steps["per_group"].items():
        print(f"  {name} (batches {r['batches']}): median step error {r['median_abs_rel_error']:.1%}, "
              f"worst {r['max_abs_rel_error']:.1%}")


if __name__ == "__main__":
    main()
