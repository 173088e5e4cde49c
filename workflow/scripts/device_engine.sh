#!/usr/bin/env bash
# One device call for the engine-speed work (issue 11): GPU tests, then decode-floor, profile and e2e measurements.
# Steps are chosen with env vars so that one script serves every call:
#   TESTS=1              pytest -m gpu over the whole suite (every helper's GPU tests)
#   KERNEL_TESTS="paths" pytest without a marker filter first (kernel tests run on CUDA when it is there)
#   FLOOR_LAYERS="4 48"  decode_floor_gpu.py per layer count (FLOOR_POLICIES_<n>; FLOOR_BATCHES and FLOOR_ARGS, or
#                        FLOOR_BATCHES_<n> / FLOOR_ARGS_<n> for that layer count alone)
#   PROFILE=1            profile_decode_gpu.py at 48 layers (per-kernel-class time vs floor)
#   AB="fast;baseline"   profile_decode_gpu.py --ab: kernel variants (rimuru/kernels/variants.py) A/B'd on the same
#                        48-layer graphs, ABBA rounds of replays per batch (AB_BATCHES), per-kernel times of each;
#                        AB_ARGS="--ab-choose fast" writes the winner, which FLOOR_KERNELS=auto then measures
#   FLOOR_KERNELS=...    RIMURU_DECODE_KERNELS of the decode-floor runs (auto: the A/B's winner, else fast)
#   E2E_RUNS="..."       e2e_gpu.py --runs (ABBA, REPEATS each), NREQ requests, LAYERS layers (burst)
#   POISSON_RUNS="..."   a second e2e_gpu.py call for the Poisson runs (POISSON_NREQ requests at RATE/s)
#   BURST2_NREQ=200      the E2E_RUNS again at a second burst size
#   E2E48_RUNS="..."     the full 48-layer model, E2E48_NREQ requests at once, outputs capped (E2E48_ARGS)
#   E2E_TRACE_SKIP=N     every e2e call serves the trace from its request N+1 on (other prompts than the committed
#                        runs' first ones: fit data for the modeled executor that no validation run serves; issue 15)
# Every output lands in /tmp/res and comes back as one results.tar.gz plus the logs under $OUT (at most 8 files
# come back); the e2e calls also write timelines.csv: every run's per-step timeline with policy/workload/repeat.
# MODEL (qwen3-30b-a3b), DEVICE (cuda) and FLOOR_ARGS/E2E_ARGS let the same script dry-run on the CPU first:
#   MODEL=tiny-qwen3-moe DEVICE=cpu TESTS=0 FLOOR_LAYERS=2 FLOOR_BATCHES=1,4 FLOOR_ARGS="--static-budget 1GiB" ...
# Wheels the image lacks (.whl/, carried) are installed into /tmp/pylib when present.
set -uo pipefail
OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res}
mkdir -p "$OUT" "$RES"
if compgen -G ".whl/*.whl" > /dev/null && [ "${WHEELS:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pylib .whl/*.whl 2>&1 | tail -2
  EXTRA_PATH=:/tmp/pylib
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${EXTRA_PATH:-} RIMURU_COMMIT=${RIMURU_COMMIT:-unknown}
MODEL=${MODEL:-qwen3-30b-a3b}
DEVICE=${DEVICE:-cuda}
{
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%dT%H:%M:%SZ
} 2>&1 | tee "$RES/env.log"
pack() {  # what is done so far comes back even if a later step outlasts the call (packed after each step)
  tar -C "$RES" -czf "$OUT/results.tar.gz" .
  cp "$RES"/*.log "$OUT/" 2>/dev/null
}
gpu_tests() {
  timeout -s INT -k 15 "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    ${TEST_PATHS:-tests} 2>&1 | grep -v Warning > "$RES/pytest_gpu.log"
  tail -6 "$RES/pytest_gpu.log"
}
if [ -n "${KERNEL_TESTS:-}" ]; then
  timeout -s INT -k 10 "${KERNEL_TEST_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider $KERNEL_TESTS 2>&1 \
    | grep -v Warning > "$RES/pytest_kernels_cuda.log"
  tail -4 "$RES/pytest_kernels_cuda.log"
  pack
fi
# TESTS_LAST=1: the measurements first, so that a slow test cannot cost them
[ "${TESTS:-1}" = 1 ] && [ "${TESTS_LAST:-0}" != 1 ] && gpu_tests
if [ -n "${AB:-}" ]; then
  timeout "${AB_TIMEOUT:-200}" python3 workflow/scripts/profile_decode_gpu.py --ab "$AB" --ab-only \
    --batches "${AB_BATCHES:-1,4,16,64,256}" --ab-rounds "${AB_ROUNDS:-4}" ${AB_ARGS:-} --out "$RES/ab" 2>&1 \
    | grep -v -i warn > "$RES/ab.log"
  grep -E "^AB" "$RES/ab.log"
  pack
fi
if [ "${FLOOR_KERNELS:-}" = auto ]; then
  FLOOR_KERNELS=$(cat "$RES/ab/ab_winner.txt" 2>/dev/null || echo fast)
fi
FLOOR_KERNELS=${FLOOR_KERNELS:-${RIMURU_DECODE_KERNELS:-fast}}
for n in ${FLOOR_LAYERS:-}; do
  pol_var="FLOOR_POLICIES_$n" bat_var="FLOOR_BATCHES_$n" args_var="FLOOR_ARGS_$n"
  echo "floor kernels: RIMURU_DECODE_KERNELS=$FLOOR_KERNELS" | tee "$RES/floor_${n}_kernels.log"
  RIMURU_DECODE_KERNELS=$FLOOR_KERNELS timeout "${FLOOR_TIMEOUT:-300}" python3 workflow/scripts/decode_floor_gpu.py \
    --model "$MODEL" --layers "$n" \
    --fast-synth --policies "${!pol_var:-static}" --batches "${!bat_var:-${FLOOR_BATCHES:-1,4,16,64,256}}" \
    --steps "${FLOOR_STEPS:-10}" --discard "${FLOOR_DISCARD:-3}" --device "$DEVICE" ${!args_var:-${FLOOR_ARGS:-}} \
    --out "$RES/floor_$n" 2>&1 | grep -v Warning > "$RES/floor_$n.log"
  tail -12 "$RES/floor_$n.log"
  pack
done
if [ "${PROFILE:-0}" = 1 ]; then
  timeout "${PROFILE_TIMEOUT:-200}" python3 workflow/scripts/profile_decode_gpu.py --out "$RES/profile" 2>&1 \
    | grep -v -i warn > "$RES/profile.log"
  grep -E "^batch" "$RES/profile.log"
fi
TRACE=.device/trace_sharegpt_400.jsonl
if [ -n "${E2E_TRACE_SKIP:-}" ]; then  # the trace from request N+1 on, named by N (the command column shows it)
  tail -n +$(( E2E_TRACE_SKIP + 1 )) "$TRACE" > "/tmp/trace_sharegpt_400_skip${E2E_TRACE_SKIP}.jsonl"
  TRACE=/tmp/trace_sharegpt_400_skip${E2E_TRACE_SKIP}.jsonl
  echo "trace: $TRACE ($(wc -l < "$TRACE") requests)" | tee -a "$RES/env.log"
fi
e2e() {  # name runs nreq timeout [layers repeats warm-up-requests calibration-prompts extra-args]
  timeout "$4" python3 workflow/scripts/e2e_gpu.py --model "$MODEL" --device "$DEVICE" --layers "${5:-${LAYERS:-4}}" \
    --fast-synth --trace "$TRACE" --num-requests "$3" --rate "${RATE:-4}" --runs "$2" \
    --repeats "${6:-${REPEATS:-2}}" --warmup-requests "${7:-${WARMUP:-16}}" --calibration-prompts "${8:-${CAL:-64}}" \
    ${9:-${E2E_ARGS:-}} --out "$RES/$1" 2>&1 | grep -v Warning > "$RES/$1.log"
  grep -E '^\{"policy"' "$RES/$1.log" | grep request_throughput | cut -c1-260
  rm -f "$RES/$1"/timeline_*.csv  # the same rows are in timelines.csv
}
# E2E_RUNS: the burst of NREQ requests, then (BURST2_NREQ set) the same runs at a second burst size
[ -n "${E2E_RUNS:-}" ] && e2e "burst_${NREQ:-400}" "$E2E_RUNS" "${NREQ:-400}" "${E2E_TIMEOUT:-400}"
[ -n "${E2E_RUNS:-}" ] && [ -n "${BURST2_NREQ:-}" ] && e2e "burst_${BURST2_NREQ}" "$E2E_RUNS" "$BURST2_NREQ" \
  "${BURST2_TIMEOUT:-200}"
[ -n "${POISSON_RUNS:-}" ] && e2e "poisson_${POISSON_NREQ:-100}" "$POISSON_RUNS" "${POISSON_NREQ:-100}" \
  "${POISSON_TIMEOUT:-300}"
# E2E48_RUNS: the full-depth model (E2E48_LAYERS, default 48), E2E48_NREQ requests at once, outputs capped by
# E2E48_ARGS (e.g. "--max-output 16"), E2E48_REPEATS of each policy, a short warm-up pass and calibration
[ -n "${E2E48_RUNS:-}" ] && e2e "burst_${E2E48_NREQ:-100}_${E2E48_LAYERS:-48}L" "$E2E48_RUNS" "${E2E48_NREQ:-100}" \
  "${E2E48_TIMEOUT:-200}" "${E2E48_LAYERS:-48}" "${E2E48_REPEATS:-1}" "${E2E48_WARMUP:-4}" "${E2E48_CAL:-16}" \
  "${E2E48_ARGS:---max-output 16}"
# TESTS_FLOOR_KERNELS=1: the last GPU tests run with the decode floor's kernels (e.g. the A/B's winner)
[ "${TESTS_FLOOR_KERNELS:-0}" = 1 ] && export RIMURU_DECODE_KERNELS=$FLOOR_KERNELS
[ "${TESTS:-1}" = 1 ] && [ "${TESTS_LAST:-0}" = 1 ] && gpu_tests
pack
ls -la "$OUT"
