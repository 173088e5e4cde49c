# Hybrid models (Qwen3.5: Gated DeltaNet + gated attention): the KV-waste table (16-token KV pages vs a block
# forced to the state page, ShareGPT lengths) and the state-page leak check (a 1,000-request burst through
# the real engine on the tiny hybrid, CPU). GPU kernel timings and the scaled H200 e2e are committed under
# results/reference/hybrid/ (workflow/scripts/device_hybrid.sh); hybrid_gpu_table renders the kernel timings, the e2e
# rows reach the end-to-end table through config e2e.hardware.1gpu-hybrid.

HYBRID = config.get("hybrid", {})


rule hybrid_kv_waste:
    output:
        csv="results/hybrid/kv_waste.csv",
        md="results/hybrid/kv_waste.md",
    params:
        models=",".join(HYBRID.get("models", ["qwen3.5-35b-a3b", "qwen3.5-122b-a10b"])),
        n=HYBRID.get("waste_requests", 1000),
    log: "results/logs/hybrid/kv_waste.log"
    shell: "{PY} {SCRIPTS}/hybrid_kv_waste.py --models {params.models} --num-requests {params.n} --out {output.csv} > {log} 2>&1"


rule hybrid_state_burst:
    output: "results/hybrid/state_burst.json"
    params: n=HYBRID.get("burst_requests", 1000)
    log: "results/logs/hybrid/state_burst.log"
    shell: "{PY} {SCRIPTS}/hybrid_state_burst.py --num-requests {params.n} --out {output} > {log} 2>&1"


HYBRID_GPU_REFERENCE = ["results/reference/hybrid/gdn_kernels_h200.csv",
                        "results/reference/hybrid/gdn_prefill_conv_h200.csv"]


rule hybrid_gpu_table:
    input: if_exists(*HYBRID_GPU_REFERENCE)  # absent (a copy without results/reference): "not measured yet"
    output:
        csv="results/hybrid/gpu_kernels.csv",
        md="results/hybrid/gpu_kernels.md",
    params: refs=" ".join(HYBRID_GPU_REFERENCE)
    log: "results/logs/hybrid/gpu_kernels.log"
    shell: "{PY} {SCRIPTS}/hybrid_gpu_table.py --reference {params.refs} --csv {output.csv} --md {output.md} > {log} 2>&1"


rule hybrid_all:
    input:
        rules.hybrid_kv_waste.output,
        rules.hybrid_gpu_table.output,
        rules.hybrid_state_burst.output if HYBRID.get("burst", True) else [],
