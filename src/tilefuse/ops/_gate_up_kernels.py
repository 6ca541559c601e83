"""Kernel and launch heuristics of ``tilefuse.swiglu_linear``: the fused gate-up GEMM.

    out = act(x @ Wgᵀ) · (x @ Wuᵀ)      x [M, K], w [2I, K] packed (rows 0..I-1 Wg, I..2I-1 Wu)

* ``gate_up_kernel``: the persistent grouped GEMM of ``_matmul_kernels.matmul_kernel`` (same tile
  order through ``_tile_coords``, same pointer / TMA-descriptor load paths), with two fp32
  accumulators per program: the gate tile (weight rows off_n..off_n+BLOCK_N) and the matching up
  tile (rows I+off_n..), both fed by the same x tile. The epilogue writes act(g)·u only -- the
  [M, 2I] product never reaches memory -- and, when the backward will need them (SAVE_GATE_UP),
  also stores g | u packed into one [M, 2I] buffer (the layout glu's packed backward reads).

The backward is not here: it runs on glu's backward kernel and ``matmul_kernel`` (see gate_up.py).
Launch configs come from ``_matmul_kernels.choose_config`` (one function, no twin), adapted by
:func:`choose_gate_up_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import cdiv, empty, num_sms
from .._launch import fast_launch, use_device_descriptors
from ._activation_math import activation_fwd
from ._matmul_configs import DEFAULT_FLATTEN, _fit, choose_config, tma_layout, use_tma_default
from ._matmul_kernels import _tile_coords

# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def gate_up_kernel(
    x_ptr,              # *x [M, K], any strides (unit K stride with USE_TMA)
    w_ptr,              # *w [2I, K] packed gate|up weight, any strides (unit K stride with USE_TMA)
    out_ptr,            # *out [M, I], x's dtype
    gate_up_ptr,        # *saved g | u [M, 2I], x's dtype (ignored unless SAVE_GATE_UP)
    M,                  # rows of x and out (tokens)
    I,                  # intermediate size: columns of out, half the rows of w
    K,                  # hidden size, the reduced dimension (0: g = u = 0)
    stride_xm,          # elements between rows of x
    stride_xk,          # elements between columns of x
    stride_wn,          # elements between rows of w
    stride_wk,          # elements between columns of w
    stride_om,          # elements between rows of out
    stride_on,          # elements between columns of out
    stride_sm,          # elements between rows of gate_up
    stride_sn,          # elements between columns of gate_up
    ACT: tl.constexpr,              # "silu" (swiglu), "gelu" / "gelu_tanh" (geglu)
    SAVE_GATE_UP: tl.constexpr,     # also store g | u for the backward
    BLOCK_M: tl.constexpr,          # tile rows (>= 16: tl.dot's minimum)
    BLOCK_N: tl.constexpr,          # tile columns of out, = rows of each weight tile (>= 16)
    BLOCK_K: tl.constexpr,          # K per step (>= 16)
    GROUP_M: tl.constexpr,          # row tiles per group of the tile order
    NUM_PROGRAMS: tl.constexpr,     # the persistent grid size (stride of the tile loop)
    EVEN_K: tl.constexpr,           # K % BLOCK_K == 0: pointer loads without a mask
    USE_TMA: tl.constexpr,          # operands through tensor descriptors instead of pointers
    FLATTEN: tl.constexpr,          # tl.range(flatten=...) of the tile loop (pipelines across tiles)
    DOT_PRECISION: tl.constexpr,    # "ieee" for fp32 operands (as torch without TF32)
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        # one descriptor over all 2I rows: a gate tile past row I reads up rows (columns past I
        # are never stored); an up tile past row 2I is zero-filled
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2 * I, K], strides=[stride_wn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            for ki in range(k_tiles):
                x = x_desc.load([off_m, ki * BLOCK_K])
                wg = w_desc.load([off_n, ki * BLOCK_K])
                wu = w_desc.load([I + off_n, ki * BLOCK_K])
                acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
        else:
            # clamped rows / columns read row 0 / weight row 0 (and I): valid memory, never stored
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            rows = tl.where(rows < M, rows, 0).to(tl.int64)
            cols = tl.where(cols < I, cols, 0).to(tl.int64)
            x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
            # weight tiles read transposed, [BLOCK_K, BLOCK_N]: column j is weight row off_n + j
            wg_ptrs = w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
            wu_ptrs = w_ptr + ks[:, None] * stride_wk + (cols + I)[None, :] * stride_wn   # int64 rows
            for ki in range(k_tiles):
                if EVEN_K:
                    x = tl.load(x_ptrs)
                    wg = tl.load(wg_ptrs)
                    wu = tl.load(wu_ptrs)
                else:
                    k_left = K - ki * BLOCK_K
                    x = tl.load(x_ptrs, mask=ks[None, :] < k_left, other=0.0)
                    wg = tl.load(wg_ptrs, mask=ks[:, None] < k_left, other=0.0)
                    wu = tl.load(wu_ptrs, mask=ks[:, None] < k_left, other=0.0)
                acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PRECISION)
                x_ptrs += BLOCK_K * stride_xk
                wg_ptrs += BLOCK_K * stride_wk
                wu_ptrs += BLOCK_K * stride_wk

        # epilogue: [gate_up = g | u]; out = act(g) · u
        rows_c = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols_c = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = (rows_c < M)[:, None] & (cols_c < I)[None, :]
        if SAVE_GATE_UP:
            save_row = gate_up_ptr + rows_c[:, None] * stride_sm
            tl.store(save_row + cols_c[None, :] * stride_sn, acc_g.to(gate_up_ptr.dtype.element_ty), mask=mask)
            tl.store(save_row + (cols_c + I)[None, :] * stride_sn, acc_u.to(gate_up_ptr.dtype.element_ty),
                     mask=mask)
        y = activation_fwd(acc_g, ACT, out_ptr.dtype.element_ty == tl.float32) * acc_u
        tl.store(out_ptr + rows_c[:, None] * stride_om + cols_c[None, :] * stride_on,
                 y.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------


def choose_gate_up_config(m: int, i: int, k: int, dtype: torch.dtype, sms: int) -> dict:
    """matmul's config for the [m, 2i] GEMM with BLOCK_N halved: a program holds two BLOCK_N-wide
    accumulators and reads two weight tiles per step, the registers and shared memory of one
    matmul tile of 2·BLOCK_N columns, over the same number of programs."""
    cfg = choose_config(m, 2 * i, k, dtype, sms)
    cfg["BLOCK_N"] = _fit(max(16, cfg["BLOCK_N"] // 2), i)
    return cfg


# ----------------------------------------------------------------------------------------------
# launcher (inputs validated by the public function)
# ----------------------------------------------------------------------------------------------


def launch_gate_up(x: torch.Tensor, w: torch.Tensor, activation: str, save_gate_up: bool = False,
                   config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [M, I], g | u [M, 2I] or None) of act(x @ Wgᵀ) · (x @ Wuᵀ); x [M, K], w [2I, K] with
    any strides. ``config`` overrides any key of :func:`choose_gate_up_config`, plus USE_TMA and FLATTEN."""
    (m, k), i = x.shape, w.shape[0] // 2
    out = empty((m, i), x.dtype, x.device)
    gate_up = empty((m, 2 * i), x.dtype, x.device) if save_gate_up else None
    if m == 0 or i == 0:
        return out, gate_up
    cfg = choose_gate_up_config(m, i, k, x.dtype, num_sms(x))
    cfg.update(config or {})
    layout = tma_layout(x, w.t())     # w.t() as matmul's b: needs unit K stride; x row-major
    layout_ok = layout.ok and layout.b_k_contiguous and not layout.a_m_contiguous
    use_tma = cfg.pop("USE_TMA", None)
    flatten = cfg.pop("FLATTEN", DEFAULT_FLATTEN)
    use_tma = k > 0 and (use_tma_default(x, layout_ok) if use_tma is None else (use_tma and layout_ok))
    if use_tma and x.device.type == "cuda":
        use_device_descriptors()
    tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(i, cfg["BLOCK_N"])
    programs = max(1, min(num_sms(x), tiles))
    saved = gate_up if gate_up is not None else out     # stands in when not saving
    gate_up_kernel[(programs,)](
        x, w, out, saved,
        m, i, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        saved.stride(0), saved.stride(1),
        ACT=activation, SAVE_GATE_UP=gate_up is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        NUM_PROGRAMS=programs, EVEN_K=k % cfg["BLOCK_K"] == 0, USE_TMA=bool(use_tma), FLATTEN=bool(flatten),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, gate_up
