#!/usr/bin/env bash
# Issue 22's GPU checks in one call of the device tool (a lent GPU machine; about 4 minutes on an
# H200): the CUDA tests, scripts/bench_cuda.py, and the time of each phase of the stall and of
# the load (1 GiB, 1 % and 15 % small). Everything it prints and writes lands in $OUT (at most 8
# files come back).
#
#   here:  bash scripts/device_wheels.sh    # the wheels that machine's Python lacks, into .whl/
#   tool:  run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=600)
#   here, after: cp <files_at>/benchmarks-cuda.{json,md} docs/ &&
#          .venv/bin/python scripts/bench.py --report-from docs/benchmarks.json --out docs
#
# Each step has its own time limit, so that one that hangs leaves the others their time.
# BENCH_ARGS overrides the bench's arguments (default: 3 repeats at 1 and 4 GiB).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
{
  date -u; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, zarr; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zarr', zarr.__version__)"
  git log --oneline -1 2>/dev/null
} 2>&1 | tee "$OUT/env.txt"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rA tests/test_cuda.py \
  2>&1 | tee "$OUT/test_cuda.log"
# shellcheck disable=SC2086
timeout 330 "$PY" scripts/bench_cuda.py ${BENCH_ARGS:---repeats 3} --out "$OUT" \
  2>&1 | tee "$OUT/bench_cuda.log"
# Where the time of the stall and of the load goes, phase by phase (wall clock), for both
# shares of small tensors.
for share in 0.15 0.01; do
  timeout 60 "$PY" scripts/profile_save_load.py --device cuda --size-mib 1024 --share $share \
    --repeats 3 --phases
done > "$OUT/phases.txt" 2>&1
echo "device_check: done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
