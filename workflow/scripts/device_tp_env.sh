# Sourced by the multi-GPU device scripts (device_tp2.sh, device_tpserve.sh) once they have set BUDGET_S and OUT:
# the call's clock (`left` prints the seconds of BUDGET_S still left), the environment every multi-GPU engine of
# theirs runs in (NVLink multicast off: on the lent machines it can take the shared host's GPUs out of service),
# the carried wheels (.whl/) installed into /tmp/pylib, and $OUT made.
START=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/pylib .whl/*.whl >/dev/null 2>&1; fi
export PYTHONPATH=$PWD:/tmp/pylib
mkdir -p "$OUT"
