"""Where does an op's end-to-end backward time go? (GPU machine, PYTHONPATH=src)

    python scripts/bwd_profile.py OP B,S,... [--impl tilefuse|torch|liger|...] [--iters 20]

The benchmark's ``bwd`` row times ``torch.autograd.grad(outs, leaves, grads, retain_graph=True)``
with ``triton.testing.do_bench`` (L2 flushed before every call). When that time is far above the
kernels' own (the ``fwd+bwd`` CUDA-graph column), this script says why, for one registered op and
shape, with the same closure:

* ``do_bench`` median, and the host time per call (Python loop, one sync at the end);
* the same loop under ``torch.cuda.set_sync_debug_mode("warn")``: any host-device sync warns;
* ``torch.profiler`` over ``--iters`` calls with the flush between them, as do_bench runs them:
  every CUDA kernel and memcpy/memset with its count and total device time, and the host ops
  with the largest self time.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from tilefuse import registry
from tilefuse.bench import host_us
from tilefuse.testing import grad_leaves, make_grad_outputs


def _impl(spec, name: str):
    if name == "tilefuse":
        return spec.fn
    factory = spec.peers.get(name)
    fn = factory() if factory else None
    if fn is None:
        raise SystemExit(f"{spec.name}: no peer {name!r} here (have {sorted(spec.peers)})")
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("shape", help="comma-separated, e.g. 4,4096,32,32,128")
    ap.add_argument("--impl", default="tilefuse")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    spec = next(s for s in registry.all_ops() if s.name == a.op)
    shape = tuple(int(x) for x in a.shape.split(","))
    inputs = spec.make_inputs(shape, getattr(torch, a.dtype), "cuda")
    fn = _impl(spec, a.impl)
    leaves = grad_leaves(inputs)
    outs = [o for o in registry.as_tuple(fn(*inputs.args, **inputs.kwargs))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = make_grad_outputs(outs)

    def bwd():
        return torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)

    bwd()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(bwd, warmup=25, rep=100, return_mode="median")
    print(f"{a.op} {a.shape} {a.dtype} {a.impl}: bwd do_bench {ms * 1e3:.1f} us, host {host_us(bwd, 50):.1f} us/call")

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            bwd()
    torch.cuda.set_sync_debug_mode(0)
    syncs = {str(w.message).splitlines()[0][:160] for w in caught}
    print(f"host-device syncs in 3 calls: {len(caught)}" + "".join(f"\n  {s}" for s in syncs))

    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.iters):
            flush.zero_()
            bwd()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
