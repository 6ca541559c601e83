#!/usr/bin/env bash
# Per-instruction stall samples of the int4 kernels (GPU machine; ncu with --clock-control none):
#   bash scripts/int4_ncu_source.sh  -> $OUT/ncu-<name>-{details.txt,sass.csv,summary.txt}
# The summary is the 40 SASS lines with the most stall samples, and the stall reasons summed.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
profile() {  # name kernel-regex script-args...
  local name=$1 regex=$2; shift 2
  ncu --clock-control none --set full --import-source yes -k "regex:$regex" --launch-skip 2 --launch-count 1 \
    -f -o "/tmp/ncu-$name" python3 scripts/int4_gemv_ncu.py "$@" > "$OUT/ncu-$name-run.log" 2>&1
  ncu -i "/tmp/ncu-$name.ncu-rep" --page details --print-details all > "$OUT/ncu-$name-details.txt" 2>&1
  ncu -i "/tmp/ncu-$name.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu-$name-sass.csv" 2>&1
  python3 scripts/ncu_sass_summary.py "/tmp/ncu-$name-sass.csv" > "$OUT/ncu-$name-summary.txt" 2>&1
  gzip -c "/tmp/ncu-$name-sass.csv" > "$OUT/ncu-$name-sass.csv.gz"
  echo "== $name"; grep -E "Duration|Issued Warp|Eligible|Active Warps|Theoretical Occ|Achieved Occ|Registers Per" \
    "$OUT/ncu-$name-details.txt" | head -12; head -60 "$OUT/ncu-$name-summary.txt"
}
profile gemv-m1 quant_gemv 14336 4096 1
profile wgmma-m16 int4_wgmma 14336 4096 16
