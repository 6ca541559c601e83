#!/usr/bin/env bash
# Session 22: GPU tests of the direct launch path + the attention host probe, one device call.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
timeout -s INT -k 20 ${TEST_TIMEOUT:-330} python3 -m pytest -q -rfE -p no:cacheprovider -n 8 --timeout=240 \
  tests/test_launch.py tests/test_attention.py::test_gpu_large tests/test_attention.py::test_gpu_configs \
  tests/test_attention.py::test_gpu_warp_specialized_forward tests/test_attention_bwd.py::test_gpu_warp_specialized_dq \
  tests/test_attention_bwd.py::test_gpu_shapes tests/test_attention_bwd.py::test_gpu_load_paths \
  tests/test_matmul.py::test_gpu_gluon_small_m tests/test_matmul.py::test_gpu_split_k \
  tests/test_fp8.py::test_gpu_warp_specialized_gemm tests/test_fp8.py::test_gpu_bf16_fwd_bwd_and_graph_capture \
  tests/test_attention_decode.py::test_gpu_large_bf16 tests/test_quant.py::test_gpu_int4_mma_llm_shapes \
  ${EXTRA_TESTS:-} > "$OUT/gpu-tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | cut -c1-300 | tail -30
for d in 64 128; do
  timeout 120 python3 scripts/attn_host_probe.py --d $d --causal > "$OUT/probe-d$d.log" 2>&1; echo "probe d$d exit $?"
  cat "$OUT/probe-d$d.log" | head -16
done
