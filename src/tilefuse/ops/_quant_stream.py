"""Gluon int4 kernel for decode (M = 1..16) on Hopper: a persistent grid that streams the weight
through a TMA ring while its warps dequantize into ``mma.sync`` registers.

Why another int4 kernel: the ``_quant_gluon`` kernel (same math, same layouts) loads the weight
words into registers one step ahead, so what a program has in flight is bounded by its register
budget, and its 896 short programs (14336×4096) start, wait for their first words and compute in
lockstep. On the H200 it took 12.8 µs with the weight in L2 and 13.0 µs from DRAM (session 18),
with 1.0 of 6.4 warps per scheduler eligible, where a bare read of the 29.4 MB takes 8.7 µs. Here
one loader warp per program issues TMA boxes into a ring of STAGES steps (no registers, one
instruction a step), the program walks unit after unit (row block after row block), so the ring
runs ahead across unit boundaries, and the consumer warps read each step from shared memory.

**Counted per weight value** (group 128): 0.5 byte of weight from HBM and 3/128 byte of zero
point and scale; x (M·K·2 bytes) is read from L1/L2 by every program, once per unit. FLOPs 2·M.
Instructions: the ``_quant_gluon`` dequantization (PRMT + LOP3 + HFMA2 per two values, ``q − z``
exact), one ``mma.sync`` per 16×16 values and 8 rows of x, the group scale applied to the fp32
partial. Shared memory per step: ``SLOTS × BLOCK_N × GROUP / 2`` bytes (64-byte rows at group
128: a warp's 16-byte reads cover 512 contiguous bytes, no bank conflict).

**Work split.** A unit is BLOCK_N weight rows by all of K. A step holds SLOTS consecutive groups
(one TMA box ``[SLOTS, BLOCK_N, GROUP / 8]`` of the weight viewed as ``[K / GROUP, N, GROUP / 8]``
int32 words); warps along the slot axis take one group each (``mma_layouts``' WARPS_K), and the
slots are summed once per unit through shared memory. Zero points and scales come CHUNK steps at
a time. Rows past N are zero-filled by the TMA and not stored. No split-K: every unit owns whole
rows of y, so there is no partial buffer and no second launch.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .._launch import fast_launch
from ._gluon_common import LOADER_REGS_KERNEL, release_stage
from ._quant_gluon import _pack2, _q_minus_z, _x_fragment, store_yt


@gluon.jit
def _stream_loader(w_desc, ring, ready, empty, n_units, steps, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp: for every unit of this program, every step's box of weight words into the
    ring (``ready``: count 1, the expect + TMA; ``empty``: released by the consumers)."""
    SLOTS: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    it = 0
    for unit in range(gl.program_id(0), n_units, NUM_PROGRAMS):
        for step in range(steps):
            s = it % STAGES
            # a fresh mbarrier counts as phase 1 complete: the first lap does not wait
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [step * SLOTS, unit * BLOCK_N, 0], ready.index(s), ring.index(s))
            it += 1


@gluon.jit
def _chunk_params(zeros_ptr, scales_ptr, unit, c, N, stride_sn, r_slot, r_n, r_step, BLOCK_N: gl.constexpr,
                  SLOTS: gl.constexpr):
    """(zero points, scales) ``[SLOTS, BLOCK_N, CHUNK]`` of the steps ``c ..`` of ``unit`` (rows
    past N, and units past the last, clamped to valid rows: loaded, never used)."""
    rows = gl.minimum(unit * BLOCK_N + r_n, N - 1).to(gl.int64)
    offs = rows * stride_sn + (c + r_step) * SLOTS + r_slot
    return gl.load(zeros_ptr + offs), gl.load(scales_ptr + offs)


@gluon.jit
def _stream_consumer(ring, ready, empty, x_ptr, scales_ptr, zeros_ptr, bias_ptr, y_ptr, M, N, n_units, steps,
                     stride_xm, stride_sn, stride_ym, GROUP: gl.constexpr, MMA_N: gl.constexpr,
                     WORDS_LAYOUT: gl.constexpr, MMA_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr,
                     ROW_LAYOUT: gl.constexpr, CHUNK: gl.constexpr, STAGES: gl.constexpr,
                     NUM_PROGRAMS: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The consumer warps: per unit, ``y[m, n] = Σ_g s[n, g] · Σ_{k in g} (q − z) · x[m, k]`` over
    the steps the loader delivers, slot b of step j being group ``j · SLOTS + b``."""
    DTYPE: gl.constexpr = x_ptr.dtype.element_ty
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(0, MMA_LAYOUT, 2)
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(1, MMA_LAYOUT, 2)
    SW: gl.constexpr = gl.SliceLayout(2, WORDS_LAYOUT)
    SLOTS: gl.constexpr = ring.shape[1]
    BLOCK_N: gl.constexpr = ring.shape[2]
    MAGIC: gl.constexpr = 128.0 if DTYPE == gl.bfloat16 else 1024.0
    # x as int32 pairs [SLOTS, GROUP / 2, MMA_N]: rows of x past M clamped to the last one (not stored)
    SX: gl.constexpr = gl.SliceLayout(2, X_LAYOUT)
    x_slot = gl.arange(0, SLOTS, layout=gl.SliceLayout(1, SX))[:, None, None]
    x_pair = gl.arange(0, GROUP // 2, layout=gl.SliceLayout(0, SX))[None, :, None]
    x_m = gl.minimum(gl.arange(0, MMA_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_LAYOUT))), M - 1)[None, None, :]
    x_step0 = (x_ptr.to(gl.pointer_type(gl.int32)) + x_m.to(gl.int64) * (stride_xm // 2) + x_pair
               + x_slot * (GROUP // 2))
    X_STEP: gl.constexpr = SLOTS * (GROUP // 2)          # int32 pairs between steps
    # zero points / scales of CHUNK steps [SLOTS, BLOCK_N, CHUNK]: group (c + j) · SLOTS + b
    SR: gl.constexpr = gl.SliceLayout(2, ROW_LAYOUT)
    r_slot = gl.arange(0, SLOTS, layout=gl.SliceLayout(1, SR))[:, None, None]
    r_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, SR))[None, :, None]
    r_step = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(1, ROW_LAYOUT)))[None, None, :]
    zero = gl.zeros([SLOTS, BLOCK_N, MMA_N], gl.float32, MMA_LAYOUT)

    it = 0
    xp = gl.load(x_step0)
    # the first chunk's zero points / scales; each chunk then loads the next one's (the next
    # unit's first past the last), so their latency hides behind a chunk of steps
    z_next, s_next = _chunk_params(zeros_ptr, scales_ptr, gl.program_id(0), 0, N, stride_sn, r_slot, r_n, r_step,
                                   BLOCK_N, SLOTS)
    for unit in range(gl.program_id(0), n_units, NUM_PROGRAMS):
        acc = gl.zeros([SLOTS, BLOCK_N, MMA_N], gl.float32, MMA_LAYOUT)
        for c in range(0, steps, CHUNK):
            nz_all = _pack2((-(z_next.to(gl.float32) + MAGIC)).to(DTYPE))          # -(magic + z), twice
            s_all = s_next.to(gl.float32)
            wrap = (c + CHUNK >= steps).to(gl.int32)
            z_next, s_next = _chunk_params(zeros_ptr, scales_ptr, unit + wrap * NUM_PROGRAMS, (c + CHUNK) * (1 - wrap),
                                           N, stride_sn, r_slot, r_n, r_step, BLOCK_N, SLOTS)
            for j in gl.static_range(CHUNK):
                # next step's x first (the unit's first step after its last: every unit reads the same x)
                xp_next = gl.load(x_step0 + ((c + j + 1) % steps) * X_STEP)
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                words = ring.index(s).load(WORDS_LAYOUT)
                nz = gl.convert_layout(gl.sum(gl.where(r_step == j, nz_all, 0), axis=2), SW, assert_trivial=True)
                q = gl.convert_layout(_q_minus_z(words, nz[:, :, None], DTYPE), A_LAYOUT, assert_trivial=True)
                # the slot is free once its words are read: the proxy fence orders these generic-proxy
                # reads before the TMA's (async-proxy) refill of the slot, which the release lets go
                # (without it, 2 programs per SM read refilled words: H200, M = 16)
                fence_async_shared()
                release_stage(empty, s)
                part = mma_v2(q, _x_fragment(xp, B_LAYOUT, DTYPE), zero)
                sc = gl.convert_layout(gl.sum(gl.where(r_step == j, s_all, 0.0), axis=2),
                                       gl.SliceLayout(2, MMA_LAYOUT), assert_trivial=True)
                acc += part * sc[:, :, None]
                xp = xp_next
                it += 1
        n0 = unit * BLOCK_N
        store_yt(gl.sum(acc, axis=0), n0, 0, M, N, bias_ptr, y_ptr, y_ptr, stride_ym, HAS_BIAS, False)


@fast_launch
@gluon.jit
def int4_stream_kernel(
    w_desc,             # TMA descriptor of the packed weight as int32 words [K / GROUP, N, GROUP / 8], block [SLOTS, BLOCK_N, GROUP / 8]
    x_ptr,              # *x [M, K] bf16 / fp16, unit K stride, rows on 4-byte boundaries (read as int32 pairs)
    scales_ptr,         # *scales [N, K / GROUP], x's dtype
    zeros_ptr,          # *zero points uint8 [N, K / GROUP]
    bias_ptr,           # *bias [N] (read only when HAS_BIAS)
    y_ptr,              # *y [M, N], x's dtype
    M,                  # rows of x (1 <= M <= MMA_N)
    N,                  # output features
    n_units,            # cdiv(N, BLOCK_N): row blocks
    steps,              # K / (GROUP · SLOTS): steps per unit (a multiple of CHUNK)
    stride_xm,          # elements between rows of x
    stride_sn,          # elements between rows of scales / zeros
    stride_ym,          # elements between rows of y
    GROUP: gl.constexpr,            # int4 group along K: 32, 64 or 128
    MMA_N: gl.constexpr,            # rows of x padded to the MMA's N: 8 or 16
    WORDS_LAYOUT: gl.constexpr,     # _quant_gluon.mma_layouts(...)[0]
    MMA_LAYOUT: gl.constexpr,       # mma_layouts(...)[1]
    X_LAYOUT: gl.constexpr,         # mma_layouts(...)[2]
    ROW_LAYOUT: gl.constexpr,       # mma_layouts(...)[3], with CHUNK steps
    CHUNK: gl.constexpr,            # steps per zero point / scale load (a power of two dividing steps)
    STAGES: gl.constexpr,           # steps in the TMA ring
    NUM_PROGRAMS: gl.constexpr,     # persistent grid size
    HAS_BIAS: gl.constexpr,
):
    """Grid ``(NUM_PROGRAMS,)``; program p takes the units ``p, p + NUM_PROGRAMS, ...``."""
    ring = gl.allocate_shared_memory(gl.int32, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_stream_consumer, (ring, ready, empty, x_ptr, scales_ptr, zeros_ptr, bias_ptr, y_ptr, M, N, n_units, steps,
                            stride_xm, stride_sn, stride_ym, GROUP, MMA_N, WORDS_LAYOUT, MMA_LAYOUT, X_LAYOUT,
                            ROW_LAYOUT, CHUNK, STAGES, NUM_PROGRAMS, HAS_BIAS)),
        (_stream_loader, (w_desc, ring, ready, empty, n_units, steps, NUM_PROGRAMS, STAGES)),
    ], [1], [LOADER_REGS_KERNEL])
