"""Gluon int4 kernel for few rows of x (decode, M = 1..32): the weight goes from global memory
straight into the tensor-core operand registers, with no pass through shared memory.

Why: the ``tl`` kernels of ``_quant_kernels`` spend 4.4 (GEMV, CUDA-core FMA) and 6.5 (tensor
cores, a layout change through shared memory) SASS instructions per int4 value, and on the H200
reached 32-53 % of copy bandwidth at M = 1 (benchmarks/NOTES.md, sessions 8 and 11). Here a value
costs about 1.6: one PRMT + LOP3 + HFMA2 per two values (``_dequant_int4_asm`` unscaled), and the
multiply-add is the MMA's.

**The layout trick.** ``mma.sync.m16n8k16``'s A fragment gives lane ``(g, t)`` (g = lane / 4,
t = lane % 4) of each warp the rows ``g`` and ``g + 8`` and the k pairs ``2t, 2t + 1`` and
``2t + 8, 2t + 9`` of each 16-column step. A dot product does not care in which order k is
summed as long as x is summed in the same order, so the kernel *relabels* k: lane t loads
``JW = GROUP / 32`` consecutive int32 words (a 16-byte vector at group 128) of rows g and g + 8,
physical columns ``32·JW·t/4 ..`` of the group, and the dequantized values are arranged (join,
reshape, permute: register renames only, ``convert_layout(..., assert_trivial=True)`` checks it
at compile time) so that their register/lane/warp positions *are* the A fragment's, under a
logical column ``k'``. x is loaded by physical column (16-byte vectors: a lane's columns are contiguous) and relabeled
the same way (:func:`_relabel_k`), which makes it the B fragment. The packed weight keeps the one format every other kernel reads.

**Math per group** (exact up to the fp32 sums): ``y[m, n] += s[n, g] · Σ_{k in g} (q[n, k] −
z[n, g]) · x[m, k]``: ``q − z`` is exact in bf16 / fp16 (|q − z| ≤ 15), the MMA sums exact
products in fp32, and the group's partial is scaled in fp32: the same quantity as the ``tl``
GEMV's ``Σ_g s (Σ q x − z Σ x)``, more precise than multiplying by the dequantized weight rounded
to 16 bits (the PyTorch peer, within the tests' bound of it).

**Work split.** A program owns ``BLOCK_N = 16·WARPS_N·REPS`` weight rows and a range of groups
along K. The tensors carry a leading *group slot* axis of ``SLOTS = GROUPS_PER_STEP·WARPS_K``:
warps along it take different groups of the same rows (split-K inside the program; the slots
are summed through shared memory once, at the end), registers along it take several groups per
step. The next step's words, x, zero points and scales are loaded before this step's math (one
step of prefetch in registers). Split-K across programs (grid axis 1) writes fp32 partials that
``splitk_reduce_kernel`` sums in order (deterministic, as the ``tl`` kernels).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .._launch import fast_launch
from ._quant_kernels import DEQUANT_ARGS, _dequant_int4_asm

_Q_MINUS_Z_BF16 = gl.constexpr(_dequant_int4_asm(*DEQUANT_ARGS["bf16"], scaled=False))
_Q_MINUS_Z_FP16 = gl.constexpr(_dequant_int4_asm(*DEQUANT_ARGS["fp16"], scaled=False))
_Q_MINUS_Z_CONSTRAINTS = gl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r")


def _log2(v: int) -> int:
    assert v > 0 and v & (v - 1) == 0, v
    return v.bit_length() - 1


@functools.lru_cache(maxsize=None)
def mma_layouts(group: int, slots: int, warps_k: int, warps_n: int, reps: int, mma_n: int, steps: int):
    """(words, MMA, x, per-row) layouts of a program's tiles: words ``[slots, BLOCK_N, GROUP / 8]``
    int32, accumulators ``[slots, BLOCK_N, MMA_N]``, x pairs ``[slots, GROUP / 2, MMA_N]`` and the
    zero points / scales of all steps ``[slots, BLOCK_N, steps]``. The words layout puts a lane's
    JW words of a row in registers (one vector load), the lane's t on the word axis, g on the row
    axis, row + 8 in a register, the warps on rows then slots, like the A fragment of ``mma.sync``
    (see the module docstring); :func:`int4_mma_kernel` checks the match when it compiles. The
    per-row layout holds a row's steps in registers (one vector load per row), on the threads
    that hold the row in both the words and the accumulator."""
    jw = group // 32                                    # words per lane and row (1, 2, 4)
    rows = [[0, 8, 0]] + [[0, 16 * warps_n << i, 0] for i in range(_log2(reps))]
    slot_regs = [[warps_k << i, 0, 0] for i in range(_log2(slots // warps_k))]
    lane_rows = [[0, 1, 0], [0, 2, 0], [0, 4, 0]]
    warp = [[0, 16 << i, 0] for i in range(_log2(warps_n))] + [[1 << i, 0, 0] for i in range(_log2(warps_k))]
    block_n = 16 * warps_n * reps
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(_log2(jw))] + rows + slot_regs,
        lane_bases=[[0, 0, jw], [0, 0, 2 * jw]] + lane_rows, warp_bases=warp, block_bases=[],
        shape=[slots, block_n, group // 8])
    per_row = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(_log2(steps))] + rows + slot_regs,
        lane_bases=[[0, 0, 0], [0, 0, 0]] + lane_rows, warp_bases=warp, block_bases=[],
        shape=[slots, block_n, steps])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps_k, warps_n, 1], instr_shape=[1, 16, 8])
    return words, mma, x_load_layout(group, slots, warps_k, warps_n, mma_n), per_row


@gluon.jit
def _pack2(h):
    """The bits of a 16-bit float tensor, twice, in an int32 (an fp16x2 / bf16x2 operand)."""
    b = h.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return b | (b << 16)


@gluon.jit
def _q_minus_z(words, nz, DTYPE: gl.constexpr):
    """``[SLOTS, BLOCK_N, GROUP]`` ``q − z`` (exact, DTYPE) of the words ``[SLOTS, BLOCK_N,
    GROUP / 8]``, in the logical column order k' = ib0 + 2t + 8·ib1 + 16·ib2 + 32·jw (nibble
    ``i = ib0 + 2·ib1 + 4·ib2`` of word ``JW·t + jw``): ``nz`` is ``-(magic + z)`` packed twice."""
    if DTYPE == gl.bfloat16:
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _Q_MINUS_Z_BF16, _Q_MINUS_Z_CONSTRAINTS, [words, nz],
            (gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
            True, 1)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _Q_MINUS_Z_FP16, _Q_MINUS_Z_CONSTRAINTS, [words, nz],
            (gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
            True, 1)
    SLOTS: gl.constexpr = words.shape[0]
    BLOCK_N: gl.constexpr = words.shape[1]
    WORDS: gl.constexpr = words.shape[2]
    v = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
    v = gl.permute(v, [0, 1, 2, 5, 4, 3])                                # (slot, n, word, ib2, ib1, ib0)
    return _relabel_k(gl.reshape(v, [SLOTS, BLOCK_N, 8 * WORDS]), 2)


@gluon.jit
def _relabel_k(v, AXIS: gl.constexpr):
    """Physical column ``p = 8·(JW·t + jw) + ib0 + 2·ib1 + 4·ib2`` of axis AXIS (1 or 2, of a rank-3
    tensor) to the logical ``k' = ib0 + 2t + 8·ib1 + 16·ib2 + 32·jw`` the MMA fragments use:
    a reshape, a permute and a reshape (no data moves)."""
    D0: gl.constexpr = v.shape[0]
    D1: gl.constexpr = v.shape[1]
    D2: gl.constexpr = v.shape[2]
    if AXIS == 1:
        JW: gl.constexpr = D1 // 32
        v = gl.reshape(v, [D0, 4, JW, 2, 2, 2, D2])                       # (slot, t, jw, ib2, ib1, ib0, m)
        v = gl.permute(v, [0, 2, 3, 4, 1, 5, 6])                          # (slot, jw, ib2, ib1, t, ib0, m)
        return gl.reshape(v, [D0, D1, D2])
    else:
        JW: gl.constexpr = D2 // 32
        v = gl.reshape(v, [D0, D1, 4, JW, 2, 2, 2])                       # (slot, n, t, jw, ib2, ib1, ib0)
        v = gl.permute(v, [0, 1, 3, 4, 5, 2, 6])                          # (slot, n, jw, ib2, ib1, t, ib0)
        return gl.reshape(v, [D0, D1, D2])


def x_load_layout(group: int, slots: int, warps_k: int, warps_n: int, mma_n: int) -> gl.DistributedLinearLayout:
    """x as int32 pairs ``[slots, GROUP / 2, MMA_N]`` (pair ``j`` = columns ``2j, 2j + 1``): lane
    ``(g, t)`` keeps the ``4·JW`` contiguous pairs of quarter t of the group in registers (16-byte
    loads at group 128), row g of x (further n8 steps in registers), warps on slots (the row warps
    hold copies). Unpacked and relabeled (:func:`_x_fragment`) it is the B fragment."""
    jw = group // 32
    reg = ([[0, 1 << i, 0] for i in range(_log2(4 * jw))] + [[0, 0, 8 << i] for i in range(_log2(mma_n // 8))]
           + [[warps_k << i, 0, 0] for i in range(_log2(slots // warps_k))])
    lane = [[0, 4 * jw, 0], [0, 8 * jw, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]]
    warp = [[0, 0, 0]] * _log2(warps_n) + [[1 << i, 0, 0] for i in range(_log2(warps_k))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[slots, group // 2, mma_n])


@gluon.jit
def _x_fragment(pairs, B_LAYOUT: gl.constexpr, DTYPE: gl.constexpr):
    """The B fragment ``[SLOTS, GROUP, MMA_N]`` (logical k') of x read as int32 pairs: each pair
    split into its two 16-bit halves (a register-half rename in PTX), physical column order
    restored, relabeled as the weight's columns."""
    if DTYPE == gl.bfloat16:
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs], (gl.bfloat16, gl.bfloat16),
                                           True, 1)
    else:
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs], (gl.float16, gl.float16),
                                           True, 1)
    D0: gl.constexpr = pairs.shape[0]
    D1: gl.constexpr = pairs.shape[1]
    D2: gl.constexpr = pairs.shape[2]
    v = gl.reshape(gl.permute(gl.join(lo, hi), [0, 1, 3, 2]), [D0, 2 * D1, D2])
    return gl.convert_layout(_relabel_k(v, 1), B_LAYOUT, assert_trivial=True)


@fast_launch
@gluon.jit
def int4_mma_kernel(
    x_ptr,              # *x [M, K] bf16 / fp16, unit K stride, rows on 4-byte boundaries (read as int32 pairs)
    qw_ptr,             # *packed int4 weight uint8 [N, K / 2] (two values per byte along K), 16-byte aligned rows
    scales_ptr,         # *scales [N, K / GROUP], x's dtype
    zeros_ptr,          # *zero points uint8 [N, K / GROUP]
    bias_ptr,           # *bias [N] (read only when HAS_BIAS and not SPLIT)
    y_ptr,              # *y [M, N], x's dtype (written when not SPLIT)
    partial_ptr,        # *fp32 partials [splits, M, N] (written when SPLIT)
    M,                  # rows of x (1 <= M <= MMA_N)
    N,                  # output features
    n_groups,           # K / GROUP (>= 1)
    stride_xm,          # elements between rows of x
    stride_qw,          # int32 words between rows of the packed weight (bytes / 4)
    stride_sn,          # elements between rows of scales / zeros
    stride_ym,          # elements between rows of y
    GROUP: gl.constexpr,            # int4 group along K: 32, 64 or 128
    MMA_N: gl.constexpr,            # rows of x padded to the MMA's N: 8, 16 or 32
    WORDS_LAYOUT: gl.constexpr,     # mma_layouts(...)[0]
    MMA_LAYOUT: gl.constexpr,       # mma_layouts(...)[1]
    X_LAYOUT: gl.constexpr,         # mma_layouts(...)[2]
    ROW_LAYOUT: gl.constexpr,       # mma_layouts(...)[3]
    SLOTS: gl.constexpr,            # groups in flight per step: GROUPS_PER_STEP x WARPS_K
    STEPS: gl.constexpr,            # steps per program (unrolled): SLOTS x STEPS groups of K per program
    EVEN_GROUPS: gl.constexpr,      # SLOTS x STEPS divides n_groups (no clamped group: vector loads of z, s)
    BLOCK_N: gl.constexpr,          # weight rows per program: 16 x WARPS_N x REPS
    HAS_BIAS: gl.constexpr,
    SPLIT: gl.constexpr,            # write fp32 partials (more than one split) instead of y
    PRELOAD: gl.constexpr,          # every step's weight words in flight at once (cp.async into shared memory)
):
    """``y[m, n] = Σ_g s[n, g] · Σ_{k in g} (q[n, k] − z[n, g]) · x[m, k]`` for ``BLOCK_N`` rows n
    and the groups ``[pid_s · SLOTS · STEPS, ...)`` of K (slot b takes STEPS consecutive ones:
    its zero points and scales are one vector load per row); grid ``(cdiv(N, BLOCK_N), splits)``."""
    DTYPE: gl.constexpr = x_ptr.dtype.element_ty
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(0, MMA_LAYOUT, 2)
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(1, MMA_LAYOUT, 2)
    WORDS: gl.constexpr = GROUP // 8
    MAGIC: gl.constexpr = 128.0 if DTYPE == gl.bfloat16 else 1024.0
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    g_begin = pid_s * (SLOTS * STEPS)
    g_last = gl.minimum(g_begin + SLOTS * STEPS, n_groups) - 1
    # Every load but the scales' reads a valid address without a mask: rows past N, groups past
    # the range and rows of x past M are clamped to the last valid one. A clamped group's scale
    # is 0 (its finite product counts 0), clamped rows' outputs are not stored.

    # weight words [SLOTS, BLOCK_N, WORDS]
    SW: gl.constexpr = gl.SliceLayout(2, WORDS_LAYOUT)
    w_first = g_begin + STEPS * gl.arange(0, SLOTS, layout=gl.SliceLayout(1, SW))[:, None]   # each slot's first group
    w_rows = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, SW)), N - 1)[None, :]
    w_word = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS_LAYOUT)))[None, None, :]
    qw_rows = qw_ptr.to(gl.pointer_type(gl.int32)) + (w_rows.to(gl.int64) * stride_qw)[:, :, None] + w_word
    # zero points and scales of every step [SLOTS, BLOCK_N, STEPS], loaded once
    SR: gl.constexpr = gl.SliceLayout(2, ROW_LAYOUT)
    r_rows = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, SR)), N - 1)[None, :, None]
    r_step = gl.arange(0, STEPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, ROW_LAYOUT)))[None, None, :]
    r_group = g_begin + STEPS * gl.arange(0, SLOTS, layout=gl.SliceLayout(1, SR))[:, None, None] + r_step
    if EVEN_GROUPS:            # no group past the range: a slot's steps are one contiguous vector per row
        r_offs = r_rows.to(gl.int64) * stride_sn + r_group
        z_all = gl.load(zeros_ptr + r_offs)
        s_all = gl.load(scales_ptr + r_offs).to(gl.float32)
    else:
        r_offs = r_rows.to(gl.int64) * stride_sn + gl.minimum(r_group, g_last)
        z_all = gl.load(zeros_ptr + r_offs)
        s_all = gl.load(scales_ptr + r_offs, mask=r_group <= g_last, other=0.0).to(gl.float32)
    nz_all = _pack2((-(z_all.to(gl.float32) + MAGIC)).to(DTYPE))                            # -(magic + z), twice
    # x as int32 pairs [SLOTS, GROUP / 2, MMA_N]: a lane's pairs are contiguous (vector loads)
    SX: gl.constexpr = gl.SliceLayout(2, X_LAYOUT)
    x_first = g_begin + STEPS * gl.arange(0, SLOTS, layout=gl.SliceLayout(1, SX))[:, None, None]
    x_pair = gl.arange(0, GROUP // 2, layout=gl.SliceLayout(0, SX))[None, :, None]
    x_m = gl.minimum(gl.arange(0, MMA_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_LAYOUT))), M - 1)[None, None, :]
    x_rows = x_ptr.to(gl.pointer_type(gl.int32)) + x_m.to(gl.int64) * (stride_xm // 2) + x_pair

    if PRELOAD:
        # all the program's weight bytes in flight at once: one cp.async group per step into
        # [STEPS, SLOTS, BLOCK_N, WORDS] (64-byte rows at group 128: conflict-free 16-byte reads),
        # each thread copying the words it will read (no barrier: its own copies, after the wait)
        w_smem = gl.allocate_shared_memory(gl.int32, [STEPS, SLOTS, BLOCK_N, WORDS],
                                           gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
        for j in gl.static_range(STEPS):
            async_copy.async_copy_global_to_shared(
                w_smem.index(j), qw_rows + (gl.minimum(w_first + j, g_last) * WORDS)[:, :, None])
            async_copy.commit_group()
    else:
        words = gl.load(qw_rows + (gl.minimum(w_first, g_last) * WORDS)[:, :, None])
    xp = gl.load(x_rows + gl.minimum(x_first, g_last) * (GROUP // 2))
    acc = gl.zeros([SLOTS, BLOCK_N, MMA_N], gl.float32, MMA_LAYOUT)
    zero = gl.zeros([SLOTS, BLOCK_N, MMA_N], gl.float32, MMA_LAYOUT)
    for j in gl.static_range(STEPS):
        if j + 1 < STEPS:      # the next step's operands first (clamped past the range), then this step's math
            if not PRELOAD:
                words_next = gl.load(qw_rows + (gl.minimum(w_first + (j + 1), g_last) * WORDS)[:, :, None])
            xp_next = gl.load(x_rows + gl.minimum(x_first + (j + 1), g_last) * (GROUP // 2))
        if PRELOAD:            # step j's words have landed once at most the later steps' groups are pending
            async_copy.wait_group(STEPS - 1 - j)
            words = w_smem.index(j).load(WORDS_LAYOUT)
        nz = gl.convert_layout(gl.sum(gl.where(r_step == j, nz_all, 0), axis=2), SW, assert_trivial=True)
        q = gl.convert_layout(_q_minus_z(words, nz[:, :, None], DTYPE), A_LAYOUT, assert_trivial=True)
        part = mma_v2(q, _x_fragment(xp, B_LAYOUT, DTYPE), zero)
        s = gl.convert_layout(gl.sum(gl.where(r_step == j, s_all, 0.0), axis=2), gl.SliceLayout(2, MMA_LAYOUT),
                              assert_trivial=True)
        acc += part * s[:, :, None]
        if j + 1 < STEPS:
            if not PRELOAD:
                words = words_next
            xp = xp_next

    out = gl.sum(acc, axis=0)                             # the slots' groups: [BLOCK_N, MMA_N]
    store_yt(out, n0, pid_s, M, N, bias_ptr, y_ptr, partial_ptr, stride_ym, HAS_BIAS, SPLIT)


@gluon.jit
def store_yt(out, n0, pid_s, M, N, bias_ptr, y_ptr, partial_ptr, stride_ym, HAS_BIAS: gl.constexpr,
             SPLIT: gl.constexpr):
    """Store ``out`` = yᵀ ``[BLOCK_N, MMA_N]`` (fp32, any layout) for weight rows ``n0 ..``: as
    split ``pid_s``'s fp32 partials (SPLIT), else plus the bias, as y in y's dtype; rows past N and
    columns past M are not stored."""
    BLOCK_N: gl.constexpr = out.shape[0]
    MMA_N: gl.constexpr = out.shape[1]
    SO: gl.constexpr = out.type.layout
    o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SO))[:, None]
    o_m = gl.arange(0, MMA_N, layout=gl.SliceLayout(0, SO))[None, :]
    mask = (o_n < N) & (o_m < M)
    if SPLIT:
        gl.store(partial_ptr + (pid_s * M + o_m).to(gl.int64) * N + o_n, out, mask=mask)
    else:
        if HAS_BIAS:
            out += gl.load(bias_ptr + o_n, mask=o_n < N, other=0.0).to(gl.float32)
        gl.store(y_ptr + o_m.to(gl.int64) * stride_ym + o_n, out.to(y_ptr.dtype.element_ty), mask=mask)
