"""Host time per call of every registered op, beside its torch peer (GPU machine, PYTHONPATH=src).

    python scripts/host_time.py [OP ...] [--profile OP ...]

Each op runs on one of its small test shapes, where the kernels take a few µs: the loop time per
call is then the host side alone (Python, argument checks, allocations, autograd, launches). Rows:
forward without grad, forward building the graph, backward (``autograd.grad`` on a retained graph)
and fwd+bwd, for tilefuse and the op's ``torch`` peer. ``--profile`` adds a cProfile of fwd+bwd
(top functions by own time) for the named ops.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from tilefuse import registry
from tilefuse.bench import host_us
from tilefuse.testing import grad_leaves, make_grad_outputs


def _small_shape(spec):
    """The largest test shape under 2**16 elements: every code path's launch, negligible kernels."""
    fits = [s for s in spec.test_shapes if torch.Size(s).numel() <= 1 << 16] or list(spec.test_shapes)
    return max(fits, key=lambda s: torch.Size(s).numel())


def _passes(fn, inputs, has_backward):
    args, kwargs = inputs.args, inputs.kwargs
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    rows = {"fwd (no grad)": lambda: fn(*plain, **kwargs), "fwd (graph)": lambda: fn(*args, **kwargs)}
    leaves = grad_leaves(inputs)
    if has_backward and leaves:
        outs = registry.as_tuple(fn(*args, **kwargs))
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = make_grad_outputs(outs)
        rows["bwd"] = lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)

        def step():
            o = [t for t in registry.as_tuple(fn(*args, **kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            return torch.autograd.grad(o, leaves, grads, allow_unused=True)

        rows["fwd+bwd"] = step
    return rows


def _host_us_or_nan(fn) -> float:
    """host_us, or NaN where a pass cannot repeat (an op that writes its gradient into its input
    bumps the version autograd checks on a retained graph)."""
    if fn is None:
        return float("nan")
    try:
        return host_us(fn)
    except RuntimeError:
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="*")
    ap.add_argument("--profile", nargs="*", default=[])
    a = ap.parse_args()
    specs = [s for s in registry.all_ops() if not a.ops or s.name in a.ops]
    print(f"{torch.cuda.get_device_name()}  host µs per call (loop of 300, kernels negligible)")
    print(f"{'op':22s} {'shape':18s} {'pass':14s} {'tilefuse':>9s} {'torch':>9s}")
    for spec in specs:
        shape = _small_shape(spec)
        dtype = torch.float16 if torch.float16 in spec.dtypes else spec.dtypes[0]
        try:
            inputs = spec.make_inputs(shape, dtype, "cuda")
            ours = _passes(spec.fn, inputs, spec.has_backward)
            peer_factory = spec.peers.get("torch")
            peer = peer_factory() if peer_factory else None
            theirs = _passes(peer, inputs.cloned(), spec.has_backward) if peer else {}
            for name, fn in ours.items():
                t_ours, t_peer = _host_us_or_nan(fn), _host_us_or_nan(theirs.get(name))
                print(f"{spec.name:22s} {'x'.join(map(str, shape)):18s} {name:14s} {t_ours:9.1f} {t_peer:9.1f}", flush=True)
            if spec.name in a.profile and "fwd+bwd" in ours:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(300):
                    ours["fwd+bwd"]()
                pr.disable()
                torch.cuda.synchronize()
                pstats.Stats(pr).sort_stats("tottime").print_stats(14)
        except Exception as exc:  # noqa: BLE001 - one op's failure should not hide the others
            print(f"{spec.name:22s} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
