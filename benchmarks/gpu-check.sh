#!/usr/bin/env bash
# The GPU check, by itself, on a bare GPU machine (no network): what travels is the
# repository and the bundle `make gpu-wheels` packs (.gpu/: the wheels the machine lacks,
# benchmarks/gpu-wheels.txt, and the default model's tokenizer files). It installs the
# wheels beside the machine's own packages, runs `make test-gpu`, then the GPU bench
# (benchmarks/gpu_bench.py) at the 1B and 135M shapes with random weights, c = 1, 16, 64,
# 128: first the 1B native pass (CUDA graphs, overlap) and the 1B ceiling (compiled
# static-batch generate, c = 128 first), then the same at 135M, then transformers' forward,
# and (time left) the native pass with --overlap off and the prompt budget; it prints one
# table and writes it to docs/benchmarks-cuda.md. Budget: 8 minutes in all.
#
# Where $OUT is set (the device machine's folder that comes back), the whole log is teed to
# $OUT/gpu-check.log and the table is written to $OUT/benchmarks-cuda.md after every phase:
# a run killed mid-bench (even by SIGKILL) still leaves both. A phase that raises is a row
# of the table ("Failed: ..."), and a failing test run does not stop the bench.
#
#   make gpu-wheels                                  # here, once (GPU_PYTHON=3.12 by default)
#   bash benchmarks/gpu-check.sh                     # there: carry .gpu
#   bash benchmarks/gpu-check.sh --dry-run           # check the bundle and print the plan
#   bash benchmarks/gpu-check.sh --device cpu        # the same on a CPU (small: 135M, c = 1, 4)
#
# Anything after `--` goes to gpu_bench (e.g. -- --random-weights 1b --concurrency 1,128).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
BUNDLE=${GPU_BUNDLE:-.gpu}
DEVICE=cuda
DRY_RUN=0
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --device) DEVICE="$2"; shift ;;
    --device=*) DEVICE="${1#--device=}" ;;
    --bundle) BUNDLE="$2"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "gpu-check: unknown argument $1 (--dry-run, --device cuda|cpu, --bundle DIR, -- gpu_bench args)" >&2; exit 2 ;;
  esac
  shift
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu-check: --device cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
started=$SECONDS
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
SITE=${TMPDIR:-/tmp}/tokenwire-gpu-site
REPORT=docs/benchmarks-cuda.md  # a CPU run's table goes to /tmp: it is no GPU figure
if [ -n "${OUT:-}" ] && [ "$DRY_RUN" = 0 ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu-check.log") 2>&1  # the log comes back whatever ends the run
fi
if [ "$DEVICE" = cuda ]; then
  # Last, where time is left: the prompt budget at the 1B shape (a long prompt among 16 streams).
  BENCH=(--device cuda --random-weights 135m,1b --concurrency 1,16,64,128 --max-new-tokens 128 --prefill-budgets 64,256,1024)
else
  # Not flex: on a CPU it compiles once per step shape (tests/test_flex.py proves it here).
  BENCH=(--device cpu --random-weights 135m --concurrency 1,4 --max-new-tokens 16 --requests-per-stream 1
         --forwards native,transformers,native:no-overlap,native:sampled,native:sampled+no-overlap)
  REPORT=${TMPDIR:-/tmp}/gpu-check-cpu.md
fi
if [ -n "${OUT:-}" ] && [ "$DRY_RUN" = 0 ]; then  # written in place, phase by phase: nothing to copy at the end
  [ -f "$REPORT" ] && cp "$REPORT" "$OUT/benchmarks-cuda.md"
  REPORT=$OUT/benchmarks-cuda.md
fi
TEST_S=210

# 1. The bundle: every wheel for this Python, under 60 MiB, the tokenizer there.
"$PY" -m benchmarks.gpu_bundle check "$BUNDLE" --python "$PYVER"
BUNDLE=$(cd "$BUNDLE" && pwd)  # absolute: the tests and the bench run from other folders
plan() {
  echo "plan ($DEVICE, Python $PYVER, budget ${BUDGET_S}s):"
  echo "  $PY -m pip install --no-index --no-deps --target $SITE $BUNDLE/wheels/*.whl"
  echo "  PYTHONPATH=$SITE:service:client:. TOKENWIRE_TOKENIZER_DIR=$BUNDLE/tokenizer"
  echo "  timeout ${TEST_S} $PY -m pytest tests/gpu"
  echo "  $PY -m benchmarks.gpu_bench ${BENCH[*]} --budget-s <what is left> --out $REPORT ${EXTRA[*]}"
}
plan
if [ "$DRY_RUN" = 1 ]; then
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  if [ "$DEVICE" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA device here: a run would stop before the tests (--device cpu runs it on this CPU)"
  fi
  exit 0
fi

# 2. The wheels, ahead of the machine's own packages; the tokenizer instead of the GGUF.
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$BUNDLE"/wheels/*.whl
export PYTHONPATH="$SITE:$PWD/service:$PWD/client:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENWIRE_TOKENIZER_DIR="$BUNDLE/tokenizer" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# xgrammar's tvm-ffi would JIT-build its torch add-on (about a minute) on first import.
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

# 3. The GPU tests (their CPU variants alone where there is no GPU); pytest itself, as `make`
# is not among a bare machine's tools.
status=0
timeout "$TEST_S" "$PY" -m pytest tests/gpu -q -p no:cacheprovider || status=$?
echo "tests/gpu: exit $status ($((SECONDS - started)) s so far)"

# 4. The bench, in what is left of the budget (a phase that would start late is skipped, and said so).
# A phase (a server at one shape, or the ceiling's compiles) takes up to ~2 minutes: none
# starts later than 2 minutes before the budget ends, and the table is written after each.
left=$((BUDGET_S - (SECONDS - started) - 120))
[ "$left" -gt 0 ] || left=1  # the first phase still runs, the rest are named as skipped
bench=0
timeout $((left + 150)) "$PY" -m benchmarks.gpu_bench "${BENCH[@]}" --budget-s "$left" \
  --out "$REPORT" "${EXTRA[@]}" || bench=$?
echo "gpu-check: $((SECONDS - started)) s; tests/gpu exit $status; bench exit $bench; table: $REPORT"
[ "$status" = 0 ] || exit "$status"
exit "$bench"
