# End to end: system x hardware configuration x workload -> throughput, TTFT, TPOT. The `cpu`
# configuration really runs every system's policy through the in-process bench; GPU configurations
# come from results/reference/e2e/e2e.csv (or say "not measured yet").

E2E = config["e2e"]
E2E_MEASURED = [h for h, c in E2E["hardware"].items() if c.get("measure")]


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch, no driver: no GPU
        return 0


# multi-GPU configurations run here only when a job can get enough GPUs: this machine's, or `gpus_per_node`
# when jobs go to a cluster's GPU nodes (workflow/profiles/slurm sets it); elsewhere their reference is read
GPUS_PER_JOB = int(config.get("gpus_per_node") or visible_gpus())
E2E_TP_RUN = [h for h, c in E2E["hardware"].items() if c.get("tp_run") and c["gpus"] <= GPUS_PER_JOB]


rule e2e_tp_trace:
    output: "results/e2e/tp/trace_sharegpt.jsonl"
    shell: "rimuru workload sharegpt-all-at-once --token-ids --num-requests 400 --seed 0 --no-progress --out {output}"


rule e2e_tp_run:
    input: trace=rules.e2e_tp_trace.output
    output: csv="results/e2e/tp/{hardware}/e2e.csv"
    resources: gpu=lambda w: E2E["hardware"][w.hardware]["gpus"]  # one process per GPU, all on one node
    params:
        c=lambda w: E2E["hardware"][w.hardware],
        r=lambda w: E2E["hardware"][w.hardware]["tp_run"],
    log: "results/logs/e2e/tp_{hardware}.log"
    shell:
        "{PY} {SCRIPTS}/e2e_tp_gpu.py --model {params.c[model]} --tp {params.c[gpus]} "
        "--budget {params.c[budget_gib_per_gpu]}GiB --static-budget {params.r[static_budget_gib_per_gpu]}GiB "
        "--layers {params.r[layers]} --skew {params.r[skew]} --num-requests {params.r[num_requests]} "
        "--rate {params.r[rate]} --max-output {params.r[max_output]} --trace {input.trace} "
        "--out results/e2e/tp/{wildcards.hardware} > {log} 2>&1"


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
        reference=lambda w: if_exists(E2E["reference"], *[c["reference"] for c in E2E["hardware"].values()
                                                          if c.get("reference")]),
        tp_runs=expand("results/e2e/tp/{hardware}/e2e.csv", hardware=E2E_TP_RUN),
    output:
        csv="results/e2e/e2e.csv",
        md="results/e2e/e2e.md",
        figure="figures/e2e.png",
    params:
        hardware=lambda w: json.dumps(E2E["hardware"]),
        systems=" ".join(E2E["systems"]),
        tp_runs=" ".join(f"{h}=results/e2e/tp/{h}/e2e.csv" for h in E2E_TP_RUN),
    shell:
        "{PY} {SCRIPTS}/e2e_table.py --runs {input.runs} --reference {E2E[reference]} --systems {params.systems} "
        "--tp-runs {params.tp_runs} "
        "--hardware '{params.hardware}' --csv {output.csv} --md {output.md} --figure {output.figure}"


rule e2e_all:
    input: rules.e2e_table.output,
