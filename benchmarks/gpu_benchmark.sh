#!/usr/bin/env bash
# The GPU throughput matrix (benchmarks/gpu_benchmark.py) as one command, with its log kept and a hard stop.
# Needs the installed package (`pip install -e .`); extra arguments go to gpu_benchmark.py.
#
#   bash benchmarks/gpu_benchmark.sh                         # results in ./gpu_results
#   GPU_BENCH_SMOKE=1 bash benchmarks/gpu_benchmark.sh       # CPU smoke run: ResNet-18, batch 2, 1 + 3 iterations
#
# Environment: OUT (results directory, default ./gpu_results), PYTHON (default python3), GPU_BENCH_BUDGET_S
# (seconds of rows; default: all rows), GPU_BENCH_TIMEOUT_S (hard stop; default: budget + 90 s when a budget
# is set, else none), GPU_BENCH_SMOKE=1.
# Writes $OUT/summary.md, $OUT/results.json, $OUT/gpu_benchmark.log and $OUT/runs/<row>/benchmark.json.
# Exit status: gpu_benchmark.py's (124: stopped by the hard stop; the rows finished by then are printed).
set -euo pipefail

PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu_results}
SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/gpu_benchmark.py"

if ! "$PYTHON" -c "import hydra, ssd_lightning" 2>/dev/null; then
    echo "ssd_lightning or its dependencies are not installed for $PYTHON: run 'pip install -e .'" \
        "in the repository first" >&2
    exit 2
fi

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
limit=${GPU_BENCH_TIMEOUT_S:-}
if [[ -z "$limit" && -n "${GPU_BENCH_BUDGET_S:-}" ]]; then
    limit=$((${GPU_BENCH_BUDGET_S%.*} + 90))
fi
status=0
if [[ -n "$limit" ]]; then
    timeout -k 10 "$limit" "$PYTHON" "$SCRIPT" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_benchmark.log" || status=$?
else
    "$PYTHON" "$SCRIPT" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_benchmark.log" || status=$?
fi
if ((status != 0)) && [[ -f "$OUT/summary.md" ]]; then
    echo "gpu_benchmark.py exited with $status (124: stopped after ${limit} s); rows finished so far:"
    cat "$OUT/summary.md"
fi
exit "$status"
