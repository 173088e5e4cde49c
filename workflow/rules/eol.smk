# expert_offload_limit sensitivity: Rimuru's throughput and TPOT as EOL goes from the minimum that fits
# (the cache cannot shrink: fixed offloading) to no limit. Real engine, in-process bench, wall clock.

EOL = config["eol"]
EOL_POINTS = [str(x) for x in EOL["extra"]] + ["none"]
EOL_OPTIONS = " ".join(f"--engine-option {k}={v}" for k, v in EOL.get("engine_options", {}).items())


rule eol_run:
    threads: TIMED_THREADS
    input:
        model=lambda w: model_dir(EOL["model"]),
        hotset=lambda w: hotset(EOL["model"]),
    output:
        json="results/eol/runs/eol_{extra}.json",
        timeline="results/eol/runs/eol_{extra}.timeline.csv",
    log: "results/logs/eol/eol_{extra}.log"
    shell:
        "{PY} {SCRIPTS}/run_bench.py --model-dir {input.model} --hotset {input.hotset} --system {EOL[system]} "
        "--workload {EOL[workload]} --num-requests {EOL[num_requests]} --request-rate {EOL[request_rate]} "
        "--eol-extra {wildcards.extra} {EOL_OPTIONS} {SCALE_ARGS} --label eol_{wildcards.extra} --out-json {output.json} "
        "--out-timeline {output.timeline} > {log} 2>&1"


rule eol_table:
    input: expand("results/eol/runs/eol_{extra}.json", extra=EOL_POINTS),
    output:
        csv="results/eol/eol.csv",
        md="results/eol/eol.md",
        figure="figures/eol.png",
    shell: "{PY} {SCRIPTS}/eol_table.py --runs {input} --csv {output.csv} --md {output.md} --figure {output.figure}"


rule eol_all:
    input: rules.eol_table.output,
