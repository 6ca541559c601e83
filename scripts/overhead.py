"""Where does a small op's time go? Decomposes one softmax / rms_norm call on the GPU.

For each layer (raw launcher, custom-op impl, FastOp without grad, public function with grad,
torch) prints do_bench's median (GPU events, what the benchmark reports) and the host time per
call (a Python loop, synchronized once at the end).
"""

import torch
import triton.testing

import tilefuse  # run with PYTHONPATH=src
from tilefuse.bench import host_us
from tilefuse.ops import norms as nm
from tilefuse.ops import softmax as sm


def row(name, fn):
    ms = triton.testing.do_bench(fn, return_mode="median")
    print(f"{name:42s} do_bench {ms * 1e3:8.1f} us   host loop {host_us(fn):8.1f} us/call", flush=True)


x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
xg = x.clone().requires_grad_(True)
row("softmax 8192x1024 _launch_fwd", lambda: sm._launch_fwd(x, False))
row("softmax _softmax_fwd_op._init_fn", lambda: sm._softmax_fwd_op.op._init_fn(x, False))
row("softmax custom op via dispatcher", lambda: sm._softmax_fwd_op.op(x, False))
row("softmax tilefuse.softmax (no grad)", lambda: tilefuse.softmax(x))
row("softmax tilefuse.softmax (requires grad)", lambda: tilefuse.softmax(xg))
row("softmax torch.softmax (requires grad)", lambda: torch.softmax(xg, -1))
x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
row("rms 16384x4096 _launch_fwd", lambda: nm._launch_fwd(x, w, None, None, 1e-6, 0.0, True))
row("rms tilefuse.rms_norm (no grad)", lambda: tilefuse.rms_norm(x, None, w))
row("rms tilefuse.rms_norm (requires grad)", lambda: tilefuse.rms_norm(xg, None, wg))
row("rms F.rms_norm (requires grad)", lambda: torch.nn.functional.rms_norm(xg, (4096,), wg, 1e-6))
for n in (1, 5):
    a = torch.randn(n, 1, device="cuda", requires_grad=True)
    wa = torch.randn(1, device="cuda", requires_grad=True)
    ba = torch.randn(1, device="cuda", requires_grad=True)
    out = tilefuse.layer_norm(a, (1,), wa, ba)
    print("layer_norm N=1 grads (all but db must be exactly 0):",
          [g.flatten().tolist() for g in torch.autograd.grad(out, (a, wa, ba), torch.randn_like(out))])


def profile(name, fn, steps=5):
    """The CUDA kernels one call launches, with their device time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    print(f"--- {name}: per-call averages over {steps} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
y = tilefuse.rms_norm(x, None, w)
row("rms 16384x4096 tilefuse bwd (autograd.grad)", lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True))
yt = torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)
row("rms 16384x4096 torch bwd (autograd.grad)", lambda: torch.autograd.grad(yt, (x, w), dy, retain_graph=True))
profile("tilefuse rms_norm bwd", lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True))
xs = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
ys = tilefuse.softmax(xs)
dys = torch.randn_like(ys)
row("softmax 8192x4096 tilefuse bwd (autograd.grad)", lambda: torch.autograd.grad(ys, (xs,), dys, retain_graph=True))
profile("tilefuse softmax bwd", lambda: torch.autograd.grad(ys, (xs,), dys, retain_graph=True))
