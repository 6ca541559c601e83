#!/usr/bin/env bash
# Everything one device call needs, in one command (the device tool runs this from the repo root):
#   bash scripts/gpu_call.sh "<pytest files or ''>" "<bench group>" ["<bench group>" ...]
# env: TEST_TIMEOUT, TEST_WORKERS, SWEEP (scripts/sweep.py args), EXTRA (more commands), BENCH_ARGS, BENCH_TIMEOUT
# Each bench group (space-separated op names) writes $OUT/bench-<n>.json; a group that runs out of
# time loses only itself. Liger-Kernel travels as a wheel in .whl/ (carry it).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv,noheader
tests=$1; shift
if [ -n "$tests" ]; then
  # 8 workers: the GPU tests spend most of their time compiling kernels on the CPU; SIGINT at the
  # time limit so pytest still prints its summary of the failures so far
  timeout -s INT -k 30 "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rfE -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
    --timeout=180 $tests > "$OUT/gpu-tests.log" 2>&1
  echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | cut -c1-300 | tail -40
fi
if [ -n "${SWEEP:-}" ]; then
  timeout "${SWEEP_TIMEOUT:-200}" python3 scripts/sweep.py $SWEEP > "$OUT/sweep.log" 2>&1
  echo "sweep exit $?"; sed -n '/^op | shape/,$p' "$OUT/sweep.log"
fi
if [ -n "${EXTRA:-}" ]; then   # any further commands (sweep scripts...), output in $OUT/extra.log
  timeout "${EXTRA_TIMEOUT:-200}" bash -c "$EXTRA" > "$OUT/extra.log" 2>&1
  echo "extra exit $?"; tail -n "${EXTRA_TAIL:-60}" "$OUT/extra.log"
fi
n=0
for group in "$@"; do
  n=$((n + 1))
  timeout "${BENCH_TIMEOUT:-300}" python3 -m tilefuse.cli bench $group --no-progress ${BENCH_ARGS:-} \
    --json "$OUT/bench-$n.json" > "$OUT/bench-$n.log" 2>&1
  echo "bench [$group] exit $?"; tail -n "${BENCH_TAIL:-40}" "$OUT/bench-$n.log"
done
