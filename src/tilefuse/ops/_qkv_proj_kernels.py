"""Kernel and launch heuristics of ``tilefuse.qkv_proj``: the fused QKV projection (+ RoPE).

    [q | k | v] = x @ Wᵀ + bias       x [M, K], W [(H_q + 2·H_kv)·D, K] packed q rows, k rows, v rows
    q, k ← rope(q, k)                (optional; the rotation of ``rope.py``, pairs (j, j + r/2) or (2j, 2j+1))

* ``qkv_proj_kernel``: the persistent grouped GEMM of ``_matmul_kernels.matmul_kernel`` (same tile
  order through ``_tile_coords``, same pointer / TMA-descriptor load paths) where each column tile
  is exactly one head: ``pid_n`` is the head index over all H_q + 2·H_kv heads, so the epilogue
  knows whether the tile is a q, k or v head and writes it straight into its own output
  (q [M, H_q, D], k and v [M, H_kv, D], three contiguous tensors): no [M, N] product in memory,
  no split copies. A head's D weight rows are read as up to three column groups, each with its
  own fp32 accumulator fed by the same x tile:

  ========== ============================== ================================ ===================
  ROPE       group A                         group B                          tail
  ========== ============================== ================================ ===================
  "none"     features 0..D                   --                               --
  "neox"     features 0..r/2 (x1)            features r/2..r (x2)             features r..D
  "gptj"     features 0..r (pairs 2j, 2j+1)  --                               features r..D
  ========== ============================== ================================ ===================

  NeoX halves sit in two accumulators, so the rotation out1 = x1·cos − x2·sin, out2 = x2·cos +
  x1·sin is elementwise between them (``_rope_kernels._rotate_pair``); GPT-J pairs are neighbours of one
  accumulator, split into even / odd features in registers once per tile (as rope's kernel
  does on loaded data), which keeps the K loop's weight tiles contiguous rows (TMA-readable).
  cos / sin are gathered per output row (token → table row through ``position_ids`` or the
  sequence index) for q and k heads only; v heads and the tail are stored as accumulated.

Launch configs come from ``_matmul_kernels.choose_config`` (one function, no twin), adapted by
:func:`choose_qkv_config`. The un-fused path (GEMM + ``rope``'s kernel) is :func:`launch_qkv_unfused`,
taken when the fused grid would give fewer than half the SMs a tile (:func:`fused_fills_machine`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import cdiv, empty, next_power_of_2, num_sms
from .._launch import fast_launch, use_device_descriptors
from ._matmul_configs import DEFAULT_FLATTEN, choose_config, tma_layout, use_tma_default
from ._matmul_kernels import _tile_coords, launch_matmul
from ._rope_kernels import _rotate_pair
from .rope import _rope_into, _table_view

# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def qkv_proj_kernel(
    x_ptr,              # *x [M, K], any strides (unit K stride with USE_TMA)
    w_ptr,              # *w [(H_q + 2·H_kv)·D, K] packed q|k|v rows, any strides (unit K stride with USE_TMA)
    bias_ptr,           # *bias [(H_q + 2·H_kv)·D], contiguous (ignored unless HAS_BIAS)
    q_ptr,              # *q [M, H_q, D], heads dense (head stride D, unit feature stride), x's dtype
    k_ptr,              # *k [M, H_kv, D], like q
    v_ptr,              # *v [M, H_kv, D], like q
    cos_ptr,            # *cos [B or 1, rows, r] via strides, unit stride along r (ignored if ROPE == "none")
    sin_ptr,            # *sin, like cos
    pos_ptr,            # *int position ids [B, S] via strides (ignored unless HAS_POS)
    M,                  # rows of x: tokens, B·S
    K,                  # hidden size, the reduced dimension (0: outputs are the epilogue alone)
    seq_len,            # S: row m is token (m // S, m % S)
    n_q_heads,          # H_q
    n_kv_heads,         # H_kv
    n_table_rows,       # rows of cos/sin; ids outside [0, rows) read cos = sin = 0 (as rope)
    stride_xm,          # elements between rows of x
    stride_xk,          # elements between columns of x
    stride_wn,          # elements between rows of w
    stride_wk,          # elements between columns of w
    stride_qm,          # elements between rows (tokens) of q
    stride_km,          # elements between rows of k
    stride_vm,          # elements between rows of v
    cos_sb, cos_ss,     # cos strides (batch: 0 when the table is shared, table row)
    sin_sb, sin_ss,     # sin strides
    pos_sb, pos_ss,     # position id strides (batch: 0 for [S] ids, sequence)
    HEAD_DIM: tl.constexpr,     # D
    ROPE: tl.constexpr,         # "none", "neox" (halves) or "gptj" (interleaved pairs)
    HALF_ROT: tl.constexpr,     # r / 2: feature pairs rotated (0 without rope)
    A_COLS: tl.constexpr,       # features of group A: D (none), r/2 (neox), r (gptj)
    TAIL_OFF: tl.constexpr,     # first feature of the tail group (r; D without rope)
    HAS_TAIL: tl.constexpr,     # r < D with rope: features r..D pass through
    NEOX_ONE_DOT: tl.constexpr, # neox with r/2 = BLOCK_A: groups A and B as one [.., r] dot, halves split after the K loop
    HAS_BIAS: tl.constexpr,     # add bias before the rotation
    HAS_POS: tl.constexpr,      # table rows from position_ids, else row = m % S
    BLOCK_M: tl.constexpr,      # tile rows (>= 16: tl.dot's minimum)
    BLOCK_A: tl.constexpr,      # power of two >= A_COLS (>= 16); group B has the same width
    BLOCK_TAIL: tl.constexpr,   # power of two >= D - r (>= 16)
    BLOCK_K: tl.constexpr,      # K per step (>= 16)
    GROUP_M: tl.constexpr,      # row tiles per group of the tile order
    NUM_PROGRAMS: tl.constexpr, # the persistent grid size (stride of the tile loop)
    EVEN_K: tl.constexpr,       # K % BLOCK_K == 0: pointer loads without a mask
    USE_TMA: tl.constexpr,      # operands through tensor descriptors instead of pointers
    FLATTEN: tl.constexpr,      # tl.range(flatten=...) of the tile loop (pipelines across tiles)
    DOT_PRECISION: tl.constexpr,    # "ieee" for fp32 operands (as torch without TF32)
):
    n_heads = n_q_heads + 2 * n_kv_heads
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_tiles = num_pid_m * n_heads
    k_tiles = tl.cdiv(K, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    ja = tl.arange(0, BLOCK_A)
    jt = tl.arange(0, BLOCK_TAIL)
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        # one descriptor per group width over all rows: a group's padding rows read the next
        # features / head (never stored); rows past the last head are zero-filled
        wa_desc = tl.make_tensor_descriptor(w_ptr, shape=[n_heads * HEAD_DIM, K], strides=[stride_wn, 1],
                                            block_shape=[BLOCK_A, BLOCK_K])
        if HAS_TAIL:
            wt_desc = tl.make_tensor_descriptor(w_ptr, shape=[n_heads * HEAD_DIM, K], strides=[stride_wn, 1],
                                                block_shape=[BLOCK_TAIL, BLOCK_K])
        if NEOX_ONE_DOT:
            wab_desc = tl.make_tensor_descriptor(w_ptr, shape=[n_heads * HEAD_DIM, K], strides=[stride_wn, 1],
                                                 block_shape=[2 * BLOCK_A, BLOCK_K])
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, head = _tile_coords(tile_id, num_pid_m, n_heads, GROUP_M)
        off_m = pid_m * BLOCK_M
        head_row = head * HEAD_DIM          # first weight row (and bias entry) of this head
        acc_a = tl.zeros((BLOCK_M, BLOCK_A), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_A), dtype=tl.float32)      # used with ROPE == "neox" only
        acc_t = tl.zeros((BLOCK_M, BLOCK_TAIL), dtype=tl.float32)   # used with HAS_TAIL only
        acc_ab = tl.zeros((BLOCK_M, 2 * BLOCK_A), dtype=tl.float32)  # used with NEOX_ONE_DOT only
        if USE_TMA:
            for ki in range(k_tiles):
                x = x_desc.load([off_m, ki * BLOCK_K])
                if NEOX_ONE_DOT:     # one N = r wgmma instead of two of r/2
                    acc_ab = tl.dot(x, tl.trans(wab_desc.load([head_row, ki * BLOCK_K])), acc_ab,
                                    input_precision=DOT_PRECISION)
                else:
                    acc_a = tl.dot(x, tl.trans(wa_desc.load([head_row, ki * BLOCK_K])), acc_a,
                                   input_precision=DOT_PRECISION)
                if ROPE == "neox" and not NEOX_ONE_DOT:
                    acc_b = tl.dot(x, tl.trans(wa_desc.load([head_row + HALF_ROT, ki * BLOCK_K])), acc_b,
                                   input_precision=DOT_PRECISION)
                if HAS_TAIL:
                    acc_t = tl.dot(x, tl.trans(wt_desc.load([head_row + TAIL_OFF, ki * BLOCK_K])), acc_t,
                                   input_precision=DOT_PRECISION)
        else:
            # clamped rows read row 0 / the head's first row: valid memory, never stored
            rows = off_m + tl.arange(0, BLOCK_M)
            rows = tl.where(rows < M, rows, 0).to(tl.int64)
            x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
            # weight tiles read transposed, [BLOCK_K, width]: column j is weight row head_row + off + j
            wa_rows = (head_row + tl.where(ja < A_COLS, ja, 0)).to(tl.int64)
            wt_rows = (head_row + TAIL_OFF + tl.where(jt < HEAD_DIM - TAIL_OFF, jt, 0)).to(tl.int64)
            wa_ptrs = w_ptr + ks[:, None] * stride_wk + wa_rows[None, :] * stride_wn
            wb_ptrs = wa_ptrs + HALF_ROT * stride_wn            # neox: x2 rows, r/2 further
            wt_ptrs = w_ptr + ks[:, None] * stride_wk + wt_rows[None, :] * stride_wn
            wab_ptrs = w_ptr + ks[:, None] * stride_wk + (head_row + tl.arange(0, 2 * BLOCK_A)).to(tl.int64)[None, :] * stride_wn
            for ki in range(k_tiles):
                if EVEN_K:
                    x = tl.load(x_ptrs)
                else:
                    k_mask = ks < K - ki * BLOCK_K
                    x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
                if NEOX_ONE_DOT:
                    if EVEN_K:
                        wab = tl.load(wab_ptrs)
                    else:
                        wab = tl.load(wab_ptrs, mask=k_mask[:, None], other=0.0)
                    acc_ab = tl.dot(x, wab, acc_ab, input_precision=DOT_PRECISION)
                else:
                    if EVEN_K:
                        wa = tl.load(wa_ptrs)
                    else:
                        wa = tl.load(wa_ptrs, mask=k_mask[:, None], other=0.0)
                    acc_a = tl.dot(x, wa, acc_a, input_precision=DOT_PRECISION)
                if ROPE == "neox" and not NEOX_ONE_DOT:
                    if EVEN_K:
                        wb = tl.load(wb_ptrs)
                    else:
                        wb = tl.load(wb_ptrs, mask=k_mask[:, None], other=0.0)
                    acc_b = tl.dot(x, wb, acc_b, input_precision=DOT_PRECISION)
                if HAS_TAIL:
                    if EVEN_K:
                        wt = tl.load(wt_ptrs)
                    else:
                        wt = tl.load(wt_ptrs, mask=k_mask[:, None], other=0.0)
                    acc_t = tl.dot(x, wt, acc_t, input_precision=DOT_PRECISION)
                x_ptrs += BLOCK_K * stride_xk
                wa_ptrs += BLOCK_K * stride_wk
                wb_ptrs += BLOCK_K * stride_wk
                wt_ptrs += BLOCK_K * stride_wk
                wab_ptrs += BLOCK_K * stride_wk
        if NEOX_ONE_DOT:    # [BM, r] -> [BM, 2, r/2] -> [BM, r/2, 2] -> x1 (features 0..r/2), x2 (r/2..r)
            acc_a, acc_b = tl.split(tl.permute(tl.reshape(acc_ab, [BLOCK_M, 2, BLOCK_A]), (0, 2, 1)))

        # epilogue: + bias; rotate q and k heads; store into q, k or v by the head index
        rows_c = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows_c < M
        is_q = head < n_q_heads
        is_k = (head >= n_q_heads) & (head < n_q_heads + n_kv_heads)
        out_ptr = tl.where(is_q, q_ptr, tl.where(is_k, k_ptr, v_ptr))
        out_head = tl.where(is_q, head, tl.where(is_k, head - n_q_heads, head - n_q_heads - n_kv_heads))
        stride_om = tl.where(is_q, stride_qm, tl.where(is_k, stride_km, stride_vm))
        out_rows = out_ptr + rows_c[:, None] * stride_om + out_head * HEAD_DIM
        if HAS_BIAS:
            acc_a += tl.load(bias_ptr + head_row + ja, mask=ja < A_COLS, other=0.0).to(tl.float32)[None, :]
            if ROPE == "neox":
                acc_b += tl.load(bias_ptr + head_row + HALF_ROT + ja, mask=ja < A_COLS,
                                 other=0.0).to(tl.float32)[None, :]
            if HAS_TAIL:
                acc_t += tl.load(bias_ptr + head_row + TAIL_OFF + jt, mask=jt < HEAD_DIM - TAIL_OFF,
                                 other=0.0).to(tl.float32)[None, :]
        out_a = acc_a
        if ROPE != "none":
            rotated = head < n_q_heads + n_kv_heads
            if ROPE == "neox":
                j = ja                      # pair j: features (j, j + r/2); cos/sin read the first half
                cs_cols = j
            else:
                j = tl.arange(0, BLOCK_A // 2)   # pair j: features (2j, 2j + 1); even table entries
                cs_cols = 2 * j
            batch = rows_c // seq_len
            if HAS_POS:
                pos = tl.load(pos_ptr + batch * pos_sb + (rows_c % seq_len) * pos_ss,
                              mask=row_ok & rotated, other=0).to(tl.int64)
            else:
                pos = rows_c % seq_len
            cs_ok = (row_ok & rotated & (pos >= 0) & (pos < n_table_rows))[:, None] & (j < HALF_ROT)[None, :]
            c = tl.load(cos_ptr + (batch * cos_sb + pos * cos_ss)[:, None] + cs_cols[None, :],
                        mask=cs_ok, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + (batch * sin_sb + pos * sin_ss)[:, None] + cs_cols[None, :],
                        mask=cs_ok, other=0.0).to(tl.float32)
            if ROPE == "neox":
                out_a, out_b = _rotate_pair(acc_a, acc_b, c, s)
                out_b = tl.where(rotated, out_b, acc_b)
            else:
                x1, x2 = tl.split(tl.reshape(acc_a, [BLOCK_M, BLOCK_A // 2, 2]))
                o1, o2 = _rotate_pair(x1, x2, c, s)
                out_a = tl.reshape(tl.join(o1, o2), [BLOCK_M, BLOCK_A])
            out_a = tl.where(rotated, out_a, acc_a)     # v heads: as accumulated
        out_ty = q_ptr.dtype.element_ty
        tl.store(out_rows + ja[None, :], out_a.to(out_ty), mask=row_ok[:, None] & (ja < A_COLS)[None, :])
        if ROPE == "neox":
            tl.store(out_rows + HALF_ROT + ja[None, :], out_b.to(out_ty),
                     mask=row_ok[:, None] & (ja < A_COLS)[None, :])
        if HAS_TAIL:
            tl.store(out_rows + TAIL_OFF + jt[None, :], acc_t.to(out_ty),
                     mask=row_ok[:, None] & (jt < HEAD_DIM - TAIL_OFF)[None, :])


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------

MAX_TILE_ELEMS = 128 * 256      # fp32 accumulator elements per program: matmul's largest tile
MAX_TMA_BOX = 256               # a tensor descriptor's block dims are at most 256
MIN_FILL = 0.5                  # the fused grid must give >= this share of the SMs a tile
SMEM_BUDGET = 192 * 1024        # bytes of pipelined operand tiles (H100: 227 KB per block, rest for the epilogue)


def head_groups(head_dim: int, rope: str, rotary_dim: int) -> dict:
    """The column groups of one head tile (module docstring's table): valid features of group A,
    first tail feature, and the power-of-two widths (>= 16, tl.dot's minimum) of A and the tail."""
    if rope == "none":
        a_cols, tail_off = head_dim, head_dim
    else:
        a_cols, tail_off = (rotary_dim // 2 if rope == "neox" else rotary_dim), rotary_dim
    # (GPT-J: BLOCK_A a power of two >= r, so its BLOCK_A / 2 pairs are one too)
    return dict(A_COLS=a_cols, TAIL_OFF=tail_off, HAS_TAIL=tail_off < head_dim,
                BLOCK_A=max(16, next_power_of_2(a_cols)), BLOCK_TAIL=max(16, next_power_of_2(head_dim - tail_off)))


def tile_width(groups: dict, rope: str) -> int:
    """Accumulator columns per program: A (twice for NeoX halves) plus the tail."""
    width = groups["BLOCK_A"] * (2 if rope == "neox" else 1)
    return width + (groups["BLOCK_TAIL"] if groups["HAS_TAIL"] else 0)


def choose_qkv_config(m: int, n_heads: int, width: int, k: int, dtype: torch.dtype, sms: int) -> dict:
    """matmul's config for the [m, n_heads·width] GEMM with BLOCK_N = one head (``width``
    accumulator columns) and BLOCK_M (a power of two) grown to keep matmul's tile area (its 128x256 becomes 256 rows
    x one 128-wide head), at most MAX_TILE_ELEMS fp32 accumulators; 8 warps from a 128x128 tile
    up; 4 pipeline stages where they fit (H100 2026-11-22, Llama-8B T=8192: 256x128 with 4 stages
    685 TFLOP/s, 128x128 with 3 stages 493)."""
    cfg = choose_config(m, n_heads * width, k, dtype, sms)
    area = cfg["BLOCK_M"] * cfg.pop("BLOCK_N")
    rows = min(area // width, MAX_TILE_ELEMS // width, 256, next_power_of_2(m))
    cfg["BLOCK_M"] = max(16, 1 << (max(rows, 1).bit_length() - 1))   # a power of two (heads of 96, 160 columns)
    cfg["num_warps"] = 8 if cfg["BLOCK_M"] * width >= 128 * 128 else 4
    cfg["num_stages"] = stages_that_fit(max(4, cfg["num_stages"]), cfg["BLOCK_M"], width, cfg["BLOCK_K"], dtype)
    return cfg


def stages_that_fit(stages: int, block_m: int, width: int, block_k: int, dtype: torch.dtype) -> int:
    """Fewer pipeline stages when a stage (an x tile and a head's weight rows) would overflow
    SMEM_BUDGET: wide heads (D = 256 and up) carry more weight rows per stage than matmul's tiles."""
    stage_bytes = (block_m + width) * block_k * torch.empty((), dtype=dtype).element_size()
    return max(1, min(stages, SMEM_BUDGET // stage_bytes))


def fused_fills_machine(m: int, n_heads: int, block_m: int, sms: int) -> bool:
    """One head per column tile caps the fused grid at cdiv(m, BLOCK_M)·heads tiles: at small m
    (decode: 48 tiles for Llama-8B's 48 heads on 132 SMs) the weight read, which is the whole
    cost there, would run on a fraction of the SMs; matmul's small-M tiles spread it instead."""
    return cdiv(m, block_m) * n_heads >= MIN_FILL * sms


# ----------------------------------------------------------------------------------------------
# launchers (inputs validated by the public function)
# ----------------------------------------------------------------------------------------------


def _outputs(m: int, n_q_heads: int, n_kv_heads: int, head_dim: int, x: torch.Tensor):
    return tuple(empty((m, h, head_dim), x.dtype, x.device) for h in (n_q_heads, n_kv_heads, n_kv_heads))


def _positions(position_ids: torch.Tensor | None, batch: int, seq_len: int, fallback: torch.Tensor):
    """position ids as [B, S] (zero batch stride for [S] ids) and its strides; ``fallback``
    stands in for the pointer when there are none (never read)."""
    if position_ids is None:
        return fallback, (0, 0)
    pos = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    pos = pos.expand(batch, seq_len)
    return pos, (pos.stride(0), pos.stride(1))


def launch_qkv_proj(x, w, bias, cos, sin, position_ids, n_q_heads: int, n_kv_heads: int, head_dim: int,
                    seq_len: int, interleaved: bool, rotary_dim: int, config: dict | None = None):
    """(q [M, H_q, D], k [M, H_kv, D], v [M, H_kv, D]) of x [M, K] @ w [(H_q+2H_kv)·D, K]ᵀ + bias,
    q and k rotated when ``rotary_dim`` > 0 (cos/sin as ``rope``'s, rows = tokens m // S, m % S).
    ``config`` overrides any key of :func:`choose_qkv_config`, plus USE_TMA, FLATTEN and FUSED
    (False: :func:`launch_qkv_unfused`)."""
    (m, k), n_heads = x.shape, n_q_heads + 2 * n_kv_heads
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()     # the kernels read it with unit stride
    rope = "none" if rotary_dim == 0 else ("gptj" if interleaved else "neox")
    groups = head_groups(head_dim, rope, rotary_dim)
    cfg = choose_qkv_config(m, n_heads, tile_width(groups, rope), k, x.dtype, num_sms(x))
    cfg.update(config or {})
    fused = cfg.pop("FUSED", None)
    if fused is None:
        fused = fused_fills_machine(m, n_heads, cfg["BLOCK_M"], num_sms(x))
    if not fused:
        return launch_qkv_unfused(x, w, bias, cos, sin, position_ids, n_q_heads, n_kv_heads, head_dim,
                                  seq_len, interleaved, rotary_dim)
    q, k_out, v = _outputs(m, n_q_heads, n_kv_heads, head_dim, x)
    if m == 0 or head_dim == 0:
        return q, k_out, v
    layout = tma_layout(x, w.t())     # w.t() as matmul's b: needs unit K stride; x row-major
    layout_ok = (layout.ok and layout.b_k_contiguous and not layout.a_m_contiguous
                 and max(groups["BLOCK_A"], groups["BLOCK_TAIL"]) <= MAX_TMA_BOX)
    use_tma = cfg.pop("USE_TMA", None)
    flatten = cfg.pop("FLATTEN", DEFAULT_FLATTEN)
    use_tma = k > 0 and (use_tma_default(x, layout_ok) if use_tma is None else (use_tma and layout_ok))
    if use_tma and x.device.type == "cuda":
        use_device_descriptors()
    batch = cdiv(m, seq_len)
    if rope != "none":
        cos3, sin3 = _table_view(cos, batch), _table_view(sin, batch)
    else:
        cos3 = sin3 = x.unsqueeze(0)     # any tensor: never read without rope
    pos, pos_strides = _positions(position_ids, batch, seq_len, x)
    programs = max(1, min(num_sms(x), cdiv(m, cfg["BLOCK_M"]) * n_heads))
    qkv_proj_kernel[(programs,)](
        x, w, bias if bias is not None else q, q, k_out, v, cos3, sin3, pos,
        m, k, seq_len, n_q_heads, n_kv_heads, cos3.shape[1],
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), q.stride(0), k_out.stride(0), v.stride(0),
        cos3.stride(0), cos3.stride(1), sin3.stride(0), sin3.stride(1), *pos_strides,
        HEAD_DIM=head_dim, ROPE=rope, HALF_ROT=rotary_dim // 2, HAS_BIAS=bias is not None,
        HAS_POS=position_ids is not None, **groups,
        NEOX_ONE_DOT=rope == "neox" and groups["A_COLS"] == groups["BLOCK_A"] and 2 * groups["BLOCK_A"] <= MAX_TMA_BOX,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], NUM_PROGRAMS=programs,
        EVEN_K=k % cfg["BLOCK_K"] == 0, USE_TMA=bool(use_tma), FLATTEN=bool(flatten),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return q, k_out, v


def launch_qkv_unfused(x, w, bias, cos, sin, position_ids, n_q_heads: int, n_kv_heads: int, head_dim: int,
                       seq_len: int, interleaved: bool, rotary_dim: int):
    """The same outputs through matmul's kernel ([M, N] product) and rope's kernel reading the
    q / k column slices in place; v is copied out of the product (its own contiguous tensor)."""
    m = x.shape[0]
    y, _ = launch_matmul(x, w.t(), bias)
    q_in, k_in, v_in = (y[:, a * head_dim:b * head_dim].view(m, b - a, head_dim) for a, b in (
        (0, n_q_heads), (n_q_heads, n_q_heads + n_kv_heads),
        (n_q_heads + n_kv_heads, n_q_heads + 2 * n_kv_heads)))
    q, k_out, v = _outputs(m, n_q_heads, n_kv_heads, head_dim, x)
    v.copy_(v_in)
    if rotary_dim == 0:
        q.copy_(q_in)
        k_out.copy_(k_in)
    else:
        batch = cdiv(m, seq_len) if m else 1
        _rope_into(*(t.view(batch, seq_len, t.shape[1], head_dim) for t in (q_in, k_in)), cos, sin,
                   position_ids, interleaved, rotary_dim, "bshd", False,
                   *(t.view(batch, seq_len, t.shape[1], head_dim) for t in (q, k_out)))
    return q, k_out, v
