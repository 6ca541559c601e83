"""Summarize ``ncu --page source --csv --print-source sass`` output: the SASS lines with the most
warp-stall samples and each sampled column summed over the kernel.

    python scripts/ncu_sass_summary.py report-sass.csv [top]

Column names differ between ncu versions, so the columns are found by name: the sort key is the
first header containing "Warp Stall Sampling (All", the stall reasons every numeric column whose
header names a stall or a sample count.
"""

import csv
import sys


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r)), None)
    if start is None:
        print("no header with a 'Source' column; first lines:")
        for r in rows[:10]:
            print("  ", r[:8])
        return
    header, body = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    src = header.index("Source")
    key = next((i for i, h in enumerate(header) if "Warp Stall Sampling (All" in h), None)
    sampled = [i for i, h in enumerate(header)
               if i != src and any(w in h.lower() for w in ("stall", "sampl", "executed"))
               and any(number(r[i]) for r in body)]
    print(f"{len(body)} SASS lines; columns: {[header[i] for i in sampled]}")
    totals = {header[i]: sum(number(r[i]) or 0.0 for r in body) for i in sampled}
    print("\ntotals over the kernel:")
    for name, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {v:12.0f}  {name}")
    if key is None:
        return
    print(f"\ntop {top} lines by '{header[key]}':")
    body.sort(key=lambda r: -(number(r[key]) or 0.0))
    for r in body[:top]:
        nonzero = {header[i]: r[i] for i in sampled if i != key and (number(r[i]) or 0) > 0}
        print(f"  {r[key]:>8s}  {r[src][:70]:70s}  {nonzero}")


if __name__ == "__main__":
    main()
