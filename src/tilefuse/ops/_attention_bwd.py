"""FlashAttention-2 backward: dq, dk, dv by recomputation, dense and varlen, no S×S buffer.

With ``P = exp(S - lse)`` recomputed tile by tile from the saved log-sum-exp (module docstring of
``_attention_common`` for S, the mask and softcap)::

    delta_i = Σ_d out[i, d] · do[i, d]                       (preprocess kernel, fp32)
    dV      = Pᵀ · dO
    dP      = dO · Vᵀ
    dS      = P ∘ (dP - delta) ∘ (1 - tanh²)                 (last factor only with softcap)
    dQ      = scale · dS · K,      dK = scale · dSᵀ · Q

Three launches: preprocess (delta, and lse turned into log2 units with ``-inf`` -> ``+inf`` so a
row that saw no key gets P = exp2(s - inf) = 0 exactly, never NaN), the dk/dv kernel (a program
per (key block, kv head, sequence) walks the query blocks of query_range() for each query head of
its GQA group, so dk/dv are summed in registers: no atomics) and the dq kernel (a program per
(query block, query head, sequence) walks key_range()). Nothing uses atomics: results are bitwise
reproducible, ``deterministic`` only documents that. On sm_90, dense 16-bit inputs with D = 64 /
128 take the warp-specialized Gluon dk/dv kernel (``_attention_bwd_gluon``; :func:`_use_gluon`):
same math and walk, its kernel time 11-31 % below the ``tl`` one's (H200, session 17), and at
D = 128 the warp-specialized Gluon dq kernel (``_attention_dq_gluon``, the Gluon forward's walk;
:func:`gluon_dq_default`: 18-24 % below the ``tl`` one's, session 21). The
statistics buffers are ``[H_q, B, stat_seq]`` (dense; stat_seq = S_q rounded up to 4 columns) or
``[H_q, total_q]``: every sequence's columns start on 16 bytes, as the Gluon kernel's TMA needs.

Masking costs only on boundary blocks: each loop knows its mask-free run of blocks (every (query,
key) pair visible) and applies visible() only outside it, through a uniform branch in one loop, or
(SPLIT_LOOPS, per kernel: split_loops_default) in a second loop over the edge blocks after a
mask-free loop with no mask code; both walk the same per-block body (_dkdv_block, _dq_block). Padded
query rows (past the sequence) carry lse = +inf, so they give P = 0 exactly without a mask; padded
key rows of the dk/dv kernel only touch dk/dv rows that are never stored; the dq kernel masks its
last partial key block (a zero-padded key has s = 0, whose exp may overflow against a very negative
lse).

Memory: delta and lse2, fp32 ``[H_q, rows]``: O(S). Launch configs are small named functions
(dkdv_config, dq_config). On sm_90+ the inner loops read their tiles through TMA descriptors built
in the kernel (zero fill past the sequence replaces the row masks; far fewer registers than
pointer loads); elsewhere, and for the interpreter unless a config asks for it, pointer loads.

FLOPs (FlashAttention's convention): 2.5 × the forward's 4·B·S_q·S_k·H·D, × 0.5 causal.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .._launch import PreparedArgs, config_key, use_device_descriptors
from .._dispatch import cdiv, contiguous_strides, device_major, empty, num_sms, packed_output, workspace
from ._attention_common import config_wants_gluon, schedule_grid
from ._attention_bwd_kernels import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_bwd_preprocess_kernel
from ._attention_fwd_kernels import head_block


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------


# Tiles below were chosen by ptxas -v register / spill counts on sm_90a (bf16, causal and not,
# compiled offline) pending GPU timings from scripts/attention_bwd_sweep.py: pointer loads keep a
# per-thread address per element of every pipelined tile, TMA loads none, so the TMA configs
# afford larger tiles without spilling.


def dkdv_config(d_pad: int, dtype: torch.dtype, use_tma: bool, masked: bool = False) -> dict:
    """dk/dv kernel: BLOCK_N1 keys keep two fp32 [BLOCK_N1, D] accumulators in registers, so the
    tiles shrink as D grows; BLOCK_M1 queries stream through shared memory per step. ``masked``:
    a window (causal included) applies, so the kernel carries mask code."""
    if d_pad > 128:                                                            # <= 32 B (TMA)
        return dict(BLOCK_M1=16, BLOCK_N1=64, num_warps=8, num_stages=2)
    if dtype == torch.float32:                  # the correctness path (ieee fp32 products)
        return dict(BLOCK_M1=32, BLOCK_N1=64, num_warps=8, num_stages=2)
    if d_pad <= 64:
        if use_tma:
            # 128 queries x 64 keys, 4 warps, 2 stages (H200 2026-11-24, bf16, B·S = 16k, S = 1k /
            # 4k / 16k, with the dq tiles below: 300 / 366 / 379 TF/s full, 202 / 304 / 349 causal,
            # against 292 / 350 / 370 and 206 / 298 / 341 for 64 x 64 with 3 stages; 3 stages of
            # the 128-query steps: 241-328 full)
            return dict(BLOCK_M1=128, BLOCK_N1=64, num_warps=4, num_stages=2)
        return dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=3)       # <= 12 B spilled
    # D = 128: 64 queries x 128 keys, 8 warps (H200 sweep with S_q / S_k specialized, bf16,
    # B·S = 16k, S = 4k / 16k: 365 / 366 TF/s full, 312 / 362 causal, against 315 / 297 and
    # 278 / 327 for the 32 x 128 tile the unspecialized kernels preferred on the H100). 3 stages
    # without a mask (2026-11-24, with the dq tiles below: 396 / 415 TF/s full against 383 / 378
    # at 2); with one, 2 stages and split loops (split_loops_default: 343 / 409 causal against
    # 345 / 384 at 3 stages split, 330 / 380 at 3 stages in one loop: the mask code spills)
    # dv_late (the mask-free loop's dv GEMM after dpᵀ's, so it overlaps dsᵀ) with TMA: dk/dv kernel
    # 8.19 -> 7.56 ms full and 4.13 -> 4.04 causal at S = 16k, 2.14 -> 2.00 full at 4k (H200,
    # 2026-11-24); at D = 64 with the 128 x 64 tile it doubled the time, 1.19 -> 2.15 ms full 4k
    if use_tma and not masked:           # (fp32 returned above)
        return dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=3, dv_late=True)
    return dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=2, dv_late=use_tma)


def split_loops_default(d_pad: int, dtype: torch.dtype, use_tma: bool, masked: bool) -> tuple[bool, bool]:
    """SPLIT_LOOPS of the (dk/dv, dq) kernels unless the config says. With a mask the dk/dv
    kernel's mask-free run in a loop without mask code pays (H200 2026-11-24, causal bf16, S = 16k:
    D = 128 4.19 vs 4.38 ms, D = 64 with its 128 x 64 tile 2.31 vs 2.49; it lost at D = 64 with the
    earlier 64 x 64 tile, 2.67 vs 2.59); the dq kernel's split ties at D = 128 and loses at D = 64
    (1.68 vs 1.45 ms)."""
    return (masked and use_tma and d_pad <= 128 and dtype != torch.float32), False


def dq_config(d_pad: int, dtype: torch.dtype, use_tma: bool) -> dict:
    """dq kernel: one fp32 [BLOCK_M2, D] accumulator plus the q and do tiles stay resident; the
    key / value tiles stream (BLOCK_N2 per step)."""
    if dtype == torch.float32 and d_pad > 128:
        # fp32 D = 256: 64 x 32 tiles need 262,152 B of shared memory with TMA (limit 232,448;
        # an H200 GPU test failed on it), 32 x 32 need 196,616 (offline sm_90 compiles)
        return dict(BLOCK_M2=32, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=2)
    if dtype == torch.float32 or d_pad > 128:
        return dict(BLOCK_M2=64, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=2)
    if not use_tma and d_pad > 64:
        return dict(BLOCK_M2=128, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=3)  # pointer tiles: registers
    # 128 queries x 64 keys, 8 warps, 3 stages at D = 64 and 128 with TMA (H200 2026-11-24, bf16,
    # B·S = 16k, S = 1k / 4k / 16k; dq kernel alone, µs: D = 128 full 383 / 1238 / 4611, causal
    # 273 / 739 / 2477 against 376 / 1355 / 5249 and 330 / 908 / 3118 for 128 x 32; D = 64 full
    # 202 / 699 / 2638 against 205 / 734 / 2839 for 64 x 64 with 4 warps)
    return dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3)


# dk/dv-kernel config keys only the tl kernel has: a config with any of them (and no "GLUON") keeps it
TL_ONLY_KEYS = ("BLOCK_M1", "BLOCK_N1", "num_warps", "num_stages", "split_loops", "split_loops_dkdv", "dv_late")


def _use_gluon(major: int, dtype: torch.dtype, head_dim: int, varlen: bool, use_tma: bool,
               config: dict | None) -> bool:
    """The warp-specialized Gluon dk/dv kernel (``_attention_bwd_gluon``) on sm_90 (``major``:
    the device's compute capability) for the inputs it serves; ``config={"GLUON": True / False}``
    forces the choice, tl-only tile keys (:data:`TL_ONLY_KEYS`) without "GLUON" keep the ``tl``
    kernel."""
    if major != 9:
        return False
    from ._attention_bwd_gluon import use_gluon_backward
    return use_gluon_backward(dtype, head_dim, varlen, use_tma) and config_wants_gluon(config, TL_ONLY_KEYS, True)


def gluon_dq_default(head_dim: int) -> bool:
    """The warp-specialized dq kernel with the Gluon dk/dv kernel at D = 128, the tl one at D = 64,
    where it stayed faster (H200, session 21, dq kernel µs at S = 1k / 4k / 16k, B·S = 16k, H = 16,
    tl -> Gluon: D = 128 full 407 / 1332 / 4940 -> 304 / 1051 / 4060, causal 277 / 783 / 2616 ->
    210 / 603 / 2038; D = 64 full 204 / 700 / 2668 -> 225 / 796 / 3023 with 128 keys a step,
    220 / 732 / 2860 with 64; -s21-attention-bwd-dq-ws-sweep.log)."""
    return head_dim > 64


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """The default load path: TMA descriptors where they work (sm_90+, 16-byte aligned bases and
    row strides, which D a multiple of 8 in 16-bit types gives for the usual layouts; checked,
    not assumed), pointer loads otherwise."""
    return _tma_fits(device_major(tensors[0]), _aligned(*tensors), tensors[0].element_size(),
                     tuple(t.stride() for t in tensors))


def _aligned(*tensors: torch.Tensor) -> bool:
    """Every base address on 16 bytes."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _tma_fits(major: int, aligned: bool, elem_size: int, strides: tuple) -> bool:
    """:func:`tma_eligible` from what a cached plan keys: the device, the bases' alignment, the
    strides (elements) of each tensor."""
    return major >= 9 and aligned and all((st * elem_size) % 16 == 0 for ts in strides for st in ts[:-1])


def preprocess_block(d_pad: int) -> int:
    """~8k elements of out and of do per program: enough bytes in flight, few registers."""
    return max(16, min(128, 8192 // d_pad))


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------


def _bsh_strides(strides: tuple, varlen: bool) -> tuple[int, int, int]:
    """(batch, sequence, head) strides of a tensor's ``strides``; batch stride 0 for packed
    [total, H, D] tensors."""
    if varlen:
        return 0, strides[0], strides[1]
    return strides[0], strides[1], strides[2]


def _unit_last_dim(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _clamp_window(w: int | None, bound: int) -> int:
    """A window wider than both sequences equals no window; clamping keeps the in-kernel
    arithmetic (sums of positions and the window) far inside int32."""
    return 0 if w is None else max(-bound, min(bound, int(w)))


def attention_backward(
    do, q, k, v, out, lse,
    *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    scale: float, window_left: int | None = None, window_right: int | None = None,
    softcap: float = 0.0, deterministic: bool = False,
):
    """(dq, dk, dv) of attention (layouts and masking: ``_attention_common``), in q's / k's / v's
    dtype and shape, contiguous. Inputs are assumed validated by the public API. No atomics are
    used, so the result is bitwise reproducible whether or not ``deterministic`` is set."""
    return launch_attention_backward(
        do, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
        window_left=window_left, window_right=window_right, softcap=softcap)


class _BackwardPlan(NamedTuple):
    """Everything of one backward call that shapes, strides and options fix (cached: building it
    cost ~100 µs of host time a call on the H200 host, session 22)."""
    use_tma: bool
    stat_shape: tuple               # (2, H_q, stat_stride): delta and lse2 (workspace views)
    stat_seq: int
    pre_grid: tuple
    pre: PreparedArgs               # the preprocess kernel's arguments after its 6 tensors
    gluon_dkdv: dict | None         # the Gluon dk/dv launcher's config (None: the tl kernel)
    gluon_dq: dict | None           # the Gluon dq launcher's config (None: the tl kernel)
    window: tuple                   # (left, right) as the Gluon launchers take them
    dkdv_grid: tuple
    dkdv: PreparedArgs | None       # the tl dk/dv kernel's arguments after its 10 tensors
    dq_grid: tuple
    dq: PreparedArgs | None         # the tl dq kernel's arguments after its 9 tensors


@functools.lru_cache(maxsize=512)
def _backward_plan(q_shape: tuple, k_shape: tuple, strides: tuple, lse_strides: tuple, dtype: torch.dtype,
                   major: int, aligned: bool, varlen: bool, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                   scale: float, softcap: float, window_left, window_right, config: tuple,
                   sms: int) -> _BackwardPlan:
    """The launch plan of :func:`launch_attention_backward` (``strides``: q, k, v, do, out;
    ``sms``: the device's multiprocessors, for the program order)."""
    config = dict(config)
    head_dim, h_q, h_kv = q_shape[-1], q_shape[-2], k_shape[-2]
    elem = dtype.itemsize
    if varlen:
        seqlen_q = seqlen_k = 0        # per sequence, read from cu_seqlens in the kernels
        n_stat_rows = q_shape[0]
    else:
        seqlen_q, seqlen_k = q_shape[1], k_shape[1]
    d_pad = head_block(head_dim)
    use_tma = config.get("use_tma")
    fits = _tma_fits(major, aligned, elem, strides[:4])
    use_tma = fits if use_tma is None else (bool(use_tma) and (fits or major == 0))   # asked for: where possible
    masked = window_left is not None or window_right is not None
    cfg = {**dkdv_config(d_pad, dtype, use_tma, masked), **dq_config(d_pad, dtype, use_tma), **config}
    split_dkdv, split_dq = split_loops_default(d_pad, dtype, use_tma, masked)
    if "split_loops" in cfg:
        split_dkdv = split_dq = bool(cfg["split_loops"])
    split_dkdv = bool(cfg.get("split_loops_dkdv", split_dkdv))
    split_dq = bool(cfg.get("split_loops_dq", split_dq))
    bound = max_seqlen_q + max_seqlen_k + 1
    wl, wr = _clamp_window(window_left, bound), _clamp_window(window_right, bound)
    flags = dict(USE_TMA=use_tma, HAS_LEFT=window_left is not None, HAS_RIGHT=window_right is not None,
                 HAS_SOFTCAP=softcap > 0, IS_VARLEN=varlen, HEAD_DIM=head_dim, D_PAD=d_pad,
                 DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")

    # [H_q, B, stat_seq] (dense) or [H_q, total_q] (varlen); columns of a sequence and of a head
    # start on 16 bytes, so the Gluon kernel's TMA can read them from any 4-aligned query row
    stat_seq = cdiv(seqlen_q, 4) * 4
    if not varlen:
        n_stat_rows = batch * stat_seq
    stat_stride = cdiv(n_stat_rows, 4) * 4
    bsh = [_bsh_strides(st, varlen) for st in strides]     # q, k, v, do, out
    block_pre = preprocess_block(d_pad)
    pre = attention_bwd_preprocess_kernel.prepare(
        (*bsh[4], *bsh[3], *lse_strides, seqlen_q, stat_stride, stat_seq),
        dict(HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=block_pre, IS_VARLEN=varlen, num_warps=4))
    common = (scale, softcap, wl, wr)
    gluon = _use_gluon(major, dtype, head_dim, varlen, use_tma, config)
    gluon_dkdv = gluon_dq = dkdv = dq = None
    dkdv_grid = dq_grid = ()
    if gluon:
        gluon_dkdv = {key: cfg["GLUON_" + key] for key in ("BLOCK_M", "STAGES") if "GLUON_" + key in cfg}
        if "HEAD_GROUP" in cfg:
            gluon_dkdv["HEAD_GROUP"] = cfg["HEAD_GROUP"]
    else:
        k_out = _bsh_strides(contiguous_strides(k_shape), varlen)     # dk, dv: contiguous, k's shape
        dkdv_grid = schedule_grid(cdiv(max_seqlen_k, cfg["BLOCK_N1"]), batch * h_kv, masked, sms,
                                  cfg.get("HEAD_GROUP"))
        dkdv = attention_bwd_dkdv_kernel.prepare(
            (*bsh[0], *bsh[1], *bsh[2], *bsh[3], *k_out, *k_out,
             seqlen_q, seqlen_k, stat_stride, stat_seq, h_kv, h_q // h_kv, *common),
            dict(BLOCK_M=cfg["BLOCK_M1"], BLOCK_N=cfg["BLOCK_N1"], SPLIT_LOOPS=split_dkdv,
                 DV_LATE=bool(cfg.get("dv_late", False)), **flags,
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    if gluon and cfg.get("GLUON_DQ", gluon_dq_default(head_dim)):
        gluon_dq = {key: cfg["GLUON_DQ_" + key] for key in ("BLOCK_N", "STAGES") if "GLUON_DQ_" + key in cfg}
        if "HEAD_GROUP" in cfg:
            gluon_dq["HEAD_GROUP"] = cfg["HEAD_GROUP"]
    else:
        dq_grid = schedule_grid(cdiv(max_seqlen_q, cfg["BLOCK_M2"]), batch * h_q, masked, sms, cfg.get("HEAD_GROUP"))
        dq = attention_bwd_dq_kernel.prepare(
            (*bsh[0], *bsh[1], *bsh[2], *bsh[3], *_bsh_strides(contiguous_strides(q_shape), varlen),
             seqlen_q, seqlen_k, stat_stride, stat_seq, h_q, h_q // h_kv, *common),
            dict(BLOCK_M=cfg["BLOCK_M2"], BLOCK_N=cfg["BLOCK_N2"], SPLIT_LOOPS=split_dq, **flags,
                 num_warps=cfg["num_warps_dq"], num_stages=cfg["num_stages_dq"]))
    window = (None if window_left is None else wl, None if window_right is None else wr)
    return _BackwardPlan(use_tma, (2, h_q, stat_stride), stat_seq, (cdiv(max_seqlen_q, block_pre), h_q, batch),
                         pre, gluon_dkdv, gluon_dq, window, dkdv_grid, dkdv, dq_grid, dq)


def launch_attention_backward(
    do, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, scale: float, window_left=None, window_right=None, softcap: float = 0.0,
    config: dict | None = None,
):
    """:func:`attention_backward` with an optional launch ``config`` overriding the keys of
    :func:`dkdv_config` / :func:`dq_config` (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps,
    num_stages for the dk/dv kernel, num_warps_dq, num_stages_dq; use_tma; split_loops: the
    SPLIT_LOOPS variant of both kernels, split_loops_dkdv / split_loops_dq of one; dv_late: the
    dk/dv kernel's DV_LATE; GLUON: the warp-specialized dk/dv and dq kernels on or off, GLUON_BLOCK_M /
    GLUON_STAGES the dk/dv kernel's tiles; GLUON_DQ: the warp-specialized dq kernel on or off (with
    GLUON; default :func:`gluon_dq_default`), GLUON_DQ_BLOCK_N / GLUON_DQ_STAGES its tiles) -- tests
    and the sweep. Per call: a cached plan (:func:`_backward_plan`), three allocations (dq, dk,
    dv), a reused workspace (delta, lse2), three launches."""
    varlen = cu_seqlens_q is not None
    q, k, v, do, out = (_unit_last_dim(t) for t in (q, k, v, do, out))
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch > 0 else 0
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if batch > 0 else 0
        cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
        lse_strides = (0, lse.stride(0), lse.stride(1))
    else:
        batch, max_seqlen_q, max_seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        cu_q = cu_k = q                # unused pointers
        lse_strides = lse.stride()
    if q.numel() == 0 or k.numel() == 0 or batch == 0:
        # no query or no key anywhere: every gradient is an empty sum
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if batch > 65535:
        raise ValueError(f"batch must be <= 65535 (a grid axis), got {batch}")
    plan = _backward_plan(tuple(q.shape), tuple(k.shape), (q.stride(), k.stride(), v.stride(), do.stride(), out.stride()),
                          lse_strides, q.dtype, device_major(q), _aligned(q, k, v, do), varlen, batch, max_seqlen_q,
                          max_seqlen_k, scale, softcap, window_left, window_right, config_key(config), num_sms(q))
    if plan.use_tma:
        use_device_descriptors()
    # internal to this call (written by the preprocess, read by the dk/dv and dq kernels): a
    # reused workspace, not an allocation (~5-9 µs of host time each on the H200 host)
    delta, lse2 = workspace("attention_bwd_stats", (plan.stat_shape[1:],) * 2, torch.float32, q.device)
    attention_bwd_preprocess_kernel.launch_prepared(plan.pre_grid, (out, do, lse, delta, lse2, cu_q), plan.pre)
    if varlen:      # rows outside [cu[0], cu[-1]) belong to no sequence: zero gradients
        dq = packed_output(q.shape, q.dtype, q.device, cu_seqlens_q)
        dk = packed_output(k.shape, k.dtype, k.device, cu_seqlens_k)
        dv = packed_output(v.shape, v.dtype, v.device, cu_seqlens_k)
    else:
        dq = empty(q.shape, q.dtype, q.device)
        dk = empty(k.shape, k.dtype, k.device)
        dv = empty(v.shape, v.dtype, v.device)
    left, right = plan.window
    if plan.gluon_dkdv is not None:
        from ._attention_bwd_gluon import launch_attention_bwd_dkdv_ws   # Gluon imports on first use
        launch_attention_bwd_dkdv_ws(q, k, v, do, dk, dv, lse2, delta, plan.stat_seq, scale=scale, softcap=softcap,
                                     window_left=left, window_right=right, config=plan.gluon_dkdv)
    else:
        attention_bwd_dkdv_kernel.launch_prepared(plan.dkdv_grid, (q, k, v, do, dk, dv, lse2, delta, cu_q, cu_k),
                                                  plan.dkdv)
    if plan.gluon_dq is not None:
        from ._attention_dq_gluon import launch_attention_bwd_dq_ws
        launch_attention_bwd_dq_ws(q, k, v, do, dq, lse2, delta, plan.stat_seq, scale=scale, softcap=softcap,
                                   window_left=left, window_right=right, config=plan.gluon_dq)
    else:
        attention_bwd_dq_kernel.launch_prepared(plan.dq_grid, (q, k, v, do, dq, lse2, delta, cu_q, cu_k), plan.dq)
    return dq, dk, dv
