"""Kernels and launch heuristics of ``tilefuse.matmul``.

    out = act(a @ b + bias) + residual        a [M, K], b [K, N], bias [N], residual [M, N]

* ``matmul_kernel``: a persistent GEMM (grid = min(#SMs, tiles); each program walks tiles
  ``pid, pid + grid, ...``) in grouped tile order (GROUP_M row tiles sweep the columns together,
  so the B panel they share stays in L2), fp32 accumulation, software pipelining through
  ``num_stages``, and the epilogue in registers: bias, activation (``_activation_math``), residual,
  and optionally the pre-activation ``a @ b + bias`` stored for the backward. Operands come
  through pointer loads (any strides; rows past M / columns past N clamped to row 0 / column 0
  so only the K tail is masked) or, with ``USE_TMA``, through device-side tensor descriptors
  (Hopper; unit stride on a's K and on b's K or N axis, 16-byte aligned; zero fill past the edges).
  The output goes out through masked pointer stores or, with ``STORE_TMA``, a descriptor store in
  ``STORE_SPLIT`` column pieces (the default for 128x256 tiles: :func:`wide_tile_epilogue`).
  With ``SPLIT_K`` > 1 each tile's K loop is cut into slices run by different programs and the
  last slice to finish sums the fp32 partials in slice order (:func:`_split_k_fixup`; deterministic),
  for small-M GEMMs whose tiles alone would leave SMs idle (:func:`fill_with_slices`).
* ``act_grad_kernel``: dz = dy · act'(pre), the one elementwise step of the backward; the two
  backward GEMMs (dz @ bᵀ, aᵀ @ dz) run on ``matmul_kernel`` through transposed views.

Launch configs are a small declared table and one named choice function, in ``_matmul_configs``
(``CONFIGS``, ``choose_config``); no runtime autotuning. Any key can be overridden (``config=``)
for sweeps.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._dispatch import cdiv, device_traits, empty, num_sms, rows_view  # noqa: F401  (num_sms: scripts read mk.num_sms)
from .._address_memo import AddressMemo
from .._launch import PreparedArgs, config_key, fast_launch, use_device_descriptors
from . import _matmul_autotune as _autotune
from ._activation_math import BWD_TILE_ELEMS, activation_fwd, activation_fwd_bwd, tile_config, tile_rows_cols
from ._common import row_tile_mask_offsets
from ._matmul_configs import (  # noqa: F401  (CONFIGS, MID_MAX_M, split_k_slices, _fit, use_tma_default: read through this module)
    CONFIGS,
    DEFAULT_FLATTEN,
    DEFAULT_STORE_SPLIT,
    DEFAULT_STORE_TMA,
    MID_MAX_M,
    TmaLayout,
    _cached_config,
    _fit,
    _pointer_loads_cheaper,
    _store_tma_ok,
    _tma_by_default,
    choose_config,
    m_bucket,
    split_k_slices,
    tma_layout,
    tma_layout_from_strides,
    use_tma_default,
    wide_tile_epilogue,
)

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of ``tile_id`` in grouped order: consecutive tiles walk GROUP_M
    row tiles down one column tile, then the next column, so concurrently running programs share
    B columns (and A rows) in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    in_group = tile_id % tiles_per_group
    return first_m + in_group % group_rows, in_group // group_rows


@triton.jit
def _split_k_fixup(acc, ws_ptr, lock_ptr, tile_id, split, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Serial split-K reduction (as cuBLAS's): every split stores its fp32 partial tile to the
    workspace and counts its arrival on the tile's counter; the last to arrive sums all SPLIT_K
    partials in split order (bit-identical results whatever the arrival order), resets the
    counter for the next launch, and returns (sum, True) to run the epilogue. The others return
    (zeros, False). The barrier before the counter's release makes every thread's partial visible
    (CUTLASS's semaphore pattern); the sum's loads bypass L1 (.cg). (Taking the last slice's own
    partial from registers instead of loading it was slower: H200 2026-11-24, 31.6 against
    27.1 µs at 128x4096x4096 with 4 slices.) The serial sum runs at one SM's bandwidth (~70 GB/s),
    so slices must be long for it to pay: see :func:`fill_with_slices`."""
    tile_ws = ws_ptr + tile_id.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(tile_ws + split * (BLOCK_M * BLOCK_N) + offs, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    is_last = arrived == SPLIT_K - 1
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if is_last:
        for s in tl.static_range(SPLIT_K):
            total += tl.load(tile_ws + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
        tl.store(lock_ptr + tile_id, 0)
    return total, is_last


@triton.jit
def _matmul_epilogue(acc, c_desc, bias_ptr, residual_ptr, preact_ptr, c_ptr, off_m, off_n, M, N,
                     stride_cm, stride_cn, stride_rm, stride_rn, stride_pm, stride_pn,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     SAVE_PREACT: tl.constexpr, STORE_TMA: tl.constexpr, STORE_SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The output tile at (off_m, off_n): z = acc + bias; [preact = z]; out = act(z) + residual,
    stored through ``c_desc`` (STORE_TMA) or masked pointer stores to ``c_ptr``."""
    rows_c = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols_c = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows_c < M
    col_ok = cols_c < N
    mask = row_ok[:, None] & col_ok[None, :]
    z = acc
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols_c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SAVE_PREACT:
        tl.store(preact_ptr + rows_c[:, None] * stride_pm + cols_c[None, :] * stride_pn,
                 z.to(preact_ptr.dtype.element_ty), mask=mask)
    y = activation_fwd(z, ACT, c_ptr.dtype.element_ty == tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + rows_c[:, None] * stride_rm + cols_c[None, :] * stride_rn,
                      mask=mask, other=0.0)
        y += res.to(tl.float32)
    y = y.to(c_ptr.dtype.element_ty)
    if STORE_TMA:
        if STORE_SPLIT == 2:    # two [BLOCK_M, BLOCK_N / 2] stores: half the staging buffer
            y0, y1 = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c_desc.store([off_m, off_n], y0)
            c_desc.store([off_m, off_n + BLOCK_N // 2], y1)
        else:
            c_desc.store([off_m, off_n], y)
    else:
        tl.store(c_ptr + rows_c[:, None] * stride_cm + cols_c[None, :] * stride_cn, y, mask=mask)


@fast_launch
@triton.jit
def matmul_kernel(
    a_ptr,              # *A [M, K], any strides (unit K stride with USE_TMA)
    b_ptr,              # *B [K, N], any strides (unit K or N stride with USE_TMA)
    c_ptr,              # *out [M, N], output dtype
    bias_ptr,           # *bias [N], contiguous (ignored unless HAS_BIAS)
    residual_ptr,       # *residual [M, N], output dtype (ignored unless HAS_RESIDUAL)
    preact_ptr,         # *pre-activation a @ b + bias [M, N], output dtype (ignored unless SAVE_PREACT)
    ws_ptr,             # *fp32 split-K partials [tiles, SPLIT_K, BLOCK_M, BLOCK_N] (ignored unless SPLIT_K > 1)
    lock_ptr,           # *int32 split-K arrival counter per tile, zero between launches (same)
    M,                  # rows of A and out
    N,                  # columns of B and out
    K,                  # the reduced dimension (0: out is the epilogue alone)
    stride_am,          # elements between rows of A
    stride_ak,          # elements between columns of A
    stride_bk,          # elements between rows of B
    stride_bn,          # elements between columns of B
    stride_cm,          # elements between rows of out
    stride_cn,          # elements between columns of out
    stride_rm,          # elements between rows of residual
    stride_rn,          # elements between columns of residual
    stride_pm,          # elements between rows of preact
    stride_pn,          # elements between columns of preact
    HAS_BIAS: tl.constexpr,         # add bias[N] before the activation
    ACT: tl.constexpr,              # one of _activation_math.ACTIVATIONS ("none": identity)
    HAS_RESIDUAL: tl.constexpr,     # add residual[M, N] after the activation
    SAVE_PREACT: tl.constexpr,      # also store a @ b + bias (the backward's act' input)
    BLOCK_M: tl.constexpr,          # tile rows (>= 16: tl.dot's minimum)
    BLOCK_N: tl.constexpr,          # tile columns (>= 16)
    BLOCK_K: tl.constexpr,          # K per step (>= 16)
    GROUP_M: tl.constexpr,          # row tiles per group of the tile order
    SPLIT_K: tl.constexpr,          # programs sharing one output tile, each a slice of K (1: none)
    NUM_PROGRAMS: tl.constexpr,     # the persistent grid size (stride of the tile loop)
    EVEN_K: tl.constexpr,           # K % BLOCK_K == 0: pointer loads without a mask
    USE_TMA: tl.constexpr,          # operands through tensor descriptors instead of pointers
    A_M_CONTIGUOUS: tl.constexpr,   # (TMA) A has unit M stride (a transposed activation x.t(): dW = dyᵀ @ x)
    B_K_CONTIGUOUS: tl.constexpr,   # (TMA) B has unit K stride (a transposed weight w.t())
    FLATTEN: tl.constexpr,          # tl.range(flatten=...) of the tile loop (pipelines across tiles)
    WARP_SPECIALIZE: tl.constexpr,  # tl.range(warp_specialize=...) of the tile loop
    STORE_TMA: tl.constexpr,        # out [M, N] row-major through a descriptor store (TMA)
    STORE_SPLIT: tl.constexpr,      # (STORE_TMA) column subtiles of the store: 1 or 2
    DOT_PRECISION: tl.constexpr,    # "ieee" for fp32 operands (as torch without TF32)
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    if USE_TMA:
        if A_M_CONTIGUOUS:      # A = Xᵀ with X [K, M] row-major: read X tiles, transpose in registers
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_ak, 1],
                                               block_shape=[BLOCK_K, BLOCK_M])
        else:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
        if B_K_CONTIGUOUS:      # B = Wᵀ with W [N, K] row-major: read W tiles, transpose in registers
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
    if STORE_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // STORE_SPLIT])
    else:
        c_desc = c_ptr      # (unused)
    # the epilogue's tile has its own counter: with FLATTEN the pipeliner can then issue the next
    # tile's loads before this tile's stores (one value used in both breaks that)
    # a work unit is one K slice of one tile; the SPLIT_K slices of a tile are consecutive units
    k_tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    unit_c = tl.program_id(0) - NUM_PROGRAMS
    for unit in tl.range(tl.program_id(0), num_tiles * SPLIT_K, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(unit // SPLIT_K, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        k_lo = (unit % SPLIT_K) * k_tiles_per_split
        k_hi = tl.minimum(k_lo + k_tiles_per_split, k_tiles)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            for ki in range(k_lo, k_hi):
                if A_M_CONTIGUOUS:
                    a = tl.trans(a_desc.load([ki * BLOCK_K, off_m]))
                else:
                    a = a_desc.load([off_m, ki * BLOCK_K])
                if B_K_CONTIGUOUS:
                    b = tl.trans(b_desc.load([off_n, ki * BLOCK_K]))
                else:
                    b = b_desc.load([ki * BLOCK_K, off_n])
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        else:
            # clamped rows/columns read row 0 / column 0: valid memory, never stored
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            rows = tl.where(rows < M, rows, 0).to(tl.int64)
            cols = tl.where(cols < N, cols, 0).to(tl.int64)
            k0 = (k_lo * BLOCK_K).to(tl.int64)
            a_ptrs = a_ptr + rows[:, None] * stride_am + (k0 + ks[None, :]) * stride_ak
            b_ptrs = b_ptr + (k0 + ks[:, None]) * stride_bk + cols[None, :] * stride_bn
            for ki in range(k_lo, k_hi):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    k_left = K - ki * BLOCK_K
                    a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
                    b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk

        # epilogue: z = acc + bias; [preact = z]; out = act(z) + residual
        unit_c += NUM_PROGRAMS
        tile_id_c = unit_c // SPLIT_K
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if SPLIT_K > 1:     # only the tile's last slice to finish goes on, with the summed tile
            acc, tile_done = _split_k_fixup(acc, ws_ptr, lock_ptr, tile_id_c, unit_c % SPLIT_K,
                                            SPLIT_K, BLOCK_M, BLOCK_N)
        else:
            tile_done = True
        if tile_done:
            _matmul_epilogue(acc, c_desc, bias_ptr, residual_ptr, preact_ptr, c_ptr,
                             off_m, off_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn, stride_pm, stride_pn,
                             HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT, STORE_TMA, STORE_SPLIT, BLOCK_M, BLOCK_N)


@fast_launch
@triton.jit
def act_grad_kernel(
    dy_ptr,             # *grad of out [n_rows, n_cols], unit column stride
    pre_ptr,            # *saved pre-activation [n_rows, n_cols], unit column stride
    dz_ptr,             # *dz = dy · act'(pre) [n_rows, n_cols], contiguous, operand dtype
    dy_row_stride,      # elements between rows of dy
    pre_row_stride,     # elements between rows of pre
    dz_row_stride,      # elements between rows of dz
    n_rows,             # M
    n_cols,             # N
    n_col_blocks,       # cdiv(n_cols, BLOCK_N): the grid is row blocks x column blocks
    ACT: tl.constexpr,      # the forward's activation
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, _, cols = tile_rows_cols(n_col_blocks, BLOCK_M, BLOCK_N)
    mask, dy_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dy_row_stride)
    _, pre_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, pre_row_stride)
    _, dz_offs = row_tile_mask_offsets(rows, cols, n_rows, n_cols, dz_row_stride)
    dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + pre_offs, mask=mask, other=0.0).to(tl.float32)
    _, dact = activation_fwd_bwd(pre, ACT, dz_ptr.dtype.element_ty == tl.float32)
    tl.store(dz_ptr + dz_offs, (dy * dact).to(dz_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# launchers (inputs validated by the public function)
# ----------------------------------------------------------------------------------------------


class _MatmulPlan(NamedTuple):
    grid: tuple                 # (persistent programs,)
    uses_tma: bool              # operands through device-side descriptors (needs the allocator)
    prepared: PreparedArgs      # matmul_kernel's sizes, strides and constexprs
    split_tiles: int            # output tiles when split over K (0: not split)
    workspace: int              # fp32 elements of the split-K partials (0: not split)
    ws_tile: tuple = ()         # the Gluon kernel's tile config instead (see _ws_tile)
    ws_plan: object = None      # its launch plan (_matmul_gluon_plan._ws_plan)
    ws_launch: object = None    # and _matmul_gluon_plan.launch_ws_plan (imported when the plan is made)
    memo: object = None         # the launches kept by address (_address_memo.AddressMemo)
    tail_rows: int = 0          # the last rows launched as a second GEMM (_matmul_gluon_plan.tail_split_rows)


def _ws_tile(m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype, a_strides: tuple,
             b_strides: tuple, layout: TmaLayout, sms: int, hopper: bool, epilogue: tuple, out_aligned: bool,
             config: dict) -> tuple:
    """The tile of ``_matmul_gluon.gemm_ws_kernel`` when it takes this GEMM, else (): sm_90,
    16-bit operands read through host descriptors, a row-major output TMA can store, and
    - 32 < M <= MID_MAX_M: a row-major and b a transposed weight (x @ w.t(), nn.Linear's forward)
      or row-major [K, N] (dy @ w, its input gradient), with a tile that keeps most SMs busy (no
      split-K there: ``choose_ws_tile``). H200 2026-11-24, graph replays after an L2 flush,
      M = 128: 1.00 / 0.97 / 1.04 / 0.94x cuBLAS at N x K = 4096², 14336x4096, 4096x14336,
      6144x4096, where the tl kernel measured 0.86 / 0.95 / 0.96 / 0.85x in the same run
      (-s19-matmul-sweep-small-m-graph.log; M = 64 / 256 in -s19-decode-splits-matmul-mid-sweep.log);
      row-major b: 0.99 / 0.96 / 1.01 / 1.03x, the tl kernel 0.80 / 0.93 / 0.91 / 0.87x
      (-s20-matmul-row-major-b-sweep.log, -s20-matmul-m128-stream-k-sweep.log).
    - M > MID_MAX_M: also a transposed a (dyᵀ @ x, the weight gradient), with the tile of
      ``choose_large_ws_tile`` (None: the tl kernel).
    ``config``: GLUON False never takes it, True whenever eligible (at any M, 64x64 tiles if none
    fills the SMs; the tile keys BLOCK_N, BLOCK_K, STAGES, CONSUMERS, GROUP_M and PINGPONG override); any other
    config without GLUON is a tl kernel config, and keeps the tl kernel."""
    from . import _stream_k
    from ._matmul_gluon_plan import WS_TILES, choose_large_ws_tile, choose_ws_tile     # (imports this module)

    forced = config.get("GLUON", False if config else None)
    bucket = m_bucket(m)
    a_m_major = layout.a_m_contiguous and bucket == "large"
    eligible = (hopper and dtype in (torch.bfloat16, torch.float16) and k > 0 and forced is not False
                and (forced or bucket in ("mid", "large")) and layout.ok and out_aligned
                and (a_m_major or (not layout.a_m_contiguous and a_strides[1] == 1)) and _store_tma_ok(n, out_dtype))
    if not eligible:
        return ()
    if bucket == "large":
        tile = choose_large_ws_tile(m, n, epilogue, out_dtype.itemsize, sms) if GLUON_LARGE_M or forced else None
    else:
        tile = choose_ws_tile(m, n, sms)
    tile = tile or (dict(WS_TILES["64x64"]) if forced else None)
    if tile and forced:
        tile.update({key: config[key] for key in (*tile, "PINGPONG") if key in config})
    if not tile:
        return ()
    # large M: the last waves cut along K when _stream_k.STREAM_K and the idle SMs it recovers
    # pay for its fixup (_stream_k.stream_k_pays), or when a config's STREAM_K says so
    stream_k = config.get("STREAM_K")
    if stream_k is None:
        stream_k = bucket == "large" and _stream_k.STREAM_K and _stream_k.stream_k_pays(
            m, n, k, 64 * tile["CONSUMERS"], tile["BLOCK_N"], tile["BLOCK_K"], sms)
    stream_k = bool(stream_k)
    return tuple(tile.items()) + (("B_K_MAJOR", layout.b_k_contiguous), ("A_M_MAJOR", a_m_major),
                                  ("STREAM_K", stream_k))


# large-M 16-bit GEMMs on sm_90 take the Gluon kernel (_ws_tile); False: the tl kernel. An A/B
# switch for whole-step probes (scripts/lce_profile.py): clear _matmul_plan's cache after a change.
GLUON_LARGE_M = True

# GEMM launches repeated at the same addresses (Gluon and tl) call the C launcher with the arguments
# kept the first time (_address_memo.AddressMemo); False: every launch builds them (an A/B switch for probes)
MEMO_LAUNCHES = True

_SPLIT_K_BUFFERS: dict = {}     # (device, stream) -> (int32 arrival counters, fp32 partials)


def split_k_buffers(device: torch.device, tiles: int, workspace: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(zeroed per-tile arrival counters, fp32 partials of ``workspace`` elements) for a split-K
    launch. The kernel leaves the counters zero and every launch on a stream runs after the
    previous one, so one pair per (device, stream) serves them all (as cuBLAS's workspace; no
    allocation on the host path). Under CUDA-graph capture a fresh pair is made (the counters'
    zeroing captured with it), so the cache never holds the graph pool's memory."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return (torch.zeros(tiles, dtype=torch.int32, device=device),
                torch.empty(workspace, dtype=torch.float32, device=device))
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))   # (a Stream object: µs of host time)
    locks, partials = _SPLIT_K_BUFFERS.get(key, (None, None))
    if locks is None or locks.numel() < tiles:
        locks = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    if partials is None or partials.numel() < workspace:
        partials = torch.empty(workspace, dtype=torch.float32, device=device)
    _SPLIT_K_BUFFERS[key] = (locks, partials)
    return locks, partials


@functools.lru_cache(maxsize=4096)
def _matmul_plan(m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype, a_strides: tuple,
                 b_strides: tuple, res_strides: tuple, aligned: bool, sms: int, hopper: bool,
                 hopper_exact: bool, epilogue: tuple, config: tuple, out_aligned: bool = True) -> _MatmulPlan:
    """The launch of one GEMM problem: everything but the pointers, cached (host time: a
    small-M GEMM's kernel takes a few µs). ``epilogue``: (HAS_BIAS, ACT, HAS_RESIDUAL, SAVE_PREACT).
    ``aligned``: a's and b's bases are 16-byte aligned; ``out_aligned``: out's (a caller's ``out``)."""
    layout = tma_layout_from_strides(a_strides, b_strides, (m, k), (k, n), aligned, dtype.itemsize)
    ws_tile = _ws_tile(m, n, k, dtype, out_dtype, a_strides, b_strides, layout, sms, hopper_exact, epilogue,
                       out_aligned, dict(config))
    if ws_tile:
        from ._matmul_gluon_plan import _ws_plan, launch_ws_plan, tail_split_rows     # (imports this module)

        ws = _ws_plan(m, n, k, dtype.itemsize, out_dtype.itemsize, dict(ws_tile)["B_K_MAJOR"], sms, epilogue,
                      res_strides, ws_tile)
        # a stream-K plan evens its last waves itself; else the last rows may go to a second launch
        tail = (tail_split_rows(m, n, k, dict(ws_tile), epilogue, sms)
                if m_bucket(m) == "large" and not config and not ws.sk_slots else 0)
        if tail:
            return _MatmulPlan((), True, None, 0, 0, ws_tile, tail_rows=tail)
        return _MatmulPlan((), True, None, 0, 0, ws_tile, ws, launch_ws_plan, AddressMemo())
    cfg = dict(_cached_config(m, n, k, dtype, sms))
    cfg.update(wide_tile_epilogue(cfg))
    cfg.update({key: value for key, value in config if key != "GLUON"})
    use_tma = cfg.pop("USE_TMA", None)
    if use_tma is None:
        use_tma = _tma_by_default(layout.ok, hopper) and not _pointer_loads_cheaper(m, a_strides, b_strides)
    use_tma = k > 0 and layout.ok and bool(use_tma)
    flatten = cfg.pop("FLATTEN", DEFAULT_FLATTEN)
    store_tma = cfg.pop("STORE_TMA", None)
    store_tma = use_tma and _store_tma_ok(n, out_dtype) and (DEFAULT_STORE_TMA if store_tma is None else bool(store_tma))
    store_split = cfg.pop("STORE_SPLIT", DEFAULT_STORE_SPLIT) if store_tma else 1
    if store_split not in (1, 2):
        raise ValueError(f"config: STORE_SPLIT must be 1 or 2, got {store_split}")
    split = int(cfg.pop("SPLIT_K", 1)) if k > 0 else 1
    if split < 1:
        raise ValueError(f"config: SPLIT_K must be >= 1, got {split}")
    flatten = flatten and split == 1    # (the split-K arrival must not be pipelined across units)
    tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    programs = max(1, min(sms, tiles * split))
    has_bias, act, has_res, save_preact = epilogue
    ints = (m, n, k, *a_strides, *b_strides, n, 1, *res_strides, n, 1)   # out and preact: row-major [M, N]
    kwargs = dict(
        HAS_BIAS=has_bias, ACT=act, HAS_RESIDUAL=has_res, SAVE_PREACT=save_preact,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        SPLIT_K=split, NUM_PROGRAMS=programs, EVEN_K=k % cfg["BLOCK_K"] == 0, USE_TMA=bool(use_tma),
        A_M_CONTIGUOUS=layout.a_m_contiguous, B_K_CONTIGUOUS=layout.b_k_contiguous, FLATTEN=bool(flatten),
        WARP_SPECIALIZE=bool(cfg.pop("WARP_SPECIALIZE", False)), STORE_TMA=store_tma, STORE_SPLIT=store_split,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    split_tiles = tiles if split > 1 else 0
    return _MatmulPlan((programs,), bool(use_tma), matmul_kernel.prepare(ints, kwargs),
                       split_tiles, split_tiles * split * cfg["BLOCK_M"] * cfg["BLOCK_N"], memo=AddressMemo())


def launch_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, activation: str = "none",
                  out_dtype: torch.dtype | None = None, save_preact: bool = False,
                  config: dict | None = None, out: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, preact or None) of act(a @ b + bias) + residual; a [M, K], b [K, N] with any
    strides, residual [M, N]. ``config`` overrides any key of :func:`choose_config`'s result,
    plus SPLIT_K, USE_TMA, FLATTEN, STORE_TMA, STORE_SPLIT, WARP_SPECIALIZE and GLUON (see
    :func:`_ws_tile`).
    ``out``: a contiguous [M, N] tensor of out_dtype to write (it may be ``residual`` itself: each
    tile is read by the program that writes it, before it writes it), else a new one."""
    (m, k), n = a.shape, b.shape[1]
    out_dtype = out_dtype or a.dtype
    if out is None:
        out = empty((m, n), out_dtype, a.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] {out_dtype} tensor, got {tuple(out.shape)} "
                         f"{out.dtype} with strides {out.stride()}")
    preact = empty((m, n), out_dtype, a.device) if save_preact else None
    if m == 0 or n == 0:
        return out, preact
    a_strides = a.stride()
    if m == 1 and a_strides[1] == 1:    # a one-row a's row stride is free: a 16-byte aligned one lets descriptors read it
        a_strides = (cdiv(k, 16 // a.element_size()) * (16 // a.element_size()), 1)
    sms, hopper, hopper_or_newer = device_traits(a.device)
    problem = (m, n, k, a.dtype, out_dtype, a_strides, b.stride(), residual.stride() if residual is not None else (n, 1),
               a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0, sms, hopper_or_newer, hopper,
               (bias is not None, activation, residual is not None, save_preact))
    if config is None and _autotune.ENABLED:    # opt-in: the fastest declared config, timed once per problem
        tuned = _autotuned(problem, a, b, bias, residual, activation, out_dtype, save_preact)
    else:
        tuned = config_key(config) if config else ()
    plan = _matmul_plan(*problem, tuned, out.data_ptr() % 16 == 0)
    if plan.tail_rows:      # its first rows, then the last ones on their own plan (residual and preact: none)
        m1 = m - plan.tail_rows
        for rows in (slice(0, m1), slice(m1, m)):
            launch_matmul(a[rows], b, bias, None, activation, out_dtype, False, None, out[rows])
        return out, preact
    memo = plan.memo if MEMO_LAUNCHES else None
    key = None
    if memo is not None and not memo.off:
        # the plan fixes a's and b's dtypes and views, out's and preact's; bias and residual bring
        # their dtypes (a repeat at the same addresses: one call of the C launcher)
        key = (a.data_ptr(), b.data_ptr(), out.data_ptr(),
               None if bias is None else (bias.data_ptr(), bias.dtype),
               None if residual is None else (residual.data_ptr(), residual.dtype),
               None if preact is None else preact.data_ptr())
    if plan.ws_plan is not None:
        sk = None
        if plan.ws_plan.sk_slots:       # stream-K: the per-stream workspace, its addresses in the key
            sk = split_k_buffers(a.device, plan.ws_plan.sk_slots, plan.ws_plan.sk_workspace)
            key = key and (*key, sk[0].data_ptr(), sk[1].data_ptr())
        if key is None or not memo.launch(key):
            plan.ws_launch(plan.ws_plan, a, b, out, bias, residual, preact, memo if key else None, key, sk)
        return out, preact
    if plan.uses_tma and a.device.type == "cuda":   # (forced under the interpreter: pointer loads)
        use_device_descriptors()        # per call: the allocator is a per-thread context value
    if plan.split_tiles:
        locks, workspace = split_k_buffers(a.device, plan.split_tiles, plan.workspace)
        key = key and (*key, workspace.data_ptr(), locks.data_ptr())
    else:
        workspace = locks = out
    if key is not None and memo.launch(key):
        return out, preact
    # out stands in for an absent bias / residual / preact / split-K buffers
    tensors = (a, b, out, bias if bias is not None else out, residual if residual is not None else out,
               preact if preact is not None else out, workspace, locks)
    matmul_kernel.launch_prepared(plan.grid, tensors, plan.prepared)
    if key is not None:
        memo.keep(key, matmul_kernel, plan.grid, tensors, plan.prepared)
    return out, preact


def _autotuned(problem: tuple, a, b, bias, residual, activation, out_dtype, save_preact) -> tuple:
    """The autotuned config of ``problem`` (``_matmul_autotune``): each candidate launched on
    these operands into a fresh output (``config={}``: the heuristic's, and no tuning inside)."""
    hit = _autotune.cached_choice(problem)      # the repeated call: one dict lookup, no lock
    if hit is not None:
        return hit

    def run(candidate: tuple) -> torch.Tensor:
        return launch_matmul(a, b, bias, residual, activation, out_dtype, save_preact, dict(candidate))[0]
    return _autotune.tuned_config(problem, run, a, out_dtype)


def launch_act_grad(dy: torch.Tensor, pre: torch.Tensor, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """dz = dy · act'(pre) as a contiguous [M, N] tensor of ``dtype`` (the GEMM operand dtype)."""
    dz = empty(pre.shape, dtype, pre.device)
    if dz.numel() == 0:
        return dz
    dy2, pre2 = rows_view(dy), rows_view(pre)
    n_rows, n_cols = pre2.shape
    cfg = tile_config(n_rows, n_cols, BWD_TILE_ELEMS)
    n_col_blocks = cdiv(n_cols, cfg["BLOCK_N"])
    act_grad_kernel[(cdiv(n_rows, cfg["BLOCK_M"]) * n_col_blocks,)](
        dy2, pre2, dz, dy2.stride(0), pre2.stride(0), dz.stride(0), n_rows, n_cols, n_col_blocks,
        ACT=activation, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
    )
    return dz
