"""Runtime autotuning of ``tilefuse.matmul``'s launch config over the declared candidates (opt-in).

By default every GEMM takes the config the declared launch heuristics choose for its shape
(``_matmul_configs.choose_config`` for the ``tl`` kernel, ``_matmul_gluon_plan.choose_ws_tile`` /
``choose_large_ws_tile`` for the Gluon one: rules fitted to H200 sweeps, no timing at run time).
With autotuning on (``TILEFUSE_AUTOTUNE=1`` in the environment, or :func:`set_autotune`), the
first call of each GEMM problem times the heuristic's choice and every declared candidate
(:func:`matmul_candidates`) and keeps the fastest for every later call of that problem:

- the key is everything the launch plan reads: M, N, K, the dtypes, the strides, the 16-byte
  alignments, the epilogue (bias, activation, residual, saved pre-activation) and the GPU (its SM
  count and architecture; the cache file adds its name and Triton's version), so a repeated
  training step tunes each of its GEMMs (forward and both backward GEMMs) once;
- each candidate runs on the call's own operands into scratch outputs (never the caller's ``out``,
  which may be the residual itself), is checked against the heuristic's output (relative error
  norm at most 1e-2 for 16-bit outputs, 1e-5 for fp32: a config that fails to compile, raises or
  answers differently is dropped) and timed with ``triton.testing.do_bench`` (CUDA events, median);
- ``TILEFUSE_AUTOTUNE_CACHE=<file>`` keeps the choices across processes (JSON).

Never tuned (the heuristic's choice, or the one already made, is used): while a CUDA graph is being
captured (nothing can be timed then: tune before capturing, or warm up eagerly first), on CPU
tensors (the interpreter: nothing to time) and when the problem is empty. The first call of each
problem costs the candidates' compilation (seconds) and timing (~0.1 s each).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Callable

import torch
import triton

from .._launch import config_key
from ._matmul_configs import CONFIGS, LARGE_TILES, MID_TILES, SMALL_M_BLOCK_N, m_bucket

ENABLED = os.environ.get("TILEFUSE_AUTOTUNE", "0") not in ("", "0")
CACHE_FILE = os.environ.get("TILEFUSE_AUTOTUNE_CACHE") or None
CACHE_VERSION = 1

_CHOICES: dict = {}         # plan key -> the chosen config (a config_key tuple; () the heuristic's)
_TEXT_CHOICES: dict = {}    # repr(plan key) -> a config read from the cache file (plan keys hold dtypes)
_LOADED: set = set()        # cache files read so far
_LOCK = threading.RLock()


def set_autotune(enabled: bool = True, cache_file: str | os.PathLike | None = None) -> None:
    """Turn runtime autotuning of ``tilefuse.matmul`` (and the GEMMs of ``tilefuse.nn.Linear``)
    on or off; ``cache_file``: a JSON file the choices are read from and written to."""
    global ENABLED, CACHE_FILE
    ENABLED = bool(enabled)
    if cache_file is not None:
        CACHE_FILE = os.fspath(cache_file)


def clear() -> None:
    """Forget the choices made in this process (a cache file is read again when next needed)."""
    with _LOCK:
        _CHOICES.clear()
        _TEXT_CHOICES.clear()
        _LOADED.clear()


def matmul_candidates(m: int, dtype: torch.dtype, hopper_exact: bool, gluon_ok: bool = True) -> list[tuple]:
    """The configs an autotuned GEMM of M rows is timed over, as ``config_key`` tuples: () (the
    heuristic's choice) first, then on sm_90 with 16-bit operands each Gluon tile of its M bucket
    (large M: each with and without stream-K, which a shape without a partial last wave ignores),
    then the ``tl`` kernel's declared tiles of the bucket (mid and small M also split over K in
    2 or 4; small M in each declared column width). A candidate the problem cannot take (a Gluon
    tile for a layout TMA cannot read) falls back to the ``tl`` kernel inside the plan and is timed
    as that."""
    from ._matmul_gluon_plan import LARGE_WS_TILES, WS_TILES      # (imports _matmul_kernels, which imports this)

    bucket = m_bucket(m)
    out = [()]
    if hopper_exact and gluon_ok and dtype in (torch.bfloat16, torch.float16):
        if bucket == "large":   # each tile with and without stream-K over its last waves (_stream_k)
            out += [config_key(dict(tile, GLUON=True, STREAM_K=sk)) for tile in LARGE_WS_TILES.values()
                    for sk in (False, True)]
        else:
            out += [config_key(dict(tile, GLUON=True)) for tile in WS_TILES.values()]
    if dtype == torch.float32:
        bases = [dict(CONFIGS["fp32"])]
    elif bucket == "large":
        bases = [dict(CONFIGS[name]) for name in LARGE_TILES]
    elif bucket == "mid":
        bases = [dict(CONFIGS[name]) for name in MID_TILES]
    else:
        small = CONFIGS["small_m16" if bucket == "m16" else "small_m32"]
        bases = [dict(small, BLOCK_N=bn) for bn in SMALL_M_BLOCK_N if bn >= 32]
    splits = (1,) if bucket == "large" or dtype == torch.float32 else (1, 2, 4)
    out += [config_key(dict(base, GLUON=False, SPLIT_K=s)) for base in bases for s in splits]
    seen, unique = set(), []
    for cand in out:
        if cand not in seen:
            seen.add(cand)
            unique.append(cand)
    return unique


def can_time(t: torch.Tensor) -> bool:
    """Whether a GEMM on ``t`` can be timed now: a CUDA tensor outside a graph capture (the
    interpreter on the CPU has nothing to time)."""
    return t.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def time_candidate(run: Callable[[tuple], torch.Tensor], candidate: tuple) -> float:
    """Median ms of one candidate's launch (CUDA events, L2 flushed between calls: do_bench)."""
    return float(triton.testing.do_bench(lambda: run(candidate), warmup=10, rep=40, return_mode="median"))


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def tuned_config(key: tuple, run: Callable[[tuple], torch.Tensor], a: torch.Tensor, out_dtype: torch.dtype) -> tuple:
    """The config for plan ``key`` (M first, sm_90 at [11]: ``_matmul_kernels.launch_matmul``'s
    problem): the one chosen before (this process or the cache file), else, when it can be timed,
    the fastest of :func:`matmul_candidates` whose output (``run(candidate)``, a fresh tensor)
    matches the heuristic's; else () (the heuristic's, not kept: a later eager call tunes)."""
    from ..testing import rel_err

    with _LOCK:
        _load_cache()
        hit = cached_choice(key)
        if hit is not None or not can_time(a):
            return hit if hit is not None else ()
        candidates = matmul_candidates(key[0], a.dtype, key[11])
        reference = run(candidates[0])
        if not bool(torch.isfinite(reference).all()):
            return ()       # nothing to compare the candidates with: a later call's operands tune
        best, best_ms = candidates[0], time_candidate(run, candidates[0])
        for cand in candidates[1:]:
            try:
                if rel_err(run(cand), reference) > _tolerance(out_dtype):
                    continue
                ms = time_candidate(run, cand)
            except Exception:  # noqa: BLE001 - a config the problem cannot take is not a candidate
                continue
            if ms < best_ms:
                best, best_ms = cand, ms
        _CHOICES[key] = best
        _save_cache()
        return best


# ----------------------------------------------------------------------------------------------
# the cache file
# ----------------------------------------------------------------------------------------------


def _device_tag() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{name} | triton {triton.__version__}"


def _load_cache() -> None:
    """Read CACHE_FILE's choices for this GPU once (a missing or unreadable file: none)."""
    if not CACHE_FILE or CACHE_FILE in _LOADED:
        return
    _LOADED.add(CACHE_FILE)
    try:
        data = json.loads(Path(CACHE_FILE).read_text())
    except (OSError, ValueError):
        return
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return
    for key_text, config in data.get("entries", {}).get(_device_tag(), {}).items():
        _TEXT_CHOICES[key_text] = tuple(tuple(item) for item in config)



def _save_cache() -> None:
    """Write every choice of this process for this GPU into CACHE_FILE (merged with its others)."""
    if not CACHE_FILE:
        return
    path = Path(CACHE_FILE)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError
    except (OSError, ValueError):
        data = {"version": CACHE_VERSION, "entries": {}}
    mine = data["entries"].setdefault(_device_tag(), {})
    mine.update({repr(key): [list(item) for item in config] for key, config in _CHOICES.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def cached_choice(key: tuple) -> tuple | None:
    """The choice for ``key`` made earlier in this process or read from the cache file, or None."""
    hit = _CHOICES.get(key)
    if hit is None and _TEXT_CHOICES:
        hit = _TEXT_CHOICES.get(repr(key))
        if hit is not None:
            _CHOICES[key] = hit
    return hit
