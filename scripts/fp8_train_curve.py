"""Loss curve of a small transformer LM trained in fp8 (tilefuse.fp8.Linear) vs the same model in bf16.

    PYTHONPATH=src python scripts/fp8_train_curve.py --out /tmp/fp8_curve            # GPU, ~300 steps
    PYTHONPATH=src python scripts/fp8_train_curve.py --device cpu --steps 5 --d-model 32 --layers 1 \\
        --seq 16 --batch 4 --dtype float32 --out /tmp/smoke                          # CPU smoke

Task (synthetic, learnable, identical for both runs): a fixed random first-order Markov chain
over ``--vocab`` tokens; every token has 3 successors with probabilities 0.6 / 0.3 / 0.1, so the
best achievable next-token loss is the chain's entropy, H = 0.898 nats (printed as "optimal").
Context is not needed beyond one token, but the model does not know that: it is a plain pre-norm
transformer (token + position embeddings, causal attention, GELU MLP, LM head), built from
``torch.nn`` only.

Runs, same seed, same initial weights, same batches:

* ``bf16``: parameters (the master weights AdamW updates) and activations in ``--dtype``;
* ``fp8``: the same, with every ``nn.Linear`` inside the blocks (qkv, attention output, MLP up /
  down) replaced by ``tilefuse.fp8.Linear`` sharing its parameters (e4m3 per-row forward, e5m2
  gradients, see ``tilefuse/fp8.py``); the LM head stays in ``--dtype`` unless ``--fp8-head``.

Prints the training loss (mean of the last ``--every`` steps) and a held-out loss every
``--every`` steps for both runs; writes ``fp8_train_curve.json`` and ``fp8_train_curve.png``
(matplotlib, if installed) to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from tilefuse import fp8

SUCCESSOR_PROBS = (0.6, 0.3, 0.1)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class MarkovData:
    """Sequences from a fixed random Markov chain (3 successors per token)."""

    def __init__(self, vocab: int, seed: int, device):
        g = torch.Generator().manual_seed(seed)
        self.succ = torch.stack([torch.randperm(vocab, generator=g)[:len(SUCCESSOR_PROBS)] for _ in range(vocab)])
        self.probs = torch.tensor(SUCCESSOR_PROBS)
        self.vocab, self.device = vocab, device
        self.entropy = -float((self.probs * self.probs.log()).sum())

    def batch(self, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
        tok = torch.randint(self.vocab, (batch,), generator=g)
        out = [tok]
        for _ in range(seq):
            choice = torch.multinomial(self.probs.expand(batch, -1), 1, generator=g).squeeze(1)
            tok = self.succ[tok, choice]
            out.append(tok)
        return torch.stack(out, 1).to(self.device)        # [batch, seq + 1]: inputs and targets


def lm_loss(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(seqs[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))


def train(model: nn.Module, data: MarkovData, args, held_out: torch.Tensor) -> dict:
    """AdamW for args.steps steps on batches drawn from a generator seeded with args.seed."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    g = torch.Generator().manual_seed(args.seed + 1)
    log = {"step": [], "train": [], "eval": []}
    recent: list[float] = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = lm_loss(model, data.batch(args.batch, args.seq, g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent.append(float(loss.detach()))
        if not math.isfinite(recent[-1]):
            raise FloatingPointError(f"loss is {recent[-1]} at step {step}")
        if step % args.every == 0 or step == args.steps:
            with torch.no_grad():
                ev = float(lm_loss(model, held_out))
            log["step"].append(step)
            log["train"].append(sum(recent) / len(recent))
            log["eval"].append(ev)
            recent = []
    log["seconds"] = time.perf_counter() - t0
    return log


def plot(results: dict, optimal: float, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in (("bf16", "-"), ("fp8", "--")):
        log = results[name]
        ax.plot(log["step"], log["train"], style, label=f"{name} train")
        ax.plot(log["step"], log["eval"], style, marker="o", markersize=3, label=f"{name} held-out")
    ax.axhline(optimal, color="gray", lw=0.8, ls=":", label=f"optimal ({optimal:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title("tiny transformer LM: fp8 (tilefuse.fp8.Linear) vs bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25, help="log every this many steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="parameter and activation dtype of both runs (the 'bf16' baseline)")
    p.add_argument("--grad-dtype", default="e5m2", choices=["e5m2", "e4m3"])
    p.add_argument("--fp8-head", action="store_true", help="also run the LM head in fp8")
    p.add_argument("--out", default="fp8_train_curve_out")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    data = MarkovData(args.vocab, args.seed, args.device)
    held_out = data.batch(64, args.seq, torch.Generator().manual_seed(args.seed + 2))
    base = TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq).to(args.device, dtype)
    grad_dtype = fp8.E5M2 if args.grad_dtype == "e5m2" else fp8.E4M3
    results = {}
    for name in ("bf16", "fp8"):
        model = copy.deepcopy(base)             # the same initial weights for both runs
        if name == "fp8":
            fp8.swap_linears(model.blocks, grad_dtype=grad_dtype)
            if args.fp8_head:
                model.head = fp8.Linear.from_linear(model.head, grad_dtype=grad_dtype)
        results[name] = train(model, data, args, held_out)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"optimal loss (chain entropy) {data.entropy:.4f} nats; dtype {args.dtype}; "
          f"bf16 run {results['bf16']['seconds']:.1f} s, fp8 run {results['fp8']['seconds']:.1f} s")
    print(f"{'step':>6} | {'bf16 train':>10} | {'fp8 train':>10} | {'bf16 eval':>10} | {'fp8 eval':>10} | {'eval diff':>9}")
    b, f = results["bf16"], results["fp8"]
    for i, step in enumerate(b["step"]):
        print(f"{step:>6} | {b['train'][i]:>10.4f} | {f['train'][i]:>10.4f} | {b['eval'][i]:>10.4f} | "
              f"{f['eval'][i]:>10.4f} | {f['eval'][i] - b['eval'][i]:>+9.4f}")
    summary = {"args": vars(args), "optimal": data.entropy, "device": str(args.device),
               "gpu": torch.cuda.get_device_name() if str(args.device).startswith("cuda") else None, **results}
    (out / "fp8_train_curve.json").write_text(json.dumps(summary, indent=1))
    if plot(results, data.entropy, out / "fp8_train_curve.png"):
        print(f"wrote {out / 'fp8_train_curve.png'}")
    print(f"wrote {out / 'fp8_train_curve.json'}")
    return summary


if __name__ == "__main__":
    main()
