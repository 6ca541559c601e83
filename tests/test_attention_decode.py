"""attention_decode: split-KV decode vs the fp64 reference on the same cache, paged vs contiguous,
the in-place append (right slots, nothing else), S_q 1/3/16, GQA/MQA/MHA, windows, softcap,
empty and full caches, num_splits invariance, torch.compile, CUDA graphs, bad input.

Cache slots past each row's valid keys hold NaN, and so do pages no row references: a kernel
that reads one of them fails the comparison. CPU tests shrink the key tile to 16 keys
(``small_tiles``) so that a few dozen keys already take several tiles and splits.
"""

import math

import pytest
import torch
from conftest import CPU_DTYPES, DEVICE, HAS_CUDA, count_calls
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse.ops.attention_decode as ad
from tilefuse.ops.attention_decode import _num_splits, attention_decode, attention_decode_reference
from tilefuse.testing import rel_err

DTYPES = CPU_DTYPES + ((torch.bfloat16,) if HAS_CUDA else ())
HEADS = {"mqa": (4, 1), "gqa": (6, 2), "mha": (2, 2)}      # (H_q, H_kv)
ATOL = {torch.float16: 2e-4, torch.bfloat16: 2e-3}
LSE_ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(ad, "_key_block", lambda block_d, elem_size: 16)
    ad._decode_plan.cache_clear()       # plans built with the default tiles must not be reused
    ad._FAST.clear()                    # ... nor the fast path's calls holding them
    yield
    ad._decode_plan.cache_clear()
    ad._FAST.clear()


def _case(batch, s_q, h_q, h_kv, length, d, dtype, seqlens, append):
    """Inputs on DEVICE; cache slots >= seqlens[b] are NaN (the append overwrites some)."""
    def rnd(*shape):
        return torch.randn(*shape, device=DEVICE).to(dtype)
    k_cache, v_cache = rnd(batch, length, h_kv, d), rnd(batch, length, h_kv, d)
    for b, n in enumerate(seqlens):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    return dict(q=rnd(batch, s_q, h_q, d), k_cache=k_cache, v_cache=v_cache,
                cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
                k_new=rnd(batch, s_q, h_kv, d) if append else None,
                v_new=rnd(batch, s_q, h_kv, d) if append else None)


def _paged(inp, page_size, spare_pages=3):
    """The same data scattered into shuffled pages (+ NaN pages no row references)."""
    k_cache, v_cache = inp["k_cache"], inp["v_cache"]
    batch, length, h_kv, d = k_cache.shape
    per_row = math.ceil(length / page_size)
    n_pages = batch * per_row + spare_pages
    perm = torch.randperm(n_pages, device=DEVICE)[:batch * per_row].to(torch.int32)
    out = dict(inp, block_table=perm.view(batch, per_row))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        pages = torch.full((n_pages, page_size, h_kv, d), float("nan"), dtype=cache.dtype, device=DEVICE)
        padded = torch.full((batch, per_row * page_size, h_kv, d), float("nan"), dtype=cache.dtype, device=DEVICE)
        padded[:, :length] = cache
        pages[perm.long()] = padded.view(batch * per_row, page_size, h_kv, d)
        out[name] = pages
    return out


def _unpage(cache, block_table, length):
    return cache[block_table.long()].flatten(1, 2)[:, :length]


def _clone(inp):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


def _f64(inp):
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inp.items()}


def _check(inp, dtype, **kw):
    """Run on a copy of the inputs; out and lse vs the fp64 reference (fp32: rel err norm; lower
    precision: flash-attn's rule against PyTorch's same-dtype error). Returns (out, lse, inputs)."""
    run = _clone(inp)
    out, lse = attention_decode(**run, return_lse=True, **kw)
    ref, ref_lse = attention_decode_reference(**_f64(inp), return_lse=True, **kw)
    assert out.dtype == dtype and out.shape == inp["q"].shape and lse.dtype == torch.float32
    assert not out.isnan().any()
    if dtype == torch.float32:
        assert rel_err(out, ref) <= 1e-5
    else:
        err = (out.double() - ref).abs().max().item()
        assert err <= 2 * _torch_error(inp, ref, dtype, kw) + ATOL[dtype], err
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = ~torch.isinf(ref_lse)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= LSE_ATOL[dtype] if finite.any() else True
    return out, lse, run


def _torch_error(inp, ref, dtype, kw):
    """PyTorch's own same-dtype error: SDPA's math backend, or (softcap, rows without keys) the
    fp64 reference rounded to the dtype."""
    rounded = (ref.to(dtype).double() - ref).abs().max().item()
    try:
        out = ad._torch_peer()(**_clone(inp), **kw)
    except NotImplementedError:
        return rounded
    err = (out.double() - ref).abs()
    return max(rounded, err[~err.isnan()].max().item())


def _seqlens(batch, length, s_q, append):
    """First row empty (with the append: only new tokens) or one key, last row full, others random."""
    top = length - s_q if append else length
    lens = [0 if append else 1] + torch.randint(1, top + 1, (batch - 2,)).tolist() + [top]
    return lens[:batch]


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("s_q", [1, 3, 16])
def test_matches_reference(s_q, heads, append, dtype, small_tiles):
    h_q, h_kv = HEADS[heads]
    length = 40 + s_q
    inp = _case(3, s_q, h_q, h_kv, length, 32, dtype, _seqlens(3, length, s_q, append), append)
    _check(inp, dtype)


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("page_size", [16, 24, 32])     # 24: a page that splits key tiles
def test_paged_matches_contiguous(page_size, append, small_tiles):
    length = 50
    inp = _case(3, 3, 4, 2, length, 16, torch.float32, _seqlens(3, length, 3, append), append)
    paged = _paged(inp, page_size)
    out, lse, run = _check(inp, torch.float32, num_splits=2)
    out_p, lse_p, run_p = _check(paged, torch.float32, num_splits=2)
    torch.testing.assert_close(out_p, out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse_p, lse, rtol=0, atol=1e-6)
    for name in ("k_cache", "v_cache"):   # the append went to the same logical slots
        torch.testing.assert_close(_unpage(run_p[name], paged["block_table"], length), run[name], equal_nan=True,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_append_writes_only_new_slots(paged):
    s_q, length = 3, 40
    inp = _case(3, s_q, 4, 2, length, 16, torch.float16, [0, 21, length - s_q], append=True)
    inp["k_cache"].nan_to_num_(7.0)   # a cache with no NaN: a stray write shows as a changed value
    if paged:
        inp = _paged(inp, 16)
    run = _clone(inp)
    attention_decode(**run)
    for name, new in (("k_cache", "k_new"), ("v_cache", "v_new")):
        expected = inp[name].clone()
        for b, n in enumerate(inp["cache_seqlens"].tolist()):
            for t in range(s_q):
                pos = n + t
                page, slot = (int(inp["block_table"][b, pos // 16]), pos % 16) if paged else (b, pos)
                expected[page, slot] = inp[new][b, t]
        torch.testing.assert_close(run[name], expected, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(run["cache_seqlens"], inp["cache_seqlens"])   # not incremented (flash-attn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window,softcap", [
    (True, (4, -1), 0.0), (False, (3, 2), 0.0), (False, (-1, -1), 0.0), (True, (-1, -1), 5.0),
    (False, (8, 0), 2.0), (True, (0, -1), 0.0), (False, (-1, 1), 0.0), (False, (20, 20), 1.0),
    (False, (-1, 2**31 - 1), 0.0), (True, (2**31 - 1, -1), 0.0),   # int32-max windows: none (no wrap)
])
def test_windows_and_softcap(causal, window, softcap, dtype, small_tiles):
    length = 60
    inp = _case(3, 3, 4, 2, length, 16, dtype, _seqlens(3, length, 3, True), append=True)
    _check(inp, dtype, causal=causal, window=window, softcap=softcap, scale=0.3, num_splits=3)


def test_rows_that_see_nothing():
    """No keys (empty cache, no append), or a window that excludes every key: out 0, lse -inf."""
    inp = _case(2, 3, 4, 2, 32, 16, torch.float32, [0, 10], append=False)
    out, lse, _ = _check(inp, torch.float32)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    # causal S_q = 3 against 1 key: queries 0 and 1 see nothing
    inp = _case(1, 3, 2, 1, 32, 16, torch.float32, [1], append=False)
    out, lse, _ = _check(inp, torch.float32, num_splits=4)
    assert torch.isneginf(lse[0, :, :2]).all() and torch.isfinite(lse[0, :, 2]).all()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_num_splits_give_the_same_answer(dtype, small_tiles):
    length = 100
    inp = _case(2, 2, 8, 2, length, 32, dtype, [97, 33], append=True)
    outs = [_check(inp, dtype, num_splits=s, window=(50, -1))[:2] for s in (1, 2, 5, 64, None)]
    for out, lse in outs[1:]:
        torch.testing.assert_close(out.float(), outs[0][0].float(), rtol=0, atol=1e-6 if dtype == torch.float32 else 2e-3)
        torch.testing.assert_close(lse, outs[0][1], rtol=0, atol=1e-5)


def test_combine_in_several_steps(small_tiles):
    """The combine kernel's online merge over several steps of splits (D = 256: 16 splits a
    step, 40 splits of 16 keys, the largest lse in a later step than the first's) against one
    split, and against the fp64 reference."""
    assert ad._combine_chunk(40, 256) == 16 and ad._combine_chunk(16, 128) == 16
    inp = _case(2, 1, 4, 2, 640, 256, torch.float32, [640, 300], append=False)
    inp["q"][:, :, :, :] *= 0.2
    inp["k_cache"][:, 500:520] *= 8.0          # a late split holds the row's largest scores
    one, one_lse, _ = _check(inp, torch.float32, num_splits=1)
    many, many_lse, _ = _check(inp, torch.float32, num_splits=40)
    torch.testing.assert_close(many, one, rtol=0, atol=1e-5)
    torch.testing.assert_close(many_lse, one_lse, rtol=0, atol=1e-5)


def test_num_splits_heuristic():
    assert _num_splits(128, 64, 132) == 1                      # B=16, H_kv=8: one wave already
    assert _num_splits(8, 1024, 132) == 16                      # B=1, H_kv=8, 128k keys: 128 programs, one wave
    assert _num_splits(16, 256, 132) == 8 and _num_splits(60, 256, 132) == 2
    assert _num_splits(1, 1024, 132) == ad.MAX_SPLITS
    assert _num_splits(8, 3, 132) <= 3                          # at most one split per key tile
    assert _num_splits(1, 1, 132) == 1


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 3), s_q=st.integers(1, 16), group=st.sampled_from([1, 2, 3]), h_kv=st.integers(1, 2),
       extra=st.integers(0, 40), d=st.sampled_from([8, 16, 24]), paged=st.booleans(), append=st.booleans(),
       causal=st.booleans(), left=st.integers(-1, 10), splits=st.integers(1, 4), data=st.data())
def test_random_configs(batch, s_q, group, h_kv, extra, d, paged, append, causal, left, splits, data):
    length = 16 + extra + s_q
    top = length - (s_q if append else 0)
    seqlens = data.draw(st.lists(st.integers(0, top), min_size=batch, max_size=batch))
    inp = _case(batch, s_q, group * h_kv, h_kv, length, d, torch.float32, seqlens, append)
    if paged:
        inp = _paged(inp, 16)
    _check(inp, torch.float32, causal=causal, window=(left, -1), num_splits=splits)


def test_empty_batch():
    inp = _case(0, 2, 4, 2, 16, 16, torch.float32, [], append=True)
    out, lse = attention_decode(**inp, return_lse=True)
    assert out.shape == (0, 2, 4, 16) and lse.shape == (0, 4, 2)


def test_cpu_reference_path(monkeypatch):
    """Without the interpreter, CPU tensors take the PyTorch path: the same answer and append."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inp = _case(2, 3, 4, 2, 40, 16, torch.float32, [30, 5], append=True)
    paged = _paged(inp, 16)
    _, _, run = _check(paged, torch.float32)
    assert torch.equal(_unpage(run["k_cache"], paged["block_table"], 40)[0, 30:33], inp["k_new"][0])


def test_compile_with_append(small_tiles):
    """torch.compile(fullgraph=True) traces both ops; the in-place append survives functionalization."""
    inp = _case(2, 2, 4, 2, 40, 16, torch.float32, [30, 5], append=True)
    run = _clone(inp)
    out = torch.compile(attention_decode, fullgraph=True, backend="aot_eager")(**run)
    assert rel_err(out, attention_decode_reference(**_f64(inp))) <= 1e-5
    assert torch.equal(run["v_cache"][1, 5:7], inp["v_new"][1])


def _bad_inputs():
    good = _case(2, 2, 4, 2, 32, 16, torch.float32, [3, 4], append=True)
    paged = _paged(good, 16)
    pages_8 = dict(paged, k_cache=paged["k_cache"][:, :8].contiguous(), v_cache=paged["v_cache"][:, :8].contiguous())
    return [
        (dict(pages_8), ValueError, "page_size"),
        (dict(paged, block_table=paged["block_table"].long()), TypeError, "block_table"),
        (dict(good, cache_seqlens=good["cache_seqlens"].long()), TypeError, "cache_seqlens"),
        (dict(good, cache_seqlens=good["cache_seqlens"][:1]), ValueError, "cache_seqlens"),
        (dict(good, q=torch.randn(2, 17, 4, 16), k_new=None, v_new=None), ValueError, "S_q"),
        (dict(good, q=torch.randn(2, 2, 5, 16)), ValueError, "heads"),
        (dict(good, q=torch.randn(2, 2, 4, 12)), ValueError, "head dim"),
        (dict(good, q=torch.randn(2, 2, 4, 264)), ValueError, "head dim"),
        (dict(good, k_new=good["k_new"][:, :1]), ValueError, "k_new"),
        (dict(good, k_cache=good["k_cache"].clone().requires_grad_(True)), ValueError, "require grad"),
        (dict(good, v_new=None), ValueError, "k_new and v_new"),
        (dict(good, q=good["q"].half()), TypeError, "dtype"),
        (dict(good, k_cache=good["k_cache"][:1], v_cache=good["v_cache"][:1]), ValueError, "batch"),
        (dict(good, v_cache=good["v_cache"][:, :16]), ValueError, "v_cache"),
        (dict(good, k_cache=good["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "contiguous"),
        (dict(good, num_splits=0), ValueError, "num_splits"),
        (dict(good, window=(2,)), TypeError, "window"),
        (dict(good, softcap=-1.0), ValueError, "softcap"),
        (dict(good, softcap=float("inf")), ValueError, "softcap"),
        (dict(good, scale=float("nan")), ValueError, "scale"),
        # one prompt's cache expanded over the batch: every row's append would land on row 0's
        # slots (row 0's output 0.85 off, a helper's audit, s36)
        (dict(good, k_cache=good["k_cache"][:1].expand(2, -1, -1, -1)), ValueError, "k_cache is written in place"),
        (dict(good, v_cache=good["v_cache"][:1].expand(2, -1, -1, -1)), ValueError, "v_cache is written in place"),
    ]

@pytest.fixture
def checked_decode(monkeypatch, small_tiles):
    """Counts the calls that take the checked path (they run _check_inputs)."""
    return count_calls(monkeypatch, ad, "_check_inputs")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
def test_fast_path_repeats_the_checked_launch(paged, append, return_lse, checked_decode):
    """The second call of a layout skips the checks and launches what the first launched: the same
    out (and lse) bitwise, the append rewritten in place with the cache's version bumped; new
    values of q give the reference's answer, not a stale one."""
    length = 50
    inp = _case(3, 2, 4, 2, length, 16, torch.float32, _seqlens(3, length, 2, append), append)
    run = _clone(_paged(inp, 16) if paged else inp)
    first = attention_decode(**run, return_lse=return_lse, num_splits=2)
    assert len(checked_decode) == 1 and len(ad._FAST) == 1
    version = run["k_cache"]._version
    again = attention_decode(**run, return_lse=return_lse, num_splits=2)
    assert len(checked_decode) == 1, "the repeated call took the checked path"
    for a, b in zip(first if return_lse else (first,), again if return_lse else (again,)):
        assert torch.equal(a, b)
    assert run["k_cache"]._version > version or not append
    run["q"].copy_(torch.randn_like(run["q"]))
    inp["q"].copy_(run["q"])
    out = attention_decode(**run, return_lse=return_lse, num_splits=2)
    ref = attention_decode_reference(**_f64(inp), return_lse=return_lse, num_splits=2)
    assert len(checked_decode) == 1
    assert rel_err(out[0] if return_lse else out, ref[0] if return_lse else ref) <= 1e-5


def test_fast_path_keys_layouts_and_options(checked_decode):
    """Other options or layouts after a cached call are checked again (bad input still raises);
    a list window (unhashable) always takes the checked path."""
    length = 40
    inp = _case(2, 1, 4, 2, length, 16, torch.float32, [length, 17], False)
    attention_decode(**inp)
    attention_decode(**inp, window=(8, 0))                # another option: its own entry
    with pytest.raises(TypeError, match="causal"):
        attention_decode(**inp, causal=1)                 # == True, but not a bool: checked, refused
    assert len(checked_decode) == 3 and len(ad._FAST) == 2
    with pytest.raises(TypeError):
        attention_decode(**dict(inp, cache_seqlens=inp["cache_seqlens"].long()))
    with pytest.raises(TypeError):
        attention_decode(**inp, return_lse=1)
    for _ in range(2):
        out = attention_decode(**inp, window=[8, 0])
    assert len(checked_decode) == 7 and len(ad._FAST) == 2
    ref = attention_decode_reference(**_f64(inp), window=(8, 0))
    assert rel_err(out, ref) <= 1e-5
    attention_decode(**inp, window=(1, 0))
    for window in ((8.0, 0), (True, 0), (1.0, 0)):        # == cached windows, but not ints: refused
        with pytest.raises(TypeError, match="window"):
            attention_decode(**inp, window=window)





@pytest.mark.parametrize("i", range(22))
def test_bad_input(i):
    kwargs, exc, match = _bad_inputs()[i]
    before = kwargs["k_cache"].detach().clone()
    with pytest.raises(exc, match=match):
        attention_decode(**kwargs)
    assert torch.equal(kwargs["k_cache"].nan_to_num(), before.nan_to_num())   # raised before any write


# ----------------------------------------------------------------------------------------------
# GPU: bench-sized bf16 shapes, CUDA graphs
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [None, 16, 256])
@pytest.mark.parametrize("shape", [(16, 1, 32, 8, 8192, 128), (1, 1, 32, 8, 131072, 128), (2, 4, 32, 4, 5000, 128),
                                   (3, 16, 64, 8, 3000, 256), (4, 2, 28, 4, 2000, 72)])
def test_gpu_large_bf16(shape, paged):
    batch, s_q, h_q, h_kv, length, d = shape
    seqlens = [length - s_q] + torch.randint(1, length - s_q, (batch - 1,)).tolist()
    inp = _case(batch, s_q, h_q, h_kv, length, d, torch.bfloat16, seqlens, append=True)
    if paged:
        inp = _paged(inp, paged)
    _check(inp, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_capture(paged):
    """Captured once; new q, k_new, cache_seqlens and block table values replayed without a
    re-capture give the eager answer (nothing was baked in from the values at capture time)."""
    batch, s_q, h_q, h_kv, length, d = 4, 2, 16, 4, 4096, 128
    inp = _case(batch, s_q, h_q, h_kv, length, d, torch.bfloat16, [100, 2000, 7, length - s_q], append=True)
    if paged:
        inp = _paged(inp, 64)
    static = _clone(inp)
    attention_decode(**_clone(inp))                    # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention_decode(**_clone(static))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attention_decode(**static)
    for seqlens in ([3000, 1, 0, 50], [length - s_q] * batch):
        fresh = _case(batch, s_q, h_q, h_kv, length, d, torch.bfloat16, seqlens, append=True)
        if paged:
            fresh = _paged(fresh, 64)
        for name, t in fresh.items():
            static[name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        expected = attention_decode(**_clone(fresh))
        torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
        ref = attention_decode_reference(**_f64(fresh))
        assert rel_err(static_out, ref) <= 1e-2


@pytest.mark.gpu
def test_gpu_split_partials_reuse_a_workspace(monkeypatch):
    """Split-KV partials come from a buffer reused per (stream, thread, shapes) when outputs are not
    poisoned (the default): back-to-back calls on new values, without a sync between them, on the
    default and on a side stream, give bitwise the answers of fresh (NaN-poisoned) buffers."""
    from tilefuse import _dispatch

    batch, s_q, h_q, h_kv, length, d = 2, 1, 32, 8, 32768, 128
    cases = [_case(batch, s_q, h_q, h_kv, length, d, torch.bfloat16, lens, append=False)
             for lens in ([length, 5], [17, length], [length // 2, 3])]
    fresh = [attention_decode(**_clone(c), num_splits=16) for c in cases]       # poisoned: fresh buffers
    monkeypatch.setattr(_dispatch, "POISON_OUTPUTS", False)
    _dispatch.clear_workspaces()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            outs = [attention_decode(**_clone(c), num_splits=16) for c in cases]   # no sync between
        torch.cuda.synchronize()
        for out, expected in zip(outs, fresh):
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # per stream, reused by the calls: the partials' buffer and the lse's (not returned here)
    assert len(_dispatch._WORKSPACES) == 4


def test_cache_values_are_checked_on_cpu():
    """Page ids outside the cache among the pages a row uses, a negative length or keys past the
    capacity: a ValueError naming the row on CPU tensors (the kernels read and the append wrote
    outside the cache through a bad id, s37 audit); -1 padding past the used pages stays fine."""
    i32 = (lambda *x: torch.tensor(x, dtype=torch.int32, device=DEVICE))
    kp, vp = torch.zeros(4, 16, 1, 16, device=DEVICE), torch.zeros(4, 16, 1, 16, device=DEVICE)
    q, kn = torch.randn(1, 1, 2, 16, device=DEVICE), torch.ones(1, 1, 1, 16, device=DEVICE)
    if DEVICE == "cpu":
        for lens, table, new, match in ((20, (0, 7), True, "page ids"), (20, (0, -1), False, "page ids"),
                                        (32, (0, 1), True, "capacity"), (-3, (0, 1), False, "capacity")):
            with pytest.raises(ValueError, match=f"{'block_table' if match == 'page ids' else 'cache_seqlens'}"):
                attention_decode(q, kp, vp, i32(lens), block_table=i32(*table).view(1, 2),
                                 k_new=kn if new else None, v_new=kn if new else None)
    out = attention_decode(q, kp, vp, i32(10), block_table=i32(2, -1).view(1, 2))
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_append_kernel_never_writes_through_a_bad_page_id():
    """The append kernel itself (the GPU path does not read the values on the host): a page id
    outside [0, num_pages) writes nothing, in memory past the cache included."""
    big_k, big_v = torch.zeros(8, 16, 1, 16, device=DEVICE), torch.zeros(8, 16, 1, 16, device=DEVICE)
    kn = torch.ones(1, 2, 1, 16, device=DEVICE)
    table = torch.tensor([[0, 7]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([15], dtype=torch.int32, device=DEVICE)     # slot 15 of page 0, slot 0 of "page 7"
    ad._launch_append(big_k[:4], big_v[:4], kn, kn, lens, table)
    assert big_k[0, 15].eq(1).all() and big_v[0, 15].eq(1).all()
    assert not big_k[4:].any() and not big_v[4:].any() and big_k[:4].sum() == 16


def test_fast_path_keeps_refusing_grad_requiring_caches():
    """An append into caches that require grad (under grad mode) is refused on every call: the
    refusal ran on the checked path only, and once a call of the same layout was cached the
    append wrote into the grad-requiring leaves (s43 audit)."""
    inp = _case(2, 1, 4, 2, 32, 16, torch.float32, [5, 9], append=True)
    attention_decode(**_clone(inp))                      # this layout's fast path exists
    for _ in range(2):
        run = _clone(inp)
        run["k_cache"].requires_grad_(True)
        with pytest.raises(ValueError, match="require grad"):
            attention_decode(**run)
        assert run["k_cache"]._version == 0
    with torch.no_grad():                                 # inference: fine
        attention_decode(**run)


def test_append_refuses_overlapping_caches():
    """k_cache and v_cache views that share slots: the append kernel writes k then v per block of
    heads, so a later block's k overwrote an earlier block's v (0.66 off against torch's order,
    s43 audit); refused on the checked and the fast path. A packed [B, L, 2, H, D] cache's k and v
    slices and one tensor for both stay allowed, and match the reference on both paths."""
    batch, length, h_kv, d = 1, 16, 4, 16
    inp = _case(batch, 1, 4, h_kv, length, d, torch.float32, [3], append=True)
    for make in [lambda buf: (buf[:, :, 0:4], buf[:, :, 2:6]), lambda buf: (buf[:, :, 2:6], buf[:, :, 0:4])]:
        # the same views of two buffers first: disjoint, and this layout's fast path is made
        k0, _ = make(torch.randn(batch, length, 6, d, device=DEVICE))
        _, v0 = make(torch.randn(batch, length, 6, d, device=DEVICE))
        attention_decode(**dict(_clone(inp), k_cache=k0, v_cache=v0))
        k_cache, v_cache = make(torch.randn(batch, length, 6, d, device=DEVICE))
        with pytest.raises(ValueError, match="overlap"):
            attention_decode(**dict(_clone(inp), k_cache=k_cache, v_cache=v_cache))
    for _ in range(2):                                    # checked path, then fast path
        kv = torch.randn(batch, length, 2, h_kv, d, device=DEVICE)
        ref_kv = kv.double().clone()
        run = dict(_clone(inp), k_cache=kv[:, :, 0], v_cache=kv[:, :, 1])
        out = attention_decode(**run)
        ref = attention_decode_reference(**dict(_f64(inp), k_cache=ref_kv[:, :, 0], v_cache=ref_kv[:, :, 1]))
        assert rel_err(out, ref) <= 1e-5
        assert torch.equal(kv[0, 3, 0], inp["k_new"][0, 0]) and torch.equal(kv[0, 3, 1], inp["v_new"][0, 0])
    one = torch.randn(batch, length, h_kv, d, device=DEVICE)
    attention_decode(**dict(_clone(inp), k_cache=one, v_cache=one))    # one tensor for both: torch's order
    assert torch.equal(one[0, 3], inp["v_new"][0, 0])
