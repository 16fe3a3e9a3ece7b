#!/usr/bin/env bash
# One command for a GPU machine that has torch, pytorch-lightning and torchmetrics but no Hydra: installs
# the carried pure-Python wheels (hydra-core, omegaconf, antlr4-python3-runtime) into a scratch directory,
# then runs scripts/gpu_benchmark.py (SSD300-ResNet50 bf16/fp16 at batch 64/128/256, training and
# inference, MobileNetV2, channels_last off, torch.compile) and prints one table. pycocotools and DALI are
# not needed: the benchmark tasks use synthetic data and no COCO evaluation.
#
#   bash scripts/gpu_benchmark.sh prepare       # once, on a machine with PyPI: wheels -> build/gpu_wheels
#   bash scripts/gpu_benchmark.sh               # on the GPU machine; extra arguments go to gpu_benchmark.py
#   GPU_BENCH_SMOKE=1 bash scripts/gpu_benchmark.sh   # CPU smoke run: ResNet-18, batch 2, 1 + 3 iterations
#
# Environment: OUT (results directory, default ./gpu_results), PYTHON (default python3), GPU_BENCH_WHEELS
# (default build/gpu_wheels, ignored by git through build/), GPU_BENCH_SITE (install target, default
# /tmp/gpu_bench_site), GPU_BENCH_BUDGET_S (seconds of rows, default 420), GPU_BENCH_TIMEOUT_S (hard stop,
# default budget + 90), GPU_BENCH_SMOKE=1.
# Writes $OUT/summary.md, $OUT/results.json (every row's benchmark.json), $OUT/gpu_benchmark.log and
# $OUT/runs/<row>/benchmark.json; with PACK_RUNS=1 the runs folder is packed into $OUT/runs.tar.gz instead
# (the device tool returns at most 8 files).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_BENCH_WHEELS:-build/gpu_wheels}
SITE=${GPU_BENCH_SITE:-/tmp/gpu_bench_site}
OUT=${OUT:-gpu_results}
# pinned to the versions the project's tests run with (pyproject: hydra-core 1.3.x, omegaconf 2.3.x)
REQUIREMENTS=(hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3)

if [[ "${1:-}" == prepare ]]; then
    mkdir -p "$WHEELS"
    # antlr4-python3-runtime 4.9.3 is published as a source archive only: build its (pure-Python) wheel here
    "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$WHEELS" "${REQUIREMENTS[@]}"
    ls -l "$WHEELS"
    exit 0
fi

if ! "$PYTHON" -c "import hydra, omegaconf" 2>/dev/null; then
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    if ((${#wheels[@]} == 0)); then
        echo "hydra-core is not installed and $WHEELS has no wheels: run 'bash scripts/gpu_benchmark.sh prepare'" \
            "where PyPI is reachable and carry $WHEELS" >&2
        exit 2
    fi
    # --no-deps: PyYAML and packaging (their other needs) come with pytorch-lightning
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" -c "import hydra, omegaconf; print('hydra-core', hydra.__version__, 'omegaconf', omegaconf.__version__, 'from', hydra.__path__[0])"
fi

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A hard stop past the row budget (a compile that takes far longer than estimated), so that the device
# tool's own limit never cuts the packing below; the rows finished by then are in summary.md already.
limit=${GPU_BENCH_TIMEOUT_S:-$((${GPU_BENCH_BUDGET_S:-420} + 90))}
status=0
timeout -k 10 "$limit" "$PYTHON" scripts/gpu_benchmark.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_benchmark.log" ||
    status=$?
if ((status != 0)) && [[ -f "$OUT/summary.md" ]]; then
    echo "gpu_benchmark.py exited with $status (124: stopped after ${limit} s); rows finished so far:"
    cat "$OUT/summary.md"
fi
if [[ "${PACK_RUNS:-0}" == 1 && -d "$OUT/runs" ]]; then
    tar -czf "$OUT/runs.tar.gz" -C "$OUT" runs && rm -rf "$OUT/runs"
fi
exit "$status"
