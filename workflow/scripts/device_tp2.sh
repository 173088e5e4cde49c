#!/usr/bin/env bash
# One nvidia-h200-x2 call for issue 13 (tensor parallelism), everything under $OUT:
#   0. (FUSED=1, the default) the fused all-reduce + add + RMSNorm kernel's test on one GPU (a simulated peer), then
#      the killed-rank check with symm_mem_fused (tiny fp32 engine, graphed, async; its greedy vs TP=1 first): if
#      either fails, symm_mem_fused is left out of the decode A/B (a hang there would cost the whole A/B);
#   1. the 48-layer static decode step, TP=1 vs TP=2 with each all-reduce of AB (ABBA; async scheduling on, or on
#      and off with ASYNC_AB=1), rank 0's per-kernel profile at 64 running, and the fused-MoE tile sweep at the rank's
#      expert slice (MOE_SWEEP token counts);
#   2. the killed-rank check on GPUs: a tiny fp32 engine whose steps are async-scheduled graph replays, rank 1
#      SIGKILLed — with NCCL, then with symm_mem ('auto'), then (time allowing) a `fixed` engine with NCCL; each in
#      its own process under its own timeout, so that one hang cannot hide another (a stack dump lands in its log
#      20 s after a kill without an error; the engine's last resort exits the process 30 s after it).
# Usage on the device: RIMURU_COMMIT=<sha> bash workflow/scripts/device_tp2.sh   (BUDGET_S: stop starting parts;
# DEVICE=cpu: a dry run of the kill checks with gloo, no decode A/B; SKIP_STEP=1: no decode A/B; CHECKS: the kill
# checks as all_reduce:policy words, '' for none; PY: the interpreter; FUSED=0: no step 0; FUSED_CHECK=0: step 0's
# kernel test only; FUSED_CHECKS: the fused backends step 0 checks on an engine (symm_mem_fused); FIRST: the TP
# engine's first all-reduce (nccl; nccl again if step 0 left it out); AB: the A/B's other all-reduces; SKIP_TP1=1: no
# TP=1 engine (the A/B among the TP all-reduces); BATCHES, PROFILE, MOE_SWEEP: e2e_tp_gpu.py's lists; ROUTING_BENCH=1:
# tp_routing_bench.py before the A/B, =auto: and the A/B with the kernel levers it finds faster; AB_KERNELS: decode
# kernel lever sets the A/B runs each engine with, ';'-separated ('fast;fast,pdl_wide'); GREEDY_PROMPTS: the static
# greedy check's prompts (16); CHECK_KERNELS: the kill checks' kernel levers (RIMURU_DECODE_KERNELS of their process);
# EP=1: the decode A/B again with expert parallelism on the TP engine (step_ep/), see below)
set -u
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-280}
. "$(dirname "$0")/device_tp_env.sh"  # START, left, the multi-GPU environment, wheels, $OUT
echo "start $(date -u +%FT%TZ) commit ${RIMURU_COMMIT:-unknown}" | tee "$OUT/driver.log"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/driver.log" 2>&1

kill_check() {  # $1 all_reduce (a comma list: an engine each, the last one's rank killed), $2 policy: one check in
  # its own session under its own timeout
  local L T graphs pid rc left_over tag
  tag=$(echo "$1" | tr ',+' '__')  # the result's directory and log
  L=$(left)
  if [ "$L" -lt 45 ]; then echo "not started (time): kill check $1 $2" | tee -a "$OUT/driver.log"; return 1; fi
  T=$(( 105 + 30 * $(echo "$1" | tr -cd ',' | wc -c) ))  # 30 s more for each engine after the first; 105: a cold
  # engine start took 50 s at 0d4539f (34 s warm), and the kill needs room for the last resort (30 s) and its dump
  T=$(( L < T ? L : T ))
  graphs=$([ "$2" = static ] && echo "--graphs --impl auto" || echo)  # graphs need the Triton kernels on GPUs
  echo "[$(( $(date +%s) - START ))s] kill check all_reduce=$1 policy=$2 (timeout $T s)" | tee -a "$OUT/driver.log"
  # its own session: every process it leaves behind is found (and ended) by that session's id, nothing else
  setsid env ${CHECK_KERNELS:+RIMURU_DECODE_KERNELS=$CHECK_KERNELS} timeout "$T" $PY workflow/scripts/tp_gpu_checks.py --device "$DEVICE" --all-reduce "$1" --policy "$2" $graphs \
    --out "$OUT/kill_${tag}_$2" > "$OUT/kill_${tag}_$2.log" 2>&1 &
  pid=$!
  wait $pid
  rc=$?
  for _ in 1 2 3 4 5; do [ -z "$(pgrep -s "$pid")" ] && break; sleep 1; done  # (multiprocessing's tracker exits last)
  left_over=$(pgrep -s "$pid" | tr '\n' ' ')
  echo "[$(( $(date +%s) - START ))s] kill check $1 $2 rc=$rc, processes left 5 s after: [${left_over}]" \
    | tee -a "$OUT/driver.log"
  for p in $left_over; do echo "  left: $p $(tr '\0' ' ' < /proc/$p/cmdline)" | tee -a "$OUT/driver.log"; kill -9 "$p"; done
  return $rc
}

AB=${AB-symm_mem,symm_mem_fused}
without() { echo "$AB" | tr ',' '\n' | grep -vx "$1" | paste -sd, -; }  # AB less the names matching $1
if [ "$DEVICE" = cuda ] && [ "${FUSED:-1}" = 1 ]; then
  echo "[$(( $(date +%s) - START ))s] fused kernel test on one GPU (timeout 60 s)" | tee -a "$OUT/driver.log"
  timeout 60 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_allreduce_norm.py > "$OUT/fused_kernel_test.log" 2>&1
  rc=$?
  echo "[$(( $(date +%s) - START ))s] fused kernel test rc=$rc" | tee -a "$OUT/driver.log"
  if [ $rc != 0 ]; then
    AB=$(without 'symm_mem_\(fused\|lamport\)\(+vocab\)\?')
    case "${FIRST:-nccl}" in symm_mem_fused|symm_mem_lamport) FIRST=nccl ;; esac
    echo "symm_mem_fused/lamport left out of the decode A/B (kernel test failed)" | tee -a "$OUT/driver.log"
  elif [ "${FUSED_CHECK:-1}" != 0 ]; then
    # FUSED_CHECKS: the fused backends whose engine check (fp32 greedy vs TP=1, integrity, a killed rank) runs
    # before the A/B, each word a check (a comma list: one engine each in one process, the last one's rank killed;
    # at most one of them on symmetric memory, a process holds one such engine; NAME+vocab: with a
    # vocabulary-parallel LM head); a check that fails (or hangs: its own timeout) leaves its names out of the A/B
    for names in ${FUSED_CHECKS:-symm_mem_fused}; do
      tag=$(echo "$names" | tr ',+' '__')
      if ! { kill_check "$names" static \
             && ! grep -q '"greedy_identical": false' "$OUT/kill_${tag}_static/checks.json" 2>/dev/null \
             && grep -q '"greedy_identical": true' "$OUT/kill_${tag}_static/checks.json" 2>/dev/null; }; then
        for name in ${names//,/ }; do
          AB=$(without "${name//+/[+]}")
          [ "${FIRST:-nccl}" = "$name" ] && FIRST=nccl
        done
        echo "$names left out of the decode A/B (engine check failed)" | tee -a "$OUT/driver.log"
      fi
    done
  fi
fi

if [ "$DEVICE" = cuda ] && [ -n "${ROUTING_BENCH:-}" ]; then
  # the replicated routing work alone (tp_routing_bench.py); with ROUTING_BENCH=auto the decode A/B (and the checks)
  # run with the levers it finds faster (levers.txt: fast, or fast,align_par)
  echo "[$(( $(date +%s) - START ))s] routing bench (timeout 90 s)" | tee -a "$OUT/driver.log"
  timeout 90 $PY workflow/scripts/tp_routing_bench.py --out "$OUT/routing" > "$OUT/routing.log" 2>&1
  echo "[$(( $(date +%s) - START ))s] routing bench rc=$? levers $(cat "$OUT/routing/levers.txt" 2>/dev/null)" \
    | tee -a "$OUT/driver.log"
  if [ "$ROUTING_BENCH" = auto ] && [ -s "$OUT/routing/levers.txt" ]; then
    export RIMURU_DECODE_KERNELS=$(cat "$OUT/routing/levers.txt")
  fi
fi
echo "decode kernels: ${RIMURU_DECODE_KERNELS:-fast (default)}" | tee -a "$OUT/driver.log"

# EP=1: the decode A/B runs twice, each in its own process (a process holds one symmetric-memory TP engine): the
# default TP engine (step/), then the same A/B with enable_expert_parallel on the TP engine (step_ep/: whole experts
# per rank), each against its own TP=1 engine; the time left for the A/B is split between them (EP_SHARE percent
# to the first, default 55: it compiles the kernels cold)
T_ALL=$(( $(left) - ${CHECK_RESERVE:-100} ))
runs=$([ -n "${EP:-}" ] && echo "plain ep" || echo "plain")
# DRY_STEP=1 with DEVICE=cpu: the decode A/B's shell and script on the CPU (gloo) with MODEL (a tiny model),
# STATIC_LAYERS, BUDGET_TP1/BUDGET_TPN, DECODE_STEPS and HOTSET ('' for none) set to fit it
if { [ "$DEVICE" = cuda ] || [ -n "${DRY_STEP:-}" ]; } && [ -z "${SKIP_STEP:-}" ]; then
FIRST=${FIRST:-nccl}
async=$([ -n "${ASYNC_AB:-}" ] && echo --async-ab || echo --no-async-ab)
for run in $runs; do
  if [ "$run" = plain ]; then
    T=$([ -n "${EP:-}" ] && echo $(( T_ALL * ${EP_SHARE:-55} / 100 )) || echo "$T_ALL"); dir=step; extra=""
  else
    T=$(( $(left) - ${CHECK_RESERVE:-100} )); dir=step_ep; extra=--expert-parallel
  fi
  [ "$T" -gt 220 ] && T=220  # CHECK_RESERVE: seconds kept for the checks
  if [ "$T" -lt 60 ]; then echo "not started (time): decode A/B $run" | tee -a "$OUT/driver.log"; continue; fi
  echo "[$(( $(date +%s) - START ))s] decode A/B $run $FIRST,$AB (timeout $T s)" | tee -a "$OUT/driver.log"
  timeout "$T" $PY workflow/scripts/e2e_tp_gpu.py --model "${MODEL:-qwen3-30b-a3b}" --layers 4 \
    --static-layers "${STATIC_LAYERS:-48}" --skew 0.7 --tp 2 --static-budget-tp1 "${BUDGET_TP1:-72GiB}" \
    --static-budget "${BUDGET_TPN:-44GiB}" --trace results/reference/e2e_tp2/trace_sharegpt_400.jsonl.gz \
    --hotset "${HOTSET-results/reference/e2e_tp2/hotset.json}" --device "$DEVICE" \
    --num-requests 48 --batches "${BATCHES:-64,128}" --decode-steps "${DECODE_STEPS:-30}" --repeats 4 --all-reduce "$FIRST" --ab-all-reduce "$AB" \
    $async ${SKIP_TP1:+--skip-tp1} --ab-kernels "${AB_KERNELS:-}" --greedy-prompts "${GREEDY_PROMPTS:-16}" --ar-rows 1 --profile-batches "${PROFILE-64}" --moe-sweep "${MOE_SWEEP-64,128}" --skip-serving \
    --deadline-s $(( T - ${DEADLINE_MARGIN:-45} )) $extra \
    --out "$OUT/$dir" > "$OUT/$dir.log" 2>&1
  rc=$?  # (before the line below: its $(date) would reset $?)
  echo "[$(( $(date +%s) - START ))s] decode A/B $run rc=$rc" | tee -a "$OUT/driver.log"
done
fi

for spec in ${CHECKS-nccl:static symm_mem:static nccl:fixed}; do
  set -- ${spec/:/ }
  [ "$DEVICE" = cpu ] && set -- gloo "$2"
  kill_check "$1" "$2"
done
echo "[$(( $(date +%s) - START ))s] done $(date -u +%FT%TZ)" | tee -a "$OUT/driver.log"
# every folder under $OUT as one archive (the device tool returns at most 8 files: wave 11's EP call lost step_ep/'s
# four CSVs to that limit); driver.log and the *.log files stay loose
for d in "$OUT"/*/; do [ -d "$d" ] && tar czf "${d%/}.tgz" -C "$OUT" "$(basename "$d")" && rm -rf "$d"; done
