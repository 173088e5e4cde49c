#!/usr/bin/env bash
# One device call for the modeled executor's calibration (issue 15): e2e runs of the CUDA-graphed engine
# with per-step timelines and the hotset they ran with, so that rimuru/engine/modeled is fitted and
# validated on the engine as it is now. Every run gets a fresh engine, LLM.warmup() (kernels compiled,
# decode graphs captured) and a discarded pass of the trace's first WARMUP requests (e2e_gpu.py).
# Usage on the GPU box: OUT=/tmp/out RIMURU_COMMIT=<commit> bash workflow/scripts/device_modeled.sh
# At most 8 files come back: env.log, e2e.log, e2e.csv, hotset.json and one timeline per run (4 runs).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD RIMURU_COMMIT=${RIMURU_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/modeled}
mkdir -p "$OUT" "$WORK"
{
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%dT%H:%M:%SZ
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
timeout "${E2E_TIMEOUT:-170}" python3 workflow/scripts/e2e_gpu.py --model "${MODEL:-qwen3-30b-a3b}" \
  --layers "${LAYERS:-4}" --fast-synth --trace "${TRACE:-.device/trace_sharegpt_400.jsonl}" \
  --num-requests "${NREQ:-100}" --rate "${RATE:-8}" --runs "${RUNS:-elastic:burst,fixed:burst,fixed:poisson,elastic:poisson}" \
  --repeats 1 --warmup-requests "${WARMUP:-16}" --calibration-prompts "${CAL:-64}" ${E2E_ARGS:-} --out "$WORK" 2>&1 \
  | grep -v Warning | tee "$OUT/e2e.log"
cp "$WORK/e2e.csv" "$WORK/hotset.json" "$OUT/" 2>/dev/null
cp "$WORK"/timeline_*.csv "$OUT/" 2>/dev/null
ls -la "$OUT"
