"""tilefuse.matmul's Gluon plans, checked on the CPU: which problems take the Gluon kernel and with
which tile, the views the planned launch passes, and that every plan's descriptors are valid for
its operands (hypothesis over shapes, layouts and strides)."""

from unittest import mock

import pytest
import torch
from conftest import DEVICE
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tilefuse.ops import _matmul_kernels as mk
from tilefuse.testing import rel_err


def test_one_row_a_with_any_row_stride():
    """M = 1 with a's (unused) row stride 1, as dyᵀ of a [K, 1] gradient: the same result as a
    contiguous row (the launcher gives the row an aligned stride so descriptors can read it)."""
    dy, x = torch.randn(64, 1, device=DEVICE), torch.randn(64, 24, device=DEVICE)
    assert dy.t().stride() == (1, 1)
    out, _ = mk.launch_matmul(dy.t(), x)
    assert torch.equal(out, mk.launch_matmul(dy.t().contiguous(), x)[0])
    assert rel_err(out, dy.double().t() @ x.double()) <= 1e-5


def test_gluon_small_m_plan():
    """On sm_90 (hopper_exact) mid-M x @ w.t() and row-major-b GEMMs take the Gluon kernel with the
    tile of least stream cost (as measured best); M <= 32, a transposed a, fp32, unaligned outputs,
    tl configs and GLUON=False keep the tl kernel; GLUON=True takes it at any M, with its tile keys
    overriding."""
    def plan(m, n=4096, k=4096, config=(), b_strides=None, a_strides=None, dtype=torch.bfloat16, exact=True):
        b_strides = b_strides or (1, k)
        a_strides = a_strides or (k, 1)
        return mk._matmul_plan(m, n, k, dtype, dtype, a_strides, b_strides, (n, 1), True, 132, True, exact,
                               (False, "none", False, False), config)
    tile = lambda p: dict(p.ws_tile)    # noqa: E731
    assert (tile(plan(128))["CONSUMERS"], tile(plan(128))["BLOCK_N"]) == (1, 64)            # 128 tiles
    assert (tile(plan(128, 14336))["CONSUMERS"], tile(plan(128, 14336))["BLOCK_N"]) == (2, 128)   # 112
    assert (tile(plan(128, 6144))["CONSUMERS"], tile(plan(128, 6144))["BLOCK_N"]) == (1, 128)     # 96
    assert tile(plan(256, 4096))["BLOCK_N"] == 128 and plan(mk.MID_MAX_M).ws_tile
    assert tile(plan(64))["BLOCK_N"] == 64 and tile(plan(256, 6144))["CONSUMERS"] == 2
    assert not plan(64, n=1024).ws_tile         # 16 tiles of 64x64: the tl kernel's split-K
    assert not plan(16).ws_tile
    assert tile(plan(mk.MID_MAX_M + 1))["BLOCK_N"] == 128      # large M: test_gluon_large_m_plan
    assert not plan(128, exact=False).ws_tile and not plan(128, dtype=torch.float32).ws_tile
    assert tile(plan(128, b_strides=(4096, 1)))["B_K_MAJOR"] is False and tile(plan(128))["B_K_MAJOR"] is True
    assert not plan(128, a_strides=(1, 128)).ws_tile
    assert not plan(128, n=4100).ws_tile         # out rows not 16-byte aligned for the TMA store
    assert not plan(128, config=(("SPLIT_K", 2),)).ws_tile and not plan(128, config=(("GLUON", False),)).ws_tile
    forced = plan(16, config=(("GLUON", True), ("STAGES", 4)))
    assert tile(forced)["STAGES"] == 4 and tile(forced)["BLOCK_N"] == 64


def test_gluon_large_m_plan():
    """On sm_90, 16-bit GEMMs above MID_MAX_M take the Gluon kernel: the 128x256 tile with enough
    waves of it and no fuller waves of 128x128, else 128x128; 128x128 when the epilogue has a
    residual or a saved pre-activation or the output is fp32 (registers / shared memory); a
    transposed a (the weight gradient) read M-major; too few tiles, an unaligned output, non-sm_90
    GPUs and tl configs keep the tl kernel."""
    def plan(m, n=4096, k=4096, epilogue=(False, "none", False, False), a_strides=None, out_dtype=torch.bfloat16,
             out_aligned=True, config=(), exact=True):
        a_strides = a_strides or (k, 1)
        return mk._matmul_plan(m, n, k, torch.bfloat16, out_dtype, a_strides, (1, k), (n, 1), True, 132, True, exact,
                               epilogue, config, out_aligned)
    tile = lambda p: dict(p.ws_tile)    # noqa: E731
    big = tile(plan(8192))
    assert (big["CONSUMERS"], big["BLOCK_N"], big["A_M_MAJOR"]) == (2, 256, False)
    assert tile(plan(8192, epilogue=(True, "gelu", False, False)))["BLOCK_N"] == 256
    for epilogue in [(True, "gelu", True, False), (False, "none", False, True)]:
        assert tile(plan(8192, epilogue=epilogue))["BLOCK_N"] == 128
    assert tile(plan(8192, out_dtype=torch.float32))["BLOCK_N"] == 128
    assert tile(plan(4096, k=8192, a_strides=(1, 4096)))["A_M_MAJOR"] is True
    for m, n, width in [(4096, 4096, 256), (8192, 14336, 256), (2048, 14336, 256), (640, 128256, 256),
                        (1024, 4096, 128), (1024, 14336, 128), (384, 14336, 128), (384, 4096, 128)]:
        assert tile(plan(m, n))["BLOCK_N"] == width, (m, n)     # as measured best (choose_large_ws_tile)
    assert not plan(300, n=1024).ws_tile                        # 3 x 8 = 24 tiles: the tl kernel's split-K
    assert not plan(8192, out_aligned=False).ws_tile and not plan(8192, exact=False).ws_tile
    assert not plan(8192, config=(("BLOCK_N", 128),)).ws_tile and not plan(8192, config=(("GLUON", False),)).ws_tile
    assert not plan(128, a_strides=(1, 128)).ws_tile            # mid M reads a row-major only


def test_gluon_pingpong_plan():
    """A config's PINGPONG reaches the Gluon kernel's constexprs (forced GLUON, large M), without
    stream-K; each group stages its whole tile, so the ring is shallower (5 stages of 128x128 bf16,
    3 with an fp32 output); a ping-pong config the kernel cannot run raises ValueError."""
    from tilefuse.ops import _matmul_gluon_plan as gp
    cfg = dict(gp.ACCUMULATE_TILES["128x128-pingpong"], GLUON=True, STREAM_K=True)
    p = mk._matmul_plan(8192, 14336, 4096, torch.bfloat16, torch.bfloat16, (4096, 1), (1, 4096), (14336, 1), True,
                        132, True, True, (False, "none", False, False), mk.config_key(cfg))
    assert dict(p.ws_tile)["PINGPONG"] is True and p.ws_plan.sk_slots == 0
    assert gp.fit_ring(5, 2, 128, 64, 2, 2, pingpong=True) == 5 and gp.fit_ring(5, 2, 128, 64, 2, 2) == 5
    assert gp.fit_ring(6, 2, 128, 64, 2, 4, pingpong=True) == 3 and gp.fit_ring(6, 2, 128, 64, 2, 4) == 5
    for bad in [dict(cfg, CONSUMERS=1), dict(cfg, BLOCK_N=96)]:
        with pytest.raises(ValueError, match="PINGPONG"):
            gp._ws_plan(8192, 4096, 4096, 2, 2, True, 132, (False, "none", False, False), (4096, 1),
                       tuple(bad.items()))


@pytest.mark.parametrize("a_m_major", [False, True])
@pytest.mark.parametrize("b_k_major", [True, False])
@pytest.mark.parametrize("width", [256, 96])
def test_gluon_planned_launch_passes_the_operands_views(a_m_major, b_k_major, width, monkeypatch):
    """The Gluon GEMM's planned launch (``launch_ws_plan``, the plan made once in
    ``_matmul_plan``) hands the kernel the descriptors of the right views: a [M, K] (or aᵀ's
    row-major [K, M] when M-major), b's [N, K] rows when K-major (``w.t()``) else [K, N], out in
    one or two column parts (a 96-wide tile is 64 + 32), and the tensors after them, checked field
    by field against descriptors of explicitly made views (the kernel itself runs on sm_90 only:
    test_gpu_gluon_large_m / test_gpu_gluon_small_m)."""
    from tilefuse.ops import _gluon_common as gc
    from tilefuse.ops import _matmul_gluon as g
    from tilefuse.ops import _matmul_gluon_plan as gp
    m, n, k = 512, 1024, 320
    a = torch.randn(k, m, dtype=torch.bfloat16).t() if a_m_major else torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(n, k, dtype=torch.bfloat16).t() if b_k_major else torch.randn(k, n, dtype=torch.bfloat16)
    out, bias = torch.empty(m, n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    tile = dict(gp.LARGE_WS_TILES["128x128"], BLOCK_N=width, BLOCK_K=128, B_K_MAJOR=b_k_major, A_M_MAJOR=a_m_major)
    plan = gp._ws_plan(m, n, k, 2, 2, b_k_major, 132, (True, "gelu", False, False), (n, 1), tuple(tile.items()))
    seen = []
    monkeypatch.setattr(g.gemm_ws_kernel, "launch_prepared", lambda grid, tensors, prepared: seen.append(tensors))
    gp.launch_ws_plan(plan, a, b, out, bias)
    (a_d, b_d, b2_d, c_d, c2_d, *rest), = seen
    parts = [64, 32] if width == 96 else [width, width]
    bk = plan.block_k
    expect = [gc.matrix_descriptor(a.t(), (bk, 64)) if a_m_major else gc.matrix_descriptor(a, (64, bk))]
    expect += [gc.matrix_descriptor(b.t(), (p, bk)) if b_k_major else gc.matrix_descriptor(b, (bk, p)) for p in parts]
    expect += [gc.matrix_descriptor(out, (64, p)) for p in parts]
    for got, want in zip((a_d, b_d, b2_d, c_d, c2_d), expect):
        assert (got.base.data_ptr(), got.shape, got.strides, got.block_shape, got.layout) == \
            (want.base.data_ptr(), want.shape, want.strides, want.block_shape, want.layout)
    assert rest[0] is bias and all(t is out for t in rest[1:])


def _strided(rows: int, cols: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] CPU tensor: row-major, the transpose of a row-major [cols, rows], or
    row-major with 8 elements of padding per row (a slice of a wider buffer)."""
    if layout == "t":
        return torch.randn(cols, rows).to(dtype).t()
    if layout == "pad":
        return torch.randn(rows, cols + 8).to(dtype)[:, :cols]
    return torch.randn(rows, cols).to(dtype)


def _mostly_multiples_of_8(top: int):
    """Sizes that are multiples of 8 (TMA-aligned rows of 16-bit data) three times in four."""
    eights = st.integers(1, top // 8).map(lambda v: 8 * v)
    return st.one_of(eights, eights, eights, st.integers(1, top))


@settings(max_examples=200, deadline=None)
@example(m=1024, n=2048, k=64, a_layout="t", b_layout="t", dtype=torch.bfloat16, wide_out=False, epilogue="bias-gelu", sms=2)
@example(m=1024, n=2048, k=72, a_layout="rm", b_layout="pad", dtype=torch.float16, wide_out=True, epilogue="residual",
         sms=2)
@given(m=_mostly_multiples_of_8(1200), n=_mostly_multiples_of_8(1200), k=_mostly_multiples_of_8(96), a_layout=st.sampled_from(["rm", "t", "pad"]),
       b_layout=st.sampled_from(["rm", "t", "pad"]), dtype=st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16,
                                                                             torch.float32]),
       wide_out=st.booleans(), epilogue=st.sampled_from(["none", "bias-gelu", "residual", "preact"]),
       sms=st.sampled_from([2, 8, 132]))
def test_gluon_plans_build_valid_descriptors(m, n, k, a_layout, b_layout, dtype, wide_out, epilogue, sms):
    """Any GEMM the sm_90 plan gives the Gluon kernel can be read and written through TMA
    descriptors, as the planned launch builds them (the descriptor constructor asserts 16-byte
    strides), with the tile's limits kept: 16-bit operands, K > 0, a M-major only at large M,
    128x256 only with a 2-byte output and no residual / pre-activation. Random shapes and strides
    on the CPU, the SM count shrunk so that small shapes reach every tile rule."""
    from tilefuse.ops import _matmul_gluon as g
    a, b = _strided(m, k, a_layout, dtype), _strided(k, n, b_layout, dtype)
    out_dtype = torch.float32 if wide_out else dtype
    out = torch.empty(m, n, dtype=out_dtype)
    has_bias, act = epilogue == "bias-gelu", "gelu" if epilogue in ("bias-gelu", "preact") else "none"
    residual = torch.randn(m, n).to(out_dtype) if epilogue == "residual" else None
    preact = torch.empty(m, n, dtype=out_dtype) if epilogue == "preact" else None
    aligned = a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    plan = mk._matmul_plan(m, n, k, dtype, out_dtype, a.stride(), b.stride(), (n, 1), aligned, sms, True, True,
                           (has_bias, act, residual is not None, preact is not None), (), out.data_ptr() % 16 == 0)
    if plan.ws_plan is None:
        return
    tile = dict(plan.ws_tile)
    assert dtype != torch.float32 and k > 0
    assert not tile["A_M_MAJOR"] or m > mk.MID_MAX_M
    if tile["BLOCK_N"] == 256:
        assert out_dtype != torch.float32 and residual is None and preact is None
    seen = []
    bias = torch.randn(n).to(dtype) if has_bias else None
    with mock.patch.object(g.gemm_ws_kernel, "launch_prepared", lambda grid, tensors, prepared: seen.append(tensors)):
        plan.ws_launch(plan.ws_plan, a, b, out, bias, residual, preact)     # builds every descriptor
    a_desc, b_desc, _, c_desc, _ = seen[0][:5]
    assert list(a_desc.shape) == ([k, m] if tile["A_M_MAJOR"] else [m, k])
    assert list(b_desc.shape) == ([n, k] if tile["B_K_MAJOR"] else [k, n]) and list(c_desc.shape) == [m, n]


def test_descriptors_by_default_only_above_mid_m():
    """On an sm_90 GPU (hopper=True) the plan reads K-contiguous operands (x @ w.t()) through
    descriptors for large M only; small and mid M keep pointer loads (cheaper launch). Other
    layouts (b row-major [K, N], a transposed) keep descriptors; USE_TMA still forces either way."""
    def plan(m, config=(), b_strides=(1, 4096), a_strides=(4096, 1)):
        return mk._matmul_plan(m, 4096, 4096, torch.bfloat16, torch.bfloat16, a_strides, b_strides, (4096, 1),
                               True, 132, True, False, (False, "none", False, False), config)
    assert not plan(1).uses_tma and not plan(mk.MID_MAX_M).uses_tma
    assert plan(16, b_strides=(4096, 1)).uses_tma and plan(16, a_strides=(1, 4096)).uses_tma
    assert plan(mk.MID_MAX_M + 1).uses_tma and plan(8192).uses_tma
    assert plan(128, (("USE_TMA", True),)).uses_tma and not plan(8192, (("USE_TMA", False),)).uses_tma
