"""The fp8 GEMM of ``tilefuse.fp8``: its ``tl`` kernel, launch heuristics, plan and launcher.

``fp8_gemm_kernel``: ``out = (a @ bᵀ) · scale_a · scale_b (+ bias)``, a ``[M, K]`` and b ``[N, K]``
fp8 (both K-major: what Hopper's fp8 wgmma wants; b is nn.Linear's weight layout), fp32
accumulation, persistent grid in matmul's grouped tile order (``_tile_coords``), operands through
tensor descriptors (sm_90+, 16-byte aligned rows) or pointer loads (any strides; the interpreter,
which upcasts the operands to fp32 itself: ``UPCAST``, see ``_fp8_kernels``). Its last waves can be
cut along K (stream-K, ``_stream_k``). On sm_90 the warp-specialized Gluon kernels take the large
GEMMs instead: precise accumulation ``_fp8_gluon`` (:func:`use_warp_specialized`), fast accumulation
the bf16 GEMM's ``_matmul_gluon.gemm_ws_kernel`` with fp8 operands (:func:`fast_gluon_plan`). The
quantization kernels and the fp8 constants: ``_fp8_kernels`` (which re-exports this module's
names; nothing is imported from there, so either may be imported first).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .._address_memo import AddressMemo
from .._dispatch import cdiv, device_traits, empty, is_hopper, is_hopper_or_newer, next_power_of_2, num_sms
from .._launch import PreparedArgs, config_key, fast_launch, use_device_descriptors
from . import _matmul_kernels
from ._matmul_kernels import _tile_coords, split_k_buffers
from . import _stream_k
from ._matmul_configs import MID_MAX_M
from ._stream_k import stream_k_collect_tl, stream_k_publish_tl, stream_k_run, stream_k_tiles


# ----------------------------------------------------------------------------------------------
# the GEMM
# ----------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def fp8_gemm_kernel(
    a_ptr,              # *A [M, K] fp8 (e4m3 / e5m2), any strides (unit K stride with USE_TMA)
    b_ptr,              # *B [N, K] fp8, any strides (unit K stride with USE_TMA)
    c_ptr,              # *out [M, N], output dtype
    scale_a_ptr,        # *scale of A, fp32: [M] (SCALE_A_ROWWISE) or [1]
    scale_b_ptr,        # *scale of B, fp32: [N] (SCALE_B_ROWWISE) or [1]
    bias_ptr,           # *bias [N], contiguous, any float dtype (ignored unless HAS_BIAS)
    ws_ptr,             # *fp32 [NUM_PROGRAMS, BLOCK_M, BLOCK_N] stream-K partials (ignored unless STREAM_K)
    flag_ptr,           # *int32 [NUM_PROGRAMS] their flags, zero between launches (ditto)
    M,                  # rows of A and out
    N,                  # rows of B, columns of out
    K,                  # the reduced dimension (0: out = bias)
    stride_am,          # elements between rows of A
    stride_ak,          # elements between columns of A
    stride_bn,          # elements between rows of B
    stride_bk,          # elements between columns of B
    stride_cm,          # elements between rows of out
    stride_cn,          # elements between columns of out
    sk_tiles,           # tiles at the end of the tile order cut along K (_stream_k.stream_k_tiles; 0: none)
    SCALE_A_ROWWISE: tl.constexpr,  # one scale per row of A (else one scalar)
    SCALE_B_ROWWISE: tl.constexpr,  # one scale per row of B, i.e. per output column
    HAS_BIAS: tl.constexpr,         # add bias[N] after scaling
    BLOCK_M: tl.constexpr,          # tile rows (>= 16)
    BLOCK_N: tl.constexpr,          # tile columns (>= 16)
    BLOCK_K: tl.constexpr,          # K per step (>= 32: fp8 dot minimum)
    GROUP_M: tl.constexpr,          # row tiles per group of the tile order
    NUM_PROGRAMS: tl.constexpr,     # the persistent grid size (stride of the tile loop)
    EVEN_K: tl.constexpr,           # K % BLOCK_K == 0: pointer loads without a mask
    PROMOTE_EVERY: tl.constexpr,    # > 0: fast tensor-core partial sums added into the fp32 tile every this many K steps
    USE_TMA: tl.constexpr,          # operands through tensor descriptors instead of pointers
    FLATTEN: tl.constexpr,          # tl.range(flatten=...) of the tile loop
    MAX_IMPRECISE_ACC: tl.constexpr,  # sm_90: wgmma partial sums promoted to fp32 every this many K
    UPCAST: tl.constexpr,           # (interpreter) dot on fp32 copies of the operands: exact products
    STREAM_K: tl.constexpr,         # sk_tiles > 0: the stream-K region is compiled in (_stream_k)
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        a_desc = a_ptr      # (unused: pointer loads)
        b_desc = b_ptr
    if SCALE_A_ROWWISE:
        scale_a = 1.0
    else:
        scale_a = tl.load(scale_a_ptr)
    if SCALE_B_ROWWISE:
        scale_b = 1.0
    else:
        scale_b = tl.load(scale_b_ptr)
    for tile_id in tl.range(tl.program_id(0), num_tiles - sk_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        acc = _fp8_tile_sum(a_desc, b_desc, a_ptr, b_ptr, tile_id, 0, k_tiles, num_pid_m, num_pid_n, M, N, K,
                            stride_am, stride_ak, stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K,
                            PROMOTE_EVERY, USE_TMA, MAX_IMPRECISE_ACC, UPCAST)
        _fp8_epilogue(acc, tile_id, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, scale_a, scale_b, num_pid_m,
                      num_pid_n, M, N, stride_cm, stride_cn, SCALE_A_ROWWISE, SCALE_B_ROWWISE, HAS_BIAS, BLOCK_M,
                      BLOCK_N, GROUP_M)
    if STREAM_K:        # the last waves: runs of K steps, one per program (_stream_k's three steps)
        dp_tiles = num_tiles - sk_tiles
        pid = tl.program_id(0)
        first, a, last, b = stream_k_run(pid, sk_tiles, k_tiles, NUM_PROGRAMS)
        for t in range(first + (a > 0).to(tl.int32), last + (b == k_tiles).to(tl.int32)):
            acc = _fp8_tile_sum(a_desc, b_desc, a_ptr, b_ptr, dp_tiles + t, 0, k_tiles, num_pid_m, num_pid_n, M, N,
                                K, stride_am, stride_ak, stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                EVEN_K, PROMOTE_EVERY, USE_TMA, MAX_IMPRECISE_ACC, UPCAST)
            _fp8_epilogue(acc, dp_tiles + t, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, scale_a, scale_b,
                          num_pid_m, num_pid_n, M, N, stride_cm, stride_cn, SCALE_A_ROWWISE, SCALE_B_ROWWISE,
                          HAS_BIAS, BLOCK_M, BLOCK_N, GROUP_M)
        if b < k_tiles:     # the head of the tile the run ends in: its partial for the next program
            acc = _fp8_tile_sum(a_desc, b_desc, a_ptr, b_ptr, dp_tiles + last, 0, b, num_pid_m, num_pid_n, M, N, K,
                                stride_am, stride_ak, stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                EVEN_K, PROMOTE_EVERY, USE_TMA, MAX_IMPRECISE_ACC, UPCAST)
            stream_k_publish_tl(acc, ws_ptr, flag_ptr, pid)
        if a > 0:           # the tail of the tile it starts in, plus the previous program's head
            acc = _fp8_tile_sum(a_desc, b_desc, a_ptr, b_ptr, dp_tiles + first, a, k_tiles, num_pid_m, num_pid_n, M,
                                N, K, stride_am, stride_ak, stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                EVEN_K, PROMOTE_EVERY, USE_TMA, MAX_IMPRECISE_ACC, UPCAST)
            acc = stream_k_collect_tl(acc, ws_ptr, flag_ptr, pid - 1)
            _fp8_epilogue(acc, dp_tiles + first, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, scale_a, scale_b,
                          num_pid_m, num_pid_n, M, N, stride_cm, stride_cn, SCALE_A_ROWWISE, SCALE_B_ROWWISE,
                          HAS_BIAS, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def _fp8_tile_sum(a_desc, b_desc, a_ptr, b_ptr, tile_id, k_lo, k_hi, num_pid_m, num_pid_n, M, N, K, stride_am,
                  stride_ak, stride_bn, stride_bk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
                  USE_TMA: tl.constexpr, MAX_IMPRECISE_ACC: tl.constexpr, UPCAST: tl.constexpr):
    """The fp32 sum a[rows] · b[cols]ᵀ over K steps [k_lo, k_hi) of tile ``tile_id`` (grouped order)."""
    pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA and PROMOTE_EVERY > 0:
        # two-level accumulation (DeepSeek-V3's recipe): the wgmma chain runs at full speed
        # into ``part``; every PROMOTE_EVERY steps it is added into the fp32 tile and reset
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_lo, k_hi):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            part = tl.dot(a, tl.trans(b), part)
            if (ki - k_lo + 1) % PROMOTE_EVERY == 0:
                acc += part
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc += part
    elif USE_TMA:
        for ki in range(k_lo, k_hi):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=MAX_IMPRECISE_ACC)
    else:
        # clamped rows read row 0: valid memory, never stored
        ks = tl.arange(0, BLOCK_K)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        rows = tl.where(rows < M, rows, 0).to(tl.int64)
        cols = tl.where(cols < N, cols, 0).to(tl.int64)
        a_rows = a_ptr + rows[:, None] * stride_am
        b_rows = b_ptr + cols[:, None] * stride_bn
        for ki in range(k_lo, k_hi):
            k_cols = (ki * BLOCK_K + ks[None, :]).to(tl.int64)
            a_ptrs = a_rows + k_cols * stride_ak
            b_ptrs = b_rows + k_cols * stride_bk
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = ks[None, :] < K - ki * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok, other=0.0)
                b = tl.load(b_ptrs, mask=k_ok, other=0.0)
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=MAX_IMPRECISE_ACC)
    return acc


@triton.jit
def _fp8_epilogue(acc, tile_id, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, scale_a, scale_b, num_pid_m, num_pid_n,
                  M, N, stride_cm, stride_cn, SCALE_A_ROWWISE: tl.constexpr, SCALE_B_ROWWISE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """out = acc · scale_a[row] · scale_b[col] + bias[col] for tile ``tile_id``."""
    pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
    rows_c = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols_c = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows_c < M
    col_ok = cols_c < N
    if SCALE_A_ROWWISE:
        acc = acc * tl.load(scale_a_ptr + rows_c, mask=row_ok, other=0.0)[:, None]
    else:
        acc = acc * scale_a
    if SCALE_B_ROWWISE:
        acc = acc * tl.load(scale_b_ptr + cols_c, mask=col_ok, other=0.0)[None, :]
    else:
        acc = acc * scale_b
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows_c[:, None] * stride_cm + cols_c[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])



KERNELS_INTERPRETED = not isinstance(fp8_gemm_kernel.fn, JITFunction)   # (as _fp8_kernels')


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------

# Hopper fp8 wgmma shapes: 1-byte operands make BLOCK_K = 128 the natural 128-byte row; a
# 128x256x128 stage is 48 KB of shared memory, 3 stages fit beside the epilogue. Untuned on the
# GPU as written (the lead's sweep picks among these).
GEMM_CONFIGS = {
    "tile_128x256": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    "tile_128x128": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4),
    "tile_64x128": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    # small M (decode, memory-bound on b): one row tile of 64 (wgmma's M per warp group), narrow
    # columns for many programs, more stages in flight (16 KB each)
    "small_m": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5),
}
# Precise accumulation (the default) keeps a second fp32 tile for the wgmma partial sums: at
# 128x256 with 8 warps that is 2 x 128 registers per thread for accumulators alone (spills), so
# the largest precise tile is 128x128; fast accumulation can use 128x256.
LARGE_TILES_PRECISE = ("tile_128x128", "tile_64x128")      # largest first
LARGE_TILES_FAST = ("tile_128x256", "tile_128x128", "tile_64x128")
DEFAULT_USE_TMA = True
DEFAULT_WARP_SPECIALIZE = True  # precise accumulation on sm_90 through _fp8_gluon (use_warp_specialized)
# stream-K over the last waves by default (a config's STREAM_K forces either way): off, measured
# slower than whole tiles on the H200 at all six bench shapes with fast accumulation (s48: 0.834
# against 0.948x _scaled_mm at 4096³, 0.977 against 0.984 at 8192³, equal at 8192x4096x14336;
# -s48-stream-k-probe-first.log); with stream-K compiled in, the kernel takes 255 registers and
# spills (157 registers without: s47's offline sm_90 compile)
FP8_STREAM_K = False
# Fast accumulation at large M on sm_90: the bf16 GEMM's warp-specialized Gluon kernel with fp8
# operands (a producer warp, two consumer warp groups, the dequantization scales in its epilogue;
# fast_gluon_plan). H200 2026-12-02, CUDA-graph replays after an L2 flush, 7 interleaved rounds,
# per-tensor scales, bf16 out (scripts/fp8_ws_probe.py, -s51-fp8-ws-probe.log): its 128x256 tile at
# 4096³ / 8192³ / 8192x4096x4096 / 8192x14336x4096 ran 1.038 / 1.062 / 1.075 / 1.067x _scaled_mm
# (with stream-K where _stream_k.stream_k_pays takes it, 8192³ and 8192x14336x4096: 1.074 / 1.087x),
# where this file's tl kernel ran 0.942 / 0.998 / 0.958 / 0.932x. False: the tl kernel (an A/B switch).
FAST_GLUON = True
DEFAULT_FLATTEN = False         # off, as matmul (its H100 sweep: flatten 4x slower at M=1); unswept for fp8
SMALL_M = 64                    # M up to this: the small-M config


def _fit(block: int, dim: int, minimum: int) -> int:
    """A block no larger than the dimension needs (power of two, >= tl.dot's minimum)."""
    return min(block, max(minimum, next_power_of_2(dim)))


def choose_gemm_config(m: int, n: int, k: int, sms: int, fast_accum: bool = False) -> dict:
    """The launch config of an fp8 [m, k] x [n, k]ᵀ GEMM: the largest tile that still gives every
    SM a tile (more operand reuse per byte), the small-M tile for decode-sized M."""
    if m <= SMALL_M:
        cfg = dict(GEMM_CONFIGS["small_m"])
    else:
        tiles = LARGE_TILES_FAST if fast_accum else LARGE_TILES_PRECISE
        name = next((t for t in tiles if cdiv(m, GEMM_CONFIGS[t]["BLOCK_M"])
                     * cdiv(n, GEMM_CONFIGS[t]["BLOCK_N"]) >= sms), tiles[-1])
        cfg = dict(GEMM_CONFIGS[name])
    cfg["BLOCK_M"] = _fit(cfg["BLOCK_M"], m, 64)     # >= 64: one wgmma warp group (no mma.sync fallback)
    cfg["BLOCK_N"] = _fit(cfg["BLOCK_N"], n, 16)
    cfg["BLOCK_K"] = _fit(cfg["BLOCK_K"], k, 32)
    return cfg


def _warp_specialized_by_default(m: int, n: int, k: int, fast_accum: bool, hopper: bool, sms: int,
                                 tma_ok: bool, out_tma_ok: bool) -> bool:
    """:func:`use_warp_specialized` from sizes and flags (what :func:`gemm_plan` is keyed on)."""
    fills_sms = cdiv(m, 192) * cdiv(n, 128) >= sms     # its 192x128 tiles give every SM one
    return not fast_accum and DEFAULT_WARP_SPECIALIZE and k > 0 and hopper and fills_sms and tma_ok and out_tma_ok


def use_warp_specialized(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, fast_accum: bool) -> bool:
    """The Gluon kernel (``_fp8_gluon.py``) for precise accumulation on sm_90 when its tiles fill
    every SM and TMA can read the operands and write ``out``: its consumer warp groups add their
    partial sums while another group's wgmma runs (8192³, H200, session 15 sweeps: 1,275-1,414
    against 901-990 TF/s). Fast accumulation does not take this kernel (level within the spread
    there): on sm_90 at large M it takes the 16-bit GEMM's (:func:`fast_gluon_plan`)."""
    out_tma_ok = out.stride(1) == 1 and out.data_ptr() % 16 == 0 and (out.stride(0) * out.element_size()) % 16 == 0
    return _warp_specialized_by_default(a.shape[0], b.shape[0], a.shape[1], fast_accum, is_hopper(a), num_sms(a),
                                        gemm_tma_ok(a, b), out_tma_ok)


def gemm_tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Descriptors can read a [M, K] and b [N, K]: unit K stride, 16-byte aligned bases and row
    strides (K % 16 == 0 for contiguous fp8 operands), on an sm_90+ GPU."""
    return (DEFAULT_USE_TMA and a.device.type == "cuda" and is_hopper_or_newer(a)
            and all(t.data_ptr() % 16 == 0 and _tma_rows_ok(t.stride(), t.shape[1]) for t in (a, b)))


class GemmPlan(NamedTuple):
    warp_specialized: bool          # the Gluon kernel (launch_fp8_gemm_ws); the fields below unused
    ws_config: dict                 # its config (do not mutate: shared by the plan cache)
    uses_tma: bool                  # fp8_gemm_kernel builds device-side descriptors (the allocator)
    grid: tuple                     # (persistent programs,)
    prepared: PreparedArgs | None   # fp8_gemm_kernel's sizes, strides and constexprs
    sk_workspace: int = 0           # stream-K: fp32 elements of the partials (0: whole tiles; flags: grid[0])
    gluon_plan: object = None       # fast accumulation on gemm_ws_kernel (fast_gluon_plan); the others unused
    memo: object = None             # its launches kept by address (_address_memo.AddressMemo)


def _tma_rows_ok(strides: tuple, cols: int) -> bool:
    """A K-major fp8 operand's rows suit a descriptor: unit K stride (or K = 1), 16-byte row stride."""
    return (strides[1] == 1 or cols == 1) and strides[0] % 16 == 0


@functools.lru_cache(maxsize=4096)
def gemm_plan(m: int, n: int, k: int, a_strides: tuple, b_strides: tuple, out_dtype: torch.dtype,
              rowwise_a: bool, rowwise_b: bool, has_bias: bool, fast_accum: bool, sms: int, hopper: bool,
              hopper_or_newer: bool, ab_aligned: bool, out_aligned: bool, interpret: bool,
              config: tuple = ()) -> GemmPlan:
    """The launch of one fp8 GEMM (out [m, n] contiguous): the kernel choice of
    :func:`use_warp_specialized`, the config of :func:`choose_gemm_config` and the overrides
    ``config`` (see :func:`launch_fp8_gemm`). ``*_aligned``: 16-byte aligned base pointers."""
    config = dict(config)
    ws = config.pop("WARP_SPECIALIZE", None)
    gluon = config.pop("GLUON", None)
    tma_ok = (DEFAULT_USE_TMA and hopper_or_newer and ab_aligned
              and _tma_rows_ok(a_strides, k) and _tma_rows_ok(b_strides, k))
    out_tma_ok = out_aligned and (n * out_dtype.itemsize) % 16 == 0
    if (fast_accum and hopper and tma_ok and out_tma_ok and k > 0 and not ws and gluon is not False
            and (gluon or (FAST_GLUON and not config))):
        fast = fast_gluon_plan(m, n, k, out_dtype, rowwise_a, rowwise_b, has_bias, sms, config if gluon else None)
        if fast is not None:
            return GemmPlan(False, {}, False, fast.grid, None, 0, fast, AddressMemo())
    if ws or (ws is None and not config
              and _warp_specialized_by_default(m, n, k, fast_accum, hopper, sms, tma_ok, out_tma_ok)):
        if fast_accum:                                  # forced: one partial sum over the whole K
            config.setdefault("PROMOTE_EVERY", 1 << 30)
        return GemmPlan(True, config, False, (), None)
    cfg = choose_gemm_config(m, n, k, sms, fast_accum)
    cfg.update(config)
    use_tma = cfg.pop("USE_TMA", None)
    use_tma = k > 0 and tma_ok and (use_tma is None or use_tma)
    flatten = cfg.pop("FLATTEN", DEFAULT_FLATTEN)
    # precise: promote the wgmma partial sums to the fp32 accumulator once per K step (<= 128 K
    # per promotion: DeepSeek-V3's interval); fast: never within the K loop (K <= BLOCK_K here
    # means "promote after each tl.dot"; Triton's sm_90 default, 2^30, means never)
    imprecise = cfg.pop("MAX_IMPRECISE_ACC", None) or (0 if fast_accum else min(cfg["BLOCK_K"], 128))
    promote_every = cfg.pop("PROMOTE_EVERY", 0) if not fast_accum else 0
    programs = max(1, min(sms, cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])))
    # the last waves cut along K (_stream_k), as the bf16 GEMM's: by FP8_STREAM_K or the config
    stream_k = cfg.pop("STREAM_K", FP8_STREAM_K and not config)
    sk_tiles = stream_k_tiles(m, n, k, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], programs) if stream_k else 0
    ints = (m, n, k, *a_strides, *b_strides, max(n, 1), 1, sk_tiles)      # out: a fresh row-major [m, n]
    kwargs = dict(
        SCALE_A_ROWWISE=rowwise_a, SCALE_B_ROWWISE=rowwise_b, HAS_BIAS=has_bias,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        NUM_PROGRAMS=programs, EVEN_K=k % cfg["BLOCK_K"] == 0, USE_TMA=bool(use_tma), FLATTEN=bool(flatten),
        PROMOTE_EVERY=promote_every if use_tma else 0,
        MAX_IMPRECISE_ACC=None if imprecise == 0 else min(imprecise, cfg["BLOCK_K"]),
        UPCAST=interpret and not use_tma, STREAM_K=sk_tiles > 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return GemmPlan(False, {}, bool(use_tma), (programs,), fp8_gemm_kernel.prepare(ints, kwargs),
                    programs * cfg["BLOCK_M"] * cfg["BLOCK_N"] if sk_tiles else 0)


def fast_gluon_plan(m: int, n: int, k: int, out_dtype: torch.dtype, rowwise_a: bool, rowwise_b: bool,
                    has_bias: bool, sms: int, config: dict | None = None):
    """The ``_matmul_gluon_plan._ws_plan`` of a fast-accumulation GEMM on the bf16 GEMM's Gluon
    kernel (see FAST_GLUON), or None where that kernel does not take it: large M only (M >
    MID_MAX_M, the 16-bit GEMM's rule; unmeasured below), the tile of ``choose_large_ws_tile``
    with 128-deep K steps (the 16-bit tiles' 128-byte rows and stage bytes), but 128x128 when
    per-column scales meet a bias (at 128x256 their two [256] vectors spill ~300 bytes, sm_90
    offline compile), and stream-K over the last waves where ``_stream_k.stream_k_pays``.
    ``config``: a forced (``GLUON``) call's tile keys that override, and STREAM_K; at any M, on
    128x128 where the large-M rule picks no tile. None: the default plan."""
    from ._matmul_gluon_plan import LARGE_WS_TILES, _ws_plan, choose_large_ws_tile   # Gluon: imported on use
    forced = config is not None
    config = config or {}
    epilogue = (has_bias, "none", False, False)
    tile = choose_large_ws_tile(m, n, epilogue, out_dtype.itemsize, sms) if m > MID_MAX_M or forced else None
    if tile is None and forced:
        tile = dict(LARGE_WS_TILES["128x128"])
    if tile is None:
        return None
    if rowwise_b and has_bias and tile["BLOCK_N"] == 256:
        tile = dict(LARGE_WS_TILES["128x128"])
    tile["BLOCK_K"] *= 2
    tile.update({key: config[key] for key in (*tile, "PINGPONG") if key in config})
    stream_k = config.get("STREAM_K")
    if stream_k is None:
        stream_k = _stream_k.STREAM_K and _stream_k.stream_k_pays(
            m, n, k, 64 * tile["CONSUMERS"], tile["BLOCK_N"], tile["BLOCK_K"], sms)
    tile["STREAM_K"] = bool(stream_k)
    return _ws_plan(m, n, k, 1, out_dtype.itemsize, True, sms, epilogue, (n, 1), tuple(tile.items()),
                    (2 if rowwise_a else 1, 2 if rowwise_b else 1))


# ----------------------------------------------------------------------------------------------
# launcher (inputs validated by the public functions)
# ----------------------------------------------------------------------------------------------


def _launch_fast_gluon(plan: GemmPlan, a, scale_a, b, scale_b, bias, out) -> None:
    """One launch of a :func:`fast_gluon_plan`; a repeat at the addresses of an earlier one calls
    the C launcher with that one's arguments (the plan's AddressMemo, as the 16-bit GEMM's: ~20-35
    µs of host time a launch on the H200 host, s44). The plan fixes every view and the output's
    dtype, not the operands' fp8 formats or the bias' dtype: those are in the key."""
    from ._matmul_gluon_plan import launch_ws_plan  # Gluon: imported on first use on an sm_90 GPU
    ws = plan.gluon_plan
    sk = split_k_buffers(a.device, ws.sk_slots, ws.sk_workspace) if ws.sk_slots else None
    memo = plan.memo if _matmul_kernels.MEMO_LAUNCHES else None
    key = None
    if memo is not None and not memo.off:
        key = (a.data_ptr(), a.dtype, b.data_ptr(), b.dtype, out.data_ptr(), scale_a.data_ptr(),
               scale_b.data_ptr(), None if bias is None else (bias.data_ptr(), bias.dtype),
               None if sk is None else (sk[0].data_ptr(), sk[1].data_ptr()))
        if memo.launch(key):
            return
    launch_ws_plan(ws, a, b.t(), out, bias, memo=memo if key else None, key=key, sk_buffers=sk,
                   scale_a=scale_a, scale_b=scale_b)


def launch_fp8_gemm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool = False,
                    config: dict | None = None, out_shape: tuple | None = None) -> torch.Tensor:
    """out [M, N] = (a @ bᵀ) · scale_a · scale_b + bias; a [M, K], b [N, K] fp8; scale_a [M] or
    [1], scale_b [N] or [1] contiguous fp32. ``fast_accum``: sm_90 wgmma partial sums stay in the
    tensor core's reduced-precision accumulator over the whole K (as _scaled_mm's use_fast_accum);
    otherwise they are promoted to fp32 once per K step. ``config`` overrides any key of
    :func:`choose_gemm_config`'s result, plus USE_TMA, FLATTEN and MAX_IMPRECISE_ACC; with
    ``WARP_SPECIALIZE`` (True / False: force; absent: :func:`use_warp_specialized`) the keys of
    ``_fp8_gluon.WS_CONFIG`` instead. ``out_shape``: the output allocated as ``[..., N]`` with
    M rows in all (the caller's leading dimensions: no view to return, which autograd would not
    let a user modify in place)."""
    (m, k), n = a.shape, b.shape[0]
    device = a.device
    out = empty(out_shape or (m, n), out_dtype, device)
    if m == 0 or n == 0:
        return out
    sms, hopper, hopper_or_newer = device_traits(device)
    plan = gemm_plan(m, n, k, a.stride(), b.stride(), out_dtype, scale_a.numel() != 1, scale_b.numel() != 1,
                     bias is not None, bool(fast_accum), sms, hopper, hopper_or_newer,
                     a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0,
                     KERNELS_INTERPRETED, config_key(config))
    if plan.gluon_plan is not None:
        _launch_fast_gluon(plan, a, scale_a, b, scale_b, bias, out if out.dim() == 2 else out.view(m, n))
        return out
    if plan.warp_specialized:
        from ._fp8_gluon import launch_fp8_gemm_ws      # Gluon: imported on first use on an sm_90 GPU
        launch_fp8_gemm_ws(a, scale_a, b, scale_b, bias, out if out.dim() == 2 else out.view(m, n),
                           dict(plan.ws_config))
        return out
    if plan.uses_tma:
        use_device_descriptors()        # per call: the allocator is a per-thread context value
    flags, partials = split_k_buffers(device, plan.grid[0], plan.sk_workspace) if plan.sk_workspace else (out, out)
    fp8_gemm_kernel.launch_prepared(
        plan.grid, (a, b, out, scale_a, scale_b, bias if bias is not None else out, partials, flags), plan.prepared)
    return out
