"""Launch planning for the weight-only quantized GEMMs of :mod:`.quant` (inputs validated there).

:func:`launch_plan` picks the kernel and its configuration for an ``[M, K] x [N, K]ᵀ`` call
(cached per shape); :func:`quant_call` turns a plan and the call's strides into a
:class:`QuantCall`, whose :meth:`QuantCall.run` allocates ``y`` and launches with arguments that
were keyed once (``FastKernel.prepare``), not on every call. ``quant_linear``'s eager fast path
keeps the ``QuantCall`` of each input layout it has validated, so a repeated call (a decode step)
pays for a dictionary lookup, an allocation and one or two launches.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from .._dispatch import cdiv, device_major, empty, interpreting, is_ampere_or_newer, next_power_of_2, num_sms, workspace
from .._launch import PreparedArgs
from ._quant_kernels import MAGIC_BITS, quant_dot_kernel, quant_gemv_kernel, splitk_reduce_kernel


GEMV_MAX_ROWS = 8          # quant_gemv_kernel takes up to this many rows (one program per row)
SKINNY_MAX_ROWS = 64       # up to here the dot kernel pads M to a 16..64-row tile; above: 128
REDUCE_BLOCK_N = 256       # columns per program of the split-K reduction
MMA_MAX_ROWS = 32         # the Gluon int4 kernel pads x to an MMA N of 8, 16 or 32 rows
WGMMA_MAX_ROWS = 64        # the Hopper int4 kernel pads x to a wgmma N of 8..64 rows
WGMMA_DEFAULT_MAX_ROWS = 16  # ... and is the default up to here (at 32 rows it was level with the tl kernel)
WGMMA_GROUPS_PER_PROGRAM = 8   # groups of K per program (split-K beyond): more programs hide more latency
WGMMA_SMEM = 200 * 1024    # its shared memory: x for the program's groups + the weight ring (sm_90: 227 KB)
CONFIG_KEYS = ("PATH", "SWAP_AB", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_STAGES", "num_warps", "SPLITS", "PACKED",
               "X_PAIRS", "WARPS_K", "WARPS_N", "REPS", "GROUPS_PER_STEP", "PRELOAD", "CHUNK", "STAGES", "MAXNREG")


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
    meta.update(BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"],
                **_maxnreg(cfg))
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
                num_warps=warps_k * warps_n, **_maxnreg(cfg))
    return LaunchPlan(int4_mma_kernel, (blocks, splits), splits, n_groups, slots * steps, meta)


def _maxnreg(cfg: dict) -> dict:
    """``MAXNREG`` (any path; sweeps only): a register cap per thread, the launch option
    ``maxnreg``. Why a knob: the mma kernel's 80 registers at group 128 allow 6 programs of 4
    warps per SM (25 warps' worth), so 896 row blocks (N = 14336) take 1.13 waves of 792, where
    72 registers would give 7 (924 programs in one wave; ptxas then spills 36 bytes, offline
    sm_90 compile, session 55). Unmeasured: no default uses it."""
    return {"maxnreg": int(cfg["MAXNREG"])} if cfg.get("MAXNREG") else {}


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
                CHUNK=chunk, STAGES=stages, BLOCK_N=block_n, num_warps=num_warps, **_maxnreg(cfg))
    return LaunchPlan(int4_wgmma_kernel, (blocks, splits), splits, n_groups, per_split, meta)


_PREPARED: dict = {}      # (id(owner), integers, flags) -> (owner, PreparedArgs)


def _prepared(owner, kernel, ints: tuple, flags: tuple, kwargs) -> PreparedArgs:
    """``kernel.prepare(ints, kwargs())``, built once per (owner, integers, flags): ``owner`` is the
    cached :class:`LaunchPlan` (its Gluon layouts make the constexprs slow to hash per call), kept
    beside the entry so a recycled ``id`` cannot hit; ``flags`` are what else the constexprs hold."""
    key = (id(owner), ints, flags)
    hit = _PREPARED.get(key)
    if hit is None or hit[0] is not owner:
        if len(_PREPARED) > 4096:
            _PREPARED.clear()
        hit = _PREPARED[key] = (owner, kernel.prepare(ints, kwargs()))
    return hit[1]


class QuantCall(NamedTuple):
    """The launches of one call layout (shapes, strides, dtypes, alignment, bias or not): the main
    kernel with its prepared arguments and, when K is split, the in-order reduction of the fp32
    partials (:func:`quant_call` builds it; :meth:`run` launches it on the call's tensors)."""
    kernel: object
    grid: tuple
    args: PreparedArgs
    m: int
    n: int
    splits: int                       # > 1: partials [splits, M, N], then splitk_reduce_kernel
    reduce_grid: tuple
    reduce_args: Optional[PreparedArgs]

    def run(self, x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
            bias: Optional[torch.Tensor]) -> torch.Tensor:
        """y [M, N] for x2 [M, K] (the layout this call was built for)."""
        y = empty((self.m, self.n), x2.dtype, x2.device)
        split = self.splits > 1
        # the partials live within this call (written, then summed in stream order): a reused buffer
        partial = workspace("quant_partials", ((self.splits, self.m, self.n),), torch.float32, x2.device)[0] \
            if split else y
        zeros_arg = zeros if zeros is not None else qweight   # never read for int8
        bias_arg = bias if bias is not None else y            # never read without HAS_BIAS
        self.kernel.launch_prepared(self.grid, (x2, qweight, scales, zeros_arg, bias_arg, y, partial), self.args)
        if split:
            splitk_reduce_kernel.launch_prepared(self.reduce_grid, (partial, bias_arg, y), self.reduce_args)
        return y


def quant_call(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, has_bias: bool, bits: int,
               group_size: int, config: Optional[dict] = None) -> QuantCall:
    """The :class:`QuantCall` for x2 [M, K] (unit K stride, M, N > 0) against this weight layout;
    ``config`` overrides the launch defaults (keys :data:`CONFIG_KEYS`; sweeps and tests). The
    weight must sit on a 4-byte boundary (the kernels read words)."""
    m, k = x2.shape
    n = scales.shape[0]
    overrides = tuple(sorted(config.items())) if config else ()
    mma_ok = is_ampere_or_newer(x2) and not interpreting()
    wgmma_ok = mma_ok and device_major(x2) == 9
    plan = launch_plan(bits, group_size, m, n, k, x2.dtype, num_sms(x2), overrides, mma_ok, wgmma_ok)
    if "MMA_LAYOUT" in plan.meta and not _pairs_aligned(x2):
        # the Gluon kernel reads x as int32 pairs: an x off 4-byte rows takes the default tl kernel
        plan = launch_plan(bits, group_size, m, n, k, x2.dtype, num_sms(x2))
    split = plan.splits > 1
    x_pairs = plan.meta.get("X_PAIRS", False)
    y_stride = n                                          # y is a fresh contiguous [M, N]
    if "ACC_LAYOUT" in plan.meta:                         # the Hopper kernel
        ints = (m, n, plan.n_chunks, plan.chunks_per_split, x2.stride(0), qweight.stride(0) // 4, scales.stride(0),
                y_stride)
    elif plan.kernel is not quant_gemv_kernel and plan.kernel is not quant_dot_kernel:   # the mma kernel
        ints = (m, n, plan.n_chunks, x2.stride(0) if m > 1 else 0, qweight.stride(0) // 4, scales.stride(0), y_stride)
    else:
        x_pairs = x_pairs and _pairs_aligned(x2)          # else read as bf16: the same values, no copy of x
        ints = (m, n, k, x2.stride(0), qweight.stride(0), scales.stride(0), y_stride, plan.n_chunks,
                plan.chunks_per_split, MAGIC_BITS)
    flags = (has_bias and not split, split, x_pairs)
    args = _prepared(plan, plan.kernel, ints, flags, lambda: dict(
        plan.meta, HAS_BIAS=flags[0], SPLIT=split, **({"X_PAIRS": x_pairs} if "X_PAIRS" in plan.meta else {})))
    reduce_args = _prepared(splitk_reduce_kernel, splitk_reduce_kernel, (m, n, plan.splits, y_stride), (has_bias,),
                            lambda: dict(HAS_BIAS=has_bias, BLOCK_N=REDUCE_BLOCK_N, num_warps=4)) if split else None
    return QuantCall(plan.kernel, plan.grid, args, m, n, plan.splits, (m, cdiv(n, REDUCE_BLOCK_N)), reduce_args)


def launch(x2: torch.Tensor, qweight, scales, zeros, bias, bits: int, group_size: int,
           config: Optional[dict] = None) -> torch.Tensor:
    """y [M, N] for x2 [M, K] (unit K stride); group_size 0 means int8 per channel. ``config``
    overrides the launch defaults (keys :data:`CONFIG_KEYS`; sweeps and tests)."""
    m, n = x2.shape[0], scales.shape[0]
    if m == 0 or n == 0:
        return empty((m, n), x2.dtype, x2.device)
    if qweight.data_ptr() % 4:
        qweight = qweight.clone()                         # the kernels read 4-byte words
    return quant_call(x2, qweight, scales, bias is not None, bits, group_size, config).run(x2, qweight, scales,
                                                                                           zeros, bias)
