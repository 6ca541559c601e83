"""What is alive at the memory peak of one op's fwd+bwd? (GPU; PYTHONPATH=src)

    python scripts/memory_peak.py linear_cross_entropy 8192,4096,128256 bf16

Runs the op the way ``tilefuse bench`` does for its "peak MiB (fwd+bwd)" column (inputs built
first, then forward + torch.autograd.grad with random grad_outputs), with torch's allocator
history on; replays the alloc/free trace to the peak and lists the blocks alive there that the
step allocated, largest first, each with the innermost Python frames that allocated it.
"""

import sys

import torch

from tilefuse import registry
from tilefuse.bench.runner import parse_dtype
from tilefuse.testing import grad_leaves, make_grad_outputs
from tilefuse.registry import as_tuple


def live_at_peak(trace):
    live, cur, peak, peak_live = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, peak_live = cur, dict(live)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            if e["action"] == "free_requested":
                cur -= live.pop(e["addr"])["size"]
    return peak, peak_live


def where(e, depth=3):
    frames = [f for f in e.get("frames", []) if f["filename"].endswith(".py")]
    return " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:depth])


def main(name, shape, dtype):
    spec = registry.get(name)
    inp = spec.make_inputs(shape, dtype, "cuda")
    leaves = grad_leaves(inp)
    outs = as_tuple(spec.fn(*inp.args, **inp.kwargs))        # warm-up (compiles), then the measured step
    gouts = make_grad_outputs(outs, seed=0)
    idx = [i for i, o in enumerate(outs) if gouts[i] is not None and o.requires_grad]
    torch.autograd.grad([outs[i] for i in idx], leaves, [gouts[i] for i in idx])
    del outs
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    outs = as_tuple(spec.fn(*inp.args, **inp.kwargs))
    grads = torch.autograd.grad([outs[i] for i in idx], leaves, [gouts[i] for i in idx])
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    extra = torch.cuda.max_memory_allocated() - before
    trace = [e for dev in snap["device_traces"] for e in dev]
    peak, live = live_at_peak(trace)
    print(f"{name} {shape} {dtype}: peak extra {extra / 2**20:.1f} MiB (trace replay: {peak / 2**20:.1f} MiB)")
    for e in sorted(live.values(), key=lambda e: -e["size"])[:12]:
        print(f"  {e['size'] / 2**20:9.1f} MiB  {where(e)}")
    del grads, outs


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(s) for s in sys.argv[2].split(",")), parse_dtype(sys.argv[3]))
