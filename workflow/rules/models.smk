# Synthetic checkpoints (seeded weights from a real or scaled config.json) and their hotset profiles.

rule models_checkpoint:
    output: directory("results/models/{model}/ckpt")
    params:
        cfg=lambda w: config["models"][w.model],
        tok=lambda w: "" if config["models"][w.model].get("tokenizer", True) else "--no-tokenizer",
    log: "results/logs/models/{model}.checkpoint.log"
    shell:
        "rimuru checkpoint {params.cfg[config]} {output} --seed {params.cfg[seed]} --dtype {params.cfg[dtype]} "
        "--routing-skew {params.cfg[routing_skew]} {params.tok} > {log} 2>&1"


rule models_hotset:
    input: "results/models/{model}/ckpt"
    output: "results/models/{model}/hotset.json"
    params: p=config["profile"]
    log: "results/logs/models/{model}.hotset.log"
    shell:
        "OMP_NUM_THREADS=1 rimuru profile {input} --out {output} --workload {params.p[workload]} "
        "--num-prompts {params.p[num_prompts]} --max-tokens {params.p[max_tokens]} --max-prompt-tokens 256 "
        "--device cpu --dtype float32 --gpu-memory-budget 2GiB --activation-reserve 64MiB --tokenizer qwen-folded "
        "--seed 0 --calibration-seed 1 --threads 1 --no-progress > {log} 2>&1"


rule models_all:
    input:
        expand("results/models/{model}/hotset.json", model=config["models"]),
