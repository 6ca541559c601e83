"""tilefuse.fp8: current-scaling quantization (bit-exact vs torch's cast), the scaled fp8 GEMM vs
the fp64 product of its dequantized operands, fp8.matmul / fp8.Linear forward and backward vs the
exact product within fp8's error model, odd shapes, empties, bad input, torch.compile, the
registry specs, and the training-curve script.

Error model (see tilefuse/ops/fp8.py). Quantization: x̂ = x(1 + δ) + η with |δ| <= u (e4m3
2^-4, e5m2 2^-3: half an ulp of a 3- / 2-bit mantissa) and |η| <= half the smallest subnormal
times the scale (e4m3 2^-10, e5m2 2^-17). A product of two such values, summed over K, gives the
*elementwise* bound of :func:`_elementwise_bound`, deterministic (no statistics, any shape:
N = 1, M = 1, K = 1 included). The scaled GEMM itself is checked against the fp64 product of the
dequantized operands, where only accumulation and output rounding remain.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, HAS_CUDA
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse import fp8
from tilefuse._dispatch import interpreting, num_sms
from tilefuse.ops import _fp8_kernels as fk
from tilefuse.ops import fp8 as fp8_ops
from tilefuse.registry import get
from tilefuse.testing import check_impl, rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = {E4M3: 2**-4, E5M2: 2**-3}                       # unit roundoff (normal range)
SUBNORMAL_HALF_ULP = {E4M3: 2**-10, E5M2: 2**-17}
OUT_U = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}
# the output's rounding below its normal range: half its smallest subnormal, absolute (a CI run
# had an fp16 result of -1.31e-5, where fp16's spacing is 2^-24: 2.02x the relative bound alone)
OUT_SUBNORMAL_HALF_ULP = {torch.float32: 2**-150, torch.float16: 2**-25, torch.bfloat16: 2**-134}


def _acc_rel(k: int) -> float:
    """Accumulation error relative to Σ|a||b|: fp32 sums on the CPU ((K + 2) roundings); on sm_90
    the tensor core adds each 32-product wgmma with a ~13-bit mantissa, 4 per 128-K chunk before
    the promotion to fp32 (4 · 2^-13), then fp32 across chunks."""
    return 2**-11 + (k // 128 + 2) * 2**-24 if HAS_CUDA else (k + 2) * 2**-24


# rel-err bound vs the fp64 product of the dequantized operands, per output dtype
GEMM_TOL = {torch.float32: 2**-11 if HAS_CUDA else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
OUT_DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if HAS_CUDA else ())
# use_fast_accum (GPU): no promotion within K; sm_90 truncates the running sum to ~13 mantissa
# bits at each of the K/32 wgmmas (biased toward zero): percent-level at K = 8192
FAST_ACC_TOL = 3e-2


def _bits(q):
    return q.view(torch.uint8)


def _deq(q, scale):
    """fp64 x̂ = q · scale (scale [] or [R, 1])."""
    return q.double() * scale.double()


def _elementwise_bound(a, b, dta, dtb, scale_a, scale_b, out_dtype):
    """|fp8 product - a @ bᵀ| elementwise bound; a [M, K], b [N, K] (fp64), scale_a [] or [M, 1],
    scale_b [] or [N, 1] (the quantization scales), out [M, N]."""
    ua, ub = U[dta] + 2**-22, U[dtb] + 2**-22        # + the fp32 rounding of x · (fp8_max / amax)
    eta_a = SUBNORMAL_HALF_ULP[dta] * scale_a.double().reshape(-1, 1)
    eta_b = SUBNORMAL_HALF_ULP[dtb] * scale_b.double().reshape(1, -1)
    abs_a, abs_b = a.abs(), b.abs()
    prod = abs_a @ abs_b.t()
    bound = ((ua + ub + ua * ub) * prod + eta_a * (1 + ub) * abs_b.sum(1)[None, :]
             + eta_b * (1 + ua) * abs_a.sum(1)[:, None] + a.shape[1] * eta_a * eta_b)
    bound = bound + _acc_rel(a.shape[1]) * (prod + bound)
    exact = a @ b.t()
    return exact, bound + OUT_U[out_dtype] * (exact.abs() + bound) + OUT_SUBNORMAL_HALF_ULP[out_dtype] + 1e-300


def _scaled_gemm_bound(qa, sa, qb, sb, bias, out_dtype):
    """(exact, elementwise bound) of the scaled GEMM against the fp64 product of its dequantized
    operands: accumulation (:func:`_acc_rel`) relative to Σ|a||b|, the two scale products and the
    bias add in fp32 (4 roundings), then the output's rounding. Elementwise, so a sum that cancels
    (N = 1, K = 33 on an H200: 0.0441 against -0.0443, normwise 8e-4) is judged by its terms."""
    k = qa.shape[-1]
    exact = fp8_ops.scaled_matmul_reference(qa, sa, qb, sb, bias)
    da = qa.double().abs() * sa.double().abs().reshape(-1, 1)
    db = qb.double().abs() * sb.double().abs().reshape(-1, 1)
    terms = da @ db.t() + (bias.double().abs()[None, :] if bias is not None else 0.0)
    bound = (_acc_rel(k) + 4 * 2**-24) * terms
    return exact, bound + OUT_U[out_dtype] * (exact.abs() + bound) + OUT_SUBNORMAL_HALF_ULP[out_dtype] + 1e-300


def _assert_within(out, exact, bound, what):
    err = (out.double() - exact).abs()
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error reaches {worst:.3g} x the fp8 elementwise bound"


# ----------------------------------------------------------------------------------------------
# quantization
# ----------------------------------------------------------------------------------------------


def _spread(shape, dtype):
    """Values over ~12 decades across columns (normal, subnormal and flushed fp8 ranges), one all-zero row."""
    x = torch.randn(shape, device=DEVICE) * torch.logspace(-6, 6, shape[-1], device=DEVICE)
    x[..., 1, :] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else []))
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_quantize_matches_torch_bitwise(dtype, in_dtype, scaling):
    """q bit-identical to torch's cast of clamp(x · fp8_max / amax), scale == amax / fp8_max
    exactly (amax from torch), for per-tensor and per-row scaling, and the transposed layout."""
    x = _spread((37, 300), in_dtype) if in_dtype == torch.float32 else torch.randn(37, 300, device=DEVICE).to(in_dtype)
    q, scale = fp8.quantize_fp8(x, dtype, scaling)
    q_ref, s_ref = fp8_ops.quantize_reference(x, dtype, scaling == "row")
    assert q.dtype == dtype and q.shape == x.shape and scale.dtype == torch.float32
    assert scale.shape == ((37, 1) if scaling == "row" else ())
    assert torch.equal(_bits(q), _bits(q_ref))
    amax = (x.abs().amax(dim=1, keepdim=True) if scaling == "row" else x.abs().amax()).float()
    amax = amax.clamp(min=fk.AMAX_FLOOR)
    assert torch.equal(scale, amax / torch.full_like(amax, fk.FP8_MAX[dtype]))       # IEEE division
    if scaling == "tensor":
        qt, scale_t = fp8.quantize_fp8(x, dtype, transpose=True)
        assert qt.shape == (300, 37) and qt.is_contiguous()
        assert torch.equal(_bits(qt), _bits(q_ref).t()) and torch.equal(scale_t, scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_rounding_grid(dtype):
    """Every fp8 value, every midpoint (ties: to even) and the fp32 neighbours of each midpoint,
    both signs, subnormals included; amax = fp8_max so the scale is exactly 1."""
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()            # sorted, +0 .. fp8_max
    mid = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, grid[-1:].expand_as(mid))])
    x = torch.cat([vals, -vals, torch.tensor([-0.0])]).to(DEVICE)
    for q, want in ((fp8.quantize_fp8(x, dtype)[0], x.to(dtype)),
                    (fp8.quantize_fp8(x[None], dtype, "row")[0][0], x.to(dtype))):
        assert torch.equal(_bits(q), _bits(want))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_round_trip_bound(dtype):
    """|x - q·scale| <= u|x| in fp8's normal range, <= half a subnormal ulp · scale below it."""
    x = _spread((8, 200), torch.float32)
    for scaling in ("tensor", "row"):
        q, scale = fp8.quantize_fp8(x, dtype, scaling)
        err = (_deq(q, scale) - x.double()).abs()
        normal = x.double().abs() >= 2.0 ** fk.FP8_GRID[dtype][1] * scale.double()
        bound = torch.where(normal, (U[dtype] + 2**-22) * x.double().abs(),
                            SUBNORMAL_HALF_ULP[dtype] * scale.double() * (1 + 2**-20))
        assert bool((err <= bound).all()), scaling


def test_quantize_zero_empty_and_shapes():
    """All-zero input: scale = 1e-12 / fp8_max > 0, q = 0, no NaN. Empty inputs. N-D per-row
    scales are [..., 1]; scale broadcasts back: x ≈ q.float() * scale."""
    for scaling in ("tensor", "row"):
        q, scale = fp8.quantize_fp8(torch.zeros(3, 40, device=DEVICE), scaling=scaling)
        assert bool((scale > 0).all()) and not q.float().any() and not torch.isnan(q.float()).any()
        for shape in ((0, 8), (4, 0), (0, 0)):
            q, scale = fp8.quantize_fp8(torch.randn(shape, device=DEVICE), scaling=scaling)
            assert q.shape == shape and scale.shape == ((shape[0], 1) if scaling == "row" else ())
            assert bool((scale > 0).all())
    x = torch.randn(2, 3, 48, device=DEVICE)
    q, scale = fp8.quantize_fp8(x, scaling="row")
    assert q.shape == x.shape and scale.shape == (2, 3, 1)
    assert rel_err(q.float() * scale, x.double()) <= 2**-4
    q, scale = fp8.quantize_fp8(x.transpose(1, 2))      # strided input
    assert torch.equal(_bits(q), _bits(fp8_ops.quantize_reference(x.transpose(1, 2).reshape(-1, 3), E4M3, False)[0]).view(2, 48, 3))


def _clear_plans():
    for plan in (fk.quantize_rows_plan, fk.quantize_tensor_plan, fk.gemm_plan):
        plan.cache_clear()


@pytest.fixture
def few_partials(monkeypatch):
    """MAX_PARTIALS = 3: the per-row kernel strides its row blocks over a capped grid at test sizes."""
    _clear_plans()
    monkeypatch.setattr(fk, "MAX_PARTIALS", 3)
    yield
    _clear_plans()       # no plan built with the small cap outlives the test


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_per_tensor_scale_from_earlier_partials(few_partials, dtype):
    """The backward's per-tensor quantization from the forward's amax partials (per-row kernel,
    5 row blocks on 3 programs; or the per-tensor kernel) is bit-identical to a fresh amax pass:
    the same scale, the same qᵀ; the per-row outputs are unchanged by the strided row blocks."""
    x = _spread((37, 300), torch.float32)
    q_rows, s_rows, p_rows = fk.launch_quantize_rows(x, dtype)
    assert p_rows.numel() == fk.rows_programs(37, 300) == 3 < 37 // fk.rows_tile(37, 300)[0] + 1
    q_ref, s_ref = fp8_ops.quantize_reference(x, dtype, True)
    assert torch.equal(_bits(q_rows), _bits(q_ref)) and torch.equal(s_rows, s_ref)
    _, qt_fresh, s_fresh, _ = fk.launch_quantize_tensor(x, dtype, False, True)
    _, _, _, p_tensor = fk.launch_quantize_tensor(x, dtype, True, False)
    for partials in (p_rows, p_tensor):
        _, qt, s, _ = fk.launch_quantize_tensor(x, dtype, False, True, partials)
        assert torch.equal(s, s_fresh) and torch.equal(_bits(qt), _bits(qt_fresh))
    assert float(p_rows.max()) == float(x.abs().max())


def test_launch_plans_follow_shape_and_strides():
    """The cached launch plans are keyed on shape and strides: fp8.matmul on a new shape builds new
    plans, on a strided a of a seen shape new quantize plans (the GEMMs read fresh contiguous fp8
    copies: their plans are reused), on a seen shape and layout none; every result matches the recipe."""
    _clear_plans()
    plans = (fk.quantize_rows_plan, fk.quantize_tensor_plan, fk.gemm_plan)
    b = _leaf((19, 40), scale=0.15)
    for a, new_gemm in ((torch.randn(24, 40, device=DEVICE), True), (torch.randn(9, 40, device=DEVICE), True),
                        (torch.randn(40, 24, device=DEVICE).t(), False), (torch.randn(9, 40, device=DEVICE), False)):
        before = [plan.cache_info() for plan in plans]
        _check_matmul(a.requires_grad_(True), b, None, "row")
        after = [plan.cache_info() for plan in plans]
        seen = not new_gemm and a.is_contiguous()
        expect_new = (not seen, not seen, new_gemm)
        got_new = tuple(n.misses > m.misses for n, m in zip(after, before))
        assert got_new == expect_new, (a.shape, a.stride(), before, after)
        assert after[2].hits + after[2].misses == before[2].hits + before[2].misses + 3     # 3 GEMMs a step


# ----------------------------------------------------------------------------------------------
# the scaled GEMM (pre-quantized operands) vs the fp64 product of the dequantized operands
# ----------------------------------------------------------------------------------------------


def _operands(m, n, k, dta=E4M3, dtb=E4M3, rowwise_a=False, rowwise_b=False):
    qa, sa = fp8.quantize_fp8(torch.randn(m, k, device=DEVICE), dta, "row" if rowwise_a else "tensor")
    qb, sb = fp8.quantize_fp8(torch.randn(n, k, device=DEVICE) / max(k, 1) ** 0.5, dtb, "row" if rowwise_b else "tensor")
    return qa, sa, qb, sb


@pytest.mark.parametrize("m,n,k", [(37, 29, 45), (1, 40, 16), (5, 3, 8), (64, 64, 64), (2, 1, 33), (70, 33, 130), (3, 17, 1)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_scaled_matmul_vs_dequantized(m, n, k, out_dtype):
    """Odd M / N / K (K tails), M = 1, N = 1, K = 16, K = 8 and 1 (below the 32-wide K block)."""
    for dta, dtb, row_a, row_b, has_bias in ((E4M3, E4M3, False, False, False), (E4M3, E4M3, True, True, True),
                                             (E5M2, E4M3, False, True, True), (E4M3, E5M2, True, False, False)):
        qa, sa, qb, sb = _operands(m, n, k, dta, dtb, row_a, row_b)
        bias = torch.randn(n, device=DEVICE) if has_bias else None
        out = fp8.scaled_matmul(qa, sa, qb, sb, bias, out_dtype)
        assert out.shape == (m, n) and out.dtype == out_dtype
        _assert_within(out, *_scaled_gemm_bound(qa, sa, qb, sb, bias, out_dtype), (dta, dtb, row_a, row_b))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gemm_every_fp8_code(dtype):
    """Every finite fp8 value (subnormals, ±0, ±max) through the GEMM against the identity: exact."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[torch.isfinite(codes.float())]
    codes = torch.cat([codes, torch.zeros(256 - codes.numel(), dtype=dtype)]).to(DEVICE)   # K = 256: TMA on GPU
    n = codes.numel()
    eye = torch.eye(n, device=DEVICE).to(E4M3)
    one = torch.ones((), device=DEVICE)
    out = fp8.scaled_matmul(codes.reshape(1, n), one, eye, one, out_dtype=torch.float32)
    assert torch.equal(out[0], codes.float())
    out_t = fp8.scaled_matmul(eye, one, codes.reshape(1, n), one, out_dtype=torch.float32)   # as operand b
    assert torch.equal(out_t[:, 0], codes.float())


def test_scaled_matmul_scale_shapes_and_layouts():
    """Scales as [M], [M, 1], [1]-element; [N], [1, N], [N, 1]; 3-D a; non-contiguous operands."""
    qa, sa, qb, sb = _operands(12, 20, 48, rowwise_a=True, rowwise_b=True)
    ref = fp8_ops.scaled_matmul_reference(qa, sa, qb, sb)
    for sa_, sb_ in ((sa, sb), (sa.reshape(12), sb.reshape(1, 20)), (sa.reshape(12, 1), sb.reshape(20))):
        assert rel_err(fp8.scaled_matmul(qa, sa_, qb, sb_, out_dtype=torch.float32), ref) <= GEMM_TOL[torch.float32]
    out3 = fp8.scaled_matmul(qa.view(3, 4, 48), sa.view(3, 4, 1), qb, sb, out_dtype=torch.float32)
    assert out3.shape == (3, 4, 20) and rel_err(out3.reshape(12, 20), ref) <= GEMM_TOL[torch.float32]
    big_a, big_b = torch.randn(48, 30, device=DEVICE).to(E4M3), torch.randn(48, 25, device=DEVICE).to(E4M3)
    a_t, b_t = big_a.t()[:12], big_b.t()[5:]                # unit M / N stride: pointer loads
    one = torch.ones((), device=DEVICE)
    assert rel_err(fp8.scaled_matmul(a_t, one, b_t, one, out_dtype=torch.float32),
                   a_t.double() @ b_t.double().t()) <= GEMM_TOL[torch.float32]


@pytest.mark.parametrize("cfg", [
    dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4),      # several tiles per program
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=3),                   # EVEN_K (K = 96)
    dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, FLATTEN=True, MAX_IMPRECISE_ACC=32),
    dict(fk.GEMM_CONFIGS["small_m"]), dict(fk.GEMM_CONFIGS["tile_64x128"]),
])
def test_gemm_launch_configs(cfg):
    qa, sa, qb, sb = _operands(45, 70, 96, rowwise_a=True)         # BLOCK_M >= 64: one wgmma warp group
    bias = torch.randn(70, device=DEVICE)
    out = fk.launch_fp8_gemm(qa, sa.reshape(-1), qb, sb.reshape(1), bias, torch.float32, config=cfg)
    assert rel_err(out, fp8_ops.scaled_matmul_reference(qa, sa, qb, sb, bias)) <= GEMM_TOL[torch.float32]


def test_choose_gemm_config():
    h100 = 132
    for m, n, k in [(1, 4096, 4096), (64, 4096, 4096), (8192, 8192, 8192), (300, 7, 1), (5, 3, 8)]:
        for fast in (False, True):
            cfg = fk.choose_gemm_config(m, n, k, h100, fast)
            assert cfg["BLOCK_M"] >= 16 and cfg["BLOCK_N"] >= 16 and cfg["BLOCK_K"] >= 32, (m, n, k, cfg)
    assert fk.choose_gemm_config(8192, 8192, 8192, h100) == fk.GEMM_CONFIGS["tile_128x128"]
    assert fk.choose_gemm_config(8192, 8192, 8192, h100, True) == fk.GEMM_CONFIGS["tile_128x256"]
    assert fk.choose_gemm_config(16, 4096, 4096, h100)["BLOCK_M"] == 64


def _plan(m, n, k, out_dtype=torch.bfloat16, rowwise=(False, False), has_bias=False, fast=True, config=(),
          hopper=True):
    """fk.gemm_plan of contiguous operands on a 132-SM GPU (sm_90 with ``hopper``), 16-byte aligned."""
    return fk.gemm_plan(m, n, k, (k, 1), (k, 1), out_dtype, *rowwise, has_bias, fast, 132, hopper, True, True,
                        True, False, config)


def _gluon_constexprs(plan):
    return dict(plan.gluon_plan.prepared.kwargs)


def test_fast_accumulation_plans_take_the_gluon_gemm(monkeypatch):
    """Fast accumulation at M > 256 on sm_90 plans the bf16 GEMM's Gluon kernel with fp8 operands
    (_fp8_gemm.fast_gluon_plan): 128-deep K steps, the scale forms in SCALE_A / SCALE_B, stream-K
    where _stream_k.stream_k_pays, 128x128 for per-column scales beside a bias; everything else
    keeps its kernel (precise accumulation, small M, another GPU, a tl config, FAST_GLUON off)."""
    from tilefuse.ops import _fp8_gemm, _stream_k
    big = _plan(8192, 8192, 8192)
    assert big.gluon_plan is not None and not big.warp_specialized and big.prepared is None
    assert big.gluon_plan.block_k == 128 and big.gluon_plan.b_k_major and not big.gluon_plan.a_m_major
    consts = _gluon_constexprs(big)
    assert (consts["SCALE_A"], consts["SCALE_B"], consts["HAS_BIAS"]) == (1, 1, False)
    assert big.gluon_plan.block_n1 == 256 and consts["STREAM_K"] == _stream_k.stream_k_pays(
        8192, 8192, 8192, 128, 256, 128, 132) is True
    assert _gluon_constexprs(_plan(4096, 4096, 4096))["STREAM_K"] is False        # pays nothing there
    rows = _plan(4096, 4096, 4096, rowwise=(True, True), has_bias=True)
    assert _gluon_constexprs(rows)["SCALE_A"] == 2 and _gluon_constexprs(rows)["SCALE_B"] == 2
    assert rows.gluon_plan.block_n1 == 128                                          # spills at 128x256
    assert _plan(4096, 4096, 4096, rowwise=(True, False), has_bias=True).gluon_plan.block_n1 == 256
    assert _plan(4096, 4096, 4096, torch.float32).gluon_plan.block_n1 == 128       # 4-byte output staging
    for other in (_plan(4096, 4096, 4096, fast=False), _plan(256, 4096, 4096), _plan(4096, 4096, 4096, hopper=False),
                  _plan(4096, 4096, 4096, config=tuple(fk.GEMM_CONFIGS["tile_128x256"].items())),
                  _plan(4096, 4096, 4096, config=(("GLUON", False),))):
        assert other.gluon_plan is None
    forced = _plan(64, 4096, 4096, config=(("GLUON", True), ("STREAM_K", True)))
    assert forced.gluon_plan is not None and _gluon_constexprs(forced)["STREAM_K"] is False   # one wave: no region
    monkeypatch.setattr(_fp8_gemm, "FAST_GLUON", False)
    fk.gemm_plan.cache_clear()
    assert _plan(8192, 8192, 8192).gluon_plan is None
    fk.gemm_plan.cache_clear()


# ----------------------------------------------------------------------------------------------
# fp8.matmul: forward and backward
# ----------------------------------------------------------------------------------------------


def _leaf(shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype).requires_grad_(True)


def _check_matmul(a, b, bias, scaling, out_dtype=torch.float32, grad_dtype=E5M2):
    """fp8.matmul forward and backward: (1) within the elementwise bound of the exact product,
    (2) tight vs the fp64 product of the operands quantized as the recipe says (elementwise too:
    the random shapes include N = 1 and K = 1, whose sums may cancel)."""
    rowwise = scaling == "row"
    k = a.shape[-1]
    a2 = a.detach().reshape(-1, k)
    y = fp8.matmul(a, b, scaling, out_dtype, bias, grad_dtype)
    assert y.shape == (*a.shape[:-1], b.shape[0]) and y.dtype == out_dtype
    y2 = y.detach().reshape(-1, b.shape[0])
    bias64 = 0 if bias is None else bias.detach().double()
    qa, sa = fp8_ops.quantize_reference(a2, E4M3, rowwise)
    qb, sb = fp8_ops.quantize_reference(b.detach(), E4M3, rowwise)
    exact, bound = _elementwise_bound(a2.double(), b.detach().double(), E4M3, E4M3, sa, sb, out_dtype)
    _assert_within(y2, exact + bias64, bound + OUT_U[out_dtype] * (abs(bias64) if bias is not None else 0), "forward")
    _assert_within(y2, *_scaled_gemm_bound(qa, sa, qb, sb, bias, out_dtype), "forward vs the recipe")

    leaves = [t for t in (a, b, bias) if t is not None]
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    dy2 = dy.reshape(-1, b.shape[0])
    qdy, sdy = fp8_ops.quantize_reference(dy2, grad_dtype, False)
    qbt, sbt = fp8_ops.quantize_reference(b.detach(), E4M3, False)      # bᵀ per tensor: same values
    qat, sat = fp8_ops.quantize_reference(a2, E4M3, False)
    da, db = grads[0].reshape(-1, k), grads[1]
    assert grads[0].dtype == a.dtype and db.dtype == b.dtype and db.shape == b.shape
    # da = dy @ b ; db = dyᵀ @ a: exact-product bound and the tight recipe emulation
    exact, bound = _elementwise_bound(dy2.double(), b.detach().double().t(), grad_dtype, E4M3, sdy, sbt, a.dtype)
    _assert_within(da, exact, bound, "grad a")
    _assert_within(da, *_scaled_gemm_bound(qdy, sdy, qbt.t(), sbt, None, a.dtype), "grad a vs the recipe")
    exact, bound = _elementwise_bound(dy2.double().t(), a2.double().t(), grad_dtype, E4M3, sdy, sat, b.dtype)
    _assert_within(db, exact, bound, "grad b")
    _assert_within(db, *_scaled_gemm_bound(qdy.t(), sdy, qat.t(), sat, None, b.dtype), "grad b vs the recipe")
    if bias is not None:
        assert grads[2].dtype == bias.dtype         # an fp32 sum, rounded once to the bias dtype
        # elementwise: with N = 1 the whole gradient is one sum of M terms that may cancel (a
        # relative norm failed ~2e-3 of runs, s45); fp32 summation ((M - 1)·u·Σ|dy|), then one
        # rounding to the bias dtype (and half a subnormal step of fp16 where it lands there)
        exact = dy2.double().sum(0)
        summed = max(dy2.shape[0] - 1, 1) * 2**-24 * dy2.double().abs().sum(0)
        bound = OUT_U[bias.dtype] * (exact.abs() + summed) + summed + (2**-25 if bias.dtype == torch.float16 else 0)
        _assert_within(grads[2], exact, bound, "grad bias")
    return y


@pytest.mark.parametrize("m,n,k", [(37, 29, 45), (1, 64, 16), (5, 1, 8), (64, 64, 64), (2, 3, 1), (17, 40, 100)])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_matmul_fwd_bwd(m, n, k, scaling):
    """Odd shapes, M = 1 (dW an outer product), N = 1, K = 16, K = 1; bias on half of them."""
    _check_matmul(_leaf((m, k)), _leaf((n, k), scale=k ** -0.5), _leaf(n) if (m + n) % 2 else None, scaling)


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 40), k=st.integers(1, 70), scaling=st.sampled_from(["tensor", "row"]),
       grad_dtype=st.sampled_from([E5M2, E4M3]), has_bias=st.booleans())
def test_matmul_random_shapes(m, n, k, scaling, grad_dtype, has_bias):
    _check_matmul(_leaf((m, k)), _leaf((n, k), scale=k ** -0.5), _leaf(n) if has_bias else None, scaling,
                  grad_dtype=grad_dtype)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_matmul_dtypes(out_dtype):
    """fp16 activations with an fp32 master weight (mixed operand dtypes), e4m3 gradients, 3-D a."""
    a, b, bias = _leaf((2, 9, 48), torch.float16), _leaf((24, 48), scale=48 ** -0.5), _leaf(24, torch.float16)
    _check_matmul(a, b, bias, "row", out_dtype)
    _check_matmul(_leaf((9, 40)), _leaf((24, 40), scale=0.2), None, "tensor", out_dtype, grad_dtype=E4M3)


def test_matmul_nd_output_modifiable_in_place():
    """3-D a: the leading dimensions are flattened inside the op, and the output is a tensor of its
    own (not a view made inside the autograd Function, which autograd forbids modifying in place):
    an in-place op on it, then the backward, give the same gradients as on a fresh 2-D call."""
    a, b, bias = _leaf((2, 9, 48)), _leaf((24, 48), scale=48 ** -0.5), _leaf(24)
    y = fp8.matmul(a, b, "row", torch.float32, bias)
    assert y._base is None and y.shape == (2, 9, 24)
    y.mul_(2.0)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (a, b, bias), dy)
    a2 = a.detach().reshape(18, 48).requires_grad_(True)
    ref = torch.autograd.grad(fp8.matmul(a2, b, "row", torch.float32, bias) * 2.0, (a2, b, bias), dy.reshape(18, 24))
    assert grads[0].shape == a.shape
    for g, r in zip(grads, ref):
        assert torch.equal(g.reshape(r.shape), r)


def test_matmul_noncontiguous_a():
    big = torch.randn(30, 2, 50, device=DEVICE)
    a = big.transpose(0, 1)[..., 3:43].requires_grad_(True)           # [2, 30, 40], strided rows
    _check_matmul(a, _leaf((19, 40), scale=0.15), _leaf(19), "row")
    a_t = torch.randn(40, 21, device=DEVICE).t().requires_grad_(True)  # unit M stride
    _check_matmul(a_t, _leaf((19, 40), scale=0.15), None, "tensor")


def test_matmul_large_statistical_error():
    """On a shape with many terms the relative error norm vs the exact product sits at the error
    model's typical value (~0.036 forward) and below its bound √2·2^-4 (+ bf16 rounding)."""
    a, b = torch.randn(96, 128, device=DEVICE), torch.randn(80, 128, device=DEVICE) / 128 ** 0.5
    for scaling in ("tensor", "row"):
        err = rel_err(fp8.matmul(a, b, scaling, torch.float32), a.double() @ b.double().t())
        assert 0.01 <= err <= fp8_ops.FWD_REL_BOUND, (scaling, err)


@pytest.mark.parametrize("m,n,k", [(0, 5, 32), (4, 0, 32), (3, 6, 0), (0, 0, 0)])
def test_empty(m, n, k):
    """K = 0: out = bias, zero gradients for a and b; M or N = 0: empty outputs."""
    a, b, bias = _leaf((m, k)), _leaf((n, k)), _leaf(n)
    y = fp8.matmul(a, b, "row", torch.float32, bias)
    assert y.shape == (m, n) and rel_err(y, bias.detach().double().expand(m, n)) <= 1e-7
    grads = torch.autograd.grad(y, (a, b, bias), torch.randn_like(y))
    for g, t in zip(grads, (a, b, bias)):
        assert g.shape == t.shape and not torch.isnan(g).any()
    assert not grads[0].any() and not grads[1].any()
    qa = torch.zeros(m, k, device=DEVICE, dtype=E4M3)
    one = torch.ones((), device=DEVICE)
    assert fp8.scaled_matmul(qa, one, torch.zeros(n, k, device=DEVICE, dtype=E4M3), one).shape == (m, n)


@pytest.mark.parametrize("path", ["kernels", "cpu-reference"])
def test_empty_on_each_path(monkeypatch, path):
    """K = 0 and M = 0 (whose weight gradient reduces over M) on the kernels and, for CPU
    tensors without the interpreter, the reference path (its reshape(-1, 0) raised, s37 audit)."""
    if path == "cpu-reference":
        if DEVICE != "cpu":
            pytest.skip("the reference path is the CPU path")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    y = fp8.matmul(torch.randn(3, 0, device=DEVICE), torch.randn(4, 0, device=DEVICE), out_dtype=torch.float32)
    assert y.shape == (3, 4) and not y.any()
    a, b = _leaf((0, 5)), _leaf((4, 5))
    ga, gb = torch.autograd.grad(fp8.matmul(a, b, out_dtype=torch.float32).sum(), (a, b))
    assert ga.shape == (0, 5) and gb.shape == (4, 5) and not gb.any()


@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_inputs_give_non_finite_outputs(scaling, bad):
    """A NaN / inf in an operand or in the output gradient never comes out as a finite product:
    the amax and the clamp propagate NaN (they dropped it, s37 audit: a NaN gave a plausible
    finite row, +inf gave -inf, and a NaN gradient vanished from x.grad and weight.grad)."""
    a, b = torch.randn(3, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)
    a[1, 3] = bad
    out = fp8.matmul(a, b, scaling, torch.float32)
    assert not torch.isfinite(out[1]).any()
    if scaling == "row":      # the other rows have their own scales
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    x, w = _leaf((4, 16)), _leaf((8, 16))
    y = fp8.matmul(x, w, scaling, torch.float32)
    dy = torch.randn_like(y)
    dy[2, 5] = bad
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    assert not torch.isfinite(gx).all() and not torch.isfinite(gw).all()



@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_quantize_matches_the_reference(scaling, bad):
    """The kernel's q and product are NaN exactly where the reference's are: under the interpreter
    the fp8 grid rounding turned NaN into a finite ±384, so an inf input gave an inf product row
    where the reference (and the GPU's cvt) gives NaN (s55 audit)."""
    x = torch.randn(3, 16, device=DEVICE)
    x[1, 4] = bad
    q, scale = fp8.quantize_fp8(x, E4M3, scaling)
    q_ref, scale_ref = fp8_ops.quantize_reference(x, E4M3, scaling == "row")
    assert torch.equal(torch.isnan(q.float()), torch.isnan(q_ref.float()))
    assert torch.isnan(q.float()[1, 4])
    assert torch.equal(torch.isfinite(scale), torch.isfinite(scale_ref.reshape(scale.shape)))
    out = fp8.matmul(x, torch.randn(4, 16, device=DEVICE), scaling, torch.float32)
    assert not torch.isfinite(out[1]).any()
    if not interpreting():   # the 3.6 interpreter loads an fp8 NaN as a finite 480 (e4m3) / 114688 (e5m2)
        assert torch.isnan(out[1]).all()

_A, _B = (lambda: torch.randn(3, 8, device=DEVICE)), (lambda: torch.randn(6, 8, device=DEVICE))
_Q = (lambda: torch.randn(3, 8, device=DEVICE).to(E4M3))
_ONE = (lambda: torch.ones((), device=DEVICE))


@pytest.mark.parametrize("call,exc,match", [
    (lambda: fp8.matmul(_A().tolist(), _B()), TypeError, "a must be a torch.Tensor"),
    (lambda: fp8.matmul(_A(), _B().int()), TypeError, "b has dtype int32"),
    (lambda: fp8.matmul(_A().long(), _B()), TypeError, "a has dtype int64"),
    (lambda: fp8.matmul(_Q(), _B()), TypeError, "a has dtype float8_e4m3fn"),
    (lambda: fp8.matmul(_A(), _B()[:, :7]), ValueError, "b has K = 7 columns"),
    (lambda: fp8.matmul(_A(), _B()[0]), ValueError, "b must be 2-D"),
    (lambda: fp8.matmul(_A(), _B(), scaling="block"), ValueError, "scaling must be"),
    (lambda: fp8.matmul(_A(), _B(), out_dtype=E4M3), TypeError, "out_dtype must be"),
    (lambda: fp8.matmul(_A(), _B(), grad_dtype=torch.float16), TypeError, "grad_dtype must be"),
    (lambda: fp8.matmul(_A(), _B(), bias=torch.randn(5, device=DEVICE)), ValueError, "bias has shape"),
    (lambda: fp8.matmul(_A(), _B().to("meta")), ValueError, "b is on meta"),
    (lambda: fp8.matmul(_A(), _B(), bias=torch.randn(6, device="meta")), ValueError, "bias is on meta"),
    (lambda: fp8.scaled_matmul(_A(), _ONE(), _Q(), _ONE()), TypeError, "a_fp8 has dtype float32"),
    (lambda: fp8.scaled_matmul(_Q(), _ONE(), _Q()[:, :5], _ONE()), ValueError, "b_fp8 has K = 5 columns"),
    (lambda: fp8.scaled_matmul(_Q(), _ONE().half(), _Q(), _ONE()), TypeError, "scale_a has dtype float16"),
    (lambda: fp8.scaled_matmul(_Q(), torch.ones(2, device=DEVICE), _Q(), _ONE()), ValueError, "scale_a has shape"),
    (lambda: fp8.scaled_matmul(_Q(), _ONE(), _Q(), torch.ones(3, 3, device=DEVICE)), ValueError, "scale_b has shape"),
    (lambda: fp8.scaled_matmul(_Q(), _ONE().to("meta"), _Q(), _ONE()), ValueError, "scale_a is on meta"),
    (lambda: fp8.scaled_matmul(_Q(), _ONE(), _Q(), _ONE(), out_dtype=torch.int32), TypeError, "out_dtype must be"),
    (lambda: fp8.quantize_fp8(_A(), torch.float16), TypeError, "dtype must be"),
    (lambda: fp8.quantize_fp8(_A().int()), TypeError, "x has dtype int32"),
    (lambda: fp8.quantize_fp8(_A(), scaling="col"), ValueError, "scaling must be"),
    (lambda: fp8.quantize_fp8(_A()[None], transpose=True), ValueError, "transpose=True needs"),
    (lambda: fp8.quantize_fp8(_A(), scaling="row", transpose=True), ValueError, "transpose=True needs"),
    (lambda: fp8.Linear(4, 4, grad_dtype=torch.float16), TypeError, "grad_dtype must be"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) through quantize, the scaled GEMM and fp8.matmul's autograd."""
    fn = torch.compile(lambda a, b, bias: fp8.matmul(a, b, "row", torch.float32, bias) * 2.0,
                       fullgraph=True, backend="aot_eager")
    a, b, bias = _leaf((2, 7, 40)), _leaf((19, 40), scale=0.15), _leaf(19)
    y = fn(a, b, bias)
    y_eager = fp8.matmul(a, b, "row", torch.float32, bias) * 2.0
    assert rel_err(y, y_eager.detach().double()) <= 1e-6
    dy = torch.randn_like(y)
    for g, g_eager in zip(torch.autograd.grad(y, (a, b, bias), dy), torch.autograd.grad(y_eager, (a, b, bias), dy)):
        assert rel_err(g, g_eager.double()) <= 1e-6
    gemm = torch.compile(lambda x, w: fp8.scaled_matmul(*fp8.quantize_fp8(x, scaling="row"),
                                                        *fp8.quantize_fp8(w, scaling="row"), out_dtype=torch.float32),
                         fullgraph=True, backend="aot_eager")
    x, w = torch.randn(9, 48, device=DEVICE), torch.randn(21, 48, device=DEVICE)
    assert rel_err(gemm(x, w), fp8.matmul(x, w, "row", torch.float32).double()) <= 1e-6


# ----------------------------------------------------------------------------------------------
# fp8.Linear
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_linear_vs_nn_linear(bias):
    """Same constructor, parameters and state_dict keys as nn.Linear; forward / backward within
    the fp8 error bounds (statistical, this shape has many terms) of nn.Linear in fp64."""
    ref = torch.nn.Linear(64, 48, bias=bias).to(DEVICE)
    lin = fp8.Linear(64, 48, bias=bias, device=DEVICE)
    assert isinstance(lin, torch.nn.Linear) and list(lin.state_dict()) == list(ref.state_dict())
    lin.load_state_dict(ref.state_dict())
    ref.load_state_dict(lin.state_dict())               # and back
    x = torch.randn(4, 16, 64, device=DEVICE, requires_grad=True)
    y = lin(x)
    x64 = x.detach().double().requires_grad_(True)
    params64 = [p.detach().double().requires_grad_(True) for p in ref.parameters()]
    y_ref = F.linear(x64, *params64)
    assert y.dtype == x.dtype and rel_err(y, y_ref) <= fp8_ops.FWD_REL_BOUND
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *lin.parameters()], dy)
    ref_grads = torch.autograd.grad(y_ref, [x64, *params64], dy.double())
    for g, r, what in zip(grads, ref_grads, ("x", "weight", "bias")):
        assert rel_err(g, r) <= (fp8_ops.BWD_REL_BOUND if what != "bias" else 1e-6), what
    assert grads[1].is_contiguous() and grads[1].shape == (48, 64)


def test_linear_helpers():
    """from_linear / swap_linears share the parameters; repr names the gradient format."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Sequential(torch.nn.Linear(32, 8)))
    w0 = model[0].weight
    fp8.swap_linears(model.to(DEVICE), grad_dtype=E4M3)
    assert isinstance(model[0], fp8.Linear) and isinstance(model[2][0], fp8.Linear)
    assert model[0].weight is w0 and "grad_dtype=float8_e4m3fn" in repr(model[0])
    x = torch.randn(5, 16, device=DEVICE)
    model(x).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# registry specs and the training-curve script
# ----------------------------------------------------------------------------------------------

_SPECS = ("fp8_matmul", "fp8_matmul_rowwise", "fp8_scaled_matmul", "fp8_scaled_matmul_fast", "fp8_linear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", _SPECS)
def test_registry_specs(name, dtype):
    """The registry sweep (tests/test_ops.py) for these ops, runnable before ops/__init__ imports them."""
    spec = get(name)
    for shape in spec.test_shapes:
        chk = check_impl(spec, spec.fn, spec.make_inputs(shape, dtype, DEVICE), dtype)
        assert chk.error is None and chk.ok, (shape, chk)
    m, n, k = spec.bench_shapes[0]
    bias_add = m * n if name == "fp8_linear" else 0          # (its bias [N], added to each row)
    assert spec.flops_fn((m, n, k), "fwd") == 2 * m * n * k + bias_add
    assert spec.bytes_fn((m, n, k), torch.bfloat16, "fwd") > 0


def test_train_curve_script_smoke(tmp_path):
    """scripts/fp8_train_curve.py end to end on a tiny model (5 steps; kernels interpreted on CPU)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import fp8_train_curve
    finally:
        sys.path.pop(0)
    summary = fp8_train_curve.main(["--device", DEVICE, "--steps", "5", "--every", "2", "--d-model", "32",
                                    "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "4", "--vocab", "32",
                                    "--dtype", "float32", "--out", str(tmp_path)])
    assert (tmp_path / "fp8_train_curve.json").exists()
    assert summary["fp8"]["step"] == [2, 4, 5] and all(math.isfinite(v) for v in summary["fp8"]["eval"])
    assert abs(summary["fp8"]["eval"][-1] - summary["bf16"]["eval"][-1]) < 0.05


# ----------------------------------------------------------------------------------------------
# GPU: bf16, large shapes, TMA vs pointer loads, every config, _scaled_mm, graph capture
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 4096, 4096), (128, 4096, 4096), (1000, 1032, 8192),
                                   (4096, 4096, 4096), (2048, 14336, 4096), (130, 4097, 1000)])
def test_gpu_gemm_large(m, n, k):
    """Both load paths (K = 1000: unaligned rows, pointer loads), both accumulation modes, vs the
    dequantized fp64 product, and beside torch._scaled_mm on the same operands."""
    qa, sa, qb, sb = _operands(m, n, k, rowwise_a=True, rowwise_b=True)
    ref = fp8_ops.scaled_matmul_reference(qa, sa, qb, sb)
    for cfg in ({"USE_TMA": True}, {"USE_TMA": False}):
        for fast in (False, True):
            out = fk.launch_fp8_gemm(qa, sa.reshape(-1), qb, sb.reshape(-1), None, torch.bfloat16, fast, cfg)
            assert rel_err(out, ref) <= (FAST_ACC_TOL if fast else 1e-2), (cfg, fast)
    if k % 16 == 0 and n % 16 == 0:
        peer = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.reshape(1, -1), out_dtype=torch.bfloat16)
        assert rel_err(fp8.scaled_matmul(qa, sa, qb, sb), peer.double()) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(fk.GEMM_CONFIGS))
def test_gpu_configs_compile_and_agree(name):
    qa, sa, qb, sb = _operands(3000, 4096, 4096, E5M2, E4M3)     # e5m2 x e4m3: the backward's mix
    ref = fp8_ops.scaled_matmul_reference(qa, sa, qb, sb)
    for fast in (False, True):
        out = fk.launch_fp8_gemm(qa, sa.reshape(1), qb, sb.reshape(1), None, torch.float16, fast, dict(fk.GEMM_CONFIGS[name]))
        assert rel_err(out, ref) <= (FAST_ACC_TOL if fast else GEMM_TOL[torch.float16]), fast


@pytest.mark.gpu
def test_gpu_quantize_large_bitwise():
    x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16) * 3
    for dtype in (E4M3, E5M2):
        for scaling in ("tensor", "row"):
            q, scale = fp8.quantize_fp8(x, dtype, scaling)
            q_ref, s_ref = fp8_ops.quantize_reference(x, dtype, scaling == "row")
            assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(scale.reshape(-1), s_ref.reshape(-1))
        qt, _ = fp8.quantize_fp8(x, dtype, transpose=True)
        assert torch.equal(_bits(qt), _bits(fp8_ops.quantize_reference(x, dtype, False)[0]).t())


@pytest.mark.gpu
def test_gpu_bf16_fwd_bwd_and_graph_capture():
    """bf16 training-size shapes through fp8.matmul's forward and backward, then the whole step
    captured in a CUDA graph (no host synchronization anywhere: the per-tensor amax stays on device),
    through both GEMM kernels."""
    a, b, bias = _leaf((4, 256, 1024), torch.bfloat16), _leaf((1536, 1024), torch.bfloat16, 1024 ** -0.5), _leaf(1536, torch.bfloat16)
    _check_matmul(a, b, bias, "row", torch.bfloat16)
    # 512 x 768: the tl GEMM; 4096 x 1024: the Gluon GEMM (its TMA descriptors are kernel
    # parameters, captured by value)
    for m, n in ((512, 768), (4096, 1024)):
        x, w = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16), torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16)
        for scaling in ("tensor", "row"):
            fp8.matmul(x, w, scaling)                          # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = fp8.matmul(x, w, scaling)
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert rel_err(y, fp8.matmul(x, w, scaling).double()) == 0.0


@pytest.mark.gpu
def test_gpu_compile_inductor():
    lin = fp8.Linear(1024, 2048, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda x: F.gelu(lin(x)), fullgraph=True)
    x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = fn(x)
    y.sum().backward()
    assert rel_err(y, F.gelu(lin(x)).double()) <= 1e-2 and torch.isfinite(x.grad).all()


# fast accumulation on the bf16 GEMM's Gluon kernel (_fp8_gemm.fast_gluon_plan): whole tiles with a
# ragged edge and K tail, just past MID_MAX_M, stream-K over 2 waves + 1 tile (637x13560x4000: 265
# 128x256 tiles, 32 K steps), a 128x128 tile (per-column scales with a bias), a one-wave forced call
FAST_GLUON_CASES = [(4100, 4104, 4096, {}), (257, 8200, 1008, {}), (637, 13560, 4000, {}),
                    (637, 13560, 4000, {"GLUON": True, "STREAM_K": False}), (64, 200, 96, {"GLUON": True})]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,config", FAST_GLUON_CASES)
def test_gpu_fast_accumulation_gluon_gemm(m, n, k, config):
    """Every scale form, bias, e4m3 / e5m2 operands, every output dtype: within twice the tl fast
    kernel's error (+1e-4) against the fp64 product of the dequantized operands, and within
    FAST_ACC_TOL; NaN-poisoned outputs through launch_gemm_ws (an unwritten element fails);
    a relaunch bit-identical (stream-K's fixed summation order) and its plan as the case says."""
    from tilefuse.ops import _matmul_gluon_plan as gp
    for dta, dtb, row_a, row_b, has_bias, out_dtype in ((E4M3, E4M3, False, False, False, torch.bfloat16),
                                                        (E4M3, E4M3, True, True, True, torch.bfloat16),
                                                        (E5M2, E4M3, False, True, True, torch.float16),
                                                        (E4M3, E5M2, True, False, False, torch.float32)):
        qa, sa, qb, sb = _operands(m, n, k, dta, dtb, row_a, row_b)
        sa, sb = sa.reshape(-1), sb.reshape(-1)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        ref = fp8_ops.scaled_matmul_reference(qa, sa, qb, sb, bias)
        tl_fast = fk.launch_fp8_gemm(qa, sa, qb, sb, bias, out_dtype, True, {"GLUON": False})
        bound = min(FAST_ACC_TOL, 2 * rel_err(tl_fast, ref) + 1e-4)
        out = fk.launch_fp8_gemm(qa, sa, qb, sb, bias, out_dtype, True, config or None)
        plan = fk.gemm_plan(m, n, k, qa.stride(), qb.stride(), out_dtype, row_a, row_b, has_bias, True, num_sms(qa),
                            True, True, True, True, False, tuple(config.items()))
        assert plan.gluon_plan is not None
        assert rel_err(out, ref) <= bound, (dta, dtb, row_a, row_b, out_dtype, rel_err(out, ref), bound)
        assert torch.equal(fk.launch_fp8_gemm(qa, sa, qb, sb, bias, out_dtype, True, config or None), out)
        tile = dict(plan.gluon_plan.prepared.kwargs)
        poisoned = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        cfg = {"CONSUMERS": tile["CONSUMERS"], "BLOCK_N": plan.gluon_plan.block_n1, "BLOCK_K": 128, "STAGES": 4,
               "GROUP_M": tile["GROUP_M"], "STREAM_K": tile["STREAM_K"]}
        gp.launch_gemm_ws(qa, qb.t(), poisoned, bias, config=cfg, scale_a=sa, scale_b=sb)
        assert torch.equal(poisoned, out), (dta, dtb, row_a, row_b, out_dtype)
    if m == 637 and not config:
        assert tile["STREAM_K"]
    # the kept launch is keyed on the operands' fp8 format: the same bytes read as e5m2
    qa, sa, qb, sb = _operands(m, n, k)
    sa, sb = sa.reshape(-1), sb.reshape(-1)
    for _ in range(3):      # kept from the second sighting on
        fk.launch_fp8_gemm(qa, sa, qb, sb, None, torch.bfloat16, True, config or None)
    q5, s5 = fp8.quantize_fp8(torch.randn(m, k, device="cuda"), E5M2)
    qa.view(torch.uint8).copy_(q5.view(torch.uint8))       # same addresses: only the format differs
    sa.copy_(s5.reshape(1))
    as_e5m2 = fk.launch_fp8_gemm(qa.view(E5M2), sa, qb, sb, None, torch.bfloat16, True, config or None)
    assert rel_err(as_e5m2, fp8_ops.scaled_matmul_reference(q5, s5, qb, sb)) <= FAST_ACC_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (130, 4104, 1008), (1, 64, 32), (700, 72, 4096), (2048, 14336, 512)])
@pytest.mark.parametrize("promote_every", [1, 4])
def test_gpu_warp_specialized_gemm(m, n, k, promote_every):
    """The Gluon kernel (_fp8_gluon.py): row / column tails (TMA zero fill and clipped stores), K
    tails, M = 1, every scale form, bias, both operand formats, every output dtype; NaN-poisoned
    output so an unwritten element fails; within the tl kernel's precise tolerance."""
    from tilefuse.ops._fp8_gluon import launch_fp8_gemm_ws
    for dta, dtb, row_a, row_b, has_bias, out_dtype in ((E4M3, E4M3, False, False, False, torch.bfloat16),
                                                        (E4M3, E4M3, True, True, True, torch.float16),
                                                        (E5M2, E4M3, False, True, True, torch.float32),
                                                        (E4M3, E5M2, True, False, False, torch.bfloat16)):
        qa, sa, qb, sb = _operands(m, n, k, dta, dtb, row_a, row_b)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        launch_fp8_gemm_ws(qa, sa.reshape(-1), qb, sb.reshape(-1), bias, out, dict(PROMOTE_EVERY=promote_every))
        ref = fp8_ops.scaled_matmul_reference(qa, sa, qb, sb, bias)
        assert rel_err(out, ref) <= GEMM_TOL[out_dtype], (dta, dtb, out_dtype, rel_err(out, ref))
