"""Weight-only quantization: X_PAIRS (bf16 x read as int32 pairs) on the interpreter, and the GPU
kernels (bf16, the sweep's and the LLM shapes, the int4 mma / wgmma paths, CUDA-graph replays of
the fast path, tinygemm's peer). Outputs start NaN-poisoned (conftest)."""

import pytest
import torch
from conftest import DEVICE
from quant_cases import TOL, _check_launch, _check_linear, _fmt_id, _launch, _plan, _reference, _weight

from tilefuse.ops import _quant_plan as quant_plan
from tilefuse.ops import quant   # registers int4_gemm / int8_gemm (until ops/__init__ imports it)
from tilefuse.ops.quant import quant_linear, quantize_weight
from tilefuse.testing import rel_err


# ------------------------------------------------------------------------------------------------
# X_PAIRS: bf16 x read as int32 pairs (on by default in the int4 GEMV)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,config", [
    (1, {}),                                                   # the default plan: one chunk of 8 groups
    (1, dict(BLOCK_N=8, num_warps=2, BLOCK_K=64)),             # 8 one-group chunks
    (1, dict(SPLITS=3, BLOCK_K=64)),                           # split-K, a ragged last split
    (5, dict(PATH="gemv", BLOCK_K=128)),                       # several rows of x, one program each
], ids=["default", "n8-c1", "split3", "m5"])
def test_x_pairs_is_bitwise_the_bf16_conversion(m, config):
    """X_PAIRS reads bf16 x as int32 pairs (shift / mask to fp32): the very fp32 values the bf16
    conversion gives, so y is bitwise the same with it on (the default) and off, x spanning 40
    decades. (The interpreter runs this kernel's bf16 loads and stores correctly, so this runs on
    CPU too.)"""
    n, k, g = 70, 512, 64
    qw = quantize_weight(_weight(n, k, torch.bfloat16, k ** -0.5), 4, g)
    x = (torch.randn(m, k, device=DEVICE) * torch.logspace(-20, 20, k, device=DEVICE)).bfloat16()
    bias = torch.randn(n, device=DEVICE).bfloat16()
    off = dict(config, X_PAIRS=False)
    assert _plan(x, qw, config).meta["X_PAIRS"] and not _plan(x, qw, off).meta["X_PAIRS"]
    y = _launch(x, qw, bias, config)
    assert torch.equal(y, _launch(x, qw, bias, off))
    assert rel_err(y, _reference(x, qw, bias)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("m,view", [(1, "offset"), (3, "offset"), (3, "odd-stride")])
def test_x_pairs_off_a_4_byte_boundary(m, view):
    """A bf16 x whose rows do not start on 4-byte boundaries (a view one element in, or an odd row
    stride) cannot be read as int32 pairs: the launcher reads it as bf16, the same y bit for bit."""
    n, k, g = 24, 256, 32
    qw = quantize_weight(_weight(n, k, torch.bfloat16, k ** -0.5), 4, g)
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    wide = torch.zeros(m, k + 1, device=DEVICE, dtype=torch.bfloat16)       # rows of 257 elements
    if view == "offset":
        wide[:, 1:] = x
        shifted = wide[:, 1:]
    else:
        wide[:, :k] = x
        shifted = wide[:, :k]
    assert quant_plan._pairs_aligned(x) and not quant_plan._pairs_aligned(shifted)
    config = dict(PATH="gemv")
    assert _plan(shifted, qw, config).meta["X_PAIRS"]                       # the plan is per shape
    assert torch.equal(_launch(shifted, qw, None, config), _launch(x, qw, None, config))
    if m == 1:
        assert torch.equal(quant_linear(shifted, qw), quant_linear(x, qw))


def test_x_pairs_config_rules():
    """X_PAIRS is on in the default int4 GEMV plan for bf16 x (off with X_PAIRS=False); fp32 and
    fp16 x, int8 and the dot kernel have no use for it."""
    qw4 = quantize_weight(_weight(40, 256, torch.float32), 4, 32)
    x1 = torch.randn(1, 256, device=DEVICE)
    assert not _plan(x1, qw4, dict(X_PAIRS=True)).meta["X_PAIRS"]                   # fp32 x
    assert not _plan(x1.half(), quantize_weight(_weight(40, 256, torch.float16), 4, 32)).meta["X_PAIRS"]
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        default = quant_plan.launch_plan(4, 128, 1, n, k, torch.bfloat16, 132)
        assert default.kernel is quant_plan.quant_gemv_kernel and default.meta["X_PAIRS"]
        assert not quant_plan.launch_plan(4, 128, 1, n, k, torch.bfloat16, 132, (("X_PAIRS", False),)).meta["X_PAIRS"]
    assert not quant_plan.launch_plan(8, 0, 1, 4096, 4096, torch.bfloat16, 132).meta["X_PAIRS"]       # int8
    assert "X_PAIRS" not in quant_plan.launch_plan(4, 128, 16, 4096, 4096, torch.bfloat16, 132).meta  # dot kernel


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("nk", [(4096, 4096), (14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("fmt", [(4, 128), (8, None)], ids=_fmt_id)
def test_gpu_sweep_shapes_bf16(m, nk, fmt):
    """The sweep's shapes with the default launch (bf16, bias)."""
    _check_launch(m, *nk, fmt, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(PATH="gemv"), dict(PATH="dot", BLOCK_N=16), dict(PATH="dot", BLOCK_N=128),
                                    dict(SPLITS=4), dict(BLOCK_K=128, NUM_STAGES=4), dict(num_warps=8)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("fmt", [(4, 128), (4, 32), (8, None)], ids=_fmt_id)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_gpu_configs_bf16(config, fmt, m):
    if config.get("PATH") == "gemv" and m > quant_plan.GEMV_MAX_ROWS:
        pytest.skip("the GEMV kernel takes up to GEMV_MAX_ROWS rows")
    _check_launch(m, 4097, 4096, fmt, torch.bfloat16, config)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_fast_path_in_a_cuda_graph(m, checked_calls):
    """The fast path's launches (split-K partials from the workspace) captured in a CUDA graph, two
    layers back to back, replayed on new x: each replay matches the reference; the capture itself
    took the fast path (warmed up first, so no check ran inside it)."""
    n, k = 14336, 4096
    layers = [quantize_weight(_weight(n, k, torch.bfloat16, k ** -0.5), 4, 128) for _ in range(2)]
    down = quantize_weight(_weight(k, n, torch.bfloat16, n ** -0.5), 4, 128)
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):                                  # warm: the first call of each layout is checked
            ys = [quant_linear(x, qw) for qw in layers]
            quant_linear(ys[0], down)
        warm = len(checked_calls)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ys = [quant_linear(x, qw) for qw in layers]
            z = quant_linear(ys[0], down)
        assert len(checked_calls) == warm == 2
    for _ in range(2):
        x.copy_(torch.randn(m, k, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        for y, qw in zip(ys, layers):
            assert rel_err(y, _reference(x, qw)) <= TOL[torch.bfloat16]
        assert rel_err(z, _reference(ys[0], down)) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (5, 14336, 4096), (16, 4096, 14336), (300, 4097, 4096)])
@pytest.mark.parametrize("fmt", [(8, None), (4, 128), (4, 32)], ids=_fmt_id)
def test_gpu_shapes_bf16(shape, fmt):
    m, n, k = shape
    qw = quantize_weight(_weight(n, k, torch.bfloat16, k ** -0.5), *fmt)
    bias = torch.randn(n, device=DEVICE).bfloat16()
    _check_linear(torch.randn(m, k, device=DEVICE).bfloat16(), qw, bias, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(PATH="gemv"), dict(PATH="gemv", X_PAIRS=False),
                                    dict(PATH="gemv", BLOCK_N=8, num_warps=2),
                                    dict(PATH="gemv", BLOCK_N=8, num_warps=2, X_PAIRS=False),
                                    dict(PATH="gemv", BLOCK_N=32, NUM_STAGES=4)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("nk", [(4096, 4096), (14336, 4096), (4096, 14336), (4097, 1024)])
@pytest.mark.parametrize("g", [32, 128])
def test_gpu_gemv_x_pairs_bf16(config, nk, g):
    """The sweep's GEMV configs at its shapes (and a ragged N), bf16, bias: X_PAIRS on (the
    GEMV's default) and off."""
    _check_launch(1, *nk, (4, g), torch.bfloat16, config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("m,config", [(5, dict(PATH="dot")), (16, dict(PATH="dot", BLOCK_K=128)), (33, {}),
                                      (33, dict(SWAP_AB=True, BLOCK_N=64)), (300, {})],
                         ids=lambda v: str(v).replace(" ", ""))
def test_gpu_packed_dequant_is_the_fp32_path_bit_for_bit(dtype, g, m, config):
    """The 16-bit-pair PTX dequantization gives the very weight the fp32 path rounds to x's dtype:
    y is bitwise equal (same tiles, same MMA order), with scales spanning many binades (tiny ones
    into fp16's subnormals) and zero points from 0 to 15."""
    n, k = 200, 8 * g
    w = torch.randn(n, k, device=DEVICE)
    w[::3], w[1::3] = w[::3].abs(), -w[1::3].abs()     # one-signed rows: zero points 0 and 15
    qw = quantize_weight((w * torch.logspace(-6, 2, n, device=DEVICE)[:, None]).to(dtype), 4, g)
    assert set(qw.zeros.unique().tolist()) >= {0, 15}
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    packed = _launch(x, qw, None, config)
    meta = _plan(x, qw, config).meta
    assert meta["PACKED_DEQUANT"] == (meta["SWAP_AB"] or g >= 64)    # Triton 3.6 cannot compile xw at g32
    fp32 = _launch(x, qw, None, dict(config, PACKED=False))
    assert not _plan(x, qw, dict(config, PACKED=False)).meta["PACKED_DEQUANT"]
    assert torch.equal(packed, fp32)
    assert rel_err(packed, _reference(x, qw)) <= TOL[dtype]


def _one_signed_rows_weight(n, k, dtype, g):
    """Rows alternately >= 0 and <= 0 (zero points 0 and 15) with scales spanning many binades
    (tiny ones into fp16's subnormals)."""
    w = torch.randn(n, k, device=DEVICE)
    w[::3], w[1::3] = w[::3].abs(), -w[1::3].abs()
    qw = quantize_weight((w * torch.logspace(-6, 2, n, device=DEVICE)[:, None]).to(dtype), 4, g)
    assert set(qw.zeros.unique().tolist()) >= {0, 15}
    return qw


MMA_CONFIGS = [{}, dict(SPLITS=3), dict(WARPS_K=2, WARPS_N=2), dict(REPS=1), dict(GROUPS_PER_STEP=2),
               dict(WARPS_K=1, WARPS_N=4, REPS=1), dict(WARPS_K=8, REPS=1, SPLITS=1),
               dict(PRELOAD=True), dict(PRELOAD=True, GROUPS_PER_STEP=2, SPLITS=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("config", MMA_CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
def test_gpu_int4_mma(dtype, g, m, config):
    """The Gluon int4 kernel (``PATH="mma"``: int4 with up to 32 rows of fp16 / bf16 x) against
    the fp64 product with the dequantized weight: N off every tile (201), 13 groups (ragged
    splits and steps: a last step with clamped groups), bias on odd M; every row and column
    checked (y is NaN-poisoned)."""
    n, k = 201, 13 * g
    qw = _one_signed_rows_weight(n, k, dtype, g)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if m % 2 else None
    config = dict(config, PATH="mma")
    plan = _plan_on_gpu(x, qw, config)
    assert plan.meta["MMA_N"] == max(8, 1 << (m - 1).bit_length()) and plan.kernel is not quant_plan.quant_dot_kernel
    y = _launch(x, qw, bias, config)
    assert y.dtype == dtype and y.shape == (m, n) and not y.isnan().any()
    assert rel_err(y, _reference(x, qw, bias)) <= TOL[dtype], rel_err(y, _reference(x, qw, bias))
    assert torch.equal(y, _launch(x, qw, bias, config))                # no atomics: reproducible


def _plan_on_gpu(x, qw, config=None):
    m, k = x.shape
    return quant_plan.launch_plan(4, qw.group_size, m, qw.shape[0], k, x.dtype, quant_plan.num_sms(x),
                             tuple(sorted((config or {}).items())), True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("nk", [(4096, 4096), (14336, 4096), (4096, 14336), (4097, 1024)])
@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("preload", [False, True])
def test_gpu_int4_mma_llm_shapes(m, nk, g, preload):
    """The sweep's shapes (and a ragged N) with the Gluon int4 kernel's default config, weight words
    one step ahead in registers or all through cp.async (PRELOAD), bf16, bias."""
    _check_launch(m, *nk, (4, g), torch.bfloat16, dict(PATH="mma", PRELOAD=preload))


WGMMA_CONFIGS = [{}, dict(SPLITS=3), dict(REPS=1), dict(num_warps=8, REPS=1), dict(STAGES=2),
                 dict(CHUNK=8, STAGES=8, SPLITS=1), dict(CHUNK=8, STAGES=4, num_warps=8, REPS=1),
                 dict(SPLITS=3, REPS=1)]


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the wgmma kernel needs sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("config", WGMMA_CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
def test_gpu_int4_wgmma(dtype, m, config):
    """The Hopper int4 kernel (``PATH="wgmma"``: group 128, up to 64 rows of fp16 / bf16 x) against
    the fp64 product with the dequantized weight: N off every tile (201 rows: a half-empty second
    row block), 13 groups (ragged splits and a last CHUNK with clamped groups), weights of both
    signs and scales over 8 decades, bias on odd M; y NaN-poisoned by the launcher's empty, every
    element checked; bitwise reproducible. The weight it multiplies is ``dequantize_weight``'s in
    x's dtype, so y must match the ``tl`` dot kernel's closely."""
    n, k = 201, 13 * 128
    qw = _one_signed_rows_weight(n, k, dtype, 128)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if m % 2 else None
    config = dict(config, PATH="wgmma")
    plan = _plan(x, qw, config)
    assert plan.meta["MMA_N"] == max(8, 1 << (m - 1).bit_length()) and "ACC_LAYOUT" in plan.meta
    y = _launch(x, qw, bias, config)
    assert y.dtype == dtype and y.shape == (m, n) and not y.isnan().any()
    assert rel_err(y, _reference(x, qw, bias)) <= TOL[dtype], rel_err(y, _reference(x, qw, bias))
    assert torch.equal(y, _launch(x, qw, bias, config))                # no atomics: reproducible
    y_dot = _launch(x, qw, bias, dict(PATH="dot", SPLITS=1))
    assert rel_err(y, y_dot) <= TOL[dtype] / 2, rel_err(y, y_dot)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the wgmma kernel needs sm_90")
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("nk", [(4096, 4096), (14336, 4096), (4096, 14336), (4097, 1024)])
def test_gpu_int4_wgmma_llm_shapes(m, nk):
    """The sweep's shapes (and a ragged N) with the Hopper kernel's default config, bf16, bias."""
    _check_launch(m, *nk, (4, 128), torch.bfloat16, dict(PATH="wgmma"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("nk", [(4096, 11008), (5120, 13824), (1000, 11008 + 64)])
@pytest.mark.parametrize("g", [32, 64, 128])
def test_gpu_gemv_ragged_k(dtype, nk, g):
    """The default M = 1 GEMV on K whose groups its 1024-column chunks do not divide (Llama-2's
    11008, 13824; 11072 = 173 groups of 64 or 346 of 32), bf16 x read as int32 pairs or fp16, bias."""
    n, k = nk
    if k % g:
        pytest.skip("K is not a multiple of the group")
    plan = _check_launch(1, n, k, (4, g), dtype)
    assert plan.kernel is quant_plan.quant_gemv_kernel and plan.meta["BLOCK_K"] == 1024
    assert plan.meta["RAGGED_K"] == (k % 1024 != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5])
def test_gpu_int4_mma_falls_back_off_4_byte_rows(m):
    """x rows off a 4-byte boundary (a view from column 1) cannot be read as int32 pairs: the
    launcher takes the default tl kernel instead, with the same result up to rounding."""
    qw = quantize_weight(_weight(96, 256, torch.bfloat16, 256 ** -0.5), 4, 64)
    x = torch.randn(m, 257, device=DEVICE).bfloat16()[:, 1:]
    assert x.data_ptr() % 4 and "MMA_N" in _plan_on_gpu(x, qw, dict(PATH="mma")).meta
    y = _launch(x, qw, None, dict(PATH="mma"))
    assert rel_err(y, _reference(x, qw)) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_tinygemm_peer_matches():
    peer = quant._tinygemm_peer()
    qw = quantize_weight(_weight(4096, 4096, torch.bfloat16, 4096 ** -0.5), 4, 128)
    x = torch.randn(1, 4096, device=DEVICE).bfloat16()
    assert rel_err(peer(x, qw), quant_linear(x, qw)) <= 1e-2
