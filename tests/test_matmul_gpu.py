"""tilefuse.matmul on the GPU: bf16 at big shapes through both load and store paths, split-K, the
Gluon warp-specialized kernels (small M, large M, accumulate) by config and by default, forward and
backward, the launch memo by address, and CUDA-graph replays."""

import subprocess
import sys

import pytest
import torch
from matmul_cases import ACTS, TOL, _assert_graph_replays, _check, _rand, _weight_t

from tilefuse.ops import _matmul_kernels as mk
from tilefuse.ops.matmul import matmul_reference
from tilefuse.testing import rel_err


# ----------------------------------------------------------------------------------------------
# GPU: bf16, big shapes, both load paths (run by the lead on the H100/H200)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [{"USE_TMA": True}, {"USE_TMA": False},
                                 {"USE_TMA": True, "STORE_TMA": True, "STORE_SPLIT": 2, "FLATTEN": True},
                                 {"USE_TMA": True, "STORE_TMA": True, "STORE_SPLIT": 1}], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 4096, 4096), (128, 4096, 4096), (1000, 1031, 8192),
                                   (1000, 1032, 8192),
                                   (4096, 4096, 4096), (2048, 14336, 4096)])
def test_gpu_bf16_large(m, n, k, cfg):
    """Both load paths and both store paths (the descriptor store needs 16-byte rows: N = 1032)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for b in (w.t(), w.t().contiguous()):
        out, _ = mk.launch_matmul(a, b, config=cfg)
        assert rel_err(out, a.double() @ b.double()) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 4, 7])
@pytest.mark.parametrize("store_tma", [False, True])
@pytest.mark.parametrize("use_tma", [False, True])
def test_gpu_split_k(split, store_tma, use_tma):
    """Split-K on the GPU (real concurrency between the slices of a tile): bias + gelu + residual
    at M = 128 and an odd shape, bit-identical over repeated launches, and inside a CUDA graph
    (its own counters, zeroed by the captured memset) replayed twice."""
    for m, n, k in [(128, 4096, 4096), (77, 1000, 3000)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias, res = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        cfg = dict(SPLIT_K=split, USE_TMA=use_tma, STORE_TMA=store_tma)
        ref = matmul_reference(a.double(), w.double().t(), bias.double(), "gelu", res.double())
        out = mk.launch_matmul(a, w.t(), bias, res, "gelu", config=cfg)[0]
        assert rel_err(out, ref) <= 1e-2
        for _ in range(3):
            assert torch.equal(out, mk.launch_matmul(a, w.t(), bias, res, "gelu", config=cfg)[0])
        _assert_graph_replays(lambda: mk.launch_matmul(a, w.t(), bias, res, "gelu", config=cfg)[0], out)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["64x64", "64x128", "128x128", "64x96", "128x96"])
@pytest.mark.parametrize("dtype,out_dtype,row_major_b", [
    (torch.bfloat16, None, False), (torch.float16, None, False), (torch.bfloat16, torch.float32, False),
    (torch.bfloat16, None, True), (torch.float16, torch.float32, True)], ids=str)
def test_gpu_gluon_small_m(tile, dtype, out_dtype, row_major_b):
    """The Gluon small-M kernel with each tile (forced through config, so it runs on any sm_90
    GPU whatever the heuristic picks; 96 wide: two B parts of 64 + 32 columns), b as x @ w.t() or
    row-major [K, N]: ragged M / N / K (TMA
    zero fill and clipped stores), every epilogue, output NaN-poisoned first, bit-identical
    relaunches, the residual as the output itself, and a CUDA graph replay."""
    from tilefuse.ops import _matmul_gluon_plan as gp
    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("wgmma kernel: sm_90 only")
    rows, width = (int(v) for v in tile.split("x"))     # 96 wide: a 64- and a 32-column part
    cfg = dict(gp.WS_TILES[f"{rows}x128"] if width == 96 else gp.WS_TILES[tile], BLOCK_N=width, GLUON=True)
    shapes = [(128, 6144, 4096), (200, 1000, 3000), (33, 136, 72), (1, 64, 8)]
    for (m, n, k), act in zip(shapes, ["gelu", "silu", None, "relu"]):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        b = w.t().contiguous() if row_major_b else w.t()
        assert mk._matmul_plan(m, n, k, dtype, out_dtype or dtype, a.stride(), b.stride(), (n, 1), True, 132, True,
                               True, (False, "none", False, False), mk.config_key(cfg)).ws_tile
        bias, res = torch.randn(n, device="cuda", dtype=dtype), torch.randn(m, n, device="cuda", dtype=out_dtype or dtype)
        ref = matmul_reference(a.double(), b.double(), bias.double(), act, res.double())
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype or dtype)
        out, pre = mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype, save_preact=act is not None,
                                    config=cfg, out=out)
        assert rel_err(out, ref) <= TOL[dtype], (m, n, k)
        if act is not None:
            assert rel_err(pre, matmul_reference(a.double(), b.double(), bias.double())) <= TOL[dtype]
        plain = mk.launch_matmul(a, b, config=cfg)[0]
        assert rel_err(plain, a.double() @ b.double()) <= TOL[dtype]
        for _ in range(2):
            assert torch.equal(out, mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype, config=cfg)[0])
        inplace = res.clone()
        mk.launch_matmul(a, b, bias, inplace, act or "none", out_dtype=out_dtype, config=cfg, out=inplace)
        assert torch.equal(inplace, out)
    _assert_graph_replays(lambda: mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype,
                                                   config=cfg)[0], out)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["128x256", "128x128", "128x128-pingpong"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["a-m-major", "row-major", "b-k-major"])
def test_gpu_gluon_large_m(tile, dtype, layout):
    """The Gluon kernel at M > MID_MAX_M with each large tile (forced through config): a row-major
    or M-major (dyᵀ, the weight gradient), b a transposed weight or row-major; ragged M / N / K
    (TMA zero fill and clipped stores), K shorter than the ring, the epilogues the tile's heuristic
    allows (128x256: bias + activation; 128x128: also residual and pre-activation, and fp32 out),
    output NaN-poisoned, bit-identical relaunches and a CUDA graph replay."""
    from tilefuse.ops import _matmul_gluon_plan as gp
    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("wgmma kernel: sm_90 only")
    cfg = dict(gp.ACCUMULATE_TILES[tile], GLUON=True)     # (the large-M tiles and the ping-pong one)
    full = tile != "128x256"            # residual / preact / fp32 out fit its registers and shared memory
    for (m, n, k), act in zip([(1000, 768, 3000), (300, 136, 40), (4104, 520, 1032), (2049, 4096, 8)],
                              ["gelu", "silu", None, "relu"]):
        if layout == "a-m-major":       # descriptors read aᵀ [K, M]: 16-byte rows (M a multiple of 8)
            m = (m + 7) // 8 * 8
        a = torch.randn(k, m, device="cuda", dtype=dtype).t() if layout == "a-m-major" else \
            torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, k, device="cuda", dtype=dtype).t() if layout == "b-k-major" else \
            torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
        out_dtype = torch.float32 if full and act == "silu" else dtype
        plan = mk._matmul_plan(m, n, k, dtype, out_dtype, a.stride(), b.stride(), (n, 1), True, 132, True, True,
                               (True, act or "none", full, full and act is not None), mk.config_key(cfg))
        assert dict(plan.ws_tile)["A_M_MAJOR"] == (layout == "a-m-major")
        bias = torch.randn(n, device="cuda", dtype=dtype)
        res = torch.randn(m, n, device="cuda", dtype=out_dtype) if full else None
        ref = matmul_reference(a.double(), b.double(), bias.double(), act, res.double() if full else None)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        out, pre = mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype,
                                    save_preact=full and act is not None, config=cfg, out=out)
        assert rel_err(out, ref) <= TOL[dtype], (m, n, k)
        if pre is not None:
            assert rel_err(pre, matmul_reference(a.double(), b.double(), bias.double())) <= TOL[dtype]
        plain = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        mk.launch_matmul(a, b, config=cfg, out=plain)
        assert rel_err(plain, a.double() @ b.double()) <= TOL[dtype]
        assert torch.equal(out, mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype, config=cfg)[0])
    _assert_graph_replays(lambda: mk.launch_matmul(a, b, bias, res, act or "none", out_dtype=out_dtype,
                                                   config=cfg)[0], out)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [192, 1000])
@pytest.mark.parametrize("epilogue", ["none", "bias-gelu-residual-preact"])
def test_gpu_gluon_launch_memo_by_address(m, epilogue):
    """Repeated Gluon GEMMs at the same addresses go through the plan's AddressMemo (from the
    second sighting on): new values at those addresses give the new product every time (the
    memo keeps addresses, never values), outputs NaN-poisoned before each launch; other
    addresses, a bias of the same address in another dtype's plan and a CUDA graph replay are right too."""
    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("wgmma kernel: sm_90 only")
    n, k, dtype = 2048, 320, torch.bfloat16
    full = epilogue != "none"
    a = torch.empty(m, k, device="cuda", dtype=dtype)
    w = torch.empty(n, k, device="cuda", dtype=dtype)
    bias = torch.empty(n, device="cuda", dtype=dtype) if full else None
    res = torch.empty(m, n, device="cuda", dtype=dtype) if full else None
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    act = "gelu" if full else "none"
    # every argument positional, as launch_matmul passes them (lru_cache keys on how they are passed)
    plan = mk._matmul_plan(m, n, k, dtype, dtype, a.stride(), w.t().stride(), (n, 1), True, mk.num_sms(a), True, True,
                           (full, act, full, full), (), True)
    assert plan.ws_plan is not None, "this shape must take the Gluon kernel"
    plan.memo._entries.clear()
    plan.memo._seen.clear()
    for i in range(5):
        for t in (a, w, bias, res):
            if t is not None:
                t.normal_()
        out.fill_(float("nan"))
        got, pre = mk.launch_matmul(a, w.t(), bias, res, act, save_preact=full, out=out)
        ref = matmul_reference(a.double(), w.double().t(), bias.double() if full else None, act,
                               res.double() if full else None)
        assert got is out and rel_err(out, ref) <= TOL[dtype], i
        if full:    # preact is a fresh tensor: its address may change, so only out's part is fixed
            assert rel_err(pre, a.double() @ w.double().t() + bias.double()) <= TOL[dtype], i
    assert len(plan.memo) >= 1, "repeats at one address tuple must be kept"
    a2 = torch.randn_like(a)        # another address: a miss, right
    got, _ = mk.launch_matmul(a2, w.t(), bias, res, act, save_preact=full)
    ref = matmul_reference(a2.double(), w.double().t(), bias.double() if full else None, act,
                           res.double() if full else None)
    assert rel_err(got, ref) <= TOL[dtype]
    _assert_graph_replays(lambda: mk.launch_matmul(a, w.t(), bias, res, act, save_preact=full, out=out)[0],
                          mk.launch_matmul(a, w.t(), bias, res, act, save_preact=full)[0].clone())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 1024])
def test_gpu_gluon_gemm_first_in_a_fresh_backward(m):
    """A process whose first backward kernel is a Gluon GEMM (dx = dy @ w at M = 128 and 1024),
    after the same GEMMs ran on the main thread: its host TMA descriptors are encoded on the
    autograd engine's device thread, where no CUDA context is current until some CUDA runtime
    call makes it so (with the allocator's cache warm, the gradients' allocations make none).
    Failed with "Failed to create tensor map descriptor: invalid device context" before
    ``_launch.ensure_thread_context`` (H200, 2026-11-29, scripts/gemm_host_us.py's step row);
    now the gradients match fp64. In a child process: the first backward of a process is the case.
    ``TILEFUSE_TEST_NO_CONTEXT_FIX=1`` runs the child without the fix (to see the failure)."""
    code = (f"import os, torch, tilefuse, tilefuse._launch as L\n"
            f"from tilefuse.ops import _matmul_kernels as mk\n"
            f"from tilefuse.testing import rel_err\n"
            f"if os.environ.get('TILEFUSE_TEST_NO_CONTEXT_FIX') == '1': L.ensure_thread_context = lambda: None\n"
            f"x = torch.randn({m}, 4096, device='cuda', dtype=torch.bfloat16)\n"
            f"w = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16) / 64\n"
            f"dy = torch.randn({m}, 4096, device='cuda', dtype=torch.bfloat16)\n"
            f"for _ in range(20):\n"
            f"    mk.launch_matmul(x, w.t()), mk.launch_matmul(dy, w), mk.launch_matmul(dy.t(), x)\n"
            f"torch.cuda.synchronize()\n"
            f"xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)\n"
            f"got = torch.autograd.grad(tilefuse.matmul(xg, wg.t()), (xg, wg), dy)\n"
            f"xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)\n"
            f"ref = torch.autograd.grad(xd @ wd.t(), (xd, wd), dy.double())\n"
            f"print(max(rel_err(g, r) for g, r in zip(got, ref)))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "gelu"])
def test_gpu_gluon_large_m_by_default_fwd_bwd(act):
    """M = 2048 through the public op on sm_90: the forward, the input gradient (dz @ w) and the
    weight gradient (xᵀ @ dz, a M-major) each take the Gluon kernel by default; outputs and every
    gradient vs the fp64 reference."""
    if torch.cuda.get_device_capability()[0] == 9:
        for a_strides, b_strides, epilogue in [((4096, 1), (1, 4096), (True, act or "none", True, act is not None)),
                                               ((4096, 1), (4096, 1), (False, "none", False, False)),
                                               ((1, 4096), (4096, 1), (False, "none", False, False))]:
            assert mk._matmul_plan(4096, 4096, 4096, torch.bfloat16, torch.bfloat16, a_strides, b_strides,
                                   (4096, 1), True, 132, True, True, epilogue, ()).ws_tile
    _check(_rand((2, 2048, 4096), torch.bfloat16), _weight_t(4096, 4096, torch.bfloat16), _rand(4096, torch.bfloat16),
           act, _rand((2, 2048, 4096), torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["128x256", "128x128", "128x128-pingpong"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["a-m-major", "row-major", "b-k-major"])
def test_gpu_gluon_accumulate(tile, dtype, layout):
    """out += a @ b on the Gluon kernel (linear cross-entropy's grad_weight): a as dyᵀ (the
    transpose of a row-major [K, M]) or row-major, b row-major or a transposed weight; ragged M / N
    and K below, at and over the ring depth; one rounding of the sum (against the fp64 sum of the
    old tile and the product); relaunches give the same bits; accumulate=False writes a @ b into a
    NaN-poisoned out; ``scale`` multiplies the sum; the launch replays in a CUDA graph."""
    from tilefuse.ops import _matmul_gluon_plan as gp
    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("wgmma kernel: sm_90 only")
    cfg = gp.ACCUMULATE_TILES[tile]
    for m, n, k in [(1000, 768, 512), (136, 200, 40), (64, 256, 8), (4104, 520, 1032)]:
        a = torch.randn(k, m, device="cuda", dtype=dtype).t() if layout == "a-m-major" else \
            torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, k, device="cuda", dtype=dtype).t() if layout == "b-k-major" else \
            torch.randn(k, n, device="cuda", dtype=dtype)
        old = torch.randn(m, n, device="cuda", dtype=dtype) * 8
        ref = old.double() + a.double() @ b.double()
        out = gp.launch_gemm_accumulate(a, b, old.clone(), config=cfg)
        assert rel_err(out, ref) <= (4e-3 if dtype == torch.bfloat16 else 1e-3), (m, n, k)
        assert torch.equal(out, gp.launch_gemm_accumulate(a, b, old.clone(), config=cfg))
        fresh = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        gp.launch_gemm_accumulate(a, b, fresh, config=cfg, accumulate=False)
        assert rel_err(fresh, a.double() @ b.double()) <= (4e-3 if dtype == torch.bfloat16 else 1e-3)
        scale = torch.rand(1, device="cuda") * 4 - 2      # out = scale · (old + a @ b), one rounding
        scaled = gp.launch_gemm_accumulate(a, b, old.clone(), config=cfg, scale=scale)
        assert rel_err(scaled, ref * scale.double()) <= (4e-3 if dtype == torch.bfloat16 else 1e-3), (m, n, k)
    graph_out = old.clone()

    def relaunch():
        graph_out.copy_(old)
        return gp.launch_gemm_accumulate(a, b, graph_out, config=cfg)
    _assert_graph_replays(relaunch, out)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "gelu"])
def test_gpu_gluon_small_m_by_default_fwd_bwd(act):
    """M = 128 through the public op on sm_90 takes the Gluon kernel by default for the forward and
    the input gradient (dy @ w: row-major b), the tl kernel for the weight gradient (a transposed
    a): outputs and every gradient vs the fp64 reference."""
    if torch.cuda.get_device_capability()[0] == 9:      # (4096 columns: 128 tiles of 64x64 fill the SMs)
        for b_strides, epilogue in [((1, 4096), (True, act or "none", True, act is not None)),     # x @ w.t()
                                    ((4096, 1), (False, "none", False, False))]:                  # dz @ w
            assert mk._matmul_plan(128, 4096, 4096, torch.bfloat16, torch.bfloat16, (4096, 1), b_strides, (4096, 1),
                                   True, 132, True, True, epilogue, ()).ws_tile
    _check(_rand((2, 64, 4096), torch.bfloat16), _weight_t(4096, 4096, torch.bfloat16), _rand(4096, torch.bfloat16), act,
           _rand((2, 64, 4096), torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_gpu_bf16_epilogues_fwd_bwd(act):
    a = _rand((4, 256, 1024), torch.bfloat16)
    _check(a, _weight_t(1536, 1024, torch.bfloat16), _rand(1536, torch.bfloat16), act,
           _rand((4, 256, 1536), torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(FLATTEN=True), dict(mk.CONFIGS["tile_128x128"]), dict(mk.CONFIGS["tile_64x128"]),
                                 dict(mk.CONFIGS["small_m32"], BLOCK_N=128)])
def test_gpu_configs_compile_and_agree(cfg):
    a = torch.randn(3000, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 2999, device="cuda", dtype=torch.float16)
    for use_tma in (True, False):
        out, _ = mk.launch_matmul(a, b, config=dict(cfg, USE_TMA=use_tma))
        assert rel_err(out, a.double() @ b.double()) <= 2e-3
