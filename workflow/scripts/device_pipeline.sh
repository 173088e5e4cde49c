#!/usr/bin/env bash
# The GPU pipeline profile end to end on a GPU box (the `run` device tool): installs the wheels carried in
# WHEELS (default .whl/: snakemake and the project's non-image dependencies) into /tmp/site, puts a `rimuru`
# command on PATH, runs snakemake with CONFIGS (default: the scaled GPU profile) and SNAKEMAKE_ARGS (default
# --forceall: every rule runs, also those whose tables are committed, kernel_measure on the GPU included),
# and packs tables, figures, kernel CSVs and logs into $OUT/pipeline.tar.gz, with the console log in
# $OUT/pipeline.log.
#   CONFIGS="config/gpu.yaml" bash workflow/scripts/device_pipeline.sh     # the full GPU profile
#   WHEELS=none SNAKEMAKE_ARGS="-n --forceall" bash workflow/scripts/device_pipeline.sh   # a local dry run
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
# a copy without .git: the commit it was made from, for the provenance of every number (rimuru/provenance.py)
[ -f COMMIT ] && export RIMURU_COMMIT=${RIMURU_COMMIT:-$(cat COMMIT)}
CONFIGS=${CONFIGS:-"config/gpu.yaml config/smoke.yaml config/gpu-smoke.yaml"}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
exec > >(tee "$OUT/pipeline.log") 2>&1
t0=$(date +%s)
if [ "$WHEELS" != none ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
mkdir -p /tmp/site/bin
printf '#!/bin/sh\nexec python3 -m rimuru.cli "$@"\n' > /tmp/site/bin/rimuru
printf '#!/bin/sh\nexec python3 -m snakemake "$@"\n' > /tmp/site/bin/snakemake
chmod +x /tmp/site/bin/rimuru /tmp/site/bin/snakemake
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
echo "install: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi (a dry run?)"
python3 -c "import torch, triton, snakemake; print('torch', torch.__version__, 'triton', triton.__version__, 'snakemake', snakemake.__version__)"
# the CPU jobs use one torch thread each (Snakefile); run as many jobs as there are cores
# greedy scheduler: the ILP one needs pulp and its solver binaries (16 MB), not worth carrying for ~25 jobs
# LIMIT (s): stop snakemake in time to pack what finished when the device call has a hard limit
timeout "${LIMIT:-3000}" snakemake --cores all --scheduler greedy --configfile $CONFIGS --printshellcmds \
  ${SNAKEMAKE_ARGS:---forceall} ${TARGETS:-}
rc=$?
echo "snakemake exit $rc after $(( $(date +%s) - t0 )) s"
tar czf "$OUT/pipeline.tar.gz" --exclude='results/models' --exclude='results/reference' results figures 2>/dev/null
exit $rc
