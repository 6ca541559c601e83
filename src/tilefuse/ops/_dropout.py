"""Counter-based dropout masks: regenerated from (seed, element position), never stored.

The keep decision of element (row, col) of a logical ``[rows, cols]`` tensor is

    r0, r1, r2, r3 = philox4x32_10(key=seed, counter=(col // 4, row mod 2**32, row >> 32, 0))
    r              = (r0, r1, r2, r3)[col % 4]
    keep           = (r >> 1) >= threshold,     threshold = round(p * 2**31)

so it depends on the seed and the element's position only: not on the program id, the block
shape or the grid. Backward regenerates exactly the forward's mask, any launch config gives the
same mask, and :func:`dropout_keep_reference` (plain PyTorch) reproduces it bit for bit on any
device, which is what the CPU path and the tests use.

One Philox call yields four 32-bit words, so four neighbouring columns share a call (as
PyTorch's own CUDA dropout does): ~25 integer ops per element instead of ~100, which matters
because a 10-round Philox per element would make a bf16 dropout compute-bound on H100.
``dropout_keep`` has two implementations of the same mask: ``GROUPED`` runs Philox once per
4 columns and interleaves the words into the tile; the other runs it per element and selects
the word (4x the integer work, no shuffle). A GPU sweep picks; tests check they agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import cdiv

THRESHOLD_BITS = 31      # keep compares the top 31 bits of a word: p is resolved to 2**-31
NEVER_KEEP = 1 << 31     # threshold no 31-bit value reaches: p == 1 drops everything


def dropout_threshold(p: float) -> int:
    """Integer threshold of ``keep = (r >> 1) >= threshold`` for drop probability ``p``."""
    if p >= 1.0:
        return NEVER_KEEP
    return min(round(p * (1 << THRESHOLD_BITS)), NEVER_KEEP - 1)


def dropout_scale(p: float) -> float:
    """Scale of kept elements: 1/(1-p); 0 for p == 1 (everything dropped, no inf)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def draw_seed() -> int:
    """A fresh 63-bit seed from torch's default CPU generator (reproducible under
    ``torch.manual_seed``)."""
    return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def _philox_words(seed, groups, rows):
    """The 4 Philox words of counter (group, row lo, row hi, 0): groups [1, G], rows [BM] int64."""
    c0, c1 = tl.broadcast(groups.to(tl.uint32), rows.to(tl.uint32)[:, None])  # c1: row's low 32 bits
    c2 = tl.broadcast_to((rows >> 32).to(tl.uint32)[:, None], c0.shape)       # row's high 32 bits
    return tl.philox(seed, c0, c1, c2, c0 * 0)


@triton.jit
def dropout_keep(
    seed,               # int: Philox key
    rows,               # [BLOCK_M] int64 row indices of the tile
    col_start,          # first column of the tile (a multiple of 4)
    threshold,          # dropout_threshold(p)
    BLOCK_N: tl.constexpr,   # tile width, a multiple of 4
    GROUPED: tl.constexpr,   # one Philox call per 4 columns (else one per element)
):
    """[BLOCK_M, BLOCK_N] bool: which elements of the tile are kept (see the module docstring)."""
    if GROUPED:
        groups = (col_start // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
        r0, r1, r2, r3 = _philox_words(seed, groups, rows)
        # join twice: [..., j, k] = word 2j + k once the two new size-2 dims flatten into col % 4
        words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
        r = tl.reshape(words, [rows.shape[0], BLOCK_N])
    else:
        cols = (col_start + tl.arange(0, BLOCK_N))[None, :]
        r0, r1, r2, r3 = _philox_words(seed, cols // 4, rows)
        lane = cols % 4
        r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return (r >> 1).to(tl.int32) >= threshold


# ----------------------------------------------------------------------------------------------
# PyTorch mirror (the CPU path and the tests): the same bits, in int64 arithmetic
# ----------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85        # Philox4x32 key increments (Weyl constants)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57    # Philox4x32 round multipliers


def _mulhi32(a: int, b: torch.Tensor) -> torch.Tensor:
    """High 32 bits of a * b for a, b < 2**32, without overflowing int64 (b split in 16-bit halves)."""
    return (a * (b >> 16) + ((a * (b & 0xFFFF)) >> 16)) >> 16


def _mullo32(a: int, b: torch.Tensor) -> torch.Tensor:
    """Low 32 bits of a * b for a, b < 2**32, without overflowing int64."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _M32


def philox_reference(seed: int, c0, c1, c2, c3, n_rounds: int = 10):
    """Philox4x32 as ``tl.philox`` computes it, on int64 tensors holding uint32 values."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(n_rounds):
        c0, c1, c2, c3 = (
            _mulhi32(_ROUND_B, c2) ^ c1 ^ k0,
            _mullo32(_ROUND_B, c2),
            _mulhi32(_ROUND_A, c0) ^ c3 ^ k1,
            _mullo32(_ROUND_A, c0),
        )
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def dropout_keep_reference(seed: int, n_rows: int, n_cols: int, p: float, device=None,
                           first_row: int = 0) -> torch.Tensor:
    """The ``[n_rows, n_cols]`` bool keep mask the kernels generate for (seed, p), from row
    ``first_row`` on."""
    rows = torch.arange(first_row, first_row + n_rows, dtype=torch.int64, device=device)[:, None]
    groups = torch.arange(cdiv(n_cols, 4), dtype=torch.int64, device=device)[None, :]
    groups, rows = torch.broadcast_tensors(groups, rows)
    words = philox_reference(seed, groups, rows & _M32, rows >> 32, torch.zeros_like(rows))
    r = torch.stack(words, dim=-1).reshape(n_rows, -1)[:, :n_cols]
    return (r >> 1) >= dropout_threshold(p)
