"""Program order of the attention kernels on the GPU: heads per scheduling group (HEAD_GROUP,
``_attention_common.schedule_grid``) against plain head order, forward and backward.

    PYTHONPATH=src python scripts/attention_order_probe.py [--d 64 128] [--s 1024 4096] [--rounds 5]

bf16, B·S = 16k, H = 16, causal unless --full. Per shape: every HEAD_GROUP that divides B·H (and the
default heuristic, "auto") is checked against the default's output (bitwise: the order must not
change a result) and timed with ``triton.testing.do_bench`` (median, L2 flushed), all configs and
SDPA's flash / cuDNN backends interleaved for ``--rounds`` rounds, medians kept. Backward: the
launcher alone (no autograd), out / lse from SDPA-flash, as ``attention_bwd_sweep.py``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from tilefuse.ops._attention_bwd import launch_attention_backward
from tilefuse.ops._attention_common import heads_per_group
from tilefuse.ops._attention_fwd_kernels import attention_flops, attention_forward

TOKENS, HEADS = 16384, 16


def sdpa_fns(q, k, v, do, causal):
    """{name: (fwd fn, bwd fn)} for SDPA's flash and cuDNN backends ([B, H, S, D] views)."""
    fns = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fwd(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            bwd = (lambda out=out: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
            bwd()
            fns[name] = (fwd, bwd)
        except RuntimeError as exc:
            print(f"  sdpa {name}: {str(exc)[:100]}")
    return fns


def interleaved(fns: dict, rounds: int) -> dict:
    """Median ms per name, every fn timed once per round in rotated order (clock drift)."""
    names = list(fns)
    samples = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            samples[n].append(triton.testing.do_bench(fns[n], return_mode="median"))
    return {n: statistics.median(v) for n, v in samples.items()}


def probe(d: int, s: int, causal: bool, rounds: int, sms: int) -> None:
    b = TOKENS // s
    scale = d ** -0.5
    q, k, v = (torch.randn(b, HEADS, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, HEADS, s, d, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    qs, ks, vs, dos, outs = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v, do, out))
    right = 0 if causal else None
    groups = ["auto"] + [g for g in (1, 4, 8, 16, 32, 64) if (b * HEADS) % g == 0]
    flops = attention_flops(b, s, s, HEADS, d, causal)
    ref_f = attention_forward(qs, ks, vs, scale=scale, window_right=right)[0]
    ref_b = launch_attention_backward(dos, qs, ks, vs, outs, lse, scale=scale, window_right=right)
    fwd, bwd = {}, {}
    for g in groups:
        cfg = None if g == "auto" else {"HEAD_GROUP": g}
        f = (lambda c: lambda: attention_forward(qs, ks, vs, scale=scale, window_right=right, config=c)[0])(cfg)
        bk = (lambda c: lambda: launch_attention_backward(dos, qs, ks, vs, outs, lse, scale=scale,
                                                         window_right=right, config=c))(cfg)
        same_f = torch.equal(f(), ref_f)
        same_b = all(torch.equal(x, y) for x, y in zip(bk(), ref_b))
        if not (same_f and same_b):
            print(f"  HEAD_GROUP={g}: result differs from the default (fwd {same_f}, bwd {same_b})")
        fwd[f"G={g}"], bwd[f"G={g}"] = f, bk
    for name, (f, bk) in sdpa_fns(q, k, v, do, causal).items():
        fwd[name], bwd[name] = f, bk
    auto = {n: heads_per_group(n_blocks, b * HEADS, causal, sms) for n, n_blocks in
            (("fwd 128-row blocks", -(-s // 128)), ("dkdv 128-key blocks", -(-s // 128)))}
    for kind, fns, fl in (("fwd", fwd, flops), ("bwd", bwd, 2.5 * flops)):
        ms = interleaved(fns, rounds)
        base = ms["G=1"]
        print(f"D={d} S={s} {'causal' if causal else 'full'} {kind} (auto: {auto}):")
        for n, t in ms.items():
            print(f"  {n:8s} {t * 1e3:8.1f} us {fl / t / 1e9:6.0f} TF/s  {base / t:5.3f}x G=1"
                  f"  x{ms.get('flash', float('nan')) / t:.2f} flash  x{ms.get('cudnn', float('nan')) / t:.2f} cudnn",
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--s", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--full", action="store_true", help="no causal mask")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), sms, "SMs, torch", torch.__version__, "triton", triton.__version__)
    for d in args.d:
        for s in args.s:
            probe(d, s, not args.full, args.rounds, sms)


if __name__ == "__main__":
    main()
