"""Where the attention backward's host time goes (GPU machine, PYTHONPATH=src).

    python scripts/attn_host_probe.py [--d 128] [--causal]

At a tiny shape (B=1, S=128, H=2, bf16: the kernels take a few µs, so a loop of calls measures the
host alone), µs per call of each piece the backward's host path runs: a host TMA descriptor built
(``TensorDescriptor``), its CUtensorMap filled (what the launcher does for each descriptor
argument on every launch), an output allocated, the preprocess kernel's launch, each Gluon
launcher, the whole ``launch_attention_backward``, and ``autograd.grad`` through the op, beside
SDPA-flash's backward through autograd.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tilefuse import attention
from tilefuse.ops import _attention_bwd as bwd
from tilefuse.ops._attention_fwd_gluon import _descriptor


def us_per_call(fn, n: int = 300, rounds: int = 5) -> float:
    """The best of ``rounds`` loops of ``n`` calls, µs per call, the GPU drained before each loop."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t)
    torch.cuda.synchronize()
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile of the backward, top functions by own time")
    a = ap.parse_args()
    d = a.d
    q, k, v = (torch.randn(1, 128, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, causal=a.causal)
    do = torch.randn_like(out)
    import triton.backends.nvidia.driver as driver
    captured = []
    real_fill = driver.make_tensordesc_arg

    def capture(arg, meta):        # the (descriptor, metadata) pairs of one real launch
        captured.append((arg, meta))
        return real_fill(arg, meta)

    driver.make_tensordesc_arg = capture
    o2, lse = attention(q.detach(), k.detach(), v.detach(), causal=a.causal, return_lse=True)
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    driver.make_tensordesc_arg = real_fill
    x = q.detach()
    desc, meta = captured[0]
    rows = {
        "TensorDescriptor (_descriptor)": lambda: _descriptor(x, 64),
        "CUtensorMap fill (make_tensordesc_arg)": lambda: real_fill(desc, meta),
        "torch.empty (q's shape)": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
    }
    print(f"descriptor arguments filled per fwd + bwd: {len(captured)}")
    saved = (q, k, v)
    wr = 0 if a.causal else None
    args = (do, q.detach(), k.detach(), v.detach(), o2, lse)
    from tilefuse.ops._attention_bwd_gluon import launch_attention_bwd_dkdv_ws
    from tilefuse.ops._attention_dq_gluon import launch_attention_bwd_dq_ws
    stat = torch.zeros(2, 128, device="cuda")        # lse2 / delta [H_q, B·stat_seq]
    grads = [torch.empty_like(t) for t in args[1:4]]
    kw = dict(scale=d ** -0.5, softcap=0.0, window_left=None, window_right=wr)
    rows["  Gluon dk/dv launcher alone"] = lambda: launch_attention_bwd_dkdv_ws(
        *args[1:4], do, grads[1], grads[2], stat, stat, 128, **kw)
    rows["  Gluon dq launcher alone"] = lambda: launch_attention_bwd_dq_ws(
        *args[1:4], do, grads[0], stat, stat, 128, **kw)
    rows["launch_attention_backward"] = lambda: bwd.launch_attention_backward(*args, scale=d ** -0.5, window_right=wr)
    rows["  same, tl kernels (GLUON=False)"] = lambda: bwd.launch_attention_backward(
        *args, scale=d ** -0.5, window_right=wr, config={"GLUON": False})
    rows["autograd.grad (retained graph)"] = lambda: torch.autograd.grad(out, saved, do, retain_graph=True)
    rows["forward (no grad)"] = lambda: attention(q.detach(), k.detach(), v.detach(), causal=a.causal)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
        o_s = F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
        do_s = do.transpose(1, 2)
        rows["SDPA-flash autograd.grad"] = lambda: torch.autograd.grad(o_s, (qt, kt, vt), do_s, retain_graph=True)
        rows["SDPA-flash forward (no grad)"] = lambda: F.scaled_dot_product_attention(
            qt.detach(), kt.detach(), vt.detach(), is_causal=a.causal)
        print(f"{torch.cuda.get_device_name()}  D={d} causal={a.causal}: host µs per call")
        for name, fn in rows.items():
            print(f"  {name:42s} {us_per_call(fn):8.1f}")
    # fast_launch misses per kernel over one more fwd + bwd: a kernel that misses on every call
    # pays Triton's own launch path (~20 µs) each time
    from tilefuse import _launch
    misses = {}
    real_run = _launch.FastKernel._run_keyed

    def counting(self, cache, key, device, grid, args, kwargs):
        if cache.get(key) is None:
            misses[self.fn.__name__] = misses.get(self.fn.__name__, 0) + 1
        return real_run(self, cache, key, device, grid, args, kwargs)

    _launch.FastKernel._run_keyed = counting
    for _ in range(3):
        torch.autograd.grad(attention(q, k, v, causal=a.causal), (q, k, v), do)
    torch.cuda.synchronize()
    _launch.FastKernel._run_keyed = real_run
    print(f"fast_launch misses in 3 fwd + bwd steps: {misses or 'none'}")
    if a.profile:
        import cProfile
        import pstats
        step = rows["autograd.grad (retained graph)"]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
