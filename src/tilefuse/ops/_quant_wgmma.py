"""Gluon int4 GEMM for a few rows of x on Hopper (M = 1..64, group 128): warpgroup MMA with the
dequantized weight as the register A operand and x, relabeled, resident in shared memory.

Why another int4 kernel: at M = 16 the ``mma.sync`` kernel of ``_quant_gluon`` took twice its
M = 1 time for the same weight bytes (H200, session 20). There each warp loads its own copy of
x's B fragment for every step, MMA_N·2 bytes per column against the weight's 16·REPS / 2: at
M = 16 and 16 rows per warp, four bytes of x through L1 for every byte of weight, and L1 was the
busy unit at M = 1 already. Here x is read from global memory once per program, relabeled,
stored into shared memory, and read by the tensor core from there (``wgmma``'s B operand is
shared by the warp group's four warps); only the weight goes through the registers.

**Counted per weight value** (int4, group 128, M rows of x): HBM 0.5 bytes of weight + 3/128 of
zero point and scale; x is M·(its K range)·2 bytes per program from L2: M·K·2 per row block of
BLOCK_N in all (at N×K = 14336×4096, M = 16 and the default 64 rows per program, 224 row blocks:
29 MB of L2 reads beside 29.4 MB of weight from HBM; 128 rows per program halve it, but ran slower).
FLOPs 2·M per value. Instructions per value: PRMT + LOP3 + 2 HFMA2 per two values (the scaled
dequantization of ``_quant_kernels._dequant_int4_asm``: ``(q − z)·s`` rounded once to x's dtype,
the weight ``dequantize_weight`` gives, so y is the PyTorch peer's product with fp32 sums).

**Layout.** The k relabeling of ``_quant_gluon``: lane ``(g, t)`` loads the 4 consecutive int32
words (16 bytes) of rows ``g`` and ``g + 8`` at physical columns ``32t .. 32t + 31`` of the group,
and reshapes and permutes (register renames) make them the A fragment under a logical column
``k' = ib0 + 2t + 8·ib1 + 16·ib2 + 32·jw``; ``convert_layout(..., assert_trivial=True)`` proves it
when the kernel compiles. wgmma's A fragment in each warp is ``mma.sync``'s (16 rows per warp,
warps stacked along M). x is stored in shared memory under the same relabeling, so the MMA's sum
over k' is the sum over k.

**Pipeline.** The weight words of a step (one group of 128 columns of BLOCK_N rows) go through a
ring of STAGES steps in shared memory by ``cp.async``, each thread copying the words it will read
(no barrier: its own copies after its own wait), so STAGES − 1 steps of weight are in flight
whatever the register budget. Zero points and scales come per CHUNK steps as one vector per row.
The wgmma of a step runs while the next step is dequantized (one MMA group in flight). Split-K
over grid axis 1 writes fp32 partials that ``splitk_reduce_kernel`` sums in order (no atomics).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .._launch import fast_launch
from ._quant_gluon import _log2, _pack2, store_yt
from ._quant_kernels import DEQUANT_ARGS, _dequant_int4_asm

GROUP = gl.constexpr(128)   # int4 group along K served here (one group per step)
WORDS = gl.constexpr(16)    # int32 words per row and step
_DEQ_BF16 = gl.constexpr(_dequant_int4_asm(*DEQUANT_ARGS["bf16"]))
_DEQ_FP16 = gl.constexpr(_dequant_int4_asm(*DEQUANT_ARGS["fp16"]))
_DEQ_CONSTRAINTS = gl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r")


@functools.lru_cache(maxsize=None)
def wgmma_layouts(num_warps: int, reps: int, mma_n: int, chunk: int):
    """(words, per-row, accumulator, x-load) layouts: words ``[BLOCK_N, 16]`` int32 (lane t on
    word bits 2-3, its 4 words in registers: one 16-byte load per row; g on rows 1-4, row + 8 in
    a register, warps on rows 16, 32, (64), REPS row blocks of 16·num_warps in registers: the A
    fragment of a warp-group MMA, see the module docstring); per-row ``[BLOCK_N, CHUNK]`` (a
    row's CHUNK zero points / scales in registers of the threads that hold the row); the wgmma
    accumulator ``[BLOCK_N, MMA_N]``; and x ``[X_UNROLL, MMA_N, GROUP]`` loaded 16 bytes per thread."""
    block_n = 16 * num_warps * reps
    rows_reg = [[8, 0]] + [[16 * num_warps << i, 0] for i in range(_log2(reps))]
    lane_rows = [[1, 0], [2, 0], [4, 0]]
    warp = [[16 << i, 0] for i in range(_log2(num_warps))]
    words = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]] + rows_reg, lane_bases=[[0, 4], [0, 8]] + lane_rows,
                                       warp_bases=warp, block_bases=[], shape=[block_n, WORDS])
    per_row = gl.DistributedLinearLayout(reg_bases=[[0, 1 << i] for i in range(_log2(chunk))] + rows_reg,
                                         lane_bases=[[0, 0], [0, 0]] + lane_rows, warp_bases=warp, block_bases=[],
                                         shape=[block_n, chunk])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, mma_n, 16])
    x_load = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [1, num_warps, 1], [2, 1, 0])
    return words, per_row, acc, x_load


@gluon.jit
def _dequant(words, nz, s2, DTYPE: gl.constexpr):
    """``[BLOCK_N, 8·WORDS]`` ``(q − z)·s`` in DTYPE of the int32 words ``[BLOCK_N, WORDS]``, in
    the physical column order (nibble i of word w is column 8w + i); ``nz`` = ``-(magic + z)`` and
    ``s2`` = s, each packed twice in an int32, broadcastable to ``words``."""
    if DTYPE == gl.bfloat16:
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _DEQ_BF16, _DEQ_CONSTRAINTS, [words, nz, s2],
            (gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
            True, 1)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _DEQ_FP16, _DEQ_CONSTRAINTS, [words, nz, s2],
            (gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
            True, 1)
    BLOCK_N: gl.constexpr = words.shape[0]
    v = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
    v = gl.permute(v, [0, 1, 4, 3, 2])                                   # (n, word, ib2, ib1, ib0)
    return gl.reshape(v, [BLOCK_N, 8 * WORDS])


@gluon.jit
def _relabel(v):
    """Physical column ``p = 8·(4t + jw) + ib0 + 2·ib1 + 4·ib2`` (a group of 128) of the last axis
    of a rank-2 or rank-3 tensor to the logical ``k' = ib0 + 2t + 8·ib1 + 16·ib2 + 32·jw`` of the
    MMA fragments (reshape, permute, reshape: no data moves)."""
    if len(v.shape) == 2:
        D0: gl.constexpr = v.shape[0]
        D1: gl.constexpr = v.shape[1]
        v = gl.reshape(v, [D0, 4, 4, 2, 2, 2])                            # (n, t, jw, ib2, ib1, ib0)
        v = gl.permute(v, [0, 2, 3, 4, 1, 5])                             # (n, jw, ib2, ib1, t, ib0)
        return gl.reshape(v, [D0, D1])
    else:
        E0: gl.constexpr = v.shape[0]
        E1: gl.constexpr = v.shape[1]
        E2: gl.constexpr = v.shape[2]
        v = gl.reshape(v, [E0, E1, 4, 4, 2, 2, 2])                        # (s, m, t, jw, ib2, ib1, ib0)
        v = gl.permute(v, [0, 1, 3, 4, 5, 2, 6])                          # (s, m, jw, ib2, ib1, t, ib0)
        return gl.reshape(v, [E0, E1, E2])


@gluon.jit
def _fill_x(x_ptr, x_smem, M, stride_xm, g_begin, g_last, MMA_N: gl.constexpr, X_LAYOUT: gl.constexpr,
            X_STEPS: gl.constexpr, X_UNROLL: gl.constexpr):
    """x, relabeled, for the program's groups into ``x_smem`` ``[2·X_STEPS, MMA_N, 64]``: per step two
    ``[MMA_N, 64]`` halves (128-byte rows, one 128-byte swizzle span, so the 2-D tiles and the 3-D
    fill view lay out the same bytes), X_UNROLL steps per load (their 16-byte loads all in flight
    before the stores). Groups past ``g_last`` and rows past M are clamped (finite, unused)."""
    DTYPE: gl.constexpr = x_ptr.dtype.element_ty
    x_fill = x_smem._reinterpret(DTYPE, [X_STEPS // X_UNROLL, 2 * X_UNROLL, MMA_N, GROUP // 2],
                                 gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
    xs = gl.arange(0, X_UNROLL, layout=gl.SliceLayout(1, gl.SliceLayout(2, X_LAYOUT)))[:, None, None]
    xm = gl.minimum(gl.arange(0, MMA_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, X_LAYOUT))), M - 1)[None, :, None]
    xk = gl.arange(0, GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_LAYOUT)))[None, None, :]
    x_rows = x_ptr + xm.to(gl.int64) * stride_xm + xk
    for i in range(0, X_STEPS, X_UNROLL):
        v = gl.load(x_rows + (gl.minimum(g_begin + i + xs, g_last) * GROUP))
        v = gl.permute(gl.reshape(_relabel(v), [X_UNROLL, MMA_N, 2, GROUP // 2]), [0, 2, 1, 3])
        x_fill.index(i // X_UNROLL).store(gl.reshape(v, [2 * X_UNROLL, MMA_N, GROUP // 2]))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _chunk_params(scales_ptr, zeros_ptr, r_rows, r_step, g_first, g_last, DTYPE: gl.constexpr):
    """``(-(magic + z), s)`` packed twice per int32, ``[BLOCK_N, CHUNK]``, for the CHUNK groups from
    ``g_first``: one vector load per row each; a group past ``g_last`` gets scale 0."""
    MAGIC: gl.constexpr = 128.0 if DTYPE == gl.bfloat16 else 1024.0
    r_group = g_first + r_step
    r_offs = r_rows + gl.minimum(r_group, g_last)
    z_all = gl.load(zeros_ptr + r_offs).to(gl.float32)
    s_all = gl.load(scales_ptr + r_offs, mask=r_group <= g_last, other=0.0)
    return _pack2((-(z_all + MAGIC)).to(DTYPE)), _pack2(s_all.to(DTYPE))


@gluon.jit
def _step_mma(acc, words, nz_all, s2_all, j: gl.constexpr, r_step, x_smem, xi, SW: gl.constexpr,
              A_LAYOUT: gl.constexpr):
    """``acc`` plus one step: the words ``[BLOCK_N, 16]`` dequantized with column ``j`` of the
    chunk's packed zero points / scales, relabeled into two A fragments (k' < 64, k' ≥ 64) against
    x's halves ``xi``, ``xi + 1``; returns once the previous step's pair is done (this one in flight)."""
    DTYPE: gl.constexpr = x_smem.dtype
    BLOCK_N: gl.constexpr = words.shape[0]
    nz = gl.convert_layout(gl.sum(gl.where(r_step == j, nz_all, 0), axis=1), SW, assert_trivial=True)
    s2 = gl.convert_layout(gl.sum(gl.where(r_step == j, s2_all, 0), axis=1), SW, assert_trivial=True)
    q = _relabel(_dequant(words, nz[:, None], s2[:, None], DTYPE))
    q0, q1 = gl.split(gl.permute(gl.reshape(q, [BLOCK_N, 2, GROUP // 2]), [0, 2, 1]))
    acc = warpgroup_mma(gl.convert_layout(q0, A_LAYOUT, assert_trivial=True),
                        x_smem.index(xi).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(gl.convert_layout(q1, A_LAYOUT, assert_trivial=True),
                        x_smem.index(xi + 1).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=2, deps=(acc,))


@gluon.jit
def _program_groups(n_groups, groups_per_split):
    """(first group, groups, last group) of this program's K range (grid axis 1)."""
    g_begin = gl.program_id(1) * groups_per_split
    g_count = gl.minimum(groups_per_split, n_groups - g_begin)
    return g_begin, g_count, g_begin + g_count - 1


@fast_launch
@gluon.jit
def int4_wgmma_kernel(
    x_ptr,              # *x [M, K] bf16 / fp16, unit K stride
    qw_ptr,             # *packed int4 weight uint8 [N, K / 2], 16-byte aligned rows
    scales_ptr,         # *scales [N, K / GROUP], x's dtype
    zeros_ptr,          # *zero points uint8 [N, K / GROUP]
    bias_ptr,           # *bias [N] (read only when HAS_BIAS and not SPLIT)
    y_ptr,              # *y [M, N], x's dtype (written when not SPLIT)
    partial_ptr,        # *fp32 partials [splits, M, N] (written when SPLIT)
    M,                  # rows of x (1 <= M <= MMA_N)
    N,                  # output features
    n_groups,           # K / GROUP (>= 1)
    groups_per_split,   # groups per program along grid axis 1 (a multiple of CHUNK)
    stride_xm,          # elements between rows of x
    stride_qw,          # int32 words between rows of the packed weight (bytes / 4)
    stride_sn,          # elements between rows of scales / zeros
    stride_ym,          # elements between rows of y
    MMA_N: gl.constexpr,            # rows of x padded to the wgmma N: 8, 16, 32 or 64
    WORDS_LAYOUT: gl.constexpr,     # wgmma_layouts(...)[0]
    ROW_LAYOUT: gl.constexpr,       # wgmma_layouts(...)[1]
    ACC_LAYOUT: gl.constexpr,       # wgmma_layouts(...)[2]
    X_LAYOUT: gl.constexpr,         # wgmma_layouts(...)[3]
    X_STEPS: gl.constexpr,          # steps of x resident in shared memory (>= groups_per_split; X_UNROLL divides it)
    X_UNROLL: gl.constexpr,         # steps of x per load in the prologue
    CHUNK: gl.constexpr,            # steps per unrolled loop body (their z / s one vector per row)
    STAGES: gl.constexpr,           # weight steps in the cp.async ring (divides CHUNK)
    BLOCK_N: gl.constexpr,          # weight rows per program: 16 x num_warps x REPS
    HAS_BIAS: gl.constexpr,
    SPLIT: gl.constexpr,            # write fp32 partials (more than one split) instead of y
):
    """``y[m, n] = Σ_k x[m, k] · (q[n, k] − z[n, k / 128]) · s[n, k / 128]`` (the weight rounded to
    x's dtype) for BLOCK_N rows n and the groups ``[pid_s · groups_per_split, ...)`` of K; grid
    ``(cdiv(N, BLOCK_N), splits)``."""
    DTYPE: gl.constexpr = x_ptr.dtype.element_ty
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(0, ACC_LAYOUT, 2)
    n0 = gl.program_id(0) * BLOCK_N
    g_begin, g_count, g_last = _program_groups(n_groups, groups_per_split)
    # rows past N, groups past the range and rows of x past M are clamped to the last valid one
    # (valid addresses, no masks); a clamped group's scale is 0, clamped rows are not stored
    x_smem = gl.allocate_shared_memory(DTYPE, [2 * X_STEPS, MMA_N, GROUP // 2],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    # weight words ring [STAGES, BLOCK_N, WORDS], one 64-byte row per (stage, row): 16-byte reads
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    SW: gl.constexpr = gl.SliceLayout(1, WORDS_LAYOUT)
    w_rows = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=SW), N - 1)
    qw_rows = (qw_ptr.to(gl.pointer_type(gl.int32)) + (w_rows.to(gl.int64) * stride_qw)[:, None]
               + gl.arange(0, WORDS, layout=gl.SliceLayout(0, WORDS_LAYOUT))[None, :])
    for p in gl.static_range(STAGES - 1):       # the first steps' words in flight before x
        async_copy.async_copy_global_to_shared(w_smem.index(p), qw_rows + gl.minimum(g_begin + p, g_last) * WORDS)
        async_copy.commit_group()
    _fill_x(x_ptr, x_smem, M, stride_xm, g_begin, g_last, MMA_N, X_LAYOUT, X_STEPS, X_UNROLL)

    SR: gl.constexpr = gl.SliceLayout(1, ROW_LAYOUT)
    r_rows = (gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=SR), N - 1).to(gl.int64) * stride_sn)[:, None]
    r_step = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, ROW_LAYOUT))[None, :]
    acc = gl.zeros([BLOCK_N, MMA_N], gl.float32, ACC_LAYOUT)
    for c in range(0, groups_per_split, CHUNK):
        nz_all, s2_all = _chunk_params(scales_ptr, zeros_ptr, r_rows, r_step, g_begin + c, g_last, DTYPE)
        for j in gl.static_range(CHUNK):
            step = c + j
            # the step STAGES - 1 ahead into the slot this thread read last step
            async_copy.async_copy_global_to_shared(
                w_smem.index((j + STAGES - 1) % STAGES),
                qw_rows + gl.minimum(g_begin + step + (STAGES - 1), g_last) * WORDS)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)
            words = w_smem.index(j % STAGES).load(WORDS_LAYOUT)
            xi = 2 * gl.minimum(step, g_count - 1)                              # finite x under a clamped step
            acc = _step_mma(acc, words, nz_all, s2_all, j, r_step, x_smem, xi, SW, A_LAYOUT)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    store_yt(acc, n0, gl.program_id(1), M, N, bias_ptr, y_ptr, partial_ptr, stride_ym, HAS_BIAS, SPLIT)
