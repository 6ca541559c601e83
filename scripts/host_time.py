"""Host time per call of every registered op, beside its torch peer (GPU machine, PYTHONPATH=src).

    python scripts/host_time.py [OP ...] [--profile OP ...] [--cpu-stub] [--shape 1x128x128x2x2x128]
                                [--dtype bf16] [--peer sdpa_flash]

``--cpu-stub`` measures the same Python path on a machine without a GPU: CPU tensors take the
Triton launchers (as under the interpreter) but every ``fast_launch`` kernel launch is a no-op, so
the figures are the host cost of our Python up to the compiled launcher (checks, autograd, plans,
allocations, launch cache keys), not of the C launcher itself (~8 µs per kernel on the H200 host).

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


_REPEATS = 1     # --cpu-stub: the best of many short batches (a shared VM's noise is one-sided)


def _best_batch_us(fn, batches: int, size: int = 20) -> float:
    """µs per call: the fastest of ``batches`` loops of ``size`` calls (no GPU to synchronize)."""
    import time

    for _ in range(size):
        fn()
    best = float("inf")
    for _ in range(batches):
        t = time.thread_time()      # CPU time of this thread: less of the VM's steal
        for _ in range(size):
            fn()
        best = min(best, time.thread_time() - t)
    return best / size * 1e6


def _host_us_or_nan(fn) -> float:
    """host_us, or NaN where a pass cannot repeat (an op that writes its gradient into its input
    bumps the version autograd checks on a retained graph)."""
    if fn is None:
        return float("nan")
    try:
        return host_us(fn) if _REPEATS == 1 else _best_batch_us(fn, _REPEATS)
    except RuntimeError:
        return float("nan")


def _stub_launches() -> None:
    """CPU tensors take the Triton path; fast_launch launches do nothing (see --cpu-stub)."""
    import sys

    from tilefuse import _launch

    def launch(self, grid, args, kwargs):     # the cache key is host work of every real launch
        self._cache.get(self._key(0, args, kwargs))

    def launch_prepared(self, grid, tensors, prepared):
        self._prepared_cache.get((0, tuple([(t.dtype, t.data_ptr() % 16 == 0) if type(t) is torch.Tensor
                                            else _launch._arg_key(t) for t in tensors]), prepared.key))

    _launch.FastKernel._launch = launch
    _launch.FastKernel.launch_prepared = launch_prepared
    for name, mod in list(sys.modules.items()):
        if name.startswith("tilefuse.") and hasattr(mod, "use_triton"):
            mod.use_triton = lambda t: True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="*")
    ap.add_argument("--profile", nargs="*", default=[])
    ap.add_argument("--cpu-stub", action="store_true", help="no GPU: stubbed launches on CPU tensors")
    ap.add_argument("--shape", help="one shape for every op named (e.g. 1x128x128x2x2x128), not the test shape")
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="input dtype (default fp16 where served)")
    ap.add_argument("--peer", default="torch", help="the peer to time beside tilefuse (a registered peer name)")
    a = ap.parse_args()
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    specs = [s for s in registry.all_ops() if not a.ops or s.name in a.ops]
    device = "cpu" if a.cpu_stub else "cuda"
    if a.cpu_stub:
        global _REPEATS
        _stub_launches()
        _REPEATS = 150
    name = "CPU, launches stubbed" if a.cpu_stub else torch.cuda.get_device_name()
    print(f"{name}  host µs per call (loop of 300, kernels negligible)")
    print(f"{'op':22s} {'shape':18s} {'pass':14s} {'tilefuse':>9s} {a.peer:>9s}")
    for spec in specs:
        shape = tuple(int(n) for n in a.shape.split("x")) if a.shape else _small_shape(spec)
        dtype = dtypes[a.dtype] if a.dtype else (torch.float16 if torch.float16 in spec.dtypes else spec.dtypes[0])
        try:
            inputs = spec.make_inputs(shape, dtype, device)
            ours = _passes(spec.fn, inputs, spec.has_backward)
            peer_factory = spec.peers.get(a.peer)
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
                pstats.Stats(pr).sort_stats("tottime").print_stats(14)
                pstats.Stats(pr).sort_stats("cumtime").print_stats(30)
        except Exception as exc:  # noqa: BLE001 - one op's failure should not hide the others
            print(f"{spec.name:22s} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
