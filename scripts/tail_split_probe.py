"""Does splitting a large GEMM's last row blocks into a second launch beat its tail wave? (GPU)

    cd scripts && python tail_split_probe.py [--shapes llama|square|all] [--rounds 5] [--rows 1,2,4]

A persistent GEMM with T tiles on S SMs runs ceil(T / S) tile-times; at 8192×14336×4096 the
Gluon kernel's 3584 tiles of 128x256 are 27.15 waves on 132 SMs, so the last wave leaves 85 % of
the SMs idle (0.97-0.99× cuBLAS in session 43). Candidates, each checked against the fp32 product
and timed as CUDA-graph replays after an L2 flush, interleaved with cuBLAS (``matmul_sweep``'s
helpers): the default launch; ``split-r``: rows [0, M - 128·r) then the last r row blocks as a
second GEMM (its own plan: a mid-M tile) into views of one output; ``split-r-2s``: the second
GEMM on a side stream forked and joined inside the graph, so it may fill SMs the first leaves
idle (the block scheduler's order between the two kernels is not fixed: measure); ``one-launch``:
the default plan with ``_matmul_gluon_plan.TAIL_SPLIT`` off (since s46 the default splits where
``tail_split_rows`` says so). b = w.t(). Prints the default's wave count and each candidate's ms
and ratio to cuBLAS.
"""

from __future__ import annotations

import argparse

import torch

from matmul_sweep import SHAPES, interleaved_ms, valid_fns
from tilefuse.ops import _matmul_gluon_plan as gp
from tilefuse.ops import _matmul_kernels as mk


def split_fn(a, b, out, rows: int, side: torch.cuda.Stream | None):
    """out = a @ b as two launches: the first M - rows rows, then the last ``rows``."""
    m1 = a.shape[0] - rows

    def fn():
        mk.launch_matmul(a[:m1], b, out=out[:m1])
        if side is None:
            mk.launch_matmul(a[m1:], b, out=out[m1:])
            return out
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            mk.launch_matmul(a[m1:], b, out=out[m1:])
        main.wait_stream(side)
        return out
    return fn


def one_launch(fns: dict, a, b, out) -> None:
    """Adds the default plan without the tail split, captured as a graph while TAIL_SPLIT is off."""
    gp.TAIL_SPLIT = False
    mk._matmul_plan.cache_clear()
    try:
        fns.update(valid_fns({"one-launch": lambda: mk.launch_matmul(a, b, out=out)[0]}, a.float() @ b.float(),
                             graph=True))
    finally:
        gp.TAIL_SPLIT = True
        mk._matmul_plan.cache_clear()


def waves(m: int, n: int, k: int, a: torch.Tensor, b: torch.Tensor) -> str:
    """The default plan's tile and its wave count on this GPU."""
    sms = mk.num_sms(a)
    plan = mk._matmul_plan(m, n, k, a.dtype, a.dtype, a.stride(), b.stride(), (n, 1), True, sms, True, True,
                           (False, "none", False, False), (), True)
    if plan.tail_rows:
        return f"split: the last {plan.tail_rows} rows on their own plan"
    if plan.ws_plan is None:
        return "tl kernel"
    tile = dict(plan.ws_tile)
    rows = 64 * tile["CONSUMERS"]
    tiles = -(-m // rows) * -(-n // tile["BLOCK_N"])
    return f"Gluon {rows}x{tile['BLOCK_N']}: {tiles} tiles = {tiles / sms:.2f} waves"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,2,4", help="row blocks of 128 split off")
    args = ap.parse_args()
    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    side = torch.cuda.Stream()
    print(torch.cuda.get_device_name(), "bf16, b = w.t(), CUDA-graph replays after an L2 flush")
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        ref = a.float() @ b.float()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        candidates = {"cublas": lambda: torch.matmul(a, b), "default": lambda: mk.launch_matmul(a, b, out=out)[0]}
        for r in (int(v) for v in args.rows.split(",")):
            candidates[f"split-{r}"] = split_fn(a, b, torch.empty_like(out), 128 * r, None)
            candidates[f"split-{r}-2s"] = split_fn(a, b, torch.empty_like(out), 128 * r, side)
        fns = valid_fns(candidates, ref, graph=True)
        one_launch(fns, a, b, torch.empty_like(out))
        ms = interleaved_ms(fns, args.rounds)
        print(f"{m}x{n}x{k}  ({waves(m, n, k, a, b)})")
        for name, t in ms.items():
            print(f"  {name:12s} {t:.4f} ms {2 * m * n * k / t / 1e9:5.0f} TF/s  {ms['cublas'] / t:5.3f}x cuBLAS")


if __name__ == "__main__":
    main()
