#!/usr/bin/env bash
# On a lent GPU machine (no network): install what it lacks from wheels carried in
# wheels/, then measure the batched engine with random weights in the 135M and 1B
# shapes at c=1/16/64/128 and write docs/benchmarks-cuda.md. Budget: under 8 minutes.
#
#   pip download --only-binary=:all: --python-version 3.11 -d wheels \
#       grpcio-health-checking grpcio-reflection grpcio-status protobuf nvidia-ml-py   # here, first
#   bash benchmarks/gpu-check.sh                                                        # there
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ -d wheels ]; then
  "$PY" -m pip install --no-index --find-links wheels --no-deps -q wheels/*.whl
fi
"$PY" -m pip install --no-index --no-deps --no-build-isolation -q -e . 2>/dev/null || true
export PYTHONPATH="$PWD/service:$PWD/client:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 450 "$PY" -m benchmarks.gpu_bench --random-weights 135m,1b --device cuda --concurrency 1,16,64,128 \
  --max-new-tokens 128 --out docs/benchmarks-cuda.md "$@"
cp docs/benchmarks-cuda.md "${OUT:-.}/" 2>/dev/null || true
