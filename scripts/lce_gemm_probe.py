"""Where linear_cross_entropy's time goes, one token chunk at a time (GPU; PYTHONPATH=src).

    python scripts/lce_gemm_probe.py [T H V] [--chunks 512 2048]

Per chunk of C tokens the op runs (``linear_cross_entropy._chunked_pass``): the logits GEMM
``h_c @ Wᵀ`` [C, V], the CE rows kernel (logits -> dlogits in place), ``grad_hidden[c] =
dlogits @ W`` [C, H] (K = V) and ``grad_weight += dlogitsᵀ @ h_c`` [V, H] (K = C), the last one
reading and writing the whole [V, H] accumulator once per chunk. Each part is timed alone
(``triton.testing.do_bench`` median, L2 flushed), beside alternatives for the two backward GEMMs:

* ``dw_acc`` (cuBLAS ``addmm_``, beta = 1) against ``dw_new`` (the same GEMM without reading the
  accumulator: the accumulation's own cost) and tilefuse's GEMM with the accumulator as its
  residual epilogue;
* ``dh`` (cuBLAS, M = C, N = H: few output tiles, K = V long) against tilefuse's GEMM;
* the three GEMMs with the chunk's logits stored transposed, ``[V, C]`` (``W @ h_cᵀ``: V is
  the GEMM's M, so C = 512 fills whole tiles whatever M tile cuBLAS picks).

TFLOP/s = 2·C·H·V / time; "x chunks" = the time of all T / C chunks.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from tilefuse.ops._matmul_kernels import launch_matmul
from tilefuse.ops._cross_entropy_kernels import CEOptions
from tilefuse.ops._cross_entropy_shared import cross_entropy_rows
from tilefuse.ops.cross_entropy import random_targets
from tilefuse.testing import rel_err


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def probe(t: int, hdim: int, vocab: int, chunk: int) -> None:
    dev, dt = "cuda", torch.bfloat16
    h_c = torch.randn(chunk, hdim, device=dev, dtype=dt)
    w = (torch.randn(vocab, hdim, device=dev) * hdim ** -0.5).to(dt)
    target = random_targets(chunk, vocab, dev)
    logits = torch.empty(chunk, vocab, device=dev, dtype=dt)
    gw = (torch.randn(vocab, hdim, device=dev) * 1e-3).to(dt)
    gh = torch.empty(chunk, hdim, device=dev, dtype=dt)
    scale = torch.ones(1, device=dev)
    loss = torch.empty(chunk, device=dev)
    opts = CEOptions(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
    torch.mm(h_c, w.t(), out=logits)
    dl = logits.clone()
    cross_entropy_rows(dl, target, scale, loss, dl, opts)

    # correctness of the alternatives against fp32 products of the same operands
    ref_dh = dl.float() @ w.float()
    ref_dw = gw.float() + dl.float().t() @ h_c.float()
    tf_dh = launch_matmul(dl, w)[0]
    tf_dw = launch_matmul(dl.t(), h_c, residual=gw)[0]
    cb_dw = gw.clone().addmm_(dl.t(), h_c)
    print(f"C={chunk}: rel err dh tilefuse {rel_err(tf_dh, ref_dh):.2e} cuBLAS {rel_err(torch.mm(dl, w), ref_dh):.2e}; "
          f"dw_acc tilefuse {rel_err(tf_dw, ref_dw):.2e} cuBLAS {rel_err(cb_dw, ref_dw):.2e}")

    tmp = torch.empty_like(gw)
    logits_t = torch.empty(vocab, chunk, device=dev, dtype=dt)     # the chunk's logits stored [V, C]
    dl_t = dl.t().contiguous()
    parts = {
        "fwd^T (cuBLAS W @ h_c^T -> [V, C])": (lambda: torch.mm(w, h_c.t(), out=logits_t), True),
        "fwd (tilefuse h_c @ W^T)": (lambda: launch_matmul(h_c, w.t()), True),
        "dh ([V, C] dlogits, cuBLAS)": (lambda: torch.mm(dl_t.t(), w, out=gh), True),
        "dw_acc ([V, C] dlogits, addmm_)": (lambda: gw.addmm_(dl_t, h_c), True),
        "dw_acc ([V, C] dlogits, transposed)": (lambda: gw.t().addmm_(h_c.t(), dl_t.t()), True),
        "fwd (cuBLAS h_c @ W^T)": (lambda: torch.mm(h_c, w.t(), out=logits), True),
        "ce rows (in place)": (lambda: cross_entropy_rows(logits, target, scale, loss, logits, opts), False),
        "dh (cuBLAS)": (lambda: torch.mm(dl, w, out=gh), True),
        "dh (tilefuse)": (lambda: launch_matmul(dl, w), True),
        "dw_acc (cuBLAS addmm_)": (lambda: gw.addmm_(dl.t(), h_c), True),
        "dw_new (cuBLAS mm)": (lambda: torch.mm(dl.t(), h_c, out=tmp), True),
        "dw_acc (cuBLAS addmm_, transposed)": (lambda: gw.t().addmm_(h_c.t(), dl), True),
        "dw_new (tilefuse)": (lambda: launch_matmul(dl.t(), h_c), True),
        "dw_acc (tilefuse residual)": (lambda: launch_matmul(dl.t(), h_c, residual=gw), True),
        "dw_acc (tilefuse residual, in place)": (lambda: launch_matmul(dl.t(), h_c, residual=gw, out=gw), True),
        "dw_acc (tilefuse residual, flatten)": (lambda: launch_matmul(dl.t(), h_c, residual=gw,
                                                                      config=dict(FLATTEN=True)), True),
    }
    flops = 2 * chunk * hdim * vocab
    n_chunks = t // chunk
    print(f"{'part':38s} {'ms':>8s} {'TFLOP/s':>8s} {'x chunks ms':>12s}")
    for name, (fn, gemm) in parts.items():
        if name.startswith("ce rows"):
            torch.mm(h_c, w.t(), out=logits)
        tms = ms(fn)
        tf = f"{flops / tms / 1e9:8.0f}" if gemm else f"{'':8s}"
        print(f"{name:38s} {tms:8.3f} {tf} {tms * n_chunks:12.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8192, 4096, 128256])
    ap.add_argument("--chunks", nargs="+", type=int, default=[512, 2048])
    args = ap.parse_args()
    t, hdim, vocab = args.shape
    print(f"T={t} H={hdim} V={vocab} bf16, {torch.cuda.get_device_name()}")
    for c in args.chunks:
        probe(t, hdim, vocab, c)


if __name__ == "__main__":
    main()
