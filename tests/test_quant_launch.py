"""Weight-only quantization's launch paths: every kernel (the GEMV and tensor-core kernels, unsplit
= one launch, split-K with a ragged last split, int4 chunks of one or several groups, int8 words /
bytes, config overrides), the plans each M gets, and the eager fast path that skips the checks on a
repeated call. Outputs (and split-K partials) start NaN-poisoned (conftest)."""

import pytest
import torch
from conftest import DEVICE
from quant_cases import FORMATS, TOL, _check_launch, _fmt_id, _launch, _reference, _weight

from tilefuse.ops import _quant_kernels as quant_kernels
from tilefuse.ops import _quant_plan as quant_plan
from tilefuse.ops import quant   # registers int4_gemm / int8_gemm (until ops/__init__ imports it)
from tilefuse.ops.quant import dequantize_weight, quant_linear, quantize_weight
from tilefuse.quantization import QuantLinear
from tilefuse.testing import rel_err


# ------------------------------------------------------------------------------------------------
# launch paths: every kernel, split-K (ragged last split), one kernel when unsplit, configs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemv", 5), ("dot", 1), ("dot", 9), ("dot-xw", 17), ("dot-xw", 40)])
@pytest.mark.parametrize("splits", [1, 3])
def test_paths_and_split_k(fmt, path, m, splits, monkeypatch):
    """Each kernel (the dot kernel both ways round: W xᵀ and "xw", x Wᵀ) unsplit (one launch writes
    y and the bias) and split 3 ways over K chunks that do not divide evenly (the last split runs
    past K: its extra chunks must add nothing)."""
    bits, g = fmt
    k = 7 * (g or 32)                                  # int4: 7 groups -> 7 one-group chunks
    config = dict(PATH=path.split("-")[0], BLOCK_K=g or 32, SPLITS=splits, BLOCK_N=16)
    if path == "dot-xw":
        config.update(SWAP_AB=False, BLOCK_M=16)
    reduce_grids = []

    class CountingReduce:
        def launch_prepared(self, grid, tensors, prepared):
            reduce_grids.append(grid)
            return quant_kernels.splitk_reduce_kernel.launch_prepared(grid, tensors, prepared)

        def __getattr__(self, name):
            return getattr(quant_kernels.splitk_reduce_kernel, name)

    monkeypatch.setattr(quant_plan, "splitk_reduce_kernel", CountingReduce())
    plan = _check_launch(m, 19, k, fmt, torch.float32, config, bias=m % 2 == 1)
    assert len(reduce_grids) == (splits > 1)           # unsplit: the main kernel writes y, one launch
    assert plan.splits == splits and plan.n_chunks == 7
    assert splits == 1 or plan.chunks_per_split * splits > plan.n_chunks   # ragged last split
    assert plan.grid[1] == splits


@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 17, 33, 64, 65])
@pytest.mark.parametrize("fmt", [(8, None), (4, 32)], ids=_fmt_id)
def test_default_plans_every_m(m, fmt):
    """The default launch for each M class (GEMV, 16/32/64-row dot tiles, the 128-row tile above 64),
    N not a multiple of the tile (19)."""
    plan = _check_launch(m, 19, 64, fmt, torch.float16, bias=m % 2 == 0)
    assert (plan.kernel is quant_plan.quant_gemv_kernel) == (m == 1)
    if m > 1:
        assert plan.meta["BLOCK_M"] == (16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128)


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@pytest.mark.parametrize("m", [1, 6])
def test_k_is_one_group_and_ragged_k(fmt, m):
    """K = one int4 group (one chunk); int8 with K not a multiple of BLOCK_K (masked tail) and not
    a multiple of 4 (bytes instead of words)."""
    bits, g = fmt
    if bits == 4:
        plan = _check_launch(m, 21, g, fmt, torch.float32, dict(BLOCK_K=4 * g))
        assert plan.meta["BLOCK_K"] == g and plan.n_chunks == 1          # rounded down to the one group
    else:
        for k in (100, 101):                           # 100: words, masked tail; 101: byte loads
            plan = _check_launch(m, 21, k, fmt, torch.float32, dict(BLOCK_K=32))
            assert plan.meta["INT8_WORDS"] == (k % 4 == 0) and plan.n_chunks == 4


def test_int4_chunk_of_several_groups():
    """A chunk holding 4 groups (4 scales per row per step), with a group count it must divide."""
    plan = _check_launch(1, 24, 8 * 32, (4, 32), torch.float32, dict(BLOCK_K=128))
    assert plan.meta["BLOCK_K"] == 128 and plan.n_chunks == 2
    plan = _check_launch(3, 24, 6 * 32, (4, 32), torch.float16, dict(BLOCK_K=128))
    assert plan.meta["BLOCK_K"] == 64                  # 6 groups: chunks of 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("groups,g", [(6, 32), (11, 32), (3, 64)])
def test_gemv_ragged_last_chunk(dtype, splits, groups, g):
    """The int4 GEMV keeps its 4-group chunks when they do not divide K's groups: the last chunk
    is partial, masked per group (words, x, zero points and scales past K read as 0). 6 groups:
    chunks of 4 + 2; 11: 4 + 4 + 3; 3 groups of 64: one chunk of 4 with one masked. Split 3 ways,
    a split can also start past K. Bias on; y NaN-poisoned, every element checked."""
    k = groups * g
    plan = _check_launch(1, 37, k, (4, g), dtype, dict(PATH="gemv", BLOCK_K=4 * g, SPLITS=splits))
    assert plan.meta["BLOCK_K"] == 4 * g and plan.meta["RAGGED_K"] and plan.n_chunks == -(-groups // 4)


def test_gemv_chunk_rule():
    """The GEMV's chunk stays at the wanted width when it does not divide K's groups (K = 11008:
    86 groups of 128 -> 1024-column chunks, the last of 6 groups; it used to halve to 256), and
    shrinks only to K's own size (2 groups -> 2 groups); the dot kernel keeps dividing chunks."""
    plan = quant_plan.launch_plan(4, 128, 1, 4096, 11008, torch.bfloat16, 132)
    assert plan.kernel is quant_plan.quant_gemv_kernel and plan.meta["BLOCK_K"] == 1024 and plan.meta["RAGGED_K"]
    plan = quant_plan.launch_plan(4, 128, 1, 4096, 4096, torch.bfloat16, 132)
    assert plan.meta["BLOCK_K"] == 1024 and not plan.meta["RAGGED_K"]
    plan = quant_plan.launch_plan(4, 128, 1, 64, 256, torch.float16, 132)
    assert plan.meta["BLOCK_K"] == 256 and not plan.meta["RAGGED_K"]
    plan = quant_plan.launch_plan(4, 128, 1, 64, 384, torch.float16, 132)
    assert plan.meta["BLOCK_K"] == 512 and plan.meta["RAGGED_K"]
    plan = quant_plan.launch_plan(4, 128, 16, 4096, 11008, torch.float16, 132)
    assert plan.kernel is quant_plan.quant_dot_kernel and 11008 % plan.meta["BLOCK_K"] == 0


def test_unaligned_packed_weight():
    """A packed weight that is a view off a 4-byte boundary is read from an aligned copy."""
    qw = quantize_weight(_weight(8, 64, torch.float32), 4, 32)
    buf = torch.zeros(qw.qweight.numel() + 1, dtype=torch.uint8, device=DEVICE)
    buf[1:] = qw.qweight.flatten()
    shifted = qw._replace(qweight=buf[1:].view(8, 32))
    assert shifted.qweight.data_ptr() % 4
    x = torch.randn(3, 64, device=DEVICE)
    assert torch.equal(quant_linear(x, shifted), quant_linear(x, qw))


def test_split_k_is_deterministic_and_config_errors():
    qw = quantize_weight(_weight(40, 512, torch.float32), 4, 32)
    x = torch.randn(2, 512, device=DEVICE)
    cfg = dict(SPLITS=5)
    assert torch.equal(_launch(x, qw, config=cfg), _launch(x, qw, config=cfg))
    with pytest.raises(ValueError, match="unknown keys"):
        _launch(x, qw, config=dict(BLOCKN=16))
    with pytest.raises(ValueError, match="cannot serve M"):
        _launch(torch.randn(9, 512, device=DEVICE), qw, config=dict(PATH="gemv"))


def test_launch_plans_for_an_h100():
    """Cached per shape; M = 1 on 4096 x 4096 is one launch of 256 programs; split-K gives the
    16-row tiles about 6 programs per SM (8 splits of 4 chunks at 4096², 4 at 14336 x 4096), and
    at 64 rows stays within the partials' traffic cap (K·bits / (128·M) = 2)."""
    args = (4, 128, 1, 4096, 4096, torch.bfloat16, 132)
    assert quant_plan.launch_plan(*args) is quant_plan.launch_plan(*args)
    plan = quant_plan.launch_plan(*args)
    assert plan.splits == 1 and plan.kernel is quant_plan.quant_gemv_kernel and plan.grid == (256, 1)
    assert plan.meta["X_PAIRS"] and plan.meta["BLOCK_N"] == 16 and plan.meta["BLOCK_K"] == 1024
    plan = quant_plan.launch_plan(4, 128, 16, 4096, 4096, torch.bfloat16, 132)
    assert plan.meta["SWAP_AB"] and plan.grid == (64, 8) and plan.chunks_per_split == 4
    plan = quant_plan.launch_plan(4, 128, 64, 4096, 4096, torch.bfloat16, 132)
    assert not plan.meta["SWAP_AB"] and plan.splits == 2
    assert quant_plan.launch_plan(4, 128, 16, 14336, 4096, torch.bfloat16, 132).splits == 4
    assert quant_plan.launch_plan(4, 128, 32, 4096, 4096, torch.bfloat16, 132).splits == 4    # the cap


def test_mma_plans():
    """Where the Gluon int4 kernel can run (``PATH="mma"`` on an sm_80+ GPU: ``mma_ok``): int4 with
    fp16 / bf16 x and up to 32 rows; not a default. A program takes SLOTS x STEPS groups (STEPS a
    power of two up to 8), the split-K fills the GPU; asking for it where it cannot run
    (int8, fp32 x, 33+ rows, no GPU) is an error."""
    mma = (("PATH", "mma"),)
    for m, n, k, g in [(1, 4096, 4096, 128), (16, 14336, 4096, 128), (3, 4096, 14336, 128), (32, 4097, 4096, 32)]:
        assert "MMA_N" not in quant_plan.launch_plan(4, g, m, n, k, torch.bfloat16, 132, (), True).meta
        plan = quant_plan.launch_plan(4, g, m, n, k, torch.bfloat16, 132, mma, True)
        meta = plan.meta
        assert meta["MMA_N"] == max(8, 1 << (m - 1).bit_length()) and meta["BLOCK_N"] == 16 and meta["SLOTS"] == 4
        steps = meta["STEPS"]
        assert steps & (steps - 1) == 0 and 1 <= steps <= 8 and plan.chunks_per_split == 4 * steps
        assert plan.grid == ((n + 15) // 16, plan.splits) and plan.n_chunks == k // g
        assert (plan.splits - 1) * plan.chunks_per_split < plan.n_chunks <= plan.splits * plan.chunks_per_split
        assert meta["EVEN_GROUPS"] == (plan.n_chunks % plan.chunks_per_split == 0)
        assert plan.grid[0] * plan.grid[1] >= 2 * 132 or steps == 1
    plan = quant_plan.launch_plan(4, 32, 32, 4096, 4096, torch.float16, 132, (("PATH", "mma"), ("SPLITS", 3)), True)
    assert plan.meta["STEPS"] == 8 and plan.splits == 4           # 128 groups / 3 splits -> 11 -> at most 8 steps of 4
    for bits, g, m, dtype in [(8, 0, 1, torch.bfloat16), (4, 128, 33, torch.bfloat16), (4, 128, 1, torch.float32)]:
        with pytest.raises(ValueError, match="mma"):
            quant_plan.launch_plan(bits, g, m, 4096, 4096, dtype, 132, mma, True)
    assert quant_plan.launch_plan(4, 128, 1, 4096, 4096, torch.bfloat16, 132, (), False).kernel is quant_plan.quant_gemv_kernel
    with pytest.raises(ValueError, match="mma"):
        quant_plan.launch_plan(4, 128, 1, 4096, 4096, torch.bfloat16, 132, mma, False)


def test_wgmma_plans():
    """Where the Hopper int4 kernel can run (``PATH="wgmma"`` on an sm_90 GPU: ``wgmma_ok``): int4
    group 128 with fp16 / bf16 x and up to 64 rows; the default for 2..16 rows there. A program
    takes a whole number of CHUNKs of groups, about 8, and keeps x for all of them in shared
    memory (so K is split further where that would not fit); asking for it where it cannot run
    is an error naming the path."""
    wg = (("PATH", "wgmma"),)
    # (m, n, k, splits, blocks): 64 rows per program by default
    cases = [(1, 4096, 4096, 4, 64), (16, 14336, 4096, 4, 224), (16, 4096, 14336, 14, 64),
             (64, 4096, 14336, 14, 64), (33, 4097, 1024, 1, 65), (5, 256, 128, 1, 4)]
    for m, n, k, splits, blocks in cases:
        plan = quant_plan.launch_plan(4, 128, m, n, k, torch.bfloat16, 132, wg, True, True)
        meta = plan.meta
        assert meta["MMA_N"] == max(8, 1 << (m - 1).bit_length()) and meta["BLOCK_N"] == 64
        assert plan.grid == (blocks, plan.splits) and plan.splits == splits, (m, n, k, plan.grid)
        assert plan.chunks_per_split % meta["CHUNK"] == 0 and meta["X_STEPS"] == plan.chunks_per_split
        assert (plan.splits - 1) * plan.chunks_per_split < plan.n_chunks == k // 128 <= plan.splits * plan.chunks_per_split
        x_bytes = meta["X_STEPS"] * meta["MMA_N"] * 128 * 2
        assert x_bytes + meta["STAGES"] * meta["BLOCK_N"] * 64 <= quant_plan.WGMMA_SMEM
    plan = quant_plan.launch_plan(4, 128, 16, 4096, 4096, torch.float16, 132, wg + (("SPLITS", 3),), True, True)
    assert plan.splits == 3 and plan.chunks_per_split == 12                  # 32 groups: 12 + 12 + 8
    plan = quant_plan.launch_plan(4, 128, 64, 4096, 4096, torch.bfloat16, 132, wg + (("SPLITS", 1),), True, True)
    assert plan.splits == 4 and plan.meta["X_STEPS"] == 8     # x of 32 groups would be 512 KB: 8 fit (128 KB)
    plan = quant_plan.launch_plan(4, 128, 9, 4096, 4096, torch.bfloat16, 132,
                             (("CHUNK", 8), ("PATH", "wgmma"), ("REPS", 1), ("STAGES", 8), ("num_warps", 8)), True, True)
    assert plan.meta["BLOCK_N"] == 128 and plan.meta["num_warps"] == 8 and plan.chunks_per_split % 8 == 0
    with pytest.raises(ValueError, match="STAGES"):
        quant_plan.launch_plan(4, 128, 9, 4096, 4096, torch.bfloat16, 132, wg + (("CHUNK", 4), ("STAGES", 8)), True, True)
    for bits, g, m, dtype in [(8, 0, 1, torch.bfloat16), (4, 64, 16, torch.bfloat16), (4, 128, 65, torch.bfloat16),
                              (4, 128, 1, torch.float32)]:
        with pytest.raises(ValueError, match="wgmma"):
            quant_plan.launch_plan(bits, g, m, 4096, 4096, dtype, 132, wg, True, True)
    with pytest.raises(ValueError, match="sm_90"):
        quant_plan.launch_plan(4, 128, 16, 4096, 4096, torch.bfloat16, 132, wg, True, False)
    # the default: 2..16 rows of int4 group 128 (fp16 / bf16) on sm_90; the GEMV at 1 row, the tl
    # kernel elsewhere (17+ rows, other groups, int8, fp32 x, no sm_90)
    for m in (2, 5, 16):
        assert "ACC_LAYOUT" in quant_plan.launch_plan(4, 128, m, 4096, 4096, torch.float16, 132, (), True, True).meta
    assert quant_plan.launch_plan(4, 128, 1, 4096, 4096, torch.bfloat16, 132, (), True, True).kernel is quant_plan.quant_gemv_kernel
    for args in [(4, 128, 17, torch.bfloat16, True), (4, 64, 16, torch.bfloat16, True), (8, 0, 16, torch.bfloat16, True),
                 (4, 128, 16, torch.float32, True), (4, 128, 16, torch.bfloat16, False)]:
        bits, g, m, dtype, ok = args
        assert quant_plan.launch_plan(bits, g, m, 4096, 4096, dtype, 132, (), ok, ok).kernel is quant_plan.quant_dot_kernel, args



def test_maxnreg_override():
    """``MAXNREG`` (a sweep knob) becomes the launch option ``maxnreg`` on every path, only when
    asked; the interpreted launch takes it and gives the same y as without it."""
    for path, ok in [("gemv", False), ("dot", False), ("mma", True), ("wgmma", True)]:
        m = 1 if path == "gemv" else 16
        base = quant_plan.launch_plan(4, 128, m, 4096, 4096, torch.bfloat16, 132, (("PATH", path),), ok, ok)
        capped = quant_plan.launch_plan(4, 128, m, 4096, 4096, torch.bfloat16, 132,
                                        (("MAXNREG", 72), ("PATH", path)), ok, ok)
        assert "maxnreg" not in base.meta and capped.meta["maxnreg"] == 72, path
        assert {k: v for k, v in capped.meta.items() if k != "maxnreg"} == base.meta
    w, x = _weight(40, 256, torch.float32), torch.randn(3, 256, device=DEVICE)
    qw = quantize_weight(w, 4, 128)
    y = quant_plan.launch(x, qw.qweight, qw.scales, qw.zeros, None, 4, 128, {"MAXNREG": 64})
    assert torch.equal(y, quant_plan.launch(x, qw.qweight, qw.scales, qw.zeros, None, 4, 128))

# ------------------------------------------------------------------------------------------------
# the eager fast path: a repeated call skips the checks and the plan (not their outcome)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [False, True])
def test_fast_path_repeats_the_checked_launch(fmt, lead, bias, checked_calls):
    """The second call of a layout launches what the first (checked) call launched, bitwise, on
    the new values of x; splits and leading dims as the default plans make them."""
    bits, g = fmt
    n, k = 37, 3 * (g or 32)
    qw = quantize_weight(_weight(n, k, torch.float16, k ** -0.5), bits, g)
    b = torch.randn(n, device=DEVICE).to(torch.float16) if bias else None
    x = torch.randn(*lead, k, device=DEVICE).to(torch.float16)
    first = quant_linear(x, qw, b)
    assert len(checked_calls) == 1 and len(quant._FAST) == 1
    again = quant_linear(x, qw, b)
    assert len(checked_calls) == 1, "the repeated call took the checked path"
    assert again.shape == (*lead, n) and torch.equal(again, first)
    x.copy_(torch.randn(*lead, k, device=DEVICE))         # new values, same layout: no stale result
    y = quant_linear(x, qw, b)
    assert len(checked_calls) == 1
    assert rel_err(y, _reference(x.reshape(-1, k), qw, b).reshape(*lead, n)) <= TOL[torch.float16]
    y2 = QuantLinear(qw, b)(x)                            # the module: same layout, same entry
    assert torch.equal(y2, y) and len(checked_calls) == 1 + (b is not None)   # a bias Parameter needs grad


def test_fast_path_keys_what_the_checks_read(checked_calls):
    """Another layout (strides, dtype, K, weight) after a cached call is checked again: bad input
    still raises, and a strided x gets its own entry with its own row stride."""
    n, k = 24, 64
    qw = quantize_weight(_weight(n, k, torch.float32), 4, 32)
    x = torch.randn(3, k, device=DEVICE)
    quant_linear(x, qw)
    with pytest.raises(ValueError, match="K = 64"):
        quant_linear(torch.randn(3, k + 2, device=DEVICE), qw)
    with pytest.raises(TypeError):
        quant_linear(x.half(), qw)                        # x's dtype differs from the scales'
    wide = torch.randn(3, 2 * k, device=DEVICE)[:, :k]   # row stride 2K: same shape, another entry
    assert rel_err(quant_linear(wide, qw), _reference(wide, qw)) <= TOL[torch.float32]
    assert rel_err(quant_linear(wide, qw), _reference(wide, qw)) <= TOL[torch.float32]
    assert len(quant._FAST) == 2 and len(checked_calls) == 2     # the bad calls raised before the op
    other = quantize_weight(_weight(n, k, torch.float32), 4, 64)   # another group size: checked
    assert rel_err(quant_linear(x, other), _reference(x, other)) <= TOL[torch.float32]
    assert len(checked_calls) == 3


def test_fast_path_not_for_autograd_or_copies(checked_calls):
    """x that needs a gradient goes through the custom op's autograd every time (and its
    backward is right); an x that rows_view must copy, and a weight off 4-byte words, are not
    kept (the checked path copies them)."""
    n, k = 19, 64
    qw = quantize_weight(_weight(n, k, torch.float32), 4, 32)
    x = torch.randn(2, k, device=DEVICE, requires_grad=True)
    for _ in range(2):
        y = quant_linear(x, qw)
    assert len(checked_calls) == 2 and not quant._FAST
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert rel_err(dx, dy.double() @ dequantize_weight(qw, torch.float64)) <= TOL[torch.float32]
    with torch.no_grad():
        quant_linear(x, qw)
        quant_linear(x, qw)
    assert len(checked_calls) == 3 and len(quant._FAST) == 1
    t = torch.randn(k, 4, 2, device=DEVICE).permute(1, 2, 0)      # [4, 2, K], K not the unit stride
    for _ in range(2):
        assert rel_err(quant_linear(t, qw), _reference(t.reshape(-1, k), qw).reshape(4, 2, n)) <= TOL[torch.float32]
    assert len(checked_calls) == 5 and len(quant._FAST) == 1
    raw = torch.empty(qw.qweight.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(qw.qweight.shape)
    raw.copy_(qw.qweight)                                 # the packed weight one byte off its words
    odd = quant.QuantizedWeight(raw, *qw[1:])
    x1 = torch.randn(1, k, device=DEVICE)
    for _ in range(2):
        assert rel_err(quant_linear(x1, odd), _reference(x1, qw)) <= TOL[torch.float32]
    assert len(checked_calls) == 7 and len(quant._FAST) == 1
