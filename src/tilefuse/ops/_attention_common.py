"""What every attention kernel agrees on: the masking rule, softcapping, the fp64 reference.

Layout (flash-attn's): q ``[B, S_q, H_q, D]``, k and v ``[B, S_k, H_kv, D]``; packed (varlen)
tensors ``[total, H, D]`` with ``cu_seqlens`` offsets. Query head ``h`` reads key/value head
``h // (H_q // H_kv)`` (GQA/MQA), without K/V ever being repeated in memory.

Scores, for query ``i`` and key ``j`` of one sequence::

    s[i, j] = scale · q_i · k_j                       (scale defaults to 1/sqrt(D))
    s[i, j] = softcap · tanh(s[i, j] / softcap)        when softcap > 0 (Gemma 2)

Masking. With ``shift = S_k - S_q`` (queries aligned to the *bottom right* of the score matrix,
as FlashAttention ≥ 2.1 does when S_q ≠ S_k) and ``d = j - i - shift``, key ``j`` is visible to
query ``i`` iff::

    d <= right     (when right >= 0; causal is right = 0)
    d >= -left     (when left >= 0)

``window = (left, right)`` with -1 meaning unbounded on that side. A query row that sees no key
(e.g. causal with S_q > S_k) gets output 0 and log-sum-exp ``-inf``: the value that merges
correctly when partial results are combined by their lse (ring attention).

``lse[b, h, i] = log Σ_j exp(s[i, j])`` in natural log, float32, shape ``[B, H_q, S_q]``
(varlen: ``[H_q, total_q]``), as flash-attn returns it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .._op import once_differentiable

NO_WINDOW = -1
MAX_GRID_YZ = 65535   # CUDA's limit on grid axes y and z (x takes 2**31 - 1)


# ----------------------------------------------------------------------------------------------
# host side: argument normalization shared by attention, attention_varlen and attention_decode
# ----------------------------------------------------------------------------------------------


def config_wants_gluon(config: dict | None, tl_only_keys: Sequence[str], default: bool) -> bool:
    """A launch config's say on a Gluon kernel the inputs qualify for: ``"GLUON"`` forces it on or
    off; a ``tl``-only tile key without it keeps the ``tl`` kernel; otherwise ``default``."""
    config = config or {}
    if "GLUON" in config:
        return bool(config["GLUON"])
    return not any(key in config for key in tl_only_keys) and default


def normalize_window(causal: bool, window: Sequence[int]) -> tuple[int, int]:
    """(left, right) with -1 for unbounded; causal tightens right to 0. Raises on bad types."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    left, right = window
    for name, w in (("window[0] (left)", left), ("window[1] (right)", right)):
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"{name} must be an int (-1 for unbounded), got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"{name} must be >= -1 (-1 for unbounded), got {w}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def unbounded_past(w: int | None, bound: int) -> int | None:
    """A window side of ``bound`` = S_q + S_k + 1 or more sees every key any query can (no
    |query - key| distance reaches it): None, unbounded. The kernels add windows to positions in
    int32, so a window near 2^31 (a "large" sentinel) must not reach them."""
    return None if w is None or w >= bound else w


def normalize_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not -math.inf < scale < math.inf:     # comparisons, not math.isfinite: dynamo traces them on SymFloats
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def normalize_softcap(softcap: float) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0 for none), got {type(softcap).__name__}")
    if not 0 <= softcap < math.inf:     # NaN fails too; comparisons trace on SymFloats (dynamic=True)
        raise ValueError(f"softcap must be finite and >= 0 (0 for none), got {softcap}")
    return float(softcap)


# ----------------------------------------------------------------------------------------------
# device side: the same rule inside the kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def tanh_via_exp2(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1): one exp2, exact at ±inf, no libdevice (the interpreter
    runs it too)."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)   # 2·log2(e)


ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)   # 1.5·2^23: x + it rounds x to an integer j held in its low mantissa bits


@triton.jit
def exp2_fma(x):
    """2^x on the FMA pipe, no MUFU (FlashAttention-4's trick, here for Hopper's 16 ex2 per SM
    clock against 128 FMAs): x = j + f with j = round(x) (the 1.5·2^23 add) and f in [-1/2, 1/2];
    2^f by a degree-3 polynomial (relative error 7.5e-5, fitted minimax in fp64, evaluated in
    fp32: below half a bf16 / fp16 ulp of the probabilities it feeds); the exponent j is added to
    the polynomial's bits as an integer. x is clamped to >= -125 (2^-125, not 0, for very negative
    x; -125 keeps the result a normal number, as p(f) may sit just below 1): callers pass finite
    x <= 0 whose row also holds an x = 0, so the clamp changes the row's sum by < 2^-124 per
    element. 8 instructions (FMNMX, 3 FADD, 3 FFMA, SHL+IADD)."""
    x = tl.maximum(x, -125.0)
    t = x + ROUND_MAGIC
    f = x - (t - ROUND_MAGIC)
    p = ((0.05517132207751274 * f + 0.24261054396629333) * f + 0.6932609677314758) * f + 0.9999281167984009
    return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_tree(x, DEPTH: tl.constexpr, FMA: tl.constexpr):
    """exp2 of ``x [..., 2 x DEPTH]`` split on its trailing size-2 dims: the all-upper leaf by
    :func:`exp2_fma` when FMA, every other leaf on MUFU. Both halves of every split go down the
    same chain of splits and joins, so their layouts match at each join (Gluon requires it; tl
    folds the moves away)."""
    if DEPTH == 0:
        if FMA:
            out = exp2_fma(x)
        else:
            out = tl.exp2(x)
    else:
        lo, hi = tl.split(x)
        out = tl.join(_exp2_tree(lo, DEPTH - 1, False), _exp2_tree(hi, DEPTH - 1, FMA))
    return out


@triton.jit
def _exp2_parts(x, ROWS: tl.constexpr, COLS: tl.constexpr, FMA_PARTS: tl.constexpr):
    """exp2 of ``x [ROWS, COLS]`` with the last 1/FMA_PARTS (2, 4 or 8) of the columns on the FMA
    pipe: the split is on the highest column bits (register bits of the MMA accumulator layout:
    no data moves)."""
    if FMA_PARTS == 2:
        y = tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1))
        return tl.reshape(tl.permute(_exp2_tree(y, 1, True), (0, 2, 1)), (ROWS, COLS))
    elif FMA_PARTS == 4:
        y = tl.permute(tl.reshape(x, (ROWS, 2, 2, COLS // 4)), (0, 3, 2, 1))
        return tl.reshape(tl.permute(_exp2_tree(y, 2, True), (0, 3, 2, 1)), (ROWS, COLS))
    else:
        tl.static_assert(FMA_PARTS == 8, "FMA_PARTS: 0, 2, 4 or 8")
        y = tl.permute(tl.reshape(x, (ROWS, 2, 2, 2, COLS // 8)), (0, 4, 3, 2, 1))
        return tl.reshape(tl.permute(_exp2_tree(y, 3, True), (0, 4, 3, 2, 1)), (ROWS, COLS))


@triton.jit
def exp2_mixed(x, ROWS: tl.constexpr, COLS: tl.constexpr, FMA_PARTS: tl.constexpr):
    """exp2 of ``x [ROWS, COLS]``: all on MUFU (FMA_PARTS = 0), or 1/FMA_PARTS of the columns (a
    power of two <= COLS) by :func:`exp2_fma`, so the special-function unit and the FMA pipe share the work."""
    if FMA_PARTS == 0:
        return tl.exp2(x)
    else:
        return _exp2_parts(x, ROWS, COLS, FMA_PARTS)


@triton.jit
def apply_softcap(s, softcap, HAS_SOFTCAP: tl.constexpr):
    """softcap · tanh(s / softcap) on scaled scores ``s``; also returns ds_out/ds_in for the
    backward (1 - tanh², or 1 when there is no cap)."""
    # one return statement: the compiler (not the interpreter) rejects returns whose types differ
    # across constexpr branches ((tensor, tensor) vs (tensor, float))
    if HAS_SOFTCAP:
        t = tanh_via_exp2(s / softcap)
        capped = softcap * t
        dcap = 1.0 - t * t
    else:
        capped = s
        dcap = 1.0
    return capped, dcap


@triton.jit
def visible(offs_m, offs_n, seqlen_k, shift, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: key ``offs_n`` exists and query ``offs_m`` may see it
    (module docstring: d = j - i - shift within [-left, right])."""
    ok = (offs_n < seqlen_k)[None, :]
    if HAS_LEFT or HAS_RIGHT:
        d = offs_n[None, :] - offs_m[:, None] - shift
        if HAS_RIGHT:
            ok = ok & (d <= window_right)
        if HAS_LEFT:
            ok = ok & (d >= -window_left)
    return ok


@triton.jit
def key_range(start_m, BLOCK_M: tl.constexpr, seqlen_k, shift, window_left, window_right,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[lo, hi) of the keys that any of the queries start_m .. start_m + BLOCK_M - 1 can see.
    The forward (and dq) loop walks only these key blocks: causal and windowed attention skip
    the rest."""
    lo = 0
    hi = seqlen_k
    if HAS_RIGHT:
        hi = tl.minimum(hi, start_m + BLOCK_M + shift + window_right)
    if HAS_LEFT:
        lo = tl.maximum(lo, start_m + shift - window_left)
    hi = tl.maximum(hi, lo)   # empty range, never negative
    return lo, hi


@triton.jit
def query_range(start_n, BLOCK_N: tl.constexpr, seqlen_q, shift, window_left, window_right,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[lo, hi) of the queries that can see any of keys start_n .. start_n + BLOCK_N - 1: the
    dk/dv loop of the backward walks only these query blocks."""
    lo = 0
    hi = seqlen_q
    if HAS_RIGHT:
        lo = tl.maximum(lo, start_n - shift - window_right)
    if HAS_LEFT:
        hi = tl.minimum(hi, start_n + BLOCK_N - shift + window_left)
    hi = tl.maximum(hi, lo)
    return lo, hi


# ----------------------------------------------------------------------------------------------
# program order: which (block, head) each program of a grid takes
# ----------------------------------------------------------------------------------------------


@triton.jit
def scheduled_block(REVERSE: tl.constexpr):
    """(block, bh) of this program in a :func:`schedule_grid` grid ``(G, blocks, B·H / G)``.
    The hardware starts programs in x, then y, then z order, so within each group of G heads
    every head's block 0 starts before any head's block 1. REVERSE counts blocks from the last
    (the heavy ones under a causal mask when blocks are query blocks)."""
    block = tl.program_id(1)
    if REVERSE:
        block = tl.num_programs(1) - 1 - block
    return block, tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)


def heads_per_group(n_blocks: int, n_bh: int, uneven: bool, sms: int) -> int:
    """G of :func:`schedule_grid`. When blocks differ in work (a causal or windowed mask) and a
    head has fewer blocks than there are SMs, about one wave of programs per group (G·n_blocks
    ≥ SMs): each group runs its heavy blocks before its light ones, so the grid ends on light
    programs rather than on a heavy block of the last head, while no more heads are in flight
    than in plain head order (their K/V and Q/dO stay shared through L2). G divides B·H (the
    grid has no ragged group); G = 1 is plain head order."""
    if not uneven or not 0 < n_blocks < sms or n_bh <= 1:
        return 1
    target = min(n_bh, -(-sms // n_blocks))
    return max(d for d in range(1, target + 1) if n_bh % d == 0)


def schedule_grid(n_blocks: int, n_bh: int, uneven: bool, sms: int, head_group: int | None = None) -> tuple:
    """The grid ``(G, n_blocks, n_bh / G)`` that :func:`scheduled_block` reads; ``head_group``
    forces G (a launch config's "HEAD_GROUP"; it must divide ``n_bh``)."""
    g = heads_per_group(n_blocks, n_bh, uneven, sms) if head_group is None else int(head_group)
    if g < 1 or n_bh % max(g, 1):
        raise ValueError(f"HEAD_GROUP={head_group} must be a positive divisor of B·H = {n_bh}")
    if head_group is None and n_bh // g > MAX_GRID_YZ:     # more groups than grid axis z takes: wider ones
        g = next((d for d in range(g, n_bh + 1) if n_bh % d == 0 and n_bh // d <= MAX_GRID_YZ), g)
    if n_blocks > MAX_GRID_YZ or n_bh // g > MAX_GRID_YZ:
        raise ValueError(f"{n_blocks} blocks per head x {n_bh // g} head groups: each must be <= {MAX_GRID_YZ}")
    return (g, n_blocks, n_bh // g)


# ----------------------------------------------------------------------------------------------
# references (fp64 for tests; fp32 math otherwise); also the CPU path
# ----------------------------------------------------------------------------------------------


def visible_mask(seqlen_q: int, seqlen_k: int, left: int, right: int, device=None,
                 shift: int | None = None) -> torch.Tensor:
    """[S_q, S_k] bool: the masking rule of the module docstring (shift = S_k - S_q unless given)."""
    if shift is None:
        shift = seqlen_k - seqlen_q
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    d = j - i - shift
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    # |d| <= S_q + S_k + |shift|: a wider side is no limit (and a Python int past int64 cannot be compared)
    bound = seqlen_q + seqlen_k + abs(shift) + 1
    right, left = min(right, bound), min(left, bound)
    if right >= 0:
        ok &= d <= right
    if left >= 0:
        ok &= d >= -left
    return ok


# score matrices above this many elements go through the query-chunked reference (O(S) memory)
REFERENCE_CHUNK_ABOVE = 2**27


def attention_reference(q, k, v, causal: bool = False, window=(-1, -1), softcap: float = 0.0,
                        scale: float | None = None, return_lse: bool = False, shift: int | None = None,
                        chunk_rows: int | None = None):
    """Plain PyTorch attention with the module's semantics; ``[B, S, H, D]`` layout.

    Math in float64 for float64 inputs, float32 otherwise; out in q's dtype, lse float32 (float64
    for float64 inputs). Differentiable (autograd through the reference gives the reference
    gradients). Score matrices over REFERENCE_CHUNK_ABOVE elements (the benchmark's S = 16k),
    or any with ``chunk_rows``, are computed ``chunk_rows`` queries at a time by
    :class:`_ChunkedAttention`, whose backward recomputes each chunk (same math, O(S) memory)."""
    left, right = normalize_window(causal, window)
    scale = normalize_scale(scale, q.shape[-1])
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    if chunk_rows is not None or b * hq * sq * sk > REFERENCE_CHUNK_ABOVE:
        rows = chunk_rows or max(1, REFERENCE_CHUNK_ABOVE // (4 * b * hq * max(sk, 1)))
        out, lse = _ChunkedAttention.apply(q.to(wide), k.to(wide), v.to(wide), left, right, float(softcap),
                                           scale, sk - sq if shift is None else shift, rows)
        out = out.to(q.dtype)
        return (out, lse.detach()) if return_lse else out
    qw = q.to(wide).transpose(1, 2)                                   # [B, Hq, Sq, D]
    kw = k.to(wide).transpose(1, 2).repeat_interleave(group, dim=1)   # [B, Hq, Sk, D]
    vw = v.to(wide).transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qw, kw.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    ok = visible_mask(sq, sk, left, right, device=q.device, shift=shift)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                  # -inf on rows that see nothing
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])   # 0 on those rows
    out = torch.matmul(p, vw).transpose(1, 2).to(q.dtype)
    lse = lse.to(torch.float64 if wide == torch.float64 else torch.float32)
    return (out, lse) if return_lse else out


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, window=(-1, -1),
                               softcap=0.0, scale=None, return_lse=False):
    """Varlen reference: packed ``[total, H, D]``, one dense reference call per sequence. Rows
    outside ``[cu[0], cu[-1])`` (padding of the packed buffer) belong to no sequence: out 0,
    lse -inf."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]].unsqueeze(0)
        ki, vi = k[ck[i]:ck[i + 1]].unsqueeze(0), v[ck[i]:ck[i + 1]].unsqueeze(0)
        o, lse = attention_reference(qi, ki, vi, causal, window, softcap, scale, return_lse=True)
        outs.append(o[0])
        lses.append(lse[0])                                           # [H, S_i]
    total = q.shape[0]
    lo, hi = (cq[0], cq[-1]) if cq else (0, 0)
    dtype = outs[0].dtype if outs else q.dtype
    head = q.new_zeros((lo,) + q.shape[1:-1] + (v.shape[-1],), dtype=dtype)
    tail = q.new_zeros((total - hi,) + q.shape[1:-1] + (v.shape[-1],), dtype=dtype)
    out = torch.cat([head, *outs, tail], 0)
    lse_pad = (lambda n: torch.full((q.shape[1], n), float("-inf"), device=q.device))
    lse = torch.cat([lse_pad(lo), *lses, lse_pad(total - hi)], 1)
    return (out, lse) if return_lse else out


def _chunk_scores(qc, k, i0, left, right, softcap, scale, shift):
    """Scores of queries i0.. (qc [B, H, C, D]) against all keys, masked; and tanh for softcap."""
    s = torch.matmul(qc, k.transpose(-1, -2)) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    sk = k.shape[-2]
    ok = visible_mask(qc.shape[-2], sk, left, right, device=qc.device, shift=shift + i0)   # row i0 + i
    return s.masked_fill(~ok, float("-inf")), t


class _ChunkedAttention(torch.autograd.Function):
    """The reference by query chunks: forward keeps out and lse only; backward recomputes each
    chunk's probabilities P = exp(S - lse) and applies dS = P ∘ (dO·Vᵀ - rowsum(dO ∘ O)),
    dQ = scale·dS'·K, dK = scale·dS'ᵀ·Q, dV = Pᵀ·dO (dS' = dS ∘ (1 - tanh²) with softcap),
    dK / dV summed over each GQA group. Inputs [B, S, H, D] in the math dtype."""

    @staticmethod
    def forward(ctx, q, k, v, left, right, softcap, scale, shift, rows):
        group = q.shape[2] // k.shape[2]
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        outs, lses = [], []
        for i0 in range(0, q.shape[1], rows):
            s, _ = _chunk_scores(qh[:, :, i0:i0 + rows], kh, i0, left, right, softcap, scale, shift)
            lse = torch.logsumexp(s, -1)
            outs.append(torch.matmul(torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None]), vh))
            lses.append(lse)
        out = torch.cat(outs, 2).transpose(1, 2) if outs else q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        lse = torch.cat(lses, 2) if lses else q.new_zeros((q.shape[0], q.shape[2], 0))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (left, right, softcap, scale, shift, rows, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        left, right, softcap, scale, shift, rows, group = ctx.args
        qh, oh, doh = (t.transpose(1, 2) for t in (q, out, dout))
        kh = k.transpose(1, 2).repeat_interleave(group, 1)
        vh = v.transpose(1, 2).repeat_interleave(group, 1)
        dq = torch.zeros_like(qh)
        dk, dv = torch.zeros_like(kh), torch.zeros_like(vh)
        for i0 in range(0, q.shape[1], rows):
            sl = slice(i0, i0 + rows)
            s, t = _chunk_scores(qh[:, :, sl], kh, i0, left, right, softcap, scale, shift)
            lse_c = lse[:, :, sl]
            p = torch.exp(s - lse_c.masked_fill(torch.isinf(lse_c), 0.0)[..., None])
            dp = torch.matmul(doh[:, :, sl], vh.transpose(-1, -2))
            ds = p * (dp - (doh[:, :, sl] * oh[:, :, sl]).sum(-1, keepdim=True))
            if t is not None:
                ds = ds * (1 - t * t)
            dq[:, :, sl] = torch.matmul(ds, kh) * scale
            dk += torch.matmul(ds.transpose(-1, -2), qh[:, :, sl]) * scale
            dv += torch.matmul(p.transpose(-1, -2), doh[:, :, sl])
        b, hq, sk, d = dk.shape
        dk = dk.view(b, hq // group, group, sk, d).sum(2)
        dv = dv.view(b, hq // group, group, sk, dv.shape[-1]).sum(2)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None, None, None
