"""Stream-K for the last waves of a persistent GEMM (the Gluon warp-specialized kernels).

A persistent GEMM of T output tiles on P programs runs ceil(T / P) tile-times, while the work is
T / P of them: with r = T mod P > 0 the last wave leaves P - r SMs idle for a whole tile-time
(8192x6144x4096 in 128x256 tiles: 1536 tiles = 11.64 waves on 132 SMs, so 2.8 % of the kernel's
time has a third of the machine idle). Here the tiles are split in two regions:

- the first ``T - S`` tiles go to the programs whole, in turn (data-parallel, as without stream-K);
- the last ``S = r + P`` tiles (the partial wave and one full wave before it) are cut along K:
  their ``S · k_tiles`` K steps are dealt out as P contiguous runs of equal length (±1 step).

Every run is at least one tile long (S >= P), so a tile of that region is covered by one run
(whole) or by two: the head ``[0, b)`` of its K steps ends run p, the tail ``[a, k_tiles)``
starts run p + 1. Program p then walks its run in this order:

1. the tiles its run covers whole (their epilogue as usual);
2. the head of the tile its run ends in: the fp32 partial sum (plus the tile's bias, so that the
   tail's epilogue loads none) goes to the workspace slot of (p, consumer group) and a flag is
   raised (``stream_k_publish``);
3. the tail of the tile its run starts in: once program p - 1's flag is up (``stream_k_wait``,
   which also lowers it again for the next launch), its partial is added to this one
   (``stream_k_add``; the producer has prefetched it into L2, ``stream_k_prefetch``) and the
   epilogue runs on the sum.

A program waits only on the program before it, and only after publishing its own partial, so
the waits form a chain towards program 0 (which never waits): the kernel finishes whenever
programs start in grid order (as the hardware dispatches a 1-D grid), even when fewer SMs than
programs are free. Program p - 1 publishes before the end of its run and program p collects at the
end of its own, so the wait is short. The sum is ``head + tail`` in a fixed order: a launch is
bitwise reproducible (not bitwise equal to the data-parallel kernel: a different fp32 association).

Workspace: one [64, BLOCK_N] fp32 tile per (program, consumer group) and one int32 flag per slot,
left zero by the kernel (the split-K buffers of ``_matmul_kernels.split_k_buffers``, per stream).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .._dispatch import cdiv

# Whether large-M plans take stream-K by default where it pays (stream_k_pays; a config's STREAM_K
# overrides either way). Measured on the H200 in session 48 (scripts/stream_k_probe.py, graph
# replays against whole tiles, fwd / dgrad / wgrad over two runs): 8192³ 0.99-1.09x,
# 8192x4096x14336 1.01-1.05x, 8192x14336x4096 1.01-1.03x; 4096³ 0.94-0.96x (which stream_k_pays
# leaves whole). The fp8 tl kernel has its own switch (off: _fp8_gemm.FP8_STREAM_K).
STREAM_K = True
# below this K a tile-time is short beside the partial's store and load (~2-4 µs on one SM)
STREAM_K_MIN_K = 2048
# the default takes stream-K only where the idle SMs of the last wave cost more than the fixup:
# measured on the H200 (s48, bf16 128x256 tiles, graph replays), stream-K's time was the even
# share of the work plus ~14 µs at every shape (4096³ ... 8192x4096x14336), ~18 K steps of 64.
# Where it goes (s49, per-program timeline, scripts/stream_k_trace.py): the collect's add and
# epilogue 7.7-8.4 µs (4.6-4.9 with the partial prefetched into L2, gemm_load_partition), the head's
# publish 1-3 µs, and the region's K steps 3-7 % slower than the data-parallel ones; after the
# prefetch the span still exceeds the even share by 10.7-12.5 µs at K = 4096 (24.8 at K = 8192)
STREAM_K_MIN_IDLE_STEPS = 24


def stream_k_pays(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, sms: int) -> bool:
    """Whether the default plan takes stream-K: the whole-tile kernel's last wave leaves
    ``P - r`` of P SMs idle for a tile-time of ``k_tiles`` K steps, which stream-K recovers for a
    fixed cost (~11-14 µs on the H200 at K = 4096, ~18 K steps: STREAM_K_MIN_IDLE_STEPS' note):
    the loss must be at least STREAM_K_MIN_IDLE_STEPS K steps of the whole machine,
    (P - r) · k_tiles >= that · P. At the bench's shapes: 8192³, 8192x14336x4096 and
    8192x4096x14336 take it; 4096³, 8192x4096x4096 and 8192x6144x4096 (idle 7.8, 15.5 and 23.3
    steps) keep whole tiles."""
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    programs = min(sms, tiles)          # the persistent grid
    if not stream_k_tiles(m, n, k, block_m, block_n, block_k, programs):
        return False
    return (programs - tiles % programs) * cdiv(k, block_k) >= STREAM_K_MIN_IDLE_STEPS * programs


def stream_k_tiles(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, programs: int) -> int:
    """S, the tiles at the end of the tile order that are cut along K (0: none) in a plan that
    takes stream-K: the partial last wave plus one full wave, when there are at least two waves, a
    partial one, and K is long enough for the fixup to pay (STREAM_K_MIN_K)."""
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    rem = tiles % programs
    if k < STREAM_K_MIN_K or rem == 0 or tiles < 2 * programs or cdiv(k, block_k) < 2:
        return 0
    return rem + programs


def stream_k_epilogue_ok(block_n: int, epilogue: tuple) -> bool:
    """Whether a tile of ``block_n`` columns takes stream-K with ``epilogue`` (HAS_BIAS, ACT,
    HAS_RESIDUAL, SAVE_PREACT): a 128x256 consumer group has no registers to spare for the fixup
    beside an activation, a residual or a saved pre-activation (sm_90 offline compile, spill stores
    + loads: 360 bytes with bias + GELU), so 128x256 takes it for a product with at most a bias
    (which the head's partial carries: 328 bytes of spills when the tail's epilogue loaded it);
    128x128 with any epilogue."""
    _, act, has_res, save_preact = epilogue
    return block_n < 256 or (act == "none" and not has_res and not save_preact)


def stream_k_segments(sk_tiles: int, k_tiles: int, programs: int, pid: int) -> list[tuple[str, int, int, int]]:
    """Program ``pid``'s share of the stream-K region in the order it runs it, as
    ``(role, tile, first K step, end K step)`` with the tile counted from the region's start and
    role "whole", "publish" (a head: its partial goes to the workspace) or "collect" (a tail:
    the previous program's partial is added, then the epilogue). The same arithmetic as
    :func:`stream_k_run` (the tests check its invariants on it)."""
    iters = sk_tiles * k_tiles
    lo, hi = pid * iters // programs, (pid + 1) * iters // programs
    first, a = divmod(lo, k_tiles)
    last = (hi - 1) // k_tiles
    b = hi - last * k_tiles
    out = [("whole", t, 0, k_tiles) for t in range(first + (a > 0), last + (b == k_tiles))]
    if b < k_tiles:
        out.append(("publish", last, 0, b))
    if a > 0:
        out.append(("collect", first, a, k_tiles))
    return out


@triton.jit
def stream_k_run(pid, sk_tiles, k_tiles, NUM_PROGRAMS: tl.constexpr):
    """(first, a, last, b) of program ``pid``'s run of the stream-K region's ``sk_tiles · k_tiles``
    K steps: it starts at step ``a`` of region tile ``first`` and ends after step ``b - 1`` of
    region tile ``last`` (1 <= b <= k_tiles). Scalar arithmetic only, so the ``tl`` and the Gluon
    kernels share it. int64 products: S · k_tiles · P can pass 2^31."""
    iters = sk_tiles.to(tl.int64) * k_tiles
    lo = pid.to(tl.int64) * iters // NUM_PROGRAMS
    hi = (pid.to(tl.int64) + 1) * iters // NUM_PROGRAMS
    first = lo // k_tiles
    a = lo - first * k_tiles
    last = (hi - 1) // k_tiles
    b = hi - last * k_tiles
    return first.to(tl.int32), a.to(tl.int32), last.to(tl.int32), b.to(tl.int32)


@gluon.jit
def _slot_offsets(acc):
    """Offsets of an accumulator's elements in its row-major [rows, cols] workspace slot."""
    layout: gl.constexpr = acc.type.layout
    rows = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    return rows[:, None] * acc.shape[1] + cols[None, :]


@gluon.jit
def stream_k_publish(acc, ws_ptr, flag_ptr, slot):
    """Store the fp32 partial ``acc`` in workspace slot ``slot`` and raise its flag. The barrier
    before the release makes every thread's stores visible with it (CUTLASS's semaphore pattern,
    as the tl kernel's split-K fixup). Raising it after some of the tail's K steps instead (so the
    release's wait for the stores overlaps wgmmas) measured no different (H200, s49)."""
    gl.store(ws_ptr + slot.to(gl.int64) * (acc.shape[0] * acc.shape[1]) + _slot_offsets(acc), acc)
    gl.thread_barrier()
    gl.atomic_xchg(flag_ptr + slot, 1, sem="release", scope="gpu")


@gluon.jit
def stream_k_prefetch(ws_ptr, program, ELEMS: gl.constexpr):
    """Ask L2 for the partials of ``program`` (ELEMS fp32 from ``program · ELEMS``: its consumer
    groups' slots, contiguous) ahead of their collect: one bulk prefetch
    (cp.async.bulk.prefetch.L2) from lane 0 of the calling warp (the producer). Without it the
    collect's add and epilogue took 7.7-8.4 µs a program (H200, s49, scripts/stream_k_trace.py):
    the partial is written up to a tile-time before and leaves L2 meanwhile. A hint only: issued
    before the partial is written it fetches old lines, which the partial's stores (through L2)
    then replace; the collect still reads after the flag's acquire."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %laneid; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ws_ptr + program.to(gl.int64) * ELEMS, ELEMS * 4], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def stream_k_wait(flag_ptr, slot):
    """Wait until workspace slot ``slot``'s flag is up, and lower it as it is taken (compare-and-swap
    1 -> 0), so the kernel leaves every flag zero."""
    seen = gl.atomic_cas(flag_ptr + slot, 1, 0, sem="acquire", scope="gpu")
    while seen != 1:
        seen = gl.atomic_cas(flag_ptr + slot, 1, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def stream_k_add(acc, ws_ptr, slot):
    """``acc`` + the partial in workspace slot ``slot`` (after :func:`stream_k_wait`). The loads
    bypass L1 (.cg): the partial was written by another SM."""
    part = gl.load(ws_ptr + slot.to(gl.int64) * (acc.shape[0] * acc.shape[1]) + _slot_offsets(acc),
                   cache_modifier=".cg")
    return acc + part


# the tl kernels' forms (fp8_gemm_kernel): the same protocol, with tl's barrier and layouts


@triton.jit
def stream_k_publish_tl(acc, ws_ptr, flag_ptr, slot):
    """:func:`stream_k_publish` for a ``tl`` kernel's [BLOCK_M, BLOCK_N] accumulator."""
    offs = tl.arange(0, acc.shape[0])[:, None] * acc.shape[1] + tl.arange(0, acc.shape[1])[None, :]
    tl.store(ws_ptr + slot.to(tl.int64) * (acc.shape[0] * acc.shape[1]) + offs, acc)
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr + slot, 1, sem="release", scope="gpu")


@triton.jit
def stream_k_collect_tl(acc, ws_ptr, flag_ptr, slot):
    """:func:`stream_k_wait` then :func:`stream_k_add` for a ``tl`` kernel (under the interpreter
    the programs run one after another in grid order, so the flag a program waits for is already
    up; no L2 prefetch: the fp8 tl kernel's stream-K is off by default)."""
    seen = tl.atomic_cas(flag_ptr + slot, 1, 0, sem="acquire", scope="gpu")
    while seen != 1:
        seen = tl.atomic_cas(flag_ptr + slot, 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    offs = tl.arange(0, acc.shape[0])[:, None] * acc.shape[1] + tl.arange(0, acc.shape[1])[None, :]
    return acc + tl.load(ws_ptr + slot.to(tl.int64) * (acc.shape[0] * acc.shape[1]) + offs, cache_modifier=".cg")
