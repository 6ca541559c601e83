"""linear_cross_entropy: time and peak extra memory of fwd+bwd per chunk budget (GPU; PYTHONPATH=src).

    python scripts/lce_chunk_sweep.py [T H V [MiB ...]]

The chunk's [C, V] logits buffer is the op's only large temporary; smaller chunks save memory
but add a read+write of the [V, H] grad_weight accumulator per chunk. Prints one row per budget.
"""

import sys

import torch

import tilefuse
import tilefuse.ops.linear_cross_entropy as lce
from tilefuse.bench import time_ms
from tilefuse.bench.runner import _peak_extra_bytes
from tilefuse.ops.cross_entropy import random_targets

T, H, V = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 4096, 128256)
h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, H, device="cuda") * H ** -0.5).to(torch.bfloat16).requires_grad_(True)
t = random_targets(T, V, "cuda")
g = torch.rand((), device="cuda") + 0.5


def step():
    return torch.autograd.grad(tilefuse.linear_cross_entropy(h, w, t), (h, w), g)


def eager():
    return torch.autograd.grad(torch.nn.functional.cross_entropy((h @ w.t()).float(), t), (h, w), g)


def measure(fn):
    """(median ms, peak extra GiB), measured as `tilefuse bench` measures its rows."""
    fn()    # warm-up: compiles, caches
    peak = _peak_extra_bytes(fn, "cuda") / 2**30
    return time_ms(fn, warmup=50, rep=300), peak


print(f"T={T} H={H} V={V} bf16 fwd+bwd, {torch.cuda.get_device_name()}")
ms, gib = measure(eager)
print(f"eager F.cross_entropy(h @ W.T): {ms:7.2f} ms  {gib:5.2f} GiB extra")
for mib in [int(a) for a in sys.argv[4:]] or (64, 128, 192, 256, 512):
    lce.CHUNK_LOGITS_BYTES = mib * 2**20
    ms, gib = measure(step)
    print(f"chunk budget {mib:4d} MiB ({lce._chunk_tokens(T, V, 2)} tokens): {ms:7.2f} ms  {gib:5.2f} GiB extra")
