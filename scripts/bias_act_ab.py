"""A/B of bias_act kernels (bias + GELU, and relu for scale) between two source trees, CUDA-graph
times: run once per tree and interleave the runs (GPU).

    PYTHONPATH=old/src python scripts/bias_act_ab.py old; PYTHONPATH=src python scripts/bias_act_ab.py new
"""

import statistics
import sys

import torch

from tilefuse.ops import activations as ba
from tilefuse.bench.ceilings import graph_time_ms
from tilefuse import registry
from tilefuse.testing import rel_err

tag = sys.argv[1]
spec = registry.get("bias_act")
torch.manual_seed(0)
for shape in [(16384, 14336), (16384, 4096)]:
    n = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2).bfloat16()
    b = torch.randn(n, device="cuda").bfloat16()
    dy = torch.randn_like(x)
    for act in ("gelu", "relu"):
        fwd = lambda: ba._launch_fwd(x, b, None, act, 0.0, 0, None)
        bwd = lambda: ba._launch_bwd(dy, x, b, act, 0.0, 0, True, True, n, None)[0]
        if act == "gelu":
            y_ref = ba.bias_act_reference(x.double(), b.double(), "gelu")
            dx_ref, _ = ba._bias_act_bwd_reference(dy.double(), x.double(), b.double(), "gelu", 0.0, 0)
            print(f"{tag} {shape} errs fwd {rel_err(fwd(), y_ref):.3g} bwd {rel_err(bwd(), dx_ref):.3g}", flush=True)
            del y_ref, dx_ref
        for pass_, fn in (("fwd", fwd), ("bwd", bwd)):
            nbytes = spec.bytes_fn(shape, torch.bfloat16, pass_)
            ts = [graph_time_ms(fn, rep=30) for _ in range(3)]
            ms = statistics.median(ts)
            print(f"RESULT {tag} {act} {shape[0]}x{shape[1]} {pass_} {ms*1e3:.1f} us {nbytes/ms/1e6:.0f} GB/s", flush=True)
