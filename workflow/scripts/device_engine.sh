#!/usr/bin/env bash
# One device call for the engine-speed work (issue 11): GPU tests, then decode-floor and e2e measurements.
# Steps are chosen with env vars so that one script serves every call:
#   TESTS=1            pytest -m gpu over the whole suite (every helper's GPU tests)
#   FLOOR_LAYERS="4 48" decode_floor_gpu.py per layer count (FLOOR_POLICIES_<n>, FLOOR_BATCHES)
#   E2E_RUNS="..."     e2e_gpu.py --runs (ABBA, REPEATS each), NREQ requests, LAYERS layers
# Everything lands under $OUT (at most 8 files come back: logs and CSVs only).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD RIMURU_COMMIT=${RIMURU_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.log"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests 2>&1 \
    | grep -v Warning > "$OUT/pytest_gpu.log"
  tail -15 "$OUT/pytest_gpu.log"
fi
for n in ${FLOOR_LAYERS:-}; do
  pol_var="FLOOR_POLICIES_$n"
  timeout "${FLOOR_TIMEOUT:-300}" python3 workflow/scripts/decode_floor_gpu.py --layers "$n" --fast-synth \
    --policies "${!pol_var:-static}" --batches "${FLOOR_BATCHES:-1,4,16,64,256}" --steps "${FLOOR_STEPS:-10}" \
    --out "/tmp/floor_$n" 2>&1 | grep -v Warning > "$OUT/floor_$n.log"
  tail -14 "$OUT/floor_$n.log"
  cp "/tmp/floor_$n/decode_floor_detail.csv" "$OUT/floor_detail_$n.csv" 2>/dev/null
done
if [ -n "${E2E_RUNS:-}" ]; then
  timeout "${E2E_TIMEOUT:-400}" python3 workflow/scripts/e2e_gpu.py --model qwen3-30b-a3b --layers "${LAYERS:-4}" \
    --trace .device/trace_sharegpt_400.jsonl --num-requests "${NREQ:-200}" --rate "${RATE:-4}" --runs "$E2E_RUNS" \
    --repeats "${REPEATS:-2}" ${E2E_ARGS:-} --out /tmp/e2e 2>&1 | grep -v Warning > "$OUT/e2e.log"
  tail -30 "$OUT/e2e.log"
  cp /tmp/e2e/e2e.csv "$OUT/e2e.csv" 2>/dev/null
  cp /tmp/e2e/step_floor.csv "$OUT/e2e_step_floor.csv" 2>/dev/null
fi
