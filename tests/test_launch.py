"""tilefuse._launch.fast_launch: the cached launch path computes what Triton's own path does."""

import weakref

import pytest
import torch

from tilefuse import _address_memo, _launch
from tilefuse.ops import softmax as sm
from tilefuse.testing import rel_err


def test_arg_key_separates_what_triton_specializes():
    k = _launch._arg_key
    assert k(1) != k(17) and k(16) != k(32 + 1) and k(2**31) != k(2**31 - 16)
    assert k(32) == k(48)                               # same specialization: may share a kernel
    assert k(True) != k(False) and k(1.0) == k(2.5)
    a = torch.empty(64, dtype=torch.float16)
    assert k(a) != k(a.to(torch.float32))
    assert k(a[1:]) != k(a)                              # 2-byte offset: no longer 16-byte aligned


def test_arg_key_of_gluon_descriptors():
    """A Gluon host descriptor keys on what its kernel signature holds (dtype, block, layout), not
    on the tensor's address or shape, and the key is hashable."""
    from tilefuse.ops._fp8_gluon import _descriptor
    a, b = torch.empty(256, 128, dtype=torch.float8_e4m3fn), torch.empty(512, 256, dtype=torch.float8_e4m3fn)
    ka, kb = _launch._arg_key(_descriptor(a, (64, 128))), _launch._arg_key(_descriptor(b, (64, 128)))
    assert ka == kb and hash(ka) == hash(kb)
    assert _launch._arg_key(_descriptor(a, (128, 128))) != ka
    assert _launch._arg_key(_descriptor(a.view(torch.float8_e5m2), (64, 128))) != ka


def test_address_memo_keeps_the_second_sighting_and_passes_addresses(monkeypatch):
    """AddressMemo (on the CPU, with a stand-in kernel): a key is bound the second time it is seen,
    a hit calls the C launcher with the tensors as their addresses, descriptors in their encoded
    form, the prepared integers and the kernel's fixed parameters, on its device's current stream;
    a kernel with a global scratch buffer gets one of programs × CTAs × its size for that stream;
    a profiler's launch hooks send it back to Triton's path; ``limit`` entries, then it starts
    over; a kernel it cannot call directly turns it off."""
    calls, scratch_asks = [], []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(_address_memo, "_tma_scratch", lambda size, align, stream: scratch_asks.append((size, align, stream))
                        or "scratch")
    launcher = lambda *args: calls.append(args)     # noqa: E731

    class CudaLauncher:         # Triton's, for a kernel with device-side descriptors
        launch, num_ctas, global_scratch_size, global_scratch_align = staticmethod(launcher), 1, 128, 64
        profile_scratch_size, launch_cooperative_grid, launch_pdl = 0, False, False

    class Compiled:
        function, packed_metadata, run = 77, ("meta",), CudaLauncher()

    entry = (Compiled, ["rest"], _launch._DirectLaunch(launcher, False, True, ()))

    class Kernel:
        def prepared_entry(self, tensors, prepared):
            return entry

    x, y = torch.empty(8), torch.empty(8)
    prepared = _launch.PreparedArgs((11, 12), {}, 0)
    memo = _address_memo.AddressMemo(limit=2)
    key = (x.data_ptr(), y.data_ptr())
    assert not memo.launch(key)
    memo.keep(key, Kernel(), (5,), (x, y), prepared)
    assert len(memo) == 0 and not memo.launch(key)          # first sighting: only noted
    memo.keep(key, Kernel(), (5,), (x, y), prepared)
    assert len(memo) == 1 and memo.launch(key) and len(calls) == 1
    assert calls[0] == (5, 1, 1, 1003, 77, False, True, None, None, ("meta",), None, None, None,
                        x.data_ptr(), y.data_ptr(), 11, 12, "rest")
    # a Parameter operand is kept as its address too, not as the object: the launcher would read
    # the Parameter's storage at launch time (after `p.data = ...`, another tensor) and keep it alive
    p = torch.nn.Parameter(torch.empty(8))
    pkey = (x.data_ptr(), p.data_ptr())
    memo.keep(pkey, Kernel(), (5,), (x, p), prepared)
    memo.keep(pkey, Kernel(), (5,), (x, p), prepared)
    p_addr, p.data = p.data_ptr(), torch.empty(8)
    assert memo.launch(pkey) and calls[-1][13:16] == (x.data_ptr(), p_addr, 11)
    held = weakref.ref(p)
    del p
    assert held() is None
    memo = _address_memo.AddressMemo(limit=2)
    memo.keep(key, Kernel(), (5,), (x, y), prepared)
    memo.keep(key, Kernel(), (5,), (x, y), prepared)
    monkeypatch.setattr(_address_memo, "hooks_active", lambda: True)
    assert not memo.launch(key) and len(calls) == 2
    monkeypatch.setattr(_address_memo, "hooks_active", lambda: False)
    entry = (Compiled, ["rest"], None)                      # Triton's run with a global scratch buffer
    for other in [(1, 2), (3, 4)]:                           # a third key past the limit: start over
        memo.keep(other, Kernel(), (5, 2), (x, y), prepared)
        memo.keep(other, Kernel(), (5, 2), (x, y), prepared)
    assert len(memo) == 1 and not memo.launch(key)
    assert memo.launch((3, 4)) and scratch_asks == [(5 * 2 * 1 * 128, 64, 1003)]
    assert calls[-1][:9] == (5, 2, 1, 1003, 77, False, False, "scratch", None)
    monkeypatch.setattr(_address_memo, "MEMO_KEYS", 5)             # all memos together past their budget: start over
    monkeypatch.setattr(_address_memo, "_MEMO_HELD", [0])
    other = _address_memo.AddressMemo()
    for k in [(7, 1), (7, 2)]:
        other.keep(k, Kernel(), (5,), (x, y), prepared)
        other.keep(k, Kernel(), (5,), (x, y), prepared)
    assert len(other) == 2 and len(memo) == 1 and _address_memo._MEMO_HELD[0] == 4
    other.keep((7, 3), Kernel(), (5,), (x, y), prepared)     # the fifth tuple held: within budget
    other.keep((7, 4), Kernel(), (5,), (x, y), prepared)     # the sixth: every memo starts over
    assert len(other) == 0 and len(memo) == 0 and not other.launch((7, 1)) and _address_memo._MEMO_HELD[0] == 1
    CudaLauncher.profile_scratch_size = 16                   # a launcher it cannot call: off for good
    memo.keep(key, Kernel(), (5,), (x, y), prepared)
    memo.keep(key, Kernel(), (5,), (x, y), prepared)
    assert memo.off and len(memo) == 0


@pytest.mark.gpu
def test_cached_launches_match_triton_path(monkeypatch):
    """Alternate shapes whose specialization differs (n_cols == 1, % 16, misaligned rows) through
    the cache; every result must match the reference, i.e. no kernel is reused across keys.
    softmax's launcher takes the prepared path: the kernel is called through ``[grid]`` here with
    the same arguments, so both caches are checked."""
    base = torch.randn(4097 * 65, device="cuda", dtype=torch.float16)
    cases = [(64, 1), (64, 16), (33, 1000), (64, 4096), (7, 17)]
    for _ in range(2):                                  # second round: all cache hits
        for rows, cols in cases:
            for offset in (0, 1):                       # offset 1: a 2-byte misaligned view
                x = base[offset:offset + rows * cols].view(rows, cols)
                ref = torch.softmax(x.double(), -1)
                plan = sm._fwd_plan(rows, cols, x.stride(0), False)
                y = torch.empty_like(x)
                sm.softmax_fwd_fused_kernel[plan.grid](x, y, *plan.prepared.ints, **plan.prepared.kwargs)
                assert rel_err(y, ref) <= 2e-3, (rows, cols, offset)
                assert rel_err(sm._launch_fwd(x, False), ref) <= 2e-3, (rows, cols, offset)
    assert len(sm.softmax_fwd_fused_kernel._cache) >= len(cases)
    assert len(sm.softmax_fwd_fused_kernel._prepared_cache) >= len(cases)


def test_prepared_args_key_their_integers_once():
    from tilefuse.ops.rope import rope_kernel

    prepared = rope_kernel.prepare((1, 17, 2**31), {"TOKENS": 2, "num_warps": 4})
    k = _launch._arg_key
    assert prepared.ints == (1, 17, 2**31)
    assert prepared.key == _launch.key_token(((k(1), k(17), k(2**31)), (("TOKENS", 2), ("num_warps", 4))))
    assert rope_kernel.prepare((1, 17, 2**31), {"TOKENS": 2, "num_warps": 4}).key == prepared.key
    for other in [((1, 16, 2**31), {"TOKENS": 2, "num_warps": 4}), ((1, 17, 2**31 - 1), {"TOKENS": 2, "num_warps": 4}),
                  ((1, 17, 2**31), {"TOKENS": 4, "num_warps": 4}), ((1, 17, 2**31), {"TOKENS": 2})]:
        assert rope_kernel.prepare(*other).key != prepared.key, other    # every part of the key counts


@pytest.mark.gpu
def test_prepared_launches_match_reference():
    """rope's prepared launches (the integers keyed once per plan, tensors per call): shapes,
    layouts and a 2-byte-misaligned q alternate through the cache over two rounds; every result
    must match the reference."""
    from tilefuse import rope
    from tilefuse.ops.rope import rope_cos_sin_table, rope_kernel, rope_reference

    base = torch.randn(2 * 33 * 8 * 64 + 1, device="cuda", dtype=torch.float16)
    for _ in range(2):
        for seq, heads, offset, layout in ((33, 8, 0, "bshd"), (33, 8, 1, "bshd"), (16, 4, 0, "bhsd"), (1, 1, 1, "bshd")):
            n = 2 * seq * heads * 64
            shape = (2, seq, heads, 64) if layout == "bshd" else (2, heads, seq, 64)
            q = base[offset:offset + n].view(shape)
            k = torch.randn(shape, device="cuda", dtype=torch.float16)
            cos, sin = rope_cos_sin_table(seq, 64, dtype=torch.float16, device="cuda")
            out = rope(q, k, cos, sin, layout=layout)
            ref = rope_reference(q.double(), k.double(), cos.double(), sin.double(), layout=layout)
            for o, r in zip(out, ref):
                assert rel_err(o, r) <= 2e-3, (seq, heads, offset, layout)
    assert len(rope_kernel._prepared_cache) >= 3


def test_host_descriptors_cached_by_view_and_not_owning():
    """Gluon host descriptors (``host_descriptor``): the same address and view give the same
    cached object, another view or block another one; a cached descriptor keeps the address, not
    the tensor (its memory is freed with the tensor); its launch key equals the uncached one's
    except for the layout, which is a token of the layout's value."""
    import gc
    import weakref

    from tilefuse.ops._gluon_common import host_descriptor, smem_layout

    x = torch.randn(4, 64, 32, dtype=torch.float16)
    layout = smem_layout((1, 16, 32), torch.float16)
    d1 = host_descriptor(x, (4, 64, 32), (2048, 32, 1), (1, 16, 32), layout)
    assert host_descriptor(x, (4, 64, 32), (2048, 32, 1), (1, 16, 32), layout) is d1
    assert host_descriptor(x, (4, 32, 32), (2048, 32, 1), (1, 16, 32), layout) is not d1      # another view
    other = smem_layout((1, 32, 32), torch.float16)
    d2 = host_descriptor(x, (4, 64, 32), (2048, 32, 1), (1, 32, 32), other)
    assert d2 is not d1 and d2.launch_key != d1.launch_key
    assert d1.base.data_ptr() == x.data_ptr() and d1.base.dtype == x.dtype
    assert d1.launch_key[:3] == ("d", torch.float16, (1, 16, 32)) and _launch._arg_key(d1) is d1.launch_key
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None          # the cache did not keep the tensor


@pytest.mark.gpu
def test_direct_launch_with_cached_descriptors():
    """Hits call the C launcher directly (``_DirectLaunch``) with each cached descriptor's encoded
    CUtensorMap: the tl attention forward (host descriptors, S below the Gluon kernel's range)
    over shapes, head counts and fresh buffers (new addresses, and old addresses reused with other
    views), two rounds, every result against the reference."""
    from tilefuse import attention
    from tilefuse.ops._attention_common import attention_reference
    from tilefuse.ops._attention_fwd_kernels import attention_fwd_kernel

    cases = [(1, 128, 2, 64), (2, 200, 4, 64), (1, 77, 2, 128), (3, 128, 1, 64)]
    # only this test's launches: other tests in the same worker may have cached pointer-load plans
    attention_fwd_kernel._prepared_cache.clear()
    for _ in range(2):
        for b, s, h, d in cases:
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
            out = attention(q, k, v, causal=True)
            ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
            assert rel_err(out, ref) <= 2e-3, (b, s, h, d)
    entries = list(attention_fwd_kernel._prepared_cache.values())     # the forward's plan launches
    assert entries and all(direct is not None and direct.descs for _, _, direct in entries)
    encoded = [d for d in _launch._HOST_DESCRIPTORS.values() if d.launch_key[3] is None and d.encoded]
    assert encoded                      # the tl descriptors kept their encoded form


def test_every_launch_path_makes_a_context_current_first(monkeypatch):
    """Triton's own launch path (the interpreter's; on a GPU fast launches off, as here, callable
    grids and a cache miss) calls ``ensure_thread_context`` before the kernel runs, so host TMA
    descriptors are never encoded on a thread without a current CUDA context (the autograd
    engine's device thread: test_matmul's test_gpu_gluon_gemm_first_in_a_fresh_backward). On a
    machine where CUDA was never initialized the function does nothing."""
    from conftest import DEVICE
    calls = []
    monkeypatch.setattr(_launch, "ensure_thread_context", lambda: calls.append(1))
    monkeypatch.setattr(_launch, "_ENABLED", False)
    x = torch.randn(4, 33, device=DEVICE)
    y = sm.softmax(x)
    assert calls and rel_err(y, torch.softmax(x.double(), -1)) <= 1e-5
    if not torch.cuda.is_available():
        monkeypatch.undo()
        _launch.ensure_thread_context()         # CUDA never initialized: returns without touching it
        assert not torch.cuda.is_initialized()
