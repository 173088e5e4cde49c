# Fused MoE kernel ablations (GPU only): overhead of the page-table-aware kernel over the contiguous
# baseline vs tokens, and the expert-placement ablation. Read from results/reference/kernel/ (an H200
# run of workflow/scripts/bench_kernel.py) unless `kernel.measure` is set on a GPU machine.

KERNEL = config["kernel"]
KERNEL_RAW = "results/kernel/raw" if KERNEL.get("measure") else KERNEL["reference_dir"]


rule kernel_measure:
    output: expand("results/kernel/raw/kernel_{model}.csv", model=KERNEL["models"])
    params:
        models=",".join(KERNEL["models"]),
        extra=KERNEL.get("measure_args", ""),  # e.g. a scaled sweep: --max-tokens 256 --no-tune --rounds 1
    log: "results/logs/kernel/measure.log"
    shell: "{PY} {SCRIPTS}/bench_kernel.py --out results/kernel/raw --models {params.models} {params.extra} > {log} 2>&1"


rule kernel_tables:
    input:
        lambda w: (rules.kernel_measure.output if KERNEL.get("measure") else
                   if_exists(*[f"{KERNEL_RAW}/kernel_{m}.csv" for m in KERNEL["models"]])),
    output:
        overhead_csv="results/kernel/overhead.csv",
        overhead_md="results/kernel/overhead.md",
        placement_csv="results/kernel/placement.csv",
        placement_md="results/kernel/placement.md",
        figure="figures/kernel.png",
    params:
        models=" ".join(KERNEL["models"]),
        tokens=KERNEL["placement_tokens"],
    shell:
        "{PY} {SCRIPTS}/kernel_tables.py --raw-dir {KERNEL_RAW} --models {params.models} "
        "--placement-tokens {params.tokens} --overhead-csv {output.overhead_csv} --overhead-md {output.overhead_md} "
        "--placement-csv {output.placement_csv} --placement-md {output.placement_md} --figure {output.figure}"


rule kernel_all:
    input: rules.kernel_tables.output,
