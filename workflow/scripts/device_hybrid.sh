#!/usr/bin/env bash
# One device call for the hybrid (issue 12): GDN kernel timings against their bandwidth floors, then the scaled
# Qwen3.5-35B-A3B end to end (elastic, fixed, static; 24 GiB budget scaled to the layers kept).
# fla-core is not on the GPU box (no network): carry its wheel in .whl/ (pip download fla-core==0.6.0 --no-deps
# -d .whl; einops likewise) and the token trace in .device/ (`rimuru workload --token-ids`).
# Usage on the GPU box: OUT=/tmp/out [WHL_DIR=.whl TRACE=.device/trace_sharegpt_400.jsonl] bash workflow/scripts/device_hybrid.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps "${WHL_DIR:-.whl}"/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'fla', fla.__version__)"
timeout "${KERNEL_S:-80}" python3 workflow/scripts/bench_gdn_gpu.py --out "$OUT/kernel" 2>&1 | grep -v Warn | tail -45
timeout "${E2E_S:-110}" python3 workflow/scripts/e2e_gpu.py --model qwen3.5-35b-a3b --layers "${LAYERS:-4}" --skew 0.7 \
  --budget 24GiB --static-budget 80GiB --trace "${TRACE:-.device/trace_sharegpt_400.jsonl}" --num-requests "${NREQ:-64}" \
  --runs "${RUNS:-elastic:burst,fixed:burst,static:burst}" --calibration-prompts 32 --out "$OUT/e2e" 2>&1 \
  | grep -v Warn | tail -30
