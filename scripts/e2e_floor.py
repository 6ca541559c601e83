"""What end-to-end timing can show for a memory-bound op of a given size (GPU machine, PYTHONPATH=src).

    python scripts/e2e_floor.py [--bwd [--ab 'two launches' 'via FastOp']] [--rounds 3]

``tilefuse bench`` reports % of the copy ceiling, measured on a 1 GiB ``copy_`` where the fixed
cost of one timed call is negligible. At 8192×4096 bf16 softmax (134 MB moved) it is not.

Forward rows (default): per shape, end to end (``triton.testing.do_bench``: L2 flushed, CUDA
events around one call) and as CUDA-graph replays (back to back, the bench's graph column): an
empty Triton kernel, ``copy_`` of the same bytes (half read, half written), a Triton copy launched
as tilefuse launches its kernels, and the op itself, each as µs and % of the 1 GiB copy ceiling.

``--bwd``: the bench's backward timer (``torch.autograd.grad(outs, leaves, grad_outputs,
retain_graph=True)`` under do_bench) against the floor it allows on this machine's host, for the
#2 backward shapes. Every row moves the same bytes: two [rows, cols] bf16 tensors read, one
written (softmax: y, dy -> dx; the norms: x, dy -> dx; their dw / db partials are under 1 %):
* ``native mul``: ``x * c`` with only x requiring grad, so the backward is torch's C++ autograd
  node and one native kernel (dx = dy · c);
* ``Python Function``: the same product from a Python ``autograd.Function`` whose backward makes
  one ``fast_launch`` Triton launch, the cheapest host path a Python-launched backward has;
* the op itself (tilefuse) and its torch / Liger peers.
Each row also gives the host time per call (a loop synchronized once: max(host, GPU) per call).
When that exceeds the flush plus the kernel, the host sets the end-to-end figure, whoever's
kernel it is. ``--rounds`` repeats the rows interleaved.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import triton
import triton.language as tl

import tilefuse
from tilefuse import registry
from tilefuse._launch import fast_launch
from tilefuse.bench import host_us
from tilefuse.ops import _norm_launch as norm_launch
from tilefuse.ops import activations
from tilefuse.ops import norms
from tilefuse.ops import softmax as softmax_ops
from tilefuse.bench.ceilings import graph_time_ms, measure_copy_gbps, time_ms
from tilefuse.testing import grad_leaves, make_grad_outputs


@triton.jit
def empty_kernel(x_ptr):
    pass


@fast_launch
@triton.jit
def mul_kernel(a_ptr, b_ptr, out_ptr, n, COPY: tl.constexpr, BLOCK: tl.constexpr):
    """out = a · b (a copy of a when COPY): the floor kernel, 64-bit offsets."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    if not COPY:
        a = a * tl.load(b_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a, mask=mask)


def triton_mul(a, b, out, block: int = 4096):
    n = a.numel()
    mul_kernel[(triton.cdiv(n, block),)](a, b, out, n, COPY=a is b, BLOCK=block, num_warps=8)
    return out


class _PythonMul(torch.autograd.Function):
    """y = x · c, c a constant: the backward is one Triton launch, dx = dy · c."""

    @staticmethod
    def forward(ctx, x, c):
        ctx.save_for_backward(c)
        return triton_mul(x, c, torch.empty_like(x))

    @staticmethod
    def backward(ctx, dy):
        (c,) = ctx.saved_tensors
        return triton_mul(dy, c, torch.empty_like(dy)), None


def row(name: str, fn, nbytes: int, gbps: float, setup=None, host: bool = False) -> None:
    e2e, graph = time_ms(fn) * 1e3, graph_time_ms(fn, setup=setup) * 1e3
    floor = nbytes / gbps / 1e3 if nbytes else 0.0      # µs at the ceiling
    pct = (lambda us: f"{100 * floor / us:5.1f} %") if nbytes else (lambda us: "    -  ")
    extra = f"   host {host_us(fn):7.1f} us/call" if host else ""
    print(f"{name:44s} e2e {e2e:7.1f} us {pct(e2e)}   graph {graph:7.1f} us {pct(graph)}{extra}", flush=True)


def forward_rows(gbps: float) -> None:
    x = torch.empty(1, device="cuda")
    row("empty Triton kernel", lambda: empty_kernel[(1,)](x), 0, gbps)
    for rows, cols in ((8192, 1024), (8192, 4096), (4096, 32768), (16384, 4096)):
        a = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        b = torch.empty_like(a)
        nbytes = 2 * a.numel() * a.element_size()
        row(f"copy_ {rows}x{cols} bf16", lambda: b.copy_(a), nbytes, gbps)
        row(f"Triton copy {rows}x{cols} bf16", lambda: triton_mul(a, a, b), nbytes, gbps)
        row(f"tilefuse.softmax {rows}x{cols} bf16", lambda: tilefuse.softmax(a, -1), nbytes, gbps)


def _bwd_closure(fn, args, kwargs, leaves):
    """(backward, setup) as the bench times a backward: ``setup`` runs the forward once (again on
    a CUDA graph's capture stream), then each call is ``autograd.grad`` on it with retain_graph."""
    state: dict = {}

    def setup():
        state.clear()    # the old graph first: its leaves' AccumulateGrad would keep the old stream
        outs = [o for o in registry.as_tuple(fn(*args, **kwargs)) if isinstance(o, torch.Tensor) and o.requires_grad]
        state["outs"], state["gouts"] = outs, make_grad_outputs(outs)

    setup()
    return (lambda: torch.autograd.grad(state["outs"], leaves, state["gouts"], retain_graph=True,
                                        allow_unused=True)), setup


@contextlib.contextmanager
def _variant(name: str):
    """The code before one of s40's / s41's changes, for an A/B in one process: "via FastOp"
    (backward ops called through FastOp, not ``direct_backward``), "two launches" (the norm
    backward's dw / db and, since s41, bias_act's db summed by a second kernel, not behind the
    in-kernel grid barrier),
    "planned launch" (every norm backward through its plan, never a bound launch: s41)."""
    mods = [norms, softmax_ops]
    saved = ([m.direct_backward for m in mods], norm_launch._COOPERATIVE_OK[0], norm_launch._bwd_call_key,
             activations.cooperative_launch)
    if name.endswith("planned launch"):
        norm_launch._bwd_call_key = lambda *args: None
    if name.endswith("via FastOp"):
        for m in mods:
            m.direct_backward = lambda ctx, *grads: False
    if name.endswith("two launches"):
        norm_launch._COOPERATIVE_OK[0] = False
        activations.cooperative_launch = lambda *args: None
    try:
        yield
    finally:
        for m, f in zip(mods, saved[0]):
            m.direct_backward = f
        norm_launch._COOPERATIVE_OK[0] = saved[1]
        norm_launch._bwd_call_key = saved[2]
        activations.cooperative_launch = saved[3]


def backward_rows(gbps: float, ab: tuple = ()) -> None:
    cases = (("softmax", (8192, 4096)), ("rms_norm", (16384, 4096)), ("layer_norm", (16384, 4096)),
             ("bias_act", (16384, 4096)))
    for op, shape in cases:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        c = torch.randn_like(x).detach()
        nbytes = 3 * x.numel() * x.element_size()
        for name, fn in (("native mul", lambda a, b: a * b), ("Python Function", _PythonMul.apply)):
            grad, setup = _bwd_closure(fn, (x, c), {}, [x])
            row(f"{name} bwd {shape[0]}x{shape[1]}", grad, nbytes, gbps, setup=setup, host=True)
        spec = registry.get(op)
        inputs = spec.make_inputs(shape, torch.bfloat16, "cuda")
        op_bytes = int(spec.bytes_fn(shape, torch.bfloat16, "bwd"))
        impls = [("tilefuse", spec.fn)] + [(k, f()) for k, f in spec.peers.items() if k in ("torch", "liger")]
        for variant in ab:
            impls.insert(1, (f"tilefuse {variant}", spec.fn))
        for name, fn in impls:
            inp = inputs if name == "tilefuse" else inputs.cloned()
            grad, setup = _bwd_closure(fn, inp.args, inp.kwargs, grad_leaves(inp))
            with _variant(name):
                row(f"{op} {name} bwd {shape[0]}x{shape[1]}", grad, op_bytes, gbps, setup=setup, host=True)
        del x, c, inputs
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bwd", action="store_true", help="the backward timer against its host floor")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ab", nargs="*", default=[], choices=["via FastOp", "two launches", "planned launch"],
                    help="--bwd: also tilefuse as before one of s40's / s41's changes")
    a = ap.parse_args()
    gbps = measure_copy_gbps()["copy_gbps"]
    print(f"{torch.cuda.get_device_name()}: 1 GiB copy ceiling {gbps:,.0f} GB/s, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    for r in range(a.rounds):
        print(f"-- round {r + 1}", flush=True)
        backward_rows(gbps, tuple(a.ab)) if a.bwd else forward_rows(gbps)


if __name__ == "__main__":
    main()
