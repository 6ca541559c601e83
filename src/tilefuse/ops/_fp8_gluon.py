"""fp8 GEMM with fp32 promotion of the tensor-core partial sums, warp-specialized for Hopper (Gluon).

Why a second kernel: sm_90's fp8 wgmma accumulates in reduced precision, so the precise mode
adds each K step's partial sum into an fp32 tile (DeepSeek-V3's two-level accumulation, as
``torch._scaled_mm`` without ``use_fast_accum``). Adding a wgmma result needs the wgmma finished.
In the ``tl`` kernel (``fp8_gemm_kernel``) every warp runs the same instruction stream and the
pipeliner's CTA barriers keep the two warp groups in lockstep, so both drain the tensor core at
once on every step: 0.67x ``_scaled_mm`` at 8192^3 (sessions 7 and 15). Here:

- one producer warp issues the TMA loads of a ``STAGES``-deep ring (``ready`` / ``empty`` mbarriers);
- three consumer warp groups each own 64 rows of the 192-row tile and share its B tile; each waits
  for its own wgmma, adds it into its fp32 tile and releases the stage, with no barrier across
  the groups. While one group adds, the tensor core runs the other groups' wgmmas.
- the epilogue (scales, bias, cast: ``_matmul_gluon._gemm_epilogue``, the bf16 GEMM's) goes
  through shared memory and a TMA store that completes while the next tile's main loop runs.

    out[M, N] = (a[M, K] @ b[N, K]ᵀ) · scale_a · scale_b + bias,   a, b fp8 (e4m3 / e5m2)

Bytes and FLOPs are the same as ``fp8_gemm_kernel``'s (the op registry's model in ``fp8.py``).
GPU only (Gluon has no interpreter): the launcher is reached from ``launch_fp8_gemm`` on sm_90
when the operands can be read through TMA (``use_warp_specialized``); GPU tests compare it with
the fp64 product of the dequantized operands.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .._dispatch import cdiv, num_sms
from .._launch import fast_launch
from ._gluon_common import matrix_descriptor as _descriptor
from ._gluon_common import (LOADER_REGS_KERNEL, ROWS_PER_GROUP, SMEM_BYTES, WG_ROWS, consumer_regs,
                             gemm_load_partition, gemm_ring, release_stage)
from ._matmul_gluon import _gemm_epilogue, wgmma_layout
from ._matmul_kernels import _tile_coords     # the grouped tile order, shared with the tl GEMMs



@gluon.jit
def fp8_mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, scale_a_ptr, scale_b_ptr, bias_ptr,
                      M, N, K,
                      WG: gl.constexpr, SCALE_A_ROWWISE: gl.constexpr, SCALE_B_ROWWISE: gl.constexpr,
                      HAS_BIAS: gl.constexpr, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      PROMOTE_EVERY: gl.constexpr, CONSUMERS: gl.constexpr):
    """One consumer warp group: rows [WG·64, WG·64 + 64) of each tile. Each K step's wgmma
    starts from zero (use_acc=False) or, with PROMOTE_EVERY > 1, continues the partial sum for
    that many steps; the finished partial sum is added into the fp32 tile."""
    mma_layout: gl.constexpr = wgmma_layout(BLOCK_N, a_bufs.dtype)
    num_pid_m = gl.cdiv(M, WG_ROWS * CONSUMERS)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    part = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, mma_layout)
    it = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * (WG_ROWS * CONSUMERS) + WG * WG_ROWS
        off_n = pid_n * BLOCK_N
        acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, mma_layout)
        for ki in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            # the previous partial sum's registers are the wgmma's C (dead after the add), so
            # restarting from zero costs no register copies. The add must wait for the wgmma
            # (ptxas serializes every wgmma if a partial sum is read while another is in flight):
            # the other consumer groups' wgmmas keep the tensor core busy meanwhile.
            part = warpgroup_mma(a_bufs.index(CONSUMERS * s + WG), b_bufs.index(s).permute((1, 0)), part,
                                 use_acc=(ki % PROMOTE_EVERY) != 0, is_async=True)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            release_stage(empty, s)
            if (ki % PROMOTE_EVERY == PROMOTE_EVERY - 1) or (ki == k_tiles - 1):
                acc += part
            it += 1

        # out = acc · scale_a · scale_b + bias, stored through TMA: the bf16 GEMM's epilogue
        _gemm_epilogue(acc, c_desc, c_smem, bias_ptr, bias_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, off_m, off_n,
                       M, N, 0, 0, 0, HAS_BIAS, "none", False, False, 2 if SCALE_A_ROWWISE else 1,
                       2 if SCALE_B_ROWWISE else 1)
    tma.store_wait(pendings=0)


@fast_launch
@gluon.jit
def fp8_gemm_ws_kernel(
    a_desc,             # TMA descriptor of a [M, K] fp8, block [64, BLOCK_K]
    b_desc,             # TMA descriptor of b [N, K] fp8, block [BLOCK_N, BLOCK_K]
    c_desc,             # TMA descriptor of out [M, N], block [64, BLOCK_N]
    scale_a_ptr,        # *fp32 [M] (SCALE_A_ROWWISE) or [1]
    scale_b_ptr,        # *fp32 [N] (SCALE_B_ROWWISE) or [1]
    bias_ptr,           # *bias [N], any float dtype (ignored unless HAS_BIAS)
    M,                  # rows of a and out
    N,                  # rows of b, columns of out
    K,                  # the reduced dimension (> 0)
    SCALE_A_ROWWISE: gl.constexpr,  # one scale per row of a
    SCALE_B_ROWWISE: gl.constexpr,  # one scale per row of b (output column)
    HAS_BIAS: gl.constexpr,         # add bias[N] after scaling
    NUM_PROGRAMS: gl.constexpr,     # persistent grid size
    GROUP_M: gl.constexpr,          # row tiles per group of the tile order
    STAGES: gl.constexpr,           # depth of the shared-memory ring
    PROMOTE_EVERY: gl.constexpr,    # K steps per fp32 promotion (1: every step, <= 128 K)
    CONSUMERS: gl.constexpr,        # consumer warp groups (3): BLOCK_M = 64 * CONSUMERS
    CONSUMER_REGS: gl.constexpr,    # registers per thread of the worker consumer groups
):
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs, b_bufs, c_bufs, ready, empty = gemm_ring(a_desc, b_desc, c_desc, STAGES, CONSUMERS, False)
    # the argument lists are written out: warp_specialize takes literal tuples
    gl.static_assert(CONSUMERS == 3, "three consumer warp groups (CONSUMER_GROUPS)")
    gl.warp_specialize([
        (fp8_mma_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs.index(0), scale_a_ptr, scale_b_ptr,
                             bias_ptr, M, N, K, 0, SCALE_A_ROWWISE, SCALE_B_ROWWISE, HAS_BIAS, NUM_PROGRAMS,
                             GROUP_M, BLOCK_N, BLOCK_K, STAGES, PROMOTE_EVERY, CONSUMERS)),
        (fp8_mma_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs.index(1), scale_a_ptr, scale_b_ptr,
                             bias_ptr, M, N, K, 1, SCALE_A_ROWWISE, SCALE_B_ROWWISE, HAS_BIAS, NUM_PROGRAMS,
                             GROUP_M, BLOCK_N, BLOCK_K, STAGES, PROMOTE_EVERY, CONSUMERS)),
        (fp8_mma_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs.index(2), scale_a_ptr, scale_b_ptr,
                             bias_ptr, M, N, K, 2, SCALE_A_ROWWISE, SCALE_B_ROWWISE, HAS_BIAS, NUM_PROGRAMS,
                             GROUP_M, BLOCK_N, BLOCK_K, STAGES, PROMOTE_EVERY, CONSUMERS)),
        (gemm_load_partition, (a_desc, b_desc, b_desc, a_bufs, b_bufs, b_bufs, ready, empty, M, N, K, NUM_PROGRAMS,
                              GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, True, False, c_desc, c_bufs, ready,
                              empty, False, False, 0, bias_ptr, False, False)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS_KERNEL])


# ----------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------

# Three consumer groups: with two, a group's turnaround (wait, barrier, arrive, 64 FADDs, issue)
# must fit in the other's ~256-cycle wgmma. Session 15 sweeps (H200, 8192³, four runs): 3 groups
# 1,275-1,414 TF/s, 2 groups 1,167-1,298 (the 2-group variant was removed: it repeated the
# partition list). Promotion every 2 steps (256 K): 1,322-1,433 at 8192³ (kept at DeepSeek's 128).
CONSUMER_GROUPS = 3
WS_CONFIG = dict(BLOCK_N=128, BLOCK_K=128, STAGES=4, GROUP_M=8, PROMOTE_EVERY=1)


def fit_stages(requested: int, consumers: int, block_n: int, block_k: int, out_bytes: int) -> int:
    """The ring depth that fits beside the output tiles (one [64, BLOCK_N] per consumer group):
    3 groups with fp32 output leave room for 3 stages of 40 KB, not 4."""
    stage = (consumers * ROWS_PER_GROUP + block_n) * block_k          # fp8 operand bytes per stage
    free = SMEM_BYTES - consumers * ROWS_PER_GROUP * block_n * out_bytes - 1024
    return max(2, min(requested, free // stage))


def launch_fp8_gemm_ws(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
                       bias: torch.Tensor | None, out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """out [M, N] = (a @ bᵀ) · scale_a · scale_b + bias with precise accumulation; a [M, K] and
    b [N, K] fp8 with K > 0, scales fp32 [M]/[N] or [1]; ``out`` preallocated; every base and
    row stride TMA-aligned (``_fp8_gemm.use_warp_specialized``)."""
    cfg = dict(WS_CONFIG, **(config or {}))
    (m, k), n = a.shape, b.shape[0]
    block_n, block_k, consumers = cfg["BLOCK_N"], cfg["BLOCK_K"], CONSUMER_GROUPS
    tiles = cdiv(m, ROWS_PER_GROUP * consumers) * cdiv(n, block_n)
    programs = max(1, min(num_sms(a), tiles))
    launch_regs, worker_regs = consumer_regs(consumers)
    stages = fit_stages(cfg["STAGES"], consumers, block_n, block_k, out.element_size())
    fp8_gemm_ws_kernel[(programs,)](
        _descriptor(a, (ROWS_PER_GROUP, block_k)), _descriptor(b, (block_n, block_k)),
        _descriptor(out, (ROWS_PER_GROUP, block_n)),
        scale_a, scale_b, bias if bias is not None else scale_b,
        m, n, k,
        SCALE_A_ROWWISE=scale_a.numel() != 1, SCALE_B_ROWWISE=scale_b.numel() != 1, HAS_BIAS=bias is not None,
        NUM_PROGRAMS=programs, GROUP_M=cfg["GROUP_M"], STAGES=stages, PROMOTE_EVERY=cfg["PROMOTE_EVERY"],
        CONSUMERS=consumers, CONSUMER_REGS=worker_regs, num_warps=4, maxnreg=launch_regs,
    )
    return out
