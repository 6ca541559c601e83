"""attention_backward (the dq/dk/dv kernels) against autograd through the fp64 reference.

out and lse come from attention_reference in fp64 (cast to the test dtype / fp32), so these tests
need nothing of the forward kernels. fp16/bf16 use the flash-attn rule: max abs error of the
kernel vs fp64 <= 2 x (the same computation in plain PyTorch at the same dtype) + a small atol;
fp32 uses the relative error norm.

Windows in the kernel interface are arbitrary ints (None = unbounded). A reference with windows
(l, r) >= -1 and its own ``shift`` s0 equals the kernel's bottom-right rule with
    right = r + (s0 - shift),  left = l - (s0 - shift),     shift = S_k - S_q,
which is how the tests reach negative windows (e.g. SDPA's top-left causal: s0 = 0).

Every correctness case runs in both loop forms of the kernels (``split``: launch config key
split_loops, mask-free blocks and masked edge blocks in separate loops; the default walks one loop).
"""

import math

import pytest
import torch
from conftest import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse.ops._attention_bwd import attention_backward, launch_attention_backward
from tilefuse.ops._attention_common import attention_reference, attention_varlen_reference, visible_mask
from tilefuse.testing import rel_err

SMALL = dict(BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16)   # several blocks at tiny S
SPLIT = [pytest.param((False, False), id="one_loop"), pytest.param((True, False), id="split_loops"),
         pytest.param((False, True), id="one_loop_dv_late"), pytest.param((True, True), id="split_loops_dv_late")]


def _loops(config, split):
    """``config`` with the kernels' loop form chosen: ``split = (split_loops, late)``; late: the
    dk/dv kernel's dv GEMM after dpᵀ's (dv_late)."""
    split_loops, late = split
    return dict(config or {}, split_loops=split_loops, dv_late=late)


def _fp32_close(g, r):
    """Relative error norm <= 1e-5, with an absolute floor: a gradient can be exactly 0 by
    cancellation (a row that sees one key has dq = 0), where fp32 leaves ~1e-7 residue."""
    return (g.double() - r).norm().item() <= 1e-5 * (r.norm().item() + g.numel() ** 0.5)


def _kernel_window(window, s0, shift):
    """The reference's (left, right) with shift s0 -> the kernel's ints (None: unbounded)."""
    left, right = window
    off = s0 - shift
    return (None if left < 0 else left - off), (None if right < 0 else right + off)


def _same_dtype_grads(q, k, v, do, window, s0, softcap, scale):
    """PyTorch at the inputs' own dtype (no upcast): the baseline of the flash-attn rule."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, 1)
    vt = v.transpose(1, 2).repeat_interleave(group, 1)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    ok = visible_mask(q.shape[1], k.shape[1], *window, device=q.device, shift=s0)
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    out = torch.matmul(p, vt).transpose(1, 2)
    return torch.autograd.grad(out, (q, k, v), do)


def _check(b, sq, sk, hq, hkv, d, dtype, window=(-1, -1), s0=None, softcap=0.0, scale=None,
           config=None, layout=None):
    """Kernel grads vs fp64 autograd; ``layout`` 'bhsd' passes transposed (strided) views."""
    s0 = sk - sq if s0 is None else s0
    scale = 1 / math.sqrt(d) if scale is None else scale
    q64 = torch.randn(b, sq, hq, d, device=DEVICE, dtype=torch.float64).to(dtype).double().requires_grad_(True)
    k64 = torch.randn(b, sk, hkv, d, device=DEVICE, dtype=torch.float64).to(dtype).double().requires_grad_(True)
    v64 = torch.randn(b, sk, hkv, d, device=DEVICE, dtype=torch.float64).to(dtype).double().requires_grad_(True)
    out64, lse64 = attention_reference(q64, k64, v64, False, window, softcap, scale, return_lse=True, shift=s0)
    do64 = torch.randn_like(out64).to(dtype).double()
    refs = torch.autograd.grad(out64, (q64, k64, v64), do64)
    args = [t.detach().to(dtype) for t in (do64, q64, k64, v64, out64)]
    lse = lse64.float()
    if layout == "bhsd":   # [B, H, S, D] storage seen as [B, S, H, D]; lse stored [B, S, H]
        args = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in args]
        lse = lse.transpose(1, 2).contiguous().transpose(1, 2)
        assert not args[1].is_contiguous()
    left, right = _kernel_window(window, s0, sk - sq)
    grads = launch_attention_backward(*args, lse, scale=scale, window_left=left, window_right=right,
                                      softcap=softcap, config=config)
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, refs, args[1:4]):
        assert g.shape == t.shape and g.dtype == dtype, name
        assert not torch.isnan(g).any(), name
        if dtype == torch.float32:
            assert _fp32_close(g, r), (name, rel_err(g, r))
    if dtype != torch.float32:
        base = _same_dtype_grads(*args[1:4], args[0], window, s0, softcap, scale)
        for name, g, r, p in zip(("dq", "dk", "dv"), grads, refs, base):
            err = (g.double() - r).abs().max().item()
            torch_err = (p.double() - r).abs().max().item()
            assert err <= 2 * torch_err + 1e-3 * max(r.abs().max().item(), 1.0), (name, err, torch_err)
    return grads


CASES = {   # (b, sq, sk, hq, hkv, d, window, softcap, scale)
    "mha": (1, 33, 33, 2, 2, 64, (-1, -1), 0.0, None),
    "gqa_causal_sq<sk": (2, 37, 50, 4, 2, 24, (-1, 0), 0.0, None),
    "mqa_causal_sq>sk": (2, 50, 37, 3, 1, 8, (-1, 0), 0.0, None),
    "window_softcap_scale": (2, 45, 40, 4, 2, 40, (7, 3), 5.0, 0.3),
    "sq1": (3, 1, 29, 2, 1, 24, (-1, 0), 0.0, None),
}


@pytest.mark.parametrize("split", SPLIT)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(case, dtype, split):
    b, sq, sk, hq, hkv, d, window, softcap, scale = CASES[case]
    _check(b, sq, sk, hq, hkv, d, dtype, window=window, softcap=softcap, scale=scale,
           config=_loops(SMALL, split))


@pytest.mark.parametrize("split", SPLIT)
def test_default_config_and_strided_inputs(split):
    _check(2, 21, 30, 4, 2, 40, torch.float32, window=(-1, 0), config=_loops(None, split))
    _check(2, 21, 30, 4, 2, 24, torch.float32, window=(5, 2), softcap=3.0, config=_loops(SMALL, split),
           layout="bhsd")


def test_split_loops_edges_on_both_sides():
    """A window narrower than the tiles on both sides: left-edge and right-edge masked blocks
    around a mask-free run, in every dk/dv and dq program (the split masked loop's index map)."""
    for window in ((20, 20), (30, 3), (3, 30)):
        for late in (False, True):
            _check(1, 64, 64, 2, 1, 16, torch.float32, window=window, config=_loops(SMALL, (True, late)))


@settings(max_examples=25, deadline=None)
@given(sq=st.integers(1, 40), sk=st.integers(1, 40), hkv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), d=st.sampled_from([8, 24]), left=st.integers(-1, 20),
       right=st.integers(-1, 20), s0=st.integers(-30, 30), softcap=st.sampled_from([0.0, 2.0]),
       block=st.sampled_from([16, 32]), split=st.booleans(), late=st.booleans())
def test_random_windows(sq, sk, hkv, group, d, left, right, s0, softcap, block, split, late):
    """Arbitrary (also negative) kernel windows, through the reference's own shift."""
    cfg = _loops(dict(BLOCK_M1=block, BLOCK_N1=48 - block, BLOCK_M2=48 - block, BLOCK_N2=block), (split, late))
    _check(1, sq, sk, hkv * group, hkv, d, torch.float32, window=(left, right), s0=s0,
           softcap=softcap, config=cfg)


@pytest.mark.parametrize("split", SPLIT)
def test_top_left_causal_and_fully_masked_rows(split):
    """SDPA's causal (top-left, s0 = 0) with S_q < S_k: the kernel's right window is -16.
    Bottom-right causal with S_q > S_k: the first 16 rows see nothing: dq exactly 0, no NaN."""
    _check(1, 24, 40, 2, 2, 24, torch.float32, window=(-1, 0), s0=0, config=_loops(SMALL, split))
    dq, _, _ = _check(1, 40, 24, 2, 2, 24, torch.float32, window=(-1, 0), config=_loops(SMALL, split))
    assert torch.equal(dq[:, :16], torch.zeros_like(dq[:, :16]))    # bottom-right: first 16 rows blind


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)])
def test_empty(shape):
    b, sq, sk = shape
    q = torch.randn(b, sq, 2, 16, device=DEVICE)
    k, v = torch.randn(b, sk, 1, 16, device=DEVICE), torch.randn(b, sk, 1, 16, device=DEVICE)
    lse = torch.full((b, 2, sq), float("-inf"), device=DEVICE)
    dq, dk, dv = attention_backward(torch.randn_like(q), q, k, v, torch.zeros_like(q), lse,
                                    scale=0.25, window_right=0)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and not g.any()


def _varlen_case(lens_q, lens_k, hq, hkv, d, causal, dtype=torch.float32, config=SMALL):
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), hq, d, device=DEVICE, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lens_k), hkv, d, device=DEVICE, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lens_k), hkv, d, device=DEVICE, dtype=torch.float64, requires_grad=True)
    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    do = torch.randn_like(out)
    refs = torch.autograd.grad(out, (q, k, v), do, allow_unused=True)
    refs = [torch.zeros_like(t) if r is None else r for r, t in zip(refs, (q, k, v))]
    args = [t.detach().to(dtype) for t in (do, q, k, v, out)]
    run = lambda: launch_attention_backward(   # noqa: E731
        *args, lse.float(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
        max_seqlen_k=max(lens_k), scale=1 / math.sqrt(d), window_right=0 if causal else None,
        config=config)
    return run, refs


@pytest.mark.parametrize("split", SPLIT)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_lengths_0_and_1(causal, split):
    run, refs = _varlen_case([0, 1, 17, 5, 30], [3, 0, 20, 1, 26], 4, 2, 24, causal, config=_loops(SMALL, split))
    for name, g, r in zip(("dq", "dk", "dv"), run(), refs):
        assert _fp32_close(g, r), (name, rel_err(g, r))


@pytest.mark.parametrize("split", SPLIT)
def test_tma_descriptors(split):
    """The use_tma path (inner-loop tiles through tensor descriptors: their zero fill replaces the
    row / column masks) on padded D, strided and varlen inputs."""
    tma = _loops(dict(SMALL, use_tma=True), split)
    _check(2, 37, 50, 4, 2, 24, torch.float32, window=(-1, 0), config=tma)
    _check(2, 21, 30, 4, 2, 40, torch.float16, window=(5, 2), softcap=3.0, config=tma, layout="bhsd")
    run, refs = _varlen_case([0, 1, 17, 5, 30], [3, 0, 20, 1, 26], 4, 2, 24, True, config=tma)
    for name, g, r in zip(("dq", "dk", "dv"), run(), refs):
        assert _fp32_close(g, r), (name, rel_err(g, r))


def test_deterministic_bitwise():
    run, _ = _varlen_case([9, 33], [20, 31], 6, 2, 16, True, config=None)
    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    run, _ = _varlen_case([9, 33], [20, 31], 6, 2, 16, True, config=_loops(SMALL, (True, True)))
    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    torch.manual_seed(0)
    q = torch.randn(1, 30, 4, 16, device=DEVICE)
    k, v = torch.randn(1, 30, 1, 16, device=DEVICE), torch.randn(1, 30, 1, 16, device=DEVICE)
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    do = torch.randn_like(out)
    a = attention_backward(do, q, k, v, out, lse, scale=0.25, window_right=0, deterministic=True)
    b = attention_backward(do, q, k, v, out, lse, scale=0.25, window_right=0, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------
# GPU: bf16, the kernel's default tiles, realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (200, 10)])
def test_gpu_shapes(dtype, d, window):
    _check(2, 777, 1000, 8, 2, d, dtype, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_bf16(causal):
    run, refs = _varlen_case([0, 1, 300, 517], [5, 0, 400, 517], 8, 2, 128, causal,
                             dtype=torch.bfloat16, config=None)
    for name, g, r in zip(("dq", "dk", "dv"), run(), refs):
        assert rel_err(g, r) <= 2e-2, (name, rel_err(g, r))


@pytest.mark.gpu
@pytest.mark.parametrize("split", SPLIT)
@pytest.mark.parametrize("use_tma", [True, False])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)])
def test_gpu_load_paths(use_tma, d, window, split):
    """Both load paths with their own default tiles (TMA is the default on sm_90+), both loop forms."""
    cfg = {"use_tma": use_tma, "split_loops": split}
    _check(2, 777, 1000, 8, 2, d, torch.bfloat16, window=window, config=cfg)
    _check(1, 300, 300, 4, 4, d, torch.bfloat16, window=window, config=cfg, layout="bhsd")
    run, refs = _varlen_case([0, 1, 300, 517], [5, 0, 400, 517], 8, 2, d, window == (-1, 0),
                             dtype=torch.bfloat16, config=cfg)
    for name, g, r in zip(("dq", "dk", "dv"), run(), refs):
        assert rel_err(g, r) <= 2e-2, (name, rel_err(g, r))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(200, 10), (-1, 0)])
def test_gpu_split_loops_windows(d, window):
    """split_loops with the default tiles: sliding window (edges on both sides) and causal + softcap."""
    _check(2, 777, 1000, 8, 2, d, torch.bfloat16, window=window, softcap=30.0 if window == (-1, 0) else 0.0,
           config={"split_loops": True})


@pytest.mark.gpu
def test_gpu_softcap_strided_bf16():
    _check(2, 512, 512, 8, 8, 128, torch.bfloat16, window=(-1, 0), softcap=30.0, layout="bhsd")


# (B, S_q, S_k, H_q, H_kv): S_q = 1, lengths off the 64-row tiles with GQA, S_q > S_k (causal
# rows that see nothing), a 2k square with many query blocks per program
WS_SHAPES = [(1, 1, 21, 2, 2), (2, 65, 129, 4, 2), (1, 1000, 1531, 8, 2), (1, 300, 200, 2, 1), (2, 2048, 2048, 4, 4)]


def _check_ws_shapes(d, dtype, config):
    """Every WS_SHAPES case by the flash-attn rule at every masking mode: full, causal, window +
    softcap, top-left causal (negative windows) with a negative scale."""
    for b, sq, sk, hq, hkv in WS_SHAPES:
        _check(b, sq, sk, hq, hkv, d, dtype, config=config)
        _check(b, sq, sk, hq, hkv, d, dtype, window=(-1, 0), config=config)
        _check(b, sq, sk, hq, hkv, d, dtype, window=(100, 7), softcap=20.0, config=config)
        _check(b, sq, sk, hq, hkv, d, dtype, window=(-1, 0), s0=0, scale=-0.3, config=config)


def _causal_gqa_inputs(d, dtype):
    """(do, q, k, v, out, lse) of a causal GQA case, 2 x 1000 tokens, 8 query heads on 2 kv heads."""
    q = torch.randn(2, 1000, 8, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(2, 1000, 2, d, device=DEVICE, dtype=dtype) for _ in range(2))
    out, lse = attention_reference(q, k, v, True, (-1, -1), 0.0, d ** -0.5, return_lse=True)
    return torch.randn_like(out), q, k, v, out, lse.float()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [{}, {"GLUON_STAGES": 2}, {"GLUON_BLOCK_M": 64}], ids=["default", "stages2", "m64"])
def test_gpu_warp_specialized_dkdv(d, dtype, cfg):
    """The Gluon dk/dv kernel (sm_90) by the flash-attn rule at every masking mode (full, causal,
    window + softcap, top-left causal = negative windows), a negative scale and GQA; its dk / dv
    also within bf16 rounding of the tl kernel's."""
    from tilefuse._dispatch import is_hopper
    if not is_hopper(torch.empty(0, device=DEVICE)):
        pytest.skip("the warp-specialized dk/dv kernel is sm_90 only")
    config = dict(cfg, GLUON=True)
    _check_ws_shapes(d, dtype, config)
    # the same inputs through both Gluon kernels and both tl kernels
    do, q, k, v, out, lse = _causal_gqa_inputs(d, dtype)
    grads = {g: launch_attention_backward(do, q, k, v, out, lse, scale=d ** -0.5, window_right=0,
                                          config=dict(cfg, GLUON=g)) for g in (True, False)}
    for name, a, r in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        assert rel_err(a, r) <= 1e-2, (name, rel_err(a, r))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [{"GLUON_DQ_STAGES": 2}, {"GLUON_DQ_BLOCK_N": 64}, {"GLUON_DQ_STAGES": 3}],
                         ids=["stages2", "n64", "stages3"])
def test_gpu_warp_specialized_dq(d, dtype, cfg):
    """The Gluon dq kernel (sm_90; the default at D = 128, where the dk/dv test above runs its
    default tiles) in other tiles and at D = 64, by the flash-attn rule at every masking mode; its
    dq within bf16 rounding of the tl dq kernel's, with the dk/dv kernel fixed."""
    from tilefuse._dispatch import is_hopper
    if not is_hopper(torch.empty(0, device=DEVICE)):
        pytest.skip("the warp-specialized dq kernel is sm_90 only")
    config = dict(cfg, GLUON=True, GLUON_DQ=True)
    _check_ws_shapes(d, dtype, config)
    do, q, k, v, out, lse = _causal_gqa_inputs(d, dtype)
    dq = {g: launch_attention_backward(do, q, k, v, out, lse, scale=d ** -0.5, window_right=0,
                                       config=dict(config, GLUON_DQ=g))[0] for g in (True, False)}
    assert rel_err(dq[True], dq[False]) <= 1e-2, rel_err(dq[True], dq[False])


@pytest.mark.gpu
def test_gpu_default_dkdv_is_warp_specialized():
    """On sm_90 the backward reaches the Gluon dk/dv kernel for dense 16-bit D = 64 / 128 that TMA
    can read, and the tl kernel otherwise."""
    from tilefuse.ops import _attention_bwd
    from tilefuse._dispatch import device_major, is_hopper
    x = torch.randn(1, 64, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    hopper = is_hopper(x)

    def _use_gluon(t, varlen, use_tma, config):
        return _attention_bwd._use_gluon(device_major(t), t.dtype, t.shape[-1], varlen, use_tma, config)
    assert _use_gluon(x, False, True, None) == hopper
    assert not _use_gluon(x, True, True, None)                              # varlen
    assert not _use_gluon(x, False, False, None)                            # pointer loads
    assert not _use_gluon(x.float(), False, True, None)                     # fp32
    assert not _use_gluon(x[..., :96], False, True, None)                   # D = 96
    assert not _use_gluon(x, False, True, {"BLOCK_M1": 32})                 # a tl tile config
    assert _use_gluon(x, False, True, {"BLOCK_M1": 32, "GLUON": True}) == hopper


@pytest.mark.gpu
@pytest.mark.parametrize("d, dq_kernel", [(128, "attention_bwd_dq_ws_kernel"), (64, "attention_bwd_dq_kernel")])
def test_gpu_default_dq_kernel(d, dq_kernel):
    """The backward's default dq kernel on sm_90 (``gluon_dq_default``): the Gluon one at D = 128,
    the tl one at D = 64 -- read from the kernels the profiler saw launch."""
    from torch.profiler import ProfilerActivity, profile
    from tilefuse._dispatch import is_hopper
    q = torch.randn(1, 256, 2, d, device=DEVICE, dtype=torch.bfloat16)
    if not is_hopper(q):
        pytest.skip("the warp-specialized kernels are sm_90 only")
    out, lse = attention_reference(q, q, q, True, (-1, -1), 0.0, d ** -0.5, return_lse=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch_attention_backward(torch.randn_like(out), q, q, q, out, lse.float(), scale=d ** -0.5, window_right=0)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    dq_kernels = {"attention_bwd_dq_ws_kernel", "attention_bwd_dq_kernel"} & names
    assert dq_kernels == {dq_kernel}, names
    assert "attention_bwd_dkdv_ws_kernel" in names, names


# ----------------------------------------------------------------------------------------------
# program order (HEAD_GROUP): which program takes which (block, head) must never change a result
# ----------------------------------------------------------------------------------------------


def _order_inputs(b, s, hq, hkv, d, dtype):
    q = torch.randn(b, s, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, s, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    out, lse = attention_reference(q, k, v, True, (-1, -1), 0.0, d ** -0.5, return_lse=True)
    return torch.randn_like(out), q, k, v, out.to(dtype), lse.float()


@pytest.mark.parametrize("window", [(None, 0), (9, None)], ids=["causal", "left_window"])
def test_head_group_orders_programs_only(window):
    """B·H_kv = 6, H_q = 12: every HEAD_GROUP dividing them gives the same gradients, bitwise, and
    they match the fp64 reference; one that divides neither is a ValueError before any launch."""
    left, right = window
    do, q, k, v, out, lse = _order_inputs(2, 45, 6, 3, 16, torch.float32)
    run = lambda cfg: launch_attention_backward(do, q, k, v, out, lse, scale=0.25, window_left=left,  # noqa: E731
                                                window_right=right, config=dict(SMALL, **cfg))
    first = run({"HEAD_GROUP": 1})
    for g in (2, 3, 6):
        assert all(torch.equal(a, b) for a, b in zip(run({"HEAD_GROUP": g}), first)), g
    assert all(torch.equal(a, b) for a, b in zip(run({}), first))
    with pytest.raises(ValueError, match="HEAD_GROUP"):
        run({"HEAD_GROUP": 4})
    _check(2, 45, 45, 6, 3, 16, torch.float32, window=(-1 if left is None else left, -1 if right is None else right),
           config=dict(SMALL, HEAD_GROUP=3), scale=0.25)


def test_heads_per_group_heuristic():
    from tilefuse.ops._attention_common import heads_per_group, schedule_grid
    assert heads_per_group(8, 256, True, 132) == 16          # 8 blocks x 16 heads: one wave
    assert heads_per_group(32, 64, True, 132) == 4
    assert heads_per_group(8, 256, False, 132) == 1          # even work: head order
    assert heads_per_group(256, 16, True, 132) == 1          # a head fills the GPU on its own
    assert heads_per_group(8, 19, True, 132) == 1            # prime B·H above the target: head order
    assert heads_per_group(8, 12, True, 132) == 12
    assert schedule_grid(8, 256, True, 132) == (16, 8, 16)
    assert schedule_grid(8, 256, True, 132, head_group=1) == (1, 8, 256)
    assert schedule_grid(0, 6, True, 132) == (1, 0, 6)       # no block: an empty grid
    assert schedule_grid(4, 120000, False, 132) == (2, 4, 60000)   # z <= 65535: wider groups
    with pytest.raises(ValueError, match="<= 65535"):
        schedule_grid(70000, 4, True, 132)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_head_group_bitwise(d):
    """The default kernels (Gluon dk/dv and dq on sm_90) in every program order: bitwise equal."""
    do, q, k, v, out, lse = _order_inputs(4, 1000, 6, 2, d, torch.bfloat16)
    run = lambda g: launch_attention_backward(do, q, k, v, out, lse, scale=d ** -0.5,   # noqa: E731
                                              window_right=0, config={"HEAD_GROUP": g})
    first = run(1)
    for g in (2, 4, 8):
        assert all(torch.equal(a, b) for a, b in zip(run(g), first)), g
