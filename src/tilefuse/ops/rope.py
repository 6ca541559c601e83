"""Rotary position embedding (RoPE) of queries and keys, forward and backward, in one launch.

For each token (b, s) with table row p (p = s, or p = position_ids[b, s]) and each head, the
first ``r = rotary_dim`` features are rotated in pairs (x1_j, x2_j), j < r/2:

    out1_j = x1_j·cos_j − x2_j·sin_j,      out2_j = x2_j·cos_j + x1_j·sin_j

* GPT-NeoX / Llama (``interleaved=False``): x1 = x[..., :r/2], x2 = x[..., r/2:r].
* GPT-J (``interleaved=True``): the pairs are (x[2j], x[2j+1]).
* features r..D−1 pass through unchanged (partial rotary, e.g. GPT-J, Phi, NeoX).
* backward is the inverse rotation (sin → −sin) of dq_out, dk_out; cos and sin get no gradient.

cos/sin convention: last dim = rotary_dim, as HuggingFace builds them. NeoX style: halves
duplicated (cos = cat(cos_θ, cos_θ)), the kernel reads the first half; GPT-J style:
repeat_interleaved (cos = cos_θ.repeat_interleave(2)), the kernel reads the even entries.
``rope_cos_sin_table`` builds such tables. Shapes: ``[S, r]``, ``[1, S, r]`` or ``[B, S, r]``;
with ``position_ids`` (``[S]``, ``[1, S]`` or ``[B, S]``, int32/int64) a ``[max_pos, r]`` table.

Layouts: q ``[B, S, H_q, D]`` and k ``[B, S, H_k, D]`` (``layout="bshd"``, flash-attn / the
projection output) or ``[B, H, S, D]`` (``layout="bhsd"``, HF after ``transpose(1, 2)``); a
3-D ``[S, H, D]`` / ``[H, S, D]`` input is one batch. Any strides with a unit stride along D
are read in place (q and k may be views into one packed qkv tensor); outputs keep the input's
memory order. GQA: H_q and H_k may differ.

Bytes counted (ideal, per pass): q and k read once and written once, plus r/2 cos and r/2 sin
values per table row the kernel reads (once per position when the table is shared by the
batch). Backward moves the same: dq_out, dk_out read, dq, dk written, cos/sin read.

Kernel: one program per token (several for short tokens) rotates every q head and then every k
head of that token, so cos/sin are loaded once and reused across heads; each head block is a
[heads, r/2] tile walked with unit stride along D (16-byte vectors), fp32 math.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch.autograd.graph import increment_version

from .._checks import (DisjointByOffset, check_same_device, check_same_dtype, check_tensor, check_writable,
                       may_share_elements)
from .._dispatch import cdiv, empty, next_power_of_2, num_sms, use_triton
from .._launch import PreparedArgs
from .._op import CallCache, call_key, custom_op, no_grad_layout, plain_tensors
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._rope_kernels import rope_kernel

MAX_TILE = 2048          # elements of one head-block tile: 16 fp32 values per thread at 4 warps. H200
                         # sweep (2026-11-23): 16 heads x 128 at 4 warps beat 32 heads at 8 warps by 7 %
                         # with 8 kv heads and tied (within 0.7 %) at 32 kv heads and 64 q heads
MIN_TOKEN_ELEMS = 2048   # q+k elements a program moves at least, by packing several short tokens
LAYOUTS = ("bshd", "bhsd")
POSITION_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------
# launch heuristics
# ----------------------------------------------------------------------------------------------


def _block_heads(n_heads: int, block_r2: int) -> int:
    """All heads of a token in one tile while it stays <= MAX_TILE elements; more heads loop."""
    return max(1, min(next_power_of_2(max(n_heads, 1)), MAX_TILE // (2 * block_r2)))


def _tokens_per_program(token_elems: int, n_tokens: int, sms: int) -> int:
    """Short tokens (few heads, small D) share a program so it moves >= MIN_TOKEN_ELEMS, while
    the grid keeps >= 8 programs per SM to spread the bytes over every SM."""
    tokens = min(16, next_power_of_2(cdiv(MIN_TOKEN_ELEMS, max(token_elems, 1))))
    while tokens > 1 and cdiv(n_tokens, tokens) < 8 * sms:
        tokens //= 2
    return tokens


def _num_warps(tile_elems: int) -> int:
    """~16 fp32 values per thread for the largest tile (1 to 8 warps): 16-byte accesses, no spills."""
    return max(1, min(8, tile_elems // (32 * 16)))


def _launch_config(n_tokens: int, n_q_heads: int, n_k_heads: int, head_dim: int, rotary_dim: int,
                   sms: int, config: tuple = ()) -> dict:
    """Tiles and warps for one call; ``config`` (sorted (key, value) pairs) overrides keys (GPU sweeps)."""
    block_r2 = next_power_of_2(max(rotary_dim // 2, 1))
    block_hq, block_hk = _block_heads(n_q_heads, block_r2), _block_heads(n_k_heads, block_r2)
    cfg = {
        "TOKENS": _tokens_per_program((n_q_heads + n_k_heads) * head_dim, n_tokens, sms),
        "BLOCK_HQ": block_hq,
        "BLOCK_HK": block_hk,
        "num_warps": _num_warps(max(block_hq, block_hk) * 2 * block_r2),
    }
    cfg.update(config)
    return cfg


# ----------------------------------------------------------------------------------------------
# launcher (inputs already validated by the public function)
# ----------------------------------------------------------------------------------------------


def _bshd_meta(shape: tuple, strides: tuple, layout: str) -> tuple[tuple, tuple]:
    """(shape, strides) of q or k viewed as [B, S, H, D] (what ``_bshd`` returns, without
    building the view): a 3-D tensor is one batch (its batch stride is never used), bhsd swaps."""
    if len(shape) == 3:
        shape, strides = (1, *shape), (0, *strides)
    if layout == "bhsd":
        return (shape[0], shape[2], shape[1], shape[3]), (strides[0], strides[2], strides[1], strides[3])
    return tuple(shape), tuple(strides)


def _bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """q or k as a [B, S, H, D] view (no copy): a 3-D tensor is one batch, bhsd is transposed."""
    t = t.unsqueeze(0) if t.dim() == 3 else t
    return t.transpose(1, 2) if layout == "bhsd" else t


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim (the kernel's vector axis): a copy only when not."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _table_view(cs: torch.Tensor, batch: int) -> torch.Tensor:
    """cos or sin as [B, rows, r] with a zero batch stride when shared, unit stride along r
    (the fused qkv projection's launcher reads tables this way)."""
    cs = _unit_last(cs)
    cs = cs.unsqueeze(0) if cs.dim() == 2 else cs
    return cs.expand(batch, cs.shape[1], cs.shape[2])


def _batch_row_strides(shape: tuple, strides: tuple, batched: bool) -> tuple[int, int]:
    """(batch, row) strides of a cos/sin table ([rows, r], or [1 or B, rows, r] when ``batched``)
    or of position ids ([S], or [1 or B, S]): batch stride 0 when the batch shares it."""
    if not batched:
        return 0, strides[0]
    return (0 if shape[0] == 1 else strides[0]), strides[1]


class _Plan(NamedTuple):
    grid: tuple
    prepared: PreparedArgs     # every integer argument and constexpr of rope_kernel


@functools.lru_cache(maxsize=1024)
def _plan(q_shape: tuple, q_strides: tuple, k_shape: tuple, k_strides: tuple, qo_strides: tuple, ko_strides: tuple,
          cos_shape: tuple, cos_strides: tuple, sin_strides: tuple, pos_meta: Optional[tuple], interleaved: bool,
          rotary_dim: int, inverse: bool, inplace: bool, layout: str, sms: int, config: tuple) -> Optional[_Plan]:
    """The launch of one call, from its tensors' shapes and strides (cached: a rope call's kernel
    takes tens of µs, its host path as long again without it). None: nothing to launch."""
    (batch, seq_len, n_q_heads, head_dim), q_st = _bshd_meta(q_shape, q_strides, layout)
    (_, _, n_k_heads, _), k_st = _bshd_meta(k_shape, k_strides, layout)
    _, qo_st = _bshd_meta(q_shape, qo_strides, layout)
    _, ko_st = _bshd_meta(k_shape, ko_strides, layout)
    n_tokens = batch * seq_len
    if n_tokens == 0 or (n_q_heads + n_k_heads) * head_dim == 0:
        return None
    cfg = _launch_config(n_tokens, n_q_heads, n_k_heads, head_dim, rotary_dim, sms, config)
    cos_st = _batch_row_strides(cos_shape, cos_strides, len(cos_shape) == 3)
    sin_st = _batch_row_strides(cos_shape, sin_strides, len(cos_shape) == 3)
    pos_st = (0, 0) if pos_meta is None else _batch_row_strides(*pos_meta, len(pos_meta[0]) == 2)
    n_table_rows = cos_shape[-2]
    ints = (n_tokens, seq_len, n_q_heads, n_k_heads, n_table_rows, *q_st[:3], *k_st[:3], *qo_st[:3], *ko_st[:3],
            *cos_st, *sin_st, *pos_st)
    kwargs = dict(
        HEAD_DIM=head_dim, HALF_ROT=rotary_dim // 2, HAS_POS=pos_meta is not None, INTERLEAVED=interleaved,
        INVERSE=inverse, COPY_TAIL=not inplace and rotary_dim < head_dim,
        TOKENS=cfg["TOKENS"], BLOCK_HQ=cfg["BLOCK_HQ"], BLOCK_HK=cfg["BLOCK_HK"],
        BLOCK_R2=next_power_of_2(max(rotary_dim // 2, 1)),
        BLOCK_TAIL=next_power_of_2(max(head_dim - rotary_dim, 1)), num_warps=cfg["num_warps"],
    )
    return _Plan((cdiv(n_tokens, cfg["TOKENS"]),), rope_kernel.prepare(ints, kwargs))


def _plan_of(q, k, q_out, k_out, cos, sin, position_ids, interleaved, rotary_dim, inverse, inplace, config,
             layout) -> Optional[_Plan]:
    """:func:`_plan` of these tensors' layouts."""
    pos_meta = None if position_ids is None else (tuple(position_ids.shape), position_ids.stride())
    return _plan(tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), q_out.stride(), k_out.stride(),
                 tuple(cos.shape), cos.stride(), sin.stride(), pos_meta, interleaved, rotary_dim, inverse, inplace,
                 layout, num_sms(q), tuple(sorted(config.items())) if config else ())


def _launch(q, k, q_out, k_out, cos, sin, position_ids, interleaved, rotary_dim, inverse, inplace,
            config=None, layout="bshd"):
    """rope of q, k (3-D or 4-D, ``layout``) into q_out, k_out (the same tensors when
    ``inplace``, and the pass-through features are then left untouched). q, k, cos and sin need a
    unit stride along their last dim (``_rope_into`` copies those that do not)."""
    plan = _plan_of(q, k, q_out, k_out, cos, sin, position_ids, interleaved, rotary_dim, inverse, inplace, config,
                    layout)
    if plan is not None:   # (position ids: any pointer when absent, HAS_POS=False never reads it)
        rope_kernel.launch_prepared(plan.grid, (q, k, q_out, k_out, cos, sin,
                                                cos if position_ids is None else position_ids), plan.prepared)


def _alloc_order(shape: tuple, strides: tuple) -> tuple[tuple, Optional[tuple]]:
    """(shape in t's memory order of the leading dims (sorted by stride) with D last, the
    permutation back to t's dim order or None when it is the identity)."""
    order = sorted(range(len(shape) - 1), key=lambda d: -strides[d]) + [len(shape) - 1]
    perm = tuple(order.index(d) for d in range(len(shape)))
    return tuple(shape[d] for d in order), (None if perm == tuple(range(len(shape))) else perm)


_alloc_order_cached = functools.lru_cache(maxsize=1024)(_alloc_order)


def _alloc(order: tuple, t: torch.Tensor, alloc=empty) -> torch.Tensor:
    """A new tensor of t's dtype and device in the memory order ``order`` (:func:`_alloc_order`)."""
    shape, perm = order
    buf = alloc(shape, t.dtype, t.device)
    return buf if perm is None else buf.permute(perm)


def _new_like(t: torch.Tensor, alloc, cached: bool = True) -> torch.Tensor:
    """A fresh tensor of t's shape in t's memory order of the leading dims and unit stride along
    D: a [B, H, S, D] transpose of bshd memory gets a bshd-ordered output, a packed-qkv view a
    dense one. ``cached=False`` for symbolic shapes (the fake impl): SymInts are not hashable."""
    return _alloc((_alloc_order_cached if cached else _alloc_order)(tuple(t.shape), t.stride()), t, alloc)


def _rope_into(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, inverse, q_out, k_out):
    """Writes rope(q), rope(k) into q_out, k_out (which may be q, k themselves)."""
    if not use_triton(q):
        q_ref, k_ref = _rope_reference(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, inverse)
        q_out.copy_(q_ref)
        k_out.copy_(k_ref)
        return
    inplace = q_out is q
    if not inplace:   # a D-strided input is read through a unit-stride copy
        q, k = _unit_last(q), _unit_last(k)
    _launch(q, k, q_out, k_out, _unit_last(cos), _unit_last(sin), position_ids, interleaved, rotary_dim, inverse,
            inplace, layout=layout)


# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _rope_reference(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, inverse):
    if position_ids is not None:    # ids outside [0, max_pos) read cos = sin = 0, as the kernel does
        valid = ((position_ids >= 0) & (position_ids < cos.shape[0]))[..., None]
        ids = position_ids.clamp(0, max(cos.shape[0] - 1, 0))
        cos, sin = (torch.where(valid, t[ids], 0.0) if t.shape[0] else t.new_zeros(ids.shape + t.shape[1:])
                    for t in (cos, sin))
    half = slice(0, None, 2) if interleaved else slice(0, rotary_dim // 2)
    c = _wide(cos)[..., half].unsqueeze(-2)          # [(B,) S, 1, r/2]: broadcast over heads
    s = _wide(sin)[..., half].unsqueeze(-2) * (-1.0 if inverse else 1.0)

    def rotate(x):
        xw = _wide(_bshd(x, layout))
        rot, tail = xw[..., :rotary_dim], xw[..., rotary_dim:]
        if interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.stack((o1, o2), -1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)
        out = torch.cat((out, tail), -1).to(x.dtype)
        out = out.transpose(1, 2) if layout == "bhsd" else out
        return out.squeeze(0) if x.dim() == 3 else out

    return rotate(q), rotate(k)


def rope_reference(q, k, cos, sin, position_ids=None, interleaved=False, rotary_dim=None,
                   inplace=False, layout="bshd"):
    """Plain PyTorch rope with the same conventions, in fp32 (fp64 for fp64 inputs)."""
    rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
    q_out, k_out = _rope_reference(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, False)
    if inplace:
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out


# ----------------------------------------------------------------------------------------------
# custom ops + autograd
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             position_ids: Optional[torch.Tensor], interleaved: bool, rotary_dim: int, layout: str,
             inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _new_like(q, empty), _new_like(k, empty)
    _rope_into(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, inverse, q_out, k_out)
    return q_out, k_out


@_rope_op.register_fake
def _(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, inverse):
    def alloc(shape, dtype, device):
        return torch.empty(shape, dtype=dtype, device=device)

    return _new_like(q, alloc, cached=False), _new_like(k, alloc, cached=False)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, inverse = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.flags = (interleaved, rotary_dim, layout, not inverse)
    ctx.dtypes = (q.dtype, k.dtype)


def _backward(ctx, dq_out, dk_out):
    # the rotation is orthogonal: its gradient is the inverse rotation of the output gradients
    cos, sin, position_ids = ctx.saved_tensors
    dq, dk = _rope_op(dq_out.to(ctx.dtypes[0]), dk_out.to(ctx.dtypes[1]), cos, sin, position_ids, *ctx.flags)
    return dq, dk, None, None, None, None, None, None, None


_rope_op.register_autograd(_backward, setup_context=_setup_context)


@custom_op("tilefuse::rope_", mutates_args=("q", "k"))
def _rope_inplace_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     position_ids: Optional[torch.Tensor], interleaved: bool, rotary_dim: int,
                     layout: str) -> None:
    _rope_into(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, False, q, k)


@_rope_inplace_op.register_fake
def _(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout):
    return None


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _check_rope_inputs(q, k, cos, sin, position_ids, interleaved, rotary_dim, inplace, layout) -> int:
    """Validates everything before any launch; returns the rotary dim."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, flag in (("interleaved", interleaved), ("inplace", inplace)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(name, t)
    check_same_dtype(q=q, k=k)
    check_same_dtype(cos=cos, sin=sin)
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    dims = "[S, H, D]" if layout == "bshd" else "[H, S, D]"
    for name, t in (("q", q), ("k", k)):
        if t.dim() not in (3, 4):
            raise ValueError(f"{name} must be 4-D ({layout}) or 3-D {dims}, got shape {tuple(t.shape)}")
    if q.dim() != k.dim():
        raise ValueError(f"q and k must have the same number of dims, got {tuple(q.shape)} and {tuple(k.shape)}")
    (batch, seq_len, _, head_dim), _ = _bshd_meta(tuple(q.shape), q.stride(), layout)
    k_shape, _ = _bshd_meta(tuple(k.shape), k.stride(), layout)
    if (batch, seq_len, head_dim) != (k_shape[0], k_shape[1], k_shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, sequence and "
                         f"head_dim (layout {layout!r}); only the head counts may differ")
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in [0, head_dim={head_dim}], got {rotary_dim}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if position_ids is None:
        ok = cos.dim() in (2, 3) and cos.shape[-2:] == (seq_len, rotary_dim)
        ok = ok and (cos.dim() == 2 or cos.shape[0] in (1, batch))
        if not ok:
            raise ValueError(f"cos/sin have shape {tuple(cos.shape)}; expected [S, r], [1, S, r] or [B, S, r] "
                             f"with S={seq_len}, r=rotary_dim={rotary_dim}, B={batch}")
    else:
        check_tensor("position_ids", position_ids, dtypes=POSITION_DTYPES)
        if position_ids.dim() not in (1, 2) or position_ids.shape[-1] != seq_len or (
                position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch)):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected [S], [1, S] "
                             f"or [B, S] with S={seq_len}, B={batch}")
        if cos.dim() != 2 or cos.shape[1] != rotary_dim:
            raise ValueError(f"with position_ids, cos/sin must be a [max_pos, r] table with "
                             f"r=rotary_dim={rotary_dim}, got shape {tuple(cos.shape)}")
    if inplace:
        for name, t in (("q", q), ("k", k)):
            if t.numel() > 1 and t.stride(-1) != 1:
                raise ValueError(f"inplace=True needs {name} contiguous in its last dimension (stride {t.stride()})")
            check_writable(name, t, "inplace=True")
            if torch.is_grad_enabled() and t.requires_grad:
                raise ValueError(f"inplace=True is for inference: {name} requires grad and grad mode is "
                                 "enabled; use inplace=False (or torch.no_grad()) to differentiate")
        _check_disjoint_in_place(q, k)
    return rotary_dim


def _check_disjoint_in_place(q: torch.Tensor, k: torch.Tensor) -> None:
    """In place, q and k must not share an element: the kernel would rotate it twice (once as
    q, once as k), where the reference path rotates each from the original. rope(x, x) did
    that (s42 and before); so did overlapping slices (0.62 / 0.68 off) and, through the eager
    fast path, which skipped this test, rope(x, x) again (0.67 off; s43 audit). q and k sliced
    from one packed qkv buffer stay allowed (``may_share_elements`` proves them disjoint). Eager
    only (dynamo cannot compare data pointers)."""
    if not torch.compiler.is_compiling() and may_share_elements(q, k):
        raise ValueError("inplace=True with q and k in the same memory (the same tensor, or overlapping views): "
                         "shared elements would be rotated twice; pass disjoint tensors or inplace=False")


def _default_layout(q, k) -> str:
    """``layout=None``: "bshd", unless q and k read as well one way as the other (S = H, and k's
    too): then a Hugging Face [B, H, S, D] pair taken as [B, S, H, D] would pass every shape check
    and come out rotated along the wrong axis, so the caller must say which."""
    if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() in (3, 4) and k.dim() in (3, 4)
            and q.shape[-3] == q.shape[-2] > 1 and k.shape[-3] == k.shape[-2]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} have as many heads as positions, so "
                         f"their layout is ambiguous: pass layout='bshd' ([B, S, H, D]) or 'bhsd' ([B, H, S, D])")
    return "bshd"


def rope(q, k, cos, sin, position_ids=None, interleaved=False, rotary_dim=None, inplace=False,
         layout=None):
    """Rotary position embedding of q and k in one launch; returns ``(q_out, k_out)``.

    q ``[B, S, H_q, D]``, k ``[B, S, H_k, D]`` (``layout="bhsd"``: ``[B, H, S, D]``, as Hugging
    Face passes them; 3-D: one batch), any strides with unit stride along D. ``layout=None`` means
    "bshd", except that it raises when S equals the head counts (where both readings pass the
    shape checks). cos/sin: last dim ``rotary_dim`` (default D),
    shape ``[S, r]``, ``[1, S, r]`` or ``[B, S, r]``; or a ``[max_pos, r]`` table indexed by
    ``position_ids`` (``[S]`` or ``[B, S]``; ids must lie in ``[0, max_pos)``, others read
    cos = sin = 0). NeoX halves by default, GPT-J pairs with ``interleaved=True`` (cos/sin then
    repeat_interleaved). Features past ``rotary_dim`` pass through. fp32 math; outputs in q/k's
    dtype and memory order. Gradients flow to q and k only (cos/sin get none).
    ``inplace=True`` rotates q and k in place and returns them; it is for inference: autograd
    through it is not supported (error when q or k requires grad under grad mode). q and k must
    not share an element (slices of one packed qkv buffer are fine; the same tensor or
    overlapping views raise).
    """
    if layout is None:
        layout = _default_layout(q, k)
    key = call_key(no_grad_layout(q, k, cos, sin, position_ids), (interleaved, rotary_dim, inplace, layout))
    hit = _FAST.get(key)
    if hit is not None:
        return hit.run(q, k, cos, sin, position_ids)
    out = _checked_rope(q, k, cos, sin, position_ids, interleaved, rotary_dim, inplace, layout)
    if (key is not None and key[-1] and plain_tensors(q, k, cos, sin, position_ids)
            and all(t.stride(-1) == 1 for t in (q, k, cos, sin))):     # no copy made for the kernel
        rotary_dim = _check_rope_inputs(q, k, cos, sin, position_ids, interleaved, rotary_dim, inplace, layout)
        _FAST.put(key, _RopeCall(_plan_of(q, k, *out, cos, sin, position_ids, interleaved, rotary_dim, False,
                                          inplace, None, layout), inplace,
                                 None if inplace else _alloc_order(tuple(q.shape), q.stride()),
                                 None if inplace else _alloc_order(tuple(k.shape), k.stride()),
                                 DisjointByOffset(q, k) if inplace else None))
    return out


def _checked_rope(q, k, cos, sin, position_ids, interleaved, rotary_dim, inplace, layout):
    rotary_dim = _check_rope_inputs(q, k, cos, sin, position_ids, interleaved, rotary_dim, inplace, layout)
    if inplace:
        _rope_inplace_op(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout)
        return q, k
    return _rope_op(q, k, cos, sin, position_ids, interleaved, rotary_dim, layout, False)


class _RopeCall(NamedTuple):
    """A validated no-grad call layout of :func:`rope` (the eager fast path): the launch the
    checked path makes after its checks, and the outputs' allocation order."""
    plan: Optional[_Plan]           # None: nothing to launch (no tokens or no features)
    inplace: bool
    q_alloc: Optional[tuple]        # _alloc_order of q and k (new outputs), None in place
    k_alloc: Optional[tuple]
    disjoint: Optional[DisjointByOffset]    # in place: q and k share no element (addresses are not in the key)

    def run(self, q, k, cos, sin, position_ids):
        if self.inplace:
            self.disjoint.check(q, k, _check_disjoint_in_place)
            q_out, k_out = q, k
            increment_version(q)                         # as the custom op's mutation would
            increment_version(k)
        else:
            q_out, k_out = _alloc(self.q_alloc, q), _alloc(self.k_alloc, k)
        if self.plan is not None:
            rope_kernel.launch_prepared(self.plan.grid, (q, k, q_out, k_out, cos, sin,
                                                         cos if position_ids is None else position_ids),
                                        self.plan.prepared)
        return q_out, k_out


_FAST = CallCache()       # no-grad call layout and options -> _RopeCall


def rope_cos_sin_table(max_pos: int, rotary_dim: int, base: float = 10000.0, interleaved: bool = False,
                       dtype: torch.dtype = torch.float32, device=None):
    """(cos, sin) tables ``[max_pos, rotary_dim]`` in rope's convention, θ_j = base^(−2j/r):
    NeoX halves duplicated (HF Llama), or repeat_interleaved for ``interleaved=True`` (HF GPT-J)."""
    for name, v in (("max_pos", max_pos), ("rotary_dim", rotary_dim)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if max_pos < 0 or rotary_dim < 0 or rotary_dim % 2:
        raise ValueError(f"max_pos must be >= 0 and rotary_dim even and >= 0, got {max_pos} and {rotary_dim}")
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    full = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    return full.cos().to(dtype), full.sin().to(dtype)


# ----------------------------------------------------------------------------------------------
# peers + registry
# ----------------------------------------------------------------------------------------------


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope_torch(q, k, cos, sin, position_ids=None, interleaved=False, rotary_dim=None, inplace=False,
               layout="bshd"):
    """Eager PyTorch as HF writes it (``q * cos + rotate_half(q) * sin`` in q's dtype)."""
    r = q.shape[-1] if rotary_dim is None else rotary_dim
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    head_dim_axis = -2 if layout == "bshd" else -3     # cos/sin broadcast over the head axis
    cos, sin = cos.unsqueeze(head_dim_axis).to(q.dtype), sin.unsqueeze(head_dim_axis).to(q.dtype)
    rotate = _rotate_every_two if interleaved else _rotate_half

    def apply(x):
        x_rot, x_pass = x[..., :r], x[..., r:]
        out = x_rot * cos + rotate(x_rot) * sin
        out = torch.cat((out, x_pass), dim=-1) if r < x.shape[-1] else out
        return x.copy_(out) if inplace else out

    return apply(q), apply(k)


def _liger_rope():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb  # type: ignore
    except Exception:
        return None

    def liger(q, k, cos, sin, position_ids=None, interleaved=False, rotary_dim=None, inplace=False,
              layout="bshd"):
        # Liger: NeoX halves, q/k [B, H, S, D] (heads of a token dense), cos/sin [1 or B, S, r].
        # It rotates in place whenever q.transpose(1, 2) is contiguous (our bshd inputs), as in
        # HF models; it has no position_ids gather (done here, eagerly) and no GPT-J variant.
        if interleaved:
            raise NotImplementedError("Liger's rope has no GPT-J (interleaved) variant")
        if position_ids is not None:
            cos, sin = cos[position_ids], sin[position_ids]
        cos, sin = (cos.unsqueeze(0), sin.unsqueeze(0)) if cos.dim() == 2 else (cos, sin)
        partial = {} if rotary_dim in (None, q.shape[-1]) else {"rotary_dim": rotary_dim}
        qh, kh = (q, k) if layout == "bhsd" else (q.transpose(1, 2), k.transpose(1, 2))
        out = liger_rotary_pos_emb(qh, kh, cos, sin, **partial)
        q_out, k_out = out[0], out[1]
        return (q_out, k_out) if layout == "bhsd" else (q_out.transpose(1, 2), k_out.transpose(1, 2))

    return liger


def _make_inputs(shape, dtype, device):
    # shape = (B, S, H_q, H_k, D); cos/sin: a real base-10000 table for positions 0..S-1, [S, D]
    batch, seq_len, n_q_heads, n_k_heads, head_dim = shape
    q = torch.randn(batch, seq_len, n_q_heads, head_dim, device=device).to(dtype).requires_grad_(True)
    k = torch.randn(batch, seq_len, n_k_heads, head_dim, device=device).to(dtype).requires_grad_(True)
    cos, sin = rope_cos_sin_table(seq_len, head_dim, dtype=dtype, device=device)
    return Inputs((q, k, cos, sin), grad_args=(0, 1))


def _bytes(shape, dtype, pass_):
    # q, k (fwd) or dq_out, dk_out (bwd) read once and written once; cos and sin: D/2 values
    # each per position, the [S, D] table being shared by the batch
    batch, seq_len, n_q_heads, n_k_heads, head_dim = shape
    return 2 * tensor_bytes((batch, seq_len, n_q_heads + n_k_heads, head_dim), dtype) \
        + tensor_bytes((seq_len, head_dim), dtype)


def _flops(shape, pass_):
    # each rotated pair: 4 multiplies and 2 adds (the inverse rotation backward): 3 per feature
    batch, seq_len, n_q_heads, n_k_heads, head_dim = shape
    return 3 * batch * seq_len * (n_q_heads + n_k_heads) * head_dim


register(OpSpec(
    name="rope",
    fn=rope,
    reference=rope_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    test_shapes=[(1, 1, 1, 1, 8), (2, 5, 4, 2, 16), (1, 7, 3, 1, 64), (2, 3, 2, 2, 24)],
    gpu_test_shapes=[(2, 1024, 32, 8, 128), (3, 333, 12, 12, 64), (1, 777, 28, 4, 80), (4, 257, 40, 40, 96)],
    bench_shapes=[(1, 8192, 32, 8, 128), (4, 4096, 32, 8, 128), (4, 4096, 32, 32, 128), (1, 32768, 64, 8, 128)],
    peers={"torch": lambda: rope_torch, "liger": _liger_rope},
    description="RoPE of q [B,S,Hq,D] and k [B,S,Hk,D] (NeoX halves), cos/sin [S,D]; shape = (B, S, Hq, Hk, D)",
))
