"""Attention backward sweep on the GPU: a few launch configs of the dq/dk/dv kernels, each checked
and timed, next to SDPA's FlashAttention-2 and cuDNN backward measured in the same run.

    python scripts/attention_bwd_sweep.py [--d 64 128] [--s 1024 4096 16384] [--configs A B]

bf16, B·S = 16k, H = 16. FLOPs (FlashAttention's convention): backward = 2.5 × 4·B·S²·H·D, × 0.5
causal. out and lse come from SDPA's flash forward (aten._scaled_dot_product_flash_attention),
once per shape; only the backward call is timed (triton.testing.do_bench, median). Errors: max
abs difference of dq/dk/dv from SDPA-flash's gradients, next to cuDNN's own difference from them
(the noise floor). A config that fails to compile prints an error row; the sweep stops adding
configs once ``--budget`` seconds (default 160) have passed, so it stays inside one device call.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from tilefuse.ops._attention_bwd import launch_attention_backward

# per D: name -> launch config overrides ({} = the defaults: TMA loads, dkdv_config / dq_config).
# dk/dv kernel: BLOCK_M1 queries per step, BLOCK_N1 keys per program; dq kernel: BLOCK_M2
# queries per program, BLOCK_N2 keys per step. All spill <= ~150 B in ptxas -v (sm_90a).
# "-split": the same tiles with split_loops (mask-free blocks in a loop with no mask code, then the
# masked edge blocks in a second loop); without a window the dk/dv kernel compiles to the same
# code either way (it masks nothing), so the "full" rows measure the dq kernel's split only.
CONFIGS = {
    64: {
        "A": {},
        "A-ptr": {"use_tma": False},
        "A-ptr-split": {"use_tma": False, "split_loops": True},
        "B": dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=3,
                  BLOCK_M2=128, BLOCK_N2=32, num_warps_dq=4, num_stages_dq=3),
        "B-split": dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=3,
                        BLOCK_M2=128, BLOCK_N2=32, num_warps_dq=4, num_stages_dq=3, split_loops=True),
        "C": dict(BLOCK_M1=32, BLOCK_N1=64, num_warps=4, num_stages=3,
                  BLOCK_M2=64, BLOCK_N2=64, num_warps_dq=4, num_stages_dq=3),
        # with S_q / S_k specialized again (2026-11-23)
        "D": dict(BLOCK_M1=128, BLOCK_N1=128, num_warps=8, num_stages=2,
                  BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3),
        "E": dict(BLOCK_M1=64, BLOCK_N1=64, num_warps=4, num_stages=3,
                  BLOCK_M2=64, BLOCK_N2=64, num_warps_dq=4, num_stages_dq=3),
        "F": dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=3,
                  BLOCK_M2=128, BLOCK_N2=128, num_warps_dq=8, num_stages_dq=2),
        # dq tiles alone (dk/dv at its default)
        "Q64x128": dict(BLOCK_M2=64, BLOCK_N2=128, num_warps_dq=4, num_stages_dq=3),
        "Q128x64": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3),
        "Q128x128": dict(BLOCK_M2=128, BLOCK_N2=128, num_warps_dq=8, num_stages_dq=3),
        "Q128x64s4": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=4),
        "Q128x64-K128": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3,
                             BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=3),
        "Q128x64-K128s2": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3,
                               BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=2),
        "Q128x64-K64s4": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3, num_stages=4),
        "Q128x64-split": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3, split_loops=True),
        # with the dq default above: 128 queries per dk/dv step
        "K128x64s3": dict(BLOCK_M1=128, BLOCK_N1=64, num_warps=4, num_stages=3),
        "K128x64s2": dict(BLOCK_M1=128, BLOCK_N1=64, num_warps=4, num_stages=2),
        "K128x64w8": dict(BLOCK_M1=128, BLOCK_N1=64, num_warps=8, num_stages=3),
        # the default tiles with one kernel's loops split (mask-free run without mask code)
        "A-split-dkdv": dict(split_loops_dkdv=True),
        "A-split-dq": dict(split_loops_dq=True),
        "A-s3": dict(num_stages=3),
        "A-s3-split-dkdv": dict(num_stages=3, split_loops_dkdv=True),
        # dv's GEMM after dpᵀ's, overlapping dsᵀ (the mask-free loop only)
        "A-dvlate": dict(dv_late=True),
        "K64x128-dvlate": dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=3, dv_late=True),
        "K64x128": dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=3),
        "K64x64-dvlate": dict(BLOCK_M1=64, BLOCK_N1=64, num_warps=4, num_stages=3, dv_late=True),
        "K128x64w8-dvlate": dict(BLOCK_M1=128, BLOCK_N1=64, num_warps=8, num_stages=2, dv_late=True),
        "K128x128-dvlate": dict(BLOCK_M1=128, BLOCK_N1=128, num_warps=8, num_stages=2, dv_late=True),
    },
    128: {
        "A": {},
        "A-ptr": {"use_tma": False},
        "A-ptr-split": {"use_tma": False, "split_loops": True},
        "B": dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=2,
                  BLOCK_M2=128, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=3),
        "B-split": dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=2,
                        BLOCK_M2=128, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=3, split_loops=True),
        "C": dict(BLOCK_M1=16, BLOCK_N1=128, num_warps=8, num_stages=3,
                  BLOCK_M2=64, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=2),
        # with S_q / S_k specialized again (2026-11-23): wider query steps, deeper pipelines
        "D": dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=2,
                  BLOCK_M2=128, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=3),
        "E": dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=3,
                  BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=2),
        "G": dict(BLOCK_M1=16, BLOCK_N1=128, num_warps=8, num_stages=2,
                  BLOCK_M2=128, BLOCK_N2=32, num_warps_dq=8, num_stages_dq=2),
        # dq tiles alone (dk/dv at its default)
        "Q64": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=2),
        "Q64s3": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3),
        "Q64x64": dict(BLOCK_M2=64, BLOCK_N2=64, num_warps_dq=4, num_stages_dq=3),
        "Q64s4": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=4),
        "Q128": dict(BLOCK_M2=128, BLOCK_N2=128, num_warps_dq=8, num_stages_dq=2),
        "Q64s3K3": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3, num_stages=3),
        "Q64s3K32": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3, BLOCK_M1=32, num_stages=3),
        "Q64s3-split": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3, split_loops=True),
        "Q64s3K3-split": dict(BLOCK_M2=128, BLOCK_N2=64, num_warps_dq=8, num_stages_dq=3, num_stages=3,
                              split_loops=True),
        "A-dvlate": dict(dv_late=True),
        "A-dvlate-s3": dict(dv_late=True, num_stages=3),
        "A-dvlate-nosplit": dict(dv_late=True, split_loops_dkdv=False),
    },
}
# the warp-specialized Gluon dk/dv kernel (sm_90; the default where it serves) against the tl one
WS_CONFIGS = {"tl": {"GLUON": False}, "ws": {"GLUON": True}, "ws-s2": {"GLUON": True, "GLUON_STAGES": 2},
              "ws-s4": {"GLUON": True, "GLUON_STAGES": 4},
              # the warp-specialized dq kernel (default with "ws") against the tl one, and its tiles
              "ws-tldq": {"GLUON": True, "GLUON_DQ": False},
              "ws-dq-s3": {"GLUON": True, "GLUON_DQ_STAGES": 3},
              "ws-dq-s2": {"GLUON": True, "GLUON_DQ_STAGES": 2},
              "ws-dq-n64": {"GLUON": True, "GLUON_DQ_BLOCK_N": 64}}
CONFIGS[64].update(WS_CONFIGS, **{"ws-m128": {"GLUON": True, "GLUON_BLOCK_M": 128},
                                  "ws-m128-s2": {"GLUON": True, "GLUON_BLOCK_M": 128, "GLUON_STAGES": 2}})
CONFIGS[128].update(WS_CONFIGS)
BUDGET_S = 160.0   # --budget
PROFILE = False    # --profile


def bwd_flops(b, s, h, d, causal):
    return 2.5 * 4 * b * s * s * h * d * (0.5 if causal else 1.0)


def sdpa_grads_and_ms(backend, q, k, v, do, causal):
    """(dq, dk, dv) of SDPA with one backend forced, and its backward's median ms."""
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                     return_mode="median")
    return grads, ms


def kernel_split_us(fn, reps=5):
    """Mean device time per call of each attention_bwd kernel (torch.profiler), short names."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    split = {}
    for e in prof.key_averages():
        if "attention_bwd" in e.key:
            name = e.key.split("attention_bwd_")[1].split("_kernel")[0]
            split[name] = split.get(name, 0.0) + e.device_time_total / reps
    return split


def max_err(grads, refs):
    return max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, refs))


def run_shape(d, s, causal, names, started, rows):
    b, h = 16384 // s, 16
    scale = d ** -0.5
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    flops = bwd_flops(b, s, h, d, causal)
    flash, flash_ms = sdpa_grads_and_ms(SDPBackend.FLASH_ATTENTION, q, k, v, do, causal)
    try:
        cudnn, cudnn_ms = sdpa_grads_and_ms(SDPBackend.CUDNN_ATTENTION, q, k, v, do, causal)
        noise = max_err(cudnn, flash)
    except RuntimeError as exc:   # cuDNN SDPA unavailable in this build
        print(f"cuDNN: {str(exc)[:120]}")
        cudnn_ms, noise = float("nan"), float("nan")
    with torch.no_grad():
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    # the flash-attn layout [B, S, H, D], contiguous (tilefuse.attention's own)
    qs, ks, vs, dos, outs = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v, do, out))
    flash_bshd = [g.transpose(1, 2) for g in flash]
    tf = lambda ms: flops / ms / 1e9   # noqa: E731 - TFLOP/s from ms
    for name in names:
        label = f"D={d:<3} S={s:<5} {'causal' if causal else 'full  '} {name}"
        if time.time() - started > BUDGET_S:
            rows.append(f"{label} | skipped (time budget)")
            continue
        cfg = CONFIGS[d][name]
        fn = lambda: launch_attention_backward(   # noqa: E731
            dos, qs, ks, vs, outs, lse, scale=scale, window_right=0 if causal else None, config=cfg)
        try:
            err = max_err(fn(), flash_bshd)
            ms = triton.testing.do_bench(fn, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is an error row
            rows.append(f"{label} | ERROR {type(exc).__name__}: {str(exc)[:150]}")
            print(rows[-1], flush=True)
            continue
        flag = "" if err <= 4 * noise + 2e-2 or noise != noise else "  WRONG?"
        if PROFILE:
            flag += " | " + " ".join(f"{k} {v:.0f}" for k, v in sorted(kernel_split_us(fn).items())) + " us"
        rows.append(f"{label} | err {err:.3g} (cudnn {noise:.3g}){flag} | {ms * 1e3:8.0f} us {tf(ms):6.0f} TF/s"
                    f" | flash {tf(flash_ms):5.0f} cudnn {tf(cudnn_ms):5.0f} | x{flash_ms / ms:.2f} flash"
                    f" x{cudnn_ms / ms:.2f} cudnn")
        print(rows[-1], flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[128, 64])   # D=128 first: the headline
    ap.add_argument("--s", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--configs", nargs="+", default=None, help="config names (default: all)")
    ap.add_argument("--causal", choices=["both", "full", "causal"], default="both")
    ap.add_argument("--budget", type=float, default=160, help="seconds before configs are skipped")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time (torch.profiler)")
    args = ap.parse_args()
    global BUDGET_S, PROFILE
    BUDGET_S, PROFILE = args.budget, args.profile
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    started, rows = time.time(), []
    for d in args.d:
        names = [n for n in args.configs if n in CONFIGS[d]] if args.configs else list(CONFIGS[d])
        for causal in {"both": (False, True), "full": (False,), "causal": (True,)}[args.causal]:
            for s in args.s:
                run_shape(d, s, causal, names, started, rows)
    print("\nshape / config | max abs err vs SDPA-flash grads | time, TFLOP/s | SDPA TFLOP/s | speed-up")
    for r in rows:
        print(r)
    print(f"total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
