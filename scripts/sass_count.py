"""SASS instructions per element of a Triton kernel, compiled for sm_90 on a machine without a GPU.

A memory-bound bf16 elementwise kernel on an H200 moves ~4.2 TB/s; at 4 bytes per element (2 in,
2 out) that is ~1 element per ns per SM... ~4 elements per SM clock, against an issue rate of 128
thread-instructions per SM clock: ~32 instructions per element before issue, not memory, is the
limit. This script counts what a kernel issues, with no device time spent:

    python scripts/sass_count.py tilefuse.ops.activations:bias_act_fwd_kernel \\
        --constexpr ACT=gelu HAS_BIAS=1 HAS_RESIDUAL=0 DROPOUT=0 RNG_GROUPED=1 BLOCK_M=8 BLOCK_N=1024 \\
        --type scale=fp32 seed=i64 --num-warps 16 --elems 8192

Pointers default to ``*bf16`` (``--type NAME=*fp32`` to change), integers to ``i32``; pointers and
integers are marked divisible by 16 as Triton specializes them at LLM sizes (``--no-div NAME`` to
drop that for one). ``--elems`` is the elements one program handles (tile size); the count is
straight-line SASS, so loops are counted once.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(v, v)


def compile_sm90(jit_fn, constexprs: dict, types: dict, num_warps: int, num_stages: int, no_div=()) -> bytes:
    fn = getattr(jit_fn, "fn", jit_fn)          # a fast_launch wrapper holds the JITFunction
    names = [p.name for p in fn.params]
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        else:
            sig[n] = types.get(n, "*bf16" if n.endswith("_ptr") or n.endswith("ptr") else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n not in no_div and (sig[n].startswith("*") or sig[n] in ("i32", "i64"))}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    return kernel.asm["cubin"]


def opcode_counts(cubin: bytes) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", help="module:kernel_name")
    ap.add_argument("--constexpr", nargs="*", default=[], help="NAME=VALUE")
    ap.add_argument("--type", nargs="*", default=[], help="NAME=TRITON_TYPE (i64, fp32, *fp32, ...)")
    ap.add_argument("--no-div", nargs="*", default=[], help="arguments not specialized as divisible by 16")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--elems", type=int, required=True, help="elements one program handles")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    module, name = args.kernel.split(":")
    jit_fn = getattr(importlib.import_module(module), name)
    constexprs = {k: _value(v) for k, v in (c.split("=", 1) for c in args.constexpr)}
    types = dict(t.split("=", 1) for t in args.type)
    ops = opcode_counts(compile_sm90(jit_fn, constexprs, types, args.num_warps, args.num_stages, args.no_div))
    total = sum(ops.values())
    per_thread = args.elems / (args.num_warps * 32)
    print(f"{name}: {total} SASS instructions per thread, {per_thread:g} elements per thread, "
          f"{total / per_thread:.1f} per element")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top)))


if __name__ == "__main__":
    main()
