"""Test setup shared by every test file.

Without CUDA the Triton kernels run on CPU tensors through Triton's interpreter. Triton decides
at decoration time whether a ``@triton.jit`` function is interpreted, so ``TRITON_INTERPRET``
must be set before tilefuse's op modules are imported: that is done here, first.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tilefuse._dispatch as _dispatch  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"

# The interpreter mishandles bf16 (tl.dot and bf16 scalars), so bf16 runs on the GPU only.
CPU_DTYPES = (torch.float32, torch.float16)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run the GPU tests on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every kernel output buffer starts as NaN, so an unwritten element fails the comparison."""
    _dispatch.POISON_OUTPUTS = True
    yield
    _dispatch.POISON_OUTPUTS = False


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs each run (seed printed on failure to reproduce)."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


@pytest.fixture
def device():
    return DEVICE
