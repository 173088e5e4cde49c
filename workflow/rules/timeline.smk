# Timeline: the elastic expert cache vs KV pages over time under two bursts (CPU, scaled model), and
# decode step time vs its HBM/PCIe floor where GPU timelines exist (results/reference/e2e/run_*/).

TIMELINE = config["timeline"]


rule timeline_run:
    input:
        model=lambda w: model_dir(TIMELINE["model"]),
        hotset=lambda w: hotset(TIMELINE["model"]),
    output:
        json="results/timeline/run.json",
        timeline="results/timeline/run.timeline.csv",
    log: "results/logs/timeline/run.log"
    shell:
        "{PY} {SCRIPTS}/run_case.py --model-dir {input.model} --hotset {input.hotset} --system {TIMELINE[system]} "
        "--workload {TIMELINE[workload]} --step-ms {TIMELINE[step_ms]} --executor {TIMELINE[executor]} "
        "{SCALE_ARGS} --out-json {output.json} --out-timeline {output.timeline} > {log} 2>&1"


rule timeline_figures:
    input:
        run="results/timeline/run.json",
        timeline="results/timeline/run.timeline.csv",
        reference=lambda w: sorted(glob.glob(f"{TIMELINE['reference_dir']}/run_*/*.csv")),
    output:
        memory="figures/timeline_memory.png",
        step="figures/timeline_step.png",
        csv="results/timeline/step_floor.csv",
        md="results/timeline/step_floor.md",
    shell:
        "{PY} {SCRIPTS}/timeline_figures.py --run {input.run} --timeline {input.timeline} "
        "--reference-dir {TIMELINE[reference_dir]} --memory-figure {output.memory} --step-figure {output.step} "
        "--csv {output.csv} --md {output.md}"


rule timeline_all:
    input: rules.timeline_figures.output,
