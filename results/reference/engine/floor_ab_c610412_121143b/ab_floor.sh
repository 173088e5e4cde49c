#!/usr/bin/env bash
# Same-call A/B of the 4-layer decode floor at small batches: the engine at c610412 (.device/old, git archive) against
# the working tree, fresh process each, order O N N O.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/pylib .whl/*.whl 2>&1 | tail -1
ROOT=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.log"; date -u +%FT%TZ | tee -a "$OUT/env.log"
i=0
for tag in old new new old; do
  if [ $tag = old ]; then dir=$ROOT/.device/old; sha=c610412; else dir=$ROOT; sha=${NEW_SHA}; fi
  t0=$(date +%s)
  (cd "$dir" && PYTHONUNBUFFERED=1 PYTHONPATH=$dir:/tmp/pylib RIMURU_COMMIT=$sha timeout ${RUN_TIMEOUT:-120} \
     python3 workflow/scripts/decode_floor_gpu.py --model qwen3-30b-a3b --layers 4 --fast-synth --policies fixed,elastic \
     --batches 1,2,4 --steps 30 --discard 5 --device cuda --out /tmp/floor_${i}_${tag} 2>&1 | grep -v -i warn | tail -8)
  echo "run $i $tag: $(( $(date +%s) - t0 )) s"
  cp /tmp/floor_${i}_${tag}/decode_floor_detail.csv "$OUT/detail_${i}_${tag}.csv" 2>/dev/null
  i=$((i+1))
done
