"""The host-time floor of a Python autograd.Function on this machine (GPU, PYTHONPATH=src).

    python scripts/autograd_floor.py

On CUDA tensors the autograd engine runs every backward node on its device thread, so a Python
``backward`` pays a thread hand-off plus the GIL on top of its own code; torch's native ops pay
the hand-off only. Rows (µs per call, a loop of 300 synchronized once, small tensors):
a native op's fwd+bwd, an empty Python Function's fwd+bwd (one empty_like each way), and
tilefuse's rms_norm / softmax fwd+bwd for scale.
"""

from __future__ import annotations

import torch

import tilefuse
from tilefuse.bench import host_us


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.empty_like(dy)


def main() -> None:
    x = torch.randn(8, 4096, device="cuda", requires_grad=True)
    w = torch.randn(4096, device="cuda", requires_grad=True)
    dy = torch.randn(8, 4096, device="cuda")
    rows = {
        "native x*2 fwd+bwd": lambda: torch.autograd.grad(x * 2, (x,), dy),
        "native rms_norm fwd+bwd": lambda: torch.autograd.grad(torch.nn.functional.rms_norm(x, (4096,), w), (x, w), dy),
        "empty Python Function fwd": lambda: _Empty.apply(x),
        "empty Python Function fwd+bwd": lambda: torch.autograd.grad(_Empty.apply(x), (x,), dy),
        "tilefuse softmax fwd+bwd": lambda: torch.autograd.grad(tilefuse.softmax(x), (x,), dy),
        "tilefuse rms_norm fwd+bwd": lambda: torch.autograd.grad(tilefuse.rms_norm(x, None, w), (x, w), dy),
        "torch.empty_like": lambda: torch.empty_like(x),
    }
    print(f"{torch.cuda.get_device_name()}: host µs per call")
    for name, fn in rows.items():
        print(f"{name:32s} {min(host_us(fn) for _ in range(3)):8.1f}", flush=True)


if __name__ == "__main__":
    main()
