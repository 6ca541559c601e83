"""Merge the JSON of several `tilefuse bench` runs (one device call each) into one result, and
render it: JSON (source of truth), Markdown and PNG.

    python scripts/merge_results.py OUT_STEM bench-1.json bench-2.json ...

writes OUT_STEM.json, OUT_STEM.md and OUT_STEM.png. Runs must come from the same device; the
first run's metadata (device, ceilings, versions) heads the merged result, and each run's own
ceilings stay in ``runs`` so a reader can see they agree.
"""

import sys

from tilefuse import registry
from tilefuse.bench.report import load_json, plot, write_json, write_markdown
from tilefuse.bench.runner import unsplit_pass_rows


def main(argv):
    stem, paths = argv[0], argv[1:]
    runs = [load_json(p) for p in paths]
    devices = {r["device"]["name"] for r in runs if r.get("device")}
    if len(devices) > 1:
        raise SystemExit(f"runs come from different devices: {sorted(devices)}")
    merged = dict(runs[0])
    merged["rows"] = [row for r in runs for row in r["rows"]]
    for spec in registry.all_ops():     # today's registry decides which per-pass rows compare
        unsplit_pass_rows(spec, [row for row in merged["rows"] if row["op"] == spec.name])
    merged["runs"] = [{"path": p, "date": r.get("date"), "ceilings": r.get("ceilings"),
                       "summary": r.get("summary")} for p, r in zip(paths, runs)]
    keys = ("rows", "ok", "failed", "errors", "skipped", "tilefuse_not_ok")
    merged["summary"] = {k: sum((r.get("summary") or {}).get(k, 0) or 0 for r in runs) for k in keys}
    write_json(merged, stem + ".json")
    write_markdown(merged, stem + ".md")
    plot(merged, stem + ".png")
    print(f"wrote {stem}.json/.md/.png: {len(merged['rows'])} rows from {len(runs)} runs")


if __name__ == "__main__":
    main(sys.argv[1:])
