#!/usr/bin/env bash
# Session 22: GPU tests of the direct launch path + the attention host probe + the attention bench, one call.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
timeout -s INT -k 20 ${TEST_TIMEOUT:-240} python3 -m pytest -q -rfE -p no:cacheprovider -n 12 --timeout=200 \
  ${TESTS:-tests/test_launch.py tests/test_attention.py::test_gpu_default_forward_is_warp_specialized \
  tests/test_attention.py::test_gpu_warp_specialized_forward tests/test_attention_bwd.py::test_gpu_warp_specialized_dq \
  tests/test_attention_bwd.py::test_gpu_warp_specialized_dkdv tests/test_attention_bwd.py::test_gpu_varlen_bf16 \
  tests/test_attention.py::test_gpu_varlen_load_paths tests/test_matmul.py::test_gpu_gluon_small_m_by_default_fwd_bwd} \
  > "$OUT/gpu-tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | cut -c1-300 | tail -30
for d in ${PROBE_DIMS:-64 128}; do
  timeout 120 python3 scripts/attn_host_probe.py --d $d --causal > "$OUT/probe-d$d.log" 2>&1; echo "probe d$d exit $?"
  sed -n '2,14p' "$OUT/probe-d$d.log"
done
for g in ${BENCH_GROUPS:-attention_causal}; do
  timeout ${BENCH_TIMEOUT:-240} python3 -m tilefuse.cli bench $g --no-progress --no-compile \
    --impls ${IMPLS:-tilefuse,sdpa_flash,sdpa_cudnn} ${BENCH_ARGS:-} --json "$OUT/bench-$g.json" > "$OUT/bench-$g.log" 2>&1
  echo "bench $g exit $?"; grep -E "tilefuse|sdpa" "$OUT/bench-$g.log" | awk -F'│' '{print $3,$5,$6,$7,$10}' | tail -${BENCH_TAIL:-40}
done
