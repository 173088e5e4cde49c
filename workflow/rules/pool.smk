# Pool and allocator: build each model's layout, check integrity, time the allocator hot path.

rule pool_check:
    output: "results/pool/{model}_layout.txt"
    params: budget=config["pool"]["budget"]
    shell: "rimuru pool {wildcards.model} --budget {params.budget} --check > {output}"


rule pool_bench_allocator:
    output: "results/pool/allocator_bench.csv"
    params: reps=config["pool"]["bench_reps"], gib=" ".join(map(str, config["pool"].get("fragmented_gib", [])))
    shell: "{PY} workflow/scripts/bench_allocator.py --out {output} --reps {params.reps} --fragmented-gib {params.gib}"


rule pool_all:
    input:
        expand("results/pool/{model}_layout.txt", model=config["pool"]["models"]),
        "results/pool/allocator_bench.csv",
