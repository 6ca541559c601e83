"""Experimental: a 2-CTA-cluster GEMM on Hopper whose B tile is TMA-multicast to both CTAs.

    out[M, N] = a[M, K] @ w[N, K]ᵀ        (x @ w.t(), bf16 / fp16, K-major both)

Why: under sustained load the H200 runs at its 700 W cap, and there tilefuse's GEMMs got 1-3 %
less SM clock than cuBLAS's at the same power (session 52, ``scripts/clock_probe.py``): more
energy per FLOP. cuBLAS's nvjet kernels run 2-CTA clusters in which one operand tile is
multicast: each CTA reads half of it from L2 and receives the other half from its partner's
load, so a cluster's two 128x256 tiles read (128 + 128) rows per K step per CTA instead of
(128 + 256): 2/3 of the L2 → SM bytes. At M = 128 the same design (64-row tiles) halves the
weight's L2 reads, the operand that has to stream.

Triton 3.6's Gluon has no multicast argument and gives no shared-memory address to inline PTX,
so this kernel issues the multicast itself (inline PTX) at addresses it learns from a first
compile: ``smem_offsets`` re-runs the shared-memory allocation pass on the compiled TTGIR and
reads each buffer's ``allocation.offset``; the kernel is compiled again with them as constexprs
(they change no allocation, so the second compile places every buffer where the first did, and
``compile_multicast`` checks that). The B-half descriptor is read by its kernel-parameter name.

Protocol (a ring of STAGES stages per CTA, as ``_gluon_common``'s, plus the cluster):
- CTA rank r of a cluster (program_id % 2) takes row tile 2·p + r of each tile pair (p, n);
  both walk the same pairs, so their rings advance in lockstep;
- each stage's producer TMA-loads its own A rows and multicasts rows [r·BN/2, (r+1)·BN/2) of
  the B tile to both CTAs, signalling the ``ready`` mbarrier at the same offset in each; every
  ``ready`` expects the full stage (A + all of B: half is its partner's);
- a stage is free when the consumer groups of *both* CTAs have released it (the partner writes
  into it): ``empty`` counts 2·CONSUMERS arrivals, one local and one remote per group;
- a cluster barrier in every partition after the mbarriers are initialized, and again before
  exit (no CTA leaves while its partner may still write into it). The loader is a whole warp
  group so that no padding warp misses the cluster barrier.
GPU only (sm_90). Measured slower than the same kernel without multicast (H200, 2026-12-02,
``scripts/multicast_probe.py``; benchmarks/NOTES.md, session 53), so it is kept here, as an
experiment, and not in the library.

DIRECT_STORE: the epilogue stores the accumulator from registers (no shared staging tile, no TMA
store), which frees the 64 KB of the 128x256 tile's staging for a fourth ring stage.
"""

from __future__ import annotations

import os
import re
import tempfile

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from tilefuse.ops._matmul_kernels import _tile_coords

WG_ROWS = gl.constexpr(64)


@gluon.constexpr_function
def _multicast_asm(param):
    """PTX: lane 0 of the loader group multicasts a B box (coords $3, $4) of the descriptor
    kernel parameter ``param`` to the CTAs of mask $5, at shared offset $1, signalling $2."""
    return ("{\n.reg .pred mc_p;\n.reg .b32 mc_t, mc_base, mc_dst, mc_bar;\n.reg .b64 mc_desc;\n"
            "mov.u32 mc_t, %tid.x;\nand.b32 mc_t, mc_t, 127;\nsetp.eq.u32 mc_p, mc_t, 0;\n"
            "mov.u32 mc_base, global_smem;\nadd.u32 mc_dst, mc_base, $1;\nadd.u32 mc_bar, mc_base, $2;\n"
            "mov.b64 mc_desc, " + str(param) + ";\ncvta.param.u64 mc_desc, mc_desc;\n"
            "@mc_p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
            ".multicast::cluster [mc_dst], [mc_desc, {$3, $4}], [mc_bar], $5;\n"
            "mov.u32 $0, 0;\n}")


# one thread per consumer group arrives on the partner CTA's mbarrier at shared offset $1
_REMOTE_ARRIVE_ASM = gl.constexpr(
    "{\n.reg .pred ra_p;\n.reg .b32 ra_t, ra_a, ra_r;\n"
    "mov.u32 ra_t, %tid.x;\nand.b32 ra_t, ra_t, 127;\nsetp.eq.u32 ra_p, ra_t, 0;\n"
    "mov.u32 ra_a, global_smem;\nadd.u32 ra_a, ra_a, $1;\n"
    "mapa.shared::cluster.u32 ra_r, ra_a, $2;\n"
    "@ra_p mbarrier.arrive.shared::cluster.b64 _, [ra_r];\n"
    "mov.u32 $0, 0;\n}")

_CLUSTER_SYNC_ASM = gl.constexpr(
    "fence.mbarrier_init.release.cluster;\nbarrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n"
    "mov.u32 $0, 0;")


@gluon.jit
def _cluster_sync():
    gl.inline_asm_elementwise(_CLUSTER_SYNC_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release(empty, s, EMPTY_OFF: gl.constexpr, peer, MULTICAST: gl.constexpr):
    """Stage ``s`` free here and at the partner (its producer multicasts into our copy)."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(s), count=1)
    if MULTICAST:
        gl.inline_asm_elementwise(_REMOTE_ARRIVE_ASM, "=r,r,r", [EMPTY_OFF + 8 * s, peer], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def mc_load_partition(a_desc, b_desc, bh_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_PROGRAMS: gl.constexpr,
                      GROUP_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMERS: gl.constexpr, B_OFF: gl.constexpr, READY_OFF: gl.constexpr,
                      BH_PARAM: gl.constexpr, MULTICAST: gl.constexpr):
    _cluster_sync()
    rank = gl.program_id(0) % 2
    num_pid_m = gl.cdiv(M, WG_ROWS * CONSUMERS)
    pairs = gl.cdiv(num_pid_m, 2)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    HALF: gl.constexpr = BLOCK_N // 2
    STAGE_B: gl.constexpr = BLOCK_N * BLOCK_K * 2
    step_bytes: gl.constexpr = CONSUMERS * a_desc.block_type.nbytes + STAGE_B
    mask = gl.full([1], 3, gl.int16, gl.BlockedLayout([1], [32], [4], [0]))
    it = 0
    for t in range(gl.program_id(0) // 2, pairs * num_pid_n, NUM_PROGRAMS // 2):
        pm, pn = _tile_coords(t, pairs, num_pid_n, GROUP_M)
        off_m = (pm * 2 + rank) * (WG_ROWS * CONSUMERS)
        off_n = pn * BLOCK_N
        for ki in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, step_bytes)
            for g in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(a_desc, [off_m + g * WG_ROWS, ki * BLOCK_K], bar,
                                                a_bufs.index(CONSUMERS * s + g))
            if MULTICAST:
                dst = B_OFF + s * STAGE_B + rank * (STAGE_B // 2)
                gl.inline_asm_elementwise(_multicast_asm(BH_PARAM), "=r,r,r,r,r,h",
                                          [dst + mask.to(gl.int32) * 0, READY_OFF + 8 * s + mask.to(gl.int32) * 0,
                                           ki * BLOCK_K + mask.to(gl.int32) * 0,
                                           off_n + rank * HALF + mask.to(gl.int32) * 0, mask],
                                          dtype=gl.int32, is_pure=False, pack=1)
            else:
                tma.async_copy_global_to_shared(b_desc, [off_n, ki * BLOCK_K], bar, b_bufs.index(s))
            it += 1
    _cluster_sync()


@gluon.jit
def mc_mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, c_ptr, stride_cm, M, N, K, WG: gl.constexpr,
                     NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                     EMPTY_OFF: gl.constexpr, MULTICAST: gl.constexpr, DIRECT_STORE: gl.constexpr):
    _cluster_sync()
    rank = gl.program_id(0) % 2
    peer = 1 - rank
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    num_pid_m = gl.cdiv(M, WG_ROWS * CONSUMERS)
    pairs = gl.cdiv(num_pid_m, 2)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0) // 2, pairs * num_pid_n, NUM_PROGRAMS // 2):
        pm, pn = _tile_coords(t, pairs, num_pid_n, GROUP_M)
        off_m = (pm * 2 + rank) * (WG_ROWS * CONSUMERS) + WG * WG_ROWS
        off_n = pn * BLOCK_N
        acc = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout)
        for ki in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(CONSUMERS * s + WG), b_bufs.index(s).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if ki > 0:
                _release(empty, (it + STAGES - 1) % STAGES, EMPTY_OFF, peer, MULTICAST)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _release(empty, (it + STAGES - 1) % STAGES, EMPTY_OFF, peer, MULTICAST)
        if DIRECT_STORE:
            rows = off_m + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, layout))
            cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            gl.store(c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=(rows < M)[:, None] & (cols < N)[None, :])
        else:
            tma.store_wait(pendings=0)
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(pendings=0)
    _cluster_sync()


@gluon.jit
def mc_gemm_kernel(
    a_desc,             # TMA descriptor of a [M, K], block [64, BLOCK_K]
    b_desc,             # TMA descriptor of w [N, K], block [BLOCK_N, BLOCK_K] (its layout: the B ring's)
    bh_desc,            # the same with block [BLOCK_N / 2, BLOCK_K]: the half each CTA multicasts
    c_desc,             # TMA descriptor of out [M, N], block [64, BLOCK_N]
    c_ptr,              # *out (DIRECT_STORE)
    stride_cm,          # elements between rows of out
    M, N, K,            # sizes
    NUM_PROGRAMS: gl.constexpr,     # CTAs (an even number: clusters of 2)
    GROUP_M: gl.constexpr,          # tile pairs per group of the tile order
    STAGES: gl.constexpr,           # ring depth
    CONSUMERS: gl.constexpr,        # consumer warp groups (1 or 2): BLOCK_M = 64 · CONSUMERS
    CONSUMER_REGS: gl.constexpr,    # registers of the worker consumer group
    B_OFF: gl.constexpr,            # shared offset of b_bufs (from the first compile)
    READY_OFF: gl.constexpr,        # ... of the ready mbarriers
    EMPTY_OFF: gl.constexpr,        # ... of the empty mbarriers
    BH_PARAM: gl.constexpr,         # PTX name of bh_desc's CUtensorMap parameter
    MULTICAST: gl.constexpr,        # False: each CTA loads all of B itself (the same kernel otherwise: an A/B)
    DIRECT_STORE: gl.constexpr,     # the epilogue stores from registers (no staging tile)
):
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [CONSUMERS * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    if DIRECT_STORE:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS, 8, 8], c_desc.layout)     # unused
    else:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 * CONSUMERS if MULTICAST else CONSUMERS)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (mc_mma_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs.index(0), c_ptr, stride_cm, M, N, K, 0, NUM_PROGRAMS,
                                GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, EMPTY_OFF, MULTICAST,
                                DIRECT_STORE)),
            (mc_load_partition, (a_desc, b_desc, bh_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_PROGRAMS,
                                 GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, B_OFF, READY_OFF, BH_PARAM,
                                 MULTICAST)),
        ], [4], [40])
    else:
        gl.warp_specialize([
            (mc_mma_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs.index(0), c_ptr, stride_cm, M, N, K, 0, NUM_PROGRAMS,
                                GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, EMPTY_OFF, MULTICAST,
                                DIRECT_STORE)),
            (mc_mma_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs.index(1), c_ptr, stride_cm, M, N, K, 1, NUM_PROGRAMS,
                                GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, EMPTY_OFF, MULTICAST,
                                DIRECT_STORE)),
            (mc_load_partition, (a_desc, b_desc, bh_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_PROGRAMS,
                                 GROUP_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, B_OFF, READY_OFF, BH_PARAM,
                                 MULTICAST)),
        ], [4, 4], [CONSUMER_REGS, 40])


# ---------------------------------------------------------------------------------------------
# The two-pass compile


def smem_offsets(ttgir: str, capability: int = 90, ptx_version: int = 87) -> dict:
    """{buffer name: byte offset} of every ``ttg.local_alloc`` of a compiled kernel, from
    re-running the allocation passes of Triton's ``make_llir`` on its final TTGIR."""
    from triton._C.libtriton import ir, nvidia, passes
    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ttgir")
        with open(path, "w") as f:
            f.write(ttgir)
        mod = ir.parse_mlir_module(path, ctx)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, ptx_version)
    pm.run(mod, "smem_offsets")
    out = {}
    for line in str(mod).splitlines():
        m = re.search(r"%([A-Za-z_]\w*?)(?:_\d+)? = ttg\.local_alloc.*allocation\.offset = (\d+)", line)
        if m:
            out.setdefault(m.group(1), int(m.group(2)))
    return out


def tensordesc_param(ptx: str, kernel: str, index: int) -> str:
    """PTX name of the ``index``-th tensor-descriptor argument's CUtensorMap (128-byte) parameter."""
    names = re.findall(r"\.param \.align 64 \.b8 (" + re.escape(kernel) + r"_param_\d+)\[128\]", ptx)
    return names[index]


def _compile(args: dict, constexprs: dict, target, num_warps: int = 4):
    import torch
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    kernel = mc_gemm_kernel
    names = [p.name for p in kernel.params]
    signature = {n: "constexpr" if n in constexprs else mangle_type(args[n]) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if isinstance(args.get(n), torch.Tensor)}
    src = GluonASTSource(fn=kernel, signature=signature, attrs=attrs,
                         constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=target, options=dict(num_warps=num_warps))


def compile_multicast(args: dict, constexprs: dict, target):
    """The kernel compiled twice: first with placeholder offsets (and a parameter name that
    exists), then with the shared offsets and the B-half descriptor's parameter name that the
    first compile shows. Raises if the second compile moved a buffer."""
    first = dict(constexprs, B_OFF=0, READY_OFF=0, EMPTY_OFF=0, BH_PARAM="mc_gemm_kernel_param_0")
    c1 = _compile(args, first, target)
    offs = smem_offsets(c1.asm["ttgir"])
    final = dict(constexprs, B_OFF=offs["b_bufs"], READY_OFF=offs["ready"], EMPTY_OFF=offs["empty"],
                 BH_PARAM=tensordesc_param(c1.asm["ptx"], c1.metadata.name, 2))
    c2 = _compile(args, final, target)
    if smem_offsets(c2.asm["ttgir"]) != offs:
        raise RuntimeError("the second compile moved a shared buffer")
    return c2, offs, final
