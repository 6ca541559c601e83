"""TFLOP/s vs sequence length for tilefuse.attention and SDPA's backends, from a bench JSON.

    python scripts/plot_attention.py benchmarks/results/<gpu>-<date>.json OUT.png

Panels: forward / backward x full / causal; one line per implementation, D = 128 solid and
D = 64 dashed (B·S = 16k tokens, H = 16, bf16: the registry's attention bench shapes).
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    result = json.load(open(src))
    series = defaultdict(list)   # (op, pass, impl, D) -> [(S, TFLOP/s)]
    for r in result["rows"]:
        if r["op"] in ("attention", "attention_causal") and r["pass"] in ("fwd", "bwd") and r.get("achieved"):
            b, s_q, s_k, h_q, h_kv, d = r["shape"]
            series[(r["op"], r["pass"], r["impl"], d)].append((s_q, r["achieved"]))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    colors = {}
    for (op, pass_, impl, d), pts in sorted(series.items()):
        ax = axes[0 if pass_ == "fwd" else 1][0 if op == "attention" else 1]
        pts.sort()
        color = colors.setdefault(impl, f"C{len(colors)}")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, linestyle="-" if d == 128 else "--",
                label=f"{impl} D={d}", linewidth=2.5 if impl == "tilefuse" else 1.2)
    for i, pass_ in enumerate(("forward", "backward")):
        for j, kind in enumerate(("full", "causal")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pass_}, {kind}")
            ax.set_ylabel("TFLOP/s (FlashAttention convention)")
            ax.grid(alpha=0.3)
    axes[1][0].set_xlabel("sequence length S (B·S = 16k, H = 16, bf16)")
    axes[1][1].set_xlabel("sequence length S (B·S = 16k, H = 16, bf16)")
    axes[0][0].legend(fontsize=7, ncol=2)
    dev = result.get("device", {}).get("name", "?")
    fig.suptitle(f"attention TFLOP/s vs S -- {dev} -- {result.get('date', '')[:10]}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print("wrote", dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
