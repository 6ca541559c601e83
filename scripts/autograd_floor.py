"""The host-time floor of a Python autograd.Function on this machine (GPU, PYTHONPATH=src).

    python scripts/autograd_floor.py [--profile]

On CUDA tensors the autograd engine runs every backward node on its device thread, so a Python
``backward`` pays a thread hand-off plus the GIL on top of its own code; torch's native ops pay
the hand-off only. Rows (µs per call, a loop of 300 synchronized once, small tensors): native
ops, empty Python Functions (one ``empty_like`` each way; one with four outputs, as the norms'
forward has), tilefuse's rms_norm / softmax, and the backward alone on a retained graph: empty,
one Triton launch, and tilefuse's norm backward launcher inside a Python backward. The
backward-only rows are repeated with ``torch.autograd.set_multithreading_enabled(False)`` (the
backward on the calling thread: no hand-off).
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch
import triton
import triton.language as tl

import tilefuse
from tilefuse._launch import fast_launch
from tilefuse.bench import host_us
from tilefuse.ops import _norm_launch as nl


@fast_launch
@triton.jit
def _fill_kernel(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 0.0, mask=offs < n)


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.empty_like(dy)


class _Empty4(torch.autograd.Function):
    """Four outputs and saved tensors, no materialized grads: the norm forward's autograd shape."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.set_materialize_grads(False)
        y, h, mean, rstd = torch.empty_like(x), x.new_empty(0), x.new_empty(0), x.new_empty(x.shape[0])
        ctx.save_for_backward(x, w, mean, rstd)
        return y, h, mean, rstd

    @staticmethod
    def backward(ctx, dy, dh, dmean, drstd):
        x, w, _, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


class _OneLaunch(_Empty):
    """_Empty whose backward launches one Triton kernel."""

    @staticmethod
    def backward(ctx, dy):
        dx = torch.empty_like(dy)
        _fill_kernel[(triton.cdiv(dx.numel(), 1024),)](dx, dx.numel(), BLOCK=1024)
        return dx


class _NormBwd(torch.autograd.Function):
    """Backward = tilefuse's rms_norm backward launcher (dx, dw), nothing else."""

    @staticmethod
    def forward(ctx, x, w, rstd):
        ctx.save_for_backward(x, w, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw, _ = nl._launch_bwd(dy, x, w, None, rstd, None, 0.0, True, True, False)
        return dx, dw, None


def main(profile: bool = False) -> None:
    x = torch.randn(8, 4096, device="cuda", requires_grad=True)
    w = torch.randn(4096, device="cuda", requires_grad=True)
    dy = torch.randn(8, 4096, device="cuda")
    rstd = torch.rand(8, device="cuda") + 0.5
    b = torch.randn(4096, device="cuda", requires_grad=True)
    retained = {
        "empty Function": _Empty.apply(x),
        "empty Function, 4 outputs": _Empty4.apply(x, w)[0],
        "Function, one Triton launch": _OneLaunch.apply(x),
        "Function, norm bwd launcher": _NormBwd.apply(x, w, rstd),
        "native rms_norm": torch.nn.functional.rms_norm(x, (4096,), w),
        "tilefuse rms_norm": tilefuse.rms_norm(x, None, w),
        "tilefuse layer_norm": tilefuse.layer_norm(x, None, w, b),
        "tilefuse softmax": tilefuse.softmax(x),
    }
    rows = {
        "native x*2 fwd+bwd": lambda: torch.autograd.grad(x * 2, (x,), dy),
        "native rms_norm fwd+bwd": lambda: torch.autograd.grad(torch.nn.functional.rms_norm(x, (4096,), w), (x, w), dy),
        "empty Python Function fwd": lambda: _Empty.apply(x),
        "empty Python Function fwd+bwd": lambda: torch.autograd.grad(_Empty.apply(x), (x,), dy),
        "tilefuse softmax fwd+bwd": lambda: torch.autograd.grad(tilefuse.softmax(x), (x,), dy),
        "tilefuse rms_norm fwd (grad)": lambda: tilefuse.rms_norm(x, None, w),
        "tilefuse rms_norm fwd+bwd": lambda: torch.autograd.grad(tilefuse.rms_norm(x, None, w), (x, w), dy),
        "norm bwd launcher, main thread": lambda: nl._launch_bwd(dy, x, w, None, rstd, None, 0.0, True, True, False),
        "norm bwd launcher, planned (s40), main thread":
            lambda: nl._launch_bwd(dy, x, w, None, rstd, None, 0.0, True, True, False, config={}),
        "empty_like + one Triton launch, main thread":
            lambda: _fill_kernel[(8,)](torch.empty_like(x), x.numel(), BLOCK=4096),
        "torch.empty_like": lambda: torch.empty_like(x),
    }
    for name, y in retained.items():
        leaves = ((x, w, b) if "layer_norm" in name else
                  (x, w) if "rms_norm" in name or "4 outputs" in name or "norm bwd" in name else (x,))
        rows[f"bwd only: {name}"] = (lambda y=y, leaves=leaves:
                                     torch.autograd.grad(y, leaves, dy, retain_graph=True))
    print(f"{torch.cuda.get_device_name()}: host µs per call")
    for name, fn in rows.items():
        print(f"{name:48s} {min(host_us(fn) for _ in range(3)):8.1f}", flush=True)
    with torch.autograd.set_multithreading_enabled(False):
        for name, fn in rows.items():
            if name.startswith("bwd only") or "fwd+bwd" in name:
                print(f"{name + ' (calling thread)':48s} {min(host_us(fn) for _ in range(3)):8.1f}", flush=True)
        if profile:     # where the backward's host time goes: on the calling thread cProfile sees it
            for name in ("bwd only: tilefuse layer_norm", "bwd only: Function, one Triton launch"):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(2000):
                    rows[name]()
                pr.disable()
                torch.cuda.synchronize()
                print(f"\n== cProfile, {name} (calling thread), 2000 calls")
                pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(profile="--profile" in sys.argv)
