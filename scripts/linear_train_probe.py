"""tilefuse.nn.Linear against torch.nn.Linear (cuBLAS) on a training step's GEMMs: forward, and
forward + backward (dX and dW) of bf16 Linears at Llama-8B MLP / attention shapes and M tokens;
do_bench medians, interleaved rounds. (s38: the MLP with tilefuse's Linear was ~3 ms per block
slower at M = 4096 in scripts/autocast_step.py.)

    PYTHONPATH=src python scripts/linear_train_probe.py [--tokens 4096 8192]
"""

import argparse

import torch
import triton.testing

import tilefuse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    shapes = [(4096, 14336), (14336, 4096), (4096, 12288), (4096, 4096)]      # (in, out): gate/up, down, qkv, o
    print(f"{torch.cuda.get_device_name()}  bf16 Linear (no bias), ms per call (median of rounds)")
    print(f"{'M':>6s} {'in->out':>12s} {'pass':>8s} {'torch':>8s} {'tilefuse':>9s} {'ratio':>6s}")
    for m in args.tokens:
        for k, n in shapes:
            torch_lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            ours = tilefuse.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            ours.load_state_dict(torch_lin.state_dict())
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            for name, fn in (("fwd", lambda lin: lin(x.detach())),
                             ("fwd+bwd", lambda lin: torch.autograd.grad(lin(x), (x, lin.weight), dy))):
                times = {"torch": [], "tilefuse": []}
                for _ in range(args.rounds):
                    for label, lin in (("torch", torch_lin), ("tilefuse", ours)):
                        times[label].append(triton.testing.do_bench(lambda: fn(lin), warmup=5, rep=25))
                t, o = (sorted(v)[len(v) // 2] for v in times.values())
                print(f"{m:6d} {f'{k}->{n}':>12s} {name:>8s} {t:8.3f} {o:9.3f} {t / o:6.2f}")


if __name__ == "__main__":
    main()
