"""cross_entropy kernels alone, per launch config (GPU; PYTHONPATH=src).

    python scripts/ce_sweep.py [T V] [--lanes]

On bf16 logits [T, V], each looped-tier config of the forward kernel is checked against fp32
torch and timed in both of the op's modes:

* ``stats``: the deferred mode's forward, one read of the logits for (m, log2 s, q) per row
  (bytes: T·V·2);
* ``grad``: the gradient written in the forward (into a separate buffer here), a stats walk and
  a gradient walk over each row (bytes: T·V·2 read + T·V·2 written; the second read should hit
  L2), with and without L2 eviction hints;

then the deferred backward kernel (read logits, write gradient) for a few tiles. ``--lanes``
instead times the gradient-writing kernel's tiles and warps with and without GRAD_PREFETCH (session
32's sweep of the per-thread-max walk (LANE_STATS then) and PREFETCH over persistent grids is in
git history, commit "per-thread-max stats walk ... as a sweepable config"). GB/s over the
ideal bytes, and % of a same-size device copy measured in the same run.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import triton.testing

from tilefuse.ops import _cross_entropy_kernels as k
from tilefuse.ops.cross_entropy import random_targets

LANES = "--lanes" in sys.argv
_dims = [a for a in sys.argv[1:] if not a.startswith("--")]
T, V = (int(a) for a in _dims[:2]) if len(_dims) >= 2 else (8192, 128256)
dev = "cuda"
x = torch.randn(T, V, device=dev).to(torch.bfloat16) * 3
t = random_targets(T, V, dev)
opts = k.CEOptions(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
valid = t != -100
row_scale = torch.full((1,), 1.0 / max(1, int(valid.sum())), device=dev)

xf = x.float()
loss_ref = torch.where(valid, torch.logsumexp(xf, -1) - xf.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
g_ref = torch.softmax(xf, -1) * row_scale
rows_valid = valid.nonzero()[:, 0]
g_ref[rows_valid, t[rows_valid]] -= row_scale
g_ref[~valid] = 0
del xf
copy_src = torch.empty(T * V, device=dev, dtype=torch.bfloat16)
copy_dst = torch.empty_like(copy_src)


def ms(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


nbytes = T * V * 2
copy_gbps = 2 * nbytes / ms(lambda: copy_dst.copy_(copy_src)) / 1e6
print(f"{torch.cuda.get_device_name()} T={T} V={V} bf16; same-size copy {copy_gbps:.0f} GB/s")


def report(label, cfg, t_ms, moved, err):
    gbps = moved / t_ms / 1e6
    print(f"{label} {'default' if cfg is None else cfg}: {t_ms * 1e3:7.1f} us {gbps:6.0f} GB/s "
          f"({100 * gbps / copy_gbps:.0f} % of copy) err {err:.1e}", flush=True)
    return gbps


loss = torch.empty(T, device=dev)
stats = torch.empty(3, T, device=dev)
g = torch.empty_like(x)
fwd_cfgs = [None] + [
    {"single_tile": False, "BLOCK_V": bv, "num_warps": w, "maxnreg": r, "programs_per_sm": None}
    for bv, w, r in itertools.product((4096, 8192), (8, 16), (64, None)) if bv // (32 * w) >= 8
]
# the gradient-writing forward (looped tier): without L2 hints, then with the stats walk's loads
# evict_last and the gradient walk's evict_first, the stores' policy either way (the default)
grad_cfgs = [dict(c, STATS_EVICT="", GRAD_EVICT="", STORE_EVICT="") for c in fwd_cfgs[1:]] + [
    {"single_tile": False, "BLOCK_V": bv, "num_warps": w, "maxnreg": r, "programs_per_sm": pps,
     "STATS_EVICT": "evict_last", "GRAD_EVICT": "evict_first", "STORE_EVICT": se}
    for bv, w, r, pps, se in itertools.product((4096, 8192), (8, 16), (64, None), (None, 1, 2), ("", "evict_first"))
    if bv // (32 * w) >= 8
]
if LANES:   # the gradient-writing kernel's prefetch of the gradient walk, around the default's tile / warps
    fwd_cfgs = [None]
    grad_cfgs = [
        {**k.default_config(V, True), "BLOCK_V": bv, "num_warps": w, "GRAD_PREFETCH": gp}
        for (bv, w), gp in itertools.product(((8192, 16), (16384, 32), (32768, 32)), (False, True))
        if (bv, w, gp) != (k.default_config(V, True)["BLOCK_V"], k.default_config(V, True)["num_warps"], False)
    ]
best = {}
for mode in ("stats", "grad"):
    for cfg in (fwd_cfgs if mode == "stats" else [None] + grad_cfgs):
        out = None if mode == "stats" else g
        fn = lambda: k.launch_cross_entropy_rows(x, t, row_scale, loss, out, opts, cfg, stats if mode == "stats" else None)  # noqa: E731
        try:
            loss.fill_(float("nan"))
            fn()
            err = max(rel(loss, loss_ref), rel(g, g_ref) if mode == "grad" else 0.0)
            gbps = report(mode, cfg, ms(fn), nbytes * (1 if mode == "stats" else 2), err)
        except Exception as exc:  # noqa: BLE001
            print(f"{mode} {cfg}: ERROR {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        if gbps > best.get(mode, (0, None))[0]:
            best[mode] = (gbps, cfg)

k.launch_cross_entropy_rows(x, t, row_scale, loss, None, opts, None, stats)
for cfg in [None, {"BLOCK_V": 4096, "num_warps": 8}, {"BLOCK_V": 8192, "num_warps": 16}, {"BLOCK_V": 8192, "num_warps": 8}]:
    fn = lambda: k.launch_cross_entropy_bwd(x, t, stats, row_scale, g, opts, cfg)  # noqa: E731
    g.fill_(float("nan"))
    fn()
    gbps = report("bwd", cfg, ms(fn), 2 * nbytes, rel(g, g_ref))
    if gbps > best.get("bwd", (0, None))[0]:
        best["bwd"] = (gbps, cfg)
for mode, (gbps, cfg) in best.items():
    print(f"best {mode}: {gbps:.0f} GB/s ({100 * gbps / copy_gbps:.0f} % of copy) {cfg}")
for mode, (gbps, cfg) in best.items():   # machine-readable, for a follow-up run with the winner
    print(f"BESTJSON {mode} {json.dumps(cfg)}")
