# Modeled executor (rimuru/engine/modeled): calibration on the committed H200 measurements, fidelity
# against every committed H200 e2e run, and the paper's configurations at full scale, modeled.
# Re-calibration is one target: `snakemake modeled_calibrate` (or results/modeled/calibration.json);
# it re-runs whenever a file under results/reference/ that it reads changes (a re-measured e2e run).
# Every job runs under rusage.py, which writes its exact wall and CPU seconds to results/logs/modeled/cpu/;
# modeled_pipeline_time.py sums them per rule and estimates the pipeline's wall time on an idle 2-core machine.

MODELED = config["modeled"]
REF = "results/reference"
CPU = "{PY} {SCRIPTS}/rusage.py "  # + the job's results/logs/modeled/cpu/*.json + " -- " + its command


def tp_run_files(folder):
    """What modeled_calibrate.py's read_tp_timelines reads of a TP serving-runs folder under REF."""
    return [f"{REF}/{folder}/e2e_runs.csv"] + glob.glob(f"{REF}/{folder}/timeline.csv*")


def tp_fit_folders():
    """The serving-runs folders the calibration fits TP and hybrid terms on (tp_fit's, gdn_fit's)."""
    tp = MODELED.get("tp_fit", {})
    return ([tp[k] for k in ("timelines", "async_timelines", "graph_timelines") if k in tp]
            + ([MODELED["gdn_fit"]["timelines"]] if "gdn_fit" in MODELED else []))


def calibration_inputs(w):
    return (glob.glob(f"{REF}/kernel/kernel_*.csv") + [f"{REF}/attention_h200.csv", f"{REF}/e2e/e2e.csv"]
            + [f"{REF}/{f}" for f in MODELED["decode_floor"]]
            + glob.glob(f"{REF}/e2e/run_*/timeline_*.csv") + glob.glob(f"{REF}/e2e/run_*/hotset.json")
            + [f"{REF}/{k.rsplit(':', 1)[0].rsplit('/', 1)[0]}/timelines_{k.rsplit(':', 1)[0].rsplit('/', 1)[1]}.csv.gz"
               for k in MODELED["fit_timelines"]]
            + [f"{REF}/{f}" for f in MODELED.get("async_floor", [])]
            + [f"{REF}/{f}" for f in MODELED.get("prefill_requests", []) + MODELED.get("prefill_floor", [])]
            + [f"{REF}/{d}/{f}" for d in MODELED.get("routing_prior_fit", []) for f in ("hotset.json", "e2e.csv")]
            + ([f"{REF}/{MODELED['tp_fit']['step_tp']}"] if "tp_fit" in MODELED else [])
            + [f for folder in tp_fit_folders() for f in tp_run_files(folder)]
            + [f"{REF}/{f}" for f in MODELED.get("gdn_fit", {}).get("floors", [])]
            + [f"{REF}/{profile}" for profile in MODELED.get("decode_gamma_fit", {})
               if profile not in MODELED.get("routing_prior_build", {})]  # BUILD keys: each run's folder's hotset
            + [h for profile, keys in MODELED.get("decode_gamma_fit", {}).items()
               if profile in MODELED.get("routing_prior_build", {}) for key in keys
               for h in glob.glob(f"{REF}/{key.rpartition(':')[0]}/hotset.json")]
            + [t for keys in MODELED.get("decode_gamma_fit", {}).values() for key in keys
               for t in glob.glob(f"{REF}/{key.rpartition(':')[0]}/timelines.csv.gz")]
            + [f"{REF}/{key.rpartition(':')[0]}/{f}" for keys in MODELED.get("chunk_law_fit", {}).values()
               for key in keys for f in ("e2e.csv", "hotset.json")]
            + [t for keys in MODELED.get("chunk_law_fit", {}).values() for key in keys
               for t in glob.glob(f"{REF}/{key.rpartition(':')[0]}/timelines*.csv.gz")]
            + ([f"results/modeled/lengths_{MODELED['workload']}_{MODELED['num_requests']}.csv"]
               if MODELED.get("chunk_law_fit") else [])
            + [f"{REF}/{f}" for f in MODELED.get("decode_kernels_fit", {}).get("floors", [])]
            + [f"{REF}/{d}/{f}" for dirs in MODELED.get("routing_prior_build", {}).values() for d in dirs
               for f in ("hotset.json", "e2e.csv")]
            + [f"{REF}/{d}/{f}" for d in MODELED.get("engine_terms_fit", {}).get("timelines", [])
               for f in ("timelines.csv.gz", "e2e.csv")]
            + [f"{REF}/{key.rpartition(':')[0]}/{f}" for keys in MODELED.get("decode_request_fit", {}).values()
               for key in keys for f in ("timelines.csv.gz", "e2e.csv", "hotset.json")])


def engine_terms_option():
    """modeled_calibrate.py's options of the engine-terms fit (config modeled.engine_terms_fit; none: not fitted)."""
    fit = MODELED.get("engine_terms_fit")
    if not fit:
        return ""
    return (f"--engine-terms-fit {fit['wave']}={'+'.join(fit['timelines'])} --engine-terms-free {' '.join(fit['free'])} "
            f"--engine-terms-kernels {fit['decode_kernels']} --engine-terms-async {int(fit['async_scheduling'])} "
            f"--engine-terms-weights {fit.get('weights', 'kind')}")


FIDELITY = MODELED["fidelity"]


def workload_path(name):
    """A workload spec name (workloads/) or one of config/workloads/."""
    return f"config/workloads/{name}.yaml" if Path(f"config/workloads/{name}.yaml").exists() else name


rule modeled_lengths:
    output: "results/modeled/lengths_{workload}_{n}.csv"
    params: path=lambda w: workload_path(w.workload)
    log: "results/logs/modeled/lengths_{workload}_{n}.log"
    shell:
        CPU + "results/logs/modeled/cpu/lengths_{wildcards.workload}_{wildcards.n}.json -- "
        "{PY} {SCRIPTS}/modeled_trace.py --workload {params.path} --num-requests {wildcards.n} "
        "--out {output} > {log} 2>&1"


rule modeled_calibrate:
    input: calibration_inputs
    output: "results/modeled/calibration.json"
    params:
        fit=",".join(MODELED["fit_runs"]),
        floor=" ".join(MODELED["decode_floor"]),
        routing=",".join(MODELED["routing_fit_runs"]),
        prior=",".join(MODELED.get("routing_prior_fit", [])),
        timelines=",".join(MODELED["fit_timelines"]),
        async_floor=" ".join(MODELED.get("async_floor", [])),
        fit_loop="--fit-loop" if MODELED.get("fit_loop") else "",
        overlap="--eager-host-overlap" if MODELED.get("eager_host_overlap") else "",
        tie_token=("--tie-token-us" if MODELED.get("tie_token_us") else "")
                  + (" --post-sync" if MODELED.get("post_sync") else "")
                  + (f" --pcie-from-h2d {MODELED['pcie_from_h2d']}" if MODELED.get("pcie_from_h2d") else "")
                  + (f" --prefill-requests {' '.join(MODELED['prefill_requests'])}"
                     if MODELED.get("prefill_requests") else "")
                  + (f" --prefill-floor {' '.join(MODELED['prefill_floor'])}" if MODELED.get("prefill_floor") else ""),
        tp=(f"--tp-step {MODELED['tp_fit']['step_tp']} --tp-timelines {MODELED['tp_fit']['timelines']}"
            + (f" --tp-async-timelines {MODELED['tp_fit']['async_timelines']} --tp-async-kernels "
               f"{MODELED['tp_fit']['async_kernels']}" if "async_timelines" in MODELED.get("tp_fit", {}) else "")
            + (f" --tp-graph-timelines {MODELED['tp_fit']['graph_timelines']}"
               if "graph_timelines" in MODELED.get("tp_fit", {}) else "")
            if "tp_fit" in MODELED else "")
           + (f" --gdn-timelines {MODELED['gdn_fit']['timelines']}" if "gdn_fit" in MODELED else "")
           + (f" --gdn-floor {' '.join(MODELED['gdn_fit']['floors'])} --gdn-floor-steps "
              f"{MODELED['gdn_fit']['floor_steps']}" if "floors" in MODELED.get("gdn_fit", {}) else ""),
        # each value carries its option: snakemake compares a rule's params as a set of values, so two options with
        # the same value (a build name) would hide a change of one of them from its params trigger
        gamma="--decode-gamma-fit " + " ".join(f"{profile}={'+'.join(runs)}"
                                               for profile, runs in MODELED.get("decode_gamma_fit", {}).items()),
        laws="--chunk-law-fit " + " ".join(f"{name}={'+'.join(runs)}"
                                           for name, runs in MODELED.get("chunk_law_fit", {}).items()),
        prefill="--prefill-gamma-fit " + " ".join(MODELED.get("prefill_gamma_fit", [])),
        cross="--prefill-cross-fit " + " ".join(MODELED.get("prefill_cross_fit", [])),
        requests="--decode-request-fit " + " ".join(f"{name}={'+'.join(runs)}"
                                                    for name, runs in MODELED.get("decode_request_fit", {}).items()),
        request_spread="--decode-request-spread " + " ".join(MODELED.get("decode_request_spread", [])),
        priors="--routing-prior-build " + " ".join(f"{name}={'+'.join(dirs)}"
                                                   for name, dirs in MODELED.get("routing_prior_build", {}).items()),
        lengths=f"results/modeled/lengths_{MODELED['workload']}_{MODELED['num_requests']}.csv",
        kernels=(f"--decode-kernels-fit {' '.join(MODELED['decode_kernels_fit']['floors'])} --decode-kernels-waves "
                 + " ".join(f"{v}={w}" for v, w in MODELED["decode_kernels_fit"]["waves"].items())
                 + f" --decode-kernels-base {MODELED['decode_kernels_base']}" if MODELED.get("decode_kernels_fit") else ""),
        engine_terms=engine_terms_option(),
    log: "results/logs/modeled/calibrate.log"
    shell:
        CPU + "results/logs/modeled/cpu/calibrate.json -- "
        "{PY} {SCRIPTS}/modeled_calibrate.py --reference {REF} --decode-floor {params.floor} --fit-runs {params.fit} "
        "--routing-fit-runs {params.routing} --routing-prior-fit {params.prior} --fit-timelines {params.timelines} "
        "--async-floor {params.async_floor} "
        "{params.fit_loop} {params.overlap} {params.tie_token} {params.tp} {params.gamma} "
        "{params.laws} {params.prefill} {params.cross} "
        "{params.priors} "
        "{params.requests} {params.request_spread} "
        "--lengths {params.lengths} "
        "{params.kernels} {params.engine_terms} "
        "--hardware {MODELED[calibration_hardware]} --out {output} > {log} 2>&1"


rule modeled_fidelity:
    input:
        calibration="results/modeled/calibration.json",
        lengths=f"results/modeled/lengths_{MODELED['workload']}_{MODELED['num_requests']}.csv",
        runs=[f"{r}/e2e.csv" for r in FIDELITY["reference"]],
        hotsets=[f"{r}/hotset.json" for r in FIDELITY["reference"]],
        floor=[f"{REF}/{f}" for f in MODELED["decode_floor"]],
        tp_runs=[item.partition("=")[2] for item in FIDELITY.get("tp_runs", [])],
        timelines=lambda w: ([t for r in FIDELITY["reference"] for t in glob.glob(f"{r}/timelines*.csv.gz")]
                             + [t for item in FIDELITY.get("tp_runs", [])
                                for t in glob.glob(f"{Path(item.partition('=')[2]).parent}/timeline.csv*")]
                             # a TP run that profiled its own hotset (modeled_tp_check.tp_rows) replays with it
                             + [h for item in FIDELITY.get("tp_runs", [])
                                for h in glob.glob(f"{Path(item.partition('=')[2]).parent}/hotset.json")]),
    output:
        csv="results/modeled/fidelity.csv",
        steps="results/modeled/fidelity_steps.csv",  # written beside csv: the step-time model per run, kind, batch
        kinds="results/modeled/fidelity_kinds.csv",  # beside csv: measured vs replayed steps summed per step kind
        positions="results/modeled/fidelity_decode_position.csv",  # beside csv: fixed Poisson misses by decode position
        pairs="results/modeled/fidelity_policy_pairs.csv",  # beside csv: TP fixed minus elastic at the same steps
        band="results/modeled/fidelity_tp_band.csv",  # beside csv: TP validation runs pooled per set-up vs the replays
        setup_band="results/modeled/fidelity_setup_band.csv",  # beside csv: one-GPU validation runs per set-up (wave 16)
        seeds="results/modeled/fidelity_seeds.csv",  # beside csv: one-GPU Poisson runs replayed with other routing seeds
        figure="figures/modeled_fidelity.png",
        timelines=directory("results/modeled/fidelity_timelines"),
    params:
        caps=" ".join(f"{c}={n}" for c, n in FIDELITY["graph_caps"].items()),
        refs=" ".join(FIDELITY["reference"]),
        fit=" ".join(MODELED["fit_timelines"]),
        overlap=" ".join(f"{c}={int(n)}" for c, n in FIDELITY["async_scheduling"].items()),
        next_step=" ".join(f"{c}={int(n)}" for c, n in FIDELITY["next_step_prefetch"].items()),
        compaction=" ".join(f"{c}={int(n)}" for c, n in FIDELITY.get("kv_compaction", {}).items()),
        ablation=" ".join(f"{k}={v}" for k, v in FIDELITY.get("routing_ablation", {}).items()),
        headroom=" ".join(f"{c}={int(n)}" for c, n in FIDELITY.get("expand_headroom", {}).items()),
        lookahead=" ".join(f"{c}={int(n)}" for c, n in FIDELITY.get("short_lookahead", {}).items()),
        before_graphs=" ".join(f"{c}={int(n)}" for c, n in FIDELITY.get("prefetch_before_graphs", {}).items()),
        running=" ".join(f"{c}={int(n)}" for c, n in FIDELITY.get("running_lookahead", {}).items()),
        kernels=" ".join(f"{c}={int(n)}" for c, n in FIDELITY.get("decode_kernels", {}).items()),
        engine_terms=" ".join(f"{c}={int(n)}" for c, n in FIDELITY.get("engine_terms", {}).items()),
        engine_default=" ".join(f"{k}={int(n)}" for k, n in FIDELITY.get("engine_default", {}).items()),
        tp_runs=" ".join(FIDELITY.get("tp_runs", [])),
        # each value carries its option (a rule's params are compared as a set of values: calibrate above)
        gamma="--decode-gamma " + " ".join(f"{folder}={profile}"
                                           for folder, profile in FIDELITY.get("decode_gamma", {}).items()),
        laws="--chunk-law " + " ".join(f"{folder}={name}" for folder, name in FIDELITY.get("chunk_law", {}).items()),
        priors="--routing-prior " + " ".join(f"{folder}={name}"
                                             for folder, name in FIDELITY.get("routing_prior", {}).items()),
        requests="--decode-request " + " ".join(f"{folder}={name}"
                                                for folder, name in FIDELITY.get("decode_request", {}).items()),
        seed_spread=FIDELITY.get("seed_spread", 0),
        async_admission="--async-admission" if FIDELITY.get("async_admission") else "",
        tp_gamma=(f"--tp-decode-gamma {FIDELITY['tp_decode_gamma']}" if FIDELITY.get("tp_decode_gamma") else ""),
    log: "results/logs/modeled/fidelity.log"
    shell:
        CPU + "results/logs/modeled/cpu/fidelity.json -- "
        "{PY} {SCRIPTS}/modeled_fidelity.py --reference {params.refs} "
        "--lengths {input.lengths} --cost-params {input.calibration} --hardware {MODELED[calibration_hardware]} "
        "--arrivals {FIDELITY[arrivals]} --graph-cap {params.caps} --async-scheduling {params.overlap} "
        "--next-step-prefetch {params.next_step} --kv-compaction {params.compaction} "
        "--short-lookahead {params.lookahead} --expand-headroom {params.headroom} "
        "--prefetch-before-graphs {params.before_graphs} --running-lookahead {params.running} "
        "--decode-kernels {params.kernels} --engine-terms {params.engine_terms} "
        "--routing-ablation {params.ablation} "
        "--engine-default {params.engine_default} "
        "{params.gamma} {params.tp_gamma} {params.laws} {params.priors} "
        "{params.requests} --seed-spread {params.seed_spread} {params.async_admission} --fit {params.fit} --tp-runs {params.tp_runs} --decode-floor {input.floor} --out-csv {output.csv} "
        "--out-timelines {output.timelines} "
        "--figure {output.figure} > {log} 2>&1"


TP_STEPS = MODELED.get("tp_steps_runs", MODELED["tp_fit"]["timelines"])


rule modeled_tp_steps:
    input:
        calibration="results/modeled/calibration.json",
        timeline=f"{REF}/{TP_STEPS}/timeline.csv",
        runs=f"{REF}/{TP_STEPS}/e2e_runs.csv",
    output: "results/modeled/tp_steps.csv"
    params: runs=f"{REF}/{TP_STEPS}"
    log: "results/logs/modeled/tp_steps.log"
    shell:
        CPU + "results/logs/modeled/cpu/tp_steps.json -- "
        "{PY} {SCRIPTS}/modeled_tp_steps.py --runs {params.runs} --cost-params {input.calibration} "
        "--hardware {MODELED[calibration_hardware]} --out {output} > {log} 2>&1"


# the decode tokens' routing against the replay's profile (wave 14): routing_split_gpu.py's measured splits
ROUTING_SPLITS = [f"{REF}/{d}/routing_split.json" for d in MODELED.get("routing_split", [])]


rule modeled_routing_split:
    input:
        calibration="results/modeled/calibration.json",
        splits=ROUTING_SPLITS,
    output:
        csv="results/modeled/routing_split.csv",
        md="results/modeled/routing_split.md",
    log: "results/logs/modeled/routing_split.log"
    shell:
        CPU + "results/logs/modeled/cpu/routing_split.json -- "
        "{PY} {SCRIPTS}/modeled_routing_split.py --splits {input.splits} --cost-params {input.calibration} "
        "--out-csv {output.csv} --out-md {output.md} > {log} 2>&1"


# elastic against fixed splits, measured on the H200, beside the replays of the same runs (wave 19)
SPLITS_H200 = [f"{REF}/{d}" for d in MODELED.get("splits_h200", [])]


rule modeled_splits_h200:
    input:
        fidelity="results/modeled/fidelity.csv",
        runs=[f"{d}/e2e.csv" for d in SPLITS_H200],
    output:
        csv="results/modeled/splits_h200.csv",
        md="results/modeled/splits_h200.md",
    log: "results/logs/modeled/splits_h200.log"
    params: folders=" ".join(SPLITS_H200)
    shell:
        CPU + "results/logs/modeled/cpu/splits_h200.json -- "
        "{PY} {SCRIPTS}/splits_h200.py --folders {params.folders} --fidelity {input.fidelity} "
        "--out-csv {output.csv} --out-md {output.md} > {log} 2>&1"


# ---- the paper's configurations at full scale (MODELED) -----------------------------------------------
PAPER = MODELED["paper"]
SPLITS = MODELED["splits"]
PAPER_LENGTHS = f"results/modeled/lengths_{MODELED['workload']}_{MODELED['num_requests']}.csv"


def split_name(f):
    return f"split{int(round(100 * f)):02d}"


rule modeled_paper_run:
    input:
        calibration="results/modeled/calibration.json",
        lengths=PAPER_LENGTHS,
        hotset=PAPER["hotset"],
    output: "results/modeled/paper/{setup}/{system}.json"
    params:
        setup=lambda w: json.dumps({"name": w.setup, **PAPER["setups"][w.setup]}),
        system=lambda w: json.dumps({"name": w.system, **{k: v for k, v in PAPER["systems"][w.system].items()
                                                          if k != "loads"}}),
        loads=lambda w: json.dumps(PAPER["systems"][w.system].get("loads", PAPER["loads"])),
    log: "results/logs/modeled/paper/{setup}/{system}.log"
    shell:
        CPU + "results/logs/modeled/cpu/paper/{wildcards.setup}/{wildcards.system}.json -- "
        "{PY} {SCRIPTS}/modeled_paper.py --setup '{params.setup}' --system '{params.system}' --loads '{params.loads}' "
        "--lengths {input.lengths} --num-requests {PAPER[num_requests]} --hotset {input.hotset} "
        "--cost-params {input.calibration} --out {output} > {log} 2>&1"


def elastic_from_paper():
    """The splits' elastic row is the paper's run of the same system on the same setup at the same loads when the
    paper runs one (same engine options and seed: the same deterministic run), so it is read from there, not run
    twice."""
    system = PAPER["systems"].get(SPLITS["baseline"], {})
    loads = system.get("loads", PAPER["loads"])
    return (SPLITS["setup"] in PAPER["setups"] and set(system) <= {"baseline", "loads"}
            and system.get("baseline") == SPLITS["baseline"]
            and all(k in loads and float(loads[k]) == float(v) for k, v in SPLITS["loads"].items()))


SPLITS_ELASTIC = (f"results/modeled/paper/{SPLITS['setup']}/{SPLITS['baseline']}.json" if elastic_from_paper()
                  else f"results/modeled/splits/{SPLITS['setup']}/elastic.json")


rule modeled_split_run:
    input:
        calibration="results/modeled/calibration.json",
        lengths=PAPER_LENGTHS,
        hotset=PAPER["hotset"],
    output: "results/modeled/splits/{setup}/{split}.json"
    params:
        setup=lambda w: json.dumps({"name": w.setup, **PAPER["setups"][w.setup]}),
        system=lambda w: json.dumps({"name": w.split, "baseline": SPLITS["baseline"],
                                     **({"split": int(w.split.removeprefix("split")) / 100}
                                        if w.split.startswith("split") else {})}),
        loads=json.dumps(SPLITS["loads"]),
    log: "results/logs/modeled/splits/{setup}/{split}.log"
    shell:
        CPU + "results/logs/modeled/cpu/splits/{wildcards.setup}/{wildcards.split}.json -- "
        "{PY} {SCRIPTS}/modeled_paper.py --setup '{params.setup}' --system '{params.system}' --loads '{params.loads}' "
        "--lengths {input.lengths} --num-requests {PAPER[num_requests]} --hotset {input.hotset} "
        "--cost-params {input.calibration} --out {output} > {log} 2>&1"


rule modeled_paper_tables:
    input:
        paper=expand("results/modeled/paper/{setup}/{system}.json", setup=PAPER["setups"], system=PAPER["systems"]),
        splits=expand("results/modeled/splits/{setup}/{split}.json", setup=SPLITS["setup"],
                      split=[split_name(f) for f in SPLITS["fractions"]]),
        elastic=SPLITS_ELASTIC,
    output:
        paper_csv="results/modeled/paper.csv",
        paper_md="results/modeled/paper.md",
        splits_csv="results/modeled/splits.csv",
        splits_md="results/modeled/splits.md",
        paper_fig="figures/modeled_paper.png",
        splits_fig="figures/modeled_splits.png",
    params: loads=json.dumps(SPLITS["loads"])
    shell:
        CPU + "results/logs/modeled/cpu/paper_tables.json -- "
        "{PY} {SCRIPTS}/modeled_tables.py --paper {input.paper} --splits {input.splits} "
        "--splits-elastic {input.elastic} --splits-loads '{params.loads}' "
        "--paper-csv {output.paper_csv} --paper-md {output.paper_md} --splits-csv {output.splits_csv} "
        "--splits-md {output.splits_md} --paper-figure {output.paper_fig} --splits-figure {output.splits_fig}"


# ---- case study and EOL sweep at full scale (MODELED) ---------------------------------------------------
MCASE, MEOL = MODELED["case"], MODELED["eol"]


rule modeled_case_run:
    input:
        calibration="results/modeled/calibration.json",
        lengths=f"results/modeled/lengths_{MCASE['workload']}_{MCASE['num_requests']}.csv",
        hotset=PAPER["hotset"],
    output: "results/modeled/case/{system}.json"
    params:
        setup=json.dumps(MCASE["setup"]),
        system=lambda w: json.dumps({"name": w.system, **MCASE["systems"][w.system]}),
    log: "results/logs/modeled/case/{system}.log"
    shell:
        CPU + "results/logs/modeled/cpu/case/{wildcards.system}.json -- "
        "{PY} {SCRIPTS}/modeled_paper.py --setup '{params.setup}' --system '{params.system}' "
        "--loads '{{\"burst\": \"trace\"}}' --lengths {input.lengths} --num-requests {MCASE[num_requests]} "
        "--hotset {input.hotset} --cost-params {input.calibration} --out {output} > {log} 2>&1"


rule modeled_eol_run:
    input:
        calibration="results/modeled/calibration.json",
        lengths=f"results/modeled/lengths_{MEOL['workload']}_{MEOL['num_requests']}.csv",
        hotset=PAPER["hotset"],
    output: "results/modeled/eol/{extra}.json"
    params:
        setup=json.dumps(MCASE["setup"]),
        system=lambda w: json.dumps({"name": f"eol-{w.extra}", "baseline": "rimuru",
                                     "engine_options": MEOL["engine_options"],
                                     **({"eol_extra": int(w.extra)} if w.extra != "none" else {})}),
    log: "results/logs/modeled/eol/{extra}.log"
    shell:
        CPU + "results/logs/modeled/cpu/eol/{wildcards.extra}.json -- "
        "{PY} {SCRIPTS}/modeled_paper.py --setup '{params.setup}' --system '{params.system}' "
        "--loads '{{\"all-at-once\": \"inf\"}}' --lengths {input.lengths} --num-requests {MEOL[num_requests]} "
        "--hotset {input.hotset} --cost-params {input.calibration} --out {output} > {log} 2>&1"


rule modeled_case_eol_tables:
    input:
        case=expand("results/modeled/case/{system}.json", system=MCASE["systems"]),
        eol=expand("results/modeled/eol/{extra}.json", extra=[str(e) for e in MEOL["extra"]] + ["none"]),
    output:
        case_md="results/modeled/case.md",
        case_csv="results/modeled/case.csv",
        eol_md="results/modeled/eol.md",
        eol_csv="results/modeled/eol.csv",
        figure="figures/modeled_case_eol.png",
    shell:
        CPU + "results/logs/modeled/cpu/case_eol_tables.json -- "
        "{PY} {SCRIPTS}/modeled_case_eol.py --case {input.case} --eol {input.eol} --case-md {output.case_md} "
        "--case-csv {output.case_csv} --eol-md {output.eol_md} --eol-csv {output.eol_csv} --figure {output.figure}"


rule modeled_all:
    input:
        rules.modeled_calibrate.output,
        rules.modeled_fidelity.output,
        rules.modeled_tp_steps.output,
        rules.modeled_routing_split.output if ROUTING_SPLITS else [],
        rules.modeled_splits_h200.output if SPLITS_H200 else [],
        rules.modeled_paper_tables.output,
        rules.modeled_case_eol_tables.output,
