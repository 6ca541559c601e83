"""Weight-only quantization: int8 per output channel, int4 group-wise with zero points.

Formats (``W`` is a linear layer's weight ``[N, K]``: N output features, K input features):

* **int8**, symmetric, one scale per output channel (``group_size`` None)::

      s[n] = absmax(W[n, :]) / 127,   q = clamp(round(W / s), -127, 127)  (int8 [N, K])
      dequant: W[n, k] = q[n, k] * s[n]

* **int4**, asymmetric, groups of ``group_size`` (32, 64, 128) consecutive k::

      lo = min(min(W[n, group]), 0),  hi = max(max(W[n, group]), 0)
      s = (hi - lo) / 15,  z = clamp(round(-lo / s), 0, 15),  q = clamp(round(W / s) + z, 0, 15)
      dequant: W[n, k] = (q[n, k] - z[n, k // group_size]) * s[n, k // group_size]

  The range always holds 0 (GPTQ's choice): z then lies in [0, 15] without clamping, zero
  weights stay exact, and no value is clamped. Packing: two values per uint8 along K,
  ``qweight[n, j] = q[n, 2j] | (q[n, 2j + 1] << 4)`` (even k in the low nibble), so ``qweight``
  is ``[N, K / 2]``; zero points are one uint8 per group, ``[N, K / group_size]``.

Scales are stored in the weight's dtype, rounded *up* to it (so ``range / s <= 15`` and
``absmax / s <= 127`` still hold after rounding), and the quantization itself is done in fp64
against the stored scale: every element then obeys ``|W - dequant(q)| <= s / 2`` exactly.

``quant_linear(x, qw, bias)`` computes ``x @ dequant(qw).T + bias`` with the kernels of
``_quant_kernels`` on CUDA or under the interpreter (M = 1: the FMA GEMV; more rows: the
tensor-core kernel; either splits K when its tiles alone cannot fill the GPU; launch configs in
:func:`launch_plan`, cached per shape), and ``F.linear(x, dequantize_weight(qw), bias)`` on CPU
otherwise. On sm_90, 2..16 rows of fp16 / bf16 x against an int4 group-128 weight take the Hopper
kernel of ``_quant_wgmma`` instead (warp-group MMA, the weight dequantized into its register
operand, x relabeled in shared memory: 1.40-1.53× bf16 cuBLAS at M = 16 on the H200, against
1.17-1.29× for the tensor-core kernel; benchmarks/NOTES.md, session 23). For int4 with up to 32
rows of fp16 / bf16 x the launcher can also run the Gluon
kernel of ``_quant_gluon`` (config ``PATH="mma"``, sm_80+; sweeps and tests): the weight dequantized straight into
``mma.sync``'s registers, 2.5 SASS instructions per value instead of 4.4; not a default, since
on the H200 it was faster at only one of the sweep's shapes (benchmarks/NOTES.md, session 18).

Bytes counted (ideal, one forward): the packed weight (N·K or N·K/2), scales and zero points,
x and y (and the bias when given). FLOPs: 2·M·N·K.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from .._dispatch import cdiv, device_major, empty, interpreting, is_ampere_or_newer, next_power_of_2, num_sms, rows_view, use_triton
from .._op import custom_op
from ..registry import Inputs, OpSpec, register
from ._quant_kernels import MAGIC_BITS, quant_dot_kernel, quant_gemv_kernel, splitk_reduce_kernel

SUPPORTED_BITS = (4, 8)
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 128
INT8_QMAX = 127
INT4_QMAX = 15


class QuantizedWeight(NamedTuple):
    """A quantized ``[N, K]`` weight; see the module docstring for the formats."""
    qweight: torch.Tensor            # int8 [N, K] or uint8 [N, K/2] (int4, two per byte)
    scales: torch.Tensor             # [N] (int8) or [N, K/group_size] (int4), the weight's dtype
    zeros: Optional[torch.Tensor]    # uint8 [N, K/group_size] (int4); None for int8
    bits: int                        # 8 or 4
    group_size: Optional[int]        # None for int8 (per channel)
    shape: tuple                     # (N, K) of the original weight

    def nbytes(self) -> int:
        """Bytes of the stored tensors (packed weight, scales, zero points)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)


# ----------------------------------------------------------------------------------------------
# quantize / dequantize (torch; one-time work, fp64 so the error bound holds exactly)
# ----------------------------------------------------------------------------------------------


def _round_up_to(s64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``s64`` in ``dtype``, rounded toward +inf (never below the fp64 value); 0 -> 1 (an
    all-zero row or group: any scale is exact, and 1 avoids dividing by zero)."""
    s = s64.to(dtype)
    low = s.double() < s64
    if bool(low.any()):
        try:
            up = torch.nextafter(s, torch.full_like(s, float("inf")))
        except RuntimeError:   # nextafter not built for this dtype on this device
            up = torch.nextafter(s.cpu(), torch.full_like(s.cpu(), float("inf"))).to(s.device)
        s = torch.where(low, up, s)
    return torch.where(s == 0, torch.ones_like(s), s)


def _check_format(bits: int, group_size: Optional[int]) -> Optional[int]:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be 4 or 8; got {bits!r}")
    if bits == 8:
        if group_size is not None:
            raise ValueError(f"group_size: int8 is quantized per output channel, pass None; got {group_size!r}")
        return None
    group_size = DEFAULT_INT4_GROUP_SIZE if group_size is None else group_size
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} for int4; got {group_size!r}")
    return group_size


def quantize_weight(w: torch.Tensor, bits: int = 8, group_size: Optional[int] = None) -> QuantizedWeight:
    """Quantize a float weight ``[N, K]`` (see the module docstring). ``group_size`` None means
    per channel for int8 and 128 for int4. Raises ValueError when K % group_size != 0."""
    check_tensor("w", w)
    if w.dim() != 2:
        raise ValueError(f"w must be a 2-D [N, K] weight; got shape {tuple(w.shape)}")
    group_size = _check_format(bits, group_size)
    n, k = w.shape
    if k == 0:
        raise ValueError("w has K = 0 input features: nothing to quantize")
    if group_size is not None and k % group_size:
        raise ValueError(f"group_size {group_size} must divide K = {k} (w's last dimension)")
    w64 = w.detach().double()
    if not bool(torch.isfinite(w64).all()):
        raise ValueError("w has non-finite values (inf or nan)")
    if bits == 8:
        s = _round_up_to(w64.abs().amax(dim=1) / INT8_QMAX, w.dtype)
        q = torch.round(w64 / s.double()[:, None]).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
        return QuantizedWeight(q, s, None, 8, None, (n, k))
    wg = w64.reshape(n, k // group_size, group_size)
    lo = wg.amin(dim=2).clamp(max=0.0)
    hi = wg.amax(dim=2).clamp(min=0.0)
    s = _round_up_to((hi - lo) / INT4_QMAX, w.dtype)
    s64 = s.double()
    z = torch.round(-lo / s64).clamp_(0, INT4_QMAX)
    q = (torch.round(wg / s64[..., None]) + z[..., None]).clamp_(0, INT4_QMAX).to(torch.uint8).reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return QuantizedWeight(packed.contiguous(), s, z.to(torch.uint8), 4, group_size, (n, k))


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> uint8 ``[N, K]`` values in [0, 15] (low nibble = even k)."""
    lo, hi = qweight & 0xF, qweight >> 4
    return torch.stack((lo, hi), dim=-1).reshape(qweight.shape[0], -1)


def dequantize_weight(q: QuantizedWeight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float weight ``[N, K]`` that ``q`` stands for, in ``dtype`` (default: the scales'
    dtype); computed in fp32 (fp64 when ``dtype`` is fp64), rounded once."""
    dtype = q.scales.dtype if dtype is None else dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    s = q.scales.to(wide)
    if q.bits == 8:
        return (q.qweight.to(wide) * s[:, None]).to(dtype)
    n, k = q.shape
    ints = unpack_int4(q.qweight).to(wide).reshape(n, k // q.group_size, q.group_size)
    return ((ints - q.zeros.to(wide)[..., None]) * s[..., None]).reshape(n, k).to(dtype)


# ----------------------------------------------------------------------------------------------
# launchers (inputs validated by quant_linear)
# ----------------------------------------------------------------------------------------------

GEMV_MAX_ROWS = 8          # quant_gemv_kernel takes up to this many rows (one program per row)
SKINNY_MAX_ROWS = 64       # up to here the dot kernel pads M to a 16..64-row tile; above: 128
REDUCE_BLOCK_N = 256       # columns per program of the split-K reduction
MMA_MAX_ROWS = 32         # the Gluon int4 kernel pads x to an MMA N of 8, 16 or 32 rows
WGMMA_MAX_ROWS = 64        # the Hopper int4 kernel pads x to a wgmma N of 8..64 rows
WGMMA_DEFAULT_MAX_ROWS = 16  # ... and is the default up to here (at 32 rows it was level with the tl kernel)
WGMMA_GROUPS_PER_PROGRAM = 8   # groups of K per program (split-K beyond): more programs hide more latency
WGMMA_SMEM = 200 * 1024    # its shared memory: x for the program's groups + the weight ring (sm_90: 227 KB)
CONFIG_KEYS = ("PATH", "SWAP_AB", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_STAGES", "num_warps", "SPLITS", "PACKED",
               "X_PAIRS", "WARPS_K", "WARPS_N", "REPS", "GROUPS_PER_STEP", "PRELOAD", "CHUNK", "STAGES")


class LaunchPlan(NamedTuple):
    """Everything a call of a given shape launches with (cached per shape by :func:`launch_plan`)."""
    kernel: object             # quant_gemv_kernel, quant_dot_kernel, int4_mma_kernel or int4_wgmma_kernel
    grid: tuple
    splits: int                # > 1: fp32 partials, then splitk_reduce_kernel
    n_chunks: int              # BLOCK_K chunks of K
    chunks_per_split: int
    meta: dict                 # constexpr and launch options (do not mutate: shared by the cache)


def _dot_precision(dtype: torch.dtype):
    """fp32 inputs must not drop to tf32 (the fp32 tolerance is 1e-5); others: the default."""
    return "ieee" if dtype == torch.float32 else None


def _use_gemv(m: int) -> bool:
    """One row: FMA on CUDA cores beats an MMA tile padded from 1 to 16 rows."""
    return m == 1


def _gemv_config(bits: int, n: int, sms: int) -> dict:
    """16 weight rows x 1024 (int4) / 512 (int8) columns per loop step: 8 KiB of weight and 128
    values per thread (4 warps), few enough registers for 4-5 programs per SM; 3 steps in flight.
    8 rows (2 warps) when N is too small to give every SM a program. Instruction counts (sm_90
    SASS of the loop, per weight value): 4.6 int4 (4.4 with bf16 x read as int32 pairs, X_PAIRS:
    :func:`_x_pairs`), 5.6 int8.

    A persistent variant (programs walking row blocks in one pipelined loop) measured no gain on
    the H200, 2026-11-24 (6.5 / 14.6 / 15.4 us at best at N×K = 4096², 14336×4096, 4096×14336,
    int4 g128), and was removed."""
    if cdiv(n, 16) >= sms:
        return dict(PATH="gemv", BLOCK_N=16, BLOCK_K=1024 if bits == 4 else 512, NUM_STAGES=3, num_warps=4,
                    X_PAIRS=True)
    return dict(PATH="gemv", BLOCK_N=8, BLOCK_K=1024 if bits == 4 else 512, NUM_STAGES=3, num_warps=2,
                X_PAIRS=True)


def _x_pairs(cfg: dict, bits: int, dtype: torch.dtype) -> bool:
    """X_PAIRS (int4 GEMV, on by default; ``X_PAIRS=False`` turns it off): bf16 x read as int32
    pairs, one shift or mask per value instead of a PRMT and a shift per two (sm_90 loop: 4.41
    against 4.57 instructions per weight value), the same fp32 values, so y is bitwise the same.
    H200, 2026-11-24 (graph time, weights from DRAM, int4 g128): 6.6 / 14.1 / 15.8 -> 6.5 / 13.9 /
    15.6 us at N×K = 4096², 14336×4096, 4096×14336, about 1-1.5 % faster at all three. Only bf16
    has the layout; other dtypes ignore the key. An x whose rows are off 4-byte boundaries is read
    as bf16 instead (:func:`_pairs_aligned`)."""
    return bool(cfg.get("X_PAIRS")) and bits == 4 and dtype == torch.bfloat16


def _pairs_aligned(x2: torch.Tensor) -> bool:
    """Every row of x starts on a 4-byte boundary, as X_PAIRS's int32 loads need (a bf16 view off
    one, e.g. ``x[..., 1:]``, does not)."""
    return x2.data_ptr() % 4 == 0 and (x2.shape[0] == 1 or x2.stride(0) % 2 == 0)


def _dot_config(m: int, dtype: torch.dtype) -> dict:
    """Up to 32 rows: SWAP_AB, x padded to a 16/32-row tile against 64 weight rows (the wgmma M of
    one warp group) x 128 columns, split along K into many programs (:func:`_splits`). 33..64 rows: a
    64 x 64 tile x 128 columns, the weight tile as the B operand in shared memory (6.2; 5.2 with
    128 weight rows, but then N = 4096 gives 32 tiles). Above: 128 x 128 tiles, 8 warps. fp32 x
    has no tensor-core path (an FMA dot): 64 x 64 tiles, 64 columns, to stay in registers."""
    if dtype == torch.float32:
        return dict(PATH="dot", SWAP_AB=True, BLOCK_M=min(64, max(16, next_power_of_2(m))), BLOCK_N=64, BLOCK_K=64,
                    NUM_STAGES=2, num_warps=4)
    if m <= 32:
        return dict(PATH="dot", SWAP_AB=True, BLOCK_M=max(16, next_power_of_2(m)), BLOCK_N=64, BLOCK_K=128,
                    NUM_STAGES=3, num_warps=4)
    if m <= SKINNY_MAX_ROWS:
        return dict(PATH="dot", SWAP_AB=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=3, num_warps=4)
    return dict(PATH="dot", SWAP_AB=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, NUM_STAGES=3, num_warps=8)


def _use_mma(bits: int, m: int, dtype: torch.dtype, mma_ok: bool) -> bool:
    """What the Gluon kernel (``_quant_gluon``, ``PATH="mma"``: the weight dequantized straight into
    the MMA's registers) takes: int4 with fp16 / bf16 x and up to MMA_MAX_ROWS rows, on an sm_80+
    GPU (not the interpreter)."""
    return mma_ok and bits == 4 and m <= MMA_MAX_ROWS and dtype in (torch.float16, torch.bfloat16)


def _use_wgmma(bits: int, group_size: int, m: int, dtype: torch.dtype, wgmma_ok: bool) -> bool:
    """What the Hopper kernel (``_quant_wgmma``, ``PATH="wgmma"``) takes: int4 group 128 with fp16 /
    bf16 x and up to WGMMA_MAX_ROWS rows, on an sm_90 GPU (not the interpreter)."""
    return (wgmma_ok and bits == 4 and group_size == 128 and m <= WGMMA_MAX_ROWS
            and dtype in (torch.float16, torch.bfloat16))


def _wgmma_config(m: int, n: int) -> dict:
    """One warp group on 64 weight rows (REPS = 1), z / s for 4 steps per loop body, 4 steps of
    weight in the cp.async ring, about WGMMA_GROUPS_PER_PROGRAM groups of K per program. The
    best of the H200 sweep at M = 4 and 16 (``-s23-quant-sweep-wgmma-*.log``): 128 rows per
    program (REPS = 2 or 8 warps) and 16-32 groups per program were slower."""
    return dict(PATH="wgmma", num_warps=4, REPS=1, CHUNK=4, STAGES=4)


def _mma_config(m: int, n: int) -> dict:
    """4 warps on 16 weight rows (REPS = 1 row tile of 16 per warp), each warp on its own run of
    groups of K (WARPS_K = 4, summed through shared memory at the end), one group per warp and
    step; the program count is filled up by split-K (:func:`_mma_steps`). The best Gluon config
    of the H200 sweep at M = 1 (``-s18-quant-sweep-*.log``)."""
    return dict(PATH="mma", WARPS_K=4, WARPS_N=1, REPS=1, GROUPS_PER_STEP=1)


MMA_MAX_STEPS = 8          # the Gluon int4 kernel's steps are unrolled: 16 ran 1.8-16x slower (H200)


def _mma_steps(blocks: int, n_groups: int, slots: int, sms: int) -> int:
    """Steps per program of the Gluon int4 kernel (a power of two; the K split follows): the
    largest that still gives 2 programs per SM, at most MMA_MAX_STEPS."""
    steps = MMA_MAX_STEPS
    while steps > 1 and blocks * cdiv(n_groups, slots * steps) < 2 * sms:
        steps //= 2
    return steps


def _default_config(bits: int, group_size: int, m: int, n: int, dtype: torch.dtype, sms: int,
                    wgmma_ok: bool = False) -> dict:
    """M = 1: the GEMV kernel; 2..WGMMA_DEFAULT_MAX_ROWS rows of int4 group 128 on sm_90: the Hopper
    kernel; more rows: the tensor-core kernel (see the functions above). The Gluon ``mma.sync``
    kernel (``PATH="mma"``) is not a default: on the H200 it was level with them or slower at
    every shape but one (benchmarks/NOTES.md, session 18)."""
    if _use_gemv(m):
        return _gemv_config(bits, n, sms)
    if m <= WGMMA_DEFAULT_MAX_ROWS and _use_wgmma(bits, group_size, m, dtype, wgmma_ok):
        return _wgmma_config(m, n)
    return _dot_config(m, dtype)


def _packed_dequant(bits: int, dtype: torch.dtype, group_size: int, swap_ab: bool) -> bool:
    """int4 into fp16/bf16 x: dequantize two values per 16-bit pair instruction (inline PTX, 4.95
    against 6.51 SASS instructions per weight value in the 16-row loop). On the H200 this did not
    change the time (the loop is latency-bound, not issue-bound: benchmarks/NOTES.md, session 8);
    it leaves issue slots to the co-resident programs. The interpreter cannot run PTX: it takes
    the fp32 path, which gives the same weight bit for bit (a GPU test compares y bitwise). Not for
    group 32 with the weight as the B operand: Triton 3.6 fails to compile that tile ("Illegal
    shared layout" in TritonGPUOptimizeDotOperands)."""
    return (bits == 4 and dtype in (torch.float16, torch.bfloat16) and not interpreting()
            and (swap_ab or group_size >= 64))


def _int4_block_k(want: int, group_size: int, n_groups: int) -> int:
    """Whole groups per chunk (one scale per group and row), a power of two that divides the
    group count, so every chunk is entirely inside K or entirely past it."""
    groups = max(1, want // group_size)
    while n_groups % groups:
        groups //= 2
    return groups * group_size


def _gemv_int4_block_k(want: int, group_size: int, n_groups: int) -> int:
    """The GEMV's int4 chunk: ``want`` columns in whole groups (a power of two of them, at most
    what K holds), the last chunk partial where they do not divide K's groups (``RAGGED_K``
    masks per group). Halving the chunk until it divides instead (``_int4_block_k``) made K =
    11008 (86 groups of 128) run 256-column chunks at 25.6 µs against 13.9 for the mma kernel
    at 4096×11008 (H200, session 33)."""
    groups = max(1, want // group_size)
    while groups > 1 and groups // 2 >= n_groups:
        groups //= 2
    return groups * group_size


def _splits(tiles: int, n_chunks: int, sms: int, bits: int, m: int, k: int, swap_ab: bool) -> int:
    """K splits. No more than keep the fp32 partials' traffic (splits·M·N·8 bytes, written and read
    back) within half the weight's (N·K·bits/8): at most K·bits / (128·M).

    W·xᵀ tiles (up to 32 rows): about 6 programs per SM, each of at least 4 chunks. A program's K
    step is a chain of waits (layout change through shared memory, wgmma) that only other
    programs on the SM hide: at M = 16 the H200 sweep (``-s8-quant-sweep-splits.log``) found 8, 4
    and 8 splits of 128-column chunks best at 4096², 14336×4096 and 4096×14336 (0.96, 0.89 and
    0.78× the time of the former 256-column default). Larger tiles: split only when the tiles
    leave SMs idle, to about 2 programs per SM."""
    cap = k * bits // (128 * m)
    if swap_ab:
        return max(1, min(cap, cdiv(6 * sms, tiles), n_chunks // 4))
    if tiles >= sms:
        return 1
    return max(1, min(n_chunks, cdiv(2 * sms, tiles), cap))


@functools.lru_cache(maxsize=4096)
def launch_plan(bits: int, group_size: int, m: int, n: int, k: int, dtype: torch.dtype, sms: int,
                overrides: tuple = (), mma_ok: bool = False, wgmma_ok: bool = False) -> LaunchPlan:
    """The launch of an ``[m, k] x [n, k]ᵀ`` call; ``overrides`` (sorted ``(key, value)`` pairs of
    :data:`CONFIG_KEYS`) replace the defaults (sweeps), those of the overriding PATH when it names
    another kernel. int4 BLOCK_K is rounded to whole groups. ``mma_ok``: the Gluon kernel can run
    (an sm_80+ GPU, not the interpreter)."""
    cfg = _default_config(bits, group_size, m, n, dtype, sms, wgmma_ok)
    path = dict(overrides).get("PATH", cfg["PATH"])
    if path != cfg["PATH"]:
        cfg = {"gemv": lambda: _gemv_config(bits, n, sms), "dot": lambda: _dot_config(m, dtype),
               "mma": lambda: _mma_config(m, n), "wgmma": lambda: _wgmma_config(m, n)}.get(path, lambda: dict(PATH=path))()
    cfg.update(overrides)
    unknown = set(cfg) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}; known: {CONFIG_KEYS}")
    if (cfg["PATH"] not in ("gemv", "dot", "mma", "wgmma") or (cfg["PATH"] == "gemv" and m > GEMV_MAX_ROWS)
            or (cfg["PATH"] == "mma" and not _use_mma(bits, m, dtype, mma_ok))
            or (cfg["PATH"] == "wgmma" and not _use_wgmma(bits, group_size, m, dtype, wgmma_ok))):
        needs = {"mma": (mma_ok, "an sm_80+ GPU"), "wgmma": (wgmma_ok, "an sm_90 GPU")}.get(cfg["PATH"], (True, ""))
        raise ValueError(f"config: PATH {cfg['PATH']!r} cannot serve M = {m}, {bits} bits, group {group_size}, {dtype}"
                         + ("" if needs[0] else f" here (the {cfg['PATH']} path needs {needs[1]})"))
    if cfg["PATH"] == "mma":
        return _mma_plan(cfg, group_size, m, n, k, sms)
    if cfg["PATH"] == "wgmma":
        return _wgmma_plan(cfg, m, n, k)
    if bits == 4:
        pick = _gemv_int4_block_k if cfg["PATH"] == "gemv" else _int4_block_k
        block_k = pick(cfg["BLOCK_K"], group_size, k // group_size)
    else:
        block_k = cfg["BLOCK_K"]
    n_chunks = cdiv(k, block_k)
    block_n = cfg["BLOCK_N"]
    meta = dict(BITS=bits, GROUP_SIZE=group_size, INT8_WORDS=bits == 8 and k % 4 == 0)
    swap_ab = False
    if cfg["PATH"] == "gemv":
        kernel, tiles = quant_gemv_kernel, m * cdiv(n, block_n)
        meta.update(X_PAIRS=_x_pairs(cfg, bits, dtype), RAGGED_K=bits == 4 and k % block_k != 0)
    else:
        block_m = cfg.get("BLOCK_M") or max(16, next_power_of_2(m))
        kernel, tiles = quant_dot_kernel, cdiv(m, block_m) * cdiv(n, block_n)
        swap_ab = bool(cfg.get("SWAP_AB", True))
        packed = bool(cfg.get("PACKED", True)) and _packed_dequant(bits, dtype, group_size, swap_ab)
        meta.update(DOT_PRECISION=_dot_precision(dtype), SWAP_AB=swap_ab, BLOCK_M=block_m, PACKED_DEQUANT=packed)
    splits = min(cfg.get("SPLITS") or _splits(tiles, n_chunks, sms, bits, m, k, swap_ab), n_chunks)
    chunks_per_split = cdiv(n_chunks, splits)
    splits = cdiv(n_chunks, chunks_per_split)            # no split without work
    meta.update(BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"])
    return LaunchPlan(kernel, (tiles, splits), splits, n_chunks, chunks_per_split, meta)


def _mma_plan(cfg: dict, group_size: int, m: int, n: int, k: int, sms: int) -> LaunchPlan:
    """The Gluon kernel's plan: ``n_chunks`` counts groups, ``chunks_per_split`` = SLOTS x STEPS
    groups per program (STEPS a power of two: the steps' zero points and scales are one register
    tile). ``SPLITS`` (an override) is met as closely as a power-of-two STEPS allows."""
    from ._quant_gluon import int4_mma_kernel, mma_layouts        # Gluon: imported when first used
    warps_k, warps_n, reps, gps = cfg["WARPS_K"], cfg["WARPS_N"], cfg["REPS"], cfg["GROUPS_PER_STEP"]
    slots = warps_k * gps
    mma_n = max(8, next_power_of_2(m))
    block_n = 16 * warps_n * reps
    n_groups = k // group_size
    blocks = cdiv(n, block_n)
    if cfg.get("SPLITS"):
        steps = min(MMA_MAX_STEPS, next_power_of_2(cdiv(n_groups, slots * cfg["SPLITS"])))
    else:
        steps = _mma_steps(blocks, n_groups, slots, sms)
    splits = cdiv(n_groups, slots * steps)
    words, mma, xl, rows = mma_layouts(group_size, slots, warps_k, warps_n, reps, mma_n, steps)
    meta = dict(GROUP=group_size, MMA_N=mma_n, WORDS_LAYOUT=words, MMA_LAYOUT=mma, X_LAYOUT=xl, ROW_LAYOUT=rows,
                PRELOAD=bool(cfg.get("PRELOAD", False)),
                SLOTS=slots, STEPS=steps, EVEN_GROUPS=n_groups % (slots * steps) == 0, BLOCK_N=block_n,
                num_warps=warps_k * warps_n)
    return LaunchPlan(int4_mma_kernel, (blocks, splits), splits, n_groups, slots * steps, meta)


def _x_unroll(x_steps: int, mma_n: int, threads: int) -> int:
    """Steps of x the Hopper kernel's prologue loads at once: up to 64 values per thread (8
    16-byte loads in flight), a power of two dividing ``x_steps``."""
    unroll = 1
    while x_steps % (2 * unroll) == 0 and 2 * unroll * mma_n * 128 <= 64 * threads:
        unroll *= 2
    return unroll


def _wgmma_plan(cfg: dict, m: int, n: int, k: int) -> LaunchPlan:
    """The Hopper kernel's plan: ``n_chunks`` counts groups, ``chunks_per_split`` groups per
    program (a multiple of CHUNK). Splits: about WGMMA_GROUPS_PER_PROGRAM groups per program
    (several programs per SM: each one's steps are a chain of waits the others hide), and few
    enough that x for all of them fits in shared memory beside the weight ring."""
    from ._quant_wgmma import GROUP, int4_wgmma_kernel, wgmma_layouts   # Gluon: imported when first used
    num_warps, reps, chunk, stages = cfg["num_warps"], cfg["REPS"], cfg["CHUNK"], cfg["STAGES"]
    if chunk % stages:
        raise ValueError(f"config: STAGES ({stages}) must divide CHUNK ({chunk})")
    group = GROUP.value
    mma_n = max(8, next_power_of_2(m))
    block_n = 16 * num_warps * reps
    n_groups = k // group
    blocks = cdiv(n, block_n)
    x_steps_max = (WGMMA_SMEM - stages * block_n * group // 2) // (mma_n * group * 2) // chunk * chunk
    splits = cfg.get("SPLITS") or cdiv(n_groups, WGMMA_GROUPS_PER_PROGRAM)
    splits = max(splits, cdiv(n_groups, x_steps_max))
    per_split = cdiv(cdiv(n_groups, splits), chunk) * chunk
    splits = cdiv(n_groups, per_split)
    words, rows, acc, xl = wgmma_layouts(num_warps, reps, mma_n, chunk)
    meta = dict(MMA_N=mma_n, WORDS_LAYOUT=words, ROW_LAYOUT=rows, ACC_LAYOUT=acc, X_LAYOUT=xl, X_STEPS=per_split,
                X_UNROLL=_x_unroll(per_split, mma_n, 32 * num_warps),
                CHUNK=chunk, STAGES=stages, BLOCK_N=block_n, num_warps=num_warps)
    return LaunchPlan(int4_wgmma_kernel, (blocks, splits), splits, n_groups, per_split, meta)


_PREPARED: dict = {}      # (id(plan), integers, HAS_BIAS, SPLIT) -> (plan, PreparedArgs)


def _prepared(plan: LaunchPlan, ints: tuple, has_bias: bool, split: bool):
    """The prepared arguments of a Gluon launch of ``plan`` (its layouts make the constexprs slow
    to key per call), built once per plan, strides and flags; the plan is kept beside them so a
    recycled ``id`` cannot hit."""
    key = (id(plan), ints, has_bias, split)
    hit = _PREPARED.get(key)
    if hit is None or hit[0] is not plan:
        if len(_PREPARED) > 4096:
            _PREPARED.clear()
        hit = _PREPARED[key] = (plan, plan.kernel.prepare(ints, dict(plan.meta, HAS_BIAS=has_bias, SPLIT=split)))
    return hit[1]


def _launch(x2: torch.Tensor, qweight, scales, zeros, bias, bits: int, group_size: int,
            config: Optional[dict] = None) -> torch.Tensor:
    """y [M, N] for x2 [M, K] (unit K stride); group_size 0 means int8 per channel. ``config``
    overrides the launch defaults (keys :data:`CONFIG_KEYS`; sweeps and tests)."""
    m, k = x2.shape
    n = scales.shape[0]
    y = empty((m, n), x2.dtype, x2.device)
    if m == 0 or n == 0:
        return y
    overrides = tuple(sorted(config.items())) if config else ()
    mma_ok = is_ampere_or_newer(x2) and not interpreting()
    wgmma_ok = mma_ok and device_major(x2) == 9
    plan = launch_plan(bits, group_size, m, n, k, x2.dtype, num_sms(x2), overrides, mma_ok, wgmma_ok)
    if "MMA_LAYOUT" in plan.meta and not _pairs_aligned(x2):
        # the Gluon kernel reads x as int32 pairs: an x off 4-byte rows takes the default tl kernel
        plan = launch_plan(bits, group_size, m, n, k, x2.dtype, num_sms(x2))
    if qweight.data_ptr() % 4:
        qweight = qweight.clone()                         # the kernels read 4-byte words
    split = plan.splits > 1
    partial = empty((plan.splits, m, n), torch.float32, x2.device) if split else y
    zeros_arg = zeros if zeros is not None else qweight   # never read for int8
    bias_arg = bias if bias is not None else y            # never read without HAS_BIAS
    meta = plan.meta
    if "ACC_LAYOUT" in meta:                              # the Hopper kernel: a prepared launch
        ints = (m, n, plan.n_chunks, plan.chunks_per_split, x2.stride(0), qweight.stride(0) // 4, scales.stride(0),
                y.stride(0))
        plan.kernel.launch_prepared(plan.grid, (x2, qweight, scales, zeros, bias_arg, y, partial),
                                    _prepared(plan, ints, bias is not None and not split, split))
    elif plan.kernel is not quant_gemv_kernel and plan.kernel is not quant_dot_kernel:
        plan.kernel[plan.grid](
            x2, qweight, scales, zeros, bias_arg, y, partial, m, n, plan.n_chunks,
            x2.stride(0) if m > 1 else 0, qweight.stride(0) // 4, scales.stride(0), y.stride(0),
            **meta, HAS_BIAS=bias is not None and not split, SPLIT=split,
        )
    else:
        if meta.get("X_PAIRS") and not _pairs_aligned(x2):
            meta = dict(meta, X_PAIRS=False)              # read as bf16: the same values, no copy of x
        plan.kernel[plan.grid](
            x2, qweight, scales, zeros_arg, bias_arg, y, partial, m, n, k,
            x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
            plan.n_chunks, plan.chunks_per_split, MAGIC_BITS,
            **meta, HAS_BIAS=bias is not None and not split, SPLIT=split,
        )
    if split:
        splitk_reduce_kernel[(m, cdiv(n, REDUCE_BLOCK_N))](
            partial, bias_arg, y, m, n, plan.splits, y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=REDUCE_BLOCK_N, num_warps=4,
        )
    return y


# ----------------------------------------------------------------------------------------------
# reference + custom op
# ----------------------------------------------------------------------------------------------


def _as_qw(qweight, scales, zeros, bits: int, group_size: int) -> QuantizedWeight:
    n = scales.shape[0]
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    return QuantizedWeight(qweight, scales, zeros, bits, group_size or None, (n, k))


def quant_linear_reference(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None):
    """``F.linear(x, dequantize_weight(qw), bias)`` in x's dtype (fp32 math below fp32)."""
    wide = x.dtype if x.dtype == torch.float64 else torch.float32
    w = dequantize_weight(qw, wide)
    b = bias.to(wide) if bias is not None else None
    return F.linear(x.to(wide), w, b).to(x.dtype)


@custom_op("tilefuse::quant_linear", mutates_args=())
def _quant_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], bits: int, group_size: int) -> torch.Tensor:
    n = scales.shape[0]
    if use_triton(x):
        return _launch(rows_view(x), qweight, scales, zeros, bias, bits, group_size).view(*x.shape[:-1], n)
    return quant_linear_reference(x, _as_qw(qweight, scales, zeros, bits, group_size), bias).contiguous()


@_quant_linear_op.register_fake
def _(x, qweight, scales, zeros, bias, bits, group_size):
    return x.new_empty((*x.shape[:-1], scales.shape[0]))


def _setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, bias, bits, group_size = inputs
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.bits, ctx.group_size, ctx.has_bias = bits, group_size, bias is not None


def _backward(ctx, dy):
    """Gradients for x and bias only (the quantized weight is frozen): dx = dy @ dequant(W)."""
    qweight, scales, zeros = ctx.saved_tensors
    w = dequantize_weight(_as_qw(qweight, scales, zeros, ctx.bits, ctx.group_size), dy.dtype)
    dx = dy @ w
    dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
    return dx, None, None, None, dbias, None, None


_quant_linear_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _check_qweight(name: str, qw: QuantizedWeight) -> None:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{name} must be a QuantizedWeight (from quantize_weight), got {type(qw).__name__}")
    _check_format(qw.bits, qw.group_size)
    n, k = qw.shape
    want = torch.int8 if qw.bits == 8 else torch.uint8
    check_tensor(f"{name}.qweight", qw.qweight, dtypes=(want,))
    check_shape(f"{name}.qweight", qw.qweight, (n, k if qw.bits == 8 else k // 2), "packed [N, K] weight")
    check_tensor(f"{name}.scales", qw.scales)
    if qw.bits == 8:
        check_shape(f"{name}.scales", qw.scales, (n,), "one per output channel")
    else:
        check_shape(f"{name}.scales", qw.scales, (n, k // qw.group_size), "[N, K / group_size]")
        check_tensor(f"{name}.zeros", qw.zeros, dtypes=(torch.uint8,))
        check_shape(f"{name}.zeros", qw.zeros, (n, k // qw.group_size), "[N, K / group_size]")


def quant_linear(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x @ dequantize_weight(qw).T + bias`` without materializing the float weight.

    ``x`` ``[..., K]`` in the scales' dtype (fp32/fp16/bf16), ``bias`` ``[N]`` or None; ``y``
    ``[..., N]`` in x's dtype, fp32 accumulation. M = prod(leading dims) = 1: the FMA GEMV kernel;
    more: the tensor-core kernel (see :func:`launch_plan`)."""
    check_tensor("x", x, min_dim=1)
    _check_qweight("qw", qw)
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features in its last dimension, the weight has K = {k}")
    check_same_dtype(x=x, **{"qw.scales": qw.scales})
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, (n,))
        check_same_dtype(x=x, bias=bias)
    check_same_device(x=x, **{"qw.qweight": qw.qweight, "qw.scales": qw.scales, "qw.zeros": qw.zeros}, bias=bias)
    scales = qw.scales.contiguous()
    zeros = qw.zeros.contiguous() if qw.zeros is not None else None
    return _quant_linear_op(x, qw.qweight.contiguous(), scales, zeros, bias, qw.bits, qw.group_size or 0)


# ----------------------------------------------------------------------------------------------
# registry: shape = (M, N, K)
# ----------------------------------------------------------------------------------------------


def _int4_group(k: int) -> int:
    """The bench group (128) where K allows it, else the largest supported divisor of K."""
    return next((g for g in sorted(INT4_GROUP_SIZES, reverse=True) if k % g == 0), INT4_GROUP_SIZES[0])


def _make_inputs(bits: int):
    def make(shape, dtype, device):
        m, n, k = shape
        w = torch.randn(n, k, device=device, dtype=torch.float32) / k ** 0.5
        qw = quantize_weight(w.to(dtype), bits, _int4_group(k) if bits == 4 else None)
        x = torch.randn(m, k, device=device).to(dtype)
        return Inputs((x, qw), {}, grad_args=())
    return make


def _bytes_fn(bits: int):
    def count(shape, dtype, pass_):
        m, n, k = shape
        esize = torch.empty((), dtype=dtype).element_size()
        weight = n * k * bits // 8
        if bits == 8:
            side = n * esize                                  # scales
        else:
            side = n * (k // _int4_group(k)) * (esize + 1)    # scales + uint8 zero points
        return weight + side + (m * k + m * n) * esize        # + x read, y written
    return count


def _torch_dequant_linear(x, qw, bias=None):
    """PyTorch peer: dequantize the whole weight, then cuBLAS / F.linear."""
    return F.linear(x, dequantize_weight(qw, x.dtype), bias)


def _tinygemm_peer():
    """``torch._weight_int4pack_mm`` (tinygemm, CUDA, bf16 x) on our int4 format, or None.

    Converted once per weight (cached by storage pointer): tinygemm takes uint8 [N, K/2] with
    the *even* k in the high nibble, and dequantizes ``(q - 8) * s + zero`` with a float zero,
    so ``zero = (8 - z) * s``; scales_and_zeros is ``[K/g, N, 2]``."""
    if not (torch.cuda.is_available() and hasattr(torch, "_weight_int4pack_mm")):
        return None
    cache: dict = {}

    def run(x, qw, bias=None):
        if x.dtype != torch.bfloat16:
            raise NotImplementedError("tinygemm takes bf16 activations only")
        key = (qw.qweight.data_ptr(), qw.scales.data_ptr(), qw.shape)
        if key not in cache:
            n, k = qw.shape
            swapped = ((qw.qweight & 0xF) << 4) | (qw.qweight >> 4)
            inner_k_tiles = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
            packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
            s = qw.scales.to(torch.bfloat16)
            zero = ((8 - qw.zeros.float()) * qw.scales.float()).to(torch.bfloat16)
            sz = torch.stack((s, zero), dim=-1).transpose(0, 1).contiguous()
            cache.clear()
            cache[key] = (packed, sz)
        packed, sz = cache[key]
        y = torch._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), packed, qw.group_size, sz)
        y = y.reshape(*x.shape[:-1], -1)
        return y + bias if bias is not None else y
    return run


# small, odd N: M = 1 (GEMV), 3, 8 and 16 (one 16-row dot tile), 33 (a partial 64-row tile)
_TEST_SHAPES = [(1, 33, 64), (3, 17, 128), (8, 40, 96), (16, 24, 64), (33, 19, 128)]
_GPU_TEST_SHAPES = [(1, 4096, 4096), (5, 14336, 4096), (16, 4096, 14336), (300, 4097, 4096)]
_BENCH_SHAPES = [(1, 4096, 4096), (1, 14336, 4096), (16, 4096, 4096), (16, 14336, 4096)]

for _bits in SUPPORTED_BITS:
    register(OpSpec(
        name=f"int{_bits}_gemm",
        fn=quant_linear,
        reference=quant_linear_reference,
        make_inputs=_make_inputs(_bits),
        bytes_fn=_bytes_fn(_bits),
        flops_fn=lambda shape, pass_: 2 * shape[0] * shape[1] * shape[2],
        test_shapes=_TEST_SHAPES,
        gpu_test_shapes=_GPU_TEST_SHAPES,
        bench_shapes=_BENCH_SHAPES,
        peers={"torch": lambda: _torch_dequant_linear,
               **({"tinygemm": _tinygemm_peer} if _bits == 4 else {})},
        has_backward=False,
        description=f"x @ dequant(W).T, int{_bits} weight-only "
                    + ("(per channel)" if _bits == 8 else "(group-wise, zero points)"),
    ))
