#!/usr/bin/env bash
# One nvidia-h200-x2 call for issue 13's failure path and "elastic >= fixed at TP=2" (helper tprel), everything
# under $OUT, in this order, each part started only if BUDGET_S leaves room for it:
#   1. KILLS killed-rank checks (default 0): device_tp2.sh's check with the default kernels — a tiny fp32 engine at
#      TP=2, symm_mem_lamport, static, graphed decode, async scheduling, rank 1 SIGKILLed — each in a fresh process
#      (the wave-9 stall was intermittent); their logs carry the peer release's report ("peer release: drained=…");
#   2. PROBE=1: tp_release_probe.py (GPU 0 alone: does a kernel release need a free SM, do side streams share
#      hardware queues);
#   3. DIAG_S > 0: tp_h2d_diag.py (topology and pinned H2D rates; wave 9's);
#   4. E2E_S > 0: e2e_tp_gpu.py, TP=2 elastic vs fixed serving, burst (WORKLOADS), ABBA x REPEATS (E | F F | E) after a
#      discarded first engine (DISCARD=1, the default: the first TP engine of a process was the slow one in every
#      wave-8/9 call) and a discarded pass of the same workload on every engine; per-rank H2D probe before every
#      timed pass; the killed-rank check on the last engine.
# Usage on the device: RIMURU_COMMIT=<sha> KILLS=3 PROBE=1 E2E_S=0 DIAG_S=0 BUDGET_S=180 bash workflow/scripts/device_tpserve.sh
# (the serving A/B: KILLS=0 PROBE=0 DIAG_S=0 E2E_S=300 BUDGET_S=340; the hybrid: MODEL=qwen3.5-35b-a3b HOTSET= ...)
# (DRY=1: the CPU dry run, tiny sizes, gloo). Results come back as one archive per part (the run tool returns at most
# 8 files): kills.tgz, probe.tgz, diag.tgz, tp.tgz, plus driver.log.
set -u
PY=${PY:-python3}
KILLS=${KILLS:-0}
PROBE=${PROBE:-0}
DIAG_S=${DIAG_S:-50}
E2E_S=${E2E_S:-230}
REPEATS=${REPEATS:-2}
WORKLOADS=${WORKLOADS:-burst}
# the serving A/B's model (MODEL, LAYERS of it, NREQ requests, outputs <= MAX_OUTPUT; HOTSET: the routing profile,
# '' for none — the default is the Qwen3-30B-A3B one; HYBRID_MODEL: e2e_tp_gpu.py's TP=N greedy check of a hybrid
# after the A/B; CAL: profile the serving checkpoint's hotset from the trace's first CAL prompts instead, e.g.
# MODEL=qwen3.5-35b-a3b CAL=64 HYBRID_MODEL=qwen3.5-35b-a3b for the paper's dual-GPU model; TRACE_SKIP=N: the trace
# from request N+1 on; RATE: the Poisson workload's requests per second, default 8)
MODEL=${MODEL:-qwen3-30b-a3b}
BUDGET_S=${BUDGET_S:-600}
. "$(dirname "$0")/device_tp_env.sh"  # START, left, the multi-GPU environment, wheels, $OUT
echo "start $(date -u +%FT%TZ) commit ${RIMURU_COMMIT:-unknown} KILLS=$KILLS PROBE=$PROBE DIAG_S=$DIAG_S E2E_S=$E2E_S" \
  "BUDGET_S=$BUDGET_S" | tee "$OUT/driver.log"
{ nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv; free -g; head -5 /proc/meminfo; } \
  >> "$OUT/driver.log" 2>&1
DEV=$([ "${DRY:-0}" = 1 ] && echo cpu || echo cuda)

# 1. killed-rank checks, each its own process (device_tp2.sh: its own session and timeout, leftovers listed)
for i in $(seq 1 "$KILLS"); do
  L=$(left)
  if [ "$L" -lt 50 ]; then echo "[$(( $(date +%s) - START ))s] kill check $i not started (${L} s left)" \
    | tee -a "$OUT/driver.log"; break; fi
  echo "[$(( $(date +%s) - START ))s] kill check $i of $KILLS" | tee -a "$OUT/driver.log"
  OUT="$OUT/kills/kill$i" DEVICE=$DEV BUDGET_S=$L FUSED=0 SKIP_STEP=1 CHECKS='symm_mem_lamport:static' \
    bash workflow/scripts/device_tp2.sh > /dev/null 2>&1
  grep -h "kill check .* rc=\|left:" "$OUT/kills/kill$i/driver.log" | sed "s/^/  kill$i /" | tee -a "$OUT/driver.log"
  grep -h "peer release\|rank 0 is still blocked\|Timeout (" "$OUT"/kills/kill"$i"/kill_*.log 2>/dev/null \
    | cut -c1-400 | sed "s/^/  kill$i /" | tee -a "$OUT/driver.log"
  for f in "$OUT"/kills/kill"$i"/kill_*/checks.json; do [ -f "$f" ] && $PY -c "import json, sys; d = json.load(open(sys.argv[1])); \
print('  kill$i', {k: d.get(k) for k in ('kill_seconds_to_error', 'kill_error', 'workers_alive_after', 'close_after_kill_s')})" \
    "$f" | tee -a "$OUT/driver.log"; done
done

# 2. the release probe (one GPU; bounded by its spinners' time-out)
if [ "$PROBE" = 1 ]; then
  if [ "$(left)" -ge 25 ]; then
    echo "[$(( $(date +%s) - START ))s] release probe" | tee -a "$OUT/driver.log"
    timeout 60 $PY workflow/scripts/tp_release_probe.py --out "$OUT/probe" --polls "${POLLS:-2097152}" \
      > "$OUT/probe.log" 2>&1
    rc=$?
    echo "[$(( $(date +%s) - START ))s] release probe rc=$rc" | tee -a "$OUT/driver.log"
    tail -5 "$OUT/probe.log" | cut -c1-400 | tee -a "$OUT/driver.log"
    mkdir -p "$OUT/probe" && mv "$OUT/probe.log" "$OUT/probe/"
  else
    echo "release probe not started ($(left) s left)" | tee -a "$OUT/driver.log"
  fi
fi

# 3. the H2D diagnostic (wave 9)
if [ "$DIAG_S" -gt 0 ] && [ "$(left)" -ge $(( DIAG_S + 30 )) ]; then
  if [ "${DRY:-0}" = 1 ]; then
    $PY workflow/scripts/tp_h2d_diag.py --device cpu --out "$OUT/diag" > "$OUT/diag.log" 2>&1
  else
    timeout $(( DIAG_S + 30 )) $PY workflow/scripts/tp_h2d_diag.py --out "$OUT/diag" --total-mb 512 --rounds 5 \
      --case-timeout 25 --budget-s "$DIAG_S" > "$OUT/diag.log" 2>&1
  fi
  rc=$?
  echo "diag rc=$rc at $(date -u +%TZ)" | tee -a "$OUT/driver.log"
  mv "$OUT/diag.log" "$OUT/diag/" 2>/dev/null
fi

# 4. the serving A/B
if [ "$E2E_S" -gt 0 ] && [ "$(left)" -ge $(( E2E_S + 25 )) ]; then
  if [ "${DRY:-0}" = 1 ]; then
    E2E_ARGS="--device cpu --serving-all-reduce gloo --hotset= --layers 2 --num-requests 8 --max-output 8 --ckpt-dir /tmp/tpserve_dry_ckpt"
  else
    E2E_ARGS="--model $MODEL --layers ${LAYERS:-4} --num-requests ${NREQ:-200} --max-output ${MAX_OUTPUT:-128}"
    E2E_ARGS="$E2E_ARGS ${HOTSET+--hotset=$HOTSET} ${HYBRID_MODEL:+--hybrid-model $HYBRID_MODEL}"
    E2E_ARGS="$E2E_ARGS ${CAL:+--calibration-prompts $CAL} ${TRACE_SKIP:+--trace-skip $TRACE_SKIP} ${RATE:+--rate $RATE}"
  fi
  echo "[$(( $(date +%s) - START ))s] serving A/B (timeout $(( E2E_S + 25 )) s)" | tee -a "$OUT/driver.log"
  timeout $(( E2E_S + 25 )) $PY workflow/scripts/e2e_tp_gpu.py $E2E_ARGS --skew 0.7 --tp 2 --budget 24GiB \
    --trace results/reference/e2e_tp2/trace_sharegpt_400.jsonl.gz --repeats "$REPEATS" --policies elastic,fixed \
    --workloads "$WORKLOADS" --skip-static --deadline-s $(( E2E_S - 60 )) --out "$OUT/tp" \
    $([ "${DISCARD:-1}" = 1 ] && echo --discard-engine) > "$OUT/e2e.log" 2>&1
  rc=$?
  echo "e2e rc=$rc at $(date -u +%TZ)" | tee -a "$OUT/driver.log"
  grep -h "H2D probe\|output_throughput\|deadline\|Error\|error\|peer release" "$OUT/e2e.log" | cut -c1-400 | tail -20
  tail -3 "$OUT/e2e.log"
  mv "$OUT/e2e.log" "$OUT/tp/" 2>/dev/null
elif [ "$E2E_S" -gt 0 ]; then
  echo "serving A/B not started ($(left) s left, needs $(( E2E_S + 25 )))" | tee -a "$OUT/driver.log"
fi

echo "[$(( $(date +%s) - START ))s] done $(date -u +%FT%TZ)" | tee -a "$OUT/driver.log"
# the run tool returns at most 8 files: the result folders go back as one archive each
for d in kills probe diag tp; do [ -d "$OUT/$d" ] && tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
ls "$OUT"
