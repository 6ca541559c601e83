#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, sweeps and the benchmark; logs under $OUT.
#   scripts/gpu_run.sh [tests] [sweep OP...] [bench OP...]   (default: tests bench)
# Liger-Kernel travels as a wheel in .whl/ (carry it); the image has torch, triton, matplotlib, rich.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[ $# -eq 0 ] && set -- tests bench
status=0
while [ $# -gt 0 ]; do
  case "$1" in
    tests) shift
      python3 -m pytest -q -p no:cacheprovider -x --timeout=600 tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    sweep) shift; ops=(); while [ $# -gt 0 ] && [[ "$1" != tests && "$1" != bench ]]; do ops+=("$1"); shift; done
      python3 scripts/sweep.py "${ops[@]}" 2>&1 | tee "$OUT/sweep.log" | tail -40 ;;
    bench) shift; ops=(); while [ $# -gt 0 ] && [[ "$1" != tests && "$1" != sweep ]]; do ops+=("$1"); shift; done
      python3 -m tilefuse.cli bench "${ops[@]}" --json "$OUT/bench.json" --md "$OUT/bench.md" --plot "$OUT/bench.png" 2>&1 \
        | tee "$OUT/bench.log" | tail -80 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
exit $status
