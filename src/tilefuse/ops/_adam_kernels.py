"""Triton kernels of the AdamW / Adam step over many tensors in one launch (multi-tensor apply).

Per element, in fp32 (``p`` is the fp32 master copy when one is kept, else the param):

    g  = -grad if maximize else grad
    p  = p · (1 - lr·wd)                   AdamW (decoupled)   |   g = g + wd·p      Adam (L2)
    m  = m + (1 - β1)·(g - m)              torch's exp_avg.lerp_(g, 1 - β1)
    v  = β2·v + (1 - β2)·g²
    v̂  = max(v_max, v) (v_max updated) if amsgrad else v
    p  = p - (lr / bc1) · m / (sqrt(v̂) / sqrt(bc2) + eps),      bc_i = 1 - β_i^step

Per tensor, once per step, a tiny prep launch increments the fp32 ``step`` on the device and
derives lr/bc1, sqrt(bc2) and 1 - lr·wd from it (and from ``lr`` in device memory when lr is a
tensor) in fp64, as torch does on the host: a step never reads anything back, so it can be
captured in a CUDA graph.

Multi-tensor launch: the data_ptr of every param, grad, exp_avg, exp_avg_sq (, max_exp_avg_sq,
master) sits in one int64 pointer table; program ``pid`` updates chunk ``pid`` of the
concatenation, and a per-chunk tensor-index table plus each tensor's first chunk say which
tensor and which offset that is. Pointers are cast in-kernel with ``tl.pointer_type``. Tables
depend only on the pointers/numels, so they are cached by content and re-uploaded only when
those change (the Triton interpreter dereferences these raw CPU addresses too).

Bytes counted (ideal, per step, N elements of e bytes): param read + write (2e), grad read (e),
exp_avg and exp_avg_sq read + write (4e): 7e·N, plus the fp32 step read + write per tensor.
"""

from __future__ import annotations

import collections
import math

import torch
import triton
import triton.language as tl

from .._dispatch import cdiv, next_power_of_2
from .._launch import fast_launch

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
N_COEFS = tl.constexpr(3)   # per tensor, from the prep launch: lr / bc1, sqrt(bc2), 1 - lr·wd


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def adam_prep_kernel(
    steps_ptr,              # *fp32 [n_tensors]: step count of each tensor, incremented here
    coefs_ptr,              # *fp32 [n_tensors, N_COEFS] out: lr / bc1, sqrt(bc2), 1 - lr·wd
    lr_ptr,                 # *lr, one element (read when LR_ON_DEVICE)
    lr: tl.float64,         # lr as a number otherwise
    ln_beta1: tl.float64,   # log(β1) (-inf for β1 = 0): β^step = exp(step·log β) in fp64
    ln_beta2: tl.float64,   # log(β2)
    weight_decay: tl.float64,
    n_tensors,              # entries of steps
    LR_ON_DEVICE: tl.constexpr,  # lr is a tensor: read it from device memory (CUDA-graph safe)
    BLOCK: tl.constexpr,         # tensors per program
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < n_tensors
    step = tl.load(steps_ptr + t, mask=mask, other=0.0) + 1.0
    tl.store(steps_ptr + t, step, mask=mask)
    if LR_ON_DEVICE:
        lr_value = tl.load(lr_ptr).to(tl.float64)
    else:
        lr_value = lr
    s = step.to(tl.float64)
    bc1 = 1.0 - tl.exp(s * ln_beta1)
    bc2 = 1.0 - tl.exp(s * ln_beta2)
    row = coefs_ptr + t * N_COEFS
    tl.store(row + 0, (lr_value / bc1).to(tl.float32), mask=mask)
    tl.store(row + 1, tl.sqrt(bc2).to(tl.float32), mask=mask)
    tl.store(row + 2, (1.0 - lr_value * weight_decay).to(tl.float32), mask=mask)


@triton.jit
def _table_ptr(ptr_table, row, n_tensors, t, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Entry ``t`` of pointer-table row ``row`` as a typed pointer. ALIGN (bytes, 0: unknown)
    is promised alignment: the compiler cannot see a loaded pointer's, and without it no access
    is vectorized."""
    ptr = tl.load(ptr_table + row * n_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGN > 0:
        ptr = tl.multiple_of(ptr, ALIGN)
    return ptr


@triton.jit
def _load_f32(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x.to(tl.float32)


@triton.jit
def _store(ptrs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty))


@triton.jit
def _adam_update(
    p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, mask,
    step_size, bc2_sqrt, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay,
    WD_MODE: tl.constexpr, MAXIMIZE: tl.constexpr, AMSGRAD: tl.constexpr, MASTER: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One BLOCK of the update: every tensor read once and written once, math in fp32 in
    torch's order (so fp32 results agree with torch.optim.AdamW to rounding)."""
    g = _load_f32(g_ptr + offs, mask, MASKED)
    if MAXIMIZE:
        g = -g
    if MASTER:
        p = _load_f32(w_ptr + offs, mask, MASKED)
    else:
        p = _load_f32(p_ptr + offs, mask, MASKED)
    if WD_MODE == 1:
        p = p * decay
    elif WD_MODE == 2:
        g = g + p * weight_decay
    m = _load_f32(m_ptr + offs, mask, MASKED)
    v = _load_f32(v_ptr + offs, mask, MASKED)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    v_hat = v
    if AMSGRAD:
        v_hat = tl.maximum(_load_f32(vmax_ptr + offs, mask, MASKED), v)
        _store(vmax_ptr + offs, v_hat, mask, MASKED)
    denom = tl.div_rn(tl.sqrt_rn(v_hat), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    _store(m_ptr + offs, m, mask, MASKED)
    _store(v_ptr + offs, v, mask, MASKED)
    if MASTER:
        _store(w_ptr + offs, p, mask, MASKED)
    _store(p_ptr + offs, p, mask, MASKED)


@fast_launch
@triton.jit
def adam_multi_tensor_kernel(
    ptr_table,          # *int64 [rows, n_tensors]: data_ptr of param, grad, exp_avg, exp_avg_sq,
                        #   then max_exp_avg_sq (AMSGRAD), master (MASTER)
    numels,             # *int64 [n_tensors]: elements of each tensor
    chunk_tensor,       # *int32 [n_chunks]: the tensor chunk `pid` belongs to
    chunk_first,        # *int32 [n_tensors]: first chunk of each tensor (cumulative chunk offsets)
    coefs,              # *fp32 [n_tensors, N_COEFS]: written by adam_prep_kernel
    n_tensors,          # tensors in the launch
    beta1,              # fp32 hyperparameters
    beta2,
    one_minus_beta1,    # 1 - β1 rounded once from fp64, as torch's lerp weight is
    one_minus_beta2,
    eps,
    weight_decay,       # L2 coefficient (Adam); AdamW's decay comes per tensor from coefs
    PARAM_DTYPE: tl.constexpr,  # params and grads
    STATE_DTYPE: tl.constexpr,  # exp_avg, exp_avg_sq, max_exp_avg_sq (and fp32 master)
    WD_MODE: tl.constexpr,      # 0: none, 1: decoupled (AdamW), 2: L2 (Adam)
    MAXIMIZE: tl.constexpr,
    AMSGRAD: tl.constexpr,      # row 4 holds max_exp_avg_sq
    MASTER: tl.constexpr,       # last row holds fp32 master weights; params get the rounded copy
    PARAM_ALIGN: tl.constexpr,  # promised alignment (bytes) of params and grads, 0: none
    STATE_ALIGN: tl.constexpr,  # of exp_avg, exp_avg_sq, max_exp_avg_sq (see _alignments)
    MASTER_ALIGN: tl.constexpr, # of the fp32 masters
    BLOCK: tl.constexpr,        # elements per inner step
    CHUNK: tl.constexpr,        # elements per program, a multiple of BLOCK
):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    numel = tl.load(numels + t)
    start = (pid - tl.load(chunk_first + t)).to(tl.int64) * CHUNK   # int64: tensors may pass 2^31
    p_ptr = _table_ptr(ptr_table, 0, n_tensors, t, PARAM_DTYPE, PARAM_ALIGN)
    g_ptr = _table_ptr(ptr_table, 1, n_tensors, t, PARAM_DTYPE, PARAM_ALIGN)
    m_ptr = _table_ptr(ptr_table, 2, n_tensors, t, STATE_DTYPE, STATE_ALIGN)
    v_ptr = _table_ptr(ptr_table, 3, n_tensors, t, STATE_DTYPE, STATE_ALIGN)
    vmax_ptr = v_ptr
    w_ptr = m_ptr
    if AMSGRAD:
        vmax_ptr = _table_ptr(ptr_table, 4, n_tensors, t, STATE_DTYPE, STATE_ALIGN)
    if MASTER:
        w_ptr = _table_ptr(ptr_table, 4 + AMSGRAD, n_tensors, t, tl.float32, MASTER_ALIGN)
    step_size = tl.load(coefs + t * N_COEFS + 0)
    bc2_sqrt = tl.load(coefs + t * N_COEFS + 1)
    decay = tl.load(coefs + t * N_COEFS + 2)
    if start + CHUNK <= numel:
        # a whole chunk: no mask, so aligned accesses vectorize
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, offs < numel,
                         step_size, bc2_sqrt, decay, beta1, beta2, one_minus_beta1, one_minus_beta2,
                         eps, weight_decay, WD_MODE, MAXIMIZE, AMSGRAD, MASTER, MASKED=False)
    else:
        # the tensor's last, partial chunk: masked, and only as many steps as it has elements
        for j in range(0, numel - start, BLOCK):
            offs = start + j + tl.arange(0, BLOCK)
            _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, w_ptr, offs, offs < numel,
                         step_size, bc2_sqrt, decay, beta1, beta2, one_minus_beta1, one_minus_beta2,
                         eps, weight_decay, WD_MODE, MAXIMIZE, AMSGRAD, MASTER, MASKED=True)


# ----------------------------------------------------------------------------------------------
# launch heuristics and the cached tables
# ----------------------------------------------------------------------------------------------


def _default_config() -> dict:
    """1024 elements per step with 4 warps is 8 per thread: two 16-byte fp32 vectors per stream
    and ~8 x 16 B of loads in flight per thread; 8 steps per program amortize the table lookups."""
    return {"BLOCK": 1024, "CHUNK": 8192, "num_warps": 4}


def _alignments(aligned: bool, param_dtype: torch.dtype, state_dtype: torch.dtype,
                master: bool) -> tuple:
    """Alignment promised to the compiler for (params/grads, state, masters). Every stream gets
    the same elements per thread, 16 bytes of the widest dtype: bf16 params beside fp32 state
    promise 8 bytes (4 elements, like fp32) -- promising 16 gives them 8-element vectors and the
    fp32 ones 4, and converting between those layouts went through shared memory (150 registers
    instead of 63 on sm_90)."""
    if not aligned:
        return 0, 0, 0
    p_size, s_size = _element_size(param_dtype), _element_size(state_dtype)
    vec = 16 // max(p_size, s_size, 4 if master else 1)
    return vec * p_size, vec * s_size, vec * 4


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _prep_block(n_tensors: int) -> int:
    """One program covers up to 1024 tensors; the prep launch is O(n_tensors), not O(elements)."""
    return min(1024, next_power_of_2(max(n_tensors, 1)))


_TABLE_CACHE_SIZE = 16
_layout_cache: collections.OrderedDict = collections.OrderedDict()
_pointer_cache: collections.OrderedDict = collections.OrderedDict()


# Tables a CUDA graph captured a launch with: a replay reads them by address, long after the LRU
# may have evicted (and freed) its entry, so they are kept for the process (a few KB each).
_captured_tables: dict = {}


def _cached(cache: collections.OrderedDict, key, build):
    """LRU lookup. Entries are pure functions of their key (addresses and sizes), so a hit is
    always right, even if the tensors that produced it are gone and others now sit there."""
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        if device_is_capturing(key[0]):
            _captured_tables[key] = hit
        return hit
    if device_is_capturing(key[0]):
        raise RuntimeError(
            "tilefuse adam: the pointer/chunk tables for these tensors are not built yet and cannot "
            "be uploaded during CUDA graph capture; run one step before capturing (warm-up)")
    cache[key] = hit = build()
    if len(cache) > _TABLE_CACHE_SIZE:
        cache.popitem(last=False)
    return hit


def device_is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        # pinned + non_blocking: no host sync when grads moved and the table is rebuilt
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _layout_tables(device: torch.device, numels: tuple, chunk: int):
    def build():
        chunks = [cdiv(n, chunk) for n in numels]
        first = [0] * len(numels)
        for i in range(1, len(numels)):
            first[i] = first[i - 1] + chunks[i - 1]
        owner = [t for t, c in enumerate(chunks) for _ in range(c)]
        return (_upload(list(numels), torch.int64, device), _upload(owner, torch.int32, device),
                _upload(first, torch.int32, device), len(owner))
    return _cached(_layout_cache, (device, numels, chunk), build)


def _pointer_table(device: torch.device, ptrs: tuple, n_rows: int):
    def build():
        return _upload(list(ptrs), torch.int64, device), all(p % 16 == 0 for p in ptrs)
    return _cached(_pointer_cache, (device, ptrs, n_rows), build)


def launch(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps,
           lr, beta1, beta2, eps, weight_decay, maximize, decoupled, config=None):
    """Prep launch + one multi-tensor launch for validated lists (one dtype, one device).
    ``config`` overrides ``BLOCK``, ``CHUNK`` and ``num_warps`` (GPU sweeps)."""
    cfg = {**_default_config(), **(config or {})}
    block, chunk = cfg["BLOCK"], cfg["CHUNK"]
    if chunk % block:
        raise ValueError(f"config: CHUNK={chunk} must be a multiple of BLOCK={block}")
    n = len(params)
    device = params[0].device
    rows = [params, grads, exp_avgs, exp_avg_sqs]
    rows += [max_exp_avg_sqs] if max_exp_avg_sqs else []
    rows += [master_params] if master_params else []
    ptrs = tuple(t.data_ptr() for row in rows for t in row)
    ptr_table, aligned = _pointer_table(device, ptrs, len(rows))
    numels, chunk_tensor, chunk_first, n_chunks = _layout_tables(
        device, tuple(p.numel() for p in params), chunk)

    coefs = torch.empty((n, N_COEFS.value), dtype=torch.float32, device=device)
    lr_on_device = isinstance(lr, torch.Tensor)
    prep_block = _prep_block(n)
    adam_prep_kernel[(cdiv(n, prep_block),)](
        state_steps, coefs, lr if lr_on_device else state_steps, 0.0 if lr_on_device else float(lr),
        _log(beta1), _log(beta2), float(weight_decay), n,
        LR_ON_DEVICE=lr_on_device, BLOCK=prep_block,
    )
    if n_chunks == 0:
        return
    wd_mode = 0 if weight_decay == 0 else (1 if decoupled else 2)
    param_align, state_align, master_align = _alignments(
        aligned, params[0].dtype, exp_avgs[0].dtype, bool(master_params))
    adam_multi_tensor_kernel[(n_chunks,)](
        ptr_table, numels, chunk_tensor, chunk_first, coefs, n,
        beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, weight_decay,
        PARAM_DTYPE=_TL_DTYPES[params[0].dtype], STATE_DTYPE=_TL_DTYPES[exp_avgs[0].dtype],
        WD_MODE=wd_mode, MAXIMIZE=bool(maximize), AMSGRAD=bool(max_exp_avg_sqs),
        MASTER=bool(master_params), PARAM_ALIGN=param_align, STATE_ALIGN=state_align,
        MASTER_ALIGN=master_align, BLOCK=block, CHUNK=chunk, num_warps=cfg["num_warps"],
    )


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf
