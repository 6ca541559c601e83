"""Why does fwd+bwd cost more than fwd plus bwd? Times the three passes of one op the way the
benchmark does, then profiles a few fwd+bwd steps (run on the GPU machine, PYTHONPATH=src)."""

import cProfile
import pstats
import sys

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import tilefuse


def case(name, fn, x, *params):
    leaves = (x,) + params
    out = fn(x, *params)
    g = torch.randn_like(out)
    t_fwd = triton.testing.do_bench(lambda: fn(x, *params), return_mode="median")
    t_bwd = triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, g, retain_graph=True), return_mode="median")

    def step():
        return torch.autograd.grad(fn(x, *params), leaves, g)

    t_both = triton.testing.do_bench(step, return_mode="median")
    print(f"{name}: fwd {t_fwd * 1e3:.1f} us, bwd {t_bwd * 1e3:.1f} us, fwd+bwd {t_both * 1e3:.1f} us", flush=True)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=55))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=55))
    # where the host time goes, in Python terms (the GPU runs behind: no syncs inside the loop)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        step()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


dt = torch.bfloat16
x = torch.randn(16384, 4096, device="cuda", dtype=dt, requires_grad=True)
w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(dt).requires_grad_(True)
case("tilefuse rms_norm 16384x4096", lambda x, w: tilefuse.rms_norm(x, None, w), x, w)
case("torch rms_norm 16384x4096", lambda x, w: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6), x, w)
xs = torch.randn(8192, 4096, device="cuda", dtype=dt, requires_grad=True)
case("tilefuse softmax 8192x4096", lambda x: tilefuse.softmax(x), xs)
sys.stdout.flush()
