"""layer_norm / rms_norm beyond the registry sweep: options, tiers, layouts, empties, bad input,
torch.compile, and the nn modules against torch's."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA, count_calls, record_returns

import tilefuse.ops.norms as nm
import tilefuse.ops._norm_launch as norm_launch
from tilefuse.nn.norms import LayerNorm, RMSNorm
from tilefuse import registry
from tilefuse.testing import check_impl, rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _t(shape, dtype=torch.float32, scale=1.0, shift=0.0):
    """A fresh random leaf (never zeros)."""
    return (torch.randn(shape, device=DEVICE) * scale + shift).to(dtype).requires_grad_(True)


def _check(fn, ref, tensors: dict, tol: float, **kw):
    """fn(**tensors, **kw) vs ref on float64 copies: every output and the grad of every tensor."""
    ref_tensors = {k: None if v is None else v.detach().double().requires_grad_(True) for k, v in tensors.items()}
    outs = fn(**tensors, **kw)
    refs = ref(**ref_tensors, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.dtype == tensors["x"].dtype and o.shape == r.shape, i
        assert torch.isfinite(o).all(), f"output {i} not finite"
        assert rel_err(o, r) <= tol, f"output {i}: {rel_err(o, r):.3g}"
    gouts = [torch.randn_like(o) for o in outs]
    leaves = {k: v for k, v in tensors.items() if v is not None}
    grads = torch.autograd.grad(outs, list(leaves.values()), gouts)
    ref_grads = torch.autograd.grad(refs, [ref_tensors[k] for k in leaves], [g.double() for g in gouts])
    for name, g, rg in zip(leaves, grads, ref_grads):
        assert g.dtype == leaves[name].dtype and g.shape == rg.shape, name
        assert torch.isfinite(g).all(), f"grad of {name} not finite"
        assert rel_err(g, rg) <= tol, f"grad of {name}: {rel_err(g, rg):.3g}"
    return outs, grads


def _ln(x, weight=None, bias=None, residual=None, **kw):
    return nm.layer_norm(x, None, weight, bias, residual=residual, **kw)


def _ln_ref(x, weight=None, bias=None, residual=None, **kw):
    return nm.layer_norm_reference(x, None, weight, bias, residual=residual, **kw)


def _rms(x, weight=None, residual=None, **kw):
    return nm.rms_norm(x, None, weight, residual=residual, **kw)


def _rms_ref(x, weight=None, residual=None, **kw):
    return nm.rms_norm_reference(x, None, weight, residual=residual, **kw)


# ----------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_w,has_b", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("shape", [(5, 300), (3, 2, 64)])
def test_layer_norm_affine_options(dtype, has_w, has_b, shape):
    n = shape[-1]
    t = dict(x=_t(shape, dtype, 2, 0.5), weight=_t(n, dtype, 0.1, 1) if has_w else None,
             bias=_t(n, dtype, 0.1) if has_b else None)
    _check(_ln, _ln_ref, t, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_w,offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
def test_rms_norm_weight_and_gemma_offset(dtype, has_w, offset):
    n = 513
    w = _t(n, dtype, 0.1, 1 - offset) if has_w else None      # Gemma stores weight - 1
    _check(_rms, _rms_ref, dict(x=_t((6, n), dtype, 2), weight=w), TOL[dtype], offset=offset)


def test_gemma_offset_matches_hf_formula():
    x, w = torch.randn(4, 96, device=DEVICE), torch.randn(96, device=DEVICE) * 0.1
    hf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)
    assert rel_err(nm.rms_norm(x, 96, w, 1e-6, offset=1.0), hf) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("n", [200, norm_launch.MAX_FUSED_N_FWD + 5])     # fused and looped tiers
def test_residual_fused(dtype, is_rms, n):
    t = dict(x=_t((3, n), dtype, 2, 0.5), weight=_t(n, dtype, 0.1, 1), residual=_t((3, n), dtype))
    fn, ref = (_rms, _rms_ref) if is_rms else (_ln, _ln_ref)
    if not is_rms:
        t["bias"] = _t(n, dtype, 0.1)
    (y, h), grads = _check(fn, ref, t, TOL[dtype])
    assert torch.equal(h, t["x"] + t["residual"])                 # h is exactly x + residual, rounded
    names = [k for k, v in t.items() if v is not None]
    assert torch.equal(grads[names.index("x")], grads[names.index("residual")])


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("which", ["y", "h"])
def test_residual_grad_through_one_output(is_rms, which):
    """Only y or only h feeds the loss: the other output's grad is absent, not garbage."""
    x, r, w = _t((4, 100)), _t((4, 100)), _t(100, scale=0.1, shift=1)
    y, h = (nm.rms_norm if is_rms else nm.layer_norm)(x, None, w, residual=r)
    xr, rr, wr = (v.detach().double().requires_grad_(True) for v in (x, r, w))
    yr, hr = (nm.rms_norm_reference if is_rms else nm.layer_norm_reference)(xr, None, wr, residual=rr)
    g = torch.randn_like(y)
    out, ref = (y, yr) if which == "y" else (h, hr)
    gx, gr = torch.autograd.grad(out, (x, r), g)
    gxr, = torch.autograd.grad(ref, xr, g.double())
    assert rel_err(gx, gxr) <= 1e-5 and torch.equal(gx, gr)


@pytest.mark.parametrize("is_rms", [False, True])
def test_fp32_weight_with_fp16_x(is_rms):
    n = 257
    t = dict(x=_t((5, n), torch.float16, 2), weight=_t(n, torch.float32, 0.1, 1), residual=_t((5, n), torch.float16))
    if not is_rms:
        t["bias"] = _t(n, torch.float32, 0.1)
    _check(_rms if is_rms else _ln, _rms_ref if is_rms else _ln_ref, t, TOL[torch.float16])


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("shape", [(4096, 4096), (64, 65537)])
def test_bf16_with_fp32_weight_gpu(is_rms, shape):
    n = shape[-1]
    t = dict(x=_t(shape, torch.bfloat16, 2), weight=_t(n, torch.float32, 0.1, 1), residual=_t(shape, torch.bfloat16))
    _check(_rms if is_rms else _ln, _rms_ref if is_rms else _ln_ref, t, TOL[torch.bfloat16])


# ----------------------------------------------------------------------------------------------
# layouts and sizes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_rms", [False, True])
def test_non_contiguous_inputs(is_rms):
    base = _t((40, 6))
    x = base.t()                                        # [6, 40], column stride 6
    r = _t((6, 80))[:, ::2]                             # [6, 40], strided rows and columns
    w = _t(80, scale=0.1, shift=1)[::2]                 # a strided weight
    t = dict(x=x, weight=w, residual=r)
    fn, ref = (_rms, _rms_ref) if is_rms else (_ln, _ln_ref)
    ref_t = {k: v.detach().double().requires_grad_(True) for k, v in t.items()}
    (y, h), (ry, rh) = fn(**t), ref(**ref_t)
    assert rel_err(y, ry) <= 1e-5 and rel_err(h, rh) <= 1e-5
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (base, w), g)
    ref_grads = torch.autograd.grad(ry, (ref_t["x"], ref_t["weight"]), g.double())
    assert rel_err(grads[0].t(), ref_grads[0]) <= 1e-5 and rel_err(grads[1], ref_grads[1]) <= 1e-5


@pytest.mark.parametrize("is_rms", [False, True])
def test_multi_dim_normalized_shape(is_rms):
    x, w = _t((3, 4, 5, 7)), _t((5, 7), scale=0.1, shift=1)
    y = (nm.rms_norm if is_rms else nm.layer_norm)(x, (5, 7), w)
    ref = F.rms_norm(x.double(), (5, 7), w.double()) if is_rms else F.layer_norm(x.double(), (5, 7), w.double())
    assert y.shape == x.shape and rel_err(y, ref) <= 1e-5
    gx, gw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert gx.shape == x.shape and gw.shape == w.shape


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (3, 0)])
def test_empty(is_rms, shape):
    n = shape[-1]
    x, w, r = _t(shape), _t(n), _t(shape)
    y, h = (nm.rms_norm if is_rms else nm.layer_norm)(x, None, w, residual=r)
    assert y.shape == x.shape and h.shape == x.shape
    gx, gw, gr = torch.autograd.grad((y * 2).sum() + h.sum(), (x, w, r))
    assert gx.shape == x.shape and gr.shape == x.shape and torch.equal(gw, torch.zeros_like(w))


def test_rows_of_length_one():
    """LayerNorm of one element is the bias with zero grads; RMSNorm is sign(x)·w (its dx, eps·rstd³·wdy,
    is tiny and cancellation-bound in fp32, so it gets an absolute bound)."""
    x, w, b = _t((9, 1), shift=0.5), _t(1, shift=1), _t(1)
    y = nm.layer_norm(x, None, w, b)
    assert torch.equal(y, b.expand_as(y))
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    assert torch.equal(gx, torch.zeros_like(x)) and torch.equal(gw, torch.zeros_like(w)) and gb.item() == 9
    # with a random dy the exact dx is still 0, but on the GPU dx = (dy·w - mean(dy·w))·rstd contracts
    # to fma(dy, w, -round(dy·w))·rstd: the rounding of one product, scaled by rstd = 1/sqrt(eps)
    y = nm.layer_norm(x, None, w, b)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, (x,), g)
    rstd = 1.0 / math.sqrt(1e-5)
    assert (gx.abs() <= 2 * torch.finfo(torch.float32).eps * rstd * (g * w).abs()).all()
    y = nm.rms_norm(x, None, w)
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    yr = nm.rms_norm_reference(xr, None, wr)
    assert rel_err(y, yr) <= 1e-5
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    gxr, gwr = torch.autograd.grad(yr, (xr, wr), g.double())
    # gw = Σ g·x̂ over the 9 rows (x̂ = x·rstd ≈ ±1) may cancel: bound it by the sum of the terms'
    # sizes (a relative 1e-5 failed 13 of 3,000 draws, worst 12x, at a sum cancelled to ~1e-3; s45)
    x_hat = xr.detach() / torch.sqrt(xr.detach() ** 2 + 1e-5)
    assert (gw.double() - gwr).abs().item() <= 1e-5 * (g.double() * x_hat).abs().sum().item()
    assert (gx.double() - gxr).abs().max() <= 1e-6 * (g.abs() / x.detach().abs()).max()


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("shape", [(300, 24), (37, 130)])
def test_persistent_backward_many_row_blocks(is_rms, shape):
    """Each backward program walks many row blocks; dw/db partials are summed once."""
    n = shape[-1]
    t = dict(x=_t(shape, shift=0.3), weight=_t(n, scale=0.1, shift=1))
    if not is_rms:
        t["bias"] = _t(n, scale=0.1)
    _check(_rms if is_rms else _ln, _rms_ref if is_rms else _ln_ref, t, 1e-5)


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_looped_tier_with_small_tiles(is_rms, dtype, monkeypatch):
    """The looped tier on column tiles with a ragged last tile, forced at a small N."""
    monkeypatch.setattr(norm_launch, "MAX_FUSED_N_FWD", 64)
    monkeypatch.setattr(norm_launch, "MAX_FUSED_N_BWD", 64)
    monkeypatch.setattr(norm_launch, "LOOPED_BLOCK_N", 64)
    n = 1000
    t = dict(x=_t((7, n), dtype, 2, 3), weight=_t(n, dtype, 0.1, 1), residual=_t((7, n), dtype))
    if not is_rms:
        t["bias"] = _t(n, dtype, 0.1)
    _check(_rms if is_rms else _ln, _rms_ref if is_rms else _ln_ref, t, TOL[dtype])


def test_looped_layer_norm_large_mean_is_accurate():
    """A row mean of 1e3 over 3·16K elements: the per-tile (Chan) variance merge keeps the error at
    the fp32 rounding of the mean itself (~6e-5 of a unit std); E[x²] - E[x]² would lose percents."""
    x = _t((2, 3 * norm_launch.MAX_FUSED_N_FWD + 7), shift=1e3)
    _check(_ln, _ln_ref, dict(x=x, weight=_t(x.shape[-1], scale=0.1, shift=1)), 2e-4)


@pytest.mark.parametrize("cfg", [
    {"BLOCK_M": 1, "num_warps": 4, "programs_per_sm": 1},
    {"BLOCK_M": 4, "num_warps": 8, "programs_per_sm": 3, "prefetch": False},
    {"BLOCK_M": 2, "num_warps": 4, "programs_per_sm": 2, "prefetch": True},
    {"max_fused_n": 128, "BLOCK_N": 128},
    {"BLOCK_M": 2, "num_warps": 4, "programs_per_sm": 1, "prefetch": False, "STAGES": 2},   # bwd: pipelined rows
    {"BLOCK_M": 1, "num_warps": 4, "programs_per_sm": 3, "prefetch": False, "STAGES": 3},   # uneven per program
    {"max_fused_n": 128, "BLOCK_N": 128, "programs_per_sm": 1, "STAGES": 2},   # pipelined column tiles
])
def test_launcher_config_overrides(cfg):
    if DEVICE == "cpu" and not nm.use_triton(torch.empty(0)):
        pytest.skip("launchers need CUDA or the interpreter")
    x, w, b, r = (torch.randn(*s, device=DEVICE) for s in ((9, 300), (300,), (300,), (9, 300)))
    y, h, mean, rstd = nm._launch_fwd(x, w, b, r, 1e-5, 0.0, False, config=cfg)
    ry, rh, rmean, rrstd = nm._fwd_reference(x, w, b, r, 1e-5, 0.0, False)
    assert all(rel_err(a, c) <= 1e-5 for a, c in ((y, ry), (h, rh), (mean, rmean), (rstd, rrstd)))
    dy, dh = torch.randn_like(x), torch.randn_like(x)
    got = nm._launch_bwd(dy, h, w, mean, rstd, dh, 0.0, False, True, True, config=cfg)
    want = nm._bwd_reference(dy, h, w, mean, rstd, dh, 0.0, False, True, True)
    assert all(rel_err(a, c) <= 1e-5 for a, c in zip(got, want))


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("shape", [(2, 300), pytest.param((3000, 4096), marks=pytest.mark.gpu),
                                   pytest.param((777, 1000), marks=pytest.mark.gpu)])
def test_backward_final_sum_in_kernel(is_rms, shape):
    """dw / db summed inside the backward kernel behind a grid barrier (one launch; on the GPU by
    default for the fused tier, under the interpreter with one program) agree with the two-launch
    path and the fp64 reference; the barrier's counters are left at zero, so calls in a row and on
    another stream start clean."""
    if DEVICE == "cpu" and not nm.use_triton(torch.empty(0)):
        pytest.skip("launchers need CUDA or the interpreter")
    from tilefuse._dispatch import _GRID_SYNC

    n = shape[-1]
    x, w, b = torch.randn(*shape, device=DEVICE), torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    _, _, mean, rstd = nm._launch_fwd(x, w, None if is_rms else b, None, 1e-5, 0.0, is_rms)
    mean = None if is_rms else mean
    args = (x, w, mean, rstd, None, 0.0, is_rms, True, not is_rms)
    dy = torch.randn_like(x)
    want = nm._bwd_reference(*(t.double() if isinstance(t, torch.Tensor) else t for t in (dy,) + args))
    two_launches = nm._launch_bwd(dy, *args, config={"final_sum": False})
    streams = [None, None, torch.cuda.Stream() if DEVICE == "cuda" else None]
    for stream in streams:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            got = nm._launch_bwd(dy, *args, config={"final_sum": True})
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        for g, t, r in zip(got, two_launches, want):
            assert rel_err(g, r) <= 1e-5 and rel_err(g, t) <= 1e-5
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        assert not norm_launch._COOPERATIVE_REFUSED, "the cooperative launch was refused"
    assert _GRID_SYNC and all(int(c.abs().sum()) == 0 for c in _GRID_SYNC.values())


@pytest.mark.parametrize("shape", [(2, 300), pytest.param((3000, 4096), marks=pytest.mark.gpu)])
def test_backward_two_launches_beside_collectives(shape, monkeypatch):
    """With torch.distributed initialized (a collective may hold SMs on another stream, which a
    cooperative grid over every SM would wait for) the norm backward takes its two launches and
    never binds the one-launch path; the answers are the same."""
    if DEVICE == "cpu" and not nm.use_triton(torch.empty(0)):
        pytest.skip("launchers need CUDA or the interpreter")
    import tilefuse._dispatch as dispatch

    monkeypatch.setattr(dispatch, "POISON_OUTPUTS", False)     # let the bound path be tried
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    tried = record_returns(monkeypatch, norm_launch, "cooperative_launch")
    bound = count_calls(monkeypatch, norm_launch, "_bound_bwd")
    n = shape[-1]
    x, w = torch.randn(*shape, device=DEVICE), torch.randn(n, device=DEVICE)
    _, _, _, rstd = nm._launch_fwd(x, w, None, None, 1e-5, 0.0, True)
    args = (x, w, None, rstd, None, 0.0, True, True, False)
    for _ in range(3):
        dy = torch.randn_like(x)
        want = nm._bwd_reference(*(t.double() if isinstance(t, torch.Tensor) else t for t in (dy,) + args))
        got = nm._launch_bwd(dy, *args, config=None if DEVICE == "cuda" else {"final_sum": True})
        assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got[:2], want[:2]))
    assert not bound and len(tried) == 3 and all(t is None for t in tried)


@pytest.mark.gpu
def test_backward_final_sum_refused_grid_takes_two_launches():
    """A grid the GPU cannot hold at once (8 programs of 16 warps per SM) is refused by the
    cooperative launch before anything runs; that plan then takes the two launches, correct, and
    the other plans keep the in-kernel sum."""
    x, w = torch.randn(3000, 4096, device=DEVICE), torch.randn(4096, device=DEVICE)
    _, _, mean, rstd = nm._launch_fwd(x, w, None, None, 1e-5, 0.0, False)
    dy = torch.randn_like(x)
    args = (x, w, mean, rstd, None, 0.0, False, True, True)
    want = nm._bwd_reference(*(t.double() if isinstance(t, torch.Tensor) else t for t in (dy,) + args))
    refused = set(norm_launch._COOPERATIVE_REFUSED)
    for _ in range(2):      # the refusal, then the remembered two-launch path
        got = nm._launch_bwd(dy, *args, config={"programs_per_sm": 8, "final_sum": True, "num_warps": 16})
        assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got, want))
    assert len(norm_launch._COOPERATIVE_REFUSED) == len(refused) + 1
    nm._launch_bwd(dy, *args)
    torch.cuda.synchronize()
    assert len(norm_launch._COOPERATIVE_REFUSED) == len(refused) + 1


@pytest.mark.parametrize("is_rms", [False, True])
def test_cpu_reference_path_options(is_rms, monkeypatch):
    """Without the interpreter, CPU tensors take the fp32 reference path: same answers, same dtypes."""
    monkeypatch.setattr(nm, "use_triton", lambda t: False)
    n = 100
    t = dict(x=_t((4, n), torch.float16, 2), weight=_t(n, torch.float32, 0.1, 1), residual=_t((4, n), torch.float16))
    _check(_rms if is_rms else _ln, _rms_ref if is_rms else _ln_ref, t, TOL[torch.float16])
    _check(_rms if is_rms else _ln, _rms_ref if is_rms else _ln_ref, dict(x=_t((3, 5, n))), 1e-5)


@pytest.mark.parametrize("triton_path", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("shape", [(10,), (3, 4)], ids=["1d", "whole-2d"])
@pytest.mark.parametrize("module", ["RMSNorm", "LayerNorm"])
def test_norm_over_every_dim_of_x(module, shape, triton_path, monkeypatch):
    """normalized_shape covering every dim of x (unbatched 1-D input, as torch.nn allows): the
    reference path's weight / bias gradients summed over an empty tuple of row dims, i.e. over
    everything, and raised on the reshape (s42 audit); every gradient against torch.nn's."""
    if not triton_path:
        monkeypatch.setattr(nm, "use_triton", lambda t: False)
    ours, theirs = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}[module](list(shape)), getattr(torch.nn, module)(list(shape))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    x, g = torch.randn(shape), torch.randn(shape)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours.to(DEVICE)(xa.to(DEVICE)).backward(g.to(DEVICE))
    theirs(xb).backward(g)
    assert rel_err(xa.grad.cpu(), xb.grad) <= 1e-5
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert rel_err(p.grad.cpu(), q.grad) <= 1e-5, name


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def _bad_cases():
    x, w = torch.randn(4, 8), torch.randn(8)
    return [
        ("x", lambda: nm.layer_norm([1.0, 2.0])),
        ("x", lambda: nm.rms_norm(x.double())),
        ("x", lambda: nm.layer_norm(x.long())),
        ("x", lambda: nm.layer_norm(torch.tensor(1.0))),
        ("weight", lambda: nm.layer_norm(x, None, torch.randn(7))),
        ("weight", lambda: nm.rms_norm(x, None, w.int())),
        ("weight", lambda: nm.rms_norm(x, None, "w")),
        ("bias", lambda: nm.layer_norm(x, None, w, torch.randn(4, 8))),
        ("residual", lambda: nm.rms_norm(x, None, w, residual=torch.randn(4, 9))),
        ("residual", lambda: nm.rms_norm(x, None, w, residual=torch.randn(4, 8).half())),
        ("residual", lambda: nm.layer_norm(x, residual=3.0)),
        ("normalized_shape", lambda: nm.rms_norm(x, w)),
        ("normalized_shape", lambda: nm.layer_norm(x, (9,))),
        ("normalized_shape", lambda: nm.layer_norm(x, (4, 8, 1))),
        ("eps", lambda: nm.layer_norm(x, eps="1e-5")),
        ("eps", lambda: nm.rms_norm(x, eps=-1.0)),
        ("offset", lambda: nm.rms_norm(x, offset=1.0)),
        ("offset", lambda: nm.rms_norm(x, None, w, offset=None)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_names_the_argument(case):
    name, call = _bad_cases()[case]
    with pytest.raises((TypeError, ValueError), match=name):
        call()


@pytest.fixture
def checked_norms(monkeypatch):
    """Counts the calls that take the checked path; empties the fast path's cache first and last."""
    nm._FAST.clear()
    yield count_calls(monkeypatch, nm, "_checked_norm")
    nm._FAST.clear()


@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape,normalized", [((3, 97), None), ((2, 3, 40), (3, 40))], ids=["row", "two-dims"])
def test_fast_path_repeats_the_checked_launch(is_rms, residual, shape, normalized, checked_norms):
    """A repeated no-grad call skips the checks: the same y (and h) bitwise, then the reference's
    answer on new values; a call that needs a gradient always takes the checked path."""
    norm = nm.rms_norm if is_rms else nm.layer_norm
    x, r = _t(shape), _t(shape) if residual else None
    w = _t(normalized or shape[-1:], shift=1.0)
    kw = dict(residual=r) if residual else {}
    with torch.no_grad():
        first = norm(x, normalized, w, **kw)
        again = norm(x, normalized, w, **kw)
        assert len(checked_norms) == 1 and len(nm._FAST) == 1
        for a, b in zip(first if residual else (first,), again if residual else (again,)):
            assert torch.equal(a, b)
        x.copy_(torch.randn(shape, device=DEVICE))
        out = norm(x, normalized, w, **kw)
    assert len(checked_norms) == 1
    ref = (nm.rms_norm_reference if is_rms else nm.layer_norm_reference)(x.double(), normalized, w.double(), **(
        dict(residual=r.double()) if residual else {}))
    for o, e in zip(out if residual else (out,), ref if residual else (ref,)):
        assert rel_err(o, e) <= 1e-5
    xg = x.clone().requires_grad_(True)
    for _ in range(2):
        y = norm(xg, normalized, w, **kw)
    assert len(checked_norms) == 3 and (y[0] if residual else y).requires_grad


def test_fast_path_checks_new_options(checked_norms):
    """Other options or layouts after a cached call are checked again: bad ones still raise."""
    x, w = _t((4, 64)), _t((64,), shift=1.0)
    with torch.no_grad():
        nm.rms_norm(x, None, w)
        with pytest.raises(ValueError, match="eps"):
            nm.rms_norm(x, None, w, eps=-1.0)
        with pytest.raises(ValueError, match="normalized_shape"):
            nm.rms_norm(x, (32,), w)
        with pytest.raises(ValueError, match="weight"):
            nm.rms_norm(x, None, _t((32,)))
        nm.rms_norm(x[:, :32], None, w[:32])             # a strided x: its own entry
        nm.rms_norm(x[:, :32], None, w[:32])
    assert len(checked_norms) == 5 and len(nm._FAST) == 2


@pytest.mark.skipif(not HAS_CUDA, reason="needs a second device")
def test_mixed_devices():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="weight"):
        nm.layer_norm(x, None, torch.randn(8))
    with pytest.raises(ValueError, match="residual"):
        nm.rms_norm(x, residual=torch.randn(4, 8))


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_rms", [False, True])
def test_compile_fullgraph_residual_and_offset(is_rms):
    torch._dynamo.reset()
    n = 96
    if is_rms:
        def fn(x, weight, residual):
            y, h = nm.rms_norm(x, n, weight, 1e-6, 1.0, residual)
            return y * 2, h

        def ref(x, weight, residual):
            y, h = nm.rms_norm_reference(x, n, weight, 1e-6, 1.0, residual)
            return y * 2, h
    else:
        def fn(x, weight, residual):
            y, h = nm.layer_norm(x, None, weight, None, 1e-5, residual)
            return y * 2, h

        def ref(x, weight, residual):
            y, h = nm.layer_norm_reference(x, None, weight, None, 1e-5, residual)
            return y * 2, h
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _check(compiled, ref, dict(x=_t((2, 3, n)), weight=_t(n, scale=0.1), residual=_t((2, 3, n))), 1e-5)


def test_compile_dynamic_shapes_and_eps():
    """dynamic=True: row count and eps are symbolic; one graph serves both calls."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, r, eps: nm.rms_norm(x, None, w, eps, residual=r), dynamic=True,
                       fullgraph=True, backend="aot_eager")
    for m in (3, 5):
        t = dict(x=_t((m, 64)), weight=_t(64, scale=0.1, shift=1), residual=_t((m, 64)))
        _check(lambda **k: fn(k["x"], k["weight"], k["residual"], 1e-5 * m),
               lambda **k: nm.rms_norm_reference(k["x"], None, k["weight"], 1e-5 * m, residual=k["residual"]), t, 1e-5)


@pytest.mark.parametrize("case", ["ln_res", "rms_offset", "rms_noweight_res", "ln_3d"])
def test_opcheck_custom_ops(case):
    """Schema, fake impl, autograd registration and aot dispatch of both custom ops."""
    lead = (2, 3) if case == "ln_3d" else (3,)
    x, w, b, r = _t(lead + (40,)), _t(40), _t(40), _t(lead + (40,))
    fwd_args = {"ln_res": (x, w, b, r, 1e-5, 0.0, False), "rms_offset": (x, w, None, None, 1e-6, 1.0, True),
                "rms_noweight_res": (x, None, None, r, 1e-6, 0.0, True), "ln_3d": (x, w, b, None, 1e-5, 0.0, False)}[case]
    torch.library.opcheck(nm._norm_fwd_op.op, fwd_args)
    with torch.no_grad():
        _, h, mean, rstd = nm._norm_fwd_op(*fwd_args)
    is_rms, has_res = fwd_args[-1], fwd_args[3] is not None
    dy = torch.randn(lead + (40,), device=DEVICE)
    bwd_args = (dy, (h if has_res else x).detach(), None if fwd_args[1] is None else w.detach(),
                None if is_rms else mean, rstd, dy.clone() if has_res else None, fwd_args[5], is_rms,
                fwd_args[1] is not None, fwd_args[2] is not None, w.dtype, b.dtype)
    torch.library.opcheck(nm._norm_bwd_op.op, bwd_args)


def test_compile_inductor_default_backend():
    torch._dynamo.reset()
    mod = LayerNorm(64).to(DEVICE)
    compiled = torch.compile(lambda x: mod(x).relu(), fullgraph=True)
    x = _t((5, 64))
    y = compiled(x)
    assert rel_err(y, F.layer_norm(x.double(), (64,)).relu()) <= 1e-5
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.isfinite(g).all()


# ----------------------------------------------------------------------------------------------
# nn modules
# ----------------------------------------------------------------------------------------------


def _assert_module_matches(mod, ref, x):
    """Outputs and the gradients of x and every parameter agree with torch's module."""
    y, yr = mod(x), ref(x)
    assert rel_err(y, yr) <= 1e-5
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *mod.parameters()], g)
    ref_grads = torch.autograd.grad(yr, [x, *ref.parameters()], g)
    assert all(rel_err(a, c) <= 1e-5 for a, c in zip(grads, ref_grads))


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3}])
def test_layer_norm_module_matches_torch(kwargs):
    ref = torch.nn.LayerNorm(48, **kwargs).to(DEVICE)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    mod = LayerNorm(48, **kwargs).to(DEVICE)
    mod.load_state_dict(ref.state_dict())
    assert list(mod.state_dict()) == list(ref.state_dict())
    assert repr(mod).replace("LayerNorm", "") == repr(ref).replace("LayerNorm", "")
    _assert_module_matches(mod, ref, torch.randn(3, 5, 48, device=DEVICE, requires_grad=True))
    ref.load_state_dict(mod.state_dict())


@pytest.mark.parametrize("kwargs", [{}, {"eps": 1e-5}, {"elementwise_affine": False}])
def test_rms_norm_module_matches_torch(kwargs):
    ref = torch.nn.RMSNorm((4, 12), **kwargs).to(DEVICE)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    mod = RMSNorm((4, 12), **kwargs).to(DEVICE)
    mod.load_state_dict(ref.state_dict())
    assert list(mod.state_dict()) == list(ref.state_dict())
    _assert_module_matches(mod, ref, torch.randn(6, 4, 12, device=DEVICE, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rms_norm_default_eps_is_torchs(dtype):
    """eps=None: torch takes the epsilon of the dtype it computes in (fp32 for fp16 / bf16), not
    the input's: with fp16's 9.8e-4 a row of RMS 0.01 came out 0.72 off (a helper's audit, s36)."""
    x = (torch.randn(4, 64, device=DEVICE) * 0.01).to(dtype)
    ref = torch.nn.RMSNorm(64, device=DEVICE, dtype=dtype)
    mod = RMSNorm(64, device=DEVICE, dtype=dtype)
    want = F.rms_norm(x.double(), (64,), eps=torch.finfo(torch.float32).eps)
    assert rel_err(mod(x), want) <= (2e-3 if dtype == torch.float16 else 1e-5)
    assert rel_err(mod(x), ref(x)) <= (2e-3 if dtype == torch.float16 else 1e-5)
    assert rel_err(nm.rms_norm(x, (64,), eps=None), want) <= (2e-3 if dtype == torch.float16 else 1e-5)


def test_modules_residual_and_gemma_offset():
    gemma = RMSNorm(32, eps=1e-6, offset=1.0).to(DEVICE)
    assert torch.equal(gemma.weight, torch.zeros(32, device=DEVICE)) and "offset=1.0" in repr(gemma)
    x, r = torch.randn(4, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    y, h = gemma(x, r)
    assert torch.equal(h, x + r) and rel_err(y, F.rms_norm((x + r).double(), (32,), eps=1e-6)) <= 1e-5
    y, h = LayerNorm(32).to(DEVICE)(x, residual=r)
    assert rel_err(y, F.layer_norm((x + r).double(), (32,))) <= 1e-5
    with pytest.raises(ValueError, match="offset"):
        RMSNorm(32, elementwise_affine=False, offset=1.0)


# ----------------------------------------------------------------------------------------------
# registry extras: peers and byte counts
# ----------------------------------------------------------------------------------------------

SPECS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]


@pytest.mark.parametrize("name", SPECS)
def test_torch_peer_matches_reference(name):
    spec = registry.get(name)
    peer = spec.peers["torch"]()
    res = check_impl(spec, peer, spec.make_inputs((3, 2, 130), torch.float32, DEVICE), torch.float32)
    assert res.ok, res
    liger = spec.peers["liger"]()
    assert liger is None or callable(liger)


def test_bytes_are_exact():
    m, n, e = 16384, 4096, 2
    big, vec = m * n * e, n * e
    bf16 = torch.bfloat16
    assert registry.get("layer_norm").bytes_fn((m, n), bf16, "fwd") == 2 * big + 2 * vec + 8 * m
    assert registry.get("layer_norm").bytes_fn((m, n), bf16, "bwd") == 3 * big + 3 * vec + 8 * m
    assert registry.get("rms_norm").bytes_fn((4, m // 4, n), bf16, "fwd") == 2 * big + vec + 4 * m
    assert registry.get("rms_norm").bytes_fn((m, n), bf16, "bwd") == 3 * big + 2 * vec + 4 * m
    assert registry.get("add_rms_norm").bytes_fn((m, n), bf16, "fwd") == 4 * big + vec + 4 * m
    assert registry.get("add_rms_norm").bytes_fn((m, n), bf16, "bwd") == 4 * big + 2 * vec + 4 * m
    assert registry.get("add_layer_norm").bytes_fn((m, n), bf16, "bwd") == 4 * big + 3 * vec + 8 * m


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["rms", "rms_offset_3d", "ln", "ln_no_affine", "ln_bias_only", "add_rms_fp32_w"])
def test_repeated_backward_reuses_its_bound_launch(case, monkeypatch):
    """A repeated backward of one layout takes the bound launch (no plan, workspace or launch-key
    lookups): the same gradients as the planned path and the fp64 reference on every call, with
    fresh dy each time; a misaligned x, a non-contiguous dy, another stream and poisoned-output
    tests take the planned path instead."""
    import tilefuse._dispatch as dispatch

    monkeypatch.setattr(dispatch, "POISON_OUTPUTS", False)     # the bound path is off while tests poison
    bound = count_calls(monkeypatch, norm_launch, "_bound_bwd")
    is_rms, shape = case.startswith(("rms", "add_rms")), (4, 3, 4096) if case.endswith("3d") else (3000, 4096)
    n, dt = shape[-1], torch.bfloat16
    x = torch.randn(*shape, device=DEVICE, dtype=dt)
    w_dtype = torch.float32 if case.endswith("fp32_w") else dt
    w = None if case in ("ln_no_affine", "ln_bias_only") else torch.randn(n, device=DEVICE, dtype=w_dtype)
    b = torch.randn(n, device=DEVICE, dtype=dt) if case in ("ln", "ln_bias_only") else None
    offset = 1.0 if "offset" in case else 0.0
    _, _, mean, rstd = nm._launch_fwd(x, w, b, None, 1e-5, offset, is_rms)
    mean = None if is_rms else mean
    dres = torch.randn_like(x) if case.startswith("add") else None
    need_dw, need_db = w is not None, b is not None

    def call(dy, x=x, **kw):
        return nm._launch_bwd(dy, x, w, mean, rstd, dres, offset, is_rms, need_dw, need_db,
                              w.dtype if w is not None else torch.float32, dt, **kw)

    def check(got, dy, x=x):
        args = (dy, x, w, mean, rstd, dres, offset, is_rms, need_dw, need_db)
        want = nm._bwd_reference(*(t.double() if isinstance(t, torch.Tensor) else t for t in args))
        planned = call(dy, x, config={})
        for i, (g, p, r) in enumerate(zip(got, planned, want)):
            assert g.dtype == p.dtype and g.shape == p.shape, i
            assert torch.equal(g, p), f"output {i} differs from the planned path"
            assert rel_err(g, r) <= TOL[dt], f"output {i}: {rel_err(g, r):.3g}"

    for i in range(3):
        dy = torch.randn_like(x)
        got = call(dy)
        assert len(bound) == i, "the second and later calls take the bound launch"
        check(got, dy)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dy = torch.randn_like(x)
        got = call(dy)                          # a new key: planned, then bound on this stream
        got2 = call(dy)
    torch.cuda.current_stream().wait_stream(stream)
    assert len(bound) == 3
    check(got, dy)
    check(got2, dy)
    before = len(bound)
    xs = torch.randn(x.numel() + 1, device=DEVICE, dtype=dt)[1:].view(x.shape)   # 2 bytes off 16
    xs.copy_(x)
    check(call(dy, xs), dy, xs)
    dy_nc = torch.randn(*x.shape[:-1], 2 * n, device=DEVICE, dtype=dt)[..., ::2]     # not contiguous
    check(call(dy_nc), dy_nc)
    assert len(bound) == before
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in dispatch._GRID_SYNC.values())


@pytest.mark.gpu
def test_repeated_autograd_backward_bound_launch(monkeypatch):
    """Through the public op and autograd: backwards on one retained graph, the later ones by the
    bound launch, each against the fp64 reference."""
    import tilefuse._dispatch as dispatch

    monkeypatch.setattr(dispatch, "POISON_OUTPUTS", False)
    bound = count_calls(monkeypatch, norm_launch, "_bound_bwd")
    x, w, b = _t((2, 1000, 4096), torch.bfloat16), _t(4096, torch.bfloat16, 0.1, 1), _t(4096, torch.bfloat16)
    y = nm.layer_norm(x, None, w, b)
    ref_in = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    ref = nm.layer_norm_reference(ref_in[0], None, ref_in[1], ref_in[2])
    for _ in range(3):
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
        want = torch.autograd.grad(ref, ref_in, dy.double(), retain_graph=True)
        for g, r in zip(got, want):
            assert rel_err(g, r) <= TOL[torch.bfloat16]
    assert len(bound) == 2
