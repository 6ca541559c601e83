"""Varlen forward: pointer loads against in-kernel (per sequence) TMA descriptors, on the GPU.

    python scripts/attention_varlen_loads.py [--rounds 3]

Packed bf16 sequences of equal length S (B·S = 16k tokens, H = 16; the registry's
attention_varlen bench shapes), causal and not, D = 64 / 128. Each load path is checked against
the dense forward of the same tensors, then timed with triton.testing.do_bench (median), the
paths interleaved over ``--rounds`` rounds; TFLOP/s by FlashAttention's convention.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.testing

from tilefuse.ops._attention_fwd_kernels import attention_flops, attention_forward

TOKENS, HEADS = 16384, 16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for d in (128, 64):
        for s in (1024, 4096):
            for causal in (False, True):
                b = TOKENS // s
                q, k, v = (torch.randn(TOKENS, HEADS, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                cu = torch.arange(0, TOKENS + 1, s, device="cuda", dtype=torch.int32)
                right = 0 if causal else None
                dense = attention_forward(q.view(b, s, HEADS, d), k.view(b, s, HEADS, d), v.view(b, s, HEADS, d),
                                          scale=d ** -0.5, window_right=right)[0].view(TOKENS, HEADS, d)
                fns = {}
                for load in ("ptr", "desc_device"):
                    fn = (lambda c: lambda: attention_forward(q, k, v, cu, cu, s, s, scale=d ** -0.5,
                                                              window_right=right, config=c)[0])({"LOAD": load})
                    err = (fn().float() - dense.float()).abs().max().item()
                    print(f"D={d} S={s} {'causal' if causal else 'full'} {load}: max |diff| vs dense {err:.3g}", flush=True)
                    fns[load] = fn
                flops = attention_flops(b, s, s, HEADS, d, causal)
                samples = {name: [] for name in fns}
                for r in range(args.rounds):
                    for name, fn in (list(fns.items())[r % 2:] + list(fns.items())[:r % 2]):
                        samples[name].append(flops / triton.testing.do_bench(fn, warmup=10, rep=50) / 1e9)
                print(f"D={d:3d} S={s:5d} {'causal' if causal else 'full  '} | "
                      + " | ".join(f"{n} {statistics.median(v):5.0f} TF/s" for n, v in samples.items()), flush=True)


if __name__ == "__main__":
    main()
