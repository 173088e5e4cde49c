#!/usr/bin/env bash
# One nvidia-h200-x2 call for issue 13's "elastic >= fixed at TP=2" (helper tpserve), everything under $OUT:
#   1. tp_h2d_diag.py: topology (nvidia-smi topo, lscpu, numactl, sysfs NUMA of each GPU, meminfo) and the pinned
#      H2D rate per GPU alone / both at once, fresh processes, several buffers in one process (DIAG_S seconds);
#   2. e2e_tp_gpu.py: TP=2 elastic vs fixed serving, burst (WORKLOADS), ABBA x REPEATS with a discarded warm-up pass,
#      each rank's pinned-store H2D probe before every timed pass (h2d_gbps_rank0/1 in e2e_runs.csv) and rank 0's
#      eager load rate (load_gbps), per-step lateness in timeline.csv.
# Usage on the device: RIMURU_COMMIT=<sha> bash workflow/scripts/device_tpserve.sh  (DRY=1: CPU dry run, tiny sizes;
# DIAG_S=0: no diagnostic; DISCARD=0: no discarded first engine, as in the wave-9 calls). Results come back as diag.tgz / tp.tgz (the run tool returns at most 8 files).
set -u
PY=${PY:-python3}
DIAG_S=${DIAG_S:-50}
E2E_S=${E2E_S:-230}
REPEATS=${REPEATS:-2}
WORKLOADS=${WORKLOADS:-burst}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/pylib .whl/*.whl >/dev/null 2>&1; fi
export PYTHONPATH=$PWD:/tmp/pylib
mkdir -p "$OUT"
echo "start $(date -u +%FT%TZ) commit ${RIMURU_COMMIT:-unknown}" | tee "$OUT/driver.log"
{ nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv; free -g; head -5 /proc/meminfo; } \
  >> "$OUT/driver.log" 2>&1
if [ "${DRY:-0}" = 1 ]; then
  $PY workflow/scripts/tp_h2d_diag.py --device cpu --out "$OUT/diag" > "$OUT/diag.log" 2>&1
  echo "diag rc=$?" | tee -a "$OUT/driver.log"
  E2E_ARGS="--device cpu --serving-all-reduce gloo --hotset= --layers 2 --num-requests 8 --max-output 8 --ckpt-dir /tmp/tpserve_dry_ckpt"
elif [ "$DIAG_S" -gt 0 ]; then
  timeout $(( DIAG_S + 30 )) $PY workflow/scripts/tp_h2d_diag.py --out "$OUT/diag" --total-mb 512 --rounds 5 \
    --case-timeout 25 --budget-s "$DIAG_S" > "$OUT/diag.log" 2>&1
  echo "diag rc=$? at $(date -u +%TZ)" | tee -a "$OUT/driver.log"
fi
[ "${DRY:-0}" = 1 ] || E2E_ARGS="--model qwen3-30b-a3b --layers 4 --num-requests 200 --max-output 128"
timeout $(( E2E_S + 25 )) $PY workflow/scripts/e2e_tp_gpu.py $E2E_ARGS --skew 0.7 --tp 2 --budget 24GiB \
  --trace results/reference/e2e_tp2/trace_sharegpt_400.jsonl.gz --repeats "$REPEATS" --policies elastic,fixed \
  --workloads "$WORKLOADS" --skip-static --deadline-s $(( E2E_S - 60 )) --out "$OUT/tp" \
  $([ "${DISCARD:-1}" = 1 ] && echo --discard-engine) > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? at $(date -u +%TZ)" | tee -a "$OUT/driver.log"
grep -h "H2D probe\|output_throughput\|deadline\|Error\|error" "$OUT/e2e.log" | tail -20
tail -3 "$OUT/e2e.log"
# the run tool returns at most 8 files: the result folders go back as one archive each
for d in diag tp; do [ -d "$OUT/$d" ] && tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
ls "$OUT"
