"""Stream-K over the large-M GEMM's last waves (``ops/_stream_k.py``). On the CPU: the rule that
picks the region, the plan that carries it, and the schedule's invariants over random sizes (every
K step of the region done once, each cut tile split between two neighbouring programs, waits only
on the program before). On an sm_90 GPU: the kernel against fp64 with NaN-poisoned outputs, over
b and a layouts, ragged M / N / K and the 128x128 epilogues; bitwise reproducible; the workspace
flags left zero; a graph replay; the public op's forward and backward."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA
from hypothesis import given, settings
from hypothesis import strategies as st
from matmul_cases import _assert_graph_replays

from tilefuse.ops import _matmul_gluon_plan as gp
from tilefuse.ops import _matmul_kernels as mk
from tilefuse.ops import _stream_k as sk
from tilefuse.ops.matmul import matmul, matmul_reference
from tilefuse.testing import rel_err

PLAIN = (False, "none", False, False)


def _plan(m, n, k, epilogue=PLAIN, config=(), sms=132, a_strides=None, b_strides=None):
    return mk._matmul_plan(m, n, k, torch.bfloat16, torch.bfloat16, a_strides or (k, 1), b_strides or (1, k), (n, 1),
                           True, sms, True, True, epilogue, config, True)


def _rebuild_plans():
    mk._matmul_plan.cache_clear()
    gp._ws_plan.cache_clear()


@pytest.fixture
def stream_k_on(monkeypatch):
    """Plans made with stream-K as the large-M default (``_stream_k.STREAM_K``, whatever the module
    says), and none of them kept afterwards."""
    monkeypatch.setattr(sk, "STREAM_K", True)
    _rebuild_plans()
    yield
    _rebuild_plans()


@pytest.fixture
def stream_k_everywhere(stream_k_on, monkeypatch):
    """stream_k_on, and at every shape that can take it (not only where ``stream_k_pays``)."""
    monkeypatch.setattr(sk, "STREAM_K_MIN_IDLE_STEPS", 0)
    _rebuild_plans()


def test_stream_k_rule():
    """S = the partial wave + one full wave, with >= 2 waves, a partial one and K >= 2048; none
    at full waves, below two waves, or at short K."""
    assert sk.stream_k_tiles(8192, 6144, 4096, 128, 256, 64, 132) == 1536 % 132 + 132 == 216
    assert sk.stream_k_tiles(4096, 4096, 4096, 128, 256, 64, 132) == 512 % 132 + 132
    assert sk.stream_k_tiles(128 * 33, 1024, 4096, 128, 256, 64, 132) == 0     # 132 tiles: one full wave
    assert sk.stream_k_tiles(128 * 66, 1024, 4096, 128, 256, 64, 132) == 0     # two full waves
    assert sk.stream_k_tiles(128 * 40, 1024, 4096, 128, 256, 64, 132) == 0     # 160 tiles < 2 waves
    assert sk.stream_k_tiles(8192, 6144, 1024, 128, 256, 64, 132) == 0         # short K


def test_stream_k_pays():
    """The default takes stream-K where the last wave's idle SMs lose at least
    STREAM_K_MIN_IDLE_STEPS K steps of the whole machine: (P - r) · k_tiles >= 24 · P."""
    pays = lambda m, n, k: sk.stream_k_pays(m, n, k, 128, 256, 64, 132)      # noqa: E731
    assert pays(8192, 8192, 8192)           # 2048 tiles, r = 68: 64 idle SMs x 128 steps
    assert pays(8192, 14336, 4096)          # r = 20: 112 x 64
    assert pays(8192, 4096, 14336)          # r = 100: 32 x 224
    assert not pays(4096, 4096, 4096)       # r = 116: 16 x 64 = 7.8 steps of the machine
    assert not pays(8192, 4096, 4096)       # 32 x 64 = 15.5
    assert not pays(8192, 6144, 4096)       # 48 x 64 = 23.3
    assert not pays(8192, 8192, 1024)       # short K: no stream-K at all
    assert not sk.stream_k_pays(128 * 33, 2048, 8192, 128, 256, 64, 132)     # full waves
    assert sk.stream_k_pays(8192, 6144, 4096, 128, 256, 64, 100)             # 100 SMs: r = 36, 64 x 64 steps
    assert not sk.stream_k_pays(8192, 6144, 4096, 128, 256, 64, 128)         # 1536 = 12 full waves of 128


def test_stream_k_default():
    """Stream-K is the large-M default where it pays (measured on the H200, session 48): 8192x14336x4096
    takes it instead of its tail split, 8192x6144x4096 keeps whole tiles; a config forces it; with
    the switch off the tail split is back."""
    assert sk.STREAM_K
    _rebuild_plans()
    assert _plan(8192, 6144, 4096).ws_plan.sk_slots == 0
    assert _plan(8192, 14336, 4096).ws_plan.sk_slots == 264
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sk, "STREAM_K", False)
        _rebuild_plans()
        assert _plan(8192, 14336, 4096).tail_rows == 128
    _rebuild_plans()
    forced = _plan(8192, 6144, 4096, config=(("GLUON", True), ("STREAM_K", True)))
    assert forced.ws_plan.sk_slots == 264


def test_stream_k_epilogues():
    """128x256 takes it for a product with at most a bias (its consumer groups have no registers
    for the fixup beside an activation, a residual or a saved pre-activation); 128x128 with any
    epilogue."""
    assert sk.stream_k_epilogue_ok(256, PLAIN) and sk.stream_k_epilogue_ok(256, (True, "none", False, False))
    for epilogue in [(True, "gelu", False, False), (False, "silu", False, False), (False, "none", True, False),
                     (False, "none", False, True)]:
        assert not sk.stream_k_epilogue_ok(256, epilogue)
        assert sk.stream_k_epilogue_ok(128, epilogue)


def test_stream_k_plan(stream_k_on):
    """With stream-K the large-M default, the bench's large shapes where it pays
    (``stream_k_pays``) plan it on 132 SMs (one launch: the tail split steps aside, also at
    8192x14336x4096), its region size passed to the kernel, a workspace of one 64-row partial per
    (program, consumer group); the others keep whole tiles; with a GELU epilogue on 128x256, or a
    config's STREAM_K False, none (8192x14336x4096 then splits its last rows off again)."""
    for m, n, k in [(8192, 8192, 8192), (8192, 14336, 4096), (8192, 4096, 14336)]:
        plan = _plan(m, n, k)
        tile = dict(plan.ws_tile)
        tiles = mk.cdiv(m, 128) * mk.cdiv(n, tile["BLOCK_N"])
        assert plan.tail_rows == 0 and plan.ws_plan is not None, (m, n, k)
        assert plan.ws_plan.prepared.ints[-1] == tiles % 132 + 132, (m, n, k)
        assert plan.ws_plan.prepared.kwargs["STREAM_K"]
        assert plan.ws_plan.sk_slots == 264 and plan.ws_plan.sk_workspace == 264 * 64 * tile["BLOCK_N"]
    for m, n, k in [(4096, 4096, 4096), (8192, 4096, 4096), (8192, 6144, 4096)]:
        assert _plan(m, n, k).ws_plan.sk_slots == 0, (m, n, k)
        forced = _plan(m, n, k, config=(("GLUON", True), ("STREAM_K", True)))
        assert forced.ws_plan.sk_slots == 264, (m, n, k)
    dw = _plan(4096, 14336, 8192, a_strides=(1, 4096))          # dW's M-major a
    assert dict(dw.ws_tile)["A_M_MAJOR"] and dw.ws_plan.sk_slots
    gelu = _plan(8192, 14336, 4096, epilogue=(True, "gelu", False, False))
    assert gelu.tail_rows == 128
    assert _plan(8192, 4096, 14336, epilogue=(True, "none", False, False)).ws_plan.sk_slots == 264
    assert _plan(8192, 4096, 14336, epilogue=(True, "gelu", False, False)).ws_plan.sk_slots == 0
    assert _plan(8192, 4096, 14336, config=(("GLUON", True), ("STREAM_K", False))).ws_plan.sk_slots == 0
    assert _plan(8192, 6144, 1024).ws_plan.sk_slots == 0


def _check_schedule(num_tiles: int, sk_tiles: int, k_tiles: int, programs: int):
    """The invariants the kernel's fixup relies on, on the schedule's Python statement."""
    dp_tiles = num_tiles - sk_tiles
    done = {}
    for pid in range(programs):
        segs = sk.stream_k_segments(sk_tiles, k_tiles, programs, pid)
        roles = [s[0] for s in segs]
        # the order the kernel runs them: whole tiles, then at most one head, then at most one tail
        assert roles == sorted(roles, key=["whole", "publish", "collect"].index) and roles.count("publish") <= 1
        assert roles.count("collect") <= 1
        for role, tile, lo, hi in segs:
            assert 0 <= tile < sk_tiles and 0 <= lo < hi <= k_tiles
            assert (role == "whole") == (lo == 0 and hi == k_tiles) and (role != "publish" or lo == 0)
            assert role != "collect" or hi == k_tiles
            for step in range(lo, hi):
                assert (tile, step) not in done
                done[tile, step] = (pid, role)
        if pid == 0:
            assert "collect" not in roles
        if pid == programs - 1:
            assert "publish" not in roles
    assert len(done) == sk_tiles * k_tiles and dp_tiles >= 0
    for tile in range(sk_tiles):
        owners = {done[tile, s] for s in range(k_tiles)}
        pids = sorted({p for p, _ in owners})
        assert len(pids) <= 2
        if len(pids) == 2:      # the head of program p, the tail of program p + 1
            assert pids[1] == pids[0] + 1
            assert done[tile, 0] == (pids[0], "publish") and done[tile, k_tiles - 1] == (pids[1], "collect")


@settings(max_examples=300, deadline=None)
@given(programs=st.integers(1, 140), waves=st.integers(2, 30), rem=st.integers(1, 139), k_tiles=st.integers(1, 300))
def test_stream_k_schedule_invariants(programs, waves, rem, k_tiles):
    rem = rem % programs or 1
    if programs == 1:
        return          # no partial wave on one program
    num_tiles = waves * programs + rem
    sk_tiles = rem + programs
    _check_schedule(num_tiles, sk_tiles, k_tiles, programs)


def test_stream_k_schedule_bench_shapes():
    """The schedules of the bench's large shapes on 132 SMs (128x256 tiles, 64-deep K steps)."""
    for m, n, k in [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096),
                    (8192, 4096, 14336), (8192, 6144, 4096)]:
        tiles = mk.cdiv(m, 128) * mk.cdiv(n, 256)
        _check_schedule(tiles, sk.stream_k_tiles(m, n, k, 128, 256, 64, 132), mk.cdiv(k, 64), 132)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

def _sm90():
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma kernel: sm_90 only")


def _workspace_flags_zero(device) -> bool:
    flags, _ = mk.split_k_buffers(device, 1, 1)
    return not flags.any().item()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="Gluon kernel: sm_90 GPU")
@pytest.mark.parametrize("m,n,k,layout,epilogue", [
    (4096, 4096, 4096, "w.t()", "none"),             # 128x256, 512 tiles: S = 248
    (4000, 4096, 4096, "w.t()", "bias"),             # 128x256 with a bias (carried by the heads)
    (4000, 3000, 2104, "w.t()", "none"),             # ragged M, N and K (33 K steps, the last partial; TMA-aligned rows)
    (8192, 6144, 4096, "row-major", "none"),         # dy @ w: row-major b
    (4096, 4096, 4096, "a-m-major", "none"),         # dyᵀ @ x: the weight gradient's M-major a
    (2048, 4096, 4096, "w.t()", "bias-silu-residual"),   # 128x128 with the full epilogue
    (2048, 4096, 2048, "w.t()", "bias-gelu-preact"),
])
def test_gpu_stream_k_launch(m, n, k, layout, epilogue, stream_k_everywhere):
    """The stream-K launch writes every element (NaN-poisoned out) with a single launch's error
    against fp64, matches the all-whole-tiles kernel within bf16 rounding, repeats bit for bit,
    leaves the workspace flags zero, and replays from a CUDA graph."""
    _sm90()
    a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t() if layout == "a-m-major" else \
        torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = w.t().contiguous() if layout == "row-major" else w.t()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if "bias" in epilogue else None
    act = "silu" if "silu" in epilogue else "gelu" if "gelu" in epilogue else "none"
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if "residual" in epilogue else None
    save_preact = "preact" in epilogue
    plan = mk._matmul_plan(m, n, k, a.dtype, a.dtype, a.stride(), b.stride(), (n, 1), True, mk.num_sms(a), True,
                           True, (bias is not None, act, residual is not None, save_preact), (), True)
    assert plan.ws_plan is not None and plan.ws_plan.sk_slots, "the shape must take stream-K"
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    got, pre = mk.launch_matmul(a, b, bias, residual, act, save_preact=save_preact, out=out)
    torch.cuda.synchronize()
    assert not got.isnan().any() and (pre is None or not pre.isnan().any())
    ref = matmul_reference(a.double(), b.double(), None if bias is None else bias.double(), act,
                           None if residual is None else residual.double())
    assert rel_err(got, ref) <= 1e-2
    if save_preact:
        pre_ref = a.double() @ b.double() + (0 if bias is None else bias.double())
        assert rel_err(pre, pre_ref) <= 1e-2
    assert _workspace_flags_zero(a.device)
    again = mk.launch_matmul(a, b, bias, residual, act, save_preact=save_preact)[0]
    assert torch.equal(again, got)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sk, "STREAM_K", False)
        _rebuild_plans()
        whole = mk.launch_matmul(a, b, bias, residual, act)[0]
    _rebuild_plans()
    assert rel_err(got, whole.double()) <= 1e-2
    target = torch.empty_like(got)
    _assert_graph_replays(lambda: mk.launch_matmul(a, b, bias, residual, act, out=target)[0], got)
    assert _workspace_flags_zero(a.device)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="Gluon kernel: sm_90 GPU")
def test_gpu_stream_k_fwd_bwd(stream_k_everywhere):
    """tilefuse.matmul at a stream-K shape, training (x @ w.t()): out, dx (dy @ w) and dw
    (dyᵀ @ x) against fp64; all three GEMMs take stream-K."""
    _sm90()
    m, n, k = 4096, 6144, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = matmul(x, w.t())
    out.backward(dy)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    ref = matmul_reference(x64, w64.t())
    ref.backward(dy.double())
    assert rel_err(out, ref) <= 1e-2
    assert rel_err(x.grad, x64.grad) <= 1e-2 and rel_err(w.grad, w64.grad) <= 1e-2
    assert _workspace_flags_zero(x.device)


# ----------------------------------------------------------------------------------------------
# the fp8 tl kernel (fast accumulation on sm_90, any fp8 GEMM elsewhere; the interpreter on the CPU)
# ----------------------------------------------------------------------------------------------

# 64x32 tiles: 289 / 306 tiles on a GPU's 132 SMs; 9 on the interpreter's 4 (every role: whole, head, tail)
FP8_CASES = ([(1088, 544, 2048, False, False), (1100, 530, 2100, True, True)] if HAS_CUDA
             else [(192, 96, 2048, False, False), (190, 90, 2100, True, True)])
FP8_TILE = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=2)


# fast accumulation (no promotion within K) only changes the numbers on a GPU (sm_90's truncated
# running sum); the interpreter runs one form, exact against the whole-tile kernel either way
FP8_FAST = (False, True) if HAS_CUDA else (True,)


@pytest.mark.parametrize("fast", FP8_FAST)
@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_stream_k(case, fast):
    """fp8_gemm_kernel with stream-K over its last waves (a config's STREAM_K; the default follows
    _stream_k.STREAM_K): against the dequantized fp64 product, within fp32 rounding of the
    whole-tile kernel, bitwise repeatable, the workspace flags left zero; ragged M / N / K, row
    scales and a bias. With fast accumulation on a GPU each run of K steps is its own truncated
    running sum (test_fp8.FAST_ACC_TOL's error model), so the cut tiles differ from the whole-tile
    kernel's by that error, not by fp32 rounding: there the bound is flash-attn's rule, stream-K's
    error against fp64 at most twice the whole-tile kernel's."""
    from test_fp8 import FAST_ACC_TOL, GEMM_TOL

    from tilefuse.ops import _fp8_kernels as fk
    from tilefuse.ops import fp8 as fp8_ops

    m, n, k, rowwise, has_bias = case
    device = "cuda" if HAS_CUDA else "cpu"
    # fp8 operands and scales made directly (the quantize kernels are slow under the interpreter)
    qa = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    qb = (torch.randn(n, k, device=device) / k ** 0.5).to(torch.float8_e4m3fn)
    sa = torch.rand(m if rowwise else 1, device=device) + 0.5
    sb = torch.rand(n if rowwise else 1, device=device) + 0.5
    bias = torch.randn(n, device=device) if has_bias else None
    sms, hopper, hopper_or_newer = mk.device_traits(qa.device)
    plan = fk.gemm_plan(m, n, k, qa.stride(), qb.stride(), torch.float32, rowwise, rowwise, has_bias, True, sms,
                        hopper, hopper_or_newer, True, True, fk.KERNELS_INTERPRETED,
                        tuple(dict(FP8_TILE, STREAM_K=True).items()))
    tiles = mk.cdiv(m, 64) * mk.cdiv(n, 32)
    assert plan.sk_workspace == sms * 64 * 32 and plan.prepared.ints[-1] == tiles % sms + sms
    got = fk.launch_fp8_gemm(qa, sa, qb, sb, bias, torch.float32, fast, dict(FP8_TILE, STREAM_K=True))
    assert not got.isnan().any()
    ref = fp8_ops.scaled_matmul_reference(qa, sa, qb, sb, bias)
    whole = fk.launch_fp8_gemm(qa, sa, qb, sb, bias, torch.float32, fast, dict(FP8_TILE))
    if fast and HAS_CUDA:
        assert rel_err(got, ref) <= min(FAST_ACC_TOL, 2 * rel_err(whole, ref) + 1e-6)
    else:
        assert rel_err(got, ref) <= GEMM_TOL[torch.float32]
        assert rel_err(got, whole) <= 1e-6
    assert torch.equal(fk.launch_fp8_gemm(qa, sa, qb, sb, bias, torch.float32, fast, dict(FP8_TILE, STREAM_K=True)),
                       got)
    assert _workspace_flags_zero(qa.device)
