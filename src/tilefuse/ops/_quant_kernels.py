"""Triton kernels for weight-only quantized linear layers: ``y = x @ dequant(W).T (+ bias)``.

Weight formats (see ``tilefuse.ops.quant`` for the quantizer and the exact layout):

* int8, symmetric, per output channel: ``W[n, k] = q[n, k] * s[n]``, ``q`` int8 in [-127, 127].
  The scale is constant along K: it multiplies the finished dot product.
* int4, asymmetric, group-wise along K: ``W[n, k] = (q[n, k] - z[n, g]) * s[n, g]`` with
  ``g = k // GROUP_SIZE``, ``q`` and ``z`` in [0, 15]. Two values per byte, along K:
  byte ``[n, j]`` holds ``k = 2j`` in its low nibble and ``k = 2j + 1`` in its high nibble, so
  the little-endian int32 word ``j`` of a row holds ``k = 8j + i`` in bits ``4i .. 4i + 3``.

Reading the weight (the fp weight is never materialized; instruction counts are per value):

* A K chunk of ``BLOCK_K`` columns is a contiguous run of bytes per row, loaded as int32 words
  (16-byte vector loads, every byte once). Each of the 8 nibble positions (4 byte positions for
  int8) is a *plane* computed from the whole word tile; ``tl.join`` + ``tl.reshape`` put the
  planes back in k order in registers.
* No shift and no int->float conversion per value (I2F is a quarter-rate unit): the nibble is
  masked in place, ``v = word & (0xF << P)``, and ``bitcast(v | 0x4B000000) = 2^23 + q * 2^P``
  exactly (an integer in the mantissa of 2^23, bits <= 19 for P <= 16). Times ``2^-P`` (exact)
  that is ``2^(23-P) + q``, and one subtraction leaves ``q`` or ``q - z`` exactly. Nibbles 5..7
  are read from ``word >> 12`` (one shift per word), so P is 0, 4, 8, 12, 16, 8, 12, 16.
  int8 bytes: ``word ^ 0x80808080`` gives ``q + 128`` per byte; bytes 0, 1 in place, 2, 3 from
  ``>> 16``. The 0x4B000000 comes in as a run-time argument (``magic_bits``): as a register
  operand ptxas fuses mask and OR into one LOP3 (with two immediates it takes two). sm_90 SASS of
  the default loops: 4.6 instructions per int4 weight value (GEMV; 1 LOP3, 2 FFMA, the rest x
  conversion and reductions), 6.5 (tensor-core kernel, 16 rows; 6.2 with 64), 5.6 int8 GEMV.
  A bf16 x read as int32 pairs (X_PAIRS, :func:`_x_chunk`, on by default) takes the int4 GEMV to 4.4.
* Loads are software-pipelined (``tl.range(num_stages=...)``: cp.async into shared memory). The
  int4 scales / zero points of a chunk (``[BLOCK_N, GROUPS]``, too narrow for cp.async) are
  prefetched one loop step ahead in registers.

Kernels:

* :func:`quant_gemv_kernel` -- one row of x per program, fp32 FMA on CUDA cores (decode, M = 1:
  no tensor-core tile to pad). int4: ``sum_g s[g] * (sum_{k in g} q[k] x[k] - z[g] * sum_{k in g}
  x[k])``: the planes need no per-group zero point, only constants. A persistent variant
  (programs walking row blocks in one pipelined loop) measured no gain on the H200, 2026-11-24
  (6.5 / 14.6 / 15.4 us at best against 6.6 / 14.1 / 15.8, int4 g128 at N×K = 4096², 14336×4096,
  4096×14336), and was removed.
* :func:`quant_dot_kernel` -- tensor cores, any M: ``yᵀ[BLOCK_N, BLOCK_M] = W_tile @ x_tileᵀ``
  (SWAP_AB: the weight rows are the MMA's M side, so a decode batch of 2..32 rows pads only to
  16) or ``y = x_tile @ W_tileᵀ`` (64+ rows). The dequantized tile is ``(q - z) * s`` rounded to
  x's dtype: the very weight ``dequantize_weight`` gives, so the product is the PyTorch peer's
  with fp32 accumulation.
* Both run split-K over grid axis 1 when the output tiles alone cannot fill the GPU: fp32 partials
  ``[splits, M, N]``, summed in split order by :func:`splitk_reduce_kernel` (no atomics: the
  result is deterministic), which also adds the bias. With one split (``SPLIT`` False) the kernel
  adds the bias and writes y itself: one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import fast_launch

MAGIC_BITS = 0x4B000000                # fp32 bits of 2^23: bitcast(v | it) == 2^23 + v for 0 <= v < 2^23
INT8_FLIP = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32: word ^ it = q + 128 in every byte


@triton.jit
def _nibble(words, words_hi, magic, N: tl.constexpr):
    """``2^(23-P) + q`` (fp32, exact) for nibble ``N`` of every word (``k = 8j + N``): masked in
    place at bit ``P = 4N`` (N < 5) or ``4N - 12`` in ``words >> 12``, bitcast onto 2^23, times
    ``2^-P``. The caller subtracts ``2^(23-P)`` (+ z). ``magic`` is MAGIC_BITS, a run-time value."""
    P: tl.constexpr = 4 * N if N < 5 else 4 * N - 12
    if N < 5:
        v = words & (0xF << P)
    else:
        v = words_hi & (0xF << P)
    return (v | magic).to(tl.float32, bitcast=True) * (2.0 ** -P)


@triton.jit
def _int4_values(words, magic, offset, scale, N: tl.constexpr, SCALED: tl.constexpr):
    """Plane ``N`` as ``q - offset`` (``offset`` 0 or z, broadcastable), times ``scale`` when SCALED."""
    P: tl.constexpr = 4 * N if N < 5 else 4 * N - 12
    w = _nibble(words, words >> 12, magic, N) - (offset + 2.0 ** (23 - P))
    if SCALED:
        w = w * scale
    return w


@triton.jit
def _join_nibbles(words, magic, offset, scale, SCALED: tl.constexpr):
    """``[*words.shape, 8]`` fp32 (k order in the last axis) of :func:`_int4_values`; the first
    join is the slowest new axis, so the flat index is ``4a + 2b + c`` = the nibble."""
    p0 = _int4_values(words, magic, offset, scale, 0, SCALED)
    p1 = _int4_values(words, magic, offset, scale, 1, SCALED)
    p2 = _int4_values(words, magic, offset, scale, 2, SCALED)
    p3 = _int4_values(words, magic, offset, scale, 3, SCALED)
    p4 = _int4_values(words, magic, offset, scale, 4, SCALED)
    p5 = _int4_values(words, magic, offset, scale, 5, SCALED)
    p6 = _int4_values(words, magic, offset, scale, 6, SCALED)
    p7 = _int4_values(words, magic, offset, scale, 7, SCALED)
    return tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))


def _dequant_int4_asm(fma: str, one: int, magic: int, scaled: bool = True) -> str:
    """PTX for :func:`_int4_dequant_x16`: operands ``$0..$7`` the 8 values of a word (16-bit, k
    order), ``$8`` the word, ``$9`` ``-(magic + z)`` twice, ``$10`` the scale twice (packed
    fp16x2 / bf16x2; only when ``scaled``). Per pair of nibbles (k = 2i, 2i + 1): PRMT puts byte i
    of the word in byte 0 and byte i of ``word >> 4`` in byte 2 (low nibbles = the two values);
    one LOP3 masks them and ORs the magic exponent (``magic + q``, exact); ``x * 1 - (magic + z)``
    = ``q - z`` (exact); when ``scaled``, ``x * s + (-0)`` rounds ``(q - z) * s`` once, as an fp32
    product rounded to 16 bits would. Unscaled, the values are ``q - z`` exactly (|q - z| <= 15):
    the Gluon MMA kernel scales the group's fp32 dot product instead."""
    scale = "\n    {fma} t{i}, t{i}, $10, nzero;" if scaled else ""
    pairs = "".join(("""
    prmt.b32 t{i}, $8, u, {sel};
    lop3.b32 t{i}, t{i}, 0x000F000F, m, 0xEA;
    {fma} t{i}, t{i}, one, $9;""" + scale + """
    mov.b32 {{$%d, $%d}}, t{i};""").format(i=i, fma=fma, sel=0x0400 + 0x0101 * i) % (2 * i, 2 * i + 1)
                    for i in range(4))
    return f"""{{
    .reg .b32 u, m, one, nzero, t0, t1, t2, t3;
    mov.b32 m, {magic:#x};
    mov.b32 one, {one:#x};
    mov.b32 nzero, 0x80008000;
    shr.u32 u, $8, 4;{pairs}
    }}"""


# (fma instruction, 1.0 twice, magic twice, the magic as a float): 16-bit values 2^7 + q (bf16: 7
# mantissa bits) and 2^10 + q (fp16: 10) hold q in their low mantissa bits exactly
DEQUANT_ARGS = {"bf16": ("fma.rn.bf16x2", 0x3F803F80, 0x43004300), "fp16": ("fma.rn.f16x2", 0x3C003C00, 0x64006400)}
_DEQUANT_BF16 = tl.constexpr(_dequant_int4_asm(*DEQUANT_ARGS["bf16"]))
_DEQUANT_FP16 = tl.constexpr(_dequant_int4_asm(*DEQUANT_ARGS["fp16"]))
_DEQUANT_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r")


@triton.jit
def _pack2(h):
    """The bits of a 16-bit float tensor, twice, in an int32 (an fp16x2 / bf16x2 operand)."""
    b = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _int4_dequant_x16(words, z, s, DTYPE: tl.constexpr):
    """``[*words.shape, 8]`` ``(q - z) * s`` in DTYPE (fp16 / bf16; k order in the last axis) of
    int32 words of int4 values, ``z`` (fp32) and ``s`` broadcastable to ``words``: the value
    :func:`_join_nibbles` gives rounded to DTYPE, bit for bit, computed two values per 16-bit
    pair instruction (PTX; sm_90 SASS: 17 instructions per word, 2.1 per value, against 3.7 for
    the fp32 path's LOP3, FFMA / FADD, FMUL and F2FP). GPU only: the interpreter cannot run PTX."""
    if DTYPE == tl.bfloat16:
        nz = _pack2((-(z + 128.0)).to(DTYPE))
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _DEQUANT_BF16, _DEQUANT_CONSTRAINTS, [words, nz, _pack2(s.to(DTYPE))],
            (tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
            True, 1)
    else:
        nz = _pack2((-(z + 1024.0)).to(DTYPE))
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _DEQUANT_FP16, _DEQUANT_CONSTRAINTS, [words, nz, _pack2(s.to(DTYPE))],
            (tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16),
            True, 1)
    return tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))


@triton.jit
def _int8_values(words, magic, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` fp32 ``q`` (exact) of a ``[BLOCK_N, BLOCK_K / 4]`` int32 word tile
    of int8 values (byte i of word j: ``k = 4j + i``); a zero (masked) word gives q = 0."""
    biased = words ^ INT8_FLIP
    hi = biased >> 16
    b0 = (biased & 0xFF | magic).to(tl.float32, bitcast=True) - (2.0 ** 23 + 128)
    b1 = (biased & 0xFF00 | magic).to(tl.float32, bitcast=True) * (2.0 ** -8) - (2.0 ** 15 + 128)
    b2 = (hi & 0xFF | magic).to(tl.float32, bitcast=True) - (2.0 ** 23 + 128)
    b3 = (hi & 0xFF00 | magic).to(tl.float32, bitcast=True) * (2.0 ** -8) - (2.0 ** 15 + 128)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N, BLOCK_K))


@triton.jit
def _int8_chunk(qw_ptr, rows, row_mask, k0, K, magic, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                WORDS: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` fp32 int8 ``q`` of columns ``k0 ..`` of rows at byte offsets
    ``rows``: as int32 words when WORDS (K % 4 == 0), else byte by byte."""
    if WORDS:
        offs_w = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        words = tl.load(qw_ptr.to(tl.pointer_type(tl.int32)) + (rows // 4)[:, None] + offs_w[None, :],
                        mask=row_mask[:, None] & (offs_w < K // 4)[None, :], other=0)
        return _int8_values(words, magic, BLOCK_N, BLOCK_K)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(qw_ptr + rows[:, None] + offs_k[None, :], mask=row_mask[:, None] & (offs_k < K)[None, :], other=0)
        return (((q.to(tl.int32) & 0xFF) ^ 0x80) | magic).to(tl.float32, bitcast=True) - (2.0 ** 23 + 128)


@triton.jit
def _group_params(scales_ptr, zeros_ptr, sz_rows, row_mask, chunk, n_chunks, GROUPS: tl.constexpr, n_groups=0,
                  RAGGED: tl.constexpr = False):
    """(zero points, scales) ``[BLOCK_N, GROUPS]`` fp32 of chunk ``chunk`` (0 past ``n_chunks``;
    RAGGED: 0 past group ``n_groups``, the last chunk being partial)."""
    groups = chunk * GROUPS + tl.arange(0, GROUPS)
    offs = sz_rows[:, None] + groups[None, :]
    if RAGGED:
        mask = row_mask[:, None] & (groups < n_groups)[None, :]
    else:
        mask = row_mask[:, None] & (chunk < n_chunks)
    z = tl.load(zeros_ptr + offs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scales_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return z, s


@triton.jit
def _x_chunk(x_row, chunk, valid, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, X_PAIRS: tl.constexpr, K=0,
             RAGGED: tl.constexpr = False):
    """``[GROUPS, GROUP_SIZE]`` fp32 x of K chunk ``chunk``; 0 if not ``valid`` (RAGGED: 0 past
    column ``K``, the last chunk being partial; K a multiple of GROUP_SIZE). X_PAIRS (bf16 x): read
    as int32 pairs; a bf16 is the top half of an fp32, so the even k is ``pair << 16`` and the odd
    k ``pair & 0xFFFF0000``: one instruction per value (the same values) where converting bf16
    takes a PRMT and a shift for every second one. The row must start on a 4-byte boundary (the
    launcher turns X_PAIRS off for an x that does not)."""
    if RAGGED:      # whole groups are in or out: the mask is uniform along a group's columns
        valid = ((chunk * GROUPS + tl.arange(0, GROUPS)) * GROUP_SIZE < K)[:, None]
    if X_PAIRS:
        pairs = tl.load(x_row.to(tl.pointer_type(tl.int32)) + chunk * (GROUPS * GROUP_SIZE // 2)
                        + tl.arange(0, GROUPS)[:, None] * (GROUP_SIZE // 2) + tl.arange(0, GROUP_SIZE // 2)[None, :],
                        mask=valid, other=0)
        lo = (pairs << 16).to(tl.float32, bitcast=True)
        hi = (pairs & -65536).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(lo, hi), (GROUPS, GROUP_SIZE))
    else:
        return tl.load(x_row + chunk * (GROUPS * GROUP_SIZE) + tl.arange(0, GROUPS)[:, None] * GROUP_SIZE
                       + tl.arange(0, GROUP_SIZE)[None, :], mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _write_out(acc, offs_n, offs_m, pid_s, M, N, bias_ptr, y_ptr, partial_ptr, stride_ym,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Store ``acc[BLOCK_N, R]`` (fp32, y transposed) for output rows ``offs_m[R]``: as split
    ``pid_s``'s partial ``[splits, M, N]`` when SPLIT, else plus bias, in y's dtype, into y."""
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    m64 = offs_m.to(tl.int64)[None, :]
    if SPLIT:
        tl.store(partial_ptr + (pid_s * M + m64) * N + offs_n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + m64 * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def quant_gemv_kernel(
    x_ptr,              # *x [M, K], unit K stride, fp32/fp16/bf16
    qw_ptr,             # *packed weight: int8 [N, K] or uint8 [N, K/2] (int4, two per byte), 4-byte aligned
    scales_ptr,         # *scales: [N] (int8) or [N, K/GROUP_SIZE] (int4), x's dtype
    zeros_ptr,          # *zero points uint8 [N, K/GROUP_SIZE] (int4; unused for int8)
    bias_ptr,           # *bias [N] (read only when HAS_BIAS and not SPLIT)
    y_ptr,              # *y [M, N], x's dtype (written when not SPLIT)
    partial_ptr,        # *fp32 partials [splits, M, N] (written when SPLIT)
    M,                  # rows of x
    N,                  # output features
    K,                  # input features
    stride_xm,          # elements between rows of x
    stride_qn,          # bytes between rows of the packed weight
    stride_sn,          # elements between rows of scales / zeros (K / GROUP_SIZE for int4)
    stride_ym,          # elements between rows of y
    n_chunks,           # BLOCK_K chunks of K
    chunks_per_split,   # chunks per program along grid axis 1 (the last split may run past n_chunks)
    magic_bits,         # MAGIC_BITS, passed at run time: as a register operand it lets ptxas fuse a
                        # value's mask and OR into one LOP3 (two immediates take two)
    BITS: tl.constexpr,           # 8 or 4
    GROUP_SIZE: tl.constexpr,     # int4 group along K; BLOCK_K is a multiple of it (0 for int8)
    INT8_WORDS: tl.constexpr,     # int8: read the weight as int32 words (K % 4 == 0)
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,          # write fp32 partials (more than one split) instead of y
    X_PAIRS: tl.constexpr,        # int4, bf16 x: read x as int32 pairs (see _x_chunk)
    BLOCK_N: tl.constexpr,        # weight rows per program
    BLOCK_K: tl.constexpr,        # K columns per loop step
    NUM_STAGES: tl.constexpr,     # software-pipeline depth of the K loop
    RAGGED_K: tl.constexpr = False,  # int4: the last chunk holds fewer groups (masks per group)
):
    """``y[m, n] = sum_k x[m, k] * W[n, k]`` for one row m per program (grid ``(M * n_blocks,
    splits)``, m fastest so that the rows sharing a weight block read it back to back from L2).
    int4: ``sum_g s[n, g] * (sum_{k in g} q[n, k] x[m, k] - z[n, g] sum_{k in g} x[m, k])``, fp32."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    m = pid % M
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_n < N
    rows = offs_n.to(tl.int64) * stride_qn
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    chunk = pid_s * chunks_per_split
    if BITS == 4:
        GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE
        WORDS: tl.constexpr = BLOCK_K // 8
        sz_rows = offs_n.to(tl.int64) * stride_sn
        n_groups = K // GROUP_SIZE
        z_next, s_next = _group_params(scales_ptr, zeros_ptr, sz_rows, row_mask, chunk, n_chunks, GROUPS, n_groups,
                                       RAGGED_K)
    for _ in tl.range(0, chunks_per_split, num_stages=NUM_STAGES):
        if BITS == 4:
            valid = chunk < n_chunks
            z, s = z_next, s_next                   # this chunk's; the next chunk's are read now
            z_next, s_next = _group_params(scales_ptr, zeros_ptr, sz_rows, row_mask, chunk + 1, n_chunks, GROUPS,
                                           n_groups, RAGGED_K)
            word = chunk * WORDS + tl.arange(0, WORDS)
            if RAGGED_K:    # the words of groups past K read as 0 (their scale is 0 too); a mask by group
                # is constant over a group's words, so the loads stay 16-byte vectors
                w_group = chunk * GROUPS + tl.arange(0, WORDS) // (GROUP_SIZE // 8)
                w_mask = row_mask[:, None] & (w_group < n_groups)[None, :]
            else:
                w_mask = row_mask[:, None] & valid
            words = tl.load(qw_ptr.to(tl.pointer_type(tl.int32)) + (rows // 4)[:, None] + word[None, :], mask=w_mask,
                            other=0)
            q = tl.reshape(_join_nibbles(words, magic_bits, 0.0, 1.0, False), (BLOCK_N, GROUPS, GROUP_SIZE))
            xg = _x_chunk(x_row, chunk, valid, GROUPS, GROUP_SIZE, X_PAIRS, K, RAGGED_K)    # [GROUPS, GROUP_SIZE]
            group_dot = tl.sum(q * xg[None, :, :], axis=2) - z * tl.sum(xg, axis=1)[None, :]     # [BLOCK_N, GROUPS]
            acc += tl.sum(group_dot * s, axis=1)
        else:
            k0 = chunk * BLOCK_K
            w = _int8_chunk(qw_ptr, rows, row_mask, k0, K, magic_bits, BLOCK_N, BLOCK_K, INT8_WORDS)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            acc += tl.sum(w * xk[None, :], axis=1)
        chunk += 1
    if BITS == 8:
        acc *= tl.load(scales_ptr + offs_n, mask=row_mask, other=0.0).to(tl.float32)
    _write_out(acc[:, None], offs_n, m + tl.arange(0, 1), pid_s, M, N, bias_ptr, y_ptr, partial_ptr, stride_ym,
               HAS_BIAS, SPLIT)


@fast_launch
@triton.jit
def quant_dot_kernel(
    x_ptr,              # *x [M, K], unit K stride, fp32/fp16/bf16
    qw_ptr,             # *packed weight, as quant_gemv_kernel
    scales_ptr,         # *scales, as quant_gemv_kernel
    zeros_ptr,          # *zero points (int4)
    bias_ptr,           # *bias [N] (read only when HAS_BIAS and not SPLIT)
    y_ptr,              # *y [M, N], x's dtype (written when not SPLIT)
    partial_ptr,        # *fp32 partials [splits, M, N] (written when SPLIT)
    M,                  # rows of x
    N,                  # output features
    K,                  # input features
    stride_xm,          # elements between rows of x
    stride_qn,          # bytes between rows of the packed weight
    stride_sn,          # elements between rows of scales / zeros
    stride_ym,          # elements between rows of y
    n_chunks,           # BLOCK_K chunks of K
    chunks_per_split,   # chunks per program along grid axis 1
    magic_bits,         # MAGIC_BITS (see quant_gemv_kernel)
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    INT8_WORDS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 x (no tf32), None for fp16/bf16
    PACKED_DEQUANT: tl.constexpr, # int4, fp16/bf16 x, on a GPU: _int4_dequant_x16 (else fp32 math)
    SWAP_AB: tl.constexpr,        # yᵀ = W x_tileᵀ (the weight tile is the MMA's A operand) or y = x_tile Wᵀ
    BLOCK_M: tl.constexpr,        # rows of x per tile (>= 16; >= 64 for wgmma unless SWAP_AB)
    BLOCK_N: tl.constexpr,        # weight rows per tile (>= 64 for wgmma when SWAP_AB)
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``y[m, n] = sum_k x[m, k] * Wq[n, k]`` with ``Wq = dequant(W)`` rounded to x's dtype (int4:
    ``(q - z) * s``; int8: ``q``, scaled by ``s[n]`` after the sum), fp32 accumulation. Grid
    ``(m_blocks * n_blocks, splits)``, m-blocks fastest (they share the weight tile in L2).

    SWAP_AB (few rows of x): ``yᵀ = Wq_tile @ x_tileᵀ``, so x pads only to 16 rows, the MMA's N
    side; the dequantized tile is the register A operand (moved into the MMA layout through
    shared memory in pieces). Otherwise ``y = x_tile @ Wq_tileᵀ``: the tile is written to shared
    memory once as the B operand (fewer instructions and barriers per value, but x pads to the
    64-row wgmma M)."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_blocks_m = tl.cdiv(M, BLOCK_M)
    offs_m = (pid % n_blocks_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid // n_blocks_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_n < N
    rows = offs_n.to(tl.int64) * stride_qn
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    chunk = pid_s * chunks_per_split
    if BITS == 4:
        GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE
        WORDS: tl.constexpr = GROUP_SIZE // 8            # per group
        sz_rows = offs_n.to(tl.int64) * stride_sn
        z_next, s_next = _group_params(scales_ptr, zeros_ptr, sz_rows, row_mask, chunk, n_chunks, GROUPS)
        offs_w = tl.arange(0, GROUPS)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    for _ in tl.range(0, chunks_per_split, num_stages=NUM_STAGES):
        offs_k = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
        if BITS == 4:
            valid = chunk < n_chunks
            z, s = z_next, s_next
            z_next, s_next = _group_params(scales_ptr, zeros_ptr, sz_rows, row_mask, chunk + 1, n_chunks, GROUPS)
            words = tl.load(qw_ptr.to(tl.pointer_type(tl.int32)) + (rows // 4)[:, None, None]
                            + (chunk * (BLOCK_K // 8) + offs_w)[None, :, :], mask=row_mask[:, None, None] & valid,
                            other=0)                                                 # [BLOCK_N, GROUPS, WORDS]
            if PACKED_DEQUANT:
                w = _int4_dequant_x16(words, z[:, :, None], s[:, :, None], x_ptr.dtype.element_ty)
            else:
                w = _join_nibbles(words, magic_bits, z[:, :, None], s[:, :, None], True)       # (q - z) * s
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        else:
            w = _int8_chunk(qw_ptr, rows, row_mask, chunk * BLOCK_K, K, magic_bits, BLOCK_N, BLOCK_K, INT8_WORDS)
        w = w.to(x_ptr.dtype.element_ty)
        k_mask = offs_k < K                                 # int4: K is whole chunks, so: the chunk is valid
        if SWAP_AB:
            xk = tl.load(x_rows[:, None] + offs_k[None, :], mask=(offs_m < M)[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(xk), acc, input_precision=DOT_PRECISION)         # [BLOCK_N, BLOCK_M]
        else:
            xk = tl.load(x_rows[:, None] + offs_k[None, :], mask=(offs_m < M)[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(xk, tl.trans(w), acc, input_precision=DOT_PRECISION)         # [BLOCK_M, BLOCK_N]
        chunk += 1
    if not SWAP_AB:
        acc = tl.trans(acc)
    if BITS == 8:
        acc *= tl.load(scales_ptr + offs_n, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    _write_out(acc, offs_n, offs_m, pid_s, M, N, bias_ptr, y_ptr, partial_ptr, stride_ym, HAS_BIAS, SPLIT)


@fast_launch
@triton.jit
def splitk_reduce_kernel(
    partial_ptr,        # *fp32 partial sums [n_splits, M, N]
    bias_ptr,           # *bias [N] (read only when HAS_BIAS)
    y_ptr,              # *y [M, N], x's dtype
    M,                  # rows
    N,                  # output features
    n_splits,           # partials per output element, summed in order (deterministic)
    stride_ym,          # elements between rows of y
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``y[m, n] = sum_s partial[s, m, n] (+ bias[n])``, s in increasing order."""
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in range(n_splits):
        acc += tl.load(partial_ptr + (split * M + pid_m).to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
