"""Functional drop-ins with torch.nn.functional's signatures.

``scaled_dot_product_attention`` takes SDPA's ``[B, H, S, D]`` layout and arguments, so code
written for ``torch.nn.functional.scaled_dot_product_attention`` switches with one import. The
``[B, H, S, D]`` tensors are handed to tilefuse's attention kernel as transposed ``[B, S, H, D]``
views (no copy: the kernel takes any batch / sequence / head strides, unit stride along D).

SDPA's ``is_causal`` keeps query i on keys j <= i (aligned *top-left*), while tilefuse's causal
is bottom-right when S_q != S_k; the wrapper passes the kernel a right window bound of
S_q - S_k instead (key j visible to query i iff j - i - (S_k - S_q) <= S_q - S_k, i.e. j <= i).

Falls back to ``torch.nn.functional.scaled_dot_product_attention`` (same arguments) for what
the kernel does not cover:

* ``attn_mask`` given, or ``dropout_p > 0``;
* inputs that are not 4-D tensors of one float dtype (fp16, bf16, fp32) on one device;
* head dim not a multiple of 8, above 256, or different for v;
* head counts that do not match, or differ without ``enable_gqa`` / without dividing
  (torch then raises its own error).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._autocast import autocast_inputs, autocast_on
from .._checks import FLOAT_DTYPES
from ..ops.attention import MAX_HEAD_DIM, _dense
from ..ops._attention_common import normalize_scale

__all__ = ["scaled_dot_product_attention"]


def _kernel_covers(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    """True when tilefuse's kernel computes exactly what SDPA would (module docstring)."""
    tensors = (query, key, value)
    if attn_mask is not None or dropout_p != 0.0 or not isinstance(is_causal, bool):
        return False
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    if query.dtype not in FLOAT_DTYPES or any(t.dtype != query.dtype or t.device != query.device for t in tensors):
        return False
    b, h_q, _, d = query.shape
    if key.shape != value.shape or key.shape[0] != b or key.shape[-1] != d:
        return False
    if d % 8 or not 8 <= d <= MAX_HEAD_DIM:
        return False
    h_kv = key.shape[1]
    if h_kv == 0:       # no heads: torch's SDPA returns the empty output
        return False
    if h_q != h_kv and not (enable_gqa and h_kv > 0 and h_q % h_kv == 0):
        return False
    return True


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``softmax(query keyᵀ · scale [+ causal mask]) value`` for query ``[B, H_q, S_q, D]``, key and
    value ``[B, H_kv, S_k, D]``; returns ``[B, H_q, S_q, D]`` in query's dtype. Arguments and
    semantics as ``torch.nn.functional.scaled_dot_product_attention`` (``is_causal`` top-left
    aligned); unsupported cases run torch's SDPA (module docstring). Under ``torch.autocast``
    query, key and value are cast to its dtype, as torch's SDPA casts them."""
    if autocast_on():
        query, key, value = autocast_inputs(query, key, value)
    if not _kernel_covers(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))     # [B, S, H, D] views
    s_q, s_k = q.shape[1], k.shape[1]
    window_right = s_q - s_k if is_causal else None                 # top-left: j <= i
    out, _ = _dense(q, k, v, normalize_scale(scale, q.shape[-1]), None, window_right, 0.0, False)
    return out.transpose(1, 2)
