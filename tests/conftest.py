"""Test setup shared by every test file.

Without CUDA the Triton kernels run on CPU tensors through Triton's interpreter. Triton decides
at decoration time whether a ``@triton.jit`` function is interpreted, so ``TRITON_INTERPRET``
must be set before tilefuse's op modules are imported: that is done here, first.
"""

import fcntl
import os
import tempfile

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


# One lock file per machine: tests marked ``bigmem`` hold it exclusively while they run.
BIGMEM_LOCK = os.path.join(tempfile.gettempdir(), "tilefuse-bigmem-tests.lock")


@pytest.fixture(autouse=True)
def _one_bigmem_test_at_a_time(request):
    """Tests marked ``bigmem`` (10-60 GiB of GPU memory: tensors past 2^31 elements) run one at a
    time across pytest-xdist workers, and hand their memory back to the device when done. Without
    this a full GPU run with 12 workers on the H200 (2026-11-25) had three such tests holding 50 +
    59 + 11 GiB at once, and 241 tests failed out of memory."""
    if not HAS_CUDA or request.node.get_closest_marker("bigmem") is None:
        yield
        return
    with open(BIGMEM_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            torch.cuda.empty_cache()
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


# A worker keeps what its caching allocator reserved: above this, a test's teardown hands it back,
# so that one worker's big case does not leave the others short for the rest of the run.
KEEP_RESERVED_BYTES = 4 << 30


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    """Hands a worker's cached GPU memory back after a test that left more than
    KEEP_RESERVED_BYTES reserved. With ``TILEFUSE_TEST_MEM_REPORT=<file>`` each GPU test also
    appends its peak allocated GPU memory (GiB) and node id to the file: the way to find the tests
    that should be marked ``bigmem``."""
    if not HAS_CUDA:
        yield
        return
    path = os.environ.get("TILEFUSE_TEST_MEM_REPORT")
    torch.cuda.reset_peak_memory_stats()
    yield
    if path:
        with open(path, "a") as f:
            f.write(f"{torch.cuda.max_memory_allocated() / 2**30:8.2f} {request.node.nodeid}\n")
    if torch.cuda.memory_reserved() > KEEP_RESERVED_BYTES:
        torch.cuda.empty_cache()


@pytest.fixture
def device():
    return DEVICE


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` so each call is recorded (its positional arguments); returns the
    record. The ops' fast-path tests count the calls that reach the checked path this way."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def record_returns(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` so each call's return value is recorded; returns the record (which
    path a launcher took: ``cooperative_launch`` returns None when it launched nothing)."""
    returns = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        returns.append(real(*args, **kwargs))
        return returns[-1]

    monkeypatch.setattr(module, name, spy)
    return returns


@pytest.fixture
def checked_calls(monkeypatch):
    """quant_linear's calls that take the checked path (they reach the custom op), counted;
    the fast path's cache emptied first and last (test_quant_launch.py, test_quant_gpu.py)."""
    from tilefuse.ops import quant
    quant._FAST.clear()
    yield count_calls(monkeypatch, quant, "_quant_linear_op")
    quant._FAST.clear()
