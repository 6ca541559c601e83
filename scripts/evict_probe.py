"""L2 eviction hints on the streaming kernels, timed four ways (GPU machine, PYTHONPATH=src).

    python scripts/evict_probe.py [--only softmax,decode,floor]

Question (s39): ``tilefuse bench`` times with ``triton.testing.do_bench``, whose ``zero_`` flush
leaves ~50 MB of dirty lines in L2; a kernel that allocates its own lines with the default policy
evicts them and pays their write-back inside the timed call (s34, ``scripts/timing_probe.py``:
3.7 µs of the softmax 8192×4096 forward's 38, ~10 µs of decode's 49 at B = 1, L = 32k). A kernel
that streams (every byte used once) can load and store with ``evict_first``: its own lines are
then the first victims, the lines already in L2 stay, and nothing the kernel did not write is
written back during it. Prediction: the zero-flush column moves to the read-flush column
(softmax fwd ~38 -> ~34 µs, decode B=1 32k ~49 -> ~40 µs); the graph column does not move.

Each variant is validated against the default launch (bitwise: the hints change no arithmetic)
before it is timed. Columns as ``timing_probe.py``: zero flush (the bench's timer), read flush,
back-to-back stream over input copies, CUDA graph; µs and % of this run's 1 GiB copy ceiling.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

from timing_probe import copies_for, methods, print_row
from tilefuse.bench.ceilings import measure_copy_gbps
from tilefuse.ops import attention_decode as dec
from tilefuse.ops import softmax as sm

HINTS = ["", "evict_first", "evict_last"]


def softmax_cases(shape, dtype, loads=HINTS, stores=("", "evict_first")):
    """(label, bytes, [fn per input copy]) for each forward / backward hint pair, each checked
    bitwise against the unhinted launch first."""
    nbytes = math.prod(shape) * dtype.itemsize
    copies = copies_for(3 * nbytes)
    xs = [torch.randn(shape, device="cuda").mul_(4).to(dtype) for _ in range(copies)]
    dys = [torch.randn(shape, device="cuda").to(dtype) for _ in range(copies)]
    ys = [sm._launch_fwd(x, False) for x in xs]
    for load in loads:
        for store in stores:
            cfg = {"LOAD_EVICT": load, "STORE_EVICT": store}
            tag = f"load {load or 'default'}, store {store or 'default'}"
            ref = sm._launch_fwd(xs[0], False, {"LOAD_EVICT": "", "STORE_EVICT": ""})
            assert torch.equal(sm._launch_fwd(xs[0], False, cfg), ref), tag
            yield ("fwd " + tag, 2 * nbytes, [lambda x=x, c=cfg: sm._launch_fwd(x, False, c) for x in xs])
            ref = sm._launch_bwd(ys[0], dys[0], False, {"LOAD_EVICT": "", "STORE_EVICT": ""})
            assert torch.equal(sm._launch_bwd(ys[0], dys[0], False, cfg), ref), tag
            yield ("bwd " + tag, 3 * nbytes,
                   [lambda y=y, dy=dy, c=cfg: sm._launch_bwd(y, dy, False, c) for y, dy in zip(ys, dys)])


def decode_cases(batch, length, dtype, h_q=32, h_kv=8, d=128):
    nbytes = 2 * batch * length * h_kv * d * dtype.itemsize + 2 * batch * h_q * d * dtype.itemsize
    copies = copies_for(nbytes)
    sets = []
    for _ in range(copies):
        q = torch.randn(batch, 1, h_q, d, device="cuda").to(dtype)
        k = torch.randn(batch, length, h_kv, d, device="cuda").to(dtype)
        v = torch.randn(batch, length, h_kv, d, device="cuda").to(dtype)
        sets.append((q, k, v, torch.full((batch,), length, dtype=torch.int32, device="cuda")))
    scale = d ** -0.5

    def call(s, cfg):
        return dec._launch_decode(*s, None, 0, -1, 0, 0.0, scale, 0, cfg)[0]

    ref = call(sets[0], None)
    for hint in ("", "evict_first", "evict_last"):
        cfg = {"KV_EVICT": hint}
        assert torch.equal(call(sets[0], cfg), ref), hint
        yield (f"decode B={batch} L={length} kv {hint or 'default'}", nbytes,
               [lambda s=s, c=cfg: call(s, c) for s in sets])


@triton.jit
def read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Reads ITERS·BLOCK elements per program once (a sum, so the loads cannot be dropped)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def floor_cases(length, dtype, h_kv=8, d=128):
    """What decode B=1 at ``length`` keys could reach under each timer: a bare read of the same
    K/V bytes (the best of a few tiles), the copy of the same byte count, and the public
    ``attention_decode`` (its eager fast path, as the bench calls it)."""
    n = 2 * length * h_kv * d
    nbytes = n * dtype.itemsize
    bufs = [torch.randn(n, device="cuda").to(dtype) for _ in range(copies_for(nbytes))]
    for block, iters, warps in ((4096, 8, 8), (8192, 8, 16), (2048, 32, 4)):
        grid = (triton.cdiv(n, block * iters),)
        outs = [torch.empty(grid[0], device="cuda") for _ in bufs]
        fns = [lambda b=b, o=o: read_kernel[grid](b, o, n, BLOCK=block, ITERS=iters, num_warps=warps)
               for b, o in zip(bufs, outs)]
        fns[0]()
        torch.testing.assert_close(outs[0].sum(), bufs[0].float().sum(), rtol=1e-3, atol=1.0)
        yield (f"read {nbytes / 1e6:.0f} MB: {block}x{iters}, {warps} warps", nbytes, fns)
    half = [torch.empty(n // 2, device="cuda", dtype=dtype) for _ in bufs]
    yield (f"copy_ {nbytes / 2e6:.0f} MB -> {nbytes / 2e6:.0f} MB", nbytes,
           [lambda b=b, h=h: h.copy_(b[: n // 2]) for b, h in zip(bufs, half)])
    del bufs
    from tilefuse.registry import get
    spec = get("attention_decode")
    shape = (1, 1, 32, h_kv, length, d)
    inputs = [spec.make_inputs(shape, dtype, "cuda") for _ in range(copies_for(nbytes))]
    yield (f"attention_decode B=1 L={length} (public)", spec.bytes_fn(shape, dtype, "fwd"),
           [lambda i=i: spec.fn(*i.args, **i.kwargs) for i in inputs])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="softmax,decode,floor")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--loads", default=",".join(HINTS), help="softmax load hints, comma-separated ('' = none)")
    ap.add_argument("--stores", default=",evict_first", help="softmax store hints, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the softmax variants, interleaved")
    a = ap.parse_args()
    gbps = measure_copy_gbps()["copy_gbps"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy ceiling {gbps:,.0f} GB/s")
    print(f"{'case':44s} " + "  ".join(f"{m:>16s}" for m in ("zero flush", "read flush", "stream", "graph")))
    groups = []
    if "softmax" in a.only:
        for r in range(a.rounds):
            groups.append((f"softmax 8192x4096 bf16, round {r + 1}",
                           softmax_cases((8192, 4096), torch.bfloat16, a.loads.split(","), a.stores.split(","))))
    if "decode" in a.only:
        for batch, length in ((1, 32768), (16, 8192), (1, 131072)):
            groups.append((f"decode B={batch} L={length}", decode_cases(batch, length, torch.bfloat16)))
    if "floor" in a.only:
        groups.append(("floors for decode B=1 L=32768", floor_cases(32768, torch.bfloat16)))
    for title, cases in groups:
        print(f"-- {title}", flush=True)
        for label, nbytes, fns in cases:
            with torch.no_grad():
                print_row(label, nbytes, methods(fns, a.calls), gbps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
