# Modeled executor (rimuru/engine/modeled): calibration on the committed H200 measurements, fidelity
# against every committed H200 e2e run, and the paper's configurations at full scale, modeled.
# Re-calibration is one target: `snakemake modeled_calibrate` (or results/modeled/calibration.json);
# it re-runs whenever a file under results/reference/ that it reads changes (a re-measured e2e run).

MODELED = config["modeled"]
REF = "results/reference"


def calibration_inputs(w):
    return (glob.glob(f"{REF}/kernel/kernel_*.csv") + [f"{REF}/attention_h200.csv", f"{REF}/e2e/e2e.csv"]
            + glob.glob(f"{REF}/e2e/run_*/timeline_*.csv") + glob.glob(f"{REF}/e2e/run_*/hotset.json"))


rule modeled_lengths:
    output: "results/modeled/lengths_{workload}_{n}.csv"
    log: "results/logs/modeled/lengths_{workload}_{n}.log"
    shell:
        "{PY} {SCRIPTS}/modeled_trace.py --workload {wildcards.workload} --num-requests {wildcards.n} "
        "--out {output} > {log} 2>&1"


rule modeled_calibrate:
    input: calibration_inputs
    output: "results/modeled/calibration.json"
    params: fit=",".join(MODELED["fit_runs"])
    log: "results/logs/modeled/calibrate.log"
    shell:
        "{PY} {SCRIPTS}/modeled_calibrate.py --reference {REF} --fit-runs {params.fit} "
        "--hardware {MODELED[calibration_hardware]} --out {output} > {log} 2>&1"


rule modeled_fidelity:
    input:
        calibration="results/modeled/calibration.json",
        lengths=f"results/modeled/lengths_{MODELED['workload']}_{MODELED['num_requests']}.csv",
        runs=calibration_inputs,
    output:
        csv="results/modeled/fidelity.csv",
        steps="results/modeled/fidelity_steps.csv",
        figure="figures/modeled_fidelity.png",
        timelines=directory("results/modeled/fidelity_timelines"),
    params: fit=",".join(MODELED["fit_runs"])
    log: "results/logs/modeled/fidelity.log"
    shell:
        "{PY} {SCRIPTS}/modeled_fidelity.py --reference {REF}/e2e --lengths {input.lengths} "
        "--cost-params {input.calibration} --fit-runs {params.fit} --hardware {MODELED[calibration_hardware]} "
        "--out-csv {output.csv} --out-steps {output.steps} --out-timelines {output.timelines} "
        "--figure {output.figure} > {log} 2>&1"


rule modeled_all:
    input:
        rules.modeled_calibrate.output,
        rules.modeled_fidelity.output,
