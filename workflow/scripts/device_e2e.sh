#!/usr/bin/env bash
# One device call: GPU unit tests, attention kernel check, a tiny CUDA smoke run, then the e2e runs given
# in RUNS (policy:workload,...). Usage on the GPU box: RUNS=elastic:burst,fixed:burst bash workflow/scripts/device_e2e.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. RIMURU_COMMIT=${RIMURU_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "${CHECKS:-1}" = 1 ]; then
  timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    tests/memory tests/kernels tests/models tests/experts tests/engine 2>&1 | tail -15
  timeout 240 python3 workflow/scripts/check_attention_gpu.py --out "$OUT/attention.csv" 2>&1 | tail -30
fi
if [ "${SMOKE:-1}" = 1 ]; then
  timeout 120 python3 workflow/scripts/e2e_gpu.py --model tiny-qwen3-moe --layers 2 --budget 2GiB --static-budget 2GiB \
    --trace .device/trace_sharegpt_400.jsonl --num-requests 16 --runs elastic:burst,fixed:burst,static:burst \
    --profile-budget 4GiB --out /tmp/smoke 2>&1 | tail -8 || { echo "smoke failed"; exit 1; }
fi
python3 workflow/scripts/e2e_gpu.py --model qwen3-30b-a3b --layers "${LAYERS:-4}" --skew "${SKEW:-0.7}" \
  --trace .device/trace_sharegpt_400.jsonl --num-requests "${NREQ:-200}" --rate "${RATE:-4}" --runs "$RUNS" \
  --cprofile-steps "${CPROFILE:-0}" --out "$OUT/e2e" 2>&1 | grep -v Warning | tail -"${TAIL:-40}"
