"""The RoPE kernel (see ``rope.py`` for the op, its math and the bytes it moves): one program per
token (several for short tokens) rotates every q head and then every k head of that token, so
cos/sin are loaded once and reused across heads."""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import fast_launch


@triton.jit
def _rotate_pair(x1, x2, c, s):
    """The 2-D rotation RoPE applies to each feature pair (s is −sin for the inverse)."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rope_token_heads(
    x_ptr,              # *input at (b, s, head 0, feature 0) of this token
    o_ptr,              # *output at the same place (== x_ptr in place)
    x_head_stride,      # elements between heads of x
    o_head_stride,      # elements between heads of the output
    n_heads,            # heads of this tensor (H_q or H_k)
    c,                  # [BLOCK_R2] fp32 cos of this token's angles
    s,                  # [BLOCK_R2] fp32 sin (negated for the inverse rotation)
    token_ok,           # the token exists (a program's spare token slots past the end do not)
    HEAD_DIM: tl.constexpr,     # D (constexpr: known offsets let D/2-aligned halves vectorize)
    HALF_ROT: tl.constexpr,     # r / 2: feature pairs rotated
    INTERLEAVED: tl.constexpr,  # GPT-J pairs (2j, 2j+1) instead of NeoX halves (j, j + r/2)
    COPY_TAIL: tl.constexpr,    # copy features r..D-1 (out of place with r < D)
    BLOCK_H: tl.constexpr,      # heads per step
    BLOCK_R2: tl.constexpr,     # power of two >= r/2
    BLOCK_TAIL: tl.constexpr,   # power of two >= D - r
):
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_ok = ((heads < n_heads) & token_ok)[:, None]
        x_rows = x_ptr + heads.to(tl.int64)[:, None] * x_head_stride
        o_rows = o_ptr + heads.to(tl.int64)[:, None] * o_head_stride
        if INTERLEAVED:
            # one contiguous [heads, r] tile, split into even/odd features in registers
            cols = tl.arange(0, 2 * BLOCK_R2)[None, :]
            mask = head_ok & (cols < 2 * HALF_ROT)
            x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_R2, 2]))
            o1, o2 = _rotate_pair(x1, x2, c[None, :], s[None, :])
            o = tl.reshape(tl.join(o1, o2), [BLOCK_H, 2 * BLOCK_R2])
            tl.store(o_rows + cols, o.to(o_ptr.dtype.element_ty), mask=mask)
        else:
            cols = tl.arange(0, BLOCK_R2)[None, :]
            mask = head_ok & (cols < HALF_ROT)
            x1 = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_rows + HALF_ROT + cols, mask=mask, other=0.0).to(tl.float32)
            o1, o2 = _rotate_pair(x1, x2, c[None, :], s[None, :])
            tl.store(o_rows + cols, o1.to(o_ptr.dtype.element_ty), mask=mask)
            tl.store(o_rows + HALF_ROT + cols, o2.to(o_ptr.dtype.element_ty), mask=mask)
        if COPY_TAIL:
            cols = 2 * HALF_ROT + tl.arange(0, BLOCK_TAIL)[None, :]
            mask = head_ok & (cols < HEAD_DIM)
            tl.store(o_rows + cols, tl.load(x_rows + cols, mask=mask), mask=mask)


@fast_launch
@triton.jit
def rope_kernel(
    q_ptr,              # *q      [B, S, H_q, D] via strides, unit stride along D
    k_ptr,              # *k      [B, S, H_k, D]
    q_out_ptr,          # *q_out  like q (== q_ptr in place)
    k_out_ptr,          # *k_out  like k (== k_ptr in place)
    cos_ptr,            # *cos    [B or 1, rows, r] via strides, unit stride along r
    sin_ptr,            # *sin    like cos
    pos_ptr,            # *int position ids [B, S] via strides (unused without HAS_POS)
    n_tokens,           # B * S
    seq_len,            # S
    n_q_heads,          # H_q
    n_k_heads,          # H_k
    n_table_rows,       # rows of cos/sin; ids outside [0, rows) read cos = sin = 0, never out of bounds
    q_sb, q_ss, q_sh,           # q strides (batch, sequence, head)
    k_sb, k_ss, k_sh,           # k strides
    qo_sb, qo_ss, qo_sh,        # q_out strides
    ko_sb, ko_ss, ko_sh,        # k_out strides
    cos_sb, cos_ss,             # cos strides (batch: 0 when the table is shared, row)
    sin_sb, sin_ss,             # sin strides
    pos_sb, pos_ss,             # position id strides (batch: 0 for [S] ids, sequence)
    HEAD_DIM: tl.constexpr,     # D
    HALF_ROT: tl.constexpr,     # r / 2
    HAS_POS: tl.constexpr,      # rows come from position_ids, else row = s
    INTERLEAVED: tl.constexpr,  # GPT-J pairs; cos/sin repeat_interleaved (read even entries)
    INVERSE: tl.constexpr,      # rotate by −θ (the backward)
    COPY_TAIL: tl.constexpr,    # copy features r..D-1
    TOKENS: tl.constexpr,       # tokens per program
    BLOCK_HQ: tl.constexpr,     # q heads per step
    BLOCK_HK: tl.constexpr,     # k heads per step
    BLOCK_R2: tl.constexpr,     # power of two >= r/2
    BLOCK_TAIL: tl.constexpr,   # power of two >= D - r
):
    j = tl.arange(0, BLOCK_R2)
    if INTERLEAVED:
        cs_cols = 2 * j
    else:
        cs_cols = j
    for i in tl.static_range(TOKENS):
        tok = tl.program_id(0).to(tl.int64) * TOKENS + i
        token_ok = tok < n_tokens
        b = tok // seq_len
        s = tok % seq_len
        if HAS_POS:
            row = tl.load(pos_ptr + b * pos_sb + s * pos_ss, mask=token_ok, other=0).to(tl.int64)
        else:
            row = s
        cs_mask = token_ok & (row >= 0) & (row < n_table_rows) & (j < HALF_ROT)
        c = tl.load(cos_ptr + b * cos_sb + row * cos_ss + cs_cols, mask=cs_mask, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + b * sin_sb + row * sin_ss + cs_cols, mask=cs_mask, other=0.0).to(tl.float32)
        if INVERSE:
            sn = -sn
        # the same cos/sin registers serve every q head, then every k head of this token
        _rope_token_heads(q_ptr + b * q_sb + s * q_ss, q_out_ptr + b * qo_sb + s * qo_ss, q_sh, qo_sh,
                          n_q_heads, c, sn, token_ok, HEAD_DIM, HALF_ROT, INTERLEAVED, COPY_TAIL,
                          BLOCK_HQ, BLOCK_R2, BLOCK_TAIL)
        _rope_token_heads(k_ptr + b * k_sb + s * k_ss, k_out_ptr + b * ko_sb + s * ko_ss, k_sh, ko_sh,
                          n_k_heads, c, sn, token_ok, HEAD_DIM, HALF_ROT, INTERLEAVED, COPY_TAIL,
                          BLOCK_HK, BLOCK_R2, BLOCK_TAIL)
