"""Elementwise activations shared by bias_act and the gated units (swiglu / geglu).

Each activation is written once, as a value and its derivative from shared subexpressions,
all in fp32 registers:

    relu(z)      = max(z, 0)                               relu'(z)      = [z > 0]
    gelu(z)      = z·Φ(z),  Φ(z) = erfc(−z/√2) / 2         gelu'(z)      = Φ(z) + z·φ(z),  φ(z) = exp(-z²/2)/√(2π)
    gelu_tanh(z) = z·σ(2u), u = √(2/π)·(z + 0.044715·z³)   gelu_tanh'(z) = σ(2u) + z·σ(2u)(1 − σ(2u))·2u'
    silu(z)      = z·σ(z)                                  silu'(z)      = σ(z)·(1 + z(1 − σ(z)))

Both gelus keep their relative accuracy in the lower tail, where the textbook forms cancel:
``gelu`` evaluates Φ through erfc (``_erfc_fit``), and ``gelu_tanh`` uses
(1 + tanh(u))/2 = σ(2u), the same function as PyTorch's ``gelu(approximate="tanh")`` with one
exp instead of a tanh.

Exps and reciprocals are single MUFU instructions (``tl.exp2``, ``_common.rcp_approx``): at
2 bytes in and 2 out per element a bf16 elementwise kernel on an H200 has ~32 issued
instructions per element before it stops being memory-bound, and Triton 3.6's ``tl.exp`` (a
range test and two scalings around MUFU.EX2) and fp32 division (``div.full``: the same around
MUFU.RCP) cost 5-7 each (``scripts/sass_count.py``; numbers in ``benchmarks/NOTES.md``).

Also here: the 2-D elementwise tile heuristic both op files launch with, and its override.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._dispatch import next_power_of_2
from ._common import rcp_approx, sigmoid_approx

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")

SQRT1_2 = tl.constexpr(0.7071067811865476)          # 1/√2
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)     # 1/√(2π)
TWO_SQRT_2_OVER_PI = tl.constexpr(1.5957691216057308)   # 2·√(2/π): σ(2u) takes 2u directly
GELU_TANH_CUBIC = tl.constexpr(0.044715)
HALF_LOG2E = tl.constexpr(0.7213475204444817)       # log2(e)/2: exp(−z²/2) = 2^(−z²·HALF_LOG2E)
LOG2_INV_SQRT_2PI = tl.constexpr(-1.3257480647361593)   # log2(1/√(2π))


@triton.jit
def _erfc_fit(a, PRECISE: tl.constexpr):
    """(t, q) with Φ(−a) = erfc(a/√2)/2 = t·2^(q − a²·log2(e)/2) for a >= 0, t = 1/(1 + p·a/√2).

    PRECISE (fp32 outputs): Numerical Recipes' erfcc fit, erfc(x) = t·exp(−x² + P(t)) with
    p = 1/2 and P of degree 9, relative error < 1.2e-7 for all x >= 0. It keeps Φ's relative
    accuracy in the lower tail, where (1 + erf(z/√2))/2 cancels in fp32 (1e-3 relative error at
    z = −4, exactly 0 below −5.5). q = P(t)·log2(e) − 1 (the ½) is evaluated directly: the
    coefficients below are NR's (0.17087277, −0.82215223, 1.48851587, −1.13520398, 0.27886807,
    −0.18628806, 0.09678418, 0.37409196, 1.00002368, −1.26551223) times log2(e), minus 1 on the
    constant term, so the exp is a bare exp2 and no multiply is spent on the scaling. 11 FMAs
    and one MUFU.RCP.

    Otherwise (fp16 / bf16 outputs, half an ulp = 2.4e-4 / 2e-3): the same form with p = 0.54 and
    q of degree 5, fitted minimax to log2(erfcx(x) / 2t) on t in (0, 1] (Lawson's iteration,
    torch.special.erfcx in fp64): relative error of Φ(−a) 2.4e-5 from the fit, 3.7e-5 evaluated in
    fp32 up to a = 14; uniform down the tail as the precise fit is. 4 FMAs fewer per value: the
    bias + GELU forward went 25.2 -> 21.2 sm_90 SASS per element and 247.5 -> 225.8 µs at
    16384x14336 bf16 on an H200 (graph replay; benchmarks/NOTES.md, session 10)."""
    if PRECISE:
        t = rcp_approx(1.0 + (0.5 * SQRT1_2) * a)
        q = 0.246517298
        q = -1.18611495 + t * q
        q = 2.14747446 + t * q
        q = -1.63775315 + t * q
        q = 0.402321582 + t * q
        q = -0.26875686 + t * q
        q = 0.139630057 + t * q
        q = 0.539700616 + t * q
        q = 1.4427292 + t * q
        q = -2.82574822 + t * q
    else:
        t = rcp_approx(1.0 + 0.381837662 * a)
        q = 0.308431875
        q = -0.834040234 + t * q
        q = 0.33342924 + t * q
        q = 0.460939282 + t * q
        q = 1.44599845 + t * q
        q = -2.71475196 + t * q
    return t, q


@triton.jit
def _gelu_erf(z, PRECISE: tl.constexpr):
    """z·Φ(z) with one exp2: z·(1 − h) above 0 and z·h below, h = Φ(−|z|), written as
    max(z, 0) − |z|·h (two instructions for the select). PRECISE: relative error ~2e-7 for
    |z| < 3 and ~1e-6 at |z| = 10 (the rounding of z² inside the exponent); the bias + GELU
    forward body is ~26 SASS instructions per element (was 54 with Triton's exp and division)."""
    a = tl.abs(z)
    t, q = _erfc_fit(a, PRECISE)
    h = t * tl.exp2(q - HALF_LOG2E * (z * z))
    return tl.maximum(z, 0.0) - a * h


@triton.jit
def _gelu_erf_fwd_bwd(z, PRECISE: tl.constexpr):
    """(z·Φ(z), Φ(z) + z·φ(z)), φ(z) = exp(−z²/2)/√(2π): the backward's GELU' (two exp2, one
    reciprocal). Each exp2 takes its constant inside its FMA, h = t·2^(q − z²·log2(e)/2) as in
    the forward and φ = 2^(log2(1/√(2π)) − z²·log2(e)/2): one instruction per value fewer than
    exp(−z²/2) shared and scaled twice."""
    a = tl.abs(z)
    t, q = _erfc_fit(a, PRECISE)
    z2 = z * z
    h = t * tl.exp2(q - HALF_LOG2E * z2)
    phi = tl.exp2(LOG2_INV_SQRT_2PI - HALF_LOG2E * z2)
    cdf = tl.where(z < 0.0, h, 1.0 - h)
    return tl.maximum(z, 0.0) - a * h, cdf + z * phi


@triton.jit
def _gelu_tanh_sigmoid(z):
    """σ(2u) and d(2u)/dz of the tanh approximation."""
    z2 = z * z
    two_u = TWO_SQRT_2_OVER_PI * z * (1.0 + GELU_TANH_CUBIC * z2)
    d_two_u = TWO_SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * z2)
    return sigmoid_approx(two_u), d_two_u


@triton.jit
def activation_fwd(z, ACT: tl.constexpr, PRECISE: tl.constexpr):
    """act(z) for an fp32 tile; ACT is one of ACTIVATIONS. PRECISE: the result is stored in fp32
    (else fp16 / bf16, whose rounding allows a shorter erf fit: ``_erfc_fit``)."""
    if ACT == "relu":       # NaN stays NaN, as torch.relu (the default maximum is maxnum on the GPU: 0)
        return tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACT == "gelu":
        return _gelu_erf(z, PRECISE)
    elif ACT == "gelu_tanh":
        s, _ = _gelu_tanh_sigmoid(z)
        return z * s
    elif ACT == "silu":
        return z * sigmoid_approx(z)
    else:
        return z


@triton.jit
def activation_fwd_bwd(z, ACT: tl.constexpr, PRECISE: tl.constexpr):
    """(act(z), act'(z)) for an fp32 tile, sharing the sigmoid / erf between the two; a caller
    that uses only one gets the other removed by the compiler. PRECISE as activation_fwd."""
    if ACT == "relu":
        return tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL), tl.where(z > 0.0, 1.0, 0.0)
    elif ACT == "gelu":
        return _gelu_erf_fwd_bwd(z, PRECISE)
    elif ACT == "gelu_tanh":
        s, d_two_u = _gelu_tanh_sigmoid(z)
        return z * s, s + z * (s * (1.0 - s)) * d_two_u
    elif ACT == "silu":
        s = sigmoid_approx(z)
        return z * s, s * (1.0 + z * (1.0 - s))
    else:
        return z, tl.full(z.shape, 1.0, tl.float32)


def _two_u(z: torch.Tensor) -> torch.Tensor:
    return TWO_SQRT_2_OVER_PI.value * z * (1.0 + GELU_TANH_CUBIC.value * z * z)


def activation_reference(z: torch.Tensor, activation: str) -> torch.Tensor:
    """PyTorch act(z), differentiable, in z's dtype (callers pass fp32 or fp64).

    The gelus are F.gelu's functions in their cancellation-free forms, z·erfc(−z/√2)/2 and
    z·σ(2u): F.gelu's own (1 + erf) and (1 + tanh) lose all digits of the lower tail even in
    fp64 (gelu(−9) = −1e−18 comes out 0), so they would be the less exact side of a test.
    """
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return 0.5 * z * torch.special.erfc(-z * SQRT1_2.value)
    if activation == "gelu_tanh":
        return z * torch.sigmoid(_two_u(z))
    if activation == "silu":
        return F.silu(z)
    return z


# FLOPs per element of act(z) and of act'(z), counted on the two references above (the
# registry's convention: one per +, -, x, / or compare, one per erfc / exp / sigmoid call).
# gelu: 0.5·z·erfc(-z·c) = 4; its grad 0.5·erfc(-z·c) + z·exp(-0.5·z·z)·c = 3 + 5 + 1.
# gelu_tanh: two_u(z) = 5, z·σ(2u) = 7; grad s + z·s·(1-s)·c·(1 + 3c'·z·z) = 6 + 9.
# silu: z·σ(z) = 2; grad σ·(1 + z·(1 - σ)) = 5.
ACTIVATION_FLOPS = {"none": (0, 0), "relu": (1, 1), "gelu": (4, 9), "gelu_tanh": (7, 15), "silu": (2, 5)}


def activation_grad_reference(z: torch.Tensor, activation: str) -> torch.Tensor:
    """PyTorch act'(z), closed form: custom-op bodies run below autograd, so the CPU path of a
    backward cannot differentiate activation_reference."""
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        return 0.5 * torch.special.erfc(-z * SQRT1_2.value) + z * torch.exp(-0.5 * z * z) * INV_SQRT_2PI.value
    if activation == "gelu_tanh":
        s = torch.sigmoid(_two_u(z))
        return s + z * s * (1.0 - s) * TWO_SQRT_2_OVER_PI.value * (1.0 + 3.0 * GELU_TANH_CUBIC.value * z * z)
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    return torch.ones_like(z)


# ----------------------------------------------------------------------------------------------
# launch heuristics shared by the elementwise row-tiled kernels (bias_act, glu)
# ----------------------------------------------------------------------------------------------


MAX_BLOCK_N = 1024      # wide rows are split into column blocks; a row of 1024 bf16 is 2 KB
FWD_TILE_ELEMS = 8192   # elements per program (the softmax H200 sweep: 4K-8K-element tiles best)
BWD_TILE_ELEMS = 4096   # backward keeps more tiles live (x, dy, dx, ...): half the tile


def tile_config(n_rows: int, n_cols: int, tile_elems: int, config: dict | None = None, *,
                max_block_n: int = MAX_BLOCK_N, elems_per_thread: int = 16) -> dict:
    """Launch parameters of a 2-D elementwise kernel: a [BLOCK_M, BLOCK_N] tile of ~``tile_elems``
    elements per program (per loop step for a reducing backward): full padded rows up to
    ``max_block_n`` columns and as many rows as fit, so short rows still give a program enough
    bytes in flight; ``elems_per_thread`` sets the warps. ``config`` overrides any key (GPU
    sweeps); op files add their own keys."""
    block_n = max(4, min(next_power_of_2(max(n_cols, 1)), max_block_n))   # >= 4: dropout RNG
    block_m = max(1, min(tile_elems // block_n, next_power_of_2(max(n_rows, 1))))
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps_for(block_m * block_n, elems_per_thread)}
    cfg.update(config or {})
    return cfg


def num_warps_for(tile_elems: int, elems_per_thread: int = 16) -> int:
    """Warps for ``elems_per_thread`` values per thread (16: two 16-byte vectors of bf16 per
    input), 1 to 16 warps."""
    return max(1, min(16, tile_elems // (32 * elems_per_thread)))


@triton.jit
def tile_rows_cols(n_col_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of a 1-D grid over [row blocks x column blocks] (column blocks fastest,
    so neighbouring programs stream neighbouring memory): int64 rows, first column, columns."""
    pid = tl.program_id(0)
    row_block = pid // n_col_blocks
    col_start = (pid % n_col_blocks) * BLOCK_N
    rows = row_block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, col_start, col_start + tl.arange(0, BLOCK_N)
