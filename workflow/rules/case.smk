# Case study (the paper's Figure 3): peak concurrency and total forward steps of static / fixed /
# elastic memory under one bursty ShareGPT workload, on the scaled Qwen1.5-MoE-A2.7B / 32 GB card.
# `case_check` re-runs a small burst with the real forward pass to show the counts do not depend on it.

CASE = config["case"]
CASE_CHECK = CASE["check"]


rule case_run:
    input:
        model=lambda w: model_dir(CASE["model"]),
        hotset=lambda w: hotset(CASE["model"]),
    output:
        json="results/case/runs/{system}.json",
        timeline="results/case/runs/{system}.timeline.csv",
    log: "results/logs/case/{system}.log"
    shell:
        "{PY} {SCRIPTS}/run_case.py --model-dir {input.model} --hotset {input.hotset} --system {wildcards.system} "
        "--workload {CASE[workload]} --step-ms {CASE[step_ms]} --executor {CASE[executor]} {SCALE_ARGS} "
        "--out-json {output.json} --out-timeline {output.timeline} > {log} 2>&1"


rule case_check_run:
    input:
        model=lambda w: model_dir(CASE["model"]),
        hotset=lambda w: hotset(CASE["model"]),
    output:
        json="results/case/check/{system}.{executor}.json",
        timeline="results/case/check/{system}.{executor}.timeline.csv",
    log: "results/logs/case/check.{system}.{executor}.log"
    shell:
        "{PY} {SCRIPTS}/run_case.py --model-dir {input.model} --hotset {input.hotset} --system {wildcards.system} "
        "--workload {CASE[workload]} --num-requests {CASE_CHECK[num_requests]} --step-ms {CASE[step_ms]} "
        "--executor {wildcards.executor} {SCALE_ARGS} --out-json {output.json} --out-timeline {output.timeline} "
        "> {log} 2>&1"


rule case_table:
    input:
        runs=expand("results/case/runs/{system}.json", system=CASE["systems"]),
        timelines=expand("results/case/runs/{system}.timeline.csv", system=CASE["systems"]),
        checks=expand("results/case/check/{system}.{executor}.json", system=CASE_CHECK["systems"],
                      executor=["torch", "modeled"]),
    output:
        csv="results/case/case.csv",
        md="results/case/case.md",
        check_csv="results/case/case_check.csv",
        figure="figures/case.png",
    params: paper=lambda w: json.dumps(CASE["paper"])
    shell:
        "{PY} {SCRIPTS}/case_table.py --runs {input.runs} --timelines {input.timelines} --checks {input.checks} "
        "--paper '{params.paper}' --csv {output.csv} --md {output.md} --check-csv {output.check_csv} "
        "--figure {output.figure}"


rule case_all:
    input: rules.case_table.output,
