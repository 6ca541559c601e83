"""FlashAttention forward kernel (dense and varlen) and its launcher.

Masking rule, softcap, lse convention and layouts: ``_attention_common``'s docstring. Per
(batch, query head, block of BLOCK_M queries), one program runs the online softmax over the key
blocks the block can see (FlashAttention-2), in the log2 domain::

    s2[i, j] = log2(e) · s[i, j]                      (scale·log2(e) folded into one multiply)
    m_i      = max_j s2[i, j]            (running)
    l_i      = Σ_j exp2(s2[i, j] - m_i)  (running, rescaled by exp2(m_old - m_new))
    acc_i    = Σ_j exp2(s2[i, j] - m_i) · v_j
    out_i    = acc_i / l_i               (normalized once, after the loop)
    lse_i    = ln(2) · (m_i + log2(l_i)) (-inf, and out_i = 0, for a row that sees no key)

Key blocks are walked in three ranges: masked blocks on the window's left edge, the unmasked
interior (every key exists and is visible to every query of the block: no mask arithmetic at
all), and masked blocks on the right edge (the causal diagonal, the window's right edge and the
sequence tail). In the interior each block's P·V may be issued one block late (``PV_LAG``,
:func:`_attend_interior_lagged`), so that it overlaps the next block's softmax. Blocks outside
``key_range`` are never touched, so causal and windowed attention do proportionally less work.

Loads go through one of four paths (``LOAD`` constexpr):

* ``"desc_bhsd"``: host TMA descriptors over the ``[B, S, H, D]`` memory viewed as
  ``[B, H, S, D]`` (permuted strides) with ``[1, 1, BLOCK, BLOCK_D]`` blocks: exact per-batch
  bounds and zero fill past S and D from the hardware, a plain 2-D tile after dropping the unit
  dims. The default for dense inputs whose pointer and strides are 16-byte aligned.
* ``"desc_bshd"``: the same over the natural ``[B, S, H, D]`` order with ``[1, BLOCK, 1,
  BLOCK_D]`` blocks (kept for the sweep: which of the two Triton lowers better).
* ``"desc_device"``: descriptors built inside the kernel over each program's (sequence, head)
  slice, ``[S, D]`` rows of the packed or dense memory: exact per-sequence bounds, so varlen
  reads and writes its tiles through TMA too (the default for 16-byte aligned varlen inputs with
  long sequences, :func:`varlen_load_default`; Triton's allocator gives each program scratch for
  its descriptors).
* ``"ptr"``: masked pointer loads with int64 offsets; inputs whose pointer or strides are not
  16-byte aligned.

D that is not a power of two is padded to BLOCK_D inside the kernel (masked / zero-filled loads:
zero columns change neither q·k nor the output columns that are stored).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._dispatch import cdiv, device_major, empty, next_power_of_2, num_sms, packed_output
from .._launch import PreparedArgs, cached_by_view, cached_descriptor, config_key, fast_launch, use_device_descriptors
from ._attention_common import (config_wants_gluon, exp2_mixed, key_range, schedule_grid, scheduled_block,
                                tanh_via_exp2, unbounded_past, visible)

LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
LOAD_MODES = ("ptr", "desc_bhsd", "desc_bshd", "desc_device")
DEFAULT_DENSE_LOAD = "desc_bhsd"    # switch to "desc_bshd" / "ptr" here if a GPU run says so

# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _head_source(src, base, n_rows, row_stride,
                 HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, LOAD: tl.constexpr):
    """What :func:`_load_rows` reads one (sequence, head) slice through: with LOAD "desc_device"
    a descriptor built in the kernel over exactly that slice, ``[n_rows, HEAD_DIM]`` from element
    ``base`` (rows past the sequence come back as zeros, so varlen needs no per-sequence host
    descriptor), else ``src`` itself (a pointer or a host descriptor)."""
    if LOAD == "desc_device":   # one return statement: Triton rejects returns of different types
        # at least one row: a sequence without keys still builds its (never read) descriptor
        out = tl.make_tensor_descriptor(src + base, shape=[tl.maximum(n_rows, 1), HEAD_DIM],
                                        strides=[row_stride, 1], block_shape=[ROWS, BLOCK_D])
    else:
        out = src
    return out


@triton.jit
def _load_rows(src, b, h, start, base, row_stride, n_rows,
               HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, LOAD: tl.constexpr):
    """[ROWS, BLOCK_D] tile of rows start .. start + ROWS - 1 of head h (zeros past n_rows / D)."""
    if LOAD == "desc_device":
        x = src.load([start, 0])
    elif LOAD == "desc_bhsd":
        x = src.load([b, h, start, 0]).reshape([ROWS, BLOCK_D])
    elif LOAD == "desc_bshd":
        x = src.load([b, start, h, 0]).reshape([ROWS, BLOCK_D])
    else:
        rows = start + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        offs = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        x = tl.load(src + offs, mask=(rows < n_rows)[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
    return x


@triton.jit
def _block_probs(qk, m_i, offs_n, seqlen_k, offs_m, shift, score_scale, softcap_log2, window_left, window_right,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, FOLD_SCALE: tl.constexpr, EXP2_FMA_PARTS: tl.constexpr):
    """(p, alpha, m_new) of one key block (keys ``offs_n``) from its raw scores qk = q·kᵀ: the
    probabilities exp2(s2 - m_new) (module docstring), the factor exp2(m_i - m_new) that rescales what was
    accumulated at the old max, and the new running max.
    MASKED=False: the caller guarantees every key of the block is visible to every query; there
    1/EXP2_FMA_PARTS of the exp2s (0: none) run on the FMA pipe (``exp2_mixed``: every argument is
    finite and each row holds its max, as that polynomial needs).
    FOLD_SCALE (scale > 0): the row max is taken on the raw scores and scaled once per row, so
    each score costs one FMA, qk·scale - m, before its exp2 (not a multiply and a subtract)."""
    if HAS_SOFTCAP:   # s2 = log2(e)·softcap·tanh(scale·qk / softcap)
        s = tanh_via_exp2(qk * score_scale) * softcap_log2
        s_scale = 1.0
    elif FOLD_SCALE:  # s2 = log2(e)·scale·qk, formed inside the exp2's argument below
        s = qk
        s_scale = score_scale
    else:             # a scale <= 0 does not commute with the max: scale first
        s = qk * score_scale
        s_scale = 1.0
    if MASKED:
        ok = visible(offs_m, offs_n, seqlen_k, shift, window_left,
                     window_right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        # a row with no visible key so far keeps m = -inf; subtract 0 there (exp2(-inf) = 0, not NaN)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * s_scale - m_use[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        m_use = m_new
        p = exp2_mixed(s * s_scale - m_use[:, None], s.shape[0], BLOCK_N, EXP2_FMA_PARTS)
    return p, tl.exp2(m_i - m_use), m_new


@triton.jit
def _online_softmax_step(acc, l_i, m_i, qk, v, b, hk, start_n, v_base, stride_vs, seqlen_k, offs_m, shift,
                         score_scale, softcap_log2, window_left, window_right,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr, FOLD_SCALE: tl.constexpr, LOAD: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, EXP2_FMA_PARTS: tl.constexpr):
    """One key block's update of (acc, l, m) from its raw scores qk (:func:`_block_probs`)."""
    p, alpha, m_new = _block_probs(qk, m_i, start_n + tl.arange(0, BLOCK_N), seqlen_k, offs_m, shift, score_scale,
                                   softcap_log2, window_left, window_right, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT,
                                   HAS_SOFTCAP, FOLD_SCALE, EXP2_FMA_PARTS)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_tile = _load_rows(v, b, hk, start_n, v_base, stride_vs, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, LOAD)
    acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_interior_lagged(acc, l_i, m_i, q_tile, k, v, start, end, b, hk, k_base, v_base,
                            stride_ks, stride_vs, seqlen_k, offs_m, shift, score_scale, softcap_log2,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            HAS_SOFTCAP: tl.constexpr, FOLD_SCALE: tl.constexpr, LOAD: tl.constexpr,
                            DOT_PRECISION: tl.constexpr, EXP2_FMA_PARTS: tl.constexpr):
    """The unmasked key blocks start, .., < end with each block's P·V issued one step late, after
    the next block's scores (FlashAttention-3's intra-warpgroup overlap): Triton 3.6 waits for a
    score GEMM as soon as it is issued, but an accumulating GEMM stays in flight until its
    accumulator is next read, so P_j·V_j now runs on the tensor cores while the softmax of block
    j + 1 runs on the FMA / MUFU pipes. Carries P_j in fp32 (carried as 16-bit, Triton 3.6 puts it
    in shared memory and waits for the GEMM at once; sm_90, 128x128 tiles: 239 registers, no
    spills) and its rescale factor."""
    if start < end:
        # the first step's P·V is a zero block against V_start: no prologue outside the loop,
        # whose tile would need shared memory beside the pipeline's stages
        p_prev = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        alpha_prev = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        for start_n in tl.range(start, end, BLOCK_N):
            k_tile = _load_rows(k, b, hk, start_n, k_base, stride_ks, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, LOAD)
            qk = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
            v_tile = _load_rows(v, b, hk, tl.maximum(start_n - BLOCK_N, start), v_base, stride_vs, seqlen_k,
                                HEAD_DIM, BLOCK_N, BLOCK_D, LOAD)
            acc = tl.dot(p_prev.to(v_tile.dtype), v_tile, acc * alpha_prev[:, None], input_precision=DOT_PRECISION)
            p, alpha, m_i = _block_probs(qk, m_i, start_n + tl.arange(0, BLOCK_N), seqlen_k, offs_m, shift,
                                         score_scale, softcap_log2, 0, 0, BLOCK_N, False, False, False, HAS_SOFTCAP,
                                         FOLD_SCALE, EXP2_FMA_PARTS)
            l_i = l_i * alpha + tl.sum(p, 1)
            p_prev = p
            alpha_prev = alpha
        v_tile = _load_rows(v, b, hk, end - BLOCK_N, v_base, stride_vs, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, LOAD)
        acc = tl.dot(p_prev.to(v_tile.dtype), v_tile, acc * alpha_prev[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_key_blocks(acc, l_i, m_i, q_tile, k, v, start, end, b, hk, k_base, v_base,
                       stride_ks, stride_vs, seqlen_k, offs_m, shift, score_scale, softcap_log2,
                       window_left, window_right,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       HAS_SOFTCAP: tl.constexpr, FOLD_SCALE: tl.constexpr, LOAD: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                       EXP2_FMA_PARTS: tl.constexpr):
    """Online-softmax update over key blocks start, start + BLOCK_N, .. < end."""
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k_tile = _load_rows(k, b, hk, start_n, k_base, stride_ks, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, LOAD)
        qk = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
        acc, l_i, m_i = _online_softmax_step(
            acc, l_i, m_i, qk, v, b, hk, start_n, v_base, stride_vs, seqlen_k, offs_m, shift, score_scale,
            softcap_log2, window_left, window_right, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED, HAS_LEFT, HAS_RIGHT,
            HAS_SOFTCAP, FOLD_SCALE, LOAD, DOT_PRECISION, EXP2_FMA_PARTS)
    return acc, l_i, m_i


@triton.jit
def program_block(n_heads_q, group_size, REVERSE_M: tl.constexpr):
    """(query block index, batch, query head, key/value head) of this program: a
    :func:`schedule_grid` grid over (query blocks, B·H_q), heavy (late, causal) query blocks first
    with REVERSE_M. Shared with the Gluon forward and dq kernels."""
    pid_m, pid_bh = scheduled_block(REVERSE_M)
    b = pid_bh // n_heads_q
    h = pid_bh % n_heads_q
    return pid_m, b, h, h // group_size


@triton.jit
def _unmasked_key_blocks(start_m, lo, seqlen_k, shift, window_left, window_right,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """(lo_aligned, full_lo, full_hi): key blocks [full_lo, full_hi) (multiples of BLOCK_N) whose
    keys all exist and are visible to all queries start_m .. start_m + BLOCK_M - 1, i.e.
    min d >= -left and max d <= right over the block (d = j - i - shift). Empty: both lo_aligned."""
    lo_aligned = (lo // BLOCK_N) * BLOCK_N
    full_lo = lo_aligned
    if HAS_LEFT:   # start_n - (start_m + BLOCK_M - 1) - shift >= -left
        first = tl.maximum(start_m + BLOCK_M - 1 + shift - window_left, 0)
        full_lo = tl.maximum(full_lo, tl.cdiv(first, BLOCK_N) * BLOCK_N)
    end = seqlen_k
    if HAS_RIGHT:  # start_n + BLOCK_N - 1 - start_m - shift <= right
        end = tl.minimum(end, start_m + shift + window_right + 1)
    full_hi = (tl.maximum(end, 0) // BLOCK_N) * BLOCK_N
    empty_range = full_hi <= full_lo
    return lo_aligned, tl.where(empty_range, lo_aligned, full_lo), tl.where(empty_range, lo_aligned, full_hi)


@fast_launch
# S_q / S_k are not specialized on value: an H100 run failed to compile ("PassManager::run
# failed") at S_q = 1, S_k = 21, D = 64; a descriptor dimension folded to the constant 1 is the
# suspect. Unlike the backward (_launch.UnitValueFallback), the forward gained nothing from the
# specialization (H200, S = 4k / 16k, D = 128: 503 / 486 TF/s full either way, causal -1 to -3 %).
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def attention_fwd_kernel(
    q,                  # *q [B, S_q, H_q, D] (varlen [total_q, H_q, D]), or a TMA descriptor of it
    k,                  # *k [B, S_k, H_kv, D] (varlen [total_k, H_kv, D]), or a descriptor
    v,                  # *v, as k
    out,                # *out [B, S_q, H_q, D] (varlen [total_q, H_q, D]), q's dtype, or a descriptor
    lse_ptr,            # *lse float32 [B, H_q, S_q] (varlen [H_q, total_q])
    cu_seqlens_q_ptr,   # *int32 [B + 1] query offsets (varlen; unused otherwise)
    cu_seqlens_k_ptr,   # *int32 [B + 1] key offsets (varlen; unused otherwise)
    stride_qb, stride_qs, stride_qh,   # q strides in elements (batch 0 for varlen); D stride is 1
    stride_kb, stride_ks, stride_kh,   # k strides
    stride_vb, stride_vs, stride_vh,   # v strides
    stride_ob, stride_os, stride_oh,   # out strides
    stride_lb, stride_lh,              # lse strides (batch, head); unit stride along queries
    seqlen_q,           # S_q (dense; varlen reads each sequence's from cu_seqlens_q)
    seqlen_k,           # S_k (dense; varlen from cu_seqlens_k)
    n_heads_q,          # H_q
    group_size,         # H_q // H_kv: query heads sharing one key/value head
    score_scale,        # scale·log2(e), or scale / softcap with softcap
    softcap_log2,       # softcap·log2(e) (unused without softcap)
    window_left,        # keys visible down to d >= -window_left (HAS_LEFT)
    window_right,       # keys visible up to d <= window_right (HAS_RIGHT; may be negative)
    HEAD_DIM: tl.constexpr,        # D
    BLOCK_D: tl.constexpr,         # D padded to a power of two >= 16
    BLOCK_M: tl.constexpr,         # queries per program
    BLOCK_N: tl.constexpr,         # keys per inner step
    HAS_LEFT: tl.constexpr,        # a left window bound exists
    HAS_RIGHT: tl.constexpr,       # a right bound exists (causal is right = 0)
    HAS_SOFTCAP: tl.constexpr,     # softcap > 0
    IS_VARLEN: tl.constexpr,       # packed sequences with cu_seqlens
    LOAD: tl.constexpr,            # one of LOAD_MODES (module docstring)
    DOT_PRECISION: tl.constexpr,   # "ieee" for fp32 inputs (no tf32), None otherwise
    REVERSE_M: tl.constexpr,       # heavy (late, causal) query blocks first: shorter tail
    WARP_SPECIALIZE: tl.constexpr,  # hook for tl.range(warp_specialize=...) on the interior loop
    FOLD_SCALE: tl.constexpr,      # score_scale > 0: scale folded into the exp2's FMA
    EXP2_FMA_PARTS: tl.constexpr,  # unmasked blocks: 1/this of the exp2s by polynomial on the FMA pipe (0: none)
    PV_LAG: tl.constexpr,          # unmasked blocks: P·V one block late (_attend_interior_lagged)
):
    pid_m, b, h, hk = program_block(n_heads_q, group_size, REVERSE_M)
    if IS_VARLEN:
        row0_q = tl.load(cu_seqlens_q_ptr + b)
        seqlen_q = tl.load(cu_seqlens_q_ptr + b + 1) - row0_q
        row0_k = tl.load(cu_seqlens_k_ptr + b)
        seqlen_k = tl.load(cu_seqlens_k_ptr + b + 1) - row0_k
    else:
        row0_q = 0
        row0_k = 0
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:   # varlen: the grid covers max_seqlen_q
        return
    shift = seqlen_k - seqlen_q
    offs_m = start_m + tl.arange(0, BLOCK_M)
    b64 = b.to(tl.int64)
    q_base = b64 * stride_qb + tl.cast(row0_q, tl.int64) * stride_qs + h.to(tl.int64) * stride_qh
    k_base = b64 * stride_kb + tl.cast(row0_k, tl.int64) * stride_ks + hk.to(tl.int64) * stride_kh
    v_base = b64 * stride_vb + tl.cast(row0_k, tl.int64) * stride_vs + hk.to(tl.int64) * stride_vh
    q = _head_source(q, q_base, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, LOAD)
    k = _head_source(k, k_base, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, LOAD)
    v = _head_source(v, v_base, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, LOAD)

    q_tile = _load_rows(q, b, h, start_m, q_base, stride_qs, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, LOAD)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, hi = key_range(start_m, BLOCK_M, seqlen_k, shift, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    lo_aligned, full_lo, full_hi = _unmasked_key_blocks(start_m, lo, seqlen_k, shift, window_left,
                                                        window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # left edge of a window (masked), interior (unmasked), right edge / diagonal / tail (masked)
    acc, l_i, m_i = _attend_key_blocks(
        acc, l_i, m_i, q_tile, k, v, lo_aligned, full_lo, b, hk, k_base, v_base, stride_ks, stride_vs,
        seqlen_k, offs_m, shift, score_scale, softcap_log2, window_left, window_right,
        HEAD_DIM, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, FOLD_SCALE, LOAD, DOT_PRECISION, False, 0)
    if PV_LAG:
        acc, l_i, m_i = _attend_interior_lagged(
            acc, l_i, m_i, q_tile, k, v, full_lo, full_hi, b, hk, k_base, v_base, stride_ks, stride_vs,
            seqlen_k, offs_m, shift, score_scale, softcap_log2, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP,
            FOLD_SCALE, LOAD, DOT_PRECISION, EXP2_FMA_PARTS)
    else:
        acc, l_i, m_i = _attend_key_blocks(
            acc, l_i, m_i, q_tile, k, v, full_lo, full_hi, b, hk, k_base, v_base, stride_ks, stride_vs,
            seqlen_k, offs_m, shift, score_scale, softcap_log2, window_left, window_right,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, FOLD_SCALE, LOAD, DOT_PRECISION,
            WARP_SPECIALIZE, EXP2_FMA_PARTS)
    acc, l_i, m_i = _attend_key_blocks(
        acc, l_i, m_i, q_tile, k, v, full_hi, hi, b, hk, k_base, v_base, stride_ks, stride_vs,
        seqlen_k, offs_m, shift, score_scale, softcap_log2, window_left, window_right,
        HEAD_DIM, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, FOLD_SCALE, LOAD, DOT_PRECISION, False, 0)

    # deferred normalization; rows that saw no key: l = 0 -> out 0, lse = -inf (m = -inf)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = (acc / l_safe[:, None]).to(q_tile.dtype)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    lse_offs = b64 * stride_lb + h.to(tl.int64) * stride_lh + tl.cast(row0_q, tl.int64) + offs_m
    tl.store(lse_ptr + lse_offs, lse, mask=offs_m < seqlen_q)
    o_base = b64 * stride_ob + tl.cast(row0_q, tl.int64) * stride_os + h.to(tl.int64) * stride_oh
    if LOAD == "desc_bhsd":
        out.store([b, h, start_m, 0], o.reshape([1, 1, BLOCK_M, BLOCK_D]))
    elif LOAD == "desc_bshd":
        out.store([b, start_m, h, 0], o.reshape([1, BLOCK_M, 1, BLOCK_D]))
    elif LOAD == "desc_device":     # rows past the sequence are clipped by the descriptor's bounds
        _head_source(out, o_base, seqlen_q, stride_os, HEAD_DIM, BLOCK_M, BLOCK_D, LOAD).store([start_m, 0], o)
    else:
        cols = tl.arange(0, BLOCK_D)
        o_offs = o_base + offs_m.to(tl.int64)[:, None] * stride_os + cols[None, :]
        tl.store(out + o_offs, o, mask=(offs_m < seqlen_q)[:, None] & (cols < HEAD_DIM)[None, :])


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------


def head_block(head_dim: int) -> int:
    """D padded to a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, next_power_of_2(head_dim))


def fwd_tile_config(block_d: int, dtype: torch.dtype, on_gpu: bool, masked: bool,
                    seqlen_k: int) -> dict:
    """BLOCK_M, BLOCK_N, num_warps, num_stages for one head-dim block; ``masked``: causal or
    windowed; ``seqlen_k``: keys per sequence (the longest, varlen). From scripts/attention_sweep.py
    (bf16, B·S = 16k, H = 16): 3 stages beat 2 by 10-19 % everywhere (H100, 2026-11-22); 64x64 x 4
    warps is best at D = 64 and for causal D = 128 at S = 4k, 128x128 x 8 warps for full D = 128
    and, since 1/8 of the exp2s moved to the FMA pipe (:func:`exp2_fma_parts`), for causal D = 128
    from S = 8k (H200, 2026-11-24: 458 / 491-503 TF/s at causal 8k / 16k against 64x64's 437-472)
    and for full D = 128 from S_k = 2k (H200, 2026-11-24, 3 interleaved rounds: 64x64 433 against
    407 TF/s at S = 1k, 462 against 468 at 2k, 485 against 493 at 4k: the short walks favour small
    tiles)."""
    if not on_gpu:      # interpreter: small tiles so tiny test shapes still cross block edges
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:   # 4-byte tiles: half the rows for the same shared memory
        return {"BLOCK_M": 64, "BLOCK_N": 64 if block_d <= 128 else 32, "num_warps": 4, "num_stages": 2}
    if block_d <= 64 or (block_d <= 128 and seqlen_k < (8192 if masked else 2048)):
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if block_d <= 128:   # q 32 KB + 3 stages x (k, v) 96 KB; 4 stages (289 KB) do not fit
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}   # D 256: 64 KB q tile


def exp2_fma_parts(block_n: int) -> int:
    """1 in 8 of the interior exp2s by polynomial on the FMA pipe for 128-key blocks: MUFU's 16
    ex2 per SM clock are the softmax's bottleneck there (H200, D = 128, 5 interleaved rounds:
    +4-9 % at 128x128 tiles with 1/8, less with 1/4, 1/2 slower than none); 64-key blocks lose
    1-4 % with it."""
    return 8 if block_n >= 128 else 0


def varlen_load_default(max_seqlen_k: int) -> str:
    """In-kernel descriptors for varlen from S_k = 4k, pointer loads below: each program builds
    its descriptors before its first load, a cost short walks do not hide. H200, bf16, 16k packed
    tokens, H = 16 (2026-11-24, scripts/attention_varlen_loads.py): S = 4k desc_device / ptr
    494 / 470 TF/s full and 421 / 362 causal at D = 128, 378 / 370 and 340 / 342 at D = 64;
    S = 1k 374 / 358, 266 / 279, 297 / 341, 206 / 260."""
    return "desc_device" if max_seqlen_k >= 4096 else "ptr"


def pv_lag_default(block_n: int) -> bool:
    """P·V one key block late (:func:`_attend_interior_lagged`) for 128-key blocks: H200, D = 128,
    128x128 tiles, 3 interleaved rounds (2026-11-24): 460 -> 518-520 TF/s full and 399 -> 449-452
    causal at S = 4k, 490 -> 525-537 full and 487 -> 527-529 causal at 16k; 64x64 tiles tie with
    it (+-1 %), so they keep the plain loop."""
    return block_n >= 128


def _use_gluon(major: int, dtype: torch.dtype, head_dim: int, varlen: bool, load: str, config: dict | None,
               masked: bool, seqlen_k: int) -> bool:
    """The warp-specialized Gluon kernel (``_attention_fwd_gluon``) on sm_90 (``major``: the
    device's compute capability) for the inputs it serves, where :func:`gluon_forward_default`
    says it is faster; ``config={"GLUON": True / False}`` forces the choice where it can serve
    them, and a config that sets a ``tl``-only key (:data:`TL_ONLY_KEYS`) without "GLUON" keeps
    the ``tl`` kernel."""
    if major != 9:
        return False
    from ._attention_fwd_gluon import use_gluon_forward
    return use_gluon_forward(dtype, head_dim, varlen, load) and config_wants_gluon(
        config, TL_ONLY_KEYS, gluon_forward_default(head_dim, masked, seqlen_k))


def gluon_forward_default(head_dim: int, masked: bool, seqlen_k: int) -> bool:
    """Where the Gluon kernel beats the tl kernel's best tiles (H200, bf16, B·S = 16k, H = 16,
    3 interleaved rounds, session 16): D = 128 at every S but causal S = 1k (full 516 / 605 / 621
    TF/s against 418 / 489 / 524 at S = 1k / 4k / 16k; causal 306 / 531 / 619 against 340 / 438
    / 516); D = 64 from S = 4k full and 16k causal (434 / 446 against 400 / 404 full; causal 444
    against 390 at 16k, 358 against 369 at 4k; S = 1k 338 against 369). The switch points
    between the measured lengths (2k, 8k) are guesses."""
    if head_dim == 128:
        return not masked or seqlen_k >= 2048
    return seqlen_k >= (8192 if masked else 4096)


def gluon_exp2_fma_parts(head_dim: int, masked: bool) -> int:
    """1/8 of the Gluon kernel's exp2s on the FMA pipe at D = 64 without masks, none otherwise.
    At D = 64 a key block's GEMMs take half the tensor-core time of D = 128 while its exp2s do
    not shrink, so MUFU (16 ex2 per SM clock) limits: H200 sweeps (session 16, two runs, 3
    rounds each) full D = 64 421-449 TF/s with 1/8 against 387-410 without; causal D = 64 350 /
    420-430 with it against 354-358 / 435-444 at 4k / 16k (no mechanism found for the causal
    rows); D = 128 600-621 with it against 605-628 without (full), 504-512 / 581-599 against
    522-531 / 619-620 (causal)."""
    return 8 if head_dim <= 64 and not masked else 0


TL_ONLY_KEYS = ("BLOCK_M", "num_warps", "num_stages", "LOAD", "PV_LAG", "WARP_SPECIALIZE")


def _desc_strides(t: torch.Tensor) -> list[int]:
    """t's strides with size-1 dims given a 16-byte one (their coordinate is always 0, but TMA
    still checks the stride's alignment; torch leaves arbitrary strides on size-1 dims)."""
    unit = 16 // t.element_size()
    return [s if n > 1 else unit for n, s in zip(t.shape, t.stride())]


def descriptors_fit(*tensors: torch.Tensor) -> bool:
    """Every tensor non-empty, 16-byte aligned, with 16-byte aligned strides (TMA's rules)."""
    for t in tensors:
        if t.numel() == 0 or t.data_ptr() % 16 or t.stride(-1) != 1:
            return False
        if any((s * t.element_size()) % 16 for s in _desc_strides(t)[:-1]):
            return False
    return True


def _strides_fit(shape: tuple, strides: tuple, elem_size: int) -> bool:
    """:func:`descriptors_fit`'s stride rule for one tensor of a cached plan (size-1 dims exempt)."""
    return strides[-1] == 1 and all((st * elem_size) % 16 == 0 for n, st in zip(shape[:-1], strides[:-1]) if n > 1)


@cached_by_view
def _descriptor(t: torch.Tensor, load: str, rows: int, block_d: int) -> TensorDescriptor:
    """TMA descriptor of a [B, S, H, D] tensor for LOAD mode ``load`` (module docstring), cached
    (``cached_descriptor``)."""
    sb, ss, sh, _ = _desc_strides(t)
    b, s, h, d = t.shape
    if load == "desc_bhsd":
        return cached_descriptor(t, (b, h, s, d), (sb, sh, ss, 1), (1, 1, rows, block_d))
    return cached_descriptor(t, (b, s, h, d), (sb, ss, sh, 1), (1, rows, 1, block_d))


# ----------------------------------------------------------------------------------------------
# launcher (inputs already validated by the public function)
# ----------------------------------------------------------------------------------------------


class _ForwardPlan(NamedTuple):
    """Everything of one forward call that shapes, strides and options fix (cached: building it
    and Triton's own launch path cost ~150-250 µs of host time a call on the H200 host, session 22)."""
    lse_shape: tuple
    keys_exist: bool                # False: no key anywhere (out 0, lse -inf)
    gluon: dict | None              # the Gluon launcher's keyword arguments (None: the tl kernel)
    load: str                       # the tl kernel's LOAD mode
    blocks: tuple                   # (BLOCK_M, BLOCK_N, BLOCK_D): the tl kernel's descriptor boxes
    grid: tuple
    prepared: PreparedArgs | None   # the tl kernel's arguments after its 7 tensors


@functools.lru_cache(maxsize=512)
def _forward_plan(q_shape: tuple, k_shape: tuple, strides: tuple, dtype: torch.dtype, major: int, aligned: bool,
                  varlen: bool, batch: int, max_seqlen_q: int, max_seqlen_k: int, scale: float, window_left,
                  window_right, softcap: float, config: tuple, sms: int) -> _ForwardPlan:
    """The launch plan of :func:`attention_forward` (``strides``: q, k, v; ``sms``: the device's
    multiprocessors, for the program order)."""
    config = dict(config) or None
    head_dim = q_shape[-1]
    block_d = head_block(head_dim)
    bound = (max_seqlen_q + max_seqlen_k if varlen else q_shape[1] + k_shape[1]) + 1
    window_left, window_right = unbounded_past(window_left, bound), unbounded_past(window_right, bound)
    masked = window_left is not None or window_right is not None
    cfg = dict(fwd_tile_config(block_d, dtype, major > 0, masked, max_seqlen_k if varlen else k_shape[1]))
    cfg["LOAD"] = varlen_load_default(max_seqlen_k) if varlen else DEFAULT_DENSE_LOAD
    cfg["WARP_SPECIALIZE"] = False
    cfg.update(config or {})
    cfg.setdefault("EXP2_FMA_PARTS", exp2_fma_parts(cfg["BLOCK_N"]))
    cfg.setdefault("PV_LAG", pv_lag_default(cfg["BLOCK_N"]) and dtype != torch.float32)
    if cfg["EXP2_FMA_PARTS"] not in (0, 2, 4, 8) or cfg["EXP2_FMA_PARTS"] > cfg["BLOCK_N"]:
        raise ValueError(f"config EXP2_FMA_PARTS={cfg['EXP2_FMA_PARTS']!r}: one of 0, 2, 4, 8, at most BLOCK_N")
    if cfg["LOAD"] not in LOAD_MODES or (varlen and cfg["LOAD"] not in ("ptr", "desc_device")):
        raise ValueError(f"config LOAD={cfg['LOAD']!r}: one of {LOAD_MODES}; varlen takes 'ptr' or 'desc_device'")
    elem = dtype.itemsize
    if varlen:
        n_heads_q, total_q, n_heads_kv = q_shape[1], q_shape[0], k_shape[1]
        lse_shape, lse_strides = (n_heads_q, total_q), (0, total_q)
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        keys_exist = k_shape[0] > 0
        # packed tensors as [1, total, H, D] with batch stride 0 (sequences start at cu_seqlens rows)
        strides = tuple((0,) + st for st in strides)
        out_strides = (0, q_shape[1] * head_dim, head_dim)
    else:
        _, seqlen_q, n_heads_q, _ = q_shape
        seqlen_k, n_heads_kv = k_shape[1], k_shape[2]
        lse_shape, lse_strides = (batch, n_heads_q, seqlen_q), (n_heads_q * seqlen_q, seqlen_q)
        keys_exist = seqlen_k > 0
        out_strides = (seqlen_q * n_heads_q * head_dim, n_heads_q * head_dim, head_dim)
    q_numel = 1
    for n in q_shape:
        q_numel *= n
    shapes = (q_shape, k_shape, k_shape)
    # varlen strides carry the leading batch stride 0 added above: the tensors' own are st[1:]
    own = tuple(st[1:] for st in strides) if varlen else strides
    fits = (aligned and q_numel > 0 and k_shape[0] * k_shape[1] > 0
            and all(_strides_fit(sh, st, elem) for sh, st in zip(shapes, own)))
    if cfg["LOAD"] != "ptr" and not fits:
        cfg["LOAD"] = "ptr"
    load = cfg["LOAD"]
    has_softcap = softcap > 0
    score_scale = scale / softcap if has_softcap else scale * LOG2E
    if _use_gluon(major, dtype, head_dim, varlen, load, config, masked, k_shape[1]):
        from ._attention_fwd_gluon import WS_CONFIG   # Gluon imports on first use
        ws_keys = (*WS_CONFIG, "HEAD_GROUP")
        ws_cfg = dict(WS_CONFIG, **{key: config[key] for key in ws_keys if config and key in config})
        parts = (config or {}).get("EXP2_FMA_PARTS", gluon_exp2_fma_parts(head_dim, masked))
        gluon = dict(scale_arg=score_scale, softcap_log2=softcap * LOG2E, window_left=window_left,
                     window_right=window_right, has_softcap=has_softcap, exp2_fma_parts=parts, config=ws_cfg)
        return _ForwardPlan(lse_shape, keys_exist, gluon, load, (), (), None)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = schedule_grid(cdiv(seqlen_q, block_m), batch * n_heads_q, masked, sms, cfg.get("HEAD_GROUP"))
    prepared = attention_fwd_kernel.prepare(
        (*strides[0][:3], *strides[1][:3], *strides[2][:3], *out_strides, *lse_strides,
         seqlen_q, seqlen_k, n_heads_q, n_heads_q // n_heads_kv, score_scale, softcap * LOG2E,
         window_left if window_left is not None else 0, window_right if window_right is not None else 0),
        dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
             HAS_LEFT=window_left is not None, HAS_RIGHT=window_right is not None,
             HAS_SOFTCAP=has_softcap, IS_VARLEN=varlen, LOAD=load,
             DOT_PRECISION="ieee" if dtype == torch.float32 else None,
             REVERSE_M=window_right is not None, WARP_SPECIALIZE=cfg["WARP_SPECIALIZE"],
             FOLD_SCALE=score_scale > 0,
             EXP2_FMA_PARTS=cfg["EXP2_FMA_PARTS"] if dtype != torch.float32 else 0,
             PV_LAG=cfg["PV_LAG"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return _ForwardPlan(lse_shape, keys_exist, None, load, (block_m, block_n, block_d), grid, prepared)


def attention_forward(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, *, scale: float, window_left: Optional[int] = None,
                      window_right: Optional[int] = None, softcap: float = 0.0,
                      config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse). Dense: q [B, S_q, H_q, D], k/v [B, S_k, H_kv, D], lse [B, H_q, S_q]. Varlen
    (cu_seqlens given): packed [total, H, D], lse [H_q, total_q]. Window bounds: None for
    unbounded, any int otherwise (a negative right bound is allowed: the SDPA wrapper's top-left
    causal). On sm_90, dense 16-bit inputs with D = 64 / 128 take the warp-specialized Gluon
    kernel where it measured faster (:func:`_use_gluon`; its config keys: GLUON, BLOCK_N, STAGES,
    EXP2_FMA_PARTS). Otherwise
    ``config`` overrides fwd_tile_config's keys and may set LOAD, WARP_SPECIALIZE,
    EXP2_FMA_PARTS (default: :func:`exp2_fma_parts` of the BLOCK_N in use; fp32 inputs always
    take exact exp2s, as their tolerance is 1e-5) and PV_LAG (default: :func:`pv_lag_default`).
    Per call: a cached plan (:func:`_forward_plan`), two allocations, one launch."""
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    plan = _forward_plan(tuple(q.shape), tuple(k.shape), (q.stride(), k.stride(), v.stride()), q.dtype,
                         device_major(q), (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0, varlen, batch,
                         max_seqlen_q or 0, max_seqlen_k or 0, scale, window_left, window_right, softcap,
                         config_key(config), num_sms(q))
    if varlen:      # rows outside [cu[0], cu[-1]) (a padded packed buffer): out 0, lse -inf
        out = packed_output(q.shape, q.dtype, q.device, cu_seqlens_q)
        lse = packed_output(plan.lse_shape, torch.float32, q.device, cu_seqlens_q, float("-inf"), row_dim=1)
    else:
        out = empty(q.shape, q.dtype, q.device)
        lse = empty(plan.lse_shape, torch.float32, q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if not plan.keys_exist:    # no key anywhere: every row sees nothing (out 0, lse -inf)
        return out.zero_(), lse.fill_(float("-inf"))
    if plan.gluon is not None:
        from ._attention_fwd_gluon import launch_attention_fwd_ws
        launch_attention_fwd_ws(q, k, v, out, lse, **plan.gluon)
        return out, lse
    if 0 in plan.grid:
        return out, lse
    load = plan.load
    if load in ("ptr", "desc_device"):
        if load == "desc_device":
            use_device_descriptors()
        args = (q, k, v, out)           # pointers: the plan's strides say how to walk them
    else:
        block_m, block_n, block_d = plan.blocks
        args = (_descriptor(q, load, block_m, block_d), _descriptor(k, load, block_n, block_d),
                _descriptor(v, load, block_n, block_d), _descriptor(out, load, block_m, block_d))
    cu_q = cu_seqlens_q if varlen else lse     # any pointer: never read when not varlen
    cu_k = cu_seqlens_k if varlen else lse
    attention_fwd_kernel.launch_prepared(plan.grid, (*args, lse, cu_q, cu_k), plan.prepared)
    return out, lse


def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """(query, key) pairs a bottom-right causal mask keeps: query i sees keys j <= i + S_k - S_q,
    so max(0, i + S_k - S_q + 1) of them (the last query sees all S_k); S(S + 1) / 2 when square."""
    first = max(1, seqlen_k - seqlen_q + 1)          # the smallest positive count (of a query that sees any)
    return (first + seqlen_k) * (seqlen_k - first + 1) // 2 if seqlen_k >= first else 0


def attention_flops(batch: int, seqlen_q: int, seqlen_k: int, n_heads_q: int, head_dim: int,
                    causal: bool) -> int:
    """FlashAttention's convention, 4·D per (query, key) pair (q·k and p·v), over B·H pairs of
    S_q × S_k, or the pairs the bottom-right causal mask keeps (:func:`causal_pairs`: S(S + 1) / 2
    when square, within 1 / S of the usual halving; S_q ≠ S_k used to be counted unmasked)."""
    pairs = causal_pairs(seqlen_q, seqlen_k) if causal else seqlen_q * seqlen_k
    return 4 * batch * n_heads_q * head_dim * pairs

