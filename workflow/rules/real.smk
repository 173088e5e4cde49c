# Real systems next to our policies: every server (vLLM's CPU build, llama.cpp's server, SGLang where it
# installs, and `rimuru serve` with each memory policy) is started, waited for on /health, driven by
# `rimuru bench --backend openai` with the same ShareGPT requests, asked for greedy texts, and stopped.
# A real system runs when `make real-venvs` built its venv; otherwise the table lists it as skipped, with
# the reason (for SGLang: the install log's tail, .venv-sglang/FAILED). docs/real_systems.md.

REAL = config.get("real", {"enabled": False})
REAL_ON = bool(REAL.get("enabled"))


def _real_status(key, sysc):
    """'' when the system can run, else why not (decided when the workflow is parsed)."""
    venv = sysc.get("needs")
    if not venv:
        return ""
    if Path(venv, "FAILED").exists():
        lines = Path(venv, "FAILED").read_text(errors="replace").strip().splitlines()
        cause = [line.strip() for line in lines if "depends on" in line or "requested" in line]
        why = "; ".join(cause) or (lines[-1] if lines else f"see {venv}/FAILED")
        return f"does not install here ({why[:300]}; docs/real_systems.md)"
    if not Path(venv, ".installed").exists():
        return f"its venv {venv} is not built (make real-venvs)"
    return ""


_REAL_TRY = {k: REAL["systems"][k] for k in REAL.get("run_systems", [])} if REAL_ON else {}
REAL_SYSTEMS = {k: v for k, v in _REAL_TRY.items() if not _real_status(k, v)}
REAL_SKIPPED = {k: _real_status(k, v) for k, v in _REAL_TRY.items() if _real_status(k, v)}
REAL_POLICIES = {k: REAL["policies"][k] for k in REAL.get("run_policies", [])} if REAL_ON else {}
REAL_KEYS = list(REAL_SYSTEMS) + list(REAL_POLICIES)
REAL_MODEL = REAL.get("model", "")


def _real_version(sysc):
    cmd = sysc.get("version", "")
    if not cmd:
        return ""
    import subprocess

    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip() or "unknown"


def real_launch(key):
    """(kind, label, version, serve command with {port} left for real_run.py)."""
    threads = REAL.get("threads", 1)
    model = f"{REAL_MODEL}"
    subst = {"model_dir": model_dir(REAL_MODEL), "model": model, "threads": threads, "last_core": threads - 1,
             "python": PY,
             "gguf": f"results/models/{REAL_MODEL}/model-f32.gguf", "port": "{port}"}
    if key in REAL_POLICIES:
        p = REAL_POLICIES[key]
        opts = " ".join(f"--engine-option {k}={v}" for k, v in p.get("options", {}).items())
        cmd = (f"rimuru serve {subst['model_dir']} --port {{port}} --served-model-name {model} --device cpu "
               f"--policy {p['policy']} --threads {threads} {opts} --log-level warning")
        return "policy", p["label"], "", cmd
    sysc = REAL_SYSTEMS[key]
    version = _real_version(sysc)
    label = sysc["label"].format(version=".".join(version.split(".")[:2]) if "." in version else version)
    return "real", label, version, " ".join(sysc["serve"].split()).format(**subst)


rule real_gguf:
    input:
        ckpt=lambda w: model_dir(w.model),
        venv=".venv-llamacpp/.installed",
    output: "results/models/{model}/model-f32.gguf"
    log: "results/logs/real/{model}.gguf.log"
    shell:
        ".venv-llamacpp/bin/python .venv-llamacpp/llama.cpp/convert_hf_to_gguf.py {input.ckpt} --outtype f32 "
        "--outfile {output} > {log} 2>&1"


rule real_run:
    threads: TIMED_THREADS
    input:
        model=lambda w: model_dir(REAL_MODEL),
        gguf=lambda w: ([f"results/models/{REAL_MODEL}/model-f32.gguf"]
                        if REAL_SYSTEMS.get(w.system, {}).get("gguf") else []),
    output: "results/real/runs/{system}/system.json"
    params:
        launch=lambda w: real_launch(w.system),
        workloads=lambda w: json.dumps(REAL["workloads"]),
        first=lambda w: next(iter(REAL["workloads"].values()))["spec"],
    log: "results/logs/real/{system}.log"
    shell:
        "{PY} {SCRIPTS}/real_run.py --system {wildcards.system} --kind {params.launch[0]} "
        "--label '{params.launch[1]}' --version '{params.launch[2]}' --serve {params.launch[3]:q} "
        "--workloads '{params.workloads}' --agreement-workload {params.first} "
        "--agreement-prompts {REAL[agreement][prompts]} --agreement-tokens {REAL[agreement][tokens]} "
        "--ready-timeout {REAL[ready_timeout]} --out-dir results/real/runs/{wildcards.system} > {log} 2>&1"


rule real_vllm_client:
    threads: TIMED_THREADS
    input:
        model=lambda w: model_dir(REAL_MODEL),
        venv=".venv-vllm/.installed",
    output:
        csv="results/real/vllm_client.csv",
        md="results/real/vllm_client.md",
    params:
        launch=lambda w: real_launch(REAL.get("reference", "rimuru")),
        w=lambda w: next(iter(REAL["workloads"].values())),
    log: "results/logs/real/vllm_client.log"
    shell:
        "{PY} {SCRIPTS}/real_vllm_client.py --serve {params.launch[3]:q} --vllm .venv-vllm/bin/vllm "
        "--model-dir {input.model} --workload {params.w[spec]} --num-requests {params.w[num_requests]} "
        "--request-rate {params.w[request_rate]} --ready-timeout {REAL[ready_timeout]} "
        "--csv {output.csv} --md {output.md} > {log} 2>&1"


rule real_table:
    input: expand("results/real/runs/{system}/system.json", system=REAL_KEYS),
    output:
        csv="results/real/real.csv",
        md="results/real/real.md",
        agreement_csv="results/real/agreement.csv",
        agreement_md="results/real/agreement.md",
        figure="figures/real.png",
    params:
        runs=lambda w: " ".join(f"results/real/runs/{k}" for k in REAL_KEYS),
        workloads=lambda w: json.dumps(REAL["workloads"]),
        skipped=lambda w: json.dumps(REAL_SKIPPED),
    shell:
        "{PY} {SCRIPTS}/real_table.py --runs {params.runs} --workloads '{params.workloads}' "
        "--reference {REAL[reference]} --skipped {params.skipped:q} --csv {output.csv} --md {output.md} "
        "--agreement-csv {output.agreement_csv} --agreement-md {output.agreement_md} --figure {output.figure}"


H2H = REAL.get("head_to_head", {}) if REAL_ON else {}
H2H_KEYS = [k for k in H2H.get("systems", []) if k in REAL_KEYS]  # those that can run here, in that order


def h2h_systems():
    out = []
    for key in H2H_KEYS:
        kind, label, version, serve = real_launch(key)
        out.append({"key": key, "label": label, "serve": serve})
    return json.dumps(out)


rule real_h2h:
    threads: TIMED_THREADS
    input:
        model=lambda w: model_dir(REAL_MODEL),
        gguf=lambda w: ([f"results/models/{REAL_MODEL}/model-f32.gguf"]
                        if any(REAL_SYSTEMS.get(k, {}).get("gguf") for k in H2H_KEYS) else []),
    output:
        csv="results/real/h2h.csv",
        md="results/real/h2h.md",
    params:
        systems=lambda w: h2h_systems(),
        workloads=lambda w: json.dumps({k: REAL["workloads"][k] for k in H2H.get("workloads", REAL["workloads"])}),
    log: "results/logs/real/h2h.log"
    shell:
        "{PY} {SCRIPTS}/real_h2h.py --systems {params.systems:q} --workloads '{params.workloads}' "
        "--repeats {H2H[repeats]} --reference {REAL[reference]} --ready-timeout {REAL[ready_timeout]} "
        "--out-dir results/real/h2h --csv {output.csv} --md {output.md} > {log} 2>&1"


rule real_all:
    input:
        (rules.real_table.output if REAL_ON else []),
        ("results/real/vllm_client.csv" if REAL_ON and REAL.get("vllm_client") and "vllm" in REAL_SYSTEMS else []),
        ("results/real/h2h.csv" if len(H2H_KEYS) >= 2 else []),
