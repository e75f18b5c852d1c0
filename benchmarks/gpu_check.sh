#!/usr/bin/env bash
# One call that proves the GPU: the tests that hold the CUDA paths to the reference, the
# benchmarks on the device, the watch's cost and its device-to-host transfers, and a
# two-rank NCCL merge where two GPUs are present. Each step has its own timeout; a step that
# fails or times out does not stop the others. One summary: ${OUT:-benchmarks/out}/gpu_check.md
# (each step's full output beside it, in gpu_check_logs/).
#
#   benchmarks/gpu_check.sh          # on a CUDA machine: about 5 minutes, at most 8
#   benchmarks/gpu_check.sh --cpu    # the same steps, shorter, on the CPU (tests/test_gpu_check.py)
#
# Run from anywhere; it works in the repository root with PYTHONPATH set to it (nothing
# needs to be installed, no console scripts are used) and no network. Environment: OUT (where
# the summary goes), PYTHON (default python3), GPU_CHECK_BUDGET (seconds for all steps,
# default 470 on CUDA, 240 with --cpu).
set -u

MODE=cuda
if [ "${1:-}" = "--cpu" ]; then
    MODE=cpu
elif [ -n "${1:-}" ]; then
    echo "usage: $0 [--cpu]" >&2
    exit 2
fi

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1          # tests and the probe's host work; a step that wants more says so
export MKL_NUM_THREADS=1
export TOKENIZERS_PARALLELISM=false
export PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$ROOT/benchmarks/out}
LOGS=$OUT_DIR/gpu_check_logs
SUMMARY=$OUT_DIR/gpu_check.md
mkdir -p "$LOGS" || exit 2
ROWS=$LOGS/rows.md
: > "$ROWS"

if [ "$MODE" = cuda ]; then
    BUDGET=${GPU_CHECK_BUDGET:-470}
else
    BUDGET=${GPU_CHECK_BUDGET:-240}
fi
START=$(date +%s)
PASSED=0; FAILED=0; SKIPPED=0

# run_step NAME LIMIT_SECONDS COMMAND...: runs it under `timeout` (never past the budget),
# logs its output, and adds a row: pass (status 0), skip (status 3), timeout, or fail.
run_step() {
    local name=$1 limit=$2
    shift 2
    local now left log status secs figure rc
    now=$(date +%s)
    left=$(( BUDGET - (now - START) ))
    log=$LOGS/$name.log
    if [ "$left" -lt 10 ]; then
        echo "| $name | skip | 0 | budget of ${BUDGET} s spent |" >> "$ROWS"
        SKIPPED=$((SKIPPED + 1))
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit} s): $*" >&2
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - now ))
    case $rc in
        0) status=pass; PASSED=$((PASSED + 1)) ;;
        3) status=skip; SKIPPED=$((SKIPPED + 1)) ;;
        124|137) status="fail (timeout after ${limit} s)"; FAILED=$((FAILED + 1)) ;;
        *) status="fail (exit $rc)"; FAILED=$((FAILED + 1)) ;;
    esac
    figure=$(grep -E 'RESULT|ratio|passed|failed|skipped|error' "$log" | tail -n 3 | tr '\n|' '; ' | cut -c1-400)
    echo "| $name | $status | $secs | ${figure:-see the log} |" >> "$ROWS"
    echo "   $status in ${secs} s" >&2
}

if [ "$MODE" = cuda ]; then
    DEV=cuda
    run_step tests 150 "$PY" -m pytest -q -p no:randomly -n 0 tests/test_cuda.py
    run_step bench_model 45 "$PY" benchmarks/bench_model.py --device cuda --repeats 15 --explicit
    run_step bench_overhead 75 "$PY" benchmarks/bench_overhead.py --device cuda --repeats 15 --breakdown 0
    run_step bench_diagnose_256 90 env OMP_NUM_THREADS=8 MKL_NUM_THREADS=8 \
        "$PY" benchmarks/bench_diagnose.py --device cuda --seq-len 256 --repeats 1
    run_step bench_diagnose_1024 120 env OMP_NUM_THREADS=8 MKL_NUM_THREADS=8 \
        "$PY" benchmarks/bench_diagnose.py --device cuda --seq-len 1024 --repeats 1
    run_step watch 45 "$PY" benchmarks/gpu_check_steps.py watch --device cuda --every 25 --steps 50 --rounds 5
    run_step transfers 45 "$PY" benchmarks/gpu_check_steps.py transfers --device cuda --every 5
    run_step nccl_2_ranks 40 "$PY" benchmarks/gpu_check_steps.py nccl
else
    DEV=cpu
    run_step tests 90 "$PY" -m pytest -q -p no:randomly -n 0 tests/test_cuda.py
    run_step bench_model 30 "$PY" benchmarks/bench_model.py --device cpu --preset tiny --batch 2 --seq 16 --repeats 3
    run_step bench_overhead 45 "$PY" benchmarks/bench_overhead.py --device cpu --batch 1 --seq 16 --repeats 3 \
        --breakdown 0 --threads 1
    run_step bench_diagnose 45 "$PY" benchmarks/bench_diagnose.py --device cpu --preset tiny --seq-len 16 \
        --repeats 1 --batches 1
    run_step watch 30 "$PY" benchmarks/gpu_check_steps.py watch --device cpu --preset tiny --batch 2 \
        --every 5 --steps 10 --rounds 2 --threads 1
    run_step transfers 30 "$PY" benchmarks/gpu_check_steps.py transfers --device cpu --preset tiny --batch 2 \
        --every 3 --threads 1
    run_step nccl_2_ranks 20 "$PY" benchmarks/gpu_check_steps.py nccl
fi

INFO=$("$PY" - "$DEV" <<'EOF' 2>&1
import sys
import torch
dev = sys.argv[1]
name = torch.cuda.get_device_name() if dev == "cuda" and torch.cuda.is_available() else "cpu (no GPU used)"
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"device: {name}; CUDA devices visible: {count}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"Python {sys.version.split()[0]}")
EOF
)

TOTAL=$(( $(date +%s) - START ))
{
    echo "# gpu_check ($MODE)"
    echo
    echo "- $INFO"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); host CPUs: $(nproc 2>/dev/null || echo '?'); OMP_NUM_THREADS=1 (bench_diagnose: 8)"
    echo "- commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')"
    echo "- steps: $PASSED passed, $FAILED failed, $SKIPPED skipped; ${TOTAL} s in all (budget ${BUDGET} s)"
    echo
    echo "| step | result | seconds | figures (the step's last RESULT / ratio / test-summary lines) |"
    echo "| --- | --- | ---: | --- |"
    cat "$ROWS"
    echo
    echo "Each step's whole output: \`$LOGS/<step>.log\`. Tail of each:"
    for log in "$LOGS"/*.log; do
        [ -e "$log" ] || continue
        echo
        echo "<details><summary>$(basename "$log" .log)</summary>"
        echo
        echo '```'
        tail -n 25 "$log"
        echo '```'
        echo "</details>"
    done
} > "$SUMMARY"
rm -f "$ROWS"
echo "wrote $SUMMARY: $PASSED passed, $FAILED failed, $SKIPPED skipped" >&2
[ "$FAILED" -eq 0 ]
