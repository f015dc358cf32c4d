"""A short start-up measurement: up to how many rows the quantized kernels beat a dense GEMM on this CPU.

Decode streams every weight from memory once per step, so the probe times both paths with cold weights (a buffer
larger than the last-level cache is read between calls). The answer is cached per CPU, torch version and setting in
the kernel cache directory, so only the first start on a machine pays for it (about two seconds; a fraction of that
without a dense copy, see QUICK_MARGIN). It runs in two rounds; where they disagree (a reading disturbed by other
work) the larger answer is kept as unsettled and probed again at a start a day later at the earliest, so a busy
machine does not pay a probe at every start (the answer only decides which path runs big steps faster, never what
they compute). A probe taken while other work keeps the CPUs busy (`BUSY_LOAD`) is kept unsettled the same way.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import torch

from pagedlm import cbuild
from pagedlm.config import KERNEL_MAX_ROWS
from pagedlm.cpu import cpu_features

logger = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # candidates; a kernel that wins at all of them takes every step
SHAPE = (1024, 3072)  # in, out: a mid-size MLP projection
HEAD_SHAPE = (768, 16384)  # the int8 embedding table as an LM head: a wide, short product
REPEATS = 7
ROUNDS = 2  # rounds that disagree are cached as unsettled: probed again after RETRY_S
RETRY_S = 24 * 3600
FLUSH_BYTES = 96 * 2**20
PROBE_VERSION = 4  # 2: the dense side is the layer's own big-step path (prepacked bf16); 3: shapes; 4: 256 rows
# Without a dense copy (models over DENSE_COPY_MEMORY_FRACTION: 1B and up on most machines) a big step dequantizes the
# whole weight first, a fixed cost fewer rows cannot amortize: the dense path's lead over the kernel, if it has one,
# is largest at the most rows. So those probes time the most rows first (QUICK_REPEATS runs of each path); a kernel
# QUICK_MARGIN times as fast there takes every step, settled, without the rounds (a probe of ~0.3 s, not ~10 s).
QUICK_REPEATS = 3
QUICK_MARGIN = 1.5
# Other work disturbs both rounds alike (they agree, on the wrong answer: the kernels' thread team suffers more from
# a co-runner than the GEMM's), so a probe taken while the 1-minute load average per CPU is above this is kept as
# unsettled too.
BUSY_LOAD = 0.5


def measure_kernel_max_rows(method: str, group_size: int, dense_dtype: torch.dtype,
                            shape: tuple[int, int] = SHAPE, copy: bool = True) -> tuple[int, str]:
    """(rows, a sentence saying how they were found) for a layer of `shape` (in, out) whose big steps run over a
    dense copy (`copy`) or over the weight dequantized per call (`QuantLinear.set_dense`)."""
    key = json.dumps([sorted(cpu_features().flags), torch.__version__, method, group_size, str(dense_dtype),
                      shape, ROWS, torch.get_num_threads(), _kernel_version(), PROBE_VERSION, copy])
    path = cbuild.cache_dir() / f"probe-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        cached = json.loads(path.read_text())
        rows = int(cached["kernel_max_rows"])
        if cached.get("settled", True) or time.time() - path.stat().st_mtime < RETRY_S:
            settled = "" if cached.get("settled", True) else ", unsettled"
            return rows, f"kernel_max_rows {_rows(rows)} (probe cached in {path.name}{settled})"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    t0, busy = time.perf_counter(), _busy()
    top = {} if copy else _time_paths(method, group_size, dense_dtype, shape, copy, (max(ROWS),), QUICK_REPEATS)
    if top and top[max(ROWS)][0] * QUICK_MARGIN <= top[max(ROWS)][1]:
        rows, timings, stable, found = KERNEL_MAX_ROWS, top, True, [KERNEL_MAX_ROWS]
    else:
        rounds = [_time_paths(method, group_size, dense_dtype, shape, copy) for _ in range(ROUNDS)]
        found = [_crossover(t) for t in rounds]
        rows, timings = max(zip(found, rounds), key=lambda x: x[0])
        stable = len(set(found)) == 1 and not busy
    detail = ", ".join(f"{r}: {k * 1e6:.0f}/{d * 1e6:.0f} us" for r, (k, d) in timings.items())
    logger.info("probe (%.1f s): %s %dx%d kernel / dense %s GEMM by rows: %s -> kernel_max_rows %s%s",
                time.perf_counter() - t0, method, *shape, str(dense_dtype).removeprefix("torch."), detail, _rows(rows),
                "" if stable else f" (rounds {found}{', the machine busy' if busy else ''}: kept, probed again in a "
                "day)")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"kernel_max_rows": rows, "settled": stable,
                                   "timings_ms": {r: t for r, t in timings.items()}}))
        tmp.replace(path)
    except OSError:
        pass
    how = "measured" if stable else f"measured, rounds {found}{', the machine busy' if busy else ''}: kept unsettled"
    return rows, f"kernel_max_rows {_rows(rows)} ({how}: kernel/dense {detail})"


def _busy() -> bool:
    """Whether other work runs: the 1-minute load average above BUSY_LOAD per CPU (False where there is none)."""
    try:
        return os.getloadavg()[0] > BUSY_LOAD * (os.cpu_count() or 1)
    except OSError:
        return False


def _rows(rows: int) -> str:
    return "unlimited" if rows >= KERNEL_MAX_ROWS else str(rows)


def _kernel_version() -> str:
    """The quantized kernel's source hash: a changed kernel is probed again."""
    from pagedlm.model.quant import SOURCE

    try:
        return cbuild.cache_key(SOURCE, cbuild.compiler() or "")
    except (OSError, RuntimeError):
        return ""


def _crossover(timings: dict[int, tuple[float, float]]) -> int:
    """The most rows up to which the kernel is at least as fast as the dense GEMM at every candidate
    (KERNEL_MAX_ROWS, no limit, where it wins at all of them)."""
    rows = 1
    for r in ROWS:
        if r not in timings:
            return rows
        kernel, dense = timings[r]
        if kernel > dense:
            return rows
        rows = r
    return KERNEL_MAX_ROWS


def _time_paths(method: str, group_size: int, dense_dtype: torch.dtype, shape: tuple[int, int],
                copy: bool = True, candidates: tuple[int, ...] = ROWS,
                repeats: int = REPEATS) -> dict[int, tuple[float, float]]:
    from pagedlm.model.quant import make_quant_linear

    k, n = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    quant = make_quant_linear(w, method, group_size)
    quant.kernel_max_rows = max(ROWS)
    dense = make_quant_linear(w, method, group_size)  # the same layer's big-step path, as the engine runs it
    dense.kernel_max_rows = 0
    dense.set_dense(dense_dtype, copy)
    flush = torch.ones(FLUSH_BYTES // 4)
    out: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for rows in candidates:
            x = torch.randn(rows, k, generator=gen)
            runs = {"kernel": lambda: quant(x), "dense": lambda: dense(x)}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(repeats):
                for name, fn in runs.items():
                    flush.sum()  # evict the weights
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            out[rows] = (min(times["kernel"]), min(times["dense"]))  # the least disturbed run of each
            if out[rows][0] > out[rows][1]:  # the crossover: bigger steps are not timed
                break
    return out
