# End to end: system x hardware configuration x workload -> throughput, TTFT, TPOT. The `cpu`
# configuration really runs every system's policy through the in-process bench; GPU configurations
# come from results/reference/e2e/e2e.csv (or say "not measured yet").

E2E = config["e2e"]
E2E_MEASURED = [h for h, c in E2E["hardware"].items() if c.get("measure")]


rule e2e_run:
    threads: TIMED_THREADS
    input:
        model=lambda w: model_dir(E2E["model"]),
        hotset=lambda w: hotset(E2E["model"]),
    output:
        json="results/e2e/runs/{hardware}/{workload}/{system}.json",
        timeline="results/e2e/runs/{hardware}/{workload}/{system}.timeline.csv",
    params:
        w=lambda w: E2E["workloads"][w.workload],
    log: "results/logs/e2e/{hardware}/{workload}/{system}.log"
    shell:
        "{PY} {SCRIPTS}/run_bench.py --model-dir {input.model} --hotset {input.hotset} --system {wildcards.system} "
        "--workload {params.w[spec]} --num-requests {params.w[num_requests]} --request-rate {params.w[request_rate]} "
        "{SCALE_ARGS} --label {wildcards.workload} --out-json {output.json} --out-timeline {output.timeline} "
        "> {log} 2>&1"


rule e2e_table:
    input:
        runs=expand("results/e2e/runs/{hardware}/{workload}/{system}.json", hardware=E2E_MEASURED,
                    workload=E2E["workloads"], system=E2E["systems"]),
        reference=lambda w: if_exists(E2E["reference"]),
    output:
        csv="results/e2e/e2e.csv",
        md="results/e2e/e2e.md",
        figure="figures/e2e.png",
    params:
        hardware=lambda w: json.dumps(E2E["hardware"]),
        systems=" ".join(E2E["systems"]),
    shell:
        "{PY} {SCRIPTS}/e2e_table.py --runs {input.runs} --reference {E2E[reference]} --systems {params.systems} "
        "--hardware '{params.hardware}' --csv {output.csv} --md {output.md} --figure {output.figure}"


rule e2e_all:
    input: rules.e2e_table.output,
