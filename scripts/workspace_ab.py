"""End-to-end time with internal buffers from reused workspaces (session 26) against fresh
allocations per call (before), in one process, on the GPU.

    PYTHONPATH=src python scripts/workspace_ab.py [--rounds 5]

"before" swaps ``workspace`` in each launcher module for a function that allocates, as the code
did until session 26; "after" is the code as it is. Each case is one pass as the benchmark times it
end to end (do_bench median, L2 flushed): a backward through ``torch.autograd.grad`` on a retained
graph, or decode's forward. The two are interleaved over ``--rounds``; outputs checked equal.
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch
import triton.testing

from tilefuse import _dispatch, registry
from tilefuse.registry import as_tuple
from tilefuse.testing import backward_grads, make_grad_outputs

# the modules by path (tilefuse.ops re-exports functions under some of these names)
MODULES = tuple(importlib.import_module(f"tilefuse.ops.{m}") for m in ("_attention_bwd", "activations",
                                                                        "attention_decode", "norms"))
CASES = [("bias_act", (16384, 4096)), ("rms_norm", (16384, 4096)), ("layer_norm", (16384, 4096)),
         ("attention_causal", (16, 1024, 1024, 16, 16, 64)), ("attention_decode", (1, 1, 32, 8, 32768, 128))]


def _fresh(purpose, shapes, dtype, device):
    return tuple(_dispatch.empty(s, dtype, device) for s in shapes)


class _Mode:
    """"before": every launcher module allocates its internal buffers per call."""

    def __init__(self, before: bool):
        self.before = before

    def __enter__(self):
        if self.before:
            for m in MODULES:
                m.workspace = _fresh

    def __exit__(self, *exc):
        for m in MODULES:
            m.workspace = _dispatch.workspace


def _pass(spec, shape):
    inp = spec.make_inputs(shape, torch.bfloat16, "cuda")
    if not spec.has_backward:
        return lambda: as_tuple(spec.fn(*inp.args, **inp.kwargs))
    outs = as_tuple(spec.fn(*inp.args, **inp.kwargs))
    grads = make_grad_outputs(outs)
    return lambda: backward_grads(outs, inp, grads, retain_graph=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    rounds = ap.parse_args().rounds
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: end to end, µs (median of {rounds} rounds)")
    print(f"{'case':44s} {'before':>8s} {'after':>8s} {'speedup':>8s}")
    for name, shape in CASES:
        spec = registry.get(name)
        run = _pass(spec, shape)
        with _Mode(True):
            ref = [t.clone() for t in run()]
        with _Mode(False):
            got = run()
        same = all(torch.equal(a, b) for a, b in zip(ref, got))
        samples = {True: [], False: []}
        for r in range(rounds):
            for before in ((True, False) if r % 2 == 0 else (False, True)):
                with _Mode(before):
                    samples[before].append(triton.testing.do_bench(run, return_mode="median") * 1e3)
        t0, t1 = statistics.median(samples[True]), statistics.median(samples[False])
        label = f"{name} {'x'.join(map(str, shape))} {'bwd' if spec.has_backward else 'fwd'}"
        print(f"{label:44s} {t0:8.1f} {t1:8.1f} {t0 / t1:7.3f}x{'' if same else '  OUTPUTS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
