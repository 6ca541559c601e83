"""The Gluon kernels compiled offline for sm_90 on the CPU (no GPU, no interpreter needed).

Gluon has no interpreter, so CI cannot run these kernels; it can compile them. Each config is
compiled to a cubin exactly as the launchers would launch it, and the result must keep what makes
the kernel fast and correct to launch: no register spills (the attention backward: scalars only),
``setmaxnreg`` between the warp groups (USETMAXREG in the SASS), shared memory within sm_90's
227 KB, and no ptxas notice that the wgmmas were serialized (which happens when a warp group reads
an accumulator while a wgmma that writes registers is in flight). Their results are checked on the
GPU (test_attention.py, test_attention_bwd.py, test_fp8.py). Each compile (and the import of the
Gluon modules) runs in a child process without TRITON_INTERPRET: under the interpreter the
kernels' @triton.jit helpers are interpreted functions, which do not compile. One ``tl`` kernel is
here for a property the interpreter cannot see: the cross-entropy rows kernel's register budget.
"""

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type

gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")

NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _compile_sm90(kernel, args: dict, constexprs: dict, maxnreg: int):
    """cubin of ``kernel`` (a Gluon JIT function, possibly behind fast_launch) for the given
    runtime argument values (their types make the signature) and constexprs."""
    names = [p.name for p in kernel.params]
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in names}
    # tensors are 16-byte aligned, as the launcher's specialization sees them (vectorized accesses)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if isinstance(args.get(name), torch.Tensor)}
    src = gluon_runtime.GluonASTSource(fn=kernel, signature=signature, attrs=aligned,
                                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))


def _spill_bytes(report: str) -> int:
    """Spill stores + loads of a ptxas -v report (0 when it names none)."""
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return int(m.group(1)) + int(m.group(2)) if m else 0


def _ptxas_and_sass(compiled) -> tuple[str, str]:
    """(ptxas -v report, SASS) of a compiled kernel's PTX, assembled for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = subprocess.run([os.path.join(NVIDIA_BIN, "ptxas"), "--gpu-name", "sm_90a", "-v", ptx, "-o", cubin],
                               capture_output=True, text=True)
        assert ptxas.returncode == 0, ptxas.stderr
        sass = subprocess.run([os.path.join(NVIDIA_BIN, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True).stdout
    return ptxas.stdout + ptxas.stderr, sass


def _check(compiled, spill_below: int = 1):
    """``spill_below``: the kernel must spill fewer bytes than this (stores + loads)."""
    from tilefuse.ops._gluon_common import SMEM_BYTES
    report, sass = _ptxas_and_sass(compiled)
    assert _spill_bytes(report) < spill_below, report
    assert "serialized" not in report, report
    assert "USETMAXREG" in sass                 # the register split between the warp groups
    assert compiled.metadata.shared <= SMEM_BYTES


ATTN_CASES = {   # name: (D, BLOCK_N, STAGES, masks, softcap, exp2 parts on the FMA pipe)
    "d128-full": (128, 128, 3, (False, False), False, 8),
    "d128-causal": (128, 128, 3, (False, True), False, 0),
    "d64-window-softcap": (64, 128, 3, (True, True), True, 0),
    "d128-n64-stages2": (128, 64, 2, (False, True), False, 0),
}


def _in_child(kind: str, case: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, kind, case], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), (run.stdout + run.stderr)[-3000:]


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention_forward_compiles_for_sm90(case):
    _in_child("attention", case)


BWD_CASES = {   # name: (D, BLOCK_M, STAGES, masks, softcap)
    "d128-full": (128, 64, 3, (False, False), False),
    "d128-causal": (128, 64, 3, (False, True), False),
    "d64-window-softcap": (64, 64, 3, (True, True), True),
    "d64-m128-stages2": (64, 128, 2, (False, True), False),
}


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_attention_backward_compiles_for_sm90(case):
    _in_child("attention-bwd", case)


DQ_CASES = {   # name: (D, BLOCK_N, STAGES, masks, softcap)
    "d128-full": (128, 64, 4, (False, False), False),
    "d128-causal": (128, 64, 4, (False, True), False),
    "d64-causal": (64, 128, 4, (False, True), False),
    "d64-window-softcap": (64, 64, 4, (True, True), True),
}


@pytest.mark.parametrize("case", list(DQ_CASES))
def test_attention_dq_compiles_for_sm90(case):
    _in_child("attention-dq", case)


@pytest.mark.parametrize("case", ["bf16", "rowwise-bias-fp32"])
def test_fp8_gemm_compiles_for_sm90(case):
    _in_child("fp8", case)


def compile_attention(case):
    from tilefuse.ops import _attention_fwd_gluon as attn
    from tilefuse.ops._gluon_common import consumer_regs
    d, block_n, stages, (left, right), softcap, parts = ATTN_CASES[case]
    q = torch.empty(2, 300, 4, d, dtype=torch.bfloat16)
    kv = torch.empty(2, 500, 2, d, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 300)
    launch_regs, worker_regs = consumer_regs(attn.CONSUMER_GROUPS)
    args = dict(q_desc=attn._descriptor(q, attn.ROWS_PER_GROUP), k_desc=attn._descriptor(kv, block_n),
                v_desc=attn._descriptor(kv, block_n), o_desc=attn._descriptor(q, attn.ROWS_PER_GROUP), lse_ptr=lse,
                stride_lb=lse.stride(0), stride_lh=lse.stride(1), seqlen_q=300, seqlen_k=500, n_heads_q=4,
                group_size=2, score_scale=0.1, softcap_log2=1.5, window_left=7, window_right=0)
    constexprs = dict(HAS_LEFT=left, HAS_RIGHT=right, HAS_SOFTCAP=softcap, FOLD_SCALE=True, EXP2_FMA_PARTS=parts,
                      REVERSE_M=right, STAGES=stages, CONSUMERS=attn.CONSUMER_GROUPS, CONSUMER_REGS=worker_regs)
    _check(_compile_sm90(attn.attention_fwd_ws_kernel, args, constexprs, launch_regs))


def compile_attention_bwd(case):
    from tilefuse.ops import _attention_bwd_gluon as bwd
    from tilefuse.ops._attention_fwd_gluon import _descriptor
    from tilefuse.ops._gluon_common import consumer_regs
    d, block_m, stages, (left, right), softcap = BWD_CASES[case]
    q = torch.empty(2, 300, 4, d, dtype=torch.bfloat16)
    kv = torch.empty(2, 500, 2, d, dtype=torch.bfloat16)
    stat = torch.empty(4, 600)
    launch_regs, worker_regs = consumer_regs(bwd.CONSUMER_GROUPS, bwd.LOADER_REGS, cap=240)
    rows = bwd.KEYS_PER_GROUP
    args = dict(q_desc=_descriptor(q, block_m), do_desc=_descriptor(q, block_m), k_desc=_descriptor(kv, rows),
                v_desc=_descriptor(kv, rows), dk_desc=_descriptor(kv, rows), dv_desc=_descriptor(kv, rows),
                lse_desc=bwd._stat_descriptor(stat, 600, block_m), delta_desc=bwd._stat_descriptor(stat, 600, block_m),
                seqlen_q=300, seqlen_k=500, stat_seq=300, n_heads_kv=2, group_size=2, scale=0.1, score_scale=0.14,
                softcap=30.0, window_left=7, window_right=0)
    constexprs = dict(HAS_LEFT=left, HAS_RIGHT=right, HAS_SOFTCAP=softcap, STAGES=stages,
                      CONSUMERS=bwd.CONSUMER_GROUPS, CONSUMER_REGS=worker_regs)
    # Its consumer groups run at 240 registers, the most two groups can take, and ptxas spills a few
    # 32-bit scalars (wgmma descriptor addresses, reloaded from L1 once per query block: 28-164 B
    # stored + loaded in these cases). The bound is one thread's share of an fp32 [64, 64] tile
    # spilled (32 registers: 128 B stored and 128 loaded): a spilled tile would cost the tensor
    # core, a scalar does not.
    _check(_compile_sm90(bwd.attention_bwd_dkdv_ws_kernel, args, constexprs, launch_regs), spill_below=2 * 128)


def compile_attention_dq(case):
    from tilefuse.ops import _attention_dq_gluon as dqk
    from tilefuse.ops._attention_fwd_gluon import _descriptor
    from tilefuse.ops._gluon_common import consumer_regs
    d, block_n, stages, (left, right), softcap = DQ_CASES[case]
    q = torch.empty(2, 300, 4, d, dtype=torch.bfloat16)
    kv = torch.empty(2, 500, 2, d, dtype=torch.bfloat16)
    stat = torch.empty(4, 600)
    launch_regs, worker_regs = consumer_regs(dqk.CONSUMER_GROUPS)
    rows = dqk.ROWS_PER_GROUP
    args = dict(q_desc=_descriptor(q, rows), do_desc=_descriptor(q, rows), k_desc=_descriptor(kv, block_n),
                v_desc=_descriptor(kv, block_n), dq_desc=_descriptor(q, rows), lse2_ptr=stat, delta_ptr=stat,
                stat_stride=600, stat_seq=300, seqlen_q=300, seqlen_k=500, n_heads_q=4, group_size=2, scale=0.1,
                score_scale=0.14, softcap=30.0, window_left=7, window_right=0)
    constexprs = dict(HAS_LEFT=left, HAS_RIGHT=right, HAS_SOFTCAP=softcap, REVERSE_M=right, STAGES=stages,
                      CONSUMERS=dqk.CONSUMER_GROUPS, CONSUMER_REGS=worker_regs)
    _check(_compile_sm90(dqk.attention_bwd_dq_ws_kernel, args, constexprs, launch_regs))


def compile_fp8(case):
    from tilefuse.ops import _fp8_gluon as fp8
    from tilefuse.ops._gluon_common import consumer_regs
    rowwise_bias_fp32 = case == "rowwise-bias-fp32"
    a = torch.empty(512, 256, dtype=torch.float8_e4m3fn)
    b = torch.empty(384, 256, dtype=torch.float8_e4m3fn)
    out = torch.empty(512, 384, dtype=torch.float32 if rowwise_bias_fp32 else torch.bfloat16)
    cfg = fp8.WS_CONFIG
    launch_regs, worker_regs = consumer_regs(fp8.CONSUMER_GROUPS)
    rows = fp8.ROWS_PER_GROUP
    args = dict(a_desc=fp8._descriptor(a, (rows, cfg["BLOCK_K"])), b_desc=fp8._descriptor(b, (cfg["BLOCK_N"], cfg["BLOCK_K"])),
                c_desc=fp8._descriptor(out, (rows, cfg["BLOCK_N"])), scale_a_ptr=torch.empty(512),
                scale_b_ptr=torch.empty(384), bias_ptr=torch.empty(384, dtype=torch.bfloat16), M=512, N=384, K=256)
    stages = fp8.fit_stages(cfg["STAGES"], fp8.CONSUMER_GROUPS, cfg["BLOCK_N"], cfg["BLOCK_K"], out.element_size())
    constexprs = dict(SCALE_A_ROWWISE=rowwise_bias_fp32, SCALE_B_ROWWISE=rowwise_bias_fp32, HAS_BIAS=rowwise_bias_fp32,
                      NUM_PROGRAMS=132, GROUP_M=cfg["GROUP_M"], STAGES=stages, PROMOTE_EVERY=cfg["PROMOTE_EVERY"],
                      CONSUMERS=fp8.CONSUMER_GROUPS, CONSUMER_REGS=worker_regs)
    _check(_compile_sm90(fp8.fp8_gemm_ws_kernel, args, constexprs, launch_regs))


GEMM_CASES = {   # name: (tile of _matmul_gluon_plan.WS_TILES, activation, bias / residual / preact, out dtype,
    # b K-major (x @ wᵀ) or row-major [K, N], [a M-major (aᵀ given)]); epilogue "bias": the bias alone
    "64x64-plain": ("64x64", "none", False, torch.bfloat16, True),
    "64x128-gelu-epilogue": ("64x128", "gelu", True, torch.bfloat16, True),
    "128x128-silu-epilogue-fp32": ("128x128", "silu", True, torch.float32, True),
    "64x64-row-major-b": ("64x64", "none", False, torch.bfloat16, False),
    "128x128-row-major-b-epilogue": ("128x128", "relu", True, torch.float16, False),
    "64x96-two-part-tile-epilogue": ("64x96", "gelu", True, torch.bfloat16, True),
    # the large-M tiles (_matmul_gluon_plan.LARGE_WS_TILES) with the epilogues choose_large_ws_tile gives them
    "large-128x256-bias-gelu": ("large-128x256", "gelu", "bias", torch.bfloat16, True),
    "large-128x256-a-m-major": ("large-128x256", "none", False, torch.bfloat16, False, True),
    "large-128x128-epilogue-fp32": ("large-128x128", "silu", True, torch.float32, True),
    # stream-K over the last waves (_stream_k), as _stream_k.stream_k_epilogue_ok admits it: 128x256
    # for a product with at most a bias (with bias + GELU it spills 360 bytes), 128x128 with any epilogue
    "large-128x256-plain-stream-k": ("large-128x256", "none", False, torch.bfloat16, True, False, True),
    "large-128x256-bias-stream-k": ("large-128x256", "none", "bias", torch.bfloat16, True, False, True),
    "large-128x256-row-major-b-stream-k": ("large-128x256", "none", False, torch.bfloat16, False, False, True),
    "large-128x256-a-m-major-stream-k": ("large-128x256", "none", False, torch.bfloat16, False, True, True),
    "large-128x128-epilogue-fp32-stream-k": ("large-128x128", "silu", True, torch.float32, True, False, True),
    # ping-pong (each consumer group on its own 128x128 tile: _matmul_gluon.gemm_pingpong_partition)
    "large-128x128-pingpong-bias-gelu": ("large-128x128-pingpong", "gelu", "bias", torch.bfloat16, True),
    "large-128x128-pingpong-a-m-major": ("large-128x128-pingpong", "none", False, torch.bfloat16, False, True),
    "large-128x128-pingpong-epilogue-fp32": ("large-128x128-pingpong", "silu", True, torch.float32, True),
    # fp8 operands with fast accumulation (_fp8_gemm's Gluon plan): 128-deep K steps, the dequantization
    # scales (SCALE_A, SCALE_B: 1 per tensor, 2 per row / column) in the epilogue and a stream-K head;
    # per-column scales beside a bias take 128x128 (at 128x256 the two [256] vectors spill ~300 bytes)
    "large-128x256-fp8-row-a-scales-bias": ("large-128x256", "none", "bias", torch.bfloat16, True, False, False,
                                            (2, 1)),
    "large-128x128-fp8-row-scales-bias": ("large-128x128", "none", "bias", torch.bfloat16, True, False, False, (2, 2)),
    "large-128x256-fp8-tensor-scales-stream-k": ("large-128x256", "none", "bias", torch.bfloat16, True, False, True,
                                                 (1, 1)),
    "large-128x256-fp8-row-scales-stream-k": ("large-128x256", "none", False, torch.bfloat16, True, False, True, (2, 2)),
    "large-128x128-fp8-fp32-out": ("large-128x128", "none", "bias", torch.float32, True, False, False, (2, 1)),
}


@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_small_m_gemm_compiles_for_sm90(case):
    _in_child("gemm", case)


def compile_gemm(case):
    """The Gluon small-M GEMM with each declared tile, as the launcher builds it: no spills, the
    ring and output tiles within shared memory, wgmma and TMA in the SASS."""
    from tilefuse.ops import _matmul_gluon as g
    from tilefuse.ops import _matmul_gluon_plan as gp
    tile, act, epilogue, out_dtype, b_k_major, *rest = GEMM_CASES[case]
    a_m_major, stream_k, scales = list(rest) + [False, False, (0, 0)][len(rest):]
    cfg = dict(gp.ACCUMULATE_TILES[tile.removeprefix("large-")] if tile.startswith("large-")
               else gp.WS_TILES.get(tile) or dict(gp.WS_TILES["64x128"], BLOCK_N=96))      # 96 = 64 + 32: two B parts
    m, n, k = 2000, 1000, 3000
    dtype = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
    if scales != (0, 0):        # fp8: K steps of the same bytes; 16-byte rows for TMA
        dtype, cfg["BLOCK_K"], k = torch.float8_e4m3fn, 2 * cfg["BLOCK_K"], 3008
    a, w = torch.empty(m, k, dtype=dtype), torch.empty(n, k, dtype=dtype)
    a_desc = gp._descriptor(a.t().contiguous(), (cfg["BLOCK_K"], gp.ROWS_PER_GROUP)) if a_m_major else \
        gp._descriptor(a, (gp.ROWS_PER_GROUP, cfg["BLOCK_K"]))
    out = torch.empty(m, n, dtype=out_dtype)
    launch_regs, worker_regs = gp.ws_regs(cfg["CONSUMERS"])
    rows = gp.ROWS_PER_GROUP
    bn1 = 1 << (cfg["BLOCK_N"].bit_length() - 1)
    bn2 = cfg["BLOCK_N"] - bn1
    w_t = w.t().contiguous()
    part = lambda width: (gp._descriptor(w, (width, cfg["BLOCK_K"])) if b_k_major  # noqa: E731
                          else gp._descriptor(w_t, (cfg["BLOCK_K"], width)))
    args = dict(a_desc=a_desc, b_desc=part(bn1), b2_desc=part(bn2 or bn1),
                c_desc=gp._descriptor(out, (rows, bn1)), c2_desc=gp._descriptor(out, (rows, bn2 or bn1)),
                bias_ptr=torch.empty(n, dtype=torch.bfloat16), residual_ptr=out, preact_ptr=out,
                scale_ptr=torch.empty(m), scale_b_ptr=torch.empty(n), ws_ptr=torch.empty(1, dtype=torch.float32), flag_ptr=torch.empty(1, dtype=torch.int32), M=m, N=n, K=k,
                stride_rm=n, stride_rn=1, stride_pm=n, sk_tiles=200 if stream_k else 0)
    stages = gp.fit_ring(cfg["STAGES"], cfg["CONSUMERS"], cfg["BLOCK_N"], cfg["BLOCK_K"], a.element_size(),
                         out.element_size(), cfg.get("PINGPONG", False))
    full = epilogue is True     # "bias": the bias alone (no residual / preact)
    constexprs = dict(HAS_BIAS=bool(epilogue), ACT=act, HAS_RESIDUAL=full, SAVE_PREACT=full, NUM_PROGRAMS=132,
                      GROUP_M=cfg["GROUP_M"], STAGES=stages, CONSUMERS=cfg["CONSUMERS"], CONSUMER_REGS=worker_regs,
                      B_K_MAJOR=b_k_major, HAS_B2=bn2 > 0, A_M_MAJOR=a_m_major, ACCUMULATE=False,
                      HAS_SCALE=False, SCALE_A=scales[0], SCALE_B=scales[1], STREAM_K=stream_k,
                      PINGPONG=cfg.get("PINGPONG", False))
    compiled = _compile_sm90(g.gemm_ws_kernel, args, constexprs, launch_regs)
    _check(compiled)
    sass = _ptxas_and_sass(compiled)[1]
    assert ("QGMMA" if scales != (0, 0) else "HGMMA") in sass       # QGMMA: sm_90's fp8 wgmma
    assert "UTMALDG" in sass and "UTMASTG" in sass
    # the fixup: the flag raised with a release, taken with an acquiring compare-and-swap, and the
    # producer's L2 prefetch of the partials before the collect (_stream_k.stream_k_prefetch)
    assert ("ATOM" in sass or "ATOMG" in sass) == stream_k
    assert ("UBLKPF.L2" in sass) == stream_k
    assert "globaltimer" not in compiled.asm["ptx"]      # _matmul_gluon.TRACE is compiled out by default


ACCUMULATE_CASES = {   # name: (tile of _matmul_gluon_plan.ACCUMULATE_TILES, a given as aᵀ [K, M], b as wᵀ, out +=)
    "128x256-a-m-major": ("128x256", True, False, True),
    "128x128-a-m-major": ("128x128", True, False, True),
    "128x256-row-major-a-k-major-b": ("128x256", False, True, True),
    "128x256-k-major-b-no-accumulator": ("128x256", False, True, False),    # linear cross-entropy's logits
    "128x256-a-m-major-scaled": ("128x256", True, False, "scaled"),         # its deferred last chunk
    "128x128-pingpong-a-m-major": ("128x128-pingpong", True, False, True),
    "128x128-pingpong-a-m-major-scaled": ("128x128-pingpong", True, False, "scaled"),
    "128x128-pingpong-k-major-b-no-accumulator": ("128x128-pingpong", False, True, False),
}


@pytest.mark.parametrize("case", list(ACCUMULATE_CASES))
def test_accumulate_gemm_compiles_for_sm90(case):
    _in_child("gemm-accumulate", case)


def compile_gemm_accumulate(case):
    """out += a @ b (the producer loads the old output tile): as launch_gemm_accumulate builds it,
    no spills, within shared memory, wgmma and TMA loads and stores in the SASS."""
    from tilefuse.ops import _matmul_gluon as g
    from tilefuse.ops import _matmul_gluon_plan as gp
    tile, a_m_major, b_k_major, accumulate = ACCUMULATE_CASES[case]
    cfg = gp.ACCUMULATE_TILES[tile]
    m, n, k = 1000, 768, 512
    a_t, b = torch.empty(k, m, dtype=torch.bfloat16), torch.empty(k, n, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    rows, bn, bk = gp.ROWS_PER_GROUP, cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = gp._descriptor(a_t, (bk, rows)) if a_m_major else gp._descriptor(a_t.t().contiguous(), (rows, bk))
    b_desc = gp._descriptor(b.t().contiguous(), (bn, bk)) if b_k_major else gp._descriptor(b, (bk, bn))
    c_desc = gp._descriptor(out, (rows, bn))
    launch_regs, worker_regs = gp.ws_regs(cfg["CONSUMERS"])
    args = dict(a_desc=a_desc, b_desc=b_desc, b2_desc=b_desc, c_desc=c_desc, c2_desc=c_desc, bias_ptr=out,
                residual_ptr=out, preact_ptr=out, scale_ptr=torch.empty(1), scale_b_ptr=out, ws_ptr=out, flag_ptr=out,
                M=m, N=n, K=k,
                stride_rm=n, stride_rn=1, stride_pm=n, sk_tiles=0)
    pingpong = cfg.get("PINGPONG", False)
    stages = gp.fit_ring(cfg["STAGES"], cfg["CONSUMERS"], bn, bk, 2, 2, pingpong)
    constexprs = dict(HAS_BIAS=False, ACT="none", HAS_RESIDUAL=False, SAVE_PREACT=False, NUM_PROGRAMS=132,
                      GROUP_M=cfg["GROUP_M"], STAGES=stages, CONSUMERS=cfg["CONSUMERS"], CONSUMER_REGS=worker_regs,
                      B_K_MAJOR=b_k_major, HAS_B2=False, A_M_MAJOR=a_m_major, ACCUMULATE=bool(accumulate),
                      HAS_SCALE=accumulate == "scaled", SCALE_A=0, SCALE_B=0, STREAM_K=False, PINGPONG=pingpong)
    compiled = _compile_sm90(g.gemm_ws_kernel, args, constexprs, launch_regs)
    _check(compiled)
    report, sass = _ptxas_and_sass(compiled)
    assert "HGMMA" in sass and "UTMALDG" in sass and "UTMASTG" in sass
    print(report.strip().splitlines()[-1], "stages", stages, "shared", compiled.metadata.shared)


INT4_MMA_CASES = {   # name: (x dtype, group, rows of x, WARPS_K, WARPS_N, REPS, GROUPS_PER_STEP, bound on the
    # kernel's SASS instructions per weight value: ~10 % over the count measured 2026-11-24)
    "bf16-g128-m1": (torch.bfloat16, 128, 1, 4, 1, 2, 1, 2.85),         # 2.59
    "fp16-g64-m16": (torch.float16, 64, 16, 2, 2, 2, 1, 4.2),           # 3.81
    "bf16-g32-m32-steps2": (torch.bfloat16, 32, 32, 4, 1, 1, 2, 8.2),   # 7.44
}


@pytest.mark.parametrize("case", list(INT4_MMA_CASES))
def test_int4_mma_compiles_for_sm90(case):
    _in_child("int4-mma", case)


def _compile_int4_plan(plan, dtype, g: int, m: int, n: int, k: int):
    """(ptxas report, SASS) of an int4 Gluon plan's kernel as the launcher launches it, with the
    specialization Triton makes on LLM shapes (16-byte aligned pointers, strides divisible by 16)."""
    meta = dict(plan.meta)
    num_warps = meta.pop("num_warps")
    kernel = plan.kernel.fn
    args = dict(x_ptr=torch.empty(m, k, dtype=dtype), qw_ptr=torch.empty(n, k // 2, dtype=torch.uint8),
                scales_ptr=torch.empty(n, k // g, dtype=dtype), zeros_ptr=torch.empty(n, k // g, dtype=torch.uint8),
                bias_ptr=torch.empty(n, dtype=dtype), y_ptr=torch.empty(m, n, dtype=dtype),
                partial_ptr=torch.empty(1), M=m, N=n, n_groups=k // g, groups_per_split=plan.chunks_per_split,
                stride_xm=k, stride_qw=k // 8, stride_sn=k // g, stride_ym=n)
    names = [p.name for p in kernel.params]
    constexprs = dict(meta, HAS_BIAS=True, SPLIT=plan.splits > 1)
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or (name.startswith("stride") and args[name] % 16 == 0)}
    src = gluon_runtime.GluonASTSource(fn=kernel, signature=signature, attrs=aligned,
                                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    report, sass = _ptxas_and_sass(compiled)
    assert _spill_bytes(report) == 0, report
    return report, sass


def _sass_count(sass: str) -> int:
    return len(re.findall(r"/\*[0-9a-f]{4}\*/\s+[@A-Z]", sass))


def compile_int4_mma(case):
    """The Gluon int4 kernel as the launcher builds it: compiling proves its register layouts are
    the MMA fragments (``convert_layout(..., assert_trivial=True)``), ptxas must not spill, and
    the kernel (unrolled steps, prologue and epilogue included) must issue about 3 instructions per
    weight value or fewer at group 128 (the point of the kernel)."""
    from tilefuse.ops import _quant_plan as quant_plan
    dtype, g, m, warps_k, warps_n, reps, gps, _ = INT4_MMA_CASES[case]
    n, k = 256, 8 * g * warps_k * gps                  # unsplit: 8 steps
    cfg = (("GROUPS_PER_STEP", gps), ("PATH", "mma"), ("REPS", reps), ("SPLITS", 1), ("WARPS_K", warps_k),
           ("WARPS_N", warps_n))
    plan = quant_plan.launch_plan(4, g, m, n, k, dtype, 132, cfg, True)
    _, sass = _compile_int4_plan(plan, dtype, g, m, n, k)
    # a thread's values: 2·REPS rows x GROUP/4 columns per group, GROUPS_PER_STEP groups a step
    per_value = _sass_count(sass) / (2 * reps * gps * g // 4 * plan.meta["STEPS"])
    print(f"{per_value:.2f} instructions per value")
    assert "HMMA" in sass and per_value < INT4_MMA_CASES[case][-1], per_value


INT4_WGMMA_CASES = {   # name: (x dtype, rows of x, config, bound on the kernel's SASS instructions per
    # weight value of its unrolled loop body, prologue and epilogue included: ~10 % over 2026-11-25's count)
    "bf16-m16-default": (torch.bfloat16, 16, (), 5.2),                                      # 4.72
    "fp16-m1-reps2": (torch.float16, 1, (("REPS", 2),), 4.15),                               # 3.75
    "bf16-m64-w8-chunk8": (torch.bfloat16, 64, (("CHUNK", 8), ("STAGES", 8), ("num_warps", 8)), 5.3),   # 4.80
}


@pytest.mark.parametrize("case", list(INT4_WGMMA_CASES))
def test_int4_wgmma_compiles_for_sm90(case):
    _in_child("int4-wgmma", case)


def compile_int4_wgmma(case):
    """The Hopper int4 kernel as the launcher builds it: the dequantized words are wgmma's A
    fragment (``assert_trivial``), no spills, no wgmma serialized by ptxas (its accumulator read
    while one is in flight), and a bound on instructions per weight value."""
    from tilefuse.ops import _quant_plan as quant_plan
    dtype, m, cfg, bound = INT4_WGMMA_CASES[case]
    n, k = 256, 8 * 128                                  # one program's 8 groups, unsplit
    plan = quant_plan.launch_plan(4, 128, m, n, k, dtype, 132, (("PATH", "wgmma"), ("SPLITS", 1)) + cfg, True, True)
    report, sass = _compile_int4_plan(plan, dtype, 128, m, n, k)
    assert "serialized" not in report, report
    reps = plan.meta["BLOCK_N"] // (16 * plan.meta["num_warps"])
    # static count over the unrolled loop body (CHUNK steps; a thread: 2·REPS rows x 32 columns a step)
    per_value = _sass_count(sass) / (2 * reps * 32 * plan.meta["CHUNK"])
    print(f"{per_value:.2f} instructions per value")
    assert "HGMMA" in sass and "LDGSTS" in sass and per_value < bound, per_value


CE_CASES = {"v128256-bf16": (128256, torch.bfloat16), "v32000-bf16": (32000, torch.bfloat16),
            "v256000-fp32": (256000, torch.float32)}


@pytest.mark.parametrize("case", list(CE_CASES))
def test_cross_entropy_rows_compile_for_sm90(case):
    _in_child("cross-entropy", case)


def compile_cross_entropy(case):
    """The gradient-writing cross-entropy kernel (a ``tl`` kernel) at its default looped config:
    its stats walk reduces inside each thread (no convert_layout or shared-memory staging in the
    TTGIR), no spills, and registers within 64K / (32 · num_warps), so that a program of 32 warps
    launches at all and one fits on an SM (the config's premise)."""
    from triton.compiler import ASTSource

    from tilefuse.ops import _cross_entropy_kernels as ce
    n_cols, dtype = CE_CASES[case]
    logits = torch.empty(4, n_cols, dtype=dtype)
    cfg = ce.default_config(n_cols, True, logits.element_size())
    kernel = ce.cross_entropy_fwd_kernel.fn
    args = dict(logits_ptr=logits, grad_ptr=logits, target_ptr=torch.empty(4, dtype=torch.int64),
                loss_ptr=torch.empty(4), scale_ptr=torch.empty(1), stats_ptr=torch.empty(4),
                skip_ptr=torch.empty((), dtype=torch.bool), logits_row_stride=n_cols, grad_row_stride=n_cols,
                scale_stride=0, n_rows=8192, n_cols=n_cols, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                softcap=1.0)
    constexprs = dict(HAS_SOFTCAP=False, HAS_SMOOTHING=False, HAS_Z_LOSS=False, HAS_SKIP=True, WRITE_GRAD=True,
                      SAVE_STATS=False, SINGLE_TILE=False, BLOCK_V=cfg["BLOCK_V"], STATS_EVICT=cfg["STATS_EVICT"],
                      GRAD_EVICT=cfg["GRAD_EVICT"], STORE_EVICT=cfg["STORE_EVICT"], VEC=16 // logits.element_size(),
                      PREFETCH=cfg["PREFETCH"], GRAD_PREFETCH=cfg["GRAD_PREFETCH"])
    names = [p.name for p in kernel.params]
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or (type(args.get(name)) is int and args[name] % 16 == 0)}
    src = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"]))
    ttgir = compiled.asm["ttgir"]
    assert "convert_layout" not in ttgir and "local_alloc" not in ttgir, "a layout conversion in the row walks"
    report, _ = _ptxas_and_sass(compiled)
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    print(f"{case}: BLOCK_V {cfg['BLOCK_V']}, {cfg['num_warps']} warps, {regs} registers")
    assert _spill_bytes(report) == 0, report
    assert regs <= 65536 // (32 * cfg["num_warps"]), report


if __name__ == "__main__":
    kind, name = sys.argv[1:]
    {"attention": compile_attention, "attention-bwd": compile_attention_bwd, "attention-dq": compile_attention_dq,
     "fp8": compile_fp8,
     "int4-mma": compile_int4_mma, "int4-wgmma": compile_int4_wgmma, "gemm": compile_gemm,
     "gemm-accumulate": compile_gemm_accumulate, "cross-entropy": compile_cross_entropy}[kind](name)
    print("OK")


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU mode")
def test_gluon_kernels_do_not_count_as_compiled_mode():
    """The CLI's interpreter check skips Gluon kernels (never interpreted, never launched off sm_90)."""
    import tilefuse.ops._attention_bwd_gluon  # noqa: F401
    import tilefuse.ops._attention_dq_gluon  # noqa: F401
    import tilefuse.ops._attention_fwd_gluon  # noqa: F401
    import tilefuse.ops._fp8_gluon  # noqa: F401
    import tilefuse.ops._matmul_gluon  # noqa: F401
    from tilefuse.cli import _kernels_compiled_mode
    assert not _kernels_compiled_mode()
