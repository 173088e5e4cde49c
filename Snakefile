# Rimuru reproduction pipeline: `snakemake --cores all` regenerates every table and figure.
# One .smk per experiment under workflow/rules/, prefixed rule names, an `<prefix>_all` target each.
# Config: config/default.yaml (CPU, tiny models); `--configfile config/gpu.yaml` on GPU machines.

configfile: "config/default.yaml"

PY = "python"  # the interpreter snakemake runs under (the project's .venv via `make run`)

include: "workflow/rules/pool.smk"


rule all:
    input:
        rules.pool_all.input,
