#!/usr/bin/env bash
# One device call for the hybrid (issue 12): the hybrid's GPU tests (Triton GDN/conv kernels and fla's chunked
# prefill against the torch reference; greedy of the fp32 tiny hybrid on CUDA against transformers), GDN kernel
# timings against their bandwidth floors (SECTIONS: decode, conv, prefill), then the scaled Qwen3.5-35B-A3B end to
# end (weights drawn on the GPU; elastic, fixed, static; 24 GiB budget scaled to the layers kept by the engine's
# MemoryPolicy plan; ABBA repeats after a discarded warm-up pass).
# fla-core is not on the GPU box (no network): carry its wheel and einops' in .whl/ (pip download --no-deps -d .whl
# fla-core==0.6.0 einops==0.8.2), installed with --target into $PYLIB; the token trace in .device/
# (`rimuru workload sharegpt-all-at-once --token-ids --num-requests 400 --seed 0 --out .device/trace_sharegpt_400.jsonl`).
# Usage on the GPU box: OUT=/tmp/out RIMURU_COMMIT=<commit> bash workflow/scripts/device_hybrid.sh
# Pending (not yet run): the GPU tests and the tiled conv kernel's timings, without the e2e:
#   TESTS=1 SECTIONS=conv E2E=0 bash workflow/scripts/device_hybrid.sh   (~1 min after a cold start)
set -uo pipefail
OUT=${OUT:-/tmp/out}
PYLIB=${PYLIB:-/tmp/pylib}
# everything lands in $RES and comes back as one $OUT/results.tar.gz (the device tool returns a limited number
# of files: the first call lost its kernel CSV and most timelines to that limit)
RES=${RES:-/tmp/hybrid_results}
mkdir -p "$OUT" "$RES"
trap 'tar czf "$OUT/results.tar.gz" -C "$RES" .' EXIT
python3 -m pip install -q --no-index --no-deps --target "$PYLIB" "${WHL_DIR:-.whl}"/*.whl 2>&1 | tail -2
# TRITON_CACHE_AUTOTUNING: fla's autotuning results are kept on disk, so the e2e process reuses the kernel bench's
export PYTHONUNBUFFERED=1 PYTHONPATH=".:$PYLIB" TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'fla', fla.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_S:-70}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gdn.py \
    tests/engine/test_hybrid.py 2>&1 | grep -v Warn | tail -12
fi
timeout "${KERNEL_S:-50}" python3 workflow/scripts/bench_gdn_gpu.py --sections "${SECTIONS:-conv,prefill}" \
  --out "$RES/kernel" 2>&1 | grep -v Warn | grep -v '^{' | tail -12
[ "${E2E:-1}" = 1 ] || exit 0
timeout "${E2E_S:-150}" python3 workflow/scripts/e2e_gpu.py --model qwen3.5-35b-a3b --layers "${LAYERS:-4}" --skew 0.7 \
  --gpu-synth --budget 24GiB --static-budget 80GiB --trace "${TRACE:-.device/trace_sharegpt_400.jsonl}" \
  --num-requests "${NREQ:-48}" --max-output "${MAX_OUTPUT:-48}" --rate "${RATE:-12}" --warmup-requests "${WARMUP:-16}" \
  --runs "${RUNS:-elastic:poisson,fixed:poisson,elastic:burst,fixed:burst,static:burst}" --repeats "${REPEATS:-2}" \
  --calibration-prompts 32 --out "$RES/e2e" 2>&1 | grep -v Warn | tail -"${TAIL:-45}"
