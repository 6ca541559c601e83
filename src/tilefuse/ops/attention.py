"""Exact attention without the S×S matrix: ``attention`` (dense) and ``attention_varlen`` (packed).

Semantics (layout, GQA, bottom-right causal, windows, softcap, lse and the -inf / 0 convention
for rows that see no key): ``_attention_common``'s docstring. The forward kernel is
``_attention_fwd_kernels``; the backward (dq, dk, dv by recomputation from q, k, v, out, lse)
is ``_attention_bwd``. Saved for the backward: q, k, v, out and lse only, O(S) memory.

Bytes counted (ideal, per pass; D = head dim, e = element size):
  forward  reads q, k, v and writes out (e·D·(2·B·S_q·H_q + 2·B·S_k·H_kv)) and lse (4·B·H_q·S_q);
  backward reads q, k, v, out, dout, lse and writes dq, dk, dv (e·D·(4·B·S_q·H_q + 4·B·S_k·H_kv)
  + 4·B·H_q·S_q).
FLOPs: FlashAttention's convention, 4·B·S_q·S_k·H_q·D forward (halved for causal with S_q ==
S_k), backward 2.5x the forward.

Registry shapes: ``attention`` / ``attention_causal``: (B, S_q, S_k, H_q, H_kv, D);
``attention_varlen`` (causal): (B, S, H_q, H_kv, D, ragged), B sequences of length S each, or
with ragged=1 the lengths of :func:`varlen_lengths` (include 0 and 1).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._autocast import autocast_inputs, autocast_on
from .._checks import check_same_device, check_same_dtype, check_tensor
from .._dispatch import use_triton
from .._op import custom_op
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._attention_common import (
    attention_reference, attention_varlen_reference, normalize_scale, normalize_softcap, normalize_window,
    unbounded_past, visible_mask,
)
from ._attention_bwd import attention_backward
from ._attention_fwd_kernels import attention_flops, attention_forward

MAX_HEAD_DIM = 256

# ----------------------------------------------------------------------------------------------
# references (fp32 math, fp64 for fp64 inputs): the CPU path, with internal window bounds
# ----------------------------------------------------------------------------------------------


def _reference_dense(q, k, v, scale, window_left, window_right, softcap):
    """attention_reference with internal bounds (None = unbounded, any int): a right bound r is
    the reference's causal rule (right = 0) with the shift moved by r, and left by r with it.
    A side past every |query - key| distance is no bound (a Python int past int64 would not fit
    the index tensors)."""
    bound = q.shape[1] + k.shape[1] + 1
    window_left, window_right = unbounded_past(window_left, bound), unbounded_past(window_right, bound)
    if window_right is None:
        return attention_reference(q, k, v, window=(-1 if window_left is None else window_left, -1),
                                   softcap=softcap, scale=scale, return_lse=True)
    left = -1
    if window_left is not None:
        left = window_left + window_right
        if left < 0:
            raise ValueError(f"empty window (left {window_left}, right {window_right}) is not supported")
    shift = k.shape[1] - q.shape[1] + window_right
    return attention_reference(q, k, v, window=(left, 0), softcap=softcap, scale=scale,
                               return_lse=True, shift=shift)


def _reference_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap):
    if cu_seqlens_q is None:
        return _reference_dense(q, k, v, scale, window_left, window_right, softcap)
    window = (-1 if window_left is None else window_left, -1 if window_right is None else window_right)
    return attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, window=window,
                                      softcap=softcap, scale=scale, return_lse=True)


@contextlib.contextmanager
def _autograd_recording():
    """Autograd records again inside a custom op's implementation. Called through the dispatcher
    (torch.compile's graphs, tensor subclasses) the implementation runs below the Autograd keys,
    so ``enable_grad`` alone builds no graph there (the CPU path's backward under torch.compile
    raised "element 0 of tensors does not require grad"); the eager direct path needs nothing."""
    key = torch._C.DispatchKey.AutogradFunctionality
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)


def _reference_bwd(do, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap):
    """(dq, dk, dv) by autograd through the reference, in fp32 math (fp64 for fp64 inputs)."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    leaves = [t.detach().to(wide).requires_grad_(True) for t in (q, k, v)]
    with _autograd_recording():
        out, _ = _reference_fwd(*leaves, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap)
        grads = torch.autograd.grad(out, leaves, do.to(wide), allow_unused=True)
    return tuple((torch.zeros_like(t) if g is None else g).to(t.dtype) for g, t in zip(grads, (q, k, v)))


# ----------------------------------------------------------------------------------------------
# varlen offsets: checked against the tensors before the kernels index with them
# ----------------------------------------------------------------------------------------------


@triton.jit
def _bad_offsets(cu_ptr, n_entries, total, max_seqlen, BLOCK: tl.constexpr):
    """How many entries of one cu_seqlens break its rules (see cu_seqlens_check_kernel)."""
    bad = 0
    for start in range(0, n_entries, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        cur = tl.load(cu_ptr + offs, mask=offs < n_entries, other=0)
        nxt = tl.load(cu_ptr + offs + 1, mask=offs + 1 < n_entries, other=0)
        length = nxt - cur
        has_next = offs + 1 < n_entries
        wrong = (has_next & ((length < 0) | (length > max_seqlen))) | ((offs == 0) & (cur < 0))
        wrong = wrong | ((offs == n_entries - 1) & (cur > total))
        bad += tl.sum(wrong.to(tl.int32), 0)
    return bad


@triton.jit
def cu_seqlens_check_kernel(
    cu_q_ptr,           # *int32 [B + 1] query offsets
    cu_k_ptr,           # *int32 [B + 1] key offsets
    ok_ptr,             # *int32 [1]: 1 when both are valid, else 0
    n_entries,          # B + 1
    total_q,            # rows of q
    total_k,            # rows of k / v
    max_seqlen_q,       # the grid's bound on a query sequence
    max_seqlen_k,       # ... on a key sequence
    BLOCK: tl.constexpr,
):
    """Valid offsets: the first >= 0, non-decreasing, no sequence longer than max_seqlen, the
    last <= the rows of the tensor (one program; B + 1 entries)."""
    bad = _bad_offsets(cu_q_ptr, n_entries, total_q, max_seqlen_q, BLOCK)
    bad += _bad_offsets(cu_k_ptr, n_entries, total_k, max_seqlen_k, BLOCK)
    tl.store(ok_ptr, (bad == 0).to(tl.int32))


def _offsets_error(name: str, cu: list, total: int, max_seqlen: int, max_name: str) -> str | None:
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] < 0 or any(n < 0 for n in lengths):
        return f"{name} must start at >= 0 and never decrease, got {cu}"
    if cu[-1] > total:
        return f"{name} ends at {cu[-1]}, past the {total} rows of its tensor"
    if lengths and max(lengths) > max_seqlen:
        return f"{max_name}={max_seqlen} is shorter than a sequence of {max(lengths)} in {name}"
    return None


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int,
                            max_seqlen_k: int) -> None:
    """The offsets' values against the tensors, before any kernel indexes with them: on the host
    for CPU tensors (a ValueError naming the argument); on a GPU without a sync, as one small
    kernel and a queued ``torch._assert_async`` (a failure stops the CUDA context before the
    attention kernels run: no out-of-bounds access, no silent wrong rows)."""
    if cu_seqlens_q.device.type != "cuda":
        for args in ((cu_seqlens_q, total_q, max_seqlen_q, "cu_seqlens_q", "max_seqlen_q"),
                     (cu_seqlens_k, total_k, max_seqlen_k, "cu_seqlens_k", "max_seqlen_k")):
            error = _offsets_error(args[3], args[0].tolist(), args[1], args[2], args[4])
            if error:
                raise ValueError(error)
        return
    ok = torch.empty(1, dtype=torch.int32, device=cu_seqlens_q.device)
    cu_seqlens_check_kernel[(1,)](cu_seqlens_q, cu_seqlens_k, ok, cu_seqlens_q.shape[0], total_q, total_k,
                                  max_seqlen_q, max_seqlen_k, BLOCK=1024)
    torch._assert_async(ok, "attention_varlen: cu_seqlens_q / cu_seqlens_k must start at >= 0, never "
                            "decrease, end within their tensors' rows and hold no sequence longer than "
                            "max_seqlen_q / max_seqlen_k")


# ----------------------------------------------------------------------------------------------
# custom ops + autograd (dense when cu_seqlens_q is None, varlen otherwise)
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::attention_fwd", mutates_args=())
def _attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                      max_seqlen_q: int, max_seqlen_k: int, scale: float, window_left: Optional[int],
                      window_right: Optional[int], softcap: float,
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); ``deterministic`` is the backward's (kept here for setup_context)."""
    if cu_seqlens_q is not None:
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    if use_triton(q):
        return attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 scale=scale, window_left=window_left, window_right=window_right,
                                 softcap=softcap)
    out, lse = _reference_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap)
    return out.contiguous(), lse.float().contiguous()


@_attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
      window_right, softcap, deterministic):
    if cu_seqlens_q is None:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = (q.shape[1], q.shape[0])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@custom_op("tilefuse::attention_bwd", mutates_args=())
def _attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                      cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                      scale: float, window_left: Optional[int], window_right: Optional[int],
                      softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(q):
        dq, dk, dv = attention_backward(
            do, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
            window_left=window_left, window_right=window_right, softcap=softcap,
            deterministic=deterministic)
    else:
        dq, dk, dv = _reference_bwd(do, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_left,
                                    window_right, softcap)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attention_bwd_op.register_fake
def _(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
      window_left, window_right, softcap, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options   # max_seqlen_q, max_seqlen_k, scale, window_left, window_right, softcap, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    """dlse is ignored: lse is returned as a non-differentiable output (module docstring). Eager
    autograd passes None for it (materialize_grads=False): autograd would otherwise allocate and
    zero-fill a [B, H, S] fp32 tensor on every backward, a launch and an allocation of host time."""
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = _attention_bwd_op(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context, materialize_grads=False)


# ----------------------------------------------------------------------------------------------
# input checks and the public API
# ----------------------------------------------------------------------------------------------


def _check_qkv(q, k, v, rank: int, layout: str) -> None:
    """Types, dtypes, devices, ranks and shapes of q, k, v; raises before any launch."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}, expected k's shape {tuple(k.shape)}")
    if rank == 4 and k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k has head dim {k.shape[-1]} but q has {head_dim}")
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")
    n_heads_q, n_heads_kv = q.shape[-2], k.shape[-2]
    if n_heads_kv < 1 or n_heads_q % n_heads_kv:
        raise ValueError(f"q's head count ({n_heads_q}) must be a multiple of k's ({n_heads_kv})")


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _unit_d_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any B/S/H strides but need stride 1 along D."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _dense(q, k, v, scale, window_left, window_right, softcap, deterministic):
    """(out, lse) of checked [B, S, H, D] inputs with internal window bounds (also the SDPA path)."""
    q, k, v = (_unit_d_stride(t) for t in (q, k, v))
    return _attention_fwd_op(q, k, v, None, None, q.shape[1], k.shape[1], scale, window_left,
                             window_right, softcap, deterministic)


def _bounds(causal, window) -> tuple[Optional[int], Optional[int]]:
    left, right = normalize_window(causal, window)
    return (None if left < 0 else left), (None if right < 0 else right)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              window: tuple[int, int] = (-1, -1), softcap: float = 0.0, scale: float | None = None,
              return_lse: bool = False, deterministic: bool = False):
    """softmax(scale · q kᵀ [softcapped, masked]) v for q ``[B, S_q, H_q, D]``, k, v ``[B, S_k,
    H_kv, D]`` (flash-attn layout; H_q a multiple of H_kv; D a multiple of 8 up to 256).

    ``causal`` aligns bottom-right when S_q != S_k; ``window=(left, right)`` (-1 unbounded);
    ``softcap`` > 0 caps the scores as softcap·tanh(s / softcap); ``scale`` defaults to
    1/sqrt(D). Returns out ``[B, S_q, H_q, D]`` in q's dtype, and with ``return_lse`` also the
    float32 log-sum-exp ``[B, H_q, S_q]`` (-inf for rows that see no key; it has no gradient).
    ``deterministic`` makes the backward avoid atomics. fp16, bf16 and fp32 (fp32 math inside);
    under ``torch.autocast`` q, k and v are cast to its dtype first, as SDPA's are."""
    if autocast_on():
        q, k, v = autocast_inputs(q, k, v)
    _check_qkv(q, k, v, 4, "[B, S, H, D]")
    _check_flags(return_lse=return_lse, deterministic=deterministic)
    left, right = _bounds(causal, window)
    scale = normalize_scale(scale, q.shape[-1])
    softcap = normalize_softcap(softcap)
    out, lse = _dense(q, k, v, scale, left, right, softcap, deterministic)
    return (out, lse) if return_lse else out


def _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, dtypes=(torch.int32,))
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D [batch + 1], got shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens_q has "
                         f"{cu_seqlens_q.shape[0]} (one batch of sequences for both)")
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     scale: float | None = None, return_lse: bool = False, deterministic: bool = False):
    """:func:`attention` on packed sequences: q ``[total_q, H_q, D]``, k, v ``[total_k, H_kv, D]``;
    sequence i is rows cu_seqlens[i] .. cu_seqlens[i + 1] - 1 (int32 ``[B + 1]``, same length for
    q and k; empty sequences allowed). ``max_seqlen_q`` / ``max_seqlen_k`` must be at least
    the longest query / key sequence (they size the grids). The offsets' values are checked
    against the tensors and these bounds (:func:`check_cu_seqlens_values`: a ValueError on the
    CPU; on a GPU a queued device assertion, no sync). Causal and windows apply per sequence.
    lse is ``[H_q, total_q]``. Autocast as in :func:`attention`."""
    if autocast_on():
        q, k, v = autocast_inputs(q, k, v)
    _check_qkv(q, k, v, 3, "[total, H, D]")
    _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_flags(return_lse=return_lse, deterministic=deterministic)
    left, right = _bounds(causal, window)
    scale = normalize_scale(scale, q.shape[-1])
    softcap = normalize_softcap(softcap)
    q, k, v = (_unit_d_stride(t) for t in (q, k, v))
    out, lse = _attention_fwd_op(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                                 max_seqlen_q, max_seqlen_k, scale, left, right, softcap, deterministic)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# registry: shapes, byte / FLOP counts, peers
# ----------------------------------------------------------------------------------------------


def varlen_lengths(batch: int, seqlen: int, ragged: int) -> tuple[list[int], list[int]]:
    """(query lengths, key lengths) of the varlen spec: all ``seqlen``, or with ``ragged`` a
    cycle through full, empty, 1 and middle lengths (keys rotated by one: S_q != S_k too)."""
    if not ragged:
        return [seqlen] * batch, [seqlen] * batch
    cycle = [seqlen, 0, 1, seqlen // 2 + 1, max(seqlen - 3, 0)]
    lens_q = [cycle[i % len(cycle)] for i in range(batch)]
    lens_k = [cycle[(i + 1) % len(cycle)] for i in range(batch)]
    return lens_q, lens_k


def _cu(lengths, device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _qkv(shape_q, shape_kv, dtype, device):
    return tuple(torch.randn(s, device=device).to(dtype).requires_grad_(True) for s in (shape_q, shape_kv, shape_kv))


def _dense_inputs(kwargs):
    def make(shape, dtype, device):
        b, s_q, s_k, h_q, h_kv, d = shape
        q, k, v = _qkv((b, s_q, h_q, d), (b, s_k, h_kv, d), dtype, device)
        return Inputs((q, k, v), dict(kwargs), grad_args=(0, 1, 2))
    return make


def _varlen_inputs(kwargs):
    def make(shape, dtype, device):
        b, s, h_q, h_kv, d, ragged = shape
        lens_q, lens_k = varlen_lengths(b, s, ragged)
        q, k, v = _qkv((sum(lens_q), h_q, d), (sum(lens_k), h_kv, d), dtype, device)
        args = (q, k, v, _cu(lens_q, device), _cu(lens_k, device), max(lens_q, default=0), max(lens_k, default=0))
        return Inputs(args, dict(kwargs), grad_args=(0, 1, 2))
    return make


def _dense_traffic(shape, dtype, pass_):
    b, s_q, s_k, h_q, h_kv, d = shape
    q_bytes, kv_bytes = tensor_bytes((b, s_q, h_q, d), dtype), tensor_bytes((b, s_k, h_kv, d), dtype)
    lse_bytes = tensor_bytes((b, h_q, s_q), torch.float32)
    if pass_ == "fwd":   # q, out; k, v; lse written
        return 2 * q_bytes + 2 * kv_bytes + lse_bytes
    return 4 * q_bytes + 4 * kv_bytes + lse_bytes    # q, out, do, dq; k, v, dk, dv; lse read


def _varlen_traffic(shape, dtype, pass_):
    b, s, h_q, h_kv, d, ragged = shape
    lens_q, lens_k = varlen_lengths(b, s, ragged)
    offsets = 2 * tensor_bytes((b + 1,), torch.int32)         # cu_seqlens_q and _k
    return _dense_traffic((1, sum(lens_q), sum(lens_k), h_q, h_kv, d), dtype, pass_) + offsets


def _pass_flops(fwd: int, pass_: str) -> int:
    return fwd if pass_ == "fwd" else int(2.5 * fwd)


def _dense_flops(causal):
    def flops(shape, pass_):
        b, s_q, s_k, h_q, _, d = shape
        return _pass_flops(attention_flops(b, s_q, s_k, h_q, d, causal), pass_)
    return flops


def _varlen_flops(causal):
    def flops(shape, pass_):
        b, s, h_q, _, d, ragged = shape
        fwd = sum(attention_flops(1, lq, lk, h_q, d, causal) for lq, lk in zip(*varlen_lengths(b, s, ragged)))
        return _pass_flops(fwd, pass_)
    return flops


def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    return attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)


def _sdpa(q, k, v, backend, mask=None, is_causal=False, scale=None):
    """SDPA with ``backend`` forced, on [B, S, H, D] tensors (transposed views), GQA via enable_gqa."""
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=is_causal, scale=scale,
                                             enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _torch_attention(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None,
                     return_lse=False, deterministic=False):
    """PyTorch's own attention in the same dtype (SDPA math backend with the explicit mask of
    the shared rule): the "torch" peer that sets the flash-attn error bound."""
    from torch.nn.attention import SDPBackend
    if softcap or return_lse:
        raise NotImplementedError("SDPA has no softcap and returns no lse")
    left, right = normalize_window(causal, window)
    mask = visible_mask(q.shape[1], k.shape[1], left, right, device=q.device)
    out = _sdpa(q, k, v, SDPBackend.MATH, mask=mask, scale=scale)
    return out.masked_fill(~mask.any(-1)[None, :, None, None], 0.0)   # rows that see no key: 0, not NaN


def _torch_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = [_torch_attention(q[cq[i]:cq[i + 1]][None], k[ck[i]:ck[i + 1]][None], v[ck[i]:ck[i + 1]][None],
                             **kwargs)[0] for i in range(len(cq) - 1)]
    return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)


def _sdpa_peer(backend_name: str):
    """Factory: SDPA with one backend forced, attention's signature (plain causal / full only)."""
    def factory():
        from torch.nn.attention import SDPBackend
        backend = getattr(SDPBackend, backend_name)

        def run(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, return_lse=False,
                deterministic=False):
            if tuple(window) != (-1, -1) or softcap or return_lse or (causal and q.shape[1] != k.shape[1]):
                raise NotImplementedError("SDPA peers: full or square causal attention only")
            return _sdpa(q, k, v, backend, is_causal=causal, scale=scale)
        return run
    return factory


def _flex_peer():
    """torch.compile'd FlexAttention; causal through a block mask built once per shape. None if absent."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention)
    block_masks = {}

    def run(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, return_lse=False,
            deterministic=False):
        if tuple(window) != (-1, -1) or softcap or return_lse:
            raise NotImplementedError("flex peer: full or causal attention only")
        s_q, s_k = q.shape[1], k.shape[1]
        block_mask = None
        if causal:
            key = (s_q, s_k, str(q.device))
            if key not in block_masks:
                shift = s_k - s_q
                block_masks[key] = create_block_mask(lambda b, h, i, j: j - i <= shift, None, None, s_q, s_k,
                                                     device=q.device)
            block_mask = block_masks[key]
        # donated buffers off: the bench's backward pass runs with retain_graph=True, which a
        # compiled backward with donated buffers refuses (the bench runner also rebuilds a peer
        # that raises it, as its flex `bwd` rows still did with this patch alone)
        with torch._functorch.config.patch(donated_buffer=False):
            out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                           scale=scale, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    return run


_DENSE_PEERS = {
    "torch": lambda: _torch_attention,
    "sdpa_flash": _sdpa_peer("FLASH_ATTENTION"),
    "sdpa_cudnn": _sdpa_peer("CUDNN_ATTENTION"),
    "sdpa_efficient": _sdpa_peer("EFFICIENT_ATTENTION"),
    "flex": _flex_peer,
}
# (B, S_q, S_k, H_q, H_kv, D): odd lengths, GQA / MQA, S_q != S_k both ways, S_q = 1, D padded
_TEST_SHAPES = [(1, 17, 17, 2, 1, 32), (2, 19, 27, 4, 2, 24), (1, 30, 13, 2, 2, 40), (1, 1, 21, 2, 1, 64),
                (2, 16, 16, 1, 1, 8)]
_GPU_TEST_SHAPES = [(2, 1000, 1000, 8, 2, 128), (1, 2048, 2048, 4, 4, 64), (2, 333, 777, 4, 1, 96),
                    (1, 513, 257, 2, 2, 256), (3, 129, 129, 6, 3, 72)]
_BENCH_SHAPES = [(16384 // s, s, s, 16, 16, d) for d in (64, 128) for s in (1024, 4096, 16384)]

for _name, _causal in (("attention", False), ("attention_causal", True)):
    register(OpSpec(
        name=_name,
        fn=attention,
        reference=attention_reference,
        make_inputs=_dense_inputs({"causal": _causal}),
        bytes_fn=_dense_traffic,
        flops_fn=_dense_flops(_causal),
        test_shapes=_TEST_SHAPES,
        gpu_test_shapes=_GPU_TEST_SHAPES,
        bench_shapes=_BENCH_SHAPES,
        peers=dict(_DENSE_PEERS),
        description=("causal (bottom-right) " if _causal else "") + "attention, shape (B, S_q, S_k, H_q, H_kv, D)",
    ))

register(OpSpec(
    name="attention_varlen",
    fn=attention_varlen,
    reference=_varlen_reference,
    make_inputs=_varlen_inputs({"causal": True}),
    bytes_fn=_varlen_traffic,
    flops_fn=_varlen_flops(True),
    test_shapes=[(5, 13, 2, 1, 32, 1), (3, 20, 4, 2, 24, 1), (2, 9, 2, 2, 16, 0)],
    gpu_test_shapes=[(7, 1000, 8, 2, 128, 1), (4, 2048, 16, 16, 64, 0)],
    bench_shapes=[(16384 // s, s, 16, 16, d, 0) for d in (64, 128) for s in (1024, 4096)],
    peers={"torch": lambda: _torch_attention_varlen},
    description="causal attention on packed sequences, shape (B, S, H_q, H_kv, D, ragged)",
))
