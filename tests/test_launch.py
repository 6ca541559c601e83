"""tilefuse._launch.fast_launch: the cached launch path computes what Triton's own path does."""

import pytest
import torch

from tilefuse import _launch
from tilefuse.ops import softmax as sm
from tilefuse.testing import rel_err


def test_arg_key_separates_what_triton_specializes():
    k = _launch._arg_key
    assert k(1) != k(17) and k(16) != k(32 + 1) and k(2**31) != k(2**31 - 16)
    assert k(32) == k(48)                               # same specialization: may share a kernel
    assert k(True) != k(False) and k(1.0) == k(2.5)
    a = torch.empty(64, dtype=torch.float16)
    assert k(a) != k(a.to(torch.float32))
    assert k(a[1:]) != k(a)                              # 2-byte offset: no longer 16-byte aligned


@pytest.mark.gpu
def test_cached_launches_match_triton_path(monkeypatch):
    """Alternate shapes whose specialization differs (n_cols == 1, % 16, misaligned rows) through
    the cache; every result must match the reference, i.e. no kernel is reused across keys."""
    base = torch.randn(4097 * 65, device="cuda", dtype=torch.float16)
    cases = [(64, 1), (64, 16), (33, 1000), (64, 4096), (7, 17)]
    for _ in range(2):                                  # second round: all cache hits
        for rows, cols in cases:
            for offset in (0, 1):                       # offset 1: a 2-byte misaligned view
                x = base[offset:offset + rows * cols].view(rows, cols)
                y = sm._launch_fwd(x, False)
                assert rel_err(y, torch.softmax(x.double(), -1)) <= 2e-3, (rows, cols, offset)
    assert len(sm.softmax_fwd_fused_kernel._cache) >= len(cases)
