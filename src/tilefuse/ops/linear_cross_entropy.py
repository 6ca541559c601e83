"""linear_cross_entropy: cross-entropy of ``hidden @ weight.T (+ bias)`` without the [T, V] logits.

    logits      = hidden @ weight.T + bias                    ([T, H] x [V, H] -> [T, V])
    loss        = cross_entropy(logits, target, ...)          (see ops/cross_entropy.py)
    grad_hidden = dlogits @ weight
    grad_weight = dlogits.T @ hidden
    grad_bias   = sum_t dlogits

The tokens are walked in chunks of C (``_chunk_tokens``). Per chunk, a GEMM (tilefuse's on CUDA,
see TILEFUSE_GEMMS) writes the chunk's logits into one reused [C, V] buffer; tilefuse's
cross-entropy kernel writes the rows' losses and overwrites the buffer with dlogits (already
scaled by 1/n_valid for ``mean``); then ``grad_hidden[chunk] = dlogits @ W`` and
``grad_weight (+)= dlogits.T @ h_chunk``. So the gradients are computed during the forward, as
Liger's fused linear cross-entropy does, and the backward only scales them by grad_output in
place (nothing at all when it is 1). In eager calls with several chunks, the last chunk's
grad_weight GEMM waits for the backward (DEFER_LAST_WEIGHT_GRAD), whose grad_output it applies
in its epilogue on sm_90: ``grad_weight = g · (grad_weight + dlogits_lastᵀ @ h_last)``, one pass
over [V, H] where the GEMM and a scale pass made two; that chunk's dlogits stay allocated until
the backward.

Memory beyond the inputs and the gradients themselves: the [C, V] chunk buffer (<= 160 MiB:
640 tokens of a 128256 vocab in bf16) plus O(T + V) fp32 vectors.

Precision: ``grad_weight`` lives in the weight's dtype. Each chunk's GEMM accumulates in fp32,
and the running sum over chunks is rounded to the weight's dtype once per chunk: 13 roundings at
T=8192, V=128256 (640-token chunks). bf16, H200 (s35, 512-token chunks): 5.9e-3 relative error
against fp64, where eager's single GEMM gives 3.4e-3 (its bf16 dlogits); 1.9e-2 with 128-token chunks, so a smaller
``chunk_tokens`` than the default costs precision as well as time. An fp32 [V, H] accumulator
would be 2 GiB at H=4096, over the 1.2 GiB budget.

``reduction="none"``: each row's gradient carries its own grad_output, which must multiply
dlogits *before* the weight GEMM; so the forward computes the loss only, and the backward
recomputes the logits chunk by chunk with the row scales (one extra 2·T·H·V GEMM).

FLOPs counted: 2·T·H·V for the logits ("fwd") + 4·T·H·V for the two gradient GEMMs ("bwd"),
although with a gradient wanted all 6·T·H·V run inside the forward call: compare fwd+bwd times.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .._autocast import autocast_inputs, autocast_on
from .._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from .._dispatch import empty, is_hopper
from .._op import custom_op
from ..registry import Inputs, OpSpec, register, tensor_bytes
from ._attention_bwd import tma_eligible
from ._cross_entropy_kernels import CEOptions
from ._matmul_kernels import launch_matmul
from ._cross_entropy_shared import (
    check_ce_options,
    check_target,
    cross_entropy_rows,
    loss_dtype,
    reduce_loss_rows,
    reference_cross_entropy,
    rescale_,
    saved_grads_for_backward,
    scan_targets,
    softcap_reference,
    torch_cross_entropy,
)
from .cross_entropy import random_targets

# the [C, V] logits buffer, the op's only large extra allocation. Smaller chunks re-read and
# re-write the [V, H] grad_weight accumulator more often (one pass over it per chunk). H100,
# T=8192 H=4096 V=128256 bf16 fwd+bwd (scripts/lce_chunk_sweep.py): 512 MiB 41.2 ms / 1.53 GiB
# extra, 256 MiB 41.4 / 1.29, 128 MiB 47.3 / 1.16 (eager 51.2 / 11.7). H200, 2026-11-25
# (scripts/lce_profile.py --ab 4, -s37-lce-ab-streams-chunks.log, do_bench medians / peak extra):
# 512 tokens 44.53 ms / 1,191 MiB, 640 tokens 43.74 / 1,223 MiB, 768 tokens 43.07 / 1,254 MiB
# (eager 42.08 / 6,012). 160 MiB gives 640 tokens there: 1002 MiB of grad_weight + 64 of
# grad_hidden + 157 of logits, the largest chunk within the 1.2 GiB (1,228.8 MiB) budget.
CHUNK_LOGITS_BYTES = 160 * 2**20
CHUNK_ROWS_ALIGN = 128      # chunk rows rounded down to the GEMMs' 128-row tiles (when >= 128)

# Which GEMMs are tilefuse's (``tilefuse_gemm`` in _chunked_pass; TILEFUSE_GEMMS = False: all
# cuBLAS): on CUDA (fp16 / bf16) the chunk's logits GEMM (M = 512 tokens, N = V, K = H; cuBLAS
# picks 320-row tiles there, which cover 512 rows as 640) and the first chunk's grad_weight (no
# accumulator to read); grad_hidden stays on cuBLAS, and the accumulating grad_weight GEMMs take
# the Gluon accumulate GEMM below (GLUON_WEIGHT_GRAD; the tl kernel's residual epilogue took
# 1.25-1.30 ms against cuBLAS's 0.95-1.03 per chunk, so cuBLAS where that is off). H200, 2026-11-25,
# T = 8192, H = 4096, V = 128256, fwd+bwd steps interleaved in one process
# (scripts/lce_profile.py --ab 6, -s28-lce-gemm-ab.log): 44.18 ms median against 45.52 with
# cuBLAS for all. The GEMMs timed alone (scripts/lce_gemm_probe.py) swing run to run: logits
# 0.739 / 0.809 / 0.766 ms against cuBLAS's 0.800 / 0.769 / 0.774 in three runs.
TILEFUSE_GEMMS = True

# On sm_90 with TMA-aligned operands, tilefuse's warp-specialized Gluon GEMM
# (_matmul_gluon_plan.launch_gemm_accumulate, 128x256 tiles) can take the logits GEMM (no bias;
# GLUON_LOGITS) and grad_weight (+)= dlogitsᵀ @ h_c (GLUON_WEIGHT_GRAD; it loads the old [V, H]
# tile during its K loop) in place of the above. Timed alone at M = 128256, N = 4096, K = 512
# (scripts/gemm_accumulate_probe.py, H200 s29): 0.983 ms accumulating against cuBLAS's 0.978 /
# 1.089 (its two operand orders), 0.879 without the accumulator against 0.911. In whole steps
# (scripts/lce_profile.py --ab 4, two calls) neither moved the step outside the run-to-run spread:
# do_bench 45.74 (Gluon logits) / 45.58 (both) / 45.58 ms (neither); so GLUON_LOGITS stays off.
# The accumulating grad_weight GEMMs take the ping-pong tile (each consumer group on its own
# 128x128 tile, so one group's epilogue with its old-tile add runs under the other's wgmmas):
# H200 2026-12-02, M = 128256, N = 4096, K = 640 (scripts/gemm_accumulate_probe.py, 5 rounds,
# -s50-acc-probe-pingpong.log): 1.170 ms against 1.232 for 128x256 and cuBLAS's 1.236 / 1.203
# (its two operand orders; the first is LCE's); whole steps in the notes (NOTES s50).
GLUON_LOGITS = False
GLUON_WEIGHT_GRAD = True
# the accumulate GEMM's tile (_matmul_gluon_plan.ACCUMULATE_TILES) for grad_weight: GLUON_WEIGHT_GRAD's
# chunks and the deferred last chunk (_finish_weight_grad_op)
WEIGHT_GRAD_TILE = "128x128-pingpong"

# Eager calls leave the last chunk's grad_weight GEMM to the backward (_finish_weight_grad_op),
# which folds grad_output into it: the 1 GiB [V, H] bf16 gradient is read and written once there
# instead of once by the GEMM and once more by the scale pass. The price: that chunk's dlogits
# (<= CHUNK_LOGITS_BYTES) stay allocated from the forward until the backward.
DEFER_LAST_WEIGHT_GRAD = True


# ----------------------------------------------------------------------------------------------
# chunking heuristic
# ----------------------------------------------------------------------------------------------


def _chunk_tokens(n_tokens: int, vocab: int, elem_size: int, budget: int | None = None) -> int:
    """Tokens per chunk: the chunk's logits fit ``budget`` (CHUNK_LOGITS_BYTES); multiples of
    CHUNK_ROWS_ALIGN keep the GEMMs' M dimension tile-aligned (640 tokens at V=128256 bf16: 12
    full chunks and one of 512 at T=8192)."""
    rows = max(1, (budget or CHUNK_LOGITS_BYTES) // max(1, vocab * elem_size))
    if rows >= CHUNK_ROWS_ALIGN:
        rows = rows // CHUNK_ROWS_ALIGN * CHUNK_ROWS_ALIGN
    return max(1, min(n_tokens, rows))


# ----------------------------------------------------------------------------------------------
# the chunked pass (CUDA, the interpreter and the CPU path alike: only the CE rows differ)
# ----------------------------------------------------------------------------------------------


def _chunked_pass(h2, weight, bias, target, row_scale, opts: CEOptions, loss_rows, grad_hidden, grad_weight,
                  grad_bias32, chunk=None, config=None, before_targets=None, defer_last=False):
    """Loss rows into ``loss_rows``; the gradients asked for (tensors, or None) from dlogits
    scaled by ``row_scale`` ([1] shared, or one per token). ``chunk``/``config`` override the
    chunk size and the CE kernel's launch config (GPU sweeps). ``before_targets``: called once
    the first logits GEMM is queued, before the first kernel that reads the targets (the second
    half of cross_entropy.TargetCheck). ``defer_last``: leave the last chunk's grad_weight GEMM
    out when there are several chunks and return that chunk's dlogits (for
    :func:`_finish_weight_grad_op`), else None."""
    n_tokens, vocab = h2.shape[0], weight.shape[0]
    want_grad = grad_hidden is not None or grad_weight is not None or grad_bias32 is not None
    chunk = chunk or _chunk_tokens(n_tokens, vocab, h2.element_size())
    buf = empty((min(chunk, n_tokens), vocab), h2.dtype, h2.device)
    tilefuse_gemm = _tilefuse_gemms(h2)
    pending = None
    for c0 in range(0, n_tokens, chunk):
        c1 = min(c0 + chunk, n_tokens)
        h_c, logits = h2[c0:c1], buf[: c1 - c0]
        if tilefuse_gemm and GLUON_LOGITS and bias is None and _tma_ready(h_c, weight, logits):
            from ._matmul_gluon_plan import launch_gemm_accumulate     # Gluon: GPU only, imported there

            launch_gemm_accumulate(h_c, weight.t(), logits, accumulate=False)
        elif tilefuse_gemm:       # see "Which GEMMs are tilefuse's" above
            launch_matmul(h_c, weight.t(), bias=bias, out=logits)
        elif bias is None:
            torch.mm(h_c, weight.t(), out=logits)
        else:
            torch.addmm(bias, h_c, weight.t(), out=logits)
        if c0 == 0 and before_targets is not None:
            before_targets()
        scale = row_scale if row_scale.numel() == 1 else row_scale[c0:c1]
        # the kernel overwrites the chunk's logits with dlogits
        cross_entropy_rows(logits, target[c0:c1], scale, loss_rows[c0:c1], logits if want_grad else None,
                           opts, config)
        if grad_hidden is not None:
            torch.mm(logits, weight, out=grad_hidden[c0:c1])
        if grad_weight is not None:
            if defer_last and c0 > 0 and c1 == n_tokens:
                pending = logits
            else:
                _weight_grad_gemm(grad_weight, logits, h_c, c0 == 0, tilefuse_gemm)
        if grad_bias32 is not None:
            grad_bias32 += logits.sum(0, dtype=torch.float32)
    if grad_weight is not None and n_tokens == 0:
        grad_weight.zero_()
    return pending


def _tilefuse_gemms(h2: torch.Tensor) -> bool:
    """Whether tilefuse's GEMMs take this call's chunks (TILEFUSE_GEMMS: 16-bit CUDA tensors)."""
    return TILEFUSE_GEMMS and h2.is_cuda and h2.dtype != torch.float32


def _weight_grad_gemm(grad_weight, dlogits, h_c, first: bool, tilefuse_gemm: bool) -> None:
    """grad_weight (+)= dlogitsᵀ @ h_c (``first``: no old value to add)."""
    if not first and tilefuse_gemm and GLUON_WEIGHT_GRAD and _tma_ready(dlogits, h_c, grad_weight):
        from ._matmul_gluon_plan import launch_gemm_accumulate     # Gluon: GPU only, imported there

        launch_gemm_accumulate(dlogits.t(), h_c, grad_weight, _weight_grad_tile())
    elif first and tilefuse_gemm:
        launch_matmul(dlogits.t(), h_c, out=grad_weight)
    elif first:
        torch.mm(dlogits.t(), h_c, out=grad_weight)
    elif min(grad_weight.shape) > 1:   # as grad_weightᵀ += h_cᵀ @ dlogits: cuBLAS picks a ~5 %
        grad_weight.t().addmm_(h_c.t(), dlogits)     # faster kernel (H200, C = 512: 0.96-1.02 vs 1.02-1.06 ms)
    else:   # H = 1: the [1, V] view has strides (1, 1), which cuBLASLt rejects (INVALID_VALUE, H200)
        grad_weight.addmm_(dlogits.t(), h_c)


def _weight_grad_tile() -> dict:
    """The accumulate GEMM's config for grad_weight (WEIGHT_GRAD_TILE)."""
    from ._matmul_gluon_plan import ACCUMULATE_TILES     # Gluon: GPU only, imported there

    return ACCUMULATE_TILES[WEIGHT_GRAD_TILE]


def _deferred_rows(n_tokens: int, vocab: int, elem_size: int, chunk: int) -> int:
    """Rows of the chunk whose grad_weight GEMM the forward defers (the last, when there are
    several; 0 otherwise): the shape of _lce_fwd_op's pending output."""
    chunk = chunk or _chunk_tokens(n_tokens, vocab, elem_size)
    return n_tokens - (n_tokens - 1) // chunk * chunk if n_tokens > chunk else 0


def _tma_ready(*mats: torch.Tensor) -> bool:
    """sm_90 exactly (the Gluon kernel's wgmma) and every matrix TMA-addressable."""
    return is_hopper(mats[0]) and tma_eligible(*mats)


def _grads_and_pass(hidden, weight, target, bias, row_scale, opts, need_h, need_w, need_b, chunk=0,
                    before_targets=None, defer_last=False):
    """Allocate the wanted gradients (empty [0] tensors for the others) and run the chunked pass
    (``chunk`` tokens at a time; 0: _chunk_tokens' choice; ``before_targets`` and ``defer_last``:
    _chunked_pass's). Returns (loss rows, grad_hidden, grad_weight, grad_bias, the deferred
    chunk's dlogits or an empty [0] tensor)."""
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = target.reshape(-1).contiguous()   # the CE kernel reads target[row]: unit stride
    gh = empty(hidden.shape, hidden.dtype, hidden.device) if need_h else hidden.new_empty(0)
    gw = empty(weight.shape, weight.dtype, weight.device) if need_w else weight.new_empty(0)
    gb32 = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
    loss_rows = empty((h2.shape[0],), torch.float32, hidden.device)
    pending = _chunked_pass(h2, weight, bias, t1, row_scale, opts, loss_rows,
                            gh.view(h2.shape) if need_h else None, gw if need_w else None, gb32,
                            chunk=chunk or None, before_targets=before_targets, defer_last=defer_last)
    gb = gb32.to(bias.dtype) if need_b else weight.new_empty(0)   # distinct empties: outputs may not alias
    return loss_rows, gh, gw, gb, pending if pending is not None else hidden.new_empty(0)


# ----------------------------------------------------------------------------------------------
# references (fp32 or wider; the CPU path is _chunked_pass with torch's CE rows)
# ----------------------------------------------------------------------------------------------


def _wide(t):
    return t if t is None or t.dtype == torch.float64 else t.float()


def linear_cross_entropy_reference(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                                   z_loss=0.0, softcap=None, reduction="mean", check_targets=True,
                                   chunk_tokens=None):
    """fp32-or-wider torch composition over the full logits; same signature as the op."""
    logits = F.linear(_wide(hidden), _wide(weight), _wide(bias))
    if softcap is not None:
        logits = softcap_reference(logits, softcap)
    out = reference_cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, reduction)
    return out.to(hidden.dtype)


# ----------------------------------------------------------------------------------------------
# custom ops + autograd
# ----------------------------------------------------------------------------------------------


@custom_op("tilefuse::linear_cross_entropy_fwd", mutates_args=())
def _lce_fwd_op(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                ignore_index: int, label_smoothing: float, z_loss: float, softcap: Optional[float],
                reduction: str, need_h: bool, need_w: bool, need_b: bool, check_targets: bool,
                chunk_tokens: int, loss_dtype: torch.dtype,
                defer_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias, pending); a gradient not wanted (or any, for
    "none") comes back as an empty [0] tensor. ``defer_weight_grad`` (eager calls): grad_weight
    still lacks the last chunk, whose dlogits come back as ``pending`` ([rows, V]; else [0]) for
    the backward's :func:`_finish_weight_grad_op`."""
    opts = CEOptions(ignore_index, label_smoothing, z_loss, softcap)
    t1 = target.reshape(-1).contiguous()
    # the range test's result is awaited only once the first logits GEMM is queued
    scale, finish_check = scan_targets(t1, weight.shape[0], ignore_index, reduction, check_targets)
    in_fwd = reduction != "none"
    loss_rows, gh, gw, gb, pending = _grads_and_pass(hidden, weight, target, bias, scale, opts,
                                                     need_h and in_fwd, need_w and in_fwd, need_b and in_fwd,
                                                     chunk_tokens, before_targets=finish_check,
                                                     defer_last=defer_weight_grad)
    return reduce_loss_rows(loss_rows, scale, reduction, target.shape, loss_dtype), gh, gw, gb, pending


def _grad_fakes(hidden, weight, need_h, need_w, need_b):
    def fake(t, need):
        return torch.empty(t.shape if need else (0,), dtype=t.dtype, device=t.device)
    # grad_bias has the bias' dtype, which the public function checks equals weight's
    return fake(hidden, need_h), fake(weight, need_w), torch.empty(
        (weight.shape[0],) if need_b else (0,), dtype=weight.dtype, device=weight.device)


@_lce_fwd_op.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, need_h, need_w,
      need_b, check_targets, chunk_tokens, loss_dtype, defer_weight_grad):
    in_fwd = reduction != "none"
    loss = torch.empty(target.shape if not in_fwd else (), dtype=loss_dtype, device=hidden.device)
    n_tokens, vocab = target.numel(), weight.shape[0]
    rows = (_deferred_rows(n_tokens, vocab, hidden.element_size(), chunk_tokens)
            if defer_weight_grad and need_w and in_fwd else 0)
    pending = torch.empty((rows, vocab) if rows else (0,), dtype=hidden.dtype, device=hidden.device)
    return (loss, *_grad_fakes(hidden, weight, need_h and in_fwd, need_w and in_fwd, need_b and in_fwd), pending)


@custom_op("tilefuse::linear_cross_entropy_finish_weight_grad", mutates_args=("grad_weight",))
def _finish_weight_grad_op(grad_weight: torch.Tensor, dlogits: torch.Tensor, h_last: torch.Tensor,
                           applied: torch.Tensor, grad_output: torch.Tensor) -> None:
    """grad_weight = grad_output / applied · (grad_weight + dlogitsᵀ @ h_last): the last chunk's
    weight-gradient GEMM, deferred from the forward so that the backward's scale rides in its
    epilogue (sm_90 with TMA-aligned operands: the Gluon accumulate GEMM, one pass over the
    [V, H] gradient where a GEMM then a scale pass make two: ~0.5 ms at V = 128256, H = 4096
    bf16); elsewhere the forward's GEMM, then the scale pass (none when the factor is 1)."""
    go = grad_output.reshape(-1).to(torch.float32)
    tilefuse_gemm = _tilefuse_gemms(h_last)
    if tilefuse_gemm and _tma_ready(dlogits, h_last, grad_weight):
        from ._matmul_gluon_plan import launch_gemm_accumulate     # Gluon: GPU only, imported there

        launch_gemm_accumulate(dlogits.t(), h_last, grad_weight, _weight_grad_tile(), scale=go / applied)
    else:
        _weight_grad_gemm(grad_weight, dlogits, h_last, False, tilefuse_gemm)
        rescale_(grad_weight, applied, go)


@_finish_weight_grad_op.register_fake
def _(grad_weight, dlogits, h_last, applied, grad_output):
    return None


@custom_op("tilefuse::linear_cross_entropy_bwd", mutates_args=())
def _lce_bwd_op(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                grad_rows: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
                softcap: Optional[float], need_h: bool, need_w: bool, need_b: bool,
                chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none": the logits recomputed chunk by chunk, dlogits rows scaled by grad_rows."""
    opts = CEOptions(ignore_index, label_smoothing, z_loss, softcap)
    row_scale = grad_rows.reshape(-1).to(torch.float32).contiguous()
    _, gh, gw, gb, _ = _grads_and_pass(hidden, weight, target, bias, row_scale, opts, need_h, need_w, need_b,
                                       chunk_tokens)
    return gh, gw, gb


@_lce_bwd_op.register_fake
def _(hidden, weight, target, bias, grad_rows, ignore_index, label_smoothing, z_loss, softcap, need_h, need_w,
      need_b, chunk_tokens):
    return _grad_fakes(hidden, weight, need_h, need_w, need_b)


def _setup_context(ctx, inputs, output):
    (hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction,
     need_h, need_w, need_b, _check, chunk_tokens, _dtype, _defer) = inputs
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap)
    ctx.chunk_tokens = chunk_tokens
    ctx.needs = (need_h, need_w, need_b)
    ctx.reduction = reduction
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias)
    else:
        _, gh, gw, gb, pending = output
        deferred = pending.numel() > 0
        ctx.pending_start = target.numel() - pending.shape[0] if deferred else 0
        # finished: whether *this* grad_weight already holds the deferred chunk. A saved tensor (on
        # the CPU: read without a sync), not a ctx attribute, so that it travels with the saved
        # grad_weight: a checkpoint recompute or copying saved-tensor hooks hand a later backward
        # fresh copies of both, as they stood at the forward
        ctx.save_for_backward(gh, gw, gb, torch.ones(1, dtype=torch.float32, device=hidden.device),
                              pending if deferred else None, hidden if deferred else None,
                              torch.zeros(1, dtype=torch.bool) if deferred else None)


def _backward(ctx, grad_loss, _gh, _gw, _gb, _pending):
    need_h, need_w, need_b = ctx.needs
    if ctx.reduction == "none":
        hidden, weight, target, bias = ctx.saved_tensors
        gh, gw, gb = _lce_bwd_op(hidden, weight, target, bias, grad_loss, *ctx.options, need_h, need_w, need_b,
                                 ctx.chunk_tokens)
    else:
        gh, gw, gb, applied, pending, hidden, finished = ctx.saved_tensors
        if pending is not None and not bool(finished):
            h_last = hidden.reshape(-1, hidden.shape[-1])[ctx.pending_start:]
            first = not getattr(ctx, "grads_handed_out", False)
            # saved tensors edited in place (as scale_saved_grads_ does): their versions kept
            with torch.autograd._unsafe_preserve_version_counter(gw), \
                    torch.autograd._unsafe_preserve_version_counter(finished):
                # the first backward: the deferred GEMM completes grad_weight, scaled in its
                # epilogue; a later one on fresh copies (see _setup_context): completed at the
                # copies' own scale (factor applied / applied), then rescaled with the others
                _finish_weight_grad_op(gw, pending, h_last, applied, grad_loss if first else applied)
                finished.fill_(True)
            if first:       # gw is scaled already: the others only
                gh, gb = saved_grads_for_backward(ctx, [gh, gb], applied, grad_loss)
            else:
                gh, gw, gb = saved_grads_for_backward(ctx, [gh, gw, gb], applied, grad_loss)
        else:
            gh, gw, gb = saved_grads_for_backward(ctx, [gh, gw, gb], applied, grad_loss)
    return (gh if need_h else None, gw if need_w else None, None, gb if need_b else None) + (None,) * 12


# the stored gradients are outputs too: never materialize zero [V, H] / [T, H] grads for them
# (a 1 GiB zero-fill at Llama-3's vocab, measured as the top allocation at the memory peak)
_lce_fwd_op.register_autograd(_backward, setup_context=_setup_context, materialize_grads=False)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    check_targets: bool = True,
    chunk_tokens: Optional[int] = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, target)`` for ``hidden [..., H]``, ``weight
    [V, H]``, ``bias [V]``, ``target [...]`` (int64/int32), never materializing the [T, V] logits.
    Options as in :func:`tilefuse.cross_entropy`; the loss has hidden's dtype. The gradients are
    computed in this call (except for ``reduction="none"``, whose backward recomputes the logits).

    ``chunk_tokens``: tokens per chunk (None: as many as fit CHUNK_LOGITS_BYTES of logits). Larger
    chunks are faster and need chunk_tokens·V more bytes (H200, T=8192, H=4096, V=128256: 512
    tokens 44.5 ms / 1,191 MiB extra, 640 (the default) 43.7 ms / 1,223 MiB, 768 43.1 ms / 1,254 MiB;
    CHUNK_LOGITS_BYTES). Each chunk
    rounds the running ``grad_weight`` to the weight's dtype once: with bf16 weights, chunks of
    fewer than ~512 tokens at T = 8192 put its error past eager's (module docstring).

    Under ``torch.autocast`` hidden, weight and bias are cast to its dtype first (the linear
    torch would autocast), and the loss is fp32 (as torch's autocast cross-entropy returns it)."""
    if autocast_on():
        hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_tensor("hidden", hidden, min_dim=1)
    check_tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected (vocab, {hidden.shape[-1]}) "
                         f"to match hidden's last dimension")
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, (weight.shape[0],), "weight's vocabulary dimension")
    check_same_dtype(hidden=hidden, weight=weight, bias=bias)
    check_same_device(hidden=hidden, weight=weight, bias=bias)
    check_target(target, hidden.shape[:-1], hidden, "hidden")
    check_ce_options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
    grad_on = torch.is_grad_enabled()
    loss, _, _, _, _ = _lce_fwd_op(
        hidden, weight, target, bias, ignore_index, float(label_smoothing), float(z_loss),
        None if softcap is None else float(softcap), reduction,
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad, bool(check_targets), int(chunk_tokens or 0),
        loss_dtype(hidden),
        # eager only: a traced backward scales the stored gradients as one functional op each time
        DEFER_LAST_WEIGHT_GRAD and not torch.compiler.is_compiling(),
    )
    return loss


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


def _make_inputs(shape, dtype, device):
    n_tokens, n_hidden, vocab = shape
    hidden = torch.randn((n_tokens, n_hidden), device=device).to(dtype).requires_grad_(True)
    # weight ~ 3/sqrt(H): logits of std ~3, a real spread of probabilities
    weight = (torch.randn((vocab, n_hidden), device=device) * (3 / math.sqrt(n_hidden))).to(dtype)
    return Inputs((hidden, weight.requires_grad_(True), random_targets(n_tokens, vocab, device)),
                  grad_args=(0, 1))


def _bytes(shape, dtype, pass_):
    """The function's must-move bytes (as cross_entropy's): grad_output is unknown when the forward
    runs, so the forward reads hidden and weight, the backward reads them again and writes their
    gradients: 3 (h + w) in all. (Our in-forward mode writes the unscaled gradients in the forward
    and reads and writes them in the backward, 4 (h + w); its fwd / bwd rows are not compared.)"""
    n_tokens, n_hidden, vocab = shape
    h, w = tensor_bytes((n_tokens, n_hidden), dtype), tensor_bytes((vocab, n_hidden), dtype)
    if pass_ == "fwd":   # hidden, weight, int64 targets read; the loss written
        return (h + w) + n_tokens * 8 + tensor_bytes((), dtype)
    return 2 * (h + w) + n_tokens * 8 + tensor_bytes((), dtype)   # h, w, targets, grad_output read; dh, dw written


def _flops(shape, pass_):
    n_tokens, n_hidden, vocab = shape
    return (2 if pass_ == "fwd" else 4) * n_tokens * n_hidden * vocab


def _torch_peer():
    def eager_linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                                   z_loss=0.0, softcap=None, reduction="mean", check_targets=True):
        return torch_cross_entropy(F.linear(hidden, weight, bias), target, ignore_index, label_smoothing, z_loss,
                                   softcap, reduction)
    return eager_linear_cross_entropy


def _liger_peer():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # type: ignore
    except Exception:
        return None

    def liger(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
              softcap=None, reduction="mean", check_targets=True):
        loss = liger_fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias=bias,
            ignore_index=ignore_index, lse_square_scale=z_loss, label_smoothing=label_smoothing,
            reduction=reduction, softcap=softcap)
        return loss.reshape(target.shape) if reduction == "none" else loss
    return liger


register(OpSpec(
    name="linear_cross_entropy",
    split_passes=False,
    graph_capturable=False,   # the target range check syncs with the host
    fn=linear_cross_entropy,
    reference=linear_cross_entropy_reference,
    make_inputs=_make_inputs,
    bytes_fn=_bytes,
    flops_fn=_flops,
    test_shapes=[(4, 16, 50), (9, 32, 130), (1, 8, 7)],
    # (4096, 2048, 128256): six 640-token chunks and one of 256; (5000, 1024, 151936): 512-token chunks, a ragged last one
    gpu_test_shapes=[(37, 4096, 32000), (4096, 2048, 128256), (5000, 1024, 151936)],
    bench_shapes=[(8192, 4096, 128256)],
    peers={"torch": _torch_peer, "liger": _liger_peer},
    description="cross-entropy of hidden @ weight.T, chunked over tokens (no [T, V] logits)",
))
