"""layer_norm and rms_norm over the last dimension(s), optionally fused with a residual add.

    h      = x + residual                    (fused add; otherwise h = x)
    μ      = mean_j h_j                      (0 for RMSNorm)
    rstd   = 1 / sqrt(mean_j (h_j - μ)² + eps)
    x̂      = (h - μ) · rstd
    y      = x̂ · (offset + w) + b            (offset = 1 gives Gemma's RMSNorm)
    backward, wdy = dy · (offset + w):
        dh  = rstd · (wdy - mean(wdy) - x̂ · mean(wdy · x̂))   (no mean(wdy) term for RMSNorm)
              + the gradient flowing into h itself;  dx = dresidual = dh
        dw  = Σ_rows dy · x̂,   db = Σ_rows dy

Bytes counted (ideal, per pass; M rows of N): forward reads x (and residual) and writes y (and h),
reads w/b, writes rstd (and μ) as fp32 [M]; backward reads x (h when fused), dy (and dh) and
writes dx, reads w and rstd/μ, writes dw/db. x is read once per pass in the fused tier.

Tiers (kernels in ``_norm_kernels``, one set for both norms and both residual variants; launch
heuristics and launchers in ``_norm_launch``):

* fused: the padded row fits one register tile (``MAX_FUSED_N_FWD`` / ``_BWD``); short rows share
  a program. Forward: one read, one write. Backward: a persistent grid, each program walks a
  slice of the rows and keeps dw/db partials in fp32 registers, written once to a
  ``[programs, N]`` buffer that one ``.sum(0)`` reduces (no atomics).
* looped (long rows): a stats kernel walks each row in tiles first (mean/rstd forward, the two
  row dot products backward), then the same normalize / backward kernels run on column tiles.
  Two walks over the row per pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from .._dispatch import use_triton, workspace
from .._op import CallCache, call_key, custom_op, direct_backward, no_grad_layout, plain_tensors
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._norm_launch import _launch_bwd, _launch_fwd

# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; also the CPU path)
# ----------------------------------------------------------------------------------------------


def _wide(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t if t is None or t.dtype == torch.float64 else t.float()


def _norm_stats(h: torch.Tensor, eps: float, is_rms: bool, dims=(-1,)):
    """(mean or None, rstd) of the wide tensor h over ``dims``, keepdim."""
    mean = None if is_rms else h.mean(dims, keepdim=True)
    hc = h if is_rms else h - mean
    return mean, torch.rsqrt((hc * hc).mean(dims, keepdim=True) + eps)


def _norm_reference(x, normalized_shape, weight, bias, eps, offset, residual, is_rms):
    dims = tuple(range(-len(_shape_tuple(normalized_shape, x)), 0))
    h = x if residual is None else x + residual          # rounded to x's dtype, as the kernel does
    hw = _wide(h)
    mean, rstd = _norm_stats(hw, eps, is_rms, dims)
    y = (hw if is_rms else hw - mean) * rstd
    if weight is not None:
        y = y * (_wide(weight) + offset)
    if bias is not None:
        y = y + _wide(bias)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def layer_norm_reference(x, normalized_shape=None, weight=None, bias=None, eps=1e-5, residual=None):
    return _norm_reference(x, normalized_shape, weight, bias, eps, 0.0, residual, is_rms=False)


def default_rms_eps(dtype: torch.dtype) -> float:
    """torch's ``eps=None`` for RMSNorm: the machine epsilon of the dtype it computes in, which is
    fp32 for fp16 / bf16 inputs (fp16's own, 9.8e-4, would be 8000x too large)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def rms_norm_reference(x, normalized_shape=None, weight=None, eps=1e-6, offset=0.0, residual=None):
    eps = default_rms_eps(x.dtype) if eps is None else eps
    return _norm_reference(x, normalized_shape, weight, None, eps, offset, residual, is_rms=True)


def _fwd_reference(x, weight, bias, residual, eps, offset, is_rms):
    """The custom op's CPU path: (y, h, mean, rstd) like _launch_fwd."""
    h = x if residual is None else x + residual
    hw = _wide(h)
    mean, rstd = _norm_stats(hw, eps, is_rms)
    y = (hw if is_rms else hw - mean) * rstd
    if weight is not None:
        y = y * (weight.float() + offset)
    if bias is not None:
        y = y + bias.float()
    mean = x.new_empty((0,), dtype=torch.float32) if is_rms else mean.reshape(-1).float()
    return (y.to(x.dtype).contiguous(), h.contiguous() if residual is not None else x.new_empty((0,)),
            mean.contiguous(), rstd.reshape(-1).float().contiguous())


def _bwd_reference(dy, x, weight, mean, rstd, dres, offset, is_rms, need_dw, need_db,
                   dw_dtype=torch.float32, db_dtype=torch.float32):
    n = x.shape[-1]
    xw, dyw = x.float(), dy.float()
    lead_shape = x.shape[:-1] + (1,)    # mean / rstd come flat, [rows]
    rstd = rstd.reshape(lead_shape)
    xhat = (xw if is_rms else xw - mean.reshape(lead_shape)) * rstd
    wdy = dyw * (weight.float() + offset) if weight is not None else dyw
    dx = wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)
    if not is_rms:
        dx = dx - wdy.mean(-1, keepdim=True)
    dx = dx * rstd
    if dres is not None:
        dx = dx + dres.float()
    # column sums over every row (a 1-D x is one row: sum(()) would sum everything)
    dw = (dyw * xhat).reshape(-1, n).sum(0) if need_dw else x.new_empty((0,))
    db = dyw.reshape(-1, n).sum(0) if need_db else x.new_empty((0,))
    return dx.to(x.dtype).contiguous(), dw.to(dw_dtype), db.to(db_dtype)


# ----------------------------------------------------------------------------------------------
# custom ops + autograd
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::norm_fwd", mutates_args=())
def _norm_fwd_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor], eps: float, offset: float, is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _launch_fwd(x, weight, bias, residual, eps, offset, is_rms)
    return _fwd_reference(x, weight, bias, residual, eps, offset, is_rms)


@_norm_fwd_op.register_fake
def _(x, weight, bias, residual, eps, offset, is_rms):
    f32 = dict(dtype=torch.float32, device=x.device)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else math.prod(x.shape[:-1])
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape if residual is not None else (0,)),
        torch.empty((0 if is_rms else rows,), **f32),   # mean and rstd: flat [rows]
        torch.empty((rows,), **f32),
    )


@custom_op("tilefuse::norm_bwd", mutates_args=())
def _norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: Optional[torch.Tensor],
    rstd: torch.Tensor, dres: Optional[torch.Tensor], offset: float, is_rms: bool, need_dw: bool, need_db: bool,
    dw_dtype: torch.dtype, db_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db); dw / db already in the weight's / bias's dtype (the cast fused into the
    final reduction)."""
    args = (dy, x, weight, mean, rstd, dres, offset, is_rms, need_dw, need_db, dw_dtype, db_dtype)
    return _launch_bwd(*args) if use_triton(x) else _bwd_reference(*args)


@_norm_bwd_op.register_fake
def _(dy, x, weight, mean, rstd, dres, offset, is_rms, need_dw, need_db, dw_dtype, db_dtype):
    n = x.shape[-1]
    return (x.new_empty(x.shape), torch.empty((n,) if need_dw else (0,), dtype=dw_dtype, device=x.device),
            torch.empty((n,) if need_db else (0,), dtype=db_dtype, device=x.device))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, offset, is_rms = inputs
    _, h, mean, rstd = output
    ctx.has_res, ctx.offset, ctx.is_rms = residual is not None, offset, is_rms
    ctx.w_dtype = weight.dtype if weight is not None else None
    ctx.b_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    # mean / rstd (and h without a residual) never get gradients: untracked outputs spare the
    # autograd engine their grad slots (host time of every backward)
    ctx.mark_non_differentiable(mean, rstd, *(() if residual is not None else (h,)))


def _backward(ctx, dy, dh, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_dw = ctx.w_dtype is not None and ctx.needs_input_grad[1]
    need_db = ctx.b_dtype is not None and ctx.needs_input_grad[2]
    dy = torch.zeros_like(x) if dy is None else dy if dy.dtype == x.dtype else dy.to(x.dtype)
    dres = None if not ctx.has_res or dh is None else dh if dh.dtype == x.dtype else dh.to(x.dtype)
    bwd_op = _norm_bwd_op.direct if direct_backward(ctx, dy, dres) else _norm_bwd_op
    dx, dw, db = bwd_op(dy, x, weight, None if ctx.is_rms else mean, rstd, dres,
                        ctx.offset, ctx.is_rms, need_dw, need_db,
                        ctx.w_dtype or torch.float32, ctx.b_dtype or torch.float32)
    return (dx, dw if need_dw else None, db if need_db else None,
            dx if ctx.has_res else None, None, None, None)


# mean/rstd never receive gradients: skip materializing zeros for them (and for an unused y or h)
_norm_fwd_op.register_autograd(_backward, setup_context=_setup_context, materialize_grads=False)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _shape_tuple(normalized_shape, x) -> tuple:
    if normalized_shape is None:
        return (x.shape[-1],)
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(normalized_shape)


def _check_normalized_shape(normalized_shape, x: torch.Tensor) -> tuple:
    # the common cases first (host time): None, N, (N,) for x's last dim N
    n = x.shape[-1] if x.dim() else None
    kind = type(normalized_shape)
    if normalized_shape is None and n is not None or kind is int and normalized_shape == n:
        return (n,)
    if kind is tuple and len(normalized_shape) == 1 and type(normalized_shape[0]) is int and normalized_shape[0] == n:
        return normalized_shape
    ok_type = normalized_shape is None or isinstance(normalized_shape, (int, tuple, list, torch.Size))
    if not ok_type or isinstance(normalized_shape, bool):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got "
                        f"{type(normalized_shape).__name__} (pass weight/bias by keyword)")
    shape = _shape_tuple(normalized_shape, x)
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise TypeError(f"normalized_shape must be a non-empty sequence of ints, got {normalized_shape!r}")
    if len(shape) > x.dim() or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape {shape} does not match the trailing dims of x {tuple(x.shape)}")
    return shape


def _check_number(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    if not -math.inf < v < math.inf:   # (not math.isfinite: dynamo traces floats symbolically)
        raise ValueError(f"{name} must be finite, got {v}")
    return float(v)


class _NormCall(NamedTuple):
    """A validated no-grad call layout of :func:`_norm` (the eager fast path): what the checked
    path launches after its checks, with mean / rstd in a workspace (nothing saves them)."""
    shape: tuple               # normalized_shape
    eps: float
    offset: float
    is_rms: bool
    rows: int

    def run(self, x, weight, bias, residual):
        flat = len(self.shape) > 1
        if flat:
            x = x.flatten(x.dim() - len(self.shape))
            weight = weight.flatten() if weight is not None else None
            bias = bias.flatten() if bias is not None else None
            residual = residual.flatten(residual.dim() - len(self.shape)) if residual is not None else None
        stats = workspace("norm_fwd_stats", ((0 if self.is_rms else self.rows,), (self.rows,)), torch.float32,
                          x.device)
        y, h, _, _ = _launch_fwd(x, weight, bias, residual, self.eps, self.offset, self.is_rms, stats=stats)
        if flat:
            y = y.unflatten(-1, self.shape)
            h = h.unflatten(-1, self.shape) if residual is not None else h
        return y if residual is None else (y, h)


_FAST = CallCache()       # no-grad call layout and options -> _NormCall


def _fast_key(x, normalized_shape, weight, bias, eps, offset, residual, is_rms):
    """The layout key of an eager call with no gradient to build, else None (:func:`layout_key`
    of every tensor, the options with their types, the Triton path or not)."""
    return call_key(no_grad_layout(x, weight, bias, residual), (normalized_shape, eps, offset, is_rms))


def _norm(x, normalized_shape, weight, bias, eps, offset, residual, is_rms):
    key = _fast_key(x, normalized_shape, weight, bias, eps, offset, residual, is_rms)
    hit = _FAST.get(key)
    if hit is not None:
        return hit.run(x, weight, bias, residual)
    out = _checked_norm(x, normalized_shape, weight, bias, eps, offset, residual, is_rms)
    if key is not None and key[-1] and x.numel() and plain_tensors(x, weight, bias, residual):
        shape = _check_normalized_shape(normalized_shape, x)
        _FAST.put(key, _NormCall(shape, float(eps), float(offset), is_rms, x.numel() // math.prod(shape)))
    return out


def _checked_norm(x, normalized_shape, weight, bias, eps, offset, residual, is_rms):
    check_tensor("x", x, min_dim=1)
    shape = _check_normalized_shape(normalized_shape, x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, t)
            check_shape(name, t, shape, "normalized_shape")
    if residual is not None:
        check_tensor("residual", residual)
        check_same_dtype(x=x, residual=residual)
        check_shape("residual", residual, x.shape, "x's shape")
    check_same_device(x=x, weight=weight, bias=bias, residual=residual)
    eps = _check_number("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    offset = _check_number("offset", offset)
    if offset != 0.0 and weight is None:
        raise ValueError("offset scales the weight (y = x̂·(offset + weight)): pass weight with offset")
    if len(shape) > 1:  # normalize the trailing dims as one flattened row
        x = x.flatten(x.dim() - len(shape))
        weight = weight.flatten() if weight is not None else None
        bias = bias.flatten() if bias is not None else None
        residual = residual.flatten(residual.dim() - len(shape)) if residual is not None else None
    y, h, _, _ = _norm_fwd_op(x, weight, bias, residual, eps, offset, is_rms)
    if len(shape) > 1:
        y = y.unflatten(-1, shape)
        h = h.unflatten(-1, shape) if residual is not None else h
    return y if residual is None else (y, h)


def layer_norm(x, normalized_shape=None, weight=None, bias=None, eps=1e-5, residual=None):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)``; normalized_shape defaults to
    x's last dim. fp32 math; y in x's dtype; weight/bias may be another float dtype than x.

    With ``residual`` (x's shape and dtype): ``h = x + residual``, returns ``(layer_norm(h), h)``.
    """
    return _norm(x, normalized_shape, weight, bias, eps, 0.0, residual, is_rms=False)


def rms_norm(x, normalized_shape=None, weight=None, eps=1e-6, offset=0.0, residual=None):
    """``F.rms_norm(x, normalized_shape, weight, eps)`` with ``y = x̂·(offset + weight)``
    (offset=1.0: Gemma). ``eps=None`` means torch's default: the epsilon of the computation dtype,
    ``torch.finfo(torch.float32).eps`` for fp16 / bf16 / fp32 x (fp64's for fp64).

    With ``residual``: ``h = x + residual``, returns ``(rms_norm(h), h)`` (Llama's pre-norm add).
    """
    if eps is None and isinstance(x, torch.Tensor) and x.is_floating_point():
        eps = default_rms_eps(x.dtype)
    return _norm(x, normalized_shape, weight, None, eps, offset, residual, is_rms=True)


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


def _randn(shape, dtype, device, scale=1.0, shift=0.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale + shift).to(dtype).requires_grad_(True)


def _make_inputs(is_rms: bool, fused_add: bool):
    def make(shape, dtype, device):
        n = shape[-1]
        x = _randn(shape, dtype, device, scale=2.0, shift=0.5)   # a real mean to subtract
        w = _randn((n,), dtype, device, scale=0.1, shift=1.0)    # near 1 but random, like a trained norm
        res = _randn(shape, dtype, device) if fused_add else None
        if is_rms:                      # rms_norm(x, normalized_shape, weight, eps, offset, residual)
            args, grads = (x, (n,), w, 1e-6, 0.0) + ((res,) if fused_add else ()), (0, 2, 5)
        else:                           # layer_norm(x, normalized_shape, weight, bias, eps, residual)
            b = _randn((n,), dtype, device, scale=0.1)
            args, grads = (x, (n,), w, b, 1e-5) + ((res,) if fused_add else ()), (0, 2, 3, 5)
        return Inputs(args, grad_args=grads if fused_add else grads[:-1])
    return make


def _bytes(is_rms: bool, fused_add: bool):
    def count(shape, dtype, pass_):
        n = shape[-1]
        m = math.prod(shape[:-1])
        big = tensor_bytes(shape, dtype)            # one [M, N] tensor
        vec = tensor_bytes((n,), dtype)             # one of w, b, dw, db
        stats = (1 if is_rms else 2) * 4 * m        # rstd (and mean), fp32
        params = 1 if is_rms else 2                 # w (and b)
        if pass_ == "fwd":                          # x (+ residual) read, y (+ h) written
            return big * (4 if fused_add else 2) + vec * params + stats
        # bwd: x (h), dy (+ dh) read, dx written (also d residual: the same tensor); w read, dw/db written
        return big * (4 if fused_add else 3) + vec * (1 + params) + stats
    return count


def _flops(is_rms: bool, fused_add: bool):
    """Per row of n, the module docstring's formulas (offset 0, as the bench's inputs):
    forward mu (n), h - mu (n), the variance, + eps and rsqrt (2n + 2), x̂ (n), · w (n), + b (n):
    LayerNorm 7n + 2, RMSNorm 4n + 2; backward wdy (n), x̂ again (2n / n), mean(wdy · x̂) (2n),
    mean(wdy) (n), dh (4n / 3n), dy · x̂ (n): LayerNorm 11n, RMSNorm 8n, plus the column sums of
    dw (and db) over the M rows; the fused add is one more add per element each way."""
    def count(shape, pass_):
        n = shape[-1]
        m = math.prod(shape[:-1])
        add = m * n if fused_add else 0
        if pass_ == "fwd":
            return m * ((4 if is_rms else 7) * n + 2) + add
        return m * (8 if is_rms else 11) * n + (1 if is_rms else 2) * max(0, m - 1) * n + add
    return count


def _torch_peer(is_rms: bool, fused_add: bool):
    def fn(x, normalized_shape, weight, *rest):
        if is_rms:
            eps, offset, residual = (list(rest) + [1e-6, 0.0, None][len(rest):])[:3]
            h = x + residual if fused_add else x
            y = torch.nn.functional.rms_norm(h, normalized_shape, weight + offset if offset else weight, eps)
        else:
            bias, eps, residual = (list(rest) + [None, 1e-5, None][len(rest):])[:3]
            h = x + residual if fused_add else x
            y = torch.nn.functional.layer_norm(h, normalized_shape, weight, bias, eps)
        return (y, h) if fused_add else y
    return lambda: fn


def _liger_peer(is_rms: bool, fused_add: bool):
    def factory():
        try:
            if is_rms:
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction as Norm  # type: ignore
                if fused_add:
                    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction as Add  # type: ignore
            else:
                from liger_kernel.ops.layer_norm import LigerLayerNormFunction as Norm  # type: ignore
        except Exception:
            return None
        import inspect

        def no_in_place(fn):            # liger may overwrite dy with dx unless told not to
            return (False,) if "in_place" in inspect.signature(fn.forward).parameters else ()

        def fn(x, normalized_shape, weight, *rest):
            if is_rms:
                eps, offset, residual = (list(rest) + [1e-6, 0.0, None][len(rest):])[:3]
                if fused_add:
                    return Add.apply(x, residual, weight, eps, offset, "llama", *no_in_place(Add))
                return Norm.apply(x, weight, eps, offset, "llama", *no_in_place(Norm))
            bias, eps, residual = (list(rest) + [None, 1e-5, None][len(rest):])[:3]
            h = x + residual if fused_add else x
            y = Norm.apply(h, weight, bias, eps)
            return (y, h) if fused_add else y
        return fn
    return factory


# Rows of one element are tested in tests/test_norms.py::test_rows_of_length_one: LayerNorm's exact
# dx is 0 at N = 1 and N = 2 (two values normalize to ±1 whatever they are), so a relative error
# is undefined there (the GPU's FMA leaves rounding-level values); the sweep starts at N = 3.
_TEST_SHAPES = [(1, 3), (3, 781), (7, 4097), (2, 3, 1000), (1, 65537), (5, 3)]
# RMSNorm's dx at N = 1 is eps·rstd³·wdy: a difference of two O(1) terms, ill-conditioned in fp32
# against an fp64 reference (LayerNorm's is exactly 0); tests/test_norms.py checks N = 1 separately.
_RMS_TEST_SHAPES = [(1, 2), (3, 781), (7, 4097), (2, 3, 1000), (1, 65537), (5, 2)]
_GPU_TEST_SHAPES = [(16384, 4096), (4096, 8192), (64, 65537), (1000, 12288)]
_BENCH_SHAPES = [(16384, 4096), (16384, 8192)]

for _name, _is_rms, _add, _desc in (
    ("layer_norm", False, False, "LayerNorm over the last dim"),
    ("rms_norm", True, False, "RMSNorm over the last dim"),
    ("add_layer_norm", False, True, "residual add fused with LayerNorm: (norm(x + r), x + r)"),
    ("add_rms_norm", True, True, "residual add fused with RMSNorm: (norm(x + r), x + r)"),
):
    register(OpSpec(
        name=_name,
        fn=rms_norm if _is_rms else layer_norm,
        reference=rms_norm_reference if _is_rms else layer_norm_reference,
        make_inputs=_make_inputs(_is_rms, _add),
        bytes_fn=_bytes(_is_rms, _add),
        flops_fn=_flops(_is_rms, _add),
        test_shapes=_RMS_TEST_SHAPES if _is_rms else _TEST_SHAPES,
        gpu_test_shapes=_GPU_TEST_SHAPES,
        bench_shapes=_BENCH_SHAPES,
        peers={"torch": _torch_peer(_is_rms, _add), "liger": _liger_peer(_is_rms, _add)},
        description=_desc,
    ))
