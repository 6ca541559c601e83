"""attention_decode on the GPU: validate, then time (do_bench median), in one call of < 2 minutes.

    python scripts/attention_decode_bench.py [--dtype bf16] [--no-sweep] [--budget-s 100] [--graph-ab ROUNDS]

Shapes (B, S_q, H_q, H_kv, L, D), full caches (cache_seqlens = L, no append): the registry's bench
shapes, B=16 L=8k and B=1 L=32k/128k. Per shape: tilefuse contiguous (auto splits), paged with
16- and 256-slot pages (shuffled pages), a few forced num_splits, and torch SDPA (default backend,
enable_gqa, one batched call on the cache slice). Each row: us, GB/s on the KV bytes read
(2·B·L·H_kv·D·elem), % of a measured device copy (torch copy_ of a 1 GiB tensor, read + write
counted). Then a launch-config sweep (BLOCK_N, num_stages, num_warps) per shape while the time
budget lasts. Everything is checked against a fp32 reference (rel err norm <= 1e-2) first.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import torch
import triton.testing

import tilefuse.ops.attention_decode as ad
from tilefuse.ops.attention_decode import attention_decode, attention_decode_reference
from tilefuse.testing import rel_err

SHAPES = [(16, 1, 32, 8, 8192, 128), (1, 1, 32, 8, 32768, 128), (1, 1, 32, 8, 131072, 128)]
FORCED_SPLITS = {8192: (1, 2, 4), 32768: (8, 16, 32, 64), 131072: (16, 32, 64, 128)}
# --graph-ab: split counts besides the automatic one, and launch configs (default tiles first)
GRAPH_SPLITS = {8192: (), 32768: (16, 33, 49), 131072: (16, 33)}
GRAPH_CONFIGS = {"default": {}, "N=64 st=3 w=4": dict(BLOCK_N=64, num_stages=3, num_warps=4),
                 "N=64 st=4 w=4": dict(BLOCK_N=64, num_stages=4, num_warps=4),
                 "N=128 st=2 w=8": dict(BLOCK_N=128, num_stages=2, num_warps=8),
                 # 64 KB of shared memory: three programs an SM (49 splits x 8 heads = 392 of 396 slots)
                 "N=64 st=2 w=4": dict(BLOCK_N=64, num_stages=2, num_warps=4)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def time_us(fn) -> float:
    return 1e3 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_gbps() -> float:
    """torch copy_ of a 1 GiB tensor into another; bytes = read + write."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * (1 << 30) / us / 1e3


def make_inputs(shape, dtype):
    batch, s_q, h_q, h_kv, length, d = shape
    q = torch.randn(batch, s_q, h_q, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, length, h_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, length, h_kv, d, device="cuda", dtype=dtype)
    return q, k, v, torch.full((batch,), length, dtype=torch.int32, device="cuda")


def paged(k, v, page_size):
    """k/v scattered into shuffled pages of ``page_size`` slots, and the block table."""
    batch, length, h_kv, d = k.shape
    per_row = math.ceil(length / page_size)
    perm = torch.randperm(batch * per_row, device="cuda")
    table = perm.view(batch, per_row).to(torch.int32)
    out = []
    for cache in (k, v):
        pages = torch.zeros(batch * per_row, page_size, h_kv, d, dtype=cache.dtype, device="cuda")
        pages[perm] = cache.view(batch * per_row, page_size, h_kv, d)   # length % page_size == 0 here
        out.append(pages)
    return out[0], out[1], table


def report(rows, ceiling):
    print(f"{'impl':34s} {'us':>9s} {'GB/s':>8s} {'% copy':>7s}  rel_err")
    for name, us, nbytes, err in rows:
        gbps = nbytes / us / 1e3
        print(f"{name:34s} {us:9.1f} {gbps:8.0f} {100 * gbps / ceiling:6.1f}%  {err}")


def bench_shape(shape, dtype, ceiling, sweep, deadline, layouts=("contiguous",)):
    batch, s_q, h_q, h_kv, length, d = shape
    q, k, v, seqlens = make_inputs(shape, dtype)
    kv_bytes = 2 * k.numel() * k.element_size()
    print(f"\n== B={batch} S_q={s_q} H_q={h_q} H_kv={h_kv} L={length} D={d} {dtype}: KV {kv_bytes / 1e6:.0f} MB")
    ref = attention_decode_reference(q.float(), k.float(), v.float(), seqlens)
    rows = []

    def run(name, fn, check=True):
        out = fn()
        err = rel_err(out, ref)
        status = f"{err:.2e}" + ("" if err <= 1e-2 else "  FAILED")
        if check and err > 1e-2:
            rows.append((name, float("nan"), kv_bytes, status))
            return
        rows.append((name, time_us(fn), kv_bytes, status))

    auto = ad._launch_config(q, length, h_kv, 0)
    run(f"tilefuse contiguous (splits={auto['splits']})", lambda: attention_decode(q, k, v, seqlens))
    caches = {"contiguous": (k, v, None)}
    for page_size in (16, 256):
        kp, vp, table = caches[f"paged{page_size}"] = paged(k, v, page_size)
        run(f"tilefuse paged {page_size}",
            lambda kp=kp, vp=vp, table=table: attention_decode(q, kp, vp, seqlens, block_table=table))
    for s in FORCED_SPLITS.get(length, ()):
        run(f"tilefuse splits={s}", lambda s=s: attention_decode(q, k, v, seqlens, num_splits=s))
    sdpa = ad._sdpa_on_slices(None)
    run("torch SDPA (default backend)", lambda: sdpa(q, k, v, seqlens), check=False)
    report(rows, ceiling)
    if not sweep:
        return
    print(f"-- config sweep (splits auto unless given); budget left {deadline - time.time():.0f} s")
    rows = []
    splits_list = (0,) + FORCED_SPLITS.get(length, ())[1:3]
    for layout in layouts:
        kc, vc, table = caches[layout]
        rows = []
        grid = (itertools.product((64, 128), (2, 3, 4), (4, 8), splits_list) if layout == "contiguous"
                else itertools.product((64, 128), (3, 4), (4, 8), (0,)))
        for block_n, stages, warps, splits in grid:
            if time.time() > deadline:
                print("   (time budget spent: sweep cut short)")
                break
            cfg = {"BLOCK_N": block_n, "num_stages": stages, "num_warps": warps}
            fn = lambda: ad._launch_decode(q, kc, vc, seqlens, table, 0, -1, 0, 0.0, d ** -0.5, splits, cfg)[0]  # noqa: E731
            try:
                run(f"{layout} N={block_n} st={stages} w={warps} sp={splits or 'auto'}", fn)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                print(f"   N={block_n} st={stages} w={warps}: {type(exc).__name__}: {str(exc)[:120]}")
        rows.sort(key=lambda r: r[1] if r[1] == r[1] else float("inf"))
        report(rows[:6], ceiling)


def graph_ab(dtype, rounds: int) -> None:
    """CUDA-graph replay time (kernels only, ``graph_time_ms``) of each shape under a few split
    counts x launch configs (GRAPH_SPLITS, GRAPH_CONFIGS), in interleaved rounds; the median of
    the rounds per row. Every variant is checked against the fp32 reference first."""
    import statistics

    from tilefuse.bench.ceilings import graph_time_ms

    for shape in SHAPES:
        batch, s_q, h_q, h_kv, length, d = shape
        q, k, v, seqlens = make_inputs(shape, dtype)
        kv_bytes = 2 * k.numel() * k.element_size()
        ref = attention_decode_reference(q.float(), k.float(), v.float(), seqlens)
        auto = ad._launch_config(q, length, h_kv, 0)["splits"]
        variants = {}
        for splits, (cfg_name, cfg) in itertools.product(sorted({auto, *GRAPH_SPLITS.get(length, ())}),
                                                         GRAPH_CONFIGS.items()):
            fn = (lambda splits=splits, cfg=cfg:  # noqa: E731
                  ad._launch_decode(q, k, v, seqlens, None, 0, -1, 0, 0.0, d ** -0.5, splits, cfg)[0])
            try:
                err = rel_err(fn(), ref)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                print(f"   splits={splits} {cfg_name}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            if err > 1e-2:
                raise AssertionError(f"{shape} splits={splits} {cfg_name}: rel err {err:.2e}")
            variants[f"splits={splits}{' (auto)' if splits == auto else ''} {cfg_name}"] = fn
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                times[name].append(1e3 * graph_time_ms(fn))
        print(f"\n== graph A/B B={batch} H_q={h_q} H_kv={h_kv} L={length} D={d}: KV {kv_bytes / 1e6:.0f} MB")
        for name, ts in times.items():
            us = statistics.median(ts)
            print(f"  {name:36s} {us:8.1f} us  {kv_bytes / us / 1e3:7.0f} GB/s  rounds {' '.join(f'{t:.1f}' for t in ts)}")
        torch.cuda.empty_cache()


def graph_parts(dtype, rounds: int) -> None:
    """CUDA-graph replay time of the decode (split + combine kernels) against the split kernel
    alone (the combine launch skipped): what merging the splits costs inside a graph."""
    import statistics

    from tilefuse.bench.ceilings import graph_time_ms

    class _Skip:
        launch_prepared = staticmethod(lambda *args, **kwargs: None)

    for shape in SHAPES:
        batch, s_q, h_q, h_kv, length, d = shape
        q, k, v, seqlens = make_inputs(shape, dtype)
        kv_bytes = 2 * k.numel() * k.element_size()

        def full():
            return ad._launch_decode(q, k, v, seqlens, None, 0, -1, 0, 0.0, d ** -0.5, 0)[0]

        def split_only(combine=ad.decode_combine_kernel):
            ad.decode_combine_kernel = _Skip
            try:
                return full()
            finally:
                ad.decode_combine_kernel = combine

        err = rel_err(full(), attention_decode_reference(q.float(), k.float(), v.float(), seqlens))
        assert err <= 1e-2, err
        times = {"split + combine": [], "split only": []}
        for _ in range(rounds):
            times["split + combine"].append(1e3 * graph_time_ms(full))
            times["split only"].append(1e3 * graph_time_ms(split_only))
        print(f"\n== graph parts B={batch} H_q={h_q} H_kv={h_kv} L={length} D={d}: KV {kv_bytes / 1e6:.0f} MB, "
              f"splits {ad._launch_config(q, length, h_kv, 0)['splits']}")
        for name, ts in times.items():
            us = statistics.median(ts)
            print(f"  {name:20s} {us:8.1f} us  {kv_bytes / us / 1e3:7.0f} GB/s  rounds {' '.join(f'{t:.1f}' for t in ts)}")
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    parser.add_argument("--budget-s", type=float, default=100.0, help="seconds before the sweep stops")
    parser.add_argument("--layouts", nargs="+", default=["contiguous"], choices=["contiguous", "paged16", "paged256"],
                        help="caches the config sweep covers")
    parser.add_argument("--graph-ab", type=int, default=0, metavar="ROUNDS",
                        help="only the graph-replay A/B of split counts and configs, ROUNDS rounds")
    parser.add_argument("--graph-parts", type=int, default=0, metavar="ROUNDS",
                        help="only split + combine against the split kernel alone, as graphs, ROUNDS rounds")
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    ceiling = copy_gbps()
    print(f"{props.name}, {props.multi_processor_count} SMs; copy {ceiling:.0f} GB/s (1 GiB copy_, read + write)")
    if args.graph_parts:
        graph_parts(DTYPES[args.dtype], args.graph_parts)
        return 0
    if args.graph_ab:
        graph_ab(DTYPES[args.dtype], args.graph_ab)
        return 0
    for i, shape in enumerate(SHAPES):
        # the sweep shares what is left of the budget with the shapes still to come
        deadline = start + args.budget_s * (i + 1) / len(SHAPES)
        bench_shape(shape, DTYPES[args.dtype], ceiling, not args.no_sweep, deadline, args.layouts)
        torch.cuda.empty_cache()
    print(f"\ntotal {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
