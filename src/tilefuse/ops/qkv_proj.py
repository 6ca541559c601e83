"""``tilefuse.qkv_proj``: the fused QKV projection, optionally with RoPE, from one packed weight.

    [q | k | v] = x @ Wᵀ + bias
        x [..., K] (leading dims flattened to T tokens), W [(H_q + 2·H_kv)·D, K] packed as HF's
        fused qkv_proj / Phi-3 / vLLM store it (rows 0..H_q·D q, then H_kv·D k, then H_kv·D v),
        bias [(H_q + 2·H_kv)·D] (Qwen2); fp32 accumulation
    q, k ← rope(q, k, cos, sin, position_ids, interleaved, rotary_dim)    (when cos/sin are given;
        ``tilefuse.rope``'s conventions and math: NeoX halves or GPT-J pairs, partial rotary)
    returns q [..., H_q, D], k [..., H_kv, D], v [..., H_kv, D]: three contiguous tensors, the
        flash-attn / ``tilefuse.attention`` layout ([B, S, H, D] for x [B, S, K])
    backward, with dq, dk, dv the output gradients and R⁻¹ rope's inverse rotation (sin → −sin):
        d = [R⁻¹ dq | R⁻¹ dk | dv]   [T, (H_q + 2·H_kv)·D], packed like W's rows
        dx = d @ W,   dW = dᵀ @ x,   dbias = Σ_tokens d          (cos / sin get no gradient)

Forward: one kernel (``_qkv_proj_kernels.py``): a persistent GEMM whose column tiles are single
heads, rotating q / k heads in the epilogue and writing each head into its own output. Small T
(the grid would not fill the GPU) takes the un-fused path: matmul's kernel, then rope's kernel
on the q / k slices of the product (and a copy of v's). Rope positions: for x [B, S, K] token
(b, s) uses table row s (or position_ids[b, s]); a 2-D x [T, K] is one sequence of T tokens.

Backward: rope's kernel inverse-rotates dq and dk straight into their column slices of the
packed d (strided writes, no concatenation; dv is copied into its slice), then two GEMMs on
``tilefuse.matmul``'s kernel. Nothing beyond x, W and the tables is saved by the forward.

Bytes counted (ideal, per pass), N = (H_q + 2·H_kv)·D, r = rotary_dim: forward reads x and W,
r/2 cos and r/2 sin values per token, writes q, k, v: T·K + N·K + T·r + T·N elements. Backward
reads dq, dk, dv, the tables, x and W, writes dx and dW: T·N + T·r + 2·T·K + 2·N·K (the packed d,
T·N written once and read twice, is the un-fused backward's own traffic, not counted).
FLOPs: 2·T·K·N forward, twice that backward (dx and dW).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .._autocast import autocast_inputs, autocast_on
from .._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from .._dispatch import cdiv, empty, use_triton
from .._op import CallCache, call_key, custom_op, direct_backward, eager_layout, plain_tensors, records_graph
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._qkv_proj_kernels import launch_qkv_proj
from .matmul import _gemm
from .rope import _check_rope_inputs, _rope_into, rope, rope_cos_sin_table, rope_reference, rope_torch

# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dtype == torch.float64 else t.float()


def _split_heads(y: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int):
    """q, k, v views [..., H, D] of the packed projection y [..., (H_q + 2·H_kv)·D]."""
    lead = y.shape[:-1]
    parts = y.split([n_q_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    return tuple(p.reshape(*lead, p.shape[-1] // head_dim, head_dim) for p in parts)


def _reference(x, w, bias, cos, sin, position_ids, n_q_heads, n_kv_heads, head_dim, interleaved, rotary_dim):
    """(q, k, v) in fp32 math (fp64 for fp64 inputs), cast to x's dtype; x [T, K] (one sequence)
    or [B, S, K]; differentiable."""
    y = _wide(x) @ _wide(w).t()
    if bias is not None:
        y = y + _wide(bias)
    q, k, v = _split_heads(y, n_q_heads, n_kv_heads, head_dim)
    if rotary_dim:
        q, k = rope_reference(q, k, cos, sin, position_ids, interleaved, rotary_dim)
    return q.to(x.dtype), k.to(x.dtype), v.to(x.dtype)


def qkv_proj_reference(x, w_qkv, num_heads, num_kv_heads, head_dim=None, bias=None, cos=None, sin=None,
                       position_ids=None, interleaved=False, rotary_dim=None):
    """Plain PyTorch, differentiable, same signature as :func:`qkv_proj` (the fp64 reference)."""
    head_dim = head_dim or w_qkv.shape[0] // (num_heads + 2 * num_kv_heads)
    rotary_dim = 0 if cos is None else (head_dim if rotary_dim is None else rotary_dim)
    return _reference(x, w_qkv, bias, cos, sin, position_ids, num_heads, num_kv_heads, head_dim,
                      interleaved, rotary_dim)


# ----------------------------------------------------------------------------------------------
# custom ops + autograd (2-D x: the public function flattens the leading dims)
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::qkv_proj_fwd", mutates_args=())
def _qkv_fwd_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                sin: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], n_q_heads: int,
                n_kv_heads: int, head_dim: int, seq_len: int, interleaved: bool,
                rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, H_q, D], k [T, H_kv, D], v [T, H_kv, D]); rows are tokens (t // seq_len, t % seq_len);
    rotary_dim 0: no rope."""
    if use_triton(x):
        return launch_qkv_proj(x, w, bias, cos, sin, position_ids, n_q_heads, n_kv_heads, head_dim,
                               seq_len, interleaved, rotary_dim)
    t = x.shape[0]
    x3 = x.view(cdiv(t, seq_len) if t else 1, seq_len if t else 0, x.shape[1])
    outs = _reference(x3, w, bias, cos, sin, position_ids, n_q_heads, n_kv_heads, head_dim, interleaved,
                      rotary_dim)
    return tuple(o.reshape(t, o.shape[2], head_dim).contiguous() for o in outs)


@_qkv_fwd_op.register_fake
def _(x, w, bias, cos, sin, position_ids, n_q_heads, n_kv_heads, head_dim, seq_len, interleaved, rotary_dim):
    t = x.shape[0]
    return tuple(x.new_empty((t, h, head_dim)) for h in (n_q_heads, n_kv_heads, n_kv_heads))


@custom_op("tilefuse::qkv_proj_pack_grads", mutates_args=())
def _pack_grads_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: Optional[torch.Tensor],
                   sin: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], seq_len: int,
                   interleaved: bool, rotary_dim: int) -> torch.Tensor:
    """d = [R⁻¹ dq | R⁻¹ dk | dv] as [T, (H_q + 2·H_kv)·D] in dq's dtype: rope's inverse rotation
    (its kernel, or its reference on the CPU path) writes into d's column slices in place."""
    (t, n_q_heads, head_dim), n_kv_heads = dq.shape, dk.shape[1]
    d = empty((t, (n_q_heads + 2 * n_kv_heads) * head_dim), dq.dtype, dq.device)
    d_q, d_k, d_v = _split_heads(d, n_q_heads, n_kv_heads, head_dim)    # views into d
    d_v.copy_(dv)
    if rotary_dim == 0 or t == 0:
        d_q.copy_(dq)
        d_k.copy_(dk)
        return d
    batch = cdiv(t, seq_len)

    def seqs(g):
        return g.reshape(batch, seq_len, g.shape[1], head_dim)

    _rope_into(seqs(dq), seqs(dk), cos, sin, position_ids, interleaved, rotary_dim, "bshd", True,
               seqs(d_q), seqs(d_k))
    return d


@_pack_grads_op.register_fake
def _(dq, dk, dv, cos, sin, position_ids, seq_len, interleaved, rotary_dim):
    return dq.new_empty((dq.shape[0], (dq.shape[1] + 2 * dk.shape[1]) * dq.shape[2]))


def _setup_context(ctx, inputs, output):
    x, w, bias, cos, sin, position_ids, _, _, _, seq_len, interleaved, rotary_dim = inputs
    ctx.rope_args = (seq_len, interleaved, rotary_dim)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, w, cos, sin, position_ids)


def _backward(ctx, dq, dk, dv):
    x, w, cos, sin, position_ids = ctx.saved_tensors
    need_dx, need_dw, need_dbias = ctx.needs_input_grad[:3]
    dx = dw = dbias = None
    if need_dx or need_dw or need_dbias:
        d = _pack_grads_op(dq.to(x.dtype), dk.to(x.dtype), dv.to(x.dtype), cos, sin, position_ids,
                           *ctx.rope_args)
        direct = direct_backward(ctx, dq, dk, dv)     # an eager backward: no op dispatch for the GEMMs
        dx = _gemm(d, w, x.dtype, direct) if need_dx else None
        dw = _gemm(d.t(), x, w.dtype, direct) if need_dw else None        # straight into w's row-major layout
        dbias = d.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if need_dbias else None
    return dx, dw, dbias, None, None, None, None, None, None, None, None, None


_qkv_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _shape_stub(x: torch.Tensor, shape) -> torch.Tensor:
    """A tensor of ``shape`` on x's device and dtype, no memory of its own (stride 0): stands in
    for q / k in rope's input checks before q / k exist."""
    if x.numel():
        return x.detach().as_strided(shape, [0] * len(shape))
    return x.new_empty(()).expand(shape)


def _check_inputs(x, w_qkv, num_heads, num_kv_heads, head_dim, bias, cos, sin, position_ids, interleaved,
                  rotary_dim) -> tuple[int, int, int]:
    """Validate everything before any launch; returns (head_dim, rotary_dim (0: no rope), seq_len)."""
    check_tensor("x", x, min_dim=1)
    check_tensor("w_qkv", w_qkv)
    if w_qkv.dim() != 2:
        raise ValueError(f"w_qkv must be 2-D [(num_heads + 2*num_kv_heads) * head_dim, hidden], "
                         f"got shape {tuple(w_qkv.shape)}")
    n_q, n_kv = _check_int("num_heads", num_heads), _check_int("num_kv_heads", num_kv_heads)
    if n_q % n_kv:
        raise ValueError(f"num_heads ({n_q}) must be a multiple of num_kv_heads ({n_kv}) (grouped queries)")
    rows, n_heads = w_qkv.shape[0], n_q + 2 * n_kv
    if head_dim is None:
        if rows % n_heads or rows == 0:
            raise ValueError(f"w_qkv has {rows} rows, not a positive multiple of num_heads + 2*num_kv_heads "
                             f"= {n_heads} (rows = (num_heads + 2*num_kv_heads) * head_dim)")
        head_dim = rows // n_heads
    elif _check_int("head_dim", head_dim) * n_heads != rows:
        raise ValueError(f"w_qkv has {rows} rows but (num_heads + 2*num_kv_heads) * head_dim = "
                         f"{n_heads} * {head_dim} = {n_heads * head_dim}")
    if w_qkv.shape[1] != x.shape[-1]:
        raise ValueError(f"w_qkv has hidden = {w_qkv.shape[1]} columns but x's last dimension is "
                         f"{x.shape[-1]} (x {tuple(x.shape)}, w_qkv {tuple(w_qkv.shape)})")
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, (rows,), "[(num_heads + 2*num_kv_heads) * head_dim]")
    check_same_dtype(x=x, w_qkv=w_qkv, bias=bias)
    check_same_device(x=x, w_qkv=w_qkv, bias=bias)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if cos is None and sin is None:
        for name, given in (("position_ids", position_ids is not None), ("rotary_dim", rotary_dim is not None),
                            ("interleaved", interleaved)):
            if given:
                raise ValueError(f"{name} is a rope option: pass cos and sin too (or leave {name} unset)")
        return head_dim, 0, 1
    if cos is None or sin is None:
        raise ValueError(f"cos and sin go together: got only {'sin' if cos is None else 'cos'}")
    if x.dim() not in (2, 3):
        raise ValueError(f"with rope, x must be [T, hidden] (one sequence) or [B, S, hidden]; "
                         f"got shape {tuple(x.shape)}")
    check_same_device(x=x, cos=cos, sin=sin, position_ids=position_ids)
    lead = tuple(x.shape[:-1])
    q_stub, k_stub = _shape_stub(x, (*lead, n_q, head_dim)), _shape_stub(x, (*lead, n_kv, head_dim))
    rotary_dim = _check_rope_inputs(q_stub, k_stub, cos, sin, position_ids, interleaved, rotary_dim, False, "bshd")
    return head_dim, rotary_dim, x.shape[-2]


def qkv_proj(x: torch.Tensor, w_qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int | None = None, bias: torch.Tensor | None = None, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
             interleaved: bool = False, rotary_dim: int | None = None):
    """``q, k, v`` of ``x @ w_qkvᵀ + bias`` split into heads, q and k rotated when cos/sin are
    given; one fused kernel, differentiable in x, w_qkv and bias.

    x ``[..., hidden]`` (with rope: ``[B, S, hidden]``, or ``[T, hidden]`` as one sequence);
    w_qkv ``[(num_heads + 2·num_kv_heads)·head_dim, hidden]``, rows q | k | v (head_dim defaults to
    rows / (num_heads + 2·num_kv_heads)); bias ``[rows]``; fp16 / bf16 (fp32 computed without
    TF32), all one dtype. cos / sin / position_ids / interleaved / rotary_dim exactly as
    :func:`tilefuse.rope` takes them for q ``[B, S, H, D]`` (tables ``[S, r]``, ``[1 or B, S, r]``,
    or a ``[max_pos, r]`` table indexed by position_ids). Returns contiguous
    ``q [..., num_heads, head_dim]``, ``k`` and ``v [..., num_kv_heads, head_dim]`` in x's dtype.
    Under ``torch.autocast`` x, w_qkv and bias are cast to its dtype first (the rope tables keep theirs).

    Host path: a repeated eager call (with or without a graph to record) skips the checks its
    layout, requires_grad flags and options passed the first time, and the op's argument scan
    (:class:`_QkvCall`)."""
    if autocast_on():
        x, w_qkv, bias = autocast_inputs(x, w_qkv, bias)
    key = call_key(eager_layout(x, w_qkv, bias, cos, sin, position_ids),
                   (num_heads, num_kv_heads, head_dim, interleaved, rotary_dim))
    call = _FAST.get(key)
    op = _qkv_fwd_op if call is None else call.entry
    if call is None:
        call = _QkvCall(*_check_inputs(x, w_qkv, num_heads, num_kv_heads, head_dim, bias, cos, sin, position_ids,
                                       interleaved, rotary_dim))
        if key is not None and key[-1] and x.numel() and plain_tensors(x, w_qkv, bias, cos, sin, position_ids):
            _FAST.put(key, call._replace(entry=_qkv_fwd_op.apply_eager if records_graph(key) else _qkv_fwd_op.direct))
    lead, hidden = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, hidden) if hidden else x.reshape(lead.numel(), 0)
    q, k, v = op(x2, w_qkv, bias, cos, sin, position_ids, num_heads, num_kv_heads, call.head_dim,
                 call.seq_len, interleaved, call.rotary_dim)
    return q.view(*lead, num_heads, call.head_dim), k.view(*lead, num_kv_heads, call.head_dim), \
        v.view(*lead, num_kv_heads, call.head_dim)


class _QkvCall(NamedTuple):
    """What the checks of one eager call layout of :func:`qkv_proj` derived, and (kept in
    ``_FAST``) the op's entry its repeats take: the eager autograd Function when the call records
    a graph, else the implementation (both without the op's argument scan: the key holds what the
    scan reads, :func:`eager_layout`)."""
    head_dim: int
    rotary_dim: int         # 0: no rope
    seq_len: int
    entry: object = None


_FAST = CallCache()       # eager call layout, requires_grad flags and options -> _QkvCall


# ----------------------------------------------------------------------------------------------
# peers + registry
# ----------------------------------------------------------------------------------------------


def _torch_qkv_proj(x, w_qkv, num_heads, num_kv_heads, head_dim=None, bias=None, cos=None, sin=None,
                    position_ids=None, interleaved=False, rotary_dim=None, rope_fn=rope_torch):
    """Eager composition as HF writes it: one cuBLAS GEMM, split, view, rope (tilefuse-free
    ``rope_torch`` by default); v stays a strided view of the product (no copy)."""
    head_dim = head_dim or w_qkv.shape[0] // (num_heads + 2 * num_kv_heads)
    q, k, v = _split_heads(F.linear(x, w_qkv, bias), num_heads, num_kv_heads, head_dim)
    if cos is not None:
        q, k = rope_fn(q, k, cos, sin, position_ids, interleaved, rotary_dim)
    return q, k, v


def _cublas_tilefuse_rope(*args, **kwargs):
    """The un-fused tilefuse pipeline with cuBLAS: F.linear, then tilefuse.rope on the slices."""
    return _torch_qkv_proj(*args, rope_fn=rope, **kwargs)


def _make_inputs(shape, dtype, device):
    """x [T, hidden] (one sequence), w_qkv scaled by 1/√hidden (q, k, v ~ N(0, 1)), a base-10000
    [T, D] cos/sin table in x's dtype (full NeoX rotary, as Llama)."""
    t, hidden, n_q, n_kv, head_dim = shape
    x = torch.randn(t, hidden, device=device).to(dtype).requires_grad_(True)
    w = (torch.randn((n_q + 2 * n_kv) * head_dim, hidden, device=device) / max(hidden, 1) ** 0.5)
    cos, sin = rope_cos_sin_table(t, head_dim, dtype=dtype, device=device)
    return Inputs((x, w.to(dtype).requires_grad_(True), n_q, n_kv, None, None, cos, sin), {}, grad_args=(0, 1))


def _bytes(shape, dtype, pass_):
    t, hidden, n_q, n_kv, head_dim = shape
    n = (n_q + 2 * n_kv) * head_dim
    x, w, out = tensor_bytes((t, hidden), dtype), tensor_bytes((n, hidden), dtype), tensor_bytes((t, n), dtype)
    tables = tensor_bytes((t, head_dim), dtype)       # r/2 cos + r/2 sin per token, r = D
    return x + w + tables + out if pass_ == "fwd" else out + tables + 2 * x + 2 * w


def _flops(shape, pass_):
    t, hidden, n_q, n_kv, head_dim = shape
    return (2 if pass_ == "fwd" else 4) * t * hidden * (n_q + 2 * n_kv) * head_dim


register(OpSpec(
    name="qkv_proj",
    fn=qkv_proj,
    reference=qkv_proj_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    # (T, hidden, H_q, H_kv, D): T = 1, odd T / hidden, D = 16 / 32 / 64, GQA and MQA
    test_shapes=[(1, 16, 2, 1, 16), (33, 40, 4, 2, 32), (5, 24, 2, 2, 64), (17, 19, 3, 1, 16)],
    # T = 1: the un-fused path; D = 80: NeoX halves of 40 in 64-wide accumulators
    gpu_test_shapes=[(1, 4096, 32, 8, 128), (130, 4097, 32, 8, 128), (2048, 4096, 32, 8, 128),
                     (333, 2048, 16, 16, 80)],
    bench_shapes=[(8192, 4096, 32, 8, 128), (4096, 8192, 64, 8, 128), (16, 4096, 32, 8, 128)],
    peers={"torch": lambda: _torch_qkv_proj, "cublas_rope": lambda: _cublas_tilefuse_rope},
    description="q, k, v = split(x @ Wqkv.T) with RoPE on q, k, one GEMM; shape = (T, hidden, Hq, Hkv, D)",
))
