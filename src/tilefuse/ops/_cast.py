"""The dtype casts autocast puts around the GEMM family (see ``tilefuse._autocast``).

Forward, fp32 parameters go to bf16 / fp16 with torch's ``.to`` (4.07-4.38 TB/s on the H200 for
4096x4096 .. 128256x4096 weights, at the copy ceiling). Backward, the 16-bit gradient goes back to
the parameter's fp32, and there torch's dtype-converting copy moves 2 + 4 bytes per element at
only 1.9-2.1 TB/s (its dynamic-casting kernel); one Triton pass does it at 3.3-3.9 TB/s
(`results/nvidia-h200-2026-11-25-s38-cast-probe.log`). In a bf16-autocast training step of two
Llama-8B-sized blocks, tilefuse's 8 casts took 2.27 ms of GPU time that way and take 1.07 ms
with this kernel (`scripts/autocast_step.py --profile`).

Bytes: n·(2 + 4) per upcast (read 16-bit, write fp32); no FLOPs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import cdiv, use_triton
from .._launch import fast_launch

CAST_BLOCK = 4096        # elements per program: 16 KiB of fp32 written, 8 warps


@fast_launch
@triton.jit
def upcast_kernel(
    x_ptr,              # *fp16 / *bf16 [n], contiguous
    y_ptr,              # *fp32 [n], contiguous
    n,                  # elements
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)     # int64: n may pass 2**31
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float32), mask=mask)


def _one_block(t: torch.Tensor) -> bool:
    """t's elements fill one block of memory (contiguous, or a transposed 2-D view of a
    contiguous tensor: a weight's ``.t()``), which ``empty_like`` reproduces with the same strides."""
    return t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous())


def upcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, through :func:`upcast_kernel` for a 16-bit tensor in one block of memory
    going to fp32 on the Triton path (exact: every fp16 / bf16 value is an fp32 value)."""
    if (dtype != torch.float32 or t.dtype not in (torch.float16, torch.bfloat16) or not t.numel()
            or not use_triton(t) or not _one_block(t) or t.is_neg()):     # (a negative view: .to resolves it)
        return t.to(dtype)
    y = torch.empty_like(t, dtype=torch.float32)       # t's strides: the same order in memory
    n = t.numel()
    upcast_kernel[(cdiv(n, CAST_BLOCK),)](t, y, n, BLOCK=CAST_BLOCK, num_warps=8)
    return y


class AutocastCast(torch.autograd.Function):
    """``x.to(dtype)`` whose backward casts the gradient back with :func:`upcast`."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.src_dtype = x.dtype
        return x.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return upcast(grad, ctx.src_dtype), None
