"""cross_entropy kernels alone, per launch config (GPU; PYTHONPATH=src).

    python scripts/ce_sweep.py [T V]

Times the deferred mode's two kernels on bf16 logits: the forward walk that reads the logits once
for (m, log2 s, q) per row (bytes: T·V·2 read), and the backward that reads them again and writes
the gradient (T·V·2·2). Each config is checked against the fp32 torch statistics / gradient first.
Prints GB/s and % of a same-size copy per config, then the registry default.
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton.testing

from tilefuse.ops import _cross_entropy_kernels as k
from tilefuse.ops.cross_entropy import random_targets

T, V = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (8192, 128256)
dev = "cuda"
x = torch.randn(T, V, device=dev).to(torch.bfloat16) * 3
t = random_targets(T, V, dev)
opts = k.CEOptions(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
row_scale = torch.full((1,), 1.0 / max(1, int((t != -100).sum())), device=dev)
valid = t != -100

# reference: fp32 loss rows and gradient
xf = x.float()
lse = torch.logsumexp(xf, -1)
loss_ref = torch.where(valid, lse - xf.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
copy_src = torch.empty(T * V, device=dev, dtype=torch.bfloat16)
copy_dst = torch.empty_like(copy_src)


def ms(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


copy_ms = ms(lambda: copy_dst.copy_(copy_src))
read_bytes = T * V * 2
print(f"{torch.cuda.get_device_name()} T={T} V={V} bf16; same-size copy {2 * read_bytes / copy_ms / 1e6:.0f} GB/s")

fwd_cfgs = [None] + [
    {"single_tile": False, "BLOCK_V": bv, "num_warps": w, "maxnreg": r, "programs_per_sm": None}
    for bv, w, r in itertools.product((4096, 8192), (8, 16), (64, 96, None))
    if bv // (32 * w) >= 8
]
loss = torch.empty(T, device=dev)
stats = torch.empty(3, T, device=dev)
rows = []
for cfg in fwd_cfgs:
    fn = lambda: k.launch_cross_entropy_rows(x, t, row_scale, loss, None, opts, cfg, stats)  # noqa: E731
    try:
        loss.fill_(float("nan"))
        fn()
        err = ((loss - loss_ref).norm() / loss_ref.norm()).item()
        t_ms = ms(fn)
    except Exception as exc:  # noqa: BLE001
        print(f"fwd {cfg}: ERROR {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        continue
    gbps = read_bytes / t_ms / 1e6
    rows.append((gbps, cfg))
    print(f"fwd {'default' if cfg is None else cfg}: {t_ms * 1e3:7.1f} us {gbps:6.0f} GB/s "
          f"({100 * gbps / (2 * read_bytes / copy_ms / 1e6):.0f} % of copy) err {err:.1e}", flush=True)

# the deferred backward with the forward's stats (default config)
k.launch_cross_entropy_rows(x, t, row_scale, loss, None, opts, None, stats)
g_ref = torch.softmax(xf, -1) * row_scale
rows_valid = valid.nonzero()[:, 0]
g_ref[rows_valid, t[rows_valid]] -= row_scale
g_ref[~valid] = 0
g = torch.empty_like(x)
for cfg in [None, {"BLOCK_V": 4096, "num_warps": 8}, {"BLOCK_V": 8192, "num_warps": 16}, {"BLOCK_V": 8192, "num_warps": 8}]:
    fn = lambda: k.launch_cross_entropy_bwd(x, t, stats, row_scale, g, opts, cfg)  # noqa: E731
    fn()
    err = ((g.float() - g_ref).norm() / g_ref.norm()).item()
    t_ms = ms(fn)
    gbps = 2 * read_bytes / t_ms / 1e6
    print(f"bwd {'default' if cfg is None else cfg}: {t_ms * 1e3:7.1f} us {gbps:6.0f} GB/s "
          f"({100 * gbps / (2 * read_bytes / copy_ms / 1e6):.0f} % of copy) err {err:.1e}", flush=True)
best = max(rows, key=lambda r: r[0]) if rows else None
print(f"best fwd: {best}")
